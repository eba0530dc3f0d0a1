"""RolloutPool: run episodes on worker processes and stream Trajectories back as they finish.

    pool = RolloutPool(cfg.rollout, WorkerContext(config=cfg, urls=urls, run_dir=cfg.run_dir))
    with pool:
        for traj in pool.run(make_episodes(tasks, cfg.rollout.group_size)):
            ...                      # in completion order; pool.stats has pool/retries, pool/failed

Backends (``rollout.backend``): ``loky`` spawns ``workers`` processes (the
name is kept from the launcher it once used; today each is a fresh
interpreter with a socket pair, ``slots.ProcessSlot``), ``dask`` runs ``workers``
long-lived tasks on the cluster at ``dask_address``, ``threading`` runs
``workers`` threads here, and ``sequential`` runs one episode at a time in the
caller's thread. Each
process or thread keeps an asyncio loop and runs up to
``concurrency_per_worker`` episodes at once; as many again wait there in
line, so a finished episode is replaced without a round trip to the pool.
New episodes go to the least loaded worker, and a worker with free places
takes back episodes still waiting at another (work stealing). The messages
are ``rollout.messages``; a ``Slot`` is only the transport to one worker, and
the pool's record of it (``_Worker``) holds the episodes sent there.

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

from aflow_rl.rollout.messages import (Cancel, Done, EpisodeError, Exited, Hello, Lost, Run, Started, Unqueue,
                                       Unqueued, WorkerStartError)
from aflow_rl.rollout.slots import (DEAD, READY, STARTING, DaskSlot, InlineSlot, ProcessSlot, Slot, Switchboard,
                                    ThreadSlot, callback_host)
from aflow_rl.rollout.types import Trajectory, WorkerContext

_EOF_WAIT_S = 2.0  # dask: how long a connected worker's socket may outlive its task

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


@dataclass
class _Worker:
    """The pool's record of one slot: the episodes sent to it and what the pool decided about it."""

    slot: Slot
    concurrency: int               # episodes it runs at once
    # Up to `prefetch` more episodes wait in the worker, so a finished episode's place is refilled
    # at once rather than after a round trip through the pool (bench.rollout_pool: ~80-90% -> ~90%+
    # of the ideal rate with 0.2 s episodes on a busy 2-core machine). The pool takes waiting
    # episodes back for idle workers (work stealing), so a deep queue costs no load balance.
    prefetch: int
    inflight: dict[str, _Episode] = field(default_factory=dict)  # in send order: the oldest deadline first
    tainted: bool = False          # a stuck sync thread: drain, then replace
    reserved: bool = False         # draining so that it can run a suspect alone
    start_deadline: float = 0.0
    exited_at: float | None = None  # dask: the task ended; the socket's EOF should follow

    def restart(self, start_timeout_s: float) -> None:
        """A fresh generation of the slot, with a clean record."""
        self.inflight, self.tainted, self.reserved, self.exited_at = {}, False, False, None
        self.slot.start()
        self.start_deadline = time.monotonic() + start_timeout_s


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
        self._workers: list[_Worker] = []
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

    @property
    def slots(self) -> list[Slot]:
        """The transports, one per worker (``slot.pid`` is the worker's process id once it is up)."""
        return [w.slot for w in self._workers]

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
            self._workers = self._make_workers()
            for w in self._workers:
                self._start_worker(w)
            while any(w.slot.state == STARTING for w in self._workers):
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
        for w in self._workers:
            w.reserved = False
            if w.inflight and w.slot.state == READY:
                w.slot.send(Cancel(list(w.inflight)))
            w.inflight.clear()  # late results of these are dropped as unknown
        self._run_id = 0

    # -- scheduling -------------------------------------------------------------------------------

    def _dispatch(self) -> None:
        """Top up every ready worker; suspects of a crash run alone on an otherwise idle worker."""
        ready = [w for w in self._workers if w.slot.state == READY and not w.tainted]
        if self._quarantine:
            for w in ready:
                if self._quarantine and not w.inflight:
                    self._send(w, [self._quarantine.popleft()])
            if self._quarantine and ready and not any(w.reserved for w in ready):
                min(ready, key=lambda w: len(w.inflight)).reserved = True  # drain it for the next suspect
        else:
            for w in ready:
                w.reserved = False
        open_workers = [w for w in ready if not w.reserved and not _isolating(w)]
        if not open_workers:
            return
        if not self._pending:
            self._steal(open_workers)
            return
        # Water-filling: each episode to the least loaded worker, so a small batch spreads over all.
        load = {id(w): len(w.inflight) for w in open_workers}
        batches: dict[int, list[_Episode]] = {id(w): [] for w in open_workers}
        while self._pending:
            w = min(open_workers, key=lambda x: load[id(x)])
            if load[id(w)] >= w.concurrency + w.prefetch:
                break  # every worker is full (all workers of a pool have the same capacity)
            batches[id(w)].append(self._pending.popleft())
            load[id(w)] += 1
        for w in open_workers:
            if batches[id(w)]:
                self._send(w, batches[id(w)])

    def _steal(self, open_workers: list[_Worker]) -> None:
        """Nothing left to send, but a worker has free places: take back episodes still waiting in others.

        Only unstarted episodes are asked for, and the worker answers with the
        ones it actually removed, so an episode never runs twice.
        """
        free = sum(max(0, w.concurrency - len(w.inflight)) for w in open_workers)
        free -= sum(ep.stealing for w in self._workers for ep in w.inflight.values())
        for victim in sorted(self._workers, key=lambda w: -len(w.inflight)):
            if free <= 0:
                return
            if victim.slot.state != READY or len(victim.inflight) <= victim.concurrency:
                continue  # nothing waits there
            waiting = [ep for ep in victim.inflight.values() if not ep.started and not ep.stealing]
            take = waiting[max(0, len(waiting) - free):]  # the last in its line: furthest from starting
            if take:
                for ep in take:
                    ep.stealing = True
                free -= len(take)
                victim.slot.send(Unqueue([ep.episode_id for ep in take]))

    def _unqueued(self, w: _Worker, removed: list[str], asked: list[str]) -> None:
        """The worker gave back ``removed`` (not started); the rest of ``asked`` had started meanwhile."""
        for eid in asked:
            ep = w.inflight.get(eid)
            if ep is not None:
                ep.stealing = False
        for eid in reversed(removed):
            ep = w.inflight.pop(eid, None)
            if ep is not None and ep.run_id == self._run_id:
                self._pending.appendleft(ep)
        self._recycle_if_drained(w)

    def _send(self, w: _Worker, episodes: list[_Episode]) -> None:
        for ep in episodes:
            ep.started, ep.stealing, ep.deadline = False, False, float("inf")
            w.inflight[ep.episode_id] = ep
        w.slot.send(Run([ep.payload() for ep in episodes]))

    def _mark_started(self, w: _Worker, eids: list[str]) -> None:
        """The hard deadline runs from the reported start (an episode may wait its turn in the worker)."""
        # The caller's own thread (sequential) cannot be interrupted, so it gets no hard deadline.
        deadline = float("inf") if w.slot.kind == "inline" else (
            time.monotonic() + self.cfg.episode_timeout_s + self.cfg.timeout_grace_s)
        for eid in eids:
            ep = w.inflight.get(eid)
            if ep is not None:
                ep.started, ep.deadline = True, deadline

    def _step(self) -> None:
        """Handle one event, or the deadline that comes first."""
        now = time.monotonic()
        wake = min([_oldest(w).deadline for w in self._workers if w.inflight]
                   + [w.start_deadline for w in self._workers if w.slot.state == STARTING]
                   + [w.exited_at + _EOF_WAIT_S for w in self._workers if w.exited_at] + [now + 1.0])
        try:
            index, gen, msg = self._events.get(timeout=max(0.0, wake - now))
        except queue.Empty:
            self._check_deadlines()
            return
        w = self._workers[index]
        if gen == w.slot.gen and w.slot.state != DEAD:  # else: from a replaced generation
            self._handle(w, msg)
        self._check_deadlines()

    def _handle(self, w: _Worker, msg: Any) -> None:
        match msg:
            case Hello(info):
                if info.get("error"):
                    raise WorkerStartError(info["error"])
                w.slot.ready(info)
            case Started(eids):
                self._mark_started(w, eids)
            case Unqueued(removed, asked):
                self._unqueued(w, removed, asked)
            case Done(eid, result, started):
                self._mark_started(w, started)
                self._done(w, eid, result)
            case Lost(reason):
                self._lost(w, reason)
            case Exited(reason):
                self._exited(w, reason)

    def _done(self, w: _Worker, eid: str, result: Trajectory | EpisodeError) -> None:
        ep = w.inflight.pop(eid, None)
        if ep is not None and ep.run_id == self._run_id:
            if isinstance(result, EpisodeError):
                self._charge(ep, result.kind, result.error)
                if result.stuck and w.slot.killable:
                    w.tainted = True  # its thread still runs: no new work; replace once drained
            else:
                if ep.errors:
                    result.info["retry_errors"] = list(ep.errors)
                self._finished.append(result)
        self._recycle_if_drained(w)

    def _exited(self, w: _Worker, reason: str) -> None:
        """Dask saw the task end. Once connected, wait for the socket's EOF (it follows the worker's
        last results); before that, this is the only news of it."""
        if w.slot.state == STARTING:
            error = w.slot.start_error()
            if error:
                raise WorkerStartError(error)
            self._lost(w, reason)
        elif w.exited_at is None:
            w.exited_at = time.monotonic()

    def _lost(self, w: _Worker, reason: str) -> None:
        """A worker's process or thread went away on its own."""
        slot = w.slot
        starting = slot.state == STARTING
        reason = slot.exit_reason() or reason
        running = [ep for ep in w.inflight.values() if ep.started]
        waiting = [ep for ep in w.inflight.values() if not ep.started]
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
        self._start_worker(w)

    def _check_deadlines(self) -> None:
        now = time.monotonic()
        for w in self._workers:
            if w.slot.state == READY and w.exited_at is not None and now > w.exited_at + _EOF_WAIT_S:
                self._lost(w, "worker exited")  # no EOF: a forked child may hold the socket open
            if w.slot.state == STARTING and now > w.start_deadline:
                raise PoolError(
                    f"{w.slot.kind} worker {w.slot.index} did not start within rollout.start_timeout_s="
                    f"{self.cfg.start_timeout_s:g}s" + (" (does the dask cluster have a free thread for "
                                                        "every rollout.workers?)" if w.slot.kind == "dask" else ""))
            if w.inflight and _oldest(w).deadline <= now:
                overdue = list(itertools.takewhile(lambda ep: ep.deadline <= now, w.inflight.values()))
                self._expire(w, overdue)

    def _expire(self, w: _Worker, overdue: list[_Episode]) -> None:
        """No word from a worker past the hard deadline: its loop is blocked. Kill it and replace it."""
        others = list(w.inflight.values())[len(overdue):]
        w.slot.kill()
        self.stats["pool/worker_kills"] += 1
        limit = self.cfg.episode_timeout_s + self.cfg.timeout_grace_s
        what = (f"no result within episode_timeout_s + timeout_grace_s = {limit:g}s; worker {w.slot.pid} was "
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
        self._start_worker(w)

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

    def _recycle_if_drained(self, w: _Worker) -> None:
        """A worker with a stuck sync thread is replaced once nothing else runs on it."""
        if w.tainted and not w.inflight and w.slot.state == READY:
            w.slot.kill()
            self.stats["pool/worker_recycles"] += 1
            self._start_worker(w)

    # -- workers ----------------------------------------------------------------------------------

    def _make_workers(self) -> list[_Worker]:
        slots = self._make_slots()
        # The sequential backend runs each episode inside send(): nothing can wait there.
        return [_Worker(s, s.concurrency, 0 if isinstance(s, InlineSlot) else s.concurrency) for s in slots]

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
        if backend == "loky":  # the name is kept from the launcher it used to be: local spawned processes
            return [ProcessSlot(i, **common, sys_path=sys_path) for i in range(cfg.workers)]
        if backend == "dask":
            if not cfg.dask_address:
                raise PoolError("rollout.dask_address: the dask backend needs a scheduler address")
            from distributed import Client

            self._client = Client(cfg.dask_address)
            self._board = Switchboard(self._events, host=callback_host(cfg.dask_address))
            return [DaskSlot(i, **common, board=self._board, sys_path=sys_path, client=self._client)
                    for i in range(cfg.workers)]
        raise PoolError(f"rollout.backend: unknown backend {backend!r} (loky | threading | sequential | dask)")

    def _start_worker(self, w: _Worker) -> None:
        if self._started and w.slot.gen:
            self.stats["pool/worker_restarts"] += 1
        w.restart(self.cfg.start_timeout_s)


def _isolating(w: _Worker) -> bool:
    """Running a suspect, which always runs alone."""
    return len(w.inflight) == 1 and next(iter(w.inflight.values())).isolate


def _oldest(w: _Worker) -> _Episode:
    """The worker's earliest deadline: episodes are added in send order and all get the same allowance."""
    return next(iter(w.inflight.values()))


def _zero_stats() -> dict[str, float]:
    """pool/retries (charged re-runs), pool/failed (returned not ok), and what happened to workers."""
    return {k: 0 for k in ("pool/retries", "pool/failed", "pool/requeued", "pool/worker_deaths",
                           "pool/worker_kills", "pool/worker_recycles", "pool/worker_restarts")}
