"""The pre-registered knowledge comparison (experiments/knowledge/PREREGISTRATION.md), stage by stage.

    python -m experiments.knowledge.run                  # every stage, in order; rerun to resume
    python -m experiments.knowledge.run --stage sft      # or one: start, compare, sft, shuffled, illusion, mixed, rows, longer

Stages:
  start     (always first) the demo recipe, trained once (experiments/demo/demo.toml): every arm
            starts from its final weights, which hold the skill that forgetting is measured on
  compare   GRPO alone, the OPD losses with the fact-sheet teacher, the external SFT teacher
            (`selfopd compare`'s runner over arms.toml; finished runs are skipped)
  sft       SFT on the gold answers and on the start model's own verified fact-sheet answers, per seed
  shuffled  opd_forward_kl with every question shown another country's sheet
  longer    the best OPD arm at 3x the steps
  illusion  the other regime for the diagnostics: the demo recipe with the answer note at full
            weight (lambda_opd = 1, the search's run whose accuracy fell after step 12), seed 0, and
            `selfopd diagnose` on it and on the start run (the demo recipe itself)
  mixed     grpo_only and opd_forward_kl on the mixture of this task and the demo's, one teacher
            template per task (teacher/fact_sheet_or_answer_note): learning and forgetting in one run
  rows      (exploratory) the transfer's per-prompt rows of the seed-0 runs diagnosed before
            `selfopd diagnose` kept them: each diagnosed again from its weights

As each run finishes, while its weights are the newest on disk: its retention (the start model's
arithmetic on the demo's 200 held-out sums; split c, the countries no run trains on; the drift,
KL(trained || start) on general prompts) and, for seed 0, `selfopd diagnose`. Then its records,
everything but weights, go into results/knowledge_runs.tar.xz (ARCHIVE, one file for the study,
committed): a new checkout restores them into --out and goes on with what is missing. The start
model is trained again on a checkout that lacks it; its weights' digest is checked against the
one the archived runs started from.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import subprocess
import sys
from pathlib import Path

from selfopd.comparisons.compare import CompareConfig, load_compare_config, run_compare
from selfopd.comparisons.compare_report import ArmResult, measure_comparison, write_compare_report
from selfopd.comparisons.records import RecordArchive, keep_run, restore_runs, run_records, unkept_runs
from selfopd.config import load_config
from selfopd.core.run_folder import RunFolder
from selfopd.run.folder_guard import folder_lock

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
CONFIG = HERE / "knowledge.toml"
ARMS = HERE / "arms.toml"
DEMO = ROOT / "experiments" / "demo" / "demo.toml"
RESULTS = HERE / "results"
ARCHIVE = RESULTS / "knowledge_runs.tar.xz"
START_RECORD = RESULTS / "knowledge_start.json"  # the start model's digest and accuracy, shipped
SEEDS = (0, 1, 2)
PRIMARY_OPD = "opd_forward_kl"  # the arm the shuffled-sheet control repeats
OPD_ARMS = ("opd_sampled", "opd_topk", "opd_reverse_kl", "opd_forward_kl", "external_sft")
# The SFT arms (`selfopd sft` on the study's config): matched to the OPD arms' trained tokens.
SFT_ARMS = {
    "sft_gold": ["sft.targets=solution"],
    "sft_teacher": ["sft.targets=sampled", "sft.sample_template=teacher/fact_sheet", "sft.samples_per_prompt=4",
                    "sft.temperature=0.7", "sft.max_tokens=16"],
}
SFT_COMMON = ["sft.train_examples=0", "sft.epochs=10", "sft.lr=3e-5", "sft.batch_size=32", "sft.checkpoint_every=0"]
SFT_NOT_RECORDS = ("model", "checkpoint")  # an SFT folder's weights


def selfopd(*args: str) -> None:
    """Run the selfopd CLI as a user would; a failure stops the stage with its message."""
    command = [sys.executable, "-m", "selfopd", *args]
    print("$", " ".join(command[2:]), flush=True)
    subprocess.run(command, cwd=ROOT, check=True)


# --- the start model ------------------------------------------------------------------


def start_model(out: Path) -> Path:
    """The demo recipe's final weights (trained here unless --out has them), checked against the
    digest the archived runs started from (START_RECORD, written by the first call)."""
    run_dir, steps = out / "start", load_config(DEMO).run.steps
    final_eval = RunFolder(run_dir).eval_dir(steps) / "summary.json"
    if not final_eval.is_file():
        if RunFolder(run_dir).latest_checkpoint() is not None:
            selfopd("train", "--resume", str(run_dir))
        else:
            selfopd("train", str(DEMO), "--set", f"run.out_dir={out}", "--set", "run.name=start",
                    "--set", "run.progress=false")
    checkpoint = RunFolder(run_dir).latest_checkpoint()
    record = {"digest": weights_digest(checkpoint), "steps": steps,
              "held_out_accuracy": json.loads(final_eval.read_text())["accuracy"]}
    if START_RECORD.is_file():
        shipped = json.loads(START_RECORD.read_text())
        if shipped["digest"] != record["digest"]:
            raise SystemExit(f"{checkpoint}: its weights' digest {record['digest'][:16]} is not the "
                             f"{shipped['digest'][:16]} the archived runs started from ({START_RECORD}); "
                             "move the archive and that record aside to run the study again from these weights")
    else:
        _write(START_RECORD, record)
    retention(run_dir, checkpoint, checkpoint, load_config(CONFIG).data.spec, only=("arithmetic", "unseen", "fresh"))
    return checkpoint


def weights_digest(checkpoint: Path) -> str:
    """sha256 over the checkpoint's safetensors files, in name order."""
    digest = hashlib.sha256()
    for path in sorted(checkpoint.glob("*.safetensors")):
        digest.update(path.read_bytes())
    return digest.hexdigest()


