"""Worker side of the rollout pool: load the worker module (``aflow_rl.envs.load_env``), run episodes, serve a link.

This code runs wherever episodes run: in a spawned worker process
(``serve_process``), in a dask worker (``serve_remote``), in a thread
(threading backend) or in the caller (sequential). The parent side
(``aflow_rl.rollout.pool``) hands it tasks over a *link* and gets back one
``Done(episode_id, result, started)`` per task, where ``result`` is the
worker's Trajectory or an ``EpisodeError`` (messages: ``rollout.messages``).

A long-lived serve loop per process keeps one asyncio event loop alive, so
many episodes of one process wait on HTTP at once and each finished one is
replaced at once from the process's own queue.
"""
from __future__ import annotations

import asyncio
import collections
import contextvars
import inspect
import os
import signal
import socket
import sys
import threading
import traceback
from multiprocessing.connection import Client
from typing import Any, Callable, Protocol

from aflow_rl.config import ConfigError
from aflow_rl.envs.loader import EnvModule, load_env
from aflow_rl.procs import die_with_parent
from aflow_rl.rollout.messages import (Cancel, Dial, Done, EpisodeError, Hello, Run, Started, Stop, Unqueue,
                                       Unqueued, WorkerStartError, decode, encode)
from aflow_rl.rollout.traces import TraceWriter, episode_scope
from aflow_rl.rollout.types import Trajectory, WorkerContext

_ERROR_CHARS = 4000  # keep the tail of a traceback: the exception line is at the end

__all__ = ["EpisodeError", "EpisodeRunner", "WorkerStartError", "get_runner", "serve", "serve_process", "serve_remote"]


class Link(Protocol):
    """Two-way message channel between the pool and one serve loop."""

    def recv(self) -> Any: ...          # blocking; raises EOFError when the pool is gone
    def send(self, msg: Any) -> None: ...


def load_worker(spec: str) -> EnvModule:
    """The worker module of ``spec`` (an ``env.name``: a shipped name or a module path) in this process.

    The pool needs only ``run_episode`` (``init_worker`` is called when present);
    ``train.py`` has already checked the whole contract with the same loader. A
    failure adds where it happened: this process may be a spawned or remote one.
    """
    try:
        return load_env(spec, need=("run_episode",))
    except ConfigError as exc:
        raise WorkerStartError(
            f"{exc}\n  in process {os.getpid()} on {socket.gethostname()}, cwd: {os.getcwd()}\n"
            f"  sys.path: {sys.path}\n"
            "  worker modules must be importable where the pool runs them "
            "(pip install -e . installs aflow_rl and workers/)") from None


def extend_sys_path(paths: list[str]) -> None:
    """Append the parent's import path entries this process lacks.

    A spawned process (or a dask worker) starts from its own cwd and
    environment; the parent may have put the repository on sys.path by hand
    (tests, notebooks, a script run from /), so its entries travel along.
    Appended, never prepended, so a remote machine's own packages win.
    """
    for p in paths:
        if p and p not in sys.path:
            sys.path.append(p)


