"""Learning benchmark: does the trained swarm orchestrator beat the rules it replaces?

    python -m aflow_rl.bench.learning [--config configs/learning.yaml] [--estimators grpo,gigpo]
                                      [--steps N] [--eval-n 50] [--eval-seeds 900001,900002,900003]
                                      [--out runs/bench_learning] [--json OUT.json] [--smoke]
                                      [--set KEY=VALUE ...] [--pressure KEY=V1,V2,...]

For each advantage estimator (GRPO, GiGPO: same recipe, budget and seeds) it
trains the orchestrator through the real entry point, ``python train.py
CONFIG run.dir=OUT/<estimator> algo.adv_estimator=<estimator>``, on the
recipe's task mixture (wide tasks reward parallel subagents, deep chains
reward serial work, mixed ones a bit of both). Then every policy, the final
checkpoint of each run (greedy), the single, heuristic and bandit
baselines, and the ``adaptive`` reference rule (it reads the task's
structure: the headroom over the baselines, not part of the verdict) play
the same held-out tasks, suite by suite, under the recipe's environment, and
are judged by one objective they all share:

    objective = item_f1 - c * critical_steps        (c = env.swarm.latency_coef)

Per suite (wide, deep, mixed) it reports item F1, success, critical steps and
the objective, each as the mean over the evaluation seeds and their
seed-to-seed spread (sample std of the per-seed means), the learning curve of
each run (mean PARL-shaped training reward and mean objective of the training
episodes, per optimizer step and against the loop's wall time) and the two
verdicts of issue 10: on mixed the trained policy beats every baseline by more
than the spread; on wide it keeps the heuristic's item F1 within 0.05 with no
more critical steps. The evaluation tasks are held out: the tasks the runs
trained on are replayed from the recipe's task sampler, and an evaluation draw
that repeats one (a short deep chain can recur by chance) is replaced by the
seed's next task.

``--json PATH`` writes every number; a PNG of the curves is written beside it
(``PATH`` with ``.png``). ``--smoke`` is a few-step version for the test suite.
``--pressure`` adds the context-pressure sweep of ``bench.swarm`` over every
policy, trained ones included.
"""
from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import shutil
import subprocess
import sys
import time
from typing import Any

import numpy as np

from aflow_rl.bench import machine, write_json
from aflow_rl.bench.swarm import EVAL_RESET, format_pressure, parse_pressure, pressure_sweep, run_bench
from aflow_rl.config import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASELINES = ("single", "heuristic", "bandit")    # what the trained policy must beat (the goal's verdict)
REFERENCES = ("adaptive",)   # a structure-aware rule, reported beside them: the headroom there is to find
SUITES = ("wide", "deep", "mixed")
WIDE_F1_TOLERANCE = 0.05
REPORTED = ("item_f1", "success", "critical_steps", "objective", "spawn_count", "solved_self", "invalid_actions")
# A few steps of a small batch: enough to run every stage of the benchmark inside the test suite.
SMOKE = dict(steps=2, eval_n=3, eval_seeds=[900001],
             sets=["rollout.group_size=2", "rollout.tasks_per_step=2", "rollout.concurrency_per_worker=8",
                   "trainer.micro_batch_size=8", "trainer.save_every=1", "trainer.sample_every=100",
                   "env.swarm.curriculum=[0, 1, 1]"])


# ---------------------------------------------------------------------------
# Training (train.py, as a user runs it)
# ---------------------------------------------------------------------------


def train_command(config: str, estimator: str, run_dir: str, steps: int, sets: list[str]) -> list[str]:
    return [sys.executable, "train.py", os.path.abspath(config), f"run.dir={os.path.abspath(run_dir)}",
            f"algo.adv_estimator={estimator}", f"trainer.max_steps={steps}", "resume=never", *sets]


def train_all(config: str, estimators: list[str], out: str, steps: int, sets: list[str],
              parallel: bool = False) -> list[dict[str, Any]]:
    """``python train.py CONFIG ...`` per estimator, one after another (``parallel``: all at once,
    for the smoke run only: the runs then share the cores, so their wall times mean little)."""
    procs = []
    for est in estimators:
        run_dir = os.path.join(out, est)
        if os.path.isdir(run_dir):
            shutil.rmtree(run_dir)  # this benchmark's own output: a fresh run, never a resumed one
        os.makedirs(run_dir)
        cmd = train_command(config, est, run_dir, steps, sets)
        log = open(os.path.join(run_dir, "train.log"), "w")
        print(f"training {est}: {steps} steps -> {run_dir}", flush=True)
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        procs.append((est, run_dir, cmd, log, proc, t0))
        if not parallel:
            _finish_training(procs[-1])
    return [_finish_training(p) for p in procs]


