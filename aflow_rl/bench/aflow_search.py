"""Does search make a better workflow? IO vs plain AFlow vs RL-guided MCTS vs a trained optimizer, on held-out test.

    python -m aflow_rl.bench.aflow_search [--config configs/aflow_smol.yaml] [--seeds 0 1 2] [--rounds 5]
        [--checkpoint HF_DIR | --train-steps K] [--methods io aflow mcts trained] [--out DIR] [--json PATH]
        [--smoke] [key=value ...]

For each seed s the problems of ``env.aflow`` are split with ``split_seed + s`` (a different
validation/test split per seed, so the spread includes the choice of problems), then:

* ``io``: the single-call workflow (AFlow's round-1 workflow, one ``Custom`` call) on the test split;
* ``aflow``: ``--rounds`` rounds of the optimizer loop (``optimizer.Optimizer``) with AFlow's own parent
  selection (``selection: aflow``) and the frozen optimizer policy (``serving.policy``); its best
  workflow by validation score, run on the test split;
* ``mcts``: the same with the RL-guided tree selection (``selection: mcts``);
* ``trained``: ``mcts`` with the optimizer policy trained by ``python train.py CONFIG`` (``--checkpoint``
  names its HF export, e.g. ``runs/aflow_smol/checkpoints/step_20/hf``; ``--train-steps K`` runs that
  training first, K steps, under ``OUT/train``, and reports its GiGPO anchor-group fractions).

``--methods`` runs a subset (``io`` always runs: every row is read against it), e.g. the frozen
methods while the optimizer trains, then ``--methods trained --checkpoint ...`` when it is done.

A workflow's result on one problem is cached by (workflow hash, problem id) for the whole bench: the
executor answers at temperature 0 unless a node samples, so a repeat would spend CPU for the same
number, and every method pays for a workflow it is the first to evaluate. Rows are mean +- half the
min-max range over seeds. Found workflows are written as YAML under ``OUT/seed<s>/<method>/best.yaml``;
``--json PATH`` writes every number there and ``PATH`` with ``.png``: best validation score so far per
round for each selection method (mean over seeds, min-max band).

``--smoke``: the tiny random model as both optimizer and executor, 3 problems, 2 rounds, 1 seed, the
policy itself as the "trained" checkpoint (checks the pipe, not the numbers).
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import glob
import json
import os
import subprocess
import sys
import time
from typing import Any

import numpy as np

from aflow_rl.bench import machine, write_json

DEFAULT_CONFIG = "configs/aflow_smol.yaml"
METHODS = ("io", "aflow", "mcts", "trained")
SEARCH_METHODS = {"aflow": "aflow", "mcts": "mcts", "trained": "mcts"}  # method -> selection mode
SMOKE_OVERRIDES = ["env.aflow.num_problems=3", "env.aflow.val_ratio=0.34", "env.aflow.executor_max_tokens=8",
                   "env.max_new_tokens=96", "env.aflow.eval_concurrency=3", "env.aflow.problem_timeout_s=60"]


# ---------------------------------------------------------------------------
# Evaluation with a per-problem cache
# ---------------------------------------------------------------------------


class CachedEvaluator:
    """``evaluate`` of ``env.aflow`` with each (workflow hash, problem id) result kept for the bench."""

    def __init__(self, a: Any, executor: Any):
        self.a, self.executor = a, executor
        self.cache: dict[tuple[str, str], Any] = {}
        self.fresh = 0       # problem results computed (not read from the cache)

    async def run(self, workflow: Any, problems: list) -> Any:
        from aflow_rl.envs.aflow.evaluator import Cost, EvalResult, evaluate
        from aflow_rl.envs.aflow.graph import workflow_hash

        a, h, t0 = self.a, workflow_hash(workflow), time.monotonic()
        missing = [p for p in problems if (h, p.id) not in self.cache]
        if missing:
            res = await evaluate(workflow, missing, executor=self.executor, concurrency=a.eval_concurrency,
                                 problem_timeout_s=a.problem_timeout_s, max_tokens=a.executor_max_tokens,
                                 max_nodes=a.max_nodes, max_samples=a.max_samples,
                                 max_loop_rounds=a.max_loop_rounds, code_timeout_s=a.code_timeout_s,
                                 scoring_mode=a.scoring)
            for r in res.per_problem:
                self.cache[(h, r.id)] = r
            self.fresh += len(missing)
        rows = [self.cache[(h, p.id)] for p in problems]
        cost = Cost(tokens_in=sum(r.tokens_in for r in rows), tokens_out=sum(r.tokens_out for r in rows),
                    calls=sum(r.calls for r in rows), code_runs=sum(r.code_runs for r in rows))
        failures = [{"id": r.id, "question": str(p.question), "prediction": r.prediction, "expected": p.answer,
                     "error": r.error, "score": r.score} for p, r in zip(problems, rows) if r.score < 1.0]
        score = float(np.mean([r.score for r in rows])) if rows else 0.0
        return EvalResult(score=score, per_problem=rows, cost=cost, seconds=time.monotonic() - t0,
                          failures=failures, workflow_hash=h)

    def on(self, problems: list):
        """``evaluate(workflow)`` on ``problems``: the optimizer's EvaluateFn."""
        async def fn(workflow: Any) -> Any:
            return await self.run(workflow, problems)

        return fn


