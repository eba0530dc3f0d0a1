"""A resumable stream of tasks, expanded into groups of episodes.

Task batch k is generated from seed ``(run_seed, position)``, so a run resumed
at sampler position p draws exactly the tasks it would have drawn without the
interruption. Each task becomes ``group_size`` episodes sharing one group id
(GRPO/GiGPO groups); each episode gets its own sampling seed.
"""
from __future__ import annotations

import copy
import zlib
from typing import Callable

TaskFactory = Callable[[object, int, int], list]  # (config, n, seed) -> list[task dict]


class TaskSampler:
    """Draws ``tasks_per_step`` tasks per call; ``position`` counts tasks drawn."""

    def __init__(self, make_tasks: TaskFactory, config: object, seed: int, position: int = 0):
        self.make_tasks = make_tasks
        self.config = config
        self.seed = int(seed)
        self.position = int(position)

    def next(self, n: int) -> list[dict]:
        # 1_000_003 is prime: distinct (seed, position) pairs give distinct seeds.
        tasks = self.make_tasks(self.config, n, self.seed * 1_000_003 + self.position)
        if len(tasks) != n:
            raise RuntimeError(f"task factory returned {len(tasks)} tasks, expected {n}")
        self.position += n
        return tasks

    def state_dict(self) -> dict:
        return {"seed": self.seed, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.seed, self.position = int(state["seed"]), int(state["position"])


def expand_groups(tasks: list[dict], group_size: int, step: int) -> list[dict]:
    """One episode dict per (task, member): ``group_id`` shared within a task."""
    episodes = []
    for i, task in enumerate(tasks):
        group_id = f"s{step}-t{i}"
        for j in range(group_size):
            ep = copy.deepcopy(task)
            ep["group_id"] = group_id
            ep["episode_id"] = f"{group_id}-e{j}"
            # Same task, different sampling seed per member: the group explores.
            # crc32, not hash(): str hashes change between processes (PYTHONHASHSEED).
            ep["episode_seed"] = zlib.crc32(repr((task.get("seed", i), step, j)).encode()) & 0x7FFFFFFF
            episodes.append(ep)
    return episodes
