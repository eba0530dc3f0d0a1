"""The per-turn action schema (env.swarm.task_schema) and orchestrator aggregation (env.swarm.auto_answer)."""
import asyncio
import json

import jsonschema
import pytest

from aflow_rl.config import load_config
from aflow_rl.envs.swarm.actions import action_schema_for, parse_action
from aflow_rl.envs.swarm.episode import run_swarm_episode
from aflow_rl.envs.swarm.policies import ModelPolicy
from aflow_rl.envs.swarm.tasks import make_tasks
from tests.envs.swarm.fakes import FakeTokenizer, ScriptedLLM

VIEW = {"items": [{"id": "w0"}, {"id": "w1"}], "subagents": [], "max_concurrent": 4}


def test_schema_admits_only_real_ids():
    schema = action_schema_for(VIEW)
    ok = {"action": "spawn", "n": 2, "profile": "small", "subtasks": ["w0", "w1"]}
    jsonschema.validate(ok, schema)
    for bad in ({"action": "spawn", "n": 2, "profile": "small", "subtasks": ["w7"]},      # unknown item
                {"action": "spawn", "n": 5, "profile": "small", "subtasks": ["w0"]},      # over the cap
                {"action": "assign", "subagent": 0, "subtask": "w0"},                     # no subagent yet
                {"action": "join", "ids": [0]},                                           # no subagent yet
                {"action": "finish", "answer": {"w9": "x"}}):                             # unknown item
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    two = action_schema_for({**VIEW, "subagents": [{}, {}]})
    jsonschema.validate({"action": "assign", "subagent": 1, "subtask": "w1"}, two)
    jsonschema.validate({"action": "join", "ids": [0, 1]}, two)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"action": "join", "ids": [2]}, two)
    # Everything the narrowed schema admits, the parser accepts.
    assert parse_action(json.dumps(ok)).ok


def test_model_policy_sends_the_narrowed_schema():
    cfg = load_config(None, ["env.swarm.task_schema=true", "env.swarm.max_steps=1"])
    task = make_tasks(cfg, 1, seed=0)[0]
    llm = ScriptedLLM(['{"action": "replan", "scope": "all"}'])
    traj = asyncio.run(run_swarm_episode(task, cfg, ModelPolicy(llm, FakeTokenizer(), task_schema=True)))
    sent = json.loads(llm.sampling[0]["json_schema"])
    spawn = next(v for v in sent["anyOf"] if v["properties"]["action"]["enum"] == ["spawn"])
    assert spawn["properties"]["subtasks"]["items"]["enum"] == [it["id"] for it in task["items"]]
    # The Turn carries the exact grammar the server applied, for the trainer's masks.
    assert json.loads(traj.turns[0].grammar["json_schema"]) == sent


@pytest.mark.parametrize("auto", [False, True])
def test_auto_answer_scores_collected_results(auto):
    cfg = load_config(None, [f"env.swarm.auto_answer={str(auto).lower()}", "env.swarm.max_steps=3",
                             "env.swarm.min_items=3", "env.swarm.max_items=3", "env.swarm.suite=wide"])
    task = make_tasks(cfg, 1, seed=3)[0]
    ids = [it["id"] for it in task["items"]]
    script = [json.dumps({"action": "spawn", "n": 3, "profile": "large", "subtasks": ids}),
              json.dumps({"action": "join", "ids": []}),
              json.dumps({"action": "finish", "answer": {}})]
    traj = asyncio.run(run_swarm_episode(task, cfg, ModelPolicy(ScriptedLLM(script), FakeTokenizer(),
                                                                constrained=False)))
    assert traj.info["termination"] == "finish"
    if auto:  # the large profile is reliable: every item's result is collected and scored
        assert traj.reward_components["r_perf"] == pytest.approx(1.0)
        assert traj.info["answer"] == task["gold"]
    else:     # an empty finish answers nothing
        assert traj.reward_components["r_perf"] == 0.0


MIXED_VIEW = {"items": [{"id": "c0h0", "deps": []}, {"id": "c0h1", "deps": ["c0h0"]}, {"id": "c1h0", "deps": []},
                        {"id": "sum", "deps": ["c0h1", "c1h0"]}],
              "subagents": [], "subtasks": [], "results": {}, "max_concurrent": 4, "solve": True}