# ---------------------------------------------------------------------------
# One seed
# ---------------------------------------------------------------------------


def seed_split(cfg: Any, seed: int) -> tuple[list, list]:
    """(validation, test) of ``env.aflow`` split with ``split_seed + seed``."""
    from aflow_rl.envs.aflow.datasets import load_dataset, split

    a = cfg.env.aflow
    val, test = split(load_dataset(a.dataset, num_problems=a.num_problems), a.val_ratio, a.split_seed + seed)
    if not val or not test:
        raise SystemExit(f"env.aflow: {a.dataset} with num_problems={a.num_problems}, val_ratio={a.val_ratio} "
                         "leaves an empty validation or test split; raise num_problems")
    return val, test


def best_so_far(results: list[dict], rounds: int) -> list[float | None]:
    """Best validation score after each round 1..rounds (rejected rounds keep the previous best)."""
    per_round: dict[int, list[float]] = {}
    for e in results:
        if e.get("score") is not None:
            per_round.setdefault(int(e["round"]), []).append(float(e["score"]))
    out, best = [], None
    for r in range(1, rounds + 1):
        if per_round.get(r):
            s = float(np.mean(per_round[r]))
            best = s if best is None else max(best, s)
        out.append(best)
    return out


async def run_search(cfg: Any, selection: str, out_dir: str, proposer: Any, evaluator: CachedEvaluator,
                     val: list, test: list, seed: int, rounds: int) -> dict:
    """``rounds`` optimizer rounds with ``selection``; the best validation workflow scored on ``test``."""
    from aflow_rl.envs.aflow.graph import Workflow
    from aflow_rl.envs.aflow.optimizer import Optimizer, initial_workflow, question_type

    a = dataclasses.replace(cfg.env.aflow, selection=selection, max_rounds=rounds, convergence_rounds=0)
    kind = question_type(val)
    opt = Optimizer(a, out_dir, proposer=proposer, evaluate=evaluator.on(val), initial=initial_workflow(a, kind),
                    seed=seed, kind=kind, num_problems=len(val), log=lambda msg: print(f"  {msg}", flush=True))
    t0 = time.perf_counter()
    summary = await opt.run()
    with open(os.path.join(out_dir, "best.yaml")) as fh:
        best = Workflow.from_yaml(fh.read())
    test_res = await evaluator.run(best, test)
    return {"test": test_res.score, "val": summary["best_score"], "best_round": summary["best_round"],
            "accepted": summary["accepted"], "rejected": summary["rejected"], "errors": summary["errors"],
            "curve": best_so_far(opt.results, rounds), "nodes": len(best.nodes),
            "ops": [n.op for n in best.nodes], "workflow": os.path.join(out_dir, "best.yaml"),
            "seconds": time.perf_counter() - t0}


async def run_seed(cfg: Any, seed: int, rounds: int, evaluator: CachedEvaluator, proposers: dict,
                   out: str) -> dict:
    """Every method of one seed; returns {method: row}."""
    from aflow_rl.envs.aflow.optimizer import initial_workflow, question_type

    val, test = seed_split(cfg, seed)
    io = initial_workflow(cfg.env.aflow, question_type(val))
    io_test, io_val = await evaluator.run(io, test), await evaluator.run(io, val)
    rows: dict[str, Any] = {"io": {"test": io_test.score, "val": io_val.score, "curve": [io_val.score] * rounds},
                            "split": {"val": len(val), "test": len(test)}}
    for method, selection in SEARCH_METHODS.items():
        if method not in proposers:
            continue
        print(f"seed {seed}: {method} ({selection} selection), {rounds} rounds", flush=True)
        # Every method of a seed draws from the same sampling seeds (common random numbers: a first
        # proposal from the same parent is the same proposal), and each seed from its own, in one
        # process or one per seed.
        rows[method] = await run_search(cfg, selection, os.path.join(out, f"seed{seed}", method),
                                        proposers[method].seeded(seed), evaluator, val, test, seed, rounds)
    return rows


