"""Child side of :mod:`aflow_rl.sandbox`: set up the isolation, then exec the user's Python.

The parent runs this file as a script (``python -I -S -B sandbox_init.py CONFIG_JSON``)
in a new session, so it imports only the standard library and never ``aflow_rl``.
It reports through the status pipe named in the config, one line each:
``exit N`` / ``signal N`` (how the user's program ended) or ``setup-error TEXT``.

Before anything else this process joins the run's memory and pids cgroups
(``cgroup_procs`` in the config, made by the parent): everything it starts is
counted and killed together.

Two modes (the parent picks one; see ``sandbox.isolation()``):

* ``jail`` (needs root with CAP_SYS_ADMIN, Linux): new mount, network, PID and
  IPC namespaces. This process stays outside the new PID namespace and waits;
  its child is PID 1 (a tiny init) inside it. The init builds a read-only
  chroot (system dirs, the Python install, a few /etc files, /dev nodes, a fresh
  /proc) whose only writable place is /tmp, a size-limited tmpfs holding a copy
  of the work directory, forks the user's program under a fresh unprivileged uid with rlimits,
  and reaps. When the init exits, the kernel kills everything left in the
  namespace, so no process outlives the run. The empty network namespace has
  no route anywhere (not even to the host's 127.0.0.1). A per-run uid makes
  RLIMIT_NPROC effective (the kernel never enforces it for uid 0) and means the
  program owns nothing outside its work directory.
* ``basic`` (any POSIX): rlimits and an exec in the parent-made session; the
  parent's Python-level guards (see ``sandbox._prelude``) block sockets and
  process creation. No filesystem or network isolation beyond that.
"""
import ctypes
import json
import os
import resource
import select
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWIPC = 0x08000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18

PR_SET_NO_NEW_PRIVS = 38
PR_SET_PDEATHSIG = 1

# Entries of / that make up a working userland; symlinks (merged /usr) are copied as symlinks.
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
# Just enough of /etc for the dynamic linker, getpass/pwd and time zones; the rest stays hidden.
ETC_FILES = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/passwd", "/etc/group", "/etc/nsswitch.conf",
             "/etc/localtime", "/etc/hosts")
DEV_NODES = ("null", "zero", "full", "random", "urandom")

_libc = ctypes.CDLL(None, use_errno=True)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(src, dst, fstype, flags, data=None) -> None:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(_libc.mount(enc(src), enc(dst), enc(fstype), ctypes.c_ulong(flags), enc(data)), f"mount {dst}")


def _bind(src: str, dst: str, *, readonly: bool = True) -> None:
    """Bind ``src`` at ``dst`` (non-recursive, so host submounts stay out), then set the flags."""
    _mount(src, dst, None, MS_BIND)
    # Bind mounts ignore flags on creation; they take effect only on a remount.
    _mount(None, dst, None, MS_BIND | MS_REMOUNT | MS_NOSUID | MS_NODEV | (MS_RDONLY if readonly else 0))


def _mkdirs(path: str) -> None:
    os.makedirs(path, mode=0o755, exist_ok=True)


def _bind_python_dirs(root: str, dirs: list[str], bound: list[str]) -> None:
    """Bind each of the interpreter's dirs read-only at the same path, unless one bound already covers it."""
    for real in dirs:
        if not os.path.isdir(real) or any(real == b or real.startswith(b + "/") for b in bound):
            continue
        if real == "/tmp" or (root + "/").startswith(real + "/"):
            # Binding it would show the host's /tmp (other runs' work dirs) inside the jail.
            raise OSError(f"the Python install at {real} contains the sandbox's own directory; "
                          "install Python (or the venv) below a directory of its own")
        _mkdirs(root + real)
        _bind(real, root + real)
        bound.append(real)


def _work_tmpfs(root: str, work: str, quota: dict, uid: int) -> None:
    """The jail's /tmp: a tmpfs of ``quota`` bytes and files, owned by the run's uid, holding a copy of
    ``work`` (main.py). The size bounds what the program can write in all; the tmpfs lives in this
    mount namespace only and vanishes with the run. Its pages are memory, charged to the run's cgroup."""
    _mount("tmpfs", root + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV,
           f"size={quota['bytes']},nr_inodes={quota['files']},mode=0700,uid={uid},gid={uid}")
    for name in os.listdir(work):
        src = os.path.join(work, name)
        if os.path.isfile(src):
            with open(src, "rb") as f, open(os.path.join(root + "/tmp", name), "wb") as g:
                g.write(f.read())


