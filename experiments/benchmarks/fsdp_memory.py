"""What one rank holds under torchrun + FSDP2: bytes of weights, gradients and AdamW state
per rank, 1 process vs N, measured after one real training step of the packaged SmolLM2.

    python -m experiments.benchmarks.fsdp_memory              # N = 2 on CPU (gloo), about a minute
    python -m experiments.benchmarks.fsdp_memory --ranks 4

Each rank loads the model with selfopd's own loader, shards it as `selfopd train` does under
torchrun (`selfopd.core.distributed.shard_model`: every decoder layer, then the rest), builds
AdamW, runs one forward/backward of a completion loss on its share of a fixed batch and one
optimizer step, then sums the local sizes of its parameter shards, their gradients and the
optimizer state. Printed as a table; JSON in runs/benchmarks/ (the shipped
copy: `--out experiments/benchmarks/results/fsdp_memory.json`).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[2]
SEQUENCES = [([1, 504, 3031, 314, 29, 216], [42, 28, 1095, 2]), ([1, 504, 3031, 314, 30, 216], [43, 28, 2])] * 4


def local_bytes(tensors) -> int:
    total = 0
    for tensor in tensors:
        tensor = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        total += tensor.numel() * tensor.element_size()
    return total


def measure(rank: int, ranks: int, model: str, rendezvous: str, out: str) -> None:
    from selfopd.core.distributed import World, share, shard_model
    from selfopd.engines.build import load_model
    from selfopd.engines.scoring import completion_logprobs

    world = World(rank=rank, size=ranks, local_rank=rank)
    if ranks > 1:
        dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=ranks)
    torch.manual_seed(0)
    student, tokenizer = load_model(model)
    shard_model(student, world)
    optimizer = torch.optim.AdamW(student.parameters(), lr=1e-6)
    logprobs, mask = completion_logprobs(student, share(SEQUENCES, world), tokenizer.pad_token_id)
    (-(logprobs * mask).sum() / mask.sum()).backward()
    optimizer.step()
    params = list(student.parameters())
    state = [value for per_param in optimizer.state.values() for value in per_param.values() if value.dim() > 0]
    row = {"rank": rank, "weights": local_bytes(params), "gradients": local_bytes(p.grad for p in params if p.grad is not None),
           "adamw_state": local_bytes(state)}
    rows = [None] * ranks
    if ranks > 1:
        dist.all_gather_object(rows, row)
        dist.destroy_process_group()
    else:
        rows = [row]
    if rank == 0:
        Path(out).write_text(json.dumps(rows))


def run(ranks: int, model: str) -> list[dict]:
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "rows.json")
        if ranks == 1:
            measure(0, 1, model, "", out)
        else:
            mp.spawn(measure, args=(ranks, model, os.path.join(folder, "rendezvous"), out), nprocs=ranks)
        return json.loads(Path(out).read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "benchmarks" / "fsdp_memory.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    single = run(1, args.model)[0]
    sharded = run(args.ranks, args.model)
    print(f"{'':>12} {'weights MB':>11} {'grads MB':>9} {'AdamW MB':>9} {'total share':>12}")
    whole = sum(single[k] for k in ("weights", "gradients", "adamw_state"))
    for label, row in [("1 process", single), *[(f"rank {r['rank']}/{args.ranks}", r) for r in sharded]]:
        total = sum(row[k] for k in ("weights", "gradients", "adamw_state"))
        print(f"{label:>12} {row['weights'] / 1e6:11.1f} {row['gradients'] / 1e6:9.1f} {row['adamw_state'] / 1e6:9.1f} "
              f"{total / whole:12.3f}")
    result = {"model": args.model, "ranks": args.ranks, "torch": torch.__version__, "backend": "gloo (CPU)",
              "one_process": single, "per_rank": sharded,
              "largest_rank_share": max(sum(r[k] for k in ("weights", "gradients", "adamw_state")) for r in sharded) / whole}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out}")


if __name__ == "__main__":
    main()
