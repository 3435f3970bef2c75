"""Phase 1 of a step, the student's rollouts, sampled ahead when `rollout.max_staleness` = k >= 1.

With k = 0 each step samples its own prompts with the weights it is about to train: the
synchronous loop. With k >= 1 step s, once it has taken its own rollouts, asks the engine for
step s + k's with the weights it holds now (version s), and trains while the engine samples.

k = 1: before the next weight sync the trainer waits for that request to finish. So each
request runs under one version only, every rollout of step b >= 1 was sampled by the weights
of step b - 1 (those of step 0 by the initial weights), and a run is the same whatever the
timing: a resumed run regenerates nothing, since the rollouts sampled ahead are saved with
each checkpoint (`pending_json` / `load_pending`).

k >= 2 with servers: up to k requests are in flight at once (the servers batch them together)
and nothing waits for them before a weight sync: the push freezes them, and they go on with
the new weights (`selfopd.serving.weight_sync`, `keep_requests`). A rollout of step b was asked
for with the weights of step b - k (`weight_version`) and may have later tokens from newer ones,
up to `last_weight_version`; each token carries the logprob it was drawn with, so the importance
ratio stays exact per token. Which tokens come from which weights depends on timing: such a run
is not reproduced bit for bit by a resume.

The overlap happens only where sampling runs in other processes (`Engine.samples_in_background`:
vLLM servers). An in-process engine (the transformers one, the colocated vLLM that sleeps while
the trainer trains) samples the same rollouts at the moment they are asked for: the staleness of
a k-step pipeline, every request under one version, without its speed, which is what a laptop
needs to study staleness.

The loss stays correct off-policy because nothing but the sampling is stale: the trainer
recomputes the student's logprobs with its current weights, the teacher scores at the
current step (a `self` or `ema` teacher on the weights or average of the step that trains),
and the importance ratio student / sampler (`loss.is_cap`) corrects for the old sampler.
"""

from __future__ import annotations

import json
import random
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable, Sequence

from transformers import PreTrainedTokenizerBase

from selfopd.config import TrainConfig
from selfopd.core.distributed import World, all_gather, padded_share
from selfopd.core.faults import fault_point
from selfopd.data.example import Example
from selfopd.data.mixture import by_task
from selfopd.engines.base import Engine, Rollout, SamplingParams
from selfopd.episodes.sampling import EpisodeSampler
from selfopd.run.tracking import PhaseTimer
from selfopd.templating.chat_format import ChatFormat
from selfopd.templating.templates import Message, PromptTemplate, render_student

PENDING_FILE = "pending_rollouts.json"  # in a checkpoint folder: the rollouts sampled ahead of it


@dataclass(frozen=True)
class StudentSide:
    """What sampling reads of a run; fixed for the run (`training.state.Run.student_side`)."""

    config: TrainConfig
    tokenizer: PreTrainedTokenizerBase
    engine: Engine
    template: PromptTemplate
    train_examples: Sequence[Example]
    world: World
    chat: ChatFormat  # the student's chat format (`selfopd.training.grading.student_format`), built once
    episodes: EpisodeSampler | None = None  # rollout.environment: each rollout an episode of several turns


@dataclass
class Request:
    """One step's prompts, rendered and tokenised, as the engine is asked for them."""

    step: int
    examples: list[Example]
    student_messages: list[list[Message]]
    prompts: list[list[int]]
    params: SamplingParams
    first_group: int  # the step-wide index of this rank's first prompt
    # Per prompt: whether its chat template opened a reasoning block (decided when it was tokenized,
    # `ChatFormat.prompt`); None: not told, grading decides it from the prompt's ids by the same rule.
    opened: list[bool] | None = None
    # How many of `examples` are this rank's share of the step; those after them pad the share to every
    # rank's size (`padded_share`) and are run, then weighed zero. None: all of them.
    real: int | None = None

    def is_padding(self, group: int) -> bool:
        """Whether the step-wide prompt `group` of this request only pads the rank's share."""
        return self.real is not None and group >= self.first_group + self.real


@dataclass
class Sampled:
    """The student's rollouts of one request: `groups[i]` are the samples of `request.prompts[i]`."""

    request: Request
    groups: list[list[Rollout]]
    version: int  # the trainer step whose weights sampled the rollouts (asked with, when several were in flight)
    sample_seconds: float = 0.0  # the engine's time on them (in the background, with k >= 1 and servers)

    @property
    def last_version(self) -> int | None:
        """In flight across weight pushes: the newest weights that may have sampled a token (the
        rollouts' `last_weight_version`, the same for the whole request); None otherwise."""
        return next((rollout.last_weight_version for group in self.groups for rollout in group), None)


