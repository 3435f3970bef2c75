"""The `selfopd` command line: one sub-command per stage, each a thin call into the library."""

from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path
from typing import Any, Sequence

from selfopd.cli.common import (DEFAULT_DATA, DEFAULT_MODEL, Parser, UsageError, UserError, add_overrides, command,
                                number)
from selfopd.cli.compare import add_compare_command
from selfopd.cli.drift import add_drift_command
from selfopd.cli.evaluate import add_eval_command
from selfopd.cli.plan import add_plan_command, show_plan
from selfopd.cli.prompts import add_prompts_command
from selfopd.cli.slurm import add_slurm_command
from selfopd.config import MAX_ITEMS
from selfopd.config.settings import Bounds, escaped
from selfopd.core.run_folder import RunFolder, checkpoint_steps_text, load_run_config

COUNT = Bounds(ge=0, most=MAX_ITEMS)  # --limit, --gap-items, ...: how many items
EXIT_STOPPED = 75  # EX_TEMPFAIL: stopped by a signal with its checkpoint written; `--resume` goes on


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except UsageError as error:  # a refused flag: its one line is printed
        return int(error.code or 1)
    if not hasattr(args, "run"):
        parser.print_help()
        return 2
    try:
        return args.run(args) or 0
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as error:
        if _is_stop(error):  # SIGTERM / SIGUSR1: checkpointed; a scheduler's requeue resumes it
            print(f"selfopd: {escaped(str(error))}", file=sys.stderr)
            return EXIT_STOPPED
        if _is_user_error(error):
            one_line = " ".join(line.strip() for line in str(error).splitlines() if line.strip())
            print(f"selfopd: error: {escaped(one_line)}", file=sys.stderr)  # no control or bidi character reaches the terminal
            return 1
        raise


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="selfopd",
        description="On-policy distillation and self-distillation with privileged-information teachers.",
    )
    commands = parser.add_subparsers(title="commands", metavar="COMMAND")
    _add_models(commands)
    _add_data(commands)
    add_prompts_command(commands)
    add_eval_command(commands)
    _add_train(commands)
    add_plan_command(commands)
    _add_merge_lora(commands)
    _add_sft(commands)
    _add_serve(commands)
    add_slurm_command(commands)
    _add_diagnose(commands)
    add_drift_command(commands)
    add_compare_command(commands)
    return parser


# --- models -------------------------------------------------------------------------


def _add_models(commands: argparse._SubParsersAction) -> None:
    models = commands.add_parser("models", help="resolve, convert and cache models")
    sub = models.add_subparsers(title="models commands", metavar="COMMAND")
    prepare = command(sub, "prepare", _models_resolve, "convert a packaged model once into the cache (offline)")
    prepare.add_argument("spec", nargs="?", default=DEFAULT_MODEL, help=f"model spec (default: {DEFAULT_MODEL})")
    path = command(sub, "path", _models_resolve, "print the local folder for a model spec")
    path.add_argument("spec", help="packaged model name, local folder or hub id")
    models.set_defaults(run=lambda _args: models.print_help() or 2)


def _models_resolve(args: argparse.Namespace) -> None:
    """Both `prepare` and `path`: resolving converts or downloads on first use."""
    from selfopd.core.models import resolve_model

    print(resolve_model(args.spec))


# --- data ---------------------------------------------------------------------------


def _add_data(commands: argparse._SubParsersAction) -> None:
    data = commands.add_parser("data", help="inspect datasets")
    sub = data.add_subparsers(title="data commands", metavar="COMMAND")
    show = command(sub, "show", _data_show, "print the first examples of a data spec")
    show.add_argument("spec", nargs="?", default=DEFAULT_DATA, help="data spec (grammar: docs/data-and-verifiers.md; default: the demo task)")
    show.add_argument("--limit", type=number(int, COUNT), default=3, help="how many examples to print (default: 3)")
    data.set_defaults(run=lambda _args: data.print_help() or 2)


