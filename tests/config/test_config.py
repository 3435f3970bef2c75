"""The training config: defaults, TOML round trip, `--set` overrides, and every kind of error."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import pytest

from selfopd.config import (
    DEMO_DATA,
    EngineConfig,
    GuardConfig,
    VerifierConfig,
    SECTIONS,
    ConfigError,
    OptimConfig,
    RunConfig,
    TrainConfig,
    config_to_dict,
    config_to_toml,
    load_config,
    parse_overrides,
)

# The defaults as the design states them; a changed default must change this table too.
EXPECTED_DEFAULTS = {
    "run": dict(name="run", out_dir="runs", seed=0, steps=20, eval_every=10, checkpoint_every=0,
                checkpoint_format="gathered", checkpoint_async=True, export_every=0, keep_checkpoints=1,
                keep_best_checkpoint=False, rollouts_to_save=32, progress=True,
                trackers=(), wandb_project="selfopd", wandb_mode="offline"),
    "model": dict(student="smollm2-135m-instruct", revision="", dtype="auto", device="auto", attn_implementation="auto",
                  gradient_checkpointing=False, compile_layers=False, lora_rank=0, lora_alpha=32.0, lora_dropout=0.0,
                  lora_targets=("all-linear",), lora_bf16_servers=False, chat_template_kwargs={}, threads=0, trust_remote_code=False),
    "teacher": dict(kind="self", model="", revision="", tokenizer="student", template="teacher/reference_answer", chat_template_kwargs={}, ema_rate=0.05, skip_self_success=True, strip_reasoning=False,
                    tasks=(), demonstration_fallback="teacher/empty"),
    "data": dict(
        spec=DEMO_DATA,
        student_template="student/plain",
        eval_size=200,
        split_seed=0,
    ),
    "rollout": dict(prompts_per_step=8, samples_per_prompt=4, max_tokens=48, temperature=1.0, top_p=1.0, top_k=0,
                    min_p=0.0, max_staleness=0, environment="none", max_turns=3, max_episode_tokens=512,
                    tools=("calculator",), max_tool_calls=4),
    "loss": dict(lambda_opd=1.0, lambda_rl=0.0, rl_advantage="group_norm", wrong_reward=0.0, normalisation="token",
                 is_cap=2.0, divergence="sampled", top_k=20, jsd_beta=0.5,
                 token_clip=0.0, clip_per="position", partial_credit=False, rlsd_weight=0.0, rlsd_decay_steps=50, rlsd_clip=0.2, opd_on="all",
                 opd_baseline="student", pass_rate_weighting=False),
    "optim": dict(
        lr=1e-6, weight_decay=0.0, beta1=0.9, beta2=0.999, warmup_steps=0, schedule="constant", grad_clip=1.0, micro_batch_prompts=2,
        max_nonfinite_steps=3,
    ),
    "eval": dict(max_tokens=48, batch_size=32, data="", samples=1, temperature=0.0, top_p=1.0, top_k=0, min_p=0.0,
                 student_template="", chat_template_kwargs={}, truncated="", reasoning="", environment=""),
    "probe": dict(tolerance=3e-4, bf16_tolerance=0.25),
    "engine": dict(kind="local", batch_size=64, packed_sampling=False, compiled_sampling=False, student_urls="", teacher_url="", teacher_engine="vllm", host="127.0.0.1", port=8100, max_model_len=2048,
                   weight_sync="auto", sync_port=0, sync_timeout_s=60.0, sync_buffer_mb=512, verify_every=1,
                   trainer_address="127.0.0.1", compile="auto", gpu_memory_utilization=0.0,
                   check_memory_plan=True, cpu_kv_cache_gb=1, extra_server_args="", startup_timeout_s=900.0, request_timeout_s=0.0,
                   retries=3, max_concurrency=64, student_servers=1, student_gpus="", teacher_servers=1, teacher_gpus="",
                   tensor_parallel_size=1, teacher_tensor_parallel_size=0, sleep_mode=True, api_key_env=""),
    "guard": dict(action="warn", window=6, kl_drop=0.1, accuracy_drop=0.05, truncated_share=0.5, truncated_rise=0.1,
                  truncated_z=1.645,
                  preference_max=0.0, preference_groups=8, starved_teacher_steps=5),
    "verifier": dict(reasoning_start="<think>", reasoning_end="</think>", truncated="wrong", isolation="sandbox"),
}


def write(tmp_path, text: str):
    path = tmp_path / "demo.toml"
    path.write_text(text, encoding="utf-8")
    return path


def load_error(tmp_path, text: str, overrides=()) -> ConfigError:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    return info.value


def test_the_default_data_is_the_demos():
    """`selfopd eval` without a config must look at the demo's split, never at its training prompts."""
    demo = load_config(Path(__file__).resolve().parents[2] / "experiments" / "demo" / "demo.toml")
    defaults = load_config(None)
    assert (defaults.data.spec, defaults.data.eval_size, defaults.data.split_seed, defaults.data.student_template) == (
        demo.data.spec, demo.data.eval_size, demo.data.split_seed, demo.data.student_template)
    from selfopd.comparisons.sft import load_sft_config

    # The shipped SFT teacher holds out the demo's prompts, so it never trains on them.
    sft = load_sft_config(Path(__file__).resolve().parents[2] / "experiments" / "self_vs_external" / "sft_teacher.toml")
    assert sft.train.data == demo.data


