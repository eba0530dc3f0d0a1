"""Training on the search: one episode = ``env.aflow.episode_rounds`` workflow proposals from a parent.

``make_tasks(cfg, n, seed)`` draws ``n`` parents from the shared search
state under ``run_dir/search`` (the experience pool's executed workflows,
selected by ``env.aflow.selection`` exactly as the search selects them); the
pool runs ``group_size`` episodes per task, so a GRPO group is several
proposals from the same parent. ``run_proposal_episode(task, ctx)`` makes one
proposal turn (``generate_turn``, anchor key = the parent's hash, the GiGPO
anchor state), validates the child, evaluates it on the validation split and
records the experience, so training and search grow the same tree.

With ``episode_rounds`` K > 1 the episode goes on from the result (propose
-> evaluate -> propose from the result): round t+1 proposes from round t's
child when that child scored strictly better than its parent, else from the
same parent again (``next_parent``). Each round is one turn whose anchor key
is the workflow it proposed from, so rounds of a group's episodes that stand
on the same intermediate workflow (the shared start, a child two episodes
both found, or a parent all their children failed to beat) form GiGPO
anchor-state step groups; with K = 1 every step group equals its episode
group and GiGPO reduces to GRPO. Round t's reward below is turn t's
``step_reward`` (the last round's is the terminal reward), so the episode's
return is the sum over its rounds.

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
from collections import Counter
from typing import Any, Sequence

import numpy as np

from aflow_rl.algos.advantages import step_group_fraction
from aflow_rl.envs.aflow.experience import SharedExperiencePool
from aflow_rl.envs.aflow.graph import Workflow, proposal_schema, workflow_hash
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


def next_parent(parent: TreeNode, outcome: Any) -> TreeNode:
    """The workflow the next round of an episode proposes from: the child when it scored strictly
    better than its parent, else the parent again (a rejected or no-better child changes nothing).

    Staying on the parent is what makes rounds of different episodes meet in the same anchor state."""
    if not outcome.accepted or outcome.child_score is None or outcome.child_score <= parent.score:
        return parent
    return TreeNode(hash=outcome.child_hash, round=parent.round + 1, score=float(outcome.child_score),
                    parent_hash=parent.hash, workflow=outcome.child_yaml)


async def _propose_round(parent: TreeNode, task: dict, ctx: WorkerContext, evaluate, pool: SharedExperiencePool,
                         rnd: int) -> tuple[Any, Any]:
    """One round of an episode from ``parent``: generate (anchor key = parent hash), validate, evaluate, record."""
    cfg, st = ctx.config, ctx.state
    a = cfg.env.aflow
    seed, sample = int(task.get("seed", 0)), int(task.get("sample", 0))
    # Round 0 keeps the single-round episode's seeding, so old runs replay.
    rng = np.random.default_rng(seed * 1_000_003 + sample if rnd == 0 else [seed, sample, rnd])
    state = build_state(parent, pool, rng, failures_shown=a.failures_shown, kind=task.get("kind", ""),
                        max_nodes=a.max_nodes, compact=a.prompt == "compact")
    proposer = PolicyProposer(st["policy_client"], st["tokenizer"], temperature=cfg.env.temperature,
                              max_new_tokens=cfg.env.max_new_tokens,
                              schema=proposal_schema(a))
    proposal = await proposer(state)
    outcome = await assess(proposal.text, parent, evaluate=evaluate, runs=a.validation_runs, max_nodes=a.max_nodes,
                           max_samples=a.max_samples, max_loop_rounds=a.max_loop_rounds, penalty=a.format_penalty)
    episode_id = str(task.get("episode_id", task["task_id"]))
    key = f"train/{episode_id}" if rnd == 0 else f"train/{episode_id}/r{rnd}"
    pool.add(to_experience(outcome, parent, round=0, source="train", key=key,
                           info={"finish_reason": proposal.finish_reason, "episode_round": rnd}))
    return proposal, outcome


async def run_proposal_episode(task: dict, ctx: WorkerContext) -> Trajectory:
    """``env.aflow.episode_rounds`` rounds from the task's parent, each proposing from the previous
    round's result (``next_parent``). Round t's reward (``rewards``) is turn t's ``step_reward``; the
    last round's is the episode's terminal reward, so an episode's return is the sum over its rounds."""
    from aflow_rl.envs.aflow.datasets import Problem

    t0 = time.perf_counter()
    cfg, st = ctx.config, ctx.state
    a = cfg.env.aflow
    if "aflow_pool" not in st:
        st["aflow_pool"] = SharedExperiencePool(pool_path(ctx.run_dir or cfg.run_dir))
    pool: SharedExperiencePool = st["aflow_pool"]
    evaluate = make_evaluate(a, st["actor_client"], [Problem(**p) for p in task["problems"]])
    parent = await _scored_parent(task, pool, evaluate, ctx)
    start = parent
    rounds: list[tuple[TreeNode, Any, Any, dict]] = []
    for rnd in range(int(a.episode_rounds)):
        proposal, outcome = await _propose_round(parent, task, ctx, evaluate, pool, rnd)
        comps = rewards(parent.score, outcome.child_score if outcome.accepted else None, a.format_penalty)
        if proposal.turn is not None:
            proposal.turn.step_reward = comps["r_perf"] + comps["format"]
        rounds.append((parent, proposal, outcome, comps))
        parent = next_parent(parent, outcome)
    return _trajectory(task, start, parent, rounds, time.perf_counter() - t0)


