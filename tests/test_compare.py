"""`selfopd compare`: config checks (arms may not change the budget), and a real two-arm
comparison of the packaged SmolLM2: shared base eval, skip after interruption, report numbers
against an independent recomputation from the eval files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import matplotlib.image
import pytest

from selfopd.cli import main
from selfopd.compare import arm_configs, load_compare_config, sft_config
from selfopd.config import ConfigError
from selfopd.stats import paired_difference

ROOT = Path(__file__).resolve().parents[1]
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
base = "{ROOT / 'experiments' / 'demo.toml'}"
set = {json.dumps(SHARED)}
{compare_extra}
{extra}
{arms}"""
    )
    return path


TWO_ARMS = """
[arms.opd]
description = "pure OPD"
set = ["loss.lambda_rl=0"]

[arms.grpo]
set = ["loss.lambda_opd=0", "loss.lambda_rl=1"]
"""


def test_the_shipped_comparison_parses_and_every_arm_shares_the_budget():
    compare = load_compare_config(ROOT / "experiments" / "self_vs_external.toml")
    configs = arm_configs(compare, Path("/nowhere/sft/model"))
    assert list(configs) == ["self_answer_note", "self_feedback", "frozen_answer_note", "external_sft", "grpo_only", "grpo_opd"]
    assert {c.run.seed for c in configs.values()} == {0}
    assert {(c.rollout.prompts_per_step, c.rollout.samples_per_prompt, c.run.steps) for c in configs.values()} == {(8, 4, 8)}
    assert configs["external_sft"].teacher.model == "/nowhere/sft/model"
    assert configs["grpo_only"].loss.lambda_opd == 0
    assert {c.run.out_dir for c in configs.values()} == {"runs/self_vs_external/arms"}


@pytest.mark.parametrize(
    "arms, extra, message",
    [
        ('[arms.a]\nset = ["rollout.max_tokens=64"]', "", "arms may only change teacher.*, loss.*, optim.*"),
        ('[arms.a]\nset = ["run.seed=3"]', "", "arms may only change"),
        ('[arms.a]\nset = "loss.lambda_rl=0"', "", "expected a list"),
        ('[arms.a]\nsett = []', "", "an arm is a table"),
        ('[arms.a]\nset = ["teacher.kind=external", "teacher.model={sft}"]', "", "no [sft] section"),
        ("", "", "no arms"),
        ('[arms.a]\nset = []', "[extra]\nx = 1", "unknown section"),
    ],
)
def test_bad_comparison_files_name_the_offending_key(tmp_path, arms, extra, message):
    with pytest.raises(ConfigError, match=message.replace("*", r"\*").replace("[", r"\[").replace("]", r"\]")) as error:
        load_compare_config(_write(tmp_path, arms, extra))
    assert str(tmp_path / "cmp.toml") in str(error.value)


def test_a_bad_value_in_an_arm_names_the_arm(tmp_path):
    compare = load_compare_config(_write(tmp_path, '[arms.hot]\nset = ["optim.lr=-1"]'))
    with pytest.raises(ConfigError, match=r"arm hot: optim.lr: must be > 0"):
        arm_configs(compare, None)


def test_the_sft_teacher_takes_the_arms_split_and_may_not_change_it(tmp_path):
    arm = '[arms.ext]\nset = ["teacher.kind=external", "teacher.model={sft}", "loss.lambda_rl=0"]'
    compare = load_compare_config(_write(tmp_path, arm, extra='[sft]\nname = "t"\nepochs = 1'))
    config = sft_config(compare)
    assert (config.data, config.eval_size, config.epochs) == (DATA, 8, 1)
    assert config.model_dir == tmp_path / "runs" / "cmp" / "t" / "model"
    assert arm_configs(compare, config.model_dir)["ext"].teacher.model == str(config.model_dir)
    compare = load_compare_config(_write(tmp_path, arm, extra='[sft]\neval_size = 300'))
    with pytest.raises(ConfigError, match=r"sft.eval_size: is 300 but the arms' data.eval_size is 8"):
        sft_config(compare)


def test_unknown_arm_and_key_are_refused(tmp_path):
    path = _write(tmp_path, TWO_ARMS)
    with pytest.raises(ConfigError, match="no arm named 'nope'"):
        load_compare_config(path, only=["nope"])
    with pytest.raises(ConfigError, match=r"compare.sead: unknown key"):
        load_compare_config(_write(tmp_path, TWO_ARMS, compare_extra="sead = 1"))