def test_defaults():
    assert config_to_dict(load_config(None, resolve=False)) == EXPECTED_DEFAULTS  # 'auto' as written
    assert load_config(None, resolve=False) == TrainConfig()
    assert load_config(None).model.dtype == "float32"  # 'auto' resolved on this CPU machine


def test_every_field_has_help_and_a_comment_in_the_toml():
    text = config_to_toml(TrainConfig())
    for section, cls in SECTIONS.items():
        assert f"[{section}]" in text
        for f in dataclasses.fields(cls):
            help = f.metadata.get("help", "")
            assert help.strip(), f"{section}.{f.name} has no help"
            assert f"# {help}\n{f.name} = " in text


def test_round_trip_of_defaults(tmp_path):
    config = TrainConfig()
    assert load_config(write(tmp_path, config_to_toml(config)), resolve=False) == config  # 'auto' as written
    assert load_config(write(tmp_path, config_to_toml(config))).model.dtype == "float32"  # resolved here, a CPU


def test_round_trip_of_every_field_changed(tmp_path):
    config = TrainConfig(
        run=RunConfig(name='odd "name" é end', out_dir="C:\\out dir", seed=7, steps=5, eval_every=0, checkpoint_every=2,
                      checkpoint_format="sharded", checkpoint_async=False, export_every=4, keep_checkpoints=3,
                      keep_best_checkpoint=True, rollouts_to_save=0, progress=False, trackers=("wandb", "tensorboard"), wandb_project="p", wandb_mode="online"),
        model=dataclasses.replace(TrainConfig().model, student="org/x", revision="abc123", dtype="bfloat16", threads=3,
                                  device="cuda:1", attn_implementation="eager", gradient_checkpointing=True, compile_layers=True,
                                  lora_rank=0, lora_alpha=16, lora_dropout=0.1, lora_targets=("q_proj", "v_proj"), lora_bf16_servers=True,
                                  trust_remote_code=True,
                                  chat_template_kwargs={"enable_thinking": False, "n": 2, "t": 0.5, "s": 'a "b" é\n'}),
        teacher=dataclasses.replace(TrainConfig().teacher, kind="external", model="org/teacher", revision="v1.0",
                                    template="teacher/hints",
                                    chat_template_kwargs={"enable_thinking": True},
                                    ema_rate=0.25, skip_self_success=False, strip_reasoning=True, demonstration_fallback="teacher/answer_note"),
        data=dataclasses.replace(TrainConfig().data, spec="champ?concepts=true", student_template="student/boxed", eval_size=10, split_seed=3),
        rollout=dataclasses.replace(TrainConfig().rollout, prompts_per_step=6, samples_per_prompt=2, max_tokens=9, temperature=1.0, top_p=0.95,
                                    top_k=20, min_p=0.05, max_staleness=2, environment="retry_feedback",
                                    max_turns=5, max_episode_tokens=300, tools=("python", "calculator"),
                                    max_tool_calls=7),
        loss=dataclasses.replace(TrainConfig().loss, lambda_opd=0.1, lambda_rl=0.3, normalisation="sequence", is_cap=0.0,
                                  divergence="topk_reverse_kl", top_k=7, jsd_beta=0.3, partial_credit=True,
                                  rl_advantage="raw", wrong_reward=-1.0,
                                  token_clip=1.5, rlsd_weight=0.4, rlsd_decay_steps=20, rlsd_clip=0.3, opd_on="failed",
                                  pass_rate_weighting=True),
        optim=OptimConfig(lr=3e-6, weight_decay=0.01, beta1=0.8, beta2=0.95, warmup_steps=2, schedule="cosine", grad_clip=0.0, micro_batch_prompts=3,
                          max_nonfinite_steps=5),
        eval=dataclasses.replace(TrainConfig().eval, max_tokens=7, batch_size=5, data="hf:org/x?split=test", samples=4,
                                 temperature=0.6, top_p=0.95, top_k=20, min_p=0.05, student_template="student/opsd_eval",
                                 chat_template_kwargs={"enable_thinking": True}, truncated="grade", reasoning="graded",
                                 environment="none"),
        probe=dataclasses.replace(TrainConfig().probe, tolerance=2.5e-5, bf16_tolerance=0.5),
        engine=EngineConfig(kind="vllm", batch_size=8, student_urls="http://a:1,http://b:2", teacher_url="https://c:3", host="0.0.0.0",
                            port=9000, max_model_len=4096, weight_sync="nccl", sync_port=29700, sync_timeout_s=30.0,
                            sync_buffer_mb=64, verify_every=4, trainer_address="10.0.0.2", compile="on",
                            gpu_memory_utilization=0.8, check_memory_plan=False, cpu_kv_cache_gb=4, extra_server_args="--seed 1\n--kv-cache-dtype 'fp8'\t--enforce-eager",
                            startup_timeout_s=60.0, request_timeout_s=30.0, retries=0, max_concurrency=8,
                            student_servers=2, student_gpus="1,2,3,4", teacher_servers=2, teacher_gpus="5,6,7,8,9,10",
                            tensor_parallel_size=2,
                            teacher_tensor_parallel_size=3, sleep_mode=False, api_key_env="MY_KEY"),
        guard=GuardConfig(action="stop", window=5, kl_drop=0.2, accuracy_drop=0.1, truncated_share=0.75,
                          truncated_rise=0.2, truncated_z=2.5, preference_max=-0.1, preference_groups=12,
                          starved_teacher_steps=3),
        verifier=VerifierConfig(reasoning_start="<reasoning>", reasoning_end="</reasoning>", truncated="grade",
                                isolation="limits"),
    )
    changed = config_to_dict(config)
    for section, defaults in EXPECTED_DEFAULTS.items():
        for key, default in defaults.items():
            # vLLM needs temperature 1, top-k a sampled baseline, LoRA with vLLM fp32, top-k the student's tokenizer,
            # a teacher scored in process no teacher server, packed and compiled sampling the local engine, a per-entry
            # clip a full-vocabulary divergence: round-tripped below
            if (section, key) not in (("rollout", "temperature"), ("loss", "opd_baseline"), ("loss", "clip_per"),
                                      ("model", "lora_rank"),
                                      ("teacher", "tokenizer"), ("teacher", "tasks"), ("engine", "teacher_engine"),
                                      ("engine", "packed_sampling"), ("engine", "compiled_sampling")):
                assert changed[section][key] != default, f"{section}.{key} not changed: the round trip would not test it"
    assert load_config(write(tmp_path, config_to_toml(config))) == config
    contrastive = dataclasses.replace(TrainConfig(), loss=dataclasses.replace(TrainConfig().loss, opd_baseline="wrong_context"))
    assert load_config(write(tmp_path, config_to_toml(contrastive)), resolve=False) == contrastive
    entry = dataclasses.replace(TrainConfig(), loss=dataclasses.replace(TrainConfig().loss, divergence="jsd", token_clip=0.05,
                                                                        clip_per="vocabulary_entry"))
    assert load_config(write(tmp_path, config_to_toml(entry)), resolve=False) == entry
    lora = dataclasses.replace(config, model=dataclasses.replace(config.model, lora_rank=8, dtype="float32"),
                               run=dataclasses.replace(config.run, checkpoint_format="gathered"))  # sharded: not with LoRA
    assert load_config(write(tmp_path, config_to_toml(lora))) == lora
    tempered = dataclasses.replace(config, engine=EngineConfig(), rollout=dataclasses.replace(config.rollout, temperature=0.7))
    assert load_config(write(tmp_path, config_to_toml(tempered))) == tempered
    packed = TrainConfig(engine=dataclasses.replace(TrainConfig().engine, packed_sampling=True, compiled_sampling=True))
    assert load_config(write(tmp_path, config_to_toml(packed)), resolve=False) == packed
    scored_here = dataclasses.replace(config, engine=dataclasses.replace(config.engine, teacher_url="", teacher_gpus="",
                                                                         teacher_engine="local"))
    assert load_config(write(tmp_path, config_to_toml(scored_here))) == scored_here
    own = TrainConfig(teacher=dataclasses.replace(TrainConfig().teacher, kind="external", model="org/t", tokenizer="own"))
    assert load_config(write(tmp_path, config_to_toml(own)), resolve=False) == own


