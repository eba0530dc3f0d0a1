"""env.swarm.prompt: shape, the compact observation plus the task's shape line."""
from aflow_rl.config import load_config
from aflow_rl.envs.swarm.observation import graph_line, render, shape_line
from aflow_rl.envs.swarm.policies import make_policy
from aflow_rl.envs.swarm.runtime import Budgets, SwarmRuntime
from aflow_rl.envs.swarm.tasks import generate_task
from tests.envs.swarm.fakes import FakeTokenizer, ScriptedLLM


def test_shape_line_states_width_depth_lookups_and_own_tools_left():
    task = generate_task("mixed", 4, min_items=5, max_items=5)   # two chains of two hops, then the sum
    lookups = sum(1 if "op" in it else len(it["path"]) for it in task["items"])
    assert 6 <= lookups <= 7                                      # first hops take 1 or 2 lookups
    rt = SwarmRuntime(task["items"], Budgets(max_tool_calls=8), executor=None)
    assert shape_line(task, rt) == f"Shape: width 2 depth 3 lookups {lookups} tools left 8"
    rt.tool_calls = 3
    obs = render(task, rt, mailbox=[], last=None, compact=True, shape=True)
    assert obs.text.splitlines()[-1] == f"Shape: width 2 depth 3 lookups {lookups} tools left 5"
    assert "Shape:" not in render(task, rt, mailbox=[], last=None, compact=True).text
    deep = generate_task("deep", 4, min_items=4, max_items=4)
    assert shape_line(deep, rt).startswith("Shape: width 1 depth 4 lookups 4 ")


def test_shape_prompt_uses_the_compact_system_prompt():
    cfg = load_config(None, ["env.swarm.prompt=shape"])
    policy = make_policy(cfg, client=ScriptedLLM(["{}"]), tokenizer=FakeTokenizer())
    assert policy.system_prompt.startswith("Orchestrate subagents")


def test_graph_line_names_the_dependency_structure_last():
    wide = generate_task("wide", 7, min_items=6, max_items=6)
    deep = generate_task("deep", 7, min_items=3, max_items=3)
    mixed = generate_task("mixed", 7, min_items=4, max_items=4)   # two chains, then the sum
    assert [graph_line(t) for t in (wide, deep, mixed)] == [
        "Graph: parallel", "Graph: serial", "Graph: parallel then serial"]
    # Derived from the dependencies, not the suite label: relabelled, the line does not change.
    assert graph_line({**deep, "suite": "wide"}) == "Graph: serial"
    # One item with a dependency on another is a chain of width 1.
    assert graph_line({"items": [{"id": "a", "deps": []}, {"id": "b", "deps": ["a"]}]}) == "Graph: serial"
    rt = SwarmRuntime(mixed["items"], Budgets(max_tool_calls=8), executor=None)
    lines = render(mixed, rt, mailbox=[], last=None, compact=True, shape=True, graph=True).text.splitlines()
    assert lines[-2].startswith("Shape: width 2 depth 3 ") and lines[-1] == "Graph: parallel then serial"
    assert "Graph:" not in render(mixed, rt, mailbox=[], last=None, compact=True, shape=True).text


def test_graph_prompt_config_renders_the_graph_line_in_episodes():
    cfg = load_config(None, ["env.swarm.prompt=graph"])
    policy = make_policy(cfg, client=ScriptedLLM(["{}"]), tokenizer=FakeTokenizer())
    assert policy.system_prompt.startswith("Orchestrate subagents")