def _finish_training(entry: tuple) -> dict[str, Any]:
    est, run_dir, cmd, log, proc, t0 = entry
    proc.wait()
    log.close()
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        with open(log.name) as fh:
            tail = fh.read()[-3000:]
        raise RuntimeError(f"train.py ({est}) exited with {proc.returncode}; end of {log.name}:\n{tail}")
    steps = int(cmd[5].split("=")[1])
    hf = os.path.join(run_dir, "checkpoints", f"step_{steps}", "hf")
    if not os.path.isdir(hf):
        raise RuntimeError(f"train.py ({est}) finished without its final checkpoint {hf}")
    return {"estimator": est, "run_dir": run_dir, "command": " ".join(cmd), "wall_s": wall, "checkpoint": hf}


def first_action(episode: dict, tokenizer: Any) -> str:
    """The kind of an episode's first orchestrator action (its first turn decoded), '' if none.
    Under the effective grammar it is the choice between serial work (solve) and delegation
    (spawn) that decides most of the objective."""
    import re

    if not episode.get("turns"):
        return ""
    m = re.search(r'"action"\s*:\s*"(\w+)"', tokenizer.decode(episode["turns"][0]["response_ids"]))
    return m.group(1) if m else "?"


def _spawn_first_shares(eps: list[dict], tokenizer: Any) -> dict[str, float]:
    out = {}
    for suite in SUITES:
        firsts = [first_action(e, tokenizer) for e in eps if e["info"].get("suite") == suite]
        if firsts:
            out[f"spawn_first/{suite}"] = firsts.count("spawn") / len(firsts)
    return out


def _policy_tokenizer(cfg: Any) -> Any:
    from transformers import AutoTokenizer

    path = cfg.serving.policy.model_path
    path = path if os.path.isabs(path) else os.path.join(ROOT, path)
    return AutoTokenizer.from_pretrained(path) if os.path.isfile(os.path.join(path, "tokenizer.json")) else None


def learning_curve(run_dir: str, config: str, sets: list[str]) -> list[dict[str, float]]:
    """Per optimizer step: mean shaped training reward, mean objective, item F1, critical steps,
    the loop's wall time so far (sum of ``timing/step_s``: start-up excluded), and per suite the
    share of episodes whose first action is spawn (``spawn_first/<suite>``: does the policy's
    first action depend on the task?)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from aflow_rl.algos.parl import shaped_reward
    from aflow_rl.envs.swarm.metrics import task_objective

    cfg = load_config(config, sets)
    coef = cfg.env.swarm.latency_coef
    tokenizer = _policy_tokenizer(cfg)
    acc = EventAccumulator(os.path.join(run_dir, "events"), size_guidance={"scalars": 0})
    acc.Reload()
    step_s = {e.step: e.value for e in acc.Scalars("timing/step_s")} if "timing/step_s" in acc.Tags()["scalars"] else {}
    curve, wall = [], 0.0
    for path in sorted(glob.glob(os.path.join(run_dir, "episodes", "step_*.jsonl"))):
        step = int(os.path.basename(path)[5:11])
        with open(path) as fh:
            eps = [e for e in map(json.loads, fh) if e.get("status") == "ok"]
        wall += step_s.get(step + 1, 0.0)
        if not eps:
            continue
        m = lambda k: float(np.mean([e["metrics"][k] for e in eps]))  # noqa: E731
        obj = [task_objective(e["metrics"]["item_f1"], e["metrics"]["critical_steps"], coef) for e in eps]
        point = {"step": step + 1, "wall_s": wall, "objective": float(np.mean(obj)),
                 "reward": float(np.mean([shaped_reward(e["reward_components"], step, cfg.algo.parl) for e in eps])),
                 "item_f1": m("item_f1"), "critical_steps": m("critical_steps"), "episodes": len(eps)}
        for suite in SUITES:
            o = [v for e, v in zip(eps, obj) if e["info"].get("suite") == suite]
            if o:
                point[f"objective/{suite}"] = float(np.mean(o))
        if tokenizer is not None:
            point.update(_spawn_first_shares(eps, tokenizer))
        curve.append(point)
    return curve


def training_tasks(config: str, sets: list[str], steps: int) -> set[str]:
    """Fingerprints of every task the runs trained on, replayed from the trainer's own task sampler."""
    from aflow_rl.rollout.sampler import TaskSampler
    from workers.swarm import make_tasks

    cfg = load_config(config, sets + [f"trainer.max_steps={steps}"])
    sampler = TaskSampler(make_tasks, cfg, cfg.run.seed, num_tasks=cfg.rollout.num_tasks)
    return {_fingerprint(t) for _ in range(steps) for t in sampler.next(cfg.rollout.tasks_per_step)}


