"""Rollout pool + shipped client throughput against an HTTP endpoint of fixed latency.

    python -m aflow_rl.bench.rollout_pool [--json OUT] [--latency 0.2] [--requests 1]
        [--plan 64:2 256:2 1024:4] [--clients shipped raw] [--repeats 2] [--server raw|uvicorn]

Starts a local HTTP server (its own process) that answers every ``POST
/generate`` after ``--latency`` seconds with a reply in SGLang's shape (48
output ids with their logprobs). Episodes each make ``--requests`` sequential
requests carrying a quickstart-sized ``/generate`` body (a few hundred input
ids and a JSON-schema grammar), through a loky RolloutPool, at each
``concurrency:workers`` of ``--plan``. An episode takes ``requests x latency``
at best, so the ideal rate is ``concurrency / (requests x latency)``.

Clients (``--clients``), measured in the same pool, interleaved A B A B:

- ``shipped``: ``SGLangClient.generate`` -> ``HTTPTransport``, exactly what
  training runs (payload building, balancing, deadlines, reply parsing);
- ``shipped_aiohttp``: the same client with its plain-http endpoint sent through
  aiohttp instead of the lean HTTP/1.1 client (llm/http1.py): the transport before
  that change, kept to measure it against the shipped one in the same run;
- ``raw``: a bare keep-alive asyncio-streams client, the reference row: what
  the pool and this machine reach with almost no client work;
- ``aiohttp``, ``httpx``, ``httpx2``: the bare libraries, to choose the
  transport's library by measurement.

Each row gives % of ideal, episode latency p50/p95, the workers' CPU per
episode (process CPU time over the row / episodes) and the 1-minute load
average when the row started.
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import json
import multiprocessing
import os
import random
import socket
import statistics
import sys
import time
from typing import Any

from aflow_rl.bench import machine as bench_machine
from aflow_rl.rollout.types import Trajectory, WorkerContext

CLIENTS = ("shipped", "shipped_aiohttp", "raw", "aiohttp", "httpx", "httpx2")

# -- the workload: one quickstart turn ------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _schema() -> str:
    """A JSON-schema grammar the size of a quickstart turn's (an action union over items and subagents)."""
    items = [f"item_{i}" for i in range(4)]
    agents = ["researcher", "coder", "analyst", "writer"]
    variants = [{"type": "object", "properties": {"action": {"const": a}, "item": {"enum": items},
                                                  "subagent": {"enum": agents}, "note": {"type": "string",
                                                                                         "maxLength": 40}},
                 "required": ["action", "item"], "additionalProperties": False}
                for a in ("plan", "delegate", "retry", "answer")]
    return json.dumps({"anyOf": variants})


def generate_sampling() -> dict:
    return {"max_new_tokens": 48, "temperature": 1.0, "json_schema": _schema()}


def request_ids(seed: int, n: int = 400) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(512) for _ in range(n)]


def _reply_body() -> bytes:
    """A /generate reply in SGLang's shape: 48 output ids with their logprob rows."""
    ids = list(range(100, 148))
    meta = {"id": "bench", "finish_reason": {"type": "stop"}, "prompt_tokens": 400, "completion_tokens": 48,
            "weight_version": "0", "output_token_logprobs": [[-0.6931, t, None] for t in ids]}
    return json.dumps({"text": "x" * 120, "output_ids": ids, "meta_info": meta}).encode()


# -- the endpoint -------------------------------------------------------------------------------------


def _endpoint_app(latency_s: float, body: bytes) -> Any:
    """A bare ASGI app: every request except /health answers after ``latency_s``."""
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]

    async def app(scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        if scope["path"] != "/health":
            await asyncio.sleep(latency_s)
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    return app


def _response(body: bytes) -> bytes:
    return (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)) + body


