"""The orchestrator's action space (Kimi K2.5 Agent Swarm) as one JSON object per turn.

    {"action": "spawn", "n": 3, "profile": "medium", "subtasks": ["w0", "w1", "w2"]}
    {"action": "assign", "subagent": 0, "subtask": "w3"}
    {"action": "join", "ids": [0, 1]}                      # [] joins every subagent
    {"action": "tool_call", "tool": "lookup", "args": {"entity": "Arvenia", "attribute": "capital"}}
    {"action": "replan", "scope": "failed"}               # failed | remaining | all
    {"action": "solve", "subtask": "w3"}                  # env.swarm.solve_action: work an item yourself
    {"action": "finish", "answer": {"w0": "51234", "w1": "Tolmar"}}

``solve`` is the orchestrator doing an item's tool calls itself, serially (what the single-agent
baseline does one tool call per turn); it is charged exactly as those turns would be (see
``runtime.SwarmRuntime._do_solve``) and exists only when ``env.swarm.solve_action`` is on.

``ACTION_SCHEMA`` is what the policy server constrains generation with;
``parse_action`` checks the same rules on any text, because a turn generated
without the constraint (or truncated by ``max_new_tokens``) can be anything.
Parsing never raises: it returns either an Action or the reason there is none,
and the episode charges a format penalty for the latter.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from aflow_rl.envs.swarm.profiles import PROFILE_NAMES
from aflow_rl.envs.swarm.tools import TOOLS

ACTIONS = ("spawn", "assign", "join", "tool_call", "replan", "finish", "solve")
REPLAN_SCOPES = ("failed", "remaining", "all")
MAX_SPAWN = 64  # per action; the runtime's concurrency cap is usually lower and checked there
MAX_VALUE_CHARS = 32  # narrowed schema: longest answer value (the knowledge base's longest is 12 characters)


def _variant(name: str, props: dict, required: list[str]) -> dict:
    return {"type": "object", "properties": {"action": {"type": "string", "enum": [name]}, **props},
            "required": ["action", *required], "additionalProperties": False}


_TOOL_ARGS = {"type": "object",
              "properties": {a: {"type": "string"} for tool in TOOLS for a in TOOLS[tool]},
              "additionalProperties": False}

ACTION_SCHEMA: dict = {"anyOf": [
    _variant("spawn", {"n": {"type": "integer", "minimum": 1, "maximum": MAX_SPAWN},
                       "profile": {"type": "string", "enum": list(PROFILE_NAMES)},
                       "subtasks": {"type": "array", "items": {"type": "string"}}},
             ["n", "profile", "subtasks"]),
    _variant("assign", {"subagent": {"type": "integer", "minimum": 0}, "subtask": {"type": "string"}},
             ["subagent", "subtask"]),
    _variant("join", {"ids": {"type": "array", "items": {"type": "integer", "minimum": 0}}}, ["ids"]),
    _variant("tool_call", {"tool": {"type": "string", "enum": list(TOOLS)}, "args": _TOOL_ARGS},
             ["tool", "args"]),
    _variant("replan", {"scope": {"type": "string", "enum": list(REPLAN_SCOPES)}}, ["scope"]),
    _variant("finish", {"answer": {"anyOf": [{"type": "string"},
                                             {"type": "object", "additionalProperties": {"type": "string"}}]}},
             ["answer"]),
]}
_SOLVE = _variant("solve", {"subtask": {"type": "string"}}, ["subtask"])
ACTION_SCHEMA_SOLVE: dict = {"anyOf": [*ACTION_SCHEMA["anyOf"][:-1], _SOLVE, ACTION_SCHEMA["anyOf"][-1]]}

def _depths(items: list[dict]) -> dict[str, int]:
    """Dependency depth of each item id (0: no dependencies)."""
    depth: dict[str, int] = {}
    by_id = {it["id"]: it for it in items}

    def d(i: str) -> int:
        if i not in depth:
            depth[i] = 1 + max((d(x) for x in by_id[i].get("deps", [])), default=-1)
        return depth[i]

    for i in by_id:
        d(i)
    return depth


def _live(view: dict) -> set[str]:
    """Items a subtask is working on or has answered, or the orchestrator solved."""
    return {st["item"] for st in view.get("subtasks", []) if st["status"] in ("queued", "done")} | set(
        view.get("results", {}))


def _unplanned(view: dict) -> list[str]:
    """Items nothing is working on and nobody answered, in dependency order (stable within a depth)."""
    depth, live = _depths(view["items"]), _live(view)
    return sorted((it["id"] for it in view["items"] if it["id"] not in live), key=lambda i: depth[i])


def _own_budget(view: dict) -> int:
    """Tool steps the orchestrator can still take itself: the fewer of its tool calls and turns left."""
    calls_left = view.get("max_tool_calls", 1 << 30) - view.get("tool_calls", 0)
    turns_left = view.get("max_steps", 1 << 30) - view.get("step", 0)
    return min(calls_left, turns_left)


def _ready(view: dict) -> list[str]:
    """What solve can work on: items whose inputs are known, whose answer is not, and whose
    lookups fit the orchestrator's tool calls and turns left (``runtime._do_solve``'s rule)."""
    known, budget = view.get("results", {}), _own_budget(view)
    need = lambda it: 1 if "op" in it else len(it.get("path", ()))  # noqa: E731 - tasks.tool_steps
    return [it["id"] for it in view["items"] if it["id"] not in known and all(d in known for d in it.get("deps", []))
            and need(it) <= budget]


def _delegable(view: dict, delegate_ops: bool = True) -> list[str]:
    """The unplanned items a spawn may hand out. Without ``delegate_ops``, an ``op`` item (a sum of
    other items' answers) stays with the orchestrator while it has a tool call and a turn left:
    its own solve computes it with one calc once the inputs are in, where a subagent costs a spawn,
    another wave and a join for the same calc."""
    todo = _unplanned(view)
    if delegate_ops or _own_budget(view) < 1:
        return todo
    ops = {it["id"] for it in view["items"] if "op" in it}
    return [i for i in todo if i not in ops]


def _level_prefixes(view: dict, todo: list[str]) -> dict:
    """Spawn's subtasks under ``effective``: the items ``todo`` (delegable, in dependency order) of the
    first L dependency levels, L >= 1, in order (each option an exact array)."""
    depth = _depths(view["items"])
    options = [todo[:k] for k in range(1, len(todo) + 1) if k == len(todo) or depth[todo[k]] != depth[todo[k - 1]]]
    arrays = [{"type": "array", "prefixItems": [{"const": i} for i in o], "items": False, "minItems": len(o)}
              for o in options]
    return arrays[0] if len(arrays) == 1 else {"anyOf": arrays}


def _effective_variants(view: dict, delegate_ops: bool = True) -> dict[str, dict | None]:
    """spawn / assign / join / replan restricted to what changes the state (None: not offered)."""
    todo, live, delegable = _unplanned(view), _live(view), _delegable(view, delegate_ops)
    items = {it["id"]: it for it in view["items"]}
    active = [g["id"] for g in view.get("subagents", []) if not g.get("retired")]
    agent_id = {"type": "integer", "enum": active}
    plannable = [i for i in todo if all(d in live for d in items[i].get("deps", []))]
    latest = {st["item"]: st["status"] for st in view.get("subtasks", [])}
    failed = any(latest[i] in ("failed", "skipped") for i in todo if i in latest)
    queued = any(g.get("queue") for g in view.get("subagents", []))
    scopes = (["failed"] if failed else []) + (["remaining", "all"] if queued else [])
    return {
        "spawn": _level_prefixes(view, delegable) if delegable else None,
        "assign": {"subagent": agent_id, "subtask": {"type": "string", "enum": plannable}}
        if active and plannable else None,
        "join": {"ids": {"type": "array", "items": agent_id, "maxItems": len(active)}} if queued else None,
        "replan": {"scope": {"type": "string", "enum": scopes}} if scopes else None,
    }


def _one_per_item_spawns(view: dict, spawn: dict, *, width_n: bool = False) -> list[dict]:
    """Spawn variants of ``no_duplicate``: one per dependency-level option, each with at most
    one subagent per delegated item (a subagent beyond that would idle).

    ``width_n`` fixes ``n`` to the option's widest dependency level (capped): one subagent per
    item that can run at once. Fewer serialise a level, more idle, so it is the one ``n``
    that neither adds critical steps nor spawns waste."""
    depth = _depths(view["items"])
    options = spawn["subtasks"].get("anyOf", [spawn["subtasks"]])
    out = []
    for o in options:
        cap = min(spawn["n"]["maximum"], o["minItems"])
        if width_n:
            levels = [depth[p["const"]] for p in o["prefixItems"]]
            n = {"type": "integer", "enum": [min(cap, max(levels.count(d) for d in set(levels)))]}
        else:
            n = {**spawn["n"], "maximum": cap}
        out.append(_variant("spawn", {**spawn, "n": n, "subtasks": o}, list(spawn)))
    return out


def action_schema_for(view: dict, *, effective: bool = False, no_duplicate: bool = False,
                      spawn_n: str = "choose", spawn_profile: str = "choose", auto_answer: bool = False,
                      delegate_ops: bool = True) -> dict:
    """ACTION_SCHEMA narrowed to the current state: item ids are the task's, subagent
    ids the ones that exist, ``n`` at most the concurrency cap; ``solve`` (on the items
    whose inputs are known and whose answer is not) only when ``view["solve"]`` says
    the environment offers it.

    With ``solve`` offered, raw ``tool_call`` is left out (solve makes the same
    lookups, item by item, and a free-text argument is where a small policy
    loses its token budget); answer values are at most ``MAX_VALUE_CHARS`` long.

    ``effective`` (``env.swarm.effective_actions``) admits only actions that change
    the state: spawn delegates whole dependency levels of the unplanned items, in
    order (the first L levels, L >= 1: a small policy chooses how much to delegate
    instead of spelling out or repeating ids); assign only an unplanned item whose
    inputs are live; join only while work is queued; replan only on failed or
    queued work. Once every item is answered and nothing runs, finish is the only
    action left.

    The grammar then only admits actions that name real things, so a small or
    untrained policy explores decompositions instead of inventing ids; the same
    schema string travels in the Turn, so the trainer rebuilds the same masks.

    ``no_duplicate`` (with ``effective``; ``env.swarm.no_duplicate_work``) also leaves out
    work that duplicates work already delegated: solve only on items no subagent holds or
    answered, and spawn at most one subagent per delegated item.

    ``spawn_n="width"`` (with ``no_duplicate``; ``env.swarm.spawn_n``) fixes a spawn's ``n``
    to the widest dependency level it delegates; ``spawn_profile`` other than ``"choose"``
    (``env.swarm.spawn_profile``) fixes its profile. Both take a choice away whose wrong
    values only lose (an idle or serialised subagent, a profile that errs), so that the
    policy's exploration goes to the decisions that depend on the task: delegate or
    solve, and how many dependency levels.

    ``delegate_ops=False`` (with ``effective``; ``env.swarm.delegate_ops``) keeps ``op`` items
    (sums) out of spawns while the orchestrator can still compute them itself: ``_delegable``.

    ``auto_answer`` (``env.swarm.auto_answer``: what subagents and solves found is the
    answer, finish's entries only fill gaps) leaves the answered items out of finish's
    answer: an entry for one would be overwritten, and a greedy small policy spells such
    entries out to the length limit, past ``max_new_tokens``.
    """
    items = [it["id"] for it in view["items"]]
    agents = len(view.get("subagents", []))
    item = {"type": "string", "enum": items}
    agent_id = {"type": "integer", "minimum": 0, "maximum": max(agents - 1, 0)}
    n = {"type": "integer", "minimum": 1, "maximum": max(1, int(view["max_concurrent"]))}
    value = {"type": "string", "maxLength": MAX_VALUE_CHARS}
    if effective:
        props = _effective_variants(view, delegate_ops)
    else:
        props = {"spawn": {"subtasks": {"type": "array", "items": item, "minItems": 1, "maxItems": len(items)}},
                 "assign": {"subagent": agent_id, "subtask": item} if agents else None,
                 "join": {"ids": {"type": "array", "items": agent_id, "maxItems": agents}},
                 "replan": {"scope": {"type": "string", "enum": list(REPLAN_SCOPES)}}}
    if props["spawn"] is not None:
        subtasks = props["spawn"]["subtasks"] if "subtasks" in props["spawn"] else props["spawn"]
        profiles = list(PROFILE_NAMES) if spawn_profile == "choose" else [spawn_profile]
        props["spawn"] = {"n": n, "profile": {"type": "string", "enum": profiles}, "subtasks": subtasks}
    if not view.get("solve"):  # solve does the orchestrator's own lookups item by item; raw calls add nothing
        props["tool_call"] = {"tool": {"type": "string", "enum": list(TOOLS)}, "args": _TOOL_ARGS}
    ready = _ready(view) if view.get("solve") else []
    lean = no_duplicate and effective
    if lean:
        ready = [i for i in ready if i not in _live(view)]
    props["solve"] = {"subtask": {"type": "string", "enum": ready}} if ready else None
    open_items = [i for i in items if i not in view.get("results", {})] if auto_answer else items
    props["finish"] = {"answer": {"type": "object", "properties": {i: value for i in open_items},
                                  "additionalProperties": False}}
    order = ("spawn", "assign", "join", "tool_call", "replan", "solve", "finish")
    variants = []
    for k in order:
        if props.get(k) is None:
            continue
        if k == "spawn" and lean:
            variants.extend(_one_per_item_spawns(view, props[k], width_n=spawn_n == "width"))
        else:
            variants.append(_variant(k, props[k], list(props[k])))
    return {"anyOf": variants}


_FIELDS = {"spawn": {"n", "profile", "subtasks"}, "assign": {"subagent", "subtask"}, "join": {"ids"},
           "tool_call": {"tool", "args"}, "replan": {"scope"}, "finish": {"answer"}, "solve": {"subtask"}}


@dataclass(frozen=True)
class Action:
    """A well-formed action; which fields are set depends on ``kind``."""

    kind: str
    n: int = 0
    profile: str = ""
    subtasks: tuple[str, ...] = ()
    subagent: int = -1
    subtask: str = ""
    ids: tuple[int, ...] = ()
    tool: str = ""
    args: dict = field(default_factory=dict)
    scope: str = ""
    answer: Any = None

    def to_json(self) -> str:
        """The canonical JSON of this action (what a baseline policy emits)."""
        body: dict[str, Any] = {"action": self.kind}
        for name in sorted(_FIELDS[self.kind], key=["n", "profile", "subtasks", "subagent", "subtask", "ids",
                                                     "tool", "args", "scope", "answer"].index):
            value = getattr(self, name)
            body[name] = list(value) if isinstance(value, tuple) else value
        return json.dumps(body)


@dataclass(frozen=True)
class Parsed:
    """``action`` when the text was a valid action, else ``error`` says what was wrong."""

    action: Action | None
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.action is not None


def first_json_object(text: str) -> Any:
    """The first JSON value that starts at a ``{`` in ``text`` (models like to add prose around it)."""
    decoder = json.JSONDecoder()
    start = text.find("{")
    while start != -1:
        try:
            return decoder.raw_decode(text, start)[0]
        except json.JSONDecodeError:
            start = text.find("{", start + 1)
    raise ValueError("no JSON object in the text")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _nonempty_str(x: Any) -> bool:
    return isinstance(x, str) and bool(x.strip())


def _check(body: dict) -> Action:
    """Build the Action of a decoded object or raise ValueError naming the problem."""
    kind = body.get("action")
    if kind not in ACTIONS:
        raise ValueError(f"'action' must be one of {', '.join(ACTIONS)}, got {kind!r}")
    extra = set(body) - _FIELDS[kind] - {"action"}
    if extra:
        raise ValueError(f"{kind}: unknown field(s) {', '.join(sorted(extra))}")
    missing = _FIELDS[kind] - set(body)
    if missing:
        raise ValueError(f"{kind}: missing field(s) {', '.join(sorted(missing))}")
    if kind == "spawn":
        n, profile, subtasks = body["n"], body["profile"], body["subtasks"]
        if not _is_int(n) or not 1 <= n <= MAX_SPAWN:
            raise ValueError(f"spawn: n must be an integer in 1..{MAX_SPAWN}, got {n!r}")
        if profile not in PROFILE_NAMES:
            raise ValueError(f"spawn: profile must be one of {', '.join(PROFILE_NAMES)}, got {profile!r}")
        if not isinstance(subtasks, list) or not all(_nonempty_str(s) for s in subtasks):
            raise ValueError("spawn: subtasks must be a list of item ids (strings)")
        return Action(kind, n=n, profile=profile, subtasks=tuple(s.strip() for s in subtasks))
    if kind == "solve":
        if not _nonempty_str(body["subtask"]):
            raise ValueError("solve: subtask must be an item id (string)")
        return Action(kind, subtask=body["subtask"].strip())
    if kind == "assign":
        if not _is_int(body["subagent"]) or body["subagent"] < 0:
            raise ValueError(f"assign: subagent must be a subagent id (integer >= 0), got {body['subagent']!r}")
        if not _nonempty_str(body["subtask"]):
            raise ValueError("assign: subtask must be an item id (string)")
        return Action(kind, subagent=body["subagent"], subtask=body["subtask"].strip())
    if kind == "join":
        ids = body["ids"]
        if not isinstance(ids, list) or not all(_is_int(i) and i >= 0 for i in ids):
            raise ValueError("join: ids must be a list of subagent ids (integers >= 0)")
        return Action(kind, ids=tuple(ids))
    if kind == "tool_call":
        tool, args = body["tool"], body["args"]
        if tool not in TOOLS:
            raise ValueError(f"tool_call: tool must be one of {', '.join(TOOLS)}, got {tool!r}")
        if not isinstance(args, dict):
            raise ValueError("tool_call: args must be an object")
        bad = [a for a in TOOLS[tool] if not _nonempty_str(args.get(a))]
        if bad or set(args) - set(TOOLS[tool]):
            raise ValueError(f"tool_call: {tool} takes exactly the string args {', '.join(TOOLS[tool])}")
        return Action(kind, tool=tool, args={a: args[a] for a in TOOLS[tool]})
    if kind == "replan":
        if body["scope"] not in REPLAN_SCOPES:
            raise ValueError(f"replan: scope must be one of {', '.join(REPLAN_SCOPES)}, got {body['scope']!r}")
        return Action(kind, scope=body["scope"])
    answer = body["answer"]
    if isinstance(answer, dict):
        if not all(isinstance(v, (str, int, float)) and not isinstance(v, bool) for v in answer.values()):
            raise ValueError("finish: answer values must be strings or numbers")
        return Action(kind, answer={str(k): str(v) for k, v in answer.items()})
    if isinstance(answer, (str, int, float)) and not isinstance(answer, bool):
        return Action(kind, answer=str(answer))
    raise ValueError("finish: answer must be a string or an object {item_id: value}")


def parse_action(text: Any) -> Parsed:
    """Parse one orchestrator turn. Never raises; an invalid turn gives ``Parsed(None, error)``."""
    try:
        if not isinstance(text, str) or not text.strip():
            return Parsed(None, "empty turn: expected one JSON action")
        try:
            body = json.loads(text)
        except json.JSONDecodeError:
            body = first_json_object(text)
        if not isinstance(body, dict):
            return Parsed(None, f"expected a JSON object, got {type(body).__name__}")
        return Parsed(_check(body))
    except (ValueError, TypeError, RecursionError) as exc:
        return Parsed(None, str(exc) or type(exc).__name__)
    except Exception as exc:  # a parser bug must cost a penalty, not the episode
        return Parsed(None, f"unparseable action ({type(exc).__name__}: {exc})")
