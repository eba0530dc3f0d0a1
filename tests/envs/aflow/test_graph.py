"""Workflow graphs: validation (every rejection kind, before any execution), YAML, hash, schema, parsing."""
import asyncio
import json
import random

import pytest

from aflow_rl.envs.aflow.graph import (OPERATORS, WORKFLOW_SCHEMA, Node, Workflow, WorkflowError, default_workflow,
                                       execution_order, parse_workflow, validate, workflow_hash, workflow_schema)
from aflow_rl.llm.base import Completion
from tests.envs.aflow.fakes import Problem


class CountingLLM:
    """Counts chat calls; a rejected workflow must leave it at zero."""

    base_url = "fake://executor"

    def __init__(self):
        self.calls = 0

    async def chat(self, messages, *, return_logprob=False, **sampling):
        self.calls += 1
        return Completion(text="x", prompt_tokens=1, completion_tokens=1)

    async def generate(self, prompt=None, **kw):
        raise AssertionError("operators use chat")

    async def aclose(self):
        pass


def wf(*nodes, output=None, name="") -> Workflow:
    return Workflow(nodes=[Node(*n) if isinstance(n, tuple) else n for n in nodes],
                    output=output or (nodes[-1][0] if nodes else "a"), name=name)


def review_revise() -> Workflow:
    return wf(("a", "AnswerGenerate", {}, ["problem"]), ("r", "Review", {}, ["a"]),
              ("v", "Revise", {"max_rounds": 2}, ["a", "r"]))


VALID = [
    default_workflow(),
    default_workflow("code"),
    review_revise(),
    wf(("g", "Custom", {"instruction": "Solve.", "samples": 3}, []), ("e", "ScEnsemble", {}, ["g"])),
    wf(("x", "Custom", {}, []), ("y", "AnswerGenerate", {}, []), ("z", "Programmer", {"attempts": 2}, ["problem"]),
       ("m", "MdEnsemble", {"votes": 2}, ["x", "y", "z"]), ("f", "Format", {}, ["m"])),
    wf(("c", "CustomCodeGenerate", {"instruction": "Write it."}, []), ("t", "Test", {"max_fixes": 2}, ["c"]),
       ("f", "Format", {}, ["t"])),
]


@pytest.mark.parametrize("workflow", VALID, ids=lambda w: "-".join(n.op for n in w.nodes))
def test_valid_workflows_pass(workflow):
    validate(workflow, max_nodes=8)


