"""Example counts for the property tests, relative to the loaded hypothesis profile.

tests/conftest.py loads the "ci" profile (100 examples by default) unless HYPOTHESIS_PROFILE
names another: a test that needs a budget of its own asks for `examples(n)`, which is n
under "ci" and proportionally more under "explore", so exploring searches every test harder.
"""

from __future__ import annotations

from hypothesis import settings

CI_EXAMPLES = 100  # max_examples of the "ci" profile


def examples(n: int, **overrides) -> settings:
    """Settings for n examples under the CI profile, scaled to the loaded one."""
    return settings(max_examples=max(1, n * settings.default.max_examples // CI_EXAMPLES), **overrides)
