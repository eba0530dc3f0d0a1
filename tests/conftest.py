"""Shared fixtures: the tiny model (built once per session), a gpu marker that skips without CUDA,
and a session guard that fails the run if a test left a process running."""
import os
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny random Qwen2 + BPE tokenizer, built offline once per test session."""
    from aflow_rl.models.tiny import build

    return build(str(tmp_path_factory.mktemp("models") / "tiny"), preset="tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_model_dir_b(tmp_path_factory):
    """Same architecture and tokenizer family, other weights (seed 1)."""
    from aflow_rl.models.tiny import build

    return build(str(tmp_path_factory.mktemp("models_b") / "tiny"), preset="tiny", seed=1)


# What a test session may keep until it exits: the resource trackers that loky and multiprocessing start
# once per process (they end with this process, when their pipe closes).
_SESSION_HELPERS = ("resource_tracker import main",)
_LEFTOVER_GRACE_S = 10.0  # a process being stopped as the last test ends gets this long


@pytest.fixture(scope="session", autouse=True)
def no_process_left_behind(tmp_path_factory):
    """After the last test: every process the tests started must be gone. Looks at this process's
    descendants and at any process whose command line names the session's temporary directory (an
    orphan re-parented to init, e.g. a server whose test lost track of it). Survivors are killed and
    listed, and the run fails."""
    base = os.path.join(str(tmp_path_factory.getbasetemp()), "")
    yield
    left = _leftovers(base)
    deadline = time.monotonic() + _LEFTOVER_GRACE_S
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = _leftovers(base)
    if left:
        names = "; ".join(f"{p.pid}: {_cmdline(p)[:150]}" for p in left)
        for p in left:
            _kill(p)
        pytest.fail(f"{len(left)} process(es) left running by the tests (now killed): {names}", pytrace=False)


def _leftovers(base: str) -> list:
    import psutil

    me = psutil.Process()
    found = {p.pid: p for p in me.children(recursive=True)}
    for p in psutil.process_iter(["cmdline"]):
        if p.pid != me.pid and any(base in arg for arg in p.info["cmdline"] or ()):
            found.setdefault(p.pid, p)
    helpers = {p.pid for p in me.children() if any(h in _cmdline(p) for h in _SESSION_HELPERS)}
    return [p for pid, p in found.items() if pid not in helpers and _alive(p)]


def _alive(p) -> bool:
    import psutil

    try:  # a zombie has ended (its reaper, PID 1 here, may never collect it)
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _cmdline(p) -> str:
    import psutil

    try:
        return " ".join(p.cmdline())
    except psutil.Error:
        return "?"


def _kill(p) -> None:
    import psutil

    try:
        p.kill()
    except psutil.Error:
        pass
