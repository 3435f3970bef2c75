"""`selfopd compare`: config checks (arms may not change the budget), and a real two-arm
comparison of the packaged SmolLM2: shared base eval, skip after interruption, report numbers
against an independent recomputation from the eval files."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import matplotlib.image
import pytest

from selfopd.cli import main
from selfopd.comparisons.compare import arm_configs, load_compare_config, run_compare, sft_config
from selfopd.config import ConfigError, load_config
from selfopd.core.run_folder import RunFolder
from selfopd.data.example import prompt_key
from selfopd.run.tracking import untimed

ROOT = Path(__file__).resolve().parents[2]
DATA = "rg:chain_sum?min_terms=2&max_terms=2&min_digits=1&max_digits=1&size=200&seed=5"
SHARED = [
    f"data.spec={DATA}", "data.eval_size=8", "run.steps=1", "run.eval_every=0", "run.progress=false",
    "run.rollouts_to_save=4", "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_tokens=8",
    "optim.micro_batch_prompts=2", "optim.lr=1e-5", "eval.max_tokens=8", "eval.batch_size=8",
]


def _write(tmp_path: Path, arms: str, extra: str = "", compare_extra: str = "") -> Path:
    path = tmp_path / "cmp.toml"
    path.write_text(
        f"""[compare]
name = "cmp"
out_dir = "{tmp_path / 'runs'}"
base = "{ROOT / 'experiments' / 'demo' / 'demo.toml'}"
set = {json.dumps(SHARED)}
{compare_extra}
{extra}
{arms}"""
    )
    return path


TWO_ARMS = """
[arms.opd]
description = "pure OPD"
set = ["loss.lambda_rl=0", "loss.lambda_opd=1"]

[arms.grpo]
set = ["loss.lambda_opd=0", "loss.lambda_rl=1"]
"""


def test_the_shipped_comparison_parses_and_every_arm_shares_the_budget():
    compare = load_compare_config(ROOT / "experiments" / "self_vs_external" / "compare.toml")
    configs = arm_configs(compare, Path("/nowhere/sft/model"))
    arms = ["self_answer_note", "self_feedback", "frozen_answer_note", "external_sft", "grpo_only", "grpo_opd"]
    assert list(configs) == [(arm, seed) for seed in (0, 1, 2) for arm in arms]  # seed by seed
    assert all(c.run.seed == seed and c.run.name == f"seed{seed}" for (_, seed), c in configs.items())
    assert {(c.rollout.prompts_per_step, c.rollout.samples_per_prompt, c.run.steps) for c in configs.values()} == {(8, 4, 12)}
    assert configs["external_sft", 1].teacher.model == "/nowhere/sft/model"
    assert configs["grpo_only", 2].loss.lambda_opd == 0
    assert configs["grpo_opd", 0].run.out_dir == "runs/self_vs_external/arms/grpo_opd"


def test_the_cures_comparison_parses_with_each_cure_on_in_its_arm_and_on_both_tasks():
    """experiments/cures/arms.toml, as the pre-registration describes it, on the demo task and
    with a sparse task's data set for every arm."""
    for overrides in ((), ("data.spec=rg:basic_arithmetic?min_terms=2&max_terms=2&min_digits=2&max_digits=2&operators=*"
                           "&allow_negation=false&allow_parentheses=false&size=4000&seed=1",)):
        compare = load_compare_config(ROOT / "experiments" / "cures" / "arms.toml", overrides)
        configs = arm_configs(compare, None)
        assert {arm for arm, _ in configs} == {"grpo_only", "demo_recipe", "rlsd", "routing", "contrastive", "pass_rate",
                                               "worked_solution"}
        assert {c.run.steps for c in configs.values()} == {12} and compare.reference == "grpo_only"
        assert len({c.data.spec for c in configs.values()}) == 1
        loss = {arm: c.loss for (arm, seed), c in configs.items() if seed == 0}
        assert loss["rlsd"].rlsd_weight == 0.5 and loss["rlsd"].lambda_opd == 0
        assert loss["routing"].opd_on == "failed" and loss["pass_rate"].pass_rate_weighting
        assert loss["contrastive"].opd_baseline == "wrong_context" and loss["contrastive"].token_clip == 0.5
        assert configs["worked_solution", 0].teacher.template == "teacher/worked_solution"


