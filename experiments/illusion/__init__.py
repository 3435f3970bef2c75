"""Leaky vs clean privileged templates: on one set of rollouts, in training, and the guard replayed."""
