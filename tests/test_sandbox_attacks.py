"""The hostile tester's sandbox attack battery, run in ``jail`` mode: each attack is contained.

Every row of the probe (process, thread and memory bombs; writes and reads outside the work
directory; the caller's secrets through /proc and ptrace; network below the Python guard;
processes outliving the run; privileged syscalls; output, file and disk floods; killing the
caller) is one attack here. All attacks run once, a few at a time, in one module-scoped battery;
each test then checks its attack's result and what the host saw (its listener, its files, its
processes). What these attacks achieve in ``basic`` mode is in docs/security.md.
"""
import os
import resource
import secrets
import site
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import psutil
import pytest

from aflow_rl import sandbox, sandbox_cgroup
from aflow_rl.sandbox import MAX_OUTPUT_BYTES, NPROC, run_python


@dataclass
class Attack:
    code: str                                   # runs after `CTX = {...}` (the host's pids, ports, paths)
    check: Callable                             # check(result, battery) asserts the attack was contained
    timeout_s: float = 10
    memory_mb: int = 256


@dataclass
class Battery:
    ctx: dict
    results: dict = field(default_factory=dict)
    udp_received: set = field(default_factory=set)
    tcp_accepted: dict = field(default_factory=dict)
    maxrss_growth_kb: int = 0
    seconds: float = 0.0


# -- checks --------------------------------------------------------------------------------------

def _count(r, word: str) -> int:
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith(word + " "))
    return int(line.split()[1])


def _failed_with(*phrases):
    def check(r, b):
        assert not r.ok and any(p in r.error for p in phrases), r
    return check


def _fewer_than_nproc(word):
    def check(r, b):
        assert _count(r, word) < NPROC, r
    return check


def _memory_limit(r, b):
    assert not r.ok and r.error == "memory limit 256 MB exceeded", r


def _no_secret(r, b):
    assert b.ctx["secret"] not in r.stdout + r.stderr, r


def _wrote_nothing(key):
    def check(r, b):
        assert "wrote" not in r.stdout, r
        assert not os.path.exists(b.ctx[key]), b.ctx[key]
    return check


def _read_nothing(r, b):
    _no_secret(r, b)
    assert r.stdout.split() == ["hidden"] * len(r.stdout.split()) and r.stdout, r


def _no_tcp(key):
    def check(r, b):
        assert "connected" not in r.stdout, r
        assert b.tcp_accepted[key] == 0, "the host's listener got a connection"
    return check


def _no_udp(payload):
    def check(r, b):
        assert payload not in b.udp_received, "the host's UDP socket got the datagram"
        assert "sent" not in r.stdout, r
    return check


def _no_survivor(r, b):
    alive = [p for p in psutil.process_iter(["cmdline"]) if b.ctx["marker"] in " ".join(p.info["cmdline"] or ())]
    for p in alive:
        p.kill()
    assert alive == [], "a process of the run outlived it"


def _all_denied(r, b):
    results = [int(x) for x in r.stdout.split()]
    assert len(results) == 6 and all(x == -1 for x in results), r.stdout  # -1: every call failed


def _victim_alive(r, b):
    assert psutil.pid_exists(b.ctx["victim_pid"]) and psutil.Process(b.ctx["victim_pid"]).status() != "zombie"
    assert "killed" not in r.stdout, r


def _output_capped(r, b):
    assert len(r.stdout) < MAX_OUTPUT_BYTES + 100 and "output truncated" in r.stdout
    assert b.maxrss_growth_kb < 64 * 1024, f"the host's peak RSS grew by {b.maxrss_growth_kb} kB"


def _quota(r, b):
    assert not r.ok and r.error.startswith("work directory quota exceeded"), r
    assert _count(r, "written") <= sandbox.WORK_DIR_MB << 20, r


def _children_share_memory(r, b):
    if sandbox_cgroup.find()[0] is None:
        pytest.skip("no memory cgroup here: children are limited per process only")
    assert _count(r, "survivors") <= 1, r


