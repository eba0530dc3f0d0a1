"""RolloutPool: retry accounting, start-up errors, cwd, backends agree, streaming, concurrency.

The worker modules are tests/rollout/fake_workers.py (behaviour per task
"mode") and broken_worker.py (fails to import). Timeouts are short (1 s +
1 s grace) so the failure paths run in seconds.
"""
import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from aflow_rl.config import RolloutConfig
from aflow_rl.rollout.pool import RolloutPool, make_episodes, whole_groups
from aflow_rl.rollout.runner import WorkerStartError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ASYNC = "tests.rollout.fake_workers"        # worker modules, named as env.name names them
SYNC = "tests.rollout.fake_workers_sync"


def new_pool(env: str = ASYNC, **kw) -> RolloutPool:
    base = dict(backend="loky", workers=2, concurrency_per_worker=4,
                episode_timeout_s=1.0, timeout_grace_s=1.0, max_attempts=2, start_timeout_s=60.0)
    base.update(kw)
    return RolloutPool(RolloutConfig(**base), env=env)


def run_all(tasks, env: str = ASYNC, **kw):
    with new_pool(env, **kw) as pool:
        out = list(pool.run(tasks))
        return out, dict(pool.stats)


def by_id(trajs):
    trajs = list(trajs)
    ids = [t.episode_id for t in trajs]
    assert len(ids) == len(set(ids)), f"duplicated: {ids}"
    return {t.episode_id: t for t in trajs}


def tasks_of(*modes, **extra):
    return [{"episode_id": f"{m}-{i}", "mode": m, "seed": i, **extra} for i, m in enumerate(modes)]


# -- retry accounting --------------------------------------------------------------------------


def test_raise_timeout_and_bad_return_are_retried_then_failed():
    tasks = tasks_of("ok", "ok", "raise_first", "raise_first", "raise_always", "hang", "bad_return", "ok")
    out, stats = run_all(tasks)
    got = by_id(out)
    assert set(got) == {t["episode_id"] for t in tasks}
    for eid, t in got.items():
        mode = eid.rsplit("-", 1)[0]
        expect = {"ok": ("ok", 1), "raise_first": ("ok", 2), "raise_always": ("failed", 2),
                  "hang": ("timeout", 2), "bad_return": ("failed", 2)}[mode]
        assert (t.status, t.attempt) == expect, (eid, t.status, t.attempt, t.error)
    assert "boom on attempt 2" in got["raise_always-4"].error
    assert "RuntimeError" in got["raise_always-4"].error
    assert len(got["raise_always-4"].info["errors"]) == 2
    assert "episode_timeout_s=1" in got["hang-5"].error
    assert "returned builtins.dict, expected aflow_rl.rollout.types.Trajectory" in got["bad_return-6"].error
    assert "boom on attempt 1" in got["raise_first-2"].info["retry_errors"][0]
    # retries: 2 raise_first + raise_always + hang + bad_return; failed: the last three
    assert stats["pool/retries"] == 5 and stats["pool/failed"] == 3


def test_sigkill_charges_the_culprit_not_its_neighbours():
    # One process, four episodes on it: the crash cannot be pinned on one, so each re-runs alone.
    tasks = tasks_of("sleep", "sleep", "kill_first", "sleep", sleep=0.5)
    out, stats = run_all(tasks, workers=1)
    got = by_id(out)
    assert set(got) == {t["episode_id"] for t in tasks}
    assert all(t.ok for t in out), [(t.episode_id, t.error) for t in out]
    assert got["kill_first-2"].attempt == 2
    assert "SIGKILL" in got["kill_first-2"].info["retry_errors"][-1]
    assert [got[f"sleep-{i}"].attempt for i in (0, 1, 3)] == [1, 1, 1]  # collateral: not charged
    assert "not counted" in got["sleep-0"].info["retry_errors"][0]
    assert stats["pool/retries"] == 1 and stats["pool/failed"] == 0
    assert stats["pool/worker_deaths"] == 2  # once among neighbours, once alone