def test_partial_file_fills_defaults_and_int_is_accepted_for_float(tmp_path):
    config = load_config(write(tmp_path, "[run]\nsteps = 3\n\n[optim]\nlr = 1\n"))
    assert config.run.steps == 3
    assert config.optim.lr == 1.0 and type(config.optim.lr) is float
    assert config.model == dataclasses.replace(TrainConfig().model, dtype="float32")  # 'auto' on a CPU


@pytest.mark.parametrize(
    "text, key, fragment",
    [
        ("[trainer]\nsteps = 3\n", "[trainer]", "unknown section; sections: run, model, teacher"),
        ("[rn]\nsteps = 3\n", "[rn]", "did you mean 'run'?"),
        ("[run]\nstepz = 3\n", "run.stepz", "did you mean 'steps'?"),
        ("[run]\nfoo = 3\n", "run.foo", "keys of [run]: name, out_dir, seed, steps, eval_every"),
        ("steps = 3\n", "steps", "did you mean 'run.steps'?"),
        ('[run]\nsteps = "ten"\n', "run.steps", "expected an integer, got 'ten'"),
        ("[run]\nsteps = true\n", "run.steps", "expected an integer, got True"),
        ("[run]\nsteps = 2.0\n", "run.steps", "expected an integer, got 2.0"),
        ("[optim]\nlr = true\n", "optim.lr", "expected a number, got True"),
        ('[optim]\nlr = "1e-6"\n', "optim.lr", "expected a number, got '1e-6'"),
        ("[optim]\nlr = nan\n", "optim.lr", "must be finite"),
        ("[run]\nprogress = 1\n", "run.progress", "expected true or false, got 1"),
        ("[run]\nname = 5\n", "run.name", "expected a string, got 5"),
        ("[run.sub]\nx = 1\n", "run.sub", "unknown key"),
        ('[loss]\nnormalisation = "tokens"\n', "loss.normalisation", "must be one of 'token', 'sequence', got 'tokens'"),
        ("[run]\nsteps = 0\n", "run.steps", "must be >= 1, got 0"),
        ("[run]\neval_every = -1\n", "run.eval_every", "must be >= 0"),
        ('[run]\nname = "a/b"\n', "run.name", "plain folder name"),
        ('[model]\nstudent = ""\n', "model.student", "must not be empty"),
        ("[rollout]\ntemperature = -0.5\n", "rollout.temperature", "must be >= 0.0"),
        ("[rollout]\nmax_staleness = -1\n", "rollout.max_staleness", ">= 0"),
        ("[rollout]\ntop_p = 0\n", "rollout.top_p", "must be in (0, 1]"),
        ("[rollout]\ntop_p = 1.01\n", "rollout.top_p", "must be in (0, 1]"),
        ("[optim]\nlr = 0\n", "optim.lr", "must be > 0"),
        ("[optim]\nbeta2 = 1.0\n", "optim.beta2", "must be in [0, 1)"),
        ("[optim]\ngrad_clip = -1\n", "optim.grad_clip", "must be >= 0.0"),
        ("[optim]\nwarmup_steps = 21\n", "optim.warmup_steps", "must be <= run.steps (20)"),
        ("[loss]\nis_cap = 0.5\n", "loss.is_cap", "must be 0 (off) or >= 1, got 0.5"),
        ("[loss]\nlambda_opd = 0\n", "loss.lambda_opd", "both 0"),
        ("[loss]\nlambda_rl = 1\n[rollout]\nsamples_per_prompt = 1\n", "rollout.samples_per_prompt", "must be >= 2 when loss.lambda_rl > 0"),
        ("[probe]\ntolerance = 0\n", "probe.tolerance", "must be > 0"),
        # The vLLM pipe's refusals at start.
        ('[engine]\nkind = "vllm"\n[rollout]\ntemperature = 1.0\n[model]\nlora_rank = 8\ndtype = "bfloat16"\n',
         "model.lora_rank", "vLLM would serve W + dW rounded to bf16"),
        ('[engine]\nkind = "vllm_colocate"\n[rollout]\ntemperature = 1.0\n[model]\nlora_rank = 8\ndtype = "bfloat16"\n',
         "model.lora_rank", "refused"),
        ('[engine]\nkind = "vllm_colocate"\n[rollout]\ntemperature = 1.0\n[model]\ndevice = "cuda:1"\n',
         "model.device", "run with CUDA_VISIBLE_DEVICES=N and model.device = 'cuda'"),
        ('[engine]\nstudent_urls = "http://localhost:8000,http://127.0.0.1:8000/"\n', "engine.student_urls",
         "lists one server twice"),
        ('[engine]\nstudent_urls = "http://a:8000"\nteacher_url = "http://A:8000"\n[teacher]\nkind = "frozen"\n',
         "engine.teacher_url", "a 'frozen' teacher needs a server of its own"),
        ('[loss]\nopd_baseline = "same_engine"\n[teacher]\nkind = "frozen"\n', "loss.opd_baseline",
         "only with teacher.kind = 'self'"),
        ('[loss]\nopd_baseline = "same_engine"\ndivergence = "topk_reverse_kl"\n', "loss.opd_baseline",
         "sampled-token signal"),
        ('[engine]\nweight_sync = "file"\n', "engine.weight_sync", "must be one of 'auto', 'gloo', 'nccl'"),
        ("[engine]\nsync_timeout_s = 0\n", "engine.sync_timeout_s", "must be > 0"),
    ],
)
def test_file_errors_name_the_file_and_the_key(tmp_path, text, key, fragment):
    error = load_error(tmp_path, text)
    assert error.key == key
    assert str(error).startswith(f"{tmp_path / 'demo.toml'}: {key}: ")
    assert fragment in str(error)