def _fds(r, b):
    fds, reopen = r.stdout.splitlines()
    assert fds == "[0, 1, 2]", r
    assert reopen == "denied", r


# -- the attacks ---------------------------------------------------------------------------------

_CHILD_SLEEPS = "time.sleep(5)\n            os._exit(0)"

ATTACKS = {
    "infinite_loop": Attack("while True:\n    pass\n", lambda r, b: r.timed_out or pytest.fail(str(r)), timeout_s=1.5),
    # Stopped by the pids limit, or first by the memory cgroup (64 interpreters' copied pages add up).
    "fork_bomb": Attack("import os\nwhile True:\n    os.fork()\n",
                        _failed_with(f"process limit of {NPROC} processes/threads reached",
                                     "memory limit 256 MB exceeded")),
    "posix_fork_300": Attack(f"""
import posix, os, time
n = 0
for _ in range(300):
    try:
        if posix.fork() == 0:
            {_CHILD_SLEEPS}
        n += 1
    except OSError:
        break
print("forked", n)
""", _fewer_than_nproc("forked")),
    "ctypes_fork_300": Attack("""
import ctypes, os, time
libc = ctypes.CDLL(None, use_errno=True)
n = 0
for _ in range(300):
    pid = libc.fork()
    if pid == 0:
        time.sleep(5)
        os._exit(0)
    if pid < 0:
        break
    n += 1
print("forked", n)
""", _fewer_than_nproc("forked")),
    "multiprocessing_100": Attack("""
import multiprocessing as mp, time
procs = []
try:
    for _ in range(100):
        p = mp.Process(target=time.sleep, args=(5,), daemon=True)
        p.start()
        procs.append(p)
except Exception:
    pass
print("started", len(procs))
""", _fewer_than_nproc("started")),
    "thread_bomb_8mb_stacks": Attack("""
import threading, time
n = 0
try:
    for _ in range(2000):
        threading.Thread(target=time.sleep, args=(5,), daemon=True).start()
        n += 1
except RuntimeError:
    pass
print("threads", n)
""", _fewer_than_nproc("threads")),
    "thread_bomb_64k_stacks": Attack("""
import threading, time
threading.stack_size(65536)
n = 0
try:
    for _ in range(2000):
        threading.Thread(target=time.sleep, args=(5,), daemon=True).start()
        n += 1
except RuntimeError:
    pass
print("threads", n)
""", _fewer_than_nproc("threads")),
    "bytearray_10gb": Attack("bytearray(10**10)\n", _memory_limit),
    "incremental_10mb": Attack("chunks = []\nwhile True:\n    chunks.append(bytearray(10 * 2**20))\n", _memory_limit),
    "numpy_ones": Attack("import numpy\nnumpy.ones(10**10)\n", _memory_limit),
    "children_200mb_each": Attack("""
import os, posix, time
t_end = time.time() + 2
kids = []
for i in range(6):
    pid = posix.fork()
    if pid == 0:
        try:
            b = bytearray(200 * 2**20)
            b[::4096] = b"x" * len(b[::4096])
        except MemoryError:
            os._exit(3)
        time.sleep(max(t_end - time.time(), 0))
        os._exit(0)
    kids.append(pid)
codes = [os.waitstatus_to_exitcode(os.waitpid(k, 0)[1]) for k in kids]
print("survivors", sum(c == 0 for c in codes))
""", _children_share_memory, timeout_s=20),
    **{f"write_{key}": Attack(f"open(CTX[{key!r}], 'w').write('pwned')\nprint('wrote')\n", _wrote_nothing(key))
       for key in ("host_tmp", "caller_cwd", "etc", "root_home", "site_packages_pth", "run_dir_file")},
    "read_etc_shadow": Attack("""
try:
    print(open('/etc/shadow').read())
except OSError:
    print("hidden")
""", lambda r, b: r.stdout == "hidden\n" or pytest.fail(r.stdout[:300])),
    "read_proc_environs": Attack("""
import os
pids = ['1', 'self', str(os.getppid()), str(CTX['host_pid']), str(CTX['victim_pid'])]
for p in pids:
    try:
        data = open(f'/proc/{p}/environ', 'rb').read().decode(errors='replace')
        print(data.replace('\\0', ' ') or "hidden")
    except OSError:
        print("hidden")
""", _no_secret),
    # Below the Python audit hook that guards open() in basic mode: libc's open and read via ctypes.
    "read_proc_environs_via_libc": Attack("""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
for pid in (os.getppid(), CTX['host_pid'], CTX['victim_pid']):
    fd = libc.open(f'/proc/{pid}/environ'.encode(), 0)
    buf = ctypes.create_string_buffer(1 << 16)
    n = libc.read(fd, buf, len(buf)) if fd >= 0 else -1
    print(buf.raw[:max(n, 0)].replace(b'\\0', b' ').decode(errors='replace') if n > 0 else 'hidden')
""", _no_secret),
    "scan_all_proc_environs": Attack("""
import os
visible = [p for p in os.listdir('/proc') if p.isdigit()]
for p in visible:
    try:
        print(open(f'/proc/{p}/environ', 'rb').read().decode(errors='replace').replace('\\0', ' '))
    except OSError:
        pass
print("visible", len(visible))
""", lambda r, b: (_no_secret(r, b), _count(r, "visible") <= 3 or pytest.fail(r.stdout))),
    "read_run_dir_and_repo": Attack("""
import os
for path in (CTX['run_dir_file'] + '.secret', CTX['repo_file'], f'/proc/{os.getppid()}/cwd/setup.py',
             f'/proc/{CTX["host_pid"]}/cwd/setup.py', CTX['answers']):
    try:
        print(open(path).read()[:100])
    except OSError:
        print("hidden")
try:
    print(os.listdir(os.path.dirname(CTX['run_dir_file'])))
except OSError:
    print("hidden")
""", _read_nothing),
    "tcp_guarded_socket": Attack("""
import socket
try:
    socket.create_connection(('127.0.0.1', CTX['tcp_port_1']), timeout=2)
    print('connected')
except OSError as e:
    print(type(e).__name__)
""", _no_tcp("tcp_port_1")),
    "tcp_raw_socket": Attack("""
import _socket
s = _socket.socket()
s.settimeout(2)
try:
    s.connect(('127.0.0.1', CTX['tcp_port_2']))
    print('connected')
except OSError as e:
    print(e)
""", _no_tcp("tcp_port_2")),
    "tcp_socket_base_class": Attack("""
import socket
s = socket.socket.__mro__[1]()
s.settimeout(2)
try:
    s.connect(('127.0.0.1', CTX['tcp_port_3']))
    print('connected')
except OSError as e:
    print(e)
""", _no_tcp("tcp_port_3")),
    "udp_guarded_socket": Attack("""
import socket
try:
    socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'udp-guarded', ('127.0.0.1', CTX['udp_port']))
    print('sent')
except OSError as e:
    print(e)
""", _no_udp(b"udp-guarded")),
    "udp_raw_socket": Attack("""
import _socket
try:
    _socket.socket(_socket.AF_INET, _socket.SOCK_DGRAM).sendto(b'udp-bypass', ('127.0.0.1', CTX['udp_port']))
    print('sent')
except OSError as e:
    print(e)
""", _no_udp(b"udp-bypass")),
    "udp_ctypes_sendto": Attack("""
import ctypes, struct
libc = ctypes.CDLL(None, use_errno=True)
fd = libc.socket(2, 2, 0)
addr = struct.pack('=H', 2) + struct.pack('!H', CTX['udp_port']) + bytes([127, 0, 0, 1]) + bytes(8)
n = libc.sendto(fd, b'udp-ctypes', 10, 0, addr, 16)
print('sent' if n == 10 else f'errno {ctypes.get_errno()}')
""", _no_udp(b"udp-ctypes")),
    "setsid_double_fork_exec": Attack("""
import os, posix, time
if posix.fork() == 0:
    os.setsid()
    if posix.fork() == 0:
        posix.execv('/bin/sh', ['/bin/sh', '-c', f"exec -a {CTX['marker']} sleep 30"])
    os._exit(0)
time.sleep(30)
""", _no_survivor, timeout_s=1.5),
    "posix_spawn_nohup": Attack("""
import os, time
os.posix_spawn('/usr/bin/nohup', ['nohup', 'bash', '-c', f"exec -a {CTX['marker']}-spawn sleep 25"],
               {'PATH': '/usr/bin:/bin'}, setsid=True)
time.sleep(30)
""", _no_survivor, timeout_s=1.5),
    "ctypes_privileged_calls": Attack("""
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
print(libc.setuid(0), libc.unshare(0x10000000), libc.mount(b'none', b'/tmp', b'tmpfs', 0, None),
      libc.chroot(b'/tmp'), libc.sethostname(b'pwned', 5), libc.kill(1, 0))
""", _all_denied),
    "segfault": Attack("import ctypes\nctypes.string_at(0)\n", _failed_with("killed by signal 11 (SIGSEGV)")),
    "ptrace_the_callers": Attack("""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
for pid in (os.getppid(), CTX['victim_pid']):
    print('attach', pid, libc.ptrace(16, pid, None, None))
""", lambda r, b: r.stdout.count(" -1\n") == 2 or pytest.fail(r.stdout)),
    "gdb_attach_host_process": Attack("""
import os
os.posix_spawn('/usr/bin/gdb', ['gdb', '-batch', '-p', str(CTX['victim_pid']), '-ex', 'info proc'],
               {'PATH': '/usr/bin:/bin', 'HOME': '/tmp'})
os.wait()
""", lambda r, b: ("cmdline" not in r.stdout and "cwd =" not in r.stdout) or pytest.fail(r.stdout), timeout_s=20),
    "print_1gb": Attack("""
import sys
chunk = 'x' * 2**20
for _ in range(1024):
    sys.stdout.write(chunk)
""", _output_capped, timeout_s=30),
    "one_10gb_file": Attack("with open('big', 'wb') as f:\n    f.seek(0)\n    while True:\n        f.write(b'x' * 2**20)\n",
                            _failed_with("File too large")),
    "files_40x15mb": Attack("""
written = 0
try:
    for i in range(40):
        with open(f"f{i}", "wb") as f:
            for _ in range(15):
                f.write(b"x" * 2**20)
                f.flush()
                written += 2**20
finally:
    print("written", written)
""", _quota, timeout_s=20),
    "raise_rlimits": Attack("""
import resource
for r in (resource.RLIMIT_AS, resource.RLIMIT_NPROC, resource.RLIMIT_FSIZE, resource.RLIMIT_CPU):
    try:
        resource.setrlimit(r, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        print('raised')
    except (ValueError, OSError) as e:
        print(e)
bytearray(2**30)
""", lambda r, b: ("raised" not in r.stdout and _memory_limit(r, b)) or None),
    "kill_the_callers": Attack("""
import os
for pid in (os.getppid(), CTX['host_pid'], CTX['victim_pid']):
    try:
        os.kill(pid, 9)
        print('killed', pid)
    except OSError as e:
        print(type(e).__name__)
""", _victim_alive),
    "kill_everything": Attack("import os\ntry:\n    os.kill(-1, 9)\n    print('killed all')\nexcept OSError as e:\n    print(e)\n",
                              _victim_alive),
    "fd_inventory_reopen_stdin": Attack("""
import os
print(sorted(int(f) for f in os.listdir('/proc/self/fd') if int(f) > 2 and os.path.exists(f'/proc/self/fd/{f}'))
      or [0, 1, 2])
try:
    open('/proc/self/fd/0', 'w').write('pwned')
    print('reopened')
except OSError:
    print('denied')
""", _fds),
}


