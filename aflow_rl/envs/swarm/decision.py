"""What every orchestrator policy shares: the Policy protocol, the Decision one turn returns, and
``rule_decision``, which prices a rule-based action as a model turn would cost.

Its own module so that ``policies.py`` (the model policy and ``make_policy``) and ``baselines.py``
(the rule-based policies) both import it and neither imports the other's caller: no import circle.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from aflow_rl.envs.swarm.actions import Action
from aflow_rl.envs.swarm.observation import COMPACT_SYSTEM_PROMPT, SYSTEM_PROMPT, Observation
from aflow_rl.envs.swarm.profiles import ORCHESTRATOR_MS_PER_TOKEN_IN, ORCHESTRATOR_MS_PER_TOKEN_OUT, approx_tokens
from aflow_rl.rollout.types import Turn


@dataclass
class Decision:
    """One orchestrator turn: the action text, its Turn (model only), tokens and latency."""

    text: str
    turn: Turn | None = None
    tokens_in: int = 0
    tokens_out: int = 0
    latency_ms: float = 0.0


@runtime_checkable
class Policy(Protocol):
    name: str

    def begin_episode(self, task: dict) -> None: ...

    async def act(self, obs: Observation) -> Decision: ...

    def end_episode(self, task: dict, metrics: dict[str, float], rewards: dict[str, float]) -> None: ...


def rule_decision(obs: Observation, action: Action) -> Decision:
    """A baseline's action as a Decision, with the tokens and virtual latency a model would have spent."""
    text = action.to_json()
    # Charged the prompt a model would read under the same env.swarm.prompt (compact or full).
    system = COMPACT_SYSTEM_PROMPT if obs.view.get("compact") else SYSTEM_PROMPT
    t_in, t_out = approx_tokens(system) + approx_tokens(obs.text), approx_tokens(text)
    return Decision(text=text, tokens_in=t_in, tokens_out=t_out,
                    latency_ms=t_in * ORCHESTRATOR_MS_PER_TOKEN_IN + t_out * ORCHESTRATOR_MS_PER_TOKEN_OUT)