def _data_show(args: argparse.Namespace) -> None:
    from selfopd.data import load_examples

    examples = load_examples(args.spec)
    print(f"{len(examples)} examples from {args.spec}")
    for example in examples[: args.limit]:
        print("-" * 60)
        print(f"id:       {example.id}")
        print(f"prompt:   {example.prompt}")
        print(f"answer:   {example.answer}")
        if example.solution:
            print(f"solution: {textwrap.shorten(example.solution, 300)}")
        for hint in example.hints:
            print(f"hint:     {textwrap.shorten(hint, 200)}")
        if "part" in example.meta:  # a source that fixes its split (kb:): which part, and the document
            print(f"part:     {example.meta['part']} (split: {example.meta.get('split')})")
        if "fact_sheet" in example.meta:
            print("sheet:    " + example.meta["fact_sheet"].replace("\n", "\n          "))


# --- train --------------------------------------------------------------------------


def _add_train(commands: argparse._SubParsersAction) -> None:
    train = command(commands, "train", _train, "run on-policy (self-)distillation from a TOML config")
    train.add_argument("config", nargs="?", type=Path, help="TOML config (see experiments/demo/demo.toml); omit with --resume")
    add_overrides(train, "optim.lr=3e-6")
    train.add_argument("--resume", type=Path, metavar="RUN_DIR", help="continue a run from its latest checkpoint")
    train.add_argument("--show-config", action="store_true",
                       help="print the resolved config (every field, with its help) as TOML and exit")


def _train(args: argparse.Namespace) -> None:
    from selfopd.config import load_config
    from selfopd.core.distributed import current_world
    from selfopd.serving.server import ServerError
    from selfopd.run.summary import summarize_run
    from selfopd.training.trainer import train

    if args.resume is not None:
        if args.config is not None:
            raise UserError("give either a CONFIG or --resume RUN_DIR, not both")
        # The folder named is the one resumed, wherever it was first written (run.out_dir may be stale).
        where = [f"run.out_dir={args.resume.parent}", f"run.name={args.resume.name}"]
        config = load_run_config(args.resume, [*where, *args.overrides])
    elif args.config is None and not args.show_config:
        raise UserError("give a CONFIG file (e.g. experiments/demo/demo.toml) or --resume RUN_DIR")
    else:  # --show-config prints 'auto' as written, and what it means here below
        config = load_config(args.config, args.overrides, resolve=not args.show_config)
    if args.show_config:
        from selfopd.config import config_to_toml

        print(config_to_toml(config), end="")
        print(show_plan(config), end="")  # memory per GPU (selfopd plan), as TOML comments
        _print_auto_choices(config)
        return
    from selfopd.run.folder_guard import kept_on_write_failure, stopped_run_note

    folder = RunFolder.of(config.run.out_dir, config.run.name)
    try:
        run_dir = kept_on_write_failure(folder, lambda: train(config, resume=args.resume is not None))
    except ServerError as error:  # a server died or garbled an answer: say what is safe and how to go on
        first, *rest = str(error).split("\n")
        note = stopped_run_note(folder, "once the server answers again")
        raise ServerError("\n".join([f"{first}. {note}", *rest])) from None
    if current_world().is_main:  # under torchrun: once, from rank 0
        print(summarize_run(run_dir))
        print(f"run folder: {run_dir} (metrics.jsonl, plots/, eval/, checkpoints/, rollouts/)")
        print(f"checkpoints kept: steps {checkpoint_steps_text(RunFolder(run_dir).complete_checkpoints())} "
              f"(evaluate one: selfopd eval --run {run_dir} --step S)")


def _print_auto_choices(config: Any) -> None:
    """What each 'auto' setting of `config` means on this machine and why, as TOML comments."""
    from selfopd.config.auto import Machine
    from selfopd.config.bundles import ServingSettings
    from selfopd.planning.auto_settings import auto_choices

    choices = auto_choices(ServingSettings.of(config), Machine.here())
    if choices:
        print("\n# 'auto' settings on this machine (selfopd.config.auto):")
        print("\n".join(f"#   {choice.line()}" for choice in choices))


# --- merge-lora ---------------------------------------------------------------------


def _add_merge_lora(commands: argparse._SubParsersAction) -> None:
    merge = command(commands, "merge-lora", _merge_lora,
                    "merge a LoRA run's checkpoint (its adapters) into its base: a full HF model folder")
    merge.add_argument("checkpoint", type=Path, help="a LoRA checkpoint folder, e.g. runs/NAME/checkpoints/step_00024")
    merge.add_argument("out", type=Path, help="the model folder to write (transformers and vLLM load it)")
    merge.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                       help="dtype of the merged weights (default: float32)")


