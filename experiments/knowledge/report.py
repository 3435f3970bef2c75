"""The knowledge study's report (PREREGISTRATION.md): every pre-registered number, from the runs.

    python -m experiments.knowledge.report                       # runs/knowledge, restored from the archive
    python -m experiments.knowledge.report --out-dir experiments/knowledge/results

Reads the grid, the shuffled-sheet control, the 3x-steps runs and the SFT arms under --runs (the
finished runs the study's archive holds are copied back first, so it works on a fresh clone),
and writes knowledge_report.md, knowledge_summary.json and knowledge_accuracy.png. A run still
missing is said, never guessed: the report can be written at any point of the study.
"""

from __future__ import annotations

import argparse
import json
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from experiments.knowledge import run as study
from selfopd.comparisons.compare import CompareConfig
from selfopd.comparisons.compare_report import ArmResult, measure_comparison
from selfopd.comparisons.records import TIMING, restore_runs
from selfopd.core.atomic import write_json_atomic, write_text_atomic
from selfopd.core.plots import decorate, new_figure, save_figure
from selfopd.diagnostics.measures import as_jsonable
from selfopd.diagnostics.transfer import NothingToTransfer, read_transfer_rows, transfer
from selfopd.core.stats import PairedDifference, mean_interval, pooled_accuracy, pooled_change
from selfopd.config import load_config
from selfopd.core.run_folder import RunFolder
from selfopd.data import load_examples
from selfopd.data.example import prompt_key
from selfopd.run.evaluate import read_eval_outcomes
from selfopd.training.guard import replay

Outcomes = dict[str, list[bool]]


@dataclass
class Arm:
    """One arm over the seeds that have finished: what each pre-registered measure reads."""

    name: str
    held_out: dict[int, Outcomes] = field(default_factory=dict)  # seed -> split (b) at the end
    arithmetic: dict[int, Outcomes] = field(default_factory=dict)  # the start model's skill after training
    unseen: dict[int, Outcomes] = field(default_factory=dict)  # split (c)
    fresh: dict[int, Outcomes] = field(default_factory=dict)  # the trained facts in fresh phrasings
    drift: dict[int, dict[str, float]] = field(default_factory=dict)  # seed -> prompt -> KL per token
    tokens: dict[int, float] = field(default_factory=dict)  # trained completion tokens
    curve: list[tuple[int, float, float]] = field(default_factory=list)  # (step, generated tokens, accuracy)

    @property
    def seeds(self) -> list[int]:
        return sorted(self.held_out)


def read_retention(arm: Arm, seed: int, run_dir: Path) -> None:
    target = run_dir / "retention"
    for name in ("arithmetic", "unseen", "fresh"):
        if (target / name / "eval.jsonl").is_file():
            getattr(arm, name)[seed] = read_eval_outcomes(target / name)
    if (target / "drift" / "summary.json").is_file():
        arm.drift[seed] = json.loads((target / "drift" / "summary.json").read_text())["per_prompt"]


def grid_arms(config: CompareConfig, rename: dict[str, str] | None = None,
              only_prompts: set[str] | None = None) -> tuple[dict[str, Arm], list[ArmResult]]:
    """The finished runs of one grid, by arm (renamed by `rename`); `only_prompts`: the held-out
    outcomes of those prompt keys alone (a mixture's knowledge task; its curve is then left out)."""
    results = measure_comparison(config)
    arms = {}
    for result in results:
        arm = Arm((rename or {}).get(result.name, result.name))
        for run in result.per_seed:
            if not run.finished:
                continue
            final = run.final if only_prompts is None else {k: v for k, v in run.final.items() if k in only_prompts}
            arm.held_out[run.seed] = final
            arm.tokens[run.seed] = run.generated_tokens
            read_retention(arm, run.seed, config.arm_dir(result.name, run.seed))
        if only_prompts is None:
            arm.curve = [(p.step, p.generated_tokens, p.accuracy) for p in result.curve]
        if arm.held_out:
            arms[arm.name] = arm
    return arms, results