def _variant(schema, kind):
    return next((v for v in schema["anyOf"] if v["properties"]["action"]["enum"] == [kind]), None)


def _kinds(schema):
    return [v["properties"]["action"]["enum"][0] for v in schema["anyOf"]]


def test_effective_spawn_delegates_whole_dependency_levels_in_order():
    schema = action_schema_for(MIXED_VIEW, effective=True)
    def spawn(ids):
        return {"action": "spawn", "n": 2, "profile": "large", "subtasks": ids}
    # levels: {c0h0, c1h0} (depth 0), {c0h1} (depth 1), {sum} (depth 2)
    for ok in (["c0h0", "c1h0"], ["c0h0", "c1h0", "c0h1"], ["c0h0", "c1h0", "c0h1", "sum"]):
        jsonschema.validate(spawn(ok), schema)
        assert parse_action(json.dumps(spawn(ok))).ok
    for bad in ([], ["c0h0"], ["c1h0", "c0h0"], ["c0h0", "c0h1"], ["c0h0", "c0h0"],
                ["c0h0", "c1h0", "c0h1", "sum", "c0h0"]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(spawn(bad), schema)
    # c0h0 is queued on #0, c1h0 done, c0h1 failed: unplanned are c0h1 and sum (levels 1 and 2)
    later = {**MIXED_VIEW, "subagents": [{"id": 0, "queue": ["c0h0"]}, {"id": 1, "queue": [], "retired": True}],
             "subtasks": [{"item": "c0h0", "status": "queued"}, {"item": "c1h0", "status": "done"},
                          {"item": "c0h1", "status": "failed"}], "results": {"c1h0": "7"}}
    options = _variant(action_schema_for(later, effective=True), "spawn")["properties"]["subtasks"]["anyOf"]
    assert [[p["const"] for p in o["prefixItems"]] for o in options] == [["c0h1"], ["c0h1", "sum"]]
    eff = action_schema_for(later, effective=True)
    assert _variant(eff, "replan")["properties"]["scope"]["enum"] == ["failed", "remaining", "all"]
    assert _variant(eff, "assign")["properties"]["subtask"]["enum"] == ["c0h1"]   # its input c0h0 is live
    assert "join" in _kinds(eff)
    assert _variant(eff, "assign")["properties"]["subagent"]["enum"] == [0]        # #1 is retired


def test_effective_schema_offers_only_actions_that_change_the_state():
    assert _kinds(action_schema_for(MIXED_VIEW, effective=True)) == ["spawn", "solve", "finish"]
    # everything answered, nothing queued: finish is all that is left
    done = {**MIXED_VIEW, "subagents": [{"id": 0, "queue": []}],
            "subtasks": [{"item": i, "status": "done"} for i in ("c0h0", "c1h0", "c0h1", "sum")],
            "results": {"c0h0": "a", "c1h0": "b", "c0h1": "c", "sum": "d"}}
    assert _kinds(action_schema_for(done, effective=True)) == ["finish"]
    assert _kinds(action_schema_for(done)) == ["spawn", "assign", "join", "replan", "finish"]  # without: no-ops too
    # all planned and queued: join (and cancelling replans), no spawn or assign
    planned = {**done, "subagents": [{"id": 0, "queue": ["sum"]}], "results": {"c0h0": "a", "c1h0": "b", "c0h1": "c"},
               "subtasks": done["subtasks"][:3] + [{"item": "sum", "status": "queued"}]}
    assert _kinds(action_schema_for(planned, effective=True)) == ["join", "replan", "solve", "finish"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"action": "replan", "scope": "failed"}, action_schema_for(planned, effective=True))


def test_solve_is_offered_on_the_items_whose_inputs_are_known():
    def ready(view):
        return _variant(action_schema_for(view), "solve")["properties"]["subtask"]["enum"]
    assert ready(MIXED_VIEW) == ["c0h0", "c1h0"]
    assert ready({**MIXED_VIEW, "results": {"c0h0": "x", "c1h0": "y"}}) == ["c0h1"]
    assert ready({**MIXED_VIEW, "results": {"c0h0": "x", "c1h0": "y", "c0h1": "z"}}) == ["sum"]
    everything = {"c0h0": "x", "c1h0": "y", "c0h1": "z", "sum": "w"}
    assert _variant(action_schema_for({**MIXED_VIEW, "results": everything}), "solve") is None
    assert _variant(action_schema_for({**MIXED_VIEW, "solve": False}), "solve") is None


