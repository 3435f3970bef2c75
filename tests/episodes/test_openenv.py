"""OpenEnv environments as episodes, on the packaged SmolLM2: a game written against OpenEnv's own base
classes (tests/episodes/openenv_envs.py) run in process and served by OpenEnv's own server, reached
through its WebSocket client; the prompts are the game's opening observations (`env:` data). Ids exact,
masks on the student's ids, the game's rewards, the same episodes both ways, and environments and
servers that misbehave: each ends its episode in one line with the student's reply kept."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
import threading
import time
import tomllib
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from selfopd.config import ConfigError, RolloutConfig, load_config
from selfopd.data import DataError, load_examples
from selfopd.data.openenv_session import Timeouts
from selfopd.engines.base import SamplingParams
from selfopd.engines.local import LocalEngine
from selfopd.episodes.environment import MAX_MESSAGE_CHARS, checked_response
from selfopd.episodes.openenv import OpenEnvEpisode, openenv_environments
from selfopd.episodes.sampling import EpisodeLimits, EpisodeSampler, episode_sampler, run_episodes
from selfopd.run.evaluate import evaluate
from selfopd.serving.server import free_port
from selfopd.templating.chat_format import ChatFormat
from selfopd.templating.templates import load_template, render_student
from selfopd.episodes.verdicts import grade_rollout
from selfopd.training.grading import grade_groups
from tests.episodes import openenv_envs as envs
from tests.episodes.openenv_envs import GuessAction, expected_reward, first_number, secret

ROOT = Path(__file__).resolve().parents[2]
GUESS = "python:tests.episodes.openenv_envs:Guess"
PARAMS = SamplingParams(max_tokens=12, temperature=1.0, seed=11)
LIMITS = EpisodeLimits(max_turns=3, max_episode_tokens=200)
SHORT = EpisodeLimits(max_turns=2, max_episode_tokens=200)  # a misbehaving step is the first one
QUICK = Timeouts(connect_s=2.0, answer_s=3.0)  # a hung step costs 3 s; a live one answers in ms


@pytest.fixture(scope="module")
def setting(smollm2_model, smollm2_tokenizer):
    return LocalEngine(smollm2_model, smollm2_tokenizer, batch_size=8), ChatFormat(smollm2_tokenizer)


def _episodes(setting, target: str, seeds: list[int], engine=None, timeouts: Timeouts = QUICK, examples=None,
              limits: EpisodeLimits = LIMITS):
    """Episodes of `target` from its own opening observations for `seeds`, and the environments made."""
    default_engine, chat = setting
    examples = examples or [e for seed in seeds for e in load_examples(f"env:{target}?size=1&seed={seed}")]
    prompts = [chat.prompt_ids(render_student(load_template("student/plain"), e)) for e in examples]
    make, made = openenv_environments(target, timeouts), []
    episodes = run_episodes(engine or default_engine, chat, prompts, examples,
                            lambda example: made.append(make(example)) or made[-1], PARAMS, limits)
    return examples, episodes, made


def _message(seed: int, reply: str) -> str:
    """What the game answers `reply` with, worked out here apart from it."""
    guess = first_number(reply)
    return ("No number found." if guess is None else "Correct!" if guess == secret(seed)
            else "Higher." if guess < secret(seed) else "Lower.")


@pytest.fixture(scope="module")
def in_process(setting):
    return _episodes(setting, GUESS, [0, 1])


def test_an_in_process_game_gives_exact_ids_masks_and_its_rewards(setting, in_process):
    _, chat = setting
    examples, episodes, made = in_process
    assert [e.prompt for e in examples] == [f"Game {s}: guess my number from 1 to 50. Reply with one number."
                                            for s in (0, 1)]
    assert any(sum(t.role == "student" for t in e.turns) > 1 for e in episodes), "no second turn: proves nothing"
    for example, episode in zip(examples, episodes):
        seed = example.meta["env_seed"]
        ids = list(episode.prompt_ids)
        for turn, after in zip(episode.turns, [*episode.turns[1:], None]):
            if turn.role == "student" and after is not None:  # the game's answer, appended as the chat format does
                message = _message(seed, turn.text)
                assert after.role == "environment"
                assert list(after.ids) == chat.continuation([*ids, *turn.ids], [{"role": "user", "content": message}])
            ids += turn.ids
        students = [t for t in episode.turns if t.role == "student"]
        assert episode.reward == pytest.approx(expected_reward(seed, students[-1].text))
        assert episode.info["turn"] == len(students) and episode.info["guess"] == first_number(students[-1].text)
        assert episode.ending == ("done" if _message(seed, students[-1].text) == "Correct!" else "max_turns")
        rollout = episode.rollout()
        assert rollout.prompt_ids + rollout.completion_ids == episode.ids
        assert list(rollout.loss_mask) == [t.role == "student" for t in episode.turns for _ in t.ids]
    assert all(isinstance(m, OpenEnvEpisode) and m.session is None for m in made)  # every session let go


def test_the_game_s_reward_grades_its_episodes_in_training(setting, in_process):
    """An `env:` example has no reference: the environment's reward for the last reply is the verdict, as
    the game pays it (a miss costs its distance), correct at 1; a reply the game never answered scores 0,
    unchecked (its reference, had it one, aside); without a judging environment, an example with a reference
    is graded by the reply's text."""
    _, chat = setting
    examples, episodes, _ = in_process
    groups = grade_groups(chat, examples, [[episode.rollout()] for episode in episodes])
    rewards = []
    for example, episode, graded in zip(examples, episodes, groups):
        reply = [t for t in episode.turns if t.role == "student"][-1].text
        (verdict,) = graded.verdicts
        rewards.append(expected_reward(example.meta["env_seed"], reply))
        assert (verdict.reward, verdict.correct, verdict.method) == (pytest.approx(rewards[-1]), rewards[-1] == 1.0,
                                                                     "environment")
    assert any(r != 0 for r in rewards), "every reward 0: a grade from the empty reference would pass"
    unanswered = dataclasses.replace(episodes[0].rollout(), environment_reward=None)
    verdict = grade_rollout(chat, unanswered, examples[0], False)
    assert (verdict.reward, verdict.correct, verdict.unchecked) == (0.0, False, True)
    referenced = dataclasses.replace(examples[0], answer="7", meta={})
    assert grade_rollout(chat, unanswered, referenced, False).unchecked  # the judge never answered: no verdict
    not_judged = dataclasses.replace(unanswered, environment_judged=False)
    assert grade_rollout(chat, not_judged, referenced, False).method != "environment"  # no judge: its text


