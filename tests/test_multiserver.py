"""The multi-server recipe (docs/multinode.md) on one machine: two embedded servers started outside the
run, as a user starts them, and a short training whose policy client balances between them and survives
one of them going away mid-run (its requests retry on the other; the weight sync leaves it out)."""
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from aflow_rl.trainer.learner import clean_dist_env
from tests.leftovers import kill_tree

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = clean_dist_env()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.loads(resp.read())


def _requests_served(url: str) -> int:
    return int(_get(url + "/get_server_info")["internal_states"][0]["requests"])


def _start_server(model_dir: str, log_path: str) -> tuple[str, subprocess.Popen]:
    """``python -m aflow_rl.serving.embedded --model-path M --port P``, exactly the recipe's command."""
    port = _free_port()
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "aflow_rl.serving.embedded", "--model-path", model_dir,
                             "--port", str(port), "--max-batch-size", "32", "--threads", "1"],
                            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=ENV)
    return f"http://127.0.0.1:{port}", proc


def _wait_healthy(url: str, proc: subprocess.Popen, log_path: str, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"server {url} exited: {open(log_path).read()[-2000:]}"
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as resp:
                if resp.status == 200:   # SGLang's /health answers 200 with an empty body
                    return
        except OSError:
            time.sleep(0.3)
    raise AssertionError(f"server {url} not healthy within {timeout_s} s")


@pytest.mark.slow
def test_training_against_two_external_servers_survives_losing_one(tmp_path, tiny_model_dir):
    servers = [_start_server(tiny_model_dir, str(tmp_path / f"server{i}.log")) for i in range(2)]
    run = None
    try:
        for i, (url, proc) in enumerate(servers):
            _wait_healthy(url, proc, str(tmp_path / f"server{i}.log"))
        (url_a, _), (url_b, proc_b) = servers
        run_dir = str(tmp_path / "run")
        out = open(tmp_path / "train.log", "w")
        run = subprocess.Popen(
            [sys.executable, "train.py", "configs/test.yaml", f"run.dir={run_dir}",
             f"serving.policy.model_path={tiny_model_dir}", "serving.policy.backend=external",
             f"serving.policy.urls=[{url_a},{url_b}]", "trainer.max_steps=3", "trainer.save_every=1",
             "llm.policy.max_retries=4", "llm.policy.backoff_s=0.2"],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=ENV)
        marker = os.path.join(run_dir, "checkpoints", "step_1", "COMPLETE")
        deadline = time.monotonic() + 600
        while not os.path.exists(marker):
            assert run.poll() is None, f"training exited early: {open(tmp_path / 'train.log').read()[-3000:]}"
            assert time.monotonic() < deadline, "no step-1 checkpoint within 10 minutes"
            time.sleep(0.1)
        # Step 1's rollout (4 episodes of up to 4 turns) and its weight sync went through both servers.
        served = [_requests_served(url_a), _requests_served(url_b)]
        assert min(served) >= 3, f"the client did not balance over both servers: {served}"
        os.killpg(proc_b.pid, signal.SIGKILL)   # server B goes away mid-run
        proc_b.wait(timeout=10)
        assert run.wait(timeout=600) == 0, open(tmp_path / "train.log").read()[-4000:]
        log = open(tmp_path / "train.log").read()
        assert f"{url_b} is unreachable" in log   # the weight sync said so, and went on with A
        assert os.path.exists(os.path.join(run_dir, "checkpoints", "step_3", "COMPLETE"))
        episodes = [json.loads(line) for step in (1, 2)
                    for line in open(os.path.join(run_dir, "episodes", f"step_{step:06d}.jsonl"))]
        assert episodes and all(e["status"] == "ok" for e in episodes)   # after the loss: no failed episode
        assert _requests_served(url_a) > served[0]
    finally:
        if run is not None and run.poll() is None:
            kill_tree(run)
        for _, proc in servers:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
