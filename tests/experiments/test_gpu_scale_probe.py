"""The scale mode of the prepared GPU check (experiments/benchmarks/gpu_scale_probe.py) runs all its
cases on the CPU with gpu_check's tiny model, started as a GPU machine starts it (gpu_check.sh
scale), and its per-phase figures agree with each other: tokens/s is tokens over seconds, FLOPs
follow the stated count, fractions of the measured matmul peak lie in (0, 1]."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a tiny model's four CPU cases, 3 steps each, in a subprocess: about 20 s

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def report(smollm2_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("probe") / "probe.json"
    result = subprocess.run(["bash", "experiments/benchmarks/gpu_check.sh", "scale", "--tiny", "--out", str(out),
                             "--tokenizer-dir", str(smollm2_dir)], cwd=ROOT, capture_output=True, text=True,
                            timeout=300, env={**os.environ, "PYTHON": sys.executable})
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(out.read_text())


def test_every_case_runs_and_reports_its_phases(report):
    from experiments.benchmarks import gpu_scale_probe

    assert list(report["cases"]) == [case.name for case in gpu_scale_probe.CASES]
    assert report["machine"]["device"] == "cpu" and report["wall_s"] < report["limit_s"]
    for name, case in report["cases"].items():
        if name == "lora" and importlib.util.find_spec("peft") is None:
            assert case == {"skipped": "needs the peft package, which is not installed here"}
            continue
        if name.startswith("compiled-"):  # GPU only
            assert case == {"skipped": "needs a CUDA device; this check runs on cpu"}
            continue
        assert "error" not in case, (name, case["error"], case.get("traceback"))
        assert 2 <= case["steps"] <= gpu_scale_probe.STEPS and case["peak_memory_gib"] is None  # CUDA only
        assert set(case["phases"]) == {"tokens"} | {key.removeprefix("time/") for key in case["phase_s_median"]}
        assert case["phases"]["tokens"]["completion"] == case["completion_tokens_per_step"]
        assert (case["trainer"]["trainable_params"] < case["trainer"]["total_params"]) == (name == "lora")


def test_the_figures_agree_with_each_other(report):
    from experiments.benchmarks.gpu_check import TINY

    peak, model = report["matmul_peak"], report["model"]
    assert peak["flop_per_s"] == pytest.approx(2 * peak["size"] ** 3 / peak["best_s"])
    # The tiny model ties its head to its input embedding: one vocab x hidden matrix is not counted in N.
    assert model["head_params"] == model["vocab_size"] * TINY["hidden_size"]
    assert model["non_embedding_params"] == model["params"] - model["head_params"]
    for name, case in report["cases"].items():
        if "phases" not in case:
            continue
        phases = dict(case["phases"])
        tokens = phases.pop("tokens")
        assert phases["train"]["tokens"] == tokens["prompt"] + tokens["completion"] > tokens["completion"] > 0
        assert phases["teacher"]["tokens"] == tokens["teacher_prompt"] + tokens["completion"]
        assert tokens["distinct_prompt"] <= tokens["prompt"]
        per_token = 4 if name == "lora" else 6  # forward + backward; LoRA: no weight gradient of frozen weights
        for phase, factor in (("train", per_token), ("teacher", 2)):
            entry = phases[phase]
            assert entry["flop"] == pytest.approx(factor * (model["non_embedding_params"] * entry["tokens"]
                                                            + model["head_params"] * tokens["completion"]))
            assert entry["flop_per_s"] == pytest.approx(entry["flop"] / entry["s"])
            assert entry["fraction_of_matmul_peak"] == pytest.approx(entry["flop_per_s"] / peak["flop_per_s"])
            assert 0 < entry["fraction_of_matmul_peak"] <= 1 or "note" in entry, (name, phase, entry)
        for phase, entry in phases.items():  # a phase timed at 0 s (nothing to do) has no rate
            rate = entry["tokens"] / entry["s"] if entry["s"] > 0 else None
            assert entry["tokens_per_s"] == (rate if rate is None else pytest.approx(rate)), (name, phase)
        sample = phases["sample"]
        assert sample["s_per_decode_step"] == pytest.approx(sample["s"] / tokens["longest_completion"])
