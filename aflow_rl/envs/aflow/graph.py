"""Workflows as typed, validated graphs over AFlow's operators.

AFlow (Zhang et al., ICLR 2025) writes each workflow as Python code that calls
operators (``Custom``, ``ScEnsemble``, ``Test``, ...). Here a workflow is data:
a list of operator nodes, each reading the outputs of earlier nodes (or the
special ``problem`` input), and one output node whose text is the prediction.
Data can be validated before anything runs, hashed (the GiGPO anchor key and
the experience-pool key), written as readable YAML and emitted by a policy
under a JSON schema.

The control constructs of AFlow's code workflows are node parameters:

- **ensembles of k**: a generator node (``Custom``, ``AnswerGenerate``,
  ``CustomCodeGenerate``, ``Programmer``) with ``samples: k`` yields k
  candidates, which only ``ScEnsemble`` / ``MdEnsemble`` may consume; an
  ensemble also accepts several single-answer inputs as its candidates;
- **bounded review-then-revise**: ``Review`` critiques a solution, and
  ``Revise`` (inputs ``[solution, review]``) revises while the review fails,
  re-reviewing its own revision, for at most ``max_rounds`` revisions;
- **test-then-fix**: ``Test`` runs the problem's tests on a code solution and
  asks for a fix on failure, at most ``max_fixes`` times.

    wf = Workflow.from_yaml(text)
    validate(wf, max_nodes=8)          # raises WorkflowError listing every problem
    key = workflow_hash(wf)
"""
from __future__ import annotations

import difflib
import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

import yaml

PROBLEM = "problem"            # the input id every workflow may read: the problem statement
DEFAULT_MAX_NODES = 8          # env.aflow.max_nodes
DEFAULT_MAX_SAMPLES = 5        # env.aflow.max_samples: cap on k (samples, candidates, votes)
DEFAULT_MAX_LOOP_ROUNDS = 3    # env.aflow.max_loop_rounds: cap on max_rounds, max_fixes, attempts
MAX_INPUTS = 8                 # inputs of one node (ensembles are capped by max_samples as well)
MAX_INSTRUCTION_CHARS = 2000   # an instruction is a prompt fragment, not a document
SCHEMA_INSTRUCTION_CHARS = 400  # shorter in the proposal schema: the policy's token budget is small
CODE_KINDS = ("code", "humaneval", "mbpp")  # AFlow's question type "code" and the code datasets' kinds
_ID_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,31}$")

# Value kinds flowing along edges: one text, k candidate texts, or a review verdict.
TEXT, CANDIDATES, REVIEW = "text", "candidates", "review"


class WorkflowError(ValueError):
    """An invalid or unparseable workflow. ``problems`` lists every issue found, one line each."""

    def __init__(self, problems: list[str] | str):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("invalid workflow: " + "; ".join(self.problems))


# ---------------------------------------------------------------------------
# Operators
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ParamSpec:
    """One operator parameter: its type, default, lower bound and which cap bounds it above."""

    type: type
    default: Any
    help: str
    low: float | None = None
    high: float | None = None
    cap: str = ""              # "samples" | "rounds": bounded by max_samples | max_loop_rounds


@dataclass(frozen=True)
class OpSpec:
    """An operator: what it reads, its parameters, what it yields."""

    name: str
    description: str
    min_inputs: int
    max_inputs: int
    params: dict[str, ParamSpec] = field(default_factory=dict)
    required: tuple[str, ...] = ()
    produces: str = TEXT
    ensemble: bool = False     # consumes candidates (k samples or several inputs)

    @property
    def generator(self) -> bool:
        """Generators take ``samples`` and read the problem when they have no inputs."""
        return "samples" in self.params


_SAMPLES = ParamSpec(int, 1, "k answers sampled independently; k > 1 yields candidates for an ensemble.",
                     low=1, cap="samples")
_TEMPERATURE = ParamSpec(float, None, "Sampling temperature (default: 0 for one sample, 0.8 for k > 1).",
                         low=0.0, high=2.0)
_INSTRUCTION = ParamSpec(str, "", "Prompt text placed before the node's inputs.")

