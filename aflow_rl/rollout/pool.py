"""RolloutPool: run episodes on worker processes and stream Trajectories back as they finish.

    pool = RolloutPool(cfg.rollout, WorkerContext(config=cfg, urls=urls, run_dir=cfg.run_dir))
    with pool:
        for traj in pool.run(make_episodes(tasks, cfg.rollout.group_size)):
            ...                      # in completion order; pool.stats has pool/retries, pool/failed

Backends (``rollout.backend``): ``loky`` spawns ``workers`` processes (one
loky executor each), ``dask`` runs ``workers`` long-lived tasks on the
cluster at ``dask_address``, ``threading`` runs ``workers`` threads here, and
``sequential`` runs one episode at a time in the caller's thread. Each
process or thread keeps an asyncio loop and runs up to
``concurrency_per_worker`` episodes at once; as many again wait there in
line, so a finished episode is replaced without a round trip to the pool.
New episodes go to the least loaded worker, and a worker with free places
takes back episodes still waiting at another (work stealing).

Failure handling, per episode (an *attempt* is charged, then the episode is
retried while ``attempt < max_attempts``, else returned failed with its errors):

- the episode raised, returned something other than a Trajectory, or passed
  ``episode_timeout_s`` (the worker enforces it; a sync episode's thread is
  abandoned and its process replaced once its other episodes finish):
  charged to that episode.
- an episode still has no result ``episode_timeout_s + timeout_grace_s``
  after it started (the worker's own timeout could not fire: a blocked event
  loop): the process is killed and replaced, the overdue episode is charged
  with ``timeout`` and the others on it re-run uncharged (several overdue at
  once: each re-runs alone, as below).
- the process died (SIGKILL, segfault, OOM): if it ran one episode, that one
  is charged. If it ran several, nobody can tell which one killed it, so
  each is re-run *alone* on a process, uncharged; a crash while alone is
  charged. Collateral episodes thus never lose an attempt, and a crasher is
  still caught after at most one extra run per suspect. Episodes waiting in
  the dead worker's line had not started: they go back to the front, uncharged.

Threads cannot be killed: on ``threading`` and ``dask`` a stuck sync episode's
thread is abandoned (the episode is still timed out and retried), and
``sequential`` cannot interrupt a sync episode at all.
"""
from __future__ import annotations

import collections
import itertools
import os
import queue
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

from aflow_rl.rollout.runner import EpisodeError, WorkerStartError
from aflow_rl.rollout.slots import (DEAD, READY, STARTING, DaskSlot, InlineSlot, LokySlot, Slot, Switchboard,
                                    ThreadSlot, callback_host)
from aflow_rl.rollout.types import Trajectory, WorkerContext

_EOF_WAIT_S = 2.0  # how long a connected worker's socket may outlive its process

__all__ = ["RolloutPool", "PoolError", "WorkerStartError", "make_episodes", "whole_groups"]


class PoolError(RuntimeError):
    """The pool cannot go on (a worker never came up, or died while starting)."""


@dataclass
class _Episode:
    """The pool's record of one episode across its attempts."""

    task: dict
    episode_id: str
    group_id: str
    run_id: int
    attempt: int = 1
    isolate: bool = False          # suspected of crashing a process: runs alone
    errors: list[str] = field(default_factory=list)
    started: bool = False          # the worker reported it running (not just waiting there)
    stealing: bool = False         # asked back from its worker's queue for an idle one
    deadline: float = float("inf")  # hard deadline of the attempt running

    def payload(self) -> dict:
        return {**self.task, "episode_id": self.episode_id, "group_id": self.group_id, "attempt": self.attempt}


def make_episodes(tasks: Iterable[dict], group_size: int, prefix: str = "") -> list[dict]:
    """G episodes per task, one group per task: ``group_id`` and ``episode_id`` set, ``sample`` = 0..G-1.

    A task's own ``group_id`` (or ``task_id``) names its group; otherwise
    ``<prefix>g<i>``. Use a prefix (e.g. the step) to keep ids unique across calls.
    """
    out = []
    for i, task in enumerate(tasks):
        gid = str(task.get("group_id") or task.get("task_id") or f"{prefix}g{i}")
        out += [{**task, "group_id": gid, "episode_id": f"{gid}/{j}", "sample": j} for j in range(group_size)]
    return out


def whole_groups(results: Iterable[Trajectory], group_size: int) -> Iterator[list[Trajectory]]:
    """Regroup a stream of trajectories: yield each group as soon as all ``group_size`` members are back."""
    pending: dict[str, list[Trajectory]] = collections.defaultdict(list)
    for traj in results:
        members = pending[traj.group_id]
        members.append(traj)
        if len(members) == group_size:
            yield pending.pop(traj.group_id)
    for members in pending.values():  # short groups (the caller sent fewer): still returned
        yield members


