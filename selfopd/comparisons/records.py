"""A comparison's finished runs kept outside its run folders (`selfopd compare --keep-records KEEP`).

Run folders live under `runs/`, which a fresh clone, another machine or a cleaned disk lacks, so
a comparison longer than one sitting would start again from nothing. As each run finishes, its
records (metrics, evals, saved rollouts, diagnostics, config, split: everything but its weights,
plots and HTML pages) are kept in KEEP, at the same paths as under the comparison's folder; a
later call copies the finished runs KEEP holds back into a comparison folder that lacks them, and
the comparison then skips them as finished. A restored run has no weights: its records are
complete, but nothing can be evaluated on it again.

KEEP is a folder (each run's files as they are, about 1-2 MB a run) or one compressed archive:
a path ending in `.tar.xz`, or a folder inside one (`study.tar.xz/comparison`: several
comparisons of a study in one file). An archive keeps a run's saved rollouts as one digest
(`rollouts/digest.jsonl`, `selfopd.run.rollouts.RolloutDigest`): every field but the per-token
logprobs and advantages, the bulk of a run's records (60% of their bytes), which no report reads (the
comparison's report reads their mean per rollout, which the digest keeps). A study's records are
then one file of a few hundred kB that a repository can hold; the archive is rewritten whole,
atomically, each time a run is kept.
"""

from __future__ import annotations

import io
import lzma
import shutil
import tarfile
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from selfopd.core.atomic import replace_atomic
from selfopd.core.run_folder import RunFolder
from selfopd.data import DataError
from selfopd.run.rollouts import DIGEST, rollout_digest_lines

if TYPE_CHECKING:
    from selfopd.comparisons.compare import CompareConfig

NOT_RECORDS = ("checkpoints", "plots", "figures", "*.html", ".lock")
TIMING = "timing.jsonl"
ARCHIVE_SUFFIX = ".tar.xz"
# Bounds on what an archive may unpack to (the largest shipped study's: 2.2 MB a member, 41 MB in all, 980 members).
MOST_MEMBER_BYTES = 64 * 2**20
MOST_TOTAL_BYTES = 1024 * 2**20
MOST_MEMBERS = 100_000


def keep_run(compare: CompareConfig, run_dir: Path, keep: Path) -> Path:
    """Keep one run's records, and the comparison's timing log, in `keep`; returns where the run's
    copy is (inside the archive, for an archive)."""
    relative = run_dir.relative_to(compare.folder)
    timing = compare.folder / TIMING
    archive = _archive(keep)
    if archive is None:
        shutil.copytree(run_dir, keep / relative, dirs_exist_ok=True, ignore=shutil.ignore_patterns(*NOT_RECORDS))
        if timing.is_file():
            shutil.copy2(timing, keep / TIMING)
        return keep / relative
    files = run_records(run_dir)
    archive.replace_folder(relative.as_posix(), files, {TIMING: timing.read_bytes()} if timing.is_file() else {})
    return keep / relative


def unkept_runs(compare: CompareConfig, keep: Path) -> list[tuple[str, int, Path]]:
    """(arm, seed, run folder) of each finished run whose records `keep` lacks (one finished by a
    call stopped before it kept them)."""
    held = _holder(keep, _archive(keep))
    return [(arm, seed, run_dir) for arm, seed in compare.runs()
            if RunFolder(run_dir := compare.arm_dir(arm, seed)).finished.is_file()
            and not held(f"{run_dir.relative_to(compare.folder).as_posix()}/finished.json")]


def keep_finished(compare: CompareConfig, keep: Path) -> list[Path]:
    """Keep every finished run that `keep` lacks."""
    return [keep_run(compare, run_dir, keep) for _, _, run_dir in unkept_runs(compare, keep)]


def restore_runs(compare: CompareConfig, keep: Path) -> list[Path]:
    """Copy back each finished run of this comparison that `keep` holds and its folder lacks (a
    run already in the folder is never overwritten); the timing log too when the folder has none."""
    restored = []
    archive = _archive(keep)
    held = _holder(keep, archive)
    for arm, seed in compare.runs():
        run_dir = compare.arm_dir(arm, seed)
        relative = run_dir.relative_to(compare.folder).as_posix()
        if not held(f"{relative}/finished.json") or run_dir.exists():
            continue
        if archive is None:
            shutil.copytree(keep / relative, run_dir)
        else:
            archive.extract_folder(relative, run_dir)
        restored.append(run_dir)
    if held(TIMING) and not (compare.folder / TIMING).is_file():
        compare.folder.mkdir(parents=True, exist_ok=True)
        if archive is None:
            shutil.copy2(keep / TIMING, compare.folder / TIMING)
        else:
            (compare.folder / TIMING).write_bytes(archive.read(TIMING))
    return restored


def run_records(run_dir: Path) -> dict[str, bytes]:
    """{path in the run folder: bytes} of what an archive keeps of a run: its records, the saved
    rollouts as one digest (kept whole when a step file is not in the current format)."""
    ignored = shutil.ignore_patterns(*NOT_RECORDS)
    files: dict[str, bytes] = {}

    def walk(folder: Path) -> None:
        names = sorted(path.name for path in folder.iterdir())
        for name in sorted(set(names) - ignored(str(folder), names)):
            path = folder / name
            if path.is_dir():
                walk(path)
            elif path.is_file():
                files[path.relative_to(run_dir).as_posix()] = path.read_bytes()

    walk(run_dir)
    digest = rollout_digest_lines(run_dir)
    if digest is not None:
        files = {name: data for name, data in files.items() if not _is_step_file(name)}
        files[f"rollouts/{DIGEST}"] = digest.encode()
    return files