INVALID = {
    "unknown operator": (wf(("a", "Magic", {}, [])), "unknown operator 'Magic'"),
    "operator typo": (wf(("a", "ScEnsembel", {}, ["problem"])), "did you mean 'ScEnsemble'"),
    "missing input": (wf(("a", "Format", {}, ["ghost"])), "missing input 'ghost'"),
    "cycle": (wf(("a", "Custom", {}, ["b"]), ("b", "Format", {}, ["a"])), "cycle"),
    "self loop": (wf(("a", "Format", {}, ["a"])), "cycle: a -> a"),
    "too many nodes": (wf(*[(f"n{i}", "Custom", {}, []) for i in range(9)]),
                       "complexity over the limit: 9 nodes (at most 8)"),
    "k over cap": (wf(("g", "Custom", {"samples": 9}, []), ("e", "ScEnsemble", {}, ["g"])),
                   "complexity over the limit: param samples=9 is above 5"),
    "candidates over cap": (wf(*[(f"g{i}", "Custom", {}, []) for i in range(6)],
                               ("e", "ScEnsemble", {}, [f"g{i}" for i in range(6)])),
                            "complexity over the limit: 6 candidates"),
    "loop over cap": (wf(("a", "Custom", {}, []), ("r", "Review", {}, ["a"]),
                         ("v", "Revise", {"max_rounds": 7}, ["a", "r"])),
                      "complexity over the limit: param max_rounds=7 is above 3"),
    "fixes over cap": (wf(("c", "CustomCodeGenerate", {}, []), ("t", "Test", {"max_fixes": 4}, ["c"])),
                       "param max_fixes=4 is above 3"),
    "missing output": (wf(("a", "Custom", {}, []), output="zzz"), "missing output node 'zzz'"),
    "unknown param": (wf(("a", "Custom", {"instructions": "x"}, [])), "unknown param 'instructions'"),
    "param type": (wf(("a", "Custom", {"samples": "3"}, [])), "param 'samples' must be int"),
    "bool is not int": (wf(("a", "Custom", {"samples": True}, [])), "param 'samples' must be int"),
    "param below": (wf(("a", "Programmer", {"attempts": 0}, [])), "param attempts=0 is below 1"),
    "temperature": (wf(("a", "Custom", {"temperature": 5}, [])), "param temperature=5 is above 2"),
    "long instruction": (wf(("a", "Custom", {"instruction": "x" * 3000}, [])), "3000 chars"),
    "arity": (wf(("a", "Custom", {}, []), ("f", "Format", {}, ["a", "problem"])), "takes exactly 1 inputs, got 2"),
    "no inputs": (wf(("e", "ScEnsemble", {}, [])), "takes 1 to 8 inputs, got 0"),
    "duplicate id": (wf(("a", "Custom", {}, []), ("a", "Format", {}, ["a"])), "duplicate node id 'a'"),
    "bad id": (wf(("a b", "Custom", {}, [])), "bad node id 'a b'"),
    "problem as id": (wf(("problem", "Custom", {}, [])), "bad node id 'problem'"),
    "candidates to non-ensemble": (wf(("g", "Custom", {"samples": 3}, []), ("f", "Format", {}, ["g"])),
                                   "only ScEnsemble or MdEnsemble can read them"),
    "candidates as output": (wf(("g", "Custom", {"samples": 2}, [])), "add a ScEnsemble or MdEnsemble"),
    "ensemble of one": (wf(("g", "Custom", {}, []), ("e", "ScEnsemble", {}, ["g"])), "at least 2 candidates"),
    "revise without review": (wf(("a", "Custom", {}, []), ("b", "Custom", {}, []), ("v", "Revise", {}, ["a", "b"])),
                              "second input must be a Review"),
    "revise other solution": (wf(("a", "Custom", {}, []), ("b", "Custom", {}, []), ("r", "Review", {}, ["b"]),
                                 ("v", "Revise", {}, ["a", "r"])), "revises 'a' but Review 'r' reviews 'b'"),
    "review as output": (wf(("a", "Custom", {}, []), ("r", "Review", {}, ["a"])), "is a Review"),
    "no nodes": (Workflow(nodes=[], output="a"), "no nodes"),
}


@pytest.mark.parametrize("case", list(INVALID), ids=list(INVALID))
def test_invalid_workflow_rejected_with_message_and_never_executed(case):
    from aflow_rl.envs.aflow.evaluator import evaluate

    workflow, message = INVALID[case]
    with pytest.raises(WorkflowError) as info:
        validate(workflow, max_nodes=8)
    assert message in str(info.value), str(info.value)

    llm = CountingLLM()
    with pytest.raises(WorkflowError):
        asyncio.run(evaluate(workflow, [Problem("p1", "2+2?", "4")], executor=llm, max_nodes=8,
                             scorer=lambda p, pred: 1.0))
    assert llm.calls == 0


def test_every_problem_is_listed():
    bad = wf(("a", "Magic", {}, []), ("b", "Custom", {"samples": 99}, ["nope"]), output="c")
    with pytest.raises(WorkflowError) as info:
        validate(bad, max_nodes=8)
    problems = info.value.problems
    assert len(problems) == 4
    assert any("unknown operator" in p for p in problems) and any("missing input 'nope'" in p for p in problems)
    assert any("samples=99" in p for p in problems) and any("missing output node 'c'" in p for p in problems)


def test_caps_follow_the_arguments():
    big = wf(("g", "Custom", {"samples": 6}, []), ("e", "ScEnsemble", {}, ["g"]))
    validate(big, max_nodes=2, max_samples=6)
    with pytest.raises(WorkflowError, match="2 nodes"):
        validate(big, max_nodes=1, max_samples=6)


def test_yaml_round_trip_and_readable():
    w = VALID[4]
    w.name = "vote"
    w.nodes[0].params["instruction"] = "Think.\nThen answer."
    text = w.to_yaml()
    assert "op: MdEnsemble" in text and "inputs: [x, y, z]" in text and "instruction: |" in text
    back = Workflow.from_yaml(text)
    assert back.to_dict() == w.to_dict() and workflow_hash(back) == workflow_hash(w)
    for sample in VALID:
        assert Workflow.from_yaml(sample.to_yaml()).to_dict() == sample.to_dict()
    assert Workflow.from_dict(json.loads(json.dumps(w.to_dict()))).to_dict() == w.to_dict()


