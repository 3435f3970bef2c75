"""`selfopd eval` refuses, in one line and before it loads anything, an option outside the range
its config setting takes, and a prompt that leaves no room for the answer in the model's context."""

from __future__ import annotations

import json
import re

import pytest

from selfopd.cli import main
from selfopd.config.settings import MAX_SEED

PROGRESS_BAR = re.compile(r"examples/s\]|\| \d+/\d+ \[")  # what datasets and transformers print is not a message


def _one_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.strip().splitlines() if line.strip() and not PROGRESS_BAR.search(line)]
    assert len(lines) == 1 and lines[0].startswith("selfopd: error: ") and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("flags, message", [
    (["--samples", "0"], r"argument --samples: must be >= 1, got 0"),
    (["--samples", "-4"], r"argument --samples: must be >= 1, got -4"),
    (["--samples", "1e9"], r"argument --samples: expected an integer, got '1e9'"),
    (["--samples", "100000", "--temperature", "1"], r"argument --samples: must be <= 10000 \(a sane maximum\)"),
    (["--temperature", "nan"], r"argument --temperature: must be finite, got nan"),
    (["--temperature=-inf"], r"argument --temperature: must be finite, got -inf"),
    (["--temperature", "-0.5"], r"argument --temperature: must be >= 0\.0, got -0\.5"),
    (["--temperature", "1e300"], r"argument --temperature: must be <= 100\.0 \(a sane maximum\)"),
    (["--seed", "-1"], r"argument --seed: must be >= 0, got -1"),
    (["--top-p", "0"], r"argument --top-p: must be in \(0, 1\], got 0\.0"),
    (["--top-k", "-1"], r"argument --top-k: must be >= 0, got -1"),
    (["--min-p", "1.5"], r"argument --min-p: must be .*1.*got 1\.5"),
    (["--max-tokens", "0"], r"argument --max-tokens: must be >= 1, got 0"),
    (["--engine", "gpu"], r"argument --engine: invalid choice: 'gpu'"),
    (["--samples", "4"], r"--samples 4 \(avg@k\) needs --temperature > 0"),
    (["--engine", "local", "--server", "http://127.0.0.1:9"], r"--server URL samples on that vLLM server"),
    (["--seed", str(2**63)], rf"argument --seed: must be <= {MAX_SEED} \(a sane maximum\)"),
    (["--set", "eval.max_tokens=-5"], r"--set eval\.max_tokens=-5: eval\.max_tokens: must be >= 1, got -5"),
    (["--set", "eval.max_tokens=1e12"], r"eval\.max_tokens: expected an integer, got '1e12'"),
    (["--set", "eval.batch_size=0"], r"eval\.batch_size: must be >= 1, got 0"),
], ids=lambda value: " ".join(value) if isinstance(value, list) else "")
def test_an_eval_option_out_of_range_is_one_line(flags, message, tmp_path, capsys):
    out = tmp_path / "eval"
    assert main(["eval", *flags, "--out", str(out)]) == 1
    assert re.search(message, _one_line(capsys))
    assert not out.exists()


