"""Weight sync fails loudly: rejected updates, stale versions, wrong weights, hung servers."""
import asyncio
import time

import numpy as np
import pytest

from aflow_rl.llm.sglang import SGLangClient
from aflow_rl.serving.weight_sync import WeightSyncError, sync_weights
from tests.llm.conftest import FakeServer

PROBE = [5, 6, 7, 8]
GOOD_LP = [-1.0, -2.0, -3.0]


def server(update_ok=True, served_version=None, logprobs=GOOD_LP, hang_s=0.0, pause_status=200,
           continue_status=200):
    state = {"version": "default"}

    def reply(method, path, body, headers):
        if path == "/pause_generation":      # SGLang's replies
            return pause_status, {"message": "Generation paused successfully.", "status": "ok"}
        if path == "/continue_generation":
            return continue_status, {"message": "Generation continued successfully.", "status": "ok"}
        if path == "/update_weights_from_disk":
            if hang_s:
                time.sleep(hang_s)
            if not update_ok:
                return 200, {"success": False, "message": "shape mismatch in layer 0"}
            state["version"] = body.get("weight_version", state["version"])
            return 200, {"success": True, "message": "ok"}
        if path == "/generate":
            rows = [[None, PROBE[0], None]] + [[lp, t, None] for lp, t in zip(logprobs, PROBE[1:])]
            version = served_version if served_version is not None else state["version"]
            return 200, {"text": "", "output_ids": [1], "meta_info": {
                "id": "x", "finish_reason": {"type": "length"}, "prompt_tokens": 4, "completion_tokens": 1,
                "input_token_logprobs": rows, "output_token_logprobs": [[-0.1, 1, None]],
                "weight_version": version}}
        return 404, {"error": path}
    return FakeServer(reply)


def run_sync(*servers, expected=GOOD_LP, timeout_s=5.0, **kw):
    client = SGLangClient([s.url for s in servers], timeout_s=timeout_s, max_retries=0)
    try:
        return asyncio.run(sync_weights(client, "/weights/step_3", 3, probe_ids=PROBE,
                                        expected_logprobs=np.asarray(expected), tol=1e-3, timeout_s=timeout_s, **kw))
    finally:
        asyncio.run(client.aclose())


def test_good_sync_on_every_server():
    a, b = server(), server()
    try:
        out = run_sync(a, b)
        assert out["probe_mismatch"] < 1e-9
        for s in (a, b):   # every server got the update, with the version, and was probed
            assert s.paths() == ["/update_weights_from_disk", "/generate"]
            assert s.calls[0]["body"] == {"model_path": "/weights/step_3", "weight_version": "3"}
    finally:
        a.close(), b.close()


@pytest.mark.parametrize("kind,match", [
    ("rejected", "rejected.*shape mismatch"),
    ("stale", "weight_version '2'.*stale"),
    ("wrong_weights", r"disagree with the trainer's"),
])
def test_bad_sync_raises(kind, match):
    s = {"rejected": lambda: server(update_ok=False),
         "stale": lambda: server(served_version="2"),
         "wrong_weights": lambda: server(logprobs=[-1.5, -2.0, -3.0])}[kind]()
    try:
        with pytest.raises(WeightSyncError, match=match):
            run_sync(s)
    finally:
        s.close()


def test_one_bad_server_of_two_fails_the_sync():
    good, bad = server(), server(update_ok=False)
    try:
        with pytest.raises(WeightSyncError, match=bad.url.replace(".", r"\.")):
            run_sync(good, bad)
    finally:
        good.close(), bad.close()


def test_hung_update_fails_within_timeout():
    s = server(hang_s=5.0)
    try:
        t0 = time.monotonic()
        with pytest.raises(WeightSyncError):
            run_sync(s, timeout_s=0.5)
        assert time.monotonic() - t0 < 3.0
    finally:
        s.close()


# ---- in-flight flow: pause -> update -> continue, continue on every path ---------------------------------

PAUSED_FLOW = ["/pause_generation", "/update_weights_from_disk", "/continue_generation"]


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_in_flight_sync_pauses_updates_continues_then_probes(mode):
    a, b = server(), server()
    try:
        out = run_sync(a, b, inflight=True, pause_mode=mode)
        assert out["probe_mismatch"] < 1e-9
        for s in (a, b):   # the probe comes after continue: a paused server would not answer it
            assert s.paths() == PAUSED_FLOW + ["/generate"]
            assert s.calls[0]["body"] == {"mode": mode}
            assert s.calls[1]["body"] == {"model_path": "/weights/step_3", "weight_version": "3"}
    finally:
        a.close(), b.close()


def test_in_flight_sync_continues_after_a_rejected_update():
    s = server(update_ok=False)
    try:
        with pytest.raises(WeightSyncError, match="rejected.*shape mismatch"):
            run_sync(s, inflight=True)
        assert s.paths() == PAUSED_FLOW
    finally:
        s.close()


def test_in_flight_sync_continues_after_a_hung_update_within_the_timeout():
    s = server(hang_s=5.0)
    try:
        t0 = time.monotonic()
        with pytest.raises(WeightSyncError, match="did not finish within"):
            run_sync(s, timeout_s=1.0, inflight=True)
        assert time.monotonic() - t0 < 2.0     # the whole flow, continue included, within timeout_s (+ slack)
        assert s.paths() == PAUSED_FLOW
    finally:
        s.close()


def test_in_flight_sync_refused_pause_sends_no_update_and_still_continues():
    s = server(pause_status=404)
    try:
        with pytest.raises(WeightSyncError, match="pause_generation.*sync_inflight: false"):
            run_sync(s, inflight=True)
        assert s.paths() == ["/pause_generation", "/continue_generation"]
    finally:
        s.close()


def test_in_flight_sync_failed_continue_is_loud_and_names_the_first_failure():
    s = server(update_ok=False, continue_status=500)
    try:
        with pytest.raises(WeightSyncError, match="stays paused.*shape mismatch"):
            run_sync(s, inflight=True)
    finally:
        s.close()
    ok = server(continue_status=400)
    try:
        with pytest.raises(WeightSyncError, match="continue_generation failed.*stays paused"):
            run_sync(ok, inflight=True)
        assert "/generate" not in ok.paths()
    finally:
        ok.close()


def test_in_flight_sync_refuses_an_unknown_pause_mode():
    s = server()
    try:
        with pytest.raises(WeightSyncError, match="sync_pause_mode"):
            run_sync(s, inflight=True, pause_mode="abort_everything")
        assert s.paths() == []
    finally:
        s.close()


def test_in_flight_sync_skips_an_unreachable_server_as_a_plain_sync_does():
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    s.close()
    live = server()
    client = SGLangClient([live.url, dead], timeout_s=5.0, max_retries=0)
    try:
        asyncio.run(sync_weights(client, "/weights/step_3", 3, probe_ids=PROBE, expected_logprobs=np.asarray(GOOD_LP),
                                 tol=1e-3, timeout_s=5.0, inflight=True))
        assert client.urls == [live.url] and live.paths() == PAUSED_FLOW + ["/generate"]
    finally:
        asyncio.run(client.aclose())
        live.close()