def test_sigkill_on_last_attempt_returns_failed_and_pool_carries_on():
    tasks = tasks_of("kill_first", "ok", "ok")
    with new_pool(workers=1, concurrency_per_worker=1, max_attempts=1) as pool:
        got = by_id(pool.run(tasks))
        assert got["kill_first-0"].status == "failed" and got["kill_first-0"].attempt == 1
        assert "died" in got["kill_first-0"].error and "SIGKILL" in got["kill_first-0"].error
        assert got["ok-1"].ok and got["ok-2"].ok
        again = by_id(pool.run(tasks_of("ok", "ok")))  # the replaced worker keeps serving
        assert all(t.ok for t in again.values())
        assert pool.stats["pool/worker_deaths"] == 0  # stats are per run


def test_sync_episode_that_hangs_times_out_and_its_process_is_replaced():
    tasks = tasks_of("hang", "raise_first", "ok", "sleep", sleep=0.2)
    out, stats = run_all(tasks, env=SYNC, workers=1)
    got = by_id(out)
    assert (got["hang-0"].status, got["hang-0"].attempt) == ("timeout", 2)
    assert (got["raise_first-1"].status, got["raise_first-1"].attempt) == ("ok", 2)
    assert got["ok-2"].ok and got["sleep-3"].ok and got["ok-2"].attempt == 1
    assert stats["pool/worker_recycles"] == 2  # once per stuck attempt, after the others finished
    assert stats["pool/retries"] == 2 and stats["pool/failed"] == 1


def test_blocked_event_loop_is_killed_at_the_hard_deadline():
    # time.sleep inside an async episode: the worker cannot even report its timeout.
    tasks = tasks_of("block", "ok", "ok", "ok")
    t0 = time.monotonic()
    out, stats = run_all(tasks, workers=2, concurrency_per_worker=1)
    got = by_id(out)
    assert (got["block-0"].status, got["block-0"].attempt) == ("timeout", 2)
    assert "blocked event loop" in got["block-0"].error
    assert all(got[f"ok-{i}"].ok and got[f"ok-{i}"].attempt == 1 for i in (1, 2, 3))
    assert stats["pool/worker_kills"] == 2
    assert time.monotonic() - t0 < 40


# -- start-up -----------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["threading", "loky"])
def test_import_error_stops_the_pool_at_start_naming_the_module(backend):
    t0 = time.monotonic()
    with pytest.raises(WorkerStartError) as err:
        new_pool(env="tests.rollout.broken_worker", backend=backend).start()
    msg = str(err.value)
    assert "tests.rollout.broken_worker" in msg and "aflow_rl_no_such_dependency" in msg
    assert "sys.path" in msg
    assert time.monotonic() - t0 < 30  # at once, not after start_timeout_s


def test_missing_function_is_a_start_error():
    # tests.rollout (the package) imports fine but defines no episode function.
    with pytest.raises(WorkerStartError, match=r"has no run_episode\(task, ctx\)"):
        new_pool(env="tests.rollout", backend="threading").start()


def test_pool_runs_from_root_directory():
    # The repository is put on sys.path by hand (not PYTHONPATH): spawned workers must inherit it.
    script = textwrap.dedent(f"""
        import json, sys
        from aflow_rl.config import RolloutConfig
        from aflow_rl.rollout.pool import RolloutPool
        from aflow_rl.rollout.runner import WorkerStartError
        cfg = RolloutConfig(workers=2, start_timeout_s=60.0)
        try:
            RolloutPool(cfg, env={ASYNC!r}).start()
            before = "started"
        except WorkerStartError as exc:
            before = str(exc)
        sys.path.insert(0, {ROOT!r})
        with RolloutPool(cfg, env={ASYNC!r}) as pool:
            out = [(t.episode_id, t.status) for t in pool.run([{{"seed": i}} for i in range(4)])]
        print(json.dumps({{"before": before, "out": sorted(out)}}))
    """)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", script], cwd="/", env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "cannot import worker module 'tests.rollout.fake_workers'" in result["before"]
    assert result["out"] == [[f"e{i}", "ok"] for i in range(4)]


