"""Where episodes run: one *slot* is a worker process (loky, dask) or thread running a serve loop.

Every slot reports to one ``queue.Queue`` of events ``(slot_index, generation,
message)``; the generation changes each time a slot is (re)started, so
messages from a replaced process or abandoned thread are recognised and
dropped. Messages are those of ``runner.serve`` plus ``("hello", info,
conn)`` when a slot is up and ``("lost", reason)`` when it is gone.

- ``LokySlot``: a loky ``ProcessPoolExecutor`` with one spawned process. One
  executor per slot, not one shared (reusable) executor, because loky marks
  a whole executor broken and terminates *all* its workers when one dies; a
  slot of its own confines a SIGKILL to the episodes of that process. The
  process dies with the pool's process (``aflow_rl.procs.die_with_parent``).
- ``DaskSlot``: a long-running task on a ``distributed`` cluster.
- ``ThreadSlot``: a thread in this process (threading backend).
- ``InlineSlot``: the caller's thread, one episode at a time (sequential backend).

Process and dask slots talk to the pool over a ``multiprocessing.connection``
socket (``Switchboard``), authenticated with a per-pool random key. Their
loss is signalled by the socket's end of file, which comes after every
message the worker sent, so no finished result is lost in a crash; the
launcher's own ``("exited", reason)`` serves while there is no socket yet.
"""
from __future__ import annotations

import abc
import asyncio
import dataclasses
import os
import queue
import re
import secrets
import socket
import threading
import urllib.parse
from multiprocessing.connection import Listener
from typing import Any

from aflow_rl.procs import can_signal_children, die_with_parent
from aflow_rl.rollout.runner import EpisodeRunner, WorkerStartError, get_runner, serve, serve_remote
from aflow_rl.rollout.types import WorkerContext

STARTING, READY, DEAD = "starting", "ready", "dead"


class Switchboard:
    """A listening socket that worker processes dial back to; one reader thread per connection."""

    def __init__(self, events: queue.Queue, host: str = "127.0.0.1"):
        self.events = events
        self.authkey = secrets.token_bytes(32)
        # Listener's default backlog is 1: workers dialling in together would wait on TCP retries.
        self.listener = Listener((host, 0), backlog=256, authkey=self.authkey)
        self.address = self.listener.address
        self.closed = False
        threading.Thread(target=self._accept, daemon=True, name="rollout-accept").start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                conn = self.listener.accept()  # includes the authkey challenge
            except Exception:  # a failed handshake, or the wake-up connection from close()
                continue
            threading.Thread(target=self._read, args=(conn,), daemon=True, name="rollout-reader").start()

    def _read(self, conn: Any) -> None:
        try:
            kind, slot, gen, info = conn.recv()
        except Exception:
            conn.close()
            return
        self.events.put((slot, gen, (kind, info, conn)))
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                self.events.put((slot, gen, ("lost", "connection closed")))
                return
            except Exception as exc:  # a message that does not unpickle here
                self.events.put((slot, gen, ("lost", f"unreadable message: {exc!r}")))
                return
            self.events.put((slot, gen, msg))

    def close(self) -> None:
        self.closed = True
        self.listener.close()
        try:  # a closed socket does not wake a blocked accept() on Linux; a connection does
            socket.create_connection(self.address, timeout=1).close()
        except OSError:
            pass


class Slot(abc.ABC):
    """One place episodes run. The pool owns the bookkeeping fields; subclasses start and stop."""

    kind = "slot"
    killable = True  # a stuck sync thread can be cleared by replacing the process

    def __init__(self, index: int, events: queue.Queue, spec: str, ctx: WorkerContext,
                 concurrency: int, timeout_s: float):
        self.index, self.events, self.spec, self.ctx = index, events, spec, ctx
        self.concurrency, self.timeout_s = concurrency, timeout_s
        # Up to `prefetch` more episodes wait in the worker, so a finished episode's place is refilled
        # at once rather than after a round trip through the pool (bench.rollout_pool: ~80-90% -> ~90%+
        # of the ideal rate with 0.2 s episodes on a busy 2-core machine). The pool takes waiting
        # episodes back for idle workers (work stealing), so a deep queue costs no load balance.
        self.prefetch = concurrency
        self.gen = 0
        self.state = DEAD
        self.pid: int | None = None
        self.inflight: dict[str, Any] = {}  # episode_id -> the pool's episode record
        self.tainted = False                # a stuck sync thread: drain, then replace
        self.reserved = False               # draining so that it can run a suspect alone
        self.start_deadline = 0.0
        self.exited_at: float | None = None  # the launcher saw it exit; the socket's EOF should follow

    def start(self) -> None:
        """Launch a fresh generation; its hello arrives as an event."""
        self.gen += 1
        self.state, self.pid, self.tainted, self.reserved = STARTING, None, False, False
        self.inflight, self.exited_at = {}, None
        self._launch()

    def ready(self, info: dict, conn: Any) -> None:
        self.state, self.pid = READY, info.get("pid")

    @abc.abstractmethod
    def _launch(self) -> None:
        """Start the worker of this generation (a process, a dask task, a thread, or nothing)."""

    @abc.abstractmethod
    def send(self, msg: Any) -> None:
        """Deliver one message (episodes, stop) to the worker."""

    def stop(self) -> None:
        """Ask politely (the serve loop returns); see ``kill`` for the other kind."""
        self.state = DEAD

    def kill(self) -> None:
        """Make sure this generation runs nothing more (best effort where a thread cannot be killed)."""
        self.stop()

    def join(self, timeout: float) -> None:
        """Wait for a stopped slot to finish and free its resources."""

    def exit_reason(self, wait: float) -> str:
        """Why the slot went away, if the launcher knows (e.g. loky's exit code)."""
        return ""

    def start_error(self) -> str:
        """The worker's start-up error, if it exited with one before its hello was read."""
        return ""