# --- after each run: retention, diagnosis, records --------------------------------------


def retention(run_dir: Path, weights: Path | None, start: Path, spec: str,
              only: tuple[str, ...] = ("arithmetic", "unseen", "fresh", "drift")) -> None:
    """The run's final weights on the start model's skill, on split c and on general prompts,
    once each; said when the weights are gone (a restored run keeps the results it had)."""
    target = run_dir / "retention"
    checks = {
        "arithmetic": ["eval", str(DEMO), "--model", str(weights), "--out", str(target / "arithmetic")],
        "unseen": ["eval", str(CONFIG), "--model", str(weights), "--data", f"{spec}&part=unseen",
                   "--out", str(target / "unseen")],
        "fresh": ["eval", str(CONFIG), "--model", str(weights), "--data", f"{spec}&part=fresh",
                  "--out", str(target / "fresh")],
        "drift": ["drift", "--model", str(weights), "--reference", str(start), "--out", str(target / "drift")],
    }
    for name, command in checks.items():
        if name not in only or (target / name / "summary.json").is_file():
            continue
        if weights is None:
            print(f"retention: {run_dir} has no weights left: {name} not measured", flush=True)
            continue
        selfopd(*command)


def diagnose_run(run_dir: Path) -> None:
    if not (run_dir / "diagnostics" / "report.md").is_file():
        selfopd("diagnose", str(run_dir), "--gap-items", "64", "--heatmaps", "0")


def transfer_rows(out: Path, grids: list[CompareConfig]) -> None:
    """Amendment 5 (exploratory): the transfer's per-prompt rows of each seed-0 run diagnosed before
    `selfopd diagnose` kept them, by diagnosing it again from its weights on disk (the transfer it
    gives must repeat the first diagnosis's); its records are then kept again, with the rows."""
    for config in grids:
        for arm in config.arms:
            run_dir = config.arm_dir(arm.name, config.seeds[0])
            if rediagnose(run_dir):
                keep_run(config, run_dir, ARCHIVE / config.name)
    archive = RecordArchive(ARCHIVE, "illusion")
    for name, run_dir in (("answer_note_full", out / "illusion" / "answer_note_full"), ("start", out / "start")):
        if rediagnose(run_dir):
            archive.replace_folder(name, run_records(run_dir))


def rediagnose(run_dir: Path) -> bool:
    """Diagnose a run again when its diagnosis lacks the transfer's rows and its weights are here."""
    summary = run_dir / "diagnostics" / "summary.json"
    if (not summary.is_file() or (run_dir / "diagnostics" / "transfer.jsonl").is_file()
            or RunFolder(run_dir).latest_checkpoint() is None):
        return False
    def numbers(transfer: dict | None) -> dict:  # a later summary also names each estimate's unit
        return {part: {k: v for k, v in value.items() if k != "unit"} if isinstance(value, dict) else value
                for part, value in (transfer or {}).items()}

    before = json.loads(summary.read_text()).get("transfer")
    selfopd("diagnose", str(run_dir), "--gap-items", "64", "--heatmaps", "0")
    after = json.loads(summary.read_text()).get("transfer")
    print(f"{run_dir}: the transfer {'repeats' if numbers(after) == numbers(before) else 'differs'}: {before} -> {after}",
          flush=True)
    return True


