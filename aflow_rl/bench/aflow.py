"""AFlow environment throughput: workflow evaluations through the rollout pool, and the sandbox.

    python -m aflow_rl.bench.aflow [--problems 32] [--workers 1 2] [--workflow review_revise|ensemble]
                                   [--max-tokens 32] [--inflight 8] [--chunk 4] [--repeats 3]
                                   [--sandbox-calls 24] [--sandbox-mode auto|jail|basic|jail,basic]
                                   [--model-path DIR] [--json OUT]

(a) **Workflow evaluation.** An embedded actor server (the tiny random model,
built into a temporary directory unless ``--model-path`` holds one) serves as
the executor. The same ``--problems`` problems (``rg:basic_arithmetic``,
seeded) are evaluated with a three-operator workflow through a loky
``RolloutPool`` at each ``--workers`` count: every episode is one
``workers.aflow.evaluate_task`` call on a chunk of ``--chunk`` problems,
the path an AFlow search takes. The total number of problems in flight is
held at ``--inflight`` for every worker count (episodes per worker =
inflight / (chunk x workers)), so the 2-vs-1 ratio shows what a second
process adds, not what a bigger batch on the server adds. Every pool is
started (its start-up reported, not timed) and warmed (one single-problem
episode per worker: connections, the scorer's imports) first; then
``--repeats`` rounds time every worker count in turn, so a change in the
machine's load falls on all of them alike, and a row is the median round.
Each row also gives the CPU the server and the worker processes used per
wall second (1.0 = one core busy), which says which of them sets the rate.

(b) **Sandbox.** ``aflow_rl.sandbox.run_python`` on a small program, one call
after another and from 2 threads (rounds interleaved the same way):
executions per second, per-call latency p50/p90 and CPU per run. Where the
machine gives the sandbox its ``jail`` (namespaces, chroot), ``basic`` runs
beside it, so the table shows what the jail costs.

The random model's text is nonsense, so scores are ~0 and Review's verdict
is unreadable (read as pass): AnswerGenerate -> Review -> Revise makes two
executor calls per problem; the calls column says what was actually made.
"""
from __future__ import annotations

import argparse
import datetime
import math
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import asdict
from typing import Any

from aflow_rl.bench import machine, write_json
from aflow_rl.rollout.types import Trajectory, WorkerContext

DATASET = "rg:basic_arithmetic"
# Three operators each. review_revise: AFlow's generate-critique-revise loop (Revise runs only when the
# review fails). ensemble: three sampled answers, a self-consistency pick, then answer extraction.
WORKFLOWS: dict[str, dict] = {
    "review_revise": {"name": "review_revise", "output": "revise", "nodes": [
        {"id": "answer", "op": "AnswerGenerate", "inputs": [], "params": {}},
        {"id": "review", "op": "Review", "inputs": ["answer"], "params": {}},
        {"id": "revise", "op": "Revise", "inputs": ["answer", "review"], "params": {"max_rounds": 1}}]},
    "ensemble": {"name": "ensemble", "output": "final", "nodes": [
        {"id": "draft", "op": "Custom", "inputs": [], "params": {
            "instruction": "Solve the problem. End with the final answer.", "samples": 3}},
        {"id": "pick", "op": "ScEnsemble", "inputs": ["draft"], "params": {}},
        {"id": "final", "op": "Format", "inputs": ["pick"], "params": {}}]},
}
SANDBOX_ENV = "AFLOW_SANDBOX"  # aflow_rl.sandbox's switch: basic | jail (unset: probe)
# A small program with a little work and output: what Programmer/Test runs look like, minus the model.
SANDBOX_CODE = "import math\nprint(sum(math.isqrt(i) for i in range(20000)))\n"

