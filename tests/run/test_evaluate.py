"""summary.json of an eval (`selfopd.run.evaluate.write_eval`): avg@k and the unbiased pass@k over
distinct prompts, checked against a brute-force count of k-subsets, and the sampling recorded."""

from __future__ import annotations

import itertools
import json

import pytest

from selfopd.core.stats import Proportion
from selfopd.run.evaluate import EvalRecord, write_eval


def _record(prompt: str, sample: int, correct: bool) -> EvalRecord:
    return EvalRecord(id=prompt, sample=sample, prompt=prompt, completion="", extracted=None, reference="1",
                      correct=correct, finish_reason="stop", completion_tokens=3)


def test_summary_reports_avg_and_pass_at_k_over_distinct_prompts(tmp_path):
    outcomes = {"p": [1, 0, 0, 0, 1, 0], "q": [0] * 6, "r": [1, 1, 1, 0, 1, 1]}
    records = [_record(prompt, i, bool(v)) for prompt, values in outcomes.items() for i, v in enumerate(values)]
    sampling = {"temperature": 1.0, "top_p": 0.9, "top_k": 0, "min_p": 0.0, "max_tokens": 8, "seed": 0}
    write_eval(tmp_path, Proportion(0, 3, 0.0, 0.0), records, "student/plain", samples=6, temperature=1.0,
               sampling=sampling)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["sampling"] == sampling and summary["k"] == 6
    assert [key for key in summary if key.startswith("pass@")] == ["pass@1", "pass@2", "pass@4", "pass@6"]
    for k in (1, 2, 4, 6):
        brute = [sum(any(s) for s in itertools.combinations(v, k)) / len(list(itertools.combinations(v, k)))
                 for v in outcomes.values()]
        assert abs(summary[f"pass@{k}"]["value"] - sum(brute) / 3) < 1e-12 and summary[f"pass@{k}"]["n"] == 3
        low, high = summary[f"pass@{k}"]["ci95"]
        assert 0 <= low <= summary[f"pass@{k}"]["value"] <= high <= 1
    assert summary["avg@6"]["value"] == pytest.approx(summary["pass@1"]["value"]) == pytest.approx((2 / 6 + 5 / 6) / 3)
