"""A memory and a pids cgroup per sandbox run: limits for the run as a whole, not per process.

RLIMIT_AS bounds each process's address space, so N forked children may use N times
``memory_mb``; RLIMIT_NPROC counts per uid and the kernel ignores it for root. A cgroup
bounds the sum over every process and thread the run creates, whatever its uid, and
lets the parent kill every one of them at the end, wherever they moved (setsid, exec).

``find()`` locates the memory and pids controllers once per process: cgroup v1 (one
hierarchy per controller) or v2 (the unified hierarchy), whichever mounts them writable.
``RunCgroup.create`` makes ``aflow_sbx_<creator pid>_<token>`` below this process's own
cgroup in each hierarchy; the sandbox's first process joins it (``join_files``) before any
untrusted code runs, so everything the run forks is inside. ``close`` kills what is left
and removes the directories. Where no writable hierarchy exists (not root, a read-only
/sys/fs/cgroup, a v2 parent that holds processes), ``find`` says why and the sandbox falls
back to the per-process limits (``sandbox.limits_summary`` reports which applies).
"""
from __future__ import annotations

import functools
import os
import signal
import time
from dataclasses import dataclass

_PREFIX = "aflow_sbx_"
_RMDIR_WAIT_S = 2.0  # processes killed at the end leave the cgroup within milliseconds; this is slack
_STALE_AGE_S = 60.0  # a live run joins its cgroup within milliseconds of making it; older empty ones are stale


@dataclass(frozen=True)
class Hierarchy:
    """Where this process's cgroups are: version 1 (a dir per controller) or 2 (one dir for both)."""

    version: int
    memory_dir: str
    pids_dir: str

    def dirs(self) -> list[str]:
        return list(dict.fromkeys((self.memory_dir, self.pids_dir)))


def _mounts() -> list[tuple[str, str, str, set[str]]]:
    """(mount root, mount point, fstype, super options) of every cgroup mount, from mountinfo."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, rest = left.split(), right.split()
            if len(fields) >= 5 and len(rest) >= 3 and rest[0] in ("cgroup", "cgroup2"):
                out.append((fields[3], fields[4], rest[0], set(rest[2].split(","))))
    return out


def _own_paths() -> dict[str, str]:
    """Controller -> this process's cgroup path (v2 under the key ``""``), from /proc/self/cgroup."""
    out = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for c in controllers.split(",") if controllers else [""]:
                out[c] = path
    return out


def _below(mount_root: str, mount_point: str, path: str) -> str:
    """The directory of cgroup ``path`` in a hierarchy mounted at ``mount_point`` (from ``mount_root``)."""
    if mount_root != "/" and (path == mount_root or path.startswith(mount_root + "/")):
        path = path[len(mount_root):]
    return os.path.join(mount_point, path.lstrip("/"))


def _writable(d: str) -> bool:
    return os.path.isdir(d) and os.access(d, os.W_OK)


def _find_v1(mounts, own) -> Hierarchy | None:
    dirs = {}
    for root, point, fstype, opts in mounts:
        for c in ("memory", "pids"):
            if fstype == "cgroup" and c in opts and c in own and c not in dirs:
                dirs[c] = _below(root, point, own[c])
    if len(dirs) == 2 and all(_writable(d) for d in dirs.values()):
        return Hierarchy(1, dirs["memory"], dirs["pids"])
    return None


def _find_v2(mounts, own) -> tuple[Hierarchy | None, str]:
    v2 = next(((r, p) for r, p, t, _ in mounts if t == "cgroup2"), None)
    if v2 is None or "" not in own:
        return None, "no cgroup2 mount"
    d = _below(v2[0], v2[1], own[""])
    try:
        with open(os.path.join(d, "cgroup.controllers")) as f:
            available = set(f.read().split())
        if not {"memory", "pids"} <= available:
            return None, f"cgroup v2 at {d} lacks the memory or pids controller"
        with open(os.path.join(d, "cgroup.subtree_control")) as f:
            enabled = set(f.read().split())
        if not {"memory", "pids"} <= enabled:
            # Fails with EBUSY when this cgroup holds processes and is not the root (no internal processes).
            with open(os.path.join(d, "cgroup.subtree_control"), "w") as f:
                f.write("+memory +pids")
    except OSError as e:
        return None, f"cgroup v2 at {d}: {e.strerror or e}"
    return Hierarchy(2, d, d), ""


