"""What the orchestrator sees each turn: a text for the model, a structured view for baselines.

The observation is a complete summary of the state (Markov), not a growing
chat transcript: the model's prompt is the system prompt plus this text, so
prompt length grows only with what the episode has learned (results, tool
results), as an orchestrator's context does.

``anchor_key`` is the GiGPO anchor state (arXiv 2505.10978): a hash of the
task and of what is known and running, leaving out budget counters and the
last outcome, so that two trajectories of a task group that reach the same
state at different step counts share one step group.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from aflow_rl.envs.swarm.tools import TOOL_HELP

if TYPE_CHECKING:
    from aflow_rl.envs.swarm.runtime import SwarmRuntime

SYSTEM_PROMPT = (
    "You are the orchestrator of a swarm of subagents. Answer every item of the task.\n"
    "Reply with exactly one JSON action per turn:\n"
    '{"action":"spawn","n":N,"profile":"small|medium|large","subtasks":["<item id>",...]}'
    " starts N subagents; the subtasks are shared out round-robin\n"
    '{"action":"assign","subagent":ID,"subtask":"<item id>"} gives a subagent one more item\n'
    '{"action":"join","ids":[ID,...]} runs those subagents ([] = all) and collects their results\n'
    '{"action":"tool_call","tool":"lookup","args":{"entity":"...","attribute":"..."}} or '
    '{"action":"tool_call","tool":"calc","args":{"expr":"..."}} does one step yourself\n'
    '{"action":"replan","scope":"failed|remaining|all"} re-runs failed items | cancels queued work | '
    "also retires every subagent\n"
    '{"action":"finish","answer":{"<item id>":"<value>",...}} ends the episode\n'
    "An item that needs another item's answer may be spawned together with it. Subagents run in "
    "parallel; small ones are fast and cheap but less reliable, large ones slow, costly and reliable.")

_MAX_NOTES = 24  # most recent tool results shown; older ones are summarised by count


@dataclass
class Observation:
    text: str
    anchor_key: str
    view: dict = field(default_factory=dict)


def shape_line(task: dict, rt: "SwarmRuntime") -> str:
    """``Shape: width W depth D lookups L tools left K``: the task graph's parallelism and the
    orchestrator's own remaining budget, in a few tokens."""
    from aflow_rl.envs.swarm.tasks import item_depths, task_width, tool_steps

    depth = 1 + max(item_depths(task["items"]).values(), default=-1)
    lookups = sum(tool_steps(it) for it in task["items"])
    return (f"Shape: width {task_width(task['items'])} depth {depth} lookups {lookups} "
            f"tools left {rt.budgets.max_tool_calls - rt.tool_calls}")


def graph_line(task: dict) -> str:
    """``Graph: parallel`` (one dependency level), ``Graph: serial`` (a single chain) or
    ``Graph: parallel then serial`` (several chains joined later), derived from the items'
    dependencies alone. The words are single tokens of the tiny tokenizer, where the Shape
    line's numbers are one digit among thirty character tokens: a 2-layer policy reads a
    word placed just before its answer far more easily. It says no more than the bandit
    baseline's context (the suite name) already tells that baseline."""
    from aflow_rl.envs.swarm.tasks import item_depths, task_width

    depth = 1 + max(item_depths(task["items"]).values(), default=-1)
    if depth <= 1:
        return "Graph: parallel"
    return "Graph: serial" if task_width(task["items"]) <= 1 else "Graph: parallel then serial"


def public_items(task: dict) -> list[dict]:
    """The task's items as a policy may see them (no gold answers)."""
    return [dict(it) for it in task["items"]]


COMPACT_SYSTEM_PROMPT = "Orchestrate subagents to answer every item. One JSON action per turn."