def sft_arms(out: Path) -> dict[str, Arm]:
    arms = {}
    for name in study.SFT_ARMS:
        arm = Arm(name)
        for seed in study.SEEDS:
            run_dir = out / "sft" / f"{name}_seed{seed}"
            if not (run_dir / "eval" / "tuned" / "eval.jsonl").is_file():
                continue
            summary = json.loads((run_dir / "summary.json").read_text())
            arm.held_out[seed] = read_eval_outcomes(run_dir / "eval" / "tuned")
            epochs = tomllib.loads((run_dir / "config.toml").read_text())["sft"]["epochs"]
            arm.tokens[seed] = summary["train_tokens"] * epochs  # train_tokens: one pass over the targets
            read_retention(arm, seed, run_dir)
        if arm.held_out:
            arms[name] = arm
    return arms


def paired(before: dict[int, Outcomes], after: dict[int, Outcomes], level: float = 0.95) -> PairedDifference | None:
    """after - before, paired by prompt and seed, over the seeds both hold."""
    seeds = sorted(set(before) & set(after))
    return pooled_change([(before[s], after[s]) for s in seeds], level) if seeds else None


def against_start(start: Outcomes, after: dict[int, Outcomes]) -> PairedDifference | None:
    return pooled_change([(start, after[s]) for s in sorted(after)]) if after else None


def pooled(outcomes: dict[int, Outcomes]):
    return pooled_accuracy([outcomes[s] for s in sorted(outcomes)]) if outcomes else None


def pooled_drift(drift: dict[int, dict[str, float]]):
    """Each prompt's KL averaged over the seeds, then a mean with its interval over prompts."""
    if not drift:
        return None
    prompts = sorted(set.intersection(*(set(d) for d in drift.values())))
    return mean_interval([float(np.mean([d[p] for d in drift.values()])) for p in prompts], unit_range=False)


def _fmt(value, signed: bool = False) -> str:
    if value is None:
        return "not yet run"
    if isinstance(value, PairedDifference):
        return f"{value.mean:+.3f} [{value.low:+.3f}, {value.high:+.3f}]"
    number = getattr(value, "value", value)
    sign = "+" if signed else ""
    return f"{number:{sign}.3f} [{value.low:{sign}.3f}, {value.high:{sign}.3f}]"


def _difference(a, b) -> str:
    """Of two accuracies on different prompts (no pairing, so no interval)."""
    return "not yet run" if a is None or b is None else f"{a.value - b.value:+.3f}"


def _estimate(value: dict | None) -> str:
    """An estimate stored as JSON ({value, low, high, n}), with its n."""
    if not value:
        return "no prompt with right and wrong samples"
    return f"{value['value']:+.3f} [{value['low']:+.3f}, {value['high']:+.3f}] (n={value['n']})"


def _transfer(value: dict | None) -> str:
    if not value:
        return "not measured"
    if "not_measured" in value:
        return "not measured: " + value["not_measured"].split(": ")[-1]
    ratio, held, trained = value["ratio"], value["held_out"], value["trained"]
    if trained["low"] <= 0:  # no gap closed on the training prompts: the ratio is not read
        return f"none to measure ({held['value']:.2f} / {trained['value']:.2f})"
    return (f"{ratio['value']:.2f} [{ratio['low']:.2f}, {ratio['high']:.2f}] "
            f"({held['value']:.2f} / {trained['value']:.2f})")


def _tokens(value: float | None) -> str:
    return "" if value is None else f"{value:,.0f}"


def _seeds(arm: Arm | None) -> str:
    return ", ".join(map(str, arm.seeds)) if arm else "-"


def guard_events(run_dir: Path) -> list[str]:
    """The guard's events replayed on the run's metrics with today's rule (runs trained before the
    length cap's noise test logged events it no longer gives)."""
    if not (run_dir / "metrics.jsonl").is_file():
        return []
    return [f"{event.condition}@{event.step}" for event in replay(run_dir)]


def transfer_at_least_doubled(rows: Path) -> dict | None:
    """Amendment 5 (exploratory): the transfer over the prompts whose context at least doubles the
    reference answer's probability (a gap of ln 2 nats or more), from the diagnosis's rows."""
    if not rows.is_file():
        return None
    try:
        return as_jsonable(transfer(*read_transfer_rows(rows), min_gap=math.log(2)))
    except NothingToTransfer as error:
        return {"not_measured": str(error)}


