"""Action parsing: valid and invalid examples; parsing never raises."""
import json

import pytest

from aflow_rl.envs.swarm.actions import ACTION_SCHEMA, Action, parse_action

VALID = [
    ('{"action": "spawn", "n": 3, "profile": "medium", "subtasks": ["w0", "w1", "w2"]}',
     Action("spawn", n=3, profile="medium", subtasks=("w0", "w1", "w2"))),
    ('{"action":"spawn","n":2,"profile":"small","subtasks":[]}', Action("spawn", n=2, profile="small")),
    ('{"action": "assign", "subagent": 0, "subtask": "w3"}', Action("assign", subagent=0, subtask="w3")),
    ('{"action": "join", "ids": [0, 1]}', Action("join", ids=(0, 1))),
    ('{"action": "join", "ids": []}', Action("join")),
    ('{"action": "tool_call", "tool": "lookup", "args": {"entity": "Arvenia", "attribute": "capital"}}',
     Action("tool_call", tool="lookup", args={"entity": "Arvenia", "attribute": "capital"})),
    ('{"action": "tool_call", "tool": "calc", "args": {"expr": "1 + 2"}}',
     Action("tool_call", tool="calc", args={"expr": "1 + 2"})),
    ('{"action": "replan", "scope": "failed"}', Action("replan", scope="failed")),
    ('{"action": "finish", "answer": {"w0": "51234", "w1": 7}}', Action("finish", answer={"w0": "51234", "w1": "7"})),
    ('{"action": "finish", "answer": "Tolmar"}', Action("finish", answer="Tolmar")),
    # prose around the JSON is tolerated: the first JSON object counts
    ('Sure! {"action": "join", "ids": [2]} and then we wait', Action("join", ids=(2,))),
]

INVALID = [
    ("", "empty"),
    ("   ", "empty"),
    ("spawn three agents please", "no JSON object"),
    ('{"action": "spawn", "n": 3', "no JSON object"),               # truncated by max_new_tokens
    ("[1, 2, 3]", "expected a JSON object"),
    ('{"n": 3}', "'action' must be one of"),
    ('{"action": "fly"}', "'action' must be one of"),
    ('{"action": "spawn", "n": 0, "profile": "small", "subtasks": []}', "n must be an integer"),
    ('{"action": "spawn", "n": true, "profile": "small", "subtasks": []}', "n must be an integer"),
    ('{"action": "spawn", "n": 2.5, "profile": "small", "subtasks": []}', "n must be an integer"),
    ('{"action": "spawn", "n": 2, "profile": "huge", "subtasks": []}', "profile must be one of"),
    ('{"action": "spawn", "n": 2, "profile": "small", "subtasks": "w0"}', "subtasks must be a list"),
    ('{"action": "spawn", "n": 2, "profile": "small", "subtasks": [""]}', "subtasks must be a list"),
    ('{"action": "spawn", "n": 2, "profile": "small"}', "missing field(s) subtasks"),
    ('{"action": "spawn", "n": 2, "profile": "small", "subtasks": [], "x": 1}', "unknown field(s) x"),
    ('{"action": "assign", "subagent": -1, "subtask": "w0"}', "subagent must be"),
    ('{"action": "assign", "subagent": "0", "subtask": "w0"}', "subagent must be"),
    ('{"action": "join", "ids": [0, "1"]}', "ids must be a list"),
    ('{"action": "join", "ids": 3}', "ids must be a list"),
    ('{"action": "tool_call", "tool": "search", "args": {}}', "tool must be one of"),
    ('{"action": "tool_call", "tool": "lookup", "args": {"entity": "X"}}', "takes exactly"),
    ('{"action": "tool_call", "tool": "calc", "args": {"expr": "1", "entity": "X"}}', "takes exactly"),
    ('{"action": "tool_call", "tool": "calc", "args": "1+1"}', "args must be an object"),
    ('{"action": "replan", "scope": "everything"}', "scope must be one of"),
    ('{"action": "finish", "answer": null}', "answer must be"),
    ('{"action": "finish", "answer": {"w0": [1]}}', "answer values"),
    ('{"action": "finish", "answer": true}', "answer must be"),
]


@pytest.mark.parametrize("text, expected", VALID)
def test_valid_actions(text, expected):
    parsed = parse_action(text)
    assert parsed.ok, parsed.error
    assert parsed.action == expected


@pytest.mark.parametrize("text, fragment", INVALID)
def test_invalid_actions(text, fragment):
    parsed = parse_action(text)
    assert not parsed.ok and parsed.action is None
    assert fragment in parsed.error


@pytest.mark.parametrize("junk", [None, 42, b"\x00\xff", "{" * 5000, '{"action": ' + "[" * 3000 + "]" * 3000 + "}",
                                  "\udcff{\x00}", '{"action": {"nested": "dict"}}'])
def test_garbage_never_raises(junk):
    parsed = parse_action(junk)
    assert not parsed.ok and parsed.error


@pytest.mark.parametrize("text, _", VALID[:-1])
def test_to_json_round_trips(text, _):
    action = parse_action(text).action
    assert parse_action(action.to_json()).action == action


def test_schema_lists_every_action_and_is_json():
    kinds = [v["properties"]["action"]["enum"][0] for v in ACTION_SCHEMA["anyOf"]]
    assert kinds == ["spawn", "assign", "join", "tool_call", "replan", "finish"]
    assert json.loads(json.dumps(ACTION_SCHEMA)) == ACTION_SCHEMA


def test_schema_compiles_with_xgrammar(tiny_model_dir):
    from aflow_rl.serving.grammar import GrammarBackend

    backend = GrammarBackend.from_pretrained(tiny_model_dir)
    assert backend.compile({"json_schema": json.dumps(ACTION_SCHEMA)}) is not None
