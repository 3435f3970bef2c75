"""A comparison's records kept outside its run folders (selfopd.comparisons.records): in a folder,
or in one .tar.xz archive that keeps the saved rollouts as a digest, and that a later call (or
`selfopd compare --keep-records`) reads back as if the runs had never left."""

from __future__ import annotations

import dataclasses
import json
import random
import tarfile
from dataclasses import asdict
from pathlib import Path

import pytest

from selfopd.comparisons.compare import load_compare_config
from selfopd.comparisons.compare_report import _teacher_preference
from selfopd.comparisons.records import RecordArchive, keep_finished, keep_run, restore_runs, unkept_runs
from selfopd.core.run_folder import RunFolder
from selfopd.data import DataError
from selfopd.diagnostics.measures import correct_preference
from selfopd.run.rollouts import RolloutRecord, read_rollout_digest, read_run_rollouts, write_records

ROOT = Path(__file__).resolve().parents[2]
ARMS = ROOT / "experiments" / "cures" / "arms.toml"


def _record(step: int, group: int, sample: int, correct: bool) -> RolloutRecord:
    teacher = [-0.5 - 0.1 * sample, -1.25 + 0.01 * step, -0.75]
    return RolloutRecord(step=step, id=f"item/{group}", group=group, prompt_ids=[1, 2, group], completion_ids=[5, 6, 7],
                         text="7 + 8 = 15.", sampler_logprobs=[-0.5, -1.0, -0.25], student_logprobs=[-0.5, -1.0, -0.3],
                         teacher_logprobs=teacher, advantage=[0.1, 0.2, 0.3], reward=float(correct), correct=correct,
                         answer="15" if correct else "14", weight_version=step - 1)


def finished_run(run_dir: Path) -> dict[str, bytes]:
    """A run folder as training leaves it: two saved steps of rollouts, weights, plots; returns
    its files that are records (not weights, not plots)."""
    for step in (1, 2):
        write_records(run_dir / "rollouts" / f"step_{step:05d}.jsonl",
                      [_record(step, group, sample, correct=sample == 0) for group in (0, 1) for sample in (0, 1)])
    records = {"finished.json": b'{"arm": "rlsd", "seed": 1}', "metrics.jsonl": b'{"step": 1}\n',
               "eval/step_00002/eval.jsonl": b'{"correct": true}\n', "fresh_eval/summary.json": b'{"accuracy": 0.5}',
               "diagnostics/summary.json": b'{"illusion": {}}'}
    for name, data in {**records, "checkpoints/step_00002/model.safetensors": b"weights", "plots/curves.png": b"png",
                       "diagnostics/figures/lift.png": b"png", "diagnostics/signals.html": b"<html>", ".lock": b"1"}.items():
        (run_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / name).write_bytes(data)
    return records


@pytest.fixture
def compare(tmp_path):
    return dataclasses.replace(load_compare_config(ARMS), out_dir=tmp_path / "runs")


@pytest.mark.parametrize("kind", ["folder", "archive", "folder inside an archive"])
def test_kept_records_come_back_into_a_new_checkout(compare, tmp_path, kind):
    keep = {"folder": tmp_path / "kept", "archive": tmp_path / "kept.tar.xz",
            "folder inside an archive": tmp_path / "study.tar.xz" / compare.name}[kind]
    run_dir = compare.arm_dir("rlsd", 1)
    records = finished_run(run_dir)
    (compare.folder / "timing.jsonl").write_text('{"what": "rlsd seed 1"}\n')
    assert unkept_runs(compare, keep) == [("rlsd", 1, run_dir)]

    kept = keep_run(compare, run_dir, keep)
    assert kept == keep / "arms" / "rlsd" / "seed1" and unkept_runs(compare, keep) == []
    new = dataclasses.replace(compare, out_dir=tmp_path / "new_checkout")
    assert restore_runs(new, keep) == [new.arm_dir("rlsd", 1)]
    restored = new.arm_dir("rlsd", 1)
    assert {name: (restored / name).read_bytes() for name in records} == records
    assert (new.folder / "timing.jsonl").read_text() == '{"what": "rlsd seed 1"}\n'
    assert not (restored / "checkpoints").exists() and not (restored / "plots").exists()
    assert not (restored / "diagnostics" / "figures").exists() and not (restored / ".lock").exists()

    full = [r for records in read_run_rollouts(run_dir).values() for r in records]
    if kind == "folder":  # a folder keeps the rollouts as they are
        assert [r for records in read_run_rollouts(restored).values() for r in records] == full
    else:  # an archive keeps their digest: every field but the per-token values, and the report's mean
        with pytest.raises(FileNotFoundError, match="only their digest"):
            read_run_rollouts(restored)
        digest = read_rollout_digest(restored)
        assert [asdict(d) for d in digest] == [
            {**{k: v for k, v in asdict(r).items()
                if k not in ("sampler_logprobs", "student_logprobs", "teacher_logprobs", "advantage")},
             "opd_mean": sum(r.opd_advantage) / len(r.opd_advantage)} for r in full]
        assert [d.prompt for d in digest] == [r.prompt for r in full]
    assert _teacher_preference([restored]) == _teacher_preference([run_dir]) == correct_preference(full)

    # A run the checkout already holds is never overwritten by its kept copy.
    (restored / "metrics.jsonl").write_bytes(b"newer\n")
    assert restore_runs(new, keep) == []
    assert (restored / "metrics.jsonl").read_bytes() == b"newer\n"