def diagnosis_row(run_dir: Path) -> dict | None:
    path = run_dir / "diagnostics" / "summary.json"
    if not path.is_file():
        return None
    summary = json.loads(path.read_text())
    steps = sorted(summary["illusion"], key=int)
    first, last = summary["illusion"][steps[0]], summary["illusion"][steps[-1]]
    return {"lift_first": first["lift"], "lift_last": last["lift"], "warning_first": first["warning"],
            "warning_last": last["warning"], "transfer": summary.get("transfer"),
            "transfer_doubling": transfer_at_least_doubled(run_dir / "diagnostics" / "transfer.jsonl"),
            "prefers_correct": summary.get("teacher_prefers_correct"), "guard": guard_events(run_dir)}


def start_records(out: Path) -> Path:
    """The start run's folder: trained here, or its records as the archive keeps them (illusion/start)."""
    trained = out / "start"
    return trained if (trained / "retention").is_dir() else out / "illusion" / "start"


def measure(out: Path) -> dict:
    spec = load_config(study.CONFIG).data.spec
    grid = study.comparison(out, Path("start"), spec)
    shuffled_grid = study.comparison(out, Path("start"), spec, "knowledge_shuffled", only=(study.PRIMARY_OPD,))
    mixed = study.mixed_grid(out, Path("start"), spec)
    for config in (grid, shuffled_grid, mixed):
        restore_runs(config, study.ARCHIVE / config.name)
    for folder in ("sft", "illusion"):
        study.restore_folder(out, folder)
    arms, results = grid_arms(grid)
    arms |= grid_arms(shuffled_grid, {study.PRIMARY_OPD: "shuffled"})[0]
    knowledge_prompts = {prompt_key(e.prompt) for e in load_examples(f"{spec}&part=heldout")}
    arms |= grid_arms(mixed, {name: f"mixed_{name}" for name in ("grpo_only", study.PRIMARY_OPD)},
                      only_prompts=knowledge_prompts)[0]
    arms |= sft_arms(out)
    start_dir = start_records(out)
    start = {name: read_eval_outcomes(start_dir / "retention" / name) for name in ("arithmetic", "unseen", "fresh")
             if (start_dir / "retention" / name / "eval.jsonl").is_file()}
    reference = arms.get("grpo_only")
    rows = {}
    for name, arm in arms.items():
        row = {"seeds": arm.seeds, "held_out": pooled(arm.held_out), "unseen": pooled(arm.unseen),
               "fresh": pooled(arm.fresh),
               "arithmetic": pooled(arm.arithmetic), "drift": pooled_drift(arm.drift),
               "tokens": float(np.mean(list(arm.tokens.values()))) if arm.tokens else None}
        if reference is not None and name != "grpo_only":
            row["vs_grpo"] = paired(reference.held_out, arm.held_out)
            row["vs_grpo_99"] = paired(reference.held_out, arm.held_out, level=0.99)
        for sft in study.SFT_ARMS:
            if sft in arms and name not in study.SFT_ARMS:
                row[f"vs_{sft}"] = paired(arms[sft].held_out, arm.held_out)
        if "sft_gold" in arms and name != "sft_gold":
            row["arithmetic_vs_sft_gold"] = paired(arms["sft_gold"].arithmetic, arm.arithmetic)
        if "arithmetic" in start:
            row["arithmetic_vs_start"] = against_start(start["arithmetic"], arm.arithmetic)
        if "unseen" in start:
            row["unseen_vs_start"] = against_start(start["unseen"], arm.unseen)
        rows[name] = row
    for name in ("grpo_only", study.PRIMARY_OPD):  # the mixture against the same arm on this task alone
        if f"mixed_{name}" in arms and name in arms:
            rows[f"mixed_{name}"]["vs_single_task"] = paired(arms[name].held_out, arms[f"mixed_{name}"].held_out)
            rows[f"mixed_{name}"]["arithmetic_vs_single_task"] = paired(arms[name].arithmetic,
                                                                        arms[f"mixed_{name}"].arithmetic)
    if "shuffled" in arms and study.PRIMARY_OPD in arms:
        rows["shuffled"]["vs_" + study.PRIMARY_OPD] = paired(arms[study.PRIMARY_OPD].held_out, arms["shuffled"].held_out)
    diagnoses = {name: diagnosis_row(grid.arm_dir(name, 0)) for name in (a.name for a in grid.arms)}
    diagnoses["shuffled"] = diagnosis_row(shuffled_grid.arm_dir(study.PRIMARY_OPD, 0))
    diagnoses["demo task: answer note, full weight"] = diagnosis_row(out / "illusion" / "answer_note_full")
    diagnoses["demo task: the demo recipe (start)"] = diagnosis_row(out / "illusion" / "start")
    sft_steps = [json.loads(p.read_text())["steps"] for p in sorted((out / "sft").glob("*/summary.json"))]
    return {"arms": arms, "rows": rows, "start": start, "diagnoses": diagnoses, "results": results,
            "sft_steps": sft_steps[0] if sft_steps else None, "longer": measure_longer(out, spec, grid, arms, results),
            "time": study_time(out)}


