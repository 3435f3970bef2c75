"""The prepared GPU check (experiments/benchmarks/gpu_check.py) cannot rot: its whole plumbing
runs here on the CPU with a tiny random Qwen3, one step per case."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # minutes of real processes: the whole suite only (make test)

SCRIPT = Path(__file__).resolve().parents[1] / "experiments" / "benchmarks" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_cpu_plumbing_reports_every_case(gpu_check, smollm2_dir, tmp_path):
    broken = gpu_check.Case("broken", ("model.lora_rank=-1",))  # a case that fails must not lose the others
    out = tmp_path / "gpu_check.json"
    gpu_check.run_check(out, "cpu", tiny=True, tokenizer_dir=Path(smollm2_dir), steps=1, budget_s=120,
                        work_dir=tmp_path / "work", cases=(*gpu_check.CASES, broken))
    report = json.loads(out.read_text())

    assert report["machine"]["torch"] and report["model"]["params"] > 0
    assert set(report["cases"]) == {case.name for case in gpu_check.CASES} | {"broken"}
    for name, case in report["cases"].items():
        if "error" in case:  # e.g. 'not available: the trainer ignored model.lora_rank = 16 ...'
            assert isinstance(case["error"], str) and case["error"], name
            continue
        for key in ("step_s_median", "tokens_per_s", "train_tokens_per_s", "completion_tokens_per_step"):
            assert math.isfinite(case[key]) and case[key] > 0, (name, key)
        assert case["phase_s_median"]["time/train"] > 0 and case["phase_s_median"]["time/sample"] > 0
        assert case["trainer"]["device"] == "cpu" and case["compute_dtypes"]["train"]
    assert "full" in report["cases"] and "error" not in report["cases"]["full"]
    assert report["cases"]["full+staleness1"]["staleness"] == [0]  # the first step samples its own prompts
    assert "model.lora_rank" in report["cases"]["broken"]["error"]

    check = report["device_vs_cpu"]
    assert check["verdict"] == "pass" and check["same_rollouts"]
    assert check["weight_max_abs_diff"] == 0.0 and check["update_max_abs"] > 0  # the step moved the weights
    assert check["update_cosine"] == pytest.approx(1.0)
    assert "loss/pg" in check["metrics"] and "opd/reverse_kl" in check["metrics"]

    mixed = report["bf16_vs_fp32"]  # bf16 on the CPU: the same code a GPU runs
    assert mixed["verdict"] == "pass" and not mixed["missing_gradients"]
    assert 0 < mixed["gradient_relative_error_max"] <= mixed["gradient_tolerance"]
    assert mixed["gradient_cosine_min"] > 0.99 and mixed["two_steps_update_sign_agreement"] > 0.5


def test_ignored_settings_are_named(gpu_check):
    from selfopd.config import load_config

    config = load_config(None, ["model.device=cuda", "model.lora_rank=8", "model.gradient_checkpointing=true"])
    state = {"device": "cpu", "gradient_checkpointing": False, "trainable_params": 10, "total_params": 10}
    with pytest.raises(gpu_check.NotAvailable, match=r"model.device = 'cuda'.*gradient_checkpointing.*lora_rank = 8"):
        gpu_check.check_honoured(config, state)
    gpu_check.check_honoured(config, {"device": "cuda:0", "gradient_checkpointing": True, "trainable_params": 1,
                                      "total_params": 10})
