"""Several teachers in one run (`[teachers.NAME]`): every example reaches the teacher its rule
names, per-teacher metrics match hand counts from the saved rollouts, teachers of the same weights
share one engine, a config with one teacher behaves as before, and bad routing is refused at start."""

from __future__ import annotations

import json

import pytest
import torch

from selfopd.config import ConfigError, config_to_toml
from selfopd.data import load_examples
from selfopd.run.rollouts import rollout_digest_lines
from selfopd.training.teacher_metrics import starved_teachers
from selfopd.training.trainer import build_run, train
from selfopd.run.tracking import untimed
from tests.training.test_trainer import _config, _lines

MIXED = ("data.spec=rg:chain_sum?min_terms=2&max_terms=2&size=30&seed=2 + "
         "rg:basic_arithmetic?min_terms=2&max_terms=2&size=30&seed=1")
ARITH = ["teachers.arith.kind=frozen", "teachers.arith.tasks=rg:basic_arithmetic",
         "teachers.arith.template=teacher/answer_note"]


def _records(run_dir):
    return [json.loads(line) for path in sorted((run_dir / "rollouts").glob("step_*.jsonl"))
            for line in path.read_text().splitlines()]


def test_examples_reach_their_teachers_and_metrics_match_hand_counts(tmp_path, tiny_model_dir):
    run_dir = train(_config(tmp_path, tiny_model_dir, MIXED, "data.eval_size=2", *ARITH, "run.steps=2",
                            "run.name=mixed"))
    task = {e.id: e.meta["task"] for e in load_examples(MIXED.partition("=")[2])}
    records = _records(run_dir)
    assert {r["teacher"] for r in records} == {"default", "arith"}
    for record in records:  # the rule: basic_arithmetic to 'arith', the rest to [teacher]
        assert record["teacher"] == ("arith" if task[record["id"]] == "rg:basic_arithmetic" else "default")
    for line in (m for m in _lines(run_dir) if "loss/pg" in m):
        mine = [r for r in records if r["step"] == line["step"]]
        total = sum(len(r["completion_ids"]) for r in mine)
        for name in ("default", "arith"):
            theirs = [r for r in mine if r["teacher"] == name]
            tokens = sum(len(r["completion_ids"]) for r in theirs)
            assert line[f"teacher/{name}/token_share"] == pytest.approx(tokens / total, abs=1e-12)
            signal = torch.tensor([t - s for r in theirs for t, s in zip(r["teacher_logprobs"], r["student_logprobs"])],
                                  dtype=torch.float64)
            assert line[f"teacher/{name}/advantage_mean"] == pytest.approx(signal.mean().item(), abs=1e-6)
            assert line[f"teacher/{name}/reverse_kl"] == pytest.approx(-signal.mean().item(), abs=1e-6)
            # teacher-prefers-correct: per group with both outcomes, correct minus wrong mean signal
            groups = {}
            for r in theirs:
                mean = sum(t - s for t, s in zip(r["teacher_logprobs"], r["student_logprobs"])) / len(r["completion_ids"])
                groups.setdefault(r["group"], {True: [], False: []})[r["correct"]].append(mean)
            contrasts = [sum(g[True]) / len(g[True]) - sum(g[False]) / len(g[False]) for g in groups.values()
                         if g[True] and g[False]]
            if contrasts:
                assert line[f"teacher/{name}/correct_preference"] == pytest.approx(sum(contrasts) / len(contrasts), abs=1e-6)
            else:
                assert f"teacher/{name}/correct_preference" not in line
    assert "[teachers.arith]" in (run_dir / "config.toml").read_text()
    assert "teacher/answer_note" in json.loads((run_dir / "templates" / "index.json").read_text())  # kept for a resume


def test_teachers_of_the_same_weights_share_one_engine(tmp_path, tiny_model_dir):
    three = MIXED + " + rg:products?size=30&seed=3"
    run = build_run(_config(tmp_path, tiny_model_dir, three, "data.eval_size=2", "rollout.prompts_per_step=3", *ARITH,
                            "teachers.again.kind=frozen", "teachers.again.tasks=rg:chain_sum", "teachers.live.kind=self",
                            "teachers.live.tasks=rg:products", "run.name=engines"))
    try:
        named = run.teachers
        assert named["arith"].engine is named["again"].engine  # one frozen copy
        assert named["arith"].engine is not run.student_engine
        assert named["live"].engine is run.student_engine  # `self`: the live student, never a copy
    finally:
        run.close()


