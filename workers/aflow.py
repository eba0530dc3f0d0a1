"""Worker module of the AFlow environment (``env.name: aflow``): the contract of docs/architecture.md.

Training episodes: ``make_tasks`` and ``run_episode`` (the optimizer's proposals,
aflow_rl/envs/aflow/episode.py). Evaluating workflows with the executor model:

``init_worker(ctx)`` runs once per worker process: it builds the executor
client (``llm.actor`` against ``ctx.urls["actor"]``, the actor endpoint: SGLang,
OpenAI-compatible or Anthropic) and, when the config has a policy server, the
optimizer's client (``llm.policy``) and its tokenizer.

``evaluate_task(task, ctx)`` evaluates ``task["workflow"]`` (a workflow dict)
on ``task["problems"]`` (problem dicts: id, question, answer, kind, metadata)
with the limits of ``env.aflow`` and returns a JSON-able dict: the
``EvalResult`` fields plus ``valid: true``, or ``valid: false`` with the
validation ``error`` when the workflow is rejected (nothing is executed then).
"""
from __future__ import annotations

from aflow_rl.envs.aflow.evaluator import evaluate
from aflow_rl.envs.aflow.graph import Workflow, WorkflowError
from aflow_rl.rollout.types import WorkerContext

__all__ = ["evaluate_task", "init_worker"]


def _client(ctx: WorkerContext, role: str):
    from aflow_rl.llm import make_client  # the HTTP client and the providers load only where a server is used

    return make_client(getattr(ctx.config.llm, role), list(ctx.urls.get(role, [])), role=role)


def _has_policy_server(ctx: WorkerContext) -> bool:
    cfg = ctx.config
    return bool(ctx.urls.get("policy")) or bool(cfg.llm.policy.base_url)


def init_worker(ctx: WorkerContext) -> None:
    """Per-process setup; fills ``ctx.state`` (actor_client; policy_client and tokenizer with a policy server)."""
    cfg, st = ctx.config, ctx.state
    if "actor_client" not in st:
        st["actor_client"] = _client(ctx, "actor")
    if _has_policy_server(ctx):
        if "policy_client" not in st:
            st["policy_client"] = _client(ctx, "policy")
        path = cfg.serving.policy.model_path
        if path and "tokenizer" not in st:
            from transformers import AutoTokenizer

            st["tokenizer"] = AutoTokenizer.from_pretrained(path)
    st["aflow_ready"] = True


# -- evaluation ---------------------------------------------------------------------


def _problem(data: dict):
    from aflow_rl.envs.aflow.datasets import Problem

    return Problem(**data)


async def evaluate_task(task: dict, ctx: WorkerContext) -> dict:
    """Evaluate ``task["workflow"]`` on ``task["problems"]``; see the module docstring for the reply."""
    if not ctx.state.get("aflow_ready"):
        init_worker(ctx)  # direct callers (tests, the search loop in-process) may skip the pool's start-up
    a = ctx.config.env.aflow
    try:
        workflow = Workflow.from_dict(task["workflow"])
        result = await evaluate(workflow, [_problem(p) for p in task["problems"]],
                                executor=ctx.state["actor_client"], concurrency=a.eval_concurrency,
                                problem_timeout_s=a.problem_timeout_s, max_tokens=a.executor_max_tokens,
                                max_nodes=a.max_nodes, max_samples=a.max_samples,
                                max_loop_rounds=a.max_loop_rounds, code_timeout_s=a.code_timeout_s)
    except WorkflowError as exc:
        return {"valid": False, "error": str(exc), "issues": exc.problems, "score": 0.0}
    return {"valid": True, **result.to_dict()}


# -- training episodes: the optimizer's proposals (aflow_rl.envs.aflow.episode) ------


def make_tasks(cfg, n: int, seed: int) -> list[dict]:
    """``n`` tasks: a parent drawn from the shared search state under ``run_dir/search`` + the validation problems."""
    from aflow_rl.envs.aflow.episode import make_tasks as make_proposal_tasks

    return make_proposal_tasks(cfg, n, seed)


async def run_episode(task: dict, ctx: WorkerContext):
    """One proposal from the task's parent: generate (anchor key = parent hash), validate, evaluate, record, reward."""
    from aflow_rl.envs.aflow.episode import run_proposal_episode

    if not ctx.state.get("aflow_ready"):
        init_worker(ctx)
    if "tokenizer" not in ctx.state:
        raise ValueError("the aflow training episode needs the policy server and its tokenizer: set "
                         "serving.policy (backend and model_path) or llm.policy.base_url with serving.policy.model_path")
    return await run_proposal_episode(task, ctx)


__all__ += ["make_tasks", "run_episode"]
