"""ServerManager: process lifecycle with a fake server script, external checks, command lines."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import httpx
import pytest

from aflow_rl.config import ServerConfig, ServingConfig
from aflow_rl.serving import manager as mgr
from aflow_rl.serving.manager import ServerError, ServerManager, router_command, sglang_command

# A stand-in for the embedded server: `fake_server.py PORT MODE PIDFILE`.
# It starts a child process (as SGLang does) and records both pids, so tests can
# check that stopping the server ends the whole process group.
FAKE_SERVER = textwrap.dedent('''
    import http.server, subprocess, sys, time
    port, mode, pidfile = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(pidfile, "w") as fh:
        fh.write(f"{child.pid}\\n")
    print(f"fake server starting on {port} in mode {mode}", flush=True)
    if mode == "crash":
        print("RuntimeError: weights file is corrupt", flush=True)
        sys.exit(3)
    if mode == "hang":
        time.sleep(600)
    time.sleep(0.3)  # a moment of loading before /health answers

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.send_header("content-length", "2")
            self.end_headers()
            self.wfile.write(b"ok")
        def log_message(self, *a):
            print("request", self.path, flush=True)

    http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
''')


def pid_alive(pid: int) -> bool:
    """True while the process exists and is not a zombie (PID 1 may not reap orphans here)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def wait_dead(pid: int, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def fake_embedded(tmp_path, monkeypatch):
    """Make the embedded backend launch FAKE_SERVER in a given mode; returns the serving config."""
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE_SERVER)

    def make(mode: str = "ok", num_servers: int = 1, startup_timeout_s: float = 30.0) -> ServingConfig:
        def command(cfg: ServerConfig, port: int) -> list[str]:
            return [sys.executable, str(script), str(port), mode, str(tmp_path / f"child-{port}.pid")]
        monkeypatch.setattr(mgr, "embedded_command", command)
        policy = ServerConfig(backend="embedded", model_path="/unused", num_servers=num_servers,
                              startup_timeout_s=startup_timeout_s, stop_grace_s=2.0)
        return ServingConfig(policy=policy, actor=ServerConfig(backend="none"))
    return make


def child_pids(tmp_path) -> list[int]:
    return [int(p.read_text()) for p in tmp_path.glob("child-*.pid")]


def test_start_health_logs_and_stop(fake_embedded, tmp_path):
    serving = fake_embedded("ok", num_servers=2)
    run_dir = tmp_path / "run"
    with ServerManager(serving, str(run_dir)) as servers:
        urls = servers.urls("policy")
        assert len(urls) == 2 and len(set(urls)) == 2
        assert servers.urls("actor") == []
        assert servers.all_urls() == {"policy": urls, "actor": []}
        for url in urls:
            assert httpx.get(url + "/health", trust_env=False).status_code == 200
        pids = [p.proc.pid for p in servers.processes]
        children = child_pids(tmp_path)
        assert len(children) == 2 and all(pid_alive(p) for p in pids + children)
    for i in range(2):
        log = (run_dir / "logs" / f"policy-{i}.log").read_text()
        assert "fake server starting" in log and "request /health" in log
    assert all(wait_dead(p) for p in pids + children)  # the servers and their children
    with pytest.raises(RuntimeError, match="before start"):
        servers.urls("policy")


def test_start_stop_without_with(fake_embedded, tmp_path):
    servers = ServerManager(fake_embedded("ok"), str(tmp_path / "run")).start()
    pid = servers.processes[0].proc.pid
    assert pid_alive(pid)
    servers.stop()
    servers.stop()  # idempotent
    assert wait_dead(pid)


def test_servers_stop_after_an_exception_inside_with(fake_embedded, tmp_path):
    with pytest.raises(ZeroDivisionError):
        with ServerManager(fake_embedded("ok"), str(tmp_path / "run")) as servers:
            pid = servers.processes[0].proc.pid
            1 / 0
    assert wait_dead(pid)
    assert all(wait_dead(p) for p in child_pids(tmp_path))


def test_early_exit_is_reported_at_once_with_the_log_tail(fake_embedded, tmp_path):
    serving = fake_embedded("crash", startup_timeout_s=120.0)
    start = time.monotonic()
    with pytest.raises(ServerError) as err:
        ServerManager(serving, str(tmp_path / "run")).start()
    assert time.monotonic() - start < 10.0  # far below the 120 s deadline
    msg = str(err.value)
    assert "exited with code 3" in msg and "weights file is corrupt" in msg
    assert "policy-0.log" in msg
    assert all(wait_dead(p) for p in child_pids(tmp_path))


