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

import contextlib
import io
import lzma
import os
import shutil
import tarfile
import tempfile
import uuid
from collections.abc import Callable, Iterator
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
COPY_BLOCK = 2**20  # bytes of a member copied at a time


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
    run already in the folder is never overwritten); the timing log too when the folder has none.
    Each run is written under a temporary name and renamed into place once whole, and an archive
    is read once, as a stream, after its members are checked: a damaged archive restores no run."""
    archive = _archive(keep)
    held = _holder(keep, archive)
    wanted = {}
    for arm, seed in compare.runs():
        run_dir = compare.arm_dir(arm, seed)
        relative = run_dir.relative_to(compare.folder).as_posix()
        if held(f"{relative}/finished.json") and not run_dir.exists():
            wanted[relative] = run_dir
    if archive is None:
        for relative, run_dir in wanted.items():
            _staged(run_dir, lambda staging, source=keep / relative: shutil.copytree(source, staging))
    else:
        archive.extract(wanted)
    if held(TIMING) and not (compare.folder / TIMING).exists():
        compare.folder.mkdir(parents=True, exist_ok=True)
        replace_atomic(compare.folder / TIMING, lambda temporary: temporary.write_bytes(
            (keep / TIMING).read_bytes() if archive is None else archive.read(TIMING)))
    return list(wanted.values())


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
    """One `.tar.xz` file of records, read as a stream (never whole in memory: its index of names
    and sizes is kept, a member's bytes only while they are copied) and rewritten whole (atomically,
    its members in name order with no dates, so the same records give the same bytes). `folder`:
    the folder inside it that this view reads and writes ('' for its top)."""

    def __init__(self, path: Path, folder: str = "") -> None:
        self.path, self.folder = Path(path), folder.strip("/")
        self._index: dict[str, int] | None = None

    def index(self) -> dict[str, int]:
        """{name: size} of every file of the archive ({} before it exists), read once as a stream
        whose members are checked (`read_index`)."""
        if self._index is None:
            self._index = read_index(self.path) if self.path.is_file() else {}
        return self._index

    def members(self) -> dict[str, bytes]:
        """{name: bytes} of the whole file ({} before it exists): every member in memory at once
        (at most MOST_TOTAL_BYTES), for small archives and tests; selfopd itself streams."""
        return read_members(self.path) if self.path.is_file() else {}

    def _name(self, relative: str) -> str:
        return f"{self.folder}/{relative}" if self.folder else relative

    def has(self, relative: str) -> bool:
        return self._name(relative) in self.index()

    def read(self, relative: str) -> bytes:
        """One member's bytes (KeyError: none of that name)."""
        name = self._name(relative)
        if name in self.index():
            for member, _, data in _stream(self.path):
                if member == name:
                    return data.read()
        raise KeyError(f"{self.path}: no member {name!r}")

    def names(self, relative: str = "") -> list[str]:
        """The files under `relative` (every file: ''), relative to it."""
        prefix = self._name(relative).rstrip("/") + "/" if self._name(relative) else ""
        return sorted(name[len(prefix):] for name in self.index() if name.startswith(prefix))

    def replace_folder(self, relative: str, files: dict[str, bytes], beside: dict[str, bytes] | None = None) -> None:
        """Put `files` at `relative/` in place of what was there, and `beside` at this view's top."""
        prefix = self._name(relative) + "/"
        new = {prefix + name: data for name, data in files.items()}
        new.update({self._name(name): data for name, data in (beside or {}).items()})
        self._rewrite(new, keep=lambda name: not name.startswith(prefix) and name not in new)

    def extract_folder(self, relative: str, target: Path) -> None:
        """Write the files under `relative/` into the folder `target` (see `extract`)."""
        self.extract({relative: target})

    def extract(self, folders: dict[str, Path]) -> None:
        """Write the files under each `relative/` of `folders` into its folder (one that does not
        exist), in one pass over the archive: each folder is made under a temporary name beside it
        and renamed into place once the whole archive was read, so an error restores none."""
        index, stagings, made = self.index(), {}, []
        prefixes = {self._name(relative) + "/": (relative, Path(target)) for relative, target in folders.items()}
        for relative, target in prefixes.values():
            blocker = next((p for p in (target, *target.parents) if p.exists() or p.is_symlink()), None)
            if blocker == target or (blocker is not None and not blocker.is_dir()):
                raise DataError(f"{self.path}: cannot restore {self._name(relative)!r} to {target}: {blocker} "
                                f"{'exists already' if blocker == target else 'is a file, not a folder'}")
        try:
            for name, _, data in _stream(self.path) if any(n.startswith(tuple(prefixes)) for n in index) else ():
                prefix = next((p for p in prefixes if name.startswith(p)), None)
                if prefix is not None:
                    target = prefixes[prefix][1]
                    if target not in stagings:
                        made += _make_folders(target.parent)
                        stagings[target] = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".partial",
                                                                 dir=target.parent))
                    path = stagings[target] / name[len(prefix):]
                    path.parent.mkdir(parents=True, exist_ok=True)
                    with path.open("xb") as out:
                        shutil.copyfileobj(data, out, COPY_BLOCK)
            for target, staging in stagings.items():
                os.rename(staging, target)
            made = []
        finally:
            for staging in stagings.values():
                shutil.rmtree(staging, ignore_errors=True)
            for folder in reversed(made):  # the folders made for runs that did not come back
                with contextlib.suppress(OSError):
                    folder.rmdir()

    def write(self, members: dict[str, bytes]) -> None:
        """Make the archive hold exactly `members`."""
        self._rewrite(members, keep=None)

    def _rewrite(self, new: dict[str, bytes], keep: Callable[[str], bool] | None) -> None:
        """Write the archive anew with `new` and the members of the old one that `keep` selects
        (None: none), in name order; the kept members are spooled to a temporary folder beside the
        archive, one at a time, never all in memory."""
        new = {_checked(name): data for name, data in new.items()}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=f".{self.path.name}.", suffix=".spool", dir=self.path.parent) as spool:
            kept: dict[str, Path] = {}
            if keep is not None and any(keep(name) for name in self.index()):
                for number, (name, _, data) in enumerate(_stream(self.path)):
                    if keep(name):
                        kept[name] = Path(spool) / str(number)
                        with kept[name].open("xb") as out:
                            shutil.copyfileobj(data, out, COPY_BLOCK)

            def write(temporary: Path) -> None:
                with tarfile.open(temporary, mode="w:xz", preset=9 | lzma.PRESET_EXTREME,
                                  format=tarfile.PAX_FORMAT) as tar:
                    for name in sorted({*new, *kept}):
                        info = tarfile.TarInfo(name)
                        info.mtime, info.mode = 0, 0o644
                        if name in new:
                            info.size = len(new[name])
                            tar.addfile(info, io.BytesIO(new[name]))
                        else:
                            info.size = kept[name].stat().st_size
                            with kept[name].open("rb") as data:
                                tar.addfile(info, data)

            replace_atomic(self.path, write)
            self._index = {**{name: path.stat().st_size for name, path in kept.items()},
                           **{name: len(data) for name, data in new.items()}}


