"""A training config's memory plan per GPU, and whether it fits: the trainer's ranks and each vLLM
server `selfopd.engines.gpu_layout` places, sized by `selfopd.engines.memory_plan`. When a GPU
cannot hold what the plan puts on it, `RunPlan.refusal` is one line naming the GPU, the need, the
capacity, and the settings that would make it fit (each tried on the plan)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

from selfopd.config.auto import Machine, auto_dtype
from selfopd.engines.memory_plan import (GIB, HEADROOM, RESERVE_GIB, Inputs, ModelShape, Process, gib, model_shape,
                                         read_model_config, server_process, trainer_process)

PROMPT_TOKENS = 256  # assumed prompt length when none is given (`selfopd plan --prompt-tokens`)


def resolved_dtype(config: Any, on_gpu: bool) -> str:
    """model.dtype as the run will use it, 'auto' resolved by the rule a run applies (selfopd.config.auto)."""
    return str(auto_dtype(config, Machine(cuda=on_gpu)).value) if config.model.dtype == "auto" else config.model.dtype


def plan_inputs(config: Any, on_gpu: bool, world: int, prompt_tokens: int,
                shapes: dict[str, ModelShape] | None = None) -> Inputs:
    """The plan's inputs from a TrainConfig; `shapes` ({'student': .., 'teacher': ..}) skips reading config.json."""
    model, teacher = config.model, config.teacher
    shapes = model_shapes(config, shapes)
    student = shapes["student"]
    in_process = config.engine.teacher_in_process
    held = None
    if in_process and teacher.kind == "external":
        held = shapes["teacher"]
    elif in_process and teacher.kind in ("frozen", "ema") and not model.lora:
        held = student
    return Inputs(
        student=student, teacher=held, teacher_kind=teacher.kind, dtype=resolved_dtype(config, on_gpu),
        on_gpu=on_gpu, engine=config.engine.kind, teacher_in_process=in_process and teacher.kind != "none",
        world=world, lora_rank=model.lora_rank, lora_params=student.lora_params(model.lora_rank, model.lora_targets),
        checkpointing=model.gradient_checkpointing, prompts_per_step=config.rollout.prompts_per_step,
        samples=config.rollout.samples_per_prompt, max_tokens=config.rollout.max_tokens, prompt_tokens=prompt_tokens,
        micro_batch_prompts=config.optim.micro_batch_prompts, divergence=config.loss.divergence,
        engine_batch=config.engine.batch_size)


def model_shapes(config: Any, shapes: dict[str, ModelShape] | None = None) -> dict[str, ModelShape]:
    """{'student': shape, 'teacher': shape of an external teacher}, read from config.json where not given."""
    model, teacher = config.model, config.teacher
    shapes = dict(shapes or {})
    if "student" not in shapes:
        shapes["student"] = model_shape(read_model_config(model.student, "model.student", model.trust_remote_code),
                                        model.student)
    if teacher.kind == "external" and "teacher" not in shapes:
        shapes["teacher"] = model_shape(read_model_config(teacher.model, "teacher.model", model.trust_remote_code),
                                        teacher.model)
    return shapes