def test_invalid_toml_names_the_file_and_line(tmp_path):
    error = load_error(tmp_path, "[run]\nsteps = 3\nname = \n")
    assert str(error).startswith(f"{tmp_path / 'demo.toml'}: invalid TOML: ")
    assert "line 3" in str(error)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(tmp_path / "absent.toml")


def test_overrides_are_typed_by_the_field():
    config = load_config(
        None,
        [
            "optim.lr=3e-6",
            "run.steps=5",
            "run.progress=false",
            "rollout.temperature=2",
            "loss.normalisation=sequence",
            "data.spec=rg:basic_arithmetic?size=10&seed=2",  # '=' in the value stays in the value
            "run.name=my run",
        ],
    )
    assert config.optim.lr == 3e-6 and type(config.optim.lr) is float
    assert config.run.steps == 5 and type(config.run.steps) is int
    assert config.run.progress is False
    assert config.rollout.temperature == 2.0 and type(config.rollout.temperature) is float
    assert config.loss.normalisation == "sequence"
    assert config.data.spec == "rg:basic_arithmetic?size=10&seed=2"
    assert config.run.name == "my run"
    assert parse_overrides(["run.progress=TRUE", "run.seed=1", "run.seed=2"]) == {"run": {"progress": True, "seed": 2}}