def test_startup_timeout_stops_the_server(fake_embedded, tmp_path):
    serving = fake_embedded("hang", startup_timeout_s=1.5)
    start = time.monotonic()
    with pytest.raises(ServerError, match=r"did not answer /health within 1.5s") as err:
        ServerManager(serving, str(tmp_path / "run")).start()
    assert 1.5 <= time.monotonic() - start < 8.0
    assert "mode hang" in str(err.value)  # the log tail is quoted
    assert all(wait_dead(p) for p in child_pids(tmp_path))


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signals_stop_the_servers(fake_embedded, tmp_path, sig):
    """Ctrl-C (SIGINT) and SIGTERM to a process holding a manager end its servers too."""
    fake_embedded("ok")  # writes the fake script
    script = tmp_path / "holder.py"
    script.write_text(textwrap.dedent(f'''
        import sys, time
        from aflow_rl.config import ServerConfig, ServingConfig
        from aflow_rl.serving import manager as mgr
        mgr.embedded_command = lambda cfg, port: [sys.executable, {str(tmp_path / "fake_server.py")!r},
                                                  str(port), "ok", {str(tmp_path)!r} + f"/child-{{port}}.pid"]
        serving = ServingConfig(policy=ServerConfig(backend="embedded", model_path="/x", stop_grace_s=2.0),
                                actor=ServerConfig(backend="none"))
        with mgr.ServerManager(serving, {str(tmp_path / "run")!r}) as servers:
            print(servers.processes[0].proc.pid, flush=True)
            time.sleep(600)
    '''))
    env = dict(os.environ, PYTHONPATH=os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""))
    holder = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        server_pid = int(holder.stdout.readline())
        assert pid_alive(server_pid)
        holder.send_signal(sig)
        holder.wait(timeout=15)
        assert wait_dead(server_pid)
        assert all(wait_dead(p) for p in child_pids(tmp_path))
    finally:
        if holder.poll() is None:
            holder.kill()


def test_kill_9_of_the_holder_ends_its_servers(fake_embedded, tmp_path):
    """kill -9 runs no handler in the holder: the server (here a program that knows nothing of
    aflow_rl) dies through the parent-death signal the manager gave it at launch."""
    fake_embedded("ok")
    script = tmp_path / "holder.py"
    script.write_text(textwrap.dedent(f'''
        import sys, time
        from aflow_rl.config import ServerConfig, ServingConfig
        from aflow_rl.serving import manager as mgr
        mgr.embedded_command = lambda cfg, port: [sys.executable, {str(tmp_path / "fake_server.py")!r},
                                                  str(port), "ok", {str(tmp_path)!r} + f"/child-{{port}}.pid"]
        serving = ServingConfig(policy=ServerConfig(backend="embedded", model_path="/x"),
                                actor=ServerConfig(backend="none"))
        servers = mgr.ServerManager(serving, {str(tmp_path / "run")!r}).start()
        print(servers.processes[0].proc.pid, flush=True)
        time.sleep(600)
    '''))
    env = dict(os.environ, PYTHONPATH=os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""))
    holder = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env)
    server_pid = int(holder.stdout.readline())
    try:
        assert pid_alive(server_pid)
        holder.kill()
        holder.wait(timeout=15)
        assert wait_dead(server_pid, 5.0)
    finally:
        # The fake's own child has no guard of its own (SGLang's and the embedded server's do): ours to end.
        for pid in [server_pid] + child_pids(tmp_path):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_port_held_by_an_orphan_is_refused_naming_its_pid(fake_embedded, tmp_path):
    """A fixed port another process listens on (an earlier run's orphan) stops start-up before any
    server starts; otherwise the health check would find the orphan and the run would use it."""
    orphan = subprocess.Popen([sys.executable, "-c", textwrap.dedent('''
        import socket, time
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        s.listen()
        print(s.getsockname()[1], flush=True)
        time.sleep(600)
    ''')], stdout=subprocess.PIPE, text=True)
    try:
        port = int(orphan.stdout.readline())
        serving = fake_embedded("ok", num_servers=2)
        serving.policy.port = port - 1  # the second server's port is the held one
        start = time.monotonic()
        with pytest.raises(ServerError) as err:
            ServerManager(serving, str(tmp_path / "run")).start()
        assert time.monotonic() - start < 10.0
        msg = str(err.value)
        assert "\n" not in msg
        assert msg.startswith(f"serving.policy.port: port {port} is already in use by process {orphan.pid} (")
        assert f"kill {orphan.pid}" in msg and "choose another serving.policy.port" in msg
        assert not (tmp_path / "run" / "logs").exists()  # nothing was started
        assert orphan.poll() is None                     # and the holder was left alone
    finally:
        orphan.kill()
        orphan.wait()