@pytest.mark.parametrize(
    "arms, extra, message",
    [
        ('[arms.a]\nset = ["rollout.max_tokens=64"]', "", "arms may only change teacher.*, teachers.*, loss.*, optim.*, rollout.max_staleness"),
        ('[arms.a]\nset = ["run.seed=3"]', "", "arms may only change"),
        ('[arms.a]\nset = "loss.lambda_rl=0"', "", "expected a list"),
        ('[arms.a]\nsett = []', "", "arms.a.sett: unknown key (did you mean 'set'?)"),
        ('[arms.a]\nset = ["teacher.kind=external", "teacher.model={sft}"]', "", "no [sft] section"),
        ("", "", "no arms"),
        ('[arms.a]\nset = []', "[extra]\nx = 1", "unknown section"),
        ('[arms.a]\nset = []', "", "compare.seeds: expected distinct seeds >= 0, got [1, 1]"),
    ],
)
def test_bad_comparison_files_name_the_offending_key(tmp_path, arms, extra, message):
    seeds = "seeds = [1, 1]" if "seeds" in message else ""
    with pytest.raises(ConfigError, match=re.escape(message)) as error:
        load_compare_config(_write(tmp_path, arms, extra, compare_extra=seeds))
    assert str(tmp_path / "cmp.toml") in str(error.value)


def test_a_bad_value_in_an_arm_names_the_arm(tmp_path):
    compare = load_compare_config(_write(tmp_path, '[arms.hot]\nset = ["optim.lr=-1"]'))
    with pytest.raises(ConfigError, match=r"arm hot: optim.lr: must be > 0"):
        arm_configs(compare, None)


def test_the_sft_teacher_takes_the_arms_split_and_may_not_change_it(tmp_path):
    arm = '[arms.ext]\nset = ["teacher.kind=external", "teacher.model={sft}", "loss.lambda_rl=0"]'
    compare = load_compare_config(_write(tmp_path, arm, extra='[sft]\nname = "t"\nepochs = 1'))
    config = sft_config(compare)
    assert (config.train.data.spec, config.train.data.eval_size, config.sft.epochs) == (DATA, 8, 1)
    assert config.model_dir == tmp_path / "runs" / "cmp" / "t" / "model"
    assert arm_configs(compare, config.model_dir)["ext", 0].teacher.model == str(config.model_dir)
    # The split is not the [sft] section's to choose: it has no such key.
    with pytest.raises(ConfigError, match=r"sft.eval_size: unknown key"):
        load_compare_config(_write(tmp_path, arm, extra='[sft]\neval_size = 300'))