def test_hash_is_canonical():
    d = review_revise().to_dict()
    shuffled = {"nodes": [{k: n[k] for k in reversed(list(n))} for n in reversed(d["nodes"])],
                "output": d["output"], "name": "renamed"}
    assert workflow_hash(Workflow.from_dict(shuffled)) == workflow_hash(review_revise())
    # explicit defaults and a generator's implicit problem input hash like their omission
    plain = wf(("a", "Custom", {}, []))
    explicit = wf(("a", "Custom", {"instruction": "", "samples": 1}, ["problem"]))
    assert workflow_hash(plain) == workflow_hash(explicit)
    assert workflow_hash(plain) != workflow_hash(wf(("a", "Custom", {"instruction": "Be brief."}, [])))
    assert len(workflow_hash(plain)) == 40 and workflow_hash(plain) == workflow_hash(wf(("a", "Custom", {}, [])))


def test_from_dict_shape_errors():
    for bad, msg in [([], "must be a mapping"), ({"nodes": []}, "no 'output'"), ({"output": "a"}, "no 'nodes'"),
                     ({"nodes": {}, "output": "a"}, "'nodes' must be a list"),
                     ({"nodes": [{"id": "a", "op": "Custom", "input": []}], "output": "a"}, "did you mean 'inputs'"),
                     ({"nodes": [{"id": 3, "op": "Custom"}], "output": "a"}, "'id' must be a string"),
                     ({"nodes": [{"id": "a", "op": "Custom", "inputs": "problem"}], "output": "a"}, "list of node ids"),
                     ({"nodes": [], "output": "a", "extra": 1}, "unknown workflow key 'extra'")]:
        with pytest.raises(WorkflowError) as info:
            Workflow.from_dict(bad)
        assert msg in str(info.value)


def test_parse_workflow_accepts_model_output_forms():
    d = review_revise().to_dict()
    raw = json.dumps(d)
    for text in (raw, f"```json\n{raw}\n```", f"Here is my proposal:\n{raw}\nIt adds a review.",
                 review_revise().to_yaml()):
        assert workflow_hash(parse_workflow(text)) == workflow_hash(review_revise())


def test_parse_workflow_garbage_raises_only_workflow_error():
    rng = random.Random(0)
    garbage = ["", "   ", "hello", "{", "}{", "[1, 2]", "null", "42", '{"nodes": 5, "output": "a"}',
               "{" * 5000, "[" * 5000, "```json\n{not json}\n```", '{"nodes": [], "output": 3}', "a: [b",
               "- - - x", "!!python/object:os.system {}", None, 12]
    garbage += ["".join(rng.choice('{}[]":,abc \n\\01') for _ in range(rng.randint(1, 80))) for _ in range(300)]
    for text in garbage:
        try:
            parse_workflow(text)
        except WorkflowError:
            pass


def positional(w: Workflow) -> Workflow:
    """``w`` as the proposal grammar writes it: nodes renamed n1..nL in execution order, the output last."""
    order = execution_order(w)
    names = {n.id: f"n{i}" for i, n in enumerate(order, start=1)}
    nodes = [Node(names[n.id], n.op, dict(n.params), [names.get(i, i) for i in n.inputs]) for n in order]
    return Workflow(nodes=nodes, output=names[w.output])


