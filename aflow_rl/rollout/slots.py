"""Where episodes run: one *slot* is the transport to one worker (a process, a dask task, a thread).

A slot starts, stops and kills its worker and carries messages
(``rollout.messages``) to and from it; the pool keeps all episode bookkeeping.
Every slot reports to one ``queue.Queue`` of events ``(slot_index, generation,
message)``; the generation changes each time a slot is (re)started, so messages
from a replaced process or abandoned thread are recognised and dropped.

- ``ProcessSlot`` (``rollout.backend: loky``, the name kept from the launcher it
  replaced): a fresh interpreter (``subprocess.Popen``) running
  ``runner.serve_process`` over a socket pair. One reader thread waits on the
  pipe and the process's pidfd together; the pipe's end of file follows every
  message the worker sent, so no finished result is lost in a crash, and the
  loss carries the reason from the exit code (``killed by SIGKILL``). The
  process dies with the pool's process (``aflow_rl.procs.die_with_parent``).
- ``DaskSlot``: a long-running task on a ``distributed`` cluster, dialling back
  to the pool's ``Switchboard`` (an authenticated ``multiprocessing.connection``
  socket); the task's end is reported as ``Exited`` and its socket's end of
  file as ``Lost``.
- ``ThreadSlot``: a thread in this process (threading backend).
- ``InlineSlot``: the caller's thread, one episode at a time (sequential backend).
"""
from __future__ import annotations

import abc
import asyncio
import dataclasses
import os
import queue
import secrets
import signal
import socket
import subprocess
import sys
import threading
import urllib.parse
from multiprocessing.connection import Connection, Listener, wait
from typing import Any

from aflow_rl.procs import can_signal_children
from aflow_rl.rollout.messages import (Done, Exited, Hello, Lost, Run, Stop, WorkerStartError, decode,
                                       encode)
from aflow_rl.rollout.runner import EpisodeRunner, get_runner, serve, serve_remote
from aflow_rl.rollout.types import WorkerContext

STARTING, READY, DEAD = "starting", "ready", "dead"
_REAP_S = 2.0  # how long a process whose pipe closed may take to exit before its loss is reported anyway


class Slot(abc.ABC):
    """The transport to one worker: start it, send it messages, stop or kill it."""

    kind = "slot"
    killable = True  # a stuck sync thread can be cleared by replacing the process

    def __init__(self, index: int, events: queue.Queue, spec: str, ctx: WorkerContext,
                 concurrency: int, timeout_s: float):
        self.index, self.events, self.spec, self.ctx = index, events, spec, ctx
        self.concurrency, self.timeout_s = concurrency, timeout_s
        self.gen = 0
        self.state = DEAD
        self.pid: int | None = None

    def start(self) -> None:
        """Launch a fresh generation; its ``Hello`` arrives as an event."""
        self.gen += 1
        self.state, self.pid = STARTING, None
        self._launch()

    def ready(self, info: dict) -> None:
        self.state, self.pid = READY, info.get("pid")

    def _post(self, gen: int, msg: Any) -> None:
        self.events.put((self.index, gen, msg))

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

    def exit_reason(self) -> str:
        """Why the slot went away, if the launcher knows more than the transport said."""
        return ""

    def start_error(self) -> str:
        """The worker's start-up error, if it exited with one before its hello was read."""
        return ""


