"""A training config's memory plan per GPU, and whether it fits: the trainer's ranks and each vLLM
server `selfopd.serving.gpu_layout` places, sized by `selfopd.planning.memory_plan` and
`selfopd.planning.server_memory`. When a GPU cannot hold what the plan puts on it, `RunPlan.refusal`
is one line naming the GPU, the need, the capacity, and the settings that would make it fit (each
tried on the plan); trainer GPUs it suggests are only GPUs the layout leaves free."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

from selfopd.config import ModelConfig, TeacherConfig
from selfopd.config.auto import Machine, run_dtype
from selfopd.config.bundles import PlanSettings
from selfopd.planning.memory_plan import (GIB, HEADROOM, RESERVE_GIB, Inputs, ModelShape, Process, gib, planned_shape,
                                          trainer_process)
from selfopd.planning.server_memory import (Load, batched_token_budget, prompt_logprobs_part, server_process,
                                            server_refusal, spike_bytes)

PROMPT_TOKENS = 256  # assumed prompt length when none is given (`selfopd plan --prompt-tokens`)


def plan_inputs(settings: PlanSettings, on_gpu: bool, world: int, prompt_tokens: int,
                shapes: dict[str, ModelShape] | None = None) -> Inputs:
    """The plan's inputs from a config's sections; `shapes` ({'student': .., 'teacher': ..}) skips reading
    config.json. model.dtype = 'auto' is what a run on a GPU (`on_gpu`) or a CPU makes of it
    (`selfopd.config.auto.run_dtype`, the rule a run applies)."""
    model, teacher, engine, rollout, evals = (settings.model, settings.teacher, settings.engine, settings.rollout,
                                              settings.eval)
    shapes = model_shapes(model, teacher, shapes)
    student = shapes["student"]
    in_process = engine.teacher_in_process
    held = None
    if in_process and teacher.kind == "external":
        held = shapes["teacher"]
    elif in_process and teacher.kind in ("frozen", "ema") and not model.lora:
        held = student
    return Inputs(
        student=student, teacher=held, teacher_kind=teacher.kind,
        dtype=run_dtype(model, engine, Machine(cuda=on_gpu)), on_gpu=on_gpu, engine=engine.kind,
        teacher_in_process=in_process and teacher.kind != "none",
        world=world, lora_rank=model.lora_rank, lora_params=student.lora_params(model.lora_rank, model.lora_targets),
        checkpointing=model.gradient_checkpointing, prompts_per_step=rollout.prompts_per_step,
        samples=rollout.samples_per_prompt, max_tokens=rollout.max_tokens, prompt_tokens=prompt_tokens,
        micro_batch_prompts=settings.micro_batch_prompts, divergence=settings.divergence,
        engine_batch=engine.batch_size, eval_prompts=evals.batch_size, eval_samples=evals.samples,
        eval_max_tokens=evals.max_tokens)


def model_shapes(model: ModelConfig, teacher: TeacherConfig,
                 shapes: dict[str, ModelShape] | None = None) -> dict[str, ModelShape]:
    """{'student': shape, 'teacher': shape of an external teacher}, read from config.json where not given."""
    shapes = dict(shapes or {})
    if "student" not in shapes:
        shapes["student"] = planned_shape(model.student, "model.student", model.trust_remote_code)
    if teacher.kind == "external" and "teacher" not in shapes:
        shapes["teacher"] = planned_shape(teacher.model, "teacher.model", model.trust_remote_code)
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
    length_problem: str = ""  # launched servers whose engine.max_model_len cannot hold a sequence

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
                 + (f", {i.world} FSDP ranks" if i.world > 1 else "")
                 + f"; in-run eval {i.eval_prompts} prompts x {i.eval_samples} samples, {i.eval_max_tokens} tokens"]
        for proc in self.processes:
            where = f"GPU {', '.join(map(str, proc.gpus))}" if proc.gpus else "CPU memory"
            lines.append(f"  {proc.name} ({where}): peak {gib(proc.peak)} in its {proc.peak_phase} phase"
                         + (f", of its share {gib(proc.budget)} ({proc.budget_how})" if proc.budget else ""))
            for part in proc.held + proc.phases.get(proc.peak_phase, []) + proc.outside:
                lines.append(f"    {part.what:<22}{gib(part.bytes):>11}  {part.how}")
            others = [f"{name} {gib(sum(p.bytes for p in parts))}" for name, parts in proc.phases.items()
                      if name != proc.peak_phase]
            if others:
                lines.append(f"    {'other phases':<22}{'':>11}  " + ", ".join(others))
        if self.capacity is not None:
            lines.append(f"  per GPU ({self.gpu_name}, {gib(self.capacity)}): the peaks + {HEADROOM:.0%} for the estimates' "
                         f"error (a server: its whole share, + {HEADROOM:.0%} of what it takes beyond) + "
                         f"{RESERVE_GIB:.0f} GiB for the CUDA context and the allocator's slack")
            for gpu, procs in self.per_gpu().items():
                need = self.need(procs, gpu)
                lines.append(f"    GPU {gpu}: {gib(need)} ({', '.join(p.name for p in procs)})"
                             f"{'' if need <= self.capacity else '  DOES NOT FIT'}")
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)

    @staticmethod
    def need(procs: list[Process], gpu: int | None = None) -> float:
        """Bytes GPU `gpu` must have for `procs`: their peaks with the estimates' headroom (a vLLM server with a
        share: the share, which it takes whole, and the headroom on what it allocates beyond, on its first GPU,
        where tensor parallelism gathers the logits), the CUDA context."""
        taken = sum(p.budget if p.budget else p.peak * (1 + HEADROOM) for p in procs)
        beyond = sum(part.bytes for p in procs for part in p.outside if gpu is None or p.gpus[:1] == (gpu,))
        return taken + beyond * (1 + HEADROOM) + RESERVE_GIB * GIB

    def refusal(self) -> str | None:
        """One line when a GPU cannot hold what the plan puts on it; None when everything fits."""
        if self.length_problem:
            return self.length_problem
        if self.capacity is None:
            return None
        for proc in self.processes:
            if proc.budget and proc.peak > proc.budget:
                return server_refusal(proc, self.gpu_name)
        for gpu, procs in self.per_gpu().items():
            need = self.need(procs, gpu)
            if need <= self.capacity:
                continue
            names = " and ".join(p.name for p in procs)
            line = (f"the memory plan does not fit: GPU {gpu} ({self.gpu_name}, {gib(self.capacity)}) needs "
                    f"{gib(need)} for the {names}")
            trainer = next((p for p in procs if p.name.startswith("trainer")), None)
            if trainer is None or self.suggest is None:
                return line + "; " + self._server_fixes(procs, gpu)

            def with_trainer(peak: float) -> float:
                return need + (peak - trainer.peak) * (1 + HEADROOM)

            tried = self.suggest(self.inputs)
            fits = [(what, n) for what, n in tried if with_trainer(n) <= self.capacity]
            head = "fits with" if fits else "no one setting alone fits; combine"
            return line + f"; {head}: " + ", ".join(f"{what} ({gib(with_trainer(n))})" for what, n in fits or tried)
        return None

    def _server_fixes(self, procs: list[Process], gpu: int) -> str:
        """What makes a GPU of servers fit: a smaller share when one allocates beyond it (prompt_logprobs), or
        a smaller scheduler token budget; else GPUs of their own."""
        capacity, reserve = self.capacity or 0.0, RESERVE_GIB * GIB
        spiking = [p for p in procs if p.outside and p.gpus[:1] == (gpu,)]
        beyond = sum(part.bytes for p in spiking for part in p.outside)
        servers = [p for p in procs if p.budget]
        if not beyond or not servers:
            return "place the servers on GPUs of their own (engine.student_gpus, engine.teacher_gpus)"
        fixes = []
        share = int(100 * (capacity - reserve - beyond * (1 + HEADROOM)) / (len(servers) * capacity)) / 100
        if share > 0:
            fixes.append(f"engine.gpu_memory_utilization={share} (the share of each server on it)")
        room = (capacity - reserve - sum(p.budget or 0 for p in servers)) / (1 + HEADROOM)
        load = spiking[0].loads["score"]
        tokens = max((n for n in range(256, 65537, 256) if spike_bytes(load, n) <= room), default=0)
        if tokens >= 1024:  # vLLM refuses a token budget under max_num_seqs (1024 on 70 GiB GPUs and more)
            fixes.append(f"engine.extra_server_args='--max-num-batched-tokens {tokens}' (prompt_logprobs of "
                         f"{gib(spike_bytes(load, tokens))})")
        fixes = fixes or ["place the teacher server on GPUs of its own with more memory"]
        return (f"the {spiking[0].name}'s prompt_logprobs ({gib(beyond)}) come on top of "
                f"the share vLLM takes; fits with: " + " or ".join(fixes))


def _suggestions(inputs: Inputs, taken: frozenset[int] = frozenset(), gpu_count: int | None = None
                 ) -> list[tuple[str, float]]:
    """(a setting that lowers the trainer's peak, the peak with it) for each that applies; more trainer GPUs only
    where GPUs 0..N-1 (the ranks' GPUs under torchrun) hold no server and the machine has them."""
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
        if world > inputs.world and not taken & set(range(world)) and (gpu_count is None or world <= gpu_count):
            tries.append((f"GPUs 0-{world - 1} for the trainer (torchrun --nproc-per-node {world}, FSDP)",
                          dataclasses.replace(inputs, world=world)))
    return [(what, trainer_process(changed, "trainer", (0,)).peak) for what, changed in tries]


def plan_run(settings: PlanSettings, *, capacity_gib: float | None, gpu_name: str = "GPU", on_gpu: bool | None = None,
             world: int = 1, prompt_tokens: int = PROMPT_TOKENS, shapes: dict[str, ModelShape] | None = None,
             gpu_count: int | None = None) -> RunPlan:
    """The memory plan of a run (its config's sections) on GPUs of `capacity_gib` each (None: printed, not checked).
    `on_gpu`: whether the trainer runs on a GPU (default: model.device is not 'cpu' and a capacity is known).
    `gpu_count`: the GPUs the machine has, when known (trainer GPUs are suggested within them)."""
    from selfopd.serving.gpu_layout import server_shares, server_slots

    device = settings.model.device
    on_gpu = (device != "cpu" and (capacity_gib is not None or device.startswith("cuda"))) if on_gpu is None else on_gpu
    shapes = model_shapes(settings.model, settings.teacher, shapes)
    inputs = plan_inputs(settings, on_gpu, world, prompt_tokens, shapes)
    trainer_gpus = (int(device.split(":")[1]),) if ":" in device else tuple(range(world))
    processes = [trainer_process(inputs, f"trainer rank {rank}" if world > 1 else "trainer",
                                 (trainer_gpus[rank],) if on_gpu else ()) for rank in range(world if on_gpu else 1)]
    notes = [] if on_gpu else ["the trainer runs on the CPU: its memory is the machine's, not a GPU's"]
    notes += [shape.note for shape in shapes.values() if shape.note]
    capacity = capacity_gib * GIB if capacity_gib is not None else None
    engine, rollout, evals = settings.engine, settings.rollout, settings.eval
    length, eval_length = prompt_tokens + rollout.max_tokens, prompt_tokens + evals.max_tokens
    if engine.kind == "vllm_colocate":
        colocated = server_process(inputs.student, "vLLM in the trainer", processes[0].gpus, 1, inputs.dtype,
                                   {"serve": Load(1, engine.max_concurrency, 1, 1, 1, max(length, eval_length))},
                                   None, "")
        phase = "sample" if engine.sleep_mode else "train"
        processes[0].phases.setdefault(phase, []).extend(colocated.held + colocated.phases["serve"])
        notes.append(f"vllm_colocate: vLLM's weights and KV cache ({engine.max_concurrency} sequences of up to "
                     f"{max(length, eval_length)} tokens) counted in the {phase} phase"
                     + (" (asleep while the trainer trains)" if engine.sleep_mode else ""))
    slots = server_slots(engine, settings.teacher) if engine.kind == "vllm" else []
    placed = [(slot, slot.gpus or tuple(range(slot.tensor_parallel_size))) for slot in slots]
    trained_on = [gpu for p in processes for gpu in p.gpus] if on_gpu else []
    layout_gpus = 1 + max([gpu for _, gpus in placed for gpu in gpus] + trained_on, default=0)
    shares = server_shares(slots, trained_on, layout_gpus, engine.gpu_memory_utilization)
    students, teachers = (sum(slot.role == role for slot in slots) for role in ("student", "teacher"))
    dtype_bytes = 2 if inputs.dtype == "bfloat16" else 4
    for slot, gpus in placed:
        teacher = slot.role == "teacher"
        shape = shapes["teacher"] if teacher and settings.teacher.kind == "external" else inputs.student
        share, why = shares[slot.name]
        how = (f"engine.gpu_memory_utilization = {share}" if engine.gpu_memory_utilization
               else f"{share:.2f} of the GPU, from the layout ({why}): engine.gpu_memory_utilization = 0")
        concurrency = engine.max_concurrency
        loads = ({"score": Load(rollout.prompts_per_step * rollout.samples_per_prompt, 1, concurrency, world, teachers, length,
                                shape.vocab, dtype_bytes)}
                 if teacher else
                 {"serve": Load(rollout.prompts_per_step, rollout.samples_per_prompt, concurrency, world, students, length),
                  "eval": Load(evals.batch_size, evals.samples, concurrency, world, students, eval_length)})
        proc = server_process(shape, f"{slot.name} server", gpus if on_gpu else (), slot.tensor_parallel_size,
                              inputs.dtype, loads, share * capacity if capacity and on_gpu else None, how)
        if teacher and on_gpu:  # vLLM's scoring forms full-vocabulary logits of each prompt (selfopd.planning.server_memory)
            tokens, _, why_tokens = batched_token_budget(engine.extra_server_args, capacity, gpu_name)
            proc.outside.append(prompt_logprobs_part(loads["score"], tokens, why_tokens))
        processes.append(proc)
    notes.append(f"prompts assumed {prompt_tokens} tokens (selfopd plan --prompt-tokens); vLLM's own forward "
                 "pass and CUDA graphs are inside a server's share")
    for role, url in [("student", u) for u in engine.urls("student_urls")] + [("teacher", u) for u in engine.urls("teacher_url")]:
        notes.append(f"the {role} server at {url} is given by URL: planned where it runs, not here")
    taken = frozenset(gpu for _, gpus in placed for gpu in gpus)
    return RunPlan(inputs, processes, capacity if on_gpu else None, gpu_name, notes,
                   lambda changed: _suggestions(changed, taken, gpu_count), _length_problem(settings, slots, prompt_tokens))


def _length_problem(settings: PlanSettings, slots: list, prompt_tokens: int) -> str:
    """engine.max_model_len too short for what the launched servers hold: the longest sequence + 1."""
    if not slots:
        return ""
    longest = max((settings.rollout.max_tokens, "rollout.max_tokens"),
                  (settings.eval.max_tokens if any(s.role == "student" for s in slots) else 0, "eval.max_tokens"))
    needed = prompt_tokens + longest[0] + 1
    if needed <= settings.engine.max_model_len:
        return ""
    return (f"engine.max_model_len = {settings.engine.max_model_len} cannot hold a prompt of {prompt_tokens} tokens "
            f"(assumed: selfopd plan --prompt-tokens) + {longest[1]} ({longest[0]}) + 1 on the launched servers; "
            f"raise it to {needed} or more")


def detected_gpu() -> tuple[str, float] | None:
    """(name, GiB) of GPU 0 here; None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    return props.name, props.total_memory / GIB
