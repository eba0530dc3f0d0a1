"""Start, health-check and stop the inference servers of each role.

    with ServerManager(cfg.serving, cfg.run_dir) as servers:
        client = make_client(cfg.llm.policy, servers.urls("policy"), role="policy")

Per role, ``serving.<role>.backend`` picks what happens:

- ``embedded``: ``num_servers`` processes of ``python -m aflow_rl.serving.embedded``;
- ``sglang``: ``num_servers`` processes of ``python -m sglang.launch_server``, and
  with ``router: true`` one ``sglang_router.launch_router`` in front, whose URL is
  then the role's only endpoint;
- ``external``: the given URLs, whose ``/health`` must answer at start-up;
- ``none``: no servers (``urls`` is empty).

With ``build_tiny: tiny|mid|small`` the offline tiny model is built at
``model_path`` first if nothing is there yet.

Started servers log to ``run_dir/logs/<role>-<i>.log``. Start-up waits for
``/health`` under ``startup_timeout_s`` while watching each process, so a
server that crashes is reported at once with the end of its log instead of
after the deadline. Each server runs in its own process group, so stopping it
(SIGTERM, then SIGKILL after ``stop_grace_s``) also ends the workers it spawned
(SGLang's scheduler and detokenizer processes). Servers are stopped on normal
exit, on an exception, on Ctrl-C and on SIGTERM, and by ``atexit`` as a last
resort when the manager was started without ``with``. When the process holding
the manager dies without any of these (``kill -9``), the servers die with it
(``aflow_rl.procs``: a parent-death signal, and the embedded server's watchdog).

A fixed ``port`` that another process already listens on (an orphan of an
earlier run, typically) is refused before anything starts, naming that process:
start-up would otherwise find the orphan's ``/health`` and train against it.
"""
from __future__ import annotations

import atexit
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import httpx

from aflow_rl.config import ServerConfig, ServingConfig
from aflow_rl.procs import PARENT_PID_ENV, port_listeners, preexec_die_with_parent

ROLES = ("policy", "actor")
_POLL_S = 0.2          # how often start-up checks each process and its /health
_TAIL_LINES = 30       # log lines quoted when a server fails to start


class ServerError(RuntimeError):
    """A server could not be started or reached; the message says which and what to do."""


# ---------------------------------------------------------------------------
# Command lines (pure functions, unit-tested without sglang)
# ---------------------------------------------------------------------------


def embedded_command(cfg: ServerConfig, port: int) -> list[str]:
    """Command line of one embedded CPU server."""
    cmd = [sys.executable, "-m", "aflow_rl.serving.embedded", "--model-path", cfg.model_path,
           "--port", str(port), "--host", cfg.host, "--max-batch-size", str(cfg.max_batch_size),
           "--dtype", cfg.dtype]
    if cfg.context_length:
        cmd += ["--context-length", str(cfg.context_length)]
    if cfg.threads:
        cmd += ["--threads", str(cfg.threads)]
    if cfg.device != "cpu":
        cmd += ["--device", cfg.device]
    return cmd


def sglang_command(cfg: ServerConfig, port: int, index: int = 0) -> list[str]:
    """Command line of SGLang server ``index`` of a role (its GPUs start at base_gpu_id + index*tp)."""
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", cfg.model_path,
           "--tp", str(cfg.tp), "--port", str(port), "--host", cfg.host,
           "--mem-fraction-static", str(cfg.mem_fraction),
           "--base-gpu-id", str(cfg.base_gpu_id + index * cfg.tp)]
    if cfg.dtype != "auto":
        cmd += ["--dtype", cfg.dtype]
    if cfg.context_length:
        cmd += ["--context-length", str(cfg.context_length)]
    return cmd + list(cfg.extra_args)


