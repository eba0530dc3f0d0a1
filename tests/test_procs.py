"""aflow_rl.procs: children die with their parent (kill -9 included), through the parent-death
signal, through the watchdog alone, and at once when the parent is already gone at start-up."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest

from aflow_rl import procs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")


def gone(pid: int) -> bool:
    """Ended, or a zombie (an orphan's reaper, PID 1 here, may never collect it)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    """The pids still alive after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not all(gone(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if not gone(p)]


def run_parent(child_code: str, tmp_path, popen_extra: str = "") -> tuple[subprocess.Popen, list[int]]:
    """Start a parent process P that starts a child C running ``child_code`` (P's pid in ``sys.argv[1]``)
    and return P with the pids C reports (C prints its own pid and any it starts, one line, then sleeps)."""
    child = tmp_path / "child.py"
    child.write_text(textwrap.dedent(child_code))
    parent = tmp_path / "parent.py"
    parent.write_text(textwrap.dedent(f'''
        import os, subprocess, sys, time
        from aflow_rl import procs
        c = subprocess.Popen([sys.executable, {str(child)!r}, str(os.getpid())], stdout=subprocess.PIPE,
                             text=True{popen_extra})
        print(c.stdout.readline().strip(), flush=True)
        time.sleep(600)
    '''))
    # Its own process group (in our session, so that a test can put a bystander into it).
    proc = subprocess.Popen([sys.executable, str(parent)], stdout=subprocess.PIPE, text=True, env=ENV,
                            process_group=0)
    line = proc.stdout.readline().split()
    assert line, "the parent process printed no child pid"
    return proc, [int(x) for x in line]


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@linux_only
def test_parent_death_signal_kills_the_child_on_kill_9(tmp_path):
    """The signal alone (no watchdog), set by the child itself."""
    parent, pids = run_parent('''
        import sys, time
        from aflow_rl import procs
        assert procs.set_parent_death_signal()
        print(__import__("os").getpid(), flush=True)
        time.sleep(600)
    ''', tmp_path)
    try:
        assert wait_gone(pids, 0.5) == pids, "the child died before its parent"
        parent.kill()
        parent.wait()
        t0 = time.monotonic()
        assert not wait_gone(pids, 5.0)
        assert time.monotonic() - t0 < 1.0  # the kernel's signal: no polling delay
    finally:
        kill_all(pids)


@linux_only
def test_preexec_fn_covers_programs_we_do_not_own(tmp_path):
    """ServerManager's way: preexec_fn sets the signal before exec, for any program (here `sleep`)."""
    parent_py = tmp_path / "parent.py"
    parent_py.write_text(textwrap.dedent('''
        import subprocess, time
        from aflow_rl import procs
        c = subprocess.Popen(["sleep", "600"], preexec_fn=procs.preexec_die_with_parent())
        print(c.pid, flush=True)
        time.sleep(600)
    '''))
    parent = subprocess.Popen([sys.executable, str(parent_py)], stdout=subprocess.PIPE, text=True, env=ENV)
    pid = int(parent.stdout.readline())
    try:
        assert wait_gone([pid], 0.5) == [pid]
        parent.kill()
        parent.wait()
        assert not wait_gone([pid], 5.0)
    finally:
        kill_all([pid])


def test_watchdog_alone_kills_the_child_and_its_group(tmp_path):
    """The portable fallback (macOS, or a child started from a helper thread): no signal, only the
    watchdog; a child leading its own process group (a server) takes its group with it."""
    parent, pids = run_parent('''
        import os, subprocess, sys, time
        from aflow_rl import procs
        grandchild = subprocess.Popen(["sleep", "600"])   # in the child's group, with no guard of its own
        procs.die_with_parent(int(sys.argv[1]), use_signal=False, interval_s=0.1)
        print(os.getpid(), grandchild.pid, flush=True)
        time.sleep(600)
    ''', tmp_path, popen_extra=", start_new_session=True, stderr=open(os.devnull, 'w')")
    try:
        assert wait_gone(pids, 0.5) == pids
        parent.kill()
        parent.wait()
        assert not wait_gone(pids, 5.0)
    finally:
        kill_all(pids)


def test_watchdog_does_not_kill_the_parents_group(tmp_path):
    """A child in its parent's group (a loky worker) kills only itself: never the group it shares."""
    parent, pids = run_parent('''
        import os, sys, time
        from aflow_rl import procs
        procs.die_with_parent(int(sys.argv[1]), use_signal=False, interval_s=0.1)
        print(os.getpid(), flush=True)
        time.sleep(600)
    ''', tmp_path)
    bystander = subprocess.Popen(["sleep", "600"], process_group=parent.pid)  # same group as parent+child
    try:
        parent.kill()
        parent.wait()
        assert not wait_gone(pids, 5.0)
        assert bystander.poll() is None, "the watchdog killed its parent's whole process group"
    finally:
        kill_all(pids + [bystander.pid])
        bystander.wait()


def test_an_already_orphaned_child_exits_at_once():
    """The race: the parent died before the child set its guard. The child sees a parent other than
    the one it was given and exits at start instead of waiting for a signal that will never come."""
    not_my_parent = 1  # init: not the launcher of a process started by pytest
    code = f"from aflow_rl import procs; procs.die_with_parent({not_my_parent}); import time; time.sleep(60)"
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert f"parent process {not_my_parent} is gone" in proc.stderr
    assert time.monotonic() - t0 < 10


def test_parent_pid_env_is_read_once_and_not_inherited(monkeypatch):
    monkeypatch.delenv(procs.PARENT_PID_ENV, raising=False)
    assert procs.die_with_parent_from_env() is None  # a server started by hand runs until stopped
    monkeypatch.setenv(procs.PARENT_PID_ENV, "x")
    with pytest.raises(SystemExit, match="AFLOW_RL_PARENT_PID='x'"):
        procs.die_with_parent_from_env()
    calls = []  # no real watchdog in pytest's own process
    monkeypatch.setattr(procs, "die_with_parent", lambda pid, use_signal: calls.append((pid, use_signal)))
    monkeypatch.setenv(procs.PARENT_PID_ENV, "4242")
    assert procs.die_with_parent_from_env() == 4242
    assert calls == [(4242, False)]  # the signal is the launcher's to set (it knows its thread)
    assert procs.PARENT_PID_ENV not in os.environ  # the server's own children have another parent


@linux_only
def test_signal_is_only_offered_from_the_main_thread():
    """PR_SET_PDEATHSIG fires when the forking *thread* ends: a helper thread must not use it."""
    assert procs.can_signal_children() and procs.preexec_die_with_parent() is not None
    seen = []
    t = threading.Thread(target=lambda: seen.append((procs.can_signal_children(), procs.preexec_die_with_parent())))
    t.start()
    t.join()
    assert seen == [(False, None)]


def test_port_listeners_names_the_process():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        assert procs.port_listeners(port) == []  # bound, not listening
        s.listen()
        ((pid, cmd),) = procs.port_listeners(port)
        assert pid == os.getpid() and "pytest" in cmd and "\n" not in cmd
