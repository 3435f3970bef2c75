"""`selfopd drift`: how far training moved a model on prompts unrelated to it."""

from __future__ import annotations

import argparse
from pathlib import Path

from selfopd.cli.common import UserError, command, like_setting
from selfopd.config import RolloutConfig, RunConfig
from selfopd.core.run_folder import RunFolder


def add_drift_command(commands: argparse._SubParsersAction) -> None:
    drift = command(commands, "drift", _drift,
                     "how far training moved a model on prompts unrelated to it: per-token KL(trained || start) "
                     "along the trained model's own samples, with a 95%% interval over prompts")
    drift.add_argument("--run", dest="run_dir", type=Path, metavar="RUN_DIR",
                       help="a run: its latest checkpoint against its config's model.student")
    drift.add_argument("--model", help="the trained model (checkpoint folder or model spec; default: the run's latest)")
    drift.add_argument("--reference", help="the start model (default: the run's model.student)")
    drift.add_argument("--prompts", type=Path,
                       help="text file, one prompt per line (default: the 48 everyday requests shipped with selfopd)")
    drift.add_argument("--samples", type=like_setting(RolloutConfig, "samples_per_prompt"), default=2, help="samples per prompt at temperature 1 (default: 2)")
    drift.add_argument("--max-tokens", type=like_setting(RolloutConfig, "max_tokens"), default=48, help="most tokens per sample (default: 48)")
    drift.add_argument("--seed", type=like_setting(RunConfig, "seed"), default=0, help="sampling seed (default: 0)")
    drift.add_argument("--out", type=Path, default=Path("runs/drift"), help="output folder (default: runs/drift)")


def _drift(args: argparse.Namespace) -> None:
    from selfopd.config import load_config
    from selfopd.engines.build import load_model
    from selfopd.diagnostics.drift import drift, general_prompts, write_drift
    from selfopd.training.trainer import latest_checkpoint

    config = load_config(RunFolder(args.run_dir).config) if args.run_dir else None
    model = args.model or (latest_checkpoint(args.run_dir) if args.run_dir else None)
    reference = args.reference or (config.model.student if config else None)
    if model is None or reference is None:
        raise UserError("give --run RUN_DIR, or --model and --reference")
    if args.samples < 1 or args.max_tokens < 1:
        raise UserError("--samples and --max-tokens must be >= 1")
    prompts = general_prompts(args.prompts)
    from selfopd.templating.chat_format import ChatFormat

    trained, tokenizer = load_model(model, frozen=True)
    start, _ = load_model(reference, frozen=True)
    chat = ChatFormat(tokenizer, config.model.chat_template_kwargs if config else {})  # the student's
    result = drift(trained, start, chat, prompts, args.samples, args.max_tokens, args.seed)
    path = write_drift(result, args.out, str(model), str(reference))
    print(f"{model} vs {reference}: {result} ({len(prompts)} prompts)")
    print(f"wrote {path}")