def _merge_lora(args: argparse.Namespace) -> None:
    from selfopd.engines.lora import merge_checkpoint

    if args.out.exists() and any(args.out.iterdir()):
        raise UserError(f"{args.out} exists and is not empty: choose a new folder")
    print(f"wrote {merge_checkpoint(args.checkpoint, args.out, args.dtype)}")


# --- sft ----------------------------------------------------------------------------


def _add_sft(commands: argparse._SubParsersAction) -> None:
    sft = command(commands, "sft", _sft,
                   "fine-tune the student on worked solutions or its own verified privileged answers: "
                   "a stronger teacher with the same tokenizer (the off-policy warm-up before OPD)")
    sft.add_argument("config", nargs="?", type=Path,
                     help="TOML file: the training sections it reads ([run], [model], [data], [optim], [eval]) and an "
                          "[sft] section (see experiments/self_vs_external/sft_teacher.toml; a training config such as "
                          "experiments/demo/demo.toml works too; default: all defaults)")
    add_overrides(sft, "sft.lr=3e-5")
    sft.add_argument("--student-run", type=Path, metavar="RUN_DIR",
                     help="a training run whose held-out prompts the teacher must not train on (refused if it would)")
    sft.add_argument("--show-config", action="store_true",
                     help="print the resolved config (every field it reads, with its help) and exit")


def _sft(args: argparse.Namespace) -> None:
    from selfopd.comparisons.sft import load_sft_config, run_sft, sft_config_to_toml

    config = load_sft_config(args.config, args.overrides)
    if args.show_config:
        print(sft_config_to_toml(config), end="")
        return
    model_dir = run_sft(config, student_run=args.student_run)
    print(f"run folder: {model_dir.parent} (summary.json, README.md, eval/, targets.jsonl, model/)")


# --- serve --------------------------------------------------------------------------


def _add_serve(commands: argparse._SubParsersAction) -> None:
    serve = command(commands, "serve", _serve,
                     "launch the vLLM student and teacher servers a config needs, until Ctrl-C")
    serve.add_argument("config", nargs="?", type=Path, help="TOML config; its [engine] section says how (default: all defaults)")
    add_overrides(serve, "engine.port=8200")
    serve.add_argument("--log-dir", type=Path, default=Path("runs/servers"), help="where server logs go (default: runs/servers)")


def _serve(args: argparse.Namespace) -> None:
    import time
    from dataclasses import replace

    from selfopd.config import load_config
    from selfopd.config.bundles import ServingSettings
    from selfopd.serving.server import launch_servers
    from selfopd.serving.gpu_layout import check_layout, server_role
    from selfopd.serving.launch import gpu_count, log_layout, planned_servers, serve_key

    config = load_config(args.config, args.overrides)
    layout = check_layout(config.engine, config.teacher, trainer_gpus=None,  # the trainer runs elsewhere
                          gpu_count=gpu_count())
    if not layout.servers:
        raise UserError("engine.student_urls and engine.teacher_url are both set: there is nothing to launch")
    log_layout(layout, args.log_dir, progress=True)
    with serve_key(config.engine, args.log_dir) as (key, train), launch_servers(  # every route but /health wants the key
            [replace(spec, api_key=key) for spec in planned_servers(ServingSettings.of(config))], args.log_dir,
            config.engine.startup_timeout_s) as servers:
        # Bound to every address (engine.host = '0.0.0.0'): the URLs a trainer on another machine reaches.
        urls = {role: ",".join(server.spec.public_url for server in servers if server_role(server.spec.name) == role)
                for role in ("student", "teacher")}
        sets = ([f"--set engine.student_urls={urls['student']}"] if urls["student"] else []) + \
               ([f"--set engine.teacher_url={urls['teacher']}"] if urls["teacher"] else [])
        for server in servers:
            elsewhere = f", {server.spec.public_url} from other machines" if server.spec.public_url != server.spec.url else ""
            print(f"{server.spec.name}: {server.spec.url}{elsewhere} serving {server.spec.model} (log: {server.log_path})")
        print(f"train against them with: {train} --set engine.kind=vllm {' '.join(sets)}")
        print("Ctrl-C stops the servers.", flush=True)
        while all(server.process.poll() is None for server in servers):
            time.sleep(1)
        dead = next(server for server in servers if server.process.poll() is not None)
        raise UserError(f"the {dead.spec.name} server on {dead.spec.url} exited.\n{dead.log_tail()}")


# --- diagnose -----------------------------------------------------------------------


