"""`selfopd compare CONFIG.toml`: several training arms under one budget, run one after another.

A comparison is a base training config plus named arms, each a short list of `--set`
overrides. Arms may change only who teaches and how the loss weighs it (`teacher.*`,
`loss.*`, `optim.*`): seeds, data, rollout budget, model, eval and engine are shared, so a
difference between arms is a difference of method, not of luck or budget.

    [compare]
    base = "demo.toml"                       # relative to this file
    set = ["run.steps=10"]                   # applied to every arm
    seeds = [0, 1, 2]                        # every arm under each training seed (default: the base's)
    [sft]                                    # optional: `selfopd sft` builds a teacher first;
    name = "sft-teacher"                     # arms refer to its model folder as {sft}
    [arms.self_answer_note]
    set = ["teacher.kind=self", "loss.lambda_rl=0"]

A training seed sets the data order and the sampling; every arm runs under each seed, and
the report pools the seeds (intervals over prompts and seeds). Layout:
OUT_DIR/NAME/arms/ARM/seedS is an ordinary run folder (`selfopd diagnose` works on it);
`finished.json` marks a run done, so after an interruption a rerun skips finished runs,
resumes an unfinished one from its checkpoint (or restarts it), and then writes
OUT_DIR/NAME/report.md. Runs go seed by seed, so an interrupted comparison has whole seeds
first. The base model is evaluated once, by the first run; the others reuse that eval
(same weights, same prompts, same greedy decoding).
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from selfopd.config import ConfigError, TrainConfig, config_to_dict, load_config, read_toml

ARM_SECTIONS = ("teacher", "loss", "optim")  # what arms may change; everything else is shared
SFT_PLACEHOLDER = "{sft}"
FINISHED = "finished.json"


@dataclass(frozen=True)
class Arm:
    name: str
    overrides: tuple[str, ...]
    description: str = ""


@dataclass(frozen=True)
class CompareConfig:
    """A parsed comparison file; `arm_configs` turns it into one TrainConfig per arm."""

    source: Path
    name: str
    out_dir: Path
    base: Path
    common: tuple[str, ...]
    arms: tuple[Arm, ...]
    sft: dict[str, Any] | None
    reference: str  # the arm every other arm is also compared with, paired ("" for none)
    seeds: tuple[int, ...]  # training seeds every arm runs under

    @property
    def folder(self) -> Path:
        return self.out_dir / self.name

    def arm_dir(self, arm: str, seed: int) -> Path:
        return self.folder / "arms" / arm / f"seed{seed}"

    def runs(self) -> list[tuple[str, int]]:
        """(arm, seed) of every training run, in the order they run: seed by seed."""
        return [(arm.name, seed) for seed in self.seeds for arm in self.arms]


def load_compare_config(path: Path, overrides: Sequence[str] = (), only: Sequence[str] = (),
                        only_seeds: Sequence[int] = ()) -> CompareConfig:
    """Parse and check a comparison file. `overrides` (`--set`) apply to every arm after the
    file's own settings; `only` keeps those arms, in the file's order; `only_seeds` those seeds."""
    path = Path(path)
    tables = read_toml(path, what="comparison file")

    def fail(key: str, message: str) -> ConfigError:
        return ConfigError(key, message, source=str(path))

    unknown = set(tables) - {"compare", "sft", "arms"}
    if unknown:
        raise fail(f"[{sorted(unknown)[0]}]", "unknown section; sections: [compare], [sft], [arms.NAME]")
    compare = tables.get("compare", {})
    allowed = {"name", "out_dir", "base", "set", "reference", "seeds"}
    for key in compare:
        if key not in allowed:
            raise fail(f"compare.{key}", f"unknown key; keys of [compare]: {', '.join(sorted(allowed))}")
    if "base" not in compare:
        raise fail("compare.base", "required: the training config every arm starts from")
    base = (path.parent / compare["base"]).resolve()
    if not base.is_file():
        raise fail("compare.base", f"no such training config: {base}")
    common = tuple(_string_list(compare.get("set", []), "compare.set", fail)) + tuple(overrides)
    if any(override.partition("=")[0].strip() == "run.seed" for override in common):
        raise fail("compare.set", "run.seed is set per run by compare.seeds; list the seeds there")
    seeds = compare.get("seeds")
    if seeds is None:
        try:
            seeds = [load_config(base, common).run.seed]
        except ConfigError as error:
            raise ConfigError(error.key, error.message, source=f"{path} [compare]") from None
    if not isinstance(seeds, list) or not seeds or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0
                                                           for s in seeds) or len(set(seeds)) != len(seeds):
        raise fail("compare.seeds", f"expected a non-empty list of distinct seeds >= 0, got {seeds!r}")
    if only_seeds:
        missing = [seed for seed in only_seeds if seed not in seeds]
        if missing:
            raise fail("compare.seeds", f"no seed {missing[0]}; seeds: {seeds}")
        seeds = [seed for seed in seeds if seed in only_seeds]

    arms_table = tables.get("arms", {})
    if not arms_table:
        raise fail("[arms]", "no arms: add at least one [arms.NAME] table with set = [...]")
    arms = []
    for arm_name, table in arms_table.items():
        if not isinstance(table, dict) or set(table) - {"set", "description"}:
            raise fail(f"arms.{arm_name}", "an arm is a table with `set = [...]` and an optional `description`")
        arm_overrides = tuple(_string_list(table.get("set", []), f"arms.{arm_name}.set", fail))
        for override in arm_overrides:
            section = override.partition("=")[0].strip().partition(".")[0]
            if section not in ARM_SECTIONS:
                raise fail(f"arms.{arm_name}.set",
                           f"{override!r}: arms may only change {', '.join(s + '.*' for s in ARM_SECTIONS)}; "
                           "put settings every arm shares in compare.set")
        arms.append(Arm(arm_name, arm_overrides, str(table.get("description", ""))))
    if only:
        missing = [name for name in only if name not in arms_table]
        if missing:
            raise fail("[arms]", f"no arm named {missing[0]!r}; arms: {', '.join(arms_table)}")
        arms = [arm for arm in arms if arm.name in only]

    sft = tables.get("sft")
    uses_sft = any(SFT_PLACEHOLDER in override for arm in arms for override in arm.overrides)
    if uses_sft and sft is None:
        raise fail("[sft]", f"an arm uses {SFT_PLACEHOLDER} but the file has no [sft] section")
    reference = str(compare.get("reference", ""))
    if reference and reference not in [arm.name for arm in arms]:
        reference = ""  # not among the arms run (e.g. --arms); compared with the base only
    return CompareConfig(path, str(compare.get("name", path.stem)), Path(compare.get("out_dir", "runs")), base,
                         common, tuple(arms), sft if uses_sft else None, reference, tuple(seeds))


def _string_list(value: Any, key: str, fail) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise fail(key, f"expected a list of \"section.key=value\" strings, got {value!r}")
    return value


def arm_configs(compare: CompareConfig, sft_model: Path | None) -> dict[tuple[str, int], TrainConfig]:
    """One TrainConfig per (arm, seed), all built (and so checked) before anything runs."""
    arms = {arm.name: arm for arm in compare.arms}
    configs = {}
    for name, seed in compare.runs():
        overrides = [o.replace(SFT_PLACEHOLDER, str(sft_model)) for o in (*compare.common, *arms[name].overrides)]
        run_dir = compare.arm_dir(name, seed)
        overrides += [f"run.out_dir={run_dir.parent}", f"run.name={run_dir.name}", f"run.seed={seed}"]
        try:
            configs[name, seed] = load_config(compare.base, overrides)
        except ConfigError as error:
            raise ConfigError(error.key, error.message, source=f"{compare.source} arm {name}") from None
    shared = {key: _shared_part(config) for key, config in configs.items()}
    first = next(iter(shared))
    for (name, seed), part in shared.items():
        if part != shared[first]:
            key = next(k for k in part if part[k] != shared[first][k])
            raise ConfigError(key, f"arm {name} differs from arm {first[0]} here; arms must share it", source=str(compare.source))
    return configs


def _shared_part(config: TrainConfig) -> dict[str, Any]:
    """The settings that must be equal across arms and seeds, flattened to section.key."""
    flat = {key: value for key, value in _flatten(config).items() if key.partition(".")[0] not in ARM_SECTIONS}
    for per_run in ("run.name", "run.out_dir", "run.seed"):
        flat.pop(per_run)
    return flat


def _flatten(config: TrainConfig) -> dict[str, Any]:
    return {f"{section}.{key}": value for section, table in config_to_dict(config).items() for key, value in table.items()}


# What the [sft] teacher takes from the arms' config (and may not set differently): the
# same model, data and held-out split, so it never trains on an item the arms are scored on.
SFT_FROM_ARMS = {"student": "model.student", "data": "data.spec", "eval_size": "data.eval_size",
                 "split_seed": "data.split_seed", "student_template": "data.student_template",
                 "eval_max_tokens": "eval.max_tokens"}


def sft_config(compare: CompareConfig):
    """The [sft] teacher's config, its split and model taken from the arms; None without [sft].

    Read from the base config plus compare.set: arms cannot change these settings."""
    if compare.sft is None:
        return None
    from selfopd.sft import sft_config_from_table

    table = dict(compare.sft)
    table.setdefault("out_dir", str(compare.folder))
    shared = [override for override in compare.common if SFT_PLACEHOLDER not in override]
    try:
        flat = _flatten(load_config(compare.base, shared))
    except ConfigError as error:
        raise ConfigError(error.key, error.message, source=f"{compare.source} [compare]") from None
    for key, arm_key in SFT_FROM_ARMS.items():
        if key in table and table[key] != flat[arm_key]:
            raise ConfigError(f"sft.{key}", f"is {table[key]!r} but the arms' {arm_key} is {flat[arm_key]!r}: the "
                              "teacher must share the arms' model and held-out split; leave it out", source=str(compare.source))
        table[key] = flat[arm_key]
    return sft_config_from_table(table, source=f"{compare.source} [sft]")


def run_compare(compare: CompareConfig, progress: bool = True) -> Path:
    """Run every unfinished arm, then write the report; returns the report's path."""
    from selfopd.compare_report import write_compare_report
    from selfopd.trainer import latest_checkpoint, train

    # Every arm and the teacher's config are checked before any work starts.
    sft = sft_config(compare)
    configs = arm_configs(compare, sft.model_dir if sft else None)
    compare.folder.mkdir(parents=True, exist_ok=True)
    (compare.folder / "compare.toml").write_text(compare.source.read_text())
    if sft is not None:
        from selfopd.sft import run_sft

        started = time.perf_counter()
        run_sft(sft, progress=progress)
        _note(compare, "sft", time.perf_counter() - started)
    arms = {arm.name: arm for arm in compare.arms}
    for index, (name, seed) in enumerate(compare.runs(), start=1):
        config, run_dir, arm = configs[name, seed], compare.arm_dir(name, seed), arms[name]
        header = f"[{index}/{len(configs)}] arm {name}, seed {seed}"
        if (run_dir / FINISHED).is_file():
            _check_unchanged(run_dir, config, name)
            print(f"{header}: finished earlier, not rerun")
            continue
        resume = latest_checkpoint(run_dir) is not None
        if resume:
            _check_unchanged(run_dir, config, name)
            print(f"{header}: resuming from {latest_checkpoint(run_dir).name}")
        else:
            if run_dir.exists():
                print(f"{header}: interrupted before its first checkpoint, starting it again")
                shutil.rmtree(run_dir)
            print(f"{header}: {arm.description or ' '.join(arm.overrides) or 'the base config'}")
        started = time.perf_counter()
        train(config, resume=resume, initial_eval=None if resume else base_eval(compare, exclude=run_dir))
        seconds = time.perf_counter() - started
        (run_dir / FINISHED).write_text(json.dumps({"arm": name, "seed": seed, "wall_seconds_last_session": seconds},
                                                   indent=2) + "\n")
        _note(compare, f"{name} seed {seed}", seconds)
    return write_compare_report(compare)


def base_eval(compare: CompareConfig, exclude: Path) -> Path | None:
    """The step-0 eval of a run already made (all arms and seeds start from the same weights)."""
    for name, seed in compare.runs():
        run_dir = compare.arm_dir(name, seed)
        folder = run_dir / "eval" / "step_00000"
        if run_dir != exclude and (folder / "summary.json").is_file():
            return folder
    return None


def _check_unchanged(run_dir: Path, config: TrainConfig, name: str) -> None:
    """A finished or resumed arm must have run with the config it would get now."""
    now, then = _flatten(config), _flatten(load_config(run_dir / "config.toml"))
    changed = [key for key in now if now[key] != then[key] and key != "run.progress"]
    if changed:
        key = changed[0]
        raise ConfigError(key, f"arm {name} ran with {then[key]!r}, the comparison now says {now[key]!r}: "
                          f"delete {run_dir} to rerun it", source=str(run_dir / "config.toml"))


def _note(compare: CompareConfig, what: str, seconds: float) -> None:
    """Append to the comparison's timing log (what ran, how long, when)."""
    with (compare.folder / "timing.jsonl").open("a") as handle:
        handle.write(json.dumps({"what": what, "wall_seconds": seconds, "finished_at": time.time()}) + "\n")
