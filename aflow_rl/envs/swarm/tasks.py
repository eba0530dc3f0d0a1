"""Seeded swarm tasks over the local knowledge base, and their item-level scoring.

Three suites, after the wide/deep split of Kimi K2.5's Agent Swarm evaluation:

- ``wide``: N independent items, each a short multi-hop lookup ("the
  population of the capital of Arvenia"). Embarrassingly parallel: one
  subagent per item is the obvious decomposition.
- ``deep``: a chain of N dependent hops; hop k starts from the answer of hop
  k-1. Parallelism cannot help; spawning only adds overhead.
- ``mixed``: two or three chains that run side by side, then one aggregate item
  that sums their ends (fan-out, then fan-in).

A task is a JSON-safe dict (the contract of ``aflow_rl.rollout.types``)::

    {"task_id", "suite", "seed", "kb_seed",
     "items": [{"id", "question", "deps", "start" | "ref", "path"} | {"id", "question", "deps", "op"}],
     "gold": {item_id: value}}

``start`` names the entity an item starts from, ``ref`` the item whose answer
it starts from, ``path`` the attributes to follow; an ``op`` item (``sum``)
combines the answers of its ``deps``. An answer is a dict ``{item_id: value}``;
it is scored per item (item_f1) and as a whole (pass@1).
"""
from __future__ import annotations

import hashlib
import random
import re
from typing import Any

from aflow_rl.envs.swarm.kb import LABELS, NUMBERS, RELATIONS, KnowledgeBase, build_kb
from aflow_rl.envs.swarm.tools import calc, format_number

SUITES = ("wide", "deep", "mixed")
WIDE_PATH_LENGTHS = (2, 3)       # lookups per wide item
MIXED_FIRST_PATH_LENGTHS = (1, 2)  # lookups of the first hop of a mixed chain