class _LatencyProtocol(asyncio.Protocol):
    """HTTP/1.1 keep-alive server side of one connection: each request is answered after the latency."""

    def __init__(self, latency_s: float, response: bytes):
        self.latency_s, self.response, self.buf, self.transport = latency_s, response, b"", None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while (end := self.buf.find(b"\r\n\r\n")) >= 0:
            head = self.buf[:end]
            size = _content_length(head)
            if len(self.buf) < end + 4 + size:
                return  # body not all here yet
            self.buf = self.buf[end + 4 + size:]
            delay = 0.0 if head.split(b" ", 2)[1] == b"/health" else self.latency_s
            # Equal delays fire in order, so pipelined answers keep request order.
            asyncio.get_running_loop().call_later(delay, self._reply)

    def _reply(self) -> None:
        if not self.transport.is_closing():
            self.transport.write(self.response)


def _content_length(head: bytes) -> int:
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0


def _serve(port: int, latency_s: float, server: str) -> None:
    body = _reply_body()
    if server == "uvicorn":
        import uvicorn

        uvicorn.run(_endpoint_app(latency_s, body), host="127.0.0.1", port=port, log_level="warning",
                    access_log=False, lifespan="off", backlog=4096)
        return

    async def main() -> None:
        response = _response(body)
        srv = await asyncio.get_running_loop().create_server(
            lambda: _LatencyProtocol(latency_s, response), "127.0.0.1", port, backlog=4096)
        await srv.serve_forever()

    asyncio.run(main())


def _healthy(url: str) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=1) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
            return s.recv(64).startswith(b"HTTP/1.1 200")
    except OSError:
        return False