def test_override_wins_over_the_file(tmp_path):
    path = write(tmp_path, "[run]\nsteps = 3\nseed = 4\n\n[optim]\nlr = 1e-5\n")
    config = load_config(path, ["run.steps=7", "optim.lr=2e-6"])
    assert (config.run.steps, config.run.seed, config.optim.lr) == (7, 4, 2e-6)


@pytest.mark.parametrize("override", ["run.steps", "steps=5", "=5", "run.=5", ".steps=5", "run.steps.x=5"])
def test_malformed_set(override):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert str(info.value) == f"--set {override}: expected section.key=value, e.g. --set optim.lr=3e-6"


@pytest.mark.parametrize(
    "override, key, fragment",
    [
        ("trainer.steps=5", "[trainer]", "unknown section"),
        ("run.stepz=5", "run.stepz", "did you mean 'steps'?"),
        ("run.steps=ten", "run.steps", "expected an integer, got 'ten'"),
        ("run.steps=5.0", "run.steps", "expected an integer, got '5.0'"),
        ("optim.lr=fast", "optim.lr", "expected a number, got 'fast'"),
        ("optim.lr=inf", "optim.lr", "must be finite"),
        ("run.progress=yes", "run.progress", "expected true or false, got 'yes'"),
        ("model.dtype=fp16", "model.dtype", "must be one of 'auto', 'float32', 'bfloat16', got 'fp16'"),
    ],
)
def test_set_errors_name_the_set_and_the_key(override, key, fragment):
    with pytest.raises(ConfigError) as info:
        parse_overrides([override])
    assert info.value.key == key
    assert str(info.value).startswith(f"--set {override}: {key}: ")
    assert fragment in str(info.value)


