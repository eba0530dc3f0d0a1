"""Swarm environment benchmark: orchestrator policies on seeded tasks, one table of episode metrics.

    python -m aflow_rl.bench.swarm --policy single|heuristic|bandit|adaptive|model:PATH --suite wide|deep|mixed
                                   --n N --seed S [--json OUT] [--set env.swarm.max_items=8 ...]
                                   [--config configs/learning.yaml] [--pressure env.swarm.max_tokens=20000,5000,2500]

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

``--config`` takes the environment from a recipe (its ``env.swarm`` budgets,
item ranges, latency coefficient; a training mixture and curriculum are dropped:
every row is one suite). Every row also reports the task objective
``item_f1 - c * critical_steps`` with ``c = env.swarm.latency_coef`` (the
``--objective-coef`` flag overrides it for reporting only).

``--pressure KEY=V1,V2,...`` is the context-pressure experiment: the whole
table again for each value of one budget (``env.swarm.max_tokens`` by
default: the tokens orchestrator and subagents may spend per episode; also
``env.swarm.max_tool_calls``, ``env.swarm.max_steps``, ``env.max_new_tokens``),
one row per (value, policy, suite), quality and critical steps per budget.
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
from aflow_rl.envs.swarm.metrics import METRICS, task_objective
from aflow_rl.envs.swarm.policies import POLICIES
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
    ("objective", "objective", "{:.4f}"),
]
# A recipe's training distribution is not an evaluation row: each row is one suite, full item range.
EVAL_RESET = ["env.swarm.mix=[]", "env.swarm.curriculum=[]", "env.swarm.items_ramp_steps=0"]
BAR_REDUCTION = 0.30


def _mean_row(trajs: list, policy: str, suite: str, seconds: float, coef: float = 0.0) -> dict[str, Any]:
    row: dict[str, Any] = {"policy": policy, "suite": suite, "n": len(trajs)}
    keys = list(METRICS) + ["invalid_actions"]
    for k in keys:
        row[k] = float(np.mean([t.metrics.get(k, 0.0) for t in trajs])) if trajs else 0.0
    objective = [task_objective(t.metrics.get("item_f1", 0.0), t.metrics.get("critical_steps", 0.0), coef)
                 for t in trajs]
    row["objective"] = float(np.mean(objective)) if trajs else 0.0
    row["objective_coef"] = coef
    for k in REWARD_COMPONENTS:
        row[k] = float(np.mean([t.reward_components.get(k, 0.0) for t in trajs])) if trajs else 0.0
    row["status_ok"] = sum(t.status == "ok" for t in trajs)
    row["episodes_per_s"] = len(trajs) / seconds if seconds > 0 else 0.0
    return row


async def _run_row(tasks: list[dict], ctx: WorkerContext, concurrency: int) -> list:
    from workers.swarm import run_episode

    if concurrency <= 1:
        return [await run_episode(t, ctx) for t in tasks]
    sem = asyncio.Semaphore(concurrency)

    async def one(t: dict):
        async with sem:
            return await run_episode(t, ctx)

    return list(await asyncio.gather(*(one(t) for t in tasks)))


def run_bench(policies: list[str], suites: list[str], n: int, seed: int, overrides: list[str] = (),
              concurrency: int = 4, config: str | None = None, objective_coef: float | None = None,
              task_filter: Any = None) -> dict[str, Any]:
    """Run every (policy, suite) pair; returns ``{"machine", "date", "args", "rows", "bar"}``.

    ``config``: a recipe YAML whose environment the rows use (``overrides`` apply on top);
    ``objective_coef``: c of the reported objective (default: the config's ``env.swarm.latency_coef``);
    ``task_filter``: keep only the tasks it accepts (the seed's first n that pass; held-out evaluation).
    """
    from workers.swarm import init_worker

    rows = []
    with ExitStack() as stack:
        for policy in policies:
            model_path = policy.split(":", 1)[1] if policy.startswith("model:") else ""
            base = list(overrides) + (EVAL_RESET if config else []) + [
                f"env.swarm.policy={'model' if model_path else policy}"]
            urls: dict[str, list[str]] = {}
            if model_path:
                from aflow_rl.serving.manager import ServerManager

                base += ["serving.policy.backend=embedded", f"serving.policy.model_path={model_path}",
                         "serving.policy.build_tiny=", "serving.actor.backend=none"]
                scfg = load_config(config, base)
                run_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-swarm-"))
                servers = stack.enter_context(ServerManager(scfg.serving, run_dir, roles=("policy",)))
                urls = servers.all_urls()
            for suite in suites:
                cfg = load_config(config, base + [f"env.swarm.suite={suite}"])
                coef = cfg.env.swarm.latency_coef if objective_coef is None else objective_coef
                tasks = _draw(cfg, n, seed, task_filter)
                ctx = WorkerContext(config=cfg, urls=urls)  # fresh policy per row: the bandit starts blank
                init_worker(ctx)
                t0 = time.perf_counter()
                trajs = asyncio.run(_run_row(tasks, ctx, concurrency if model_path else 1))
                rows.append(_mean_row(trajs, "model" if model_path else policy, suite, time.perf_counter() - t0, coef))
                for client in ("policy_client", "actor_client"):
                    if client in ctx.state:
                        asyncio.run(ctx.state[client].aclose())
    return {"machine": machine(), "date": datetime.date.today().isoformat(),
            "args": {"policies": policies, "suites": suites, "n": n, "seed": seed, "overrides": list(overrides),
                     "config": config},
            "rows": rows, "bar": bar_check(rows)}


def _draw(cfg: Any, n: int, seed: int, task_filter: Any) -> list[dict]:
    """The seed's first ``n`` tasks that ``task_filter`` accepts (task i depends only on seed and i)."""
    if task_filter is None:
        return make_tasks(cfg, n, seed)
    tasks = [t for t in make_tasks(cfg, 4 * n + 16, seed) if task_filter(t)][:n]
    if len(tasks) < n:
        raise RuntimeError(f"only {len(tasks)} of {4 * n + 16} tasks of seed {seed} pass the filter; need {n}")
    return tasks


def parse_pressure(spec: str) -> tuple[str, list[Any]]:
    """``KEY=V1,V2,...`` -> (key, [values]) with YAML-typed values; a bare list means env.swarm.max_tokens."""
    import yaml

    key, _, raw = spec.rpartition("=") if "=" in spec else ("env.swarm.max_tokens", "=", spec)
    values = [yaml.safe_load(v) for v in raw.split(",") if v.strip()]
    if not key or not values:
        raise ValueError(f"--pressure: expected KEY=V1,V2,... (e.g. env.swarm.max_tokens=20000,5000), got {spec!r}")
    load_config(None, [f"{key}={values[0]}"])  # an unknown key fails here, with the config's message
    return key, values


def pressure_sweep(policies: list[str], suites: list[str], n: int, seed: int, key: str, values: list[Any],
                   overrides: list[str] = (), config: str | None = None, concurrency: int = 4,
                   objective_coef: float | None = None) -> list[dict]:
    """The context-pressure experiment: ``run_bench`` once per budget value; rows carry ``budget``."""
    rows = []
    for value in values:
        out = run_bench(policies, suites, n, seed, list(overrides) + [f"{key}={value}"], concurrency, config,
                        objective_coef)
        rows += [{**r, "budget_key": key, "budget": value} for r in out["rows"]]
    return rows


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
    ap.add_argument("--config", default=None, help="recipe YAML whose environment the rows use (e.g. configs/learning.yaml)")
    ap.add_argument("--objective-coef", type=float, default=None,
                    help="c of the reported objective item_f1 - c * critical_steps (default: env.swarm.latency_coef)")
    ap.add_argument("--pressure", default="", metavar="KEY=V1,V2",
                    help="context pressure: repeat the table for each value of one budget, e.g. env.swarm.max_tokens=20000,5000,2500")
    args = ap.parse_args(argv)
    policies = [p.strip() for p in args.policy.split(",") if p.strip()]
    suites = [s.strip() for s in args.suite.split(",") if s.strip()]
    for p in policies:
        rules = [q for q in POLICIES if q != "model"]
        if p not in rules and not (p.startswith("model:") and len(p) > 6):
            ap.error(f"--policy: {p!r} is not {', '.join(rules)} or model:PATH")
    for s in suites:
        if s not in SUITES:
            ap.error(f"--suite: {s!r} is not one of {', '.join(SUITES)}")
    if args.pressure:
        try:
            key, values = parse_pressure(args.pressure)
        except Exception as exc:  # noqa: BLE001 - a bad key or value is the user's to fix
            ap.error(str(exc).splitlines()[0])
        rows = pressure_sweep(policies, suites, args.n, args.seed, key, values, args.set, args.config,
                              args.concurrency, args.objective_coef)
        print(format_pressure(rows))
        if args.json:
            _write_json(args.json, {"machine": machine(), "date": datetime.date.today().isoformat(),
                                    "args": vars(args), "pressure": rows})
        return 0
    result = run_bench(policies, suites, args.n, args.seed, args.set, args.concurrency, args.config,
                       args.objective_coef)
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
        _write_json(args.json, result)
    return 0


def format_pressure(rows: list[dict]) -> str:
    """One line per (budget, policy, suite): quality, latency, objective, tokens and how episodes ended."""
    head = f"{'budget':>22}  {'policy':>10}  {'suite':>6}  {'item_f1':>7}  {'success':>7}  {'crit':>6}  " \
           f"{'objective':>9}  {'tokens':>7}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['budget_key'].split('.')[-1] + '=' + str(r['budget']):>22}  {r['policy']:>10}  "
                     f"{r['suite']:>6}  {r['item_f1']:7.3f}  {r['success']:7.3f}  {r['critical_steps']:6.2f}  "
                     f"{r['objective']:9.4f}  {r['tokens_in'] + r['tokens_out']:7.0f}")
    return "\n".join(lines)


def _write_json(path: str, data: Any) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as fh:
        json.dump(data, fh, indent=2, default=str)


if __name__ == "__main__":
    sys.exit(main())
