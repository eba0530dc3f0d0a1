"""Process lifetime: children that die with the process that started them, however it dies.

A ``kill -9`` of the trainer runs no ``finally``, no ``atexit`` and no signal
handler, so nothing in the trainer can stop its servers and workers then. The
children have to notice on their own. Two mechanisms, both set up by the child
from the parent's pid, which the parent hands over:

- **parent-death signal** (Linux ``prctl(PR_SET_PDEATHSIG)``): the kernel sends
  the child SIGKILL when its parent dies. The kernel's "parent" is the *thread*
  that forked the child, so it is only asked for when that thread is the main
  thread (whose end is the process's end); a child forked from a helper thread
  would otherwise die when that thread returns. ``getppid()`` is checked right
  after setting it: a parent that died before the call leaves no signal to come.
- **watchdog thread** (every platform): polls ``getppid()`` and, once the
  original parent is gone (the child was re-parented to init or a subreaper),
  kills the child, and the child's whole process group if it leads one.

``ServerManager`` sets the signal through ``preexec_fn`` (it also covers
programs we do not own, like SGLang) and hands the embedded server its pid in
``PARENT_PID_ENV`` for the watchdog. The pool's worker processes do both first
thing (``rollout.runner.serve_process``), before they read their first message.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
import threading
import time
from typing import Callable

PARENT_PID_ENV = "AFLOW_RL_PARENT_PID"  # set by ServerManager for the servers it starts
WATCH_INTERVAL_S = 0.5                   # how often the watchdog looks for its parent
_PR_SET_PDEATHSIG = 1                    # <linux/prctl.h>

# Resolved once, at import, so the forked child in preexec_fn only calls a ready function pointer.
_prctl = None
if sys.platform.startswith("linux"):
    try:
        _prctl = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True).prctl
    except (OSError, AttributeError):  # a libc without prctl (e.g. some static builds): watchdog only
        _prctl = None


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent thread dies (Linux only).

    Returns False where there is no such mechanism; the caller then relies on the watchdog.
    """
    if _prctl is None:
        return False
    return _prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0


def can_signal_children() -> bool:
    """True when children forked from this thread may use the parent-death signal: on Linux,
    from the main thread (a helper thread's exit would fire it while the process lives on)."""
    return _prctl is not None and threading.current_thread() is threading.main_thread()


def preexec_die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` for ``subprocess.Popen`` that gives the child the parent-death signal,
    or None where it cannot be used safely (not Linux, or not called from the main thread)."""
    if not can_signal_children():
        return None
    parent = os.getpid()

    def preexec() -> None:  # runs in the forked child, before exec; the signal survives exec
        set_parent_death_signal(signal.SIGKILL)
        if os.getppid() != parent:  # the parent died between fork and prctl
            os.kill(os.getpid(), signal.SIGKILL)

    return preexec


def die_with_parent(parent_pid: int, use_signal: bool = True, interval_s: float = WATCH_INTERVAL_S) -> None:
    """Call at the start of a child: end this process (and the group it leads) when ``parent_pid``,
    its parent, is gone. ``use_signal``: also set the parent-death signal; pass
    ``can_signal_children()`` as the parent saw it when it started this child."""
    if use_signal:
        set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != parent_pid:  # already orphaned (or not our parent at all): no signal will come
        _die(parent_pid)
    watch_parent(parent_pid, interval_s)


def die_with_parent_from_env() -> int | None:
    """``die_with_parent`` for the pid in ``PARENT_PID_ENV`` (signal not set here: the launcher set it
    in preexec_fn where it could). Returns that pid, or None when the variable is absent (a server
    started by hand lives until it is stopped)."""
    value = os.environ.pop(PARENT_PID_ENV, "")  # popped: our own children have another parent
    if not value:
        return None
    try:
        parent = int(value)
    except ValueError:
        raise SystemExit(f"{PARENT_PID_ENV}={value!r}: expected the launching process's pid") from None
    die_with_parent(parent, use_signal=False)
    return parent


def watch_parent(parent_pid: int, interval_s: float = WATCH_INTERVAL_S) -> threading.Thread:
    """Start the watchdog: a daemon thread that ends this process once its parent is no longer
    ``parent_pid`` (re-parented after the parent's death; pids are not compared for liveness,
    so a recycled pid cannot fool it)."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(interval_s)
        _die(parent_pid)

    thread = threading.Thread(target=watch, daemon=True, name="parent-watchdog")
    thread.start()
    return thread


def _die(parent_pid: int) -> None:
    """SIGKILL this process, and its process group when it leads one (a server started in its own
    session: whatever it started goes too). Never the group of a process that does not lead it:
    that is the parent's group."""
    try:
        os.write(2, f"parent process {parent_pid} is gone; process {os.getpid()} exits with it\n".encode())
    except OSError:
        pass
    if os.getpgid(0) == os.getpid():
        os.killpg(os.getpid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def port_listeners(port: int) -> list[tuple[int | None, str]]:
    """``(pid, command line)`` of every process listening on TCP ``port`` on any address
    (pid None: the process belongs to another user and cannot be seen)."""
    import psutil

    try:
        pids = [c.pid for c in psutil.net_connections(kind="tcp") if _listens_on(c, port)]
    except psutil.AccessDenied:  # macOS without root: look through the processes we may inspect
        pids = []
        for proc in psutil.process_iter():
            try:
                if any(_listens_on(c, port) for c in proc.net_connections(kind="tcp")):
                    pids.append(proc.pid)
            except psutil.Error:
                continue
    return [(pid, _cmdline(pid)) for pid in dict.fromkeys(pids)]  # one entry per process (IPv4 + IPv6)


def _listens_on(conn, port: int) -> bool:
    import psutil

    return conn.status == psutil.CONN_LISTEN and bool(conn.laddr) and conn.laddr.port == port


def _cmdline(pid: int | None, limit: int = 120) -> str:
    import psutil

    if pid is None:
        return ""
    try:
        text = " ".join(" ".join(psutil.Process(pid).cmdline()).split())  # one line, whatever the args hold
    except psutil.Error:
        return ""
    return text if len(text) <= limit else text[:limit - 3] + "..."
