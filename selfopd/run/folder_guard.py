"""One process per output folder: a run, a comparison or an SFT folder is locked while a
process writes it, and a folder that cannot be written is refused before any model loads.

The lock is `flock` on FOLDER/.lock, which holds the owner's PID: the OS releases it when
the process dies, so a `kill -9` never leaves a stale lock, and a second process started
on the same folder refuses at once, naming the first's PID, instead of interleaving
metrics and checkpoints with it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import tempfile
from pathlib import Path
from typing import Callable, Iterator, TypeVar

from selfopd.core.run_folder import RunFolder

T = TypeVar("T")
LOCK_NAME = ".lock"
# What a full disk, a quota or a read-only / unwritable folder raise when writing.
WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EFBIG, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS})


class FolderInUse(RuntimeError):
    """Another live process holds the folder's lock."""


class FolderNotWritable(RuntimeError):
    """A folder selfopd must write to refuses writes (permissions, read-only, full disk)."""


@contextlib.contextmanager
def folder_lock(folder: Path) -> Iterator[None]:
    """Hold FOLDER/.lock (the folder must exist) until the block ends or the process dies."""
    path = Path(folder) / LOCK_NAME
    with writing(path):
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            raise FolderInUse(f"{folder} is in use by another selfopd process (PID {holder}); wait for it to end "
                              f"or stop it (its lock {path} is released when it exits)") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the flock; the file stays (unlinking it would race a waiter)


def check_not_in_use(folder: Path) -> None:
    """Refuse at once (before any model loads) a folder another live process holds."""
    if (Path(folder) / LOCK_NAME).exists():
        with folder_lock(folder):
            pass


def refuse_finished(folder: RunFolder) -> None:
    """A fresh run never writes over a run that already logged metrics."""
    if folder.metrics.exists():
        raise FileExistsError(f"{folder.root} already holds a run: choose another run.name or resume it")


@contextlib.contextmanager
def claimed_run_folder(folder: RunFolder, config_toml: str | None) -> Iterator[None]:
    """Hold the run folder's lock; a fresh run (`config_toml` given) creates the folder and
    writes its config once it holds the lock and no other run has logged there meanwhile."""
    folder.root.mkdir(parents=True, exist_ok=True)
    with folder_lock(folder.root):
        if config_toml is not None:
            refuse_finished(folder)
            with writing(folder.config):
                folder.write_config(config_toml)
        yield


def check_writable(folder: Path) -> None:
    """Refuse a folder (or, when it does not exist yet, its nearest existing parent) in which
    a file cannot be created, before hours of work are spent on results it cannot keep."""
    folder = Path(folder)
    existing = next((p for p in (folder, *folder.parents) if p.exists()), Path("."))
    if not existing.is_dir():
        raise FolderNotWritable(f"{folder}: cannot create it: {existing} is not a folder")
    try:
        with tempfile.TemporaryFile(dir=existing, prefix=".selfopd-write-check-"):
            pass
    except OSError as error:
        raise FolderNotWritable(f"{folder}: cannot write in {existing}: {error.strerror}") from None


def is_write_failure(error: BaseException) -> bool:
    """A full disk, a quota or a refused write, as open/write, torch.save or safetensors
    report them (the last two wrap the OS error in their own exception types)."""
    if isinstance(error, OSError):
        return error.errno in WRITE_ERRNOS
    text = str(error)
    return type(error).__name__ in ("RuntimeError", "SafetensorError") and any(
        os.strerror(number) in text or f"os error {number})" in text for number in WRITE_ERRNOS
    ) or "PytorchStreamWriter failed" in text or "inline_container.cc" in text


@contextlib.contextmanager
def writing(path: Path) -> Iterator[None]:
    """Turn a failed write of `path` into a FolderNotWritable that names it (one line)."""
    try:
        yield
    except Exception as error:
        if not is_write_failure(error):
            raise
        reason = error.strerror if isinstance(error, OSError) else str(error).splitlines()[0]
        where = error.filename if isinstance(error, OSError) and error.filename else path
        raise FolderNotWritable(f"cannot write {where}: {reason}") from error


def kept_on_write_failure(folder: RunFolder, work: Callable[[], T]) -> T:
    """`work()`; a full disk or a refused write inside a run becomes one line naming the file
    and the last complete checkpoint, from which `--resume` continues."""
    try:
        return work()
    except (OSError, FolderNotWritable) as error:
        if isinstance(error, OSError) and not is_write_failure(error):
            raise
        what = str(error) if isinstance(error, FolderNotWritable) else f"{error.filename or folder.root}: {error.strerror}"
        raise FolderNotWritable(f"{what}. {stopped_run_note(folder, 'once space is freed or permissions fixed')}") from error


def stopped_run_note(folder: RunFolder, once: str) -> str:
    """What a run that stopped mid-way left (its last checkpoint, written whole before the
    failed step began) and how to go on `once` the cause is gone."""
    checkpoint = folder.latest_checkpoint()
    if checkpoint is None:
        return f"The run stopped before its first checkpoint: {once}, start it again"
    return (f"The run stopped; its last complete checkpoint {checkpoint} is intact: {once}, "
            f"continue with `selfopd train --resume {folder.root}`")
