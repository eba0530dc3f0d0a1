"""train.py's pieces without a training run: the pool tags it logs, failed steps, where it starts
from, and what it prints on Ctrl-C. The pool is real (threading backend, fake episode functions)."""
import itertools
import json
import logging
import os
import subprocess
import sys
import types

import numpy as np
import pytest

import train
from aflow_rl.algos.advantages import valid_group_mask
from aflow_rl.config import RolloutConfig, load_config
from aflow_rl.rollout.pool import RolloutPool
from aflow_rl.rollout.types import Trajectory, Turn
from aflow_rl.trainer.batch import build_batch
from aflow_rl.trainer.checkpoint import list_checkpoints, manifest
from aflow_rl.trainer.console import CUDA_WARNING, interrupted_line, quiet_libraries, resume_command

FAKE = "tests.rollout.fake_workers"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEST_YAML = os.path.join(ROOT, "configs", "test.yaml")


def cfg_with(tmp_path, *overrides):
    return load_config(TEST_YAML, [f"run.dir={tmp_path / 'run'}", *overrides])


def pool_of(env=FAKE, **kw):
    base = dict(backend="threading", workers=2, concurrency_per_worker=4, episode_timeout_s=5.0,
                timeout_grace_s=1.0, max_attempts=2, start_timeout_s=30.0)
    return RolloutPool(RolloutConfig(**{**base, **kw}), env=env).start()


# ---------------------------------------------------------------------------
# Metrics: every pool/ tag is the pool's own counter
# ---------------------------------------------------------------------------


def test_pool_tags_are_the_pools_own_counters(tmp_path):
    cfg = cfg_with(tmp_path, "rollout.group_size=2")
    tasks = [{"task_id": f"t{i}", "mode": m, "seed": i}
             for i, m in enumerate(["raise_first", "ok", "raise_always", "raise_first"])]
    with pool_of() as pool:
        trajs, counters = train.rollout_with_retries(pool, tasks, cfg, 0)
        own = dict(pool.stats)
    assert counters == own                                     # one rollout: the pool's counters as they are
    keep = valid_group_mask([t.group_id for t in trajs], [t.ok and bool(t.turns) for t in trajs])
    stats = {**train._pool_tags(counters), **build_batch(trajs, 0, cfg).stats}   # as the loop logs them
    logged = {k: v for k, v in stats.items() if k.startswith("pool/") and k != "pool/skipped_episodes"}
    assert logged == {k: float(v) for k, v in own.items()}    # every counter, under its own name
    # Cross-check the counters against the episodes: the 4 raise_first and 2 raise_always episodes
    # failed their first attempt (6 retries); the raise_always pair failed again (2 failed).
    assert stats["pool/retries"] == 6 == sum(t.attempt - 1 for t in trajs)
    assert stats["pool/failed"] == 2 == sum(not t.ok for t in trajs)
    assert stats["pool/skipped_episodes"] == 2 == len(trajs) - int(np.sum(keep))


# ---------------------------------------------------------------------------
# A step in which every episode failed
# ---------------------------------------------------------------------------

_CALLS = itertools.count()


async def flaky_episode(task, ctx):
    """Fails while the shared call counter is below task["fail_calls"], then succeeds."""
    if next(_CALLS) < task["fail_calls"]:
        raise ConnectionError("policy server unreachable")
    return Trajectory(episode_id=task["episode_id"], group_id=task["group_id"],
                      turns=[Turn(prompt_ids=[1], response_ids=[2, 3], logprobs=[-0.5, -0.5])], final_reward=1.0)


run_episode = flaky_episode  # this module is the worker module (env.name) of the retry test below


def test_a_step_where_every_episode_fails_is_retried_then_stops_the_run(tmp_path):
    cfg = cfg_with(tmp_path, "rollout.group_size=2", "trainer.max_failed_step_retries=2")
    said, saved = [], []
    tasks = [{"task_id": f"t{i}", "mode": "raise_always", "seed": i} for i in range(2)]
    with pool_of() as pool:
        with pytest.raises(train.RunFailed) as err:
            train.rollout_with_retries(pool, tasks, cfg, 4, say=said.append,
                                       save=lambda trajs, again: saved.append((len(trajs), again)))
    msg = str(err.value)
    assert msg.startswith("step 5 cannot learn: every episode failed in 3 rollout(s) "
                          "(trainer.max_failed_step_retries=2); 4 of 4 episodes: RuntimeError: boom on attempt 2")
    assert "\n" not in msg
    assert said == [f"step 5: every episode failed (4 of 4 episodes: RuntimeError: boom on attempt 2); "
                    f"rollout retry {k} of 2" for k in (1, 2)]
    assert saved == [(4, False), (4, True), (4, True)]            # every rollout's episodes are kept


