"""selfopd.core.folder_key: the per-user key that marks the run folders this user's selfopd wrote."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from selfopd.core.folder_key import FolderKeyError, key_path, sign_config, signed_by_user, user_key


@pytest.fixture(autouse=True)
def own_config_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))


def _signed(folder: Path, text: str) -> tuple[Path, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.toml").write_text(text)
    (folder / "config.sig").write_text(sign_config(text) or "")
    return folder / "config.toml", folder / "config.sig"


def test_the_key_is_made_once_readable_by_its_owner_only(tmp_path):
    assert user_key(create=False) is None
    key = user_key(create=True)
    assert key is not None and len(key) == 32 and key_path() == tmp_path / "config" / "selfopd" / "run-folder.key"
    assert stat.S_IMODE(key_path().stat().st_mode) == 0o600 and stat.S_IMODE(key_path().parent.stat().st_mode) == 0o700
    assert user_key(create=True) == key  # not made again


def test_processes_making_the_key_at_once_agree_on_one(tmp_path):
    code = "from selfopd.core.folder_key import user_key; print(user_key(create=True).hex())"
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True) for _ in range(4)]
    keys = {proc.communicate(timeout=60)[0].strip() for proc in procs}
    assert len(keys) == 1 and keys == {user_key(create=False).hex()}
    assert [p.name for p in key_path().parent.iterdir()] == ["run-folder.key"]  # no temporary left


def test_a_signature_holds_for_its_config_only(tmp_path):
    config, signature = _signed(tmp_path / "run", "[run]\nseed = 1\n")
    assert signed_by_user(config, signature)
    config.write_text("[run]\nseed = 2\n")
    assert not signed_by_user(config, signature)
    config.write_text("[run]\nseed = 1\n")
    assert signed_by_user(config, signature)
    signature.unlink()
    assert not signed_by_user(config, signature)


def test_another_user_s_signature_is_not_this_user_s(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "colleague"))
    config, signature = _signed(tmp_path / "run", "[run]\nseed = 1\n")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "me"))
    assert not signed_by_user(config, signature)
    user_key(create=True)
    assert not signed_by_user(config, signature)


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o666])
def test_a_key_others_may_read_is_refused_naming_the_file(mode):
    user_key(create=True)
    os.chmod(key_path(), mode)
    with pytest.raises(FolderKeyError, match=rf"^{key_path()}: readable or owned by another user \(mode {mode:o}\), so "
                                             r"anyone could sign run folders as you; .* chmod 600 it$"):
        user_key(create=False)


def test_a_damaged_key_is_refused(tmp_path):
    key_path().parent.mkdir(parents=True)
    key_path().write_bytes(b"short")
    os.chmod(key_path(), 0o600)
    with pytest.raises(FolderKeyError, match=r"not a selfopd key \(5 bytes, expected 32\)"):
        user_key(create=False)


def test_no_key_where_none_can_be_made_writes_the_folder_unsigned(tmp_path, monkeypatch, capsys):
    blocked = tmp_path / "read-only"
    blocked.write_text("a file where the config folder would be")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(blocked))
    assert sign_config("[run]\n") is None
    assert "selfopd: warning: no run-folder key at" in capsys.readouterr().err
