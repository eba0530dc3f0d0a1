"""Plan/Act tasks: reasoning-gym problems (``env.plan_act.dataset``) and reasoning-gym's own scorer."""
from __future__ import annotations

import functools
import json
from typing import Any


@functools.lru_cache(maxsize=32)
def _dataset(name: str, seed: int, size: int) -> Any:
    """One reasoning-gym dataset per (name, seed, size) and process; entries are generated on demand."""
    import reasoning_gym  # heavy import, only where plan_act runs

    return reasoning_gym.create_dataset(name, size=size, seed=seed)


def _json_safe(value: Any) -> Any:
    """Metadata may hold tuples or odd types; tasks must survive JSON (traces, dask)."""
    return json.loads(json.dumps(value, default=str))


def make_tasks(cfg: Any, n: int, seed: int) -> list[dict]:
    """``n`` JSON-safe task dicts from the reasoning-gym dataset ``cfg.env.plan_act.dataset``.

    Each carries the dataset name, seed, size and index (which regenerate the
    entry) and the entry itself (question, answer, metadata) for scoring. The
    same seed gives the same tasks.
    """
    name = cfg.env.plan_act.dataset
    ds = _dataset(name, seed, n)
    tasks = []
    for i in range(n):
        entry = ds[i]
        tasks.append({
            "env": "plan_act",
            "task_id": f"{name}/{seed}/{i}",
            "dataset": name,
            "dataset_seed": seed,
            "dataset_size": n,
            "index": i,
            "question": entry["question"],
            "answer": entry["answer"],
            "metadata": _json_safe(entry.get("metadata", {})),
        })
    return tasks


def score_answer(task: dict, answer: str | None) -> float:
    """reasoning-gym's own score of ``answer`` for the task's entry, in [0, 1]."""
    ds = _dataset(task["dataset"], task["dataset_seed"], task["dataset_size"])
    entry = {"question": task["question"], "answer": task["answer"], "metadata": task["metadata"]}
    return float(ds.score_answer(answer, entry))
