"""The pre-registered cures comparison (experiments/cures/PREREGISTRATION.md), stage by stage.

    python -m experiments.cures.run                    # every stage, in order; rerun to resume
    python -m experiments.cures.run --stage select     # or one: select, compare, fresh, longer, diagnose

    python -m experiments.cures.run --task sparse      # only one task's comparison (demo or sparse)

Stages:
  select    the sparse task: base accuracy and a GRPO pilot (seed 100) per candidate, in order
  compare   both tasks x 7 arms x seeds 0-2 (`selfopd compare`'s runner: finished runs are skipped)
  fresh     each run's final weights on 200 fresh prompts of its task (`selfopd eval --fresh`)
  longer    the best cure and grpo_only at 3x the steps, on the task where the cure did best
  diagnose  `selfopd diagnose` on each arm's seed-0 run (answer-token lift, wrong-context contrast)

Runs are written under --out (default runs/cures). The fresh eval and the seed-0 diagnosis
of a run happen as soon as it finishes (they need its final weights, which the next runs'
disk space may not keep), then its records, everything but its weights, are kept in
experiments/cures/results/cures_runs.tar.xz (ARCHIVE, one file for the study, committed; its
saved rollouts as a digest, `selfopd.comparisons.records`): a new checkout copies them back
into --out and goes on with the runs that are missing. Every stage skips what an earlier call
finished. Each comparison's report.md is rewritten after its runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

from selfopd.comparisons.compare import CompareConfig, load_compare_config, run_compare
from selfopd.comparisons.compare_report import ArmResult, measure_comparison, write_compare_report
from selfopd.comparisons.records import keep_run, restore_runs, unkept_runs
from selfopd.core.run_folder import RunFolder
from selfopd.core.stats import paired_change
from selfopd.run.evaluate import read_eval_outcomes
from selfopd.run.folder_guard import folder_lock

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
ARMS = HERE / "arms.toml"
DEMO = ROOT / "experiments" / "demo" / "demo.toml"
RESULTS = HERE / "results"
COMMON = "allow_negation=false&allow_parentheses=false&size=4000&seed=1"
CANDIDATES = {  # the pre-registered order
    "three_sums": f"rg:basic_arithmetic?min_terms=3&max_terms=3&min_digits=1&max_digits=2&operators=+&{COMMON}",
    "three_digit_sums": f"rg:basic_arithmetic?min_terms=2&max_terms=2&min_digits=3&max_digits=3&operators=+&{COMMON}",
    "products": f"rg:basic_arithmetic?min_terms=2&max_terms=2&min_digits=1&max_digits=2&operators=*&{COMMON}",
    "two_digit_products": f"rg:basic_arithmetic?min_terms=2&max_terms=2&min_digits=2&max_digits=2&operators=*&{COMMON}",
}
BASE_LIMIT, GAIN_LIMIT, PILOT_SEED, STEPS = 0.05, 0.10, 100, 12
FRESH_SIZE, FRESH_SEED = 200, 7
# Each finished run's records (metrics, evals, a digest of the saved rollouts, diagnostics; no
# weights) and each comparison's timing log, at their paths relative to --out, in one file.
ARCHIVE = RESULTS / "cures_runs.tar.xz"
SELECTION = RESULTS / "cures_selection.json"  # the shipped copy of select's record
# A task whose grid ran before the archive existed and whose run folders were not kept: the
# summary `selfopd compare` wrote of it. Its primary metric and curves are read from there;
# its fresh-prompt evals and seed-0 diagnoses were never made.
SHIPPED = {"demo": RESULTS / "cures_demo_summary.json"}


def selfopd(*args: str) -> None:
    """Run the selfopd CLI as a user would; a failure stops the stage with its message."""
    command = [sys.executable, "-m", "selfopd", *args]
    print("$", " ".join(command[2:]), flush=True)
    subprocess.run(command, cwd=ROOT, check=True)


def select(out: Path) -> dict:
    """The sparse task by the pre-registered rule; selection.json records every number seen."""
    path = out / "selection.json"
    record = json.loads(path.read_text()) if path.is_file() else {"candidates": {}}
    if "selected" in record:
        return record
    for name, spec in CANDIDATES.items():
        seen = record["candidates"].setdefault(name, {"spec": spec})
        if "base_accuracy" not in seen:
            base_dir = out / "select" / name / "base"
            if not (base_dir / "summary.json").is_file():
                selfopd("eval", str(DEMO), "--set", f"data.spec={spec}", "--split", "eval", "--out", str(base_dir))
            seen["base_accuracy"] = json.loads((base_dir / "summary.json").read_text())["accuracy"]
            _write(path, record)
        if seen["base_accuracy"] > BASE_LIMIT:
            continue
        if "pilot_gain" not in seen:
            run_dir = out / "select" / name / "grpo_pilot"
            if not (run_dir / "finished.json").is_file():
                if (run_dir / "config.toml").is_file():
                    selfopd("train", "--resume", str(run_dir))
                else:
                    selfopd("train", str(DEMO), "--set", f"data.spec={spec}", "--set", f"run.steps={STEPS}",
                            "--set", f"run.seed={PILOT_SEED}", "--set", "run.eval_every=0", "--set", "loss.lambda_opd=0",
                            "--set", "loss.lambda_rl=1", "--set", f"run.out_dir={run_dir.parent}",
                            "--set", f"run.name={run_dir.name}", "--set", "run.progress=false")
            folder = RunFolder(run_dir)
            change = paired_change(read_eval_outcomes(folder.eval_dir(0)), read_eval_outcomes(folder.eval_dir(STEPS)))
            seen["pilot_gain"] = [change.mean, change.low, change.high]
            _write(path, record)
        if seen["pilot_gain"][0] <= GAIN_LIMIT:
            record["selected"], record["rule"] = name, "first candidate with base <= 0.05 and pilot gain <= +0.10"
            break
    if "selected" not in record:
        sparse = {n: c for n, c in record["candidates"].items() if c["base_accuracy"] <= BASE_LIMIT}
        if sparse:
            record["selected"] = min(sparse, key=lambda n: sparse[n]["pilot_gain"][0])
            record["rule"] = "no candidate passed both: the one with base <= 0.05 and the smallest pilot gain"
        else:
            record["selected"] = min(record["candidates"], key=lambda n: record["candidates"][n]["base_accuracy"])
            record["rule"] = "no candidate had base <= 0.05: the one with the lowest base accuracy"
    _write(path, record)
    print(f"sparse task: {record['selected']} ({record['rule']})")
    return record


def comparisons(out: Path, selection: dict | None) -> dict[str, CompareConfig]:
    """The demo-task comparison, and the sparse-task one once the task is selected."""
    demo = dataclasses.replace(load_compare_config(ARMS), out_dir=out)
    tasks = {"demo": demo}
    if selection and "selected" in selection:
        spec = CANDIDATES[selection["selected"]]
        sparse = load_compare_config(ARMS, [f"data.spec={spec}"])
        tasks["sparse"] = dataclasses.replace(sparse, name="cures_sparse", out_dir=out)
    return tasks


def compare(tasks: dict[str, CompareConfig], spec_of: dict[str, str]) -> None:
    for task, compare_config in tasks.items():
        compare_config.folder.mkdir(parents=True, exist_ok=True)

        def finished(arm: str, seed: int, run_dir: Path, task: str = task, config: CompareConfig = compare_config) -> None:
            if task in spec_of:  # a main-grid run (the 3x-steps check is compared on its held-out evals only)
                fresh_eval(run_dir, spec_of[task])
                if seed == config.seeds[0]:
                    diagnose_run(run_dir)
            archive(config, run_dir)

        restore(compare_config.out_dir, [compare_config])
        with folder_lock(compare_config.folder):
            run_compare(compare_config, after_run=finished)
            for arm, seed, run_dir in unkept_runs(compare_config, ARCHIVE / compare_config.name):
                finished(arm, seed, run_dir)  # finished by a call stopped before its archive
        write_compare_report(compare_config)


def archive(compare_config: CompareConfig, run_dir: Path) -> None:
    """Keep a run's records and the comparison's timing log in ARCHIVE (selfopd.comparisons.records)."""
    kept = keep_run(compare_config, run_dir, ARCHIVE / compare_config.name)
    print(f"archived {kept.relative_to(ARCHIVE)} in {ARCHIVE}", flush=True)


def restore(out: Path, configs: list[CompareConfig]) -> None:
    """Copy the archived finished runs of these comparisons that --out lacks back into it (a new
    checkout; the comparison then skips them), and the shipped selection record."""
    if not (out / "selection.json").is_file() and SELECTION.is_file():
        _write(out / "selection.json", json.loads(SELECTION.read_text()))
    for config in configs:
        for run_dir in restore_runs(config, ARCHIVE / config.name):
            print(f"restored {run_dir.relative_to(out)} from {ARCHIVE}", flush=True)


def fresh_spec(spec: str) -> str:
    """The task's generator at another seed, FRESH_SIZE prompts (`--fresh` drops any the run's data held)."""
    head, _, query = spec.partition("?")
    options = dict(part.split("=", 1) for part in query.split("&"))
    options.update(size=str(FRESH_SIZE), seed=str(FRESH_SEED))
    return f"{head}?{'&'.join(f'{k}={v}' for k, v in options.items())}"


def fresh(tasks: dict[str, CompareConfig], spec_of: dict[str, str]) -> None:
    for task, compare_config in tasks.items():
        for arm, seed in compare_config.runs():
            run_dir = compare_config.arm_dir(arm, seed)
            if (run_dir / "finished.json").is_file():
                fresh_eval(run_dir, spec_of[task])


def fresh_eval(run_dir: Path, spec: str) -> None:
    """The run's final weights on the task's fresh prompts, once; said when its weights are gone."""
    target = run_dir / "fresh_eval"
    if (target / "summary.json").is_file():
        return
    if not RunFolder(run_dir).latest_checkpoint():
        print(f"fresh: {run_dir} has no weights left (a restored or pruned run): not evaluated", flush=True)
        return
    selfopd("eval", "--run", str(run_dir), "--data", fresh_spec(spec), "--fresh", "--out", str(target))


CURES = ("rlsd", "routing", "contrastive", "pass_rate", "worked_solution")


def shipped_rows(task: str, compare_config: CompareConfig) -> list[dict] | None:
    """The task's shipped summary rows when none of its runs is on disk (see SHIPPED)."""
    on_disk = any(RunFolder(compare_config.arm_dir(arm, seed)).finished.is_file() for arm, seed in compare_config.runs())
    return json.loads(SHIPPED[task].read_text()) if task in SHIPPED and not on_disk else None


