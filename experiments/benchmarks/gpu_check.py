"""The prepared GPU checks, one entry point with two checks: `trainer` (the default) and `vllm`.

    python -m experiments.benchmarks.gpu_check --prepare                 # once, here: tokenizer files
    bash experiments/benchmarks/gpu_check.sh --out $OUT/gpu_check.json   # the trainer check, one GPU
    bash experiments/benchmarks/gpu_check.sh vllm                        # the vLLM check, 2+ GPUs
    python -m experiments.benchmarks.gpu_check vllm --plan --gpus 2      # its layout, checked, anywhere
    bash experiments/benchmarks/gpu_check.sh scale --out $OUT/gpu_scale_probe.json  # scale mode: gpu_scale_probe.py

gpu_check.sh runs `python3 -m experiments.benchmarks.gpu_check ARGS` from the tree's root with
PYTHONPATH=. (selfopd is imported from the copy of the tree, not installed) under a time limit
(the trainer check 9 min 30 s, the vLLM check 8 min). Neither is run by CI.

## trainer (default): the in-process trainer on one GPU

bf16 step time, tokens/s and peak memory of a Qwen3-1.7B-shaped model built at random, one tiny
fp32 step on the GPU against the CPU, and bf16 against fp32 on the GPU. Once, here, `--prepare`
copies the packaged SmolLM2 tokenizer (3.5 MB) into a gitignored folder; then on a machine with
one CUDA GPU (torch + transformers; no vLLM, no network, no pip install needed), with the tree and
that folder copied there, about 4-5 minutes (it starts no work after `--budget-s`, 420 s):

    PYTHONUNBUFFERED=1 python3 -m experiments.benchmarks.gpu_check --out $OUT/gpu_check.json

Its first run (one H200, 2026-12-04, every part passed) is experiments/benchmarks/results/gpu_check.json,
summarised in experiments/benchmarks/results/gpu_check_status.md.

What it does, in order:
1. says which of selfopd's dependencies are missing there and what each one costs; the
   data comes from a generator in this file (no `datasets`, `reasoning_gym`), a missing
   `math_verify` only leaves some rewards unchecked, a missing `peft` skips the LoRA cases;
2. writes a random model folder from `configs/qwen3_1p7b.json` (Qwen3-1.7B's architecture,
   its 151936-token head; the tokenizer is SmolLM2's 49152 tokens, ids past it decode to
   nothing) and runs the real trainer (`selfopd.training.setup.build_run` + `selfopd.training.trainer.
   train_step`) with model.device = cuda, model.dtype = bfloat16 in five cases: full
   fine-tuning, + gradient checkpointing, LoRA, LoRA + gradient checkpointing, full with
   rollout.max_staleness = 1 (its staleness and importance ratios per step). Per case:
   median step time of the steps after the first, completion tokens trained per second,
   peak GPU memory, the trainer's phase times, and what the trainer actually did (device,
   weight dtype, the dtype the decoder's linears computed in, checkpointing, trainable
   parameters). A setting the trainer ignores or refuses makes its case 'not available';
   one case failing never loses the others. A case that cannot run where the check runs (a
   package it needs is missing, or it needs a GPU and runs on the CPU) is 'skipped' with the
   reason, never an error: an error is a failure;
3. one greedy step of a tiny random Qwen3 in fp32 on the GPU and on the CPU: same rollouts,
   metric differences and max |weight difference| after the step, each against a tolerance;
4. bf16 against fp32 on the GPU with that tiny model (`bf16_vs_fp32`): the step-1 gradient of
   each tensor on the same rollouts (relative error against a tolerance, cosine), and the
   weight updates of 2 steps (sign agreement, relative difference).

Writes the JSON after every case (a killed run still leaves what it measured) and prints a
table. `--device cpu --tiny` runs the same plumbing on the CPU in seconds
(tests/experiments/test_gpu_check.py).

## vllm: the weight push over NCCL into vLLM servers, and throughput

    bash experiments/benchmarks/gpu_check.sh vllm                  # packaged SmolLM2, fp32, about 5 minutes
    bash experiments/benchmarks/gpu_check.sh vllm --model Qwen/Qwen3-0.6B --dtype bfloat16 --tolerance 2e-2

Needs at least two CUDA GPUs (NCCL refuses the trainer and a server worker on one GPU) and vLLM
for GPUs (`pip install -e '.[gpu]'`). What it does, in order:

1. places itself as a training run would (`selfopd.serving.gpu_layout.check_layout`): the
   trainer on GPU 0, the student server on GPU 1, the teacher on GPU 2 when there is one, else
   beside the student (two NCCL groups then: one GPU may not appear twice in one group);
2. launches both servers with selfopd's weight-transfer engine and opens the push as a run
   does (`selfopd.serving.launch.open_weight_transfers`: the trainer is rank 0);
3. three rounds: perturb the trainer's weights, push them (packed NCCL broadcast, pause /
   reset prefix cache / resume, version = round, digests compared on every worker), then check
   both servers' prompt logprobs on a fixed sequence against the trainer's and their versions;
4. rollout and scoring throughput through `VLLMEngine`.

Prints a table and writes JSON (to $OUT when set, else runs/benchmarks/). Exits non-zero when a
check fails. Not yet run on a GPU (the trainer part has; this one has not).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

# selfopd is not installed on the GPU machine: `python -m` from the tree's root (gpu_check.sh) imports
# it from the tree, and selfopd maps the tree's verifiers/ and prompts/ itself.
ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TOKENIZER_DIR = ROOT / ".cache" / "gpu_check_tokenizer"  # gitignored (.cache/), outside experiments/: result JSON lives there
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")
MODEL_CONFIG = HERE / "configs" / "qwen3_1p7b.json"
# The tiny model of --tiny and of the CPU-vs-device step: Qwen3's layout at toy size.
TINY = {"model_type": "qwen3", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "tie_word_embeddings": True,
        "max_position_embeddings": 2048}

# Which optional packages the trainer's code paths reach, and what is lost without each.
DEPENDENCIES = {
    "jinja2": "required: prompt templates (selfopd.templating.templates)",
    "tqdm": "required: imported by selfopd.training.trainer",
    "peft": "the LoRA cases (model.lora_rank) are skipped",
    "math_verify": "answers that are not plain numbers count as unchecked (reward 0)",
    "datasets": "not needed: this check generates its prompts",
    "reasoning_gym": "not needed: this check generates its prompts",
    "flash_attn": "attn_implementation 'auto' uses sdpa",
}


@dataclass(frozen=True)
class Case:
    """One trainer configuration to time: a name, its `--set` overrides, and what it cannot run
    without ('cuda', or a package's import name)."""

    name: str
    overrides: tuple[str, ...]
    requires: tuple[str, ...] = ()


CASES = (
    Case("full", ()),
    Case("full+checkpointing", ("model.gradient_checkpointing=true",)),
    Case("lora", ("model.lora_rank=16",), ("peft",)),
    Case("lora+checkpointing", ("model.lora_rank=16", "model.gradient_checkpointing=true"), ("peft",)),
    # Sampling ahead in process (no overlap without servers): each step trains on the previous step's rollouts.
    Case("full+staleness1", ("rollout.max_staleness=1",)),
)


class NotAvailable(RuntimeError):
    """The trainer ignored a setting the case asks for: its numbers would be mislabelled."""


# --------------------------------------------------------------------------- set-up


def missing_dependencies() -> dict[str, str]:
    """{package: what is lost} for the packages of DEPENDENCIES that are not importable."""
    return {name: cost for name, cost in DEPENDENCIES.items() if importlib.util.find_spec(name) is None}


def unmet(case: Case, device: str) -> str | None:
    """Why `case` cannot run here (None: it can): a missing requirement, reported as the case's
    'skipped', not a failure of the trainer."""
    for need in case.requires:
        if need == "cuda" and not device.startswith("cuda"):
            return f"needs a CUDA device; this check runs on {device}"
        if need != "cuda" and importlib.util.find_spec(need) is None:
            return f"needs the {need} package, which is not installed here"
    return None


def machine_info(device: str) -> dict[str, Any]:
    import transformers

    info: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                            "transformers": transformers.__version__, "cuda": torch.version.cuda,
                            "device": device, "selfopd_commit": _git_commit()}
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(torch.device(device))
        info.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                    float32_matmul_precision=torch.get_float32_matmul_precision())
    return info