# -- the battery -----------------------------------------------------------------------------------

def _listener(kind: int) -> socket.socket:
    s = socket.socket(socket.AF_INET, kind)
    s.bind(("127.0.0.1", 0))
    if kind == socket.SOCK_STREAM:
        s.listen(8)
    s.setblocking(False)
    return s


def _context(tmp: str, victim: int, secret: str, ports: dict) -> dict:
    token = secrets.token_hex(4)
    run_dir = os.path.join(tmp, "run_dir")
    os.makedirs(run_dir)
    with open(os.path.join(run_dir, "config.yaml.secret"), "w") as f:
        f.write(secret)
    answers = sandbox.hidden_paths()
    return {
        "host_pid": os.getpid(), "victim_pid": victim, "secret": secret, "marker": f"aflow-survivor-{token}",
        "host_tmp": os.path.join(tmp, "outside.txt"), "caller_cwd": os.path.join(os.getcwd(), f"aflow_pwned_{token}"),
        "etc": f"/etc/aflow_pwned_{token}", "root_home": f"/root/aflow_pwned_{token}",
        "site_packages_pth": os.path.join(site.getsitepackages()[0], f"aflow_pwned_{token}.pth"),
        "run_dir_file": os.path.join(run_dir, "config.yaml"),
        "repo_file": os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "setup.py"),
        "answers": os.path.join(answers[0], "HumanEval.jsonl.gz") if answers else "/nonexistent", **ports,
    }