def test_range_error_from_a_set_blames_the_set_not_the_file(tmp_path):
    error = load_error(tmp_path, "[run]\nsteps = 3\n", ["run.steps=0"])
    assert str(error) == "--set run.steps=0: run.steps: must be >= 1, got 0"
    error = load_error(tmp_path, "[run]\nsteps = 0\n", ["run.seed=1"])
    assert str(error).startswith(f"{tmp_path / 'demo.toml'}: run.steps: ")


def literal_fields():
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if typing.get_origin(hints[f.name]) is typing.Literal:
                yield section, f.name, typing.get_args(hints[f.name])


def test_the_expected_fields_are_literals():
    assert {(s, k) for s, k, _ in literal_fields()} == {
        ("model", "dtype"), ("model", "attn_implementation"), ("teacher", "kind"), ("teacher", "tokenizer"), ("loss", "normalisation"), ("loss", "divergence"),
        ("loss", "opd_on"), ("loss", "opd_baseline"), ("loss", "rl_advantage"), ("loss", "clip_per"), ("optim", "schedule"),
        ("engine", "kind"), ("engine", "teacher_engine"), ("engine", "weight_sync"), ("engine", "compile"), ("run", "wandb_mode"), ("run", "checkpoint_format"),
        ("guard", "action"), ("verifier", "truncated"), ("verifier", "isolation"), ("eval", "truncated"),
        ("eval", "reasoning"), ("eval", "environment"),
    }


def test_gpu_fields_are_checked():
    assert load_config(None, ["engine.student_gpus=1, 2", "engine.student_servers=2"]).engine.gpus("student_gpus") == [1, 2]
    with pytest.raises(ConfigError, match=r"engine.student_gpus: names 1 GPUs; engine.student_servers \(2\) x "
                       r"engine.tensor_parallel_size \(1\) = 2 are needed"):
        load_config(None, ["engine.student_gpus=1", "engine.student_servers=2"])
    with pytest.raises(ConfigError, match=r"engine.teacher_gpus: names 2 GPUs; engine.teacher_servers \(1\) x "
                       r"engine.tensor_parallel_size \(1\) = 1 are needed"):
        load_config(None, ["engine.teacher_gpus=6,7"])
    with pytest.raises(ConfigError, match=r"engine.teacher_gpus: names 1 GPUs; engine.teacher_servers \(1\) x "
                       r"engine.teacher_tensor_parallel_size \(2\) = 2 are needed"):
        load_config(None, ["engine.teacher_gpus=6", "engine.teacher_tensor_parallel_size=2"])
    assert load_config(None, ["engine.teacher_gpus=4,5,6,7", "engine.teacher_servers=2",
                              "engine.teacher_tensor_parallel_size=2"]).engine.gpus("teacher_gpus") == [4, 5, 6, 7]
    assert load_config(None, ["engine.teacher_gpus=6,7", "engine.teacher_tensor_parallel_size=2"]).engine.teacher_parallel_size() == 2
    with pytest.raises(ConfigError, match=r"engine.teacher_gpus: expected comma-separated GPU indices such as '1,2', got 'cuda:1'"):
        load_config(None, ["engine.teacher_gpus=cuda:1"])
    with pytest.raises(ConfigError, match=r"model.device: must be 'auto', 'cpu', 'cuda' or 'cuda:N', got 'gpu'"):
        load_config(None, ["model.device=gpu"])
    with pytest.raises(ConfigError, match=r"rollout.temperature: must be 1 with engine.kind = 'vllm_colocate'"):
        load_config(None, ["engine.kind=vllm_colocate", "rollout.temperature=0.7"])


def test_list_fields_parse_from_toml_and_set():
    assert load_config(None, ["run.trackers=tensorboard,wandb"]).run.trackers == ("tensorboard", "wandb")
    assert load_config(None, ["run.trackers="]).run.trackers == ()
    with pytest.raises(ConfigError, match=r"^--set run.trackers=mlflow: run.trackers: must be one of 'tensorboard'"):
        load_config(None, ["run.trackers=mlflow"])
    with pytest.raises(ConfigError, match=r"run.trackers: names a tracker twice"):
        load_config(None, ["run.trackers=wandb,wandb"])


# What a literal field's every value needs beside it to be accepted.
LITERAL_NEEDS = {("loss", "rl_advantage"): ["loss.lambda_rl=1"],
                 ("loss", "clip_per"): ["loss.divergence=jsd", "loss.token_clip=0.05"]}


