"""The session check of tests/leftovers.py, run on an inner pytest session: it must name and kill what a
test leaves running (a child, and an orphan that left our process tree), and stay quiet otherwise."""
import sys

import psutil

from tests.conftest import ROOT

LEAKY = '''
import subprocess, sys

SLEEP = [sys.executable, "-c", "import time; time.sleep(120)  # leaked-by-test"]

def test_leaks_a_child(tmp_path):
    proc = subprocess.Popen(SLEEP)
    open({pids!r} + "/child", "w").write(str(proc.pid))

def test_leaks_an_orphan():
    # The middle process exits at once; the sleeper, in a session of its own, is re-parented to init.
    spawn = (f"import subprocess; p = subprocess.Popen({{SLEEP!r}}, start_new_session=True, "
             "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); print(p.pid)")
    out = subprocess.run([sys.executable, "-c", spawn], capture_output=True, text=True, check=True).stdout
    open({pids!r} + "/orphan", "w").write(out.strip())
'''

CLEAN = '''
import subprocess, sys

def test_waits_for_its_child():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
'''


def _run_inner(pytester, monkeypatch, source: str):
    monkeypatch.setenv("PYTHONPATH", ROOT)
    pytester.makepyfile(test_inner=source)
    return pytester.runpytest_subprocess("-p", "tests.leftovers", "-p", "no:cacheprovider", "-q")


def test_leftover_child_and_orphan_fail_the_session(pytester, monkeypatch, tmp_path):
    result = _run_inner(pytester, monkeypatch, LEAKY.format(pids=str(tmp_path)))
    out = result.stdout.str()
    assert result.ret != 0, out
    assert "2 passed, 1 error" in out and "2 process(es) started by the tests were still alive" in out, out
    for name in ("child", "orphan"):
        pid = int((tmp_path / name).read_text())
        assert f"pid {pid}: {sys.executable} -c import time; time.sleep(120)  # leaked-by-test" in out, out
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE  # and killed


def test_a_clean_session_passes(pytester, monkeypatch):
    result = _run_inner(pytester, monkeypatch, CLEAN)
    assert result.ret == 0, result.stdout.str()
    assert "still alive" not in result.stdout.str()
