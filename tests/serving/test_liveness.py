"""The auto request timeout's ceiling and the /health watch against a real closed port (the watch
against a real vLLM server, slow and hung: tests/serving/test_vllm_faults.py)."""

from __future__ import annotations

import asyncio
import time

import pytest

from selfopd.serving.liveness import BASE_S, HEALTH_FAILURES, request_ceiling, request_timeout, watched
from selfopd.serving.server import ServerError, free_port


def test_the_ceiling_grows_with_the_tokens_and_the_requests_sharing_the_server():
    assert request_ceiling(0, 1) == BASE_S
    assert request_ceiling(1024, 8) == BASE_S + 0.25 * 1024 * 8 > request_ceiling(1024, 1) > request_ceiling(48, 1)
    assert request_timeout(30.0, 1024, 8).read == 30.0  # a fixed timeout is as set
    auto = request_timeout(0.0, 1024, 8)
    assert auto.read == request_ceiling(1024, 8) and auto.connect == 10.0


@pytest.mark.slow  # three polls, 5 s apart
def test_a_server_that_never_answers_health_fails_the_work_naming_its_url():
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    started = time.monotonic()
    with pytest.raises(ServerError) as error:
        asyncio.run(watched(asyncio.sleep(600), [url]))
    assert time.monotonic() - started < 30
    assert str(error.value) == (f"{url}: {url}/health failed {HEALTH_FAILURES} polls in a row (ConnectError) while "
                                "requests waited on the server: it is down or hung")


def test_work_that_ends_first_returns_and_stops_the_watch():
    url = f"http://127.0.0.1:{free_port()}"
    assert asyncio.run(watched(asyncio.sleep(0.1, result="done"), [url])) == "done"


@pytest.mark.slow  # three polls, 5 s apart
def test_with_on_dead_a_dead_server_is_handed_over_once_and_the_work_goes_on():
    """What an engine with several replicas does: the dead one is dropped (`on_dead`), not the step."""
    url = f"http://127.0.0.1:{free_port()}"
    dead: list[tuple[str, str]] = []
    work = asyncio.sleep(4 * 5 + 2, result="done")  # past the third failed poll and one more
    assert asyncio.run(watched(work, [url], lambda where, reason: dead.append((where, reason)))) == "done"
    assert dead == [(url, f"{url}: {url}/health failed {HEALTH_FAILURES} polls in a row (ConnectError) while "
                          "requests waited on the server: it is down or hung")]
