"""A resumable stream of tasks.

The tasks at sampler position p are generated from seed ``(run_seed, p)``, so a
run resumed at position p draws exactly the tasks it would have drawn without
the interruption (``RolloutPool``'s ``make_episodes`` then makes the groups).
A factory that takes a ``position`` keyword is also told p, so that a
curriculum can follow training progress (and resumes with it).
"""
from __future__ import annotations

import inspect
from typing import Callable

TaskFactory = Callable[[object, int, int], list]  # (config, n, seed) -> list[task dict]


class TaskSampler:
    """Draws ``tasks_per_step`` tasks per call; ``position`` counts tasks drawn."""

    def __init__(self, make_tasks: TaskFactory, config: object, seed: int, position: int = 0,
                 num_tasks: int = 0):
        self.make_tasks = make_tasks
        self.config = config
        self.seed = int(seed)
        self.position = int(position)
        self.num_tasks = int(num_tasks)   # > 0: a fixed set, one shuffled pass per epoch
        self._set: list[dict] | None = None

    def _next_from_set(self, n: int) -> list[dict]:
        """Tasks ``position .. position+n`` of the concatenated per-epoch shuffles of the fixed set."""
        import random

        if self._set is None:
            self._set = self.make_tasks(self.config, self.num_tasks, self.seed)
        out = []
        for pos in range(self.position, self.position + n):
            epoch, index = divmod(pos, self.num_tasks)
            order = list(range(self.num_tasks))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            out.append(self._set[order[index]])
        self.position += n
        return out

    def next(self, n: int) -> list[dict]:
        if self.num_tasks:
            return self._next_from_set(n)
        # 1_000_003 is prime: distinct (seed, position) pairs give distinct seeds.
        seed = self.seed * 1_000_003 + self.position
        if "position" in inspect.signature(self.make_tasks).parameters:
            tasks = self.make_tasks(self.config, n, seed, position=self.position)
        else:
            tasks = self.make_tasks(self.config, n, seed)
        if len(tasks) != n:
            raise RuntimeError(f"task factory returned {len(tasks)} tasks, expected {n}")
        self.position += n
        return tasks

    def state_dict(self) -> dict:
        return {"seed": self.seed, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.seed, self.position = int(state["seed"]), int(state["position"])
