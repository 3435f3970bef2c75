"""Make `import verifiers` mean the package, not this folder.

pytest puts `tests/` on sys.path (for tests/conftest.py). When pytest is started as the
`pytest` console script (not `python -m pytest`), the repository root is not on sys.path,
so `tests/verifiers/` (no __init__.py, on purpose: with one it would shadow the package
outright) is found as a namespace package named `verifiers` before the editable install's
finder is asked. Putting the root on sys.path lets the real, regular package win. The
clean fix is `pythonpath = ["."]` in pyproject's [tool.pytest.ini_options].
"""

from __future__ import annotations

import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
if getattr(sys.modules.get("verifiers"), "__file__", "") is None:  # the namespace stand-in
    for _name in [n for n in sys.modules if n == "verifiers" or n.startswith("verifiers.")]:
        del sys.modules[_name]
