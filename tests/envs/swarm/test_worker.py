"""workers.swarm: baseline episodes need no server; traces land under run.dir; LLM subagents via the actor."""
import asyncio
import glob
import json
import os

import pytest

from aflow_rl.config import load_config
from aflow_rl.rollout.types import Trajectory, WorkerContext
from workers import swarm as swarm_worker


def test_heuristic_episode_without_servers(tmp_path):
    cfg = load_config(None, ["env.swarm.policy=heuristic", "env.swarm.suite=wide", f"run.dir={tmp_path}"])
    ctx = WorkerContext(config=cfg, run_dir=str(tmp_path))
    swarm_worker.init_worker(ctx)
    assert "policy_client" not in ctx.state and "tokenizer" not in ctx.state
    tasks = swarm_worker.make_tasks(cfg, 3, seed=0)
    tasks = [dict(t, episode_id=f"{t['task_id']}#0", group_id=t["task_id"], attempt=1) for t in tasks]
    trajs = [asyncio.run(swarm_worker.run_episode(t, ctx)) for t in tasks]
    assert all(isinstance(t, Trajectory) and t.status == "ok" for t in trajs)
    assert [t.episode_id for t in trajs] == [t["episode_id"] for t in tasks]
    assert all(t.info["policy"] == "heuristic" and t.metrics["spawn_count"] > 0 for t in trajs)
    files = glob.glob(os.path.join(tmp_path, "traces", "*.jsonl"))
    assert files
    events = [json.loads(line) for f in files for line in open(f)]
    assert {e["episode_id"] for e in events} == {t["episode_id"] for t in tasks}
    assert all({"observation", "action", "outcome", "reward", "timings"} <= set(e) for e in events)


def test_run_episode_initialises_a_bare_context():
    cfg = load_config(None, ["env.swarm.policy=single"])
    ctx = WorkerContext(config=cfg)
    traj = asyncio.run(swarm_worker.run_episode(swarm_worker.make_tasks(cfg, 1, seed=0)[0], ctx))
    assert traj.status == "ok" and ctx.state["swarm_ready"] and traj.metrics["spawn_count"] == 0


def test_model_policy_needs_a_policy_model_path():
    cfg = load_config(None, ["env.swarm.policy=model", "llm.policy.base_url=http://127.0.0.1:9"])
    with pytest.raises(ValueError, match="serving.policy.model_path"):
        swarm_worker.init_worker(WorkerContext(config=cfg))


def test_llm_subagents_through_the_actor_client():
    from tests.envs.swarm.fakes import ScriptedLLM

    cfg = load_config(None, ["env.swarm.policy=heuristic", "env.swarm.subagents=llm"])
    actor = ScriptedLLM(['{"answer": "Tolmar"}'])
    ctx = WorkerContext(config=cfg, state={"actor_client": actor})
    swarm_worker.init_worker(ctx)  # keeps the given client
    task = swarm_worker.make_tasks(cfg, 1, seed=0)[0]
    traj = asyncio.run(swarm_worker.run_episode(task, ctx))
    assert ctx.state["actor_client"] is actor and actor.calls == len(task["items"])
    assert traj.status == "ok" and traj.reward_components["r_finish"] == 1.0
    assert traj.metrics["item_f1"] == 0.0       # the actor's answers are wrong, and scored as such