OPERATORS: dict[str, OpSpec] = {spec.name: spec for spec in (
    OpSpec("Custom", "Free-form generation: instruction + inputs -> text (AFlow's most used operator).",
           0, MAX_INPUTS, {"instruction": _INSTRUCTION, "samples": _SAMPLES, "temperature": _TEMPERATURE}),
    OpSpec("AnswerGenerate", "Step-by-step reasoning, then a concise final answer (the answer is the output).",
           0, MAX_INPUTS, {"samples": _SAMPLES, "temperature": _TEMPERATURE}),
    OpSpec("CustomCodeGenerate", "Python code for the problem's function signature (entry point).",
           0, MAX_INPUTS, {"instruction": _INSTRUCTION, "samples": _SAMPLES, "temperature": _TEMPERATURE}),
    OpSpec("Programmer", "Writes a Python solve() for the problem, runs it in the sandbox and returns its result, "
           "retrying with the error on failure.",
           0, MAX_INPUTS, {"attempts": ParamSpec(int, 3, "Code-and-run attempts.", low=1, cap="rounds"),
                           "samples": _SAMPLES, "temperature": _TEMPERATURE}),
    OpSpec("ScEnsemble", "Self-consistency: picks the candidate most candidates agree with.",
           1, MAX_INPUTS, ensemble=True),
    OpSpec("MdEnsemble", "Multiple shuffled votes on the best candidate; the most voted wins.",
           1, MAX_INPUTS, {"votes": ParamSpec(int, 3, "Voting rounds, each over a new shuffle.", low=1,
                                              cap="samples")}, ensemble=True),
    OpSpec("Test", "Runs the problem's tests on a code solution; on failure asks for a fix, up to max_fixes.",
           1, 1, {"max_fixes": ParamSpec(int, 3, "Most fix requests.", low=0, cap="rounds")}),
    OpSpec("Format", "Extracts the final answer from a solution, in the form the dataset expects.", 1, 1),
    OpSpec("Review", "Critiques a solution: pass or fail, with feedback (read by Revise).", 1, 1,
           produces=REVIEW),
    OpSpec("Revise", "Inputs [solution, review of that solution]: revises while the review fails, "
           "re-reviewing each revision, at most max_rounds times.",
           2, 2, {"max_rounds": ParamSpec(int, 1, "Most revisions.", low=1, cap="rounds")}),
)}