def request_for_step(side: StudentSide, step: int) -> Request:
    """This rank's share of step `step`'s prompts and their sampling parameters: a function of
    (seed, step) alone, so a step's request is the same whenever it is made."""
    cfg = side.config
    examples, real = padded_share(batch_for_step(side.train_examples, step, cfg.rollout.prompts_per_step, cfg.run.seed),
                                  side.world)
    first_group = side.world.rank * len(examples)
    messages = [render_student(side.template, e) for e in examples]
    params = SamplingParams(max_tokens=cfg.rollout.max_tokens, temperature=cfg.rollout.temperature,
                            top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k, min_p=cfg.rollout.min_p,
                            n=cfg.rollout.samples_per_prompt, seed=cfg.run.seed * 1_000_003 + step,
                            first_row=first_group * cfg.rollout.samples_per_prompt)
    prompts = [side.chat.prompt(m) for m in messages]
    return Request(step, examples, messages, [p.ids for p in prompts], params, first_group,
                   [p.opens_reasoning for p in prompts], real if real < len(examples) else None)


def sample_request(engine: Engine, request: Request, version: int, newest: Callable[[], int] | None = None,
                   episodes: EpisodeSampler | None = None) -> Sampled:
    """The engine's rollouts for `request`, each stamped with the weight version that sampled it.
    `newest`: with requests in flight across weight pushes, the newest version announced to the
    engine so far, read when the request is back (an upper bound on the weights that sampled it)."""
    started = time.perf_counter()
    groups = (episodes.sample(engine, request.prompts, request.examples, request.params) if episodes is not None
              else engine.sample(request.prompts, request.params))
    seconds = time.perf_counter() - started
    last = newest() if newest is not None else version
    later = last if last > version else None
    stamped = [[replace(rollout, weight_version=version, last_weight_version=later) for rollout in group]
               for group in groups]
    return Sampled(request, stamped, version, seconds)


def batch_for_step(examples: Sequence[Example], step: int, size: int, seed: int | str) -> list[Example]:
    """The prompts of step `step`: epochs of seeded permutations, so the order depends only
    on (seed, step) and a resumed run sees the same data. A mixture's step takes an equal
    share from each task (its own permutations; `size` is a multiple of the tasks, checked
    at start), the tasks one after another."""
    tasks = by_task(examples)
    if len(tasks) > 1:
        share = size // len(tasks)
        return [e for task, part in tasks.items() for e in batch_for_step(part, step, share, f"{seed}/{task}")]
    chosen = []
    for index in range(step * size, (step + 1) * size):
        epoch, offset = divmod(index, len(examples))
        order = list(range(len(examples)))
        random.Random(f"{seed}/{epoch}").shuffle(order)
        chosen.append(examples[order[offset]])
    return chosen