def test_a_reply_the_game_never_saw_has_no_reward(setting, in_process):
    """An episode cut at its token limit mid-reply: the game never answered that reply, so the episode has
    no reward (not the earlier reply's)."""
    _, episodes, _ = in_process
    index = next(i for i, e in enumerate(episodes) if len(e.turns) >= 3 and len(e.turns[2].ids) > 1)
    before = episodes[index]
    assert before.turns[0].role == "student" and before.turns[1].role == "environment"
    limit = len(before.turns[0].ids) + len(before.turns[1].ids) + 1  # one id of room for the second reply
    _, cut, _ = _episodes(setting, GUESS, [0, 1], limits=EpisodeLimits(max_turns=3, max_episode_tokens=limit))
    episode = cut[index]
    assert episode.turns[:2] == before.turns[:2] and len(episode.turns[2].ids) == 1
    assert episode.ending == "max_episode_tokens" and episode.reward is None
    assert episode.rollout().environment_reward is None


def test_an_eval_runs_the_game_and_grades_by_its_reward(setting, smollm2_tokenizer):
    """The eval of a run on `env:` data plays each held-out seed as an episode (not one answer graded against
    an empty reference), greedy, and counts a win as correct; the record is the last reply."""
    engine, _ = setting
    examples = load_examples(f"env:{GUESS}?size=3&seed=20")
    rollout = RolloutConfig(environment=GUESS, max_turns=3, max_episode_tokens=200)
    _, records = evaluate(engine, smollm2_tokenizer, examples, load_template("student/plain"), max_new_tokens=12,
                          progress=False, rollout=rollout)
    assert len(records) == 3
    for example, record in zip(examples, records):
        reward = expected_reward(example.meta["env_seed"], record.completion)
        assert record.correct == (reward == 1.0) and record.extracted is not None
    _, single = evaluate(engine, smollm2_tokenizer, examples, load_template("student/plain"), max_new_tokens=12,
                         progress=False)
    assert all(not r.correct and r.extracted is None for r in single)  # one answer each, never seen by the game


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """OpenEnv's own server (create_app, uvicorn) of the same game, in a process of its own."""
    process, url = _serve(tmp_path_factory.mktemp("openenv"))
    yield url
    process.kill()
    process.wait(timeout=30)