# ---------------------------------------------------------------------------
# Servers, the trained checkpoint, the whole bench
# ---------------------------------------------------------------------------


def prepare_models(cfg: Any) -> None:
    """Build what the config's servers load and are allowed to build: SmolLM2 for an actor at a
    ``models/smol``-like path that is not there yet, the tiny model where ``build_tiny`` says so."""
    from aflow_rl.models import smol

    actor = cfg.serving.actor
    if actor.backend == "embedded" and not actor.build_tiny and not os.path.isfile(
            os.path.join(actor.model_path, "config.json")) and os.path.basename(actor.model_path.rstrip("/")) == "smol":
        print(f"building SmolLM2 at {actor.model_path} (python -m aflow_rl.models.smol)", flush=True)
        smol.build(actor.model_path)


def train_optimizer(config_path: str, overrides: list[str], steps: int, run_dir: str) -> str:
    """``python train.py CONFIG`` for ``steps`` steps under ``run_dir``; returns the last checkpoint's HF dir."""
    cmd = [sys.executable, "train.py", config_path, *overrides, f"trainer.max_steps={steps}", f"run.dir={run_dir}",
           f"trainer.save_every={steps}"]
    print("training the optimizer: " + " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise SystemExit(f"train.py exited with {proc.returncode}; see {run_dir}")
    return latest_hf(run_dir)


def latest_hf(run_dir: str) -> str:
    from aflow_rl.trainer.checkpoint import is_complete, step_of

    done = sorted((p for p in glob.glob(os.path.join(run_dir, "checkpoints", "step_*")) if is_complete(p)),
                  key=step_of)
    if not done:
        raise SystemExit(f"no complete checkpoint under {run_dir}/checkpoints")
    return os.path.join(done[-1], "hf")


def anchor_stats(run_dir: str) -> dict:
    """Per training step, from ``run_dir/episodes``: GiGPO anchor-state group fractions, and the learning curve
    (mean episode return, share of valid proposals, mean score of the proposed workflows)."""
    from aflow_rl.envs.aflow.episode import anchor_group_fraction, later_round_group_fraction
    from aflow_rl.rollout.types import Trajectory

    steps = []
    for path in sorted(glob.glob(os.path.join(run_dir, "episodes", "step_*.jsonl"))):
        with open(path) as fh:
            trajs = [Trajectory.from_dict(json.loads(line)) for line in fh if line.strip()]
        trajs = [t for t in trajs if t.ok]
        steps.append({"step": os.path.basename(path), "episodes": len(trajs),
                      "turns": sum(len(t.turns) for t in trajs), "fraction": anchor_group_fraction(trajs),
                      "later_rounds_fraction": later_round_group_fraction(trajs),
                      "return": _mean([t.metrics.get("episode_return", t.final_reward) for t in trajs]),
                      "valid": _mean([t.metrics["valid"] for t in trajs if "valid" in t.metrics]),
                      "child_score": _mean([t.metrics["child_score"] for t in trajs if "child_score" in t.metrics])})
    total = sum(s["turns"] for s in steps)
    mean = sum(s["fraction"] * s["turns"] for s in steps) / total if total else None
    return {"steps": steps, "fraction": mean}


def _mean(values: list) -> float | None:
    return float(np.mean(values)) if values else None


def run_of(checkpoint: str) -> str | None:
    """The training run a checkpoint came from (``RUN/checkpoints/step_N/hf`` -> ``RUN``), if its episodes are there."""
    run = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(checkpoint))))
    return run if os.path.isdir(os.path.join(run, "episodes")) else None


def _proposer(cfg: Any, client: Any, tokenizer: Any) -> Any:
    from aflow_rl.envs.aflow.graph import proposal_schema
    from aflow_rl.envs.aflow.optimizer import PolicyProposer

    a = cfg.env.aflow
    return PolicyProposer(client, tokenizer, temperature=cfg.env.temperature, max_new_tokens=cfg.env.max_new_tokens,
                          schema=proposal_schema(a))


