"""kill -9 of train.py mid-run leaves no process of the run alive: its embedded server, its pool
worker and any resource tracker all end with it (aflow_rl.procs)."""
from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import time

import psutil

from aflow_rl.trainer.learner import clean_dist_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = clean_dist_env()  # train.py must start its own process group, not join this interpreter's
ALL_GONE_WITHIN_S = 10.0
POOL_WORKER = "aflow_rl.rollout.runner"  # in a pool worker's command line (rollout/slots.py: _BOOT)


def alive(p: psutil.Process) -> bool:
    """Running and not a zombie (an orphan's reaper, PID 1 here, may never collect it); is_running
    compares the start time too, so a recycled pid does not count."""
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def mentions(run_dir: str) -> list[psutil.Process]:
    """Every process whose command line names the run directory."""
    out = []
    for p in psutil.process_iter(["cmdline"]):
        if p.pid != os.getpid() and any(run_dir in arg for arg in p.info["cmdline"] or ()):
            out.append(p)
    return out


def cmdline(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.Error:
        return "?"


def describe(procs: list[psutil.Process]) -> str:
    return "; ".join(f"{p.pid}: {cmdline(p)[:150]}" for p in procs)


def test_sigkill_of_train_py_leaves_no_process(tmp_path, tiny_model_dir):
    run_dir = str(tmp_path / "run")
    log = open(tmp_path / "train.log", "w")
    train = subprocess.Popen([sys.executable, "train.py", "configs/test.yaml", f"run.dir={run_dir}",
                              f"serving.policy.model_path={tiny_model_dir}", "trainer.max_steps=50"],
                             cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=ENV)
    seen: dict[int, psutil.Process] = {}  # every process of the run's tree, captured while it runs
    cmds: dict[int, str] = {}
    try:
        # Mid-run: the server is up, the pool worker is up, and episodes are running against the server
        # (a worker's trace file has lines).
        deadline = time.monotonic() + 400
        while True:
            assert train.poll() is None, f"train.py exited early: {open(tmp_path / 'train.log').read()[-3000:]}"
            assert time.monotonic() < deadline, "no episode ran within 400 s"
            for p in psutil.Process(train.pid).children(recursive=True):
                seen.setdefault(p.pid, p)
            for pid, p in seen.items():
                if alive(p):  # read again: a child caught between fork and exec shows train.py's
                    cmds[pid] = cmdline(p)
            running = [cmds[pid] for pid, p in seen.items() if alive(p)]
            traced = any(os.path.getsize(f) for f in glob.glob(os.path.join(run_dir, "traces", "*.jsonl")))
            if traced and any("aflow_rl.serving.embedded" in c for c in running) and any(POOL_WORKER in c for c in running):
                break
            time.sleep(0.2)
        server = next(c.split() for c in cmds.values() if "aflow_rl.serving.embedded" in c)
        port = int(server[server.index("--port") + 1])
        # The server and the pool worker (and any resource tracker, which lives on as long as any
        # process holding its pipe does: all of them are in `seen` and must end).
        for what in ("aflow_rl.serving.embedded", POOL_WORKER):
            assert any(what in c for c in cmds.values()), f"no {what} in the run's tree: {list(cmds.values())}"

        os.kill(train.pid, signal.SIGKILL)  # train.py only: its children must notice on their own
        train.wait()
        t_kill = time.monotonic()
        run = list(seen.values()) + mentions(run_dir)
        while any(alive(p) for p in run) and time.monotonic() - t_kill < ALL_GONE_WITHIN_S:
            time.sleep(0.1)
        survivors = [p for p in run + mentions(run_dir) if alive(p)]
        gone_s = time.monotonic() - t_kill
        assert not survivors, f"alive {ALL_GONE_WITHIN_S:g} s after kill -9 of train.py: {describe(survivors)}"
        print(f"{len(seen)} processes of the run gone {gone_s:.1f} s after kill -9: "
              + "; ".join(f"{pid}: {c[:100]}" for pid, c in cmds.items()))
        # A killed multi-threaded server shows as a zombie as soon as its main thread exits, while its
        # other threads may still be releasing the shared file table: the port is closed a moment later.
        def listening() -> bool:
            return any(c.laddr.port == port and c.status == psutil.CONN_LISTEN
                       for c in psutil.net_connections(kind="tcp"))
        while listening() and time.monotonic() - t_kill < ALL_GONE_WITHIN_S:
            time.sleep(0.1)
        assert not listening(), f"port {port} still listening {ALL_GONE_WITHIN_S:g} s after kill -9 of train.py"
    finally:
        log.close()
        if train.poll() is None:
            train.kill()
            train.wait()
        for p in list(seen.values()) + mentions(run_dir):
            if alive(p):
                p.kill()
