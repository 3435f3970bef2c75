"""Hub revision pins (`model.revision`, `teacher.revision`): which specs a revision can pin, checked
when the config loads. `selfopd.core.models` downloads the pinned snapshot."""

from __future__ import annotations

import re

REVISION = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,254}")  # a branch, tag, commit hash or refs/pr/N


def looks_like_hub_id(text: str) -> bool:
    """`org/name`: what selfopd downloads from the hub when no folder of that path exists."""
    parts = text.split("/")
    return len(parts) == 2 and all(parts) and not text.startswith((".", "/", "~"))


def revision_problem(spec: str, revision: str) -> str | None:
    """Why `revision` cannot pin model `spec` (None: it can, or there is none): only a hub id has revisions."""
    if not revision:
        return None
    if not REVISION.fullmatch(revision) or ".." in revision:
        return f"{revision!r} is not a hub revision (a branch, tag or commit hash)"
    if not looks_like_hub_id(spec):
        return f"pins a hub id's revision, and {spec!r} is not a hub id (org/name); leave it empty"
    return None