def _is_step_file(name: str) -> bool:
    path = PurePosixPath(name)
    return path.parent.as_posix() == "rollouts" and path.name.startswith("step_") and path.suffix == ".jsonl"


class RecordArchive:
    """One `.tar.xz` file of records, read whole and rewritten whole (atomically, its members in
    name order with no dates, so the same records give the same bytes). `folder`: the folder inside
    it that this view reads and writes ('' for its top)."""

    def __init__(self, path: Path, folder: str = "") -> None:
        self.path, self.folder = Path(path), folder.strip("/")
        self._members: dict[str, bytes] | None = None

    def members(self) -> dict[str, bytes]:
        """{name: bytes} of the whole file ({} before it exists)."""
        if self._members is None:
            self._members = read_members(self.path) if self.path.is_file() else {}
        return self._members

    def _name(self, relative: str) -> str:
        return f"{self.folder}/{relative}" if self.folder else relative

    def has(self, relative: str) -> bool:
        return self._name(relative) in self.members()

    def read(self, relative: str) -> bytes:
        return self.members()[self._name(relative)]

    def names(self, relative: str = "") -> list[str]:
        """The files under `relative` (every file: ''), relative to it."""
        prefix = self._name(relative).rstrip("/") + "/" if self._name(relative) else ""
        return sorted(name[len(prefix):] for name in self.members() if name.startswith(prefix))

    def replace_folder(self, relative: str, files: dict[str, bytes], beside: dict[str, bytes] | None = None) -> None:
        """Put `files` at `relative/` in place of what was there, and `beside` at this view's top."""
        prefix = self._name(relative) + "/"
        members = {name: data for name, data in self.members().items() if not name.startswith(prefix)}
        members.update({prefix + name: data for name, data in files.items()})
        members.update({self._name(name): data for name, data in (beside or {}).items()})
        self.write(members)

    def extract_folder(self, relative: str, target: Path) -> None:
        """Write the files under `relative/` into the folder `target`."""
        for name in self.names(relative):
            path = target / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(self.read(f"{relative}/{name}"))

    def write(self, members: dict[str, bytes]) -> None:
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w:xz", preset=9 | lzma.PRESET_EXTREME, format=tarfile.PAX_FORMAT) as tar:
            for name in sorted(members):
                info = tarfile.TarInfo(_checked(name))
                info.size, info.mtime, info.mode = len(members[name]), 0, 0o644
                tar.addfile(info, io.BytesIO(members[name]))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        replace_atomic(self.path, lambda temporary: temporary.write_bytes(buffer.getvalue()))
        self._members = dict(members)


def read_members(path: Path, most_member: int = MOST_MEMBER_BYTES, most_total: int = MOST_TOTAL_BYTES,
                 most_members: int = MOST_MEMBERS) -> dict[str, bytes]:
    """{name: bytes} of every file of a records archive, read as a stream whose size is bounded per
    member, in total (what the archive unpacks to, headers included) and in members, whatever it claims:
    an archive from elsewhere cannot fill the memory. Anything else than such an archive is one DataError."""
    members: dict[str, bytes] = {}
    try:
        with lzma.open(path) as unpacked:
            stream = _Bounded(unpacked, most_total, path)
            with tarfile.open(fileobj=stream, mode="r|") as tar:
                for count, info in enumerate(tar, start=1):
                    if count > most_members:
                        raise DataError(f"{path}: more than {most_members} members: not a records archive")
                    if not info.isfile():
                        continue
                    if info.size > most_member:
                        raise DataError(f"{path}: member {info.name!r} is {info.size} bytes, past the "
                                        f"{most_member}-byte bound of a records file")
                    members[_checked(info.name, path)] = tar.extractfile(info).read()
    except (tarfile.TarError, lzma.LZMAError, EOFError) as error:
        raise DataError(f"{path}: not a readable records archive ({type(error).__name__}: {error})") from None
    return members


class _Bounded(io.RawIOBase):
    """A read-only stream that refuses to give more than `most` bytes of `inner`."""

    def __init__(self, inner: io.BufferedIOBase, most: int, path: Path) -> None:
        self.inner, self.left, self.most, self.path = inner, most, most, path

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        data = self.inner.read(min(len(buffer), self.left + 1))
        if len(data) > self.left:
            raise DataError(f"{self.path}: unpacks to more than {self.most} bytes, past the bound of a records archive")
        self.left -= len(data)
        buffer[: len(data)] = data
        return len(data)


def _checked(name: str, archive: Path | None = None) -> str:
    """A member name that stays inside the folder it is extracted to."""
    path = PurePosixPath(name)
    if path.is_absolute() or ".." in path.parts or not path.parts:
        raise DataError(f"{archive or 'records archive'}: member {name!r} is not a records path (absolute or with '..')")
    return path.as_posix()


def _archive(keep: Path) -> RecordArchive | None:
    """The archive that `keep` is, or is a folder inside; None for a plain folder."""
    for candidate in (keep, *keep.parents):
        if candidate.name.endswith(ARCHIVE_SUFFIX):
            inner = keep.relative_to(candidate).as_posix()
            return RecordArchive(candidate, "" if inner == "." else inner)
    return None


def _holder(keep: Path, archive: RecordArchive | None) -> Callable[[str], bool]:
    """A test of whether `keep` (that archive, when it is one) holds a file, by its path relative to it."""
    return (lambda relative: (keep / relative).is_file()) if archive is None else archive.has