def test_an_archive_is_one_file_rewritten_whole_and_only_finished_runs_come_back(compare, tmp_path):
    archive = tmp_path / "study.tar.xz"
    for seed in (0, 1):
        finished_run(compare.arm_dir("grpo_only", seed))
    assert len(keep_finished(compare, archive / compare.name)) == 2
    other = dataclasses.replace(compare, name="cures_other")
    finished_run(other.arm_dir("rlsd", 0))
    keep_finished(other, archive / other.name)  # a second comparison of the study, in the same file
    before = archive.read_bytes()
    keep_run(other, other.arm_dir("rlsd", 0), archive / other.name)  # kept again: the same bytes
    assert archive.read_bytes() == before and list(tmp_path.glob("*.partial")) == []

    with tarfile.open(archive, "r:xz") as tar:
        names = tar.getnames()
        assert all(info.mtime == 0 for info in tar)
    assert names == sorted(names)
    assert "cures_demo/arms/grpo_only/seed0/rollouts/digest.jsonl" in names
    assert not [name for name in names if "/rollouts/step_" in name or "checkpoints" in name]
    assert RecordArchive(archive, "cures_other").names("arms/rlsd/seed0")[:2] == ["diagnostics/summary.json",
                                                                                "eval/step_00002/eval.jsonl"]

    unfinished = {f"{compare.name}/arms/routing/seed0/metrics.jsonl": b"{}\n"}
    RecordArchive(archive).write({**RecordArchive(archive).members(), **unfinished})
    new = dataclasses.replace(compare, out_dir=tmp_path / "new")
    assert restore_runs(new, archive / compare.name) == [new.arm_dir("grpo_only", 0), new.arm_dir("grpo_only", 1)]
    assert not new.arm_dir("routing", 0).exists()


def test_an_archive_refuses_members_outside_its_folder(tmp_path):
    with pytest.raises(DataError, match=r"member '\.\./escape\.txt' is not a records path"):
        RecordArchive(tmp_path / "a.tar.xz").write({"../escape.txt": b"x"})


def test_selfopd_compare_keeps_records_in_an_archive(compare, tmp_path, monkeypatch, capsys):
    """`--keep-records x.tar.xz`: finished runs are restored from it first, each run that
    finishes is kept in it (the training itself is the comparison's runner, tested in test_compare)."""
    import selfopd.comparisons.compare as compare_module
    from selfopd.cli.compare import _run_keeping_records

    archive = tmp_path / "kept.tar.xz"
    finished_run(compare.arm_dir("rlsd", 0))
    keep_run(compare, compare.arm_dir("rlsd", 0), archive)
    new = dataclasses.replace(compare, out_dir=tmp_path / "new")

    def run_compare(config, after_run):
        assert RunFolder(config.arm_dir("rlsd", 0)).finished.is_file()  # restored before anything trains
        finished_run(config.arm_dir("routing", 0))
        after_run("routing", 0, config.arm_dir("routing", 0))

    monkeypatch.setattr(compare_module, "run_compare", run_compare)
    _run_keeping_records(new, archive)
    out = capsys.readouterr().out
    assert f"restored {new.arm_dir('rlsd', 0)} from {archive}" in out
    assert f"kept the records of routing seed 0 in {archive / 'arms' / 'routing' / 'seed0'}" in out
    assert RecordArchive(archive).has("arms/routing/seed0/finished.json")
    assert json.loads(RecordArchive(archive).read("arms/routing/seed0/finished.json")) == {"arm": "rlsd", "seed": 1}


