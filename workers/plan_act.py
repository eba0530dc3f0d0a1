"""Worker module of the Plan/Act environment (``env.name: plan_act``): the contract of docs/architecture.md.

``init_worker(ctx)`` runs once per worker process: the planner's client
(``llm.policy``, the trained model, which must return token ids and logprobs),
the actor's client (``llm.actor``, frozen), and the planner's tokenizer
(``serving.policy.model_path``). ``make_tasks(cfg, n, seed)`` draws reasoning-gym
problems (``env.plan_act.dataset``); ``run_episode(task, ctx)`` runs one
planner turn (bounded by ``env.plan_act.timeout_s``, with the actor-alone
fallback) and the actor's execution of the plan (aflow_rl/envs/plan_act/).
"""
from __future__ import annotations

from aflow_rl.envs.clients import policy_tokenizer, role_client
from aflow_rl.envs.plan_act.episode import run_plan_act_episode
from aflow_rl.envs.plan_act.tasks import make_tasks
from aflow_rl.rollout.traces import TraceWriter
from aflow_rl.rollout.types import Trajectory, WorkerContext

__all__ = ["init_worker", "make_tasks", "run_episode"]


def init_worker(ctx: WorkerContext) -> None:
    """Per-process setup; fills ``ctx.state`` (policy_client, actor_client, tokenizer, trace)."""
    st = ctx.state
    st.setdefault("trace", TraceWriter.from_context(ctx))
    for role in ("policy", "actor"):
        if f"{role}_client" not in st:
            st[f"{role}_client"] = role_client(ctx, role)
    if "tokenizer" not in st:
        st["tokenizer"] = policy_tokenizer(ctx.config, "the Plan/Act planner")
    st["plan_act_ready"] = True


async def run_episode(task: dict, ctx: WorkerContext) -> Trajectory:
    """One Plan/Act episode of ``task``."""
    if not ctx.state.get("plan_act_ready"):
        init_worker(ctx)  # direct callers (tests, benchmarks) may skip the pool's start-up call
    return await run_plan_act_episode(task, ctx)
