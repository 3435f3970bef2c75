"""Engines sample and score token ids behind one interface (`selfopd.engines.base.Engine`); this
package holds the interface and the in-process engine (transformers: local, scoring, kernels,
packed and compiled sampling, LoRA), the model families' table, and `build`, which opens models
and in-process engines from a config. vLLM's engines are `selfopd.serving`'s."""

from selfopd.engines.base import Engine, Rollout, SamplingParams, TokenScores

__all__ = ["Engine", "Rollout", "SamplingParams", "TokenScores"]