def measure_longer(out: Path, spec: str, grid: CompareConfig, arms: dict[str, Arm],
                   results: list[ArmResult]) -> dict | None:
    """The best OPD arm at 3x the steps: its held-out (b) at the last step against the same runs'
    step 40, paired by prompt and seed, and whether those runs' step 40 repeats the grid's (same
    seeds, same data order, a constant lr)."""
    best = study.best_opd_arm(grid, results)
    if best is None:
        return None
    steps = load_config(study.CONFIG).run.steps
    config = study.comparison(out, Path("start"), spec, "knowledge_3x", only=(best,))
    restore_runs(config, study.ARCHIVE / config.name)
    at, last, same, longer = {}, {}, 0, Arm(best)
    for seed in study.SEEDS:
        folder = RunFolder(config.arm_dir(best, seed))
        if not folder.finished.is_file() or not (evals := folder.eval_steps()) or evals[-1] != 3 * steps:
            continue
        at[seed], last[seed] = (read_eval_outcomes(folder.eval_dir(step)) for step in (steps, 3 * steps))
        grid_final = arms[best].held_out.get(seed, {})
        same += sum(grid_final.get(key) == value for key, value in at[seed].items())
        read_retention(longer, seed, folder.root)
    shorter, gold = arms[best], arms.get("sft_gold")
    return {"arm": best, "steps": (steps, 3 * steps), "seeds": sorted(last),
            "at_steps": pooled(at), "at_3x": pooled(last), "change": paired(at, last),
            "same_as_grid": (same, sum(len(v) for v in at.values())),
            "arithmetic": pooled(longer.arithmetic), "arithmetic_change": paired(shorter.arithmetic, longer.arithmetic),
            "arithmetic_vs_sft_gold": paired(gold.arithmetic, longer.arithmetic) if gold else None,
            "drift": pooled_drift(longer.drift), "unseen": pooled(longer.unseen), "fresh": pooled(longer.fresh),
            "fresh_change": paired(shorter.fresh, longer.fresh)}


def verdicts(rows: dict) -> dict[str, dict]:
    """The pre-registered calls, per OPD arm: beats GRPO; not worse than SFT on forgetting."""
    calls = {}
    for name in (*study.OPD_ARMS, "shuffled"):
        row = rows.get(name, {})
        vs, forget = row.get("vs_grpo"), row.get("arithmetic_vs_sft_gold")
        calls[name] = {"beats_grpo": None if vs is None else vs.low > 0,
                       "beats_grpo_bonferroni": None if row.get("vs_grpo_99") is None else row["vs_grpo_99"].low > 0,
                       "not_worse_than_sft_on_forgetting": None if forget is None else forget.low >= -0.05}
    return calls


GRIDS = {"knowledge": "grid", "knowledge_shuffled": "shuffled", "knowledge_mixed": "mixed", "knowledge_3x": "3x steps"}