def test_solve_is_offered_only_where_the_own_budget_covers_the_item():
    view = {"items": [{"id": "w0", "deps": [], "path": ["a", "b", "c"]}, {"id": "w1", "deps": [], "path": ["a"]}],
            "subagents": [], "results": {}, "max_concurrent": 4, "solve": True,
            "max_tool_calls": 8, "tool_calls": 6, "max_steps": 10, "step": 3}
    def ready(v):
        offered = _variant(action_schema_for(v), "solve") or {"properties": {"subtask": {"enum": []}}}
        return offered["properties"]["subtask"]["enum"]
    assert ready(view) == ["w1"]                                   # w0 needs 3 tool calls, 2 are left
    assert ready({**view, "tool_calls": 0}) == ["w0", "w1"]
    assert ready({**view, "tool_calls": 0, "step": 8}) == ["w1"]    # 2 turns left (this one included)
    assert ready({**view, "tool_calls": 8}) == []


def test_narrowed_schemas_compile_with_xgrammar(tiny_model_dir):
    from aflow_rl.serving.grammar import GrammarBackend

    backend = GrammarBackend.from_pretrained(tiny_model_dir)
    assert backend.compile({"json_schema": json.dumps(action_schema_for(MIXED_VIEW, effective=True))})


def test_with_solve_the_narrowed_schema_leaves_out_raw_tool_calls_and_bounds_answer_values():
    assert _variant(action_schema_for(MIXED_VIEW), "tool_call") is None
    assert _variant(action_schema_for({**MIXED_VIEW, "solve": False}), "tool_call") is not None
    schema = action_schema_for(MIXED_VIEW)
    jsonschema.validate({"action": "finish", "answer": {"sum": "x" * 32}}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"action": "finish", "answer": {"sum": "x" * 33}}, schema)


def test_no_duplicate_work_leaves_out_solving_delegated_items_and_idle_subagents():
    lean = action_schema_for(MIXED_VIEW, effective=True, no_duplicate=True)
    spawns = [v for v in lean["anyOf"] if v["properties"]["action"]["enum"] == ["spawn"]]
    # one spawn variant per level option, n at most its item count (and the concurrency cap 4)
    assert [(len(v["properties"]["subtasks"]["prefixItems"]), v["properties"]["n"]["maximum"]) for v in spawns] == [
        (2, 2), (3, 3), (4, 4)]
    jsonschema.validate({"action": "spawn", "n": 3, "profile": "large", "subtasks": ["c0h0", "c1h0", "c0h1"]}, lean)
    for bad in ({"action": "spawn", "n": 3, "profile": "large", "subtasks": ["c0h0", "c1h0"]},   # one would idle
                {"action": "spawn", "n": 0, "profile": "large", "subtasks": ["c0h0", "c1h0"]}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, lean)
    # c0h0 queued on #0 and c1h0 answered by a subagent: only what nobody holds may be solved;
    # without the flag the same state offers solving the queued c0h0 again.
    held = {**MIXED_VIEW, "subagents": [{"id": 0, "queue": ["c0h0"]}],
            "subtasks": [{"item": "c0h0", "status": "queued"}, {"item": "c1h0", "status": "done"}],
            "results": {"c1h0": "7"}}
    assert _variant(action_schema_for(held, effective=True), "solve")["properties"]["subtask"]["enum"] == ["c0h0"]
    assert _variant(action_schema_for(held, effective=True, no_duplicate=True), "solve") is None
    failed = {**held, "subtasks": [{"item": "c0h0", "status": "failed"}, {"item": "c1h0", "status": "done"}],
              "subagents": [{"id": 0, "queue": []}]}
    assert _variant(action_schema_for(failed, effective=True, no_duplicate=True), "solve")[
        "properties"]["subtask"]["enum"] == ["c0h0"]                              # a failed item may be redone
    # a lone level keeps a single spawn variant; the flag does nothing without effective_actions
    wide = {**MIXED_VIEW, "items": [{"id": "w0", "deps": []}, {"id": "w1", "deps": []}, {"id": "w2", "deps": []}]}
    one = [v for v in action_schema_for(wide, effective=True, no_duplicate=True)["anyOf"]
           if v["properties"]["action"]["enum"] == ["spawn"]]
    assert len(one) == 1 and one[0]["properties"]["n"]["maximum"] == 3
    assert action_schema_for(MIXED_VIEW, no_duplicate=True) == action_schema_for(MIXED_VIEW)


