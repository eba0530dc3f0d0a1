"""Step traces: JSONL events that environment code appends while an episode runs.

One file per worker process, ``<run_dir>/traces/worker-<pid>.jsonl``, one JSON
object per line, flushed per line so a killed worker loses at most the line it
was writing. Every episode's events carry ``episode_id`` and ``step``; the
pool sets the episode scope, so ``group_id`` and ``attempt`` are filled in
without the environment passing them (retries of an episode stay apart).

    trace = ctx.state["trace"]            # the pool puts a TraceWriter there in every worker
    trace.event(task["episode_id"], step=t, observation=obs, action=act,
                outcome=out, reward=r, timings={"policy_ms": 41.0})

``python -m aflow_rl.rollout.replay`` reads these files back.
"""
from __future__ import annotations

import contextvars
import dataclasses
import json
import os
import threading
import time
from typing import IO, Any

import numpy as np

# (episode_id, group_id, attempt) of the episode running in the current asyncio task or thread.
_EPISODE: contextvars.ContextVar[tuple[str, str, int] | None] = contextvars.ContextVar(
    "aflow_rl_episode", default=None)

# path -> (pid, file). One handle per file per process, shared by every writer and asyncio task;
# the pid check reopens after a fork so two processes never share a buffered handle.
_FILES: dict[str, tuple[int, IO[str]]] = {}
_LOCK = threading.Lock()


def episode_scope(task: dict) -> None:
    """Mark the current task/thread context as running ``task`` (called by the pool's runner)."""
    _EPISODE.set((str(task.get("episode_id", "")), str(task.get("group_id", "")), int(task.get("attempt", 1))))


def _jsonable(x: Any) -> Any:
    """``json.dumps`` fallback: arrays to lists, numpy scalars to numbers, dataclasses to dicts."""
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, np.generic):
        return x.item()
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return dataclasses.asdict(x)
    if isinstance(x, (set, frozenset, tuple)):
        return list(x)
    if isinstance(x, bytes):
        return x.decode("utf-8", "replace")
    return repr(x)


class TraceWriter:
    """Append step events as JSONL under ``<run_dir>/traces/``; a no-op when disabled.

    Cheap to construct (file handles are shared per process) and safe from
    many asyncio tasks and threads: each event is one ``write`` of one whole
    line under a lock, then a flush.
    """

    def __init__(self, run_dir: str, *, enabled: bool = True):
        self.enabled = bool(enabled and run_dir)
        self.dir = os.path.join(run_dir, "traces") if run_dir else ""

    @classmethod
    def from_context(cls, ctx: Any) -> "TraceWriter":
        """A writer for a WorkerContext: ``ctx.run_dir``, enabled by ``config.rollout.trace``."""
        rollout = getattr(getattr(ctx, "config", None), "rollout", None)
        return cls(getattr(ctx, "run_dir", ""), enabled=getattr(rollout, "trace", True))

    @property
    def path(self) -> str:
        """This process's trace file."""
        return os.path.join(self.dir, f"worker-{os.getpid()}.jsonl")

    def event(self, episode_id: str, *, step: int, observation: Any = None, action: Any = None,
              outcome: Any = None, reward: float | None = None, timings: dict | None = None,
              **extra: Any) -> None:
        """Append one step: what the agent saw, what it did, what came of it, and how long it took.

        ``extra`` keys (e.g. ``done=True``, ``role="planner"``) are stored as given;
        ``group_id``/``attempt`` default to the running episode's.
        """
        if not self.enabled:
            return
        rec: dict[str, Any] = {"ts": time.time(), "episode_id": str(episode_id)}
        scope = _EPISODE.get()
        if scope is not None and scope[0] == str(episode_id):
            rec["group_id"], rec["attempt"] = scope[1], scope[2]
        rec.update(step=int(step), observation=observation, action=action, outcome=outcome,
                   reward=None if reward is None else float(reward), timings=timings or {})
        rec.update(extra)
        line = json.dumps(rec, default=_jsonable, ensure_ascii=False) + "\n"
        with _LOCK:
            fh = self._file()
            fh.write(line)
            fh.flush()

    def _file(self) -> IO[str]:
        path, pid = self.path, os.getpid()
        hit = _FILES.get(path)
        if hit is None or hit[0] != pid:
            os.makedirs(self.dir, exist_ok=True)
            hit = _FILES[path] = (pid, open(path, "a", encoding="utf-8"))
        return hit[1]

    def close(self) -> None:
        """Close this process's file for this run (later events reopen it)."""
        with _LOCK:
            hit = _FILES.pop(self.path, None)
            if hit is not None and hit[0] == os.getpid():
                hit[1].close()
