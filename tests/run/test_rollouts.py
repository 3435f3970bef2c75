"""Saved rollouts read back: a record whose logprobs, advantages or reward are not finite numbers is
an error naming the file, the line, the rollout and the value, and `selfopd diagnose` says so in
one line instead of reporting NaN."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from selfopd.cli import main
from selfopd.run.rollouts import DiagnosticsError, NonFiniteRecord, read_records, read_run_rollouts

SMALL = ["data.spec=rg:chain_sum?min_terms=2&max_terms=2&size=60&seed=2", "data.eval_size=4",
         "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_tokens=6",
         "optim.micro_batch_prompts=1", "eval.max_tokens=6", "eval.batch_size=4", "run.progress=false",
         "run.eval_every=0", "run.steps=1", "run.rollouts_to_save=4"]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, tiny_model_dir) -> Path:
    out = tmp_path_factory.mktemp("finished")
    sets = [*SMALL, f"model.student={tiny_model_dir}", f"run.out_dir={out}", "run.name=done"]
    assert main(["train", "experiments/demo/demo.toml", *[arg for s in sets for arg in ("--set", s)]]) == 0
    return out / "done"


def _spoil(step_file: Path, row: int, field: str, index: int | None, value) -> None:
    """Set one number of the saved record on line `row` (1-based) as json.dumps writes it (NaN, Infinity)."""
    lines = step_file.read_text().splitlines()
    record = json.loads(lines[row - 1])
    if index is None:
        record[field] = value
    else:
        record[field][index] = value
    lines[row - 1] = json.dumps(record)
    step_file.write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize("field, index, value, shown", [
    ("teacher_logprobs", 0, math.nan, "nan"), ("student_logprobs", 1, math.inf, "inf"),
    ("advantage", 2, -math.inf, "-inf"), ("sampler_logprobs", 0, "0.5", "'0.5'"), ("reward", None, math.nan, "nan"),
])
def test_a_saved_number_that_is_not_finite_names_the_file_line_and_value(finished_run, tmp_path, field, index, value,
                                                                         shown):
    step_file = tmp_path / "step_00001.jsonl"
    step_file.write_text((finished_run / "rollouts" / "step_00001.jsonl").read_text())
    _spoil(step_file, 3, field, index, value)
    label = field if index is None else f"{field}[{index}]"
    with pytest.raises(DiagnosticsError, match=rf"^{re.escape(str(step_file))}:3: rollout '.+' \(step 1\): "
                                               rf"{re.escape(label)} is {re.escape(shown)}, not a finite number"):
        read_records(step_file)


def test_diagnose_names_the_file_and_row_of_a_nan_instead_of_reporting_nan(finished_run, tmp_path, capsys):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    _spoil(run / "rollouts" / "step_00001.jsonl", 2, "teacher_logprobs", 1, math.nan)
    assert main(["diagnose", str(run), "--no-model", "--transfer-items", "0"]) == 1
    captured = capsys.readouterr()
    lines = [line for line in captured.err.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    assert re.search(rf"^selfopd: error: {re.escape(str(run))}/rollouts/step_00001\.jsonl:2: rollout '.+' \(step 1\): "
                     r"teacher_logprobs\[1\] is nan, not a finite number", lines[0]), lines[0]
    assert "nan" not in captured.out


def test_a_step_the_trainer_skipped_is_left_out_with_a_warning_and_any_other_nan_is_an_error(finished_run, tmp_path,
                                                                                              capsys):
    """A step whose loss was not finite is skipped by the trainer, and its saved rollouts may hold the NaN that
    caused it: the diagnosis leaves that step out and says so. A NaN in a step the trainer took is an altered file."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    rollouts = run / "rollouts"
    shutil.copy(rollouts / "step_00001.jsonl", rollouts / "step_00002.jsonl")
    _spoil(rollouts / "step_00002.jsonl", 2, "teacher_logprobs", 0, math.nan)
    with pytest.raises(NonFiniteRecord, match=r"step_00002\.jsonl:2: .* in a step the trainer did not skip"):
        read_run_rollouts(run)
    with (run / "metrics.jsonl").open("a") as metrics:
        metrics.write(json.dumps({"step": 2, "skipped": "nonfinite loss"}) + "\n")
    assert sorted(read_run_rollouts(run)) == [1]
    assert re.search(r"^selfopd: warning: .*step_00002\.jsonl: step 2 left out: the trainer skipped it",
                     capsys.readouterr().err)
    (rollouts / "step_00001.jsonl").unlink()
    with pytest.raises(DiagnosticsError, match="every saved step was skipped"):
        read_run_rollouts(run)


@pytest.mark.parametrize("field, value, shown", [("completion_ids", 10**12, "1000000000000"), ("completion_ids", -1, "-1"),
                                                 ("prompt_ids", 1.5, "1.5"), ("prompt_ids", True, "True")])
def test_a_saved_token_id_that_is_not_one_names_the_file_and_line(finished_run, tmp_path, field, value, shown):
    step_file = tmp_path / "step_00001.jsonl"
    step_file.write_text((finished_run / "rollouts" / "step_00001.jsonl").read_text())
    _spoil(step_file, 2, field, 0, value)
    with pytest.raises(DiagnosticsError, match=rf"^{re.escape(str(step_file))}:2: rollout '.+' \(step 1\): "
                                               rf"{field}\[0\] is {re.escape(shown)}, not a token id"):
        read_records(step_file)
