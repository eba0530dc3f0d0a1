"""Worker module of the swarm environment (``env.name: swarm``): the contract of docs/architecture.md.

``init_worker(ctx)`` runs once per worker process: it builds the inference
clients the config needs (``llm.policy`` for the model orchestrator,
``llm.actor`` for LLM subagents) against ``ctx.urls``, loads the policy
tokenizer from ``serving.policy.model_path``, and the orchestrator policy
(``env.swarm.policy``). Baseline policies with simulated subagents need no
server at all, which is how the pool runs deterministic baseline episodes.

``make_tasks(cfg, n, seed)`` draws wide/deep/mixed tasks (``env.swarm``);
``run_episode(task, ctx)`` runs one orchestration episode.
"""
from __future__ import annotations

from aflow_rl.envs.clients import policy_tokenizer, role_client
from aflow_rl.envs.swarm.episode import run_swarm_episode
from aflow_rl.envs.swarm.kb import build_kb
from aflow_rl.envs.swarm.policies import make_policy
from aflow_rl.envs.swarm.tasks import make_tasks
from aflow_rl.rollout.traces import TraceWriter
from aflow_rl.rollout.types import Trajectory, WorkerContext

__all__ = ["init_worker", "make_tasks", "run_episode"]


def init_worker(ctx: WorkerContext) -> None:
    """Per-process setup; fills ``ctx.state`` (policy_client, actor_client, tokenizer, trace, swarm_policy)."""
    cfg, st = ctx.config, ctx.state
    needs_policy = cfg.env.swarm.policy == "model"
    st.setdefault("trace", TraceWriter.from_context(ctx))
    if needs_policy and "policy_client" not in st:
        st["policy_client"] = role_client(ctx, "policy")
    if cfg.env.swarm.subagents == "llm" and "actor_client" not in st:
        st["actor_client"] = role_client(ctx, "actor")
    if needs_policy and "tokenizer" not in st:
        st["tokenizer"] = policy_tokenizer(cfg, "the model orchestrator")
    if "swarm_policy" not in st:
        st["swarm_policy"] = make_policy(cfg, client=st.get("policy_client"), tokenizer=st.get("tokenizer"))
    st["swarm_ready"] = True


async def run_episode(task: dict, ctx: WorkerContext) -> Trajectory:
    """One orchestration episode of ``task``."""
    if not ctx.state.get("swarm_ready"):
        init_worker(ctx)  # direct callers (tests, benchmarks) may skip the pool's start-up call
    cfg = ctx.config
    executor = None
    if cfg.env.swarm.subagents == "llm":
        from aflow_rl.envs.swarm.llm_subagents import LLMSubagents

        executor = LLMSubagents(ctx.state["actor_client"], build_kb(int(task.get("kb_seed", cfg.env.swarm.kb_seed))))
    return await run_swarm_episode(task, cfg, ctx.state["swarm_policy"], executor=executor,
                                   trace=ctx.state.get("trace"))