def test_no_duplicate_schema_compiles_with_xgrammar(tiny_model_dir):
    from aflow_rl.serving.grammar import GrammarBackend

    backend = GrammarBackend.from_pretrained(tiny_model_dir)
    assert backend.compile({"json_schema": json.dumps(action_schema_for(MIXED_VIEW, effective=True, no_duplicate=True))})
    assert backend.compile({"json_schema": json.dumps(action_schema_for(
        MIXED_VIEW, effective=True, no_duplicate=True, spawn_n="width", spawn_profile="large"))})


def test_no_duplicate_work_reaches_the_model_policy():
    cfg = load_config(None, ["env.swarm.task_schema=true", "env.swarm.effective_actions=true",
                             "env.swarm.no_duplicate_work=true", "env.swarm.solve_action=true"])
    from aflow_rl.envs.swarm.policies import make_policy
    policy = make_policy(cfg, client=ScriptedLLM(["{}"]), tokenizer=FakeTokenizer())
    assert policy.no_duplicate_work and _kinds(policy.schema(type("O", (), {"view": MIXED_VIEW})())).count("spawn") == 3


def test_spawn_n_width_and_spawn_profile_fix_what_only_loses():
    # Options: [c0h0, c1h0] (width 2), + c0h1 (levels 0-1: width 2), + sum (width 2); cap 4.
    lean = action_schema_for(MIXED_VIEW, effective=True, no_duplicate=True, spawn_n="width", spawn_profile="large")
    spawns = [v for v in lean["anyOf"] if v["properties"]["action"]["enum"] == ["spawn"]]
    assert [v["properties"]["n"]["enum"] for v in spawns] == [[2], [2], [2]]
    jsonschema.validate({"action": "spawn", "n": 2, "profile": "large", "subtasks": ["c0h0", "c1h0", "c0h1"]}, lean)
    for bad in ({"action": "spawn", "n": 3, "profile": "large", "subtasks": ["c0h0", "c1h0", "c0h1"]},  # one idles
                {"action": "spawn", "n": 1, "profile": "large", "subtasks": ["c0h0", "c1h0"]},          # serialises
                {"action": "spawn", "n": 2, "profile": "small", "subtasks": ["c0h0", "c1h0"]}):         # fixed profile
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, lean)
    # the width is capped by the concurrency cap, and counts the widest level delegated, not the items
    wide = {**MIXED_VIEW, "max_concurrent": 3, "items": [{"id": f"w{i}", "deps": []} for i in range(5)]}
    (one,) = [v for v in action_schema_for(wide, effective=True, no_duplicate=True, spawn_n="width")["anyOf"]
              if v["properties"]["action"]["enum"] == ["spawn"]]
    assert one["properties"]["n"]["enum"] == [3] and one["properties"]["profile"]["enum"] == ["small", "medium", "large"]
    chain = {**MIXED_VIEW, "items": [{"id": "h0", "deps": []}, {"id": "h1", "deps": ["h0"]}, {"id": "h2", "deps": ["h1"]}]}
    assert {v["properties"]["n"]["enum"][0] for v in action_schema_for(chain, effective=True, no_duplicate=True,
                                                                        spawn_n="width")["anyOf"]
            if v["properties"]["action"]["enum"] == ["spawn"]} == {1}