def study_time(out: Path) -> dict:
    """Wall seconds of what ran, per stage: each training run as timed (evals included), the gap
    after it until the next run finished minus that run's own time (its retention measures and
    diagnosis) where the two ran back to back, and the SFT runs' own totals. Runs that shared the
    machine or were paused are in the sums; the medians say what an idle machine takes."""
    stages = {}
    for grid, label in GRIDS.items():
        path = out / grid / TIMING
        rows = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
        runs = [r for r in rows if r["wall_seconds"] > 1]  # an arm restored from the archive logs 0 s
        after = [b["finished_at"] - a["finished_at"] - b["wall_seconds"] for a, b in zip(runs, runs[1:])]
        stages[label] = {"runs": len(runs), "seconds": [r["wall_seconds"] for r in runs],
                         "measures": [gap for gap in after if 0 < gap < 900]}  # longer: an interruption
    sft = [json.loads(p.read_text())["seconds"]["total"] for p in sorted((out / "sft").glob("*/summary.json"))]
    stages["sft"] = {"runs": len(sft), "seconds": sft, "measures": []}
    single = [sum(json.loads(line).get("time/step", 0.0) for line in (run / "metrics.jsonl").read_text().splitlines())
              for run in (start_records(out), out / "illusion" / "answer_note_full") if (run / "metrics.jsonl").is_file()]
    stages["start and illusion (steps only)"] = {"runs": len(single), "seconds": single, "measures": []}
    return stages


def _time_lines(stages: dict) -> list[str]:
    measures = [gap for stage in stages.values() for gap in stage["measures"]]
    per_run = float(np.median(measures)) if measures else 0.0
    lines = ["", "## Time", "", f"Each run's retention measures and seed-0 diagnosis after it: median {per_run / 60:.1f} "
             f"min (over {len(measures)} runs that ran back to back).", "",
             "| stage | runs | wall time as measured | median run | idle estimate with measures |", "|---|---|---|---|---|"]
    total = 0.0
    for label, stage in stages.items():
        if not stage["runs"]:
            continue
        median = float(np.median(stage["seconds"]))
        estimate = stage["runs"] * (median + per_run)
        total += estimate
        lines.append(f"| {label} | {stage['runs']} | {sum(stage['seconds']) / 3600:.2f} h | {median / 60:.1f} min | "
                     f"{estimate / 3600:.2f} h |")
    lines += ["", f"Idle-machine estimate of what has run: **{total / 3600:.1f} h** on 2 cores (the wall times as "
              "measured include time when the machine was shared or the study paused)."]
    return lines


FACT_SHEET_OPD = tuple(name for name in study.OPD_ARMS if name != "external_sft")
ANSWER_NOTE = "demo task: answer note, full weight"


def _ratio(row: dict | None, key: str = "transfer") -> tuple[float, float] | None:
    """The transfer ratio's interval, when the run closed a gap on its training prompts (else None)."""
    value = (row or {}).get(key) or {}
    if "ratio" not in value or value["trained"]["low"] <= 0:
        return None
    return value["ratio"]["low"], value["ratio"]["high"]


def regimes_told_apart(diagnoses: dict, learners: list[str]) -> dict | None:
    """Amendment 2's criterion: the transfer tells the regimes apart when every learning arm's ratio
    lies above 0.5 and the answer note's does not (below 0.5, or no gap closed on its training
    prompts); the answer-token lift, when it warns on the answer note and on no learning arm."""
    note = diagnoses.get(ANSWER_NOTE)
    if note is None or any(diagnoses.get(name) is None for name in learners):
        return None
    note_ratio = _ratio(note)
    return {"learners": learners,
            "transfer": all(credited(diagnoses[name], "transfer") for name in learners)
            and (note_ratio is None or note_ratio[1] < 0.5),
            "lift": bool(note["warning_last"]) and not any(diagnoses[name]["warning_last"] for name in learners)}


def credited(row: dict | None, key: str) -> bool | None:
    """Whether a transfer credits the run with learned information (its ratio's interval above 0.5);
    None without a diagnosis or the rows that transfer needs."""
    if row is None or not row.get(key):
        return None
    return (ratio := _ratio(row, key)) is not None and ratio[0] > 0.5


def doubling_line(diagnoses: dict) -> list[str]:
    """Amendment 5's reading: the transfer over prompts whose context at least doubles the answer's
    probability should credit the arm that learns the facts and neither the answer note nor the
    wrong sheet."""
    calls = {name: credited(diagnoses.get(name), "transfer_doubling") for name in ("external_sft", ANSWER_NOTE, "shuffled")}
    if None in calls.values():
        return []
    said = {True: "credits", False: "does not credit"}
    apart = calls["external_sft"] and not calls[ANSWER_NOTE] and not calls["shuffled"]
    return ["", f"Amendment 5 (exploratory): the transfer where the context doubles the answer's probability "
            f"{said[calls['external_sft']]} `external_sft`, {said[calls[ANSWER_NOTE]]} the answer note at full weight and "
            f"{said[calls['shuffled']]} the shuffled sheet: it tells learnable information from the rest: "
            f"**{'yes' if apart else 'no'}**."]