EVAL_COLUMNS = [  # (key, header, format)
    ("workers", "workers", "{}"), ("problems", "problems", "{}"), ("episodes", "episodes", "{}"),
    ("inflight", "in flight", "{}"), ("wall_s", "wall s", "{:.2f}"), ("problems_per_s", "problems/s", "{:.2f}"),
    ("calls_per_problem", "calls/problem", "{:.2f}"), ("tokens_out_per_problem", "tok out/problem", "{:.1f}"),
    ("problem_p50_s", "problem p50 s", "{:.2f}"), ("problem_p90_s", "problem p90 s", "{:.2f}"),
    ("server_cores", "server cores", "{:.2f}"), ("worker_cores", "worker cores", "{:.2f}"),
    ("score", "score", "{:.3f}"), ("errors", "errors", "{}"), ("startup_s", "pool start s", "{:.2f}"),
]
SANDBOX_COLUMNS = [
    ("mode", "mode", "{}"), ("threads", "threads", "{}"), ("calls", "calls", "{}"), ("wall_s", "wall s", "{:.2f}"),
    ("runs_per_s", "runs/s", "{:.2f}"), ("p50_s", "p50 s", "{:.3f}"), ("p90_s", "p90 s", "{:.3f}"),
    ("cpu_per_run_s", "cpu/run s", "{:.3f}"), ("cores", "cores", "{:.2f}"),
    ("failed", "failed", "{}"),
]


# -- the episode (runs in the pool's worker processes) -------------------------------------------------


def init_worker(ctx: WorkerContext) -> None:
    """Per-process setup: the AFlow worker's executor client."""
    from workers.aflow import init_worker as aflow_init

    aflow_init(ctx)


async def run_episode(task: dict, ctx: WorkerContext) -> Trajectory:
    """Evaluate ``task["workflow"]`` on ``task["problems"]`` with the AFlow worker; sums as metrics."""
    from workers.aflow import evaluate_task

    reply = await evaluate_task({"workflow": task["workflow"], "problems": task["problems"]}, ctx)
    if not reply["valid"]:
        raise ValueError(f"benchmark workflow rejected: {reply['error']}")
    per = reply["per_problem"]
    metrics = {"problems": float(len(per)), "calls": float(sum(r["calls"] for r in per)),
               "tokens_in": float(sum(r["tokens_in"] for r in per)),
               "tokens_out": float(sum(r["tokens_out"] for r in per)),
               "score_sum": float(sum(r["score"] for r in per)), "errors": float(sum(bool(r["error"]) for r in per))}
    return Trajectory(episode_id=task["episode_id"], group_id=task["group_id"], final_reward=reply["score"],
                      metrics=metrics, info={"problem_seconds": [r["seconds"] for r in per],
                                             "first_error": next((r["error"] for r in per if r["error"]), "")})


# -- problems -----------------------------------------------------------------------------------------


def load_problems(n: int, seed: int = 0, spec: str = DATASET) -> list[dict]:
    """``n`` problem dicts (id, kind, question, answer, metadata) from the AFlow datasets module."""
    from aflow_rl.envs.aflow.datasets import load_dataset

    return [asdict(p) for p in load_dataset(spec, num_problems=n, seed=seed)]


def _percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 1]) of a non-empty list."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


# -- (a) workflow evaluation through the pool ---------------------------------------------------------


