"""Critical steps and the per-episode metrics, on hand-built numbers."""
import asyncio

import pytest

from aflow_rl.envs.swarm.actions import Action
from aflow_rl.envs.swarm.metrics import METRICS, critical_steps, episode_metrics, subtask_finish_rate
from aflow_rl.envs.swarm.runtime import Budgets, SwarmRuntime
from tests.envs.swarm.fakes import ScriptedSubagents, graph_items


@pytest.mark.parametrize("stages, expected", [
    ([(1, [3, 5]), (2, []), (1, [4])], 1 + 5 + 2 + 0 + 1 + 4),   # 13
    ([], 0),
    ([(4, [])], 4),                       # a single agent: main steps only
    ([(0, [2, 2, 2])], 2),                # parallel subagents cost the slowest one
    ([(2, [1]), (0, [7, 3]), (1, [])], 2 + 1 + 7 + 1),
])
def test_critical_steps(stages, expected):
    assert critical_steps(stages) == expected


def test_critical_steps_accepts_tuples_and_numpy_ints():
    import numpy as np

    assert critical_steps(((np.int64(2), (np.int32(3),)),)) == 5
    assert isinstance(critical_steps([(1, [2])]), int)


def test_subtask_finish_rate():
    assert subtask_finish_rate(3, 4, 2) == 0.75
    assert subtask_finish_rate(2, 2, 4) == 0.5     # two idle subagents count against it
    assert subtask_finish_rate(0, 0, 0) == 0.0


def test_episode_metrics_on_a_constructed_run():
    task = {"task_id": "t", "items": graph_items(), "gold": {"a": "A", "b": "B<A", "c": "C<B<A", "d": "D<A", "e": "E"}}

    async def main():
        rt = SwarmRuntime(task["items"], Budgets(retries=1), ScriptedSubagents({"d": [(False, 1), (False, 1)]}))
        rt.turn(100, 10, 0.0)
        await rt.apply(Action("spawn", n=6, profile="small", subtasks=("a", "b", "c", "d", "e")))
        rt.turn(100, 10, 0.0)
        await rt.apply(Action("join", ids=()))
        rt.turn(100, 10, 0.0)
        await rt.apply(Action("finish", answer=rt.results()))
        rt.close()
        return rt

    rt = asyncio.run(main())
    m = episode_metrics(task, rt.answer, rt)
    assert set(METRICS) <= set(m)
    # stages: (2, [a 2, e 2]), (0, [b 2, d 1+1]), (0, [c 2]), (1, [])
    assert m["critical_steps"] == 2 + 2 + 2 + 2 + 1 == 9
    assert m["item_f1"] == pytest.approx(2 * 1.0 * 0.8 / 1.8) and m["success"] == 0.0
    assert m["failure_rate"] == pytest.approx(1 / 5) and m["skip_rate"] == 0.0
    assert m["retry_count"] == 1 and m["spawn_count"] == 6
    assert m["subtask_finish_rate"] == pytest.approx(4 / 6)          # one idle subagent, one failure
    assert m["avg_parallelism"] == pytest.approx((3 + 2 + 2 + 2 + 2 + 2) / 9)
    assert m["tokens_in"] == 300 + 10 * 10 and m["tokens_out"] == 30 + 10
    assert m["wall_clock_ms"] == 200 + 200 + 200