def recipe_call(calls: dict, longer: dict | None) -> str:
    """The pre-registered recipe rule: beats GRPO, not worse than SFT on forgetting, and no lower at
    3x the steps than at 1x (the paired interval's upper end at or above 0)."""
    undecided = [name for name in study.OPD_ARMS if calls[name]["beats_grpo"] is None
                 or (calls[name]["beats_grpo"] and calls[name]["not_worse_than_sft_on_forgetting"] is None)]
    qualifying = [name for name in study.OPD_ARMS
                  if calls[name]["beats_grpo"] and calls[name]["not_worse_than_sft_on_forgetting"]]
    if undecided:
        return f"Recipe: not decided until {', '.join(undecided)} {'has' if len(undecided) == 1 else 'have'} every measure."
    if not qualifying:
        return ("**No recipe is shipped:** no OPD arm both beats GRPO alone and is not worse than SFT on "
                "forgetting.")
    if longer is None or longer["change"] is None:
        return f"Recipe: waits for the 3x-steps runs ({', '.join(qualifying)} qualify so far)."
    if longer["arm"] in qualifying and longer["change"].high >= 0:
        return f"**Recipe: `{longer['arm']}`**: beats GRPO, not worse than SFT on forgetting, holds at 3x the steps."
    return f"**No recipe is shipped:** `{longer['arm']}` at 3x the steps: {_fmt(longer['change'])}."