def test_one_teacher_behaves_as_before(tmp_path, tiny_model_dir):
    """A config without [teachers.*] writes no teacher names or per-teacher metrics, and routing every
    task to a named teacher equal to [teacher] changes no rollout and no other metric."""
    plain = train(_config(tmp_path, tiny_model_dir, MIXED, "data.eval_size=2", "run.steps=2", "run.name=plain"))
    assert "\n[teachers." not in (plain / "config.toml").read_text()  # no table
    assert not any(key.startswith("teacher/") for line in _lines(plain) for key in line)
    assert all("teacher" not in record for record in _records(plain))
    both = ["teachers.same.tasks=rg:basic_arithmetic,rg:chain_sum"]
    routed = train(_config(tmp_path, tiny_model_dir, MIXED, "data.eval_size=2", "run.steps=2", "run.name=routed",
                           *both))
    assert {r["teacher"] for r in _records(routed)} == {"same"}
    digest = [{k: v for k, v in json.loads(line).items() if k != "teacher"}
              for line in rollout_digest_lines(routed).splitlines()]
    assert digest == [json.loads(line) for line in rollout_digest_lines(plain).splitlines()]

    def without_teachers(line):
        return {k: v for k, v in untimed(line).items() if not k.startswith("teacher/")}
    assert [without_teachers(m) for m in _lines(routed)] == [without_teachers(m) for m in _lines(plain)]


def _jsonl(tmp_path, teachers):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"What is {i} + {i}?", "answer": str(2 * i), "teacher": t}) + "\n"
                            for i, t in enumerate(teachers)))
    return path


def test_a_teacher_column_routes_rows_and_an_unknown_name_is_refused_naming_the_row(tmp_path, tiny_model_dir):
    names = ["", "notes"] * 10
    path = _jsonl(tmp_path, names)
    base = [f"data.spec={path}", "data.eval_size=4", "teachers.notes.kind=frozen", "run.steps=1"]
    run_dir = train(_config(tmp_path, tiny_model_dir, *base, "run.name=column"))
    by_prompt = {f"What is {i} + {i}?": t or "default" for i, t in enumerate(names)}
    from selfopd.data import load_examples as load
    prompts = {e.id: e.prompt for e in load(str(path))}
    for record in _records(run_dir):
        assert record["teacher"] == by_prompt[prompts[record["id"]]]
    bad = _jsonl(tmp_path, ["", "notes", "nots", ""] * 5)
    with pytest.raises(ConfigError, match=r"data row 2 of .*rows.jsonl.*names teacher 'nots', which this config does "
                                          r"not have \(teachers: default, notes"):
        build_run(_config(tmp_path, tiny_model_dir, *base, f"data.spec={bad}", "run.name=bad-column"))
    assert not (tmp_path / "bad-column").exists()


@pytest.mark.parametrize("settings, message", [
    (["teachers.x.tasks=rg:products"], r"teachers.x.tasks: no task 'rg:products' in data.spec"),
    (["teachers.x.kind=frozen"], r"\[teachers.x\]: no training example is routed to this teacher"),
])
def test_routing_that_reaches_nothing_is_refused(tmp_path, tiny_model_dir, settings, message):
    with pytest.raises(ConfigError, match=message):
        build_run(_config(tmp_path, tiny_model_dir, MIXED, "data.eval_size=2", *settings, "run.name=refused"))


@pytest.mark.parametrize("settings, key", [
    (["teachers.default.kind=frozen"], "[teachers.default]"),
    (["teachers.a.kind=ema"], "teachers.a.kind"),
    (["teachers.a.tasks=t", "teachers.b.tasks=t"], "teachers.b.tasks"),
    (["teacher.tasks=t"], "teacher.tasks"),
    (["teachers.a.kind=frozen", "engine.kind=vllm"], "engine.kind"),
    (["teachers.a.kind=frozen", "loss.divergence=reverse_kl"], "loss.divergence"),
    (["teachers.a.kind=external", "teachers.a.model=m", "teachers.a.tokenizer=own", "loss.divergence=topk_reverse_kl"],
     "teachers.a.tokenizer"),
    (["teachers.a.ema_rate=2"], "teachers.a.ema_rate"),
])
def test_teacher_tables_are_checked(settings, key):
    from selfopd.config import load_config

    with pytest.raises(ConfigError) as error:
        load_config(None, settings)
    assert error.value.key == key


def test_named_teachers_round_trip_through_toml(tmp_path):
    from selfopd.config import load_config

    config = load_config(None, [*ARITH, "teachers.b.kind=external", "teachers.b.model=org/m", "teachers.b.tokenizer=own"])
    path = tmp_path / "c.toml"
    path.write_text(config_to_toml(config))
    assert load_config(path) == config and list(config.teachers) == ["arith", "b"]


def test_a_starved_teacher_is_found_once_its_streak_reaches_the_limit():
    lines = [{"teacher/a/token_share": 0.0, "teacher/b/token_share": 1.0}] * 2 + [
        {"teacher/a/token_share": 0.0, "teacher/b/token_share": 0.0}] * 3
    assert starved_teachers(lines, ["a", "b"], 3) == ["a", "b"]
    assert starved_teachers(lines[:3], ["a", "b"], 3) == ["a"]
    assert starved_teachers(lines[:2], ["a", "b"], 3) == []
    assert starved_teachers(lines, ["a", "b"], 0) == []