def _git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None  # the device machine's copy of the tree may have no .git


def prepare_tokenizer(target: Path = TOKENIZER_DIR) -> Path:
    """Copy the packaged SmolLM2's tokenizer files into `target`, the folder the GPU run carries."""
    from selfopd.core.models import resolve_model

    source = resolve_model("smollm2-135m-instruct")
    target.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, target / name)
    return target


def require_tokenizer(tokenizer_dir: Path) -> None:
    """Stop with one line naming the folder when `--prepare`'s tokenizer files are not there."""
    if not (tokenizer_dir / "tokenizer.json").is_file():
        raise SystemExit(f"{tokenizer_dir}: no tokenizer.json; run `python -m experiments.benchmarks.gpu_check "
                         "--prepare` here and carry .cache/gpu_check_tokenizer")


def write_random_model(folder: Path, tokenizer_dir: Path, config: dict[str, Any], init_device: str,
                       save_dtype: torch.dtype) -> dict[str, Any]:
    """A model folder (config, random weights, tokenizer) from an architecture dict; returns its facts.

    The weights are drawn on `init_device` (seconds on a GPU for 1.7B parameters, minutes on a
    CPU) and the end-of-sequence and padding ids are the tokenizer's."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    fields = dict(config)
    fields.setdefault("vocab_size", len(tokenizer))
    if fields["vocab_size"] < len(tokenizer):
        raise ValueError(f"vocab_size {fields['vocab_size']} is below the tokenizer's {len(tokenizer)} tokens")
    eos = tokenizer.eos_token_id
    fields.update(bos_token_id=tokenizer.bos_token_id, eos_token_id=eos,
                  pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos)
    model_config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(0)
    with torch.device(init_device):
        model = AutoModelForCausalLM.from_config(model_config, dtype=save_dtype)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    facts = {"architecture": type(model).__name__, "params": sum(p.numel() for p in model.parameters()),
             "vocab_size": model_config.vocab_size, "tokenizer_size": len(tokenizer)}
    del model
    return facts


def generated_examples(count: int) -> list[Any]:
    """Addition prompts with their answers: the data needs no dataset package."""
    from selfopd.data.example import Example

    return [Example(id=f"gpu_check/{i}", prompt=f"What is {i * 37 % 89 + 10} + {i * 53 % 97 + 3}? "
                    "Explain your steps, then give the final answer.", answer=str(i * 37 % 89 + 10 + i * 53 % 97 + 3))
            for i in range(count)]


@contextlib.contextmanager
def generated_data(count: int) -> Iterator[None]:
    """build_run loads `data.spec` through `load_examples`; here it gets the generated prompts."""
    from selfopd.training import setup as run_setup

    original = run_setup.load_examples
    run_setup.load_examples = lambda spec, *args, **kwargs: generated_examples(count)
    try:
        yield
    finally:
        run_setup.load_examples = original


def train_config(model_dir: Path, out_dir: Path, shape: dict[str, int], overrides: tuple[str, ...]):
    """The TrainConfig of one case: the trainer's own config, with `--set` overrides."""
    from selfopd.config import load_config

    return load_config(None, [
        f"model.student={model_dir}", f"run.out_dir={out_dir}", "run.progress=false", "run.rollouts_to_save=0",
        "data.spec=generated-by-gpu_check", "data.eval_size=2",
        f"rollout.prompts_per_step={shape['prompts']}", f"rollout.samples_per_prompt={shape['samples']}",
        f"rollout.max_tokens={shape['max_tokens']}", f"optim.micro_batch_prompts={shape['micro_batch_prompts']}",
        *overrides])