def _build_jail(root: str, work: str, python_dirs: list[str], prelude: tuple[str, str],
                hidden: list[str] = (), quota: dict | None = None, uid: int = 0) -> None:
    """Read-only chroot at ``root``: userland, Python, the prelude, /dev nodes, /proc; a copy of ``work``
    writable at /tmp (a tmpfs of ``quota``, owned by ``uid``); each ``hidden`` path (benchmark answer
    files inside the Python install) masked by an empty read-only mount. ``prelude`` is (host path,
    path in the jail)."""
    # Private propagation first, so none of the mounts below reaches the host's namespace.
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    bound: list[str] = []
    for d in SYSTEM_DIRS:
        if os.path.islink(d):
            os.symlink(os.readlink(d), root + d)
        elif os.path.isdir(d):
            _mkdirs(root + d)
            _bind(d, root + d)
            bound.append(d)
    # An interpreter under /tmp (a venv made there) is bound after the work dir takes /tmp, on top of it.
    under_tmp = lambda p: p == "/tmp" or p.startswith("/tmp/")  # noqa: E731
    python_real = [os.path.realpath(d) for d in python_dirs]
    _bind_python_dirs(root, [d for d in python_real if not under_tmp(d)], bound)
    _mkdirs(root + "/etc")
    for f in ETC_FILES:
        if os.path.isfile(f):
            open(root + f, "w").close()
            _bind(f, root + f)
    _mkdirs(root + "/dev")
    for n in DEV_NODES:
        if os.path.exists("/dev/" + n):
            open(root + "/dev/" + n, "w").close()
            _mount("/dev/" + n, root + "/dev/" + n, None, MS_BIND)
    for i, n in enumerate(("stdin", "stdout", "stderr")):
        os.symlink(f"/proc/self/fd/{i}", f"{root}/dev/{n}")
    os.symlink("/proc/self/fd", root + "/dev/fd")
    _mkdirs(root + "/proc")
    # A procfs of the new PID namespace: it lists only the sandbox's own processes.
    _mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    open(root + prelude[1], "w").close()
    _bind(prelude[0], root + prelude[1])
    _mkdirs(root + "/tmp")
    _work_tmpfs(root, work, quota or {"bytes": 64 << 20, "files": 4096}, uid)
    _bind_python_dirs(root, [d for d in python_real if under_tmp(d)], bound)
    for h in hidden:
        if os.path.isdir(root + h):
            _mount("tmpfs", root + h, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "size=4k,mode=0555")
        elif os.path.isfile(root + h):
            _mount("/dev/null", root + h, None, MS_BIND)
    # Freeze the skeleton: writes anywhere but /tmp now fail with EROFS.
    _mount(None, root, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.chroot(root)
    os.chdir("/tmp")


def _nproc_in_use(uid: int) -> int:
    """Tasks (processes and threads) of ``uid`` now: what RLIMIT_NPROC counts against."""
    n = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            if int(fields["Uid"].split()[0]) == uid:
                n += int(fields["Threads"])
        except (OSError, KeyError, ValueError):
            continue  # raced with an exiting process
    return n


def _set_limits(cfg: dict, uid: int) -> None:
    lim = cfg["limits"]
    resource.setrlimit(resource.RLIMIT_CPU, (lim["cpu_s"], lim["cpu_s"] + 1))  # SIGXCPU, then SIGKILL
    resource.setrlimit(resource.RLIMIT_AS, (lim["as_bytes"], lim["as_bytes"]))
    resource.setrlimit(resource.RLIMIT_FSIZE, (lim["fsize_bytes"], lim["fsize_bytes"]))
    resource.setrlimit(resource.RLIMIT_NOFILE, (lim["nofile"], lim["nofile"]))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if uid != 0:
        # NPROC counts every task of the uid: a fresh jail uid starts at 0; in basic mode the
        # user's other processes count too, so the budget is added on top of them.
        base = 0 if cfg["mode"] == "jail" or not os.path.isdir("/proc") else _nproc_in_use(uid)
        resource.setrlimit(resource.RLIMIT_NPROC, (base + lim["nproc"], base + lim["nproc"]))


def _exec_user(cfg: dict, status_fd: int) -> None:
    """In the process that becomes the user's program: limits, identity, exec. Never returns."""
    try:
        uid = cfg["uid"] if cfg["mode"] == "jail" else os.getuid()
        _set_limits(cfg, uid)
        if cfg["mode"] == "jail":
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)  # from root to a non-zero uid: all capabilities are dropped here
        if sys.platform.startswith("linux"):  # setuid binaries can't give the program privileges back
            _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
        os.execve(cfg["argv"][0], cfg["argv"], cfg["env"])
    except BaseException as e:  # noqa: BLE001 - report anything, then die without running user code
        os.write(status_fd, f"setup-error {type(e).__name__}: {e}\n".encode())
        os._exit(125)


