"""Rollout pool throughput against an HTTP endpoint of fixed latency.

    python -m aflow_rl.bench.rollout_pool [--json OUT] [--latency 0.2] [--requests 1] [--workers 2]
                                          [--client raw|httpx] [--server raw|uvicorn]

Starts a local HTTP server (its own process) that answers every ``POST
/generate`` after ``--latency`` seconds, then runs episodes that each make
``--requests`` sequential requests to it, through a loky RolloutPool of
``--workers`` processes, at each ``--concurrency`` (episodes in flight in all).
An episode then takes ``requests x latency`` at best, so the ideal rate is
``concurrency / (requests x latency)`` episodes/s; the table gives the
measured rate as a percentage of it, and the pool's start-up time (spawn,
import, init_worker). "direct_asyncio" runs the same episodes with asyncio in
this process, no pool: what this client and server reach on this machine.
With ``ray`` installed the same episodes also run on Ray async actors.

Why a bare asyncio client and server by default: the pool is what is
measured, and on a small machine the endpoint and the HTTP client share its
cores. A real inference server runs elsewhere; httpx's connection pool does
per-request work that grows with the number of open connections (see
``--client httpx``), and uvicorn without httptools parses HTTP in pure
Python (``--server uvicorn``).
"""
from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import multiprocessing
import os
import socket
import statistics
import sys
import time
from typing import Any

import httpx

from aflow_rl.bench import machine as bench_machine
from aflow_rl.rollout.types import Trajectory, WorkerContext

# -- the endpoint -------------------------------------------------------------------------------------


def _endpoint_app(latency_s: float) -> Any:
    """A bare ASGI app: every request except /health answers after ``latency_s``."""
    body = b'{"text": "ok"}'
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