def _serve(folder: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    log = (folder / f"server-{port}.log").open("w")
    process = subprocess.Popen([sys.executable, "-m", "tests.episodes.openenv_envs", str(port)], cwd=ROOT,
                               stdout=log, stderr=subprocess.STDOUT)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert process.poll() is None, (folder / f"server-{port}.log").read_text()
        try:
            with opener.open(f"http://127.0.0.1:{port}/health", timeout=1):
                return process, f"ws://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.2)
    process.kill()
    raise AssertionError("the OpenEnv server did not start within 60 s")


@pytest.mark.slow
def test_the_same_game_on_openenv_s_server_gives_the_same_episodes(setting, in_process, server):
    local_examples, local, _ = in_process
    examples, remote, made = _episodes(setting, f"openenv:{server}", [0, 1])
    assert [e.prompt for e in examples] == [e.prompt for e in local_examples]
    for mine, theirs in zip(remote, local):
        assert mine.ids == theirs.ids
        assert [(t.role, t.ids, t.logprobs) for t in mine.turns] == [(t.role, t.ids, t.logprobs) for t in theirs.turns]
        assert (mine.reward, mine.ending, mine.finish_reason) == (theirs.reward, theirs.ending, theirs.finish_reason)
        assert mine.info == {}  # OpenEnv's server never sends an observation's metadata
    assert all(m.session is None for m in made)


def _one_line_each(episodes, says: dict[int, str], examples) -> None:
    """Episode i's error says says[i] on one line, after the student's first reply; the others have none."""
    for index, (example, episode) in enumerate(zip(examples, episodes)):
        assert episode.turns[0].role == "student" and episode.turns[0].ids  # the reply is kept
        if index in says:
            line = episode.info.get("error", "")
            assert says[index] in line and f"episode {index} ({example.id})" in line, (index, line)
            assert "\n" not in line and len(episode.turns) == 1
        else:
            assert "error" not in episode.info, episode.info


def test_an_in_process_game_that_misbehaves_ends_that_episode_in_one_line(setting):
    seeds = [0, envs.RAISES, envs.UNDECODABLE, envs.NAN_REWARD, envs.WANDERS]
    examples = [e for s in seeds for e in load_examples(f"env:{GUESS}?size=1&seed={s}")]
    examples.append(dataclasses.replace(examples[0], id="no-seed", meta={}))  # not built from the environment
    examples, episodes, made = _episodes(setting, GUESS, seeds, examples=examples, limits=SHORT)
    _one_line_each(episodes, {1: "step raised RuntimeError: the game board caught fire",
                              3: "reward nan is not a finite number", 4: "not deterministic: reset with seed 906",
                              5: "the example has no environment seed"}, examples)
    assert "user\nbad ? bytes ? here<|im_end|>" in episodes[2].turns[1].text  # lone surrogates replaced
    assert all(m.session is None for m in made)


@pytest.mark.slow
def test_a_server_that_misbehaves_ends_that_episode_in_one_line(setting, server):
    seeds = [0, envs.RAISES, envs.UNDECODABLE, envs.HANGS, envs.WANDERS]
    examples, episodes, made = _episodes(setting, f"openenv:{server}", seeds, limits=SHORT)
    _one_line_each(episodes, {1: "Server error: the game board caught fire", 2: "surrogates not allowed",
                              3: f"step: no answer within {QUICK.answer_s:g} s", 4: "not deterministic: reset with seed 906"},
                   examples)
    assert all(m.session is None for m in made)


@pytest.mark.parametrize("remote", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["in_process", "server"])
def test_a_huge_observation_reaches_the_student_cut(request, remote):
    target = f"openenv:{request.getfixturevalue('server')}" if remote else GUESS
    (example,) = load_examples(f"env:{target}?size=1&seed={envs.HUGE}")
    episode = openenv_environments(target, QUICK)(example)
    episode.reset(example)
    response = checked_response(episode.step("12", "stop"), "here")
    (message,) = response.messages
    assert message["content"].startswith("x" * MAX_MESSAGE_CHARS) and len(message["content"]) < MAX_MESSAGE_CHARS + 100
    assert message["content"].endswith("more characters cut]") and episode.session is not None
    episode.close()


class KillsTheServer:
    """The engine, killing the server once every episode has reset: mid-episode for all of them."""

    def __init__(self, engine, process) -> None:
        self.engine, self.process = engine, process

    def sample(self, prompts, params):
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)
        return self.engine.sample(prompts, params)


