"""`selfopd slurm`: the SLURM batch script of a run over several nodes (`selfopd.serving.slurm`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from selfopd.cli.common import add_overrides, command, number
from selfopd.config.settings import Bounds


def add_slurm_command(commands: argparse._SubParsersAction) -> None:
    slurm = command(commands, "slurm", _slurm,
                    "write a SLURM batch script for a run over several nodes: torchrun on the trainer nodes, "
                    "selfopd serve on the server nodes, preemption handled")
    slurm.add_argument("config", type=Path, help="TOML config of the run ([engine] kind = 'vllm')")
    add_overrides(slurm, "engine.tensor_parallel_size=2")
    slurm.add_argument("--trainer-nodes", type=number(int, Bounds(ge=1, most=4096)), required=True,
                       help="nodes of the torchrun trainer (each runs --gpus-per-node ranks)")
    slurm.add_argument("--student-nodes", type=number(int, Bounds(ge=1, most=4096)), required=True,
                       help="nodes of student vLLM servers (each runs --gpus-per-node / engine.tensor_parallel_size)")
    slurm.add_argument("--gpus-per-node", type=number(int, Bounds(ge=1, most=64)), required=True,
                       help="GPUs of every node")
    slurm.add_argument("--notice-s", type=number(int, Bounds(ge=10, most=86400)), default=180,
                       help="seconds of notice before the time limit, for the step in progress and its checkpoint "
                            "(default: 180)")
    slurm.add_argument("--partition", default="", help="#SBATCH --partition")
    slurm.add_argument("--time", default="", help="#SBATCH --time, e.g. 24:00:00")
    slurm.add_argument("--account", default="", help="#SBATCH --account")
    slurm.add_argument("--out", type=Path, default=None, help="write the script here (default: print it)")


def _slurm(args: argparse.Namespace) -> None:
    from selfopd.config import load_config
    from selfopd.serving.slurm import SlurmLayout, SlurmRun, slurm_script

    config = load_config(args.config, args.overrides)
    layout = SlurmLayout(args.trainer_nodes, args.student_nodes, args.gpus_per_node, args.notice_s, args.partition,
                         args.time, args.account)
    run = SlurmRun(str(args.config), tuple(args.overrides), config.run.name, f"{config.run.out_dir}/{config.run.name}",
                   config.teacher.kind)
    script = slurm_script(run, config.engine, layout)
    if args.out is None:
        print(script, end="")
        return
    args.out.write_text(script)
    print(f"selfopd: wrote {args.out} ({layout.nodes} nodes); submit it with: sbatch {args.out}")
