"""The schema layer every section is built on: each numeric setting declares its range and is
refused past it (non-finite, absurd, negative where a count is meant) and accepted at its edges;
no string setting holds a control or bidi character; a config path that is a folder or not UTF-8
is one line naming the file."""

from __future__ import annotations

import dataclasses
import math

import pytest

from selfopd.comparisons.sft import SftSection
from selfopd.config import SECTIONS, TrainConfig, load_config
from selfopd.config.settings import MAX_SEED, ConfigError, escaped, field_types, hidden_characters

SCHEMA = {**SECTIONS, "sft": SftSection}
# A field whose edge value another field of its section must make room for (a rule across fields).
PARTNERS = {("loss", "lambda_opd"): {"lambda_rl": 1.0}, ("loss", "rlsd_weight"): {"lambda_rl": 1.0},
            ("sft", "samples_per_prompt"): {"temperature": 1.0}, ("eval", "samples"): {"temperature": 1.0},
            ("loss", "wrong_reward"): {"lambda_rl": 1.0, "rl_advantage": "raw"}}


def numeric_fields() -> list:
    return [pytest.param(section, cls, f, id=f"{section}.{f.name}") for section, cls in SCHEMA.items()
            for f in dataclasses.fields(cls) if field_types(cls)[f.name] in (int, float)]


@pytest.mark.parametrize("section, cls, f", numeric_fields())
def test_every_numeric_setting_declares_a_range_with_a_top(section, cls, f):
    bounds = f.metadata.get("bounds")
    assert bounds is not None, f"{section}.{f.name}: declare its range in setting(..., ge=/gt=, le=/lt=/most=)"
    assert (bounds.ge, bounds.gt) != (None, None) and (bounds.le, bounds.lt, bounds.most) != (None, None, None)


def _build(cls, section: str, name: str, value):
    return cls(**{**PARTNERS.get((section, name), {}), name: value})


@pytest.mark.parametrize("section, cls, f", numeric_fields())
def test_every_numeric_setting_refuses_what_lies_past_its_range(section, cls, f):
    bounds, kind = f.metadata["bounds"], field_types(cls)[f.name]
    low = bounds.ge if bounds.ge is not None else bounds.gt
    high = min(b for b in (bounds.le, bounds.lt, bounds.most) if b is not None)
    hostile = [low - 1 if bounds.ge is not None else low, high + 1 if bounds.lt is None else high, 2**64, -(2**64)]
    hostile = [kind(v) if kind is int else float(v) for v in hostile]
    if kind is float:
        hostile += [math.nan, math.inf, -math.inf, 1e300, 10**400]
    else:
        hostile += [1e300, 2.0]
    for value in hostile:
        with pytest.raises(ConfigError) as error:
            _build(cls, section, f.name, value)
        assert error.value.key == f"{section}.{f.name}", (value, str(error.value))


@pytest.mark.parametrize("section, cls, f", numeric_fields())
def test_every_numeric_setting_takes_the_edges_of_its_range(section, cls, f):
    bounds, kind = f.metadata["bounds"], field_types(cls)[f.name]
    edges = [b for b in (bounds.ge, bounds.le, bounds.most) if b is not None]
    for value in edges:
        built = _build(cls, section, f.name, kind(value))
        assert getattr(built, f.name) == value


def test_the_edges_the_issue_names():
    assert load_config(None, ["engine.port=65535"]).engine.port == 65535
    assert load_config(None, ["engine.kind=vllm", "engine.teacher_engine=local", "engine.port=65535"]).engine.port == 65535
    assert load_config(None, ["engine.kind=vllm", "engine.port=65534"]).engine.port == 65534  # teacher on 65535
    assert load_config(None, [f"run.seed={MAX_SEED}", f"data.split_seed={MAX_SEED}"]).run.seed == MAX_SEED
    assert load_config(None, ["run.seed=0", "rollout.temperature=0"]).run.seed == 0
    for refused, key in [(["engine.port=65536"], "engine.port"), (["engine.port=0"], "engine.port"),
                         ([f"run.seed={MAX_SEED + 1}"], "run.seed"), ([f"run.seed={2**63}"], "run.seed"),
                         (["engine.kind=vllm", "engine.port=65535"], "engine.port"),
                         (["engine.kind=vllm", "engine.student_servers=3", "engine.teacher_engine=local",
                           "engine.port=65534"], "engine.port")]:
        with pytest.raises(ConfigError) as error:
            load_config(None, refused)
        assert error.value.key == key


