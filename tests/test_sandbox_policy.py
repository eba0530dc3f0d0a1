"""aflow_rl.sandbox: basic isolation runs untrusted code only when the config says so
(``sandbox.allow_unisolated: true``), a jail that fails is never a silent fall back, and every
run says once at start-up which isolation it uses."""
import logging

import psutil
import pytest

import train
from aflow_rl import sandbox
from aflow_rl.config import ConfigError, format_help, load_config
from aflow_rl.sandbox import SandboxRefused, configure, run_judged, run_python

ALLOW = "AFLOW_SANDBOX_ALLOW_UNISOLATED"


@pytest.fixture
def refused_basic(monkeypatch):
    """Basic isolation forced, nothing allowing it (the test session allows it by default)."""
    monkeypatch.setenv("AFLOW_SANDBOX", "basic")
    monkeypatch.delenv(ALLOW, raising=False)


def _one_line_naming_the_key(msg: str) -> None:
    assert "\n" not in msg
    assert "sandbox.allow_unisolated: true" in msg and "basic isolation" in msg


def test_basic_refuses_untrusted_code_unless_allowed(refused_basic):
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(SandboxRefused) as exc:
        run_python("open('/etc/pwned', 'w')")
    _one_line_naming_the_key(str(exc.value))
    assert "AFLOW_SANDBOX=basic is set" in str(exc.value)
    with pytest.raises(SandboxRefused):
        run_judged("def f(): return 1", tests="def check(c): assert c() == 1", entry_point="f")
    assert {p.pid for p in psutil.Process().children(recursive=True)} - before == set()  # nothing ran
    assert isinstance(exc.value, ConfigError)  # train.py's cli prints it as one line


def test_allow_unisolated_lets_basic_run(refused_basic, monkeypatch):
    line = configure(True)
    assert line.startswith("sandbox: basic, NOT isolated (forced by AFLOW_SANDBOX=basic; allowed by "
                           "sandbox.allow_unisolated); "), line
    assert run_python("print(6 * 7)").stdout == "42\n"
    monkeypatch.delenv(ALLOW)
    assert configure(False, check=False) == ""
    with pytest.raises(SandboxRefused):
        run_python("print(1)")


def test_the_operators_variable_also_allows(refused_basic, monkeypatch):
    monkeypatch.setenv(ALLOW, "1")
    assert configure(False).startswith("sandbox: basic, NOT isolated")
    assert run_python("print(1)").ok


def test_a_failing_jail_is_refused_not_silently_demoted(monkeypatch):
    # The jail used to fall back to basic with a log warning only (an interpreter under /tmp did that).
    monkeypatch.delenv("AFLOW_SANDBOX", raising=False)
    monkeypatch.delenv(ALLOW, raising=False)
    monkeypatch.setattr(sandbox, "_probed", None)
    monkeypatch.setattr(sandbox, "_probe_jail", lambda: ("basic", "the jail failed to start: mount /tmp: EPERM"))
    with pytest.raises(SandboxRefused) as exc:
        run_python("print(1)")
    _one_line_naming_the_key(str(exc.value))
    assert "(the jail failed to start: mount /tmp: EPERM)" in str(exc.value)


def test_jail_needs_no_permission(jail, monkeypatch):
    monkeypatch.delenv(ALLOW, raising=False)
    line = configure(False)
    assert line.startswith("sandbox: jail (namespaces, read-only chroot, a fresh uid, no network); "), line
    assert line.endswith(f"; work dir: a {sandbox.WORK_DIR_MB} MB tmpfs")
    assert sandbox.limits_summary() in line
    assert run_python("print(1)").ok


def test_isolation_is_said_once_per_process(mode, monkeypatch, caplog):
    monkeypatch.setattr(sandbox, "_announced", False)
    with caplog.at_level(logging.INFO, logger="aflow_rl.sandbox"):
        for _ in range(3):
            assert run_python("print(1)").ok
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("sandbox: ")]
    assert lines == [sandbox.describe()], lines
    assert lines[0].startswith(f"sandbox: {mode}")


def test_config_key_and_its_help():
    assert load_config(None, []).sandbox.allow_unisolated is False
    assert load_config(None, ["sandbox.allow_unisolated=true"]).sandbox.allow_unisolated is True
    assert "sandbox.allow_unisolated" in format_help()
    with pytest.raises(ConfigError, match="sandbox.allow_unisolated"):
        load_config(None, ["sandbox.allow_unisolated=maybe"])


def test_train_preflight_refuses_an_aflow_run_without_isolation(refused_basic, capsys):
    cfg = load_config(None, ["env.name=aflow"])
    with pytest.raises(SandboxRefused):
        train.preflight(cfg)
    cfg = load_config(None, ["env.name=aflow", "sandbox.allow_unisolated=true"])
    train.preflight(cfg)
    assert capsys.readouterr().out.startswith("sandbox: basic, NOT isolated")
