"""Every engine serves the weights it should: the weight sync after each step (whose pushes
to vLLM are proven exactly by per-tensor digests, `selfopd.serving.weight_digest`), the
probe, a numeric monitor of every replica's logprobs against the trainer's (the student's
weights, or an `ema` teacher's average), and the one-time check of a frozen teacher."""

from __future__ import annotations

from typing import Any, Iterator

import torch

from selfopd.core.devices import autocast, model_device
from selfopd.core.distributed import is_sharded
from selfopd.engines.base import Engine, SamplingParams
from selfopd.engines.local import LocalEngine, eval_mode
from selfopd.engines.lora import served_weights
from selfopd.serving.weight_digest import WeightSyncError  # noqa: F401  (public here: the probe raises it too)
from selfopd.training.state import Run
from selfopd.engines.scoring import completion_logprobs


class ModelWeights:
    """The trainer's weights as a push sends them (a `selfopd.engines.base.WeightSource`): HF
    names, LoRA adapters merged in (`served_weights`); a sharded model's tensors are gathered one at
    a time, on the device, as the push reaches them (every rank iterates: each gather is a collective)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self._merged: dict[str, torch.Tensor] | None = None

    def _tensors(self) -> Any:
        if is_sharded(self.model):
            return ((name, param) for name, param in self.model.named_parameters())
        if self._merged is None:
            self._merged = served_weights(self.model)
        return self._merged.items()

    def metadata(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        return [(name, tensor.dtype, tuple(tensor.shape)) for name, tensor in self._tensors()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self._tensors():
            yield name, (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach()


def engines_serving_student_weights(run: Run) -> list[tuple[str, Engine]]:
    """The student engine, and a `self` teacher's engine when it is a separate one."""
    engines: list[tuple[str, Engine]] = [("student", run.student_engine)]
    if run.config.teacher.follows_student and run.teacher.engine is not run.student_engine:
        engines.append(("teacher", run.teacher.engine))
    return engines


def serves_live_model(engine: Engine, run: Run) -> bool:
    """An in-process engine over the trainer's own module: it sees every step at once."""
    return getattr(engine, "model", None) is run.model


def sync_weights(run: Run) -> dict[str, float]:
    """Push the trainer's weights to every engine that serves the student's weights: full
    weights under the base checkpoint's names (`ModelWeights`). An in-process engine over the
    trainer's own module already has them: it gets no tensors, only the version (with LoRA its
    parameter names are not the checkpoint's). The student's servers and a `self` teacher's share
    one transfer, which sends the one `ModelWeights` once. Under torchrun every rank takes part in
    each tensor's gather; rank 0 sends. An `ema` teacher then gets the average (`sync_ema_teacher`)."""
    copies = []
    for _, engine in engines_serving_student_weights(run):
        if serves_live_model(engine, run):
            engine.update_weights({}, version=run.step)
        else:
            copies.append(engine)
    if copies:
        weights = ModelWeights(run.model)
        if run.world.is_main:
            for engine in copies:
                engine.update_weights(weights, version=run.step)
        elif is_sharded(run.model):
            for _ in weights:  # the gathers rank 0's push makes, tensor by tensor
                pass
    sync_ema_teacher(run)
    return {**push_stats(run), **replica_stats(run)}


def replica_stats(run: Run) -> dict[str, float]:
    """Once per step, after the push (the one place a dropped vLLM replica comes back: it then holds the
    weights, proven by digest): each server engine's dropped replicas that answer again are re-added
    (`VLLMEngine.readmit`). Returns `serving/live_{role}_replicas` and `serving/dropped` (replicas out of
    the rotation now); {} without server engines. Under torchrun only rank 0 pushes, so only there can a
    replica of the student's weights be proven to hold them: other ranks keep theirs dropped."""
    stats: dict[str, float] = {}
    engines = {"student": run.student_engine, "teacher": run.teacher.engine}
    pushed_by_rank_0 = [id(engine) for _, engine in engines_serving_student_weights(run)]
    if run.ema is not None:
        pushed_by_rank_0.append(id(run.teacher.engine))
    for role, engine in engines.items():
        if not hasattr(engine, "readmit") or (role == "teacher" and engine is run.student_engine):
            continue
        if run.world.is_main or id(engine) not in pushed_by_rank_0:
            engine.readmit()
        stats[f"serving/live_{role}_replicas"] = float(len(engine.urls) - len(engine.dropped))
        stats["serving/dropped"] = stats.get("serving/dropped", 0.0) + len(engine.dropped)
    return stats


