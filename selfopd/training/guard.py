"""The illusion guard: does a run's recent record look like a teacher whose signal turned
into an illusion? Three conditions over the last `guard.window` training steps, each
comparing the window's first half with its second (config: `[guard]`, `GuardConfig`):

    kl_and_accuracy_fall  the sampled reverse KL falls while training-sample accuracy falls:
                          the student gets closer to a teacher that makes it worse
    length_cap            answers run into rollout.max_tokens more and more (high, and rising by
                          more than the noise of the window's prompts)
    teacher_prefers_wrong the teacher's signal, pooled over the window's prompt groups with
                          right and wrong samples, does not favour the right ones

The decision is a pure function of the run's metrics lines so far (what metrics.jsonl
holds), so a resumed run, whose metrics.jsonl is cut back to its checkpoint, decides
exactly as an uninterrupted one, and `replay(run_dir)` gives the same events offline. A
condition fires at its onset only (it holds at this step and did not at the previous one),
so a run that goes on after a warning, or is resumed after a stop, is not stopped again for
the same episode. It applies only while the teacher term is trained on (loss.lambda_opd > 0).
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

from selfopd.core.atomic import write_json_atomic, write_text_atomic
from selfopd.config import GuardConfig, TrainConfig, load_config
from selfopd.core.run_folder import RunFolder
from selfopd.core.stats import Z_95

FIRED = "guard/fired"  # the metrics field that marks a step where conditions fired (their names)
PREFERENCE_KEYS = ("opd/correct_preference_groups", "opd/correct_preference_sum", "opd/correct_preference_sumsq")


@dataclass(frozen=True)
class GuardEvent:
    """One condition's onset: the step, the condition, a sentence, and the numbers behind it."""

    step: int
    condition: str
    reason: str
    numbers: dict[str, float]


def applies(config: TrainConfig) -> bool:
    """The guard watches a run only when it is on and the teacher term is trained on."""
    return config.guard.action != "off" and config.loss.lambda_opd > 0


def training_lines(lines: Sequence[dict]) -> list[dict]:
    """The training-step lines of a metrics log (eval lines dropped), in order."""
    return [line for line in lines if "opd/reverse_kl" in line]


def check(history: Sequence[dict], guard: GuardConfig, prompts_per_step: int) -> list[GuardEvent]:
    """The conditions that fire at the last step of `history` (training-step metrics lines,
    oldest first): those that hold over the window ending there and did not over the window
    ending one step before. `prompts_per_step` (rollout.prompts_per_step): the units of the
    length cap's noise."""
    now = _holding(history, guard, prompts_per_step)
    before = _holding(history[:-1], guard, prompts_per_step)
    return [event for event in now if event.condition not in {e.condition for e in before}]


def replay(run_dir: str | Path, overrides: Sequence[str] = ()) -> list[GuardEvent]:
    """Every event the guard gives on a run folder's metrics, step by step, with the run's
    own config and `--set`-style `overrides` (a run made before the guard existed gets the
    defaults), whatever its guard.action was. Steps logged without the teacher-prefers-correct
    sums take them from the saved rollouts, when saved."""
    folder = RunFolder(run_dir)
    config = load_config(folder.config, overrides)
    if config.loss.lambda_opd <= 0:
        return []
    from selfopd.core.plots import read_metrics

    return events([_with_preference(line, folder) for line in training_lines(read_metrics(folder.metrics))],
                  config.guard, config.rollout.prompts_per_step)


def events(history: Sequence[dict], guard: GuardConfig, prompts_per_step: int) -> list[GuardEvent]:
    """Every event over a run's training-step lines: `check` at each step in turn."""
    return [event for end in range(1, len(history) + 1) for event in check(history[:end], guard, prompts_per_step)]


def write_events(run_dir: str | Path, events: Sequence[GuardEvent]) -> None:
    """RUN/guard.json (every event, with its numbers) and RUN/guard.md (one line each),
    each written whole."""
    folder = RunFolder(run_dir)
    write_json_atomic(folder.guard_events, [asdict(event) for event in events])
    lines = ["# Illusion guard", ""] + [f"- step {e.step}, `{e.condition}`: {e.reason}" for e in events]
    write_text_atomic(folder.guard_notes, "\n".join(lines) + "\n")


def watch(folder: RunFolder, config: TrainConfig, history: list[dict], metrics: dict) -> list[GuardEvent]:
    """The guard after a training step (the trainer's rank 0): append the step's `metrics` to
    `history` and decide; when conditions fire, mark the step's metrics (`guard/fired`), write
    RUN/guard.json and RUN/guard.md, and print one line. Returns what fired."""
    if not applies(config):
        return []
    history.append(metrics)
    fired = check(history, config.guard, config.rollout.prompts_per_step)
    if fired:
        metrics[FIRED] = [event.condition for event in fired]
        write_events(folder.root, events(history, config.guard, config.rollout.prompts_per_step))
        step = int(metrics["step"])
        where = f"checkpoint {folder.checkpoint(step)}, {folder.guard_notes}"
        print(f"selfopd: guard: step {step}: {_why(fired)} ({where})", file=sys.stderr)
    return fired


def stop_message(folder: RunFolder, step: int, fired: Sequence[GuardEvent]) -> str:
    """The one line a run the guard stopped ends with: why, where its checkpoint is, how to go on."""
    return (f"the illusion guard stopped the run after step {step} (guard.action = 'stop'): {_why(fired)}. "
            f"Checkpoint: {folder.checkpoint(step)}; details: {folder.guard_notes}. To go on anyway: selfopd train "
            f"--resume {folder.root} --set guard.action=warn (or off)")


