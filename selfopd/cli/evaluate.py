"""`selfopd eval`: greedy or avg@k accuracy of a model on distinct held-out prompts, each option
refused by the parser when out of the range its config setting takes."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from selfopd.cli.common import UserError, add_overrides, check_output_folder, command, like_setting
from selfopd.config import EvalConfig, RunConfig
from selfopd.core.file_checks import checkpoint_problem
from selfopd.core.run_folder import RunFolder, load_run_config


def add_eval_command(commands: argparse._SubParsersAction) -> None:
    evaluate = command(commands, "eval", _eval,
                        "greedy or avg@k accuracy of a model on distinct held-out prompts, with a 95%% interval")
    evaluate.add_argument("config", nargs="?", type=Path,
                          help="training config whose model, data, split, template, eval and verifier settings "
                               "(what is graded: the text after a reasoning block, verifier.truncated; eval."
                               "student_template, eval.chat_template_kwargs, eval.truncated and eval.reasoning "
                               "where set) are the defaults (default: all defaults; with --run: the run's own)")
    add_overrides(evaluate, "eval.max_tokens=96")
    evaluate.add_argument("--run", dest="run_dir", type=Path, metavar="RUN_DIR",
                          help="evaluate that run's recorded held-out prompts (its split.json), by default with its "
                               "latest checkpoint; with --data, refuse prompts the run trained on")
    evaluate.add_argument("--model", help="model spec or checkpoint folder (default: the config's model.student; "
                                          "with --run: its latest checkpoint)")
    evaluate.add_argument("--step", type=like_setting(RunConfig, "steps"),
                          help="with --run: the checkpoint of that step (run.keep_checkpoints keeps several)")
    evaluate.add_argument("--data", help="data spec to evaluate instead of the config's held-out split (all its items; "
                                         "default: eval.data when set)")
    evaluate.add_argument("--fresh", action="store_true",
                          help="with --run and --data: draw the data past every prompt the run's data holds "
                               "(train and held-out) instead of refusing an overlap")
    evaluate.add_argument("--split", choices=("all", "train", "eval"), default="eval",
                          help="without --data: which part of the config's split (default: eval)")
    evaluate.add_argument("--samples", type=like_setting(EvalConfig, "samples"),
                          help="k answers a prompt: avg@k and the unbiased pass@k for k = 1, 2, 4, ... and k "
                               "(default: eval.samples, 1)")
    for flag, name, what in (("--temperature", "temperature", "sampling temperature, 0 greedy"),
                             ("--top-p", "top_p", "nucleus mass, 1 off"), ("--top-k", "top_k", "top-k, 0 off"),
                             ("--min-p", "min_p", "min-p, 0 off"),
                             ("--max-tokens", "max_tokens", "most tokens an answer")):
        evaluate.add_argument(flag, dest=name, type=like_setting(EvalConfig, name),
                              help=f"{what} (default: eval.{name}, {getattr(EvalConfig(), name)})")
    evaluate.add_argument("--engine", choices=("local", "vllm"),
                          help="local: in process (HF generate); vllm: vLLM servers of the model, launched as training "
                               "launches the student's ([engine] settings) unless --server (default: vllm with "
                               "--server, or with --run when the run's engine.kind is 'vllm' or 'vllm_colocate': the "
                               "run's own engine; else local)")
    evaluate.add_argument("--server", metavar="URL",
                          help="a running vLLM server that serves the model (its tokenizer is read from --model or the "
                               "config's model.student)")
    evaluate.add_argument("--seed", type=like_setting(RunConfig, "seed"), default=0,
                          help="sampling seed for avg@k, as run.seed takes it (default: 0)")
    evaluate.add_argument("--out", type=Path, default=Path("runs/eval"), help="output folder (default: runs/eval)")


def _eval(args: argparse.Namespace) -> None:
    """Arguments to a call of `selfopd.run.evaluate.run_evaluation`, which chooses nothing the flags say."""
    from selfopd.config import load_config
    from selfopd.data.split import distinct_prompts
    from selfopd.run.evaluate import eval_engine_kind, eval_set, run_evaluation
    from selfopd.run.verifier_isolation import use_verifier_isolation

    if args.engine == "local" and args.server:
        raise UserError("--server URL samples on that vLLM server: drop --engine local (or --server)")
    if args.run_dir is not None and args.config is not None:
        raise UserError("give either a CONFIG or --run RUN_DIR (whose config is used), not both")
    if args.fresh and (args.run_dir is None or args.data is None):
        raise UserError("--fresh needs --run RUN_DIR and --data SPEC: it draws SPEC past the run's prompts")
    check_output_folder(args.out, "--out")  # before the answers are computed, not when they are written
    config = load_run_config(args.run_dir, args.overrides) if args.run_dir else load_config(args.config, args.overrides)
    use_verifier_isolation(config.verifier.isolation)
    flags = {name: value for name in SAMPLING if (value := getattr(args, name)) is not None}
    sampling = {name: flags.get(name, getattr(config.eval, name)) for name in SAMPLING}
    if sampling["samples"] > 1 and sampling["temperature"] == 0:
        raise UserError(f"--samples {sampling['samples']} (avg@k) needs --temperature > 0: greedy samples are identical")
    config = dataclasses.replace(config, eval=dataclasses.replace(config.eval, **flags))
    if args.step is not None and (args.run_dir is None or args.model):
        raise UserError("--step needs --run RUN_DIR (and no --model): it names one of the run's checkpoints")
    if args.step is not None:  # one line naming the steps kept when that step's checkpoint is not
        args.model = str(RunFolder(args.run_dir).kept_checkpoint(args.step))
    model = args.model or (_run_model(args.run_dir, config.model.student) if args.run_dir else config.model.student)
    chosen = eval_set(config, args.data, args.split, args.run_dir, args.fresh)
    kind = eval_engine_kind(args.engine, args.server, config if args.run_dir else None)
    if kind == "vllm" and args.engine is None and args.server is None:
        print(f"sampling on vLLM, as {args.run_dir} trained (engine.kind = {config.engine.kind!r}); --engine local "
              "samples in process")
    accuracy, _ = run_evaluation(config, chosen.examples, args.out, model=model, kind=kind, server=args.server,
                                 seed=args.seed)
    summary = json.loads((args.out / "summary.json").read_text())
    print(f"{model} on {chosen.what} with {summary['template']}: accuracy {accuracy} "
          f"({len(chosen.examples)} items, {distinct_prompts(chosen.examples)} distinct prompts)")
    print(at_k_line(summary))
    print(f"truncated at eval.max_tokens: {summary['truncated_share']:.1%} of answers; no answer graded: "
          f"{summary['no_answer_share']:.1%} ({'eval' if config.eval.truncated else 'verifier'}.truncated = "
          f"{summary['verifier']['truncated']!r})")
    print(f"wrote {args.out / 'eval.jsonl'} and {args.out / 'summary.json'}")


SAMPLING = ("samples", "temperature", "top_p", "top_k", "min_p", "max_tokens")  # flags that override [eval]


def at_k_line(summary: dict) -> str:
    """avg@k and pass@k of a summary.json, each with its 95% interval over distinct prompts."""
    names = [f"avg@{summary['k']}"] + sorted((key for key in summary if key.startswith("pass@")),
                                             key=lambda key: int(key[5:]))
    parts = [f"{name} {summary[name]['value']:.3f} [{summary[name]['ci95'][0]:.3f}, {summary[name]['ci95'][1]:.3f}]"
             for name in names]
    return f"{', '.join(parts)} (95% intervals over {summary[names[0]]['n']} distinct prompts)"


def _run_model(run_dir: Path, student: str) -> str:
    """What `eval --run RUN` evaluates: the run's newest complete checkpoint. A run whose checkpoints are
    all incomplete or damaged is refused, naming why (it silently fell back to the starting model);
    one that stopped before its first checkpoint evaluates model.student, saying so."""
    folder = RunFolder(run_dir)
    if (latest := folder.latest_checkpoint()) is not None:
        return str(latest)
    problems = [checkpoint_problem(path, folder.trainer_state(path)) for path in folder.checkpoint_folders()]
    if problems:
        raise UserError(f"{run_dir}: no complete checkpoint to evaluate ({'; '.join(map(str, problems))}); pass "
                        "--model to evaluate another model")
    print(f"selfopd: warning: {run_dir} has no checkpoint yet: evaluating its starting model, {student}",
          file=sys.stderr)
    return student
