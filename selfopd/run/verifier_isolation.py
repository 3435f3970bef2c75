"""The verifier's isolation for one run or eval (`verifier.isolation`), checked before anything starts.

Answers are scored in worker processes (`selfopd.verifiers.timeout`) that run in a bubblewrap sandbox
by default. A sandbox that cannot start would leave every answer unchecked (reward 0) with a warning
per answer, so a run or an eval asks first and stops in one line naming the setting that accepts
the weaker worker."""

from __future__ import annotations

from selfopd.config import ConfigError
from selfopd.verifiers.timeout import WorkerError, check_isolation, set_isolation


def use_verifier_isolation(mode: str) -> None:
    """Workers of this process run isolated as `mode` says ('sandbox' or 'limits'); a sandbox that
    cannot start here is refused now, before a folder is made or a model loads."""
    set_isolation(mode)
    try:
        check_isolation()
    except WorkerError as error:
        raise ConfigError("verifier.isolation", f"'sandbox': {str(error).split('; install', 1)[0]}; install "
                          "bubblewrap (apt install bubblewrap) or allow unprivileged user namespaces, or accept the "
                          "weaker audit-hook-only worker with --set verifier.isolation=limits") from None