@pytest.mark.parametrize("name", ["ok\u202etxt", "a\x1b[31mb", "a\nb", "tab\there", "zero\u200bwidth", "nul\x00",
                                  "line\u2028sep", "\u2066isolate", "del\x7f"])
def test_a_run_name_with_a_control_or_bidi_character_is_refused_and_shown_escaped(name):
    with pytest.raises(ConfigError) as error:
        load_config(None, [f"run.name={name}"])
    message = str(error.value)
    assert error.value.key == "run.name" and "invisible or control character" in message
    assert not hidden_characters(message, allow="") and f"got '{escaped(name)}'" in message


@pytest.mark.parametrize("name", ["résumé run", "日本語", "run-1_2.3", "a" * 200])
def test_a_plain_visible_run_name_is_taken(name):
    assert load_config(None, [f"run.name={name}"]).run.name == name


def test_a_run_name_too_long_for_a_folder_is_refused():
    with pytest.raises(ConfigError, match=r"run\.name: must be at most 200 bytes"):
        load_config(None, ["run.name=" + "é" * 101])


def test_strings_keep_tabs_and_newlines_but_no_other_control_character(tmp_path):
    config = TrainConfig(engine=dataclasses.replace(TrainConfig().engine, extra_server_args="--seed 1\n--block-size\t2"))
    assert config.engine.extra_server_args == "--seed 1\n--block-size\t2"
    with pytest.raises(ConfigError, match=r"data\.student_template: holds the invisible or control character U\+202E"):
        load_config(None, ["data.student_template=student/plain\u202e"])