# --------------------------------------------------------------------------- what the trainer did


def trainer_state(model: Any) -> dict[str, Any]:
    """Where the student is, its weight dtype, checkpointing, trainable parameters."""
    params = list(model.parameters())
    return {
        "device": str(params[0].device),
        "weight_dtype": str(params[0].dtype).removeprefix("torch."),
        "gradient_checkpointing": any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules()),
        "trainable_params": sum(p.numel() for p in params if p.requires_grad),
        "total_params": sum(p.numel() for p in params),
    }


def check_honoured(config: Any, state: dict[str, Any]) -> None:
    """Raise NotAvailable, naming every setting the trainer silently ignored."""
    ignored = []
    wanted = config.model.device
    if wanted != "auto" and torch.device(state["device"]).type != torch.device(wanted).type:
        ignored.append(f"model.device = {wanted!r} (the student's weights are on {state['device']})")
    if config.model.gradient_checkpointing and not state["gradient_checkpointing"]:
        ignored.append("model.gradient_checkpointing = true (no module checkpoints)")
    if config.model.lora_rank and state["trainable_params"] == state["total_params"]:
        ignored.append(f"model.lora_rank = {config.model.lora_rank} (every weight is trainable)")
    if ignored:
        raise NotAvailable(f"the trainer ignored {'; '.join(ignored)}")