def test_a_free_fixed_port_is_used(fake_embedded, tmp_path):
    serving = fake_embedded("ok")
    serving.policy.port = mgr.free_ports(1)[0]
    with ServerManager(serving, str(tmp_path / "run")) as servers:
        assert servers.urls("policy") == [f"http://127.0.0.1:{serving.policy.port}"]


def test_external_backend_checks_health(tmp_path):
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    serving = ServingConfig(policy=ServerConfig(backend="external", urls=[f"127.0.0.1:{port}"],
                                                startup_timeout_s=0.5),
                            actor=ServerConfig(backend="none"))
    with pytest.raises(ServerError) as err:
        ServerManager(serving, str(tmp_path)).start()
    msg = str(err.value)
    assert f"http://127.0.0.1:{port}/health" in msg
    assert "serving.policy.urls" in msg and "backend=embedded" in msg


def test_external_backend_with_a_live_server(tmp_path):
    from http.server import BaseHTTPRequestHandler, HTTPServer
    import threading

    class H(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *a):
            pass

    httpd = HTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}"
        serving = ServingConfig(policy=ServerConfig(backend="external", urls=[url + "/"]),
                                actor=ServerConfig(backend="none"))
        with ServerManager(serving, str(tmp_path)) as servers:
            assert servers.urls("policy") == [url]
            assert servers.processes == []
    finally:
        httpd.shutdown()


def test_sglang_missing_fails_at_once_with_the_fix(tmp_path, monkeypatch):
    monkeypatch.setattr(mgr.importlib.util, "find_spec", lambda name: None)
    serving = ServingConfig(policy=ServerConfig(backend="sglang", model_path="/m"),
                            actor=ServerConfig(backend="none"))
    with pytest.raises(ServerError, match=r"pip install -e \.\[gpu\]"):
        ServerManager(serving, str(tmp_path)).start()


def test_missing_model_path_is_reported():
    serving = ServingConfig(policy=ServerConfig(backend="embedded", model_path=""),
                            actor=ServerConfig(backend="none"))
    with pytest.raises(ServerError, match="serving.policy.model_path"):
        ServerManager(serving, "/tmp/unused").start()


def test_build_tiny_builds_the_model_once_before_start(fake_embedded, tmp_path, monkeypatch):
    import aflow_rl.models.tiny as tiny

    built = []
    monkeypatch.setattr(tiny, "build", lambda out, preset, seed: built.append((out, preset)) or out)
    serving = fake_embedded("ok")
    serving.policy.model_path = str(tmp_path / "model")
    serving.policy.build_tiny = "tiny"
    with ServerManager(serving, str(tmp_path / "run")):
        pass
    assert built == [(str(tmp_path / "model"), "tiny")]
    serving.policy.build_tiny = "huge"
    with pytest.raises(ServerError, match="serving.policy.build_tiny"):
        ServerManager(serving, str(tmp_path / "run")).start()


def test_sglang_command_line():
    cfg = ServerConfig(backend="sglang", model_path="/models/qwen", tp=2, host="0.0.0.0", mem_fraction=0.7,
                       dtype="bfloat16", context_length=8192, base_gpu_id=4,
                       extra_args=["--chunked-prefill-size", "4096"])
    assert sglang_command(cfg, 30001, index=1) == [
        sys.executable, "-m", "sglang.launch_server", "--model-path", "/models/qwen", "--tp", "2",
        "--port", "30001", "--host", "0.0.0.0", "--mem-fraction-static", "0.7", "--base-gpu-id", "6",
        "--dtype", "bfloat16", "--context-length", "8192", "--chunked-prefill-size", "4096"]
    plain = sglang_command(ServerConfig(backend="sglang", model_path="/m"), 30000)
    assert "--dtype" not in plain and "--context-length" not in plain
    assert plain[plain.index("--base-gpu-id") + 1] == "0"
    assert router_command(["http://a:1", "http://b:2"], "127.0.0.1", 30100) == [
        sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", "http://a:1", "http://b:2",
        "--host", "127.0.0.1", "--port", "30100"]