async def _run_all(cfg: Any, urls: dict, trained_url: str | None, trained_path: str | None, seeds: list[int],
                   rounds: int, out: str, methods: list[str] | tuple = METHODS) -> tuple[dict, int]:
    from transformers import AutoTokenizer

    from aflow_rl.llm import make_client

    actor = make_client(cfg.llm.actor, urls["actor"], role="actor")
    clients = {"frozen": make_client(cfg.llm.policy, urls["policy"], role="policy")}
    frozen = _proposer(cfg, clients["frozen"], AutoTokenizer.from_pretrained(cfg.serving.policy.model_path))
    proposers = {"aflow": frozen, "mcts": frozen}
    if trained_url:
        clients["trained"] = make_client(cfg.llm.policy, [trained_url], role="policy")
        proposers["trained"] = _proposer(cfg, clients["trained"], AutoTokenizer.from_pretrained(trained_path))
    proposers = {m: p for m, p in proposers.items() if m in methods}
    evaluator = CachedEvaluator(cfg.env.aflow, actor)
    try:
        per_seed = {s: await run_seed(cfg, s, rounds, evaluator, proposers, out) for s in seeds}
    finally:
        for c in [actor, *clients.values()]:
            await c.aclose()
    return per_seed, evaluator.fresh


def methods_in(per_seed: dict) -> list[str]:
    """The methods of ``per_seed``: METHODS' order first, then renamed rows of a merge (``trained_grpo``)."""
    found = {m for r in per_seed.values() for m in r if m != "split"}
    return [m for m in METHODS if m in found] + sorted(found - set(METHODS))


def summarize(per_seed: dict) -> dict:
    """mean, half-range and per-seed values of each method's test and validation score."""
    rows = {}
    for method in methods_in(per_seed):
        vals = [r[method] for r in per_seed.values() if method in r]
        if not vals:
            continue
        test = [v["test"] for v in vals]
        rows[method] = {"test_mean": float(np.mean(test)), "test_spread": float((max(test) - min(test)) / 2),
                        "test": test, "val": [v["val"] for v in vals],
                        "nodes": [v.get("nodes", 1) for v in vals], "ops": [v.get("ops", ["Custom"]) for v in vals]}
    return rows


def run_bench(config: str, overrides: list[str], seeds: list[int], rounds: int, out: str,
              checkpoint: str = "", train_steps: int = 0, methods: list[str] | tuple = METHODS) -> dict:
    """The whole bench (module docstring); returns the JSON-able result."""
    from aflow_rl.bench.serving import start_server, stop_server
    from aflow_rl.config import load_config
    from aflow_rl.serving.manager import ServerManager

    cfg = load_config(config, [f"run.dir={out}", *overrides])
    load_1m = round(os.getloadavg()[0], 2)
    t0 = time.perf_counter()
    train = {}
    if train_steps and "trained" in methods:
        checkpoint = train_optimizer(config, overrides, train_steps, os.path.join(out, "train"))
        train = {"checkpoint": checkpoint, "seconds": time.perf_counter() - t0,
                 **anchor_stats(os.path.join(out, "train"))}
    elif checkpoint and "trained" in methods and (run := run_of(checkpoint)):
        train = {"checkpoint": checkpoint, **anchor_stats(run)}   # its learning curve, for the plot
    prepare_models(cfg)
    trained = None
    try:
        with ServerManager(cfg.serving, out, roles=("policy", "actor")) as servers:
            url = None
            if checkpoint and "trained" in methods:
                trained, url = start_server(checkpoint, None, os.path.join(out, "trained_server.log"))
            per_seed, fresh = asyncio.run(_run_all(cfg, servers.all_urls(), url, checkpoint, seeds, rounds, out,
                                                   methods))
    finally:
        if trained is not None:
            stop_server(trained)
    a = cfg.env.aflow
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
            "machine": machine(load_avg_1m_at_start=load_1m, load_avg_1m_at_end=round(os.getloadavg()[0], 2)),
            "args": {"config": config, "overrides": overrides, "seeds": seeds, "rounds": rounds,
                     "checkpoint": checkpoint, "dataset": a.dataset, "num_problems": a.num_problems,
                     "val_ratio": a.val_ratio, "executor": cfg.serving.actor.model_path,
                     "optimizer": cfg.serving.policy.model_path, "executor_max_tokens": a.executor_max_tokens,
                     "max_nodes": a.max_nodes, "methods": list(methods),
                     "instructions": list(a.instructions), "temperatures": list(a.temperatures)},
            "wall_s": time.perf_counter() - t0, "problem_results_computed": fresh, "train": train,
            "summary": summarize(per_seed), "per_seed": {str(s): r for s, r in per_seed.items()}}


