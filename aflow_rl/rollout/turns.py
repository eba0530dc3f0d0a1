"""One trainable policy turn: chat messages -> token ids -> /generate -> Turn.

The worker tokenizes the prompt itself and sends ``input_ids`` so that the
prompt tokens the trainer sees are exactly the ones the server conditioned on
(a text round trip can re-tokenize differently). The server returns the
sampled ids and their logprobs; both go into the Turn unchanged.
"""
from __future__ import annotations

import json
from typing import Any

from aflow_rl.llm.base import Completion, LLMClient
from aflow_rl.rollout.types import Turn


def chat_prompt_ids(tokenizer: Any, messages: list[dict]) -> list[int]:
    """Token ids of ``messages`` under the model's chat template, ready for the assistant turn."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(text, add_special_tokens=False))


def parse_weight_version(version: Any) -> int:
    """SGLang reports ``weight_version`` as a string ("default" before any update)."""
    try:
        return int(str(version))
    except (TypeError, ValueError):
        return 0


async def generate_turn(client: LLMClient, tokenizer: Any, messages: list[dict], *,
                        temperature: float, max_new_tokens: int,
                        json_schema: dict | str | None = None, regex: str | None = None,
                        anchor_key: str | None = None, sampling_seed: int | None = None) -> tuple[Completion, Turn]:
    """Sample one policy response and package it as a Turn for training.

    ``sampling_seed``: this request's own sampler seed (SGLang's sampling param), so the response does
    not depend on what else the server sampled before it; None: the server's shared generator."""
    prompt_ids = chat_prompt_ids(tokenizer, messages)
    sampling: dict[str, Any] = {"max_new_tokens": max_new_tokens, "temperature": temperature}
    if sampling_seed is not None:
        sampling["sampling_seed"] = int(sampling_seed)
    grammar = None
    if json_schema is not None:
        schema = json_schema if isinstance(json_schema, str) else json.dumps(json_schema)
        sampling["json_schema"] = schema
        grammar = {"json_schema": schema}
    elif regex is not None:
        sampling["regex"] = regex
        grammar = {"regex": regex}
    comp = await client.generate(input_ids=prompt_ids, return_logprob=True, **sampling)
    turn = Turn(prompt_ids=prompt_ids, response_ids=comp.output_ids, logprobs=comp.logprobs or [],
                grammar=grammar, anchor_key=anchor_key,
                policy_version=parse_weight_version(comp.weight_version),
                finish_reason=comp.finish_reason)
    return comp, turn
