"""Whole files or none: every result a run writes goes to a temporary name in the same folder,
is flushed to disk, then renamed over its place (`os.replace` is atomic on POSIX). A process
killed at any moment leaves the old file or the new one, never half of one.

The temporary file is new and unique (created with O_CREAT | O_EXCL, which never follows a
link), and the rename replaces a link at the target rather than writing through it: a link
planted in an output folder cannot redirect a write elsewhere."""

from __future__ import annotations

import glob
import json
import os
import secrets
from pathlib import Path
from typing import Any, Callable, Iterable


def _new_temporary(path: Path) -> Path:
    """A fresh, empty file `.NAME.RANDOM.partial` beside `path`, made by this call."""
    for _ in range(100):
        temporary = path.with_name(f".{path.name}.{secrets.token_hex(6)}.partial")
        try:
            os.close(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666))
        except FileExistsError:
            continue
        return temporary
    raise FileExistsError(f"{path.parent}: no free temporary name for {path.name}")


def replace_atomic(path: str | Path, write: Callable[[Path], object]) -> Path:
    """Call `write(temporary)` to make the file under a new temporary name beside `path` (a
    figure's `savefig`, a `write_text`), fsync it, then rename it to `path`. What a killed write
    left (a hidden `.NAME.*.partial` file, never read) goes once the next write of `path` is in
    place: one process writes a file at a time (the folder locks of `selfopd.run.folder_guard`)."""
    path = Path(path)
    temporary = _new_temporary(path)
    try:
        write(temporary)
        fd = os.open(temporary, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    for left in path.parent.glob(f".{glob.escape(path.name)}.*.partial"):  # unlink removes a link, never its target
        left.unlink(missing_ok=True)
    return path


def write_text_atomic(path: str | Path, text: str) -> Path:
    return replace_atomic(path, lambda temporary: temporary.write_text(text, encoding="utf-8"))


def write_json_atomic(path: str | Path, value: Any) -> Path:
    """`value` as indented JSON (the layout of every summary.json)."""
    return write_text_atomic(path, json.dumps(value, indent=2) + "\n")


def write_lines_atomic(path: str | Path, rows: Iterable[Any]) -> Path:
    """One JSON line per row (the layout of every *.jsonl)."""
    return write_text_atomic(path, "".join(json.dumps(row) + "\n" for row in rows))
