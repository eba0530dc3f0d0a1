"""aflow_rl.sandbox: each hostile program is contained and reported, the host unharmed.

Most tests run in both modes: ``jail`` (skipped where the machine cannot build
one) and ``basic`` (the fallback, forced with AFLOW_SANDBOX=basic). Tests of
what only the jail promises (filesystem, raw sockets, /proc) run in jail mode only.
"""
import os
import socket
import sys
import threading
import time

import psutil
import pytest

from aflow_rl import sandbox
from aflow_rl.sandbox import NPROC, run_python


def _has_cap_sys_admin() -> bool:
    with open("/proc/self/status") as f:
        caps = next(line for line in f if line.startswith("CapEff:"))
    return bool(int(caps.split()[1], 16) & (1 << 21))


def _leftovers(token: str) -> list[int]:
    return [p.pid for p in psutil.process_iter(["cmdline"]) if token in " ".join(p.info["cmdline"] or ())]


@pytest.mark.skipif(not sys.platform.startswith("linux") or os.geteuid() != 0, reason="jail needs Linux root")
def test_jail_is_used_where_it_can_be(monkeypatch):
    # Root with CAP_SYS_ADMIN must get the jail; a silent fall back to basic would hide a broken jail.
    monkeypatch.delenv("AFLOW_SANDBOX", raising=False)
    if not _has_cap_sys_admin():
        pytest.skip("no CAP_SYS_ADMIN")
    assert sandbox.isolation() == "jail"


