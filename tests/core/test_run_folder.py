"""selfopd.core.run_folder: a run folder is data. Its newest checkpoint is the newest complete one; its
config never turns on model.trust_remote_code by itself, and decides no guarded setting (launch, network,
code, data source) unless this user's selfopd wrote it: `eval --run`, `diagnose` and `train --resume`
refuse such a folder, naming the flag that would allow it. It holds no links."""

from __future__ import annotations

import json
import shlex
import shutil
from pathlib import Path

import pytest
import torch

from selfopd.cli import main
from selfopd.config import DEMO_DATA, ConfigError, config_to_toml, load_config
from selfopd.core.run_folder import CheckpointError, RunFolder, load_run_config, refuse_links
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
    run.write_config(config_to_toml(config))
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


# --- a folder from elsewhere decides nothing that starts processes, reaches the network or reads data


@pytest.fixture()
def two_users(tmp_path, monkeypatch):
    """Switch between two users' folder keys (their config folders): `as_user("me")`, `as_user("colleague")`."""
    def as_user(name: str) -> None:
        monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "users" / name))
    as_user("me")
    return as_user


HOSTILE = [  # (setting, value): what a shared folder set, and what it would have done
    ("engine.extra_server_args", "--max-num-seqs 4"),
    ("engine.student_urls", "http://203.0.113.9:8000"),
    ("engine.api_key_env", "SELFOPD_MY_API_KEY"),
    ("engine.host", "0.0.0.0"),
    ("engine.kind", "vllm"),
    ("engine.trainer_address", "203.0.113.9"),
    ("data.spec", "rg:polynomial_multiplication?size=8&seed=1"),
    ("eval.data", "rg:chain_sum?size=8&seed=3"),
    ("run.wandb_mode", "online"),
]


@pytest.mark.parametrize("command", [["eval", "--run"], ["diagnose"], ["train", "--resume"]])
@pytest.mark.parametrize("key, value", HOSTILE, ids=[key for key, _ in HOSTILE])
def test_a_colleague_s_folder_cannot_set_a_guarded_setting(two_users, tmp_path, tiny_model_dir, capsys, command, key,
                                                           value):
    """A folder another user's selfopd wrote (or anyone edited) names a guarded setting: refused in one line
    naming the setting and the --set that accepts it; nothing is written, no server started."""
    two_users("colleague")
    run = _run_folder(tmp_path, tiny_model_dir, "engine.api_key_env=SELFOPD_MY_API_KEY"
                      if key in ("engine.host", "engine.student_urls") else "run.seed=0", f"{key}={value}")
    two_users("me")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    restated = [] if key == "data.spec" else ["--set", f"data.spec={DATA}"]  # the one guarded setting left: `key`
    assert main([*command, str(run), *restated]) == 1
    line = _one_line(capsys)
    assert line.startswith(f"selfopd: error: {run}/config.toml: {key}: {value!r} in a run folder this user's selfopd "
                           "did not write (unsigned, altered, or another user's), which decides no such setting ("), line
    also = " (it also sets engine.api_key_env, which need the same)" if key in ("engine.host", "engine.student_urls") else ""
    assert line.endswith(f"--set {shlex.quote(f'{key}={value}')} to accept it{also}"), line
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_the_same_settings_from_the_user_s_own_folder_are_taken(two_users, tmp_path, tiny_model_dir):
    run = _run_folder(tmp_path, tiny_model_dir, "eval.data=rg:chain_sum?size=8&seed=3", "run.wandb_mode=online",
                      "engine.extra_server_args=--max-num-seqs 4")
    config = load_run_config(run)
    assert config.eval.data == "rg:chain_sum?size=8&seed=3" and config.engine.extra_server_args == "--max-num-seqs 4"
    two_users("colleague")  # another user, or this user after deleting the key: the folder is no longer theirs
    with pytest.raises(ConfigError, match=r"run\.wandb_mode: 'online' in a run folder this user's selfopd did not write"):
        load_run_config(run)