class RolloutPool:
    """A pool of worker processes (or threads) running an environment's episodes. See the module docstring.

    ``env`` is an ``env.name`` (a shipped name or a worker module path); by default
    ``ctx.config.env.name``, so the trainer's pool runs the configured environment.
    """

    def __init__(self, cfg: Any, ctx: WorkerContext | None = None, env: str | None = None):
        self.cfg = cfg  # a RolloutConfig
        self.ctx = ctx if ctx is not None else WorkerContext(config=None)
        if env is None and self.ctx.config is None:
            raise ValueError("RolloutPool: pass env= (an env.name or worker module path) or a ctx with a config")
        self.env = env if env is not None else self.ctx.config.env.name
        for name in ("workers", "concurrency_per_worker", "max_attempts"):
            if getattr(cfg, name) < 1:
                raise ValueError(f"rollout.{name} must be at least 1, got {getattr(cfg, name)}")
        self.stats: dict[str, float] = _zero_stats()
        self.startup_s = 0.0
        self.slots: list[Slot] = []
        self._events: queue.Queue = queue.Queue()
        self._board: Switchboard | None = None
        self._client: Any = None
        self._run_ids = itertools.count(1)
        self._auto_ids = itertools.count()
        self._run_id = 0
        self._pending: collections.deque[_Episode] = collections.deque()
        self._quarantine: collections.deque[_Episode] = collections.deque()
        self._finished: collections.deque[Trajectory] = collections.deque()
        self._started = self._closed = False

    # -- life cycle -------------------------------------------------------------------------------

    def start(self) -> "RolloutPool":
        """Start every worker and wait until each has imported the worker module and run init_worker.

        Raises WorkerStartError (the worker's message: module, sys.path) at the
        first worker that fails, after stopping the others.
        """
        if self._started:
            return self
        t0 = time.perf_counter()
        self._started = True
        try:
            self.slots = self._make_slots()
            for slot in self.slots:
                self._start_slot(slot)
            while any(s.state == STARTING for s in self.slots):
                self._step()
        except BaseException:
            self.close()
            raise
        self.startup_s = time.perf_counter() - t0
        return self

    def close(self) -> None:
        """Stop every worker (killing any that do not stop within a few seconds)."""
        if self._closed:
            return
        self._closed = True
        for slot in self.slots:
            if slot.state == READY:
                slot.stop()   # the serve loop cancels its episodes and returns
            elif slot.state == STARTING:
                slot.kill()   # may be deep in init_worker; no reason to wait for it
        until = time.monotonic() + 3.0
        for slot in self.slots:
            slot.join(timeout=max(0.1, until - time.monotonic()))
        if self._board is not None:
            self._board.close()
        if self._client is not None:
            self._client.close()

    def __enter__(self) -> "RolloutPool":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- running ----------------------------------------------------------------------------------

    def run(self, tasks: Iterable[dict]) -> Iterator[Trajectory]:
        """Run every task as one episode; yield each Trajectory as soon as it is final.

        A task is a dict; ``episode_id`` and ``group_id`` are kept when present
        (default: a fresh id, and the episode as its own group), ``attempt`` is
        set by the pool. Every task comes back exactly once, ``ok`` or
        ``failed``/``timeout`` with its error. ``self.stats`` counts this run.
        """
        if self._closed:
            raise PoolError("the pool is closed")
        self.start()
        if self._run_id:
            raise PoolError("run() is already in progress on this pool (one run at a time)")
        self._run_id = next(self._run_ids)
        self.stats = _zero_stats()
        try:
            episodes = self._episodes(tasks)
            self._pending.extend(episodes)
            left = len(episodes)
            while left:
                self._dispatch()
                self._step()
                while self._finished:
                    left -= 1
                    yield self._finished.popleft()
        except (WorkerStartError, PoolError):
            self.close()  # a replacement worker cannot start: nothing more can run here
            raise
        finally:
            self._abandon()

    def _episodes(self, tasks: Iterable[dict]) -> list[_Episode]:
        out, seen = [], set()
        for task in tasks:
            if not isinstance(task, dict):
                raise TypeError(f"a task must be a dict, got {type(task).__name__}")
            eid = str(task["episode_id"]) if task.get("episode_id") is not None else f"e{next(self._auto_ids)}"
            if eid in seen:
                raise ValueError(f"duplicate episode_id {eid!r} in one run")
            seen.add(eid)
            gid = str(task["group_id"]) if task.get("group_id") is not None else eid
            out.append(_Episode(task=dict(task), episode_id=eid, group_id=gid, run_id=self._run_id))
        return out

    def _abandon(self) -> None:
        """End a run: cancel what is still in flight (a caller that stopped early) and forget it."""
        self._pending.clear()
        self._quarantine.clear()
        self._finished.clear()
        for slot in self.slots:
            slot.reserved = False
            if slot.inflight and slot.state == READY:
                slot.send(("cancel", list(slot.inflight)))
            slot.inflight.clear()  # late results of these are dropped as unknown
        self._run_id = 0

    # -- scheduling -------------------------------------------------------------------------------

    def _dispatch(self) -> None:
        """Top up every ready slot; suspects of a crash run alone on an otherwise idle slot."""
        ready = [s for s in self.slots if s.state == READY and not s.tainted]
        if self._quarantine:
            for slot in ready:
                if self._quarantine and not slot.inflight:
                    self._send(slot, [self._quarantine.popleft()])
            if self._quarantine and ready and not any(s.reserved for s in ready):
                min(ready, key=lambda s: len(s.inflight)).reserved = True  # drain it for the next suspect
        else:
            for slot in ready:
                slot.reserved = False
        open_slots = [s for s in ready if not s.reserved and not _isolating(s)]
        if not open_slots:
            return
        if not self._pending:
            self._steal(open_slots)
            return
        # Water-filling: each episode to the least loaded slot, so a small batch spreads over all workers.
        load = {s.index: len(s.inflight) for s in open_slots}
        batches: dict[int, list[_Episode]] = {s.index: [] for s in open_slots}
        while self._pending:
            slot = min(open_slots, key=lambda s: load[s.index])
            if load[slot.index] >= slot.concurrency + slot.prefetch:
                break  # every slot is full (all slots of a pool have the same capacity)
            batches[slot.index].append(self._pending.popleft())
            load[slot.index] += 1
        for slot in open_slots:
            if batches[slot.index]:
                self._send(slot, batches[slot.index])

    def _steal(self, open_slots: list[Slot]) -> None:
        """Nothing left to send, but a slot has free places: take back episodes still waiting in others.

        Only unstarted episodes are asked for, and the worker answers with the
        ones it actually removed, so an episode never runs twice.
        """
        free = sum(max(0, s.concurrency - len(s.inflight)) for s in open_slots)
        free -= sum(ep.stealing for s in self.slots for ep in s.inflight.values())
        for victim in sorted(self.slots, key=lambda s: -len(s.inflight)):
            if free <= 0:
                return
            if victim.state != READY or len(victim.inflight) <= victim.concurrency:
                continue  # nothing waits there
            waiting = [ep for ep in victim.inflight.values() if not ep.started and not ep.stealing]
            take = waiting[max(0, len(waiting) - free):]  # the last in its line: furthest from starting
            if take:
                for ep in take:
                    ep.stealing = True
                free -= len(take)
                victim.send(("unqueue", [ep.episode_id for ep in take]))

    def _unqueued(self, slot: Slot, removed: list[str], asked: list[str]) -> None:
        """The worker gave back ``removed`` (not started); the rest of ``asked`` had started meanwhile."""
        for eid in asked:
            ep = slot.inflight.get(eid)
            if ep is not None:
                ep.stealing = False
        for eid in reversed(removed):
            ep = slot.inflight.pop(eid, None)
            if ep is not None and ep.run_id == self._run_id:
                self._pending.appendleft(ep)
        self._recycle_if_drained(slot)

    def _send(self, slot: Slot, episodes: list[_Episode]) -> None:
        for ep in episodes:
            ep.started, ep.stealing, ep.deadline = False, False, float("inf")
            slot.inflight[ep.episode_id] = ep
        slot.send(("run", [ep.payload() for ep in episodes]))

    def _mark_started(self, slot: Slot, eids: list[str]) -> None:
        """The hard deadline runs from the reported start (an episode may wait its turn in the worker)."""
        # The caller's own thread (sequential) cannot be interrupted, so it gets no hard deadline.
        deadline = float("inf") if slot.kind == "inline" else (
            time.monotonic() + self.cfg.episode_timeout_s + self.cfg.timeout_grace_s)
        for eid in eids:
            ep = slot.inflight.get(eid)
            if ep is not None:
                ep.started, ep.deadline = True, deadline

    def _step(self) -> None:
        """Handle one event, or the deadline that comes first."""
        now = time.monotonic()
        wake = min([_oldest(s).deadline for s in self.slots if s.inflight]
                   + [s.start_deadline for s in self.slots if s.state == STARTING]
                   + [s.exited_at + _EOF_WAIT_S for s in self.slots if s.exited_at] + [now + 1.0])
        try:
            index, gen, msg = self._events.get(timeout=max(0.0, wake - now))
        except queue.Empty:
            self._check_deadlines()
            return
        slot = self.slots[index]
        if gen != slot.gen or slot.state == DEAD:
            if msg[0] == "hello" and msg[2] is not None:
                msg[2].close()  # a replaced generation dialled in late
            return
        kind = msg[0]
        if kind == "hello":
            self._hello(slot, msg[1], msg[2])
        elif kind == "started":
            self._mark_started(slot, msg[1])
        elif kind == "unqueued":
            self._unqueued(slot, msg[1], msg[2])
        elif kind == "done":
            self._mark_started(slot, msg[3])
            self._done(slot, msg[1], msg[2])
        elif kind == "lost":
            self._lost(slot, msg[1])
        elif kind == "exited":
            self._exited(slot, msg[1])
        self._check_deadlines()

    def _hello(self, slot: Slot, info: dict, conn: Any) -> None:
        if info.get("error"):
            if conn is not None:
                conn.close()
            raise WorkerStartError(info["error"])
        slot.ready(info, conn)

    def _done(self, slot: Slot, eid: str, result: Trajectory | EpisodeError) -> None:
        ep = slot.inflight.pop(eid, None)
        if ep is not None and ep.run_id == self._run_id:
            if isinstance(result, EpisodeError):
                self._charge(ep, result.kind, result.error)
                if result.stuck and slot.killable:
                    slot.tainted = True  # its thread still runs: no new work; replace once drained
            else:
                if ep.errors:
                    result.info["retry_errors"] = list(ep.errors)
                self._finished.append(result)
        self._recycle_if_drained(slot)

    def _exited(self, slot: Slot, reason: str) -> None:
        """The launcher saw the worker end. Once connected, wait for the socket's EOF (it follows the
        worker's last results); before that, this is the only news of it."""
        if slot.state == STARTING:
            error = slot.start_error()
            if error:
                raise WorkerStartError(error)
            self._lost(slot, reason)
        elif slot.exited_at is None:
            slot.exited_at = time.monotonic()

    def _lost(self, slot: Slot, reason: str) -> None:
        """A slot's process or thread went away on its own."""
        starting = slot.state == STARTING
        reason = slot.exit_reason(wait=2.0) or reason  # loky knows the exit code, e.g. SIGKILL(-9)
        running = [ep for ep in slot.inflight.values() if ep.started]
        waiting = [ep for ep in slot.inflight.values() if not ep.started]
        slot.kill()
        self.stats["pool/worker_deaths"] += 1
        if starting:
            raise PoolError(f"{slot.kind} worker {slot.index} died while starting ({reason}); "
                            f"env.name={self.env!r}")
        what = f"worker process {slot.pid} died ({reason})"
        if len(running) == 1:  # the only episode running on it: the culprit
            self._charge(running[0], "failed", f"{what} while running this episode")
        else:
            for ep in running:  # any of them may have done it: each re-runs alone, uncharged
                ep.isolate = True
                ep.errors.append(f"attempt {ep.attempt} (not counted): {what} with {len(running)} "
                                 "episodes running on it; re-run alone")
                self._requeue(ep)
        for ep in reversed(waiting):  # had not started: innocent, and first in line again
            self._requeue(ep)
        self._start_slot(slot)

    def _check_deadlines(self) -> None:
        now = time.monotonic()
        for slot in self.slots:
            if slot.state == READY and slot.exited_at is not None and now > slot.exited_at + _EOF_WAIT_S:
                self._lost(slot, "worker exited")  # no EOF: a forked child may hold the socket open
            if slot.state == STARTING and now > slot.start_deadline:
                raise PoolError(
                    f"{slot.kind} worker {slot.index} did not start within rollout.start_timeout_s="
                    f"{self.cfg.start_timeout_s:g}s" + (" (does the dask cluster have a free thread for "
                                                        "every rollout.workers?)" if slot.kind == "dask" else ""))
            if slot.inflight and _oldest(slot).deadline <= now:
                overdue = list(itertools.takewhile(lambda ep: ep.deadline <= now, slot.inflight.values()))
                self._expire(slot, overdue)

    def _expire(self, slot: Slot, overdue: list[_Episode]) -> None:
        """No word from a worker past the hard deadline: its loop is blocked. Kill it and replace it."""
        others = list(slot.inflight.values())[len(overdue):]
        slot.kill()
        self.stats["pool/worker_kills"] += 1
        limit = self.cfg.episode_timeout_s + self.cfg.timeout_grace_s
        what = (f"no result within episode_timeout_s + timeout_grace_s = {limit:g}s; worker {slot.pid} was "
                "replaced (a blocked event loop: sync code inside an async episode?)")
        if len(overdue) == 1:
            self._charge(overdue[0], "timeout", what)
        else:  # several went quiet together: the one blocking the loop is unknown
            others = overdue + others
            for ep in overdue:
                ep.isolate = True
        for ep in reversed(others):
            if ep.started:
                ep.errors.append(f"attempt {ep.attempt} (not counted): {what}; re-run")
            self._requeue(ep)
        self._start_slot(slot)

    def _requeue(self, ep: _Episode) -> None:
        """Back to the front of the line without losing an attempt (collateral of someone else's failure)."""
        if ep.run_id == self._run_id:
            (self._quarantine if ep.isolate else self._pending).appendleft(ep)
            self.stats["pool/requeued"] += 1

    def _charge(self, ep: _Episode, kind: str, error: str) -> None:
        """Count a failed attempt: retry it, or return it as failed/timeout with its errors."""
        if ep.run_id != self._run_id:
            return
        ep.errors.append(f"attempt {ep.attempt}: {error}")
        if ep.attempt < self.cfg.max_attempts:
            ep.attempt += 1
            self.stats["pool/retries"] += 1
            (self._quarantine if ep.isolate else self._pending).appendleft(ep)  # retries first: groups finish
            return
        self.stats["pool/failed"] += 1
        self._finished.append(Trajectory.failed(
            ep.episode_id, ep.group_id, ep.attempt, error, status="timeout" if kind == "timeout" else "failed",
            info={"errors": list(ep.errors)}))

    def _recycle_if_drained(self, slot: Slot) -> None:
        """A slot with a stuck sync thread is replaced once nothing else runs on it."""
        if slot.tainted and not slot.inflight and slot.state == READY:
            slot.kill()
            self.stats["pool/worker_recycles"] += 1
            self._start_slot(slot)

    # -- slots ------------------------------------------------------------------------------------

    def _make_slots(self) -> list[Slot]:
        cfg, backend = self.cfg, self.cfg.backend
        common = dict(events=self._events, spec=self.env, ctx=self.ctx,
                      concurrency=cfg.concurrency_per_worker, timeout_s=cfg.episode_timeout_s)
        if backend == "sequential":
            return [InlineSlot(0, **common)]
        if backend == "threading":
            return [ThreadSlot(i, **common) for i in range(cfg.workers)]
        # Spawned or remote processes get the parent's import path: the repository may be on it by hand.
        sys_path = [os.path.abspath(p) if p else os.getcwd() for p in sys.path]
        if backend == "loky":
            self._board = Switchboard(self._events)
            return [LokySlot(i, **common, board=self._board, sys_path=sys_path) for i in range(cfg.workers)]
        if backend == "dask":
            if not cfg.dask_address:
                raise PoolError("rollout.dask_address: the dask backend needs a scheduler address")
            from distributed import Client

            self._client = Client(cfg.dask_address)
            self._board = Switchboard(self._events, host=callback_host(cfg.dask_address))
            return [DaskSlot(i, **common, board=self._board, sys_path=sys_path, client=self._client)
                    for i in range(cfg.workers)]
        raise PoolError(f"rollout.backend: unknown backend {backend!r} (loky | threading | sequential | dask)")

    def _start_slot(self, slot: Slot) -> None:
        if self._started and slot.gen:
            self.stats["pool/worker_restarts"] += 1
        slot.start()
        slot.start_deadline = time.monotonic() + self.cfg.start_timeout_s


def _isolating(slot: Slot) -> bool:
    """Running a suspect, which always runs alone."""
    return len(slot.inflight) == 1 and next(iter(slot.inflight.values())).isolate


def _oldest(slot: Slot) -> _Episode:
    """The slot's earliest deadline: episodes are added in send order and all get the same allowance."""
    return next(iter(slot.inflight.values()))


def _zero_stats() -> dict[str, float]:
    """pool/retries (charged re-runs), pool/failed (returned not ok), and what happened to workers."""
    return {k: 0 for k in ("pool/retries", "pool/failed", "pool/requeued", "pool/worker_deaths",
                           "pool/worker_kills", "pool/worker_recycles", "pool/worker_restarts")}