@pytest.mark.parametrize("section, key, allowed", list(literal_fields()), ids=lambda v: str(v))
def test_literal_fields_accept_their_values_and_nothing_else(section, key, allowed):
    extra = ["teacher.model=org/t"] if (section, key) == ("teacher", "kind") else []
    for value in allowed:
        sets = (extra if value == "external" else ["teacher.kind=external", "teacher.model=org/t"] if value == "own"
                else ["engine.kind=vllm", "rollout.temperature=1"] if (section, key) == ("engine", "teacher_engine")
                else ["loss.lambda_opd=0", "loss.lambda_rl=1"] if value == "none" else [])
        sets = [*sets, *LITERAL_NEEDS.get((section, key), [])]
        assert getattr(getattr(load_config(None, [f"{section}.{key}={value}", *sets], resolve=False), section),
                       key) == value
    with pytest.raises(ConfigError, match=rf"^--set {section}\.{key}=bogus: {section}\.{key}: must be one of "):
        load_config(None, [f"{section}.{key}=bogus"])
    cased = next(value for value in allowed if value).upper()  # '' (eval.truncated's "as [verifier]") has no case
    with pytest.raises(ConfigError, match=rf"^--set {section}\.{key}={cased}: "):  # case matters
        load_config(None, [f"{section}.{key}={cased}"])


def test_teacher_model_is_required_iff_kind_is_external(tmp_path):
    error = load_error(tmp_path, '[teacher]\nkind = "external"\n')
    assert error.key == "teacher.model" and "required when teacher.kind = 'external'" in str(error)
    error = load_error(tmp_path, '[teacher]\nkind = "external"\nmodel = "  "\n')
    assert error.key == "teacher.model"
    for kind in ("self", "frozen"):
        error = load_error(tmp_path, f'[teacher]\nkind = "{kind}"\nmodel = "org/t"\n')
        assert error.key == "teacher.model" and "only used when teacher.kind = 'external'" in str(error)
        assert load_config(None, [f"teacher.kind={kind}"]).teacher.model == ""
    assert load_config(None, ["teacher.kind=external", "teacher.model=org/t"]).teacher.model == "org/t"


def test_micro_batch_must_divide_prompts_per_step(tmp_path):
    error = load_error(tmp_path, "[optim]\nmicro_batch_prompts = 3\n")
    assert error.key == "optim.micro_batch_prompts"
    assert "must divide rollout.prompts_per_step (8), got 3" in str(error)
    for micro in (1, 2, 4, 8):
        assert load_config(None, [f"optim.micro_batch_prompts={micro}"]).optim.micro_batch_prompts == micro
    with pytest.raises(ConfigError, match="optim.micro_batch_prompts: must divide rollout.prompts_per_step \\(6\\)"):
        load_config(None, ["rollout.prompts_per_step=6", "optim.micro_batch_prompts=4"])
    assert load_config(None, ["rollout.prompts_per_step=6", "optim.micro_batch_prompts=3"]).rollout.prompts_per_step == 6


def test_is_cap_zero_disables_and_one_is_allowed():
    assert load_config(None, ["loss.is_cap=0"]).loss.is_cap == 0.0
    assert load_config(None, ["loss.is_cap=1"]).loss.is_cap == 1.0
    with pytest.raises(ConfigError, match="loss.is_cap"):
        load_config(None, ["loss.is_cap=0.99"])


@pytest.mark.parametrize("setting, shown", [("rollout.top_k=20", "rollout.top_k = 20 > 0"),
                                            ("rollout.min_p=0.05", "rollout.min_p = 0.05 > 0")])
def test_rollout_top_k_and_min_p_need_no_importance_ratio(setting, shown):
    """Like top_p < 1, top_k and min_p renormalise the sampler's distribution over the tokens they keep,
    so the ratio trainer / sampler is not an importance weight: refused unless loss.is_cap = 0."""
    with pytest.raises(ConfigError) as error:
        load_config(None, [setting])
    assert error.value.key == "loss.is_cap"
    assert str(error.value) == (f"loss.is_cap: must be 0 with {shown}: the sampler's logprobs are over the renormalised "
                                f"tokens {shown.split(' = ')[0].split('.')[1]} keeps, the trainer's over the whole tempered "
                                "distribution, so their ratio is the kept mass (below 1 on every token), not an importance weight")
    rollout = load_config(None, [setting, "loss.is_cap=0", "rollout.top_p=0.95"]).rollout
    assert (rollout.top_k, rollout.min_p, rollout.top_p) != (0, 0.0, 1.0)


