"""What a checkpoint costs the training: today's gathered save against a sharded one written in
the background (run.checkpoint_format, run.checkpoint_async), on the packaged SmolLM2-135M with
its AdamW state, on this CPU, one process:

    python -m experiments.benchmarks.checkpoint_cost          # about 3 minutes on 2 cores
    python -m experiments.benchmarks.checkpoint_cost --out experiments/benchmarks/results/checkpoint_cost.json

Each round, side by side on the same warm process: the gathered save as `save_checkpoint` writes it
(HF weights with save_pretrained, then trainer_state.pt with the optimizer state), a sharded save
written in the foreground, and a sharded save in the background, during which a training step runs;
then the same step alone. Reported per kind (medians over --rounds after a warm-up round): the
seconds the trainer is blocked, the seconds until the checkpoint is on disk, and for the background
write how much slower the step it overlaps runs (both share 2 cores here). Under torchrun a gathered
save also sends every shard to rank 0; that part is not measured here (one process).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from selfopd.core.distributed import World
from selfopd.core.models import resolve_model
from selfopd.training.sharded_checkpoint import ShardedWriter

ROOT = Path(__file__).resolve().parents[2]


def training_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, ids: torch.Tensor) -> float:
    """One forward, backward and AdamW step on `ids`; its seconds."""
    start = time.perf_counter()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return time.perf_counter() - start


def gathered_save(model: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: Path) -> dict[str, float]:
    start = time.perf_counter()
    model.save_pretrained(folder)
    torch.save({"optimizer": optimizer.state_dict()}, folder / "trainer_state.pt")
    seconds = time.perf_counter() - start
    return {"blocked_s": seconds, "on_disk_s": seconds}


def sharded_save(model: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: Path, background: bool,
                 ids: torch.Tensor) -> dict[str, float]:
    written: list[float] = []
    start = time.perf_counter()
    writer = ShardedWriter(World(), background=background)
    writer.write(model, optimizer, folder, finish=lambda: written.append(time.perf_counter()))
    blocked = time.perf_counter() - start
    result = {"blocked_s": blocked}
    if background:
        result["overlapped_step_s"] = training_step(model, optimizer, ids)
    writer.wait()
    result["on_disk_s"] = written[0] - start
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="default: runs/benchmarks/checkpoint_cost.json")
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds after a warm-up round")
    parser.add_argument("--tokens", type=int, default=256, help="tokens of the training step's one sequence")
    args = parser.parse_args()
    out = args.out or ROOT / "runs" / "benchmarks" / "checkpoint_cost.json"
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(resolve_model("smollm2-135m-instruct"), dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    ids = torch.randint(0, model.config.vocab_size, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    training_step(model, optimizer, ids)  # the AdamW moments exist, as in any checkpoint after step 1
    rounds = []
    with tempfile.TemporaryDirectory(prefix="checkpoint-cost-") as scratch:
        for index in range(args.rounds + 1):
            folders = {kind: Path(scratch) / f"{kind}_{index}" for kind in ("gathered", "sharded", "background")}
            row = {"round": index,
                   "gathered": gathered_save(model, optimizer, folders["gathered"]),
                   "sharded": sharded_save(model, optimizer, folders["sharded"], False, ids),
                   "background": sharded_save(model, optimizer, folders["background"], True, ids),
                   "step_alone_s": training_step(model, optimizer, ids)}
            row["megabytes"] = {kind: sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) / 1e6
                                for kind, folder in folders.items()}
            rounds.append(row)
            print(json.dumps(row), flush=True)
            for folder in folders.values():
                shutil.rmtree(folder)
    measured = rounds[1:]

    def median(kind: str, key: str) -> float:
        return statistics.median(row[kind][key] for row in measured)

    step_alone = statistics.median(row["step_alone_s"] for row in measured)
    table = {kind: {"blocked_s": median(kind, "blocked_s"), "on_disk_s": median(kind, "on_disk_s"),
                    "megabytes": statistics.median(row["megabytes"][kind] for row in measured)}
             for kind in ("gathered", "sharded", "background")}
    overlapped = median("background", "overlapped_step_s")
    report = {
        "model": "smollm2-135m-instruct (fp32) + AdamW state", "processes": 1, "machine": "this CPU, 2 cores",
        "rounds": rounds, "median": table, "step_alone_s": step_alone, "overlapped_step_s": overlapped,
        "blocked_ratio_background_vs_gathered": table["background"]["blocked_s"] / table["gathered"]["blocked_s"],
        "overlapped_step_slowdown": overlapped / step_alone,
        "background_saves_s": table["gathered"]["blocked_s"] - table["background"]["blocked_s"]
        - (overlapped - step_alone),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"{'kind':<11} {'blocked s':>10} {'on disk s':>10} {'MB':>8}")
    for kind, row in table.items():
        print(f"{kind:<11} {row['blocked_s']:>10.2f} {row['on_disk_s']:>10.2f} {row['megabytes']:>8.0f}")
    print(f"step alone {step_alone:.2f} s, overlapping a background write {overlapped:.2f} s; "
          f"net saving per checkpoint {report['background_saves_s']:.2f} s\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