def test_an_edited_config_loses_its_signature_and_restating_a_setting_accepts_it(tmp_path, tiny_model_dir):
    run = RunFolder(_run_folder(tmp_path, tiny_model_dir, "data.spec=" + DEMO_DATA))
    run.config.write_text(run.config.read_text().replace('extra_server_args = ""',
                                                         'extra_server_args = "--max-num-seqs 4"'))
    with pytest.raises(ConfigError, match=r"engine\.extra_server_args: '--max-num-seqs 4' in a run folder .* "
                                          r"--set 'engine\.extra_server_args=--max-num-seqs 4' to accept it$"):
        load_run_config(run.root)
    assert load_run_config(run.root, ["engine.extra_server_args=--max-num-seqs 4"]).engine.extra_server_args \
        == "--max-num-seqs 4"
    assert load_run_config(run.root, ["engine.extra_server_args="]).engine.extra_server_args == ""


def test_an_unsigned_folder_with_every_guarded_setting_at_its_default_loads(tmp_path):
    """Folders written before signatures existed, or where no key could be made, still load when they ask for nothing."""
    run = RunFolder(tmp_path / "old")
    run.root.mkdir()
    run.config.write_text(config_to_toml(load_config(None, ["run.seed=3"])))
    assert load_run_config(run.root).run.seed == 3 and not run.signature.exists()


def test_a_signature_file_that_is_not_one_is_no_signature(tmp_path, tiny_model_dir):
    run = RunFolder(_run_folder(tmp_path, tiny_model_dir))
    for planted in ("", "hmac-sha256 " + "0" * 64, "\x00" * 10_000):
        run.signature.unlink()
        run.signature.write_text(planted)
        with pytest.raises(ConfigError, match="data.spec: .* in a run folder this user's selfopd did not write"):
            load_run_config(run.root)
    run.signature.unlink()
    run.signature.symlink_to("/dev/zero")  # a link is not followed (nor read forever)
    with pytest.raises(CheckpointError, match=r"config\.sig: a link \(to /dev/zero\), which selfopd does not follow"):
        load_run_config(run.root)


# --- links: a run folder's files are its own


@pytest.mark.parametrize("command", [["eval", "--run"], ["diagnose"], ["train", "--resume"]])
def test_a_linked_checkpoints_folder_is_refused_and_nothing_outside_is_touched(tmp_path, tiny_model_dir, capsys,
                                                                                 command):
    """A symlinked RUN/checkpoints sent pruning into the link's target (another folder's step_* deleted)."""
    run = RunFolder(_run_folder(tmp_path, tiny_model_dir))
    elsewhere = tmp_path / "elsewhere"
    run.checkpoints.rename(elsewhere)
    (elsewhere / "step_00000").mkdir()  # another folder's step, which pruning would have deleted
    run.checkpoints.symlink_to(elsewhere)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    assert main([*command, str(run.root)]) == 1
    assert _one_line(capsys) == (f"selfopd: error: {run.checkpoints}: a link (to {elsewhere}), which selfopd does not "
                                 f"follow in a run folder: it reads, writes and deletes only real files and folders "
                                 f"inside {run.root}; replace the link with a copy of what it points to")
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_a_linked_step_folder_is_no_checkpoint_and_pruning_never_follows_a_link(tmp_path, tiny_model_dir):
    """A symlinked step folder was taken as the newest, the real one pruned, then saving failed."""
    from selfopd.config import RunConfig
    from selfopd.training.outputs import prune_checkpoints

    run = RunFolder(_run_folder(tmp_path, tiny_model_dir))
    shutil.copytree(run.checkpoint(1), tmp_path / "other")
    run.checkpoint(9).symlink_to(tmp_path / "other")
    assert run.latest_checkpoint() == run.checkpoint(1) and run.checkpoint_folders() == [run.checkpoint(1)]
    with pytest.raises(CheckpointError, match=r"step_00009: a link"):
        load_run_config(run.root)
    prune_checkpoints(run, run.checkpoint(1), RunConfig(keep_checkpoints=1))
    assert run.checkpoint(1).is_dir() and (tmp_path / "other" / "config.json").is_file()


def test_a_tracker_s_own_links_are_not_read_and_not_refused(tmp_path, tiny_model_dir):
    run = RunFolder(_run_folder(tmp_path, tiny_model_dir))
    (run.wandb / "offline-run-1").mkdir(parents=True)
    (run.wandb / "latest-run").symlink_to(run.wandb / "offline-run-1")  # what wandb writes
    refuse_links(run)
