"""Transport behaviour: retries, deadlines, concurrency caps, load balancing."""
from __future__ import annotations

import asyncio
import itertools
import random
import time

import pytest

from aflow_rl.llm.base import LLMError
from aflow_rl.llm.http import HTTPTransport, backoff_delay, is_local_url, normalize_url


def scripted(statuses):
    """A reply function answering with the given statuses in turn, then 200 forever."""
    queue = list(statuses)

    def reply(method, path, body, headers):
        status = queue.pop(0) if queue else 200
        return status, {"status": status}
    return reply


def post(transport: HTTPTransport, path: str = "/x", payload=None):
    return asyncio.run(transport.post_json(path, payload or {}))


def test_503_twice_then_ok_takes_three_calls(fake_server):
    srv = fake_server(scripted([503, 503]))
    t = HTTPTransport([srv.url], max_retries=3, backoff_s=0.01)
    assert post(t) == {"status": 200}
    assert len(srv.calls) == 3


def test_429_is_retried_and_retry_after_is_honoured(fake_server):
    calls = itertools.count(1)

    def reply(method, path, body, headers):
        return (429, {"error": "slow down"}, {"retry-after": "0.3"}) if next(calls) == 1 else (200, {"ok": True})
    srv = fake_server(reply)
    t = HTTPTransport([srv.url], max_retries=2, backoff_s=0.001)
    start = time.monotonic()
    assert post(t) == {"ok": True}
    assert len(srv.calls) == 2
    assert time.monotonic() - start >= 0.3


@pytest.mark.parametrize("status", [400, 404, 422])
def test_other_4xx_fail_after_exactly_one_call(fake_server, status):
    srv = fake_server(lambda *a: (status, {"error": f"bad thing {status}"}))
    t = HTTPTransport([srv.url], max_retries=5, backoff_s=0.01)
    with pytest.raises(LLMError) as err:
        post(t, "/generate")
    assert len(srv.calls) == 1
    assert err.value.status == status and err.value.url == srv.url
    assert f"{srv.url}/generate" in str(err.value) and f"bad thing {status}" in str(err.value)


def test_5xx_retries_are_bounded(fake_server):
    srv = fake_server(lambda *a: (500, {"error": "boom"}))
    t = HTTPTransport([srv.url], max_retries=2, backoff_s=0.01)
    with pytest.raises(LLMError) as err:
        post(t)
    assert len(srv.calls) == 3
    assert err.value.status == 500 and "3 attempts" in str(err.value)


def test_dead_port_fails_within_timeout_naming_the_url(dead_url):
    t = HTTPTransport([dead_url], timeout_s=2.0, max_retries=10, backoff_s=0.1)
    start = time.monotonic()
    with pytest.raises(LLMError) as err:
        post(t, "/generate")
    elapsed = time.monotonic() - start
    assert elapsed < 2.0 + 0.25  # the deadline, plus event-loop start-up on a busy 2-core box
    assert "attempts" in str(err.value)  # it did retry (connection errors are retryable)
    assert dead_url in str(err.value) and err.value.url == dead_url


def test_hanging_server_times_out_at_the_deadline(fake_server):
    srv = fake_server(lambda *a: (200, {}), delay_s=3.0)
    t = HTTPTransport([srv.url], timeout_s=0.5, max_retries=3, backoff_s=0.05)
    start = time.monotonic()
    with pytest.raises(LLMError) as err:
        post(t)
    assert time.monotonic() - start < 1.5
    assert "timed out" in str(err.value) and srv.url in str(err.value)


def test_concurrency_cap_per_endpoint(fake_server):
    srv = fake_server(lambda *a: (200, {}), delay_s=0.1)
    t = HTTPTransport([srv.url], max_concurrency=3)

    async def many():
        await asyncio.gather(*(t.post_json("/x", {}) for _ in range(12)))
    asyncio.run(many())
    assert len(srv.calls) == 12
    assert srv.max_in_flight == 3


@pytest.mark.parametrize("balance", ["least_in_flight", "round_robin"])
def test_requests_spread_over_two_urls(fake_server, balance):
    a = fake_server(lambda *x: (200, {}), delay_s=0.02)
    b = fake_server(lambda *x: (200, {}), delay_s=0.02)
    t = HTTPTransport([a.url, b.url], balance=balance)

    async def sequential():
        for _ in range(10):
            await t.post_json("/x", {})

    async def concurrent():
        await asyncio.gather(*(t.post_json("/x", {}) for _ in range(20)))

    asyncio.run(sequential())
    assert (len(a.calls), len(b.calls)) == (5, 5)  # ties broken round-robin
    asyncio.run(concurrent())
    assert len(a.calls) + len(b.calls) == 30
    assert min(len(a.calls), len(b.calls)) >= 12


def test_least_in_flight_avoids_the_busy_server(fake_server):
    slow = fake_server(lambda *x: (200, {}), delay_s=0.5)
    fast = fake_server(lambda *x: (200, {}))
    t = HTTPTransport([slow.url, fast.url])

    async def run():
        first = asyncio.create_task(t.post_json("/x", {}))
        await asyncio.sleep(0.05)  # now one request is in flight somewhere
        for _ in range(6):
            await t.post_json("/x", {})
        await first
    asyncio.run(run())
    # While one server holds the long request, every short one goes to the other.
    assert {len(slow.calls), len(fast.calls)} == {1, 6}