@pytest.mark.slow
def test_a_server_killed_mid_episode_ends_its_episodes_in_one_line(setting, tmp_path):
    process, url = _serve(tmp_path)
    try:
        examples, episodes, made = _episodes(setting, f"openenv:{url}", [0, 1], limits=SHORT,
                                             engine=KillsTheServer(setting[0], process))
    finally:
        process.kill()
    _one_line_each(episodes, {0: f"openenv:{url}: step:", 1: f"openenv:{url}: step:"}, examples)
    assert all(m.session is None for m in made)


class Silent(BaseHTTPRequestHandler):
    """A server that accepts connections and never answers (its schema, when `schema` is set, it does)."""

    schema: bool = False
    release = threading.Event()

    def do_GET(self) -> None:
        if self.schema and self.path == "/schema":
            body = json.dumps({"action": GuessAction.model_json_schema()}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        self.release.wait(30)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture()
def silent():
    servers = []

    def start(schema: bool) -> str:
        handler = type("Handler", (Silent,), {"schema": schema})
        servers.append(ThreadingHTTPServer(("127.0.0.1", 0), handler))
        threading.Thread(target=servers[-1].serve_forever, daemon=True).start()
        return f"ws://127.0.0.1:{servers[-1].server_address[1]}"

    yield start
    Silent.release.set()
    for one in servers:
        one.shutdown()
        one.server_close()
    Silent.release.clear()


def test_a_server_that_never_answers_is_waited_for_a_bounded_time(setting, silent):
    started = time.monotonic()
    with pytest.raises(ConfigError, match=r"^rollout\.environment: openenv:ws://127\.0\.0\.1:\d+: cannot read the "
                                          r"server's schema at http://127\.0\.0\.1:\d+/schema: .*timed out"):
        openenv_environments(f"openenv:{silent(False)}", QUICK)
    assert time.monotonic() - started < QUICK.connect_s + 5
    url = silent(True)  # its schema read, its WebSocket never opened
    examples = load_examples(f"env:{GUESS}?size=1&seed=0")
    _, episodes, _ = _episodes(setting, f"openenv:{url}", [0], examples=examples, limits=SHORT)
    _one_line_each(episodes, {0: f"openenv:{url}: reset: ConnectionError: Failed to connect"}, examples)
    assert "timed out during opening handshake" in episodes[0].info["error"]


@pytest.mark.parametrize("name, says", [
    ("TrlGuess", "is a TRL environment_factory class (reset(**row), its public methods tools, no step)"),
    ("TwoTexts", "its action model has 2 string fields (guess, note"),
    ("Missing", "tests.episodes.openenv_envs has no class or function Missing"),
])
def test_an_environment_that_cannot_take_replies_is_refused_in_one_line_before_sampling(smollm2_tokenizer, name, says):
    target = f"python:tests.episodes.openenv_envs:{name}"
    with pytest.raises(ConfigError) as refused:
        episode_sampler(RolloutConfig(environment=target), ChatFormat(smollm2_tokenizer))
    assert str(refused.value).startswith(f"rollout.environment: {target}") and says in str(refused.value)
    with pytest.raises(DataError, match=f"^env:{target}: {target}"):
        load_examples(f"env:{target}?size=2")


def test_the_config_names_an_environment_and_its_data_together(smollm2_tokenizer):
    chat = ChatFormat(smollm2_tokenizer)
    factory = "python:tests.episodes.openenv_envs:make_guess"
    config = load_config(None, [f"rollout.environment={factory}", f"data.spec=env:{factory}?size=4&seed=3"])
    assert isinstance(episode_sampler(config.rollout, chat), EpisodeSampler)
    with pytest.raises(ConfigError, match=r"data\.spec: 'rg:chain_sum\?size=4' with rollout\.environment = "):
        load_config(None, [f"rollout.environment={GUESS}", "data.spec=rg:chain_sum?size=4"])
    with pytest.raises(ConfigError, match=r"rollout\.environment: 'none', and data\.spec names an environment"):
        load_config(None, [f"data.spec=env:{GUESS}?size=4"])
    game = [f"rollout.environment={GUESS}", f"data.spec=env:{GUESS}?size=4"]
    with pytest.raises(ConfigError, match=r"eval\.data: 'rg:chain_sum\?size=4' with rollout\.environment = .* use eval\.data = "):
        load_config(None, [*game, "eval.data=rg:chain_sum?size=4"])  # the in-run eval's episodes need the game's data
    assert load_config(None, [*game, f"eval.data=env:{GUESS}?size=4&seed=100"]).eval.data
    for bad, says in [("python:tests.episodes", "expected python:MODULE:NAME"), ("openenv:ftp://h:1", "expected openenv:ws"),
                      ("openenv:ws://me:secret@h:1", "holds credentials"), ("guess", "is not an environment")]:
        with pytest.raises(ConfigError, match=f"^rollout.environment: .*{re.escape(says)}") as refused:
            RolloutConfig(environment=bad)
        assert "secret" not in str(refused.value)  # a URL's credentials are not repeated


def test_make_setup_installs_the_openenv_the_envs_extra_names():
    """The CI install (`make setup`) takes openenv-core without gradio; `selfopd[envs]` names the same release."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    makefile = (ROOT / "Makefile").read_text()
    (pinned,) = [r for r in extras["envs"] if r.startswith("openenv-core")]
    assert f"OPENENV := {pinned}" in makefile and "--no-deps $(OPENENV)" in makefile


def test_an_env_data_spec_reads_and_round_trips():
    from selfopd.data import parse_data_spec

    spec = parse_data_spec("env:openenv:ws://127.0.0.1:8000?size=3&seed=2")
    assert (spec.source, spec.name, spec.size, spec.seed) == ("env", "openenv:ws://127.0.0.1:8000", 3, 2)
    assert parse_data_spec(str(spec)) == spec
    with pytest.raises(DataError, match=r"^env:openenv:ftp://x: 'openenv:ftp://x': expected openenv:ws://HOST:PORT"):
        parse_data_spec("env:openenv:ftp://x?size=2")
    with pytest.raises(DataError, match=r"unknown option 'limit' for source 'env'; allowed: distinct, seed, size"):
        parse_data_spec(f"env:{GUESS}?limit=2")
    examples = load_examples(f"env:{GUESS}?size=3&seed=7")
    assert [(e.id, e.answer, e.meta["env_seed"]) for e in examples] == [(f"env:{GUESS}/{s}", "", s) for s in (7, 8, 9)]
