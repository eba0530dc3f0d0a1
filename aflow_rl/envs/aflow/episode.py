"""Training on the search: one episode = one workflow proposal from a parent.

``make_tasks(cfg, n, seed)`` draws ``n`` parents from the shared search
state under ``run_dir/search`` (the experience pool's executed workflows,
selected by ``env.aflow.selection`` exactly as the search selects them); the
pool runs ``group_size`` episodes per task, so a GRPO group is several
proposals from the same parent. ``run_proposal_episode(task, ctx)`` makes one
proposal turn (``generate_turn``, anchor key = the parent's hash, the GiGPO
anchor state), validates the child, evaluates it on the validation split and
records the experience, so training and search grow the same tree.

Reward (components as the trainer shapes them, ``final = r_perf + format``):

    valid child, score s_c:      r_perf = (s_c − s_p) + s_c      format = 0
    rejected (invalid/unchanged): r_perf = (0 − s_p) + 0 = −s_p   format = env.aflow.format_penalty

i.e. the validation improvement over the parent plus the child's absolute
score, with a rejected proposal scored as a child that solves nothing, plus
the format penalty. Within a group s_p is constant, so the group advantage
ranks children by s_c; a rejected proposal is always below any executed one;
and across groups the absolute term keeps improving a weak parent from
paying more than matching a strong one. Copying the parent is rejected
("unchanged"), so it cannot collect s_p for free.

Before any workflow is scored, tasks carry the initial workflow with
``parent_score`` None; the first episode to run evaluates it (once per
process, the pool keeping the first record written) and every episode then
uses the stored score.
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from typing import Any

import numpy as np

from aflow_rl.envs.aflow.experience import SharedExperiencePool
from aflow_rl.envs.aflow.graph import Workflow, workflow_hash, workflow_schema
from aflow_rl.envs.aflow.mcts import SearchTree, TreeNode, TreeSelector
from aflow_rl.envs.aflow.optimizer import (PolicyProposer, assess, build_state, evaluate_runs, initial_workflow,
                                           make_evaluate, pool_path, question_type, to_experience)
from aflow_rl.rollout.types import Trajectory, WorkerContext


@functools.lru_cache(maxsize=4)
def _validation_dicts(dataset: str, num_problems: int, val_ratio: float, split_seed: int) -> tuple[dict, ...]:
    """The validation split as JSON-safe problem dicts (cached: make_tasks runs every step)."""
    from aflow_rl.envs.aflow.datasets import load_dataset, split

    val, _test = split(load_dataset(dataset, num_problems=num_problems), val_ratio, split_seed)
    return tuple(dataclasses.asdict(p) if dataclasses.is_dataclass(p) else dict(p) for p in val)


def validation_problems(cfg: Any) -> list[dict]:
    a = cfg.env.aflow
    return list(_validation_dicts(a.dataset, a.num_problems, a.val_ratio, a.split_seed))


def rewards(parent_score: float, child_score: float | None, penalty: float) -> dict[str, float]:
    """Reward components of a proposal (see the module docstring); None: rejected."""
    if child_score is None:
        return {"r_perf": -parent_score, "r_parallel": 0.0, "r_finish": 0.0, "format": penalty}
    return {"r_perf": (child_score - parent_score) + child_score, "r_parallel": 0.0, "r_finish": 0.0,
            "format": 0.0}


def make_tasks(cfg: Any, n: int, seed: int) -> list[dict]:
    """``n`` tasks, each a parent drawn from the shared search state plus the validation problems."""
    a = cfg.env.aflow
    problems = validation_problems(cfg)
    kind = question_type(problems)
    pool = SharedExperiencePool(pool_path(cfg.run_dir))
    tree = SearchTree.from_pool(pool)
    if len(tree) == 0:
        root = initial_workflow(a, kind)
        parents = [TreeNode(hash=workflow_hash(root), round=1, score=float("nan"), workflow=root.to_yaml())] * n
    else:
        selector = TreeSelector(pool, mode=a.selection, prior_weight=a.prior_weight, top_k=a.top_k,
                                q_prior_count=a.q_prior_count, c_puct=a.c_puct)
        # All n parents are chosen before any episode runs: select_many spreads them (virtual visits).
        parents = selector.select_many(tree, n, np.random.default_rng(seed))
    pool.close()
    return [{"task_id": f"aflow/{seed}/{i}", "seed": int(seed) * 1000 + i, "parent_hash": p.hash,
             "parent_round": p.round, "parent_score": None if np.isnan(p.score) else p.score,
             "parent_yaml": p.workflow, "kind": kind, "problems": problems}
            for i, p in enumerate(parents)]


async def _scored_parent(task: dict, pool: SharedExperiencePool, evaluate, ctx: WorkerContext) -> TreeNode:
    """The task's parent with its score; evaluates the initial workflow if nobody has yet."""
    node = TreeNode(hash=task["parent_hash"], round=int(task["parent_round"]), score=0.0,
                    workflow=task["parent_yaml"])
    if task.get("parent_score") is not None:
        node.score = float(task["parent_score"])
        return node
    # One evaluation per process (per event loop: a Lock belongs to its loop); across processes
    # the first record written wins and everyone reads it back.
    locks = ctx.state.setdefault("aflow_root_locks", {})
    lock = locks.setdefault((id(asyncio.get_running_loop()), node.hash), asyncio.Lock())
    async with lock:
        scored = [r for r in pool.by_child(node.hash) if r.accepted and r.child_score is not None]
        if not scored:
            wf = Workflow.from_yaml(node.workflow)
            outcome = await evaluate_runs(wf, evaluate, ctx.config.env.aflow.validation_runs)
            outcome.child, outcome.child_hash, outcome.modification = wf, node.hash, "initial workflow"
            pool.add(to_experience(outcome, None, round=1, source="train", key=f"root/{node.hash}"),
                     on_conflict="ignore")
            scored = [r for r in pool.by_child(node.hash) if r.accepted and r.child_score is not None]
    node.score = float(np.mean([r.child_score for r in scored]))
    return node


