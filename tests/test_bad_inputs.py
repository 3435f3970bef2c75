"""Every bad input a user can hand `selfopd train` gives one line that names the culprit
(file, line, key, row or PID), exit code 1, no traceback, and writes or loses nothing: a
fresh run leaves no run folder, a resumed one leaves its folder byte for byte as it was.

One table: each case builds its inputs in `tmp_path` and returns the command line and a
fragment of the expected message (a regular expression)."""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

from selfopd.cli import main
from selfopd.config.settings import hidden_characters

SMALL = [
    "data.spec=rg:chain_sum?min_terms=2&max_terms=2&size=60&seed=2", "data.eval_size=4",
    "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_tokens=6", "optim.micro_batch_prompts=1",
    "eval.max_tokens=6", "eval.batch_size=4", "run.progress=false", "run.eval_every=0",
]


# Library progress bars (datasets reading a file, transformers loading weights) are not messages.
PROGRESS_BAR = re.compile(r"\d+ examples/s\]|\| \d+/\d+ \[")


@dataclass(frozen=True)
class Setup:
    """What a case hands the test: its inputs' folder and the tiny model."""

    tmp: Path
    model: Path

    def file(self, name: str, text: str) -> Path:
        path = self.tmp / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return path

    def setting(self, key: str, name: str, text: str) -> str:
        """`KEY=PATH` of a new file: a --set that points at it."""
        return f"{key}={self.file(name, text)}"

    def rows(self, name: str, rows: list[dict]) -> Path:
        return self.file(name, "".join(json.dumps(row) + "\n" for row in rows))

    def train(self, *sets: str, config: Path | None = None) -> list[str]:
        """`selfopd train` of a small run on the tiny model into tmp/runs/fresh."""
        base = [*SMALL, f"model.student={self.model}", f"run.out_dir={self.tmp / 'runs'}", "run.name=fresh", *sets]
        config = config or self.file("run.toml", "")
        return ["train", str(config), *[arg for s in base for arg in ("--set", s)]]


