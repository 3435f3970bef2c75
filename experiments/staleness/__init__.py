"""Learning with rollouts one step old (rollout.max_staleness = 1) against the synchronous loop."""
