"""selfopd.core.run_folder: a run folder is data. Its newest checkpoint is the newest complete one, and
its config never turns on model.trust_remote_code by itself: `eval --run`, `diagnose` and `train
--resume` refuse a folder that asks for it, naming the flag that would allow it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from selfopd.cli import main
from selfopd.config import config_to_toml, load_config
from selfopd.core.run_folder import RunFolder
from selfopd.data.split import SplitRecord, load_split

DATA = "rg:chain_sum?min_terms=2&max_terms=2&size=60&seed=2"
SETS = [f"data.spec={DATA}", "data.eval_size=4", "eval.max_tokens=4", "eval.batch_size=4", "run.progress=false"]
ASKS = "--set model.trust_remote_code=true"
EVIL = '''"""A model folder's own code: what trust_remote_code runs."""
import pathlib

pathlib.Path({marker!r}).write_text("ran")

from transformers import LlamaForCausalLM


class EvilForCausalLM(LlamaForCausalLM):
    pass
'''


def _run_folder(tmp_path: Path, model: Path, *sets: str) -> Path:
    """A run folder as `selfopd train` leaves one (config, split, a checkpoint), without training."""
    config = load_config(None, [*SETS, f"model.student={model}", f"run.out_dir={tmp_path / 'runs'}", "run.name=got",
                                *sets])
    run = RunFolder.of(config.run.out_dir, config.run.name)
    run.root.mkdir(parents=True)
    run.config.write_text(config_to_toml(config))
    SplitRecord.of(DATA, config.data.split_seed, *load_split(DATA, 4, config.data.split_seed)).write(run.root)
    shutil.copytree(model, run.checkpoint(1))
    torch.save({"optimizer": {}, "scheduler": {}, "step": 1}, run.trainer_state(run.checkpoint(1)))
    return run.root


@pytest.fixture()
def downloaded_run(tmp_path, tiny_model_dir) -> Path:
    """A run folder from elsewhere whose config sets model.trust_remote_code, and whose checkpoint's
    config.json maps the model to a .py file that writes `tmp_path/ran` when imported."""
    run = _run_folder(tmp_path, tiny_model_dir, "model.trust_remote_code=true")
    checkpoint = RunFolder(run).checkpoint(1)
    (checkpoint / "modeling_evil.py").write_text(EVIL.format(marker=str(tmp_path / "ran")))
    config = json.loads((checkpoint / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
    (checkpoint / "config.json").write_text(json.dumps(config))
    return run


def _one_line(capsys) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("selfopd: error: "), lines
    return lines[0]


@pytest.mark.parametrize("command", [["eval", "--run"], ["diagnose"], ["train", "--resume"]])
def test_a_folder_that_asks_for_remote_code_is_refused_naming_the_flag(downloaded_run, tmp_path, capsys, command):
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    assert main([*command, str(downloaded_run)]) == 1
    assert _one_line(capsys) == (
        f"selfopd: error: {downloaded_run}/config.toml: model.trust_remote_code: true in the run folder's config, "
        "which selfopd never takes from a folder (it runs the Python files of the run's models): pass "
        f"{ASKS} if you trust them")
    assert not (tmp_path / "ran").exists()
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # nothing written


def test_the_flag_on_the_command_line_lets_the_run_s_code_run(downloaded_run, tmp_path, capsys):
    out = tmp_path / "eval"
    assert main(["eval", "--run", str(downloaded_run), *ASKS.split(), "--out", str(out)]) == 0
    assert (tmp_path / "ran").read_text() == "ran"  # the user's choice, on the command line
    assert (out / "summary.json").is_file()


def test_the_command_line_may_also_turn_it_off(downloaded_run, tmp_path):
    out = tmp_path / "eval"
    assert main(["eval", "--run", str(downloaded_run), "--set", "model.trust_remote_code=false", "--out", str(out)]) == 0
    assert not (tmp_path / "ran").exists() and (out / "summary.json").is_file()


def test_the_latest_checkpoint_is_the_newest_complete_one(tmp_path, tiny_model_dir):
    run = RunFolder(_run_folder(tmp_path, tiny_model_dir))
    run.checkpoint(3).mkdir()  # a kill before its first file
    shutil.copytree(run.checkpoint(1), run.checkpoint(2))
    weights = run.checkpoint(2) / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # a full disk mid-write
    assert run.checkpoint_folders() == [run.checkpoint(1), run.checkpoint(2), run.checkpoint(3)]
    assert run.latest_checkpoint() == run.checkpoint(1)
