"""selfopd.core.atomic: a write goes to a new temporary file beside its target and is renamed into
place; links planted in the folder never redirect it."""

from __future__ import annotations

import os
from pathlib import Path

from selfopd.core.atomic import replace_atomic, write_json_atomic, write_text_atomic


def test_a_link_at_the_old_fixed_temporary_name_is_not_written_through(tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("keep me")
    run = tmp_path / "run"
    run.mkdir()
    (run / ".summary.json.partial").symlink_to(outside)  # where the write used to go first
    write_json_atomic(run / "summary.json", {"accuracy": 0.5})
    assert outside.read_text() == "keep me"
    assert (run / "summary.json").read_text() == '{\n  "accuracy": 0.5\n}\n'
    assert not (run / "summary.json").is_symlink()


def test_a_link_at_the_target_is_replaced_not_followed(tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("keep me")
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").symlink_to(outside)
    write_text_atomic(run / "metrics.jsonl", "new\n")
    assert outside.read_text() == "keep me"
    assert not (run / "metrics.jsonl").is_symlink() and (run / "metrics.jsonl").read_text() == "new\n"


def test_each_write_gets_a_new_temporary_file_that_it_alone_made(tmp_path):
    seen: list[tuple[Path, int]] = []

    def write(temporary: Path) -> None:
        seen.append((temporary, temporary.stat().st_size))
        assert temporary.parent == tmp_path and not temporary.is_symlink()
        temporary.write_text("x")

    for _ in range(2):
        replace_atomic(tmp_path / "a.txt", write)
    assert seen[0][0] != seen[1][0] and [size for _, size in seen] == [0, 0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt"]


def test_the_written_file_keeps_the_umask_mode(tmp_path):
    old = os.umask(0o022)
    try:
        write_text_atomic(tmp_path / "a.txt", "x")
    finally:
        os.umask(old)
    assert (tmp_path / "a.txt").stat().st_mode & 0o777 == 0o644


def test_what_a_killed_write_left_goes_with_the_next_write(tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("keep me")
    run = tmp_path / "run"
    run.mkdir()
    (run / ".summary.json.0123456789ab.partial").write_text('{"accura')  # a write killed before its rename
    (run / ".summary.json.ba9876543210.partial").symlink_to(outside)
    (run / ".other.json.0123456789ab.partial").write_text("{")  # another file's: not this write's to remove
    write_json_atomic(run / "summary.json", {"accuracy": 0.5})
    assert sorted(p.name for p in run.iterdir()) == [".other.json.0123456789ab.partial", "summary.json"]
    assert outside.read_text() == "keep me"