class EpisodeRunner:
    """One process's worker: module imported, ``init_worker(ctx)`` called once, episodes run."""

    def __init__(self, spec: str, ctx: WorkerContext):
        env = load_worker(spec)
        module, self.fn = env.module, env.run_episode
        self.spec = spec
        self.ctx = ctx
        self.is_async = inspect.iscoroutinefunction(self.fn)
        # Every episode of this process appends to one trace file (a no-op writer when tracing is off).
        ctx.state.setdefault("trace", TraceWriter.from_context(ctx))
        init = env.init_worker
        if init is not None:
            try:
                out = init(ctx)
            except Exception:
                raise WorkerStartError(
                    f"init_worker of worker module '{module.__name__}' failed in process {os.getpid()}:\n"
                    + _tail(traceback.format_exc())) from None
            if inspect.isawaitable(out):
                getattr(out, "close", lambda: None)()
                raise WorkerStartError(f"init_worker of '{module.__name__}' must be a plain function, not async")

    async def run(self, task: dict, timeout_s: float, *, inline: bool = False) -> Trajectory | EpisodeError:
        """Run one episode with a wall-clock limit; never raises for the episode's own errors.

        Async episodes run on this loop; sync ones in a daemon thread so the
        loop stays free for the others (``inline``: in this thread, for the
        sequential backend, where a hung sync episode cannot be interrupted).
        """
        # Each episode runs in its own asyncio task, so this sets the scope for this episode only;
        # the job task and the sync thread below inherit it (traces learn the attempt from it).
        episode_scope(task)
        if self.is_async:
            job = asyncio.ensure_future(self.fn(task, self.ctx))
        elif inline:
            job = None
        else:
            job = _in_daemon_thread(contextvars.copy_context(), self.fn, task, self.ctx)
        try:
            if job is None:
                out = self.fn(task, self.ctx)
            else:
                # asyncio.wait, not wait_for: a TimeoutError raised *by the episode* is a failure, not ours.
                done, _ = await asyncio.wait({job}, timeout=timeout_s)
                if not done:
                    job.cancel()
                    if self.is_async:  # give it a moment to clean up (close sockets), not forever
                        await asyncio.wait({job}, timeout=1.0)
                    return EpisodeError("timeout", f"episode exceeded rollout.episode_timeout_s={timeout_s:g}s",
                                        stuck=not self.is_async)
                out = job.result()
            if inspect.isawaitable(out):  # a sync function that returned a coroutine
                out = await asyncio.wait_for(out, timeout_s)
        except asyncio.CancelledError:
            if job is not None:
                job.cancel()
            raise
        except Exception as exc:
            return EpisodeError("failed", _format_error(exc))
        if not isinstance(out, Trajectory):
            return EpisodeError("failed", f"{self.spec} returned {type(out).__module__}.{type(out).__name__}, "
                                          "expected aflow_rl.rollout.types.Trajectory")
        # The pool is the authority on identity: none lost, none duplicated.
        out.episode_id, out.group_id, out.attempt = task["episode_id"], task["group_id"], task["attempt"]
        return out


def _in_daemon_thread(ctx_vars: contextvars.Context, fn: Callable, *args: Any) -> asyncio.Future:
    """Run ``fn(*args)`` in a fresh daemon thread; a hung one never blocks interpreter exit."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if not fut.done():
            fut.set_result(value) if ok else fut.set_exception(value)

    def target() -> None:
        try:
            result, ok = ctx_vars.run(fn, *args), True
        except BaseException as exc:  # handed to the awaiting coroutine, which formats it
            result, ok = exc, False
        try:
            loop.call_soon_threadsafe(settle, ok, result)
        except RuntimeError:  # the loop is gone (episode timed out and the worker moved on)
            pass

    threading.Thread(target=target, daemon=True, name="rollout-sync-episode").start()
    return fut


def _format_error(exc: BaseException) -> str:
    """The episode's traceback without this module's frames (they say nothing about the episode)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    return _tail("".join(traceback.format_exception(type(exc), exc, tb)))


def _tail(text: str) -> str:
    return text if len(text) <= _ERROR_CHARS else "...\n" + text[-_ERROR_CHARS:]


# One runner per (worker spec, context) per process: init_worker runs once per process and pool.
_RUNNERS: dict[tuple[str, int], tuple[WorkerContext, EpisodeRunner]] = {}
_RUNNERS_LOCK = threading.Lock()


def get_runner(spec: str, ctx: WorkerContext) -> EpisodeRunner:
    """The process's runner for ``spec``, importing and initialising the worker on first use."""
    key = (spec, id(ctx))
    with _RUNNERS_LOCK:  # threading backend: several slots start at once in one process
        hit = _RUNNERS.get(key)
        if hit is None:
            hit = _RUNNERS[key] = (ctx, EpisodeRunner(spec, ctx))  # ctx kept alive so its id stays unique
        return hit[1]


