"""Traces: the JSONL writer (concurrent appends, disabled mode), the pool's wiring, replay and export."""
import asyncio
import json
import os
import subprocess
import sys
import threading
import types

import numpy as np

from aflow_rl.config import RolloutConfig
from aflow_rl.rollout import replay
from aflow_rl.rollout.pool import RolloutPool
from aflow_rl.rollout.traces import TraceWriter, episode_scope
from aflow_rl.rollout.types import WorkerContext


def _lines(run_dir):
    folder = os.path.join(run_dir, "traces")
    rows = []
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name)) as fh:
            rows += [json.loads(line) for line in fh]
    return rows


def test_many_tasks_and_threads_write_whole_lines(tmp_path):
    writer = TraceWriter(str(tmp_path))
    big = "x" * 20000  # longer than any pipe/buffer unit: interleaving would show

    async def episode(i):
        episode_scope({"episode_id": f"a{i}", "group_id": "g", "attempt": 2})
        for step in range(20):
            writer.event(f"a{i}", step=step, observation=big, action={"ids": np.arange(3)}, reward=np.float32(1))
            await asyncio.sleep(0)

    async def many():
        await asyncio.gather(*(episode(i) for i in range(10)))

    threads = [threading.Thread(target=lambda i=i: [TraceWriter(str(tmp_path)).event(f"t{i}", step=s)
                                                    for s in range(50)]) for i in range(4)]
    for t in threads:
        t.start()
    asyncio.run(many())
    for t in threads:
        t.join()
    rows = _lines(str(tmp_path))
    assert len(rows) == 10 * 20 + 4 * 50
    assert os.listdir(tmp_path / "traces") == [f"worker-{os.getpid()}.jsonl"]
    a0 = [r for r in rows if r["episode_id"] == "a0"]
    assert [r["step"] for r in a0] == list(range(20))
    assert a0[0]["attempt"] == 2 and a0[0]["group_id"] == "g"  # from the episode scope
    assert a0[0]["action"] == {"ids": [0, 1, 2]} and a0[0]["reward"] == 1.0
    assert "attempt" not in [r for r in rows if r["episode_id"] == "t0"][0]  # no scope in those threads


def test_disabled_writer_writes_nothing(tmp_path):
    off = types.SimpleNamespace(rollout=RolloutConfig(trace=False))
    writer = TraceWriter.from_context(WorkerContext(config=off, run_dir=str(tmp_path)))
    writer.event("e", step=0, observation="o")
    TraceWriter("").event("e", step=0)  # no run dir: nowhere to write, so off
    assert not writer.enabled and not os.path.exists(tmp_path / "traces")


def test_pool_workers_trace_with_attempts(tmp_path):
    cfg = RolloutConfig(backend="loky", workers=2, concurrency_per_worker=2, max_attempts=2, start_timeout_s=60.0)
    ctx = WorkerContext(config=types.SimpleNamespace(rollout=cfg), run_dir=str(tmp_path))
    tasks = [{"episode_id": f"e{i}", "group_id": "g0", "mode": "trace"} for i in range(4)]
    with RolloutPool(cfg, ctx, env="tests.rollout.fake_workers") as pool:
        assert all(t.ok for t in pool.run(tasks))
        pids = {f"worker-{s.pid}.jsonl" for s in pool.slots}
    assert set(os.listdir(tmp_path / "traces")) <= pids
    rows = _lines(str(tmp_path))
    assert sorted((r["episode_id"], r["step"]) for r in rows) == [(f"e{i}", s) for i in range(4) for s in range(3)]
    assert {(r["group_id"], r["attempt"]) for r in rows} == {("g0", 1)}


def _write_trace(tmp_path):
    writer = TraceWriter(str(tmp_path))
    for attempt in (1, 2):
        episode_scope({"episode_id": "ep1", "group_id": "g", "attempt": attempt})
        for step in range(3 if attempt == 2 else 1):
            writer.event("ep1", step=step, observation=f"obs{step}", action={"spawn": step},
                         outcome=f"out{step}", reward=0.5 * step, timings={"policy_ms": 12.5})
    episode_scope({"episode_id": "ep2", "group_id": "g", "attempt": 1})
    writer.event("ep2", step=0, observation="line one\nline two", action="finish", reward=1.0, role="planner")
    with open(writer.path, "a") as fh:
        fh.write('{"episode_id": "ep3", "step": 0, "obs')  # a worker killed mid-line
    return writer.path


def test_replay_prints_an_episode_turn_by_turn(tmp_path, capsys):
    path = _write_trace(tmp_path)
    assert replay.main([path, "--episode", "ep1"]) == 0
    out, err = capsys.readouterr()
    assert "== episode ep1  attempt 1  group g  steps 1" in out
    assert "== episode ep1  attempt 2  group g  steps 3  return 1.5" in out
    assert "-- step 2  [policy_ms 12.5]" in out
    assert 'action:      {"spawn": 2}' in out and "observation: obs1" in out
    assert "ep2" not in out and "skipped 1 unreadable line" in err
    assert replay.main([str(tmp_path / "traces"), "--episode", "nope"]) == 1


def test_replay_exports_transitions(tmp_path):
    path = _write_trace(tmp_path)
    out = tmp_path / "rows.jsonl"
    proc = subprocess.run([sys.executable, "-m", "aflow_rl.rollout.replay", path, "--export", str(out)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    ep1 = [r for r in rows if r["episode_id"] == "ep1" and r["attempt"] == 2]
    assert [(r["obs"], r["action"], r["reward"], r["next_obs"], r["done"]) for r in ep1] == [
        ("obs0", {"spawn": 0}, 0.0, "obs1", False),
        ("obs1", {"spawn": 1}, 0.5, "obs2", False),
        ("obs2", {"spawn": 2}, 1.0, None, True)]
    assert len(rows) == 1 + 3 + 1


def test_replay_default_is_a_short_summary(tmp_path, capsys):
    for i in range(50):   # many episodes: the summary stays a few lines
        episode_scope({"episode_id": f"many{i:02d}", "group_id": "m", "attempt": 1})
        TraceWriter(str(tmp_path)).event(f"many{i:02d}", step=0, observation="o", action="a", reward=0.25)
    path = _write_trace(tmp_path)
    assert replay.main([os.path.dirname(path)]) == 0
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert len(lines) == 4 and err == ""
    assert lines[0] == "1 trace file(s), 55 step events, 53 episode attempts of 52 episodes (1 retries), 1 unreadable line(s)"
    assert lines[1] == "steps per attempt: mean 1.0, max 3; return: mean 0.283, min 0, max 1.5"   # 15 / 53
    assert lines[2].startswith("episodes: ep1, ep2, many00,") and lines[2].endswith("... (+44)")
    assert "--episode ID" in lines[3] and "--all" in lines[3]
    assert replay.main([path, "--list"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert len(listed) == 53 and "== episode ep1  attempt 2  group g  steps 3  return 1.5" in listed


def test_replay_missing_path_is_one_line_error(tmp_path):
    for target, message in [(tmp_path / "nope", f"error: no trace file or folder at {tmp_path / 'nope'} "
                                                "(a run writes them to run_dir/traces)"),
                            (tmp_path, f"error: no trace files (*.jsonl) in {tmp_path}")]:
        proc = subprocess.run([sys.executable, "-m", "aflow_rl.rollout.replay", str(target)],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and proc.stdout == ""
        assert proc.stderr.splitlines() == [message]
