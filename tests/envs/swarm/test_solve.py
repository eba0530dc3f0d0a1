"""The solve action (env.swarm.solve_action): the orchestrator works an item itself, charged as the
single agent's tool-call turns would be."""
import asyncio
import json

import jsonschema
import pytest

from aflow_rl.config import load_config
from aflow_rl.envs.swarm.actions import ACTION_SCHEMA, ACTION_SCHEMA_SOLVE, Action, action_schema_for, parse_action
from aflow_rl.envs.swarm.baselines import SingleAgent
from aflow_rl.envs.swarm.episode import run_swarm_episode
from aflow_rl.envs.swarm.kb import build_kb
from aflow_rl.envs.swarm.metrics import critical_steps
from aflow_rl.envs.swarm.policies import ModelPolicy
from aflow_rl.envs.swarm.profiles import TOOL_CALL_MS
from aflow_rl.envs.swarm.runtime import Budgets, InvalidAction, SwarmRuntime
from aflow_rl.envs.swarm.tasks import generate_task, tool_steps
from aflow_rl.envs.swarm.tools import call_tool
from tests.envs.swarm.fakes import FakeTokenizer, ScriptedLLM, ScriptedSubagents


def runtime(task, solve=True, **budget):
    kb = build_kb(task["kb_seed"])
    b = Budgets(**{"max_steps": 20, "max_tool_calls": 16, "max_tokens": 10 ** 6, "max_wall_ms": 1e9, **budget})
    return SwarmRuntime(task["items"], b, ScriptedSubagents(), tools=lambda t, a: call_tool(kb, t, a), seed=1,
                        solve=solve)


async def act(rt, action, tokens=(100, 10), ms=40.0):
    rt.turn(*tokens, ms)
    return await rt.apply(action)


def test_solving_a_deep_chain_costs_one_main_step_and_one_tool_call_per_lookup():
    task = generate_task("deep", 5, min_items=3, max_items=3)          # h0 -> h1 -> h2, one lookup each
    wide = generate_task("wide", 5, min_items=1, max_items=1)          # w0: 2 or 3 lookups
    k = tool_steps(wide["items"][0])

    async def main():
        rt = runtime(task)
        for it in task["items"]:
            out = await act(rt, Action("solve", subtask=it["id"]))
            assert out.startswith(f"solved {it['id']} = ")
        assert rt.results() == task["gold"] and rt.solved_self == 3
        assert (rt.steps, rt.tool_calls, rt.main_pending) == (3, 3, 3)
        assert rt.clock.now_ms == pytest.approx(3 * 40.0 + 3 * TOOL_CALL_MS)
        rt2 = runtime(wide)
        await act(rt2, Action("solve", subtask="w0"), tokens=(100, 10), ms=40.0)
        # k lookups: the turn that asked plus k - 1 more, each priced like it
        assert (rt2.steps, rt2.tool_calls, rt2.tokens_in, rt2.tokens_out) == (k, k, 100 * k, 10 * k)
        assert rt2.clock.now_ms == pytest.approx(k * (40.0 + TOOL_CALL_MS))
        assert rt2.results() == wide["gold"]
        rt.close()
        assert critical_steps(rt.stages) == 3

    asyncio.run(main())


def test_solve_needs_known_inputs_and_enough_budget_and_changes_nothing_otherwise():
    task = generate_task("deep", 5, min_items=3, max_items=3)

    async def main():
        rt = runtime(task)
        with pytest.raises(InvalidAction, match="needs the answer to h0"):
            await act(rt, Action("solve", subtask="h1"))
        with pytest.raises(InvalidAction, match="unknown item"):
            await act(rt, Action("solve", subtask="h9"))
        assert (rt.tool_calls, rt.own_answers, rt.notes) == (0, {}, [])
        tight = runtime(generate_task("wide", 5, min_items=1, max_items=1), max_tool_calls=1)
        with pytest.raises(InvalidAction, match="tool call"):
            await act(tight, Action("solve", subtask="w0"))       # 2-3 lookups, 1 tool call left
        assert tight.tool_calls == 0 and tight.steps == 1
        off = runtime(task, solve=False)
        with pytest.raises(InvalidAction, match="solve_action=false"):
            await act(off, Action("solve", subtask="h0"))

    asyncio.run(main())


def test_subagents_may_build_on_the_orchestrators_own_answer():
    task = generate_task("deep", 5, min_items=2, max_items=2)

    async def main():
        rt = runtime(task)
        await act(rt, Action("solve", subtask="h0"))
        await act(rt, Action("spawn", n=1, profile="large", subtasks=("h1",)))
        st = next(iter(rt.subtasks.values()))
        assert st.deps == []                          # nothing to wait for: h0 is already known
        await act(rt, Action("join", ids=()))
        item, _, inputs = rt.executor.calls[0]
        assert (item, inputs) == ("h1", {"h0": task["gold"]["h0"]})
        assert rt.productive_subagents() == 1

    asyncio.run(main())


def test_schema_offers_solve_only_when_enabled():
    view = {"items": [{"id": "h0"}, {"id": "h1"}], "subagents": [], "max_concurrent": 4}
    def kinds(s):
        return [v["properties"]["action"]["enum"][0] for v in s["anyOf"]]
    assert "solve" not in kinds(action_schema_for(view)) and "solve" not in kinds(ACTION_SCHEMA)
    narrowed = action_schema_for({**view, "solve": True})
    assert kinds(narrowed)[-2:] == ["solve", "finish"] and kinds(ACTION_SCHEMA_SOLVE)[-2:] == ["solve", "finish"]
    jsonschema.validate({"action": "solve", "subtask": "h1"}, narrowed)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"action": "solve", "subtask": "h7"}, narrowed)
    assert parse_action('{"action": "solve", "subtask": "h1"}').action == Action("solve", subtask="h1")
    assert not parse_action('{"action": "solve", "subtask": ""}').ok


@pytest.mark.parametrize("suite, n", [("deep", 5), ("mixed", 5), ("wide", 3)])
def test_a_model_that_solves_every_item_in_order_matches_the_single_agent(suite, n):
    """solve is the single agent's serial work, in fewer but identically charged turns: same item F1,
    critical steps, tool calls and turns."""
    cfg = load_config(None, [f"env.swarm.suite={suite}", f"env.swarm.min_items={n}", f"env.swarm.max_items={n}",
                             "env.swarm.solve_action=true", "env.swarm.policy=single", "env.swarm.auto_answer=true"])
    task = generate_task(suite, 11, min_items=n, max_items=n)
    single = asyncio.run(run_swarm_episode(task, cfg, SingleAgent()))
    from aflow_rl.envs.swarm.tasks import topological_order

    script = [json.dumps({"action": "solve", "subtask": it["id"]}) for it in topological_order(task["items"])]
    script.append(json.dumps({"action": "finish", "answer": {}}))
    model = asyncio.run(run_swarm_episode(task, cfg, ModelPolicy(ScriptedLLM(script), FakeTokenizer(),
                                                                 constrained=False)))
    assert single.metrics["item_f1"] == model.metrics["item_f1"] == 1.0
    for key in ("critical_steps", "tool_calls", "steps"):
        assert model.metrics[key] == single.metrics[key], key
    assert model.metrics["solved_self"] == len(task["items"]) and len(model.turns) == len(task["items"]) + 1
