"""The OPD training loop: evals, checkpoints, metrics and the illusion guard around
`selfopd.training.step.train_step` (one step, as named phases). Set-up is
`selfopd.training.setup`, the weight checks `selfopd.training.weight_checks`, what a run writes
`selfopd.training.outputs` and `selfopd.run.tracking`.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from pathlib import Path
from typing import Callable, Iterator

from tqdm.auto import tqdm

from selfopd.training import guard
from selfopd.config import DEFAULT_TEACHER, TrainConfig, config_to_toml
from selfopd.config.auto import Machine, resolve_auto
from selfopd.core.distributed import all_sum, barrier, close_process_group, current_world
from selfopd.run.folder_guard import check_not_in_use, check_writable, claimed_run_folder, refuse_finished, writing
from selfopd.core.run_folder import RunFolder, refuse_links
from selfopd.config.bundles import PlanSettings
from selfopd.planning.plan_check import check_memory_plan
from selfopd.serving.transfer_wire import check_trainer_address
from selfopd.training.outputs import (exports_weights, finish_checkpoint_writes, plot_run, prune_checkpoints, reuse_eval,
                                      run_eval, save_checkpoint)
from selfopd.training.teacher_metrics import starved_teachers
from selfopd.training.setup import build_run, resume_checkpoint  # noqa: F401  (build_run public here: tests and benchmarks build a run, then step it)
from selfopd.training.state import Run
from selfopd.run.templates import config_template_names, save_run_templates
from selfopd.data.split import SplitRecord
from selfopd.run.tracking import MetricsLog
from selfopd.run.verifier_isolation import use_verifier_isolation
from selfopd.training.step import SKIPPED, batch_for_step, train_step  # noqa: F401  (public here)
from selfopd.training.weight_checks import WeightSyncError  # noqa: F401  (public here)

class NonFiniteLoss(RuntimeError):
    """optim.max_nonfinite_steps steps in a row had a NaN or inf loss or gradient."""


class GuardStop(RuntimeError):
    """The illusion guard fired with guard.action = 'stop' (the step is checkpointed and evaluated)."""

    def __init__(self, message: str, step: int) -> None:
        super().__init__(message)
        self.step = step


class Stopped(RuntimeError):
    """SIGTERM or SIGUSR1 (a scheduler's notice before preemption) asked the run to stop: every rank
    finished its step and the checkpoint of that step is written; `--resume` goes on exactly."""

    def __init__(self, message: str, step: int) -> None:
        super().__init__(message)
        self.step = step


STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


@contextlib.contextmanager
def stop_requests() -> Iterator[Callable[[], str | None]]:
    """While it is open, SIGTERM and SIGUSR1 are recorded instead of ending the process; yields a function
    that names the signal received so far (None: none). The previous handlers come back on exit. Only the
    main thread can set handlers: elsewhere (a notebook's worker thread) nothing is caught."""
    received: list[str] = []
    if threading.current_thread() is not threading.main_thread():
        yield lambda: None
        return
    previous = {number: signal.signal(number, lambda number, _frame: received.append(signal.Signals(number).name))
                for number in STOP_SIGNALS}
    try:
        yield lambda: received[0] if received else None
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint of a run folder (None: none yet)."""
    return RunFolder(run_dir).latest_checkpoint()


def train(config: TrainConfig, resume: bool = False, initial_eval: Path | None = None) -> Path:
    """Run (or continue) training; returns the run folder.

    `initial_eval`: an eval folder (eval.jsonl + summary.json) of these very starting weights
    on this eval split, used as the step-0 eval instead of evaluating again. `selfopd
    compare` evaluates the shared base model once for all its arms. Under torchrun every
    rank runs this; rank 0 alone writes the run folder."""
    config = resolve_auto(config, Machine.here())  # a TrainConfig built in Python may still say 'auto'
    check_memory_plan(PlanSettings.of(config), current_world().size)  # on GPUs: refused before any folder or weights
    main = current_world().is_main
    folder = RunFolder.of(config.run.out_dir, config.run.name)
    use_verifier_isolation(config.verifier.isolation)  # every rank grades; a sandbox that cannot start stops here
    if main:  # refused before any model loads; the folder itself is made once the inputs pass their checks
        check_writable(folder.root)
        check_not_in_use(folder.root)
        if config.engine.kind == "vllm":
            check_trainer_address(config.engine.trainer_address)
        if resume:  # a link or a damaged record is named now, not after the servers start (`selfopd compare`
            refuse_links(folder)  # resumes its arms here, without load_run_config)
            if folder.metrics.exists():
                from selfopd.core.plots import read_metrics

                read_metrics(folder.metrics)
    checkpoint = resume_checkpoint(folder) if resume else None  # the newest complete one, saying what it skips
    if not resume:
        refuse_finished(folder)
    claim = (lambda: _claimed(folder, config, resume, checkpoint)) if main else None
    run = build_run(config, checkpoint, claim)
    with contextlib.closing(run):  # stops launched servers on any exit, Ctrl-C included
        split = SplitRecord.of(config.data.spec, config.data.split_seed, run.train_examples, run.eval_examples)
        if resume:
            SplitRecord.read(folder.root).check_same(split, str(folder.root))
        elif main:
            split.write(folder.root)
        log = MetricsLog(folder, config) if main else None
        try:
            with contextlib.closing(log) if log else contextlib.nullcontext(), stop_requests() as stop_asked:
                _train_loop(run, log, resume, initial_eval, stop_asked)
        except (GuardStop, Stopped):  # every rank stops at the same step, its checkpoint written: plot what ran
            if main:
                plot_run(folder)
            raise
        barrier(run.world)  # the last checkpoint is written before any rank returns
    close_process_group()
    if main:
        plot_run(folder)
    return folder.root


@contextlib.contextmanager
def _claimed(folder: RunFolder, config: TrainConfig, resume: bool, checkpoint: Path | None) -> Iterator[None]:
    """Hold the run folder's lock (a fresh run: create the folder, write its config; keep its templates'
    texts); a resumed run then drops what a kill between a checkpoint and its clean-up left behind."""
    with claimed_run_folder(folder, None if resume else config_to_toml(config)):
        save_run_templates(folder.templates, config_template_names(config))
        if checkpoint is not None:
            prune_checkpoints(folder, checkpoint, config.run)
        yield


def _train_loop(run: Run, log: MetricsLog | None, resume: bool, initial_eval: Path | None,
                stop_asked: Callable[[], str | None] = lambda: None) -> None:
    """Every rank runs every step, eval and checkpoint (collectives); `log` is rank 0's. A stop signal
    (`stop_requests`) ends the run after the step in progress and its checkpoint, with no eval."""
    config = run.config

    def record(metrics: dict[str, float] | None) -> None:
        if log is not None and metrics is not None:
            log.log(metrics)

    history: list[dict] = []  # the training-step lines so far (rank 0), what the guard decides on
    if resume:
        if log is not None:
            history = guard.training_lines(log.truncate_after(run.step))
    elif initial_eval is not None:
        record(reuse_eval(run, initial_eval) if run.world.is_main else None)
    else:
        record(run_eval(run))
    bar = tqdm(total=config.run.steps, initial=run.step, desc=config.run.name, unit="step",
               disable=not (config.run.progress and run.world.is_main))
    skipped_in_row = 0
    teacher_lines: list[dict] = []  # with [teachers.*]: the step lines, for the starved-teacher warning
    routed_to = sorted({run.route(example) for example in run.train_examples})  # the teachers data reaches
    while run.step < config.run.steps:
        metrics = train_step(run)
        fired = guard.watch(run.folder, config, history, metrics) if run.world.is_main else []  # marks `metrics`
        record(metrics)
        if run.several_teachers and run.world.is_main:
            teacher_lines.append(metrics)
            warn_starved(run, teacher_lines, routed_to)
        skipped_in_row = skipped_in_row + 1 if metrics.get("skipped") else 0
        if skipped_in_row >= config.optim.max_nonfinite_steps:
            raise NonFiniteLoss(_nonfinite_message(run, skipped_in_row))
        bar.set_postfix(**({"kl": f"{metrics['opd/reverse_kl']:.3f}"} if "opd/reverse_kl" in metrics else {}),
                        acc=f"{metrics['reward/accuracy']:.2f}",
                        **({"tok/s": f"{metrics['throughput/tokens_per_s']:.0f}"}
                           if "throughput/tokens_per_s" in metrics else {}))
        bar.update(1)
        fired_any = all_sum(float(bool(fired)), run.world) > 0  # rank 0 decided; every rank checkpoints
        stop = fired_any and config.guard.action == "stop"
        signalled = all_sum(float(stop_asked() is not None), run.world) > 0  # any rank's signal stops every rank
        last = run.step == config.run.steps or stop
        if ((config.run.eval_every and run.step % config.run.eval_every == 0) or last) and not signalled:
            record(run_eval(run))
        due = config.run.checkpoint_every and run.step % config.run.checkpoint_every == 0
        exported = run.checkpoint_writer is not None and exports_weights(config.run, run.step)  # sharded
        with writing(run.folder.checkpoint(run.step)):
            if due or exported or last or fired_any or signalled:
                save_checkpoint(run)
            if last or stop or signalled:
                finish_checkpoint_writes(run)  # a write in flight is put in place before the process exits
        if stop:
            raise GuardStop(guard.stop_message(run.folder, run.step, fired), run.step)
        if signalled and not last:
            raise Stopped(f"stopped by {stop_asked() or 'a signal to another rank'} after step {run.step} of "
                          f"{config.run.steps}, its checkpoint written: go on with `selfopd train --resume "
                          f"{run.folder.root}`", run.step)
    bar.close()


def warn_starved(run: Run, lines: list[dict], names: list[str]) -> None:
    """One line for each teacher of `names` (those the training data reaches) whose run of steps without
    tokens has just reached guard.starved_teacher_steps."""
    steps = run.config.guard.starved_teacher_steps
    for name in sorted(set(starved_teachers(lines, names, steps)) - set(starved_teachers(lines[:-1], names, steps))):
        where = "[teacher]" if name == DEFAULT_TEACHER else f"teachers.{name}.tasks"
        print(f"selfopd: teacher {name!r} has received no completion tokens for {steps} steps in a row (up to step "
              f"{run.step}): no example of these steps was routed to it; check {where} and the data's "
              "'teacher' column", file=sys.stderr)


def _nonfinite_message(run: Run, count: int) -> str:
    checkpoint = run.folder.latest_checkpoint()
    return (f"steps {run.step - count + 1} to {run.step}: {count} steps in a row had a NaN or inf loss or gradient "
            f"(optim.max_nonfinite_steps = {run.config.optim.max_nonfinite_steps}); they were skipped, the weights "
            f"are those of step {run.step - count}; last checkpoint: {checkpoint or 'none'}. Check the teacher's "
            f"logprobs and the learning rate in {run.folder.metrics}")