def test_a_step_that_recovers_on_retry_goes_on_with_summed_counters(tmp_path):
    global _CALLS
    _CALLS = itertools.count()
    cfg = cfg_with(tmp_path, "rollout.group_size=2", "trainer.max_failed_step_retries=2")
    tasks = [{"task_id": "t0", "fail_calls": 4}]   # 2 episodes x 2 attempts fail, then the retry succeeds
    with pool_of("tests.test_train_loop", workers=1, backend="sequential") as pool:
        trajs, counters = train.rollout_with_retries(pool, tasks, cfg, 0, say=lambda m: None)
    assert [t.ok for t in trajs] == [True, True]
    assert counters["pool/failed"] == 2 and counters["pool/retries"] == 2   # first rollout's, carried over


def test_failure_cause_groups_errors_that_differ_in_numbers_and_names_dead_servers(tmp_path):
    from aflow_rl.serving.manager import ServerProcess

    trajs = [Trajectory.failed(f"e{i}", "g", 2, f"Traceback ...\n  File x\nLLMError: POST http://h:1/generate "
                               f"failed after 4 attempts in {1.5 + i:.1f}s") for i in range(3)]
    trajs.append(Trajectory.failed("e9", "g", 2, "ValueError: bad"))
    assert train.failure_cause(trajs) == ("3 of 4 episodes: LLMError: POST http://h:1/generate failed after "
                                          "4 attempts in 1.5s (and 1 other error(s))")
    dead = ServerProcess(name="policy server 0", cmd=[sys.executable, "-c", "raise SystemExit(3)"],
                         url="http://127.0.0.1:9", log_path=str(tmp_path / "policy-0.log"))
    dead.start()
    dead.proc.wait(30)
    servers = types.SimpleNamespace(processes=[dead])    # what failure_cause reads of a ServerManager
    assert train.failure_cause(trajs[:1], servers).endswith(
        f"; policy server 0 (http://127.0.0.1:9) is dead (exit code 3), log {tmp_path / 'policy-0.log'}")


# ---------------------------------------------------------------------------
# Where a run starts: resumed, fresh, or past a damaged checkpoint
# ---------------------------------------------------------------------------


def _checkpoint(run_dir, step, saved_at):
    path = os.path.join(run_dir, "checkpoints", f"step_{step}")
    os.makedirs(path)
    json.dump({"step": step}, open(os.path.join(path, "trainer_state.json"), "w"))
    json.dump({"step": step, "time": saved_at, "files": manifest(path)}, open(os.path.join(path, "COMPLETE"), "w"))
    return path


def test_start_passes_over_a_damaged_checkpoint_and_rewinds_records(tmp_path, capsys):
    cfg = cfg_with(tmp_path)
    run = cfg.run_dir
    one, two = _checkpoint(run, 1, 100.0), _checkpoint(run, 2, 200.0)
    size = os.path.getsize(os.path.join(two, "trainer_state.json"))
    with open(os.path.join(two, "trainer_state.json"), "a") as fh:
        fh.write(" ")                                          # one byte more than the manifest says
    os.makedirs(os.path.join(run, "traces"))
    with open(os.path.join(run, "traces", "worker-1.jsonl"), "w") as fh:
        for ts in (50.0, 150.0, 250.0):
            fh.write(json.dumps({"ts": ts, "episode_id": "e", "step": 0}) + "\n")
    assert train._choose_start(cfg) == one
    out = capsys.readouterr().out.splitlines()
    assert out == [f"checkpoint {two} is damaged (trainer_state.json has {size + 1} bytes, the manifest says {size}); "
                   f"set aside as {two}.invalid",
                   f"resumed from step 1 at {one}; dropped the 0 TensorBoard record(s), 2 trace event(s) "
                   "and 0 episode file(s) recorded after it"]
    assert list_checkpoints(run) == [one] and os.path.isdir(two + ".invalid")


def test_start_says_fresh_and_why(tmp_path, capsys):
    cfg = cfg_with(tmp_path)
    assert train._choose_start(cfg) is None
    assert capsys.readouterr().out == f"started fresh at step 0 (no checkpoint in {cfg.run_dir})\n"
    old = _checkpoint(cfg.run_dir, 1, 100.0)
    cfg.resume = "never"
    assert train._choose_start(cfg) is None
    assert capsys.readouterr().out == (f"resume=never: set aside the earlier checkpoint {old} as {old}.superseded\n"
                                       "started fresh at step 0 (resume=never)\n")
    assert list_checkpoints(cfg.run_dir) == []         # a later resume=auto cannot pick the old run's step 1


# ---------------------------------------------------------------------------
# Ctrl-C and console noise
# ---------------------------------------------------------------------------