def test_retry_moves_to_another_url(fake_server, dead_url):
    good = fake_server(lambda *x: (200, {"ok": 1}))
    t = HTTPTransport([dead_url, good.url], balance="round_robin", max_retries=1, backoff_s=0.01)
    for _ in range(4):
        assert post(t) == {"ok": 1}
    assert len(good.calls) == 4


def test_client_survives_a_new_event_loop(fake_server):
    srv = fake_server(lambda *x: (200, {"ok": 1}))
    t = HTTPTransport([srv.url])
    assert post(t) == {"ok": 1}
    assert post(t) == {"ok": 1}  # second asyncio.run: a fresh loop, fresh pool


def test_one_client_shared_by_threads_with_their_own_loops(fake_server):
    import concurrent.futures

    srv = fake_server(lambda *x: (200, {"ok": 1}), delay_s=0.05)
    t = HTTPTransport([srv.url], max_concurrency=2)

    def worker(_):
        async def burst():
            return await asyncio.gather(*(t.post_json("/x", {}) for _ in range(4)))
        return asyncio.run(burst())

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        results = list(pool.map(worker, range(3)))
    assert results == [[{"ok": 1}] * 4] * 3
    assert 2 <= srv.max_in_flight <= 6  # the cap holds per loop: 2 per thread


def test_non_json_reply_is_an_llm_error(fake_server):
    srv = fake_server(lambda *x: (200, "plain text"))
    with pytest.raises(LLMError, match="non-JSON"):
        post(HTTPTransport([srv.url]))


def test_backoff_is_exponential_and_jittered():
    rng = random.Random(0)
    delays = [backoff_delay(k, 0.5, rng) for k in range(4)]
    for k, d in enumerate(delays):
        assert 0.5 * 2 ** k * 0.5 <= d <= 0.5 * 2 ** k * 1.5
    assert len({round(backoff_delay(1, 0.5, rng), 6) for _ in range(5)}) > 1
    assert backoff_delay(30, 1.0, rng) <= 30.0


def test_url_helpers():
    assert normalize_url("127.0.0.1:8000/") == "http://127.0.0.1:8000"
    assert is_local_url("http://localhost:1") and is_local_url("10.0.0.5:30000")
    assert is_local_url("http://192.168.1.2") and is_local_url("http://127.0.0.1:5")
    assert not is_local_url("https://api.openai.com") and not is_local_url("http://8.8.8.8")


_LOOPS_SCRIPT = r'''
import asyncio, gc, sys, threading
sys.path.insert(0, sys.argv[1])
from conftest import FakeServer
from aflow_rl.llm.http import HTTPTransport

srv = FakeServer(lambda *a: (200, {"ok": 1}))
t = HTTPTransport([srv.url])
for _ in range(2):                      # asyncio.run twice: each loop's session closed at its shutdown
    assert asyncio.run(t.post_json("/x", {})) == {"ok": 1}
loop = asyncio.new_event_loop()         # a loop closed by hand (the sequential pool backend's way)
assert loop.run_until_complete(t.post_json("/x", {})) == {"ok": 1}
loop.close()

def thread():                           # a thread that ends with its hand-closed loop
    loop = asyncio.new_event_loop()
    loop.run_until_complete(t.post_json("/x", {}))
    loop.close()

th = threading.Thread(target=thread)
th.start()
th.join()
gc.collect()
print("calls", len(srv.calls))
'''


def test_sessions_close_with_their_loops_without_warnings(tmp_path):
    """No "Unclosed client session/connector" however the loops end (asyncio.run, by hand, thread exit)."""
    import os
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    script = tmp_path / "loops.py"
    script.write_text(_LOOPS_SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(here)))
    out = subprocess.run([sys.executable, "-X", "dev", str(script), here], capture_output=True, text=True,
                         timeout=60, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "calls 4" in out.stdout
    assert "Unclosed" not in out.stderr and "Exception ignored" not in out.stderr, out.stderr[-2000:]


def test_json_codec_keeps_the_json_modules_leniency(fake_server):
    from aflow_rl.llm.http import dumps, loads

    # int dict keys (logit_bias) and numpy ints encode as json.dumps would; NaN/Infinity replies decode.
    import numpy as np

    assert loads(dumps({1: -100, "ids": [np.int64(3)]})) == {"1": -100, "ids": [3]}
    assert loads(b'{"lp": -Infinity}') == {"lp": float("-inf")}
    assert dumps({"big": 2 ** 70}) == b'{"big": 1180591620717411303424}'  # past orjson's 64-bit ints
    with pytest.raises(ValueError):
        loads(b"not json")
    srv = fake_server(lambda *x: (200, {"ok": 1}))
    post(HTTPTransport([srv.url]), payload={"x": [np.int64(7)]})
    assert srv.calls[0]["body"] == {"x": [7]} and srv.calls[0]["headers"]["content-type"] == "application/json"