def _why(fired: Sequence[GuardEvent]) -> str:
    return "; ".join(f"{event.condition}: {event.reason}" for event in fired)


def fired_steps(run_dir: str | Path) -> set[int]:
    """Steps at which the guard fired (their checkpoints are kept), from RUN/guard.json."""
    path = RunFolder(run_dir).guard_events
    return {int(event["step"]) for event in json.loads(path.read_text())} if path.is_file() else set()


def _holding(history: Sequence[dict], guard: GuardConfig, prompts_per_step: int) -> list[GuardEvent]:
    """Every condition that holds over the last `guard.window` lines (none before a full window)."""
    if len(history) < guard.window:
        return []
    window = history[-guard.window:]
    half = guard.window // 2
    first, second = window[:half], window[-half:]
    step = int(window[-1]["step"])
    events = []

    kl = _mean(first, "opd/reverse_kl"), _mean(second, "opd/reverse_kl")
    accuracy = _mean(first, "reward/accuracy"), _mean(second, "reward/accuracy")
    if kl[1] <= kl[0] - guard.kl_drop and accuracy[1] <= accuracy[0] - guard.accuracy_drop:
        events.append(GuardEvent(
            step, "kl_and_accuracy_fall",
            f"over steps {window[0]['step']}-{step} the reverse KL fell {kl[0]:.3f} -> {kl[1]:.3f} while "
            f"training accuracy fell {accuracy[0]:.3f} -> {accuracy[1]:.3f}: the student is getting closer to a "
            "teacher that makes it worse",
            {"kl_first_half": kl[0], "kl_second_half": kl[1],
             "accuracy_first_half": accuracy[0], "accuracy_second_half": accuracy[1]}))

    truncated = _mean(first, "rollout/truncated_share"), _mean(second, "rollout/truncated_share")
    rise_z = _rise_z(*truncated, units=half * prompts_per_step)
    if (truncated[1] >= guard.truncated_share and truncated[1] >= truncated[0] + guard.truncated_rise
            and rise_z >= guard.truncated_z):
        events.append(GuardEvent(
            step, "length_cap",
            f"over steps {window[0]['step']}-{step} the share of answers cut off at the length cap rose "
            f"{truncated[0]:.2f} -> {truncated[1]:.2f} ({rise_z:.1f} standard errors over {half * prompts_per_step} "
            "prompts a half): the teacher asks for answers that do not fit",
            {"truncated_first_half": truncated[0], "truncated_second_half": truncated[1], "rise_z": rise_z}))

    groups, mean, high = _pooled_preference(window)
    if groups >= guard.preference_groups and high <= guard.preference_max:
        events.append(GuardEvent(
            step, "teacher_prefers_wrong",
            f"over steps {window[0]['step']}-{step} the teacher's signal on correct minus wrong samples of a "
            f"prompt is {mean:+.3f} (95% upper bound {high:+.3f}, {groups} prompt groups): it pushes toward wrong "
            "answers at least as hard as toward right ones",
            {"preference": mean, "preference_high": high, "groups": float(groups)}))
    return events


def _rise_z(first: float, second: float, units: int) -> float:
    """(second - first) over the standard error of a difference of two shares of `units` each
    (pooled share): the prompts are the units, since a prompt's samples share its length."""
    pooled = (first + second) / 2
    variance = pooled * (1 - pooled) * 2 / max(units, 1)
    if variance <= 0 or math.isnan(variance):
        return math.inf if second > first else (0.0 if second == first else -math.inf)
    return (second - first) / math.sqrt(variance)


def _mean(lines: Sequence[dict], key: str) -> float:
    """Mean of a field over lines; nan when a line lacks it (a condition on nan never holds)."""
    values = [line.get(key) for line in lines]
    if any(v is None for v in values):
        return math.nan
    return sum(values) / len(values)


def _pooled_preference(window: Sequence[dict]) -> tuple[int, float, float]:
    """(groups, mean, 95% upper bound) of the per-group contrasts of every step in the window,
    from each step's sums (normal interval over groups; nan bound with fewer than 2)."""
    n = total = squares = 0.0
    for line in window:
        if any(line.get(key) is None for key in PREFERENCE_KEYS):
            return 0, math.nan, math.nan
        n += line[PREFERENCE_KEYS[0]]
        total += line[PREFERENCE_KEYS[1]]
        squares += line[PREFERENCE_KEYS[2]]
    if n < 2:
        return int(n), (total / n if n else math.nan), math.nan
    mean = total / n
    variance = max(squares - n * mean * mean, 0.0) / (n - 1)
    return int(n), mean, mean + Z_95 * math.sqrt(variance / n)


def _with_preference(line: dict, folder: RunFolder) -> dict:
    """A step's line with the teacher-prefers-correct sums, taken from its saved rollouts when
    the line predates them (unchanged when it has them or nothing was saved)."""
    path = folder.rollouts_file(int(line["step"]))
    if all(key in line for key in PREFERENCE_KEYS) or not path.is_file():
        return line
    from selfopd.run.rollouts import read_records
    from selfopd.training.loss_metrics import preference_metrics

    records = [r for r in read_records(path) if r.completion_ids]
    return {**line, **preference_metrics((r.group, bool(r.correct), r.opd_mean) for r in records)}
