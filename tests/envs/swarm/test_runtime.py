"""Runtime semantics on hand-built graphs, with exact expected numbers."""
import asyncio
import time

import pytest

from aflow_rl.envs.swarm.actions import Action
from aflow_rl.envs.swarm.kb import build_kb
from aflow_rl.envs.swarm.metrics import critical_steps
from aflow_rl.envs.swarm.profiles import AttemptResult
from aflow_rl.envs.swarm.runtime import Budgets, InvalidAction, SwarmRuntime
from aflow_rl.envs.swarm.tools import call_tool
from tests.envs.swarm.fakes import ScriptedSubagents, graph_items


def make_rt(script=None, items=None, **budget):
    b = Budgets(**{"max_steps": 20, "max_tool_calls": 5, "max_tokens": 10 ** 6, "max_wall_ms": 1e9,
                   "max_concurrent": 8, "retries": 1, **budget})
    ex = ScriptedSubagents(script)
    kb = build_kb(0)
    rt = SwarmRuntime(items or graph_items(), b, ex, tools=lambda t, a: call_tool(kb, t, a), seed=7)
    return rt, ex


async def act(rt, action, tokens=(0, 0), ms=0.0):
    rt.turn(tokens[0], tokens[1], ms)
    return await rt.apply(action)


SPAWN_ALL = Action("spawn", n=5, profile="large", subtasks=("c", "b", "a", "d", "e"))
JOIN_ALL = Action("join", ids=())
FINISH = Action("finish", answer={})


def test_dependencies_waves_and_critical_steps():
    async def main():
        rt, ex = make_rt({"a": [(True, 3)], "e": [(True, 5)], "b": [(True, 2)], "d": [(True, 4)], "c": [(True, 1)]})
        out = await act(rt, SPAWN_ALL)
        # dependency order, then round-robin: a, e (depth 0), b, d (depth 1), c (depth 2)
        assert out.endswith("a->#0, e->#1, b->#2, d->#3, c->#4")
        await act(rt, JOIN_ALL)
        await act(rt, FINISH)
        rt.close()
        return rt, ex

    rt, ex = asyncio.run(main())
    assert rt.stages == [(2, [3, 5]), (0, [2, 4]), (0, [1]), (1, [])]
    assert critical_steps(rt.stages) == 2 + 5 + 0 + 4 + 0 + 1 + 1 == 13
    assert [c[0] for c in ex.calls] == ["a", "e", "b", "d", "c"]
    # each dependent received its dependency's answer
    assert rt.results() == {"a": "A", "e": "E", "b": "B<A", "d": "D<A", "c": "C<B<A"}
    assert rt.clock.now_ms == 500 + 400 + 100
    assert (rt.tokens_in, rt.tokens_out) == (150, 15)
    assert rt.waves == 3 and rt.sub_steps == 15 and rt.retry_count == 0
    assert rt.ended == "finish"


def test_failure_cascade_skips_dependents_and_counts_them():
    async def main():
        rt, ex = make_rt({"a": [(False, 2), (False, 3)]})
        await act(rt, SPAWN_ALL)
        out = await act(rt, JOIN_ALL)
        return rt, ex, out

    rt, ex, out = asyncio.run(main())
    status = {st.item: st.status for st in rt.subtasks.values()}
    assert status == {"a": "failed", "b": "skipped", "c": "skipped", "d": "skipped", "e": "done"}
    assert rt.count("skipped") == 3 and rt.count("failed") == 1
    assert "1 done" in out and "1 failed" in out and "3 skipped" in out
    assert rt.retry_count == 1                       # a's one in-place retry
    assert sorted(c[:2] for c in ex.calls) == [("a", 1), ("a", 2), ("e", 1)]  # skipped ones never ran
    assert rt.stages == [(2, [5, 2])]                # a's two attempts add up: 2 + 3 steps
    mail = rt.drain_mailbox()
    assert sorted(m["status"] for m in mail) == ["done", "failed", "skipped", "skipped", "skipped"]
    assert rt.drain_mailbox() == []


def test_retry_then_success_is_counted():
    async def main():
        rt, ex = make_rt({"b": [(False, 1), (True, 2)]})
        await act(rt, SPAWN_ALL)
        await act(rt, JOIN_ALL)
        return rt, ex

    rt, ex = asyncio.run(main())
    b = next(st for st in rt.subtasks.values() if st.item == "b")
    assert (b.status, b.attempts, b.steps) == ("done", 2, 3)
    assert rt.retry_count == 1
    assert rt.count("done") == 5


