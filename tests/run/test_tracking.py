"""Metrics reach TensorBoard and Weights & Biases (offline) when run.trackers names them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from selfopd.config import load_config
from selfopd.training.trainer import train

SMALL = [
    "data.spec=rg:chain_sum?min_terms=2&max_terms=2&size=60&seed=2", "data.eval_size=4",
    "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_tokens=6",
    "optim.micro_batch_prompts=1", "optim.lr=1e-3", "eval.max_tokens=6", "eval.batch_size=4",
    "run.progress=false", "run.eval_every=0", "run.steps=2",
]


@pytest.mark.slow
def test_a_short_run_writes_tensorboard_and_wandb_events_that_read_back(tmp_path, tiny_model_dir, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("WANDB_SILENT", "true")
    config = load_config(None, [*SMALL, f"model.student={tiny_model_dir}", f"run.out_dir={tmp_path}",
                                "run.name=tracked", "run.trackers=tensorboard,wandb"])
    run_dir = train(config)
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [line for line in lines if "loss/pg" in line]

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    logged = [(event.step, event.value) for event in events.Scalars("loss/pg")]
    assert logged == [(m["step"], pytest_approx(m["loss/pg"])) for m in steps]
    accuracy = [(event.step, event.value) for event in events.Scalars("eval/accuracy")]
    assert accuracy == [(m["step"], m["eval/accuracy"]) for m in lines if "eval/accuracy" in m]

    offline = list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(offline) == 1 and offline[0].stat().st_size > 0
    history = _wandb_history(offline[0])
    rows = [row for row in history if "loss/pg" in row]
    assert [row["_step"] for row in rows] == [m["step"] for m in steps]
    assert [row["loss/pg"] for row in rows] == pytest_approx([m["loss/pg"] for m in steps])


def pytest_approx(value):
    import pytest

    return pytest.approx(value, rel=1e-6)


def _wandb_history(path: Path) -> list[dict]:
    """The history rows of an offline W&B run file. The file is a LevelDB-style log (a 7-byte
    W&B header, then 32 KiB blocks of records: crc32 (4), length (2, little end), type (1: full,
    2: first, 3: middle, 4: last), data) of wandb's own protobuf Records."""
    from wandb.proto import wandb_internal_pb2

    data, block, rows = path.read_bytes(), 32768, []
    assert data[:4] == b":W&B"
    position, pending = 7, b""
    while position + 7 <= len(data):
        if block - position % block < 7:  # a block's tail too short for a header is padding
            position += block - position % block
            continue
        length, kind = int.from_bytes(data[position + 4 : position + 6], "little"), data[position + 6]
        chunk = data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind == 0:
            break
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
    return rows