# ---------------------------------------------------------------------------
# Report, plot, CLI
# ---------------------------------------------------------------------------


def report(result: dict) -> str:
    a, lines = result["args"], []
    lines.append(f"{a['dataset']}: {a['num_problems']} problems, val_ratio {a['val_ratio']}, seeds {a['seeds']}, "
                 f"{a['rounds']} rounds; executor {a['executor']}, optimizer {a['optimizer']}; "
                 f"wall {result['wall_s']:.0f} s, load {result['machine'].get('load_avg_1m_at_start')}")
    w = max([8, *map(len, result["summary"])])   # merged rows carry labels such as trained_grpo
    lines.append(f"{'method':{w}s}  {'test mean':>9s}  {'+-':>6s}  per seed (test)          val (best)")
    for method, r in result["summary"].items():
        lines.append(f"{method:{w}s}  {r['test_mean']:9.3f}  {r['test_spread']:6.3f}  "
                     f"{', '.join(f'{v:.3f}' for v in r['test']):24s} {', '.join(f'{v:.3f}' for v in r['val'])}")
    if result.get("train"):
        for label, t in train_runs(result).items():
            frac = "n/a" if t.get("fraction") is None else f"{t['fraction']:.2f}"
            steps = len(t["steps"]) if isinstance(t["steps"], list) else t["steps"]
            took = f" in {t['seconds']:.0f} s" if "seconds" in t else ""
            lines.append(f"{label} optimizer: {steps} steps{took}, GiGPO turns in anchor groups of >= 2: {frac}")
    return "\n".join(lines)


def train_runs(result: dict) -> dict[str, dict]:
    """The trainings behind the trained rows, per label (one run's ``train`` is unlabelled; a merge's is per label)."""
    train = result.get("train") or {}
    return {"trained": train} if "steps" in train else train


