"""Trajectory: what one episode hands back to the trainer (docs/architecture.md, Contracts).

Compact and picklable: token ids are int32 arrays, logprobs float32 arrays.
``to_dict``/``from_dict`` give a JSON-safe form for traces and replay.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

Status = Literal["ok", "failed", "timeout"]
REWARD_COMPONENTS = ("r_perf", "r_parallel", "r_finish", "format")


def _ids(x: Any) -> np.ndarray:
    return np.asarray(x if x is not None else [], dtype=np.int32).reshape(-1)


def _lps(x: Any) -> np.ndarray:
    return np.asarray(x if x is not None else [], dtype=np.float32).reshape(-1)


@dataclass
class Turn:
    """One policy generation: the trainer's unit of loss.

    prompt_ids: [P] tokens the server saw; response_ids: [T] tokens it sampled;
    logprobs: [T] the server's logprobs of response_ids (after temperature and
    grammar mask, as SGLang reports them). grammar is the constraint the server
    applied ({"json_schema": str} or {"regex": str}) so the trainer can rebuild
    the same masks; anchor_key identifies the state for GiGPO step groups.
    """

    prompt_ids: np.ndarray
    response_ids: np.ndarray
    logprobs: np.ndarray
    grammar: dict | None = None
    anchor_key: str | None = None
    policy_version: int = 0
    step_reward: float = 0.0
    finish_reason: str = "stop"

    def __post_init__(self) -> None:
        self.prompt_ids = _ids(self.prompt_ids)
        self.response_ids = _ids(self.response_ids)
        self.logprobs = _lps(self.logprobs)
        if len(self.logprobs) != len(self.response_ids):
            raise ValueError(
                f"Turn: {len(self.logprobs)} logprobs for {len(self.response_ids)} response tokens")

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        for k in ("prompt_ids", "response_ids"):
            d[k] = getattr(self, k).tolist()
        d["logprobs"] = [float(x) for x in self.logprobs]
        return d


@dataclass
class Trajectory:
    """One episode. Episodes of the same task share ``group_id``."""

    episode_id: str
    group_id: str
    attempt: int = 1
    turns: list[Turn] = field(default_factory=list)
    final_reward: float = 0.0
    reward_components: dict[str, float] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    status: Status = "ok"
    error: str = ""
    info: dict[str, Any] = field(default_factory=dict)  # free-form, JSON-safe (task id, answer, ...)

    @property
    def step_rewards(self) -> np.ndarray:
        return np.asarray([t.step_reward for t in self.turns], dtype=np.float64)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "turns"}
        d["turns"] = [t.to_dict() for t in self.turns]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Trajectory":
        d = dict(d)
        d["turns"] = [Turn(**t) for t in d.get("turns", [])]
        return cls(**d)

    @classmethod
    def failed(cls, episode_id: str, group_id: str, attempt: int, error: str,
               status: Status = "failed", info: dict | None = None) -> "Trajectory":
        """The record of an episode that produced nothing usable."""
        return cls(episode_id=episode_id, group_id=group_id, attempt=attempt,
                   status=status, error=error, info=dict(info or {}))


@dataclass
class WorkerContext:
    """What every worker process receives (docs/architecture.md, Contracts).

    The pool pickles it to each process once; ``init_worker(ctx)`` fills
    ``state`` with per-process objects (clients, tokenizer), which never travel
    back. A task handed to ``run_episode(task, ctx)`` is a dict whose keys
    ``episode_id``, ``group_id`` and ``attempt`` the pool sets; the rest
    (``seed``, the task itself) belong to the environment.
    """

    config: Any                                  # aflow_rl.config.Config
    urls: dict[str, list[str]] = field(default_factory=dict)  # role -> server base URLs
    run_dir: str = ""
    worker_index: int = 0
    state: dict[str, Any] = field(default_factory=dict)

    def __getstate__(self) -> dict:
        d = dict(self.__dict__)
        d["state"] = {}  # process-local: clients and sockets do not pickle
        return d