def _fingerprint(task: dict) -> str:
    return json.dumps([task["suite"], task["items"], task["gold"]], sort_keys=True)


# ---------------------------------------------------------------------------
# Evaluation
# ---------------------------------------------------------------------------


def evaluate(runs: list[dict], config: str, sets: list[str], suites: list[str], seeds: list[int], n: int,
             temperature: float, seen: set[str], concurrency: int = 8) -> list[dict]:
    """One row per (policy, suite, seed): baselines, then each run's final checkpoint, on the seed's
    first n tasks that no run trained on (``seen``: training-task fingerprints)."""
    held_out = lambda t: _fingerprint(t) not in seen  # noqa: E731
    rows = []
    for seed in seeds:
        base = run_bench(list(BASELINES + REFERENCES), suites, n, seed, sets, config=config,
                         task_filter=held_out)["rows"]
        rows += [{**r, "seed": seed} for r in base]
        for run in runs:
            out = run_bench([f"model:{run['checkpoint']}"], suites, n, seed, sets + [f"env.temperature={temperature}"],
                            concurrency=concurrency, config=config, task_filter=held_out)["rows"]
            rows += [{**r, "policy": f"trained-{run['estimator']}", "seed": seed} for r in out]
    return rows


def summarize(rows: list[dict]) -> dict[str, dict[str, dict[str, float]]]:
    """``{suite: {policy: {metric: mean over seeds, metric_spread: sample std of the per-seed means}}}``."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for r in rows:
        out.setdefault(r["suite"], {}).setdefault(r["policy"], {}).setdefault("_rows", []).append(r)
    for suite in out.values():
        for policy, agg in suite.items():
            per_seed = agg.pop("_rows")
            for k in REPORTED:
                vals = np.array([r.get(k, 0.0) for r in per_seed], dtype=float)
                agg[k] = float(vals.mean())
                agg[f"{k}_spread"] = float(vals.std(ddof=1)) if len(vals) > 1 else 0.0
            agg["seeds"] = len(per_seed)
            agg["episodes"] = int(sum(r["n"] for r in per_seed))
    return out


def verdicts(summary: dict, estimators: list[str]) -> dict[str, dict]:
    """Issue 10's goals, per trained policy: mixed (objective margin over every baseline > spread)
    and wide (item F1 within 0.05 of the heuristic's, critical steps no more than its)."""
    out = {}
    for est in estimators:
        name, v = f"trained-{est}", {}
        mixed = summary.get("mixed", {})
        if name in mixed:
            t = mixed[name]
            margins = {b: {"margin": t["objective"] - mixed[b]["objective"],
                           "spread": max(t["objective_spread"], mixed[b]["objective_spread"])}
                       for b in BASELINES if b in mixed}
            for m in margins.values():
                m["beats"] = bool(m["margin"] > m["spread"])
            # One evaluation seed has no spread to beat: no verdict, only the margins.
            v["mixed"] = {"vs": margins, "seeds": t["seeds"],
                          "passed": (bool(margins) and all(m["beats"] for m in margins.values()))
                          if t["seeds"] >= 2 else None}
        wide = summary.get("wide", {})
        if name in wide and "heuristic" in wide:
            t, h = wide[name], wide["heuristic"]
            v["wide"] = {"item_f1_gap": h["item_f1"] - t["item_f1"], "critical_steps_excess": t["critical_steps"]
                         - h["critical_steps"], "passed": bool(h["item_f1"] - t["item_f1"] <= WIDE_F1_TOLERANCE
                                                               and t["critical_steps"] <= h["critical_steps"])}
        out[name] = v
    return out


# ---------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------


def format_report(summary: dict, verdict: dict) -> str:
    lines = [f"{'suite':>6}  {'policy':>16}  {'item_f1':>13}  {'success':>13}  {'crit_steps':>13}  "
             f"{'objective':>15}  {'spawns':>6}  {'solved':>6}  {'invalid':>7}"]
    lines.append("-" * len(lines[0]))
    for suite in SUITES:
        for policy, a in summary.get(suite, {}).items():
            pm = lambda k, f: f"{a[k]:{f}}±{a[k + '_spread']:{f}}"  # noqa: E731
            lines.append(f"{suite:>6}  {policy:>16}  {pm('item_f1', '.3f'):>13}  {pm('success', '.3f'):>13}  "
                         f"{pm('critical_steps', '.2f'):>13}  {pm('objective', '.4f'):>15}  {a['spawn_count']:6.2f}  "
                         f"{a['solved_self']:6.2f}  {a['invalid_actions']:7.2f}")
    for name, v in verdict.items():
        if "mixed" in v:
            vs = ", ".join(f"{b} {m['margin']:+.4f} (spread {m['spread']:.4f})" for b, m in v["mixed"]["vs"].items())
            ok = v["mixed"]["passed"]
            lines.append(f"{name} on mixed, objective margin: {vs}: "
                         + ("no verdict (one evaluation seed: no spread)" if ok is None else "PASS" if ok else "FAIL"))
        if "wide" in v:
            w = v["wide"]
            lines.append(f"{name} on wide: item F1 {w['item_f1_gap']:+.3f} below heuristic (<= {WIDE_F1_TOLERANCE}), "
                         f"critical steps {w['critical_steps_excess']:+.2f} vs heuristic (<= 0): "
                         f"{'PASS' if w['passed'] else 'FAIL'}")
    return "\n".join(lines)


def plot(curves: dict[str, list[dict]], summary: dict, path: str) -> str:
    """Reward and objective vs optimizer step and vs wall time, baselines' held-out objective as lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharey="row")
    for est, curve in curves.items():
        for row, key in enumerate(("reward", "objective")):
            for col, x in enumerate(("step", "wall_s")):
                axes[row][col].plot([p[x] for p in curve], [p[key] for p in curve], label=est, lw=1.2)
    suites = [s for s in SUITES if s in summary]
    for i, b in enumerate(BASELINES + REFERENCES):
        vals = [summary[s][b]["objective"] for s in suites if b in summary[s]]
        if vals:
            for col in (0, 1):
                axes[1][col].axhline(float(np.mean(vals)), ls="--", lw=0.8, color=f"C{i + 3}",
                                     label=f"{b} (held-out, mean over suites)")
    for col, xl in enumerate(("optimizer step", "training-loop wall time (s)")):
        axes[1][col].set_xlabel(xl)
    axes[0][0].set_ylabel("shaped training reward")
    axes[1][0].set_ylabel("objective = item_f1 - c * critical_steps")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
    axes[1][1].legend(fontsize=7, loc="lower right")
    fig.suptitle("bench.learning: training episodes (solid) and baselines on held-out tasks (dashed)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m aflow_rl.bench.learning", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/learning.yaml", help="training recipe (also the eval environment)")
    ap.add_argument("--estimators", default="grpo,gigpo", help="advantage estimators to train, comma-separated")
    ap.add_argument("--steps", type=int, default=0, help="optimizer steps per run (0: the recipe's trainer.max_steps)")
    ap.add_argument("--eval-n", type=int, default=50, help="held-out tasks per suite and seed")
    ap.add_argument("--eval-seeds", default="900001,900002,900003", help="held-out task seeds, comma-separated")
    ap.add_argument("--eval-temperature", type=float, default=0.0, help="sampling temperature of the trained policy at evaluation (0: greedy)")
    ap.add_argument("--suites", default="wide,deep,mixed", help="evaluation suites")
    ap.add_argument("--out", default="runs/bench_learning", help="folder of the training runs")
    ap.add_argument("--json", default="", help="write the numbers here, and the curves as PNG beside it")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides for training and evaluation")
    ap.add_argument("--pressure", default="", metavar="KEY=V1,V2", help="also the context-pressure sweep (bench.swarm --pressure)")
    ap.add_argument("--skip-train", action="store_true", help="evaluate the runs already in --out")
    ap.add_argument("--smoke", action="store_true", help="a few steps and tasks (the test suite's run)")
    args = ap.parse_args(argv)
    args.estimators = [e for e in args.estimators.split(",") if e]
    args.eval_seeds = [int(s) for s in args.eval_seeds.split(",") if s]
    args.suites = [s for s in args.suites.split(",") if s]
    if args.smoke:
        args.steps, args.eval_n, args.eval_seeds = SMOKE["steps"], SMOKE["eval_n"], SMOKE["eval_seeds"]
        args.set = SMOKE["sets"] + args.set
    bad = [e for e in args.estimators if e not in ("grpo", "gigpo")] + [s for s in args.suites if s not in SUITES]
    if bad or not args.estimators or not args.eval_seeds:
        ap.error(f"--estimators must name grpo/gigpo, --suites wide/deep/mixed, --eval-seeds at least one seed (got {bad})")
    try:
        cfg = load_config(args.config, args.set)
    except Exception as exc:  # noqa: BLE001 - ConfigError: the user's to fix, one line
        ap.error(str(exc))
    args.steps = args.steps or cfg.trainer.max_steps
    return args


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.skip_train:
        runs = [{"estimator": est, "run_dir": os.path.join(args.out, est), "wall_s": None,
                 "checkpoint": os.path.join(args.out, est, "checkpoints", f"step_{args.steps}", "hf")}
                for est in args.estimators]
    else:
        runs = train_all(args.config, args.estimators, args.out, args.steps, args.set, parallel=args.smoke)
    curves = {r["estimator"]: learning_curve(r["run_dir"], args.config, args.set) for r in runs}
    from workers.swarm import make_tasks

    seen = training_tasks(args.config, args.set, args.steps)
    eval_sets = args.set + EVAL_RESET
    replaced = sum(_fingerprint(t) in seen for s in args.suites for seed in args.eval_seeds
                   for t in make_tasks(load_config(args.config, eval_sets + [f"env.swarm.suite={s}"]), args.eval_n, seed))
    rows = evaluate(runs, args.config, args.set, args.suites, args.eval_seeds, args.eval_n, args.eval_temperature, seen)
    summary = summarize(rows)
    result = {"machine": machine(), "date": datetime.date.today().isoformat(), "args": vars(args),
              "objective": {"formula": "item_f1 - c * critical_steps",
                            "c": load_config(args.config, args.set).env.swarm.latency_coef},
              "runs": runs, "curves": curves, "rows": rows, "summary": summary,
              "verdicts": verdicts(summary, args.estimators),
              "held_out": {"training_tasks": len(seen), "eval_tasks_replaced": replaced}}
    if args.pressure:
        key, values = parse_pressure(args.pressure)
        policies = list(BASELINES + REFERENCES) + [f"model:{r['checkpoint']}" for r in runs]
        result["pressure"] = pressure_sweep(policies, args.suites, args.eval_n, args.eval_seeds[0], key, values,
                                            args.set + [f"env.temperature={args.eval_temperature}"], args.config)
    return result


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    result = run(args)
    m = result["machine"]
    print(f"learning benchmark  {result['date']}  {m['platform']}  {m['cpu']}  {m['cores']} cores  "
          f"objective = item_f1 - {result['objective']['c']} * critical_steps  steps={args.steps}  "
          f"eval: {args.eval_n} tasks x seeds {args.eval_seeds}")
    for r in result["runs"]:
        curve = result["curves"][r["estimator"]]
        if curve:
            print(f"{r['estimator']}: objective (training episodes) {curve[0]['objective']:.4f} at step "
                  f"{curve[0]['step']} -> {curve[-1]['objective']:.4f} at step {curve[-1]['step']}; "
                  f"loop {curve[-1]['wall_s']:.0f} s" + (f", total {r['wall_s']:.0f} s" if r.get("wall_s") else ""))
    print(format_report(result["summary"], result["verdicts"]))
    print(f"held-out: none of the evaluation tasks is among the {result['held_out']['training_tasks']} training "
          f"tasks ({result['held_out']['eval_tasks_replaced']} drawn that were, replaced by the seed's next ones)")
    if "pressure" in result:
        print(format_pressure(result["pressure"]))
    if args.json:
        print(f"wrote {write_json(result, args.json)} and {plot(result['curves'], result['summary'], os.path.splitext(args.json)[0] + '.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