def render(task: dict, rt: "SwarmRuntime", *, mailbox: list[dict], last: dict | None,
           compact: bool = False, shape: bool = False, graph: bool = False) -> Observation:
    """Observation of ``rt`` before the orchestrator's next turn.

    ``compact`` keeps only the state (items and their dependencies, subagents,
    subtask statuses, known answers, turn budget): a fifth of the tokens, for
    small policies whose action grammar already says what they may do.
    ``shape`` (with ``compact``) adds one line with what decides between serial
    and parallel work: the task's width (most items at one dependency depth),
    its depth (dependency levels), the lookups its items need, and the
    orchestrator's own tool calls left. ``graph`` (with ``compact``) ends the text with
    ``graph_line``: the same structure as one or three words, last, next to the answer.
    """
    results = rt.results()
    items = public_items(task)
    b = rt.budgets
    view: dict[str, Any] = {
        "task_id": task["task_id"], "episode_id": str(task.get("episode_id", task["task_id"])),
        "suite": task.get("suite", ""), "items": items,
        "step": rt.steps, "max_steps": b.max_steps, "tool_calls": rt.tool_calls,
        "max_tool_calls": b.max_tool_calls, "tokens": rt.tokens_in + rt.tokens_out,
        "max_tokens": b.max_tokens, "max_concurrent": b.max_concurrent, "solve": rt.solve_enabled,
        "compact": compact,
        "subagents": [{"id": g.id, "profile": g.profile, "retired": g.retired,
                       "queue": [rt.subtasks[s].item for s in g.queue]} for g in rt.subagents],
        "subtasks": [{"id": st.id, "item": st.item, "subagent": st.subagent, "status": st.status,
                      "answer": st.answer, "attempts": st.attempts} for st in rt.subtasks.values()],
        "results": results, "notes": list(rt.notes), "mailbox": mailbox, "last": last or {},
    }

    state = [f"Task {task['task_id']} ({view['suite']}): answer every item.", "Items:"]
    for it in items:
        needs = f" (needs {', '.join(it['deps'])})" if it["deps"] else ""
        state.append(f"- {it['id']}{needs}: {it['question']}")
    if rt.subagents:
        state.append("Subagents: " + "; ".join(
            f"#{g.id} {g.profile}{' retired' if g.retired else ''}"
            + (f" queued {','.join(rt.subtasks[s].item for s in g.queue)}" if g.queue else " idle")
            for g in rt.subagents))
    if rt.subtasks:
        state.append("Subtasks: " + "; ".join(f"{st.item}@#{st.subagent} {st.status}" for st in rt.subtasks.values()))
    state.append("Known answers: " + (", ".join(f"{k}={v}" for k, v in sorted(results.items())) or "none"))
    if rt.notes:
        shown = rt.notes[-_MAX_NOTES:]
        older = len(rt.notes) - len(shown)
        state.append("Your tool results" + (f" ({older} older omitted)" if older else "") + ": " + "; ".join(
            f"{n['tool']}({', '.join(n['args'].values())}) = {n['result']}" for n in shown))
    anchor = hashlib.sha1("\n".join(state).encode()).hexdigest()[:16]

    lines = list(state)
    if mailbox:
        lines.append("New messages: " + "; ".join(
            f"{m['item']} {m['status']} by #{m['subagent']}"
            + (f": {m['answer']}" if m["status"] == "done" else f" ({m['error']})" if m["error"] else "")
            for m in mailbox))
    if last:
        lines.append(f"Last action: {last.get('action', '')[:200]} -> "
                     + (f"invalid: {last['error']}" if last.get("error") else str(last.get("outcome", ""))[:300]))
    lines.append("Tools: " + "; ".join(TOOL_HELP.values()) + ".")
    lines.append(f"Budget: turn {rt.steps + 1} of {b.max_steps}, tool calls {rt.tool_calls} of {b.max_tool_calls}, "
                 f"tokens {rt.tokens_in + rt.tokens_out} of {b.max_tokens}, at most {b.max_concurrent} "
                 f"subagents at once.")
    if compact:
        lines = ["Items: " + " ".join(it["id"] + (f"<{','.join(it['deps'])}" if it["deps"] else "") for it in items)]
        if rt.subagents:
            lines.append("Subagents: " + " ".join(f"#{g.id}:{len(g.queue)}" for g in rt.subagents))
        if rt.subtasks:
            lines.append("Subtasks: " + " ".join(f"{st.item}={st.status}" for st in rt.subtasks.values()))
        lines.append("Known: " + (" ".join(sorted(results)) or "none"))
        lines.append(f"Turn {rt.steps + 1}/{b.max_steps}")
        if shape:
            lines.append(shape_line(task, rt))
        if graph:
            lines.append(graph_line(task))
    return Observation(text="\n".join(lines), anchor_key=anchor, view=view)