def test_embedded_command_line():
    cfg = ServerConfig(model_path="/m", max_batch_size=8, dtype="float32", context_length=512, threads=1)
    assert mgr.embedded_command(cfg, 4321) == [
        sys.executable, "-m", "aflow_rl.serving.embedded", "--model-path", "/m", "--port", "4321",
        "--host", "127.0.0.1", "--max-batch-size", "8", "--dtype", "float32",
        "--context-length", "512", "--threads", "1"]


def test_router_is_the_only_endpoint(tmp_path, monkeypatch):
    """backend=sglang with router: workers and router start; only the router's URL is returned."""
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE_SERVER)
    launched = []

    def fake_cmd(kind):
        def command(*args):
            port = args[1] if kind == "server" else args[2]
            launched.append((kind, args))
            return [sys.executable, str(script), str(port), "ok", str(tmp_path / f"child-{port}.pid")]
        return command
    monkeypatch.setattr(mgr.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(mgr, "sglang_command", fake_cmd("server"))
    monkeypatch.setattr(mgr, "router_command", fake_cmd("router"))
    serving = ServingConfig(policy=ServerConfig(backend="sglang", model_path="/m", num_servers=2, router=True,
                                                stop_grace_s=2.0),
                            actor=ServerConfig(backend="none"))
    with ServerManager(serving, str(tmp_path / "run")) as servers:
        (url,) = servers.urls("policy")
        worker_urls = launched[-1][1][0]
        assert [k for k, _ in launched] == ["server", "server", "router"]
        assert len(worker_urls) == 2 and url not in worker_urls
        assert httpx.get(url + "/health", trust_env=False).status_code == 200
        assert os.path.exists(tmp_path / "run" / "logs" / "policy-router.log")


def test_embedded_server_end_to_end(tiny_model_dir, tiny_model_dir_b, tmp_path):
    """The manager starts the real embedded server with the tiny model; clients from
    make_client get completions (token ids + logprobs natively, chat via /v1) through it."""
    import asyncio

    from aflow_rl.config import ClientConfig
    from aflow_rl.llm import make_client

    serving = ServingConfig(policy=ServerConfig(backend="embedded", model_path=tiny_model_dir, threads=1,
                                                max_batch_size=8, startup_timeout_s=120.0),
                            actor=ServerConfig(backend="none"))
    with ServerManager(serving, str(tmp_path / "run")) as servers:
        urls = servers.urls("policy")
        native = make_client(ClientConfig(provider="sglang", timeout_s=60.0), urls, role="policy")
        chat = make_client(ClientConfig(provider="openai", timeout_s=60.0), urls, role="policy")

        async def session():
            c = await native.generate(input_ids=[5, 6, 7, 8], return_logprob=True, max_new_tokens=6,
                                      temperature=1.0, ignore_eos=True)
            schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
            j = await native.generate("Answer in JSON: ", json_schema=schema, max_new_tokens=32,
                                      temperature=0.7, return_logprob=True)
            ch = await chat.chat([{"role": "system", "content": "You plan."},
                                  {"role": "user", "content": "Split the task."}],
                                 return_logprob=True, max_new_tokens=5, temperature=1.0)
            health = await native.health()
            await native.update_weights_from_disk(tiny_model_dir_b, weight_version="7")
            after = await native.generate(input_ids=[5, 6, 7, 8], max_new_tokens=1)
            await native.aclose()
            await chat.aclose()
            return c, j, ch, health, after

        c, j, ch, health, after = asyncio.run(session())
        assert len(c.output_ids) == 6 and c.finish_reason == "length"
        assert len(c.logprobs) == 6 and all(lp <= 0.0 for lp in c.logprobs)
        assert c.prompt_ids == [5, 6, 7, 8] and c.prompt_tokens == 4 and c.weight_version is not None
        if j.finish_reason == "stop":
            import json
            assert isinstance(json.loads(j.text)["n"], int)
        assert len(j.logprobs) == len(j.output_ids) > 0
        assert 0 < len(ch.logprobs) <= 5 and ch.finish_reason in ("stop", "length")
        assert health == {urls[0]: True}
        assert after.weight_version == "7" != c.weight_version
        log = tmp_path / "run" / "logs" / "policy-0.log"
        assert log.exists() and log.stat().st_size > 0
        pid = servers.processes[0].proc.pid
    assert wait_dead(pid)