def _add_diagnose(commands: argparse._SubParsersAction) -> None:
    diagnose = command(commands, "diagnose", _diagnose,
                        "privileged-illusion report of a run: advantage by token class, illusion score, "
                        "wrong-context contrast, leakage, gap before training")
    diagnose.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="a run folder (runs/NAME) with saved rollouts")
    add_overrides(diagnose, "model.trust_remote_code=true")
    diagnose.add_argument("--no-model", action="store_true",
                          help="only what the saved rollouts show: skip the wrong-context contrast and the gap")
    diagnose.add_argument("--gap-items", type=number(int, COUNT), default=100,
                          help="held-out items for the accuracy gap with vs without context (default: 100)")
    diagnose.add_argument("--heatmaps", type=number(int, COUNT), default=4,
                          help="heatmap PNGs per reported step (default: 4)")
    diagnose.add_argument("--teacher", metavar="NAME", default=None,
                          help="a run with several teachers ([teachers.NAME]): diagnose this one ('default' is "
                               "[teacher]); default: each, in RUN_DIR/diagnostics/NAME/")
    diagnose.add_argument("--transfer-items", type=number(int, COUNT), default=64,
                          help="trained and held-out items each for the transfer of the teacher's advantage, start vs "
                               "latest checkpoint (default: 64; 0: skip)")


def _diagnose(args: argparse.Namespace) -> None:
    from selfopd.diagnostics.report import measure_run, write_report
    from selfopd.diagnostics.teachers import run_teachers

    teachers = run_teachers(args.run_dir) if RunFolder(args.run_dir).is_run() else ["default"]
    if args.teacher is not None and args.teacher not in teachers:
        raise UserError(f"--teacher {args.teacher}: {args.run_dir} has teachers {', '.join(teachers)}")
    chosen = [args.teacher] if args.teacher is not None else teachers
    for teacher in chosen:
        diagnosis = measure_run(args.run_dir, with_model=not args.no_model, gap_items=args.gap_items, progress=True,
                                transfer_items=args.transfer_items, teacher=teacher, overrides=args.overrides)
        out = RunFolder(args.run_dir).diagnostics
        report = write_report(diagnosis, out if len(teachers) == 1 else out / teacher, args.heatmaps)
        if len(teachers) > 1:
            print(f"teacher {teacher!r}:")
        _print_diagnosis(diagnosis, report)


def _print_diagnosis(diagnosis: Any, report: Path) -> None:
    for step in sorted({diagnosis.first, diagnosis.last}):
        score = diagnosis.illusion[step]
        flag = "  WARNING" if score.warning else ""
        print(f"illusion score at step {step}: {score.share} (interval over {score.share.n} distinct prompts){flag}")
    if diagnosis.transfer is not None and isinstance(result := diagnosis.transfer.result, str):
        print(f"transfer of the teacher's advantage: not measured, {result}")
    elif diagnosis.transfer is not None:
        print(f"transfer of the teacher's advantage, held-out / trained: {result.ratio}")
    for warning in diagnosis.warnings:
        print(f"warning: {warning}")
    print(f"report: {report}")


# --- errors -------------------------------------------------------------------------


def _is_stop(error: Exception) -> bool:
    from selfopd.training.trainer import Stopped

    return isinstance(error, Stopped)


def _is_user_error(error: Exception) -> bool:
    """Errors that describe a bad spec, file or template: print the message, not a traceback."""
    from selfopd.config import ConfigError
    from selfopd.data import DataError
    from selfopd.run.rollouts import DiagnosticsError
    from selfopd.run.folder_guard import FolderInUse, FolderNotWritable
    from selfopd.core.folder_key import FolderKeyError
    from selfopd.core.models import ModelError
    from selfopd.templating.templates import TemplateError
    from selfopd.templating.tokenizer_check import TokenizerMismatch

    from selfopd.serving.server import ServerError
    from selfopd.training.trainer import GuardStop, NonFiniteLoss
    from selfopd.training.weight_checks import WeightSyncError

    user_errors = (UserError, ConfigError, DataError, ModelError, TemplateError, TokenizerMismatch, WeightSyncError,
                   ServerError, DiagnosticsError, FileNotFoundError, FileExistsError, FolderInUse, FolderNotWritable,
                   NonFiniteLoss, GuardStop, FolderKeyError)
    return isinstance(error, user_errors)