def router_command(worker_urls: list[str], host: str, port: int) -> list[str]:
    """Command line of an sglang_router in front of ``worker_urls``."""
    return [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *worker_urls,
            "--host", host, "--port", str(port)]


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports the OS reports free (held together so none repeats)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            # Bound on every interface: a port free there is free on any one address.
            s.bind(("", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def client_host(bind_host: str) -> str:
    """The address clients use for a server bound to ``bind_host``."""
    if bind_host in ("0.0.0.0", "::", ""):
        # Bound to every interface: advertise this machine's name so that workers on
        # other machines (dask) can reach it too; start-up checks health through it.
        return socket.gethostname()
    return f"[{bind_host}]" if ":" in bind_host else bind_host


def check_port_free(port: int, key: str) -> None:
    """Refuse a fixed port that a process already listens on, naming it (``key``: the config key)."""
    holders = port_listeners(port)
    if not holders:
        return
    pid, cmd = holders[0]
    if pid is None:
        raise ServerError(f"{key}: port {port} is already in use by a process of another user "
                          f"(find it with: ss -ltnp 'sport = :{port}'); stop it or choose another {key}")
    raise ServerError(f"{key}: port {port} is already in use by process {pid} ({cmd}), perhaps an "
                      f"orphan of an earlier run; stop it with `kill {pid}` or choose another {key}")


def check_health(url: str, timeout_s: float = 2.0) -> str | None:
    """``None`` if ``GET url/health`` answers 200, else a short reason."""
    try:
        resp = httpx.get(url.rstrip("/") + "/health", timeout=timeout_s, trust_env=False)
    except httpx.HTTPError as exc:
        return f"{type(exc).__name__}: {exc or 'no answer'}"
    return None if resp.status_code == 200 else f"HTTP {resp.status_code}"


def log_tail(path: str, lines: int = _TAIL_LINES) -> str:
    """The last ``lines`` lines of a log file ('' if it does not exist)."""
    try:
        with open(path, errors="replace") as fh:
            return "".join(deque(fh, maxlen=lines)).rstrip()
    except OSError:
        return ""


# ---------------------------------------------------------------------------
# One server process
# ---------------------------------------------------------------------------


@dataclass
class ServerProcess:
    """One started server: its command, URL, log file and process."""

    name: str
    cmd: list[str]
    url: str
    log_path: str
    startup_timeout_s: float = 300.0
    proc: subprocess.Popen | None = field(default=None, repr=False)
    started_at: float = 0.0

    def start(self) -> None:
        os.makedirs(os.path.dirname(self.log_path) or ".", exist_ok=True)
        # PYTHONUNBUFFERED: the log shows a crash's last words. PARENT_PID_ENV: the embedded server
        # watches this process and exits with it (other servers ignore it).
        env = dict(os.environ, PYTHONUNBUFFERED="1", **{PARENT_PID_ENV: str(os.getpid())})
        with open(self.log_path, "ab") as log:
            log.write(f"$ {' '.join(self.cmd)}\n".encode())
            log.flush()
            # start_new_session: its own process group, so stop() reaches its children too.
            # preexec_fn: SIGKILL from the kernel when this process dies, even by kill -9.
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=env, start_new_session=True,
                                         preexec_fn=preexec_die_with_parent())
        self.started_at = time.monotonic()

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def failure(self, why: str) -> ServerError:
        tail = log_tail(self.log_path)
        return ServerError(f"{self.name} ({self.url}) {why}; log {self.log_path}"
                           + (f", last lines:\n{tail}" if tail else " is empty"))

    def signal_group(self, sig: int) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass  # the whole group is already gone


def wait_healthy(servers: list[ServerProcess]) -> None:
    """Wait until every started server answers ``/health``, each within its own
    ``startup_timeout_s``; raise at once if one of them exits."""
    pending = list(servers)
    while pending:
        for srv in list(pending):
            if not srv.alive:
                code = srv.proc.returncode if srv.proc is not None else None
                raise srv.failure(f"exited with code {code} during start-up")
            left = srv.started_at + srv.startup_timeout_s - time.monotonic()
            if check_health(srv.url, timeout_s=min(2.0, max(0.1, left))) is None:
                pending.remove(srv)
            elif left <= 0:
                raise srv.failure(f"did not answer /health within {srv.startup_timeout_s:g}s "
                                  f"(raise startup_timeout_s if it is just slow)")
        if pending:
            time.sleep(_POLL_S)


def stop_all(servers: list[ServerProcess], grace_s: float) -> None:
    """SIGTERM every server's process group, wait up to ``grace_s``, then SIGKILL what is left."""
    for srv in servers:
        srv.signal_group(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for srv in servers:
        if srv.proc is None:
            continue
        try:
            srv.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for srv in servers:
        # Also after a clean exit of the leader: its children may linger in the group.
        srv.signal_group(signal.SIGKILL)
        if srv.proc is not None:
            try:
                srv.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass


# ---------------------------------------------------------------------------
# The manager
# ---------------------------------------------------------------------------


class ServerManager:
    """Servers of every role, per ``cfg.serving``. Use as a context manager or call start()/stop()."""

    def __init__(self, serving: ServingConfig, run_dir: str, roles: tuple[str, ...] = ROLES) -> None:
        self.serving = serving
        self.run_dir = run_dir
        self.roles = roles
        self.log_dir = os.path.join(run_dir, "logs")
        self.processes: list[ServerProcess] = []
        self._urls: dict[str, list[str]] = {}
        self._started = False
        self._lock = threading.RLock()  # re-entrant: a signal may arrive while stop() runs
        self._prev_handlers: dict[int, object] = {}
        self._ports_given: set[int] = set()

    # -- public ---------------------------------------------------------------

    def urls(self, role: str) -> list[str]:
        """Base URLs of ``role`` (the router's only, when one is used)."""
        if not self._started:
            raise RuntimeError("ServerManager.urls() before start(): use `with ServerManager(...)` or call start()")
        if role not in self._urls:
            raise KeyError(f"unknown role {role!r}; roles: {', '.join(self._urls)}")
        return list(self._urls[role])

    def all_urls(self) -> dict[str, list[str]]:
        """``{role: urls}`` for every role (what ``WorkerContext.urls`` carries)."""
        return {role: self.urls(role) for role in self._urls}

    def start(self) -> "ServerManager":
        """Check the config, start every role's servers, wait until all are healthy."""
        if self._started:
            return self
        self._check()
        self._check_ports()
        self._build_tiny_models()
        self._install_handlers()
        try:
            self._start_roles()
        except BaseException:
            self.stop()
            raise
        self._started = True
        return self

    def stop(self) -> None:
        """Stop every started server (idempotent; safe from signal handlers and atexit)."""
        with self._lock:
            procs, self.processes = self.processes, []
            # Routers were started last; stopping in reverse order takes them down first.
            stop_all(list(reversed(procs)), self._grace_s())
            self._started = False
            self._restore_handlers()

    def __enter__(self) -> "ServerManager":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- start-up -------------------------------------------------------------

    def _role_cfg(self, role: str) -> ServerConfig:
        return getattr(self.serving, role)

    def _grace_s(self) -> float:
        return max(self._role_cfg(r).stop_grace_s for r in self.roles) if self.roles else 10.0

    def _check(self) -> None:
        """Fail before starting anything if a role cannot possibly start."""
        for role in self.roles:
            cfg = self._role_cfg(role)
            key = f"serving.{role}"
            if cfg.backend in ("embedded", "sglang") and not cfg.model_path:
                raise ServerError(f"{key}.model_path: the {cfg.backend} backend needs a model directory")
            from aflow_rl.models.tiny import PRESETS

            if cfg.build_tiny and cfg.build_tiny not in PRESETS:
                raise ServerError(f"{key}.build_tiny: expected one of {', '.join(sorted(PRESETS))} or empty, "
                                  f"got {cfg.build_tiny!r}")
            if cfg.backend == "external" and not cfg.urls:
                raise ServerError(f"{key}.urls: the external backend needs at least one URL")
            if cfg.backend == "sglang":
                if importlib.util.find_spec("sglang") is None:
                    raise ServerError(f"{key}.backend=sglang but the sglang package is not installed: "
                                      f"pip install -e .[gpu]  (or use {key}.backend=embedded on CPU)")
                if cfg.router and importlib.util.find_spec("sglang_router") is None:
                    raise ServerError(f"{key}.router=true but sglang_router is not installed: "
                                      f"pip install -e .[gpu]  (or set {key}.router=false)")

    def _build_tiny_models(self) -> None:
        """``build_tiny``: build the offline tiny model at model_path if none is there yet
        (so a fresh checkout runs the quickstart with nothing to download)."""
        for role in self.roles:
            cfg = self._role_cfg(role)
            if cfg.build_tiny and cfg.backend in ("embedded", "sglang"):
                from aflow_rl.models.tiny import ensure

                ensure(cfg.model_path, preset=cfg.build_tiny)

    def _start_roles(self) -> None:
        groups: dict[str, list[ServerProcess]] = {}
        for role in self.roles:
            cfg = self._role_cfg(role)
            if cfg.backend == "none":
                self._urls[role] = []
            elif cfg.backend == "external":
                self._urls[role] = self._check_external(role, cfg)
            else:
                groups[role] = self._spawn_servers(role, cfg)
        # All roles boot in parallel; one wait watches them all.
        wait_healthy([p for procs in groups.values() for p in procs])
        for role, procs in groups.items():
            cfg = self._role_cfg(role)
            worker_urls = [p.url for p in procs]
            if cfg.backend == "sglang" and cfg.router:
                port = cfg.port + cfg.num_servers if cfg.port else self._free_ports(1)[0]
                router = ServerProcess(f"{role} router", router_command(worker_urls, cfg.host, port),
                                       f"http://{client_host(cfg.host)}:{port}",
                                       os.path.join(self.log_dir, f"{role}-router.log"), cfg.startup_timeout_s)
                self.processes.append(router)
                router.start()
                wait_healthy([router])
                self._urls[role] = [router.url]
            else:
                self._urls[role] = worker_urls

    def _check_ports(self) -> None:
        """Every fixed port must be free before any server starts (see check_port_free)."""
        for role in self.roles:
            cfg = self._role_cfg(role)
            if cfg.backend not in ("embedded", "sglang") or not cfg.port:
                continue
            count = cfg.num_servers + (1 if cfg.backend == "sglang" and cfg.router else 0)
            for port in range(cfg.port, cfg.port + count):
                check_port_free(port, f"serving.{role}.port")

    def _spawn_servers(self, role: str, cfg: ServerConfig) -> list[ServerProcess]:
        ports = [cfg.port + i for i in range(cfg.num_servers)] if cfg.port else self._free_ports(cfg.num_servers)
        procs = []
        for i, port in enumerate(ports):
            cmd = sglang_command(cfg, port, i) if cfg.backend == "sglang" else embedded_command(cfg, port)
            srv = ServerProcess(f"{role} server {i}", cmd, f"http://{client_host(cfg.host)}:{port}",
                                os.path.join(self.log_dir, f"{role}-{i}.log"), cfg.startup_timeout_s)
            self.processes.append(srv)  # registered before start so that stop() always sees it
            srv.start()
            procs.append(srv)
        return procs

    def _free_ports(self, n: int) -> list[int]:
        """Free ports never handed out before by this manager: a port given to a server
        that has not bound it yet looks free to the OS and could be given twice."""
        for _ in range(100):
            ports = free_ports(n)
            if not self._ports_given.intersection(ports):
                self._ports_given.update(ports)
                return ports
        raise ServerError(f"could not find {n} free ports")

    @staticmethod
    def _check_external(role: str, cfg: ServerConfig) -> list[str]:
        """Every external URL must answer /health; retried briefly in case it is just waking up."""
        urls = [u.rstrip("/") if "://" in u else "http://" + u.rstrip("/") for u in cfg.urls]
        deadline = time.monotonic() + min(cfg.startup_timeout_s, 10.0)
        for url in urls:
            while (why := check_health(url)) is not None:
                if time.monotonic() >= deadline:
                    raise ServerError(
                        f"serving.{role}: external server {url}/health failed ({why}); start that server "
                        f"first, fix serving.{role}.urls, or use serving.{role}.backend=embedded")
                time.sleep(_POLL_S)
        return urls

    # -- signals ------------------------------------------------------------------

    def _install_handlers(self) -> None:
        atexit.register(self.stop)
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        for sig in (signal.SIGTERM, signal.SIGHUP):
            self._prev_handlers[sig] = signal.signal(sig, self._on_signal)
        # SIGINT keeps Python's default: KeyboardInterrupt unwinds through __exit__ or atexit.

    def _restore_handlers(self) -> None:
        atexit.unregister(self.stop)
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, prev in self._prev_handlers.items():
            signal.signal(sig, prev)  # type: ignore[arg-type]
        self._prev_handlers.clear()

    def _on_signal(self, signum: int, frame: object) -> None:
        prev = self._prev_handlers.get(signum)
        self.stop()
        if callable(prev):
            prev(signum, frame)
        elif prev != signal.SIG_IGN:
            # The default action of SIGTERM/SIGHUP is to die; die the Python way so
            # that `finally` blocks and other atexit hooks still run.
            raise SystemExit(128 + signum)
