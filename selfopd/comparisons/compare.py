"""`selfopd compare CONFIG.toml`: several training arms under one budget, run one after another.

A comparison is a base training config plus named arms, each a short list of `--set`
overrides. Arms may change only who teaches and how the loss weighs it (`teacher.*`,
`teachers.NAME.*`, `loss.*`, `optim.*`): seeds, data, rollout budget, model, eval and engine are shared, so a
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
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, Sequence

from selfopd.core.atomic import write_json_atomic, write_text_atomic
from selfopd.config import ConfigError, TrainConfig, flat_config, load_config
from selfopd.core.faults import fault_point
from selfopd.core.run_folder import RunFolder
from selfopd.config.settings import (Section, build_sections, check_folder_name, check_key, read_toml, section_toml, setting,
                                     toml_value)
from selfopd.config.teachers import TEACHER_NAME

ARM_SECTIONS = ("teacher", "teachers", "loss", "optim")  # what arms may change; everything else is shared
# ... and these keys of other sections: they change how the same prompts are sampled, not which.
ARM_KEYS = ("rollout.max_staleness",)


def arm_may_change(key: str) -> bool:
    """Whether an arm may set `key` (section.key): the rest is what every arm shares."""
    return key.partition(".")[0] in ARM_SECTIONS or key in ARM_KEYS
SFT_PLACEHOLDER = "{sft}"


@dataclass(frozen=True)
class CompareSection(Section):
    """The `[compare]` table."""

    SECTION: ClassVar[str] = "compare"
    base: str = setting("", "The training config every arm starts from (relative to this file); required.")
    name: str = setting("", "Name of the comparison: its folder is OUT_DIR/NAME (default: the file's name).")
    out_dir: str = setting("runs", "Folder that holds the comparison's folder.")
    set: tuple[str, ...] = setting((), "`section.key=value` settings every arm shares, applied after the base file.")
    reference: str = setting("", "The arm every other arm is also compared with, paired (empty: the base model only).")
    seeds: tuple[int, ...] = setting((), "Training seeds every arm runs under (empty: the base config's run.seed).")

    def __post_init__(self) -> None:
        super().__post_init__()
        self._non_empty("base")
        if any(seed < 0 for seed in self.seeds) or len(set(self.seeds)) != len(self.seeds):
            raise ConfigError(self._key("seeds"), f"expected distinct seeds >= 0, got {list(self.seeds)}")
        if any(override.partition("=")[0].strip() == "run.seed" for override in self.set):
            raise ConfigError(self._key("set"), "run.seed is set per run by compare.seeds; list the seeds there")


@dataclass(frozen=True)
class ArmTable(Section):
    """One `[arms.NAME]` table."""

    SECTION: ClassVar[str] = "arms"
    set: tuple[str, ...] = setting(
        (), "`section.key=value` settings of this arm: only teacher.*, loss.*, optim.* and rollout.max_staleness.")
    description: str = setting("", "One line on what the arm is, for the report.")


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
    sft: Any  # the [sft] section (selfopd.comparisons.sft.SftSection) when an arm uses {sft}, else None
    reference: str  # the arm every other arm is also compared with, paired ("" for none)
    seeds: tuple[int, ...]  # training seeds every arm runs under

    def __post_init__(self) -> None:
        check_folder_name("compare.name", self.name)  # from the file, its name or --name: it becomes a folder

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
    from selfopd.comparisons.sft import SftSection

    path = Path(path)
    tables = read_toml(path, what="comparison file")

    def error(key: str, message: str) -> ConfigError:
        return ConfigError(key, message, source=str(path))

    unknown = set(tables) - {"compare", "sft", "arms"}
    if unknown:
        raise error(f"[{sorted(unknown)[0]}]", "unknown section; sections: [compare], [sft], [arms.NAME]")
    try:
        sections = build_sections({"compare": tables.get("compare", {}), **({"sft": tables["sft"]} if "sft" in tables else {})},
                                  {"compare": CompareSection, "sft": SftSection})
    except ConfigError as failure:
        if failure.key == "compare.base" and "compare" in tables and "base" not in tables["compare"]:
            raise error("compare.base", "required: the training config every arm starts from") from None
        raise error(failure.key, failure.message) from None
    compare = sections["compare"]
    base = (path.parent / compare.base).resolve()
    if not base.is_file():
        raise error("compare.base", f"no such training config: {base}")
    common = compare.set + tuple(overrides)
    seeds = list(compare.seeds)
    if not seeds:
        try:
            seeds = [load_config(base, common).run.seed]
        except ConfigError as failure:
            raise ConfigError(failure.key, failure.message, source=f"{path} [compare]") from None
    if only_seeds:
        missing = [seed for seed in only_seeds if seed not in seeds]
        if missing:
            raise error("compare.seeds", f"no seed {missing[0]}; seeds: {seeds}")
        seeds = [seed for seed in seeds if seed in only_seeds]

    arms_table = tables.get("arms", {})
    if not arms_table:
        raise error("[arms]", "no arms: add at least one [arms.NAME] table with set = [...]")
    arms = [_arm(arm_name, table, error) for arm_name, table in arms_table.items()]
    if only:
        missing = [name for name in only if name not in arms_table]
        if missing:
            raise error("[arms]", f"no arm named {missing[0]!r}; arms: {', '.join(arms_table)}")
        arms = [arm for arm in arms if arm.name in only]

    uses_sft = any(SFT_PLACEHOLDER in override for arm in arms for override in arm.overrides)
    if uses_sft and "sft" not in sections:
        raise error("[sft]", f"an arm uses {SFT_PLACEHOLDER} but the file has no [sft] section")
    reference = compare.reference
    if reference and reference not in [arm.name for arm in arms]:
        reference = ""  # not among the arms run (e.g. --arms); compared with the base only
    try:
        return CompareConfig(path, compare.name or path.stem, Path(compare.out_dir), base, common, tuple(arms),
                             sections.get("sft") if uses_sft else None, reference, tuple(seeds))
    except ConfigError as failure:
        raise error(failure.key, failure.message) from None


def _arm(name: str, table: Any, error) -> Arm:
    """One arm from its `[arms.NAME]` table; errors name `arms.NAME.KEY`. NAME follows the rule of
    teacher names: it becomes a folder name (arms/NAME/seedS), so it never leaves the comparison."""
    if not TEACHER_NAME.fullmatch(name):
        raise error(f"[arms.{name}]", "an arm's name is letters, digits, '_' and '-' (it names the arm's folder)")
    if not isinstance(table, dict):
        raise error(f"arms.{name}", "an arm is a table with `set = [...]` and an optional `description`")
    try:
        for key in table:
            check_key(f"arms.{name}", ArmTable, key)
        arm = ArmTable(**table)
    except ConfigError as failure:
        raise error(failure.key.replace("arms.", f"arms.{name}.", 1) if failure.key.count(".") == 1 else failure.key,
                    failure.message) from None
    for override in arm.set:
        if not arm_may_change(override.partition("=")[0].strip()):
            raise error(f"arms.{name}.set", f"{override!r}: arms may only change "
                        f"{', '.join([*(s + '.*' for s in ARM_SECTIONS), *ARM_KEYS])}; put settings every arm shares "
                        "in compare.set")
    return Arm(name, arm.set, arm.description)


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


def compare_config_toml(compare: CompareConfig) -> str:
    """What `selfopd compare --show-config` prints, after checking every arm as a run would:
    the resolved [compare] (and [sft]) tables and each arm with, as comments, the teacher,
    loss and optimizer values it runs with where they differ from the shared config. Saved
    next to the original file, it is the same comparison."""
    sft = sft_config(compare)
    configs = arm_configs(compare, sft.model_dir if sft else None)
    shared = flat_config(load_config(compare.base, compare.common))
    base = os.path.relpath(compare.base, compare.source.resolve().parent)
    section = CompareSection(base=base, name=compare.name, out_dir=str(compare.out_dir), set=compare.common,
                             reference=compare.reference, seeds=compare.seeds)
    lines = [f"# {compare.source}: {len(compare.arms)} arms x {len(compare.seeds)} seeds = {len(configs)} runs, "
             f"in {compare.folder}", f"# the shared training config: selfopd train {os.path.relpath(compare.base)} --show-config "
             + " ".join(f"--set '{o}'" for o in compare.common), "", *section_toml("compare", section)]
    if compare.sft is not None:
        lines += ["", *section_toml("sft", compare.sft)]
    for arm in compare.arms:
        runs_with = flat_config(configs[arm.name, compare.seeds[0]])
        changed = [f"#   {key} = {toml_value(value)}" for key, value in runs_with.items()
                   if arm_may_change(key) and (key not in shared or value != shared[key])]
        lines += ["", f"[arms.{arm.name}]", f"description = {toml_value(arm.description)}",
                  f"set = {toml_value(arm.overrides)}", "# runs with (where it differs from the shared config):",
                  *(changed or ["#   nothing: the shared config as it is"])]
    return "\n".join(lines) + "\n"


def _shared_part(config: TrainConfig) -> dict[str, Any]:
    """The settings that must be equal across arms and seeds, flattened to section.key."""
    flat = {key: value for key, value in flat_config(config).items() if not arm_may_change(key)}
    for per_run in ("run.name", "run.out_dir", "run.seed"):
        flat.pop(per_run)
    return flat


def sft_config(compare: CompareConfig):
    """The [sft] teacher's config: the arms' shared training sections (base + compare.set:
    the same model, data and held-out split, which arms cannot change) and its [sft] section,
    its folder inside the comparison's. None without [sft]."""
    if compare.sft is None:
        return None
    from selfopd.comparisons.sft import SftConfig

    shared = [override for override in compare.common if SFT_PLACEHOLDER not in override]
    try:
        train = load_config(compare.base, [*shared, f"run.out_dir={compare.folder}"])
    except ConfigError as error:
        raise ConfigError(error.key, error.message, source=f"{compare.source} [compare]") from None
    return SftConfig(train, compare.sft)


