"""Baselines: the design's bar on wide tasks, budgets respected, the bandit learns per context."""
import asyncio

import numpy as np
import pytest

from aflow_rl.config import load_config
from aflow_rl.envs.swarm.baselines import ARMS, Adaptive, Bandit, Heuristic, SingleAgent
from aflow_rl.envs.swarm.episode import run_swarm_episode
from aflow_rl.envs.swarm.policies import make_policy
from aflow_rl.envs.swarm.tasks import make_tasks


def run(cfg, policy, tasks):
    return [asyncio.run(run_swarm_episode(t, cfg, policy)) for t in tasks]


def mean(trajs, key):
    return float(np.mean([t.metrics[key] for t in trajs]))


def test_heuristic_beats_single_on_wide():
    """The design's bar: item_f1 no lower, critical steps at least 30% lower (30 seeded tasks)."""
    cfg = load_config(None, ["env.swarm.suite=wide"])
    tasks = make_tasks(cfg, 30, seed=0)
    single, heur = run(cfg, SingleAgent(), tasks), run(cfg, Heuristic(), tasks)
    assert mean(heur, "item_f1") >= mean(single, "item_f1")
    assert mean(heur, "critical_steps") <= 0.7 * mean(single, "critical_steps")
    assert mean(single, "spawn_count") == 0 and mean(single, "avg_parallelism") == 1.0
    assert mean(heur, "avg_parallelism") > 2.0
    assert all(t.metrics["invalid_actions"] == 0 for t in single + heur)


def test_single_is_better_on_deep():
    """Dependent hops cannot run in parallel: spawning only adds orchestration steps."""
    cfg = load_config(None, ["env.swarm.suite=deep"])
    tasks = make_tasks(cfg, 10, seed=0)
    assert mean(run(cfg, SingleAgent(), tasks), "critical_steps") < mean(run(cfg, Heuristic(), tasks), "critical_steps")


def test_single_agent_stays_within_budgets_and_finishes():
    cfg = load_config(None, ["env.swarm.suite=wide", "env.swarm.max_steps=6", "env.swarm.min_items=6"])
    trajs = run(cfg, SingleAgent(), make_tasks(cfg, 5, seed=1))
    for t in trajs:
        assert t.info["termination"] == "finish" and t.metrics["steps"] <= 6
        assert 0.0 < t.metrics["item_f1"] < 1.0          # 5 tool calls cannot cover 6 items
        assert t.metrics["spawn_count"] == 0


def test_heuristic_replans_failures_once():
    cfg = load_config(None, ["env.swarm.suite=wide", "env.swarm.subtask_retries=0"])
    tasks = make_tasks(cfg, 20, seed=2)
    trajs = run(cfg, Heuristic("small"), tasks)
    for task, t in zip(tasks, trajs):
        assert t.info["termination"] == "finish" and t.metrics["invalid_actions"] == 0
        failed = t.metrics["failure_rate"] > 0
        # spawn, join, finish; after a failure: spawn, join, replan, join, finish (one replan only)
        assert t.metrics["steps"] == (5 if failed else 3)
        assert t.metrics["subtasks"] > len(task["items"]) if failed else t.metrics["subtasks"] == len(task["items"])
    assert any(t.metrics["failure_rate"] > 0 for t in trajs), "small subagents without retries fail sometimes"


def test_bandit_learns_serial_for_deep_and_parallel_for_wide():
    cfg = load_config(None, ["env.swarm.suite=deep"])
    bandit = make_policy(cfg, name="bandit")
    assert isinstance(bandit, Bandit)
    run(cfg, bandit, make_tasks(cfg, 30, seed=0))
    cfg_w = load_config(None, ["env.swarm.suite=wide"])
    run(cfg_w, bandit, make_tasks(cfg_w, 30, seed=0))
    for ctx, counts in bandit.counts.items():
        best = ARMS[int(np.argmax(counts))]
        if ctx.startswith("deep"):
            assert best == "single", (ctx, counts)
        else:
            assert best.startswith("parallel"), (ctx, counts)
    assert set(bandit.table()) == set(bandit.counts)


def test_bandit_keeps_concurrent_episodes_apart():
    cfg = load_config(None, ["env.swarm.suite=wide"])
    bandit = Bandit()
    tasks = [dict(t, episode_id=f"ep{i}") for i, t in enumerate(make_tasks(cfg, 8, seed=5))]

    async def together():
        return await asyncio.gather(*(run_swarm_episode(t, cfg, bandit) for t in tasks))

    trajs = asyncio.run(together())
    assert all(t.metrics["invalid_actions"] == 0 and t.info["termination"] == "finish" for t in trajs)
    assert sum(sum(c) for c in bandit.counts.values()) == 8 and bandit._open == {}


def test_adaptive_reference_matches_the_right_rule_per_suite_and_gains_on_mixed():
    """The headroom reference: serial on deep (as single), the heuristic's fan-out on wide, and on mixed
    fan-out of the chains with the sum computed itself: every item answered, fewer critical steps than
    the heuristic (whose second subagent wave for the sum costs a spawn, a join and a wait)."""
    over = ["env.swarm.max_tool_calls=8", "env.swarm.max_steps=10", "env.swarm.solve_action=true"]
    for suite, items in (("wide", "[6, 10]"), ("deep", "[3, 6]"), ("mixed", "[4, 10]")):
        cfg = load_config(None, over + [f"env.swarm.suite={suite}", f"env.swarm.item_range.{suite}={items}"])
        tasks = make_tasks(cfg, 12, seed=3)
        adaptive, heur, single = (run(cfg, p, tasks) for p in (Adaptive(), Heuristic(), SingleAgent()))
        assert all(t.metrics["invalid_actions"] == 0 and t.info["termination"] == "finish" for t in adaptive)
        assert mean(adaptive, "item_f1") == 1.0
        if suite == "deep":
            assert mean(adaptive, "spawn_count") == 0
            assert mean(adaptive, "critical_steps") == mean(single, "critical_steps")
        elif suite == "wide":
            assert mean(adaptive, "critical_steps") == mean(heur, "critical_steps")
        else:
            assert mean(adaptive, "critical_steps") < mean(heur, "critical_steps") - 1.0
            assert 0 < mean(adaptive, "spawn_count") < mean(heur, "spawn_count")
    assert make_policy(load_config(None, ["env.swarm.policy=adaptive"])).name == "adaptive"


def test_unknown_policy_name():
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy(load_config(None, []), name="oracle")
    with pytest.raises(ValueError, match="needs the policy client"):
        make_policy(load_config(None, []), name="model")
