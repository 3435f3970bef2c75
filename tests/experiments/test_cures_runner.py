"""experiments/cures/run.py keeps the comparison across checkouts: a finished run's records
(not its weights) are archived in one .tar.xz file, and a new checkout's runner copies them
back so the comparison skips them."""

from __future__ import annotations

import dataclasses
import importlib
import json
from pathlib import Path

import pytest

from selfopd.comparisons.compare import load_compare_config
from selfopd.comparisons.records import RecordArchive

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def runner(tmp_path, monkeypatch):
    module = importlib.import_module("experiments.cures.run")
    monkeypatch.setattr(module, "ARCHIVE", tmp_path / "cures_runs.tar.xz")
    monkeypatch.setattr(module, "SELECTION", tmp_path / "selection_shipped.json")
    return module


def _finished_run(run_dir: Path) -> dict[str, bytes]:
    """A run folder as training leaves it; returns the files that are records (not weights, not plots)."""
    records = {
        "finished.json": b'{"arm": "rlsd", "seed": 1}',
        "metrics.jsonl": b'{"step": 1}\n',
        "eval/step_00012/eval.jsonl": b'{"correct": true}\n',
        "fresh_eval/summary.json": b'{"accuracy": 0.5}',
        "rollouts/step_00012.jsonl": b'{"completion_ids": [1, 2]}\n',
        "diagnostics/summary.json": b'{"illusion": {}}',
    }
    for name, data in {**records, "checkpoints/step_00012/model.safetensors": b"weights", "plots/curves.png": b"png",
                       "diagnostics/figures/lift.png": b"png", "diagnostics/signals.html": b"<html>", ".lock": b"123"}.items():
        (run_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / name).write_bytes(data)
    return records


def test_a_finished_run_is_archived_without_weights_and_restored_into_a_new_checkout(runner, tmp_path):
    out = tmp_path / "runs"
    config = dataclasses.replace(load_compare_config(ROOT / "experiments" / "cures" / "arms.toml"), out_dir=out)
    run_dir = config.arm_dir("rlsd", 1)
    records = _finished_run(run_dir)
    (config.folder / "timing.jsonl").write_text('{"what": "rlsd seed 1"}\n')
    runner.archive(config, run_dir)

    archive = RecordArchive(runner.ARCHIVE, "cures_demo")  # rollouts not in the current format are kept whole
    assert set(archive.names("arms/rlsd/seed1")) == set(records)
    assert archive.read("timing.jsonl") == b'{"what": "rlsd seed 1"}\n'

    fresh_out = tmp_path / "new_checkout" / "runs"
    runner.SELECTION.write_text(json.dumps({"selected": "three_sums"}))
    new_config = dataclasses.replace(config, out_dir=fresh_out)
    runner.restore(fresh_out, [new_config])
    restored = fresh_out / "cures_demo" / "arms" / "rlsd" / "seed1"
    assert {name: (restored / name).read_bytes() for name in records} == records
    assert not (restored / "checkpoints").exists()
    assert json.loads((fresh_out / "selection.json").read_text()) == {"selected": "three_sums"}
    assert (fresh_out / "cures_demo" / "timing.jsonl").is_file()

    # A run the checkout already holds is never overwritten by its archived copy.
    (restored / "metrics.jsonl").write_bytes(b"newer\n")
    runner.restore(fresh_out, [new_config])
    assert (restored / "metrics.jsonl").read_bytes() == b"newer\n"


def test_an_unfinished_run_is_not_restored(runner, tmp_path):
    RecordArchive(runner.ARCHIVE).write({"cures_demo/arms/routing/seed0/metrics.jsonl": b"{}\n"})
    config = dataclasses.replace(load_compare_config(ROOT / "experiments" / "cures" / "arms.toml"), out_dir=tmp_path / "runs")
    runner.restore(tmp_path / "runs", [config])
    assert not (tmp_path / "runs" / "cures_demo" / "arms" / "routing").exists()


def test_a_restored_run_without_weights_is_said_and_not_evaluated(runner, tmp_path, capsys):
    run_dir = tmp_path / "runs" / "cures_demo" / "arms" / "rlsd" / "seed1"
    run_dir.mkdir(parents=True)
    runner.fresh_eval(run_dir, "rg:chain_sum?size=10")
    assert "has no weights left" in capsys.readouterr().out
    assert not (run_dir / "fresh_eval").exists()


def test_a_task_whose_runs_were_not_kept_is_read_from_its_shipped_summary_until_a_run_exists(runner, tmp_path):
    config = dataclasses.replace(load_compare_config(ROOT / "experiments" / "cures" / "arms.toml"), out_dir=tmp_path)
    rows = json.loads((ROOT / "experiments" / "cures" / "results" / "cures_demo_summary.json").read_text())
    assert runner.shipped_rows("demo", config) == rows
    changes = runner.primary_changes("demo", config)
    assert changes == {row["name"]: row["vs_reference"]["mean"] for row in rows if row["name"] != "grpo_only"}
    assert len(changes) == 6
    assert runner.shipped_rows("sparse", config) is None  # nothing shipped for it

    _finished_run(config.arm_dir("rlsd", 1))  # a rerun has begun: its own runs decide from now on
    assert runner.shipped_rows("demo", config) is None
