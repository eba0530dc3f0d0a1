"""Asynchronous training benchmark: seconds per optimizer step and reward at k = 0, 1, 2.

    python -m aflow_rl.bench.async_overlap [--config configs/quickstart.yaml] [--steps 30] [--ks 0,1,2]
                                           [--seeds 0,1] [--out runs/bench_async] [--json OUT.json]
                                           [--smoke] [--set KEY=VALUE ...]

Trains the recipe through the real entry point, ``python train.py CONFIG trainer.max_staleness=k
run.seed=s``, once per (k, seed), interleaved (k = 0 1 2, 0 1 2, ...) so that a change in the
machine's load hits every k alike. From each run's TensorBoard records it reports:

- ``step_s``: mean seconds per optimizer step (``timing/step_s``; the first step, which waits
  for the first rollout in every mode, is left out);
- ``ideal_s``: max(rollout, train + sync), their means in the same run: a step of perfectly
  overlapped rollout and training cannot be shorter; ``ratio = step_s / ideal_s`` (issue 13's goal
  for k >= 1: <= 1.15; k = 0 runs them one after the other, so its ratio is about
  (rollout + train + sync) / max(...));
- ``speedup``: k = 0's step_s over this k's, per seed;
- the reward per optimizer step (``rewards/mean``) and the version lag actually trained
  (``async/staleness_mean``), and the curve against the run's wall time.

``--json PATH`` writes every number and a PNG (reward vs optimizer step and vs wall time, one line
per k, mean over seeds) beside it. The machine and its load average are printed with the numbers:
on a shared machine the load decides the timings more than anything here.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from typing import Any

import numpy as np

from aflow_rl.bench import machine

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GOAL_RATIO = 1.15
TAGS = ("rewards/mean", "timing/step_s", "timing/rollout_s", "timing/train_s", "timing/sync_s", "timing/overlap",
        "async/staleness_mean", "async/staleness_max", "async/admission_wait_s", "async/queue_episodes")
# A few small steps: every stage of the benchmark, inside the test suite.
SMOKE = dict(steps=3, ks=[0, 1], seeds=[0], sets=["rollout.group_size=2", "rollout.tasks_per_step=2",
                                                  "trainer.micro_batch_size=4", "trainer.sample_every=100"])


def train_command(config: str, k: int, seed: int, run_dir: str, steps: int, sets: list[str]) -> list[str]:
    return [sys.executable, "train.py", os.path.abspath(config), f"run.dir={os.path.abspath(run_dir)}",
            f"trainer.max_staleness={k}", f"run.seed={seed}", f"trainer.max_steps={steps}", "resume=never",
            f"trainer.save_every={steps}", *sets]


def read_run(run_dir: str) -> dict[str, list[tuple[int, float, float]]]:
    """Per tag, [(optimizer step, wall time, value)] from the run's TensorBoard records."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(os.path.join(run_dir, "events"), size_guidance={"scalars": 0})
    acc.Reload()
    have = set(acc.Tags()["scalars"])
    return {tag: [(e.step, e.wall_time, e.value) for e in acc.Scalars(tag)] for tag in TAGS if tag in have}


def run_summary(records: dict[str, list[tuple[int, float, float]]]) -> dict[str, Any]:
    """One run's numbers (see the module docstring); the first step is left out of the timings."""
    def mean(tag: str) -> float:
        vals = [v for step, _, v in records.get(tag, []) if step > 1]
        return float(np.mean(vals)) if vals else 0.0

    rollout, train, sync, step = mean("timing/rollout_s"), mean("timing/train_s"), mean("timing/sync_s"), \
        mean("timing/step_s")
    ideal = max(rollout, train + sync)
    rewards = records.get("rewards/mean", [])
    t0 = rewards[0][1] if rewards else 0.0
    return {"step_s": step, "rollout_s": rollout, "train_s": train, "sync_s": sync, "ideal_s": ideal,
            "ratio": step / ideal if ideal else float("nan"), "overlap": mean("timing/overlap"),
            "staleness_mean": mean("async/staleness_mean"), "staleness_max": max(
                (v for _, _, v in records.get("async/staleness_max", [])), default=0.0),
            "admission_wait_s": mean("async/admission_wait_s"),
            "reward_curve": [[s, v] for s, _, v in rewards], "wall_curve": [[w - t0, v] for _, w, v in rewards]}


def summarize(runs: list[dict]) -> dict[str, dict[str, float]]:
    """Per k: the mean over seeds of each run's numbers, their sample std (``*_spread``), the speedup
    over k = 0 of the same seed, the final reward (mean of each run's last quarter of steps)."""
    base = {r["seed"]: r["step_s"] for r in runs if r["k"] == 0}
    out: dict[str, dict[str, float]] = {}
    for k in sorted({r["k"] for r in runs}):
        rows = [r for r in runs if r["k"] == k]
        row: dict[str, float] = {"seeds": float(len(rows))}
        for key in ("step_s", "rollout_s", "train_s", "sync_s", "ideal_s", "ratio", "overlap", "staleness_mean",
                    "admission_wait_s"):
            vals = [r[key] for r in rows]
            row[key], row[key + "_spread"] = float(np.mean(vals)), float(np.std(vals, ddof=1)) if len(vals) > 1 else 0.0
        row["staleness_max"] = max(r["staleness_max"] for r in rows)
        speedups = [base[r["seed"]] / r["step_s"] for r in rows if r["seed"] in base and r["step_s"]]
        row["speedup"] = float(np.mean(speedups)) if speedups else float("nan")
        finals = [_final_reward(r["reward_curve"]) for r in rows]
        row["final_reward"], row["final_reward_spread"] = float(np.mean(finals)), \
            float(np.std(finals, ddof=1)) if len(finals) > 1 else 0.0
        out[str(k)] = row
    return out


