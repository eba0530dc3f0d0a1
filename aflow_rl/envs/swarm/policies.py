"""Orchestrator policies: the trained model policy, and ``make_policy``, which picks it or a baseline.

A policy turns an Observation into one action text per turn. The model policy
samples it from the policy server through ``generate_turn`` (token ids,
server logprobs and the JSON-schema grammar go into a Turn for the trainer);
the baselines of ``baselines.py`` compute it by rule and return no Turn. The protocol the episode
loop drives and the Decision a turn returns live in ``decision.py``, which both modules import.

    policy = make_policy(cfg, client=client, tokenizer=tok)   # env.swarm.policy picks which
    policy.begin_episode(task); d = await policy.act(obs); ...; policy.end_episode(task, metrics, rewards)
"""
from __future__ import annotations

import time
from typing import Any

from aflow_rl.envs.swarm.actions import ACTION_SCHEMA, ACTION_SCHEMA_SOLVE, action_schema_for
from aflow_rl.envs.swarm.baselines import make_baseline
from aflow_rl.envs.swarm.decision import Decision, Policy
from aflow_rl.envs.swarm.observation import COMPACT_SYSTEM_PROMPT, SYSTEM_PROMPT, Observation
from aflow_rl.llm.base import LLMClient
from aflow_rl.rollout.turns import generate_turn

POLICIES = ("model", "single", "heuristic", "bandit", "adaptive")


class ModelPolicy:
    """The trained orchestrator on the policy server; every turn becomes a Turn with its anchor key."""

    name = "model"

    def __init__(self, client: LLMClient, tokenizer: Any, *, temperature: float = 1.0, max_new_tokens: int = 96,
                 constrained: bool = True, task_schema: bool = False, compact: bool = False,
                 effective_actions: bool = False, no_duplicate_work: bool = False, spawn_n: str = "choose",
                 spawn_profile: str = "choose", auto_answer: bool = False, delegate_ops: bool = True):
        self.client, self.tokenizer = client, tokenizer
        self.delegate_ops = delegate_ops
        self.spawn_n, self.spawn_profile, self.auto_answer = spawn_n, spawn_profile, auto_answer
        self.effective_actions, self.no_duplicate_work = effective_actions, no_duplicate_work
        self.temperature, self.max_new_tokens = temperature, max_new_tokens
        self.constrained, self.task_schema = constrained, task_schema
        self.system_prompt = COMPACT_SYSTEM_PROMPT if compact else SYSTEM_PROMPT

    def begin_episode(self, task: dict) -> None:
        pass

    async def act(self, obs: Observation) -> Decision:
        messages = [{"role": "system", "content": self.system_prompt}, {"role": "user", "content": obs.text}]
        t0 = time.perf_counter()
        comp, turn = await generate_turn(self.client, self.tokenizer, messages, temperature=self.temperature,
                                         max_new_tokens=self.max_new_tokens, json_schema=self.schema(obs),
                                         anchor_key=obs.anchor_key)
        latency_ms = 1000.0 * (comp.latency_s or (time.perf_counter() - t0))
        return Decision(text=comp.text, turn=turn, tokens_in=len(turn.prompt_ids),
                        tokens_out=len(turn.response_ids), latency_ms=latency_ms)

    def schema(self, obs: Observation) -> dict | None:
        """The grammar of this turn: none, the generic action schema, or the one narrowed to this state."""
        if not self.constrained:
            return None
        if self.task_schema:
            return action_schema_for(obs.view, effective=self.effective_actions, no_duplicate=self.no_duplicate_work,
                                     spawn_n=self.spawn_n, spawn_profile=self.spawn_profile,
                                     auto_answer=self.auto_answer, delegate_ops=self.delegate_ops)
        return ACTION_SCHEMA_SOLVE if obs.view.get("solve") else ACTION_SCHEMA

    def end_episode(self, task: dict, metrics: dict[str, float], rewards: dict[str, float]) -> None:
        pass


def make_policy(cfg: Any, *, client: LLMClient | None = None, tokenizer: Any = None, name: str | None = None) -> Policy:
    """The policy ``cfg.env.swarm.policy`` (or ``name``) names; the model policy needs client and tokenizer."""
    name = name or cfg.env.swarm.policy
    if name == "model":
        if client is None or tokenizer is None:
            raise ValueError("env.swarm.policy=model needs the policy client and tokenizer "
                             "(workers.swarm.init_worker builds them from llm.policy and serving.policy)")
        return ModelPolicy(client, tokenizer, temperature=cfg.env.temperature,
                           max_new_tokens=cfg.env.max_new_tokens, constrained=cfg.env.swarm.action_schema,
                           task_schema=cfg.env.swarm.task_schema, compact=cfg.env.swarm.prompt in ("compact", "shape", "graph"),
                           effective_actions=cfg.env.swarm.effective_actions,
                           no_duplicate_work=cfg.env.swarm.no_duplicate_work,
                           spawn_n=cfg.env.swarm.spawn_n, spawn_profile=cfg.env.swarm.spawn_profile,
                           auto_answer=cfg.env.swarm.auto_answer, delegate_ops=cfg.env.swarm.delegate_ops)
    return make_baseline(name, cfg)