class ProcessSlot(Slot):
    """A worker process (``python -c _BOOT``) running ``serve_process`` over its end of a socket pair.

    Why not multiprocessing's spawn: it re-runs the parent's main script in
    the child, so a script that makes a pool without an ``if __name__ ==
    "__main__"`` guard fails; and it starts a resource tracker nothing here uses.
    """

    kind = "process"

    def __init__(self, *args: Any, sys_path: list[str], **kw: Any):
        super().__init__(*args, **kw)
        self.sys_path = sys_path
        self.conn: Any = None
        self.process: subprocess.Popen | None = None
        self.reader: threading.Thread | None = None

    def _launch(self) -> None:
        self.process = None
        ours, theirs = socket.socketpair()
        with theirs:
            self.process = subprocess.Popen([sys.executable, "-c", _BOOT, str(theirs.fileno())],
                                            pass_fds=[theirs.fileno()])
        # Closed here once the child has its copy: our copy would keep the pipe from ever ending.
        self.conn = Connection(ours.detach())
        # Each process gets its own copy of the context, with its index; state is per process.
        ctx = dataclasses.replace(self.ctx, worker_index=self.index, state={})
        # can_signal_children() is read here, in the thread that forked: the kernel's parent-death
        # signal is tied to that thread (aflow_rl.procs).
        self._send_raw(self.sys_path, (os.getpid(), can_signal_children(), self.spec, ctx, self.concurrency,
                                      self.timeout_s, self.sys_path))
        self.reader = threading.Thread(target=self._read, args=(self.conn, self.process, self.gen),
                                       daemon=True, name=f"rollout-reader-{self.index}")
        self.reader.start()

    def _send_raw(self, *items: Any) -> None:
        try:
            for item in items:
                self.conn.send(item)
        except OSError:  # it died at once; the reader reports how
            pass

    def _read(self, conn: Any, process: subprocess.Popen, gen: int) -> None:
        """Forward the worker's messages until its pipe ends or its process is gone, then say ``Lost``.

        The process's pidfd matters when a child the worker forked still holds
        the pipe open: the pipe never ends, but the worker's death is still
        seen. The reader is the only thread that waits for (reaps) the process.
        """
        reason = ""
        pidfd = _pidfd(process.pid)
        try:
            while True:
                if conn in wait([conn] + ([pidfd] if pidfd is not None else [])):
                    self._post(gen, decode(conn.recv()))
                    continue
                while conn.poll(0):  # dead: what it wrote before dying is all in the pipe already
                    self._post(gen, decode(conn.recv()))
                break
        except (EOFError, OSError):
            pass
        except Exception as exc:  # a message that does not unpickle here
            reason = f"unreadable message: {exc!r}"
        finally:
            if pidfd is not None:
                os.close(pidfd)
        conn.close()
        self._post(gen, Lost(reason or _exit_reason(process)))

    def send(self, msg: Any) -> None:
        if self.state == DEAD:  # killed or stopped: the pool has moved on
            return
        try:
            self.conn.send(encode(msg))
        except (OSError, EOFError):  # it died (or the reader closed the pipe); the reader reports it
            pass

    def stop(self) -> None:
        if self.state == READY:
            self.send(Stop())
        super().stop()

    def kill(self) -> None:
        super().kill()
        if self.process is not None and self.process.returncode is None:
            self.process.kill()  # the reader sees the end, reaps it, and posts Lost (to a stale gen)

    def join(self, timeout: float) -> None:
        if self.reader is None:
            return
        self.reader.join(timeout)
        if self.reader.is_alive():  # did not stop when asked
            self.process.kill()
            self.reader.join(_REAP_S)


# The worker's first moments use the standard library only: the parent's sys.path (the repository
# may be on it by hand, not installed) arrives first and replaces the child's, as multiprocessing's
# spawn does; then the arguments of runner.serve_process, which unpickle with it.
_BOOT = ("import sys; from multiprocessing.connection import Connection; conn = Connection(int(sys.argv[1])); "
         "sys.path[:] = conn.recv(); "
         "from aflow_rl.rollout.runner import serve_process; serve_process(conn, *conn.recv())")


def _pidfd(pid: int) -> int | None:
    """A descriptor that becomes readable when process ``pid`` ends (Linux 5.3+), or None."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def _exit_reason(process: subprocess.Popen) -> str:
    """The process's exit, from its exit code (negative: the signal that ended it)."""
    try:
        code = process.wait(_REAP_S)
    except subprocess.TimeoutExpired:
        return "its pipe closed while the process still runs"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}" + ("" if code == 0 else "; its traceback, if any, is on stderr above")


