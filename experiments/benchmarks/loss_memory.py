"""Peak memory and time of each OPD loss, chunked (selfopd.engines.kernels) vs naive.

    python -m experiments.benchmarks.loss_memory            # batch 8, length 1024, vocab 49152, hidden 576
    python -m experiments.benchmarks.loss_memory --quick    # small sizes, to try it out
    python -m experiments.benchmarks.loss_memory --chunk-size 128 --only reverse_kl,jsd

Losses: sampled-token OPD (policy gradient on the sampled tokens' logprobs), top-k reverse
KL with a tail bucket (teacher top-k as an engine returns it), full-vocabulary reverse KL,
forward KL and JSD(0.5) against an in-process teacher (its final hidden states and the
same unembedding: self-distillation). Naive = what one writes first: full (B, T, V) fp32
logits -> log_softmax -> divergence -> backward through autograd. Both reduce with
`masked_mean` and see identical inputs (fixed seed; hidden states N(0, 1), unembedding
scaled so the logits have std 3, the teacher's hidden states are the student's plus noise).

Each (loss, implementation) runs forward + backward in a fresh subprocess, which reports
its peak RSS (getrusage ru_maxrss) minus its RSS right after the inputs are made: the
memory the loss itself needed, allocator included, with nothing left over from a previous
measurement. (Import-time peaks cannot hide it: they are far below any loss's peak; and
glibc is told to map every allocation over 64 KiB on its own, so freed memory leaves RSS.) The
child's address space is capped (--max-gb) so a naive loss that does not fit fails alone
instead of waking the OOM killer. Target: chunked peak at most 1/4 of naive, same values
(max |chunked - naive| of the loss and of both gradients). Timing on a shared machine is
noisy: compare the ratios. One thread by default: with the cores shared, every parallel
op waits ~10 ms for a descheduled thread, which penalises the chunked losses' more, smaller
ops and measures the machine's load instead of the losses.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from selfopd.engines.kernels import token_logprobs_from_hidden
from selfopd.training.divergences import full_vocab_divergence, topk_reverse_kl
from selfopd.training.advantages import opd_advantage
from selfopd.training.loss import masked_mean, policy_gradient_loss

ROOT = Path(__file__).resolve().parents[2]
LOSSES = ("sampled", "topk", "reverse_kl", "forward_kl", "jsd")
TAIL_FLOOR = 1e-6
JSD_BETA = 0.5


def make_inputs(args: argparse.Namespace) -> dict[str, torch.Tensor]:
    """Student leaves with grad, a detached teacher, and what each loss reads from it."""
    g = torch.Generator().manual_seed(0)
    B, T, H, V = args.batch, args.length, args.hidden, args.vocab
    hidden = torch.randn(B, T, H, generator=g).requires_grad_(True)
    weight = (torch.randn(V, H, generator=g) * (3 / math.sqrt(H))).requires_grad_(True)
    inputs = {
        "hidden": hidden,
        "weight": weight,
        "mask": torch.ones(B, T, dtype=torch.bool),
        "teacher_hidden": hidden.detach() + 0.5 * torch.randn(B, T, H, generator=g),
    }
    if args.loss == "sampled":
        inputs["tokens"] = torch.randint(0, V, (B, T), generator=g)
        inputs["teacher_lp"] = -3 * torch.rand(B, T, generator=g)
    if args.loss == "topk":  # the engine's top-k, formed a few positions at a time
        ids, values = [], []
        with torch.no_grad():
            for start in range(0, T, 64):
                top = torch.log_softmax(inputs["teacher_hidden"][:, start : start + 64] @ weight.T, dim=-1).topk(args.k, dim=-1)
                ids.append(top.indices)
                values.append(top.values)
        inputs["topk_ids"], inputs["topk_lp"] = torch.cat(ids, dim=1), torch.cat(values, dim=1)
    return inputs


def naive_loss(loss: str, x: dict[str, torch.Tensor]) -> torch.Tensor:
    student_lp = torch.log_softmax(x["hidden"] @ x["weight"].T, dim=-1)  # (B, T, V) fp32, kept for backward
    if loss == "sampled":
        lp = student_lp.gather(-1, x["tokens"][..., None]).squeeze(-1)
        return policy_gradient_loss(lp, opd_advantage(x["teacher_lp"], lp, x["mask"]), x["mask"])
    if loss == "topk":
        top = student_lp.gather(-1, x["topk_ids"])
        student_b = torch.cat([top, torch.log((1 - top.exp().sum(-1, keepdim=True)).clamp(min=1e-30))], dim=-1)
        teacher_tail = torch.log((1 - x["topk_lp"].exp().sum(-1, keepdim=True)).clamp(min=TAIL_FLOOR))
        teacher_b = torch.cat([x["topk_lp"], teacher_tail], dim=-1)
        return masked_mean((student_b.exp() * (student_b - teacher_b)).sum(-1), x["mask"])
    with torch.no_grad():
        teacher_lp = torch.log_softmax(x["teacher_hidden"] @ x["weight"].T, dim=-1)
    if loss == "reverse_kl":
        values = (student_lp.exp() * (student_lp - teacher_lp)).sum(-1)
    elif loss == "forward_kl":
        values = (teacher_lp.exp() * (teacher_lp - student_lp)).sum(-1)
    else:  # as TRL's generalized_jsd_loss
        log_m = torch.logsumexp(torch.stack([student_lp + math.log(1 - JSD_BETA), teacher_lp + math.log(JSD_BETA)]), dim=0)
        values = JSD_BETA * (teacher_lp.exp() * (teacher_lp - log_m)).sum(-1) + (1 - JSD_BETA) * (student_lp.exp() * (student_lp - log_m)).sum(-1)
    return masked_mean(values, x["mask"])


def chunked_loss(loss: str, x: dict[str, torch.Tensor], chunk_size: int) -> torch.Tensor:
    if loss == "sampled":
        lp = token_logprobs_from_hidden(x["hidden"], x["weight"], x["tokens"], chunk_size)
        return policy_gradient_loss(lp, opd_advantage(x["teacher_lp"], lp, x["mask"]), x["mask"])
    if loss == "topk":
        values = topk_reverse_kl(x["hidden"], x["weight"], x["topk_ids"], x["topk_lp"], x["mask"], tail_floor=TAIL_FLOOR, chunk_size=chunk_size)
    else:
        values = full_vocab_divergence(
            x["hidden"], x["weight"], x["mask"], teacher_hidden_BTH=x["teacher_hidden"], teacher_weight_VH=x["weight"].detach(),
            divergence=loss, beta=JSD_BETA, chunk_size=chunk_size,
        )  # fmt: skip
    return masked_mean(values, x["mask"])


def current_rss_mb() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize() / 2**20


def child(args: argparse.Namespace) -> None:
    """One measurement; prints a JSON line and saves the gradients for the parent to compare."""
    limit = int(args.max_gb * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    torch.set_num_threads(args.threads)
    # Warm-up on tiny inputs: lazy imports (checkpointing pulls in modules) and thread
    # pools would otherwise count as the loss's time and memory.
    tiny = argparse.Namespace(**{**vars(args), "batch": 1, "length": 3, "vocab": 64, "hidden": 8, "k": min(args.k, 64)})
    for _ in range(2):
        (naive_loss(args.loss, make_inputs(tiny)) if args.impl == "naive" else chunked_loss(args.loss, make_inputs(tiny), 2)).backward()
    x = make_inputs(args)
    baseline_mb = current_rss_mb()
    maxrss_before_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    seconds = []
    for _ in range(args.repeats):
        x["hidden"].grad = x["weight"].grad = None
        start = time.perf_counter()
        loss = naive_loss(args.loss, x) if args.impl == "naive" else chunked_loss(args.loss, x, args.chunk_size)
        loss.backward()
        seconds.append(time.perf_counter() - start)
        value = loss.item()
        del loss
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    torch.save({"hidden": x["hidden"].grad, "weight": x["weight"].grad}, args.grads)
    print(json.dumps({"peak_mb": peak_mb - baseline_mb, "import_gap_mb": maxrss_before_mb - baseline_mb,
                      "seconds": min(seconds), "loss": value}))  # fmt: skip


def measure(args: argparse.Namespace, loss: str, impl: str, grads: Path) -> dict:
    command = [sys.executable, __file__, "--child", "--loss", loss, "--impl", impl, "--grads", str(grads)]
    for flag in ("batch", "length", "vocab", "hidden", "chunk_size", "k", "threads", "repeats", "max_gb"):
        command += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    # Every allocation over 64 KiB gets its own mapping, returned to the OS when freed, so RSS
    # follows the live tensors; by default glibc keeps freed blocks of up to 32 MiB in its heap.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        reason = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        return {"error": f"did not fit or failed: {reason[:200]}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--chunk-size", type=int, default=256, help="positions per chunk (the losses' default)")
    parser.add_argument("--k", type=int, default=20, help="teacher top-k")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: on a busy machine every parallel op waits for a descheduled thread)")
    parser.add_argument("--repeats", type=int, default=1, help="forward+backward runs per measurement; the fastest is reported")
    parser.add_argument("--max-gb", type=float, default=16.0, help="address-space cap of each measurement's process")
    parser.add_argument("--only", default=",".join(LOSSES), help=f"comma-separated subset of {','.join(LOSSES)}")
    parser.add_argument("--quick", action="store_true", help="batch 2, length 256, vocab 8192, hidden 64, chunk 64")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "benchmarks" / "loss_memory.json")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--loss", choices=LOSSES, help=argparse.SUPPRESS)
    parser.add_argument("--impl", choices=("naive", "chunked"), help=argparse.SUPPRESS)
    parser.add_argument("--grads", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    if args.quick:
        args.batch, args.length, args.vocab, args.hidden, args.chunk_size = 2, 256, 8192, 64, 64

    rows = []
    print(f"batch {args.batch}, length {args.length}, vocab {args.vocab}, hidden {args.hidden}, chunk {args.chunk_size}, "
          f"top-k {args.k}, {args.threads} threads; one (B, T, V) fp32 tensor = {args.batch * args.length * args.vocab * 4 / 2**20:.0f} MB")  # fmt: skip
    header = f"{'loss':<11}{'naive MB':>10}{'chunked MB':>12}{'peak ratio':>12}{'naive s':>9}{'chunked s':>11}{'time ratio':>12}{'loss':>8}{'|d loss|':>10}{'|d grad|':>10}"
    print(header)
    with tempfile.TemporaryDirectory() as scratch:
        for loss in args.only.split(","):
            paths = {impl: Path(scratch) / f"{loss}-{impl}.pt" for impl in ("naive", "chunked")}
            result = {impl: measure(args, loss, impl, path) for impl, path in paths.items()}
            row = {"loss": loss, "naive": result["naive"], "chunked": result["chunked"]}
            if "error" not in result["naive"] and "error" not in result["chunked"]:
                naive_grads, chunked_grads = torch.load(paths["naive"], weights_only=True), torch.load(paths["chunked"], weights_only=True)
                row["peak_ratio"] = result["chunked"]["peak_mb"] / result["naive"]["peak_mb"]
                row["time_ratio"] = result["chunked"]["seconds"] / result["naive"]["seconds"]
                row["loss_abs_diff"] = abs(result["chunked"]["loss"] - result["naive"]["loss"])
                row["grad_abs_diff"] = {name: (chunked_grads[name] - naive_grads[name]).abs().max().item() for name in naive_grads}
                row["grad_abs_max"] = {name: naive_grads[name].abs().max().item() for name in naive_grads}
                print(f"{loss:<11}{result['naive']['peak_mb']:>10.0f}{result['chunked']['peak_mb']:>12.0f}{row['peak_ratio']:>12.3f}"
                      f"{result['naive']['seconds']:>9.1f}{result['chunked']['seconds']:>11.1f}{row['time_ratio']:>12.2f}"
                      f"{result['naive']['loss']:>8.3f}{row['loss_abs_diff']:>10.1e}{max(row['grad_abs_diff'].values()):>10.1e}")  # fmt: skip
            else:  # what was measured, and why the rest was not
                cells = {impl: (f"{r['peak_mb']:.0f}", f"{r['seconds']:.1f}") if "error" not in r else ("-", "-") for impl, r in result.items()}
                print(f"{loss:<11}{cells['naive'][0]:>10}{cells['chunked'][0]:>12}{'-':>12}{cells['naive'][1]:>9}{cells['chunked'][1]:>11}")
                for impl, r in result.items():
                    if "error" in r:
                        print(f"  {impl} {r['error']} (address space capped at {args.max_gb:g} GB)")
            rows.append(row)
    ratios = [row["peak_ratio"] for row in rows if "peak_ratio" in row]
    if ratios:
        print(f"worst peak ratio {max(ratios):.3f}: {'within' if max(ratios) <= 0.25 else 'ABOVE'} the 1/4 target")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    config = {key: getattr(args, key) for key in ("batch", "length", "vocab", "hidden", "chunk_size", "k", "threads", "repeats", "quick")}
    args.out.write_text(json.dumps({"config": {**config, "jsd_beta": JSD_BETA, "tail_floor": TAIL_FLOOR}, "rows": rows}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