def test_the_report_of_a_comparison_kept_in_an_archive(tmp_path, monkeypatch, capsys):
    """`--report-only --keep-records FILE` on a fresh clone: the runs come back from the study's
    archive and the report covers them, teacher-prefers-correct read from the rollouts' digest."""
    from selfopd.cli import main

    monkeypatch.chdir(tmp_path)  # the comparison's folder is runs/staleness_demo under here
    study = ROOT / "experiments" / "staleness"
    archive = study / "results" / "staleness_runs.tar.xz"
    assert main(["compare", str(study / "compare.toml"), "--report-only", "--keep-records", str(archive)]) == 0
    assert capsys.readouterr().out.count(f"from {archive}") == 6
    summary = json.loads((tmp_path / "runs" / "staleness_demo" / "summary.json").read_text())
    assert [row["name"] for row in summary] == ["synchronous", "one_step_ahead"]
    assert all(len(row["per_seed"]) == 3 and row["teacher_preference"] for row in summary)


def _tar_xz(path: Path, members: list[tuple[str, int, bytes]], preset: int = 0) -> Path:
    """A .tar.xz whose headers claim `size` for each (name, size, data): data shorter than the
    claim makes a crafted archive whose size check must come before any read."""
    import io
    import lzma

    buffer = io.BytesIO()
    for name, size, data in members:
        info = tarfile.TarInfo(name)
        info.size = size
        buffer.write(info.tobuf(format=tarfile.PAX_FORMAT) + data + b"\0" * (-len(data) % 512))
    path.write_bytes(lzma.compress(buffer.getvalue() + b"\0" * 1024, preset=preset))
    return path


def test_a_member_claiming_more_than_the_bound_is_refused_before_it_is_read(tmp_path):
    archive = _tar_xz(tmp_path / "bomb.tar.xz", [("arms/a/seed0/metrics.jsonl", 2**40, b"{}\n")])
    with pytest.raises(DataError, match=rf"{tmp_path}/bomb\.tar\.xz: member 'arms/a/seed0/metrics\.jsonl' is "
                                        r"1099511627776 bytes, past the 67108864-byte bound"):
        RecordArchive(archive).members()


def test_a_real_member_past_the_bound_is_refused(tmp_path):
    """65 MiB of zeros: 10 kB packed, past the 64 MiB bound of one member."""
    archive = _tar_xz(tmp_path / "zeros.tar.xz", [("a/finished.json", 65 * 2**20, bytes(65 * 2**20))])
    assert archive.stat().st_size < 2**20
    with pytest.raises(DataError, match="member 'a/finished.json' is 68157440 bytes, past the 67108864-byte bound"):
        RecordArchive(archive).members()


def test_what_an_archive_unpacks_to_is_bounded_in_total_and_in_members(tmp_path):
    from selfopd.comparisons.records import read_members

    archive = _tar_xz(tmp_path / "many.tar.xz", [(f"a/{i}.json", 4096, bytes(4096)) for i in range(8)])
    assert len(read_members(archive)) == 8
    with pytest.raises(DataError, match=r"many\.tar\.xz: unpacks to more than 20000 bytes"):
        read_members(archive, most_total=20_000)
    with pytest.raises(DataError, match=r"many\.tar\.xz: more than 5 members"):
        read_members(archive, most_members=5)


def test_an_archive_that_is_not_one_is_one_error_naming_it(tmp_path):
    archive = tmp_path / "kept.tar.xz"
    archive.write_bytes(b"not xz at all")
    with pytest.raises(DataError, match=rf"{tmp_path}/kept\.tar\.xz: not a readable records archive"):
        RecordArchive(archive).members()


def test_an_archive_member_with_dot_dot_is_refused_on_restore(tmp_path):
    archive = _tar_xz(tmp_path / "x.tar.xz", [("../../outside.txt", 2, b"hi")])
    with pytest.raises(DataError, match=r"member '\.\./\.\./outside\.txt' is not a records path"):
        RecordArchive(archive).members()


RUN = "arms/rlsd/seed1"


