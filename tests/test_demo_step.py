"""One step of the demo itself on the real packaged SmolLM2, through the CLI: the
end-to-end check of the fast tier (`make check`). The demo's config, data, teacher
template and loss, at one step and an 8-prompt eval."""

from __future__ import annotations

import json
import math
from pathlib import Path

from safetensors.torch import load_file

from selfopd.cli import main

ROOT = Path(__file__).resolve().parents[1]


def test_one_demo_step_trains_the_real_model(tmp_path, smollm2_dir):
    sets = ["run.steps=1", f"run.out_dir={tmp_path}", "run.name=demo-step", "run.progress=false",
            "data.eval_size=8", "eval.batch_size=8"]
    assert main(["train", str(ROOT / "experiments" / "demo" / "demo.toml"), *[a for s in sets for a in ("--set", s)]]) == 0
    run_dir = tmp_path / "demo-step"
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    (step,) = [line for line in lines if "loss/pg" in line]
    assert step["step"] == 1 and math.isfinite(step["loss/pg"]) and 0 <= step["reward/accuracy"] <= 1
    assert math.isfinite(step["opd/reverse_kl"]) and step["tokens/completion"] > 0
    assert [line["step"] for line in lines if "eval/accuracy" in line] == [0, 1]

    # The step moved the weights (the demo's lr on real gradients), and the run kept what it rendered from.
    (checkpoint,) = (run_dir / "checkpoints").glob("step_*")
    trained = {k: v for f in checkpoint.glob("*.safetensors") for k, v in load_file(f).items()}
    base = {k: v for f in Path(smollm2_dir).glob("*.safetensors") for k, v in load_file(f).items()}
    moved = [k for k in base if k in trained and not (trained[k].float() == base[k].float()).all()]
    assert len(moved) > len(base) // 2, f"only {len(moved)} of {len(base)} tensors changed"
    assert "teacher/answer_note" in json.loads((run_dir / "templates" / "index.json").read_text())
    assert len((run_dir / "rollouts" / "step_00001.jsonl").read_text().splitlines()) == 32