FLAGS = frozenset({"sync/verified"})  # 1 or 0 per push: over transfers, 1 only when every push was (min, not a sum)


def push_stats(run: Run) -> dict[str, float]:
    """What the last pushes to vLLM took (seconds, gigabytes, broadcasts; `WeightTransfer.stats`, or the
    stats of an engine that loads its own weights, the colocated one), summed over the run's transfers
    (one, or two with an `ema` teacher); a flag (`FLAGS`) is the least of them, so `sync/verified`
    says whether every push was verified."""
    transfers = {id(t): t for t in (getattr(e, "weight_sync", e) for e in (run.student_engine, run.teacher.engine))
                 if t is not None and getattr(t, "stats", None)}
    totals: dict[str, float] = {}
    for transfer in transfers.values():
        for key, value in transfer.stats.items():
            if key not in totals:
                totals[key] = value
            else:
                totals[key] = min(totals[key], value) if key in FLAGS else totals[key] + value
    return totals


def sync_ema_teacher(run: Run) -> None:
    """An `ema` teacher's engine gets the average: only the version when it scores with the
    average's own module (in process), the averaged weights when it is a server."""
    if run.ema is None:
        return
    engine = run.teacher.engine
    if getattr(engine, "model", None) is run.ema.model:
        engine.update_weights({}, version=run.step)
    elif run.world.is_main:
        engine.update_weights(served_weights(run.ema.model), version=run.step)


@torch.no_grad()
def probe_logprobs(model: Any, probe: tuple[list[int], list[int]], pad_id: int,
                   precision: str = "float32") -> torch.Tensor:
    """The trainer-side logprobs of the probe sequence (eval mode, no dropout), in the run's
    precision (`model.dtype`), from the weights as they are now: its own autocast region,
    which no earlier forward's bf16 casts outlive."""
    with eval_mode(model), autocast(model_device(model), precision):
        return completion_logprobs(model, [probe], pad_id)[0][0].float().cpu()  # where engines' scores are


def probe_gaps(engine_lp: torch.Tensor, reference_lp: torch.Tensor) -> dict[str, float]:
    """Max and mean |engine - reference| logprob over the probe's tokens (the logged metrics)."""
    diff = (engine_lp.float() - reference_lp.float()).abs()
    return {"probe/max_abs_diff": diff.max().item(), "probe/mean_abs_diff": diff.mean().item()}


def probe_rule(run: Run) -> tuple[str, float, str]:
    """(which gap, its tolerance, what they are) the checks hold engines to. fp32: the max
    |difference| (kernels agree to ~1e-4). bf16: the mean over the probe's tokens, since bf16
    kernels alone differ by up to ~0.5 nats on a token."""
    if run.config.model.dtype == "bfloat16":
        return "probe/mean_abs_diff", run.config.probe.bf16_tolerance, "mean |difference| (probe.bf16_tolerance"
    return "probe/max_abs_diff", run.config.probe.tolerance, "max |difference| (probe.tolerance"


@torch.no_grad()
def check_probe(run: Run) -> dict[str, float]:
    """The largest max and mean |engine - trainer| logprob on a fixed sequence, over every
    replica of every engine that serves the student's weights (each student server, a
    `self` teacher's server) and of an `ema` teacher's engine (against the average's
    logprobs, not the student's); raises past the tolerance (`probe_rule`), naming the replica.
    An in-process engine over the very module it would be compared with (the live student,
    the EMA's own copy) received nothing that could go wrong and is not probed; with nothing
    left to probe there are no probe metrics (and no probe forward)."""
    precision = run.config.model.dtype
    checks = [(name, engine, run.model, "the trainer's") for name, engine in engines_serving_student_weights(run)]
    if run.ema is not None:
        checks.append(("ema teacher", run.teacher.engine, run.ema.model, "the trainer's EMA weights'"))
    checks = [check for check in checks if getattr(check[1], "model", None) is not check[2]]
    if not checks:
        return {}
    references = {id(model): probe_logprobs(model, run.probe, run.pad_id, precision) for _, _, model, _ in checks}
    key, tolerance, what = probe_rule(run)
    worst = {"probe/max_abs_diff": 0.0, "probe/mean_abs_diff": 0.0}
    for name, engine, model, whose in checks:
        for replica, score in engine.score_replicas(run.probe):
            gaps = probe_gaps(score.logprobs, references[id(model)])
            if not gaps[key] <= tolerance:
                cause = ("its weights were verified by digest after the push, so its kernels compute differently "
                         "(dtype, TF32, attention backend): raise the tolerance if that is expected"
                         if getattr(engine, "pushes_verified", False) else "the weight update did not arrive")
                raise WeightSyncError(
                    f"after step {run.step} the {name} engine's logprobs ({replica}) differ from {whose}: "
                    f"{what} = {tolerance}) is {gaps[key]:.3g}: {cause}")
            worst = {metric: max(worst[metric], gaps[metric]) for metric in worst}
    return worst


