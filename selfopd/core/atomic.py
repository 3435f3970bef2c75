"""Whole files or none: every result a run writes goes to a temporary name in the same folder,
is flushed to disk, then renamed over its place (`os.replace` is atomic on POSIX). A process
killed at any moment leaves the old file or the new one, never half of one."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable, Iterable


def replace_atomic(path: str | Path, write: Callable[[Path], object]) -> Path:
    """Call `write(temporary)` to make the file under a temporary name beside `path` (a
    figure's `savefig`, a `write_text`), fsync it, then rename it to `path`. The temporary
    name is fixed (`.NAME.partial`), so what a killed write leaves is replaced by the next."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}.partial")
    try:
        write(temporary)
        with temporary.open("rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    return path


def write_text_atomic(path: str | Path, text: str) -> Path:
    return replace_atomic(path, lambda temporary: temporary.write_text(text, encoding="utf-8"))


def write_json_atomic(path: str | Path, value: Any) -> Path:
    """`value` as indented JSON (the layout of every summary.json)."""
    return write_text_atomic(path, json.dumps(value, indent=2) + "\n")


def write_lines_atomic(path: str | Path, rows: Iterable[Any]) -> Path:
    """One JSON line per row (the layout of every *.jsonl)."""
    return write_text_atomic(path, "".join(json.dumps(row) + "\n" for row in rows))