@pytest.mark.parametrize("members, expected", [
    ([(f"{RUN}/finished.json", 2, b"{}"), (f"{RUN}/metrics.jsonl", 3, b"{}\n"), (f"{RUN}/metrics.jsonl/x", 2, b"hi")],
     rf"member '{RUN}/metrics\.jsonl/x' lies inside '{RUN}/metrics\.jsonl', which the archive holds as a file"),
    ([(f"{RUN}/eval/x/summary.json", 2, b"{}"), (f"{RUN}/eval/x", 2, b"hi"), (f"{RUN}/finished.json", 2, b"{}")],
     rf"member '{RUN}/eval/x/summary\.json' lies inside '{RUN}/eval/x', which the archive holds as a file"),
    ([(f"{RUN}/finished.json", 2, b"{}"), (f"{RUN}/metrics.jsonl", 3, b"{}\n"), (f"{RUN}/metrics.jsonl", 3, b"{}\n")],
     rf"member '{RUN}/metrics\.jsonl' appears twice"),
], ids=["a file inside a file", "a file inside a later file", "a member twice"])
def test_an_archive_whose_members_collide_is_refused_up_front_restoring_nothing(compare, tmp_path, members, expected):
    """One line naming the archive and the member, and no run folder, not even a part of one: a
    half-restored run with its finished.json would be skipped as finished."""
    archive = _tar_xz(tmp_path / "kept.tar.xz", members)
    with pytest.raises(DataError, match=rf"^{tmp_path}/kept\.tar\.xz: {expected}"):
        restore_runs(compare, archive)
    assert not compare.out_dir.exists()


def test_a_run_folder_that_cannot_be_made_is_refused_naming_the_archive_and_restoring_nothing(compare, tmp_path):
    archive = _tar_xz(tmp_path / "kept.tar.xz", [(f"{RUN}/finished.json", 2, b"{}"),
                                                 ("arms/grpo_only/seed0/finished.json", 2, b"{}")])
    (compare.folder / "arms").mkdir(parents=True)
    (compare.folder / "arms" / "rlsd").write_text("a file where a folder goes")
    with pytest.raises(DataError, match=rf"^{tmp_path}/kept\.tar\.xz: cannot restore '{RUN}' to "
                                        rf"{compare.arm_dir('rlsd', 1)}: {compare.folder}/arms/rlsd is a file"):
        restore_runs(compare, archive)
    assert sorted(p.name for p in (compare.folder / "arms").iterdir()) == ["rlsd"]  # grpo_only not restored either


def test_a_bound_past_in_a_later_run_restores_no_run(compare, tmp_path):
    """The archive is read once, as a stream: runs come back only once all of it was read whole."""
    archive = _tar_xz(tmp_path / "kept.tar.xz", [("arms/grpo_only/seed0/finished.json", 2, b"{}"),
                                                 (f"{RUN}/finished.json", 2, b"{}"),
                                                 (f"{RUN}/metrics.jsonl", 65 * 2**20, bytes(65 * 2**20))])
    with pytest.raises(DataError, match=rf"member '{RUN}/metrics\.jsonl' is 68157440 bytes, past the"):
        restore_runs(compare, archive)
    assert not compare.out_dir.exists()


def test_an_archive_is_restored_as_a_stream_never_whole_in_memory(compare, tmp_path):
    """48 MiB of records (zeros, a few kB packed): indexed and restored with less than 8 MiB of
    Python memory at its peak (4.4 MiB measured), each member copied in blocks."""
    import tracemalloc

    size = 16 * 2**20
    archive = _tar_xz(tmp_path / "kept.tar.xz", [(f"{RUN}/finished.json", 2, b"{}")]
                      + [(f"{RUN}/rollouts/{i}.jsonl", size, bytes(size)) for i in range(3)])
    tracemalloc.start()
    try:
        assert RecordArchive(archive).has(f"{RUN}/finished.json")
        assert restore_runs(compare, archive) == [compare.arm_dir("rlsd", 1)]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 * 2**20, peak
    assert [(compare.arm_dir("rlsd", 1) / f"rollouts/{i}.jsonl").stat().st_size for i in range(3)] == [size] * 3



def test_an_archive_cut_short_in_a_member_is_one_error_naming_it_and_restores_no_run(compare, tmp_path):
    """Found by the first pass that reads it (the index, or every member's bytes at once)."""
    whole = _tar_xz(tmp_path / "whole.tar.xz", [("arms/grpo_only/seed0/finished.json", 2, b"{}"),
                                                (f"{RUN}/finished.json", 2, b"{}"),
                                                (f"{RUN}/metrics.jsonl", 2**20, random.Random(0).randbytes(2**20))], preset=1)
    archive = tmp_path / "cut.tar.xz"
    archive.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    for read in (lambda: RecordArchive(archive).members(), lambda: restore_runs(compare, archive)):
        with pytest.raises(DataError, match=rf"^{tmp_path}/cut\.tar\.xz: not a readable records archive \(EOFError: "):
            read()
    assert not compare.out_dir.exists()