async def run_proposal_episode(task: dict, ctx: WorkerContext) -> Trajectory:
    """One proposal from the task's parent: generate, validate, evaluate, record, reward."""
    from aflow_rl.envs.aflow.datasets import Problem

    t0 = time.perf_counter()
    cfg, st = ctx.config, ctx.state
    a = cfg.env.aflow
    if "aflow_pool" not in st:
        st["aflow_pool"] = SharedExperiencePool(pool_path(ctx.run_dir or cfg.run_dir))
    pool: SharedExperiencePool = st["aflow_pool"]
    evaluate = make_evaluate(a, st["actor_client"], [Problem(**p) for p in task["problems"]])
    parent = await _scored_parent(task, pool, evaluate, ctx)
    rng = np.random.default_rng(int(task.get("seed", 0)) * 1_000_003 + int(task.get("sample", 0)))
    state = build_state(parent, pool, rng, failures_shown=a.failures_shown, kind=task.get("kind", ""),
                        max_nodes=a.max_nodes, compact=a.prompt == "compact")
    proposer = PolicyProposer(st["policy_client"], st["tokenizer"], temperature=cfg.env.temperature,
                              max_new_tokens=cfg.env.max_new_tokens,
                              schema=workflow_schema(a.max_nodes, a.max_samples, a.max_loop_rounds))
    proposal = await proposer(state)
    outcome = await assess(proposal.text, parent, evaluate=evaluate, runs=a.validation_runs, max_nodes=a.max_nodes,
                           max_samples=a.max_samples, max_loop_rounds=a.max_loop_rounds, penalty=a.format_penalty)
    episode_id = str(task.get("episode_id", task["task_id"]))
    pool.add(to_experience(outcome, parent, round=0, source="train", key=f"train/{episode_id}",
                           info={"finish_reason": proposal.finish_reason}))
    comps = rewards(parent.score, outcome.child_score if outcome.accepted else None, a.format_penalty)
    child_nodes = len(outcome.child.nodes) if outcome.child is not None else 0
    return Trajectory(
        episode_id=episode_id, group_id=str(task.get("group_id", task["task_id"])),
        attempt=int(task.get("attempt", 1)), turns=[proposal.turn] if proposal.turn is not None else [],
        final_reward=comps["r_perf"] + comps["format"], reward_components=comps,
        metrics={"valid": float(outcome.accepted), "parent_score": parent.score,
                 "child_score": outcome.child_score if outcome.accepted else 0.0,
                 "improvement": outcome.improvement if outcome.accepted else 0.0,
                 "child_nodes": float(child_nodes), "eval_cost_usd": outcome.cost_usd,
                 "wall_clock_ms": 1000 * (time.perf_counter() - t0)},
        info={"parent_hash": parent.hash, "parent_round": parent.round, "child_hash": outcome.child_hash,
              "modification": outcome.modification, "reason": outcome.reason, "proposal": proposal.text})