@pytest.mark.parametrize("name", ["../../x", "a/b", "..", "bad name", "ok\u202etxt"])
def test_an_arm_name_that_is_not_a_plain_folder_name_is_refused_with_one_line(tmp_path, capsys, name):
    """Arm names follow the rule of teacher names: `../../x` would put the arm's run folder outside
    the comparison (OUT_DIR/NAME/arms/../../x/seedS)."""
    path = _write(tmp_path, f'[arms.{json.dumps(name)}]\nset = ["loss.lambda_rl=1"]')
    assert main(["compare", str(path)]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    shown = name.replace("\u202e", "\\u202e")  # the error line escapes control and bidi characters
    assert lines == [f"selfopd: error: {path}: [arms.{shown}]: an arm's name is letters, digits, '_' and '-' (it names "
                     "the arm's folder)"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cmp.toml"]  # no run folder anywhere


@pytest.mark.parametrize("how", ["file", "flag"])
def test_a_comparison_name_that_is_not_a_plain_folder_name_is_refused_with_one_line(tmp_path, capsys, how):
    """The comparison's name becomes OUT_DIR/NAME: `../x` in the file or in --name would put it elsewhere."""
    path = _write(tmp_path, '[arms.a]\nset = ["loss.lambda_rl=1"]')
    if how == "file":
        path.write_text(path.read_text().replace('name = "cmp"', 'name = "../x"'))
    assert main(["compare", str(path), *(["--name", "../x"] if how == "flag" else [])]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    named = f"{path}: compare.name" if how == "file" else "--name"
    assert len(lines) == 1 and f"{named}: must be a plain folder name" in lines[0], lines
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cmp.toml"]


def test_unknown_arm_and_key_are_refused(tmp_path):
    path = _write(tmp_path, TWO_ARMS)
    with pytest.raises(ConfigError, match="no arm named 'nope'"):
        load_compare_config(path, only=["nope"])
    with pytest.raises(ConfigError, match=r"compare.sead: unknown key"):
        load_compare_config(_write(tmp_path, TWO_ARMS, compare_extra="sead = 1"))


@pytest.mark.slow
def test_two_arms_two_seeds_share_the_base_eval_skip_when_finished_and_report_pooled_numbers(tmp_path, smollm2_dir, capsys):
    path = _write(tmp_path, TWO_ARMS, compare_extra='reference = "grpo"\nseeds = [0, 1]')
    assert main(["compare", str(path)]) == 0
    folder = tmp_path / "runs" / "cmp"
    runs = {(arm, seed): folder / "arms" / arm / f"seed{seed}" for arm in ("opd", "grpo") for seed in (0, 1)}
    # One base eval, reused by every arm and seed, byte for byte.
    base_bytes = {(runs[key] / "eval" / "step_00000" / "eval.jsonl").read_bytes() for key in runs}
    assert len(base_bytes) == 1 and all((run / "finished.json").is_file() for run in runs.values())
    assert [load_config(runs["opd", seed] / "config.toml").run.seed for seed in (0, 1)] == [0, 1]

    # The report's numbers, recomputed from the eval files, prompt by prompt.
    def outcomes(key, step: int) -> dict[str, float]:
        lines = (runs[key] / "eval" / f"step_{step:05d}" / "eval.jsonl").read_text().splitlines()
        return {prompt_key(r["prompt"]): float(r["correct"]) for r in map(json.loads, lines)}

    base = outcomes(("opd", 0), 0)
    assert len(base) == 8  # eval_size distinct prompts, each once
    change = {key: sum(outcomes(key, 1)[p] - base[p] for p in base) / len(base) for key in runs}
    summary = {row["name"]: row for row in json.loads((folder / "summary.json").read_text())}
    opd = summary["opd"]
    assert opd["vs_base"]["mean"] == pytest.approx((change["opd", 0] + change["opd", 1]) / 2)
    assert opd["vs_base"]["seeds"] == 2 and opd["vs_base"]["n"] == 8
    assert [run["vs_base"]["mean"] for run in opd["per_seed"]] == pytest.approx([change["opd", 0], change["opd", 1]])
    assert opd["final_accuracy"] == pytest.approx(sum(sum(outcomes(("opd", s), 1).values()) / 8 for s in (0, 1)) / 2)
    vs_reference = [sum(outcomes(("opd", s), 1)[p] - outcomes(("grpo", s), 1)[p] for p in base) / 8 for s in (0, 1)]
    assert opd["vs_reference"]["mean"] == pytest.approx(sum(vs_reference) / 2)
    assert [opd["per_seed_vs_reference"][str(s)]["mean"] for s in (0, 1)] == pytest.approx(vs_reference)
    metrics = [json.loads(line) for line in (runs["grpo", 1] / "metrics.jsonl").read_text().splitlines()]
    assert summary["grpo"]["per_seed"][1]["generated_tokens"] == sum(m["tokens/completion"] for m in metrics if "time/step" in m)
    # Teacher preference for correct attempts, recomputed from the saved rollouts: a contrast
    # per prompt group, averaged per distinct prompt, then over prompts.
    by_prompt: dict = {}
    for seed in (0, 1):
        groups: dict = {}
        for line in (runs["opd", seed] / "rollouts" / "step_00001.jsonl").read_text().splitlines():
            r = json.loads(line)
            signal = sum(t - s for t, s in zip(r["teacher_logprobs"], r["student_logprobs"])) / len(r["completion_ids"])
            groups.setdefault((r["group"], tuple(r["prompt_ids"])), {True: [], False: []})[r["correct"]].append(signal)
        for (_, prompt), g in groups.items():
            if g[True] and g[False]:
                by_prompt.setdefault(prompt, []).append(sum(g[True]) / len(g[True]) - sum(g[False]) / len(g[False]))
    preference = opd["teacher_preference"]
    if by_prompt:
        assert preference["n"] == len(by_prompt)
        assert preference["value"] == pytest.approx(sum(sum(v) / len(v) for v in by_prompt.values()) / len(by_prompt))
    else:
        assert preference is None
    report = (folder / "report.md").read_text()
    assert "| `opd` | self, teacher/answer_note | 1 x OPD + 0 x GRPO | 1 | 0, 1 |" in report
    assert "| `grpo` | none (KL column:" in report and "### Each seed" in report
    assert "8 distinct held-out prompts, none trained on" in report
    image = matplotlib.image.imread(folder / "accuracy.png")
    assert image.shape[1] > 4 * image.shape[0]  # four panels side by side

    # Rerun: nothing trains again.
    before = {key: (run / "metrics.jsonl").read_bytes() for key, run in runs.items()}
    capsys.readouterr()
    assert main(["compare", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.count("finished earlier, not rerun") == 4
    assert {key: (run / "metrics.jsonl").read_bytes() for key, run in runs.items()} == before

    # A run interrupted before its checkpoint starts again; the finished ones are kept.
    (runs["grpo", 1] / "finished.json").unlink()
    shutil.rmtree(runs["grpo", 1] / "checkpoints")
    assert main(["compare", str(path), "--seeds", "1"]) == 0
    out = capsys.readouterr().out
    assert "arm opd, seed 1: finished earlier" in out and "arm grpo, seed 1: interrupted before its first checkpoint" in out
    assert ", seed 0:" not in out  # only the seed asked for is visited; the report still pools both
    assert all(len(row["per_seed"]) == 2 for row in json.loads((folder / "summary.json").read_text()))
    assert (runs["opd", 1] / "metrics.jsonl").read_bytes() == before["opd", 1]

    # A run stopped between its last checkpoint and its mark is marked on the next call, and
    # `after_run` hears of it then, with its final weights still on disk.
    (runs["grpo", 1] / "finished.json").unlink()
    heard = []
    run_compare(load_compare_config(path, only_seeds=[1]), progress=False,
                after_run=lambda arm, seed, run_dir: heard.append(
                    (arm, seed, run_dir, (run_dir / "finished.json").is_file(), RunFolder(run_dir).latest_checkpoint().name)))
    assert heard == [("grpo", 1, runs["grpo", 1], True, "step_00001")]

    def untimed_lines(text: str) -> list[dict]:
        return [untimed(json.loads(line)) for line in text.splitlines()]

    rerun = (runs["grpo", 1] / "metrics.jsonl").read_text()
    assert untimed_lines(rerun) == untimed_lines(before["grpo", 1].decode())  # same seed, same numbers
    assert untimed_lines(rerun) != untimed_lines(before["grpo", 0].decode())  # another seed, other numbers

    # --keep-records: finished runs are copied out without weights; a checkout that lost the
    # comparison's folder gets them back and reports the same numbers without training them.
    keep = tmp_path / "kept"
    summary_before = (folder / "summary.json").read_text()
    capsys.readouterr()
    assert main(["compare", str(path), "--keep-records", str(keep)]) == 0
    for key, run in runs.items():
        kept = keep / run.relative_to(folder)
        assert (kept / "finished.json").is_file() and not (kept / "checkpoints").exists()
        assert (kept / "metrics.jsonl").read_bytes() == (run / "metrics.jsonl").read_bytes()
    shutil.rmtree(folder)
    shutil.rmtree(keep / "arms" / "grpo" / "seed1")  # a run the records never got: trained again
    capsys.readouterr()
    assert main(["compare", str(path), "--keep-records", str(keep)]) == 0
    out = capsys.readouterr().out
    assert out.count("restored ") == 3 and out.count("finished earlier, not rerun") == 3
    assert f"kept the records of grpo seed 1 in {keep / 'arms' / 'grpo' / 'seed1'}" in out
    assert (keep / "arms" / "grpo" / "seed1" / "finished.json").is_file()
    assert not (runs["opd", 0] / "checkpoints").exists()  # restored: records only

    def accuracies(text: str) -> dict:  # grpo seed 1 trained again: same numbers, other wall times
        return {row["name"]: (row["final_accuracy"], row["vs_base"], row["vs_reference"]) for row in json.loads(text)}

    assert accuracies((folder / "summary.json").read_text()) == accuracies(summary_before)

    # A finished arm whose settings changed is not silently reported as the new one.
    path.write_text(path.read_text().replace('"loss.lambda_rl=0"', '"loss.lambda_rl=0", "optim.lr=2e-5"'))
    assert main(["compare", str(path), "--arms", "opd"]) == 1
    assert "arm opd ran with 1e-05, the comparison now says 2e-05" in capsys.readouterr().err


def test_show_config_prints_the_resolved_comparison_and_trains_nothing(tmp_path, capsys):
    import tomllib

    config = ROOT / "experiments" / "self_vs_external" / "compare.toml"
    assert main(["compare", str(config), "--show-config", "--set", "run.steps=4", "--set", f"compare.out_dir={tmp_path}"
                 ]) == 1  # compare.* is not a training setting: refused by name
    assert "[compare]: unknown section" in capsys.readouterr().err
    assert main(["compare", str(config), "--show-config", "--set", "run.steps=4"]) == 0
    printed = capsys.readouterr().out
    tables = tomllib.loads(printed)
    original = load_compare_config(config, ["run.steps=4"])
    assert tables["compare"]["seeds"] == list(original.seeds) and tables["compare"]["set"][-1] == "run.steps=4"
    assert list(tables["arms"]) == [arm.name for arm in original.arms]
    # Saved next to the original, it is the same comparison.
    copy = config.parent / f".show-config-{tmp_path.name}.toml"
    try:
        copy.write_text(printed)
        again = load_compare_config(copy)
    finally:
        copy.unlink()
    assert (again.name, again.base, again.common, again.arms, again.seeds, again.reference) == (
        original.name, original.base, original.common, original.arms, original.seeds, original.reference)
    # Each arm lists the values it runs with where they differ from the shared config.
    block = printed.split("[arms.self_feedback]")[1].split("[arms.")[0]
    assert '#   teacher.template = "teacher/verifier_feedback"' in block and "#   loss.lambda_rl = 0.0" in block
    assert "#   teacher.template" not in printed.split("[arms.grpo_opd]")[1]  # the demo's own template


def test_show_config_checks_every_arm(tmp_path, capsys):
    (tmp_path / "base.toml").write_text("")
    good = '[compare]\nbase = "base.toml"\nout_dir = "out"\n[arms.a]\nset = ["loss.lambda_opd=0.5"]\n'
    (tmp_path / "c.toml").write_text(good)
    assert main(["compare", str(tmp_path / "c.toml"), "--show-config"]) == 0
    assert "#   loss.lambda_opd = 0.5" in capsys.readouterr().out and not (tmp_path / "out").exists()
    assert main(["compare", str(tmp_path / "c.toml"), "--show-config", "--name", "smoke"]) == 0
    assert 'name = "smoke"' in capsys.readouterr().out
    (tmp_path / "c.toml").write_text(good + '[arms.b]\nset = ["loss.divergence=no_such"]\n')
    assert main(["compare", str(tmp_path / "c.toml"), "--show-config"]) == 1
    assert "arm b" in capsys.readouterr().err
