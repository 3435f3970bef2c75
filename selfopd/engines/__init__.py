"""Engines sample and score token ids behind one interface (`selfopd.engines.base.Engine`)."""

from selfopd.engines.base import Engine, Rollout, SamplingParams, TokenScores

__all__ = ["Engine", "Rollout", "SamplingParams", "TokenScores"]