def _pool_config(workers: int, inflight: int, chunk: int) -> Any:
    """Loky pool of ``workers`` processes running ``inflight / chunk`` episodes at once in all."""
    from aflow_rl.config import RolloutConfig

    per_worker = max(1, math.ceil(inflight / (chunk * workers)))
    return RolloutConfig(backend="loky", workers=workers,
                         concurrency_per_worker=per_worker, episode_timeout_s=600.0, max_attempts=1,
                         start_timeout_s=120.0, trace=False)


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds so far of ``pids`` and their (live and reaped) descendants."""
    import psutil

    total = 0.0
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            procs = [proc] + proc.children(recursive=True)
        except psutil.NoSuchProcess:
            continue
        for p in procs:
            try:
                t = p.cpu_times()
            except psutil.NoSuchProcess:
                continue
            total += t.user + t.system + t.children_user + t.children_system
    return total


def _timed_run(pool: Any, tasks: list[dict], server_pids: list[int]) -> dict:
    """One round: wall time, the trajectories, and the CPU the server and the workers spent meanwhile."""
    worker_pids = [slot.pid for slot in pool.slots if slot.pid]
    server0, workers0 = cpu_seconds(server_pids), cpu_seconds(worker_pids)
    t0 = time.perf_counter()
    out = list(pool.run([dict(t) for t in tasks]))
    wall = time.perf_counter() - t0
    bad = [t.error for t in out if not t.ok]
    if bad:
        raise RuntimeError(f"{len(bad)} benchmark episodes failed; first: {bad[0][-800:]}")
    return {"wall": wall, "trajs": out, "server_cpu": cpu_seconds(server_pids) - server0,
            "workers_cpu": cpu_seconds(worker_pids) - workers0}


def bench_eval(cfg: Any, urls: dict, run_dir: str, problems: list[dict], workflow: dict,
               workers: tuple[int, ...], inflight: int, chunk: int, repeats: int,
               server_pids: list[int] = ()) -> list[dict]:
    """Problems/s of ``workflow`` on ``problems`` through a loky RolloutPool at each worker count.

    One pool per worker count, all started first (start-up reported, not timed) and warmed
    (one single-problem episode per worker: connections, the scorer's imports). Then
    ``repeats`` rounds, each timing every pool in turn on the same problems, so a change in
    the machine's load falls on every worker count alike. A row is the median round; its
    ``server_cores`` / ``worker_cores`` are CPU seconds per wall second over all rounds (what
    bounds the rate: one core is 1.0)."""
    from aflow_rl.rollout.pool import RolloutPool

    ctx = WorkerContext(config=cfg, urls=urls, run_dir=run_dir)
    tasks = [{"workflow": workflow, "problems": problems[i:i + chunk]} for i in range(0, len(problems), chunk)]
    runs: dict[int, list[dict]] = {w: [] for w in workers}
    server_pids = list(server_pids)
    with ExitStack() as stack:
        pools = {w: stack.enter_context(RolloutPool(_pool_config(w, inflight, chunk), ctx, env="aflow_rl.bench.aflow")) for w in workers}
        for w, pool in pools.items():
            _timed_run(pool, [{"workflow": workflow, "problems": [problems[i % len(problems)]]} for i in range(w)],
                       server_pids)
        for _ in range(repeats):
            for w, pool in pools.items():
                runs[w].append(_timed_run(pool, tasks, server_pids))
        startup = {w: pool.startup_s for w, pool in pools.items()}
    rows = []
    for w in workers:
        n = len(problems)
        walls = [r["wall"] for r in runs[w]]
        rates = [n / wall for wall in walls]
        out = [t for r in runs[w] for t in r["trajs"]]  # every repeat: the per-problem means and latencies
        total = lambda key: sum(t.metrics[key] for t in out)  # noqa: E731
        done = total("problems")
        seconds = [s for t in out for s in t.info["problem_seconds"]]
        per_worker = _pool_config(w, inflight, chunk).concurrency_per_worker
        rows.append({"workers": w, "problems": n, "episodes": len(tasks), "inflight": per_worker * w * chunk,
                     "episodes_per_worker": per_worker, "repeats": repeats,
                     "problems_per_s": statistics.median(rates), "problems_per_s_runs": rates,
                     "wall_s": statistics.median(walls),
                     "server_cores": sum(r["server_cpu"] for r in runs[w]) / sum(walls),
                     "worker_cores": sum(r["workers_cpu"] for r in runs[w]) / sum(walls),
                     "calls_per_problem": total("calls") / done, "tokens_in_per_problem": total("tokens_in") / done,
                     "tokens_out_per_problem": total("tokens_out") / done,
                     "problem_p50_s": _percentile(seconds, 0.5), "problem_p90_s": _percentile(seconds, 0.9),
                     "score": total("score_sum") / done, "errors": int(total("errors")),
                     "first_error": next((t.info["first_error"] for t in out if t.info["first_error"]), ""),
                     "startup_s": startup[w]})
    return rows


# -- (b) the sandbox ----------------------------------------------------------------------------------


def _children_cpu() -> float:
    """CPU seconds of this process's reaped children (every sandbox run is one, with its descendants)."""
    import resource

    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def bench_sandbox(calls: int, threads: tuple[int, ...], repeats: int, modes: tuple[str, ...] = ("",),
                  code: str = SANDBOX_CODE) -> list[dict]:
    """Executions/s of ``run_python(code)``: ``calls`` per round from each thread count in turn, ``repeats``
    rounds (interleaved, as in ``bench_eval``); a row's rate is the median round, its latencies all calls.

    ``modes`` are isolation modes to compare (``jail``, ``basic``; ``""``: the machine's own), forced
    through the sandbox's ``AFLOW_SANDBOX`` switch for their rounds. ``cpu_per_run_s`` is the CPU the
    sandbox processes used per run, ``cores`` their CPU seconds per wall second."""
    from aflow_rl.sandbox import isolation, run_python

    def one(_: int) -> tuple[float, bool]:
        t = time.perf_counter()
        r = run_python(code, timeout_s=10)
        return time.perf_counter() - t, r.ok and r.stdout.strip() != ""

    saved = os.environ.get(SANDBOX_ENV)
    runs: dict[tuple[str, int], list[tuple[float, list, float]]] = {(m, t): [] for m in modes for t in threads}
    names: dict[str, str] = {}
    try:
        for m in modes:
            _force_mode(m, saved)
            names[m] = isolation()
            one(0)  # warm-up: the first call probes the isolation mode
        for _ in range(repeats):
            for m in modes:
                _force_mode(m, saved)
                for t in threads:
                    cpu0, t0 = _children_cpu(), time.perf_counter()
                    if t <= 1:
                        results = [one(i) for i in range(calls)]
                    else:
                        with ThreadPoolExecutor(t) as ex:
                            results = list(ex.map(one, range(calls)))
                    runs[m, t].append((time.perf_counter() - t0, results, _children_cpu() - cpu0))
    finally:
        _force_mode("", saved)
    rows = []
    for (m, t), rounds in runs.items():
        walls = [wall for wall, _, _ in rounds]
        rates = [calls / wall for wall in walls]
        lat = [s for _, results, _ in rounds for s, _ in results]
        cpu = sum(c for _, _, c in rounds)
        rows.append({"mode": names[m], "threads": t, "calls": calls, "repeats": repeats,
                     "wall_s": statistics.median(walls), "runs_per_s": statistics.median(rates),
                     "runs_per_s_runs": rates, "p50_s": _percentile(lat, 0.5), "p90_s": _percentile(lat, 0.9),
                     "cpu_per_run_s": cpu / (calls * repeats), "cores": cpu / sum(walls),
                     "failed": sum(not ok for _, results, _ in rounds for _, ok in results)})
    return rows


def _force_mode(mode: str, saved: str | None) -> None:
    """Set the sandbox's isolation switch to ``mode``; ``""`` restores the caller's setting."""
    value = mode or saved
    if value:
        os.environ[SANDBOX_ENV] = value
    else:
        os.environ.pop(SANDBOX_ENV, None)
    if mode == "basic":  # the benchmark's own code, measured under basic isolation on purpose
        os.environ["AFLOW_SANDBOX_ALLOW_UNISOLATED"] = "1"


# -- the whole benchmark ------------------------------------------------------------------------------


def _ratios(rows: list[dict], key: str, field: str, a: int, b: int) -> tuple[float | None, list[float]]:
    """Rate at ``key`` = b over rate at a: of the medians, and round by round (rounds are interleaved)."""
    by = {r[key]: r for r in rows}
    if a not in by or b not in by or by[a][field] <= 0:
        return None, []
    paired = [y / x for x, y in zip(by[a][field + "_runs"], by[b][field + "_runs"]) if x > 0]
    return by[b][field] / by[a][field], paired


def sandbox_modes(choice: str) -> tuple[str, ...]:
    """``auto``: the machine's own mode, plus ``basic`` beside it when that is ``jail`` (what the jail
    costs); otherwise the comma-separated modes named."""
    from aflow_rl.sandbox import isolation

    if choice == "auto":
        return ("jail", "basic") if isolation() == "jail" else ("basic",)
    modes = tuple(m.strip() for m in choice.split(",") if m.strip())
    bad = [m for m in modes if m not in ("jail", "basic")]
    if bad or not modes:
        raise ValueError(f"sandbox modes: {choice!r} is not auto or a list of jail, basic")
    return modes


def run_bench(*, problems: int = 32, workers: tuple[int, ...] = (1, 2), workflow: str = "review_revise",
              max_tokens: int = 32, inflight: int = 8, chunk: int = 4, repeats: int = 3, sandbox_calls: int = 24,
              sandbox_threads: tuple[int, ...] = (1, 2), sandbox_mode: str = "auto", model_path: str = "",
              seed: int = 0) -> dict:
    """Run (a) at each worker count and (b) at each thread count and sandbox mode; returns the JSON-able result."""
    from aflow_rl.config import load_config
    from aflow_rl.sandbox import isolation
    from aflow_rl.serving.manager import ServerManager

    load_1m = round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None
    problem_dicts = load_problems(problems, seed)
    with ExitStack() as stack:
        run_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-aflow-"))
        overrides = ["env.name=aflow", "serving.policy.backend=none", "serving.actor.backend=embedded",
                     f"serving.actor.model_path={model_path or os.path.join(run_dir, 'tiny')}",
                     "serving.actor.build_tiny=tiny", f"run.dir={run_dir}", "rollout.trace=false",
                     f"env.aflow.executor_max_tokens={max_tokens}", f"env.aflow.eval_concurrency={chunk}",
                     "env.aflow.problem_timeout_s=300"]
        cfg = load_config(None, overrides)
        t0 = time.perf_counter()
        servers = stack.enter_context(ServerManager(cfg.serving, run_dir, roles=("actor",)))
        server_start = time.perf_counter() - t0
        server_pids = [p.proc.pid for p in servers.processes if p.proc is not None]
        eval_rows = bench_eval(cfg, servers.all_urls(), run_dir, problem_dicts, WORKFLOWS[workflow],
                               workers, inflight, chunk, repeats, server_pids)
    modes = sandbox_modes(sandbox_mode)
    sandbox_rows = bench_sandbox(sandbox_calls, sandbox_threads, repeats, modes)
    eval_ratio, eval_runs = _ratios(eval_rows, "workers", "problems_per_s", 1, 2)
    sandbox_ratios = {}
    for mode in dict.fromkeys(r["mode"] for r in sandbox_rows):
        ratio, runs = _ratios([r for r in sandbox_rows if r["mode"] == mode], "threads", "runs_per_s", 1, 2)
        sandbox_ratios[mode] = {"ratio": ratio, "runs": runs}
    return {
        "machine": machine(load_avg_1m_at_start=load_1m, sandbox_isolation=isolation()),
        "date": datetime.date.today().isoformat(),
        "args": {"dataset": DATASET, "problems": problems, "workers": list(workers), "workflow": workflow,
                 "max_tokens": max_tokens, "inflight": inflight, "chunk": chunk, "repeats": repeats,
                 "sandbox_calls": sandbox_calls, "sandbox_threads": list(sandbox_threads),
                 "sandbox_modes": list(modes), "seed": seed, "model_path": model_path or "tiny (built)"},
        "server_start_s": server_start,
        "eval": eval_rows,
        "eval_ratio_2_vs_1": eval_ratio, "eval_ratio_2_vs_1_runs": eval_runs,
        "sandbox": sandbox_rows,
        "sandbox_ratio_2_vs_1": sandbox_ratios,
    }


def format_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """A fixed-width table, one row per dict."""
    cells = [[h for _, h, _ in columns]] + [[fmt.format(r[k]) for k, _, fmt in columns] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def report(result: dict) -> str:
    """The printed report: machine, both tables, the ratios (of the medians, then round by round)."""
    m, a = result["machine"], result["args"]

    def ratio(name: str, value: float | None, runs: list[float]) -> str:
        if value is None:
            return f"{name}: n/a (needs rows for both 1 and 2)"
        return f"{name}: {value:.2f}x (rounds: {', '.join(f'{r:.2f}x' for r in runs)})"

    lines = ["machine: " + ", ".join(f"{k}={v}" for k, v in m.items()),
             f"date: {result['date']}",
             f"(a) {a['workflow']} on {a['problems']} {a['dataset']} problems (seed {a['seed']}), embedded actor "
             f"({a['model_path']}, {a['max_tokens']} tokens per call), loky RolloutPool, {a['chunk']} problems per "
             f"episode, median of {a['repeats']} interleaved rounds; server start {result['server_start_s']:.1f} s",
             format_table(result["eval"], EVAL_COLUMNS),
             ratio("problems/s, 2 workers vs 1", result["eval_ratio_2_vs_1"], result["eval_ratio_2_vs_1_runs"])]
    lines += [f"{r['workers']} worker(s) first error: {r['first_error'][:300]}" for r in result["eval"]
              if r["first_error"]]
    lines += [f"(b) sandbox (this machine: {m.get('sandbox_isolation')}): run_python on a "
              f"{len(SANDBOX_CODE.splitlines())}-line program, {a['sandbox_calls']} calls per round, median of "
              f"{a['repeats']} interleaved rounds",
              format_table(result["sandbox"], SANDBOX_COLUMNS)]
    lines += [ratio(f"runs/s, 2 threads vs 1 ({mode})", r["ratio"], r["runs"])
              for mode, r in result["sandbox_ratio_2_vs_1"].items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m aflow_rl.bench.aflow", description=__doc__.split("\n\n")[0])
    ap.add_argument("--problems", type=int, default=32, help=f"problems from {DATASET}, the same for every row")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="worker process counts, one row each")
    ap.add_argument("--workflow", choices=sorted(WORKFLOWS), default="review_revise",
                    help="the three-operator workflow")
    ap.add_argument("--max-tokens", type=int, default=32, help="executor tokens per operator call")
    ap.add_argument("--inflight", type=int, default=8, help="problems evaluated at once, over all workers")
    ap.add_argument("--chunk", type=int, default=4, help="problems per episode (one evaluate_task call)")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds per row; a row is the median")
    ap.add_argument("--sandbox-calls", type=int, default=24, help="run_python calls per sandbox row")
    ap.add_argument("--sandbox-threads", type=int, nargs="+", default=[1, 2], help="thread counts, one row each")
    ap.add_argument("--sandbox-mode", default="auto",
                    help="auto (this machine's isolation, plus basic beside a jail) | jail | basic | jail,basic")
    ap.add_argument("--model-path", default="", help="actor model directory (default: build the tiny model)")
    ap.add_argument("--seed", type=int, default=0, help="problem seed")
    ap.add_argument("--json", default="", help="also write the numbers to this JSON file")
    args = ap.parse_args(argv)
    for name in ("problems", "inflight", "chunk", "repeats", "sandbox_calls", "max_tokens"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    if min(args.workers) < 1 or min(args.sandbox_threads) < 1:
        ap.error("--workers and --sandbox-threads must be at least 1")
    try:
        sandbox_modes(args.sandbox_mode)
    except ValueError as exc:
        ap.error(f"--sandbox-mode: {exc}")
    result = run_bench(problems=args.problems, workers=tuple(args.workers), workflow=args.workflow,
                       max_tokens=args.max_tokens, inflight=args.inflight, chunk=args.chunk, repeats=args.repeats,
                       sandbox_calls=args.sandbox_calls, sandbox_threads=tuple(args.sandbox_threads),
                       sandbox_mode=args.sandbox_mode, model_path=args.model_path, seed=args.seed)
    print(report(result))
    if args.json:
        print(f"wrote {write_json(result, args.json)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
