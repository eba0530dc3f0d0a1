"""Swarm environment benchmark: orchestrator policies on seeded tasks, one table of episode metrics.

    python -m aflow_rl.bench.swarm --policy single|heuristic|bandit|model:PATH --suite wide|deep|mixed
                                   --n N --seed S [--json OUT] [--set env.swarm.max_items=8 ...]

``--policy`` and ``--suite`` also take comma-separated lists (one row per
pair). Every row averages N episodes over the same seeded tasks: quality
(success = pass@1, item_f1), latency (critical steps, episode wall clock on
the virtual clock), cost (tokens, estimated USD), stability (failure, retry and
skip rates) and parallel behaviour (avg_parallelism = work / critical steps,
spawned subagents, subtask finish rate). Baselines run episodes one after
another, so the bandit learns in a fixed order and the numbers repeat exactly.
``model:PATH`` starts an embedded server with the model at PATH (through
ServerManager) and runs the model orchestrator, several episodes at once.

The design's bar is checked whenever the wide suite has both single and
heuristic rows: heuristic item_f1 no lower, critical steps at least 30% lower.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import sys
import tempfile
import time
from contextlib import ExitStack
from typing import Any

import numpy as np

from aflow_rl.bench import machine
from aflow_rl.config import load_config
from aflow_rl.envs.swarm.metrics import METRICS
from aflow_rl.envs.swarm.tasks import SUITES, make_tasks
from aflow_rl.rollout.types import REWARD_COMPONENTS, WorkerContext

COLUMNS = [  # (key in the row, header, format)
    ("policy", "policy", "{}"), ("suite", "suite", "{}"), ("n", "n", "{}"),
    ("success", "success", "{:.3f}"), ("item_f1", "item_f1", "{:.3f}"),
    ("critical_steps", "crit_steps", "{:.2f}"), ("wall_clock_ms", "wall_ms", "{:.0f}"),
    ("tokens_in", "tok_in", "{:.0f}"), ("tokens_out", "tok_out", "{:.0f}"),
    ("estimated_cost", "cost_usd", "{:.5f}"), ("failure_rate", "fail_rate", "{:.3f}"),
    ("retry_count", "retries", "{:.2f}"), ("skip_rate", "skip_rate", "{:.3f}"),
    ("avg_parallelism", "parallel", "{:.2f}"), ("spawn_count", "spawns", "{:.2f}"),
    ("subtask_finish_rate", "finish_rate", "{:.3f}"), ("invalid_actions", "invalid", "{:.2f}"),
]
BAR_REDUCTION = 0.30


def _mean_row(trajs: list, policy: str, suite: str, seconds: float) -> dict[str, Any]:
    row: dict[str, Any] = {"policy": policy, "suite": suite, "n": len(trajs)}
    keys = list(METRICS) + ["invalid_actions"]
    for k in keys:
        row[k] = float(np.mean([t.metrics.get(k, 0.0) for t in trajs])) if trajs else 0.0
    for k in REWARD_COMPONENTS:
        row[k] = float(np.mean([t.reward_components.get(k, 0.0) for t in trajs])) if trajs else 0.0
    row["status_ok"] = sum(t.status == "ok" for t in trajs)
    row["episodes_per_s"] = len(trajs) / seconds if seconds > 0 else 0.0
    return row


async def _run_row(tasks: list[dict], ctx: WorkerContext, concurrency: int) -> list:
    from workers.swarm_worker import run_episode

    if concurrency <= 1:
        return [await run_episode(t, ctx) for t in tasks]
    sem = asyncio.Semaphore(concurrency)

    async def one(t: dict):
        async with sem:
            return await run_episode(t, ctx)

    return list(await asyncio.gather(*(one(t) for t in tasks)))


def run_bench(policies: list[str], suites: list[str], n: int, seed: int, overrides: list[str] = (),
              concurrency: int = 4) -> dict[str, Any]:
    """Run every (policy, suite) pair; returns ``{"machine", "date", "args", "rows", "bar"}``."""
    from workers.swarm_worker import init_worker

    rows = []
    with ExitStack() as stack:
        for policy in policies:
            model_path = policy.split(":", 1)[1] if policy.startswith("model:") else ""
            base = list(overrides) + [f"env.swarm.policy={'model' if model_path else policy}"]
            urls: dict[str, list[str]] = {}
            if model_path:
                from aflow_rl.serving.manager import ServerManager

                base += ["serving.policy.backend=embedded", f"serving.policy.model_path={model_path}",
                         "serving.actor.backend=none"]
                scfg = load_config(None, base)
                run_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-swarm-"))
                servers = stack.enter_context(ServerManager(scfg.serving, run_dir, roles=("policy",)))
                urls = servers.all_urls()
            for suite in suites:
                cfg = load_config(None, base + [f"env.swarm.suite={suite}"])
                tasks = make_tasks(cfg, n, seed)
                ctx = WorkerContext(config=cfg, urls=urls)  # fresh policy per row: the bandit starts blank
                init_worker(ctx)
                t0 = time.perf_counter()
                trajs = asyncio.run(_run_row(tasks, ctx, concurrency if model_path else 1))
                rows.append(_mean_row(trajs, "model" if model_path else policy, suite, time.perf_counter() - t0))
                for client in ("policy_client", "actor_client"):
                    if client in ctx.state:
                        asyncio.run(ctx.state[client].aclose())
    return {"machine": machine(), "date": datetime.date.today().isoformat(),
            "args": {"policies": policies, "suites": suites, "n": n, "seed": seed, "overrides": list(overrides)},
            "rows": rows, "bar": bar_check(rows)}


def bar_check(rows: list[dict]) -> dict[str, Any] | None:
    """The design's bar on wide: heuristic item_f1 >= single's, critical steps >= 30% lower."""
    by = {(r["policy"], r["suite"]): r for r in rows}
    single, heur = by.get(("single", "wide")), by.get(("heuristic", "wide"))
    if not single or not heur:
        return None
    reduction = 1.0 - heur["critical_steps"] / single["critical_steps"] if single["critical_steps"] else 0.0
    return {"item_f1_single": single["item_f1"], "item_f1_heuristic": heur["item_f1"],
            "critical_steps_single": single["critical_steps"], "critical_steps_heuristic": heur["critical_steps"],
            "critical_steps_reduction": reduction,
            "passed": heur["item_f1"] >= single["item_f1"] and reduction >= BAR_REDUCTION}


def format_table(rows: list[dict]) -> str:
    """One fixed-width table, a row per (policy, suite)."""
    cells = [[h for _, h, _ in COLUMNS]] + [[fmt.format(r[k]) for k, _, fmt in COLUMNS] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m aflow_rl.bench.swarm", description=__doc__.split("\n\n")[0])
    ap.add_argument("--policy", default="single,heuristic,bandit",
                    help="single | heuristic | bandit | model:PATH (comma-separated for several)")
    ap.add_argument("--suite", default="wide", help="wide | deep | mixed (comma-separated for several)")
    ap.add_argument("--n", type=int, default=50, help="episodes (tasks) per row")
    ap.add_argument("--seed", type=int, default=0, help="task seed")
    ap.add_argument("--json", default="", help="also write the numbers to this JSON file")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides, e.g. env.swarm.max_items=8")
    ap.add_argument("--concurrency", type=int, default=4, help="model policy: episodes at once")
    args = ap.parse_args(argv)
    policies = [p.strip() for p in args.policy.split(",") if p.strip()]
    suites = [s.strip() for s in args.suite.split(",") if s.strip()]
    for p in policies:
        if p not in ("single", "heuristic", "bandit") and not (p.startswith("model:") and len(p) > 6):
            ap.error(f"--policy: {p!r} is not single, heuristic, bandit or model:PATH")
    for s in suites:
        if s not in SUITES:
            ap.error(f"--suite: {s!r} is not one of {', '.join(SUITES)}")
    result = run_bench(policies, suites, args.n, args.seed, args.set, args.concurrency)
    m = result["machine"]
    print(f"swarm benchmark  {result['date']}  {m['platform']}  {m['cpu']}  {m['cores']} cores  "
          f"n={args.n} seed={args.seed}")
    print(format_table(result["rows"]))
    bar = result["bar"]
    if bar is not None:
        print(f"bar (wide): item_f1 heuristic {bar['item_f1_heuristic']:.3f} vs single {bar['item_f1_single']:.3f}; "
              f"critical steps {bar['critical_steps_reduction']:.1%} lower "
              f"(need >= {BAR_REDUCTION:.0%}): {'PASS' if bar['passed'] else 'FAIL'}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