def arm_complete(result: ArmResult, compare_config: CompareConfig) -> bool:
    """Every seed of the arm has finished its run."""
    return result.finished and len(result.per_seed) == len(compare_config.seeds)


def grid_complete(results: list[ArmResult], compare_config: CompareConfig) -> bool:
    """Every arm of the comparison has every seed finished."""
    return len(results) == len(compare_config.arms) and all(arm_complete(r, compare_config) for r in results)


def shipped_complete(rows: list[dict], compare_config: CompareConfig) -> bool:
    """`grid_complete` for a task read from its shipped summary."""
    return len(rows) == len(compare_config.arms) and all(row["finished"] for row in rows)


def primary_changes(task: str, compare_config: CompareConfig) -> dict[str, float] | None:
    """Each arm's pooled point change vs grpo_only at the comparison's steps (the primary
    metric), from its runs or its shipped summary; None until every run has finished."""
    if (rows := shipped_rows(task, compare_config)) is not None:
        if not shipped_complete(rows, compare_config):
            return None
        return {row["name"]: row["vs_reference"]["mean"] for row in rows if row["vs_reference"]}
    results = measure_comparison(compare_config)
    if not grid_complete(results, compare_config):
        return None
    return {r.name: r.vs_reference.mean for r in results if r.vs_reference is not None}