def _good_rows(n: int = 12) -> list[dict]:
    return [{"id": f"q{i}", "prompt": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(n)]


def _solved_rows() -> list[dict]:
    """70 rows with longer questions than the last, a short question with a reference solution
    too long for the teacher's context: the start check must render the teacher's prompts."""
    rows = [{"prompt": f"What is {i} + {i}? Answer with a single number.", "answer": str(2 * i),
             "solution": f"{i} + {i} = {2 * i}."} for i in range(70)]
    return rows + [{"prompt": "1 + 1?", "answer": "2", "solution": "One and one more. " * 600}]


BROKEN_ROWS = '{"prompt": "1 + 1?", "answer": "2"}\n{"prompt": "2 + 2?", "answer": \n'
ROW_LIST = '["1 + 1?", "2"]\n'


def _other_vocab_teacher(s: Setup) -> Path:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    other = s.tmp / "other-teacher"
    config = LlamaConfig(vocab_size=1000, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, head_dim=16)
    LlamaForCausalLM(config).save_pretrained(other)
    AutoTokenizer.from_pretrained(s.model).save_pretrained(other)
    return other


# (case id, argv builder, expected message fragment as a regex; "{tmp}" is the case's folder)
Case = tuple[str, Callable[[Setup], list[str]], str]
FRESH: list[Case] = [
    ("toml-syntax", lambda s: s.train(config=s.file("bad.toml", "[run]\nname = \"x\"\nsteps = \n")),
     r"{tmp}/bad\.toml: invalid TOML: .*line 3"),
    ("unknown-key", lambda s: s.train(config=s.file("c.toml", "[optim]\nlrr = 1e-3\n")),
     r"{tmp}/c\.toml: optim\.lrr: unknown key \(did you mean 'lr'\?\)"),
    ("unknown-section", lambda s: s.train(config=s.file("c.toml", "[optimizer]\nlr = 1e-3\n")),
     r"{tmp}/c\.toml: \[optimizer\]: unknown section"),
    ("top-level-key", lambda s: s.train(config=s.file("c.toml", "lr = 1e-3\n")),
     r"{tmp}/c\.toml: lr: a top-level key.*'optim\.lr'"),
    ("wrong-type", lambda s: s.train(config=s.file("c.toml", "[run]\nsteps = \"two\"\n")),
     r"{tmp}/c\.toml: run\.steps: expected an integer, got 'two'"),
    ("bool-for-number", lambda s: s.train(config=s.file("c.toml", "[optim]\nlr = true\n")),
     r"{tmp}/c\.toml: optim\.lr: expected a number, got True"),
    ("out-of-range", lambda s: s.train(config=s.file("c.toml", "[rollout]\ntop_p = 1.5\n")),
     r"{tmp}/c\.toml: rollout\.top_p: must be in \(0, 1\], got 1\.5"),
    ("cross-section", lambda s: s.train("optim.micro_batch_prompts=3"),
     r"--set optim\.micro_batch_prompts=3: optim\.micro_batch_prompts: must divide rollout\.prompts_per_step"),
    ("nonfinite-setting", lambda s: s.train("optim.max_nonfinite_steps=0"),
     r"--set optim\.max_nonfinite_steps=0: optim\.max_nonfinite_steps: must be >= 1"),
    ("secret-pasted-in-set", lambda s: s.train("engine.api_key_env=sk-live-123"),  # the key is never echoed
     r"^selfopd: error: --set engine\.api_key_env=\*\*\*: engine\.api_key_env: must be the NAME of an environment variable"),
    ("missing-config", lambda s: ["train", str(s.tmp / "nope.toml")], r"{tmp}/nope\.toml: no such config file"),
    ("weak-key-variable", lambda s: s.train("engine.api_key_env=HOME"),
     r"engine\.api_key_env: 'HOME' does not name a secret: its value would be sent to servers as their key"),
    ("server-flag-that-loads-code", lambda s: s.train("engine.extra_server_args=--tool-parser-plugin /tmp/p.py"),
     r"engine\.extra_server_args: '--tool-parser-plugin' is not one of the vLLM flags extra_server_args passes on"),
    ("template-name-too-long", lambda s: s.train("data.student_template=" + "x" * 300),
     r"no template 'x{80}'\.\.\. \(300 characters\): File name too long"),
    ("nan-answer", lambda s: s.train("data.spec=" + str(s.file("nan.jsonl", '{"prompt": "1 + 1?", "answer": NaN}\n'))),
     r"{tmp}/nan\.jsonl row 0: field 'answer' \(mapped from column 'answer'\) is NaN, not text"),
    ("trainer-address-not-an-address", lambda s: s.train("engine.kind=vllm", "rollout.temperature=1",
                                                         "engine.trainer_address=not an address"),
     r"engine\.trainer_address: 'not an address': .*; it must be an address of this machine that the servers reach"),
    ("trainer-address-of-another-machine", lambda s: s.train("engine.kind=vllm", "rollout.temperature=1",
                                                             "engine.trainer_address=203.0.113.7"),
     r"engine\.trainer_address: '203\.0\.113\.7': Cannot assign requested address; it must be an address of this"),
    ("unknown-set-key", lambda s: s.train("optim.lrr=1e-3"), r"--set optim\.lrr=1e-3: optim\.lrr: unknown key"),
    ("bad-set-syntax", lambda s: s.train("optim.lr"), r"--set optim\.lr: expected section\.key=value"),
    ("bad-set-value", lambda s: s.train("optim.lr=fast"), r"--set optim\.lr=fast: optim\.lr: expected a number"),
    ("nan-set-value", lambda s: s.train("optim.lr=nan"), r"--set optim\.lr=nan: optim\.lr: must be finite"),
    ("config-is-a-folder", lambda s: s.train(config=s.file("c.toml/x", "").parent),
     r"{tmp}/c\.toml: is a folder, not a config file"),
    ("config-not-utf8", lambda s: s.train(config=(p := s.tmp / "c.toml", p.write_bytes(b"[run]\nname = 'caf\xe9'\n"))[0]),
     r"{tmp}/c\.toml: line 2: not UTF-8 text \(byte 0xe9\)"),
    ("config-is-a-device", lambda s: s.train(config=Path("/dev/zero")), r"/dev/zero: is not a regular file"),
    ("config-nested-too-deep", lambda s: s.train(config=s.file("c.toml", "[run]\nx = " + "[" * 99999 + "]" * 99999)),
     r"{tmp}/c\.toml: invalid TOML: nested too deep to read"),
    ("inf-in-file", lambda s: s.train(config=s.file("c.toml", "[optim]\nlr = inf\n")),
     r"{tmp}/c\.toml: optim\.lr: must be finite"),
    ("huge-int-for-a-float", lambda s: s.train(config=s.file("c.toml", "[optim]\nlr = 1" + "0" * 400 + "\n")),
     r"{tmp}/c\.toml: optim\.lr: must be <= 1 \(a sane maximum\), got an integer of 401 digits"),
    ("huge-float-for-an-int", lambda s: s.train(config=s.file("c.toml", "[run]\nsteps = 1e20\n")),
     r"{tmp}/c\.toml: run\.steps: expected an integer, got 1e\+20"),
    ("absurd-temperature", lambda s: s.train("rollout.temperature=1e300"),
     r"rollout\.temperature: must be <= 100\.0 \(a sane maximum\), got 1e\+300"),
    ("absurd-lr", lambda s: s.train("optim.lr=1e9"), r"optim\.lr: must be <= 1 \(a sane maximum\), got 1000000000\.0"),
    ("seed-past-2-63", lambda s: s.train(f"run.seed={2**63}"), rf"run\.seed: must be <= {2**32 - 1} \(a sane maximum\)"),
    ("negative-size", lambda s: s.train("rollout.max_tokens=-6"), r"rollout\.max_tokens: must be >= 1, got -6"),
    ("timeout-no-socket-takes", lambda s: s.train("engine.request_timeout_s=1e300"),
     r"engine\.request_timeout_s: must be <= 604800\.0 \(a sane maximum\)"),
    ("port-past-65535", lambda s: s.train("engine.kind=vllm", "engine.port=65535"),
     r"engine\.port: the servers selfopd launches take ports 65535 to 65536 .* choose engine\.port <= 65534"),
    ("run-name-bidi", lambda s: s.train("run.name=report\u202etxt.exe"),
     r"run\.name: holds the invisible or control character U\+202E \(RIGHT-TO-LEFT OVERRIDE\) at position 6: "
     r"got 'report\\u202etxt\.exe'"),
    ("run-name-control", lambda s: s.train("run.name=ok\x1b[2Jx"),
     r"run\.name: holds the invisible or control character U\+001B .* got 'ok\\x1b\[2Jx'"),
    ("control-in-a-string-setting", lambda s: s.train(config=s.file("c.toml", '[run]\nwandb_project = "p\\u202e"\n')),
     r"{tmp}/c\.toml: run\.wandb_project: holds the invisible or control character U\+202E"),
    ("run-name-newline", lambda s: s.train("run.name=a\nb"), r"run\.name: holds .* U\+000A .* got 'a\\nb'"),
    ("extra-server-args-unparsable", lambda s: s.train("engine.extra_server_args=--served-model-name 'x"),
     r"engine\.extra_server_args: does not parse as shell words \(No closing quotation\)"),
    ("extra-server-args-open-the-host", lambda s: s.train("engine.extra_server_args=--seed 1 --host=0.0.0.0"),
     r"engine\.extra_server_args: '--host=0\.0\.0\.0' is vLLM's --host, which extra_server_args may not set"),
    ("data-size-would-hang", lambda s: s.train("data.spec=rg:chain_sum?size=100000000"),
     r"rg:chain_sum: size must be in \[1, 100000\] .*got 100000000"),
    ("data-option-would-hang", lambda s: s.train("data.spec=rg:chain_sum?max_terms=100000000&size=60"),
     r"rg:chain_sum: option max_terms=100000000 must be within \[-100000, 100000\]"),
    ("data-items-would-take-hours", lambda s: s.train(
        "data.spec=rg:chain_sum?min_terms=20000&max_terms=20000&size=99999"),
     r"rg:chain_sum: \d+ of 99999 items took \d+ s, so all of them would take about \d+ s, past the 120 s"),
    ("data-mixture-too-large", lambda s: s.train(
        "data.spec=" + " + ".join(f"rg:chain_sum?size=60000&seed={i}" for i in (1, 2))),
     r"its parts ask for 120000 generated items in all, past 100000"),
    ("data-generator-fails", lambda s: s.train(
        "data.spec=rg:chain_sum?min_digits=100000&max_digits=100000&min_terms=2&max_terms=2&size=60"),
     r"rg:chain_sum row 0: the generator failed with options .*ValueError: Exceeds the limit"),
    ("data-size-not-a-number", lambda s: s.train("data.spec=rg:chain_sum?size=10^8"),
     r"option 'size': expected int, got '10\^8'"),
    ("data-seed-huge", lambda s: s.train(f"data.spec=rg:chain_sum?size=60&seed={10**30}"),
     r"rg:chain_sum: seed must be in \[0, 4294967295\]"),
    ("data-file-is-a-folder", lambda s: s.train(f"data.spec={s.file('d.jsonl/x', '').parent}"),
     r"{tmp}/d\.jsonl: is a folder, not a data file"),
    ("data-file-not-utf8", lambda s: s.train("data.spec=" + str((p := s.tmp / "d.jsonl", p.write_bytes(b"{}\n{}\xff"))[0])),
     r"{tmp}/d\.jsonl:2: not UTF-8 text \(byte 0xff at column 3\)"),
    ("missing-model", lambda s: s.train(f"model.student={s.tmp}/no-model"),
     r"model spec '{tmp}/no-model' is not a packaged model"),
    ("model-folder-without-config", lambda s: s.train(f"model.student={s.file('empty/x.txt', '').parent}"),
     r"model folder {tmp}/empty has no config\.json"),
    ("model-tokenizer-corrupt", lambda s: (shutil.copytree(s.model, m := s.tmp / "bad-model"),
                                           (m / "tokenizer.json").write_bytes(b'{"version": "1.0", "trunc'),
                                           s.train(f"model.student={m}"))[-1],
     r"cannot load the model folder {tmp}/bad-model: {tmp}/bad-model/tokenizer\.json: not valid JSON"),
    ("model-config-corrupt", lambda s: (shutil.copytree(s.model, m := s.tmp / "bad-model"),
                                        (m / "config.json").write_bytes(b"\x89PNG\r\n\x1a\n"),
                                        s.train(f"model.student={m}"))[-1],
     r"cannot load the model folder {tmp}/bad-model: {tmp}/bad-model/config\.json: not UTF-8 text"),
    ("model-weights-cut-short", lambda s: (shutil.copytree(s.model, m := s.tmp / "bad-model"),
                                           (m / "model.safetensors").write_bytes(
                                               (m / "model.safetensors").read_bytes()[:100_000]),
                                           s.train(f"model.student={m}"))[-1],
     r"cannot load the model folder {tmp}/bad-model: {tmp}/bad-model/model\.safetensors: cut short or damaged "
     r"\(100000 bytes where its header describes \d+\)"),
    ("missing-data-file", lambda s: s.train(f"data.spec={s.tmp}/none.jsonl"), r"{tmp}/none\.jsonl: file not found"),
    ("row-missing-field", lambda s: s.train(
        f"data.spec={s.rows('rows.jsonl', _good_rows()[:5] + [{'id': 'q5', 'prompt': 'x'}] + _good_rows()[6:])}"),
     r"rows\.jsonl row 5: missing field 'answer'"),
    ("row-empty-answer", lambda s: s.train(
        f"data.spec={s.rows('rows.jsonl', _good_rows()[:3] + [{'id': 'q3', 'prompt': 'x', 'answer': ' '}])}"),
     r"rows\.jsonl row 3: empty field 'answer'"),
    ("duplicate-id", lambda s: s.train(f"data.spec={s.rows('rows.jsonl', _good_rows()[:4] + _good_rows()[:1])}?id=id"),
     r"rows\.jsonl: duplicate id 'q0' at rows 0 and 4"),
    ("empty-dataset", lambda s: s.train(f"data.spec={s.file('empty.jsonl', '')}"),
     r"{tmp}/empty\.jsonl: the file is empty: no rows"),
    ("malformed-json-line", lambda s: s.train(f"data.spec={s.file('rows.jsonl', BROKEN_ROWS)}"),
     r"{tmp}/rows\.jsonl:2: invalid JSON"),
    ("row-not-an-object", lambda s: s.train(f"data.spec={s.file('rows.jsonl', ROW_LIST)}"),
     r"{tmp}/rows\.jsonl:1: expected a JSON object per line, got list"),
    ("eval-size-past-data", lambda s: s.train(f"data.spec={s.rows('rows.jsonl', _good_rows(6))}", "data.eval_size=9"),
     r"eval_size must be in \[0, 6\]"),
    ("eval-data-holds-training-prompts", lambda s: s.train(f"eval.data={s.rows('test.jsonl', _good_rows(6))}",
                                                           f"data.spec={s.rows('rows.jsonl', _good_rows(12))}"),
     r"eval\.data: .*test\.jsonl: \d of its 6 distinct prompts are training prompts of this run"),
    ("unknown-source", lambda s: s.train("data.spec=kaggle:titanic"), r"unknown data source 'kaggle:'"),
    ("unknown-task", lambda s: s.train("data.spec=rg:no_such_task"), r"rg:no_such_task: unknown reasoning-gym task"),
    ("unknown-task-option", lambda s: s.train("data.spec=rg:chain_sum?terms=2"), r"rg:chain_sum: unknown option 'terms'"),
    ("missing-template", lambda s: s.train("data.student_template=student/nope"), r"no template 'student/nope'"),
    ("template-syntax", lambda s: s.train(s.setting("data.student_template", "t.jinja", "Solve:\n{% if %}\n")),
     r"{tmp}/t\.jinja:2: template syntax error"),
    ("template-undefined", lambda s: s.train(s.setting("data.student_template", "t.jinja", "Q:\n{{ question }}\n")),
     r"{tmp}/t\.jinja:2: variable 'question' is undefined"),
    ("student-sees-answer", lambda s: s.train(s.setting("data.student_template", "t.jinja", "{{ prompt }} {{ answer }}")),
     r"{tmp}/t\.jinja:1: variable 'answer' is undefined"),
    ("eval-template-sees-answer", lambda s: s.train(s.setting("eval.student_template", "t.jinja",
                                                              "{{ prompt }} {{ answer }}")),
     r"eval\.student_template: {tmp}/t\.jinja:1: variable 'answer' is undefined"),
    ("teacher-template-undefined", lambda s: s.train(s.setting("teacher.template", "t.jinja", "{{ prompt }}\n{{ secret }}")),
     r"{tmp}/t\.jinja:2: variable 'secret' is undefined"),
    ("sandbox-escape", lambda s: s.train(s.setting(
        "data.student_template", "t.jinja", "{{ prompt }}\n{{ cycler.__init__.__globals__.os.popen('id').read() }}")),
     r"{tmp}/t\.jinja:2: "),
    ("template-includes-a-sibling-file", lambda s: s.file("secret.txt", "sk-live-123") and s.train(s.setting(
        "data.student_template", "t.jinja", "{{ prompt }}\n{% include 'secret.txt' %}")),
     r"{tmp}/t\.jinja:2: template 'secret\.txt' refused: not a \.jinja template"),
    ("template-not-utf8", lambda s: s.train("teacher.template=" + str(
        (p := s.file("t.jinja", "")).write_bytes("{{ prompt }} café".encode("latin-1")) and p)),
     r"{tmp}/t\.jinja: not UTF-8 text \(byte 0xe9 at offset 16\)"),
    ("template-renders-too-much", lambda s: s.train(s.setting(
        "teacher.template", "t.jinja", "{{ prompt }}{% for i in range(99999) %}{{ prompt * 9 }}{% endfor %}")),
     r"{tmp}/t\.jinja: renders over 4,000,000 characters, the size limit of a prompt"),
    ("template-value-too-large", lambda s: s.train(s.setting(
        "data.student_template", "t.jinja", "{{ prompt }}\n{{ '%999999999s' % prompt }}")),
     r"{tmp}/t\.jinja:2: '%' would make over 4,000,000 characters, the size limit of a prompt"),
    ("template-renders-too-long", lambda s: s.train(s.setting(
        "teacher.template", "t.jinja", "{{ prompt }}{% for i in range(99999) %}{% for j in range(99999) %}"
                                       "{% endfor %}{% endfor %}")),
     r"{tmp}/t\.jinja:1: rendering took over 2 s of CPU time, the time limit of a prompt"),
    ("external-teacher-without-model", lambda s: s.train("teacher.kind=external"),
     r"run\.toml: teacher\.model: required when teacher\.kind = 'external'"),
    ("external-teacher-other-tokenizer", lambda s: s.train("teacher.kind=external", f"teacher.model={_other_vocab_teacher(s)}"),
     r"{tmp}/other-teacher cannot score .* token ids: - .*model vocab size 1000"),
    ("prompt-past-context", lambda s: s.train(
        f"data.spec={s.rows('rows.jsonl', _good_rows()[:5] + [{'id': 'long', 'prompt': 'one ' * 2100, 'answer': '1'}] + _good_rows()[6:])}"),
     r"rollout\.max_tokens: data row 'rows/5' of .*rows\.jsonl: its prompt \(\d+ tokens\) plus rollout\.max_tokens \(6\) "
     r"exceeds the context of 2048 tokens"),
    ("teacher-solution-past-context", lambda s: s.train(
        "teacher.template=teacher/worked_solution", "data.eval_size=1",
        f"data.spec={s.rows('rows.jsonl', _solved_rows())}?solution=solution"),
     r"teacher\.template: data row 'rows/70' of .*rows\.jsonl\?solution=solution: the teacher's prompt \(teacher/worked_solution, \d+ tokens\) "
     r"and the scored completion can reach \d+ tokens with rollout\.max_tokens = 6, past the teacher's context of 2048 "
     r"\(the teacher's max_position_embeddings\) by \d+ tokens"),
    ("teacher-prompt-past-context", lambda s: s.train(s.setting("teacher.template", "long.jinja",
                                                                "{{ prompt }}\n{% for i in range(2100) %}{{ answer }} {% endfor %}")),
     r"teacher\.template: data row '.+' of rg:chain_sum.*: the teacher's prompt \({tmp}/long\.jinja, \d+ tokens\) and the scored "
     r"completion can reach \d+ tokens with rollout\.max_tokens = 6, past the teacher's context of 2048"),
    ("teacher-shows-attempts-past-context", lambda s: s.train("teacher.template=teacher/verifier_feedback",
                                                              "rollout.max_tokens=1000"),
     r"teacher\.template: data row .*: the teacher's prompt \(teacher/verifier_feedback, \d+ tokens\), the attempt it "
     r"shows and the scored completion can reach \d+ tokens with rollout\.max_tokens = 1000, past the teacher's "
     r"context of 2048"),
    ("is-ratio-with-top-p", lambda s: s.train("rollout.top_p=0.9"),
     r"loss\.is_cap: must be 0 with rollout\.top_p = 0\.9 < 1"),
    ("is-ratio-with-top-k", lambda s: s.train("rollout.top_k=20"),
     r"loss\.is_cap: must be 0 with rollout\.top_k = 20 > 0"),
    ("wrong-reward-under-group-norm", lambda s: s.train("loss.lambda_rl=1", "loss.wrong_reward=-1"),
     r"loss\.wrong_reward: -1 changes nothing with loss\.rl_advantage = 'group_norm'"),
    ("entry-clip-of-sampled-tokens", lambda s: s.train("loss.token_clip=0.05", "loss.clip_per=vocabulary_entry"),
     r"loss\.clip_per: 'vocabulary_entry' caps the terms of a full-vocabulary divergence; loss\.divergence is 'sampled'"),
    ("resume-and-config", lambda s: ["train", str(s.file("c.toml", "")), "--resume", str(s.tmp)],
     r"give either a CONFIG or --resume RUN_DIR"),
]


def _resume(run: Path, *sets: str) -> list[str]:
    return ["train", "--resume", str(run), *[arg for s in sets for arg in ("--set", s)]]


RESUME: list[Case] = [
    ("resume-not-a-run", lambda s: _resume(s.file("notes/readme.txt", "hi").parent),
     r"{tmp}/notes/config\.toml: no such config file"),
    ("resume-changed-split", lambda s: _resume(s.tmp / "runs" / "done", "data.eval_size=3"),
     r"{tmp}/runs/done: the data now gives another split than the run recorded"),
    ("resume-changed-data", lambda s: _resume(s.tmp / "runs" / "done", "data.spec=rg:chain_sum?size=60&seed=9"),
     r"{tmp}/runs/done: the data now gives another split"),
    ("resume-without-checkpoint", lambda s: _resume(_without_checkpoints(s.tmp / "runs" / "done")),
     r"{tmp}/runs/done: no checkpoint to resume from"),
    ("resume-bad-set", lambda s: _resume(s.tmp / "runs" / "done", "rollout.top_p=0"),
     r"--set rollout\.top_p=0: rollout\.top_p: must be in \(0, 1\]"),
    ("fresh-over-a-finished-run", lambda s: s.train("run.name=done"), r"{tmp}/runs/done already holds a run"),
    ("resume-folder-sets-server-flags", lambda s: ((c := s.tmp / "runs/done/config.toml").write_text(
        c.read_text().replace('extra_server_args = ""', 'extra_server_args = "--weight-transfer-config.backend nccl"')),
        _resume(c.parent))[-1],
     r"{tmp}/runs/done/config\.toml: engine\.extra_server_args: '--weight-transfer-config\.backend' is vLLM's "
     r"--weight-transfer-config, which extra_server_args may not set"),
    ("resume-cut-short-checkpoint", lambda s: ((w := s.tmp / "runs/done/checkpoints/step_00001/model.safetensors")
                                               .write_bytes(w.read_bytes()[:4096]), _resume(w.parents[2]))[-1],
     r"{tmp}/runs/done: no complete checkpoint to resume from \({tmp}/runs/done/checkpoints/step_00001/model\."
     r"safetensors: cut short or damaged"),
    ("resume-empty-checkpoint", lambda s: (shutil.rmtree(c := s.tmp / "runs/done/checkpoints/step_00001"), c.mkdir(),
                                           _resume(c.parents[1]))[-1],
     r"{tmp}/runs/done: no complete checkpoint to resume from \({tmp}/runs/done/checkpoints/step_00001: empty"),
    ("resume-pickled-trainer-state", lambda s: (__import__("torch").save(
        {"optimizer": __import__("os").system, "scheduler": {}, "step": 1},
        s.tmp / "runs/done/checkpoints/step_00001/trainer_state.pt"), _resume(s.tmp / "runs" / "done"))[-1],
     r"{tmp}/runs/done/checkpoints/step_00001/trainer_state\.pt: not a trainer state selfopd reads \(UnpicklingError: "
     r".*GLOBAL posix\.system"),
    ("resume-garbage-split", lambda s: ((s.tmp / "runs/done/split.json").write_bytes(b"\x00\x9fgarbage"),
                                        _resume(s.tmp / "runs" / "done"))[-1],
     r"{tmp}/runs/done/split\.json: not a split record \(not valid JSON"),
    ("resume-folder-loads-a-server-plugin", lambda s: ((c := s.tmp / "runs/done/config.toml").write_text(
        c.read_text().replace('extra_server_args = ""', 'extra_server_args = "--tool-parser-plugin planted.py"')),
        _resume(c.parent))[-1],
     r"{tmp}/runs/done/config\.toml: engine\.extra_server_args: '--tool-parser-plugin' is not one of the vLLM flags"),
    ("resume-folder-sends-the-key-elsewhere", lambda s: ((c := s.tmp / "runs/done/config.toml").write_text(
        c.read_text().replace('student_urls = ""', 'student_urls = "http://203.0.113.9:8000"')
        .replace('api_key_env = ""', 'api_key_env = "SELFOPD_MY_API_KEY"')), _resume(c.parent))[-1],
     r"{tmp}/runs/done/config\.toml: data\.spec: 'rg:chain_sum\?.*' in a run folder this user's selfopd did not "
     r"write .* to accept it \(it also sets engine\.student_urls, engine\.api_key_env, which need the same\)$"),
    ("resume-linked-checkpoints", lambda s: (shutil.move(s.tmp / "runs/done/checkpoints", s.tmp / "elsewhere"),
                                             (s.tmp / "runs/done/checkpoints").symlink_to(s.tmp / "elsewhere"),
                                             _resume(s.tmp / "runs/done"))[-1],
     r"{tmp}/runs/done/checkpoints: a link \(to {tmp}/elsewhere\), which selfopd does not follow in a run folder"),
    ("resume-garbage-metrics", lambda s: ((m := s.tmp / "runs/done/metrics.jsonl").write_text(
        m.read_text() + "{not json\n"), _resume(m.parent))[-1],
     r"{tmp}/runs/done/metrics\.jsonl:\d+: not a JSON line: .*; the file was damaged or altered"),
    ("resume-folder-asks-for-remote-code", lambda s: ((c := s.tmp / "runs/done/config.toml").write_text(
        c.read_text().replace("trust_remote_code = false", "trust_remote_code = true")), _resume(c.parent))[-1],
     r"{tmp}/runs/done/config\.toml: model\.trust_remote_code: true in the run folder's config, which selfopd never "
     r"takes from a folder .*: pass --set model\.trust_remote_code=true if you trust them"),
]


def _without_checkpoints(run: Path) -> Path:
    shutil.rmtree(run / "checkpoints")
    return run


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, tiny_model_dir) -> Path:
    """A one-step run with its checkpoint, as `selfopd train` leaves it."""
    out = tmp_path_factory.mktemp("finished")
    sets = [*SMALL, f"model.student={tiny_model_dir}", f"run.out_dir={out}", "run.name=done", "run.steps=1"]
    assert main(["train", "experiments/demo/demo.toml", *[arg for s in sets for arg in ("--set", s)]]) == 0
    return out / "done"


