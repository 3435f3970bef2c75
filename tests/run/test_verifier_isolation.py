"""selfopd.run.verifier_isolation: `verifier.isolation` decides how this process's scoring workers are
isolated, and a sandbox that cannot start stops a run or an eval before anything is made, in one line
naming the setting (it left every answer unchecked, reward 0, one warning per answer, before)."""

from __future__ import annotations

import os

import pytest

from selfopd.cli import main
from selfopd.verifiers import isolation, timeout


@pytest.fixture()
def no_bubblewrap(tmp_path, monkeypatch):
    """A machine without bwrap on PATH (the probe is cached per process: cleared before and after)."""
    path = os.environ["PATH"]
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    isolation.unavailable_reason.cache_clear()
    yield
    monkeypatch.setenv("PATH", path)
    isolation.unavailable_reason.cache_clear()
    timeout.set_isolation(None)


@pytest.mark.parametrize("command", [["train", "experiments/demo/demo.toml"], ["eval", "--out", "OUT"]])
def test_a_sandbox_that_cannot_start_stops_the_command_in_one_line(no_bubblewrap, tmp_path, capsys, command):
    command = [str(tmp_path / "runs") if word == "OUT" else word for word in command]
    assert main([*command, "--set", f"run.out_dir={tmp_path / 'runs'}"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["selfopd: error: verifier.isolation: 'sandbox': the verifier sandbox cannot start: bwrap "
                   "(bubblewrap) is not installed; install bubblewrap (apt install bubblewrap) or allow unprivileged "
                   "user namespaces, or accept the weaker audit-hook-only worker with --set verifier.isolation=limits"]
    assert not (tmp_path / "runs").exists()


def test_the_config_chooses_the_weaker_worker_explicitly(no_bubblewrap):
    from selfopd.run.verifier_isolation import use_verifier_isolation

    use_verifier_isolation("limits")
    assert timeout.isolation_mode() == "limits"
    assert timeout.run_in_worker("echo", 7, timeout_s=60) == 7