def test_schema_compiles_and_accepts_valid_workflows():
    jsonschema = pytest.importorskip("jsonschema")
    xgr = pytest.importorskip("xgrammar")
    xgr.Grammar.from_json_schema(json.dumps(WORKFLOW_SCHEMA))
    for w in VALID:
        p = positional(w)
        validate(p, max_nodes=8)
        jsonschema.validate(p.to_dict(), WORKFLOW_SCHEMA)
    # Free-form ids are outside the grammar (they are still fine for validate and hand-written files).
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({k: v for k, v in review_revise().to_dict().items() if k != "name"}, WORKFLOW_SCHEMA)
    ops = {s["properties"]["op"]["const"] for s in WORKFLOW_SCHEMA["$defs"]["n8"]["anyOf"]}
    assert ops == set(OPERATORS)
    small = workflow_schema(max_nodes=3, max_samples=2)
    assert len(small["anyOf"]) == 3 and small["anyOf"][-1]["properties"]["nodes"]["maxItems"] == 3

    def bad(*nodes):
        out = {"nodes": [{"id": f"n{i}", "op": op, "inputs": inputs, "params": params}
                         for i, (op, inputs, params) in enumerate(nodes, start=1)], "output": f"n{len(nodes)}"}
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(out, small)

    bad(("Custom", [], {"samples": 3}), ("ScEnsemble", ["n1"], {}))          # k over max_samples
    bad(("Custom", ["n2"], {}), ("Custom", ["n1"], {}))                       # a later node: no cycles
    bad(("Custom", [], {}), ("Review", ["n1"], {}))                           # a Review is not an answer
    bad(("Custom", [], {"samples": 2}),)                                      # nor are k candidates
    bad(("Custom", [], {"votes": 2}), ("ScEnsemble", ["n1"], {}))             # another operator's param
    bad(("Review", ["problem"], {}), ("Custom", ["n1"], {}))                  # only generators read the problem
    bad(("Custom", [], {}), ("Revise", ["n1", "n1"], {}))                     # Revise needs two earlier nodes
    bad(("Custom", [], {}), ("Custom", ["n4"], {}))                           # ids of the enum only
    jsonschema.validate({"nodes": [{"id": "n1", "op": "Custom", "inputs": [], "params": {"samples": 2}},
                                   {"id": "n2", "op": "ScEnsemble", "inputs": ["n1"], "params": {}}],
                         "output": "n2"}, small)


def test_schema_is_deterministic_and_compiles_fast(tiny_model_dir):
    pytest.importorskip("xgrammar")
    import time

    from aflow_rl.serving.grammar import GrammarBackend

    # The trainer rebuilds grammar masks from the schema string in each Turn: one string per config.
    assert json.dumps(workflow_schema(4, 3, 3)) == json.dumps(workflow_schema(4, 3, 3))
    assert json.dumps(workflow_schema(4, 3, 3)) != json.dumps(workflow_schema(4, 3, 2))
    backend = GrammarBackend.from_pretrained(tiny_model_dir)
    t0 = time.perf_counter()
    backend.compile({"json_schema": json.dumps(workflow_schema(8, 5, 3))})
    assert time.perf_counter() - t0 < 5.0   # ~1 s measured on 2 CPU cores; 4, 3, 3 takes ~0.35 s


def test_grammar_paths_are_acyclic_with_existing_inputs():
    """Random walks through the schema (each choice uniform) always give a graph whose inputs exist and
    that has no cycle; what validate still rejects is only the value-type rules."""
    schema = workflow_schema(4, 3, 3)
    rng = random.Random(0)
    structural = ("missing input", "cycle", "unknown", "duplicate", "takes ", "bad node id", "missing output",
                  "above", "below")
    valid = 0
    for _ in range(300):
        branch = rng.choice(schema["anyOf"])
        nodes = []
        for ref in branch["properties"]["nodes"]["prefixItems"]:
            shape = rng.choice(schema["$defs"][ref["$ref"].split("/")[-1]]["anyOf"])["properties"]
            arr = shape["inputs"]
            inputs = [rng.choice(arr["items"]["enum"]) for _ in range(rng.randint(arr["minItems"], arr["maxItems"]))]
            params = {}
            for name, p in shape["params"]["properties"].items():
                if rng.random() < 0.5:
                    params[name] = ("x" if p["type"] == "string" else
                                    rng.randint(int(p.get("minimum", 0)), int(p.get("maximum", 3))))
            nodes.append({"id": shape["id"]["const"], "op": shape["op"]["const"], "inputs": inputs,
                          "params": params})
        try:
            validate(Workflow.from_dict({"nodes": nodes, "output": branch["properties"]["output"]["const"]}),
                     max_nodes=4, max_samples=3, max_loop_rounds=3)
            valid += 1
        except WorkflowError as exc:
            assert not any(s in p for p in exc.problems for s in structural), exc.problems
    assert valid > 150


def test_default_workflow_is_aflows_round_one():
    for kind, op in [("", "Custom"), ("math", "Custom"), ("code", "CustomCodeGenerate"),
                     ("humaneval", "CustomCodeGenerate"), ("mbpp", "CustomCodeGenerate")]:
        w = default_workflow(kind)
        assert [n.op for n in w.nodes] == [op] and w.nodes[0].params == {"instruction": ""}
        validate(w, max_nodes=1)