def run_compare(compare: CompareConfig, progress: bool = True,
                after_run: Callable[[str, int, Path], None] | None = None) -> None:
    """Run every unfinished arm (then `selfopd.comparisons.compare_report.write_compare_report` reports them).
    `after_run(arm, seed, run_dir)` is called as each run finishes, while its final weights
    are still the newest on disk (an evaluation of them, say, before the next run starts)."""
    from selfopd.training.trainer import GuardStop, latest_checkpoint, train

    # Every arm and the teacher's config are checked before any work starts.
    sft = sft_config(compare)
    configs = arm_configs(compare, sft.model_dir if sft else None)
    compare.folder.mkdir(parents=True, exist_ok=True)
    write_text_atomic(compare.folder / "compare.toml", compare.source.read_text())
    if sft is not None:
        from selfopd.comparisons.sft import run_sft

        started = time.perf_counter()
        run_sft(sft, progress=progress)
        _note(compare, "sft", time.perf_counter() - started)
    arms = {arm.name: arm for arm in compare.arms}
    for index, (name, seed) in enumerate(compare.runs(), start=1):
        config, run_dir, arm = configs[name, seed], compare.arm_dir(name, seed), arms[name]
        header = f"[{index}/{len(configs)}] arm {name}, seed {seed}"
        if RunFolder(run_dir).finished.is_file():
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
        stopped = {}
        try:
            train(config, resume=resume, initial_eval=None if resume else base_eval(compare, exclude=run_dir))
        except GuardStop as stop:  # reported as such (its last eval is its step's); the other arms go on
            print(f"{header}: {stop}")
            stopped = {"stopped_by_guard": stop.step}
        seconds = time.perf_counter() - started
        fault_point("compare.arm_trained")
        write_json_atomic(RunFolder(run_dir).finished,
                          {"arm": name, "seed": seed, "wall_seconds_last_session": seconds, **stopped})
        _note(compare, f"{name} seed {seed}", seconds)
        if after_run is not None:
            after_run(name, seed, run_dir)