@dataclass
class RunPlan:
    """The processes of a run with their memory, and the GPU they are checked against."""

    inputs: Inputs
    processes: list[Process]
    capacity: float | None  # bytes per GPU; None: not checked
    gpu_name: str
    notes: list[str]
    suggest: Callable[[Inputs], list[tuple[str, float]]] | None = None

    def per_gpu(self) -> dict[int, list[Process]]:
        gpus: dict[int, list[Process]] = {}
        for proc in self.processes:
            for gpu in proc.gpus:
                gpus.setdefault(gpu, []).append(proc)
        return dict(sorted(gpus.items()))

    def table(self) -> str:
        i, s = self.inputs, self.inputs.student
        lines = [f"memory plan (estimates, docs/memory-planner.md): student {s.name}, {s.params / 1e9:.2f}B params, "
                 f"{i.dtype}{', LoRA rank %d' % i.lora_rank if i.lora_rank else ''}"
                 f"{', gradient checkpointing' if i.checkpointing else ''}; {i.prompts_per_step} prompts x {i.samples} "
                 f"samples, {i.prompt_tokens} prompt + {i.max_tokens} completion tokens, micro-batch "
                 f"{i.micro_batch_prompts} prompts, loss {i.divergence}"
                 + (f", {i.world} FSDP ranks" if i.world > 1 else "")]
        for proc in self.processes:
            where = f"GPU {', '.join(map(str, proc.gpus))}" if proc.gpus else "CPU memory"
            lines.append(f"  {proc.name} ({where}): peak {gib(proc.peak)} in its {proc.peak_phase} phase"
                         + (f", of its share {gib(proc.budget)} ({proc.budget_how})" if proc.budget else ""))
            for part in proc.held + proc.phases.get(proc.peak_phase, []):
                lines.append(f"    {part.what:<22}{gib(part.bytes):>11}  {part.how}")
            others = [f"{name} {gib(sum(p.bytes for p in parts))}" for name, parts in proc.phases.items()
                      if name != proc.peak_phase]
            if others:
                lines.append(f"    {'other phases':<22}{'':>11}  " + ", ".join(others))
        if self.capacity is not None:
            lines.append(f"  per GPU ({self.gpu_name}, {gib(self.capacity)}): the peaks + {HEADROOM:.0%} for the estimates' "
                         f"error + {RESERVE_GIB:.0f} GiB for the CUDA context and the allocator's slack")
            for gpu, procs in self.per_gpu().items():
                need = self.need(procs)
                lines.append(f"    GPU {gpu}: {gib(need)} ({', '.join(p.name for p in procs)})"
                             f"{'' if need <= self.capacity else '  DOES NOT FIT'}")
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)

    @staticmethod
    def need(procs: list[Process]) -> float:
        """Bytes a GPU must have for `procs`: their peaks, the estimates' headroom, the CUDA context."""
        return sum(p.peak for p in procs) * (1 + HEADROOM) + RESERVE_GIB * GIB

    def refusal(self) -> str | None:
        """One line when a GPU cannot hold what the plan puts on it; None when everything fits."""
        if self.capacity is None:
            return None
        for proc in self.processes:
            if proc.budget and proc.peak > proc.budget:
                return _server_refusal(proc, self.gpu_name)
        for gpu, procs in self.per_gpu().items():
            need = self.need(procs)
            if need <= self.capacity:
                continue
            names = " and ".join(p.name for p in procs)
            line = (f"the memory plan does not fit: GPU {gpu} ({self.gpu_name}, {gib(self.capacity)}) needs "
                    f"{gib(need)} for the {names}")
            trainer = next((p for p in procs if p.name.startswith("trainer")), None)
            if trainer is None or self.suggest is None:
                return line + "; place the servers on GPUs of their own (engine.student_gpus, engine.teacher_gpus)"

            def with_trainer(peak: float) -> float:
                return need + (peak - trainer.peak) * (1 + HEADROOM)

            tried = self.suggest(self.inputs)
            fits = [(what, n) for what, n in tried if with_trainer(n) <= self.capacity]
            head = "fits with" if fits else "no one setting alone fits; combine"
            return line + f"; {head}: " + ", ".join(f"{what} ({gib(with_trainer(n))})" for what, n in fits or tried)
        return None


def _server_refusal(proc: Process, gpu_name: str) -> str:
    weights = sum(p.bytes for p in proc.held)
    kv = proc.peak - weights
    need_more = proc.peak - (proc.budget or 0)
    sequences = next((part.how.split(" sequences")[0] for part in proc.phases["serve"]), "?")
    fit = int(max(proc.budget - weights, 0) / (kv / int(sequences))) if sequences.isdigit() and kv else 0
    return (f"the memory plan does not fit: the {proc.name} on GPU {', '.join(map(str, proc.gpus))} ({gpu_name}) "
            f"needs {gib(proc.peak)} (weights {gib(weights)}, KV cache {gib(kv)} for {sequences} sequences), "
            f"{gib(need_more)} more than its share {gib(proc.budget or 0)} ({proc.budget_how}); lower "
            f"engine.max_concurrency to {fit} or less, raise engine.gpu_memory_utilization, or raise "
            "engine.tensor_parallel_size")