def test_execution_order_skips_dead_nodes():
    w = wf(("a", "Custom", {}, []), ("dead", "Custom", {}, []), ("r", "Review", {}, ["a"]),
           ("v", "Revise", {}, ["a", "r"]), output="v")
    validate(w, max_nodes=8)
    order = [n.id for n in execution_order(w)]
    assert order == ["a", "r", "v"]


def test_narrowed_schema_offers_only_the_instruction_set():
    """Grammar narrowing (env.aflow.instructions): every instruction is one of the set, nothing else."""
    jsonschema = pytest.importorskip("jsonschema")
    xgr = pytest.importorskip("xgrammar")
    choices = ["", "Answer with the number only.", "Answer with the number only."]   # duplicate dropped
    schema = workflow_schema(3, 2, 2, instructions=choices)
    xgr.Grammar.from_json_schema(json.dumps(schema))
    seen = 0
    for defs in schema["$defs"].values():
        for shape in defs["anyOf"]:
            props = shape["properties"]["params"]["properties"]
            if "instruction" in props:
                assert props["instruction"] == {"enum": ["", "Answer with the number only."]}
                seen += 1
    assert seen >= 6   # Custom and CustomCodeGenerate at every position, both output and non-output shapes

    def doc(instruction):
        return {"nodes": [{"id": "n1", "op": "Custom", "inputs": ["problem"], "params": {"instruction": instruction}}],
                "output": "n1"}

    jsonschema.validate(doc(""), schema)
    jsonschema.validate(doc("Answer with the number only."), schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(doc("Answer with the number only"), schema)   # one character off
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(doc("zq#r tokens"), schema)                    # free text is outside
    jsonschema.validate(doc("zq#r tokens"), workflow_schema(3, 2, 2))       # but inside the free schema
    # Everything but the instructions is the free schema's: same operators, positions, caps.
    free = workflow_schema(3, 2, 2)
    assert json.dumps(schema).replace('{"enum": ["", "Answer with the number only."]}',
                                      '{"type": "string", "maxLength": 400}') == json.dumps(free)


def test_narrowed_schema_rejects_bad_sets_and_follows_the_config():
    from aflow_rl.config import AflowConfig
    from aflow_rl.envs.aflow.graph import MAX_INSTRUCTION_CHARS, proposal_schema

    with pytest.raises(ValueError, match="instructions is empty"):
        workflow_schema(3, 2, 2, instructions=[])
    with pytest.raises(ValueError, match="over MAX_INSTRUCTION_CHARS"):
        workflow_schema(3, 2, 2, instructions=["x" * (MAX_INSTRUCTION_CHARS + 1)])
    a = AflowConfig(max_nodes=3, max_samples=2, max_loop_rounds=2)
    assert json.dumps(proposal_schema(a)) == json.dumps(workflow_schema(3, 2, 2))       # [] = free text
    a.instructions = ["", "Think step by step."]
    assert json.dumps(proposal_schema(a)) == json.dumps(workflow_schema(3, 2, 2, ["", "Think step by step."]))
    assert json.dumps(proposal_schema(a)) != json.dumps(workflow_schema(3, 2, 2))


def test_narrowed_temperatures():
    jsonschema = pytest.importorskip("jsonschema")
    xgr = pytest.importorskip("xgrammar")
    schema = workflow_schema(2, 2, 2, temperatures=[0, 0.7, 0.7])
    xgr.Grammar.from_json_schema(json.dumps(schema))

    def doc(t):
        return {"nodes": [{"id": "n1", "op": "Programmer", "inputs": ["problem"], "params": {"temperature": t}}],
                "output": "n1"}

    jsonschema.validate(doc(0.7), schema)
    jsonschema.validate(doc(0), schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(doc(2), schema)            # in [0, 2], but not one of the set
    jsonschema.validate(doc(2), workflow_schema(2, 2, 2))
    temps = [s["properties"]["params"]["properties"]["temperature"] for d in schema["$defs"].values()
             for s in d["anyOf"] if "temperature" in s["properties"]["params"]["properties"]]
    assert temps and all(t == {"enum": [0.0, 0.7]} for t in temps)
    with pytest.raises(ValueError, match="outside"):
        workflow_schema(2, 2, 2, temperatures=[2.5])
    with pytest.raises(ValueError, match="temperatures is empty"):
        workflow_schema(2, 2, 2, temperatures=[])