class _ConnSlot(Slot):
    """A slot that talks over a Switchboard connection."""

    def __init__(self, *args: Any, board: Switchboard, sys_path: list[str], **kw: Any):
        super().__init__(*args, **kw)
        self.board, self.sys_path, self.conn = board, sys_path, None
        self.future: Any = None

    def _args(self) -> tuple:
        # Each process gets its own copy of the context, with its index; state is per process.
        ctx = dataclasses.replace(self.ctx, worker_index=self.index, state={})
        return (self.board.address, self.board.authkey, self.index, self.gen, self.spec, ctx,
                self.concurrency, self.timeout_s, self.sys_path)

    def _watch(self) -> None:
        gen = self.gen
        self.future.add_done_callback(lambda f: self.events.put((self.index, gen, ("exited", _reason(f)))))

    def ready(self, info: dict, conn: Any) -> None:
        super().ready(info, conn)
        self.conn = conn

    def send(self, msg: Any) -> None:
        if self.conn is None:  # already closed by kill(); the pool has moved on
            return
        try:
            self.conn.send(msg)
        except (OSError, EOFError):  # it died; the reader reports the loss
            pass

    def stop(self) -> None:
        if self.conn is not None and self.state == READY:
            self.send(("stop",))
        super().stop()

    def _close_conn(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def exit_reason(self, wait: float) -> str:
        if self.future is None:
            return ""
        try:
            self.future.exception(timeout=wait)
        except Exception:  # still running, cancelled, or the wait timed out
            pass
        return _reason(self.future) if self.future.done() else ""

    def start_error(self) -> str:
        f = self.future
        if f is None or not f.done() or f.cancelled() or f.exception() is not None:
            return ""
        info = f.result()
        return info.get("error") or "" if isinstance(info, dict) else ""


class LokySlot(_ConnSlot):
    """A spawned process from loky, running ``serve_remote``."""

    kind = "loky"

    def _launch(self) -> None:
        from joblib.externals.loky import ProcessPoolExecutor

        # The initializer runs before the worker reads its first call: from then on the worker dies
        # with this process even if it dies (kill -9) before the call is sent (loky's workers would
        # otherwise wait on their call queue forever, and keep loky's resource trackers alive too).
        self.executor = ProcessPoolExecutor(max_workers=1, initializer=die_with_parent,
                                            initargs=(os.getpid(), can_signal_children()))
        self.future = self.executor.submit(serve_remote, *self._args())
        self._watch()

    def kill(self) -> None:
        super().kill()
        self._close_conn()
        if self.future is not None:
            self.executor.shutdown(wait=False, kill_workers=True)

    def join(self, timeout: float) -> None:
        if self.future is None:
            return
        try:
            self.future.exception(timeout=timeout)
        except Exception:
            pass
        done = self.future.done()
        self._close_conn()
        self.executor.shutdown(wait=True, kill_workers=not done)


class DaskSlot(_ConnSlot):
    """A long-running task on a dask cluster (it holds one worker thread for the pool's lifetime)."""

    kind = "dask"
    killable = False  # the pool cannot kill a remote thread; a wedged one is abandoned

    def __init__(self, *args: Any, client: Any, **kw: Any):
        super().__init__(*args, **kw)
        self.client = client

    def _launch(self) -> None:
        # pure=False: every launch is a new task; a unique key so dask never dedupes generations.
        self.future = self.client.submit(serve_remote, *self._args(), pure=False,
                                         key=f"rollout-slot-{self.index}-{self.gen}-{secrets.token_hex(4)}")
        self._watch()

    def kill(self) -> None:
        super().kill()
        self._close_conn()  # the serve loop sees EOF and returns, unless its loop is blocked
        if self.future is not None:
            self.future.cancel()  # and dask does not re-run it elsewhere

    def exit_reason(self, wait: float) -> str:
        # A dead dask worker's task is rescheduled, not failed: waiting on it would only stall the pool.
        return _reason(self.future) if self.future is not None and self.future.done() else ""

    def join(self, timeout: float) -> None:
        if self.future is None:
            return
        try:
            self.future.result(timeout=timeout)
        except Exception:
            pass
        self._close_conn()


class ThreadSlot(Slot):
    """A thread of this process with its own event loop (threading backend)."""

    kind = "thread"
    killable = False  # threads cannot be killed: a hung sync episode keeps its thread

    def _launch(self) -> None:
        self.inbox: queue.Queue = queue.Queue()
        gen = self.gen
        link = _QueueLink(self.inbox, self.events, self.index, gen)

        def main() -> None:
            reason = "thread exited"
            try:
                runner = get_runner(self.spec, self.ctx)
            except WorkerStartError as exc:
                self.events.put((self.index, gen, ("hello", {"pid": os.getpid(), "error": str(exc)}, None)))
                return
            self.events.put((self.index, gen, ("hello", {"pid": os.getpid(), "error": None}, None)))
            try:
                asyncio.run(serve(link, runner, self.concurrency, self.timeout_s))
            except BaseException as exc:  # reported as a loss; the pool replaces the slot
                reason = f"serve loop crashed: {exc!r}"
            self.events.put((self.index, gen, ("lost", reason)))

        self.thread = threading.Thread(target=main, daemon=True, name=f"rollout-slot-{self.index}")
        self.thread.start()

    def send(self, msg: Any) -> None:
        self.inbox.put(msg)

    def stop(self) -> None:
        if self.state != DEAD:
            self.inbox.put(("stop",))
        super().stop()

    def join(self, timeout: float) -> None:
        if getattr(self, "thread", None) is not None:
            self.thread.join(timeout)


class InlineSlot(Slot):
    """The caller's thread, one episode at a time (sequential backend: for debuggers and prints).

    ``send`` runs the episode before returning. Async episodes still get
    their timeout; a sync episode that hangs hangs the caller.
    """

    kind = "inline"
    killable = False

    def _launch(self) -> None:
        self.concurrency, self.prefetch = 1, 0
        try:
            self.runner: EpisodeRunner | None = get_runner(self.spec, self.ctx)
        except WorkerStartError as exc:
            self.events.put((self.index, self.gen, ("hello", {"pid": os.getpid(), "error": str(exc)}, None)))
            return
        # One loop for the pool's life, so clients made in init_worker keep their connections.
        self.loop = asyncio.new_event_loop()
        self.events.put((self.index, self.gen, ("hello", {"pid": os.getpid(), "error": None}, None)))

    def send(self, msg: Any) -> None:
        if msg[0] != "run":
            return
        for task in msg[1]:
            result = self.loop.run_until_complete(self.runner.run(task, self.timeout_s, inline=True))
            self.events.put((self.index, self.gen, ("done", task["episode_id"], result, [])))

    def join(self, timeout: float) -> None:
        if getattr(self, "loop", None) is not None and not self.loop.is_closed():
            self.loop.close()


class _QueueLink:
    """A Link over in-process queues (threading backend); outgoing messages carry the slot tags."""

    def __init__(self, inbox: queue.Queue, events: queue.Queue, index: int, gen: int):
        self.inbox, self.events, self.index, self.gen = inbox, events, index, gen

    def recv(self) -> Any:
        return self.inbox.get()

    def send(self, msg: Any) -> None:
        self.events.put((self.index, self.gen, msg))


def _reason(future: Any) -> str:
    """A short account of why a slot's future ended: loky's exit codes, an exception, or a clean exit."""
    if future.cancelled():
        return "cancelled"
    exc = future.exception()
    if exc is None:
        return "worker exited"
    text = str(exc)
    codes = re.search(r"exit codes of the workers are \{(.*?)\}", text)
    if codes:
        return f"process terminated, exit code {codes.group(1)}"
    return f"{type(exc).__name__}: {text.strip().splitlines()[-1] if text.strip() else ''}"


def callback_host(scheduler_address: str) -> str:
    """The local address dask workers can reach us on: the interface that routes to the scheduler."""
    parsed = urllib.parse.urlparse(scheduler_address if "://" in scheduler_address else f"tcp://{scheduler_address}")
    host = parsed.hostname or ""
    if parsed.scheme == "inproc" or host in ("", "localhost") or host.startswith("127."):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:  # no packet is sent
        probe.connect((host, parsed.port or 8786))
        return probe.getsockname()[0]