@torch.no_grad()
def check_sampler(run: Run) -> dict[str, float]:
    """The student engine samples the policy the trainer trains: a few tokens drawn after the
    probe's prompt at the run's temperature, on every replica, must carry the logprobs the
    trainer gives them (`probe_rule`'s tolerance). A server that reports the raw logits' logprobs
    (started without --logprobs-mode processed_logprobs) or applies a setting of its own fails
    here, before any step trains on its rollouts. Skipped for an in-process student (it is the
    trainer's module), greedy decoding and a filter on (top_p < 1, top_k or min_p > 0: the sampler's
    kept tokens are renormalised)."""
    rollout, student = run.config.rollout, run.student_engine
    filtered = rollout.top_p < 1.0 or rollout.top_k > 0 or rollout.min_p > 0
    if serves_live_model(student, run) or rollout.temperature == 0 or filtered:
        return {}
    prompt = run.probe[0]
    replicas = getattr(student, "urls", ["the student engine"])
    params = SamplingParams(max_tokens=8, temperature=rollout.temperature, n=1, seed=run.config.run.seed)
    drawn = [group[0] for group in student.sample([prompt] * len(replicas), params)]
    trainer = LocalEngine(run.model, run.tokenizer, precision=run.config.model.dtype)
    key, tolerance, what = probe_rule(run)
    worst = 0.0
    for replica, sample in zip(replicas, drawn):
        reference = trainer.score([(prompt, sample.completion_ids)], temperature=rollout.temperature)[0].logprobs
        gap = probe_gaps(torch.tensor(sample.sampler_logprobs), reference)[key]
        if not gap <= tolerance:
            raise WeightSyncError(
                f"{replica} samples another policy than the trainer's: the logprobs of its tokens at temperature "
                f"{rollout.temperature} differ from the trainer's by {what} = {tolerance}) {gap:.3g}; a vLLM server "
                "must report the sampled distribution's logprobs (--logprobs-mode processed_logprobs, as `selfopd "
                "serve` starts it)")
        worst = max(worst, gap)
    return {"probe/sampler_gap": worst}


REPLICA_AGREEMENT = 0.05  # nats: teacher replicas' largest probe gap (SkyRL refuses past the same bound)


def check_teacher_replicas(run: Run) -> dict[str, float]:
    """Several teacher servers (engine.teacher_url's replicas) must serve one teacher (`replica_agreement`),
    checked on the run's probe before any step."""
    return replica_agreement(run.teacher.engine, run.probe)


@torch.no_grad()
def replica_agreement(engine: Any, probe: tuple[list[int], list[int]], bound: float = REPLICA_AGREEMENT) -> dict[str, float]:
    """The probe scored by each of `engine`'s servers: every replica's largest |logprob gap| to the first at
    most `bound`, else WeightSyncError naming the one that disagrees. Returns
    {"probe/teacher_replica_gap": worst}; {} for an engine of one server."""
    if len(getattr(engine, "urls", ())) < 2:
        return {}
    (first, reference), *others = engine.score_replicas(probe)
    worst = 0.0
    for replica, score in others:
        gap = (score.logprobs.double() - reference.logprobs.double()).abs().max().item()
        if not gap <= bound:
            raise WeightSyncError(f"engine.teacher_url: the teacher replica {replica} scores the probe up to {gap:.3g} "
                                  f"nats away from {first} (bound {bound}): it serves other weights, another dtype or "
                                  "another model; fix it or leave it out")
        worst = max(worst, gap)
    return {"probe/teacher_replica_gap": worst}


@torch.no_grad()
def check_frozen_teacher(run: Run, initial_lp: torch.Tensor) -> None:
    """A `frozen` teacher must serve the initial student weights; a server given by URL may
    hold anything, so every replica is probed once at start (and on resume)."""
    key, tolerance, what = probe_rule(run)
    for replica, score in run.teacher.engine.score_replicas(run.probe):
        gap = probe_gaps(score.logprobs, initial_lp)[key]
        if not gap <= tolerance:
            raise WeightSyncError(
                f"the frozen teacher ({replica}) does not serve the initial student weights "
                f"({run.config.model.student}): its probe logprobs' {what} = {tolerance}) is {gap:.3g}; give it a "
                "server of the student's initial model")
