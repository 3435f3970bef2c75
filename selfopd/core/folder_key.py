"""Which run folders this user's selfopd wrote: a per-user secret key signs a run's config.toml
when the run is created, and `--resume`, `eval --run` and `diagnose` check the signature.

A run folder is data (docs/security.md): it may come from a colleague, a shared disk or an archive.
Settings that start processes, import code, name hosts, URLs or environment variables, or decide
what data is generated, downloaded or read are taken from a folder only when its config carries a
valid signature made with this user's key (`selfopd.core.run_folder.load_run_config`); anyone
else's folder must have them restated on the command line.

The key is 32 random bytes in `$XDG_CONFIG_HOME/selfopd/run-folder.key` (default `~/.config`),
readable by its owner only, made on first use. The signature is HMAC-SHA256 over the config's
bytes, in `RUN/config.sig`: copying or moving a folder keeps it valid, editing its config does not.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
import sys
from pathlib import Path

KEY_BYTES = 32
SIGNATURE_PREFIX = "hmac-sha256 "
_CONTEXT = b"selfopd run config v1\0"  # a signature made here means nothing to any other use of the key


class FolderKeyError(RuntimeError):
    """The user's folder key exists but cannot be trusted (others may read it) or read."""


def key_path() -> Path:
    """Where this user's key lives (`$XDG_CONFIG_HOME/selfopd/run-folder.key`)."""
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "selfopd" / "run-folder.key"


def _read_key(path: Path) -> bytes:
    """The key at `path`; refused when other users may read or replace it (they could sign as you)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
            raise FolderKeyError(f"{path}: readable or owned by another user (mode {stat.S_IMODE(info.st_mode):o}), "
                                 f"so anyone could sign run folders as you; delete it (a new key is made) or "
                                 f"chmod 600 it")
        key = os.read(fd, KEY_BYTES + 1)
    finally:
        os.close(fd)
    if len(key) != KEY_BYTES:
        raise FolderKeyError(f"{path}: not a selfopd key ({len(key)} bytes, expected {KEY_BYTES}); delete it and a "
                             "new one is made (run folders signed with the old key are then taken as another user's)")
    return key


def _make_key(path: Path) -> None:
    """Create the key whole or not at all; a second process making one at the same time keeps the first."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(6)}")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, secrets.token_bytes(KEY_BYTES))
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(temporary, path)  # fails if another process made it first: theirs is kept
    except FileExistsError:
        pass
    finally:
        temporary.unlink(missing_ok=True)


def user_key(create: bool) -> bytes | None:
    """This user's key (`create`: made when missing; else None when missing)."""
    path = key_path()
    if not path.exists() and not path.is_symlink():
        if not create:
            return None
        _make_key(path)
    return _read_key(path)


def signature(key: bytes, config_bytes: bytes) -> str:
    return SIGNATURE_PREFIX + hmac.new(key, _CONTEXT + config_bytes, hashlib.sha256).hexdigest()


def sign_config(config_text: str) -> str | None:
    """The signature line of a config about to be written to a new run folder; None (with one warning
    line) when no key can be made here (a read-only home): the folder is then taken as anyone else's."""
    try:
        key = user_key(create=True)
    except OSError as error:
        print(f"selfopd: warning: no run-folder key at {key_path()} ({error.strerror or error}); the run folder "
              "is written unsigned, so --resume will ask for its launch and network settings again",
              file=sys.stderr)
        return None
    assert key is not None
    return signature(key, config_text.encode("utf-8")) + "\n"


def signed_by_user(config_path: Path, signature_path: Path) -> bool:
    """Whether `config_path` carries this user's signature (False: unsigned, altered, or another user's)."""
    try:
        fd = os.open(signature_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        try:
            claimed = os.read(fd, 256).decode("ascii").strip()  # a signature line is 76 bytes; never read more
        finally:
            os.close(fd)
        config_bytes = config_path.read_bytes()
    except (OSError, UnicodeDecodeError):
        return False
    key = user_key(create=False)
    return key is not None and hmac.compare_digest(claimed, signature(key, config_bytes))
