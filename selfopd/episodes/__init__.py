"""Episodes: rollouts of several turns, the student's and, between them, an environment's (tool
results, feedback, a new observation). Token ids stay exact across turns: each continuation is the
previous ids plus the new ones (`selfopd.templating.chat_format.ChatFormat.append`), never a
re-render of the text, and a per-token mask keeps the environment's ids out of the loss
(`selfopd.engines.base.Rollout.loss_mask`). `episode` holds the record and its rollout, `environment`
what an environment answers, `sampling` the loop that runs a batch of episodes on any engine."""