class Switchboard:
    """A listening socket that dask workers dial back to; one reader thread per connection.

    A connection's first message is ``Dial(slot, gen)``; a generation the pool
    no longer runs is hung up on. The slot takes its connection when its
    ``Hello`` is handled.
    """

    def __init__(self, events: queue.Queue, host: str = "127.0.0.1"):
        self.events = events
        self.authkey = secrets.token_bytes(32)
        # Listener's default backlog is 1: workers dialling in together would wait on TCP retries.
        self.listener = Listener((host, 0), backlog=256, authkey=self.authkey)
        self.address = self.listener.address
        self.closed = False
        self.current: dict[int, int] = {}             # slot -> the generation it runs
        self.conns: dict[tuple[int, int], Any] = {}   # (slot, gen) -> its connection
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
            slot, gen = decode(conn.recv())
        except Exception:
            conn.close()
            return
        if self.current.get(slot) != gen:  # a replaced generation dialled in late
            conn.close()
            return
        self.conns[(slot, gen)] = conn
        while True:
            try:
                msg = decode(conn.recv())
            except (EOFError, OSError):
                self.events.put((slot, gen, Lost("connection closed")))
                return
            except Exception as exc:  # a message that does not unpickle here
                self.events.put((slot, gen, Lost(f"unreadable message: {exc!r}")))
                return
            self.events.put((slot, gen, msg))

    def close(self) -> None:
        self.closed = True
        self.listener.close()
        for conn in list(self.conns.values()):
            conn.close()
        try:  # a closed socket does not wake a blocked accept() on Linux; a connection does
            socket.create_connection(self.address, timeout=1).close()
        except OSError:
            pass


class DaskSlot(Slot):
    """A long-running task on a dask cluster (it holds one worker thread for the pool's lifetime)."""

    kind = "dask"
    killable = False  # the pool cannot kill a remote thread; a wedged one is abandoned

    def __init__(self, *args: Any, board: Switchboard, sys_path: list[str], client: Any, **kw: Any):
        super().__init__(*args, **kw)
        self.board, self.sys_path, self.client = board, sys_path, client
        self.conn: Any = None
        self.future: Any = None

    def _launch(self) -> None:
        self.board.current[self.index] = self.gen
        ctx = dataclasses.replace(self.ctx, worker_index=self.index, state={})
        args = (self.board.address, self.board.authkey, self.index, self.gen, self.spec, ctx,
                self.concurrency, self.timeout_s, self.sys_path)
        # pure=False: every launch is a new task; a unique key so dask never dedupes generations.
        self.future = self.client.submit(serve_remote, *args, pure=False,
                                         key=f"rollout-slot-{self.index}-{self.gen}-{secrets.token_hex(4)}")
        gen = self.gen
        self.future.add_done_callback(lambda f: self._post(gen, Exited(_future_reason(f))))

    def ready(self, info: dict) -> None:
        super().ready(info)
        self.conn = self.board.conns.pop((self.index, self.gen), None)

    def send(self, msg: Any) -> None:
        if self.conn is None:  # already closed by kill(); the pool has moved on
            return
        try:
            self.conn.send(encode(msg))
        except (OSError, EOFError):  # it died; the reader reports the loss
            pass

    def stop(self) -> None:
        if self.conn is not None and self.state == READY:
            self.send(Stop())
        super().stop()

    def kill(self) -> None:
        super().kill()
        self._close_conn()  # the serve loop sees EOF and returns, unless its loop is blocked
        if self.future is not None:
            self.future.cancel()  # and dask does not re-run it elsewhere

    def _close_conn(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def exit_reason(self) -> str:
        # A dead dask worker's task is rescheduled, not failed: waiting on it would only stall the pool.
        return _future_reason(self.future) if self.future is not None and self.future.done() else ""

    def start_error(self) -> str:
        f = self.future
        if f is None or not f.done() or f.cancelled() or f.exception() is not None:
            return ""
        info = f.result()
        return info.get("error") or "" if isinstance(info, dict) else ""

    def join(self, timeout: float) -> None:
        if self.future is None:
            return
        try:
            self.future.result(timeout=timeout)
        except Exception:
            pass
        self._close_conn()


def _future_reason(future: Any) -> str:
    """A short account of why a dask task ended: cancelled, an exception, or a clean exit."""
    if future.cancelled():
        return "cancelled"
    exc = future.exception()
    if exc is None:
        return "worker exited"
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[-1] if text else ''}"


