"""The embedded server's prefix cache on the quickstart's real prompt mix, cache on vs off.

    python -m aflow_rl.bench.prefix_cache [--rounds 4] [--baseline DIR] [--json OUT]

Builds the quickstart's tiny model, starts two embedded servers on it -- one with the
prefix cache, one with ``--disable-radix-cache`` -- and runs rollout steps of the
quickstart recipe (``configs/quickstart.yaml``: ``tasks_per_step`` tasks x ``group_size``
real swarm episodes with the model orchestrator, its grammar and prompts, up to
``rollout.concurrency_per_worker x rollout.workers`` episodes in flight) against each,
interleaved (on, off, off, on, ...) so that both see the same machine load. Each round
draws new tasks and first flushes both caches, as the trainer's weight update after every
step does. Reports per server: generated tokens/s, prompt tokens/s (prefilled or reused),
the cache hit rate (prompt tokens served from the cache / prompt tokens) and prefill
forwards. The servers sample, so the two do not generate the same tokens; the rates are
per token.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from typing import Optional

import httpx

from aflow_rl.bench import machine

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
QUICKSTART = os.path.join(ROOT, "configs", "quickstart.yaml")


def _state(url: str) -> dict:
    return httpx.get(url + "/get_server_info", timeout=30).json()["internal_states"][0]


async def _episodes(cfg, url: str, episodes: list[dict], concurrency: int) -> None:
    from aflow_rl.rollout.types import WorkerContext
    from workers.swarm import init_worker, run_episode

    ctx = WorkerContext(config=cfg, urls={"policy": [url]})
    init_worker(ctx)
    sem = asyncio.Semaphore(concurrency)

    async def one(task: dict):
        async with sem:
            return await run_episode(task, ctx)

    try:
        trajs = await asyncio.gather(*(one(t) for t in episodes))
    finally:
        await ctx.state["policy_client"].aclose()
    bad = [t.status for t in trajs if t.status != "ok"]
    if bad:
        raise RuntimeError(f"{len(bad)} of {len(trajs)} episodes failed ({bad[:3]}); the measurement would be wrong")


def _round(cfg, url: str, episodes: list[dict], concurrency: int) -> dict:
    """One rollout step against ``url``: counters before/after and the wall time."""
    httpx.post(url + "/flush_cache", timeout=30)            # the trainer's weight update empties it
    before = _state(url)
    t0 = time.perf_counter()
    asyncio.run(_episodes(cfg, url, episodes, concurrency))
    wall = time.perf_counter() - t0
    after = _state(url)
    # .get: a --baseline server from an older checkout may lack the newer counters
    d = {k: after.get(k, 0) - before.get(k, 0) for k in ("generated_tokens", "prompt_tokens", "cached_tokens",
                                                         "prefill_forwards", "requests", "prefill_cpu_s",
                                                         "decode_cpu_s")}
    return {**d, "wall_s": wall}


def _summary(rounds: list[dict]) -> dict:
    tot = {k: sum(r[k] for r in rounds) for k in rounds[0]}
    per = [r["generated_tokens"] / r["wall_s"] for r in rounds]
    return {**tot, "rounds": len(rounds), "tokens_per_s": tot["generated_tokens"] / tot["wall_s"],
            "median_round_tokens_per_s": statistics.median(per),
            "prompt_tokens_per_s": tot["prompt_tokens"] / tot["wall_s"],
            "hit_rate": tot["cached_tokens"] / max(1, tot["prompt_tokens"]),
            # None for a --baseline server without the CPU counters
            "tokens_per_engine_cpu_s": (tot["generated_tokens"] / (tot["prefill_cpu_s"] + tot["decode_cpu_s"])
                                        if tot["prefill_cpu_s"] + tot["decode_cpu_s"] > 0 else None),
            "per_round_tokens_per_s": per}


def _start(model: str, tmp: str, threads: Optional[int], prefill_chunk: int, baseline: Optional[str]) -> dict:
    from aflow_rl.bench.serving import start_server

    chunk = ["--prefill-chunk", str(prefill_chunk)]
    servers = {}
    for name, extra in (("on", chunk), ("off", chunk + ["--disable-radix-cache"])):
        servers[name] = start_server(model, threads, os.path.join(tmp, f"{name}.log"), extra_args=extra)
    if baseline:   # the same server from another checkout (e.g. the commit before the cache)
        old = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = baseline
        try:
            # cwd too: `python -m` puts the working directory ahead of PYTHONPATH
            servers["baseline"] = start_server(model, threads, os.path.join(tmp, "baseline.log"), cwd=baseline)
        finally:
            if old is None:
                os.environ.pop("PYTHONPATH")
            else:
                os.environ["PYTHONPATH"] = old
    return servers


def run(rounds: int = 4, seed: int = 0, threads: Optional[int] = 1, prefill_chunk: int = 32,
        baseline: Optional[str] = None) -> dict:
    """Both servers (and ``baseline``'s), ``rounds`` rollout steps each, interleaved; returns the report."""
    from aflow_rl.bench.serving import stop_server
    from aflow_rl.config import load_config
    from aflow_rl.models.tiny import build
    from aflow_rl.rollout.pool import make_episodes
    from workers.swarm import make_tasks

    with tempfile.TemporaryDirectory(prefix="bench-prefix-") as tmp:
        model = build(os.path.join(tmp, "tiny"), preset="tiny", seed=0)
        cfg = load_config(QUICKSTART, [f"serving.policy.model_path={model}", "serving.policy.build_tiny="])
        concurrency = cfg.rollout.concurrency_per_worker * cfg.rollout.workers
        servers = {}
        try:
            servers = _start(model, tmp, threads, prefill_chunk, baseline)
            names = list(servers)
            results: dict[str, list[dict]] = {name: [] for name in names}
            for r in range(rounds):
                tasks = make_tasks(cfg, cfg.rollout.tasks_per_step, seed + r)
                episodes = make_episodes(tasks, cfg.rollout.group_size, prefix=f"s{r}-")
                for name in (names if r % 2 == 0 else names[::-1]):
                    results[name].append(_round(cfg, servers[name][1], episodes, concurrency))
        finally:
            for proc, _ in servers.values():
                stop_server(proc)
    summary = {name: _summary(rows) for name, rows in results.items()}
    on, off = summary["on"], summary["off"]
    return {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine(),
            "load_avg_1m_end": os.getloadavg()[0], "rounds": rounds, "prefill_chunk": prefill_chunk,
            "server_threads": threads,
            "episodes_per_round": cfg.rollout.tasks_per_step * cfg.rollout.group_size, "concurrency": concurrency,
            **summary, "speedup": on["tokens_per_s"] / off["tokens_per_s"]}


def format_table(rep: dict) -> str:
    m = rep["machine"]
    lines = [f"machine: {m['platform']} | {m['cpu']} | {m['cores']} cores | torch {m['torch']} | {rep['date']} | "
             f"load avg (1 min, at the end) {rep['load_avg_1m_end']:.1f}",
             f"quickstart mix: {rep['rounds']} rounds x {rep['episodes_per_round']} episodes, "
             f"{rep['concurrency']} in flight, prefill chunk {rep['prefill_chunk']}, server threads {rep['server_threads']}", "",
             "| prefix cache | requests | prompt tokens | hit rate | prefill forwards | prefill CPU s | "
             "decode CPU s | tokens / engine CPU s | generated tokens/s | median of rounds | per round tokens/s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for name in [k for k in ("on", "off", "baseline") if k in rep]:
        s = rep[name]
        per = ", ".join(f"{x:.0f}" for x in s["per_round_tokens_per_s"])
        cpu = s["tokens_per_engine_cpu_s"]
        if cpu is None:    # an older server: only what the client sees
            lines.append(f"| {name} | {s['requests']} | – | – | – | – | – | – | {s['tokens_per_s']:.0f} | "
                         f"{s['median_round_tokens_per_s']:.0f} | {per} |")
            continue
        lines.append(f"| {name} | {s['requests']} | {s['prompt_tokens']} | {s['hit_rate']:.1%} | "
                     f"{s['prefill_forwards']} | {s['prefill_cpu_s']:.2f} | {s['decode_cpu_s']:.2f} | "
                     f"{cpu:.0f} | {s['tokens_per_s']:.0f} | "
                     f"{s['median_round_tokens_per_s']:.0f} | {per} |")
    med = rep["on"]["median_round_tokens_per_s"] / rep["off"]["median_round_tokens_per_s"]
    cpu = rep["on"]["tokens_per_engine_cpu_s"] / rep["off"]["tokens_per_engine_cpu_s"]
    pre = rep["off"]["prefill_cpu_s"] / max(1e-9, rep["on"]["prefill_cpu_s"])
    lines += ["", f"generated tokens/s, cache on / off: {rep['speedup']:.2f}x overall, {med:.2f}x median of rounds; "
                  f"per engine CPU second: {cpu:.2f}x; prefill CPU off / on: {pre:.2f}x"]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=4, help="rollout steps per server (interleaved)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1,
                    help="server torch threads (1: the engine thread's CPU time is all of the model's work)")
    ap.add_argument("--prefill-chunk", type=int, default=32)
    ap.add_argument("--baseline", default=None, metavar="DIR",
                    help="also a server run from the checkout DIR (its PYTHONPATH), e.g. the commit before the cache")
    ap.add_argument("--json", default=None, help="also write the report as JSON here")
    args = ap.parse_args(argv)
    report = run(args.rounds, args.seed, args.threads, args.prefill_chunk, args.baseline)
    print(format_table(report))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=2)


if __name__ == "__main__":
    main()
