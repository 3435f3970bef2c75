"""The shape of the code base: small modules, imports that flow one way, engines that know
nothing of losses, a vLLM side and a memory planner that read config sections, not `TrainConfig`."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 400


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted((ROOT / "selfopd").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    for path in sorted((ROOT / "verifiers").glob("*.py")):
        name = "selfopd.verifiers" + ("" if path.stem == "__init__" else f".{path.stem}")
        found[name] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """selfopd modules this one imports anywhere in its file (module level, inside functions,
    under TYPE_CHECKING): every edge counts, so a cycle cannot hide in a lazy import."""
    package = name if path.stem == "__init__" else name.rpartition(".")[0]
    edges = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        edges |= {target for target in targets if target in modules and target != name}
    return edges


def test_no_module_is_over_400_lines():
    long = {name: n for name, path in _modules().items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long


def test_imports_form_no_cycle():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    # A package's __init__ re-exporting its own modules is not a cycle of design.
    graph = {name: {t for t in targets if not (t.startswith(name + ".") and modules[name].stem == "__init__")}
             for name, targets in graph.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                return stack[stack.index(target):] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for name in sorted(graph):
        if name not in state:
            cycle = visit(name)
            assert cycle is None, " -> ".join(cycle)


def test_engines_do_not_import_the_objectives():
    modules = _modules()
    for name, path in modules.items():
        if name.startswith(("selfopd.engines", "selfopd.serving", "selfopd.planning")):
            imported = _imports(name, path, modules)
            assert not imported & {"selfopd.training.loss", "selfopd.training.advantages", "selfopd.training.divergences", "selfopd.training.loss_metrics"}, name


SECTION_READERS = ("selfopd.serving", "selfopd.planning")


def test_the_vllm_side_and_the_planner_never_see_the_whole_train_config():
    """selfopd.serving and selfopd.planning take the config sections they read (EngineConfig, ModelConfig, ...)
    or a typed bundle of them (`selfopd.config.bundles`): no module there imports `TrainConfig` (lazily or
    for types only) or names it in a signature, so a function's parameters say what it depends on."""
    found = []
    for name, path in _modules().items():
        if not name.startswith(SECTION_READERS):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and any(alias.name == "TrainConfig" for alias in node.names):
                found.append(f"{name}:{node.lineno} imports TrainConfig")
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                arguments = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
                annotations = [arg.annotation for arg in arguments if arg.annotation is not None]
                found += [f"{name}.{node.name} takes a TrainConfig" for annotation in annotations
                          if "TrainConfig" in ast.unparse(annotation)]
    assert not found, found


def test_what_auto_dtype_means_is_decided_in_one_module():
    """`model.dtype = 'auto'` (and the LoRA + bf16 + vLLM rule it avoids) is decided by selfopd.config.auto
    alone: no other module compares a dtype with 'auto' or calls `auto_dtype`; they ask `run_dtype`,
    `dtype_choices` or `resolve_auto`."""
    found = []
    for name, path in _modules().items():
        if name == "selfopd.config.auto":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and any(isinstance(side, ast.Attribute) and side.attr == "dtype"
                                                     for side in [node.left, *node.comparators]) and any(
                    isinstance(side, ast.Constant) and side.value == "auto" for side in [node.left, *node.comparators]):
                found.append(f"{name}:{node.lineno} compares a dtype with 'auto'")
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) == "auto_dtype":
                found.append(f"{name}:{node.lineno} calls auto_dtype")
    assert not found, found


def test_experiment_scripts_write_under_runs_unless_told():
    """Running an experiment script must not overwrite the shipped results: every default
    output path of a script under experiments/ lies under runs/ (the shipped copies are
    refreshed with an explicit --out)."""
    offending = []
    for path in sorted((ROOT / "experiments").rglob("*.py")):
        source = path.read_text()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument" and any(
                    isinstance(a, ast.Constant) and str(a.value).startswith("--out") for a in node.args):
                defaults = [k.value for k in node.keywords if k.arg == "default"]
                texts = [ast.get_source_segment(source, d) or "" for d in defaults]
                offending += [f"{path.relative_to(ROOT)}: {t}" for t in texts if "runs" not in t]
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith(
                    "experiments/") and "/results" in node.value and _is_default_output(source, node):
                offending.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value}")
    assert not offending, offending


def _is_default_output(source: str, node: ast.Constant) -> bool:
    """A path constant in code (not in a docstring or help text) that names a results folder."""
    line = source.splitlines()[node.lineno - 1]
    return "default" in line or "OUT" in line


def test_the_training_step_reads_as_short_named_phases():
    """`train_step` is a dozen lines naming its phases (the rollouts come from the pipeline); no phase
    function is longer than a screen."""
    source = (ROOT / "selfopd" / "training" / "step.py").read_text()
    functions = {node.name: node.end_lineno - node.lineno + 1 for node in ast.parse(source).body
                 if isinstance(node, ast.FunctionDef)}
    assert functions["train_step"] <= 25, functions["train_step"]
    for phase in ("score", "forward_backward", "optimizer_step", "sync_engines", "step_metrics"):
        assert phase in functions
    assert "run.rollouts.take(run.student_side, run.step, timer)" in source
    long = {name: n for name, n in functions.items() if n > 80}
    assert not long, long