def restore_folder(out: Path, folder: str) -> None:
    """Copy each run the archive keeps under `folder/` that --out lacks into --out/folder (a run
    already there is never overwritten)."""
    archive = RecordArchive(ARCHIVE, folder)
    for name in sorted({path.split("/")[0] for path in archive.names()}):
        if not (out / folder / name).exists():
            archive.extract_folder(name, out / folder / name)
            print(f"restored {folder}/{name} from {ARCHIVE}", flush=True)


def unkept_measures(archive: RecordArchive, relative: str, run_dir: Path) -> bool:
    """Whether the run has a retention measure its archived copy lacks (measured after it was kept)."""
    return any(not archive.has(f"{relative}/retention/{path.parent.name}/summary.json")
               for path in (run_dir / "retention").glob("*/summary.json"))


# --- the stages -------------------------------------------------------------------------


def sft(out: Path, start: Path, spec: str) -> None:
    """Each SFT arm under each seed: trained, evaluated (its own held-out eval), its retention
    measured, its records kept."""
    archive = RecordArchive(ARCHIVE, "sft")
    restore_folder(out, "sft")
    for seed in SEEDS:
        for arm, settings in SFT_ARMS.items():
            name = f"{arm}_seed{seed}"
            run_dir = out / "sft" / name
            if not (run_dir / "summary.json").is_file():
                selfopd("sft", str(CONFIG), "--set", f"model.student={start}", "--set", f"run.seed={seed}",
                        "--set", f"run.out_dir={run_dir.parent}", "--set", f"sft.name={name}",
                        *(f"--set={o}" for o in (*SFT_COMMON, *settings)))
            weights = run_dir / "model"
            retention(run_dir, weights if weights.is_dir() else None, start, spec)
            if (run_dir / "summary.json").is_file() and (not archive.has(f"{name}/summary.json")
                                                         or unkept_measures(archive, name, run_dir)):
                files = {path: data for path, data in run_records(run_dir).items()
                         if path.split("/")[0] not in SFT_NOT_RECORDS}
                archive.replace_folder(name, files)
                print(f"archived sft/{name} in {ARCHIVE}", flush=True)


def comparison(out: Path, start: Path, spec: str, name: str = "knowledge", only: tuple[str, ...] = (),
               extra: tuple[str, ...] = ()) -> CompareConfig:
    """The arms file under --out, every arm starting from the start model (and `extra` settings)."""
    config = load_compare_config(ARMS, [f"model.student={start}", *extra], only=only)
    return dataclasses.replace(config, name=name, out_dir=out)


def run_grid(config: CompareConfig, start: Path, spec: str) -> None:
    """`selfopd compare`'s runner over one grid; each finished run's retention, seed-0 diagnosis and records."""

    def finished(arm: str, seed: int, run_dir: Path) -> None:
        retention(run_dir, RunFolder(run_dir).latest_checkpoint(), start, spec)
        if seed == config.seeds[0]:
            diagnose_run(run_dir)
        kept = keep_run(config, run_dir, ARCHIVE / config.name)
        print(f"archived {kept.relative_to(ARCHIVE)} in {ARCHIVE}", flush=True)

    config.folder.mkdir(parents=True, exist_ok=True)
    for run_dir in restore_runs(config, ARCHIVE / config.name):
        print(f"restored {run_dir.relative_to(config.out_dir)} from {ARCHIVE}", flush=True)
    for arm, seed in config.runs():  # a measure added after a run finished, while its weights are on disk
        run_dir = config.arm_dir(arm, seed)
        if RunFolder(run_dir).finished.is_file() and (weights := RunFolder(run_dir).latest_checkpoint()):
            retention(run_dir, weights, start, spec)
            if unkept_measures(RecordArchive(ARCHIVE, config.name), run_dir.relative_to(config.folder).as_posix(),
                               run_dir):
                keep_run(config, run_dir, ARCHIVE / config.name)
    with folder_lock(config.folder):
        run_compare(config, after_run=finished)
        for arm, seed, run_dir in unkept_runs(config, ARCHIVE / config.name):
            finished(arm, seed, run_dir)  # finished by a call stopped before its archive
    write_compare_report(config)


