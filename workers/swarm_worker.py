"""Worker module of the swarm environment (``rollout.worker: workers.swarm_worker:run_episode``).

``init_worker(ctx)`` runs once per worker process: it builds the inference
clients the config needs (``llm.policy`` for the model orchestrator and the
Plan/Act planner, ``llm.actor`` for LLM subagents and the Plan/Act actor)
against ``ctx.urls``, loads the policy tokenizer from
``serving.policy.model_path``, and the orchestrator policy
(``env.swarm.policy``). Baseline policies with simulated subagents need no
server at all, which is how the pool runs deterministic baseline episodes.

``run_episode(task, ctx)`` dispatches on ``env.mode``: ``swarm`` runs the
orchestration episode, ``plan_act`` the planner/actor episode.
``make_tasks(cfg, n, seed)`` gives the tasks for either mode.
"""
from __future__ import annotations

from aflow_rl.envs.swarm.episode import run_swarm_episode
from aflow_rl.envs.swarm.kb import build_kb
from aflow_rl.envs.swarm.policies import make_policy
from aflow_rl.envs.swarm.tasks import make_tasks
from aflow_rl.rollout.traces import TraceWriter
from aflow_rl.rollout.types import Trajectory, WorkerContext

__all__ = ["init_worker", "make_tasks", "run_episode"]


def _client(ctx: WorkerContext, role: str):
    from aflow_rl.llm import make_client  # httpx and the providers load only where a server is used

    return make_client(getattr(ctx.config.llm, role), list(ctx.urls.get(role, [])), role=role)


def init_worker(ctx: WorkerContext) -> None:
    """Per-process setup; fills ``ctx.state`` (policy_client, actor_client, tokenizer, trace, swarm_policy)."""
    cfg, st = ctx.config, ctx.state
    plan_act = cfg.env.mode == "plan_act"
    needs_policy = plan_act or cfg.env.swarm.policy == "model"
    needs_actor = plan_act or cfg.env.swarm.subagents == "llm"
    st.setdefault("trace", TraceWriter.from_context(ctx))
    if needs_policy and "policy_client" not in st:
        st["policy_client"] = _client(ctx, "policy")
    if needs_actor and "actor_client" not in st:
        st["actor_client"] = _client(ctx, "actor")
    if needs_policy and "tokenizer" not in st:
        path = cfg.serving.policy.model_path
        if not path:
            raise ValueError("serving.policy.model_path: the model orchestrator needs its tokenizer "
                             "(set it to the policy model directory)")
        from transformers import AutoTokenizer

        st["tokenizer"] = AutoTokenizer.from_pretrained(path)
    if not plan_act and "swarm_policy" not in st:
        st["swarm_policy"] = make_policy(cfg, client=st.get("policy_client"), tokenizer=st.get("tokenizer"))
    st["swarm_ready"] = True


async def run_episode(task: dict, ctx: WorkerContext) -> Trajectory:
    """One episode of ``task``; Plan/Act or swarm per ``env.mode``."""
    if not ctx.state.get("swarm_ready"):
        init_worker(ctx)  # direct callers (tests, benchmarks) may skip the pool's start-up call
    cfg = ctx.config
    if cfg.env.mode == "plan_act":
        from aflow_rl.envs.swarm.plan_act import run_plan_act_episode

        return await run_plan_act_episode(task, ctx)
    executor = None
    if cfg.env.swarm.subagents == "llm":
        from aflow_rl.envs.swarm.llm_subagents import LLMSubagents

        executor = LLMSubagents(ctx.state["actor_client"], build_kb(int(task.get("kb_seed", cfg.env.swarm.kb_seed))))
    return await run_swarm_episode(task, cfg, ctx.state["swarm_policy"], executor=executor,
                                   trace=ctx.state.get("trace"))
