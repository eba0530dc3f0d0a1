"""Fakes for the swarm tests: a scripted subagent executor, a hand-built graph, a scripted LLM."""
from __future__ import annotations

from aflow_rl.envs.swarm.profiles import AttemptResult, SubagentJob
from aflow_rl.llm.base import Completion


class ScriptedSubagents:
    """Attempt k at item X returns ``script[X][k-1]`` = (ok, steps); unscripted attempts succeed in 2 steps.

    Each step costs 10 prompt tokens, 1 completion token and 100 virtual ms. The
    answer echoes the inputs so tests can check what a dependent received.
    """

    def __init__(self, script: dict[str, list[tuple[bool, int]]] | None = None):
        self.script = script or {}
        self.calls: list[tuple[str, int, dict]] = []

    async def run(self, job: SubagentJob) -> AttemptResult:
        item = job.item["id"]
        self.calls.append((item, job.attempt, dict(job.inputs)))
        plan = self.script.get(item, [])
        ok, steps = plan[job.attempt - 1] if job.attempt <= len(plan) else (True, 2)
        answer = item.upper() + "".join(f"<{v}" for v in job.inputs.values()) if ok else None
        return AttemptResult(ok=ok, answer=answer, steps=steps, tokens_in=10 * steps, tokens_out=steps,
                             latency_ms=100.0 * steps, error="" if ok else f"{item} failed")


def graph_items() -> list[dict]:
    """a -> b -> c, a -> d, and e on its own."""
    return [{"id": "a", "deps": []}, {"id": "b", "deps": ["a"]}, {"id": "c", "deps": ["b"]},
            {"id": "d", "deps": ["a"]}, {"id": "e", "deps": []}]


class FakeTokenizer:
    """Enough of a HF tokenizer for ``generate_turn``: a chat template and a byte-ish encoding."""

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

    def encode(self, text, add_special_tokens=False):
        return [ord(c) % 250 for c in text]


class ScriptedLLM:
    """An LLMClient that answers ``generate`` with the given texts in turn (then repeats the last)."""

    base_url = "fake://policy"

    def __init__(self, texts: list[str]):
        self.texts = list(texts)
        self.calls = 0
        self.sampling: list[dict] = []

    async def generate(self, prompt=None, *, input_ids=None, return_logprob=False, **sampling):
        text = self.texts[min(self.calls, len(self.texts) - 1)]
        self.calls += 1
        self.sampling.append(sampling)
        ids = [ord(c) % 250 for c in text] or [0]
        return Completion(text=text, output_ids=ids, logprobs=[-1.0] * len(ids), prompt_ids=input_ids,
                          prompt_tokens=len(input_ids or []), completion_tokens=len(ids), weight_version="3")

    async def chat(self, messages, *, return_logprob=False, **sampling):
        return await self.generate(None, input_ids=[1], return_logprob=return_logprob, **sampling)

    async def aclose(self):
        pass