async def serve(link: Link, runner: EpisodeRunner, concurrency: int, timeout_s: float) -> None:
    """Run the episodes the pool sends until it says ``Stop`` or goes away (messages: ``rollout.messages``).

    Up to ``concurrency`` episodes run at once; the pool may send more, which
    wait here in order so that a finished episode's place is refilled without
    a round trip to the pool (and which it may take back with ``Unqueue``
    while they wait). A start is always reported (``Started``, or in the
    ``Done`` of the episode whose place it took) before the episode's code
    runs, so after a crash the pool knows exactly which episodes were running.
    """
    loop = asyncio.get_running_loop()
    inbox: asyncio.Queue = asyncio.Queue()

    def pump() -> None:  # blocking reads stay off the event loop
        while True:
            try:
                msg = link.recv()
            except (EOFError, OSError):
                msg = None
            try:
                loop.call_soon_threadsafe(inbox.put_nowait, msg)
            except RuntimeError:  # loop closed
                return
            if msg is None or isinstance(msg, Stop):
                return

    threading.Thread(target=pump, daemon=True, name="rollout-link-reader").start()
    waiting: collections.deque[dict] = collections.deque()
    running: dict[str, asyncio.Task] = {}

    def fill() -> list[str]:
        started = []
        while waiting and len(running) < concurrency:
            task = waiting.popleft()
            running[task["episode_id"]] = asyncio.ensure_future(one(task))  # its code runs after we report
            started.append(task["episode_id"])
        return started

    async def one(task: dict) -> None:
        eid = task["episode_id"]
        try:
            result = await runner.run(task, timeout_s)
        finally:
            running.pop(eid, None)
        _send_result(link, eid, result, fill())

    while True:
        msg = await inbox.get()
        match msg:
            case None | Stop():
                break
            case Run(tasks):
                waiting.extend(tasks)
            case Unqueue(asked):
                removed = [t["episode_id"] for t in waiting if t["episode_id"] in set(asked)]
                waiting = _without(waiting, removed)
                link.send(Unqueued(removed, asked))
            case Cancel(dropped):
                waiting = _without(waiting, dropped)
                for eid in dropped:
                    job = running.pop(eid, None)
                    if job is not None:
                        job.cancel()
        started = fill()
        if started:
            link.send(Started(started))
    for job in list(running.values()):
        job.cancel()
    if running:
        await asyncio.wait(list(running.values()), timeout=2.0)


def _without(waiting: collections.deque, episode_ids: list[str]) -> collections.deque:
    drop = set(episode_ids)
    return collections.deque(t for t in waiting if t["episode_id"] not in drop)


def _send_result(link: Link, eid: str, result: Any, started: list[str]) -> None:
    try:
        link.send(Done(eid, result, started))
    except (EOFError, OSError, BrokenPipeError):
        raise
    except Exception as exc:  # pickling failed before anything was written: the stream is intact
        error = EpisodeError("failed", f"result could not be sent to the pool: {exc!r}")
        link.send(Done(eid, error, started))


class ConnLink:
    """A multiprocessing Connection as a Link (pickled messages over a pipe or socket)."""

    def __init__(self, conn: Any):
        self.conn = conn
        self.lock = threading.Lock()  # episodes finish on the loop, Unqueued answers too: one writer at a time

    def recv(self) -> Any:
        return decode(self.conn.recv())

    def send(self, msg: Any) -> None:
        with self.lock:
            self.conn.send(encode(msg))


def serve_link(link: Link, spec: str, ctx: WorkerContext, concurrency: int, timeout_s: float,
               sys_path: list[str]) -> dict:
    """Start the worker, say ``Hello`` (with the start-up error, if any), serve until stopped.

    The hello carries the start-up error so the pool can stop at once with the
    worker's own message (module, sys.path); the return value repeats it.
    """
    extend_sys_path(sys_path)
    info = {"pid": os.getpid(), "host": socket.gethostname(), "error": None}
    try:
        runner = get_runner(spec, ctx)
    except WorkerStartError as exc:
        info["error"] = str(exc)
    link.send(Hello(info))
    try:
        if info["error"] is None:
            asyncio.run(serve(link, runner, concurrency, timeout_s))
    finally:
        with _RUNNERS_LOCK:  # this context copy was the slot's alone (a dask worker outlives its slots)
            _RUNNERS.pop((spec, id(ctx)), None)
    return info


def serve_process(conn: Any, parent_pid: int, use_signal: bool, *args: Any) -> None:
    """Entry point of a local worker process (``slots.ProcessSlot``): ``serve_link`` over its socket pair.

    Set up first, before anything can hang: the process dies with the pool's
    process even if that is killed with SIGKILL (``aflow_rl.procs``).
    """
    die_with_parent(parent_pid, use_signal)
    # A terminal's Ctrl-C reaches the whole process group; the trainer stops its pool itself,
    # and a worker torn down by the same signal mid-read only adds a traceback to its one line.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        serve_link(ConnLink(conn), *args)
    finally:
        conn.close()


def serve_remote(address: Any, authkey: bytes, slot: int, gen: int, *args: Any) -> dict:
    """Entry point of a dask slot: dial back to the pool's switchboard, then ``serve_link``."""
    conn = Client(address, authkey=authkey)
    try:
        conn.send(encode(Dial(slot, gen)))
        return serve_link(ConnLink(conn), *args)
    finally:
        conn.close()