def test_no_retries_when_disabled():
    async def main():
        rt, _ = make_rt({"a": [(False, 2)]}, retries=0)
        await act(rt, SPAWN_ALL)
        await act(rt, JOIN_ALL)
        return rt

    rt = asyncio.run(main())
    assert rt.retry_count == 0 and rt.count("failed") == 1 and rt.count("skipped") == 3


def test_concurrency_cap_and_sequential_queues():
    items = [{"id": f"x{i}", "deps": []} for i in range(5)]
    script = {f"x{i}": [(True, i + 1)] for i in range(5)}

    async def main():
        rt, _ = make_rt(script, items=items, max_concurrent=2)
        with pytest.raises(InvalidAction, match="cap of 2"):
            await act(rt, Action("spawn", n=3, profile="small", subtasks=("x0",)))
        # 2 subagents, 5 subtasks: #0 runs x0, x2, x4 and #1 runs x1, x3, one after another
        await act(rt, Action("spawn", n=2, profile="small", subtasks=tuple(f"x{i}" for i in range(5))))
        await act(rt, JOIN_ALL)
        return rt

    rt = asyncio.run(main())
    assert rt.stages == [(3, [1, 2]), (0, [3, 4]), (0, [5])]   # the invalid turn was a main step too
    assert critical_steps(rt.stages) == 3 + 2 + 4 + 5


def test_cap_applies_across_subagents():
    items = [{"id": f"x{i}", "deps": []} for i in range(4)]

    async def main():
        rt, _ = make_rt({f"x{i}": [(True, i + 1)] for i in range(4)}, items=items, max_concurrent=2)
        await act(rt, Action("spawn", n=2, profile="small", subtasks=("x0", "x1")))
        await act(rt, Action("spawn", n=2, profile="small", subtasks=("x2", "x3")))
        await act(rt, JOIN_ALL)
        return rt

    rt = asyncio.run(main())
    assert rt.stages == [(3, [1, 2]), (0, [3, 4])]


def test_join_runs_only_targets_and_what_they_wait_for():
    async def main():
        rt, ex = make_rt()
        await act(rt, Action("spawn", n=1, profile="small", subtasks=("a",)))
        await act(rt, Action("spawn", n=1, profile="small", subtasks=("b",)))
        await act(rt, Action("spawn", n=1, profile="small", subtasks=("e",)))
        await act(rt, Action("join", ids=(1,)))
        return rt, ex

    rt, ex = asyncio.run(main())
    assert [c[0] for c in ex.calls] == ["a", "b"]      # b's dependency a ran first; e was not joined
    assert [st.status for st in rt.subtasks.values()] == ["done", "done", "queued"]
    assert rt.stages == [(4, [2]), (0, [2])]


def test_invalid_actions_leave_the_state_unchanged():
    async def main():
        rt, _ = make_rt()
        with pytest.raises(InvalidAction, match="b needs the answer to a"):
            await act(rt, Action("spawn", n=1, profile="small", subtasks=("b",)))
        with pytest.raises(InvalidAction, match="unknown item"):
            await act(rt, Action("spawn", n=1, profile="small", subtasks=("a", "zz")))
        with pytest.raises(InvalidAction, match="cap of 8"):
            await act(rt, Action("spawn", n=9, profile="small", subtasks=()))
        with pytest.raises(InvalidAction, match="no active subagent #7"):
            await act(rt, Action("assign", subagent=7, subtask="a"))
        with pytest.raises(InvalidAction, match="unknown subagent"):
            await act(rt, Action("join", ids=(3,)))
        assert rt.subagents == [] and rt.subtasks == {}
        await act(rt, Action("spawn", n=2, profile="medium", subtasks=("a",)))
        assert await act(rt, Action("assign", subagent=1, subtask="b")) == "assigned b to #1 as s1"
        assert rt.subtasks["s1"].deps == ["s0"]
        await act(rt, Action("replan", scope="all"))
        with pytest.raises(InvalidAction, match="no active subagent #0"):
            await act(rt, Action("assign", subagent=0, subtask="e"))
        return rt

    rt = asyncio.run(main())
    assert rt.count("cancelled") == 2 and rt.steps == 9


def test_replan_failed_respawns_failed_and_skipped_items():
    async def main():
        rt, _ = make_rt({"a": [(False, 2), (False, 3)]})
        await act(rt, SPAWN_ALL)
        await act(rt, JOIN_ALL)
        out = await act(rt, Action("replan", scope="failed"))
        await act(rt, JOIN_ALL)   # a's third attempt is unscripted: it succeeds
        return rt, out

    rt, out = asyncio.run(main())
    assert out == "re-spawned a->#5, b->#6, d->#7, c->#8"
    assert len(rt.subagents) == 9 and all(g.profile == "large" for g in rt.subagents)
    assert set(rt.results()) == {"a", "b", "c", "d", "e"}
    assert rt.count("skipped") == 3 and rt.count("failed") == 1 and rt.count("done") == 5