def _trajectory(task: dict, start: TreeNode, end: TreeNode, rounds: list, seconds: float) -> Trajectory:
    """The episode's record: one turn per round; the last round's reward is the terminal one."""
    turns = [p.turn for _, p, _, _ in rounds if p.turn is not None]
    if turns:
        turns[-1].step_reward = 0.0  # the last round's reward travels as the terminal reward instead
    _, last_proposal, last, comps = rounds[-1]
    accepted = [o for _, _, o, _ in rounds if o.accepted]
    child_nodes = len(last.child.nodes) if last.child is not None else 0
    episode_id = str(task.get("episode_id", task["task_id"]))
    return Trajectory(
        episode_id=episode_id, group_id=str(task.get("group_id", task["task_id"])),
        attempt=int(task.get("attempt", 1)), turns=turns,
        final_reward=comps["r_perf"] + comps["format"], reward_components=comps,
        metrics={"valid": len(accepted) / len(rounds), "parent_score": start.score,
                 "child_score": last.child_score if last.accepted else 0.0,
                 "improvement": last.improvement if last.accepted else 0.0,
                 "episode_improvement": end.score - start.score,
                 "episode_return": float(sum(c["r_perf"] + c["format"] for _, _, _, c in rounds)),
                 "child_nodes": float(child_nodes), "eval_cost_usd": float(sum(o.cost_usd for _, _, o, _ in rounds)),
                 "wall_clock_ms": 1000 * seconds},
        info={"parent_hash": start.hash, "parent_round": start.round, "child_hash": last.child_hash,
              "modification": last.modification, "reason": last.reason, "proposal": last_proposal.text,
              "rounds": [{"parent_hash": p.hash, "child_hash": o.child_hash, "accepted": o.accepted,
                          "child_score": o.child_score, "reason": o.reason, "modification": o.modification}
                         for p, _, o, _ in rounds]})


def anchor_group_fraction(trajectories: Sequence[Trajectory]) -> float:
    """Share of the turns of ``trajectories`` that fall in GiGPO step groups of two or more.

    A step group is GiGPO's: the turns of one task group (``group_id``) with the same
    ``anchor_key`` (``algos.advantages.gigpo``); turns without an anchor key are groups of
    their own. 0.0 for no turns. With single-round AFlow episodes every turn of a group shares
    the parent's key, so this is 1.0 and says nothing; what matters with ``episode_rounds`` > 1
    is the share beyond the first round (``anchor_group_fraction`` of the later turns alone).
    """
    return step_group_fraction(trajectories)


def later_round_group_fraction(trajectories: Sequence[Trajectory]) -> float:
    """``anchor_group_fraction`` counted over the turns after each episode's first only (their
    groups still include first-round turns): the anchor sharing multi-round episodes add."""
    keys = [(t.group_id, turn.anchor_key) for t in trajectories for turn in t.turns]
    later = [(t.group_id, turn.anchor_key) for t in trajectories for turn in t.turns[1:]]
    if not later:
        return 0.0
    counts = Counter(k for k in keys if k[1] is not None)
    return sum(1 for k in later if k[1] is not None and counts[k] >= 2) / len(later)
