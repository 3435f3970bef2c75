"""The prepared GPU checks (experiments/benchmarks/gpu_check.py: `trainer` and `vllm`) cannot rot:
the trainer check's whole plumbing runs here on the CPU with a tiny random Qwen3, one step per
case, from a bare copy of the tree through gpu_check.sh; the vLLM check plans its layout."""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # minutes of real processes: the whole suite only (make test)

ROOT = Path(__file__).resolve().parents[2]
MODULE = "experiments.benchmarks.gpu_check"


@pytest.fixture(scope="module")
def gpu_check():
    return importlib.import_module(MODULE)


def cannot_run_here(case) -> bool:
    """A case the CPU plumbing may skip: it needs a GPU, or a package this machine lacks."""
    return any(need == "cuda" or importlib.util.find_spec(need) is None for need in case.requires)


def test_cpu_plumbing_reports_every_case(gpu_check, smollm2_dir, tmp_path):
    broken = gpu_check.Case("broken", ("model.lora_rank=-1",))  # a case that fails must not lose the others
    gpu_only = gpu_check.Case("gpu-only", (), ("cuda",))  # cannot run here: skipped, with its reason
    out = tmp_path / "gpu_check.json"
    gpu_check.run_check(out, "cpu", tiny=True, tokenizer_dir=Path(smollm2_dir), steps=1, budget_s=120,
                        work_dir=tmp_path / "work", cases=(*gpu_check.CASES, broken, gpu_only))
    report = json.loads(out.read_text())

    assert report["machine"]["torch"] and report["model"]["params"] > 0
    assert set(report["cases"]) == {case.name for case in gpu_check.CASES} | {"broken", "gpu-only"}
    assert report["cases"]["gpu-only"] == {"skipped": "needs a CUDA device; this check runs on cpu"}
    assert "model.lora_rank" in report["cases"].pop("broken")["error"]
    skipped = {name for name, case in report["cases"].items() if "skipped" in case}
    assert skipped == {case.name for case in (*gpu_check.CASES, gpu_only) if cannot_run_here(case)}
    for name, case in report["cases"].items():
        assert "error" not in case, (name, case["error"], case.get("traceback"))  # every case that can run, ran
        if name in skipped:
            continue
        for key in ("step_s_median", "tokens_per_s", "train_tokens_per_s", "completion_tokens_per_step"):
            assert math.isfinite(case[key]) and case[key] > 0, (name, key)
        assert case["phase_s_median"]["time/train"] > 0 and case["phase_s_median"]["time/sample"] > 0
        assert case["trainer"]["device"] == "cpu" and case["compute_dtypes"]["train"]
    assert report["cases"]["full+staleness1"]["staleness"] == [0]  # the first step samples its own prompts
    assert report["transfer"]["verdict"] == "pass" and report["transfer"]["post_step_bytes_sent"]

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


def test_the_check_runs_from_a_bare_copy_of_the_tree_with_selfopd_not_installed(gpu_check, smollm2_dir, tmp_path):
    """The GPU machine gets a copy of the tree and no `pip install`: its dry run (imports, a tiny
    model, every case's config, the weight push's wire), started by gpu_check.sh, must pass from
    such a copy, with the editable install's import hook removed, `selfopd.verifiers` and
    `selfopd.prompts` included."""
    tree = tmp_path / "tree"
    for folder in ("selfopd", "verifiers", "prompts", "experiments"):
        shutil.copytree(ROOT / folder, tree / folder, ignore=shutil.ignore_patterns("__pycache__", "results"))
    python = tmp_path / "python"  # this Python as the GPU machine's: without the editable install's hook
    python.write_text(f"#!/bin/sh\nexec {sys.executable} -c \"import runpy, sys; sys.meta_path[:] = [f for f in "
                      "sys.meta_path if 'editable' not in repr(f).lower()]; assert sys.argv[1] == '-m'; "
                      "sys.argv = sys.argv[2:]; runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)\" \"$@\"\n")
    python.chmod(0o755)
    result = subprocess.run(["bash", "../experiments/benchmarks/gpu_check.sh", "--dry-run", "--device", "cpu",
                             "--tokenizer", str(smollm2_dir), "--out", str(tmp_path / "dry.json")],
                            cwd=tree / "prompts", capture_output=True, text=True, timeout=600,
                            env={**os.environ, "PYTHONPATH": "", "PYTHON": str(python)})
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "dry.json").read_text())
    assert report["selfopd"] == str(tree / "selfopd")  # this copy, not the installed checkout
    assert report["transfer"]["verdict"] == "pass" and report["transfer"]["post_step_bytes_sent"]
    assert report["cases"] == sorted(case.name for case in gpu_check.CASES)


@pytest.mark.parametrize("gpus, teacher_gpu", [(2, 1), (3, 2), (8, 2)])
def test_the_vllm_check_plans_a_layout_that_passes_the_layout_rules(gpu_check, gpus, teacher_gpu, capsys):
    """`gpu_check vllm` places itself as a run would: the trainer on GPU 0, the servers on
    others; its plan passes `check_layout` (a trainer and a server on one GPU never would)."""
    assert gpu_check.main(["vllm", "--plan", f"--gpus={gpus}"]) == 0
    table = capsys.readouterr().out
    assert "trainer local rank 0 (weight-sync NCCL rank 0)" in table and "student server :8100" in table
    assert f"  {teacher_gpu}    " in table and "teacher server :8101" in table.split(f"  {teacher_gpu}    ")[1].split("\n")[0]
    assert gpu_check.main(["vllm", "--plan", "--gpus=1"]) == 2
    assert "needs 2 GPUs or more" in capsys.readouterr().err
