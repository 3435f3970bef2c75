"""One OPD step as named phases, the training loop, its set-up, losses and advantages, weight sync, checkpoints
(gathered in `outputs`, sharded in `sharded_checkpoint`) and the illusion guard."""