def stable_seed(*parts: Any) -> int:
    """A 63-bit seed from any printable parts; unlike hash() it is the same in every process."""
    digest = hashlib.sha256("/".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


# ---------------------------------------------------------------------------
# Items
# ---------------------------------------------------------------------------


def tool_steps(item: dict) -> int:
    """Tool calls a perfect solver needs for ``item``: one lookup per path step, one calc for an op."""
    return 1 if "op" in item else len(item["path"])


def resolve_item(kb: KnowledgeBase, item: dict, inputs: dict[str, str]) -> str:
    """Answer ``item`` from the knowledge base given its dependencies' answers ``inputs``.

    Raises KeyError (an entity or attribute that does not exist, e.g. because an
    input was wrong) or ValueError (a non-numeric input to a sum).
    """
    if "op" in item:
        values = [inputs[d] for d in item["deps"]]
        if not all(re.fullmatch(r"-?\d+(\.\d+)?", v.strip()) for v in values):
            raise ValueError(f"sum needs numbers, got {values}")
        return calc(" + ".join(v.strip() for v in values))
    value = item["start"] if "start" in item else inputs[item["ref"]]
    for attr in item["path"]:
        value = kb.lookup(value, attr)
    return value


def topological_order(items: list[dict]) -> list[dict]:
    """Items sorted so that every item comes after its dependencies (stable otherwise)."""
    depth = item_depths(items)
    return sorted(items, key=lambda it: depth[it["id"]])


def item_depths(items: list[dict]) -> dict[str, int]:
    """Dependency depth of each item: 0 for items without dependencies."""
    by_id = {it["id"]: it for it in items}
    depth: dict[str, int] = {}

    def d(i: str) -> int:
        if i not in depth:
            depth[i] = 1 + max((d(x) for x in by_id[i]["deps"]), default=-1)
        return depth[i]

    for it in items:
        d(it["id"])
    return depth


def task_width(items: list[dict]) -> int:
    """Most items at one dependency depth: how many subagents can usefully work at once."""
    counts: dict[int, int] = {}
    for v in item_depths(items).values():
        counts[v] = counts.get(v, 0) + 1
    return max(counts.values(), default=0)


def _phrase(start: str, path: list[str]) -> str:
    out = start
    for attr in path:
        out = f"the {LABELS[attr]} of {out}"
    return out


def _walk(rng: random.Random, kb: KnowledgeBase, kind: str, length: int, numeric_end: bool) -> list[str]:
    """Attributes of a random walk of ``length`` steps from an entity of type ``kind``."""
    path = []
    for k in range(length):
        last = k == length - 1
        if last and numeric_end:
            path.append(rng.choice(sorted(NUMBERS[kind])))
        else:
            attr = rng.choice(sorted(RELATIONS[kind]))
            path.append(attr)
            kind = RELATIONS[kind][attr]
    return path


def _lookup_item(item_id: str, start: str | None, ref: str | None, path: list[str]) -> dict:
    if start is not None:
        question = f"What is {_phrase(start, path)}?"
        return {"id": item_id, "question": question, "deps": [], "start": start, "path": path}
    question = f"What is {_phrase('the answer to ' + ref, path)}?"
    return {"id": item_id, "question": question, "deps": [ref], "ref": ref, "path": path}


def _kind_after(start_kind: str, path: list[str]) -> str:
    kind = start_kind
    for attr in path:
        kind = RELATIONS[kind][attr]
    return kind


# ---------------------------------------------------------------------------
# Suites
# ---------------------------------------------------------------------------


def _wide(rng: random.Random, kb: KnowledgeBase, n: int) -> list[dict]:
    names = sorted(kb.types)
    starts = rng.sample(names, n)
    items = []
    for i, start in enumerate(starts):
        length = rng.choice(WIDE_PATH_LENGTHS)
        path = _walk(rng, kb, kb.types[start], length, numeric_end=rng.random() < 0.6)
        items.append(_lookup_item(f"w{i}", start, None, path))
    return items


def _deep(rng: random.Random, kb: KnowledgeBase, n: int) -> list[dict]:
    start = rng.choice(sorted(kb.types))
    path = _walk(rng, kb, kb.types[start], n, numeric_end=True)
    items = [_lookup_item("h0", start, None, path[:1])]
    for k in range(1, n):
        items.append(_lookup_item(f"h{k}", None, f"h{k - 1}", path[k:k + 1]))
    return items


def _mixed(rng: random.Random, kb: KnowledgeBase, n: int) -> list[dict]:
    n = max(n, 3)
    chains = 2 if n < 6 else 3
    lengths = [(n - 1) // chains + (1 if c < (n - 1) % chains else 0) for c in range(chains)]
    starts = rng.sample(sorted(kb.types), chains)
    items: list[dict] = []
    ends = []
    for c, (start, hops) in enumerate(zip(starts, lengths)):
        kind = kb.types[start]
        prev = None
        for k in range(hops):
            last = k == hops - 1
            steps = rng.choice(MIXED_FIRST_PATH_LENGTHS) if k == 0 else 1
            path = _walk(rng, kb, kind, steps, numeric_end=last)
            item_id = f"c{c}h{k}"
            items.append(_lookup_item(item_id, start if k == 0 else None, prev, path))
            if not last:
                kind = _kind_after(kind, path)
            prev = item_id
        ends.append(prev)
    listed = ", ".join(ends[:-1]) + " and " + ends[-1]
    items.append({"id": "sum", "question": f"What is the sum of the answers to {listed}?",
                  "deps": list(ends), "op": "sum"})
    return items


_GENERATORS = {"wide": _wide, "deep": _deep, "mixed": _mixed}


def generate_task(suite: str, seed: int, *, min_items: int = 3, max_items: int = 6, kb_seed: int = 0,
                  task_id: str | None = None) -> dict:
    """One task of ``suite``; the same arguments give the same dict."""
    if suite not in _GENERATORS:
        raise ValueError(f"unknown suite {suite!r}; choose one of {', '.join(SUITES)}")
    kb = build_kb(kb_seed)
    rng = random.Random(stable_seed("swarm-task", suite, seed))
    items = _GENERATORS[suite](rng, kb, rng.randint(min_items, max_items))
    gold: dict[str, str] = {}
    for item in topological_order(items):
        gold[item["id"]] = resolve_item(kb, item, gold)
    return {"task_id": task_id or f"{suite}-{seed}", "suite": suite, "seed": int(seed), "kb_seed": int(kb_seed),
            "items": items, "gold": gold}


def suite_items(sw: Any, suite: str) -> tuple[int, int]:
    """(min, max) items of ``suite``: ``env.swarm.item_range[suite]`` or min_items..max_items."""
    lo, hi = sw.item_range.get(suite, (sw.min_items, sw.max_items))
    return int(lo), int(hi)


def curriculum_stage(sw: Any, step: int | None) -> list[tuple[str, int, int]]:
    """The suites drawn at optimizer step ``step`` and their (min, max) items.

    ``env.swarm.mix`` (or ``suite`` alone) lists the suites; suite k joins at
    ``curriculum[k]``; a suite's most items grow linearly from its min to its max
    over ``items_ramp_steps`` steps after it joins. ``step=None`` (evaluation,
    fixed task sets): every suite, full ranges.
    """
    suites = list(sw.mix) or [sw.suite]
    starts = list(sw.curriculum) or [0] * len(suites)
    out = []
    for suite, start in zip(suites, starts):
        lo, hi = suite_items(sw, suite)
        if step is not None:
            if step < start:
                continue
            if sw.items_ramp_steps > 0:
                hi = lo + int((hi - lo) * min(1.0, (step - start + 1) / sw.items_ramp_steps))
        out.append((suite, lo, hi))
    return out


def make_tasks(cfg: Any, n: int, seed: int, *, position: int | None = None) -> list[dict]:
    """``n`` swarm tasks (the trainer's entry point); ``env.swarm`` picks suites and sizes.

    ``cfg`` is the full Config.
    ``position`` (tasks drawn so far, passed by the trainer's TaskSampler) places
    the draw on the curriculum: optimizer step ``position // rollout.tasks_per_step``.
    """
    sw = cfg.env.swarm
    step = None if position is None else position // max(1, cfg.rollout.tasks_per_step)
    stage = curriculum_stage(sw, step)
    tasks = []
    for i in range(n):
        task_seed = stable_seed(seed, i) % (2 ** 31)
        # One suite alone keeps the draw (and task ids) of the single-suite environment.
        # A balanced draw stratifies by suite: a random one gives some steps 3 deep tasks of 4, and
        # that imbalance moves the first action of every suite together (docs/benchmarks.md).
        if len(stage) == 1:
            k = 0
        elif sw.draw == "balanced" and position is not None:
            k = (position + i) % len(stage)
        else:
            k = stable_seed("suite", seed, i) % len(stage)
        suite, lo, hi = stage[k]
        tasks.append(generate_task(suite, task_seed, min_items=lo, max_items=hi, kb_seed=sw.kb_seed,
                                   task_id=f"{suite}-{seed}-{i}"))
    return tasks


# ---------------------------------------------------------------------------
# Scoring
# ---------------------------------------------------------------------------


def normalize(value: Any) -> str:
    """Canonical answer text: case, spaces, thousands separators and a trailing .0 do not matter."""
    text = str(value).strip().lower().rstrip(".")
    compact = text.replace(",", "").replace(" ", "")
    if re.fullmatch(r"-?\d+(\.\d+)?", compact):
        return format_number(float(compact))
    return " ".join(text.split())


def as_answer_dict(task: dict, answer: Any) -> dict[str, str]:
    """An answer as ``{item_id: text}``; a bare string answers the task's last item."""
    if answer is None:
        return {}
    if isinstance(answer, dict):
        return {str(k): str(v) for k, v in answer.items() if v is not None and str(v).strip()}
    return {task["items"][-1]["id"]: str(answer)} if str(answer).strip() else {}


def item_f1(task: dict, answer: Any) -> float:
    """F1 over items: precision over the items answered, recall over the task's items."""
    pred = as_answer_dict(task, answer)
    gold = task["gold"]
    if not pred or not gold:
        return 0.0
    tp = sum(1 for k, v in pred.items() if k in gold and normalize(v) == normalize(gold[k]))
    if tp == 0:
        return 0.0
    precision, recall = tp / len(pred), tp / len(gold)
    return 2 * precision * recall / (precision + recall)


def pass_at_1(task: dict, answer: Any) -> float:
    """1.0 when every item is answered correctly (and nothing else is claimed), else 0.0."""
    return float(item_f1(task, answer) == 1.0)
