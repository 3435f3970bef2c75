"""`selfopd compare`: train several arms under one budget and report them, or print the
resolved comparison (`--show-config`)."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from selfopd.cli.common import UserError, add_overrides, command
from selfopd.config import ConfigError


def add_compare_command(commands: argparse._SubParsersAction) -> None:
    compare = command(commands, "compare", _compare,
                      "train several arms (teachers, losses) under one budget, one after another, and report")
    compare.add_argument("config", type=Path, help="comparison TOML (see experiments/self_vs_external/compare.toml)")
    add_overrides(compare, "run.steps=4")
    compare.add_argument("--arms", default="", help="comma-separated arm names to run (default: all); the report "
                         "still covers every arm with results")
    compare.add_argument("--seeds", default="", help="comma-separated training seeds to run, of compare.seeds (default: all); the "
                         "report still pools every seed with results")
    compare.add_argument("--name", default="", help="the comparison's folder name instead of compare.name (e.g. a "
                         "short smoke run beside the full one)")
    compare.add_argument("--keep-records", type=Path, metavar="KEEP",
                         help="keep each finished run's records (no weights) in KEEP as it finishes, and first copy "
                              "back the finished runs KEEP holds that the comparison's folder lacks: a comparison "
                              "longer than one sitting goes on in a new checkout. KEEP is a folder, or one archive "
                              "(a path ending in .tar.xz) that keeps the saved rollouts as a digest without per-token "
                              "values: a few hundred kB for a study, what a repository can hold. With --report-only: "
                              "copy back, then report")
    compare.add_argument("--report-only", action="store_true", help="rewrite report.md from the arms' folders, train nothing")
    compare.add_argument("--show-config", action="store_true",
                         help="check every arm and print the resolved comparison (each arm with the teacher, loss and "
                              "optimizer values it runs with) as TOML, and exit")


def _compare(args: argparse.Namespace) -> None:
    from selfopd.comparisons.compare import compare_config_toml, load_compare_config, run_compare
    from selfopd.comparisons.compare_report import write_compare_report

    only = [name.strip() for name in args.arms.split(",") if name.strip()]
    try:
        seeds = [int(seed) for seed in args.seeds.split(",") if seed.strip()]
    except ValueError:
        raise UserError(f"--seeds: expected comma-separated integers, got {args.seeds!r}") from None
    compare = load_compare_config(args.config, args.overrides, only, seeds)
    # --arms and --seeds choose what trains; the report covers every arm and seed with results.
    whole = load_compare_config(args.config, args.overrides) if only or seeds else compare
    if args.name:
        try:
            compare, whole = dataclasses.replace(compare, name=args.name), dataclasses.replace(whole, name=args.name)
        except ConfigError as error:
            raise UserError(f"--name: {error.message}") from None
    if args.show_config:
        print(compare_config_toml(compare), end="")
        return
    if not args.report_only:
        from selfopd.run.folder_guard import folder_lock

        compare.folder.mkdir(parents=True, exist_ok=True)
        with folder_lock(compare.folder):  # a second comparison would restart this one's unfinished arms
            if args.keep_records is None:
                run_compare(compare)
            else:
                _run_keeping_records(compare, args.keep_records)
    elif args.keep_records is not None:  # the report of runs kept elsewhere: copied back first
        from selfopd.comparisons.records import restore_runs

        for run_dir in restore_runs(whole, args.keep_records):
            print(f"restored {run_dir} from {args.keep_records}")
    report = write_compare_report(whole)
    print(report.read_text())
    print(f"report: {report}")


def _run_keeping_records(compare, keep: Path) -> None:
    from selfopd.comparisons.compare import run_compare
    from selfopd.comparisons.records import keep_finished, keep_run, restore_runs

    for run_dir in restore_runs(compare, keep):
        print(f"restored {run_dir} from {keep}")

    def kept(arm: str, seed: int, run_dir: Path) -> None:
        print(f"kept the records of {arm} seed {seed} in {keep_run(compare, run_dir, keep)}")

    run_compare(compare, after_run=kept)
    for target in keep_finished(compare, keep):  # finished by a call stopped before it kept them
        print(f"kept the records of {target}")