def _final_reward(curve: list[list[float]]) -> float:
    values = [v for _, v in curve]
    tail = values[-max(1, len(values) // 4):]
    return float(np.mean(tail)) if tail else float("nan")


def format_report(summary: dict) -> str:
    lines = ["k  step_s  rollout_s  train+sync_s  ratio(goal<=%.2f)  speedup  overlap  staleness(mean/max)  "
             "final_reward" % GOAL_RATIO]
    for k, r in summary.items():
        lines.append(f"{k}  {r['step_s']:6.2f}  {r['rollout_s']:9.2f}  {r['train_s'] + r['sync_s']:12.2f}  "
                     f"{r['ratio']:5.2f} +- {r['ratio_spread']:4.2f}{'':7}  {r['speedup']:7.2f}  {r['overlap']:7.2f}  "
                     f"{r['staleness_mean']:5.2f}/{r['staleness_max']:.0f}{'':13}  "
                     f"{r['final_reward']:.3f} +- {r['final_reward_spread']:.3f}")
    return "\n".join(lines)


def plot(runs: list[dict], path: str) -> str:
    """Reward vs optimizer step and vs wall time, one line per k (each seed faint, their mean bold)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for i, k in enumerate(sorted({r["k"] for r in runs})):
        color = f"C{i}"
        rows = [r for r in runs if r["k"] == k]
        for r in rows:
            for ax, key in zip(axes, ("reward_curve", "wall_curve")):
                xs, ys = zip(*r[key]) if r[key] else ((), ())
                ax.plot(xs, ys, color=color, alpha=0.3, lw=0.8)
        n = min(len(r["reward_curve"]) for r in rows)
        if n:
            mean_y = np.mean([[v for _, v in r["reward_curve"][:n]] for r in rows], axis=0)
            mean_w = np.mean([[w for w, _ in r["wall_curve"][:n]] for r in rows], axis=0)
            axes[0].plot(range(1, n + 1), mean_y, color=color, lw=2, label=f"k={k}")
            axes[1].plot(mean_w, mean_y, color=color, lw=2, label=f"k={k}")
    axes[0].set_xlabel("optimizer step")
    axes[1].set_xlabel("wall time (s)")
    axes[0].set_ylabel("rewards/mean")
    axes[0].legend()
    fig.suptitle("trainer.max_staleness = k: reward per optimizer step and against wall time")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m aflow_rl.bench.async_overlap", description=__doc__.split("\n")[0])
    p.add_argument("--config", default=os.path.join(ROOT, "configs", "quickstart.yaml"))
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--ks", default="0,1,2", help="max_staleness values, comma separated")
    p.add_argument("--seeds", default="0,1", help="run.seed values, comma separated (>= 2 for a spread)")
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "bench_async"))
    p.add_argument("--json", default="", help="write every number here, and a PNG beside it")
    p.add_argument("--smoke", action="store_true", help="a few small steps (the test suite)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra config overrides")
    args = p.parse_args(argv)
    args.ks, args.seeds = [int(x) for x in args.ks.split(",")], [int(x) for x in args.seeds.split(",")]
    if args.smoke:
        args.steps, args.ks, args.seeds, args.set = SMOKE["steps"], SMOKE["ks"], SMOKE["seeds"], SMOKE["sets"] + args.set
    if args.steps < 2:
        p.error("--steps must be at least 2 (the first step is left out of the timings)")
    return args


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every (seed, k) run, interleaved; returns the report's dict."""
    started, load_before = datetime.datetime.now(datetime.timezone.utc), os.getloadavg()
    runs = []
    for seed in args.seeds:
        for k in args.ks:
            run_dir = os.path.join(args.out, f"k{k}_seed{seed}")
            t0 = time.perf_counter()
            proc = subprocess.run(train_command(args.config, k, seed, run_dir, args.steps, args.set), cwd=ROOT,
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"train.py (k={k}, seed={seed}) failed with exit code {proc.returncode}: "
                                   f"{(proc.stderr or proc.stdout).strip().splitlines()[-1:]}; log in {run_dir}")
            runs.append({"k": k, "seed": seed, "run_dir": run_dir, "wall_s": time.perf_counter() - t0,
                         **run_summary(read_run(run_dir))})
            print(f"k={k} seed={seed}: {runs[-1]['step_s']:.2f} s/step, ratio {runs[-1]['ratio']:.2f} "
                  f"({runs[-1]['wall_s']:.0f} s, load {os.getloadavg()[0]:.1f})", flush=True)
    return {"date": started.isoformat(timespec="seconds"), "machine": machine(),
            "load_avg_before": load_before, "load_avg_after": os.getloadavg(), "config": args.config,
            "steps": args.steps, "sets": args.set, "goal_ratio": GOAL_RATIO, "runs": runs, "summary": summarize(runs)}


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    report = run(args)
    print(f"machine: {report['machine']}")
    print(f"load average (1/5/15 min) before {report['load_avg_before']}, after {report['load_avg_after']}")
    print(format_report(report["summary"]))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=1)
        print(f"wrote {args.json} and {plot(report['runs'], os.path.splitext(args.json)[0] + '.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