_RESPONSE = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 14\r\n\r\n{\"text\": \"ok\"}"


class _LatencyProtocol(asyncio.Protocol):
    """HTTP/1.1 keep-alive server side of one connection: each request is answered after the latency."""

    def __init__(self, latency_s: float):
        self.latency_s, self.buf, self.transport = latency_s, b"", None

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
            self.transport.write(_RESPONSE)


def _content_length(head: bytes) -> int:
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0


def _serve(port: int, latency_s: float, server: str) -> None:
    if server == "uvicorn":
        import uvicorn

        uvicorn.run(_endpoint_app(latency_s), host="127.0.0.1", port=port, log_level="warning",
                    access_log=False, lifespan="off", backlog=4096)
        return

    async def main() -> None:
        srv = await asyncio.get_running_loop().create_server(
            lambda: _LatencyProtocol(latency_s), "127.0.0.1", port, backlog=4096)
        await srv.serve_forever()

    asyncio.run(main())


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
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return url, proc
        except httpx.HTTPError:
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


def _client(base_url: str, kind: str) -> Any:
    if kind == "raw":
        return RawClient(base_url)
    # No pool limit: the benchmark sets concurrency through the rollout pool, not through httpx.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    return httpx.AsyncClient(base_url=base_url, limits=limits, timeout=60.0)


async def _episode_requests(client: Any, episode_id: str, n: int) -> float:
    t0 = time.perf_counter()
    for turn in range(n):
        body = json.dumps({"episode": episode_id, "turn": turn}).encode()
        if isinstance(client, RawClient):
            await client.post("/generate", body)
        else:
            resp = await client.post("/generate", content=body, headers={"content-type": "application/json"})
            resp.raise_for_status()
    return time.perf_counter() - t0


async def run_episode(task: dict, ctx: WorkerContext) -> Trajectory:
    """One benchmark episode: ``task["requests"]`` sequential POSTs to the endpoint."""
    client = ctx.state.get("http")
    if client is None:  # made on first use, inside the worker's event loop
        client = ctx.state["http"] = _client(ctx.urls["endpoint"][0], task["client"])
    latency = await _episode_requests(client, task["episode_id"], task["requests"])
    return Trajectory(episode_id=task["episode_id"], group_id=task["group_id"], final_reward=1.0,
                      metrics={"latency_s": latency})


# -- runners ------------------------------------------------------------------------------------------


def bench_pool(url: str, concurrency: int, n: int, requests: int, workers: int, client: str) -> dict:
    """Episodes/s of a loky RolloutPool with ``concurrency`` episodes in flight over ``workers`` processes."""
    from aflow_rl.config import RolloutConfig
    from aflow_rl.rollout.pool import RolloutPool

    cfg = RolloutConfig(backend="loky", workers=workers,
                        concurrency_per_worker=max(1, concurrency // workers), episode_timeout_s=120.0,
                        max_attempts=1, trace=False)
    ctx = WorkerContext(config=None, urls={"endpoint": [url]})
    t0 = time.perf_counter()
    with RolloutPool(cfg, ctx, env="aflow_rl.bench.rollout_pool") as pool:
        startup = time.perf_counter() - t0
        task = {"requests": requests, "client": client}
        warm = list(pool.run([dict(task) for _ in range(concurrency)]))  # opens the connections
        t0 = time.perf_counter()
        out = list(pool.run([dict(task) for _ in range(n)]))
        wall = time.perf_counter() - t0
    bad = [t.error for t in out + warm if not t.ok]
    if bad:
        raise RuntimeError(f"{len(bad)} benchmark episodes failed; first: {bad[0][-500:]}")
    return {"wall_s": wall, "startup_s": startup, "latencies": [t.metrics["latency_s"] for t in out]}


def bench_direct(url: str, concurrency: int, n: int, requests: int, client: str) -> dict:
    """The same episodes with asyncio in this process: no pool, one process."""

    async def main() -> dict:
        gate = asyncio.Semaphore(concurrency)
        http = _client(url, client)

        async def one(i: int) -> float:
            async with gate:
                return await _episode_requests(http, f"d{i}", requests)

        await asyncio.gather(*(one(i) for i in range(concurrency)))  # warm-up
        t0 = time.perf_counter()
        latencies = await asyncio.gather(*(one(i) for i in range(n)))
        wall = time.perf_counter() - t0
        await http.aclose()
        return {"wall_s": wall, "startup_s": 0.0, "latencies": list(latencies)}

    return asyncio.run(main())


def bench_ray(url: str, concurrency: int, n: int, requests: int, workers: int, client: str) -> dict:
    """The same episodes on ``workers`` Ray async actors, each with ``concurrency / workers`` in flight."""
    import ray

    t0 = time.perf_counter()
    ray.init(num_cpus=workers, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)

    @ray.remote
    class Runner:
        async def episode(self, i: int) -> float:
            if not hasattr(self, "client"):
                self.client = _client(url, client)
            return await _episode_requests(self.client, f"r{i}", requests)

    actors = [Runner.options(max_concurrency=max(1, concurrency // workers)).remote() for _ in range(workers)]
    ray.get([a.episode.remote(-1) for a in actors])
    startup = time.perf_counter() - t0
    ray.get([actors[i % workers].episode.remote(i) for i in range(concurrency)])  # warm-up
    t0 = time.perf_counter()
    latencies = ray.get([actors[i % workers].episode.remote(i) for i in range(n)])
    wall = time.perf_counter() - t0
    ray.shutdown()
    return {"wall_s": wall, "startup_s": startup, "latencies": latencies}


# -- report -------------------------------------------------------------------------------------------


def machine() -> dict:
    """What the numbers were measured on (plus the pool's own dependencies and the load)."""
    import joblib

    return bench_machine(joblib=joblib.__version__, httpx=httpx.__version__,
                         load_avg_1m_at_start=round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None)


def _row(name: str, concurrency: int, n: int, res: dict, ideal: float) -> dict:
    eps = n / res["wall_s"]
    lat = sorted(res["latencies"])
    return {"runner": name, "concurrency": concurrency, "episodes": n, "wall_s": round(res["wall_s"], 3),
            "episodes_per_s": round(eps, 1), "ideal_per_s": round(ideal, 1), "pct_of_ideal": round(100 * eps / ideal, 1),
            "startup_s": round(res["startup_s"], 3), "episode_latency_p50_s": round(statistics.median(lat), 4),
            "episode_latency_p95_s": round(lat[int(0.95 * (len(lat) - 1))], 4)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m aflow_rl.bench.rollout_pool", description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--latency", type=float, default=0.2, help="endpoint latency per request, seconds")
    ap.add_argument("--requests", type=int, default=1, help="sequential requests per episode")
    ap.add_argument("--workers", type=int, default=2, help="worker processes")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[64, 256], help="episodes in flight")
    ap.add_argument("--waves", type=int, default=20, help="episodes per run = waves x concurrency")
    ap.add_argument("--client", choices=["raw", "httpx"], default="raw", help="HTTP client inside episodes")
    ap.add_argument("--server", choices=["raw", "uvicorn"], default="raw", help="the fixed-latency endpoint")
    ap.add_argument("--no-direct", action="store_true", help="skip the no-pool asyncio baseline")
    args = ap.parse_args(argv)

    info = machine()
    print("machine: " + ", ".join(f"{k}={v}" for k, v in info.items()))
    print(f"endpoint: {args.server} server on 127.0.0.1, {args.latency:g} s per request, {args.requests} request(s) "
          f"per episode, {args.client} client; pool: loky, {args.workers} worker processes")
    url, server = start_endpoint(args.latency, args.server)
    have_ray = importlib.util.find_spec("ray") is not None
    rows = []
    try:
        for conc in args.concurrency:
            n = conc * args.waves
            ideal = conc / (args.requests * args.latency)
            rows.append(_row("rollout_pool", conc, n,
                             bench_pool(url, conc, n, args.requests, args.workers, args.client), ideal))
            if not args.no_direct:
                rows.append(_row("direct_asyncio", conc, n, bench_direct(url, conc, n, args.requests, args.client), ideal))
            if have_ray:
                rows.append(_row("ray_actors", conc, n,
                                 bench_ray(url, conc, n, args.requests, args.workers, args.client), ideal))
    finally:
        server.kill()
    cols = ["runner", "concurrency", "episodes", "wall_s", "episodes_per_s", "ideal_per_s", "pct_of_ideal",
            "startup_s", "episode_latency_p50_s", "episode_latency_p95_s"]
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(str(r[c]) for c in cols))
    if not have_ray:
        print("ray: not installed, Ray actor comparison skipped (pip install ray to add it)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"machine": info, "args": vars(args), "ray": have_ray, "results": rows}, fh, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