def test_diagnose_reports_each_teacher_on_its_own_rollouts(tmp_path, tiny_model_dir, capsys):
    from selfopd.cli import main

    run_dir = train(_config(tmp_path, tiny_model_dir, MIXED, "data.eval_size=4", *ARITH, "run.steps=1",
                            "run.name=diagnosed"))
    main(["diagnose", str(run_dir), "--no-model", "--heatmaps", "0"])
    assert "teacher 'default':" in capsys.readouterr().out
    records = _records(run_dir)
    for name in ("default", "arith"):
        summary = json.loads((run_dir / "diagnostics" / name / "summary.json").read_text())
        assert summary["steps"] == [1]
        assert summary["behaviour"][0]["rollouts"] == sum(r["teacher"] == name for r in records)  # its own only
    assert "(teacher 'arith')" in json.loads((run_dir / "diagnostics" / "arith" / "summary.json").read_text())["teacher"]
    main(["diagnose", str(run_dir), "--teacher", "arith", "--gap-items", "2", "--transfer-items", "0", "--heatmaps", "0"])
    arith = json.loads((run_dir / "diagnostics" / "arith" / "summary.json").read_text())
    assert arith["at_start"]["gap"] is not None and "answer_note" in arith["teacher"]
    capsys.readouterr()
    assert main(["diagnose", str(run_dir), "--teacher", "nobody"]) == 1
    assert "--teacher nobody: " in (err := capsys.readouterr().err) and "has teachers default, arith" in err


def test_a_comparison_arm_may_add_a_teacher(tmp_path):
    from selfopd.comparisons.compare import arm_configs, load_compare_config

    (tmp_path / "base.toml").write_text(f'[data]\nspec = "{MIXED.partition("=")[2]}"\n')
    (tmp_path / "compare.toml").write_text(
        '[compare]\nbase = "base.toml"\nreference = "one"\n[arms.one]\nset = []\n'
        '[arms.two]\nset = ["teachers.arith.kind=frozen", "teachers.arith.tasks=rg:basic_arithmetic"]\n')
    configs = arm_configs(load_compare_config(tmp_path / "compare.toml"), None)
    assert [list(c.teachers) for (arm, _), c in sorted(configs.items())] == [[], ["arith"]]


def test_teacher_metrics_on_a_hand_computed_case():
    from selfopd.training.teacher_metrics import teacher_metrics

    # Rollouts: (teacher, tokens, group, correct); per-token signal teacher - student.
    teacher_of = ["a", "a", "b", "a", "b"]
    lengths = [2, 1, 3, 2, 0]
    signal = torch.tensor([1.0, 3.0, -1.0, 0.5, 0.5, 0.5, 4.0, 0.0])
    outcomes = [(0, True), (0, False), (1, True), (2, False), (1, False)]
    metrics = teacher_metrics(["default", "a", "b"], teacher_of, lengths, signal, [True] * 5, outcomes)
    assert metrics["teacher/default/token_share"] == 0.0 and "teacher/default/advantage_mean" not in metrics
    assert metrics["teacher/a/token_share"] == 5 / 8 and metrics["teacher/b/token_share"] == 3 / 8
    assert metrics["teacher/a/advantage_mean"] == pytest.approx((1 + 3 - 1 + 4 + 0) / 5)
    assert metrics["teacher/b/reverse_kl"] == pytest.approx(-0.5)
    # group 0 (teacher a): correct rollout mean 2.0, wrong one -1.0: contrast 3.0; group 2 has one outcome only
    assert metrics["teacher/a/correct_preference"] == pytest.approx(3.0)
    assert "teacher/b/correct_preference" not in metrics  # its wrong rollout of group 1 has no tokens
    masked = teacher_metrics(["a"], teacher_of, lengths, signal, [False, True, True, True, True], outcomes)
    assert masked["teacher/a/token_share"] == 5 / 8  # an unreadable completion counts in the share...
    assert masked["teacher/a/advantage_mean"] == pytest.approx((-1 + 4 + 0) / 3)  # ... not in the means


def test_the_starved_teacher_warning_is_printed_once_per_streak(tmp_path, tiny_model_dir, capsys):
    """A teacher that a row names but that few steps reach: its share is 0 on most steps. [teacher],
    which this data never reaches, is never warned about."""
    names = ["notes"] * 19 + ["rare"]
    path = _jsonl(tmp_path, names)
    train(_config(tmp_path, tiny_model_dir, f"data.spec={path}", "data.eval_size=2", "teachers.notes.kind=frozen",
                  "teachers.rare.kind=frozen", "guard.starved_teacher_steps=2", "run.steps=5", "run.name=starved",
                  "rollout.prompts_per_step=1", "optim.micro_batch_prompts=1"))
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "has received no completion tokens" in line]
    assert lines and all("'rare'" in line for line in lines) and not any("'default'" in line for line in err.splitlines())
    assert len(lines) <= 2  # once per streak of >= 2 steps, not every step


@pytest.mark.parametrize("table", ["teacher", "teachers.arith"])
def test_errors_name_the_table_of_the_teacher_they_concern(tmp_path, tiny_model_dir, table):
    sets = [f"{table}.template=teacher/sibling", f"{table}.demonstration_fallback=teacher/sibling"]
    with pytest.raises(ConfigError) as error:
        build_run(_config(tmp_path, tiny_model_dir, MIXED, "data.eval_size=2", *ARITH, *sets, "run.name=fallback"))
    assert error.value.key == f"{table}.demonstration_fallback" and "uses 'demonstration' itself" in str(error.value)
