"""The GPU scale probe (experiments/benchmarks/gpu_scale_probe.py) runs its three cases on the CPU
with gpu_check's tiny model, so the script behind results/gpu_scale_probe.json cannot rot."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow  # a tiny model's three cases: about 10 s


def test_the_probe_times_every_case_on_the_cpu(smollm2_dir, tmp_path):
    from experiments.benchmarks import gpu_scale_probe

    out = tmp_path / "probe.json"
    assert gpu_scale_probe.main(["--tiny", "--out", str(out), "--tokenizer-dir", str(smollm2_dir)]) == 0
    report = json.loads(out.read_text())
    assert list(report["cases"]) == ["full", "full+jsd", "full+ckpt+jsd"]
    for case in report["cases"].values():
        assert "error" not in case and case["step_s_median"] > 0 and case["phase_s_median"]["time/train"] > 0
