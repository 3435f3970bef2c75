"""`selfopd sft`: config errors, rejection sampling, solution targets, the saved and reused teacher.

Config and plumbing tests need no model or a tiny random one; one test runs the whole
command on the real packaged SmolLM2 at a tiny size (about half a minute on 2 CPU cores).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from selfopd.cli import main
from selfopd.config import ConfigError
from selfopd.data import load_examples
from selfopd.data.split import split_examples
from selfopd.engines.base import Rollout
from selfopd.engines.local import LocalEngine
from selfopd.engines.base import SamplingParams
from selfopd.comparisons.sft import SftConfig, load_sft_config, run_sft, sft_config_to_toml
from selfopd.core.models import MARKER, teacher_trained_prompts
from selfopd.comparisons.sft_targets import sampled_targets, select_rollouts
from selfopd.templating.chat_format import ChatFormat
from selfopd.templating.templates import load_template, prompt_token_ids, render_student, render_teacher
from selfopd.templating.tokenizer_check import check_tokenizers_compatible

TINY_DATA = "rg:chain_sum?min_terms=2&max_terms=2&min_digits=1&max_digits=1&size=40&seed=3"


# --------------------------------------------------------------------------- config


def test_defaults_are_the_demo_task_and_split():
    from selfopd.config import load_config

    config, demo = SftConfig(), load_config(Path(__file__).resolve().parents[2] / "experiments" / "demo" / "demo.toml")
    assert (config.train.data.spec, config.train.data.eval_size, config.train.data.split_seed,
            config.train.data.student_template) == (
        demo.data.spec, demo.data.eval_size, demo.data.split_seed, demo.data.student_template)
    assert config.model_dir == Path("runs") / "sft-teacher" / "model"
    # A training config is an SFT config: same data, same split, same eval budget.
    from_demo = load_sft_config(Path(__file__).resolve().parents[2] / "experiments" / "demo" / "demo.toml")
    assert from_demo.train.data == demo.data and from_demo.train.eval == demo.eval


@pytest.mark.parametrize(
    ("override", "key", "fragment"),
    [
        ("sft.epoch=3", "sft.epoch", "did you mean 'epochs'"),
        ("sft.lr=0", "sft.lr", "must be > 0"),
        ("sft.lr=fast", "sft.lr", "expected a number"),
        ("sft.epochs=true", "sft.epochs", "expected an integer"),
        ("sft.targets=solutions", "sft.targets", "must be one of 'auto', 'solution', 'sampled'"),
        ("sft.samples_per_prompt=4", "sft.samples_per_prompt", "greedy samples are identical"),
        ("sft.name=a/b", "sft.name", "plain folder name"),
        ("sft.batch_size=0", "sft.batch_size", "must be >= 1"),
        ("data.eval_size=0", "data.eval_size", "0 holds nothing out of data.spec"),
        ("eval.max_tokenz=4", "eval.max_tokenz", "did you mean 'max_tokens'"),
    ],
)
def test_bad_settings_name_the_key_and_source(override, key, fragment):
    with pytest.raises(ConfigError) as caught:
        load_sft_config(None, [override])
    assert caught.value.key == key and fragment in str(caught.value) and str(caught.value).startswith(f"--set {override}: ")


def test_file_and_overrides(tmp_path):
    path = tmp_path / "sft.toml"
    path.write_text('[sft]\nname = "from-file"\nlr = 1e-5\nepochs = 3\n[data]\neval_size = 50\n')
    config = load_sft_config(path, ["sft.lr=3e-5", "sft.batch_size=8"])
    assert (config.sft.name, config.sft.lr, config.sft.epochs, config.sft.batch_size) == ("from-file", 3e-5, 3, 8)
    assert config.train.data.eval_size == 50
    round_trip = tmp_path / "round_trip.toml"
    round_trip.write_text(sft_config_to_toml(config))
    assert load_sft_config(round_trip) == config
    (tmp_path / "bad.toml").write_text('[sft]\nepochs = "two"\n')
    with pytest.raises(ConfigError, match=r"bad.toml: sft.epochs: expected an integer"):
        load_sft_config(tmp_path / "bad.toml")
    (tmp_path / "other.toml").write_text('[train]\nsteps = 3\n')
    with pytest.raises(ConfigError, match=r"other.toml: \[train\]: unknown section"):
        load_sft_config(tmp_path / "other.toml")
    with pytest.raises(ConfigError, match="no such config file"):
        load_sft_config(tmp_path / "missing.toml")


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("data.spec=rg:no_such_task", "data.spec"),
        ("sft.sample_template=teacher/no_such_template", "sft.sample_template"),
        ("data.student_template=student/nope", "data.student_template"),
        ("data.eval_size=5000", "data.eval_size"),
    ],
)
def test_bad_inputs_fail_before_any_model_loads(tmp_path, override, key):
    config = load_sft_config(None, [f"run.out_dir={tmp_path}", "model.student=/no/such/model", override])
    with pytest.raises(ConfigError) as caught:
        run_sft(config, progress=False)
    assert caught.value.key == key


def test_missing_student_model_names_it(tmp_path, capsys):
    assert main(["sft", "--set", f"run.out_dir={tmp_path}", "--set", "model.student=/no/such/model",
                 "--set", f"data.spec={TINY_DATA}", "--set", "data.eval_size=4"]) == 1
    assert "model spec '/no/such/model'" in capsys.readouterr().err


def test_sft_refuses_to_train_on_prompts_a_student_run_holds_out(tmp_path, capsys):
    from selfopd.data.split import SplitRecord

    examples = load_examples(TINY_DATA)
    # A student run that held out 10 prompts, split with another seed than the teacher's.
    train, held_out = split_examples(examples, eval_size=10, seed=7)
    run_dir = tmp_path / "student-run"
    run_dir.mkdir()
    SplitRecord.of(TINY_DATA, 7, train, held_out).write(run_dir)
    args = ["sft", "--set", f"run.out_dir={tmp_path}", "--set", "model.student=/no/such/model",
            "--set", f"data.spec={TINY_DATA}", "--set", "data.eval_size=4", "--student-run", str(run_dir)]
    assert main(args) == 1
    error = capsys.readouterr().err
    teacher_train, _ = split_examples(examples, eval_size=4, seed=0)
    shared = {e.prompt for e in teacher_train} & {e.prompt for e in held_out}
    assert f"the teacher would train on {len(shared)} of the 10 prompts that {run_dir} holds out" in error
    assert not (tmp_path / "sft-teacher").exists()  # refused before anything was written
    # With the run's own split, nothing it holds out is a training item: the check passes
    # and the run fails later, at the missing model.
    assert main([*args, "--set", "data.eval_size=10", "--set", "data.split_seed=7"]) == 1
    assert "model spec '/no/such/model'" in capsys.readouterr().err


def test_cli_reports_errors_in_one_line(capsys):
    assert main(["sft", "--set", "sft.lrr=1"]) == 1
    assert "sft.lrr: unknown key (did you mean 'lr'?)" in capsys.readouterr().err
    assert main(["sft", "--set", "sft.epochs=3", "--show-config"]) == 0
    shown = capsys.readouterr().out
    assert shown.startswith("[run]\n") and "\n[sft]\n" in shown and "epochs = 3\n" in shown


# --------------------------------------------------------------------------- targets


def _rollout(text: str, ids: list[int], finish: str = "stop") -> Rollout:
    return Rollout(prompt_ids=[1], completion_ids=ids, sampler_logprobs=[0.0] * len(ids), finish_reason=finish, text=text)


def test_rejection_keeps_only_correct_finished_distinct_rollouts():
    example = load_examples(TINY_DATA)[0]
    right, wrong = f"The answer is {example.answer}.", f"The answer is {int(example.answer) + 1}."
    rollouts = [
        _rollout(right, [5, 6]),
        _rollout(wrong, [7, 8]),
        _rollout(right, [5, 6]),  # a repeat
        _rollout(right, [9, 10], finish="length"),  # cut at max_tokens
        _rollout(f"It is {example.answer}", [11]),
    ]
    kept, counts = select_rollouts(example, rollouts)
    assert [r.completion_ids for r in kept] == [[5, 6], [11]]
    assert counts == {"drawn": 5, "wrong": 1, "unfinished": 1, "duplicate": 1}


def test_solution_targets_append_the_answer_and_train(tmp_path, tiny_model_dir):
    rows = [{"prompt": f"What is {a} + {b}?", "answer": str(a + b),
             "solution": f"Add {a} and {b} to get {a + b}." if a % 2 else f"Add {a} and {b}."}
            for a in range(1, 7) for b in range(1, 4)]
    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = load_sft_config(None, [f"run.out_dir={tmp_path}", "sft.name=solution", f"model.student={tiny_model_dir}",
                                    f"data.spec={data}?solution=solution", "data.eval_size=4", "sft.train_examples=0",
                                    "sft.epochs=2", "sft.batch_size=7", "sft.lr=1e-3", "eval.max_tokens=4"])
    run_sft(config, progress=False)
    summary = json.loads((config.run_dir / "summary.json").read_text())
    assert summary["targets"] == "solution" and summary["train_pairs"] == 14 and summary["steps"] == 4
    by_id = {e.id: e for e in load_examples(config.train.data.spec)}
    fixed = 0
    for line in (config.run_dir / "targets.jsonl").read_text().splitlines():
        target = json.loads(line)
        example = by_id[target["id"]]
        if example.solution.endswith(f" {example.answer}."):  # the verifier finds the answer already
            assert target["text"] == example.solution
        else:
            assert target["text"] == f"{example.solution}\n\nThe final answer is {example.answer}."
            fixed += 1
    assert summary["target_counts"]["fixed"] == fixed > 0
    assert summary["train_nll_after"] < summary["train_nll_before"]
    # A finished folder with another config is refused, not silently reused.
    with pytest.raises(FileExistsError, match="sft.lr"):
        run_sft(dataclasses.replace(config, sft=dataclasses.replace(config.sft, lr=2e-3)), progress=False)
    # The same config is reused as it comes back from the marker (JSON), whatever trackers watch it.
    assert run_sft(config, progress=False) == config.model_dir
    watched = dataclasses.replace(config.train, run=dataclasses.replace(config.train.run, trackers=("tensorboard",)))
    assert run_sft(dataclasses.replace(config, train=watched), progress=False) == config.model_dir


# --------------------------------------------------------------------------- the real model


@pytest.mark.slow
def test_real_model_sampled_sft_end_to_end(tmp_path, smollm2_dir, smollm2_tokenizer, smollm2_model, capsys):
    config = load_sft_config(None, [
        f"run.out_dir={tmp_path}", "sft.name=real", f"data.spec={TINY_DATA}", "data.eval_size=8", "sft.train_examples=8",
        "sft.samples_per_prompt=2", "sft.temperature=0.7", "sft.max_tokens=24", "sft.epochs=1", "sft.batch_size=4",
        "sft.lr=3e-5", "eval.max_tokens=16", "eval.batch_size=16",
    ])
    # Rejection sampling from the privileged prompt trains on the *student* prompt.
    train, held_out = split_examples(load_examples(TINY_DATA), eval_size=8, seed=0)
    student, teacher = load_template("student/plain"), load_template("teacher/answer_note")
    engine = LocalEngine(smollm2_model, smollm2_tokenizer, batch_size=16)
    params = SamplingParams(max_tokens=24, temperature=0.7, n=2, seed=0)
    targets, stats = sampled_targets(engine, ChatFormat(smollm2_tokenizer), train[:6], student, teacher, params, 16,
                                    progress=False)
    assert stats.drawn == 12 and stats.kept == len(targets) > 0
    assert stats.kept + stats.wrong + stats.unfinished + stats.duplicate == stats.drawn
    by_id = {e.id: e for e in train}
    from selfopd.verifiers import verify_example

    for target in targets:
        example = by_id[target.example_id]
        student_ids = prompt_token_ids(smollm2_tokenizer, render_student(student, example))
        teacher_ids = prompt_token_ids(smollm2_tokenizer, render_teacher(teacher, example, render_student(student, example)))
        assert target.prompt_ids == student_ids != teacher_ids
        assert verify_example(target.text, example).correct and target.completion_ids[-1] == smollm2_tokenizer.eos_token_id

    # The whole command: held-out items never trained on, the loss falls, the folder loads.
    model_dir = run_sft(config, progress=False)
    run_dir = model_dir.parent
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["targets"] == "sampled" and summary["train_pairs"] == summary["target_counts"]["kept"] > 0
    assert summary["train_nll_after"] < summary["train_nll_before"]
    trained_ids = {json.loads(line)["id"] for line in (run_dir / "targets.jsonl").read_text().splitlines()}
    held_ids = {json.loads(line)["id"] for line in (run_dir / "eval" / "tuned" / "eval.jsonl").read_text().splitlines()}
    assert held_ids == {e.id for e in held_out} and not trained_ids & held_ids
    assert not {by_id[i].prompt for i in trained_ids} & {e.prompt for e in held_out}
    assert {"config.toml", "summary.json", "README.md", "targets.jsonl", "model"} <= {p.name for p in run_dir.iterdir()}
    assert not list(run_dir.glob(".model.partial-*"))
    trained_prompts = {e.prompt for e in load_examples(TINY_DATA) if e.id in trained_ids}
    assert len(teacher_trained_prompts(model_dir)) >= len(trained_prompts) > 0

    reloaded = AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    check_tokenizers_compatible(smollm2_tokenizer, tokenizer, reloaded.config.vocab_size, "student", "sft teacher")
    changed = any(not torch.equal(p, smollm2_model.state_dict()[n]) for n, p in reloaded.named_parameters())
    assert changed

    # A second call reuses the finished folder: nothing is retrained or rewritten.
    stamp = (model_dir / MARKER).stat().st_mtime_ns, (model_dir / "model.safetensors").stat().st_mtime_ns
    capsys.readouterr()
    assert run_sft(config, progress=False) == model_dir
    assert "reusing the finished SFT model" in capsys.readouterr().out
    assert ((model_dir / MARKER).stat().st_mtime_ns, (model_dir / "model.safetensors").stat().st_mtime_ns) == stamp
