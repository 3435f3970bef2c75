"""Throughput of a step in figures that compare across runs and with other trainers: tokens per second of
each phase, an MFU estimate and peak memory on GPUs, and the GPU-hours of a run.

Definitions (every rank's tokens together, over this rank's wall seconds of the phase):
  throughput/sampled_tokens_per_s   the student's own completion ids / time/sample (with
                                    rollout.max_staleness >= 1, time/sample is the wait for rollouts
                                    sampled while the previous step trained, so this is higher than
                                    the engine's own rate)
  throughput/scored_tokens_per_s    completion ids the teacher scored (an episode's environment ids
                                    included) / time/teacher
  throughput/trained_tokens_per_s   prompt and completion ids through the student's forward and
                                    backward / time/train
  throughput/tokens_per_s           the student's own completion ids / time/step: the end-to-end rate
  throughput/mfu                    GPU, bf16 or fp16 weights only: the train phase's model FLOPs
                                    (`training_flops_per_token`) over the devices' dense bf16 peak
  memory/peak_gb                    GPU only: the most memory torch allocated on this rank's device during
                                    the step
  throughput/gpus                   GPUs the run holds: the trainer's processes on GPUs and the servers it
                                    launched (servers given by URL are not counted)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch

# Dense (no sparsity) bf16 tensor-core peak per GPU, in TFLOP/s, from the vendors' datasheets; the first name
# found in the device's name wins, so the specific ones come first.
PEAK_BF16_TFLOPS = (
    ("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.4), ("H200", 989.4), ("GH200", 989.4),
    ("B200", 2250.0), ("A100", 312.0), ("L40S", 362.1), ("L4", 121.0),
)


def peak_flops(device_name: str) -> float | None:
    """The dense bf16 peak in FLOP/s of a GPU named `device_name` (`torch.cuda.get_device_name`); None when
    it is not in `PEAK_BF16_TFLOPS`."""
    return next((tflops * 1e12 for name, tflops in PEAK_BF16_TFLOPS if name in device_name), None)


def training_flops_per_token(parameters: int, layers: int, hidden: int, sequence: float) -> float:
    """Forward and backward FLOPs per token of a decoder: 6 per matrix parameter (the input embedding, a
    lookup, left out of `parameters` by the caller) and 12 x layers x hidden x the sequence length for
    attention's scores and weighted sum (the PaLM paper's estimate, Appendix B)."""
    return 6.0 * parameters + 12.0 * layers * hidden * sequence


def model_flops_per_token(model: torch.nn.Module, sequence: float) -> float:
    """`training_flops_per_token` of a transformers causal LM: its parameters less the input embedding's
    (a tied output head counts once, as the head's matrix multiply), its layers and width from its config."""
    embedding = model.get_input_embeddings().weight
    tied = model.get_output_embeddings() is not None and model.get_output_embeddings().weight is embedding
    parameters = sum(p.numel() for p in model.parameters()) - (0 if tied else embedding.numel())
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return training_flops_per_token(parameters, config.num_hidden_layers, config.hidden_size, sequence)


@dataclass(frozen=True)
class StepTokens:
    """A step's token counts, every rank's together."""

    sampled: int  # the student's own completion ids
    scored: int  # completion ids the teacher scored
    trained: int  # prompt and completion ids through the student's forward and backward


def throughput_metrics(tokens: StepTokens, seconds: Mapping[str, float], flops_per_token: float | None = None,
                       peak: float | None = None, devices: int = 1, gpus: int = 0) -> dict[str, float]:
    """The step's throughput metrics (module docstring) from its `tokens` and its phases' `seconds`
    (`PhaseTimer.as_metrics`); `flops_per_token` and `peak` (FLOP/s of one device; None: no MFU) over
    `devices` trainer devices."""
    metrics = {}
    for name, count, phase in (("sampled", tokens.sampled, "time/sample"), ("scored", tokens.scored, "time/teacher"),
                               ("trained", tokens.trained, "time/train"), ("", tokens.sampled, "time/step")):
        if seconds.get(phase, 0.0) > 0:
            metrics[f"throughput/{name + '_' if name else ''}tokens_per_s"] = count / seconds[phase]
    if flops_per_token and peak and seconds.get("time/train", 0.0) > 0:
        metrics["throughput/mfu"] = flops_per_token * tokens.trained / (seconds["time/train"] * peak * devices)
    if gpus:
        metrics["throughput/gpus"] = float(gpus)
    return metrics


def peak_memory_gb(device: torch.device) -> dict[str, float]:
    """memory/peak_gb of a GPU `device` since the last call (which resets the count); none on a CPU."""
    if device.type != "cuda":
        return {}
    peak = torch.cuda.max_memory_allocated(device) / 1e9
    torch.cuda.reset_peak_memory_stats(device)
    return {"memory/peak_gb": peak}


def run_gpus(engine: Any, trainer_devices: int, trainer_on_gpu: bool) -> int:
    """GPUs a run holds: its trainer processes' when they run on GPUs, and those of the servers it launches
    (engine.student_gpus and engine.teacher_gpus; a colocated engine shares the trainer's)."""
    launched = [i for key in ("student_gpus", "teacher_gpus") for i in engine.gpus(key)]
    return (trainer_devices if trainer_on_gpu else 0) + len(set(launched))


def run_hours(run_dir: Path) -> dict[str, float]:
    """A run's wall hours of training (the sum of its steps' time/step) and GPU-hours (each step's time/step
    x throughput/gpus), from its metrics.jsonl (`read_metrics`: a line still being written is skipped);
    evals and start-up are not counted."""
    from selfopd.core.plots import read_metrics
    from selfopd.core.run_folder import RunFolder

    path = RunFolder(Path(run_dir)).metrics
    steps = [row for row in (read_metrics(path) if path.is_file() else []) if "time/step" in row]
    wall = sum(row["time/step"] for row in steps) / 3600
    gpu = sum(row["time/step"] * row.get("throughput/gpus", 0.0) for row in steps) / 3600
    return {"train_hours": wall, "gpu_hours": gpu}
