"""Subagents backed by a real model through the actor endpoint (any provider of ``aflow_rl.llm``).

Each attempt is a short ReAct loop: the subagent sees its item (with the
answers of the items it depends on filled in) and replies, turn by turn, with
one JSON object: ``{"tool": "lookup", "args": {...}}`` to call a tool of the
knowledge base, or ``{"answer": "..."}`` to report. The profile bounds the
turns (``max_steps``) and tokens per turn (``max_new_tokens``); with a single
actor endpoint, that is what distinguishes small from large. Subagents are
frozen: nothing here is trained, so no logprobs are requested.
"""
from __future__ import annotations

import time

from aflow_rl.envs.swarm.actions import first_json_object
from aflow_rl.envs.swarm.kb import KnowledgeBase
from aflow_rl.envs.swarm.profiles import AttemptResult, SubagentJob
from aflow_rl.envs.swarm.tools import TOOL_HELP, call_tool
from aflow_rl.llm.base import LLMClient, LLMError

SUBAGENT_SYSTEM = (
    "You are a subagent with tools over a knowledge base. Solve your one question. Each reply is exactly "
    'one JSON object: {"tool": "lookup", "args": {"entity": "...", "attribute": "..."}} or '
    '{"tool": "calc", "args": {"expr": "..."}} to use a tool, or {"answer": "..."} when you know the answer.\n'
    "Tools: " + "; ".join(TOOL_HELP.values()) + ".")


def subtask_prompt(item: dict, inputs: dict[str, str]) -> str:
    """The item's question followed by the answers of the items it refers to."""
    known = "".join(f"\nKnown: the answer to {d} is {v}." for d, v in inputs.items())
    return f"Question: {item['question']}{known}"


class LLMSubagents:
    """Runs subagent attempts on ``client`` (the actor); tool calls go to the local knowledge base."""

    def __init__(self, client: LLMClient, kb: KnowledgeBase, *, temperature: float = 0.0):
        self.client, self.kb, self.temperature = client, kb, temperature

    async def run(self, job: SubagentJob) -> AttemptResult:
        p = job.profile
        messages = [{"role": "system", "content": SUBAGENT_SYSTEM},
                    {"role": "user", "content": subtask_prompt(job.item, job.inputs)}]
        res = AttemptResult(ok=False)
        t0 = time.perf_counter()
        try:
            for _ in range(p.max_steps):
                comp = await self.client.chat(messages, max_new_tokens=p.max_new_tokens,
                                              temperature=self.temperature)
                res.steps += 1
                res.tokens_in += comp.prompt_tokens
                res.tokens_out += comp.completion_tokens
                res.transcript.append(comp.text)
                messages.append({"role": "assistant", "content": comp.text})
                try:
                    reply = first_json_object(comp.text)
                except ValueError:
                    reply = None
                if isinstance(reply, dict) and "answer" in reply and str(reply["answer"]).strip():
                    res.ok, res.answer = True, str(reply["answer"]).strip()
                    break
                if isinstance(reply, dict) and isinstance(reply.get("tool"), str):
                    args = reply.get("args") if isinstance(reply.get("args"), dict) else {}
                    out = call_tool(self.kb, reply["tool"], args)
                    res.tool_calls += 1
                    messages.append({"role": "user", "content": f"Result: {out.text()}"})
                else:
                    messages.append({"role": "user", "content": 'Reply with one JSON object: a tool call or '
                                                                '{"answer": "..."}.'})
            else:
                res.error = f"{p.name} subagent gave no answer in {p.max_steps} steps"
        except LLMError as exc:
            # The actor endpoint failing is a subagent failure (retried by the runtime), not an episode error.
            res.error = f"actor error: {exc}"
        res.latency_ms = 1000.0 * (time.perf_counter() - t0)
        return res
