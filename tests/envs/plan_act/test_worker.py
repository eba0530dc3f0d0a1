"""workers.plan_act: the planner needs its tokenizer; a given context is kept; tasks are reasoning-gym's."""
import asyncio

import pytest

from aflow_rl.config import load_config
from aflow_rl.rollout.types import Trajectory, WorkerContext
from workers import plan_act


def test_planner_needs_a_policy_model_path():
    cfg = load_config(None, ["env.name=plan_act", "llm.policy.base_url=http://127.0.0.1:9",
                             "llm.actor.base_url=http://127.0.0.1:9"])
    with pytest.raises(ValueError, match="serving.policy.model_path: the Plan/Act planner needs its tokenizer"):
        plan_act.init_worker(WorkerContext(config=cfg))


def test_run_episode_uses_the_clients_in_the_context(monkeypatch):
    import workers.plan_act as module

    seen = {}

    async def fake(task, ctx):
        seen["task"], seen["state"] = task, dict(ctx.state)
        return Trajectory(episode_id="p", group_id="p")

    monkeypatch.setattr(module, "run_plan_act_episode", fake)
    cfg = load_config(None, ["env.name=plan_act"])
    given = {"policy_client": object(), "actor_client": object(), "tokenizer": object()}
    ctx = WorkerContext(config=cfg, state=dict(given))
    out = asyncio.run(plan_act.run_episode({"task_id": "q"}, ctx))
    assert out.episode_id == "p" and seen["task"] == {"task_id": "q"}
    assert all(seen["state"][k] is v for k, v in given.items()) and ctx.state["plan_act_ready"]


def test_make_tasks_are_reasoning_gym_problems_of_the_configured_dataset():
    cfg = load_config(None, ["env.name=plan_act", "env.plan_act.dataset=basic_arithmetic"])
    tasks = plan_act.make_tasks(cfg, 3, seed=5)
    assert [t["task_id"] for t in tasks] == [f"basic_arithmetic/5/{i}" for i in range(3)]
    assert tasks == plan_act.make_tasks(cfg, 3, seed=5) and all(t["question"] and t["answer"] for t in tasks)