def test_interrupted_line_names_the_checkpoint_and_the_command(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    argv = ["configs/test.yaml", f"run.dir={tmp_path / 'run'}", "resume=never", "trainer.max_steps=20"]
    cfg = load_config(TEST_YAML, argv[1:])
    assert interrupted_line(cfg, "train.py", argv) == (
        f"interrupted before the first checkpoint of {cfg.run_dir} (trainer.save_every=1): nothing kept; "
        f"start again with: python train.py configs/test.yaml run.dir={tmp_path / 'run'} trainer.max_steps=20 "
        "resume=auto")
    _checkpoint(cfg.run_dir, 3, 1.0)
    _checkpoint(cfg.run_dir, 12, 2.0)
    line = interrupted_line(cfg, "train.py", argv)
    assert line.startswith(f"interrupted: last checkpoint {cfg.run_dir}/checkpoints/step_12 (step 12 of 20); "
                           "resume with: python train.py")
    assert resume_command("train.py", ["a.yaml", "x=a b"], "auto") == "python train.py a.yaml 'x=a b'"


def test_cuda_runtime_warning_is_dropped_on_cpu(monkeypatch):
    """torch.utils.cpp_extension warns when it finds a CUDA toolkit but no GPU (DeepSpeed's op builders
    ask it on every CPU run with a CUDA build of torch); the filter drops exactly that warning."""
    import torch.utils.cpp_extension as cpp

    monkeypatch.setenv("CUDA_HOME", "/usr/local/cuda-not-here")
    monkeypatch.setattr(cpp.torch.cuda, "is_available", lambda: False)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("torch.utils.cpp_extension")
    logger.addHandler(handler)   # logger-level filters run before any handler, this one included
    saved = list(logger.filters)
    try:
        cpp._find_cuda_home()
        assert any(str(r.msg).startswith(CUDA_WARNING) for r in records)    # the warning as users saw it
        records.clear()
        quiet_libraries(cuda_available=False)
        cpp._find_cuda_home()
        logger.warning("another warning")
        assert [str(r.msg) for r in records] == ["another warning"]
    finally:
        logger.removeHandler(handler)
        logger.filters[:] = saved


def test_one_cpu_rank_builds_no_shm_comm_op(tmp_path):
    """DeepSpeed's CPU communicator would JIT-compile deepspeed_shm_comm (minutes) for a single rank."""
    from aflow_rl.trainer.learner import clean_dist_env

    code = ("import deepspeed.comm.comm as c\nfrom aflow_rl.trainer.learner import setup_distributed\n"
            "d = setup_distributed()\nprint(d.world_size, c.cdb.shm_comm_op)")
    env = {**clean_dist_env(), "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "1 None"
    assert not os.path.exists(tmp_path / "ext")                # nothing was compiled, or even looked up
    assert "shm_comm" not in proc.stdout + proc.stderr


# ---------------------------------------------------------------------------
# The process environment train.py sets before torch loads
# ---------------------------------------------------------------------------

_SEE_TORCH = """
import importlib.abc, os, sys
seen = []
class Watch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" and not seen:
            seen.append(os.environ.get("OMP_WAIT_POLICY"))
        return None
sys.meta_path.insert(0, Watch())
import train
import torch
print(seen[0], os.environ.get("OMP_WAIT_POLICY"))
"""


@pytest.mark.parametrize("given, expected", [(None, "PASSIVE PASSIVE"), ("ACTIVE", "ACTIVE ACTIVE")])
def test_train_sets_omp_passive_before_torch_loads(given, expected):
    """Issue 13: a loaded 2-core training step was 10.8x slower with spinning OpenMP threads. Whatever
    imports torch first, it must already see OMP_WAIT_POLICY=PASSIVE; a value the user set is kept."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if given is not None:
        env["OMP_WAIT_POLICY"] = given
    proc = subprocess.run([sys.executable, "-c", _SEE_TORCH], capture_output=True, text=True, timeout=300,
                          env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == expected.split()


# ---------------------------------------------------------------------------
# Rank 0's calls: the result and any error reach every rank; other ranks' services stay empty
# ---------------------------------------------------------------------------


class _Unpicklable(Exception):
    def __reduce__(self):
        raise TypeError("cannot pickle this")


def test_from_rank0_returns_the_value_and_raises_rank0s_error():
    assert train._from_rank0(True, lambda a, b: a + b, 1, 2) == 3
    assert train._from_rank0(True, lambda: "mine", share=False) == "mine"   # rank 0 keeps its own
    with pytest.raises(train.RunFailed, match="cannot learn"):
        train._from_rank0(True, lambda: (_ for _ in ()).throw(train.RunFailed("cannot learn")))
    with pytest.raises(RuntimeError, match="_Unpicklable: held a socket") as err:
        train._from_rank0(True, lambda: (_ for _ in ()).throw(_Unpicklable("held a socket")))
    assert isinstance(err.value.__cause__, _Unpicklable)   # the other ranks get a picklable stand-in


def test_rank0_services_on_another_rank_do_nothing(tmp_path, capsys):
    services = train.Rank0Services(cfg_with(tmp_path))   # never started: what every rank but 0 holds
    assert services.policy_admin is None and services.sampler_state() is None
    services.finish(3)
    services.close()
    assert capsys.readouterr().out == ""                  # no "done" line from a rank without the bar
    assert not os.path.exists(tmp_path / "run")           # nothing was created on this rank
