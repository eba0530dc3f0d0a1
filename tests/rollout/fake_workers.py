"""Worker modules for the pool tests: behaviour chosen per task by ``task["mode"]``.

Modes: ok | raise_first (raises on attempt 1) | raise_always | hang (past any
timeout) | block (async only: time.sleep inside the coroutine, which blocks
the event loop) | kill_first (SIGKILL of its own process on attempt 1) |
sleep (``task["sleep"]`` seconds) | bad_return (a dict, not a Trajectory) |
trace (writes three step events).

Results depend only on ``task["seed"]``, so every backend must agree.
"""
from __future__ import annotations

import asyncio
import os
import random
import signal
import time

from aflow_rl.rollout.types import Trajectory, Turn


def make_tasks(cfg, n, seed):
    """The worker module contract's task source: ``n`` ok-mode tasks with distinct seeds."""
    return [{"seed": seed * 1000 + i, "mode": "ok"} for i in range(n)]


def init_worker(ctx):
    ctx.state["init_pid"] = os.getpid()
    ctx.state["inits"] = ctx.state.get("inits", 0) + 1


def _result(task, ctx) -> Trajectory:
    rng = random.Random(task.get("seed", 0))
    ids = [rng.randrange(100) for _ in range(4)]
    turn = Turn(prompt_ids=[1, 2, 3], response_ids=ids, logprobs=[-0.5] * 4, step_reward=rng.random())
    return Trajectory(episode_id=task["episode_id"], group_id=task["group_id"], turns=[turn],
                      final_reward=round(rng.random(), 6), reward_components={"r_perf": 1.0},
                      metrics={"inits": float(ctx.state["inits"])},
                      info={"pid": os.getpid(), "init_pid": ctx.state["init_pid"]})


def _trace(task, ctx) -> None:
    trace = ctx.state["trace"]
    for step in range(3):
        trace.event(task["episode_id"], step=step, observation=f"obs{step}", action={"a": step},
                    outcome="ok" if step == 2 else None, reward=float(step), timings={"ms": 1.0})


async def run_episode(task, ctx):
    mode = task.get("mode", "ok")
    attempt = task["attempt"]
    if mode == "raise_first" and attempt == 1 or mode == "raise_always":
        raise RuntimeError(f"boom on attempt {attempt}")
    if mode == "hang":
        await asyncio.sleep(3600)
    if mode == "block":
        time.sleep(3600)
    if mode == "kill_first" and attempt == 1:
        await asyncio.sleep(0.1)  # let the other episodes on this process get going
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "sleep":
        await asyncio.sleep(task["sleep"])
    if mode == "bad_return":
        return {"not": "a trajectory"}
    if mode == "trace":
        _trace(task, ctx)
    return _result(task, ctx)


def run_episode_sync(task, ctx):
    mode = task.get("mode", "ok")
    attempt = task["attempt"]
    if mode == "raise_first" and attempt == 1 or mode == "raise_always":
        raise RuntimeError(f"boom on attempt {attempt}")
    if mode == "hang":
        time.sleep(3600)
    if mode == "kill_first" and attempt == 1:
        time.sleep(0.1)
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "sleep":
        time.sleep(task["sleep"])
    if mode == "bad_return":
        return {"not": "a trajectory"}
    if mode == "trace":
        _trace(task, ctx)
    return _result(task, ctx)
