"""One OPD step as named phases, the training loop, its set-up, losses and advantages, weight sync and the illusion guard."""