def render(measured: dict, figure: Path | None) -> str:
    rows, arms, start = measured["rows"], measured["arms"], measured["start"]
    calls = verdicts(rows)
    order = ["grpo_only", *study.OPD_ARMS, "shuffled", *study.SFT_ARMS, "mixed_grpo_only", f"mixed_{study.PRIMARY_OPD}"]
    lines = ["# Where privileged information is learnable: the knowledge study", "",
             "Pre-registered in `experiments/knowledge/PREREGISTRATION.md`; every number below is read from the runs by "
             "`python -m experiments.knowledge.report`. Task `kb:countries?entities=8&unseen=4`. Held out (b): 64 "
             "distinct prompts, the 2 phrasings of each of the 32 trained facts that no run trains on. Split (c): 96 "
             "distinct prompts about 4 countries no run sees. Arithmetic: the demo's 200 held-out sums. Intervals are "
             "95% over prompts x seeds (pooled over the seeds listed).", ""]
    if "arithmetic" in start:
        lines += [f"Start model (the demo recipe, 24 steps): arithmetic {_fmt(pooled({0: start['arithmetic']}))}, "
                  f"split (c) {_fmt(pooled({0: start['unseen']})) if 'unseen' in start else 'not measured'}, "
                  f"fresh phrasings {_fmt(pooled({0: start['fresh']})) if 'fresh' in start else 'not measured'}.", ""]
    lines += ["## Primary: held-out accuracy (b) at the last step vs GRPO alone", "",
              "| arm | seeds | held-out (b) | vs grpo_only [95%] | [99%] | beats GRPO | trained tokens |",
              "|---|---|---|---|---|---|---:|"]
    for name in order:
        if name not in rows:
            lines.append(f"| `{name}` | - | not yet run | | | | |")
            continue
        row = rows[name]
        call = calls.get(name, {}).get("beats_grpo")
        lines.append(f"| `{name}` | {_seeds(arms[name])} | {_fmt(row['held_out'])} | "
                     f"{'(reference)' if name == 'grpo_only' else _fmt(row.get('vs_grpo'))} | "
                     f"{'' if name == 'grpo_only' else _fmt(row.get('vs_grpo_99'))} | "
                     f"{'' if call is None else 'yes' if call else 'no'} | "
                     f"{_tokens(row['tokens'])} |")
    lines += ["", "## Forgetting and split (c)", "",
              "| arm | arithmetic after | vs start | vs sft_gold | drift KL(trained \\|\\| start) per token | split (c) "
              "| split (c) vs start | (b) - (c) | fresh phrasings of trained facts |",
              "|---|---|---|---|---|---|---|---|---|"]
    for name in order:
        if name in rows:
            row = rows[name]
            lines.append(f"| `{name}` | {_fmt(row['arithmetic'])} | {_fmt(row.get('arithmetic_vs_start'))} | "
                         f"{_fmt(row.get('arithmetic_vs_sft_gold')) if name != 'sft_gold' else '(reference)'} | "
                         f"{_fmt(row['drift'])} | {_fmt(row['unseen'])} | {_fmt(row.get('unseen_vs_start'))} | "
                         f"{_difference(row['held_out'], row['unseen'])} | {_fmt(row['fresh'])} |")
    lines += ["", "## Against SFT at matched tokens", "", "| arm | vs sft_gold | vs sft_teacher |", "|---|---|---|"]
    for name in (*study.OPD_ARMS, "shuffled", "grpo_only"):
        if name in rows:
            lines.append(f"| `{name}` | {_fmt(rows[name].get('vs_sft_gold'))} | {_fmt(rows[name].get('vs_sft_teacher'))} |")
    if "shuffled" in rows:
        lines += ["", f"Shuffled-sheet control minus `{study.PRIMARY_OPD}` on (b): "
                  f"{_fmt(rows['shuffled'].get('vs_' + study.PRIMARY_OPD))}."]
    mixed = [name for name in rows if name.startswith("mixed_")]
    if mixed:
        lines += ["", "## Mixed with the demo's task (exploratory, amendment 1)", "",
                  "| arm | held-out (b) vs the same arm alone | arithmetic vs the same arm alone |", "|---|---|---|"]
        lines += [f"| `{name}` | {_fmt(rows[name].get('vs_single_task'))} | "
                  f"{_fmt(rows[name].get('arithmetic_vs_single_task'))} |" for name in mixed]
    lines += ["", "## The illusion diagnostics (seed 0)", "",
              "| arm | answer-token lift first -> last (warns at 1.5) | teacher prefers correct | guard events | "
              "transfer: held-out / trained closure | the same where the context doubles the answer's probability "
              "(exploratory) | beats GRPO |",
              "|---|---|---|---|---|---|---|"]
    for name, row in measured["diagnoses"].items():
        if row is None:
            continue
        prefers = row["prefers_correct"]
        call = calls.get(name, {}).get("beats_grpo")
        lines.append(f"| `{name}` | {row['lift_first']:.2f}{' (warns)' if row['warning_first'] else ''} -> "
                     f"{row['lift_last']:.2f}{' (warns)' if row['warning_last'] else ''} | "
                     f"{_estimate(prefers)} | "
                     f"{', '.join(row['guard']) or 'none'} | {_transfer(row['transfer'])} | "
                     f"{_transfer(row['transfer_doubling']) if row['transfer_doubling'] else 'no rows kept'} | "
                     f"{'' if call is None else 'yes' if call else 'no'} |")
    told = regimes_told_apart(measured["diagnoses"], [n for n in FACT_SHEET_OPD if calls.get(n, {}).get("beats_grpo")])
    if told is not None and not told["learners"]:
        note = measured["diagnoses"][ANSWER_NOTE]
        lines += ["", "Amendment 2's criterion, the answer note at full weight against the fact-sheet OPD arms that "
                  "beat GRPO: **not decided**, no fact-sheet arm beats GRPO, so it has no learning arm to test. On the "
                  f"answer note alone: the transfer {'credits it' if _ratio(note) and _ratio(note)[0] > 0.5 else 'does not credit it'}"
                  f", the lift {'warns' if note['warning_last'] else 'does not warn'}."]
    elif told is not None:
        lines += ["", "Amendment 2's criterion, the answer note at full weight against the fact-sheet OPD arms that "
                  f"beat GRPO: the transfer tells the regimes apart: **{'yes' if told['transfer'] else 'no'}**; "
                  f"the answer-token lift: **{'yes' if told['lift'] else 'no'}**."]
    if (outside := regimes_told_apart(measured["diagnoses"], ["external_sft"])) is not None:
        lines += ["", "Exploratory, the same criterion with `external_sft` (the arm that learns the facts, from a "
                  "teacher that stores them) as the learning arm: the transfer "
                  f"**{'yes' if outside['transfer'] else 'no'}**, the lift **{'yes' if outside['lift'] else 'no'}**."]
    lines += doubling_line(measured["diagnoses"])
    if figure is not None:
        lines += ["", f"![held-out accuracy against steps and generated tokens]({figure.name})"]
    longer = measured["longer"]
    if longer is not None and longer["seeds"]:
        first, last = longer["steps"]
        same, of = longer["same_as_grid"]
        lines += ["", f"## 3x the steps: `{longer['arm']}`, {last} steps", "",
                  f"Seeds {', '.join(map(str, longer['seeds']))}; held-out (b) at step {first} "
                  f"{_fmt(longer['at_steps'])}, at step {last} {_fmt(longer['at_3x'])}; change "
                  f"{_fmt(longer['change'])} (paired by prompt and seed). At step {first} these runs give the grid's "
                  f"outcome on {same} of {of} prompt x seed pairs.", "",
                  f"| at step {last} | value | against the same arm at step {first} |", "|---|---|---|",
                  f"| arithmetic (start 0.640) | {_fmt(longer['arithmetic'])} | {_fmt(longer['arithmetic_change'])} |",
                  f"| arithmetic minus `sft_gold`'s | {_fmt(longer['arithmetic_vs_sft_gold'])} | |",
                  f"| fresh phrasings of trained facts | {_fmt(longer['fresh'])} | {_fmt(longer['fresh_change'])} |",
                  f"| split (c) | {_fmt(longer['unseen'])} | |",
                  f"| drift KL(trained \\|\\| start) per token | {_fmt(longer['drift'])} | |"]
    lines += ["", "## Verdicts", ""]
    for name, call in calls.items():
        if call["beats_grpo"] is not None:
            lines.append(f"- `{name}`: beats GRPO: {'yes' if call['beats_grpo'] else 'no'}"
                         f" (with a Bonferroni 99% interval: {'yes' if call['beats_grpo_bonferroni'] else 'no'}); "
                         f"not worse than SFT on forgetting: "
                         f"{'not yet measured' if call['not_worse_than_sft_on_forgetting'] is None else 'yes' if call['not_worse_than_sft_on_forgetting'] else 'no'}.")
    lines += ["", recipe_call(calls, longer)]
    lines += _time_lines(measured["time"])
    return "\n".join(lines) + "\n"


