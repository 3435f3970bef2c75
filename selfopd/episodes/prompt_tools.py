"""The tools a run's prompts show, decided in one place: the student's, every teacher's (merged over the
student's chat-template arguments) and the eval's. Built-in tools (rollout.environment = "tools") or a
TRL class's methods ('trl:MODULE:NAME'); no tools for every other environment."""

from __future__ import annotations

from typing import Any

from selfopd.config.environment_target import TRL_PREFIX
from selfopd.episodes.tools import builtin_tool_kwargs, tool_environments
from selfopd.episodes.trl_environment import trl_environments, trl_tool_kwargs


def tool_template_kwargs(rollout: Any) -> dict[str, Any]:
    """The chat-template argument a `[rollout]` section adds to the student's (and so to every teacher's):
    `tools`, the definitions of rollout.tools, or of a TRL class's methods; else none."""
    if rollout.environment.startswith(TRL_PREFIX):
        return trl_tool_kwargs(rollout)
    return builtin_tool_kwargs(rollout)


def check_student_tools(rollout: Any, chat: Any) -> None:
    """With tool episodes, refuse (ConfigError, one line) a student whose chat template cannot show the
    tools, or a TRL class that cannot work, before a run claims its folder; otherwise nothing."""
    if rollout.environment == "tools":
        tool_environments(rollout, chat, opened=False)
    elif rollout.environment.startswith(TRL_PREFIX):
        trl_environments(rollout, chat, opened=False)