def best_cure(tasks: dict[str, CompareConfig]) -> tuple[str, str] | None:
    """(task, cure) with the largest pooled point change vs grpo_only at the comparison's
    steps; None until every task's every run is finished."""
    best = None
    for task, compare_config in tasks.items():
        changes = primary_changes(task, compare_config)
        if changes is None:
            return None
        for name, change in changes.items():
            if name in CURES and (best is None or change > best[0]):
                best = (change, task, name)
    return (best[1], best[2]) if best else None


def longer_config(tasks: dict[str, CompareConfig], spec_of: dict[str, str]) -> CompareConfig | None:
    """The 3x-steps comparison: the best cure and grpo_only, evals every 12 steps, on the task
    where the cure did best; None until both tasks' comparisons are finished."""
    if len(tasks) < 2 or (chosen := best_cure(tasks)) is None:
        return None
    task, cure = chosen
    overrides = [f"data.spec={spec_of[task]}", f"run.steps={3 * STEPS}", f"run.eval_every={STEPS}"]
    config = load_compare_config(ARMS, overrides, only=["grpo_only", cure])
    return dataclasses.replace(config, name=f"cures_{task}_3x", out_dir=tasks[task].out_dir)


def longer(tasks: dict[str, CompareConfig], spec_of: dict[str, str]) -> None:
    config = longer_config(tasks, spec_of)
    if config is None:
        print("longer: waits for both tasks' comparisons to finish")
        return
    print(f"longer: {config.name}, arms {[arm.name for arm in config.arms]}, {3 * STEPS} steps")
    compare({"longer": config}, spec_of={})