def markdown(result: dict) -> str:
    """The summary as a markdown table (what docs/benchmarks.md shows)."""
    lines = ["| method | test score, mean ± half-range | per seed (test) | best validation per seed | best workflow per seed |",
             "|---|---:|---|---|---|"]
    for method, r in result["summary"].items():
        ops = "; ".join(" → ".join(o) for o in r["ops"])
        lines.append(f"| {method} | {r['test_mean']:.3f} ± {r['test_spread']:.3f} | "
                     f"{', '.join(f'{v:.3f}' for v in r['test'])} | {', '.join(f'{v:.3f}' for v in r['val'])} | {ops} |")
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    """Best validation score so far per round, per selection method (mean over seeds, min-max band)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    training = {label: t["steps"] for label, t in train_runs(result).items() if isinstance(t.get("steps"), list)}
    fig, axes = plt.subplots(1, 2 if training else 1, figsize=(11 if training else 6, 4), squeeze=False)
    ax = axes[0][0]
    for method in methods_in(result["per_seed"]):
        curves = [r[method]["curve"] for r in result["per_seed"].values() if method in r]
        if not curves:
            continue
        arr = np.array([[np.nan if v is None else v for v in c] for c in curves], dtype=float)
        x = np.arange(1, arr.shape[1] + 1)
        ax.plot(x, np.nanmean(arr, 0), marker="o", label=method)
        ax.fill_between(x, np.nanmin(arr, 0), np.nanmax(arr, 0), alpha=0.15)
    ax.set_xlabel("round")
    ax.set_ylabel("best validation score so far")
    ax.set_title(f"AFlow search, {result['args']['dataset']}")
    ax.legend()
    if training:   # the optimizer's training: does what it proposes get better?
        tax = axes[0][1]
        for label, steps in training.items():
            x = np.arange(1, len(steps) + 1)
            for key, style in (("return", "-o"), ("child_score", "--s")):
                y = [np.nan if s.get(key) is None else s[key] for s in steps]
                tax.plot(x, y, style, markersize=3, label=f"{label}: {key.replace('_', ' ')}")
        tax.set_xlabel("optimizer step")
        tax.set_ylabel("mean over the step's episodes")
        tax.set_title("optimizer training")
        tax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _smoke_args(args: argparse.Namespace, out: str) -> tuple[list[str], list[int], int, str]:
    """The smoke run: tiny model for both roles (built under ``out``), 3 problems, 2 rounds, 1 seed."""
    tiny = os.path.join(out, "tiny")
    roles = [f"serving.{r}.{k}" for r in ("policy", "actor") for k in ("backend=embedded", f"model_path={tiny}",
                                                                      "build_tiny=tiny")]
    from aflow_rl.models.tiny import ensure

    ensure(tiny)
    return roles + SMOKE_OVERRIDES + args.overrides, [0], 2, tiny


def merge(paths: list[str]) -> dict:
    """One result from several runs of this bench (e.g. one process per method and seed on one GPU).

    ``PATH=LABEL`` renames that run's ``trained`` row to ``LABEL`` (two trained optimizers side by
    side). A method may come from one run per seed only; ``io`` must agree wherever it repeats (the
    executor answers at temperature 0, so a mismatch means the runs did not share a set-up).
    """
    per_seed: dict[str, dict] = {}
    runs = []
    for item in paths:
        path, _, label = item.partition("=")
        with open(path) as fh:
            run = json.load(fh)
        runs.append(run)
        for seed, rows in run["per_seed"].items():
            merged = per_seed.setdefault(seed, {})
            for method, row in rows.items():
                name = label if (label and method == "trained") else method
                if name in ("io", "split") and name in merged:
                    if merged[name] != row:
                        raise SystemExit(f"--merge: {path} seed {seed}: {name} differs from an earlier run's "
                                         f"({row} vs {merged[name]}); were these runs of the same config?")
                    continue
                if name in merged:
                    raise SystemExit(f"--merge: seed {seed} has {name!r} from two runs ({path} is the second); "
                                     "label trained rows with PATH=LABEL")
                merged[name] = row
    first = runs[0]
    return {**first, "args": {**first["args"], "methods": methods_in(per_seed),
                              "merged_from": paths, "seeds": sorted(int(s) for s in per_seed)},
            "wall_s": max(r["wall_s"] for r in runs), "problem_results_computed": sum(
                r.get("problem_results_computed", 0) for r in runs),
            "train": {p.partition("=")[2] or str(i): r["train"] for i, (p, r) in enumerate(zip(paths, runs))
                      if r.get("train")},
            "summary": summarize(per_seed), "per_seed": per_seed}


def write(result: dict, path: str) -> None:
    """``path`` (JSON) and the round plot beside it (.png)."""
    write_json(result, path)
    plot(result, os.path.splitext(path)[0] + ".png")
    print(f"wrote {path} and {os.path.splitext(path)[0]}.png")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m aflow_rl.bench.aflow_search", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=DEFAULT_CONFIG)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--rounds", type=int, default=5, help="optimizer rounds per search, round 1 (IO) included")
    ap.add_argument("--checkpoint", default="", help="HF dir of a trained optimizer policy (the trained row)")
    ap.add_argument("--train-steps", type=int, default=0, help="train the optimizer first for this many steps")
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS,
                    help="methods to run (io always runs: it is the baseline); trained runs only with a checkpoint")
    ap.add_argument("--out", default="runs/bench_aflow_search")
    ap.add_argument("--json", default="", help="write the numbers here and the plot beside it (.png)")
    ap.add_argument("--smoke", action="store_true", help="tiny models, 3 problems, 2 rounds, 1 seed")
    ap.add_argument("--merge", nargs="+", default=[], metavar="JSON[=LABEL]",
                    help="run nothing: merge these results (LABEL renames a run's trained row) into --json")
    ap.add_argument("overrides", nargs="*", help="config overrides key=value")
    args = ap.parse_args(argv)
    if args.merge:
        if not args.json:
            ap.error("--merge needs --json PATH for the merged result")
        result = merge(args.merge)
        print(report(result))
        write(result, args.json)
        return 0
    if args.rounds < 1 or args.train_steps < 0:
        ap.error("--rounds must be at least 1 and --train-steps at least 0")
    if args.checkpoint and args.train_steps:
        ap.error("give --checkpoint or --train-steps, not both")
    if args.checkpoint and not os.path.isfile(os.path.join(args.checkpoint, "config.json")):
        ap.error(f"--checkpoint {args.checkpoint}: no HF model there (expected .../checkpoints/step_N/hf)")
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    overrides, seeds, rounds, checkpoint = args.overrides, args.seeds, args.rounds, args.checkpoint
    if args.smoke:
        overrides, seeds, rounds, checkpoint = _smoke_args(args, out)
    result = run_bench(args.config, overrides, seeds, rounds, out, checkpoint, 0 if args.smoke else args.train_steps,
                       methods=args.methods)
    print(report(result))
    if args.json:
        write(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
