"""`env:TARGET`: examples that are an environment's opening observations, one per seed.

    env:python:my_envs:GuessNumber?size=64&seed=0
    env:openenv:ws://127.0.0.1:8000?size=64&seed=0

Example i is the environment reset with seed `seed + i`: its prompt is the observation's text (the rule of
`selfopd.data.openenv_session`), its meta the environment and the seed. The student's prompt and the
teacher's are rendered from it like any other example, so both see the same opening context, and a group
of n samples is n episodes of one seed; each episode resets its own environment with that seed and ends
in one line if the observation differs (`selfopd.episodes.openenv`). The environment, not a reference,
grades: `answer` is empty. With the same opening text for every seed (a hidden secret), the examples are
one prompt to the train / eval split: an environment's first observation should say which game it is.
"""

from __future__ import annotations

from selfopd.config.environment_target import parse_environment_target
from selfopd.data.example import Example
from selfopd.data.openenv_session import EnvironmentFailure, connect
from selfopd.data.spec import DataError, DataSpec

META_SEED = "env_seed"  # meta key of the seed an example's environment is reset with
META_ENVIRONMENT = "environment"


def judged_by_environment(example: Example) -> bool:
    """Whether `example` is an environment's observation, graded by the environment's reward rather than a
    reference (`selfopd.episodes.verdicts.grade_rollout`)."""
    return META_ENVIRONMENT in example.meta


def load_env(spec: DataSpec) -> list[Example]:
    """One example per seed, from one session reset `spec.size` times."""
    try:
        target = parse_environment_target(spec.name)
    except ValueError as error:
        raise DataError(f"{spec.label}: {error}") from None
    examples = []
    try:
        session = connect(target).open()
        try:
            for seed in range(spec.seed, spec.seed + spec.size):
                opening = session.reset(seed)
                if opening.done or not opening.text.strip():
                    raise DataError(f"{spec.label}: reset with seed {seed} gave {'a finished episode' if opening.done else 'no text'}: "
                                    "nothing for the student to answer")
                examples.append(Example(id=f"{spec.label}/{seed}", prompt=opening.text, answer="",
                                        meta={"source": spec.label, META_ENVIRONMENT: str(target), META_SEED: seed}))
        finally:
            session.close()
    except EnvironmentFailure as error:
        raise DataError(f"{spec.label}: {error}") from None
    return examples