def test_pool_runs_from_a_script_without_a_main_guard(tmp_path):
    # Workers are fresh interpreters, not multiprocessing spawn children, which would re-run this
    # script (and make a pool inside each worker) before serving.
    script = tmp_path / "unguarded.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {ROOT!r})
        from aflow_rl.config import RolloutConfig
        from aflow_rl.rollout.pool import RolloutPool
        with RolloutPool(RolloutConfig(workers=2, start_timeout_s=60.0), env={ASYNC!r}) as pool:
            print(sorted(t.status for t in pool.run([{{"seed": i}} for i in range(4)])))
    """))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines() == ["['ok', 'ok', 'ok', 'ok']"]


# -- backends agree -------------------------------------------------------------------------------


def _signature(trajs):
    return sorted((t.episode_id, t.group_id, t.attempt, t.status, t.final_reward, t.metrics["inits"],
                   t.turns[0].response_ids.tolist(), round(float(t.turns[0].step_reward), 9)) for t in trajs)


@pytest.fixture(scope="module")
def reference_tasks():
    tasks = make_episodes([{"seed": s} for s in range(5)], group_size=2)
    for i, task in enumerate(tasks):
        task["seed"] = 100 * task["seed"] + task["sample"]
        if i == 3:
            task["mode"] = "raise_first"
    return tasks


@pytest.mark.parametrize("backend", ["sequential", "threading", "loky"])
def test_backends_give_the_same_results(backend, reference_tasks):
    out, _ = run_all(reference_tasks, backend=backend)
    ref, _ = run_all(reference_tasks, backend="sequential")
    assert _signature(out) == _signature(ref)
    assert len(out) == 10 and sum(t.attempt == 2 for t in out) == 1
    assert all(t.info["pid"] == t.info["init_pid"] for t in out)  # init_worker ran in that process


@pytest.mark.parametrize("processes", [False, True])
def test_dask_backend_gives_the_same_results(processes, reference_tasks):
    distributed = pytest.importorskip("distributed")
    ref, _ = run_all(reference_tasks, backend="sequential")
    with distributed.LocalCluster(processes=processes, n_workers=1, threads_per_worker=2,
                                  dashboard_address=":0") as cluster:
        out, _ = run_all(reference_tasks, backend="dask", dask_address=cluster.scheduler_address)
    assert _signature(out) == _signature(ref)


# -- streaming and concurrency ------------------------------------------------------------------------


def test_results_stream_as_they_complete():
    tasks = [{"mode": "sleep", "sleep": s, "episode_id": f"s{i}"} for i, s in enumerate((2.0, 0.1, 0.1))]
    with new_pool(workers=1, episode_timeout_s=10.0) as pool:
        t0 = time.monotonic()
        arrivals = [(t.episode_id, time.monotonic() - t0) for t in pool.run(tasks)]
    assert arrivals[-1][0] == "s0"
    assert arrivals[0][1] < 1.0 < 2.0 <= arrivals[-1][1]


def test_one_worker_runs_its_episodes_concurrently():
    n = 8
    tasks = [{"mode": "sleep", "sleep": 0.5} for _ in range(n)]
    with new_pool(workers=1, concurrency_per_worker=n, episode_timeout_s=10.0) as pool:
        t0 = time.monotonic()
        out = list(pool.run(tasks))
        elapsed = time.monotonic() - t0
    assert all(t.ok for t in out) and len({t.info["pid"] for t in out}) == 1
    assert elapsed < 0.5 * n / 2, f"{n} episodes of 0.5 s took {elapsed:.2f} s in one worker"


def test_a_small_batch_is_spread_over_all_workers():
    tasks = [{"mode": "sleep", "sleep": 0.2} for _ in range(8)]
    out, _ = run_all(tasks, workers=2, concurrency_per_worker=8, episode_timeout_s=10.0)
    pids = [t.info["pid"] for t in out]
    assert sorted(pids.count(p) for p in set(pids)) == [4, 4]


def test_idle_worker_takes_back_an_episode_queued_behind_a_slow_one():
    # One place per worker plus one waiting: e2 waits behind the slow e0 until worker 1 asks for it.
    tasks = [{"mode": "sleep", "sleep": s, "episode_id": f"e{i}"} for i, s in enumerate((2.5, 0.1, 0.1, 0.1))]
    with new_pool(workers=2, concurrency_per_worker=1, episode_timeout_s=10.0) as pool:
        t0 = time.monotonic()
        arrivals = {t.episode_id: (time.monotonic() - t0, t.info["pid"]) for t in pool.run(tasks)}
    assert arrivals["e2"][0] < 1.5 < arrivals["e0"][0], arrivals
    assert arrivals["e2"][1] != arrivals["e0"][1]


def test_stopping_a_run_early_leaves_the_pool_clean():
    with new_pool(backend="threading", workers=1, episode_timeout_s=10.0) as pool:
        first = pool.run([{"mode": "sleep", "sleep": s, "episode_id": f"a{i}"}
                          for i, s in enumerate((0.05, 0.5, 0.5, 0.5))])
        assert next(first).episode_id == "a0"
        first.close()  # the caller stops early; the rest is cancelled
        out = list(pool.run([{"episode_id": f"b{i}", "seed": i} for i in range(6)]))
    assert sorted(t.episode_id for t in out) == [f"b{i}" for i in range(6)]


def test_make_episodes_and_whole_groups():
    eps = make_episodes([{"task_id": "t1"}, {"x": 1}], group_size=3, prefix="s0-")
    assert [e["episode_id"] for e in eps] == ["t1/0", "t1/1", "t1/2", "s0-g1/0", "s0-g1/1", "s0-g1/2"]
    with new_pool(backend="threading") as pool:
        groups = list(whole_groups(pool.run([dict(e, seed=i) for i, e in enumerate(eps)]), 3))
    assert sorted(sorted(t.episode_id for t in g) for g in groups) == [
        ["s0-g1/0", "s0-g1/1", "s0-g1/2"], ["t1/0", "t1/1", "t1/2"]]
    assert all(len({t.group_id for t in g}) == 1 for g in groups)


def test_duplicate_episode_ids_are_refused():
    with new_pool(backend="sequential") as pool:
        with pytest.raises(ValueError, match="duplicate episode_id"):
            list(pool.run([{"episode_id": "x"}, {"episode_id": "x"}]))


# -- process lifetime -----------------------------------------------------------------------------


@pytest.mark.parametrize("starter", ["main", "helper"])
def test_workers_die_with_a_killed_pool_owner(starter):
    """kill -9 of the process that owns the pool, while its workers' event loops are blocked in an
    episode: the workers go too. Started from the main thread, the kernel's
    parent-death signal does it; from a helper thread (which has ended by then: the signal would have
    fired when it did, so it is not used) the workers' watchdog does."""
    import signal

    import psutil

    script = textwrap.dedent(f"""
        import json, sys, threading, time
        sys.path.insert(0, {ROOT!r})
        import psutil
        from aflow_rl.config import RolloutConfig
        from aflow_rl.rollout.pool import RolloutPool
        cfg = RolloutConfig(backend="loky", workers=2, concurrency_per_worker=1,
                            episode_timeout_s=600.0, start_timeout_s=60.0)
        pool = RolloutPool(cfg, env={ASYNC!r})
        if {starter!r} == "main":
            pool.start()
        else:
            t = threading.Thread(target=pool.start)
            t.start()
            t.join()
        first = [s.pid for s in pool.slots]
        time.sleep(1.0)
        ok = [t.status for t in pool.run([{{"seed": 0}}, {{"seed": 1}}])]
        ok += ["same workers" if [s.pid for s in pool.slots] == first else "workers were replaced"]
        blocked = pool.run([{{"mode": "block", "seed": i}} for i in range(2)])
        threading.Thread(target=lambda: list(blocked), daemon=True).start()
        time.sleep(1.0)
        print(json.dumps({{"ok": ok, "pids": [p.pid for p in psutil.Process().children(recursive=True)]}}),
              flush=True)
        time.sleep(600)
    """)
    owner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    line = owner.stdout.readline()
    assert line, "the pool owner printed nothing"
    report = json.loads(line)
    procs = [psutil.Process(pid) for pid in report["pids"]]
    try:
        assert report["ok"] == ["ok", "ok", "same workers"]  # they outlived the thread that started them
        assert len(procs) == 2  # the two workers (they start no resource tracker)
        owner.send_signal(signal.SIGKILL)
        owner.wait()
        deadline = time.monotonic() + 5.0
        alive = procs
        while alive and time.monotonic() < deadline:
            time.sleep(0.05)
            alive = [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert not alive, f"alive 5 s after the pool's owner was killed: {[p.cmdline() for p in alive]}"
    finally:
        if owner.poll() is None:
            owner.kill()
        for p in procs:
            try:
                p.kill()
            except psutil.Error:
                pass
