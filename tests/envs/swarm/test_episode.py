"""The episode loop: invalid actions are penalised and never crash it; same seed, same episode."""
import asyncio
import json

import numpy as np
import pytest

from aflow_rl.config import load_config
from aflow_rl.envs.swarm.baselines import Heuristic
from aflow_rl.envs.swarm.episode import run_swarm_episode
from aflow_rl.envs.swarm.policies import ModelPolicy, make_policy
from aflow_rl.envs.swarm.tasks import make_tasks
from tests.envs.swarm.fakes import FakeTokenizer, ScriptedLLM

GARBAGE = ["", "}{", "spawn!!", '{"action": "spawn", "n": 3', "\x00\x01\x02", "[]", '{"action": "fly"}',
           "null", '{"action":"finish","answer":[1]}', "\u00e9\u00e8" * 20]


def config(*extra):
    return load_config(None, ["env.swarm.max_steps=6", *extra])


class Recorder:
    def __init__(self):
        self.events = []

    def event(self, episode_id, **fields):
        self.events.append((episode_id, fields))


def test_garbage_from_the_model_is_penalised_and_the_episode_goes_on():
    cfg = config("env.swarm.action_schema=false")
    task = make_tasks(cfg, 1, seed=0)[0]
    llm = ScriptedLLM(GARBAGE)
    trace = Recorder()
    traj = asyncio.run(run_swarm_episode(task, cfg, ModelPolicy(llm, FakeTokenizer(), constrained=False),
                                         trace=trace))
    assert traj.status == "ok" and traj.info["termination"] == "max_steps"
    assert len(traj.turns) == 6 and llm.calls == 6
    assert all("json_schema" not in s for s in llm.sampling)
    assert traj.reward_components["format"] == pytest.approx(6 * -0.1)
    assert traj.reward_components["r_perf"] == 0.0 and traj.final_reward == pytest.approx(-0.6)
    assert [t.step_reward for t in traj.turns] == pytest.approx([-0.1] * 6)
    assert traj.metrics["invalid_actions"] == 6 and traj.metrics["critical_steps"] == 6
    assert traj.turns[0].policy_version == 3 and traj.turns[0].grammar is None
    assert len(traj.info["errors"]) == 6
    # one event per turn plus the closing score; every turn's event carries its penalty
    assert len(trace.events) == 7 and all(e[0] == task["task_id"] for e in trace.events)
    assert [e[1]["reward"] for e in trace.events[:6]] == pytest.approx([-0.1] * 6)
    assert trace.events[0][1]["outcome"]["error"] and "policy_ms" in trace.events[0][1]["timings"]
    json.dumps([e[1] for e in trace.events])                  # trace events are JSON-safe


def test_valid_and_invalid_turns_mixed():
    cfg = config()
    task = make_tasks(cfg, 1, seed=0)[0]
    ids = [it["id"] for it in task["items"]]
    turns = [
        "I think we should spawn",                                                         # unparseable
        json.dumps({"action": "spawn", "n": len(ids), "profile": "large", "subtasks": ids}),
        json.dumps({"action": "join", "ids": [99]}),                                       # invalid in this state
        json.dumps({"action": "join", "ids": []}),
        json.dumps({"action": "finish", "answer": task["gold"]}),
    ]
    llm = ScriptedLLM(turns)
    traj = asyncio.run(run_swarm_episode(task, cfg, ModelPolicy(llm, FakeTokenizer())))
    assert traj.info["termination"] == "finish" and len(traj.turns) == 5
    assert traj.reward_components == pytest.approx({"r_perf": 1.0, "r_parallel": 1.0, "r_finish": 1.0,
                                                    "format": -0.2})
    assert [t.step_reward for t in traj.turns] == pytest.approx([-0.1, 0.0, -0.1, 0.0, 1.0])
    assert traj.final_reward == pytest.approx(0.8) == pytest.approx(sum(traj.step_rewards))
    assert all(json.loads(t.grammar["json_schema"])["anyOf"] for t in traj.turns)
    assert all(s["json_schema"] for s in llm.sampling)
    assert "unknown subagent" in traj.info["errors"][1]
    # anchor keys: the state before and after the invalid join is the same, so they share a key
    assert traj.turns[2].anchor_key == traj.turns[3].anchor_key != traj.turns[1].anchor_key


@pytest.mark.parametrize("policy", ["single", "heuristic", "bandit"])
def test_same_seed_same_trajectory(policy):
    cfg = load_config(None, ["env.swarm.suite=mixed"])
    tasks = make_tasks(cfg, 6, seed=3)

    def run_all():
        p = make_policy(cfg, name=policy)
        return [asyncio.run(run_swarm_episode(t, cfg, p)) for t in tasks]

    a, b = run_all(), run_all()
    assert [t.metrics for t in a] == [t.metrics for t in b]
    assert [t.reward_components for t in a] == [t.reward_components for t in b]
    assert [t.info for t in a] == [t.info for t in b]


def test_episode_id_changes_the_subagents_luck_not_the_task():
    cfg = load_config(None, ["env.swarm.suite=wide"])
    task = make_tasks(cfg, 1, seed=0)[0]
    p = Heuristic("small")  # the least reliable profile shows the spread
    group = [asyncio.run(run_swarm_episode(dict(task, episode_id=f"e{k}", group_id="g"), cfg, p)) for k in range(12)]
    assert {t.group_id for t in group} == {"g"}
    assert [t.episode_id for t in group] == [f"e{k}" for k in range(12)]
    # small differences in subagent outcomes show up as different step counts across the group
    assert len({t.metrics["critical_steps"] for t in group}) > 1
    again = asyncio.run(run_swarm_episode(dict(task, episode_id="e5", group_id="g"), cfg, p))
    assert again.metrics == group[5].metrics


def test_budget_ends_the_episode_without_an_answer():
    cfg = load_config(None, ["env.swarm.max_tool_calls=1", "env.swarm.suite=wide"])
    task = make_tasks(cfg, 1, seed=0)[0]
    call = json.dumps({"action": "tool_call", "tool": "calc", "args": {"expr": "1 + 1"}})
    traj = asyncio.run(run_swarm_episode(task, cfg, ModelPolicy(ScriptedLLM([call]), FakeTokenizer())))
    assert traj.info["termination"] == "tool_budget" and len(traj.turns) == 2
    assert traj.metrics["tool_calls"] == 1 and traj.reward_components["format"] == 0.0
    assert traj.metrics["item_f1"] == 0.0 and traj.info["answer"] is None


def test_trajectory_round_trips():
    from aflow_rl.rollout.types import Trajectory

    cfg = config()
    task = make_tasks(cfg, 1, seed=0)[0]
    traj = asyncio.run(run_swarm_episode(task, cfg, ModelPolicy(ScriptedLLM(GARBAGE[:3]), FakeTokenizer())))
    back = Trajectory.from_dict(json.loads(json.dumps(traj.to_dict())))
    assert back.metrics == traj.metrics and len(back.turns) == len(traj.turns)
    assert np.array_equal(back.turns[0].response_ids, traj.turns[0].response_ids)