def _run_all(b: Battery) -> None:
    def one(name: str):
        a = ATTACKS[name]
        return name, run_python(f"CTX = {b.ctx!r}\n{a.code}", timeout_s=a.timeout_s, memory_mb=a.memory_mb)

    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.monotonic()
    with ThreadPoolExecutor(4) as pool:
        b.results = dict(pool.map(one, sorted(ATTACKS)))
    b.seconds = time.monotonic() - t0
    b.maxrss_growth_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0


@pytest.fixture(scope="module")
def battery(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("AFLOW_SANDBOX", raising=False)
        if sandbox.isolation() != "jail":
            pytest.skip("no jail on this machine (needs Linux, root, CAP_SYS_ADMIN)")
        secret = "sk-aflow-canary-" + secrets.token_hex(8)
        mp.setenv("OPENAI_API_KEY", secret)  # in the caller: the attacks hunt for it
        # A host process that holds the secret in its environment from its start (a trainer, a server):
        # the target of the /proc, ptrace, gdb and kill attacks.
        victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"],
                                  env={**os.environ, "OPENAI_API_KEY": secret})
        tcp = {f"tcp_port_{i}": _listener(socket.SOCK_STREAM) for i in (1, 2, 3)}
        udp = _listener(socket.SOCK_DGRAM)
        ports = {k: s.getsockname()[1] for k, s in tcp.items()} | {"udp_port": udp.getsockname()[1]}
        b = Battery(_context(str(tmp_path_factory.mktemp("attacks")), victim.pid, secret, ports))
        try:
            _run_all(b)
            b.tcp_accepted = {k: _drain_tcp(s) for k, s in tcp.items()}
            b.udp_received = _drain_udp(udp)
            yield b
        finally:
            victim.kill()
            victim.wait()
            for s in (*tcp.values(), udp):
                s.close()
            for key in ("caller_cwd", "etc", "root_home", "site_packages_pth"):
                if os.path.exists(b.ctx[key]):  # only if an attack got through: never leave it behind
                    os.remove(b.ctx[key])


def _drain_tcp(s: socket.socket) -> int:
    n = 0
    while True:
        try:
            s.accept()[0].close()
            n += 1
        except BlockingIOError:
            return n


def _drain_udp(s: socket.socket) -> set:
    got = set()
    while True:
        try:
            got.add(s.recv(100))
        except BlockingIOError:
            return got


def test_battery_has_every_attack_and_is_fast(battery):
    assert len(ATTACKS) >= 30
    assert battery.seconds < 60, f"the battery took {battery.seconds:.1f} s"


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_attack_is_contained(battery, name):
    ATTACKS[name].check(battery.results[name], battery)