def _snapshot(folder: Path) -> dict[str, bytes]:
    """Every file's bytes, but the lock's (it holds the PID of whoever last ran there)."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
            and p.name != ".lock"}


def _assert_one_line_error(capsys, argv: list[str], expected: str, tmp: Path) -> None:
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.strip("\n").split("\n") if not PROGRESS_BAR.search(line)]
    assert len(lines) == 1 and lines[0].startswith("selfopd: error: "), err
    assert not hidden_characters(lines[0]), lines[0]  # no control or bidi character reaches the terminal
    assert re.search(expected.replace("{tmp}", re.escape(str(tmp))), lines[0]), lines[0]


@pytest.mark.parametrize("name, argv_of, expected", FRESH, ids=[case[0] for case in FRESH])
def test_bad_input_for_a_fresh_run(name, argv_of, expected, tmp_path, tiny_model_dir, capsys):
    argv = argv_of(Setup(tmp_path, tiny_model_dir))
    _assert_one_line_error(capsys, argv, expected, tmp_path)
    assert not (tmp_path / "runs").exists()  # no run folder, not even an empty one


@pytest.mark.parametrize("name, argv_of, expected", RESUME, ids=[case[0] for case in RESUME])
def test_bad_input_for_a_resumed_run(name, argv_of, expected, tmp_path, tiny_model_dir, finished_run, capsys):
    run = tmp_path / "runs" / "done"
    shutil.copytree(finished_run, run)
    argv = argv_of(Setup(tmp_path, tiny_model_dir))
    before = _snapshot(run) if run.exists() else {}
    _assert_one_line_error(capsys, argv, expected, tmp_path)
    assert (_snapshot(run) if run.exists() else {}) == before
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["done"]