def test_an_eval_prompt_past_the_context_is_one_line_naming_its_row(tmp_path, tiny_model_dir, capsys):
    rows = [{"prompt": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(6)]
    rows[4]["prompt"] = "one " * 2100
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "eval"
    assert main(["eval", "--data", str(data), "--model", str(tiny_model_dir), "--out", str(out)]) == 1
    line = _one_line(capsys)
    assert re.search(rf"eval\.max_tokens: data row 'rows/4' of {re.escape(str(data))}: its prompt \(\d+ tokens\) plus "
                     r"eval\.max_tokens \(48\) exceeds the model's context of 2048 tokens", line), line
    assert not out.exists()  # refused before any answer was sampled


def test_an_output_folder_that_cannot_be_made_is_refused_before_the_eval(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    assert main(["eval", "--out", str(blocker / "eval")]) == 1
    assert _one_line(capsys) == f"selfopd: error: --out {blocker / 'eval'}: {blocker} is a file, not a folder"


def _rows(tmp_path, rows: list[tuple[str, str]]):
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": prompt, "answer": answer}) + "\n" for prompt, answer in rows))
    return data


def test_eval_reports_truncated_and_unanswered_shares_graded_as_the_config_says(tmp_path, tiny_model_dir, capsys):
    """A tiny random model cut at 3 tokens: every answer truncated, so none graded by default."""
    data = _rows(tmp_path, [(f"What is {i} + {i}?", str(2 * i)) for i in range(4)])
    out = tmp_path / "eval"
    assert main(["eval", "--data", str(data), "--model", str(tiny_model_dir), "--set", "eval.max_tokens=3",
                 "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["truncated_share"] == summary["no_answer_share"] == 1.0 and summary["accuracy"] == 0.0
    assert summary["verifier"] == {"reasoning_start": "<think>", "reasoning_end": "</think>", "truncated": "wrong"}
    assert all(json.loads(line)["extracted"] is None for line in (out / "eval.jsonl").read_text().splitlines())
    assert "truncated at eval.max_tokens: 100.0% of answers; no answer graded: 100.0%" in capsys.readouterr().out


def test_eval_samples_with_the_filters_given_and_reports_avg_and_pass_at_k(tmp_path, tiny_model_dir, capsys):
    """--top-k 1 leaves one token a step: the 4 samples of a prompt at temperature 1 are its one
    answer; summary.json records the sampling and avg@4 with pass@1, @2 and @4 over distinct prompts."""
    data = _rows(tmp_path, [(f"What is {i} + {i}?", str(2 * i)) for i in range(3)] + [("What is 0 + 0?", "0")])
    out = tmp_path / "eval"
    assert main(["eval", "--data", str(data), "--model", str(tiny_model_dir), "--samples", "4", "--temperature", "1",
                 "--top-k", "1", "--max-tokens", "5", "--set", "verifier.truncated=grade", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["sampling"] == {"temperature": 1.0, "top_p": 1.0, "top_k": 1, "min_p": 0.0, "max_tokens": 5, "seed": 0}
    assert summary["k"] == 4 and {"avg@4", "pass@1", "pass@2", "pass@4"} <= set(summary)
    assert summary["pass@4"]["n"] == summary["avg@4"]["n"] == 3  # the repeated prompt counts once
    answers: dict[str, set[str]] = {}
    for line in (out / "eval.jsonl").read_text().splitlines():
        row = json.loads(line)
        answers.setdefault(row["prompt"], set()).add(row["completion"])
        assert row["completion_tokens"] == 5
    assert all(len(texts) == 1 for texts in answers.values())
    printed = capsys.readouterr().out
    assert re.search(r"avg@4 \S+ \[\S+, \S+\], pass@1 .*, pass@2 .*, pass@4 .* \(95% intervals over 3 distinct prompts\)",
                     printed), printed


def test_eval_data_of_the_config_is_what_eval_answers(tmp_path, tiny_model_dir, capsys):
    """eval.data names the in-run eval's test set; `selfopd eval CONFIG` answers the same items."""
    data = _rows(tmp_path, [(f"What is {i} + {i}?", str(2 * i)) for i in range(5)])
    out = tmp_path / "eval"
    assert main(["eval", "--model", str(tiny_model_dir), "--set", f"eval.data={data}", "--set", "eval.max_tokens=2",
                 "--out", str(out)]) == 0
    assert sorted(json.loads(line)["id"] for line in (out / "eval.jsonl").read_text().splitlines()) == [
        f"rows/{i}" for i in range(5)]


def test_eval_renders_and_grades_as_the_eval_settings_say(tmp_path, tiny_model_dir, monkeypatch, capsys):
    """OPSD's eval of a student trained without thinking: eval.student_template, eval.chat_template_kwargs
    (over model.chat_template_kwargs), eval.truncated and eval.reasoning reach what `selfopd eval` renders,
    records and prints; training's settings alone are what it used before."""
    import selfopd.run.evaluate as evaluation
    from tests.thinking_template import thinking_model_dir

    rendered = []
    class Recording(evaluation.ChatFormat):  # the eval's chat format, recording what it renders
        def prompt(self, messages):
            rendered.append((messages[-1]["content"], dict(self.template_kwargs)))
            return super().prompt(messages)

    monkeypatch.setattr(evaluation, "ChatFormat", Recording)
    model = thinking_model_dir(tiny_model_dir, tmp_path / "thinking")
    data = _rows(tmp_path, [(f"What is {i} + {i}?", str(2 * i)) for i in range(2)])
    trained = ["--set", "data.student_template=student/opsd", "--set", "model.chat_template_kwargs=enable_thinking=false"]
    evals = ["--set", "eval.student_template=student/opsd_eval", "--set", "eval.chat_template_kwargs=enable_thinking=true",
             "--set", "eval.truncated=grade", "--set", "eval.reasoning=graded"]
    suffix = "\n\nPlease reason step by step, and put your final answer within \\boxed{}."
    for sets, template, content, kwargs, verifier, setting in (
            (trained, "student/opsd", "Problem: What is 1 + 1?" + suffix, {"enable_thinking": False},
             {"reasoning_start": "<think>", "reasoning_end": "</think>", "truncated": "wrong"},
             "verifier.truncated = 'wrong'"),
            ([*trained, *evals], "student/opsd_eval", "What is 1 + 1?" + suffix, {"enable_thinking": True},
             {"reasoning_start": "", "reasoning_end": "", "truncated": "grade"}, "eval.truncated = 'grade'")):
        rendered.clear()
        out = tmp_path / f"eval{len(sets)}"
        assert main(["eval", "--data", str(data), "--model", str(model), *sets, "--set", "eval.max_tokens=3",
                     "--out", str(out)]) == 0
        assert len(rendered) == 2 and rendered[1] == (content, kwargs)
        summary = json.loads((out / "summary.json").read_text())
        assert (summary["template"], summary["verifier"]) == (template, verifier)
        printed = capsys.readouterr().out
        assert f" with {template}: accuracy " in printed and f"({setting})" in printed, printed


def _run_of(tmp_path, model, *sets: str):
    """A run folder as `selfopd train` leaves it before its first checkpoint: the signed config, split.json."""
    from selfopd.config import config_to_toml, load_config
    from selfopd.core.run_folder import RunFolder
    from selfopd.data.split import SplitRecord, load_split

    spec = "rg:chain_sum?min_terms=2&max_terms=2&size=20&seed=3"
    run = RunFolder(tmp_path / "run")
    run.root.mkdir()
    run.write_config(config_to_toml(load_config(None, [f"model.student={model}", f"data.spec={spec}",
                                                       "data.eval_size=2", *sets])))
    SplitRecord.of(spec, 0, *load_split(spec, 2, 0)).write(run.root)
    return run.root


@pytest.mark.parametrize("kind, flags, expected", [
    ("vllm", [], "vllm"), ("vllm_colocate", [], "vllm"), ("local", [], "local"),
    ("vllm", ["--engine", "local"], "local"), ("local", ["--engine", "vllm"], "vllm"),
    ("vllm", ["--set", "engine.kind=local"], "local"),
])
def test_eval_of_a_run_samples_on_the_runs_own_engine_unless_told(tmp_path, tiny_model_dir, monkeypatch, capsys,
                                                                  kind, flags, expected):
    """`eval --run RUN` of a run trained on vLLM samples on vLLM (its student's server, launched as training
    launches it), not in process with HF generate; --engine local still samples in process. The engine
    is caught as it opens: no server starts here (tests/cli/test_evaluate.py's vllm test launches one)."""
    import selfopd.run.evaluate as evaluation
    from selfopd.cli.common import UserError

    chosen = []

    def opened(model, config, engine_kind, server, stack, log_dir, progress=True):
        chosen.append(engine_kind)
        raise UserError("stopped before sampling")

    monkeypatch.setattr(evaluation, "open_eval_engine", opened)
    run = _run_of(tmp_path, tiny_model_dir, f"engine.kind={kind}")
    assert main(["eval", "--run", str(run), *flags, "--out", str(tmp_path / "eval")]) == 1
    assert chosen == [expected]
    out = capsys.readouterr().out
    assert ("sampling on vLLM, as" in out) == (expected == "vllm" and not flags)
    if expected == "vllm" and not flags:
        assert f"sampling on vLLM, as {run} trained (engine.kind = {kind!r}); --engine local samples in process" in out


def test_the_eval_engine_is_decided_in_one_place():
    from selfopd.config import load_config
    from selfopd.run.evaluate import eval_engine_kind

    vllm, local = load_config(None, ["engine.kind=vllm"]), load_config(None)
    assert [eval_engine_kind(None, None, vllm), eval_engine_kind(None, None, local), eval_engine_kind(None, None, None),
            eval_engine_kind("local", None, vllm), eval_engine_kind(None, "http://127.0.0.1:8000", None)] == [
        "vllm", "local", "local", "local", "vllm"]


@pytest.mark.slow
def test_a_truncated_answer_ending_in_the_right_number_is_wrong_unless_truncated_answers_are_graded(tmp_path):
    """The packaged SmolLM2, greedy with the demo's 32 tokens: "Calculate 1 + 4." is answered "1 + 4 = 5" (finished);
    "Calculate 68 + 52." runs past 32 tokens after writing 120 ("..., which is 120. This is the"): wrong by
    default, right with `--set verifier.truncated=grade` (how it was graded before)."""
    data = _rows(tmp_path, [("Calculate 1 + 4.", "5"), ("Calculate 68 + 52.", "120")])

    def records(*sets: str) -> list[tuple[bool, str]]:
        out = tmp_path / f"eval{len(sets)}"
        argv = ["eval", "--data", str(data), "--set", "eval.max_tokens=32", *sets, "--out", str(out)]
        assert main(argv) == 0
        lines = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
        return [(line["correct"], line["finish_reason"]) for line in lines]

    assert records() == [(True, "stop"), (False, "length")]
    assert records("--set", "verifier.truncated=grade") == [(True, "stop"), (True, "length")]


@pytest.mark.vllm
def test_eval_on_a_launched_vllm_server_writes_avg_and_pass_at_k(tmp_path, servable_tiny_model_dir, capsys):
    """`--engine vllm` launches the model's server as training launches the student's, samples k
    answers a prompt there, stops it, and reports avg@k and pass@k over distinct prompts."""
    from selfopd.serving.server import free_port, port_in_use

    data = _rows(tmp_path, [(f"What is {i} + {i}?", str(2 * i)) for i in range(3)])
    out, port = tmp_path / "eval", free_port()
    assert main(["eval", "--data", str(data), "--model", str(servable_tiny_model_dir), "--engine", "vllm",
                 "--samples", "2", "--temperature", "1", "--top-p", "0.9", "--max-tokens", "4",
                 "--set", f"engine.port={port}", "--set", "model.dtype=float32", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["k"] == 2 and summary["avg@2"]["n"] == summary["pass@2"]["n"] == 3 and "pass@1" in summary
    rows = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    assert sorted((row["id"], row["sample"]) for row in rows) == [(f"rows/{i}", s) for i in range(3) for s in (0, 1)]
    assert all(1 <= row["completion_tokens"] <= 4 for row in rows)
    assert (out / "server-logs").is_dir() and not port_in_use("127.0.0.1", port)  # the server was stopped
    assert "avg@2 " in capsys.readouterr().out


def _hostile_model(tiny_model_dir, folder, kind: str):
    """A copy of the tiny model made hostile in one way: a config of 10**9 layers (transformers would
    build them before reading a weight), one of 20x its width (a model far past its weights), a
    safetensors header of an absurd shape, or a chat template of nested loops."""
    import shutil

    shutil.copytree(tiny_model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    if kind in ("layers", "width"):
        config.update(num_hidden_layers=10**9) if kind == "layers" else config.update(hidden_size=1280)
        (folder / "config.json").write_text(json.dumps(config))
    elif kind == "shape":
        weights = folder / "model.safetensors"
        raw = weights.read_bytes()
        length = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8:8 + length])
        header["model.embed_tokens.weight"]["shape"] = [10**12, 10**12]
        text = json.dumps(header).encode()
        weights.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + length:])
    else:
        (folder / "chat_template.jinja").write_text(
            "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}")
    return folder


@pytest.mark.parametrize("kind, message", [
    ("layers", r"{model}/config\.json: num_hidden_layers = 1000000000: past 16,777,216, the most a model size can be"),
    ("width", r"{model}/config\.json: its sizes \(num_hidden_layers 2, hidden_size 1280, intermediate_size 128, "
              r"vocab_size 49152\) describe a model of at least [\d,]+ parameters, more than 2x the 3,219,776 its "
              r"safetensors files hold"),
    ("shape", r"{model}/model\.safetensors: tensor 'model\.embed_tokens\.weight' has shape \[1000000000000, "
              r"1000000000000\] of F32"),
    ("chat template", r"{model}/chat_template\.jinja:1: the model's chat template: rendering took over 2 s of CPU "
                      r"time, the time limit of a prompt"),
], ids=["layers", "width", "shape", "chat template"])
def test_eval_of_a_run_with_a_hostile_model_is_one_line_in_seconds(tmp_path, tiny_model_dir, capsys, kind, message):
    """`selfopd eval --run RUN --model FOLDER` with a model folder from elsewhere: one line naming
    the file and key, exit 1, no traceback, no output, in seconds; before, the layers grew memory
    for minutes and the template rendered for hours."""
    import time

    from selfopd.config import config_to_toml, load_config
    from selfopd.core.run_folder import RunFolder
    from selfopd.data.split import SplitRecord, load_split

    spec = "rg:chain_sum?min_terms=2&max_terms=2&size=20&seed=3"
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    RunFolder(run_dir).write_config(config_to_toml(load_config(None, [f"data.spec={spec}", "data.eval_size=2"])))
    SplitRecord.of(spec, 0, *load_split(spec, 2, 0)).write(run_dir)
    model = _hostile_model(tiny_model_dir, tmp_path / "model", kind)
    out = tmp_path / "eval"
    started = time.monotonic()
    assert main(["eval", "--run", str(run_dir), "--model", str(model), "--out", str(out)]) == 1
    assert time.monotonic() - started < 60
    assert re.search(message.format(model=re.escape(str(model))), _one_line(capsys))
    assert not out.exists()


def test_eval_of_a_run_whose_checkpoints_are_all_damaged_is_refused_naming_why(tmp_path, tiny_model_dir, capsys):
    """It evaluated the run's starting model without a word before."""
    from selfopd.config import config_to_toml, load_config
    from selfopd.core.run_folder import RunFolder

    from selfopd.data.split import SplitRecord, load_split

    data = "rg:chain_sum?min_terms=2&max_terms=2&size=40&seed=3"
    run = RunFolder(tmp_path / "run")
    run.root.mkdir()
    run.write_config(config_to_toml(load_config(None, [f"model.student={tiny_model_dir}", f"data.spec={data}",
                                                       "data.eval_size=4"])))
    SplitRecord.of(data, 0, *load_split(data, 4, 0)).write(run.root)
    run.checkpoint(2).mkdir(parents=True)  # a kill before its first file
    assert main(["eval", "--run", str(run.root)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"selfopd: error: {run.root}: no complete checkpoint to evaluate ({run.checkpoint(2)}: empty (its "
                   "write was cut short)); pass --model to evaluate another model"], err