def test_replan_remaining_cancels_queued_work():
    async def main():
        rt, _ = make_rt()
        await act(rt, SPAWN_ALL)
        return rt, await act(rt, Action("replan", scope="remaining"))

    rt, out = asyncio.run(main())
    assert out == "cancelled 5 queued subtask(s)" and rt.count("cancelled") == 5
    assert all(not g.retired and not g.queue for g in rt.subagents)


def test_finish_cancels_queued_subtasks():
    async def main():
        rt, ex = make_rt()
        await act(rt, SPAWN_ALL)
        await act(rt, Action("finish", answer={"a": "1"}))
        rt.close()
        return rt, ex

    rt, ex = asyncio.run(main())
    assert rt.ended == "finish" and rt.answer == {"a": "1"}
    assert rt.count("cancelled") == 5 and ex.calls == []
    assert rt.stages == [(2, [])]
    with pytest.raises(InvalidAction, match="ended"):
        asyncio.run(rt.apply(JOIN_ALL))


def test_tool_call_budget_ends_the_episode():
    async def main():
        rt, _ = make_rt(max_tool_calls=2)
        look = Action("tool_call", tool="lookup", args={"entity": "nowhere", "attribute": "x"})
        calc = Action("tool_call", tool="calc", args={"expr": "2 * (3 + 4)"})
        first = await act(rt, look)
        second = await act(rt, calc)
        assert rt.ended is None
        third = await act(rt, calc)
        return rt, first, second, third

    rt, first, second, third = asyncio.run(main())
    assert first.startswith("lookup(nowhere, x) = error: no entity")  # a tool error is an outcome, not invalid
    assert second == "calc(2 * (3 + 4)) = 14"
    assert third.startswith("refused") and rt.ended == "tool_budget"
    assert rt.tool_calls == 2 and len(rt.notes) == 2 and rt.clock.now_ms == 100.0


def test_step_budget():
    rt, _ = make_rt(max_steps=3)
    for k in range(3):
        assert rt.check_budgets() is None
        rt.turn(1, 1, 0.0)
    assert rt.check_budgets() == "max_steps"


def test_token_budget_stops_between_waves():
    async def main():
        rt, _ = make_rt(max_tokens=60)
        await act(rt, SPAWN_ALL, tokens=(5, 1))
        await act(rt, JOIN_ALL, tokens=(5, 1))
        rt.close()
        return rt

    rt = asyncio.run(main())
    # orchestrator 12 + wave 1 (a, e) 44 = 56 <= 60; wave 2 (b, d) brings 100 > 60: stop, c never runs.
    assert rt.ended == "token_budget"
    assert rt.waves == 2 and rt.tokens_in + rt.tokens_out == 12 + 88
    assert {st.item: st.status for st in rt.subtasks.values()}["c"] == "cancelled"
    assert rt.count("done") == 4


def test_wall_time_budget_cancels_running_subagents():
    async def main():
        rt, _ = make_rt({"a": [(True, 3)], "e": [(True, 15)]}, max_wall_ms=1000.0)
        await act(rt, Action("spawn", n=2, profile="small", subtasks=("a", "e")))
        await act(rt, JOIN_ALL)
        return rt

    rt = asyncio.run(main())
    status = {st.item: st.status for st in rt.subtasks.values()}
    assert status == {"a": "done", "e": "cancelled"} and rt.ended == "wall_time"
    assert rt.stages == [(2, [3, 10])]       # e had done 10 of its 15 steps at the deadline
    assert rt.clock.now_ms == 1000.0


def test_real_time_cancellation_of_a_hanging_subagent():
    class Hangs:
        async def run(self, job):
            await asyncio.sleep(30)
            return AttemptResult(ok=True, answer="late")

    async def main():
        b = Budgets(max_wall_ms=200.0)
        rt = SwarmRuntime(graph_items(), b, Hangs())
        await act(rt, Action("spawn", n=1, profile="small", subtasks=("e",)))
        t0 = time.perf_counter()
        await act(rt, JOIN_ALL)
        return rt, time.perf_counter() - t0

    rt, took = asyncio.run(main())
    assert took < 2.0
    assert rt.count("cancelled") == 1 and rt.ended == "wall_time"
