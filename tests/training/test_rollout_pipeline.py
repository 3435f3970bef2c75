"""rollout.max_staleness: k = 0 is the synchronous loop; k >= 1 trains step b on rollouts that the
weights of step b - k sampled, which the version tags say and a fresh sampling confirms."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from selfopd.config import load_config
from selfopd.engines.base import SamplingParams
from selfopd.engines.build import load_model
from selfopd.engines.local import LocalEngine
from selfopd.run.rollouts import read_records
from selfopd.run.tracking import PhaseTimer
from selfopd.templating.templates import prompt_token_ids, render_student
from selfopd.training.rollout_pipeline import PENDING_FILE, Request, Sampled
from selfopd.training.trainer import batch_for_step, build_run, train, train_step
from selfopd.run.tracking import untimed

SMALL = [
    "data.spec=rg:chain_sum?min_terms=2&max_terms=2&size=60&seed=2", "data.eval_size=4",
    "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_tokens=6",
    "optim.micro_batch_prompts=1", "optim.lr=1e-3", "eval.max_tokens=6", "eval.batch_size=4",
    "run.progress=false", "run.eval_every=0", "run.rollouts_to_save=64",
]


def _config(tmp_path: Path, model: Path, *extra: str):
    return load_config(None, [*SMALL, f"model.student={model}", f"run.out_dir={tmp_path}", *extra])


def _steps(run_dir: Path) -> list[dict]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [untimed(line) for line in lines if "loss/pg" in line]


def _rollouts(run_dir: Path, step: int) -> list:
    return read_records(run_dir / "rollouts" / f"step_{step:05d}.jsonl")


def _weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "checkpoints" / f"step_{step:05d}" / "model.safetensors")


def _sample_by_hand(run, step: int, engine) -> list:
    """Step `step`'s rollouts as the synchronous loop samples them: its prompts, its seed, `engine`'s weights."""
    cfg = run.config
    examples = batch_for_step(run.train_examples, step, cfg.rollout.prompts_per_step, cfg.run.seed)
    prompts = [prompt_token_ids(run.tokenizer, render_student(run.student_template, e)) for e in examples]
    params = SamplingParams(max_tokens=cfg.rollout.max_tokens, temperature=cfg.rollout.temperature,
                            top_p=cfg.rollout.top_p, n=cfg.rollout.samples_per_prompt,
                            seed=cfg.run.seed * 1_000_003 + step)
    messages = [render_student(run.student_template, e) for e in examples]
    return Request(step, examples, messages, prompts, params, 0), engine.sample(prompts, params)


class SampleAtStepStart:
    """The synchronous loop's sampling, written out by hand: each step samples its own prompts
    with the weights it is about to train."""

    def __init__(self, run) -> None:
        self.run = run

    def take(self, side, step: int, timer: PhaseTimer) -> Sampled:
        with timer("sample"):
            request, groups = _sample_by_hand(self.run, step, side.engine)
        return Sampled(request, groups, step)

    def before_weight_change(self, version: int) -> None:
        pass


def test_staleness_zero_is_the_synchronous_loop(tmp_path, tiny_model_dir):
    """Metrics, saved rollouts and weights of a k = 0 run equal those of a loop that samples by hand."""
    piped = train(_config(tmp_path, tiny_model_dir, "run.steps=3", "run.name=piped", "rollout.max_staleness=0"))
    run = build_run(_config(tmp_path, tiny_model_dir, "run.steps=3", "run.name=by_hand"))
    run.rollouts = SampleAtStepStart(run)
    by_hand = [train_step(run) for _ in range(3)]
    assert _steps(piped) == [untimed(m) for m in by_hand]
    assert "rollout/staleness" not in by_hand[0]
    for step in (1, 2, 3):  # the same rollouts, the pipeline's tagged with the weights that sampled them
        assert [replace(r, weight_version=None) for r in _rollouts(piped, step)] == _rollouts(run.run_dir, step)
        assert {r.weight_version for r in _rollouts(piped, step)} == {step - 1}
    trained = dict(run.model.named_parameters())
    for name, tensor in _weights(piped, 3).items():
        assert torch.equal(tensor, trained[name]), name


def test_staleness_one_trains_on_rollouts_one_step_old(tmp_path, tiny_model_dir):
    """Version tags and metrics say step b trained on step b - 1's weights' rollouts; sampling those
    prompts again with those very weights (the initial ones; a one-step k = 0 run's, whose step is
    the same) gives the same tokens."""
    stale = train(_config(tmp_path, tiny_model_dir, "run.steps=3", "run.name=stale", "rollout.max_staleness=1"))
    fresh = train(_config(tmp_path, tiny_model_dir, "run.steps=1", "run.name=fresh"))
    metrics = _steps(stale)
    assert [m["rollout/staleness"] for m in metrics] == [0, 1, 1]
    assert [m["rollout/weight_version"] for m in metrics] == [0, 0, 1]
    for step, version in ((1, 0), (2, 0), (3, 1)):  # rollout files are named by the step that trained on them
        assert {r.weight_version for r in _rollouts(stale, step)} == {version}
    first = {k: v for k, v in metrics[0].items() if not k.startswith("rollout/") or k in _steps(fresh)[0]}
    assert first == _steps(fresh)[0]  # the first step is the synchronous one

    run = build_run(_config(tmp_path, tiny_model_dir, "run.name=check"))
    for step, weights in ((1, None), (2, fresh / "checkpoints" / "step_00001")):
        engine = run.student_engine
        if weights is not None:
            model, _ = load_model(str(weights), "float32")
            engine = LocalEngine(model, run.tokenizer)
        _, groups = _sample_by_hand(run, step, engine)
        assert [r.completion_ids for g in groups for r in g] == [r.completion_ids for r in _rollouts(stale, step + 1)]
    # The run's end keeps what it sampled past it (a longer run continues from there exactly).
    saved = json.loads((stale / "checkpoints" / "step_00003" / PENDING_FILE).read_text())
    assert [(b["step"], b["version"]) for b in saved["batches"]] == [(3, 2)]


class Crash(RuntimeError):
    pass


def test_a_checkpoint_keeps_the_rollouts_sampled_ahead_and_a_resume_trains_on_them(tmp_path, tiny_model_dir,
                                                                                  monkeypatch):
    """k = 2: a run that dies after step 2's checkpoint resumes on the rollouts that checkpoint saved
    (steps 3 and 4's, sampled by the weights of steps 0 and 1), to the metrics of an uninterrupted run."""
    import selfopd.training.trainer as trainer

    settings = ("run.steps=4", "rollout.max_staleness=2", "run.checkpoint_every=2")
    whole = train(_config(tmp_path, tiny_model_dir, "run.name=whole", *settings))
    assert [m["rollout/staleness"] for m in _steps(whole)] == [0, 1, 2, 2]

    real_step = trainer.train_step

    def dies_at_step_3(run):
        if run.step == 2:
            raise Crash("killed")
        return real_step(run)

    monkeypatch.setattr(trainer, "train_step", dies_at_step_3)
    with pytest.raises(Crash):
        train(_config(tmp_path, tiny_model_dir, "run.name=cut", *settings))
    monkeypatch.setattr(trainer, "train_step", real_step)
    cut = tmp_path / "cut"
    saved = json.loads((cut / "checkpoints" / "step_00002" / PENDING_FILE).read_text())
    assert [(b["step"], b["version"]) for b in saved["batches"]] == [(2, 0), (3, 1)]
    train(load_config(cut / "config.toml"), resume=True)
    assert _steps(cut) == _steps(whole)
    assert _rollouts(cut, 4) == _rollouts(whole, 4)


def test_a_resume_refuses_rollouts_sampled_ahead_for_other_prompts(tmp_path, tiny_model_dir, monkeypatch):
    settings = ("run.steps=4", "rollout.max_staleness=1", "run.checkpoint_every=1")
    import selfopd.training.trainer as trainer

    real_step = trainer.train_step
    monkeypatch.setattr(trainer, "train_step", lambda run: real_step(run) if run.step < 1 else (_ for _ in ()).throw(Crash()))
    with pytest.raises(Crash):
        train(_config(tmp_path, tiny_model_dir, "run.name=cut", *settings))
    monkeypatch.setattr(trainer, "train_step", real_step)
    pending = tmp_path / "cut" / "checkpoints" / "step_00001" / PENDING_FILE
    saved = json.loads(pending.read_text())
    saved["batches"][0]["rollouts"][0]["prompt_ids"][-1] += 1
    pending.write_text(json.dumps(saved))
    with pytest.raises(ValueError, match=f"{PENDING_FILE}.*step 1 are not of the prompts"):
        train(load_config(tmp_path / "cut" / "config.toml"), resume=True)


def test_the_overlap_benchmark_computes_speed_ups_and_bounds_from_the_synchronous_phases():
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "experiments" / "benchmarks" / "staleness_overlap.py"
    spec = importlib.util.spec_from_file_location("staleness_overlap", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)

    def step(total: float, sample: float, train: float, staleness: int) -> dict:
        return {"time/step": total, "time/sample": sample, "time/train": train, "time/teacher": total - sample - train,
                "rollout/staleness": staleness, "is/ratio_mean": 1.0, "is/ratio_max": 1.5, "is/clipped_share": 0.0}

    summary = bench.summarise({0: [step(10.0, 4.0, 5.0, 0), step(12.0, 4.0, 7.0, 0)], 1: [step(8.0, 0.0, 6.0, 1)]})
    synchronous, ahead = summary["rows"]
    assert synchronous["step_seconds"] == 11.0 and ahead["speedup"] == pytest.approx(11.0 / 8.0)
    # Only sampling (4 s of 11) overlaps: the best step is max(4, 7) = 7 s; the largest phase is train's 6 s of 11.
    assert summary["bounds"]["overlap_bound_speedup"] == pytest.approx(11.0 / 7.0)
    assert summary["bounds"]["max_phase_over_sum"] == pytest.approx(6.0 / 11.0)


def test_a_run_prompts_the_student_with_its_chat_template_arguments(tmp_path, tiny_model_dir):
    """model.chat_template_kwargs reaches the prompts a run samples from: with a thinking-style
    template (`tests.thinking_template`) and enable_thinking = false, every saved rollout's prompt
    ends with the empty think block."""
    from tests.thinking_template import EMPTY_THINK, thinking_model_dir, thinking_tokenizer

    model = thinking_model_dir(tiny_model_dir, tmp_path / "thinking")
    run_dir = train(_config(tmp_path, model, "run.steps=1", "run.name=thinking",
                            "model.chat_template_kwargs=enable_thinking=false"))
    tokenizer = thinking_tokenizer(model)
    prompts = [tokenizer.decode(r.prompt_ids) for r in _rollouts(run_dir, 1)]
    assert prompts and all(p.endswith("<|im_start|>assistant\n" + EMPTY_THINK) for p in prompts)


def test_a_run_samples_only_from_the_top_k_of_the_tempered_distribution(tmp_path, tiny_model_dir):
    """rollout.top_k (OPSD samples with temperature 1.1, top_p 0.95, top_k 20): every token of a
    trained step's saved rollouts is among the k most likely of the initial weights' tempered
    distribution (the tiny random model spreads its mass over 49k tokens, so without the filter
    almost none would be), and its sampler logprob is the renormalised one over those k."""
    from transformers import AutoModelForCausalLM

    k, temperature = 3, 1.1
    run_dir = train(_config(tmp_path, tiny_model_dir, "run.steps=1", "run.name=top_k", f"rollout.top_k={k}",
                            f"rollout.temperature={temperature}", "loss.is_cap=0"))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    rollouts = _rollouts(run_dir, 1)
    assert len(rollouts) == 4 and sum(len(r.completion_ids) for r in rollouts) >= 8
    for r in rollouts:
        ids = torch.tensor([r.prompt_ids + r.completion_ids])
        with torch.no_grad():
            logits_CV = model(ids).logits[0, len(r.prompt_ids) - 1 : -1].double() / temperature
        top_CK = logits_CV.topk(k, dim=-1)
        completion_C1 = torch.tensor(r.completion_ids)[:, None]
        assert (top_CK.indices == completion_C1).any(-1).all()
        renormalised_C = torch.log_softmax(top_CK.values, -1).gather(-1, (top_CK.indices == completion_C1).long().argmax(-1, keepdim=True))
        assert torch.allclose(torch.tensor(r.sampler_logprobs, dtype=torch.float64), renormalised_C[:, 0], rtol=0, atol=1e-4)


class _FakeVLLM:
    """An HTTP server that answers as a vLLM server does (the routes VLLMEngine calls) with one
    token per sample, and keeps every completion request's JSON body."""

    def __init__(self) -> None:
        import http.server
        import threading

        bodies = self.bodies = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def _send(self, payload: dict) -> None:
                data = json.dumps(payload).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):  # noqa: N802
                self._send({"version": "0.32.0"} if self.path == "/version"
                           else {"object": "list", "data": [{"id": "fake", "object": "model", "max_model_len": 4096}]})

            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                bodies.append(body)
                choices = [{"index": i, "text": "7", "finish_reason": "stop", "token_ids": [22],
                            "logprobs": {"tokens": ["7"], "token_logprobs": [-0.5], "top_logprobs": None, "text_offset": [0]}}
                           for i in range(body["n"])]
                self._send({"id": "c", "object": "text_completion", "created": 0, "model": "fake", "choices": choices})

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_the_step_request_carries_top_k_and_min_p_to_a_vllm_server(tmp_path):
    """rollout.top_k and rollout.min_p reach the JSON of every sampling request a vLLM student gets
    (vLLM's own top_k and min_p, beside top_p and the temperature); off, they are sent as off."""
    from types import SimpleNamespace

    from selfopd.core.distributed import World
    from selfopd.data.example import Example
    from selfopd.serving.vllm import VLLMEngine
    from selfopd.templating.chat_format import ChatFormat
    from selfopd.templating.templates import load_template
    from selfopd.training.rollout_pipeline import request_for_step

    class Tokenizer:  # what a chat format reads of a tokenizer, without a model folder
        def apply_chat_template(self, messages, **kwargs):
            return [1, 2, 3]

        def decode(self, ids):
            return ""

    server = _FakeVLLM()
    try:
        engine = VLLMEngine([server.url])
        for sets, (top_k, min_p) in ((["rollout.top_k=20", "rollout.min_p=0.05", "rollout.top_p=0.95",
                                       "rollout.temperature=1.1", "loss.is_cap=0"], (20, 0.05)), ([], (0, 0.0))):
            config = load_config(None, ["rollout.prompts_per_step=2", "rollout.samples_per_prompt=2",
                                        "optim.micro_batch_prompts=1", *sets])
            examples = [Example(id=f"e{i}", prompt=f"What is {i} + 1?", answer=str(i + 1)) for i in range(4)]
            side = SimpleNamespace(config=config, tokenizer=Tokenizer(), engine=engine, world=World(),
                                   template=load_template(config.data.student_template), train_examples=examples,
                                   chat=ChatFormat(Tokenizer()))
            request = request_for_step(side, 1)
            assert (request.params.top_k, request.params.min_p) == (top_k, min_p)
            server.bodies.clear()
            groups = engine.sample(request.prompts, request.params)
            assert [len(g) for g in groups] == [2, 2] and len(server.bodies) == 2
            for body in server.bodies:
                assert (body["top_k"], body["min_p"]) == (top_k, min_p)
                assert (body["top_p"], body["temperature"]) == (config.rollout.top_p, config.rollout.temperature)
        engine.close()
    finally:
        server.close()