def plot(measured: dict, path: Path) -> Path | None:
    arms = [a for a in measured["arms"].values() if a.curve]
    if not arms:
        return None
    figure = new_figure(2, "kb:countries, held-out (b), mean over seeds")
    by_step, by_tokens = figure.axes
    for index, arm in enumerate(arms):
        steps, tokens, accuracy = zip(*arm.curve)
        by_step.plot(steps, accuracy, marker="o", color=f"C{index}", label=arm.name)
        by_tokens.plot(tokens, accuracy, marker="o", color=f"C{index}", label=arm.name)
    for index, name in enumerate(study.SFT_ARMS, start=len(arms)):  # no sampling: a point at its optimizer steps
        if (arm := measured["arms"].get(name)) is not None:
            by_step.scatter([measured["sft_steps"]], [pooled(arm.held_out).value], marker="*", s=160,
                            color=f"C{index}", label=f"{name} (after its {measured['sft_steps']} SFT steps)")
    decorate(by_step, "Accuracy against steps", "held-out accuracy (b)")
    decorate(by_tokens, "Accuracy against generated tokens", "held-out accuracy (b)", xlabel="student tokens sampled")
    by_step.legend(fontsize=8)
    return save_figure(figure, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=Path, default=study.ROOT / "runs" / "knowledge")
    parser.add_argument("--out-dir", type=Path, default=study.ROOT / "runs" / "knowledge" / "report")
    args = parser.parse_args()
    measured = measure(args.runs.resolve())
    args.out_dir.mkdir(parents=True, exist_ok=True)
    figure = plot(measured, args.out_dir / "knowledge_accuracy.png")
    report = write_text_atomic(args.out_dir / "knowledge_report.md", render(measured, figure))
    write_json_atomic(args.out_dir / "knowledge_summary.json",
                      {"rows": as_jsonable(measured["rows"]), "verdicts": verdicts(measured["rows"]),
                       "diagnoses": measured["diagnoses"], "longer": as_jsonable(measured["longer"])})
    print(f"wrote {report}")


if __name__ == "__main__":
    main()