class ComputeDtypes:
    """The output dtypes of the first decoder linear layer, in training forwards (grad on)
    and in sampling/scoring (grad off): shows whether bf16 autocast is on."""

    def __init__(self, model: Any) -> None:
        self.seen: dict[str, set[str]] = {"train": set(), "no_grad": set()}
        linear = next(m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers.0." in name)
        self.handle = linear.register_forward_hook(self._record)

    def _record(self, module: Any, inputs: Any, output: torch.Tensor) -> None:
        self.seen["train" if torch.is_grad_enabled() else "no_grad"].add(str(output.dtype).removeprefix("torch."))

    def close(self) -> dict[str, list[str]]:
        self.handle.remove()
        return {key: sorted(values) for key, values in self.seen.items()}


def _synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _release(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _gib(nbytes: int) -> float:
    return round(nbytes / 2**30, 3)


def _error(error: BaseException) -> str:
    if isinstance(error, NotAvailable):
        return f"not available: {error}"
    return f"{type(error).__name__}: {error}"


# --------------------------------------------------------------------------- the measurements


def time_case(case: Case, model_dir: Path, work_dir: Path, device: str, dtype: str, shape: dict[str, int],
              steps: int, deadline: float) -> dict[str, Any]:
    """Build the run as `selfopd train` would and time `steps` train_step calls (the first is
    the warm-up); results, or the exception that stopped the case."""
    from selfopd.training.trainer import build_run, train_step

    result: dict[str, Any] = {"overrides": list(case.overrides)}
    run = probe = None
    _release(device)
    try:
        config = train_config(model_dir, work_dir / case.name, shape,
                              (f"model.device={device}", f"model.dtype={dtype}", *case.overrides))
        with generated_data(shape["prompts"] * 8):
            run = build_run(config)
        result["trainer"] = trainer_state(run.model)
        check_honoured(config, result["trainer"])
        if device.startswith("cuda"):
            result["memory_after_build_gib"] = _gib(torch.cuda.memory_allocated())
        probe = ComputeDtypes(run.model)
        metrics = []
        for index in range(steps):
            if index >= 2 and time.monotonic() > deadline:
                result["stopped_early"] = f"time budget: {index} of {steps} steps"
                break
            tick = time.perf_counter()
            step = train_step(run)
            _synchronize(device)
            metrics.append({**step, "wall_s": time.perf_counter() - tick})
        result["compute_dtypes"] = probe.close()
        probe = None
        if dtype == "bfloat16" and "bfloat16" not in result["compute_dtypes"]["train"]:
            result["warning"] = "model.dtype = bfloat16, but the decoder's linears computed in " \
                                f"{result['compute_dtypes']['train']} while training"
        result.update(summarise_steps(metrics))
        if device.startswith("cuda"):
            result["peak_memory_gib"] = _gib(torch.cuda.max_memory_allocated())
            result["peak_reserved_gib"] = _gib(torch.cuda.max_memory_reserved())
    except Exception as error:  # one case failing must not lose the others
        result["error"] = _error(error)
        if not isinstance(error, NotAvailable):
            result["traceback"] = traceback.format_exc(limit=-6)
    finally:
        if probe is not None:
            probe.close()
        if run is not None:
            run.close()
        del run
        _release(device)
    return result


def summarise_steps(metrics: list[dict[str, float]]) -> dict[str, Any]:
    """Medians over the steps after the first (all steps when there is only one)."""
    timed = metrics[1:] or metrics
    median = lambda key: statistics.median(m[key] for m in timed)  # noqa: E731
    tokens = median("tokens/completion")
    step_s, train_s = median("wall_s"), median("time/train")
    return {
        "steps": len(metrics), "timed_steps": len(timed), "warm_up_excluded": len(metrics) > 1,
        "first_step_s": metrics[0]["wall_s"], "step_s_median": step_s,
        "completion_tokens_per_step": tokens, "tokens_per_s": tokens / step_s,
        "train_tokens_per_s": tokens / train_s,
        "phase_s_median": {key: median(key) for key in sorted(timed[0]) if key.startswith("time/")},
        "loss_pg": [m["loss/pg"] for m in metrics],
        "reverse_kl": [m["opd/reverse_kl"] for m in metrics],
        **({"staleness": [m["rollout/staleness"] for m in metrics],
            "is_ratio_max": [m["is/ratio_max"] for m in metrics]} if "rollout/staleness" in metrics[0] else {}),
    }


DEVICE_VS_CPU_LR = 1e-3


def device_vs_cpu_step(model_dir: Path, work_dir: Path, device: str, shape: dict[str, int],
                       weight_tolerance: float, metric_tolerance: float, flipped_share_max: float = 1e-4
                       ) -> dict[str, Any]:
    """One greedy fp32 step on `device` and on the CPU from the same weights: the rollouts must
    be the same ids, then every metric must agree within `metric_tolerance` and the weights as an
    AdamW step allows. AdamW's first step moves each weight by about lr * sign(gradient), so a
    gradient within rounding of zero whose sign differs between the devices puts that weight
    2 lr apart: legitimate, and rare. The check therefore bounds the largest weight difference by
    2 lr, the share of weights more than `weight_tolerance` apart by `flipped_share_max`, and
    wants the two updates' cosine near 1.

    Greedy sampling, because the two devices' random streams differ; a near-tie could still
    flip one argmax, which is reported as 'inconclusive', not as a failure."""
    from selfopd.training.trainer import build_run, train_step

    outcomes = {}
    for where in ("cpu", device):
        config = train_config(model_dir, work_dir / f"step-{where.replace(':', '')}", shape, (
            f"model.device={where}", "model.dtype=float32", "rollout.temperature=0", f"optim.lr={DEVICE_VS_CPU_LR}",
            f"run.rollouts_to_save={shape['prompts'] * shape['samples']}"))
        with generated_data(shape["prompts"] * 8):
            run = build_run(config)
        try:
            check_honoured(config, trainer_state(run.model))
            before = {name: p.detach().to("cpu", copy=True) for name, p in run.model.named_parameters()}
            run.run_dir.mkdir(parents=True, exist_ok=True)
            metrics = train_step(run)
            after = {name: p.detach().to("cpu", copy=True) for name, p in run.model.named_parameters()}
            rollouts = [json.loads(line) for line in run.folder.rollouts_file(run.step).read_text().splitlines()]
        finally:
            run.close()
        outcomes[where] = (before, after, metrics, [r["completion_ids"] for r in rollouts])
        del run
        _release(device)

    (before_c, after_c, metrics_c, ids_c), (before_d, after_d, metrics_d, ids_d) = outcomes["cpu"], outcomes[device]
    start_diff = max((before_c[n] - before_d[n]).abs().max().item() for n in before_c)
    weight_diff = max((after_c[n] - after_d[n]).abs().max().item() for n in after_c)
    apart = sum(int(((after_c[n] - after_d[n]).abs() > weight_tolerance).sum()) for n in after_c)
    apart_share = apart / sum(t.numel() for t in after_c.values())
    update_c = torch.cat([(after_c[n] - before_c[n]).flatten() for n in after_c]).double()
    update_d = torch.cat([(after_d[n] - before_d[n]).flatten() for n in after_d]).double()
    cosine = torch.nn.functional.cosine_similarity(update_c, update_d, dim=0).item()
    compared = sorted(k for k in metrics_c if not k.startswith("time/") and isinstance(metrics_c[k], float)
                      and metrics_c[k] == metrics_c[k])  # skips nan
    metric_diffs = {k: abs(metrics_c[k] - metrics_d[k]) for k in compared}
    worst_metric = max(metric_diffs, key=metric_diffs.get)
    same_rollouts = ids_c == ids_d
    passed = (start_diff == 0 and weight_diff <= 2 * DEVICE_VS_CPU_LR * 1.01 and apart_share <= flipped_share_max
              and cosine >= 0.999 and metric_diffs[worst_metric] <= metric_tolerance)
    return {
        "devices": ["cpu", device], "same_rollouts": same_rollouts,
        "verdict": ("pass" if passed else "fail") if same_rollouts else "inconclusive: greedy rollouts differ",
        "start_weight_max_abs_diff": start_diff,
        "weight_max_abs_diff": weight_diff, "weight_max_abs_diff_bound": 2 * DEVICE_VS_CPU_LR,
        "weight_tolerance": weight_tolerance, "weights_apart_share": apart_share,
        "weights_apart_share_max": flipped_share_max,
        "update_max_abs": update_c.abs().max().item(), "update_cosine": cosine,
        "metric_max_abs_diff": metric_diffs[worst_metric], "metric_worst": worst_metric,
        "metric_tolerance": metric_tolerance,
        "metrics": {k: {"cpu": metrics_c[k], device: metrics_d[k]} for k in compared},
    }


def bf16_vs_fp32(model_dir: Path, work_dir: Path, device: str, shape: dict[str, int],
                 gradient_tolerance: float) -> dict[str, Any]:
    """bf16 (fp32 master weights, autocast per forward) against fp32 on `device`, one process,
    from the same weights. Step 1: the accumulated gradient of a bf16 step (self teacher: a
    no-grad forward before the micro-batches) and of an fp32 step on the same rollouts, per
    tensor (relative L2 error, cosine). Two steps: each run's weight update, compared (sign
    agreement over all weights, relative difference). Greedy rollouts: the two precisions may
    still pick different tokens at a near-tie, which the report says."""
    from experiments.benchmarks.precision_step import captured_step, relative_errors
    from selfopd.training.trainer import build_run, train_step

    def config(dtype: str, name: str) -> Any:
        return train_config(model_dir, work_dir / f"bf16-{name}", shape, (
            f"model.device={device}", f"model.dtype={dtype}", "rollout.temperature=0", "optim.lr=1e-3",
            f"run.rollouts_to_save={shape['prompts'] * shape['samples']}"))

    with generated_data(shape["prompts"] * 8):
        bf16 = captured_step(config("bfloat16", "grad16"))
        fp32 = captured_step(config("float32", "grad32"), bf16["rollouts"])
    _release(device)
    errors = relative_errors(bf16["grads"], fp32["grads"])
    cosines = {name: torch.nn.functional.cosine_similarity(bf16["grads"][name].flatten(), exact.flatten(), dim=0).item()
               for name, exact in fp32["grads"].items() if exact is not None and bf16["grads"][name] is not None}

    updates, rollouts = {}, {}
    for dtype in ("bfloat16", "float32"):
        with generated_data(shape["prompts"] * 8):
            run = build_run(config(dtype, f"two-{dtype}"))
        try:
            before = torch.cat([p.detach().flatten().double().cpu() for p in run.model.parameters()])
            run.run_dir.mkdir(parents=True, exist_ok=True)
            for _ in range(2):
                train_step(run)
            updates[dtype] = torch.cat([p.detach().flatten().double().cpu() for p in run.model.parameters()]) - before
            rollouts[dtype] = [json.loads(line)["completion_ids"]
                               for step in (1, 2) for line in run.folder.rollouts_file(step).read_text().splitlines()]
        finally:
            run.close()
        del run
        _release(device)
    a, b = updates["bfloat16"], updates["float32"]
    moved = (a != 0) | (b != 0)
    worst = max(errors, key=errors.get)
    return {
        "verdict": "pass" if errors[worst] <= gradient_tolerance else "fail",
        "gradient_relative_error_max": errors[worst], "gradient_worst_tensor": worst,
        "gradient_relative_error_median": statistics.median(errors.values()),
        "gradient_cosine_min": min(cosines.values()), "gradient_tolerance": gradient_tolerance,
        "missing_gradients": sorted(name for name, g in bf16["grads"].items() if g is None),
        "two_steps_same_rollouts": rollouts["bfloat16"] == rollouts["float32"],
        "two_steps_update_sign_agreement": ((a.sign() == b.sign()) & moved).sum().item() / max(1, moved.sum().item()),
        "two_steps_update_relative_difference": ((a - b).norm() / b.norm()).item(),
        "two_steps_update_cosine": torch.nn.functional.cosine_similarity(a, b, dim=0).item(),
    }


# --------------------------------------------------------------------------- the weight push's wire


def transfer_check(model_dir: Path, device: str) -> dict[str, Any]:
    """The trainer's side of the weight push on `device`, without vLLM (which the GPU machine lacks):
    a fused AdamW step, then at once the weights (`ModelWeights`) cast to bf16 where they are, packed
    on the wire's device, broadcast in a one-rank group of the device's collective (NCCL on a GPU,
    gloo on a CPU) and unpacked. The bytes must be the post-step weights (the packing follows the
    optimizer on the current stream), and the device's checksums (`tensor_digest` 'sum') the CPU's."""
    from transformers import AutoModelForCausalLM

    from selfopd.serving.transfer_wire import buffer_device, open_group, pack, unpack
    from selfopd.serving.server import free_port
    from selfopd.serving.weight_digest import tensor_digest
    from selfopd.training.weight_checks import ModelWeights

    backend = "nccl" if device.startswith("cuda") else "gloo"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    for param in model.parameters():
        param.grad = torch.ones_like(param)
    optimizer.step()  # queued on the current stream; the packing below must see its result
    names, tensors = zip(*[(name, tensor.to(torch.bfloat16)) for name, tensor in ModelWeights(model)])
    tick = time.monotonic()
    buffer = pack(tensors, buffer_device(backend))
    group = open_group("127.0.0.1", free_port(), 0, 1, backend, 60)
    try:
        group.broadcast(buffer)
    finally:
        group.close()
    _synchronize(device)
    wire_s = time.monotonic() - tick
    expected = {name: p.detach().cpu().to(torch.bfloat16) for name, p in model.named_parameters()}
    received = dict(unpack(buffer.cpu(), list(names), [list(t.shape) for t in tensors], [t.dtype for t in tensors]))
    tick = time.monotonic()
    device_digests = {name: tensor_digest(tensor, "sum") for name, tensor in zip(names, tensors)}
    _synchronize(device)
    digest_s = time.monotonic() - tick
    same_bytes = all(torch.equal(received[name], expected[name]) for name in names)
    same_digests = all(device_digests[name] == tensor_digest(expected[name], "sum") for name in names[:4])
    return {"backend": backend, "tensors": len(names), "megabytes": buffer.numel() / 1e6, "pack_broadcast_s": wire_s,
            "device_checksum_s": digest_s, "post_step_bytes_sent": same_bytes, "device_checksum_equals_cpu": same_digests,
            "verdict": "pass" if same_bytes and same_digests else "fail"}


# --------------------------------------------------------------------------- the whole check


def run_check(out: Path, device: str, tiny: bool, tokenizer_dir: Path, steps: int, budget_s: float,
              work_dir: Path, cases: tuple[Case, ...] = CASES) -> dict[str, Any]:
    """Every measurement, written to `out` after each one; returns the report."""
    started = time.monotonic()
    deadline = started + budget_s
    missing = missing_dependencies()
    print("missing packages:", ", ".join(f"{k} ({v})" for k, v in missing.items()) or "none", flush=True)
    require_tokenizer(tokenizer_dir)
    big = dict(TINY) if tiny else json.loads(MODEL_CONFIG.read_text())
    shape = ({"prompts": 2, "samples": 2, "max_tokens": 8, "micro_batch_prompts": 1} if tiny else
             {"prompts": 8, "samples": 4, "max_tokens": 128, "micro_batch_prompts": 4})
    report: dict[str, Any] = {
        "status": "ran", "started": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": machine_info(device),
        "missing_packages": missing, "tiny": tiny, "model_dtype": "bfloat16", "shape": shape, "steps_per_case": steps,
        "model_config": "tiny Qwen3 (TINY in gpu_check.py)" if tiny else str(MODEL_CONFIG.relative_to(ROOT)),
        "cases": {}, "device_vs_cpu": None, "transfer": None, "bf16_vs_fp32": None,
    }

    def save() -> None:
        report["wall_s"] = round(time.monotonic() - started, 1)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n")

    init_device = device if device.startswith("cuda") else "cpu"
    model_dir, tiny_dir = work_dir / "model", work_dir / "tiny-model"
    for where in dict.fromkeys((init_device, "cpu")):  # drawing on the CPU is slower, but a second chance
        try:
            tick = time.monotonic()
            report["model"] = write_random_model(model_dir, tokenizer_dir, big, where, torch.bfloat16)
            report["model"].update(write_s=round(time.monotonic() - tick, 1), drawn_on=where)
            break
        except Exception as error:
            report["model"] = {"error": _error(error), "traceback": traceback.format_exc(limit=-6)}
            _release(device)
    save()
    for case in cases:
        if "error" in report["model"]:
            report["cases"][case.name] = {"error": "not run: the random model could not be built"}
        elif time.monotonic() > deadline:
            report["cases"][case.name] = {"error": f"not run: the time budget ({budget_s:.0f} s) was spent"}
        elif unmet(case, device):
            report["cases"][case.name] = {"skipped": unmet(case, device)}
        else:
            print(f"case {case.name} ...", flush=True)
            report["cases"][case.name] = time_case(case, model_dir, work_dir, device, "bfloat16", shape, steps, deadline)
        save()
    shutil.rmtree(model_dir, ignore_errors=True)  # gigabytes on the device's disk

    print("one fp32 step, device vs cpu ...", flush=True)
    try:
        write_random_model(tiny_dir, tokenizer_dir, dict(TINY), "cpu", torch.float32)
        report["device_vs_cpu"] = device_vs_cpu_step(
            tiny_dir, work_dir, device, {"prompts": 2, "samples": 2, "max_tokens": 16, "micro_batch_prompts": 1},
            weight_tolerance=5e-5, metric_tolerance=1e-4)
    except Exception as error:
        report["device_vs_cpu"] = {"verdict": "error", "error": _error(error), "traceback": traceback.format_exc(limit=-6)}
    save()

    print("the weight push's wire on the device ...", flush=True)
    try:
        report["transfer"] = transfer_check(tiny_dir, device)
    except Exception as error:
        report["transfer"] = {"verdict": "error", "error": _error(error), "traceback": traceback.format_exc(limit=-6)}
    save()

    print("bf16 vs fp32 on the device: step-1 gradients, 2-step updates ...", flush=True)
    try:
        report["bf16_vs_fp32"] = bf16_vs_fp32(
            tiny_dir, work_dir, device, {"prompts": 2, "samples": 2, "max_tokens": 16, "micro_batch_prompts": 1},
            gradient_tolerance=0.05)
    except Exception as error:
        report["bf16_vs_fp32"] = {"verdict": "error", "error": _error(error), "traceback": traceback.format_exc(limit=-6)}
    save()
    return report


def dry_run(out: Path, device: str, tokenizer_dir: Path, work_dir: Path) -> dict[str, Any]:
    """Everything but the timed and compared steps, in seconds: the packages, the tokenizer, selfopd
    imported from this tree, a tiny model, every case's config, and the weight push's wire."""
    missing = missing_dependencies()
    require_tokenizer(tokenizer_dir)
    import selfopd
    from selfopd.training.trainer import build_run, train_step  # noqa: F401  (what the cases call)
    from selfopd.verifiers import verify  # noqa: F401  (a mapped folder: present only as the package sees it)

    tiny_dir = work_dir / "tiny-model"
    write_random_model(tiny_dir, tokenizer_dir, dict(TINY), "cpu", torch.float32)
    shape = {"prompts": 2, "samples": 2, "max_tokens": 8, "micro_batch_prompts": 1}
    configs = {case.name: train_config(tiny_dir, work_dir, shape, case.overrides).model.dtype for case in CASES}
    report = {"status": "dry run", "machine": machine_info(device), "missing_packages": missing,
              "selfopd": str(Path(selfopd.__file__).parent), "cases": sorted(configs),
              "transfer": transfer_check(tiny_dir, device)}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    return report


def print_table(report: dict[str, Any]) -> None:
    print(f"\n{report['machine'].get('gpu', report['machine']['device'])}, torch {report['machine']['torch']}, "
          f"{report.get('model', {}).get('params', '?')} parameters")
    print(f"{'case':<20}{'step s':>8}{'tok/s':>9}{'train tok/s':>13}{'peak GiB':>10}  compute / note")
    for name, case in report["cases"].items():
        if "error" in case or "skipped" in case:
            print(f"{name:<20}  {case.get('error') or 'skipped: ' + case['skipped']}"[:132])
            continue
        print(f"{name:<20}{case['step_s_median']:>8.2f}{case['tokens_per_s']:>9.0f}{case['train_tokens_per_s']:>13.0f}"
              f"{case.get('peak_memory_gib', float('nan')):>10.2f}  {','.join(case['compute_dtypes']['train'])}"
              f" {case.get('warning', '')}")
    check = report["device_vs_cpu"] or {}
    if "weight_max_abs_diff" in check:
        print(f"fp32 step device vs cpu: {check['verdict']} (weights at most {check['weight_max_abs_diff']:.2e} apart "
              f"(<= 2 lr), {check['weights_apart_share']:.1e} of them more than {check['weight_tolerance']:.0e} "
              f"(<= {check['weights_apart_share_max']:.0e}), update cosine {check['update_cosine']:.5f}; "
              f"{check['metric_worst']} {check['metric_max_abs_diff']:.2e} <= {check['metric_tolerance']:.0e}; "
              f"same rollouts {check['same_rollouts']})")
    else:
        print(f"fp32 step device vs cpu: {check.get('error', 'not run')}")
    mixed = report.get("bf16_vs_fp32") or {}
    if "gradient_relative_error_max" in mixed:
        print(f"bf16 vs fp32: {mixed['verdict']} (gradient relative error max {mixed['gradient_relative_error_max']:.3f} "
              f"<= {mixed['gradient_tolerance']}, min cosine {mixed['gradient_cosine_min']:.4f}; 2-step updates agree "
              f"in sign on {mixed['two_steps_update_sign_agreement']:.1%}, relative difference "
              f"{mixed['two_steps_update_relative_difference']:.3f}, same rollouts {mixed['two_steps_same_rollouts']})")
    else:
        print(f"bf16 vs fp32: {mixed.get('error', 'not run')}")


def trainer_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="gpu_check [trainer]", description="the in-process trainer on one GPU "
                                     "(bf16 cases, device vs CPU, bf16 vs fp32, the push's wire)")
    parser.add_argument("--prepare", action="store_true", help="copy the SmolLM2 tokenizer to .cache/gpu_check_tokenizer/ and stop")
    parser.add_argument("--out", type=Path, help="the JSON (default: $OUT/ or runs/benchmarks/, gpu_check.json "
                        "for the real check, gpu_check_plumbing.json for --tiny or a CPU run)")
    parser.add_argument("--device", default="cuda", help="cuda (the check) or cpu (plumbing only)")
    parser.add_argument("--tiny", action="store_true", help="a tiny model and 8-token rollouts instead of Qwen3-1.7B")
    parser.add_argument("--steps", type=int, default=4, help="train steps per case, the first one a warm-up")
    parser.add_argument("--budget-s", type=float, default=420.0, help="start no case after this many seconds")
    parser.add_argument("--tokenizer", type=Path, default=TOKENIZER_DIR)
    parser.add_argument("--dry-run", action="store_true", help="imports, a tiny model, the cases' configs and the "
                        "weight push's wire on --device, in seconds; no timed step")
    args = parser.parse_args(argv)
    if args.prepare:
        print(f"tokenizer files in {prepare_tokenizer()}")
        return 0
    if args.dry_run:
        out = args.out or Path(os.environ.get("OUT") or ROOT / "runs" / "benchmarks") / "gpu_check_dry_run.json"
        with tempfile.TemporaryDirectory(prefix="gpu_check-") as scratch:
            report = dry_run(out, args.device, args.tokenizer, Path(scratch))
        print(json.dumps(report["transfer"]), f"\nselfopd from {report['selfopd']}; wrote {out}")
        return 0 if report["transfer"]["verdict"] == "pass" else 1
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; --device cpu --tiny runs the plumbing", file=sys.stderr)
        return 2
    name = "gpu_check.json" if args.device.startswith("cuda") and not args.tiny else "gpu_check_plumbing.json"
    out = args.out or Path(os.environ.get("OUT") or ROOT / "runs" / "benchmarks") / name
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as scratch:
        report = run_check(out, args.device, args.tiny, args.tokenizer, args.steps, args.budget_s, Path(scratch))
    print_table(report)
    print(f"wrote {out}")
    return 0


# --------------------------------------------------------------------------- the vLLM check


def plan_config(model: str, dtype: str, gpus: int, eager: bool):
    """The training config whose layout the vLLM check uses: trainer on GPU 0, servers on the others."""
    from selfopd.config import load_config

    teacher_gpu = 2 if gpus > 2 else 1
    return load_config(ROOT / "experiments/demo/demo.toml", [
        "engine.kind=vllm", "engine.weight_sync=nccl", "model.device=cuda:0", f"model.student={model}",
        f"model.dtype={dtype}", "engine.student_gpus=1", f"engine.teacher_gpus={teacher_gpu}",
        "engine.gpu_memory_utilization=0.4", "engine.max_model_len=2048", "rollout.temperature=1",
        f"engine.compile={'off' if eager else 'auto'}", "run.progress=true"])


def trainer_logprobs(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion], device="cuda")).logits[0].float()
    logprobs = logits.log_softmax(-1)[len(prompt) - 1 : -1]
    return logprobs.gather(-1, torch.tensor(completion, device="cuda")[:, None])[:, 0].cpu()