class RolloutPipeline:
    """The rollouts of the coming steps: taken by the step that trains on them, asked for up to
    `max_staleness` steps ahead. Each step calls `take`, then `before_weight_change` before its weight sync."""

    def __init__(self, max_staleness: int, background: bool, pending: dict[int, Sampled] | None = None,
                 version: int = 0, in_flight: bool = False) -> None:
        self.max_staleness = max_staleness
        # In other processes (`background`), k >= 2 (`RolloutConfig.in_flight`): k requests may run at once.
        self.in_flight = background and in_flight
        workers = max_staleness if self.in_flight else 1
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="selfopd-sampler") if background else None
        self._ahead: dict[int, Sampled | Future[Sampled]] = dict(pending or {})
        self._newest = version  # the newest weight version the engine has been or is being sent

    def take(self, side: StudentSide, step: int, timer: PhaseTimer) -> Sampled:
        """Step `step`'s rollouts (sampled now when none were asked for: k = 0, the first step),
        then the request for step `step + k`, sampled with the weights held now (version `step`)."""
        with timer("sample"):  # with k >= 1 and servers: the wait for a request already running
            ahead = self._ahead.pop(step, None)
            if ahead is None:
                sampled = sample_request(side.engine, request_for_step(side, step), step, episodes=side.episodes)
            else:
                sampled = ahead.result() if isinstance(ahead, Future) else ahead
        fault_point("train.sampled")
        with timer("sample"):  # in process, the rollouts ahead are sampled here; with servers, only asked for
            # Past run.steps too: the last checkpoint keeps them, so a run extended later continues exactly.
            for later in range(step + 1, step + self.max_staleness + 1):
                if later not in self._ahead:
                    self._ask(side, later, version=step)
        return sampled

    def _ask(self, side: StudentSide, step: int, version: int) -> None:
        request = request_for_step(side, step)  # rendered here: the tokenizer stays on the trainer's thread
        if self._executor is None:
            self._ahead[step] = sample_request(side.engine, request, version, episodes=side.episodes)
        else:
            newest = (lambda: self._newest) if self.in_flight else None
            self._ahead[step] = self._executor.submit(sample_request, side.engine, request, version, newest,
                                                      side.episodes)

    def before_weight_change(self, version: int) -> None:
        """Called before the engines are sent weight version `version`. One request at a time: wait
        for it, so that it ran under one version. Several in flight: let them run on (the push
        freezes them), from now on tagged as possibly sampled by `version` too."""
        if self.in_flight:
            self._newest = version
        else:
            self.settle()

    def settle(self) -> None:
        """Wait until no request runs: the weights may change only between requests (an
        engine error is raised here, on the trainer's thread)."""
        for step, ahead in list(self._ahead.items()):
            if isinstance(ahead, Future):
                self._ahead[step] = ahead.result()

    def pending(self) -> list[Sampled]:
        """The rollouts sampled ahead, in step order, once no request runs."""
        self.settle()
        return [self._ahead[step] for step in sorted(self._ahead)]  # type: ignore[misc]

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)


def open_pipeline(side: StudentSide, checkpoint: Path | None, step: int = 0) -> RolloutPipeline:
    """The run's pipeline at step `step` (the engines hold its weights), holding the rollouts a
    resumed checkpoint had sampled ahead; said once on stderr when k >= 1 cannot overlap (an
    in-process engine)."""
    cfg = side.config
    k = cfg.rollout.max_staleness
    background = k > 0 and side.engine.samples_in_background
    if k > 0 and not background and side.world.is_main:
        print(f"selfopd: rollout.max_staleness = {k} with engine.kind = {cfg.engine.kind!r}: each step trains on "
              f"rollouts sampled {k} step{'s' if k > 1 else ''} earlier, in the trainer's process, so sampling does "
              "not overlap training", file=sys.stderr)
    pending = load_pending(side, checkpoint) if checkpoint is not None else {}
    return RolloutPipeline(k, background, pending, version=step, in_flight=cfg.rollout.in_flight)


def pending_json(pipeline: RolloutPipeline, world: World) -> str | None:
    """The rollouts sampled ahead of this step, every rank's, as `PENDING_FILE`'s text (rank 0;
    None elsewhere, or when none are). Every rank must call it: the shares are gathered."""
    batches = pipeline.pending()
    gathered = all_gather([[asdict(r) for group in b.groups for r in group] for b in batches], world)
    if not world.is_main or not batches:
        return None
    saved = [{"step": b.request.step, "version": b.version, "rollouts": [r for part in gathered for r in part[index]]}
             for index, b in enumerate(batches)]
    return json.dumps({"max_staleness": pipeline.max_staleness, "batches": saved})


def load_pending(side: StudentSide, checkpoint: Path) -> dict[int, Sampled]:
    """This rank's share of the rollouts `checkpoint` had sampled ahead, checked against the
    prompts its steps ask for now (another data split or template would train on rollouts of
    other prompts)."""
    path = checkpoint / PENDING_FILE
    if not path.exists():
        return {}
    saved = json.loads(path.read_text())
    pending: dict[int, Sampled] = {}
    n = side.config.rollout.samples_per_prompt
    for batch in saved["batches"]:
        request = request_for_step(side, batch["step"])
        start = request.first_group * n
        rollouts = [Rollout(**r) for r in batch["rollouts"][start : start + len(request.prompts) * n]]
        groups = [rollouts[i * n : (i + 1) * n] for i in range(len(request.prompts))]
        for prompt, group in zip(request.prompts, groups):
            if len(group) != n or any(r.prompt_ids != prompt for r in group):
                raise ValueError(f"{path}: the rollouts sampled ahead for step {batch['step']} are not of the prompts "
                                 "that step asks for now (the data, template or rollout settings changed since the "
                                 "checkpoint): resume with the run's own config.toml and templates")
        pending[batch["step"]] = Sampled(request, groups, batch["version"])
    return pending