def test_jail_works_for_an_interpreter_under_tmp(jail, tmp_path):
    """The jail mounts its work dir at /tmp; an interpreter living under /tmp (a venv made there) must
    still be visible inside, not silently demoted to basic isolation."""
    import subprocess

    venv = tmp_path / "venv"
    assert str(venv).startswith("/tmp/")
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True)
    code = ("from aflow_rl import sandbox\n"
            "r = sandbox.run_python('import sys; print(sys.executable)')\n"
            "print(sandbox.isolation(), r.ok, r.stdout.strip())\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # The venv's --system-site-packages is the base interpreter's, not this (possibly virtual) one's:
    # hand it this interpreter's site-packages too, so psutil and the rest import on a fresh machine.
    import site

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, *site.getsitepackages()])}
    env.pop("AFLOW_SANDBOX", None)
    out = subprocess.run([str(venv / "bin" / "python"), "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.stdout.split() == ["jail", "True", str(venv / "bin" / "python")], out.stderr[-2000:]


def test_ok_program_reads_stdin_writes_stdout(mode):
    r = run_python("import sys\nname = sys.stdin.read().strip()\nprint(f'hello {name}')\nprint(sum(range(10)))",
                   stdin="world\n")
    assert r.ok and r.exit_code == 0 and not r.timed_out and r.error == ""
    assert r.stdout == "hello world\n45\n"
    assert r.stderr == ""


def test_exit_code_and_stderr(mode):
    r = run_python("import sys\nprint('partial')\nsys.stderr.write('bad things\\n')\nsys.exit(3)")
    assert not r.ok and r.exit_code == 3 and r.stdout == "partial\n"
    assert r.error == "exit code 3: bad things"


def test_syntax_error(mode):
    r = run_python("def f(:\n    return 1\n")
    assert not r.ok and r.exit_code != 0 and not r.timed_out
    assert "SyntaxError" in r.stderr and "SyntaxError" in r.error
    assert 'File "main.py", line 1' in r.stderr  # the prelude's frames are not shown


def test_infinite_loop_times_out(mode):
    t0 = time.monotonic()
    r = run_python("while True:\n    pass\n", timeout_s=1)
    elapsed = time.monotonic() - t0
    assert r.timed_out and not r.ok and r.exit_code < 0
    assert r.error == "timed out after 1 s"
    assert elapsed < 1 + 2.0, f"took {elapsed:.2f} s"


def _children() -> set[int]:
    """PIDs of this test process's descendants (with creation times, so a reused PID differs)."""
    out = set()
    for p in psutil.Process().children(recursive=True):
        try:
            out.add((p.pid, p.create_time()))
        except psutil.NoSuchProcess:
            pass
    return out


def test_fork_bomb_contained(mode):
    # The classic bomb: every process forks until it cannot.
    before = _children()   # other tests' servers and pool workers may be alive: compare, don't assume none
    t0 = time.monotonic()
    r = run_python("import os\nwhile True:\n    os.fork()\n", timeout_s=10)
    assert not r.ok and not r.timed_out, r
    assert time.monotonic() - t0 < 10
    if mode == "jail":
        assert r.error == f"process limit of {NPROC} processes/threads reached"
    else:
        assert "creating processes is disabled" in r.error
    assert _children() - before == set()
    assert run_python("print('still fine')").stdout == "still fine\n"  # the host keeps working


def test_fork_bomb_orphans_do_not_survive(mode):
    # Worse: children leave the process group (setsid) and sleep, the parent exits cleanly.
    # posix.fork bypasses basic mode's Python guard, so both modes have real orphans to clean up.
    code = """
import posix, os, sys, time
print(sys.orig_argv[-1], flush=True)
n = 0
for _ in range(100):
    try:
        if posix.fork() == 0:
            os.setsid()
            time.sleep(60)
            os._exit(0)
        n += 1
    except OSError:
        break
print("forked", n, flush=True)
"""
    before = _children()
    r = run_python(code, timeout_s=10)
    token, forked = r.stdout.split("\n")[0], r.stdout.split()[-1]
    assert token.startswith("aflow-sandbox:"), r
    if mode == "jail":
        assert int(forked) < NPROC  # RLIMIT_NPROC held under the per-run uid
    assert _children() - before == set()
    time.sleep(0.2)
    assert _leftovers(token) == []


def test_memory_bomb_contained(mode):
    rss_before = psutil.Process().memory_info().rss
    r = run_python("chunks = []\nwhile True:\n    chunks.append(bytearray(10**6))\n", memory_mb=128, timeout_s=10)
    assert not r.ok and not r.timed_out
    assert r.error == "memory limit 128 MB exceeded"
    assert "MemoryError" in r.stderr
    assert psutil.Process().memory_info().rss - rss_before < 64 << 20  # the host did not take the hit


def test_secret_env_not_visible(mode, monkeypatch):
    monkeypatch.setenv("AFLOW_SECRET", "s3cret")
    r = run_python("import os\nprint(os.environ.get('AFLOW_SECRET'))\nprint(sorted(os.environ))")
    assert r.ok, r
    assert r.stdout.split("\n")[0] == "None"
    assert "s3cret" not in r.stdout and "AFLOW_SECRET" not in r.stdout


def test_network_socket_refused(mode):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        server.settimeout(0.3)
        port = server.getsockname()[1]
        r = run_python(f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
                       "s.sendall(b'leak')\nprint('connected')")
        assert not r.ok and "connected" not in r.stdout
        assert "network access is disabled" in r.error
        with pytest.raises(socket.timeout):
            server.accept()


def test_raw_socket_below_the_guard_has_no_network(jail):
    # _socket skips the Python guard; the empty network namespace still has no route to the host.
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        server.settimeout(0.3)
        port = server.getsockname()[1]
        r = run_python(f"import _socket\ns = _socket.socket()\ns.connect(('127.0.0.1', {port}))\nprint('connected')")
        assert not r.ok and "connected" not in r.stdout
        assert "Network is unreachable" in r.error
        with pytest.raises(socket.timeout):
            server.accept()


@pytest.mark.parametrize("target", ["host_tmp", "/usr/aflow_pwned.txt", "/aflow_pwned.txt"])
def test_write_outside_its_directory_contained(jail, tmp_path, target):
    outside = str(tmp_path / "outside.txt") if target == "host_tmp" else target
    code = ("open('inside.txt', 'w').write('fine')\nprint(open('inside.txt').read())\n"
            f"open({outside!r}, 'w').write('pwned')\nprint('wrote outside')")
    r = run_python(code)
    assert r.stdout == "fine\n"  # its own directory is writable...
    assert not r.ok and "wrote outside" not in r.stdout  # ...nothing else is
    assert any(e in r.error for e in ("No such file or directory", "Read-only file system", "Permission denied")), r
    assert not os.path.exists(outside)


def test_run_dir_and_host_processes_invisible(jail, tmp_path):
    # Stand-ins for run.dir: a file this test just wrote, this repository's files. (Not the repository's
    # directory itself: a venv inside a checkout under /tmp is bound into the jail's /tmp, so the path
    # down to it exists there as empty mount points, without the repository's files.)
    (tmp_path / "run_dir_file.txt").write_text("private")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    paths = [str(tmp_path / "run_dir_file.txt"), os.path.abspath(__file__), os.path.join(repo, "setup.py")]
    r = run_python(f"import os\nprint([os.path.exists(p) for p in {paths!r}])\n"
                   "print(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))\n"
                   "print(os.getuid() != 0, os.getcwd())")
    assert r.ok, r
    lines = r.stdout.split("\n")
    assert lines[0] == "[False, False, False]"
    assert len(eval(lines[1])) <= 3  # init and the program (plus a thread's /proc peer at most)
    assert lines[2] == "True /tmp"


def test_large_output_truncated(mode):
    r = run_python("import sys\nsys.stdout.write('x' * 3_000_000)\nsys.stderr.write('e' * 2_000_000)")
    assert r.ok, r.error
    cap = sandbox.MAX_OUTPUT_BYTES
    assert r.stdout.startswith("x" * cap) and r.stdout.endswith("[... output truncated: 1951424 more bytes]")
    assert len(r.stdout) < cap + 100 and len(r.stderr) < cap + 100
    assert "truncated" in r.stderr


def test_concurrent_runs_are_independent(mode):
    results = {}

    def one(i):
        results[i] = run_python(f"import time\ntime.sleep(0.2)\nprint({i} * {i})")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert {i: r.stdout for i, r in results.items()} == {i: f"{i * i}\n" for i in range(4)}


def test_bad_arguments_raise_but_bad_code_does_not():
    with pytest.raises(ValueError):
        run_python("print(1)", timeout_s=0)
    with pytest.raises(TypeError):
        run_python(b"print(1)")
    r = run_python("raise SystemExit('bye')")
    assert not r.ok and r.exit_code == 1 and "bye" in r.error


def test_sandboxed_program_dies_with_its_caller(mode, tmp_path):
    """A sleeping program (its CPU limit never fires) must not outlive a caller that is SIGKILLed."""
    import signal
    import subprocess

    marker = f"sleeper-{os.getpid()}-{mode}"
    code = f"from aflow_rl.sandbox import run_python\nrun_python('import time  # {marker}\\ntime.sleep(120)', timeout_s=100)\n"
    root = os.path.dirname(os.path.abspath(__file__ + "/.."))
    caller = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": root})
    deadline = time.time() + 30
    while time.time() < deadline and not _sandbox_children(caller.pid):
        time.sleep(0.1)
    assert _sandbox_children(caller.pid), "the sandbox never started"
    survivors = _sandbox_children(caller.pid)
    caller.send_signal(signal.SIGKILL)
    caller.wait()
    deadline = time.time() + 10  # the kernel's kills are immediate; the slack is for a loaded machine
    while time.time() < deadline and any(_alive(p) for p in survivors):
        time.sleep(0.2)
    alive = [p for p in survivors if _alive(p)]
    for p in alive:
        p.kill()
    assert alive == []


def _sandbox_children(pid: int) -> list:
    try:
        return [p for p in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _alive(p) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