def base_eval(compare: CompareConfig, exclude: Path) -> Path | None:
    """The step-0 eval of a run already made (all arms and seeds start from the same weights)."""
    for name, seed in compare.runs():
        run_dir = compare.arm_dir(name, seed)
        folder = RunFolder(run_dir).eval_dir(0)
        if run_dir != exclude and (folder / "summary.json").is_file():
            return folder
    return None


def _check_unchanged(run_dir: Path, config: TrainConfig, name: str) -> None:
    """A finished or resumed arm must have run with the config it would get now."""
    now, then = flat_config(config), flat_config(load_config(RunFolder(run_dir).config))
    changed = [key for key in now if now[key] != then[key] and key != "run.progress"]
    if changed:
        key = changed[0]
        raise ConfigError(key, f"arm {name} ran with {then[key]!r}, the comparison now says {now[key]!r}: "
                          f"delete {run_dir} to rerun it", source=str(RunFolder(run_dir).config))


def _note(compare: CompareConfig, what: str, seconds: float) -> None:
    """Append to the comparison's timing log (what ran, how long, when)."""
    with (compare.folder / "timing.jsonl").open("a") as handle:  # one whole line per write
        handle.write(json.dumps({"what": what, "wall_seconds": seconds, "finished_at": time.time()}) + "\n")