def vllm_main(argv: list[str]) -> int:
    from selfopd.config.bundles import ServingSettings
    from selfopd.core.models import resolve_model
    from selfopd.engines.base import SamplingParams
    from selfopd.serving.gpu_layout import check_layout
    from selfopd.serving.server_control import ServerControl
    from selfopd.serving.launch import gpu_count, open_vllm_engines

    parser = argparse.ArgumentParser(prog="gpu_check vllm", description="the weight push over NCCL into a student "
                                     "and a teacher vLLM server, every push verified by digest, and throughput")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--tolerance", type=float, default=1e-3, help="max |server - trainer| logprob after a push")
    parser.add_argument("--eager", action="store_true", help="no torch.compile / CUDA graphs (faster start)")
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--plan", action="store_true", help="print the checked layout and stop")
    parser.add_argument("--gpus", type=int, help="with --plan: the GPUs of the machine to plan for (default: this one's)")
    args = parser.parse_args(argv)
    gpus = args.gpus if args.plan and args.gpus is not None else gpu_count()
    if gpus < 2:
        print(f"gpu_check: needs 2 GPUs or more (this machine: {gpus}): NCCL refuses the trainer and a server "
              "worker on one GPU; `selfopd train --set engine.kind=vllm_colocate` is the one-GPU mode", file=sys.stderr)
        return 2
    config = plan_config(args.model, args.dtype, gpus, args.eager)
    layout = check_layout(config.engine, config.teacher, [0], gpus)  # a ConfigError names the rule broken
    print(layout.table())
    if args.plan:
        return 0

    from transformers import AutoModelForCausalLM, AutoTokenizer

    out_dir = Path(os.environ.get("OUT") or ROOT / "runs" / "benchmarks")
    torch.cuda.set_device(0)
    model_dir = str(resolve_model(args.model))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    report: dict = {"model": args.model, "dtype": args.dtype, "gpu": torch.cuda.get_device_name(0), "gpus": gpus,
                    "checks": {}}
    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        student, teacher = open_vllm_engines(ServingSettings.of(config), out_dir / "gpu_check_logs", stack, progress=True,
                                             trainer_gpus=[0])
        report["server_start_s"] = time.perf_counter() - started
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).cuda().eval()
        messages = [{"role": "user", "content": "What is 17 + 25? Think step by step."}]
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        prompt = prompt if isinstance(prompt, list) else prompt["input_ids"]
        completion = tokenizer.encode("17 + 25 = 42. The answer is 42.", add_special_tokens=False)
        urls = [*student.urls, *teacher.urls]

        rounds = []
        originals = {name: p.detach().clone() for name, p in model.named_parameters()}
        for version in (1, 2, 3):
            torch.manual_seed(version)
            with torch.no_grad():
                for name, param in model.named_parameters():
                    param.copy_(originals[name] + 2e-3 * originals[name].std() * torch.randn_like(param))
            student.update_weights(dict(model.named_parameters()), version)  # the self teacher shares the push
            stats = dict(student.weight_sync.stats)
            expected = trainer_logprobs(model, prompt, completion)
            diffs = [(engine.score([(prompt, completion)])[0].logprobs - expected).abs().max().item()
                     for engine in (student, teacher)]
            versions = [ServerControl(url).version() for url in urls]
            rounds.append({"version": version, **stats, "max_abs_diff": diffs, "server_versions": versions})
            print(f"push {version}: {stats['sync/gigabytes']:.3f} GB in {stats['time/push']:.2f} s "
                  f"({stats['sync/broadcasts']:.0f} broadcasts, {stats['sync/groups']:.0f} groups, verified in "
                  f"{stats['time/push_verify']:.2f} s), |server - trainer| {diffs[0]:.2e} / {diffs[1]:.2e}, "
                  f"versions {versions}", flush=True)
        report["push_rounds"] = rounds
        report["checks"]["every_push_verified_by_digest"] = all(r["time/push_verify"] > 0 for r in rounds)
        report["checks"]["logprobs_within_tolerance"] = all(max(r["max_abs_diff"]) <= args.tolerance for r in rounds)
        report["checks"]["versions_arrived"] = all(set(r["server_versions"]) == {str(r["version"])} for r in rounds)
        report["push_seconds_per_gb_median"] = statistics.median(r["time/push"] / r["sync/gigabytes"] for r in rounds)

        chat = [tokenizer.apply_chat_template([{"role": "user", "content": f"Explain how to add {i} and {3 * i + 7}."}],
                                              add_generation_prompt=True) for i in range(args.prompts)]
        prompts = [p if isinstance(p, list) else p["input_ids"] for p in chat]
        params = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, n=args.samples, seed=0)
        student.sample(prompts[:8], params)  # warm-up
        tick = time.perf_counter()
        groups = student.sample(prompts, params)
        sample_s = time.perf_counter() - tick
        rollouts = [r for g in groups for r in g]
        generated = sum(len(r.completion_ids) for r in rollouts)
        tick = time.perf_counter()
        teacher.score([(r.prompt_ids, r.completion_ids) for r in rollouts])
        score_s = time.perf_counter() - tick
        report["rollout_tokens_per_s"] = generated / sample_s
        report["scoring_tokens_per_s"] = sum(len(r.prompt_ids) + len(r.completion_ids) for r in rollouts) / score_s
        print(f"rollouts: {len(rollouts)} samples, {generated} tokens in {sample_s:.1f} s = "
              f"{report['rollout_tokens_per_s']:.0f} tok/s; scoring {report['scoring_tokens_per_s']:.0f} tok/s")
    report["total_s"] = time.perf_counter() - started
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "gpu_check.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["checks"]), f"total {report['total_s']:.0f} s")
    return 0 if all(report["checks"].values()) else 1



def main(argv: list[str] | None = None) -> int:
    """`[trainer] ARGS` (the default) or `vllm ARGS`."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["vllm"]:
        return vllm_main(argv[1:])
    return trainer_main(argv[1:] if argv[:1] == ["trainer"] else argv)


if __name__ == "__main__":
    sys.exit(main())