@functools.lru_cache(maxsize=1)
def find() -> tuple[Hierarchy | None, str]:
    """(the hierarchy to make run cgroups in, "") or (None, why there is none). Once per process."""
    if not os.path.exists("/proc/self/cgroup"):
        return None, "no cgroups on this system"
    try:
        mounts, own = _mounts(), _own_paths()
    except (OSError, ValueError) as e:
        return None, f"cannot read this process's cgroups ({e})"
    h = _find_v1(mounts, own)
    if h is not None:
        return h, ""
    h, why = _find_v2(mounts, own)
    if h is not None:
        return h, ""
    if not any(t == "cgroup" and ({"memory", "pids"} & o) for _, _, t, o in mounts) and why == "no cgroup2 mount":
        return None, "no memory/pids cgroup mounted"
    return None, why if why != "no cgroup2 mount" else "the memory/pids cgroups are not writable (root needed)"


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


class RunCgroup:
    """The cgroup(s) of one sandbox run; ``create`` then ``join_files`` (for the child) then ``close``."""

    def __init__(self, h: Hierarchy, name: str):
        self.h = h
        self.dirs = [os.path.join(d, name) for d in h.dirs()]
        self.memory = os.path.join(h.memory_dir, name)
        self.pids = os.path.join(h.pids_dir, name)

    @classmethod
    def create(cls, h: Hierarchy, token: str, memory_bytes: int, pids_max: int) -> "RunCgroup":
        """Make the run's cgroup(s) with their limits; on any failure nothing is left behind."""
        _sweep_stale(h)
        cg = cls(h, f"{_PREFIX}{os.getpid()}_{token}")
        try:
            for d in cg.dirs:
                os.mkdir(d, 0o755)
            cg._set_limits(memory_bytes, pids_max)
        except OSError:
            cg.close()
            raise
        return cg

    def _set_limits(self, memory_bytes: int, pids_max: int) -> None:
        if self.h.version == 1:
            _write(os.path.join(self.memory, "memory.limit_in_bytes"), str(memory_bytes))
            memsw = os.path.join(self.memory, "memory.memsw.limit_in_bytes")
            if os.path.exists(memsw):  # swap accounting: memory + swap, so swap cannot stretch the limit
                _write(memsw, str(memory_bytes))
            _write(os.path.join(self.memory, "memory.swappiness"), "0")
        else:
            _write(os.path.join(self.memory, "memory.max"), str(memory_bytes))
            if os.path.exists(os.path.join(self.memory, "memory.swap.max")):
                _write(os.path.join(self.memory, "memory.swap.max"), "0")
        _write(os.path.join(self.pids, "pids.max"), str(pids_max))

    def join_files(self) -> list[str]:
        """The ``cgroup.procs`` files the sandbox's first process writes its pid into."""
        return [os.path.join(d, "cgroup.procs") for d in self.dirs]

    def oom_kills(self) -> int:
        """Processes the kernel's OOM killer ended because the run hit its memory limit."""
        name = "memory.oom_control" if self.h.version == 1 else "memory.events"
        for line in _read(os.path.join(self.memory, name)).splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def close(self) -> bool:
        """Kill every process still in the run's cgroups, then remove them; False if one stayed."""
        kill = os.path.join(self.pids, "cgroup.kill")
        if self.h.version == 2 and os.path.exists(kill):
            try:
                _write(kill, "1")
            except OSError:
                pass
        deadline = time.monotonic() + _RMDIR_WAIT_S
        left = [d for d in self.dirs if os.path.isdir(d)]
        while left:
            for d in list(left):
                _kill_members(d)
                try:
                    os.rmdir(d)
                    left.remove(d)
                except FileNotFoundError:
                    left.remove(d)
                except OSError:
                    pass  # EBUSY: a killed process has not left yet
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.005)
        return not left


def _kill_members(d: str) -> None:
    for pid in _read(os.path.join(d, "cgroup.procs")).split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, PermissionError, ValueError):
            pass


def _sweep_stale(h: Hierarchy) -> None:
    """Remove empty run cgroups whose creator died before closing them (killed mid-run). Only empty
    ones (rmdir refuses others) older than a minute (a live run joins its cgroup within milliseconds
    of making it), so another process's run, even in another PID namespace, is never disturbed."""
    now = time.time()
    for parent in h.dirs():
        try:
            names = [n for n in os.listdir(parent) if n.startswith(_PREFIX)]
        except OSError:
            continue
        for n in names:
            creator = n[len(_PREFIX):].split("_", 1)[0]
            d = os.path.join(parent, n)
            try:
                if creator.isdigit() and not _alive(int(creator)) and now - os.stat(d).st_mtime > _STALE_AGE_S:
                    os.rmdir(d)
            except OSError:
                pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
