"""selfopd: on-policy distillation and self-distillation with privileged-information teachers.

The public API, imported lazily so that `import selfopd` (and the CLI's --help) stays
instant; each name lives in the module listed in `_EXPORTS`:

    import selfopd
    config = selfopd.load_config("experiments/demo/demo.toml", ["run.steps=4"])
    run_dir = selfopd.train(config)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "TrainConfig": "selfopd.config",
    "load_config": "selfopd.config",
    "config_to_toml": "selfopd.config",
    "train": "selfopd.training.trainer",
    "resolve_model": "selfopd.core.models",
    "Example": "selfopd.data.example",
    "load_examples": "selfopd.data",
    "split_examples": "selfopd.data.split",
    "load_template": "selfopd.templating.templates",
    "list_templates": "selfopd.templating.templates",
    "render_student": "selfopd.templating.templates",
    "render_teacher": "selfopd.templating.templates",
    "load_compare_config": "selfopd.comparisons.compare",
    "run_compare": "selfopd.comparisons.compare",
    "measure_run": "selfopd.diagnostics.report",
    "write_report": "selfopd.diagnostics.report",
    "token_heatmap_html": "selfopd.core.heatmaps",
    "plot_token_heatmap": "selfopd.core.heatmaps",
}
__all__ = ["__version__", *_EXPORTS]

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time each name loads on first use
    from selfopd.comparisons.compare import load_compare_config, run_compare
    from selfopd.config import TrainConfig, config_to_toml, load_config
    from selfopd.data import load_examples
    from selfopd.diagnostics.report import measure_run, write_report
    from selfopd.data.example import Example
    from selfopd.core.heatmaps import plot_token_heatmap, token_heatmap_html
    from selfopd.core.models import resolve_model
    from selfopd.data.split import split_examples
    from selfopd.templating.templates import list_templates, load_template, render_student, render_teacher
    from selfopd.training.trainer import train


class _SourceTreeFinder:
    """`selfopd.verifiers` and `selfopd.prompts` are the checkout's top-level verifiers/ and prompts/
    folders, which an install (wheel or editable) maps into the package. Run from a checkout that
    is not installed (`PYTHONPATH=.` on a GPU machine with no pip install), this finder, last in
    `sys.meta_path`, maps them the same way; an installed selfopd never reaches it."""

    FOLDERS = {"selfopd.verifiers": "verifiers", "selfopd.prompts": "prompts"}

    @classmethod
    def find_spec(cls, name: str, path: Any = None, target: Any = None) -> Any:
        import importlib.util
        from pathlib import Path

        folder = Path(__file__).resolve().parents[1] / cls.FOLDERS.get(name, "")
        if name not in cls.FOLDERS or not (folder / "__init__.py").is_file():
            return None
        return importlib.util.spec_from_file_location(name, folder / "__init__.py",
                                                      submodule_search_locations=[str(folder)])


def _map_source_tree() -> None:
    import sys

    if not any(finder is _SourceTreeFinder for finder in sys.meta_path):
        sys.meta_path.append(_SourceTreeFinder)  # type: ignore[arg-type]


_map_source_tree()


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'selfopd' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