def start_endpoint(latency_s: float, server: str = "raw") -> tuple[str, multiprocessing.Process]:
    """Start the fixed-latency server in its own process; return its URL once /health answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = multiprocessing.get_context("spawn").Process(target=_serve, args=(port, latency_s, server), daemon=True)
    proc.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if _healthy(url):
            return url, proc
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError("the benchmark endpoint did not start within 30 s")


# -- the episode (a worker module function) ------------------------------------------------------------


class RawClient:
    """A bare keep-alive HTTP/1.1 client over asyncio streams: one request per connection at a time."""

    def __init__(self, base_url: str):
        host, _, port = base_url.removeprefix("http://").partition(":")
        self.host, self.port = host, int(port)
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def post(self, path: str, body: bytes) -> bytes:
        reader, writer = self.idle.pop() if self.idle else await asyncio.open_connection(self.host, self.port)
        writer.write(b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (path.encode(), self.host.encode(), len(body), body))
        head = await reader.readuntil(b"\r\n\r\n")
        data = await reader.readexactly(_content_length(head))
        self.idle.append((reader, writer))  # only a clean exchange returns the connection
        if head.split(b" ", 2)[1] != b"200":
            raise RuntimeError(f"HTTP {head.split(b' ', 2)[1].decode()} from {path}")
        return data

    async def aclose(self) -> None:
        for _, writer in self.idle:
            writer.close()


def make_client(kind: str, url: str) -> Any:
    """One client of ``kind`` for this event loop; none has a connection limit of its own."""
    if kind in ("shipped", "shipped_aiohttp"):
        from aflow_rl.llm.sglang import SGLangClient

        # max_concurrency: the pool, not the client, sets how many requests are in flight.
        client = SGLangClient([url], timeout_s=60.0, max_concurrency=4096)
        if kind == "shipped_aiohttp":
            client.http.endpoints[0].lean = False   # the aiohttp path, for the A/B comparison
        return client
    if kind == "raw":
        return RawClient(url)
    if kind == "aiohttp":
        import aiohttp

        session = aiohttp.ClientSession(url, connector=aiohttp.TCPConnector(limit=0))
        asyncio.get_running_loop().create_task(_close_at_shutdown(session))
        return session
    if kind in ("httpx", "httpx2"):
        lib = __import__(kind)
        limits = lib.Limits(max_connections=None, max_keepalive_connections=None)
        return lib.AsyncClient(base_url=url, limits=limits, timeout=60.0, trust_env=False)
    raise ValueError(f"--clients: unknown client {kind!r}; expected one of {', '.join(CLIENTS)}")


_CLOSERS: list = []


async def _close_at_shutdown(session: Any) -> None:
    """Close a bare aiohttp session when asyncio.run shuts the worker's loop down (its async
    generators are finalised then), so the worker does not log "Unclosed client session"."""
    async def closer():
        try:
            yield
        finally:
            await session.close()

    agen = closer()
    _CLOSERS.append(agen)  # the loop holds its async generators weakly
    await agen.__anext__()


async def one_request(client: Any, kind: str, ids: list[int]) -> int:
    """Send one /generate; return the number of output ids (every client decodes the reply)."""
    if kind in ("shipped", "shipped_aiohttp"):
        comp = await client.generate(input_ids=ids, return_logprob=True, **generate_sampling())
        return len(comp.output_ids)
    body = {"input_ids": ids, "return_logprob": True, "sampling_params": generate_sampling()}
    if kind == "raw":
        return len(json.loads(await client.post("/generate", json.dumps(body).encode()))["output_ids"])
    if kind == "aiohttp":
        async with client.post("/generate", json=body) as resp:
            resp.raise_for_status()
            return len(json.loads(await resp.read())["output_ids"])
    resp = await client.post("/generate", json=body)
    resp.raise_for_status()
    return len(resp.json()["output_ids"])


async def run_episode(task: dict, ctx: WorkerContext) -> Trajectory:
    """One benchmark episode: ``task["requests"]`` sequential /generate calls with ``task["client"]``."""
    kind = task["client"]
    client = ctx.state.get(kind)
    if client is None:  # made on first use, inside the worker's event loop
        client = ctx.state[kind] = make_client(kind, ctx.urls["endpoint"][0])
    ids = ctx.state.get("ids")
    if ids is None:  # once per worker: the prompt is workload, not client work
        ids = ctx.state["ids"] = request_ids(os.getpid())
    t0 = time.perf_counter()
    for _ in range(task["requests"]):
        if await one_request(client, kind, ids) != 48:
            raise RuntimeError("the endpoint's reply lost output ids")
    return Trajectory(episode_id=task["episode_id"], group_id=task["group_id"], final_reward=1.0,
                      metrics={"latency_s": time.perf_counter() - t0, "cpu_s": time.process_time(),
                               "pid": float(os.getpid())})


# -- runner -------------------------------------------------------------------------------------------


def _last_cpu(trajs: list[Trajectory]) -> dict[float, float]:
    """pid -> the highest process CPU time any episode of that worker reported."""
    out: dict[float, float] = {}
    for t in trajs:
        pid = t.metrics["pid"]
        out[pid] = max(out.get(pid, 0.0), t.metrics["cpu_s"])
    return out


def _run(pool: Any, kind: str, count: int, requests: int) -> list[Trajectory]:
    out = list(pool.run([{"requests": requests, "client": kind} for _ in range(count)]))
    bad = [t.error for t in out if not t.ok]
    if bad:
        raise RuntimeError(f"{len(bad)} {kind} episodes failed; first: {bad[0][-500:]}")
    return out


def bench_row(pool: Any, kind: str, concurrency: int, n: int, requests: int) -> dict:
    """One measured run of ``n`` episodes after one warm-up wave (which opens the connections)."""
    before = _last_cpu(_run(pool, kind, concurrency, requests))
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    out = _run(pool, kind, n, requests)
    wall = time.perf_counter() - t0
    after = _last_cpu(out)
    cpu = sum(after[p] - before.get(p, after[p]) for p in after)
    return {"wall_s": wall, "latencies": [t.metrics["latency_s"] for t in out], "cpu_s": cpu, "load": load}


def bench_plan(url: str, concurrency: int, workers: int, args: argparse.Namespace) -> list[dict]:
    """Every client at one concurrency, in one pool, interleaved A B A B."""
    from aflow_rl.config import RolloutConfig
    from aflow_rl.rollout.pool import RolloutPool

    cfg = RolloutConfig(backend="loky", workers=workers,
                        concurrency_per_worker=max(1, concurrency // workers), episode_timeout_s=120.0,
                        max_attempts=1, trace=False)
    ctx = WorkerContext(config=None, urls={"endpoint": [url]})
    n = concurrency * args.waves
    ideal = concurrency / (args.requests * args.latency)
    rows = []
    with RolloutPool(cfg, ctx, env="aflow_rl.bench.rollout_pool") as pool:
        for rep in range(args.repeats):
            for kind in args.clients:
                res = bench_row(pool, kind, concurrency, n, args.requests)
                rows.append(_row(kind, rep + 1, concurrency, workers, n, res, ideal))
                print(_fmt(rows[-1]), flush=True)
    return rows


# -- report -------------------------------------------------------------------------------------------

COLS = ["client", "rep", "concurrency", "workers", "episodes", "episodes_per_s", "ideal_per_s", "pct_of_ideal",
        "latency_p50_s", "latency_p95_s", "worker_cpu_ms_per_episode", "load_1m"]


def machine() -> dict:
    """What the numbers were measured on (plus the client libraries' versions)."""
    import importlib.metadata as md

    versions = {}
    for dist in ("aiohttp", "httpx", "httpx2"):
        try:
            versions[dist] = md.version(dist)
        except md.PackageNotFoundError:
            versions[dist] = "absent"
    return bench_machine(**versions, load_avg_1m_at_start=round(os.getloadavg()[0], 2))


def _row(kind: str, rep: int, concurrency: int, workers: int, n: int, res: dict, ideal: float) -> dict:
    eps = n / res["wall_s"]
    lat = sorted(res["latencies"])
    return {"client": kind, "rep": rep, "concurrency": concurrency, "workers": workers, "episodes": n,
            "wall_s": round(res["wall_s"], 3), "episodes_per_s": round(eps, 1), "ideal_per_s": round(ideal, 1),
            "pct_of_ideal": round(100 * eps / ideal, 1), "latency_p50_s": round(statistics.median(lat), 4),
            "latency_p95_s": round(lat[int(0.95 * (len(lat) - 1))], 4),
            "worker_cpu_ms_per_episode": round(1000 * res["cpu_s"] / n, 3), "load_1m": round(res["load"], 2)}


def _fmt(row: dict) -> str:
    return " | ".join(str(row[c]) for c in COLS)


def parse_plan(items: list[str]) -> list[tuple[int, int]]:
    """``["64:2", "1024:4"]`` -> ``[(64, 2), (1024, 4)]`` (concurrent episodes : worker processes)."""
    plan = []
    for item in items:
        conc, _, workers = item.partition(":")
        try:
            plan.append((int(conc), int(workers or 2)))
        except ValueError:
            raise SystemExit(f"--plan: {item!r} is not CONCURRENCY:WORKERS (e.g. 256:2)") from None
    return plan


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m aflow_rl.bench.rollout_pool", description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--latency", type=float, default=0.2, help="endpoint latency per request, seconds")
    ap.add_argument("--requests", type=int, default=1, help="sequential requests per episode")
    ap.add_argument("--plan", nargs="+", default=["64:2", "256:2", "1024:4"],
                    help="CONCURRENCY:WORKERS pairs (episodes in flight in all : worker processes)")
    ap.add_argument("--clients", nargs="+", choices=CLIENTS, default=["shipped", "raw"],
                    help="clients to compare; each runs in the same pool, interleaved")
    ap.add_argument("--repeats", type=int, default=2, help="interleaved rounds (A B A B)")
    ap.add_argument("--waves", type=int, default=20, help="episodes per row = waves x concurrency")
    ap.add_argument("--server", choices=["raw", "uvicorn"], default="raw", help="the fixed-latency endpoint")
    args = ap.parse_args(argv)
    plan = parse_plan(args.plan)

    info = machine()
    print("machine: " + ", ".join(f"{k}={v}" for k, v in info.items()))
    print(f"endpoint: {args.server} server on 127.0.0.1, {args.latency:g} s per request, {args.requests} "
          f"request(s) per episode; pool: loky; clients: {', '.join(args.clients)}")
    print(" | ".join(COLS))
    url, server = start_endpoint(args.latency, args.server)
    rows: list[dict] = []
    try:
        for conc, workers in plan:
            rows += bench_plan(url, conc, workers, args)
    finally:
        server.kill()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"machine": info, "args": vars(args), "results": rows}, fh, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
