"""The installed package: every package folder is listed, and the answer checkers install as
`selfopd.verifiers`, so an environment that has the PyPI `verifiers` package (an RL
environments library) keeps both."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_folder_is_installed():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(path.parent.relative_to(ROOT).parts) for path in (ROOT / "selfopd").rglob("__init__.py")}
    assert found | {"selfopd.verifiers"} == listed and "verifiers" not in listed


def test_another_verifiers_package_does_not_shadow_ours(tmp_path):
    other = tmp_path / "site" / "verifiers"
    other.mkdir(parents=True)
    (other / "__init__.py").write_text("THE_OTHER_PACKAGE = True\n")
    code = ("import verifiers; assert verifiers.THE_OTHER_PACKAGE\n"
            "from selfopd.verifiers import verify_example\n"
            "from selfopd.data import load_examples\n"
            "example = load_examples('rg:chain_sum?min_terms=2&max_terms=2&size=3&seed=1')[0]\n"
            "assert verify_example(f'The answer is {example.answer}.', example).correct\n"
            "import selfopd.trainer\n"
            "print('ok')\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]
