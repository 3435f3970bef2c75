"""Memory of the bf16 training scheme, measured, and why pure bf16 weights lose small updates.

    python -m experiments.benchmarks.precision_memory                 # packaged SmolLM2-135M, CPU, < 1 min
    python -m experiments.benchmarks.precision_memory --lr 1e-5

model.dtype = 'bfloat16' means fp32 master weights and fp32 AdamW state, forward and
backward under bf16 autocast. Three schemes, one forward/backward of the same batch (a
causal-LM loss on fixed text) and one AdamW step each:

  fp32              fp32 weights, fp32 compute
  bf16              bf16 weights, so bf16 gradients and bf16 AdamW state (torch makes the
                    state in the weights' dtype), bf16 compute
  fp32+autocast     fp32 weights and AdamW state, bf16 compute (the chosen scheme)

Per scheme: bytes of parameters, gradients and AdamW state (sums of tensor sizes after the
step), bytes that autograd saved for backward beyond the parameters themselves, and the
share of weights with a non-zero gradient that the step left exactly unchanged. AdamW's
first step moves every such weight by about lr; a bf16 weight w only changes when that is
above half its spacing, about |w| * 2^-9, so at lr 1e-6 nearly every weight above 1e-3 in
size keeps its value. JSON in runs/benchmarks/ (the shipped copy:
`--out experiments/benchmarks/results/precision_memory.json`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

ROOT = Path(__file__).resolve().parents[2]
TEXT = ("On-policy distillation trains a student on its own samples: a teacher scores every token the student "
        "wrote, and the student moves towards the tokens the teacher prefers. ")


@dataclass(frozen=True)
class Scheme:
    """How weights are stored and in which dtype the forward and backward run."""

    name: str
    weight_dtype: torch.dtype
    autocast: bool


SCHEMES = (
    Scheme("fp32", torch.float32, autocast=False),
    Scheme("bf16", torch.bfloat16, autocast=False),
    Scheme("fp32+autocast", torch.float32, autocast=True),
)


def tensor_bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


@contextlib.contextmanager
def saved_for_backward(model: torch.nn.Module) -> Iterator[dict[int, int]]:
    """{storage address: bytes} of what autograd saves for backward, parameters left out
    (they are held anyway); each storage counted once."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield saved


def saved_bytes(model: torch.nn.Module, ids_BT: torch.Tensor, autocast: bool) -> int:
    """Bytes autograd keeps for the backward of one forward over `ids_BT` (graph then dropped)."""
    context = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with saved_for_backward(model) as saved, context:
        model(input_ids=ids_BT, labels=ids_BT)
    return sum(saved.values())


def measure(scheme: Scheme, model_dir: Path, ids_BT: torch.Tensor, lr: float,
            long_BT: torch.Tensor) -> dict[str, Any]:
    """One forward/backward and one AdamW step under `scheme`: bytes held, and updates lost."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(scheme.weight_dtype)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    before = [p.detach().clone() for p in model.parameters()]
    tick = time.perf_counter()
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if scheme.autocast else contextlib.nullcontext()
    with saved_for_backward(model) as saved, autocast:
        loss = model(input_ids=ids_BT, labels=ids_BT).loss
    loss.backward()
    grads = [p.grad.detach().clone() for p in model.parameters()]
    optimizer.step()
    seconds = time.perf_counter() - tick

    moved = touched = 0
    for old, new, grad in zip(before, model.parameters(), grads):
        has_grad = grad != 0
        touched += int(has_grad.sum())
        moved += int((has_grad & (new.detach() != old)).sum())
    state = [t for per_param in optimizer.state.values() for t in per_param.values()]
    result = {
        "weight_dtype": str(scheme.weight_dtype).removeprefix("torch."),
        "compute_dtype": "bfloat16" if scheme.autocast else str(scheme.weight_dtype).removeprefix("torch."),
        "params": sum(p.numel() for p in model.parameters()),
        "param_bytes": tensor_bytes(model.parameters()),
        "grad_bytes": tensor_bytes(p.grad for p in model.parameters()),
        "adamw_state_bytes": tensor_bytes(state),
        "saved_for_backward_bytes": sum(saved.values()),
        "loss": loss.item(),
        "weights_with_grad": touched,
        "unchanged_share": 1 - moved / touched,
        "seconds": seconds,
    }
    # Saved bytes = a fixed part (autocast's bf16 copies of the weights) + a part per token.
    tokens, long_tokens = ids_BT.numel(), long_BT.numel()
    result["saved_for_backward_bytes_long"] = saved_bytes(model, long_BT, scheme.autocast)
    per_token = (result["saved_for_backward_bytes_long"] - result["saved_for_backward_bytes"]) / (long_tokens - tokens)
    result["saved_bytes_per_token"] = per_token
    result["saved_bytes_fixed"] = result["saved_for_backward_bytes"] - per_token * tokens
    result["persistent_bytes"] = result["param_bytes"] + result["grad_bytes"] + result["adamw_state_bytes"]
    result["persistent_bytes_per_param"] = result["persistent_bytes"] / result["params"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="packaged name, folder or hub id")
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "benchmarks" / "precision_memory.json")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from selfopd.core.models import resolve_model

    model_dir = resolve_model(args.model)
    text_ids = AutoTokenizer.from_pretrained(model_dir).encode(TEXT)
    ids = torch.tensor(text_ids * (1 + 4 * args.batch * args.length // len(text_ids)))
    ids_BT = ids[: args.batch * args.length].view(args.batch, args.length)
    long_BT = ids[: args.batch * args.length * 4].view(args.batch, 4 * args.length)  # separates fixed from per-token
    results = {scheme.name: measure(scheme, model_dir, ids_BT, args.lr, long_BT) for scheme in SCHEMES}

    mb = lambda n: n / 1e6  # noqa: E731
    print(f"{args.model}, batch {args.batch} x {args.length} tokens, one AdamW step at lr {args.lr:g}")
    print(f"{'scheme':<15}{'params MB':>10}{'grads MB':>10}{'AdamW MB':>10}{'total MB':>10}{'B/param':>8}"
          f"{'saved MB':>10}{'fixed MB':>10}{'kB/token':>10}{'unchanged':>11}")
    for name, r in results.items():
        print(f"{name:<15}{mb(r['param_bytes']):>10.0f}{mb(r['grad_bytes']):>10.0f}{mb(r['adamw_state_bytes']):>10.0f}"
              f"{mb(r['persistent_bytes']):>10.0f}{r['persistent_bytes_per_param']:>8.1f}"
              f"{mb(r['saved_for_backward_bytes']):>10.0f}{mb(r['saved_bytes_fixed']):>10.0f}"
              f"{r['saved_bytes_per_token'] / 1e3:>10.1f}{r['unchanged_share']:>11.2%}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model": args.model, "lr": args.lr, "batch": args.batch, "length": args.length,
                                    "torch": torch.__version__, "device": "cpu", "schemes": results}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