def operator_docs() -> str:
    """One line per operator (inputs, params), for the optimizer's prompt."""
    lines = []
    for spec in OPERATORS.values():
        arity = (f"{spec.min_inputs}" if spec.min_inputs == spec.max_inputs
                 else f"{spec.min_inputs}..{spec.max_inputs}")
        params = ", ".join(f"{n}={p.default!r}" if p.default not in (None, "") else n
                           for n, p in spec.params.items())
        lines.append(f"- {spec.name} (inputs: {arity}{'; params: ' + params if params else ''}): "
                     f"{spec.description}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# Workflow
# ---------------------------------------------------------------------------


@dataclass
class Node:
    """One operator call. ``inputs`` are node ids or ``problem``; empty means ``[problem]`` for generators."""

    id: str
    op: str
    params: dict[str, Any] = field(default_factory=dict)
    inputs: list[str] = field(default_factory=list)

    def param(self, name: str) -> Any:
        """The parameter's value, or the operator's default."""
        if name in self.params:
            return self.params[name]
        spec = OPERATORS.get(self.op)
        return spec.params[name].default if spec and name in spec.params else None

    def resolved_inputs(self) -> list[str]:
        """Inputs with a generator's empty list read as ``[problem]``."""
        spec = OPERATORS.get(self.op)
        if not self.inputs and spec is not None and spec.generator:
            return [PROBLEM]
        return list(self.inputs)

    def to_dict(self) -> dict:
        return {"id": self.id, "op": self.op, "inputs": list(self.inputs), "params": dict(self.params)}


_NODE_KEYS = ("id", "op", "inputs", "params")
_WORKFLOW_KEYS = ("name", "output", "nodes")


@dataclass
class Workflow:
    """Operator nodes and the id of the node whose text is the prediction."""

    nodes: list[Node]
    output: str
    name: str = ""

    def node(self, node_id: str) -> Node:
        for n in self.nodes:
            if n.id == node_id:
                return n
        raise KeyError(node_id)

    def to_dict(self) -> dict:
        out: dict[str, Any] = {"name": self.name} if self.name else {}
        out["output"] = self.output
        out["nodes"] = [n.to_dict() for n in self.nodes]
        return out

    @classmethod
    def from_dict(cls, data: Any) -> "Workflow":
        """Build from a plain dict; a wrong shape raises WorkflowError naming the key (meaning is ``validate``'s)."""
        if not isinstance(data, dict):
            raise WorkflowError(f"a workflow must be a mapping with 'nodes' and 'output', got {type(data).__name__}")
        unknown = [k for k in data if k not in _WORKFLOW_KEYS]
        if unknown:
            raise WorkflowError(f"unknown workflow key {unknown[0]!r} (valid: {', '.join(_WORKFLOW_KEYS)})")
        for key in ("nodes", "output"):
            if key not in data:
                raise WorkflowError(f"the workflow has no {key!r}")
        nodes_raw, output, name = data["nodes"], data["output"], data.get("name", "") or ""
        if not isinstance(nodes_raw, list):
            raise WorkflowError(f"'nodes' must be a list, got {type(nodes_raw).__name__}")
        if not isinstance(output, str):
            raise WorkflowError(f"'output' must be a node id (a string), got {output!r}")
        if not isinstance(name, str):
            raise WorkflowError(f"'name' must be a string, got {name!r}")
        return cls(nodes=[_node_from_dict(raw, i) for i, raw in enumerate(nodes_raw)], output=output, name=name)

    def to_yaml(self) -> str:
        """Readable YAML: one block per node, inputs inline, multi-line instructions as literal blocks."""
        return yaml.dump(self.to_dict(), Dumper=_ReadableDumper, sort_keys=False, allow_unicode=True, width=100)

    @classmethod
    def from_yaml(cls, text: str) -> "Workflow":
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise WorkflowError(f"not valid YAML: {str(exc).splitlines()[0]}") from None
        return cls.from_dict(data)


def _node_from_dict(raw: Any, index: int) -> Node:
    where = f"nodes[{index}]"
    if not isinstance(raw, dict):
        raise WorkflowError(f"{where} must be a mapping with id, op, inputs, params, got {type(raw).__name__}")
    unknown = [k for k in raw if k not in _NODE_KEYS]
    if unknown:
        close = difflib.get_close_matches(str(unknown[0]), _NODE_KEYS, n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"valid: {', '.join(_NODE_KEYS)}"
        raise WorkflowError(f"{where}: unknown key {unknown[0]!r} ({hint})")
    for key in ("id", "op"):
        if not isinstance(raw.get(key), str):
            raise WorkflowError(f"{where}: {key!r} must be a string, got {raw.get(key)!r}")
    inputs = raw.get("inputs") if raw.get("inputs") is not None else []
    params = raw.get("params") if raw.get("params") is not None else {}
    if not isinstance(inputs, list) or not all(isinstance(i, str) for i in inputs):
        raise WorkflowError(f"{where} ({raw['id']}): 'inputs' must be a list of node ids, got {inputs!r}")
    if not isinstance(params, dict) or not all(isinstance(k, str) for k in params):
        raise WorkflowError(f"{where} ({raw['id']}): 'params' must be a mapping, got {params!r}")
    return Node(id=raw["id"], op=raw["op"], params=dict(params), inputs=list(inputs))


class _ReadableDumper(yaml.SafeDumper):
    """Lists of ids on one line; multi-line strings as ``|`` blocks."""


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


def _represent_list(dumper: yaml.SafeDumper, value: list) -> yaml.Node:
    flow = all(isinstance(v, (str, int, float, bool)) and not (isinstance(v, str) and "\n" in v) for v in value)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", value, flow_style=flow)


_ReadableDumper.add_representer(str, _represent_str)
_ReadableDumper.add_representer(list, _represent_list)


# ---------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------


def _check_params(node: Node, spec: OpSpec, caps: dict[str, int]) -> list[str]:
    errs = []
    where = f"node {node.id!r} ({node.op})"
    for name, value in node.params.items():
        p = spec.params.get(name)
        if p is None:
            valid = ", ".join(spec.params) or "none"
            errs.append(f"{where}: unknown param {name!r} (valid: {valid})")
            continue
        if p.type is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        else:
            ok = isinstance(value, p.type) and not isinstance(value, bool)
        if not ok:
            errs.append(f"{where}: param {name!r} must be {p.type.__name__}, got {value!r}")
            continue
        if p.type is str:
            if len(value) > MAX_INSTRUCTION_CHARS:
                errs.append(f"{where}: param {name!r} is {len(value)} chars (at most {MAX_INSTRUCTION_CHARS})")
            continue
        if p.low is not None and value < p.low:
            errs.append(f"{where}: param {name}={value} is below {p.low:g}")
        high = caps[p.cap] if p.cap else p.high
        if high is not None and value > high:
            kind = "complexity over the limit: " if p.cap else ""
            errs.append(f"{where}: {kind}param {name}={value} is above {high:g}")
    for name in spec.required:
        if name not in node.params:
            errs.append(f"{where}: missing required param {name!r}")
    return errs


def _find_cycle(nodes: dict[str, Node]) -> list[str] | None:
    """A cycle as a list of ids (first id repeated at the end), or None. Iterative DFS, colours."""
    colour = {nid: 0 for nid in nodes}  # 0 new, 1 on the stack, 2 done
    for root in nodes:
        if colour[root]:
            continue
        stack = [(root, iter(nodes[root].inputs))]
        path = [root]
        colour[root] = 1
        while stack:
            nid, it = stack[-1]
            nxt = next((i for i in it if i in nodes and colour[i] != 2), None)
            if nxt is None:
                colour[nid] = 2
                stack.pop()
                path.pop()
            elif colour[nxt] == 1:
                return path[path.index(nxt):] + [nxt]
            else:
                colour[nxt] = 1
                stack.append((nxt, iter(nodes[nxt].inputs)))
                path.append(nxt)
    return None


def validate(workflow: Workflow, *, max_nodes: int, max_samples: int = DEFAULT_MAX_SAMPLES,
             max_loop_rounds: int = DEFAULT_MAX_LOOP_ROUNDS) -> None:
    """Raise WorkflowError listing every problem: unknown operator, missing input, cycle,
    complexity over the limits (nodes, k, loop bounds), missing output node, bad params or types."""
    errs: list[str] = []
    caps = {"samples": max_samples, "rounds": max_loop_rounds}
    if not workflow.nodes:
        raise WorkflowError("the workflow has no nodes")
    if len(workflow.nodes) > max_nodes:
        errs.append(f"complexity over the limit: {len(workflow.nodes)} nodes (at most {max_nodes})")
    nodes: dict[str, Node] = {}
    for n in workflow.nodes:
        if not _ID_RE.match(n.id) or n.id == PROBLEM:
            errs.append(f"bad node id {n.id!r} (letters, digits, _; at most 32 chars; not 'problem')")
        if n.id in nodes:
            errs.append(f"duplicate node id {n.id!r}")
        nodes[n.id] = n
    for n in workflow.nodes:
        spec = OPERATORS.get(n.op)
        if spec is None:
            close = difflib.get_close_matches(n.op, list(OPERATORS), n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"known: {', '.join(OPERATORS)}"
            errs.append(f"node {n.id!r}: unknown operator {n.op!r} ({hint})")
            continue
        errs += _check_params(n, spec, caps)
        if not spec.min_inputs <= len(n.inputs) <= spec.max_inputs:
            want = (f"exactly {spec.min_inputs}" if spec.min_inputs == spec.max_inputs
                    else f"{spec.min_inputs} to {spec.max_inputs}")
            errs.append(f"node {n.id!r} ({n.op}): takes {want} inputs, got {len(n.inputs)}")
        for i in n.inputs:
            if i != PROBLEM and i not in nodes:
                errs.append(f"node {n.id!r}: missing input {i!r} (neither a node nor 'problem')")
    if workflow.output not in nodes:
        errs.append(f"missing output node {workflow.output!r} (nodes: {', '.join(nodes) or 'none'})")
    cycle = _find_cycle(nodes)
    if cycle:
        errs.append(f"cycle: {' -> '.join(reversed(cycle))}")
    if not errs:  # value types only make sense on a well-formed DAG
        errs += _check_types(workflow, nodes, max_samples)
    if errs:
        raise WorkflowError(errs)


def value_kind(node: Node) -> str:
    """What a node yields: text, candidates (k > 1 samples) or a review."""
    spec = OPERATORS[node.op]
    if spec.generator and node.param("samples") > 1:
        return CANDIDATES
    return spec.produces


def _check_types(workflow: Workflow, nodes: dict[str, Node], max_samples: int) -> list[str]:
    errs = []
    for n in workflow.nodes:
        spec = OPERATORS[n.op]
        where = f"node {n.id!r} ({n.op})"
        kinds = [TEXT if i == PROBLEM else value_kind(nodes[i]) for i in n.inputs]
        if spec.ensemble:
            count = sum(nodes[i].param("samples") if k == CANDIDATES else 1 for i, k in zip(n.inputs, kinds))
            if count < 2:
                errs.append(f"{where}: an ensemble needs at least 2 candidates (an input with samples >= 2, "
                            f"or several inputs), got {count}")
            elif count > max_samples:
                errs.append(f"{where}: complexity over the limit: {count} candidates (at most {max_samples})")
            if REVIEW in kinds:
                errs.append(f"{where}: a Review is a critique, not a candidate answer")
        else:
            for i, k in zip(n.inputs, kinds):
                if k == CANDIDATES:
                    errs.append(f"{where}: input {i!r} yields {nodes[i].param('samples')} candidates; "
                                "only ScEnsemble or MdEnsemble can read them")
        if n.op == "Revise" and len(n.inputs) == 2:
            sol, rev = n.inputs
            if kinds[1] != REVIEW:
                errs.append(f"{where}: its second input must be a Review node, got {rev!r}")
            elif nodes[rev].inputs != [sol]:
                errs.append(f"{where}: revises {sol!r} but Review {rev!r} reviews {nodes[rev].inputs[0]!r}")
            if kinds[0] == REVIEW:
                errs.append(f"{where}: its first input must be a solution, not the Review {sol!r}")
    out = nodes[workflow.output]
    if value_kind(out) == CANDIDATES:
        errs.append(f"output node {out.id!r} yields {out.param('samples')} candidates; "
                    "add a ScEnsemble or MdEnsemble to pick one")
    elif value_kind(out) == REVIEW:
        errs.append(f"output node {out.id!r} is a Review (a critique, not an answer)")
    return errs


def execution_order(workflow: Workflow) -> list[Node]:
    """The nodes the output depends on (itself included), inputs before readers. Assumes a valid workflow."""
    nodes = {n.id: n for n in workflow.nodes}
    order: list[Node] = []
    seen: set[str] = set()

    def visit(nid: str) -> None:  # depth is bounded by max_nodes, so recursion is safe
        if nid in seen or nid == PROBLEM:
            return
        seen.add(nid)
        for i in nodes[nid].inputs:
            visit(i)
        order.append(nodes[nid])

    visit(workflow.output)
    return order


# ---------------------------------------------------------------------------
# Canonical form, hash, defaults
# ---------------------------------------------------------------------------


def canonical(workflow: Workflow) -> dict:
    """The form that is hashed: no name, nodes sorted by id, defaults filled in, generators' implicit problem input."""
    nodes = []
    for n in sorted(workflow.nodes, key=lambda n: n.id):
        spec = OPERATORS.get(n.op)
        params = dict(n.params)
        if spec is not None:
            params = {k: n.param(k) for k in spec.params if n.param(k) is not None} | params
        nodes.append({"id": n.id, "op": n.op, "inputs": n.resolved_inputs(), "params": params})
    return {"output": workflow.output, "nodes": nodes}


def workflow_hash(workflow: Workflow) -> str:
    """sha1 of the canonical JSON: equal for workflows that differ only in key order, node order, name or defaults."""
    text = json.dumps(canonical(workflow), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha1(text.encode("utf-8")).hexdigest()


def default_workflow(kind: str = "") -> Workflow:
    """AFlow's round-1 workflow: one generation node with an empty instruction
    (``CustomCodeGenerate`` for code problems, i.e. ``kind`` in CODE_KINDS; ``Custom`` otherwise).

    Its node is ``n1``, the first id of the proposal grammar (``workflow_schema``),
    so a proposal can keep it and add to it."""
    op = "CustomCodeGenerate" if kind in CODE_KINDS else "Custom"
    return Workflow(nodes=[Node(id="n1", op=op, params={"instruction": ""}, inputs=[PROBLEM])],
                    output="n1", name="default")


# ---------------------------------------------------------------------------
# Proposals: JSON schema and lenient parsing
# ---------------------------------------------------------------------------


_NARROWABLE = {_INSTRUCTION: "instruction", _TEMPERATURE: "temperature"}  # params grammar narrowing may fix


def _param_schema(p: ParamSpec, caps: dict[str, int], narrow: dict[str, tuple] | None = None) -> dict:
    if narrow and p in _NARROWABLE and narrow.get(_NARROWABLE[p]) is not None:
        return {"enum": list(narrow[_NARROWABLE[p]])}   # grammar narrowing: one of a fixed set
    if p.type is str:
        return {"type": "string", "maxLength": SCHEMA_INSTRUCTION_CHARS}
    prop: dict[str, Any] = {"type": "integer" if p.type is int else "number"}
    if p.low is not None:
        prop["minimum"] = p.low
    high = caps[p.cap] if p.cap else p.high
    if high is not None:
        prop["maximum"] = high
    return prop


def _node_variants(spec: OpSpec, position: int, caps: dict[str, int],
                   narrow: dict[str, tuple] | None = None) -> list[tuple[dict, bool]]:
    """The grammar shapes of ``spec`` as the node at 1-based ``position``, each with whether it may be the output.

    The node's id is ``n<position>``; its inputs are ids of earlier positions
    (and ``problem`` for a generator: only generators have a use for the raw
    problem text), within the operator's arity, an ensemble's capped at
    ``max_samples``. The output shape of a generator has no ``samples`` (k > 1
    candidates are not an answer) and a Review has none (a critique is not
    one either). [] when the operator cannot stand at ``position`` (a
    non-generator at position 1 has nothing to read; Revise needs two
    earlier nodes)."""
    earlier = [f"n{j}" for j in range(1, position)]
    sources = [PROBLEM] + earlier if spec.generator else earlier
    high = min(spec.max_inputs, len(sources))
    if spec.ensemble:
        high = min(high, caps["samples"])
    if spec.min_inputs > high or not sources:
        return []
    inputs = {"type": "array", "items": {"enum": sources}, "minItems": spec.min_inputs, "maxItems": high}
    params = {n: _param_schema(p, caps, narrow) for n, p in spec.params.items()}

    def shape(props: dict) -> dict:
        return {"type": "object",
                "properties": {"id": {"const": f"n{position}"}, "op": {"const": spec.name}, "inputs": inputs,
                               "params": {"type": "object", "properties": props, "additionalProperties": False}},
                "required": list(_NODE_KEYS), "additionalProperties": False}

    if spec.generator:
        single = {n: p for n, p in params.items() if n != "samples"}
        return [(shape(params), False), (shape(single), True)]
    return [(shape(params), spec.produces != REVIEW)]


def _narrow_sets(instructions: list[str] | None, temperatures: list[float] | None) -> dict[str, tuple]:
    """The narrowed choices (order kept, duplicates dropped); an empty set or a value out of bounds is an error."""
    out: dict[str, tuple] = {}
    if instructions is not None:
        out["instruction"] = tuple(dict.fromkeys(str(i) for i in instructions))
        if not out["instruction"]:
            raise ValueError("instructions is empty: give at least one string (\"\" for no instruction), "
                             "or leave env.aflow.instructions unset for free text")
        too_long = [i for i in out["instruction"] if len(i) > MAX_INSTRUCTION_CHARS]
        if too_long:
            raise ValueError(f"an instruction has {len(too_long[0])} characters, over MAX_INSTRUCTION_CHARS="
                             f"{MAX_INSTRUCTION_CHARS}; shorten it")
    if temperatures is not None:
        out["temperature"] = tuple(dict.fromkeys(float(t) for t in temperatures))
        if not out["temperature"]:
            raise ValueError("temperatures is empty: give at least one value, or leave "
                             "env.aflow.temperatures unset for any temperature in [0, 2]")
        bad = [t for t in out["temperature"] if not _TEMPERATURE.low <= t <= _TEMPERATURE.high]
        if bad:
            raise ValueError(f"temperature {bad[0]} is outside [{_TEMPERATURE.low}, {_TEMPERATURE.high}]; "
                             "use a value in that range")
    return out


def proposal_schema(a: Any) -> dict:
    """The proposal grammar of an ``env.aflow`` config (AflowConfig): its limits, and its
    ``instructions`` as the fixed instruction set when that list is non-empty (grammar narrowing)."""
    instructions = list(getattr(a, "instructions", None) or []) or None
    temperatures = list(getattr(a, "temperatures", None) or []) or None
    return workflow_schema(a.max_nodes, a.max_samples, a.max_loop_rounds, instructions, temperatures)


def workflow_schema(max_nodes: int = DEFAULT_MAX_NODES, max_samples: int = DEFAULT_MAX_SAMPLES,
                    max_loop_rounds: int = DEFAULT_MAX_LOOP_ROUNDS, instructions: list[str] | None = None,
                    temperatures: list[float] | None = None) -> dict:
    """JSON schema of a proposal: a workflow in topological order whose last node is the output.

    The grammar is tight so that what a small policy samples under it is
    nearly always a valid workflow (a rejected proposal only teaches "that
    was not a graph"):

    - a proposal of L nodes (1 <= L <= ``max_nodes``: one ``anyOf`` branch
      per L) lists nodes ``n1 .. nL`` in that order, and ``output`` is ``nL``;
    - each position is one operator's shape (``anyOf`` over the operators,
      ``op`` a constant) with its own params only, their types and bounds
      (k <= ``max_samples``, loop bounds <= ``max_loop_rounds``);
    - the node at position i reads ``n1 .. n(i-1)`` (generators also
      ``problem``) within its operator's arity, so every input exists and
      there is no cycle; the last node is not a Review and yields one answer.

    The value-type rules that depend on what an earlier node is (k > 1
    candidates only into an ensemble, an ensemble's 2..max_samples
    candidates, Revise reading the Review of its own solution) cannot be
    said by a context-free choice per position without enumerating the
    kinds of all earlier nodes; they, and everything about workflows not
    written under this schema, stay ``validate``'s, the final judge.

    ``instructions`` (grammar narrowing, env.aflow.instructions): when given,
    every ``instruction`` is one of these strings (an ``enum``) instead of
    free text, so a small or untrained policy proposes structures rather
    than random prompt text that the executor would then read. None: free
    text up to SCHEMA_INSTRUCTION_CHARS. ``temperatures`` likewise makes a
    node's ``temperature`` one of a few values (None: any number in [0, 2]). The result is a pure function of
    its arguments, built in a fixed order, so its ``json.dumps`` (the
    grammar stored in each Turn) is one string per config."""
    caps = {"samples": max_samples, "rounds": max_loop_rounds}
    narrowed = _narrow_sets(instructions, temperatures)
    defs: dict[str, dict] = {}
    for i in range(1, max_nodes + 1):
        variants = [v for spec in OPERATORS.values() for v in _node_variants(spec, i, caps, narrowed)]
        defs[f"n{i}"] = {"anyOf": [s for s, _ in variants]}
        defs[f"n{i}_out"] = {"anyOf": [s for s, can_output in variants if can_output]}
    branches = []
    for length in range(1, max_nodes + 1):
        items = [{"$ref": f"#/$defs/n{i}"} for i in range(1, length)] + [{"$ref": f"#/$defs/n{length}_out"}]
        nodes = {"type": "array", "prefixItems": items, "items": False, "minItems": length, "maxItems": length}
        branches.append({"type": "object", "properties": {"nodes": nodes, "output": {"const": f"n{length}"}},
                         "required": ["nodes", "output"], "additionalProperties": False})
    return {"anyOf": branches, "$defs": defs}


WORKFLOW_SCHEMA = workflow_schema()

_FENCE_RE = re.compile(r"```(?:json|yaml|yml)?\s*\n(.*?)```", re.DOTALL)


def parse_workflow(text: Any) -> Workflow:
    """A workflow from model output: JSON (bare, fenced or inside prose) or YAML.

    Never raises anything but WorkflowError; the result still needs ``validate``."""
    if not isinstance(text, str) or not text.strip():
        raise WorkflowError("empty proposal: expected a JSON workflow with 'nodes' and 'output'")
    candidates = [m.group(1) for m in _FENCE_RE.finditer(text)] + [text]
    start, end = text.find("{"), text.rfind("}")
    if 0 <= start < end:
        candidates.append(text[start:end + 1])
    last_error = "no JSON object found"
    for chunk in candidates:
        try:
            data = json.loads(chunk)
        except (json.JSONDecodeError, RecursionError) as exc:
            last_error = f"not valid JSON: {exc}"
            try:
                data = yaml.safe_load(chunk)
            except Exception:  # YAML raises several error types (and RecursionError) on junk
                continue
        if isinstance(data, dict):
            try:
                return Workflow.from_dict(data)
            except WorkflowError:
                raise
            except Exception as exc:  # from_dict only raises WorkflowError by design; be safe on odd inputs
                raise WorkflowError(f"unreadable workflow: {exc}") from None
    raise WorkflowError(f"unparseable proposal: {last_error}")
