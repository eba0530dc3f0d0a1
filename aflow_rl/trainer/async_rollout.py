"""Asynchronous rollout with bounded staleness (``trainer.max_staleness = k >= 1``).

The rollout of optimizer step ``t`` (one *chunk*: the step's ``tasks_per_step`` groups) runs in a
background thread on rank 0 while the main thread trains earlier steps. Three rules, after AReaL
(Fu et al. 2025, "AReaL: a large-scale asynchronous RL system", section 5):

- **Admission control.** Chunk ``t`` may start only while ``t - v <= k``, where ``v`` is the
  trainer's published policy version: the optimizer steps whose weights the servers have been
  given (main() calls :meth:`AsyncRollout.publish` after each step's sync). Every turn is thus
  sampled under a version at least ``t - k`` (with ``trainer.sync_every = m``, at least
  ``t - k - (m - 1)``: the servers get only every m-th version). Staleness is bounded by what may
  start, never by discarding what finished: a completed episode is always trained.
- **Oldest first.** Chunks start in step order and step ``t`` trains exactly chunk ``t``: whole
  groups, the oldest ones waiting.
- **Weights move in the main thread.** The rollout thread only runs episodes; a sync happens
  between training steps as in the synchronous loop, while episodes are in flight (each turn
  records the version it was sampled under, see :func:`staleness_stats`).

With ``k = 0`` chunk ``t`` is admitted only once step ``t - 1`` is published: the synchronous
order (train.py keeps its own synchronous code path for ``k = 0``; tests/trainer/test_async_rollout.py
checks that this driver with ``k = 0`` yields the same batches).

The driver knows nothing of pools or batches: ``produce(t)`` runs chunk ``t`` to completion and
returns what the trainer takes for step ``t`` (train.py: a Batch and its trajectories).
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable, Sequence


class AsyncRollout:
    """Runs ``produce(t)`` for ``t = start_step .. max_steps - 1`` in a thread, each once the
    admission rule allows; :meth:`take` hands step ``t``'s result to the trainer.

    ``size(item)``: episodes in a produced item (for ``async/queue_episodes``).
    """

    def __init__(self, produce: Callable[[int], Any], *, max_staleness: int, start_step: int, max_steps: int,
                 size: Callable[[Any], int] = lambda item: 0, clock: Callable[[], float] = time.monotonic):
        if max_staleness < 0:
            raise ValueError(f"trainer.max_staleness must be at least 0, got {max_staleness}")
        self.produce, self.k, self.max_steps, self.size, self.clock = produce, max_staleness, max_steps, size, clock
        self._cv = threading.Condition()
        self._published = start_step          # v: optimizer steps whose weights the servers were given
        self._next = start_step               # the next chunk to start
        self._ready: dict[int, tuple[Any, dict]] = {}
        self._busy: list[tuple[float, float]] = []   # (start, end) of every chunk run, for timing/overlap
        self._running_since: float | None = None
        self._error: BaseException | None = None
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="async-rollout", daemon=True)

    def start(self) -> "AsyncRollout":
        """Start the rollout thread (once; later calls do nothing)."""
        if self._thread.ident is None:
            self._thread.start()
        return self

    # -- the rollout thread ------------------------------------------------------------------------

    def _admitted(self, t: int) -> bool:
        return t - self._published <= self.k

    def _loop(self) -> None:
        try:
            while True:
                with self._cv:
                    waited_from = self.clock()
                    while not self._stop and self._next < self.max_steps and not self._admitted(self._next):
                        self._cv.wait()
                    if self._stop or self._next >= self.max_steps:
                        return
                    t, self._next = self._next, self._next + 1
                    info = {"admission_wait_s": self.clock() - waited_from, "admitted_at_version": self._published}
                    self._running_since = self.clock()
                item = self.produce(t)
                with self._cv:
                    self._busy.append((self._running_since, self.clock()))
                    self._running_since = None
                    self._ready[t] = (item, info)
                    self._cv.notify_all()
        except BaseException as exc:   # noqa: BLE001 - handed to the trainer's thread by take()
            with self._cv:
                self._error, self._running_since = exc, None
                self._cv.notify_all()

    # -- the trainer's thread ----------------------------------------------------------------------

    def take(self, t: int) -> tuple[Any, dict]:
        """Step ``t``'s item once its chunk is complete, and ``info``: ``admission_wait_s`` (how long
        the chunk waited to be admitted), ``admitted_at_version``, ``queue_episodes`` (episodes of
        later chunks already complete and waiting). Raises the rollout thread's error."""
        with self._cv:
            while t not in self._ready:
                if self._error is not None:
                    raise self._error
                if not self._thread.is_alive():
                    raise RuntimeError(f"async rollout: step {t} was never produced (the rollout thread "
                                       f"stopped at chunk {self._next}, max_steps {self.max_steps})")
                self._cv.wait(timeout=1.0)
            item, info = self._ready.pop(t)
            info = {**info, "queue_episodes": float(sum(self.size(i) for i, _ in self._ready.values()))}
        return item, info

    def publish(self, version: int) -> None:
        """The trainer finished (and synced, when due) optimizer step ``version - 1``: admit up to
        chunk ``version + k``."""
        with self._cv:
            self._published = max(self._published, version)
            self._cv.notify_all()

    def overlap_s(self, start: float, end: float) -> float:
        """Seconds of ``[start, end]`` (on ``clock``) in which a chunk was running."""
        with self._cv:
            spans = list(self._busy) + ([(self._running_since, self.clock())] if self._running_since is not None else [])
            self._busy = [s for s in self._busy if s[1] >= start]   # older spans cannot overlap later steps
        return sum(max(0.0, min(end, b) - max(start, a)) for a, b in spans)

    def close(self, timeout: float = 5.0) -> None:
        """Stop admitting chunks; wait up to ``timeout`` for a running one (the pool closes after)."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)


def staleness_stats(turns: Sequence[Any], step: int) -> dict[str, float]:
    """``async/staleness_mean`` / ``_max``: how many optimizer steps each trained turn's policy
    version lags the step ``step`` (0-based) it is trained in; 0 for an empty batch. The server
    at version v holds the weights after v optimizer steps, so the synchronous loop gives 0."""
    lags = [step - int(t.policy_version) for t in turns]
    if not lags:
        return {"async/staleness_mean": 0.0, "async/staleness_max": 0.0}
    return {"async/staleness_mean": float(sum(lags)) / len(lags), "async/staleness_max": float(max(lags))}
