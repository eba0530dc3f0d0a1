"""A session check that every process the tests started has ended, and ``kill_tree`` for tests that kill a run.

A pytest plugin: tests/conftest.py loads it (``pytest_plugins``); tests/test_leftovers.py runs it in inner
sessions with ``-p tests.leftovers``.
"""
import os
import time
import uuid

import psutil
import pytest


# Every process the session starts inherits this variable, so one that outlived its parent (re-parented
# to init, in a session of its own) is still found at the end.
SESSION_ENV = "AFLOW_TEST_SESSION"
LEFTOVER_GRACE_S = 5.0
# Set on import (conftest.py imports this before any test module), not in the fixture: test modules copy
# os.environ at import time for their subprocesses (tests/test_train.py's ENV). A new token per session,
# also in an inner session that inherited an outer one's.
_TOKEN = os.environ[SESSION_ENV] = uuid.uuid4().hex


def _started_by_session(me: psutil.Process, token: str, before: set) -> list[psutil.Process]:
    """Live processes started during this session: descendants of the test process, and orphans with the token."""
    found = {p.pid: p for p in me.children(recursive=True)}
    for p in psutil.process_iter():
        if p.pid in found or p.pid == me.pid:
            continue
        try:
            if p.environ().get(SESSION_ENV) == token:
                found[p.pid] = p
        except psutil.Error:  # gone, or another user's
            continue
    alive = []
    for p in found.values():
        try:
            if (p.pid, p.create_time()) in before or p.status() == psutil.STATUS_ZOMBIE:
                continue
            if _dies_with(me, p):
                continue
            alive.append(p)
        except psutil.Error:
            continue
    return alive


def _dies_with(me: psutil.Process, p: psutil.Process) -> bool:
    """A resource tracker that this process started (loky's, multiprocessing's): it reads a pipe only we
    hold, and exits on its EOF when the test process does, so it is no leftover."""
    return p.ppid() == me.pid and any("resource_tracker" in part for part in p.cmdline())


def _describe(p: psutil.Process) -> str:
    try:
        return f"pid {p.pid}: {' '.join(p.cmdline())[:300]}"
    except psutil.Error:
        return f"pid {p.pid}: (ended while being described)"


@pytest.fixture(scope="session", autouse=True)
def no_leftover_processes():
    """Fails the run if a process a test started is still alive after the session (and kills it).

    Autouse and session-scoped: set up before, and torn down after, every other session fixture, so a
    session-wide server that its own fixture stops in time is not reported.
    """
    me = psutil.Process()
    before = {(p.pid, p.create_time()) for p in me.children(recursive=True)}
    yield
    deadline = time.monotonic() + LEFTOVER_GRACE_S
    while (left := _started_by_session(me, _TOKEN, before)) and time.monotonic() < deadline:
        time.sleep(0.2)  # a server being stopped right now gets a moment to exit
    if not left:
        return
    lines = [_describe(p) for p in left]
    for p in left:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(left, timeout=5)
    pytest.fail(f"{len(lines)} process(es) started by the tests were still alive {LEFTOVER_GRACE_S:g} s after the "
                "session (now killed); a test or fixture does not stop what it starts:\n  " + "\n  ".join(lines),
                pytrace=False)


def kill_tree(proc, timeout_s: float = 10.0) -> None:
    """SIGKILL ``proc`` (a ``subprocess.Popen``) and every process below it, then wait for them.

    A ``killpg`` is not enough: the servers a run starts live in sessions of their own. The tree is frozen
    first (SIGSTOP), so nothing in it starts another process between listing and killing.
    """
    try:
        root = psutil.Process(proc.pid)
        root.suspend()
        tree = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        tree = []
    for p in tree:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait(timeout=timeout_s)
    _, alive = psutil.wait_procs(tree, timeout=timeout_s)
    assert not alive, f"still alive {timeout_s:g} s after SIGKILL: {[_describe(p) for p in alive]}"