def test_a_config_path_that_is_a_folder_or_not_utf8_is_named(tmp_path):
    with pytest.raises(ConfigError, match=rf"^{tmp_path}: is a folder, not a config file$"):
        load_config(tmp_path)
    latin = tmp_path / "latin.toml"
    latin.write_bytes("[run]\nsteps = 3\nname = 'café'\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=rf"^{latin}: line 3: not UTF-8 text \(byte 0xe9\); TOML files are UTF-8$"):
        load_config(latin)
    bom = tmp_path / "bom.toml"
    bom.write_bytes(b"\xef\xbb\xbf[run]\nsteps = 3\n")  # a UTF-8 byte-order mark is not TOML either
    with pytest.raises(ConfigError, match=rf"^{bom}: invalid TOML"):
        load_config(bom)


def test_extra_server_args_that_do_not_parse_are_refused_at_config_time():
    for args, reason in [("--seed 'open", "No closing quotation"), ('--seed "open', "No closing quotation"),
                         ("--seed \\", "No escaped character")]:
        with pytest.raises(ConfigError, match=rf"engine\.extra_server_args: does not parse as shell words \({reason}\)"):
            load_config(None, [f"engine.extra_server_args={args}"])
    assert load_config(None, ["engine.extra_server_args=--seed '1' --enforce-eager"]).engine.extra_server_args \
        == "--seed '1' --enforce-eager"


def test_a_run_at_the_largest_seeds_trains(tmp_path, tiny_model_dir):
    """The largest seed each setting takes is a seed the run can use: the trainer derives sampling
    seeds from it (seed * 1_000_003 + step) that torch and vLLM must still take."""
    from selfopd.cli import main

    sets = [f"model.student={tiny_model_dir}", f"run.out_dir={tmp_path}", "run.name=edge", "run.steps=1",
            f"run.seed={MAX_SEED}", f"data.split_seed={MAX_SEED}", "data.eval_size=2", "run.eval_every=0",
            f"data.spec=rg:chain_sum?min_terms=2&max_terms=2&size=20&seed={MAX_SEED}", "rollout.prompts_per_step=2",
            "rollout.samples_per_prompt=2", "rollout.max_tokens=4", "optim.micro_batch_prompts=1",
            "eval.max_tokens=4", "run.progress=false", "run.rollouts_to_save=0"]
    assert main(["train", "experiments/demo/demo.toml", *[arg for s in sets for arg in ("--set", s)]]) == 0
    assert (tmp_path / "edge" / "checkpoints").is_dir()


def test_a_config_path_that_never_ends_or_nests_without_end_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"^/dev/zero: is not a regular file, so not a config file$"):
        load_config("/dev/zero")  # reading it would never end
    deep = tmp_path / "deep.toml"
    deep.write_text("[run]\nx = " + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(ConfigError, match=rf"^{deep}: invalid TOML: nested too deep to read$"):
        load_config(deep)
    big = tmp_path / "big.toml"
    big.write_text("#" * (16 * 2**20 + 1))
    with pytest.raises(ConfigError, match=rf"^{big}: is 16777217 bytes; a config file is at most 16777216$"):
        load_config(big)


@pytest.mark.parametrize("out_dir", ["runs\nmore", "runs\t", "runs\u202e"])
def test_an_output_folder_is_a_path_on_one_line(out_dir):
    with pytest.raises(ConfigError) as error:
        load_config(None, [f"run.out_dir={out_dir}"])
    assert error.value.key == "run.out_dir" and "invisible or control character" in str(error.value)


def test_a_table_setting_reads_from_set_and_toml_with_its_value_types(tmp_path):
    """model.chat_template_kwargs: `--set` takes name=value pairs (true/false, integers, numbers,
    else strings); a TOML file takes a table; an empty `--set` value is the empty table."""
    given = load_config(None, ["model.chat_template_kwargs=enable_thinking=false,n=3,t=0.5,mode=brief"])
    assert given.model.chat_template_kwargs == {"enable_thinking": False, "n": 3, "t": 0.5, "mode": "brief"}
    assert load_config(None, ["model.chat_template_kwargs="]).model.chat_template_kwargs == {}
    path = tmp_path / "c.toml"
    path.write_text('[model]\nchat_template_kwargs = {enable_thinking = false, mode = "brief"}\n')
    assert load_config(path).model.chat_template_kwargs == {"enable_thinking": False, "mode": "brief"}
    assert TrainConfig().model.chat_template_kwargs == {} and TrainConfig().model.chat_template_kwargs is not \
        TrainConfig().model.chat_template_kwargs  # each config its own table


@pytest.mark.parametrize("toml, key, says", [
    ("chat_template_kwargs = 3", "model.chat_template_kwargs", "expected a table of names"),
    ("chat_template_kwargs = {a = [1, 2]}", "model.chat_template_kwargs.a", "expected true/false, a number or a string"),
    ("chat_template_kwargs = {a = {b = 1}}", "model.chat_template_kwargs.a", "expected true/false, a number or a string"),
    ("chat_template_kwargs = {a = nan}", "model.chat_template_kwargs.a", "expected true/false, a number or a string"),
    ('chat_template_kwargs = {"not a name" = 1}', "model.chat_template_kwargs", "keys are names"),
    ("chat_template_kwargs = {messages = 1}", "model.chat_template_kwargs.messages", "apply_chat_template itself"),
])
def test_a_bad_table_value_is_one_line_naming_the_file_and_key(tmp_path, toml, key, says):
    path = tmp_path / "c.toml"
    path.write_text(f"[model]\n{toml}\n")
    with pytest.raises(ConfigError) as error:
        load_config(path)
    assert error.value.key == key and "\n" not in str(error.value) and str(path) in str(error.value)
    assert says in error.value.message


@pytest.mark.parametrize("text, says", [("enable_thinking", "expected name=value pairs"), ("=1", "keys are names"),
                                        ("a=nan", "expected true/false, a number or a string"),
                                        ("a b=1", "keys are names")])
def test_a_bad_table_override_is_one_line_naming_the_set(text, says):
    with pytest.raises(ConfigError) as error:
        load_config(None, [f"model.chat_template_kwargs={text}"])
    assert error.value.key.startswith("model.chat_template_kwargs") and "\n" not in str(error.value)
    assert f"--set model.chat_template_kwargs={text}" in str(error.value) and says in error.value.message