def _die_with_parent(parent_pid: int | None, parent_alive_fd: int | None = None) -> None:
    """SIGKILL from the kernel when the parent dies (the caller that launched us was killed, say), so a
    sleeping program cannot outlive it; it takes the rest with it (the jail's PID 1: the namespace).
    Linux clears this on the jailed program's setuid, which is why PID 1 holds it, not the program.

    A parent that died before the signal was armed sends none, so that case is checked after arming:
    by ``getppid()``, or, where the parent is outside our PID namespace (getppid() says 0), by
    ``parent_alive_fd``, the read end of a pipe only the parent holds open (EOF: it is gone)."""
    if sys.platform.startswith("linux"):
        _libc.prctl(PR_SET_PDEATHSIG, 9, 0, 0, 0)
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(125)
    if parent_alive_fd is not None and select.select([parent_alive_fd], [], [], 0)[0]:
        os._exit(125)  # readable with nothing ever written: end of file, the parent has exited


def _init(cfg: dict, status_fd: int, parent_alive_fd: int) -> None:
    """PID 1 of the sandbox: build the jail, run the program, reap, report how it ended."""
    _die_with_parent(None, parent_alive_fd)
    try:
        _build_jail(cfg["jail_root"], cfg["work"], cfg["python_dirs"], (cfg["prelude"], cfg["jail_prelude"]),
                    cfg.get("hidden", []), cfg.get("work_quota"), cfg["uid"])
    except BaseException as e:  # noqa: BLE001
        os.write(status_fd, f"setup-error {type(e).__name__}: {e}\n".encode())
        os._exit(125)
    child = os.fork()
    if child == 0:
        _exec_user(cfg, status_fd)
    while True:  # as PID 1 we inherit every orphan; reap them until the program itself ends
        pid, status = os.waitpid(-1, 0)
        if pid == child:
            break
    if os.WIFSIGNALED(status):
        os.write(status_fd, f"signal {os.WTERMSIG(status)}\n".encode())
    else:
        os.write(status_fd, f"exit {os.WEXITSTATUS(status)}\n".encode())
    os._exit(0)  # the kernel now kills whatever the program left behind in the namespace


def _join_cgroups(procs_files: list[str], status_fd: int) -> None:
    """Enter the run's memory+pids cgroup before anything else: every process forked from here on
    (the jail's init, the program, all its children) is inside and counted together. No untrusted
    code runs unless this worked."""
    try:
        for path in procs_files:
            with open(path, "w") as f:
                f.write(str(os.getpid()))
    except OSError as e:
        os.write(status_fd, f"setup-error cannot join the run's cgroup {path}: {e.strerror or e}\n".encode())
        os._exit(125)


def main() -> None:
    cfg = json.loads(sys.argv[1])
    if "parent_pid" in cfg:
        _die_with_parent(cfg["parent_pid"])
    status_fd = cfg["status_fd"]
    os.set_inheritable(status_fd, False)  # closed on exec: the user's program never sees it
    _join_cgroups(cfg.get("cgroup_procs", []), status_fd)
    if cfg["mode"] != "jail":
        _exec_user(cfg, status_fd)
    try:
        _check(_libc.unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC), "unshare")
    except OSError as e:
        os.write(status_fd, f"setup-error {e}\n".encode())
        os._exit(125)
    alive_r, alive_w = os.pipe()  # we hold the write end until we exit: the init's proof we are alive
    pid = os.fork()  # the first child after unshare(CLONE_NEWPID) is PID 1 of the new namespace
    if pid == 0:
        os.close(alive_w)
        _init(cfg, status_fd, alive_r)
    os.close(alive_r)
    # We and the init stay in the parent-made process group, so the parent's killpg reaches
    # the init, whose death tears down the whole namespace.
    _, status = os.waitpid(pid, 0)
    os._exit(os.waitstatus_to_exitcode(status) & 0xFF)


if __name__ == "__main__":
    main()