def test_spawn_n_width_needs_the_lean_grammar_and_reaches_the_model_policy():
    from aflow_rl.config import ConfigError
    from aflow_rl.envs.swarm.policies import make_policy

    with pytest.raises(ConfigError, match="no_duplicate_work=true"):
        load_config(None, ["env.swarm.spawn_n=width"])
    with pytest.raises(ConfigError, match="task_schema=true"):
        load_config(None, ["env.swarm.spawn_profile=large"])
    cfg = load_config(None, ["env.swarm.task_schema=true", "env.swarm.effective_actions=true",
                             "env.swarm.no_duplicate_work=true", "env.swarm.solve_action=true",
                             "env.swarm.spawn_n=width", "env.swarm.spawn_profile=large"])
    policy = make_policy(cfg, client=ScriptedLLM(["{}"]), tokenizer=FakeTokenizer())
    spawn = _variant(policy.schema(type("O", (), {"view": MIXED_VIEW})()), "spawn")
    assert spawn["properties"]["n"]["enum"] == [2] and spawn["properties"]["profile"]["enum"] == ["large"]


def test_auto_answer_leaves_answered_items_out_of_finish():
    view = {**MIXED_VIEW, "results": {"c0h0": "4", "c1h0": "Tolmar"}}
    finish = _variant(action_schema_for(view, effective=True, auto_answer=True), "finish")["properties"]["answer"]
    assert sorted(finish["properties"]) == ["c0h1", "sum"] and finish["additionalProperties"] is False
    jsonschema.validate({"action": "finish", "answer": {"sum": "12"}}, action_schema_for(view, auto_answer=True))
    with pytest.raises(jsonschema.ValidationError):   # c0h0 is answered: its entry would be overwritten anyway
        jsonschema.validate({"action": "finish", "answer": {"c0h0": "4"}}, action_schema_for(view, auto_answer=True))
    everything = {**view, "results": {i["id"]: "1" for i in MIXED_VIEW["items"]}}
    assert _variant(action_schema_for(everything, auto_answer=True), "finish")["properties"]["answer"]["properties"] == {}
    # without auto_answer the finish carries the answer, so every item stays offered
    assert len(_variant(action_schema_for(view), "finish")["properties"]["answer"]["properties"]) == 4


def test_delegate_ops_false_keeps_sums_for_the_orchestrator_while_it_can_compute_them():
    from aflow_rl.config import ConfigError
    from aflow_rl.envs.swarm.policies import make_policy

    view = {**MIXED_VIEW, "items": [*MIXED_VIEW["items"][:3], {"id": "sum", "deps": ["c0h1", "c1h0"], "op": "sum"}],
            "max_tool_calls": 8, "tool_calls": 0, "max_steps": 10, "step": 0}

    def options(v, **kw):
        spawns = [s for s in action_schema_for(v, effective=True, no_duplicate=True, spawn_n="width", **kw)["anyOf"]
                  if s["properties"]["action"]["enum"] == ["spawn"]]
        return [[p["const"] for p in s["properties"]["subtasks"]["prefixItems"]] for s in spawns]

    assert options(view) == [["c0h0", "c1h0"], ["c0h0", "c1h0", "c0h1"], ["c0h0", "c1h0", "c0h1", "sum"]]
    assert options(view, delegate_ops=False) == [["c0h0", "c1h0"], ["c0h0", "c1h0", "c0h1"]]
    # no tool call left: the orchestrator cannot compute the sum, so a subagent may take it after all
    assert options({**view, "tool_calls": 8}, delegate_ops=False)[-1] == ["c0h0", "c1h0", "c0h1", "sum"]
    # the chains are answered: no spawn is offered, the sum is the orchestrator's to solve
    done = {**view, "results": {"c0h0": "3", "c0h1": "4", "c1h0": "5"},
            "subtasks": [{"item": i, "status": "done"} for i in ("c0h0", "c0h1", "c1h0")]}
    schema = action_schema_for(done, effective=True, no_duplicate=True, delegate_ops=False)
    assert "spawn" not in _kinds(schema) and _variant(schema, "solve")["properties"]["subtask"]["enum"] == ["sum"]
    with pytest.raises(ConfigError, match="effective_actions=true"):
        load_config(None, ["env.swarm.delegate_ops=false"])
    cfg = load_config(None, ["env.swarm.task_schema=true", "env.swarm.effective_actions=true",
                             "env.swarm.solve_action=true", "env.swarm.delegate_ops=false"])
    policy = make_policy(cfg, client=ScriptedLLM(["{}"]), tokenizer=FakeTokenizer())
    assert not policy.delegate_ops and _kinds(policy.schema(type("O", (), {"view": view})())).count("spawn") == 1
