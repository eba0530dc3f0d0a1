"""Throughput and latency of the embedded server under concurrent load.

    python -m aflow_rl.bench.serving [--preset tiny] [--json OUT]

The prefix cache on vs off on the quickstart's prompts is ``python -m aflow_rl.bench.prefix_cache``.

Builds the tiny model into a temporary directory, starts
``python -m aflow_rl.serving.embedded`` as a subprocess, and for each concurrency
level runs closed-loop clients (each sends its next ``/generate`` as soon as the last
one returns) with a fixed ``max_new_tokens`` and ``ignore_eos``, so every request
generates the same number of tokens. Reports aggregate generated tokens/s, request
latency percentiles, and the throughput ratio of the highest level to a single client.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from typing import Optional

import httpx

from aflow_rl.bench import machine
from aflow_rl.procs import PARENT_PID_ENV, preexec_die_with_parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_path: str, threads: Optional[int], log_path: str, timeout_s: float = 120.0,
                 extra_args: tuple[str, ...] = (), cwd: Optional[str] = None):
    """Launch the embedded server (``extra_args`` appended to its command line, run in ``cwd``);
    return (process, base URL) once /health answers 200."""
    port = _free_port()
    cmd = [sys.executable, "-m", "aflow_rl.serving.embedded", "--model-path", model_path, "--port", str(port),
           "--random-seed", "0"]
    if threads:
        cmd += ["--threads", str(threads)]
    cmd += list(extra_args)
    log = open(log_path, "w")
    # Dies with this benchmark however it ends (kill -9 included), like the servers ServerManager starts.
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, preexec_fn=preexec_die_with_parent(), cwd=cwd,
                            env={**os.environ, PARENT_PID_ENV: str(os.getpid())})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; see {log_path}")
        try:
            if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.terminate()
    raise RuntimeError(f"server not healthy after {timeout_s:.0f} s; see {log_path}")


def stop_server(proc: subprocess.Popen, grace_s: float = 15.0) -> None:
    """SIGTERM, then SIGKILL after ``grace_s``; always reaped."""
    proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100])."""
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, int(round(q / 100 * len(ordered) + 0.5)) - 1))
    return ordered[k]


async def run_level(url: str, concurrency: int, n_requests: int, max_new_tokens: int, vocab: int,
                    seed: int = 0) -> dict:
    """``concurrency`` closed-loop clients share ``n_requests`` requests; returns the measurements."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(16)] for _ in range(n_requests)]
    queue: asyncio.Queue = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    latencies: list[float] = []
    tokens = 0
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal tokens
        while not queue.empty():
            prompt = queue.get_nowait()
            t0 = time.perf_counter()
            r = await http.post("/generate", json={"input_ids": prompt, "sampling_params": {
                "max_new_tokens": max_new_tokens, "ignore_eos": True, "temperature": 1.0}})
            r.raise_for_status()
            latencies.append(time.perf_counter() - t0)
            tokens += r.json()["meta_info"]["completion_tokens"]

    async with httpx.AsyncClient(base_url=url, timeout=600.0, limits=limits) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return {"concurrency": concurrency, "requests": n_requests, "tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall, "p50_s": percentile(latencies, 50), "p90_s": percentile(latencies, 90),
            "p99_s": percentile(latencies, 99)}


def run(preset: str = "tiny", levels: tuple[int, ...] = (1, 8, 32), max_new_tokens: int = 64,
        rounds: int = 4, threads: Optional[int] = None, model_path: Optional[str] = None,
        server_args: tuple[str, ...] = ()) -> dict:
    """Build the model (unless ``model_path``), start the server, measure every level.

    Each level runs ``rounds * concurrency`` requests (at least 16), so every client
    sends ``rounds`` requests and the batch stays full for most of the run.
    """
    from aflow_rl.models.tiny import build

    with tempfile.TemporaryDirectory(prefix="bench-serving-") as tmp:
        if model_path is None:
            model_path = build(os.path.join(tmp, preset), preset=preset, seed=0)
        from transformers import AutoConfig

        vocab = AutoConfig.from_pretrained(model_path).vocab_size
        proc, url = start_server(model_path, threads, os.path.join(tmp, "server.log"), extra_args=server_args)
        try:
            asyncio.run(run_level(url, 4, 8, 8, vocab, seed=99))          # warm-up: first calls are slower
            results = []
            for c in levels:
                before = httpx.get(url + "/get_server_info").json()["internal_states"][0]
                res = asyncio.run(run_level(url, c, max(16, rounds * c), max_new_tokens, vocab, seed=c))
                after = httpx.get(url + "/get_server_info").json()["internal_states"][0]
                res["decode_steps"] = after["decode_steps"] - before["decode_steps"]
                results.append(res)
            server = httpx.get(url + "/get_server_info").json()
        finally:
            stop_server(proc)
    by_c = {r["concurrency"]: r["tokens_per_s"] for r in results}
    ratio = by_c[max(levels)] / by_c[min(levels)]
    return {"date": time.strftime("%Y-%m-%d"), "machine": machine(), "preset": preset,
            "max_new_tokens": max_new_tokens, "server_threads": server["threads"], "server_args": list(server_args),
            "load_avg": os.getloadavg(), "levels": results,
            f"ratio_{max(levels)}_vs_{min(levels)}": ratio}


def format_table(report: dict) -> str:
    """The result as a Markdown table plus the machine line."""
    m = report["machine"]
    lines = [f"machine: {m['platform']} | {m['cpu']} | {m['cores']} cores | python {m['python']} | "
             f"torch {m['torch']} | server threads {report['server_threads']}",
             f"preset {report['preset']}, max_new_tokens {report['max_new_tokens']} (ignore_eos), {report['date']}",
             "",
             "| concurrent | requests | tokens/s | p50 s | p90 s | p99 s | decode steps |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in report["levels"]:
        lines.append(f"| {r['concurrency']} | {r['requests']} | {r['tokens_per_s']:.0f} | {r['p50_s']:.3f} | "
                     f"{r['p90_s']:.3f} | {r['p99_s']:.3f} | {r['decode_steps']} |")
    key = next(k for k in report if k.startswith("ratio_"))
    hi, lo = key[len("ratio_"):].split("_vs_")
    lines += ["", f"throughput at {hi} concurrent / at {lo}: {report[key]:.1f}x"]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="tiny", choices=["tiny", "small"])
    ap.add_argument("--model-path", default=None, help="serve this HF directory instead of building the preset")
    ap.add_argument("--levels", default="1,8,32", help="comma-separated concurrency levels")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=4, help="requests per client at each level")
    ap.add_argument("--threads", type=int, default=None, help="server torch threads (default: the server's)")
    ap.add_argument("--json", default=None, help="also write the report as JSON here")
    ap.add_argument("--server-args", default="", help="extra server flags, e.g. '--http h11 --loop asyncio'")
    args = ap.parse_args(argv)
    report = run(args.preset, tuple(int(x) for x in args.levels.split(",")), args.max_new_tokens, args.rounds,
                 args.threads, args.model_path, tuple(args.server_args.split()))
    print(format_table(report))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=2)


if __name__ == "__main__":
    main()