def _suggestions(inputs: Inputs) -> list[tuple[str, float]]:
    """(a setting that lowers the trainer's peak, the peak with it) for each that applies."""
    tries = []
    if not inputs.checkpointing:
        tries.append(("model.gradient_checkpointing=true", dataclasses.replace(inputs, checkpointing=True)))
    if inputs.micro_batch_prompts > 1:
        tries.append(("optim.micro_batch_prompts=1", dataclasses.replace(inputs, micro_batch_prompts=1)))
    if inputs.divergence not in ("sampled", "topk_reverse_kl"):
        tries.append(("loss.divergence=sampled", dataclasses.replace(inputs, divergence="sampled")))
    if not inputs.lora_rank:
        lora = inputs.student.lora_params(16, ("all-linear",))
        tries.append(("model.lora_rank=16", dataclasses.replace(inputs, lora_rank=16, lora_params=lora)))
    for world in (2, 4, 8):
        if world > inputs.world:
            tries.append((f"{world} GPUs for the trainer (torchrun --nproc-per-node {world}, FSDP)",
                          dataclasses.replace(inputs, world=world)))
    return [(what, trainer_process(changed, "trainer", (0,)).peak) for what, changed in tries]


def plan_run(config: Any, *, capacity_gib: float | None, gpu_name: str = "GPU", on_gpu: bool | None = None,
             world: int = 1, prompt_tokens: int = PROMPT_TOKENS, shapes: dict[str, ModelShape] | None = None) -> RunPlan:
    """The memory plan of `config` on GPUs of `capacity_gib` each (None: printed, not checked).
    `on_gpu`: whether the trainer runs on a GPU (default: model.device is not 'cpu' and a capacity is known)."""
    from selfopd.engines.gpu_layout import server_shares, server_slots

    device = config.model.device
    on_gpu = (device != "cpu" and (capacity_gib is not None or device.startswith("cuda"))) if on_gpu is None else on_gpu
    shapes = model_shapes(config, shapes)
    inputs = plan_inputs(config, on_gpu, world, prompt_tokens, shapes)
    trainer_gpus = (int(device.split(":")[1]),) if ":" in device else tuple(range(world))
    processes = [trainer_process(inputs, f"trainer rank {rank}" if world > 1 else "trainer",
                                 (trainer_gpus[rank],) if on_gpu else ()) for rank in range(world if on_gpu else 1)]
    notes = [] if on_gpu else ["the trainer runs on the CPU: its memory is the machine's, not a GPU's"]
    capacity = capacity_gib * GIB if capacity_gib is not None else None
    engine = config.engine
    length = prompt_tokens + config.rollout.max_tokens
    if engine.kind == "vllm_colocate":
        colocated = server_process(inputs.student, "vLLM in the trainer", processes[0].gpus, 1, inputs.dtype,
                                   engine.max_concurrency, length, None, "")
        phase = "sample" if engine.sleep_mode else "train"
        processes[0].phases.setdefault(phase, []).extend(colocated.held + colocated.phases["serve"])
        notes.append(f"vllm_colocate: vLLM's weights and KV cache counted in the {phase} phase"
                     + (" (asleep while the trainer trains)" if engine.sleep_mode else ""))
    slots = server_slots(config) if engine.kind == "vllm" else []
    placed = [(slot, slot.gpus or tuple(range(slot.tensor_parallel_size))) for slot in slots]
    trained_on = [gpu for p in processes for gpu in p.gpus] if on_gpu else []
    gpu_count = 1 + max([gpu for _, gpus in placed for gpu in gpus] + trained_on, default=0)
    shares = server_shares(slots, trained_on, gpu_count, engine.gpu_memory_utilization)
    for slot, gpus in placed:
        external = slot.name == "teacher" and config.teacher.kind == "external"
        shape = shapes["teacher"] if external else inputs.student
        share, why = shares[slot.name]
        how = (f"engine.gpu_memory_utilization = {share}" if engine.gpu_memory_utilization
               else f"{share:.2f} of the GPU, from the layout ({why}): engine.gpu_memory_utilization = 0")
        processes.append(server_process(shape, f"{slot.name} server", gpus if on_gpu else (), slot.tensor_parallel_size,
                                        inputs.dtype, engine.max_concurrency, length,
                                        share * capacity if capacity and on_gpu else None, how))
    for role, url in [("student", u) for u in engine.urls("student_urls")] + [("teacher", u) for u in engine.urls("teacher_url")]:
        notes.append(f"the {role} server at {url} is given by URL: planned where it runs, not here")
    notes.append(f"prompts assumed {prompt_tokens} tokens (selfopd plan --prompt-tokens); vLLM's own forward "
                 "pass and CUDA graphs are not counted in a server's share")
    return RunPlan(inputs, processes, capacity if on_gpu else None, gpu_name, notes, _suggestions)


def detected_gpu() -> tuple[str, float] | None:
    """(name, GiB) of GPU 0 here; None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    return props.name, props.total_memory / GIB