def callback_host(scheduler_address: str) -> str:
    """The local address dask workers can reach us on: the interface that routes to the scheduler."""
    parsed = urllib.parse.urlparse(scheduler_address if "://" in scheduler_address else f"tcp://{scheduler_address}")
    host = parsed.hostname or ""
    if parsed.scheme == "inproc" or host in ("", "localhost") or host.startswith("127."):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:  # no packet is sent
        probe.connect((host, parsed.port or 8786))
        return probe.getsockname()[0]


class ThreadSlot(Slot):
    """A thread of this process with its own event loop (threading backend)."""

    kind = "thread"
    killable = False  # threads cannot be killed: a hung sync episode keeps its thread

    def _launch(self) -> None:
        self.inbox: queue.Queue = queue.Queue()
        gen = self.gen
        link = _QueueLink(self.inbox, lambda msg: self._post(gen, msg))

        def main() -> None:
            reason = "thread exited"
            try:
                runner = get_runner(self.spec, self.ctx)
            except WorkerStartError as exc:
                self._post(gen, Hello({"pid": os.getpid(), "error": str(exc)}))
                return
            self._post(gen, Hello({"pid": os.getpid(), "error": None}))
            try:
                asyncio.run(serve(link, runner, self.concurrency, self.timeout_s))
            except BaseException as exc:  # reported as a loss; the pool replaces the slot
                reason = f"serve loop crashed: {exc!r}"
            self._post(gen, Lost(reason))

        self.thread = threading.Thread(target=main, daemon=True, name=f"rollout-slot-{self.index}")
        self.thread.start()

    def send(self, msg: Any) -> None:
        self.inbox.put(msg)

    def stop(self) -> None:
        if self.state != DEAD:
            self.inbox.put(Stop())
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

    def __init__(self, *args: Any, **kw: Any):
        super().__init__(*args, **kw)
        self.concurrency = 1

    def _launch(self) -> None:
        try:
            self.runner: EpisodeRunner | None = get_runner(self.spec, self.ctx)
        except WorkerStartError as exc:
            self._post(self.gen, Hello({"pid": os.getpid(), "error": str(exc)}))
            return
        # One loop for the pool's life, so clients made in init_worker keep their connections.
        self.loop = asyncio.new_event_loop()
        self._post(self.gen, Hello({"pid": os.getpid(), "error": None}))

    def send(self, msg: Any) -> None:
        if not isinstance(msg, Run):
            return
        for task in msg.tasks:
            result = self.loop.run_until_complete(self.runner.run(task, self.timeout_s, inline=True))
            self._post(self.gen, Done(task["episode_id"], result, []))

    def join(self, timeout: float) -> None:
        if getattr(self, "loop", None) is not None and not self.loop.is_closed():
            self.loop.close()


class _QueueLink:
    """A Link over in-process queues (threading backend); outgoing messages go to the pool's events."""

    def __init__(self, inbox: queue.Queue, post: Any):
        self.inbox, self.send = inbox, post

    def recv(self) -> Any:
        return self.inbox.get()


__all__ = ["STARTING", "READY", "DEAD", "Slot", "ProcessSlot", "DaskSlot", "ThreadSlot", "InlineSlot",
           "Switchboard", "callback_host"]
