"""What does an optimizer policy propose? Proposal statistics per policy, without running a workflow.

    python -m aflow_rl.bench.proposals --config configs/aflow_smol.yaml \\
        --policy frozen=models/tiny --policy grpo=RUN/checkpoints/step_3/hf --samples 128 --json PATH

An AFlow search of 8 rounds sees 7 proposals, so its test score says little about the policy that
proposed them (docs/benchmarks.md: the trained-optimizer rows move with which few proposals a
policy happens to sample). This bench asks the policy directly. It samples ``--samples`` proposals
from the search's starting state: the round-1 workflow, no history, the config's prompt, grammar
and temperature. Each proposal is judged as a search round judges it before running it
(``optimizer.judge``):

- rejected as invalid: the graph breaks the operators' rules;
- rejected as unchanged: it equals its parent;
- new: a valid, different workflow.

``--parent FILE.yaml[=SCORE]`` draws the same proposals (the same sampling seeds) from another
parent as well, and reports how often the k-th proposal is the same workflow as from the round-1
parent. A policy that reads its observation proposes different workflows for different parents.
One that ignores it proposes the same workflow, and then no parent selection (AFlow's or MCTS's)
can change what a search finds.

For new workflows it also counts the operators. On rg:chain_sum the share of proposals with a
``Programmer`` node is the one that decides a search: SmolLM2 solves those problems only through
code (IO 0.002, Programmer workflows 0.1-0.3).

Shares come with a binomial standard error, sqrt(p (1 - p) / n). Every policy draws its k-th
proposal with the same sampling seed, so the bench also reports each policy's paired difference
from the first one (``vs_first``: mean of d_k = x_k(policy) - x_k(first), standard error
sd(d) / sqrt(n)). Nothing here calls the executor, so it runs on a CPU in about a minute per policy
for 512 samples (2 cores, load 1).
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import datetime
import math
import os
import sys
from typing import Any

from aflow_rl.bench import machine, write_json

DEFAULT_CONFIG = "configs/aflow_smol.yaml"
SMOKE_SAMPLES = 4


def share(k: int, n: int) -> dict:
    """``k`` of ``n`` as a share with its binomial standard error."""
    p = k / n if n else 0.0
    return {"share": p, "se": math.sqrt(p * (1.0 - p) / n) if n else 0.0, "count": k}


def verdict(o: Any) -> str:
    """One judged proposal as a word: invalid | unchanged | new | programmer (new, with a Programmer node)."""
    if o.accepted:
        return "programmer" if any(node.op == "Programmer" for node in o.child.nodes) else "new"
    return "unchanged" if o.child is not None else "invalid"


def paired_difference(first: list[str], other: list[str], kinds: tuple[str, ...]) -> dict:
    """Mean and standard error of d_k = [other_k in kinds] - [first_k in kinds] over paired samples."""
    d = [float(b in kinds) - float(a in kinds) for a, b in zip(first, other, strict=True)]
    n = len(d)
    mean = sum(d) / n if n else 0.0
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1)) if n > 1 else 0.0
    return {"diff": mean, "se": sd / math.sqrt(n) if n else 0.0}


def tally(outcomes: list[Any], finish_reasons: list[str]) -> dict:
    """Shares of a policy's judged proposals (``optimizer.Outcome``s), and each one's ``verdict``."""
    n = len(outcomes)
    verdicts = [verdict(o) for o in outcomes]
    count = collections.Counter(verdicts)
    new = [o for o in outcomes if o.accepted]
    ops = collections.Counter(node.op for o in new for node in o.child.nodes)
    with_op = collections.Counter(op for o in new for op in {node.op for node in o.child.nodes})
    return {"n": n, "new": share(count["new"] + count["programmer"], n), "unchanged": share(count["unchanged"], n),
            "invalid": share(count["invalid"], n), "programmer": share(count["programmer"], n),
            "truncated": share(sum(r == "length" for r in finish_reasons), n),
            "mean_nodes_new": sum(len(o.child.nodes) for o in new) / len(new) if new else 0.0,
            "operator_nodes": dict(ops.most_common()),
            "proposals_with_operator": dict(with_op.most_common()),
            "top_reasons": collections.Counter(o.reason.split(":")[0] for o in outcomes
                                               if not o.accepted).most_common(5),
            "verdicts": verdicts}


def round1_parent(cfg: Any) -> tuple[Any, str]:
    """The search's starting parent (the round-1 workflow, scored 0: IO's validation score on rg:chain_sum is
    0.000-0.001) and the question type its prompt names."""
    from aflow_rl.envs.aflow.episode import validation_problems
    from aflow_rl.envs.aflow.graph import workflow_hash
    from aflow_rl.envs.aflow.mcts import TreeNode
    from aflow_rl.envs.aflow.optimizer import initial_workflow, question_type

    kind = question_type(validation_problems(cfg))
    root = initial_workflow(cfg.env.aflow, kind)
    return TreeNode(hash=workflow_hash(root), round=1, score=0.0, workflow=root.to_yaml()), kind


def load_parent(item: str) -> Any:
    """``FILE.yaml[=SCORE]`` -> a parent node (score 0 unless given); the workflow must be valid YAML."""
    from aflow_rl.envs.aflow.graph import Workflow, WorkflowError, workflow_hash
    from aflow_rl.envs.aflow.mcts import TreeNode

    path, sep, score = item.partition("=")
    try:
        with open(path) as fh:
            wf = Workflow.from_yaml(fh.read())
        return TreeNode(hash=workflow_hash(wf), round=2, score=float(score) if sep else 0.0, workflow=wf.to_yaml())
    except (OSError, WorkflowError, ValueError) as exc:
        raise ValueError(f"--parent {item}: {exc}") from None


def same_workflow(first: list[Any], other: list[Any]) -> dict:
    """Share of draws k where both proposals parse to the same workflow (``Outcome.child_hash``)."""
    k = sum(1 for a, b in zip(first, other, strict=True) if a.child is not None and a.child_hash == b.child_hash)
    return share(k, len(first))


async def sample_policy(cfg: Any, url: str, model_path: str, samples: int, seed: int = 0,
                        parents: list[tuple[str, Any]] = ()) -> dict:
    """``samples`` proposals of the policy at ``url`` from the round-1 state, judged and tallied; then the same
    draws (the same sampling seeds) from each of ``parents`` ((name, node)), and how often the proposal is the
    same workflow whatever the parent: a policy that ignores its observation proposes the same workflow.

    The k-th proposal of every policy has the same sampling seed (``PolicyProposer.seeded``): the
    policies are compared on common random numbers, and a rerun reproduces the draws."""
    from transformers import AutoTokenizer

    from aflow_rl.bench.aflow_search import _proposer
    from aflow_rl.envs.aflow.optimizer import WorkflowState, judge
    from aflow_rl.llm import make_client

    a = cfg.env.aflow
    root, kind = round1_parent(cfg)
    client = make_client(cfg.llm.policy, [url], role="policy")
    base = _proposer(cfg, client, AutoTokenizer.from_pretrained(model_path))

    async def draw(parent: Any) -> tuple[list, list]:
        state = WorkflowState(parent_hash=parent.hash, parent_round=parent.round, parent_score=parent.score,
                              parent_yaml=parent.workflow, kind=kind, max_nodes=a.max_nodes,
                              compact=a.prompt == "compact")
        proposer = base.seeded(seed)
        proposals = await asyncio.gather(*(proposer(state) for _ in range(samples)))
        return proposals, [judge(p.text, parent, max_nodes=a.max_nodes, max_samples=a.max_samples,
                                 max_loop_rounds=a.max_loop_rounds, penalty=a.format_penalty) for p in proposals]

    try:
        proposals, outcomes = await draw(root)
        row = {"model": model_path, **tally(outcomes, [p.finish_reason for p in proposals]),
               "examples": [p.text for p in proposals[:3]], "from": {}}
        for name, parent in parents:
            props, outs = await draw(parent)
            row["from"][name] = {**tally(outs, [p.finish_reason for p in props]),
                                 "same_workflow_as_round1": same_workflow(outcomes, outs)}
    finally:
        await client.aclose()
    return row


def run_bench(config: str, overrides: list[str], policies: dict[str, str], samples: int, out: str,
              seed: int = 0, parents: list[tuple[str, Any]] = ()) -> dict:
    """Every policy in turn, each on its own embedded server (stopped before the next starts); ``parents``:
    (name, node) pairs from ``load_parent``."""
    from aflow_rl.bench.serving import start_server, stop_server
    from aflow_rl.config import load_config

    cfg = load_config(config, [f"run.dir={out}", *overrides])
    load_1m = round(os.getloadavg()[0], 2)
    rows = {}
    for label, path in policies.items():
        proc, url = start_server(path, cfg.serving.policy.threads, os.path.join(out, f"{label}_server.log"))
        try:
            rows[label] = asyncio.run(sample_policy(cfg, url, path, samples, seed, parents))
        finally:
            stop_server(proc)
    first = next(iter(rows.values()))["verdicts"]
    for r in list(rows.values())[1:]:
        r["vs_first"] = {"new": paired_difference(first, r["verdicts"], ("new", "programmer")),
                         "programmer": paired_difference(first, r["verdicts"], ("programmer",))}
    a = cfg.env.aflow
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
            "machine": machine(load_avg_1m_at_start=load_1m, load_avg_1m_at_end=round(os.getloadavg()[0], 2)),
            "args": {"config": config, "overrides": overrides, "samples": samples, "seed": seed, "dataset": a.dataset,
                     "temperature": cfg.env.temperature, "max_new_tokens": cfg.env.max_new_tokens,
                     "prompt": a.prompt, "max_nodes": a.max_nodes,
                     "parents": {name: {"score": node.score, "workflow": node.workflow} for name, node in parents}},
            "policies": rows}


def report(result: dict) -> str:
    w = max([8, *map(len, result["policies"])])
    lines = [f"{result['args']['dataset']}: {result['args']['samples']} proposals per policy from the round-1 "
             f"workflow, temperature {result['args']['temperature']}",
             f"{'policy':{w}s}  {'new':>13s}  {'unchanged':>13s}  {'invalid':>13s}  {'Programmer':>13s}  nodes"]
    for label, r in result["policies"].items():
        cells = "  ".join(f"{r[k]['share']:6.3f}±{r[k]['se']:.3f}" for k in ("new", "unchanged", "invalid",
                                                                          "programmer"))
        lines.append(f"{label:{w}s}  {cells}  {r['mean_nodes_new']:.2f}")
    first = next(iter(result["policies"]))
    for label, r in result["policies"].items():
        if "vs_first" in r:
            v = r["vs_first"]
            lines.append(f"{label} - {first} (paired): new {v['new']['diff']:+.3f}±{v['new']['se']:.3f}, "
                         f"Programmer {v['programmer']['diff']:+.3f}±{v['programmer']['se']:.3f}")
    for label, r in result["policies"].items():
        for name, f in r.get("from", {}).items():
            same = f["same_workflow_as_round1"]
            lines.append(f"{label} from {name}: new {f['new']['share']:.3f}, Programmer {f['programmer']['share']:.3f}, "
                         f"the same workflow as from round 1 in {same['share']:.3f}±{same['se']:.3f} of the draws")
    return "\n".join(lines)


def parse_policies(items: list[str]) -> dict[str, str]:
    """``LABEL=HF_DIR`` items (or a bare HF_DIR, labelled by its position) -> {label: dir}; dirs must hold a model."""
    policies: dict[str, str] = {}
    for i, item in enumerate(items):
        label, sep, path = item.partition("=")
        if not sep:
            label, path = f"policy{i}", item
        if label in policies:
            raise ValueError(f"--policy {item}: the label {label!r} is given twice")
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ValueError(f"--policy {item}: no HF model at {path} (expected a model dir such as models/tiny "
                             f"or .../checkpoints/step_N/hf)")
        policies[label] = path
    return policies


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m aflow_rl.bench.proposals", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=DEFAULT_CONFIG)
    ap.add_argument("--policy", action="append", default=[], metavar="LABEL=HF_DIR",
                    help="a policy to sample (repeat; default: frozen=the config's serving.policy.model_path)")
    ap.add_argument("--samples", type=int, default=128, help="proposals per policy")
    ap.add_argument("--parent", action="append", default=[], metavar="FILE.yaml[=SCORE]",
                    help="also draw the same proposals from this parent workflow (repeat): does the policy read it?")
    ap.add_argument("--seed", type=int, default=0, help="sampling seeds seed*2**20 + k, the same for every policy")
    ap.add_argument("--out", default="runs/bench_proposals", help="server logs")
    ap.add_argument("--json", default="", help="write the numbers here")
    ap.add_argument("--smoke", action="store_true", help=f"{SMOKE_SAMPLES} proposals per policy")
    ap.add_argument("overrides", nargs="*", help="config overrides key=value")
    args = ap.parse_args(argv)
    if args.samples < 1:
        ap.error("--samples must be at least 1")
    from aflow_rl.config import load_config
    from aflow_rl.models import tiny

    items = args.policy
    if not items:
        p = load_config(args.config, args.overrides).serving.policy
        if p.build_tiny:
            tiny.ensure(p.model_path, preset=p.build_tiny)
        items = [f"frozen={p.model_path}"]
    try:
        policies = parse_policies(items)
        parents = [(os.path.basename(item.partition("=")[0]), load_parent(item)) for item in args.parent]
    except ValueError as exc:
        ap.error(str(exc))
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    result = run_bench(args.config, args.overrides, policies, SMOKE_SAMPLES if args.smoke else args.samples, out,
                       args.seed, parents)
    print(report(result))
    if args.json:
        print(f"wrote {write_json(result, args.json)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
