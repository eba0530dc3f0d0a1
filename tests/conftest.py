"""Shared fixtures: the tiny model (built once per session), a gpu marker that skips without CUDA, and a
session check that every process the tests started has ended."""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# tests.leftovers: the session check that every process a test started has ended (autouse).
# pytester: tests/test_leftovers.py runs that check on inner sessions.
pytest_plugins = ["tests.leftovers", "pytester"]


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



# Tests run trusted code in the sandbox, on machines with or without a jail: basic isolation is allowed
# (sandbox.allow_unisolated); tests/test_sandbox_policy.py checks the refusal with this unset.
os.environ.setdefault("AFLOW_SANDBOX_ALLOW_UNISOLATED", "1")


@pytest.fixture(params=["jail", "basic"])
def mode(request, monkeypatch):
    """Each sandbox isolation mode in turn (AFLOW_SANDBOX); jail skips where the machine cannot make one.
    Shared by tests/test_sandbox.py and the AFlow reward-hack battery."""
    from aflow_rl import sandbox

    monkeypatch.delenv("AFLOW_SANDBOX", raising=False)
    if request.param == "jail" and sandbox.isolation() != "jail":
        pytest.skip("no jail on this machine (needs Linux, root, CAP_SYS_ADMIN)")
    monkeypatch.setenv("AFLOW_SANDBOX", request.param)
    return request.param


@pytest.fixture
def jail(monkeypatch):
    """The sandbox's jail mode; skips where the machine cannot make one (needs Linux, root, CAP_SYS_ADMIN)."""
    from aflow_rl import sandbox

    monkeypatch.delenv("AFLOW_SANDBOX", raising=False)
    if sandbox.isolation() != "jail":
        pytest.skip("no jail on this machine (needs Linux, root, CAP_SYS_ADMIN)")