@pytest.mark.slow
def test_two_arms_share_the_base_eval_skip_when_finished_and_report_paired_numbers(tmp_path, smollm2_dir, capsys):
    path = _write(tmp_path, TWO_ARMS, compare_extra='reference = "grpo"')
    assert main(["compare", str(path)]) == 0
    folder = tmp_path / "runs" / "cmp"
    arms = folder / "arms"
    # One base eval, reused: the second arm's step-0 eval is the first arm's, byte for byte.
    assert (arms / "opd" / "eval" / "step_00000" / "eval.jsonl").read_bytes() == \
        (arms / "grpo" / "eval" / "step_00000" / "eval.jsonl").read_bytes()
    assert (arms / "opd" / "finished.json").is_file() and (arms / "grpo" / "finished.json").is_file()

    # The report's numbers, recomputed from the eval files.
    def outcomes(arm: str, step: int) -> dict[str, bool]:
        lines = (arms / arm / "eval" / f"step_{step:05d}" / "eval.jsonl").read_text().splitlines()
        return {r["id"]: r["correct"] for r in map(json.loads, lines)}

    base, opd, grpo = outcomes("opd", 0), outcomes("opd", 1), outcomes("grpo", 1)
    ids = sorted(base)
    summary = {row["name"]: row for row in json.loads((folder / "summary.json").read_text())}
    assert summary["opd"]["final_accuracy"] == sum(opd.values()) / len(opd)
    assert summary["opd"]["vs_base"]["mean"] == pytest.approx(
        paired_difference([base[i] for i in ids], [opd[i] for i in ids]).mean)
    assert summary["opd"]["vs_reference"]["mean"] == pytest.approx(
        sum(opd[i] - grpo[i] for i in ids) / len(ids))
    metrics = [json.loads(line) for line in (arms / "grpo" / "metrics.jsonl").read_text().splitlines()]
    assert summary["grpo"]["generated_tokens"] == sum(m["tokens/completion"] for m in metrics if "time/step" in m)
    # Teacher preference for correct attempts, recomputed from the saved rollouts.
    groups: dict = {}
    for line in (arms / "opd" / "rollouts" / "step_00001.jsonl").read_text().splitlines():
        r = json.loads(line)
        signal = sum(t - s for t, s in zip(r["teacher_logprobs"], r["student_logprobs"])) / len(r["completion_ids"])
        groups.setdefault(r["group"], {True: [], False: []})[r["correct"]].append(signal)
    contrasts = [sum(g[True]) / len(g[True]) - sum(g[False]) / len(g[False]) for g in groups.values() if g[True] and g[False]]
    preference = summary["opd"]["teacher_preference"]
    if contrasts:
        assert preference["n"] == len(contrasts)
        assert preference["value"] == pytest.approx(sum(contrasts) / len(contrasts))
    else:
        assert preference is None
    report = (folder / "report.md").read_text()
    assert "| `opd` | self, teacher/answer_note | 1 x OPD + 0 x GRPO | 1 |" in report
    assert "| `grpo` | none (KL column:" in report
    image = matplotlib.image.imread(folder / "accuracy.png")
    assert image.shape[1] > 4 * image.shape[0]  # four panels side by side

    # Rerun: nothing trains again.
    before = {arm: (arms / arm / "metrics.jsonl").read_bytes() for arm in ("opd", "grpo")}
    capsys.readouterr()
    assert main(["compare", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.count("finished earlier, not rerun") == 2
    assert {arm: (arms / arm / "metrics.jsonl").read_bytes() for arm in ("opd", "grpo")} == before

    # An arm interrupted before its checkpoint starts again; the finished one is kept.
    (arms / "grpo" / "finished.json").unlink()
    shutil.rmtree(arms / "grpo" / "checkpoints")
    assert main(["compare", str(path)]) == 0
    out = capsys.readouterr().out
    assert "arm opd: finished earlier" in out and "arm grpo: interrupted before its first checkpoint" in out
    assert (arms / "opd" / "metrics.jsonl").read_bytes() == before["opd"]
    def untimed(text: str) -> list[dict]:
        return [{k: v for k, v in json.loads(line).items() if not k.startswith("time/")} for line in text.splitlines()]

    rerun = (arms / "grpo" / "metrics.jsonl").read_text()
    assert untimed(rerun) == untimed(before["grpo"].decode())  # same seed, same numbers

    # A finished arm whose settings changed is not silently reported as the new one.
    path.write_text(path.read_text().replace('"loss.lambda_rl=0"', '"loss.lambda_rl=0", "optim.lr=2e-5"'))
    assert main(["compare", str(path), "--arms", "opd"]) == 1
    assert "arm opd ran with 1e-05, the comparison now says 2e-05" in capsys.readouterr().err