# The subpackages in the order data flows through them; a package imports only itself and
# those before it (selfopd.verifiers, the answer checkers, sits with the data, just before it: the
# loader refuses items whose reference or metadata a scorer would run as code, by the verifiers' grammars).
# The vLLM side (serving) stands on the engine interface; the memory planner (planning) sizes the
# servers serving places (gpu_layout), so it comes after it. Episodes run on any engine, through a
# chat format, before a run or the trainer takes them.
FLOW = ["config", "core", "verifiers", "data", "templating", "engines", "serving", "planning", "episodes", "run",
        "training", "diagnostics", "comparisons", "cli"]


def test_packages_import_only_what_comes_before_them_in_the_flow():
    modules = _modules()
    top = {name: name.split(".")[1] for name in modules if name.count(".") >= 1 and name != "selfopd.__main__"}
    assert set(top.values()) == set(FLOW), set(top.values()) ^ set(FLOW)
    for package in FLOW:
        init = ROOT / ("verifiers" if package == "verifiers" else f"selfopd/{package}") / "__init__.py"
        assert ast.get_docstring(ast.parse(init.read_text())), f"selfopd.{package} says nothing of its job"
    backwards = []
    for name, path in modules.items():
        if name not in top:
            continue
        for target in _imports(name, path, modules):
            if target in top and FLOW.index(top[target]) > FLOW.index(top[name]):
                backwards.append(f"{name} -> {target}")
    assert not backwards, backwards
    flat = [p.name for p in (ROOT / "selfopd").glob("*.py") if p.name not in ("__init__.py", "__main__.py")]
    assert not flat, f"modules outside the subpackages: {flat}"


def test_no_function_takes_a_run_typed_any():
    """Code that reads a training run says so (`training.state.Run`, or the typed side of it that it
    needs: `StudentSide`, `TeacherSide`); `run: Any` hides which fields a function depends on."""
    untyped = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for arg in node.args.args + node.args.kwonlyargs:
                    if arg.arg == "run" and isinstance(arg.annotation, ast.Name) and arg.annotation.id == "Any":
                        untyped.append(f"{name}.{node.name}")
    assert not untyped, untyped


LOSS_HOME = {"selfopd.training.loss", "selfopd.training.advantages", "selfopd.training.divergences"}
LOSS_PIECES = {"policy_gradient_loss", "masked_mean", "truncated_is_ratio", "clipped_divergence", "clipped_tokens",
               "cure_advantage", "opd_advantage", "grpo_advantage", "full_vocab_divergence", "topk_reverse_kl",
               "rlsd_factor", "rl_rewards", "entry_clipped_divergence"}


def test_only_the_chat_format_applies_a_chat_template():
    """A prompt's ids come from its role's `ChatFormat` (selfopd.templating.chat_format), which alone
    renders through `chat_template`: no other module calls `apply_chat_template`, `chat_ids` or `chat_text`."""
    allowed = {"selfopd.templating.chat_format", "selfopd.templating.chat_template"}
    banned = {"apply_chat_template", "chat_ids", "chat_text"}
    calls = []
    for name, path in _modules().items():
        if name in allowed:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                called = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
                if called in banned:
                    calls.append(f"{name}:{node.lineno} {called}")
    assert not calls, calls


def test_the_loss_is_computed_in_one_module():
    """`selfopd.training.loss.opd_loss` assembles the loss from its pieces (advantages, divergences);
    no other module touches a piece: a change of the objective is a change of one file."""
    outside = []
    for name, path in _modules().items():
        if name in LOSS_HOME:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            used = node.id if isinstance(node, ast.Name) else None
            if isinstance(node, ast.ImportFrom):
                outside += [f"{name} imports {alias.name}" for alias in node.names if alias.name in LOSS_PIECES]
                if node.module == "selfopd.training.divergences":
                    outside.append(f"{name} imports selfopd.training.divergences")
            elif used in LOSS_PIECES:
                outside.append(f"{name} uses {used}")
    assert not outside, outside
    imported_by = {name for name, path in _modules().items()
                   if "selfopd.training.divergences" in _imports(name, path, _modules())}
    assert imported_by == {"selfopd.training.loss"}


def test_tests_mirror_the_package():
    """tests/<package>/ holds the tests of selfopd/<package>/ (verifiers/, experiments/ alike), and a
    test file named after a module (test_<module>.py) sits in the folder of that module's package:
    the tests of a file are found by its path."""
    packages = {path.name for path in (ROOT / "selfopd").iterdir() if (path / "__init__.py").exists()}
    owners = {"verifiers": ROOT / "verifiers", "experiments": ROOT / "experiments",
              **{name: ROOT / "selfopd" / name for name in packages}}
    folders = {path.name for path in (ROOT / "tests").iterdir() if path.is_dir() and (path / "__init__.py").exists()}
    assert folders <= set(owners), folders - set(owners)
    misplaced = []
    for path in sorted((ROOT / "tests").glob("*/test_*.py")):
        module = path.stem.removeprefix("test_")
        homes = {name for name in packages if (ROOT / "selfopd" / name / f"{module}.py").exists()}
        if homes and path.parent.name not in homes:
            misplaced.append(f"{path.relative_to(ROOT)} (selfopd/{'|'.join(sorted(homes))}/{module}.py)")
    assert not misplaced, misplaced
    loose = sorted(p.name for p in (ROOT / "tests").glob("test_*.py"))
    assert len(loose) <= 8, loose  # only what tests the whole project (layout, docs, packaging, the demo)