def diagnose(tasks: dict[str, CompareConfig]) -> None:
    for compare_config in tasks.values():
        for arm in compare_config.arms:
            run_dir = compare_config.arm_dir(arm.name, compare_config.seeds[0])
            if (run_dir / "finished.json").is_file():
                diagnose_run(run_dir)


def diagnose_run(run_dir: Path) -> None:
    if not (run_dir / "diagnostics" / "report.md").is_file():
        selfopd("diagnose", str(run_dir), "--gap-items", "50", "--heatmaps", "0")


def _write(path: Path, value: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value, indent=1) + "\n")


def main() -> None:
    global ARCHIVE
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stage", choices=("all", "select", "compare", "fresh", "longer", "diagnose"),
                        default="all")
    parser.add_argument("--task", choices=("all", "demo", "sparse"), default="all",
                        help="the comparisons to run (select always concerns the sparse task)")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "cures")
    parser.add_argument("--archive", type=Path, default=ARCHIVE, help="the records kept of finished runs, restored "
                        "into --out and added to (default: the study's; with a new path every comparison run trains "
                        "again, its rollouts kept whole under --out)")
    args = parser.parse_args()
    ARCHIVE = args.archive.resolve()
    out = args.out.resolve()
    restore(out, [])
    selection = select(out) if args.stage in ("all", "select") else _read(out / "selection.json")
    tasks = comparisons(out, selection)  # both, for choosing the 3x-steps arm
    restore(out, list(tasks.values()))
    spec_of = task_specs(selection)
    if args.task != "all":
        to_run = {task: config for task, config in tasks.items() if task == args.task}
    else:  # a task measured before the archive existed is not rerun unless asked for by name
        to_run = {task: config for task, config in tasks.items() if shipped_rows(task, config) is None}
        for task in tasks.keys() - to_run.keys():
            print(f"{task}: measured earlier ({SHIPPED[task].relative_to(ROOT)}), not rerun (--task {task} reruns it)")
    if args.stage in ("all", "compare"):
        compare(to_run, spec_of)
    if args.stage in ("all", "fresh"):
        fresh(to_run, spec_of)
    if args.stage in ("all", "longer"):
        longer(tasks, spec_of)
    if args.stage in ("all", "diagnose"):
        diagnose(to_run)


def task_specs(selection: dict | None) -> dict[str, str]:
    """Each task's data spec: the demo's, and the selected sparse candidate's."""
    sparse = {"sparse": CANDIDATES[selection["selected"]]} if selection and "selected" in selection else {}
    return {"demo": _demo_spec(), **sparse}


def _read(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _demo_spec() -> str:
    from selfopd.config import load_config

    return load_config(DEMO).data.spec


if __name__ == "__main__":
    main()
