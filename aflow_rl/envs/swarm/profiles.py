"""The frozen subagent pool: profiles (small, medium, large) and the simulated subagents.

In PARL only the orchestrator learns; the subagents it spawns are frozen
(Kimi K2.5 Agent Swarm). A profile fixes what one subagent costs and how far
it can be trusted. Simulated subagents draw every outcome from a seed, and
their latency is virtual (milliseconds on the episode's clock, never slept), so
a simulated episode is fast and the same seed gives the same episode on any
backend. ``llm_subagents.LLMSubagents`` runs the same jobs through the actor
endpoint instead.

One attempt of a simulated subagent on an item that needs ``k`` tool calls
takes ``k + 1 + U{0..extra_steps}`` steps (its tool calls, then one step to
report). With probability ``p_fail`` it gives up part-way (a reported failure
that the runtime may retry); with probability ``p_wrong`` it reports a wrong
answer as if it were right (silent, as real subagents do).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from aflow_rl.envs.swarm.kb import KnowledgeBase
from aflow_rl.envs.swarm.tasks import resolve_item, tool_steps


@dataclass(frozen=True)
class Profile:
    """One subagent size. Prices are USD per million tokens."""

    name: str
    p_fail: float              # chance an attempt gives up (reported failure)
    p_wrong: float             # chance an attempt returns a wrong answer as if right
    extra_steps: int           # simulated: up to this many steps beyond tool calls + 1
    ms_per_step: float         # simulated latency of one step
    tokens_in_per_step: int    # simulated prompt tokens per step
    tokens_out_per_step: int   # simulated completion tokens per step
    usd_in_per_mtok: float
    usd_out_per_mtok: float
    max_steps: int             # most steps of one attempt (LLM subagents: ReAct turns)
    max_new_tokens: int        # LLM subagents: tokens per step

    def cost(self, tokens_in: int, tokens_out: int) -> float:
        return (tokens_in * self.usd_in_per_mtok + tokens_out * self.usd_out_per_mtok) / 1e6


PROFILES: dict[str, Profile] = {
    # A step is one short ReAct turn (a tool call as JSON, ~30 tokens) over a ~300-token context;
    # larger models decode more slowly, cost more and fail less.
    "small": Profile("small", p_fail=0.15, p_wrong=0.05, extra_steps=2, ms_per_step=250.0,
                     tokens_in_per_step=300, tokens_out_per_step=30, usd_in_per_mtok=0.05,
                     usd_out_per_mtok=0.2, max_steps=6, max_new_tokens=64),
    "medium": Profile("medium", p_fail=0.08, p_wrong=0.01, extra_steps=1, ms_per_step=450.0,
                      tokens_in_per_step=300, tokens_out_per_step=30, usd_in_per_mtok=0.3,
                      usd_out_per_mtok=1.2, max_steps=8, max_new_tokens=96),
    "large": Profile("large", p_fail=0.03, p_wrong=0.0, extra_steps=0, ms_per_step=700.0,
                     tokens_in_per_step=300, tokens_out_per_step=30, usd_in_per_mtok=1.0,
                     usd_out_per_mtok=4.0, max_steps=10, max_new_tokens=128),
}
PROFILE_NAMES = tuple(PROFILES)

# The orchestrator is priced like the large profile (K2.5's orchestrator is the big model).
# Baseline policies emit no real tokens, so their turns get a virtual latency from these rates.
ORCHESTRATOR_USD_IN_PER_MTOK = 1.0
ORCHESTRATOR_USD_OUT_PER_MTOK = 4.0
ORCHESTRATOR_MS_PER_TOKEN_IN = 0.2
ORCHESTRATOR_MS_PER_TOKEN_OUT = 20.0
TOOL_CALL_MS = 50.0  # virtual latency of one orchestrator tool call


def orchestrator_cost(tokens_in: int, tokens_out: int) -> float:
    return (tokens_in * ORCHESTRATOR_USD_IN_PER_MTOK + tokens_out * ORCHESTRATOR_USD_OUT_PER_MTOK) / 1e6


def approx_tokens(text: str) -> int:
    """Token count of text that never went through a tokenizer (baseline turns): ~4 characters a token."""
    return max(1, (len(text) + 3) // 4)


@dataclass
class SubagentJob:
    """One attempt of one subtask: the item, its dependencies' answers, the profile, a seed."""

    item: dict
    inputs: dict[str, str]
    profile: Profile
    seed: int
    attempt: int = 1


@dataclass
class AttemptResult:
    ok: bool
    answer: str | None = None
    steps: int = 0
    tool_calls: int = 0
    tokens_in: int = 0
    tokens_out: int = 0
    latency_ms: float = 0.0
    error: str = ""
    transcript: list[str] = field(default_factory=list)


@runtime_checkable
class SubagentExecutor(Protocol):
    """Runs one attempt of a subtask. Never raises for a task-level failure: returns ok=False."""

    async def run(self, job: SubagentJob) -> AttemptResult: ...


def _wrong_value(rng: random.Random, kb: KnowledgeBase, truth: str) -> str:
    """A plausible wrong answer: a nearby number, or another entity of the same type."""
    if truth.lstrip("-").isdigit():
        x = int(truth)
        return str(x + rng.choice((-1, 1)) * rng.randint(1, max(1, abs(x) // 10)))
    ent = kb.entity(truth)
    others = [n for n in kb.names(kb.types[ent]) if n != ent] if ent else []
    return rng.choice(others) if others else truth + "x"


class SimulatedSubagents:
    """Seeded subagents over the knowledge base: outcomes, steps, tokens and latency from the profile."""

    def __init__(self, kb: KnowledgeBase):
        self.kb = kb

    async def run(self, job: SubagentJob) -> AttemptResult:
        p, rng = job.profile, random.Random(job.seed)
        planned = tool_steps(job.item) + 1 + rng.randint(0, p.extra_steps)
        u = rng.random()
        if u < p.p_fail or planned > p.max_steps:
            steps = rng.randint(1, min(planned, p.max_steps))
            return self._result(False, None, steps, job, error=f"{p.name} subagent gave up after {steps} steps")
        try:
            truth = resolve_item(self.kb, job.item, job.inputs)
        except (KeyError, ValueError) as exc:
            # A wrong upstream answer names an entity that does not exist: the subagent notices.
            reason = exc.args[0] if exc.args else exc
            return self._result(False, None, planned, job, error=f"could not resolve: {reason}")
        answer = truth if u >= p.p_fail + p.p_wrong else _wrong_value(rng, self.kb, truth)
        return self._result(True, answer, planned, job)

    @staticmethod
    def _result(ok: bool, answer: str | None, steps: int, job: SubagentJob, error: str = "") -> AttemptResult:
        p = job.profile
        return AttemptResult(ok=ok, answer=answer, steps=steps, tool_calls=max(0, steps - 1),
                             tokens_in=steps * p.tokens_in_per_step, tokens_out=steps * p.tokens_out_per_step,
                             latency_ms=steps * p.ms_per_step, error=error)