def test_one_sample_per_prompt_trains_the_grpo_term_only_without_a_group_baseline():
    """A group of one has a group-relative advantage of 0; the raw reward (loss.rl_advantage = 'raw') has none."""
    with pytest.raises(ConfigError) as error:
        load_config(None, ["loss.lambda_rl=1", "rollout.samples_per_prompt=1", "loss.rl_advantage=group_mean"])
    assert error.value.key == "rollout.samples_per_prompt"
    assert load_config(None, ["loss.lambda_rl=1", "rollout.samples_per_prompt=1", "loss.rl_advantage=raw"])


def test_direct_construction_is_validated_too():
    with pytest.raises(ConfigError, match=r"^run\.steps: must be >= 1, got 0$"):
        RunConfig(steps=0)
    with pytest.raises(ConfigError, match=r"^optim\.lr: expected a number, got True$"):
        OptimConfig(lr=True)
    assert type(OptimConfig(lr=1).lr) is float
    with pytest.raises(ConfigError, match="optim.micro_batch_prompts"):
        dataclasses.replace(TrainConfig(), optim=OptimConfig(micro_batch_prompts=3))


def test_engine_urls_are_split_and_checked():
    config = load_config(None, ["engine.student_urls= http://a:1/ ,http://b:2", "engine.teacher_url=http://t:3"])
    assert config.engine.urls("student_urls") == ["http://a:1", "http://b:2"]
    assert config.engine.urls("teacher_url") == ["http://t:3"]
    with pytest.raises(ConfigError, match="engine.student_urls: expected http://HOST:PORT, got 'a:1'"):
        load_config(None, ["engine.student_urls=http://b:2,a:1"])
    assert load_config(None, ["engine.teacher_url=http://a:1,http://b:2"]).engine.urls("teacher_url") == [
        "http://a:1", "http://b:2"]  # replicas
    with pytest.raises(ConfigError, match="engine.teacher_url: names a replica twice"):
        load_config(None, ["engine.teacher_url=http://a:1,http://a:1/"])


def test_a_teacher_scored_by_the_trainer_lifts_the_limits_of_a_vllm_teacher():
    """engine.teacher_engine = 'local' (vLLM samples, the trainer scores): full-vocabulary losses, other
    temperatures and several teachers are allowed, as in process; it needs engine.kind = 'vllm' and no
    teacher server."""
    hybrid = ["engine.kind=vllm", "engine.teacher_engine=local"]
    config = load_config(None, [*hybrid, "rollout.temperature=0.7", "loss.divergence=reverse_kl"])
    assert config.engine.teacher_in_process and config.rollout.temperature == 0.7
    assert load_config(None, [*hybrid, "rollout.temperature=1", "teachers.anchor.kind=frozen"]).teachers
    for refused, key, words in [
        (["engine.kind=vllm", "loss.divergence=jsd", "rollout.temperature=1"], "loss.divergence", "needs the teacher's full"),
        (["engine.kind=vllm", "rollout.temperature=0.7"], "rollout.temperature", "must be 1 with engine.kind = 'vllm'"),
        (["engine.teacher_engine=local"], "engine.teacher_engine", "'local' is for engine.kind = 'vllm'"),
        (["engine.kind=vllm_colocate", "engine.teacher_engine=local", "rollout.temperature=1"], "engine.teacher_engine",
         "engine.kind is 'vllm_colocate'"),
        ([*hybrid, "engine.teacher_url=http://t:1"], "engine.teacher_url", "leave it empty"),
    ]:
        with pytest.raises(ConfigError, match=words) as error:
            load_config(None, refused)
        assert error.value.key == key


def test_rollout_tools_name_selfopds_tools_once_each():
    """rollout.tools: names of `selfopd.episodes.tools.TOOLS` (the Literal lists the same), each once,
    at least one with rollout.environment = 'tools'."""
    from selfopd.config import ToolName
    from selfopd.episodes.tools import TOOLS

    assert set(typing.get_args(ToolName)) == set(TOOLS)
    assert load_config(None, ["rollout.environment=tools", "rollout.tools=python,calculator"]).rollout.tools == (
        "python", "calculator")
    for refused, words in [(["rollout.tools=calc"], "must be one of 'calculator', 'python', got 'calc'"),
                           (["rollout.tools=python,python"], "names a tool twice"),
                           (["rollout.environment=tools", "rollout.tools="], "names no tool"),
                           (["rollout.max_tool_calls=0"], "must be >= 1")]:
        with pytest.raises(ConfigError, match=words) as error:
            load_config(None, refused)
        assert error.value.key.startswith("rollout.")
