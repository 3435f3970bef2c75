"""The `selfopd` command line: help everywhere, clear one-line errors, real outputs."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from selfopd.cli import build_parser, main
from selfopd.core.run_folder import RunFolder

DEMO_CONFIG = Path(__file__).resolve().parents[2] / "experiments" / "demo" / "demo.toml"
SMALL_DATA = "rg:chain_sum?min_terms=2&max_terms=2&size=40&seed=3"


def _all_command_paths(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    paths = [prefix]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                paths.extend(_all_command_paths(sub, prefix + (name,)))
    return paths


def test_every_command_has_help(capsys):
    paths = _all_command_paths(build_parser())
    assert ("prompts", "render") in paths and ("eval",) in paths
    for path in paths:
        with pytest.raises(SystemExit) as exit_info:
            main([*path, "--help"])
        assert exit_info.value.code == 0
        assert "usage: selfopd" in capsys.readouterr().out


def test_python_dash_m_selfopd_runs_the_cli():
    result = subprocess.run([sys.executable, "-m", "selfopd", "prompts", "list"], capture_output=True, text=True)
    assert result.returncode == 0
    assert "teacher/reference_answer" in result.stdout.split()


def test_bad_data_spec_is_one_clear_line(capsys):
    assert main(["data", "show", "rg:no_such_task"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("selfopd: error: rg:no_such_task") and "Traceback" not in err


def test_unknown_template_is_one_clear_line(capsys):
    assert main(["prompts", "lint", "teacher/no_such"]) == 1
    assert "no template 'teacher/no_such'" in capsys.readouterr().err


def test_render_shows_both_prompts_with_token_counts(capsys, smollm2_dir):
    assert main(["prompts", "render", "teacher/reference_answer", "--data", SMALL_DATA, "--index", "2"]) == 0
    out = capsys.readouterr().out
    assert "STUDENT student/plain [" in out and "TEACHER teacher/reference_answer [" in out
    student_tokens, teacher_tokens = (int(n) for n in re.findall(r"\[(\d+) tokens\]", out))
    assert teacher_tokens > student_tokens > 10  # the teacher prompt is the student's plus context


def test_render_shows_a_given_demonstration(capsys, smollm2_dir):
    assert main(["prompts", "render", "teacher/sibling", "--data", SMALL_DATA, "--index", "2",
                 "--demonstration", "Twelve plus nine is 21."]) == 0
    assert "Twelve plus nine is 21." in capsys.readouterr().out


def test_render_index_out_of_range(capsys):
    assert main(["prompts", "render", "teacher/empty", "--data", SMALL_DATA, "--index", "40"]) == 1
    assert "--index 40 is outside" in capsys.readouterr().err


def test_lint_exit_codes(capsys, tmp_path):
    assert main(["prompts", "lint", "--data", SMALL_DATA]) == 0
    out = capsys.readouterr().out
    assert "warning: teacher/answer_hint_leaky" in out
    assert "skip: teacher/hints" in out  # chain_sum has no hints
    assert "ok: teacher/sibling" in out  # rendered with a stand-in demonstration
    broken = tmp_path / "broken.jinja"
    broken.write_text("{{ student_prompt }} {{ nope }}")
    assert main(["prompts", "lint", str(broken), "--data", SMALL_DATA]) == 1


@pytest.mark.parametrize("sample", ["0", "-1"])
def test_lint_on_no_rows_is_refused_not_ok(capsys, sample):
    assert main(["prompts", "lint", "teacher/empty", "--data", SMALL_DATA, "--sample", sample]) == 1
    captured = capsys.readouterr()
    assert "ok:" not in captured.out
    assert captured.err.strip() == (f"selfopd: error: --sample must be >= 1, got {sample}: linting on no rows would "
                                    "check nothing")


# Templates past the size and time limits: `render` and `lint` name the template and the limit.
PAST_LIMITS = [
    ("{{ student_prompt }}{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
     r"slow\.jinja:1: rendering took over 2 s of CPU time, the time limit of a prompt"),
    ("{{ student_prompt }}{% for i in range(99999) %}{{ answer * 99 }}{% endfor %}",
     r"slow\.jinja: renders over 4,000,000 characters, the size limit of a prompt"),
    ("{{ student_prompt }}\n{{ answer | center(10**9) }}",
     r"slow\.jinja:2: filter 'center' would make over 4,000,000 characters, the size limit of a prompt"),
]


@pytest.mark.parametrize("source, expected", PAST_LIMITS, ids=["time", "prompt-size", "value-size"])
def test_render_and_lint_refuse_a_template_past_a_limit(tmp_path, capsys, source, expected):
    template = tmp_path / "slow.jinja"
    template.write_text(source)
    assert main(["prompts", "render", str(template), "--data", SMALL_DATA]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and re.search(rf"^selfopd: error: {re.escape(str(tmp_path))}/{expected}", err), err
    started = time.monotonic()
    assert main(["prompts", "lint", str(template), "--data", SMALL_DATA]) == 1
    out = capsys.readouterr().out
    assert re.search(rf"^error: {re.escape(str(template))}: row \S+: {re.escape(str(tmp_path))}/{expected}", out,
                     re.MULTILINE), out
    assert out.count("error:") == 1 and "ok:" not in out  # one row tells it; the others are not rendered
    assert time.monotonic() - started < 30


@pytest.mark.slow
def test_eval_writes_per_example_records_and_summary(tmp_path, capsys, smollm2_dir):
    out_dir = tmp_path / "eval"
    code = main(["eval", "--data", SMALL_DATA, "--set", "eval.max_tokens=24", "--set", "eval.batch_size=8",
                 "--out", str(out_dir)])
    assert code == 0
    records = [json.loads(line) for line in (out_dir / "eval.jsonl").read_text().splitlines()]
    summary = json.loads((out_dir / "summary.json").read_text())
    assert len(records) == 40 == summary["n"] == summary["prompts"]
    assert summary["accuracy"] == sum(r["correct"] for r in records) / 40
    low, high = summary["ci95"]
    assert 0 <= low <= summary["accuracy"] <= high <= 1
    assert {"id", "prompt", "completion", "extracted", "reference", "correct"} <= set(records[0])
    assert "(40 items, 40 distinct prompts)" in capsys.readouterr().out


@pytest.mark.slow
def test_eval_avg_at_k_averages_per_item(tmp_path, smollm2_dir):
    out_dir = tmp_path / "avg"
    code = main(["eval", "--data", SMALL_DATA, "--set", "eval.max_tokens=12", "--samples", "3",
                 "--temperature", "1.0", "--out", str(out_dir)])
    assert code == 0
    records = [json.loads(line) for line in (out_dir / "eval.jsonl").read_text().splitlines()]
    summary = json.loads((out_dir / "summary.json").read_text())
    assert len(records) == 120 and summary["n"] == 40 and summary["samples_per_item"] == 3
    assert sorted({r["sample"] for r in records}) == [0, 1, 2]
    assert summary["accuracy"] == pytest.approx(sum(r["correct"] for r in records) / 120)
    assert summary["metric"] == "avg@3 accuracy at temperature 1.0"


def _recorded_run(tmp_path: Path) -> tuple[Path, "SplitRecord"]:
    """A run folder as `selfopd train` starts it: its config and its split record."""
    from selfopd.config import config_to_toml, load_config
    from selfopd.data.split import SplitRecord, load_split

    config = load_config(None, [f"data.spec={SMALL_DATA}", "data.eval_size=6", "eval.max_tokens=6", "eval.batch_size=8"])
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    RunFolder(run_dir).write_config(config_to_toml(config))  # as `selfopd train` writes it: signed
    record = SplitRecord.of(SMALL_DATA, 0, *load_split(SMALL_DATA, 6, 0))
    record.write(run_dir)
    return run_dir, record


def test_eval_refuses_prompts_a_run_trained_on(tmp_path, capsys):
    run_dir, _ = _recorded_run(tmp_path)
    other_seed = SMALL_DATA.replace("seed=3", "seed=4")  # "another seed" is mostly the same prompts
    assert main(["eval", "--run", str(run_dir), "--data", other_seed]) == 1
    err = capsys.readouterr().err
    assert re.search(rf"error: \d+ of the 40 distinct prompts of {re.escape(other_seed)} were trained on by {run_dir}", err)
    assert "Traceback" not in err


def test_eval_of_a_run_uses_its_held_out_prompts_and_fresh_data_avoids_all_of_its_prompts(tmp_path, tiny_model_dir):
    run_dir, record = _recorded_run(tmp_path)
    out = tmp_path / "held_out"
    assert main(["eval", "--run", str(run_dir), "--model", str(tiny_model_dir), "--out", str(out)]) == 0
    assert [json.loads(line)["id"] for line in (out / "eval.jsonl").read_text().splitlines()] == record.eval_ids
    fresh = tmp_path / "fresh"
    spec = "rg:chain_sum?min_terms=2&max_terms=3&size=30&seed=3"
    assert main(["eval", "--run", str(run_dir), "--data", spec, "--fresh", "--model", str(tiny_model_dir),
                 "--out", str(fresh)]) == 0
    from selfopd.data.example import prompt_key

    prompts = {prompt_key(json.loads(line)["prompt"]) for line in (fresh / "eval.jsonl").read_text().splitlines()}
    assert len(prompts) == 30 and not prompts & (set(record.train_prompts) | set(record.eval_prompts))


def test_eval_takes_model_data_split_and_eval_settings_from_a_training_config(tmp_path, tiny_model_dir):
    from selfopd.config import load_config
    from selfopd.data.split import load_split

    out = tmp_path / "from_config"
    assert main(["eval", str(DEMO_CONFIG), "--model", str(tiny_model_dir), "--set", "data.eval_size=5",
                 "--set", "eval.max_tokens=3", "--out", str(out)]) == 0
    config = load_config(DEMO_CONFIG)
    _, held_out = load_split(config.data.spec, 5, config.data.split_seed)
    records = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    assert [r["id"] for r in records] == [e.id for e in held_out]
    assert all(r["completion_tokens"] <= 3 for r in records)


def test_avg_at_k_needs_a_temperature(capsys):
    assert main(["eval", "--samples", "4"]) == 1
    assert "needs --temperature > 0" in capsys.readouterr().err


def test_train_show_config_prints_resolved_toml(capsys):
    assert main(["train", str(DEMO_CONFIG), "--set", "optim.lr=3e-6", "--show-config"]) == 0
    out = capsys.readouterr().out
    assert "lr = 3e-06" in out and 'template = "teacher/answer_note"' in out


def test_train_show_config_keeps_auto_and_says_what_it_means_here(capsys, tmp_path):
    assert main(["train", str(DEMO_CONFIG), "--set", "engine.kind=vllm", "--set", "rollout.temperature=1",
                 "--show-config"]) == 0
    out = capsys.readouterr().out
    assert 'dtype = "auto"' in out and "gpu_memory_utilization = 0.0" in out  # a config to copy stays 'auto'
    assert "#   model.dtype = float32 (auto: CPU device)\n" in out
    assert "#   engine.gpu_memory_utilization = 0 (auto: no GPU: vLLM on a CPU uses engine.cpu_kv_cache_gb)\n" in out
    assert "#   engine.request_timeout_s = 0 (auto: no fixed timeout: " in out
    (tmp_path / "shown.toml").write_text(out)  # the notes are comments: the output loads as the config it shows
    assert main(["train", str(tmp_path / "shown.toml"), "--show-config"]) == 0 and capsys.readouterr().out == out


def test_train_config_error_is_one_line(capsys):
    assert main(["train", str(DEMO_CONFIG), "--set", "loss.normalisation=tokens", "--show-config"]) == 1
    err = capsys.readouterr().err
    assert "loss.normalisation" in err and "Traceback" not in err


@pytest.mark.parametrize("kind, message", [
    ("layers", r"{model}/config\.json: num_hidden_layers = 1000000000: past 16,777,216, the most a model size can be"),
    ("chat template", r"{model}/chat_template\.jinja:1: the model's chat template: rendering took over 2 s of CPU "
                      r"time, the time limit of a prompt \(docs/templates\.md#limits\)"),
], ids=["layers", "chat template"])
def test_train_on_a_hostile_model_is_one_line_in_seconds_and_makes_no_run_folder(tmp_path, tiny_model_dir, capsys,
                                                                                   kind, message):
    """A config of 10**9 layers and a chat template of nested loops: refused at the start checks,
    before the run folder is made (before, the one grew memory for minutes, the other hung)."""
    from tests.cli.test_evaluate import _hostile_model

    model = _hostile_model(tiny_model_dir, tmp_path / "model", kind)
    sets = [f"data.spec={SMALL_DATA}", "data.eval_size=4", "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2",
            "optim.micro_batch_prompts=1", "rollout.max_tokens=4", "eval.max_tokens=4", "run.progress=false",
            "run.eval_every=0", f"model.student={model}",
            f"run.out_dir={tmp_path / 'runs'}"]
    started = time.monotonic()
    assert main(["train", str(DEMO_CONFIG), *[arg for s in sets for arg in ("--set", s)]]) == 1
    assert time.monotonic() - started < 60
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip() and not re.search(r"examples/s\]|\| \d+/\d+ \[", line)]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("selfopd: error: ") and re.search(message.format(model=re.escape(str(model))), lines[0])
    assert not (tmp_path / "runs").exists()
