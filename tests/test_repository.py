"""The repository stays small and its experiments/ folder keeps its shape: no tracked file under
experiments/ over 2 MiB, the tracked tree under 16 MiB, every experiments/ path and module the
docs name exists, no script edits sys.path, and the shipped run records (one .tar.xz per study)
give back the shipped reports."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_EXPERIMENT_FILE = 2 * 2**20
MAX_TREE = 16 * 2**20
PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "Makefile", *sorted((ROOT / "docs").rglob("*.md")),
         *sorted((ROOT / "experiments").rglob("*.md")), *sorted((ROOT / "experiments").rglob("*.py")),
         *sorted((ROOT / "experiments").rglob("*.toml")), *sorted((ROOT / "experiments").rglob("*.sh"))]
PATH = re.compile(r"(?<![\w/.])experiments/[\w./{},*-]*[\w}*]")
MODULE = re.compile(r"python3? -m (experiments(?:\.\w+)+)")
NOT_YET = {  # paths the docs name that a step still to come writes
    "experiments/benchmarks/results/gpu_check.json": "the trainer GPU check's result, once it has run on a GPU",
    "experiments/self_vs_external/results/self_vs_external_runs.tar.xz": "its --keep-records file, once rerun",
    "experiments/recipes": "where the pre-registration ships a cure that beats GRPO alone (none has)",
}


def tracked_sizes() -> dict[str, int]:
    """{path: bytes} of every file git tracks here (as it is in the working tree)."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    paths = [name for name in listed.decode().split("\0") if name]
    return {name: (ROOT / name).stat().st_size for name in paths if (ROOT / name).is_file()}


def test_no_tracked_file_under_experiments_is_over_2_mib_and_the_tree_is_under_16_mib():
    sizes = tracked_sizes()
    large = {name: size for name, size in sizes.items() if name.startswith("experiments/") and size > MAX_EXPERIMENT_FILE}
    assert not large, f"over 2 MiB (keep run records in the study's .tar.xz, experiments/README.md): {large}"
    total = sum(sizes.values())
    assert total < MAX_TREE, f"the tracked tree is {total / 2**20:.1f} MiB; largest: {sorted(sizes.items(), key=lambda i: -i[1])[:5]}"


def _named(pattern: re.Pattern, text: str) -> set[str]:
    """The matches that name one real path or module (no globs, braces or placeholders)."""
    found = {match.group(1) if pattern.groups else match.group(0) for match in pattern.finditer(text)}
    return {name.rstrip(".") for name in found if not re.search(r"[*{]|\.\.\.|[A-Z]{3,}", name)}


def _exists(name: str) -> bool:
    """A file or folder, or the stem of files (`--out experiments/x/results/name` -> name.json, name.png),
    or a folder inside a study's archive (`--keep-records x/results/runs.tar.xz/comparison`): the archive."""
    path = ROOT / name
    archive = re.match(r"(.+?\.tar\.xz)/", name)
    if archive:
        return (ROOT / archive.group(1)).is_file()
    return path.exists() or any(path.parent.glob(f"{path.name}.*"))


def test_every_experiments_path_and_module_the_docs_name_exists():
    missing = []
    for page in PAGES:
        text = page.read_text()
        where = page.relative_to(ROOT)
        missing += [f"{where}: {name}" for name in _named(PATH, text) if not _exists(name) and name not in NOT_YET]
        missing += [f"{where}: python -m {name}" for name in _named(MODULE, text) if importlib.util.find_spec(name) is None]
    assert not missing, missing


def test_experiment_scripts_import_the_installed_package_and_there_is_one_gpu_check():
    edits = []
    for path in sorted((ROOT / "experiments").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "path" and getattr(node.value, "id", "") == "sys":
                edits.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not edits, f"sys.path edits (run scripts as `python -m experiments...` modules instead): {edits}"
    checks = sorted(path.relative_to(ROOT).as_posix() for path in ROOT.glob("experiments/**/gpu_check*.*")
                    if path.suffix in (".py", ".sh"))
    assert checks == ["experiments/benchmarks/gpu_check.py", "experiments/benchmarks/gpu_check.sh"]


def _report(module: str, *args: str, cwd: Path) -> None:
    done = subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]


def test_the_cures_report_comes_back_from_the_shipped_records(tmp_path):
    """On a fresh clone (no runs/), the report restores the runs from cures_runs.tar.xz and gives
    the shipped numbers, teacher-prefers-correct included (read from the rollouts' digest)."""
    out = tmp_path / "report"
    _report("experiments.cures.report", "--runs", str(tmp_path / "runs"), "--out", str(out), cwd=ROOT)
    shipped = ROOT / "experiments" / "cures" / "results"

    def without_commit(text: str) -> str:
        return re.sub(r"commit \w+", "commit C", text)

    assert without_commit((out / "cures_report.md").read_text()) == without_commit((shipped / "cures_report.md").read_text())
    made, kept = (json.loads((folder / "cures_summary.json").read_text()) for folder in (out, shipped))
    assert {**made, "commit": ""} == {**kept, "commit": ""}
    assert "teacher prefers correct" in (out / "cures_report.md").read_text()


def test_the_staleness_report_comes_back_from_the_shipped_records(tmp_path):
    out = tmp_path / "report"
    _report("experiments.staleness.report", "--out", str(out), cwd=tmp_path)  # runs/ of tmp_path: restored there
    shipped = ROOT / "experiments" / "staleness" / "results"
    assert (out / "staleness_report.json").read_text() == (shipped / "staleness_report.json").read_text()
    assert (out / "staleness_report.md").read_text() == (shipped / "staleness_report.md").read_text()
