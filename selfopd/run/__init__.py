"""A run's folder: its lock, metrics, kept templates, saved rollouts, evaluations and summary."""