def read_index(path: Path) -> dict[str, int]:
    """{name: size} of every file of a records archive, read as a bounded stream (`_stream`), its
    members checked before anything is written from it: a name twice, or a member inside another
    (`a/b` and `a/b/c`), is one DataError naming the archive and the member."""
    index: dict[str, int] = {}
    for name, size, _ in _stream(path):
        if name in index:
            raise DataError(f"{path}: member {name!r} appears twice: not a records archive")
        index[name] = size
    for name in sorted(index):
        parents = PurePosixPath(name).parents
        inside = next((parent.as_posix() for parent in parents if parent.as_posix() in index), None)
        if inside is not None:
            raise DataError(f"{path}: member {name!r} lies inside {inside!r}, which the archive holds as a file: "
                            "not a records archive")
    return index


def read_members(path: Path, most_member: int | None = None, most_total: int | None = None,
                 most_members: int | None = None) -> dict[str, bytes]:
    """{name: bytes} of every file of a records archive (`_stream`), all in memory."""
    return {name: data.read() for name, _, data in _stream(path, most_member, most_total, most_members)}


def _stream(path: Path, most_member: int | None = None, most_total: int | None = None,
            most_members: int | None = None) -> Iterator[tuple[str, int, Any]]:
    """(name, size, readable member) of each file of a records archive, in its order, read as a stream
    whose size is bounded per member, in total (what the archive unpacks to, headers included) and
    in members (by default MOST_MEMBER_BYTES, MOST_TOTAL_BYTES, MOST_MEMBERS), whatever it claims:
    an archive from elsewhere cannot fill the memory or the disk. A member must be read before the
    next is asked for. Anything else than such an archive is one DataError naming it."""
    most_member = MOST_MEMBER_BYTES if most_member is None else most_member
    most_total = MOST_TOTAL_BYTES if most_total is None else most_total
    most_members = MOST_MEMBERS if most_members is None else most_members
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
                    yield _checked(info.name, path), info.size, _Member(tar.extractfile(info), path)
    except STREAM_ERRORS as error:
        raise _unreadable(path, error) from None


STREAM_ERRORS = (tarfile.TarError, lzma.LZMAError, EOFError)  # what a damaged or cut .tar.xz raises


def _unreadable(path: Path, error: BaseException) -> DataError:
    return DataError(f"{path}: not a readable records archive ({type(error).__name__}: {error})")


class _Member:
    """A member's bytes as its archive's stream gives them: a damaged or cut archive, found while
    they are read, is one DataError naming it."""

    def __init__(self, data: Any, path: Path) -> None:
        self.data, self.path = data, path

    def read(self, size: int = -1) -> bytes:
        try:
            return self.data.read(size)
        except STREAM_ERRORS as error:
            raise _unreadable(self.path, error) from None


def _make_folders(folder: Path) -> list[Path]:
    """Make `folder` and its missing parents; returns those it made, outermost first."""
    missing = [p for p in (folder, *folder.parents) if not p.exists()][::-1]
    folder.mkdir(parents=True, exist_ok=True)
    return missing


def _staged(target: Path, fill: Callable[[Path], object]) -> None:
    """`fill(staging)` makes a folder at a new name beside `target` (which does not exist), then it
    is renamed to `target`: a failure leaves neither it nor the folders made for it."""
    made = _make_folders(target.parent)
    staging = target.parent / f".{target.name}.{uuid.uuid4().hex[:8]}.partial"
    try:
        fill(staging)
        os.rename(staging, target)
        made = []
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        for folder in reversed(made):
            with contextlib.suppress(OSError):
                folder.rmdir()


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
