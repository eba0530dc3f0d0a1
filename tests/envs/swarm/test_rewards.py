"""PARL reward components on constructed runs."""
import asyncio

import pytest

from aflow_rl.envs.swarm.actions import Action
from aflow_rl.envs.swarm.rewards import format_reward, r_finish, r_parallel, r_perf, reward_components
from aflow_rl.envs.swarm.runtime import Budgets, SwarmRuntime
from tests.envs.swarm.fakes import ScriptedSubagents


def wide_task(n=4):
    items = [{"id": f"w{i}", "deps": []} for i in range(n)]
    return {"task_id": "t", "items": items, "gold": {f"w{i}": f"W{i}" for i in range(n)}}


def test_component_functions():
    task = wide_task()
    assert r_perf(task, {"w0": "W0", "w1": "W1", "w2": "W2", "w3": "W3"}) == 1.0
    assert r_perf(task, {"w0": "W0", "w1": "nope"}) == pytest.approx(2 * 0.5 * 0.25 / 0.75)
    assert r_perf(task, None) == 0.0
    assert r_parallel(0, 4) == 0.0 and r_parallel(2, 4) == 0.5 and r_parallel(4, 4) == 1.0
    assert r_parallel(40, 4) == 1.0            # saturates: spawning beyond the width earns nothing
    # A chain (width 1) has no parallelism to collapse: the term is constant, spawning earns nothing.
    assert r_parallel(0, 1) == 1.0 and r_parallel(1, 1) == 1.0 and r_parallel(3, 1) == 1.0
    assert r_parallel(0, 0) == 0.0
    assert r_finish(3, 4, 4) == 0.75 and r_finish(2, 2, 8) == 0.25 and r_finish(0, 0, 0) == 0.0
    assert format_reward(3, -0.1) == pytest.approx(-0.3) and format_reward(0, -0.1) == 0.0


def run(task, actions, script=None):
    async def main():
        rt = SwarmRuntime(task["items"], Budgets(), ScriptedSubagents(script))
        for a in actions:
            rt.turn(0, 0, 0.0)
            await rt.apply(a)
        rt.close()
        return rt

    return asyncio.run(main())


def test_serial_collapse_gets_no_parallel_reward():
    task = wide_task()
    rt = run(task, [Action("finish", answer={"w0": "W0"})])
    c = reward_components(task, rt.answer, rt, invalid_actions=2, format_penalty=-0.1)
    assert c == pytest.approx({"r_perf": 2 * 1 * 0.25 / 1.25, "r_parallel": 0.0, "r_finish": 0.0, "format": -0.2})


def test_full_decomposition():
    task = wide_task()
    rt = run(task, [Action("spawn", n=4, profile="small", subtasks=("w0", "w1", "w2", "w3")),
                    Action("join", ids=())])
    rt.answer = rt.results()
    c = reward_components(task, rt.answer, rt, invalid_actions=0, format_penalty=-0.1)
    assert c == {"r_perf": 1.0, "r_parallel": 1.0, "r_finish": 1.0, "format": 0.0}


def test_spurious_parallelism_lowers_r_finish():
    task = wide_task()
    # 8 subagents for 2 subtasks, one of which fails for good: 1 done over max(2 subtasks, 8 spawned)
    rt = run(task, [Action("spawn", n=8, profile="small", subtasks=("w0", "w1")), Action("join", ids=())],
             script={"w1": [(False, 1), (False, 1)]})
    c = reward_components(task, {"w0": "W0"}, rt, invalid_actions=0, format_penalty=-0.1)
    # ... and only the one productive subagent (of 8 spawned) counts toward r_parallel: 1 / width 4
    assert c["r_parallel"] == 0.25 and c["r_finish"] == pytest.approx(1 / 8)


def test_r_parallel_counts_subagents_that_finished_a_subtask():
    task = wide_task()
    # 3 subagents for w0..w2: #0 finishes, #1 fails twice (retry included), #2 is never joined.
    rt = run(task, [Action("spawn", n=3, profile="small", subtasks=("w0", "w1", "w2")), Action("join", ids=(0, 1))],
             script={"w0": [(True, 2)], "w1": [(False, 1), (False, 1)]})
    assert rt.productive_subagents() == 1
    assert reward_components(task, {}, rt, invalid_actions=0, format_penalty=-0.1)["r_parallel"] == 0.25
    # A subagent that finishes two subtasks is one productive subagent, not two.
    rt = run(task, [Action("spawn", n=1, profile="small", subtasks=("w0", "w1")), Action("join", ids=())])
    assert rt.productive_subagents() == 1 and rt.count("done") == 2


def test_latency_cost_is_part_of_r_perf():
    """r_perf = item_f1 - c * critical_steps: the objective bench.learning judges, in the trained reward."""
    task = wide_task()
    full = {f"w{i}": f"W{i}" for i in range(4)}
    assert r_perf(task, full, critical_steps=7, latency_coef=0.02) == pytest.approx(1.0 - 0.14)
    assert r_perf(task, {"w0": "W0"}, critical_steps=3, latency_coef=0.05) == pytest.approx(0.4 - 0.15)
    assert r_perf(task, None, critical_steps=10, latency_coef=0.02) == pytest.approx(-0.2)
    assert r_perf(task, full, critical_steps=50, latency_coef=0.0) == 1.0     # c = 0: quality only
    # Through the runtime: spawn and join turns, then one wave in which every w_i takes 3 steps.
    rt = run(task, [Action("spawn", n=4, profile="small", subtasks=("w0", "w1", "w2", "w3")),
                    Action("join", ids=())], script={f"w{i}": [(True, 3)] for i in range(4)})
    from aflow_rl.envs.swarm.metrics import critical_steps
    span = critical_steps(rt.stages)
    assert span == 2 + 3                       # spawn + join turns, then the slowest subagent's 3 steps
    c = reward_components(task, rt.results(), rt, invalid_actions=0, format_penalty=-0.1, latency_coef=0.02,
                          critical_steps=span)
    assert c["r_perf"] == pytest.approx(1.0 - 0.02 * 5)