def illusion_regime(out: Path) -> None:
    """The answer note at full weight on the demo task (from the packaged model, as the demo), and
    the diagnoses of it and of the start run; records kept in the archive under illusion/."""
    run_dir, steps = out / "illusion" / "answer_note_full", load_config(DEMO).run.steps
    archive = RecordArchive(ARCHIVE, "illusion")
    restore_folder(out, "illusion")
    if not (run_dir / "diagnostics" / "summary.json").is_file():
        if not RunFolder(run_dir).eval_dir(steps).is_dir():
            if RunFolder(run_dir).latest_checkpoint() is not None:
                selfopd("train", "--resume", str(run_dir))
            else:
                selfopd("train", str(DEMO), "--set", "loss.lambda_opd=1", "--set", f"run.out_dir={run_dir.parent}",
                        "--set", "run.name=answer_note_full", "--set", "run.progress=false")
        diagnose_run(run_dir)
        archive.replace_folder("answer_note_full", run_records(run_dir))
    start_dir = out / "start"
    if not archive.has("start/diagnostics/summary.json"):
        diagnose_run(start_dir)
        archive.replace_folder("start", run_records(start_dir))


def mixed_grid(out: Path, start: Path, spec: str) -> CompareConfig:
    """grpo_only and the primary OPD arm on this task mixed with the demo's (4 + 4 prompts a step):
    the demo's 200 held-out sums are held out here too (data.eval_size caps the knowledge task at
    its own 64), so the arithmetic eval is the start model's retention measure, in the run."""
    return comparison(out, start, spec, "knowledge_mixed", only=("grpo_only", PRIMARY_OPD),
                      extra=(f"data.spec={spec} + {load_config(DEMO).data.spec}", "data.eval_size=200",
                             "teacher.template=teacher/fact_sheet_or_answer_note"))


def best_opd_arm(config: CompareConfig, results: list[ArmResult] | None = None) -> str | None:
    """The OPD arm with the largest pooled held-out change vs grpo_only; None until every run is
    finished. `results`: the grid's `measure_comparison`, when the caller has it already."""
    results = measure_comparison(config) if results is None else results
    if len(results) < len(config.arms) or not all(r.finished and len(r.per_seed) == len(SEEDS) for r in results):
        return None
    changes = {r.name: r.vs_reference.mean for r in results if r.name in OPD_ARMS and r.vs_reference is not None}
    return max(changes, key=changes.get)


def main() -> None:
    global ARCHIVE
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stage", choices=("all", "start", "compare", "sft", "shuffled", "illusion", "mixed", "rows",
                                            "longer"), default="all")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "knowledge")
    parser.add_argument("--archive", type=Path, default=ARCHIVE, help="the records kept of finished runs, restored "
                        "into --out and added to (default: the study's)")
    args = parser.parse_args()
    ARCHIVE = args.archive.resolve()
    out = args.out.resolve()
    start = start_model(out)
    spec = load_config(CONFIG).data.spec
    stages = ("compare", "sft", "shuffled", "illusion", "mixed", "rows", "longer") if args.stage == "all" else (args.stage,)
    main_grid = comparison(out, start, spec)
    if "compare" in stages:
        run_grid(main_grid, start, spec)
    if "sft" in stages:
        sft(out, start, spec)
    shuffled = comparison(out, start, spec, "knowledge_shuffled", only=(PRIMARY_OPD,), extra=(f"data.spec={spec}&sheet=shuffled",))
    if "shuffled" in stages:
        run_grid(shuffled, start, spec)
    if "illusion" in stages:
        illusion_regime(out)
    mixed = mixed_grid(out, start, spec)
    if "mixed" in stages:
        run_grid(mixed, start, spec)
    if "rows" in stages:
        transfer_rows(out, [main_grid, shuffled, mixed])
    if "longer" in stages:
        best = best_opd_arm(main_grid)
        if best is None:
            print("longer: waits for the main comparison to finish")
            return
        steps = load_config(CONFIG).run.steps
        print(f"longer: {best} at {3 * steps} steps")
        run_grid(comparison(out, start, spec, "knowledge_3x", only=(best,),
                            extra=(f"run.steps={3 * steps}", f"run.eval_every={steps}")), start, spec)


def _write(path: Path, value: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value, indent=1) + "\n")


if __name__ == "__main__":
    main()
