"""Anthropic Messages API client over the shared aiohttp transport (no SDK needed).

``POST /v1/messages`` with ``x-api-key`` and ``anthropic-version`` headers.
OpenAI-style messages are converted: system messages are split out into the
top-level ``system`` field (the API rejects a ``system`` role in the list),
and consecutive turns of the same role are merged (the API wants them to
alternate). ``stop_reason`` maps to our finish reasons: ``max_tokens`` ->
``length``; ``end_turn``/``stop_sequence``/``tool_use`` -> ``stop``; a
refusal or a paused turn -> ``abort``.

The API has no logprobs and no token ids, so ``return_logprob`` and
``input_ids`` are errors rather than silently empty results. ``json_schema``
becomes ``output_config.format`` (structured outputs); ``regex`` is not
supported.
"""
from __future__ import annotations

import json
import time
from typing import Any

from aflow_rl.llm.base import Completion, FinishReason, LLMError
from aflow_rl.llm.http import HTTPTransport

DEFAULT_URL = "https://api.anthropic.com"
API_VERSION = "2023-06-01"
# The Messages API requires max_tokens; this is used when the caller gives none.
DEFAULT_MAX_TOKENS = 1024

_STOP: dict[str, FinishReason] = {
    "end_turn": "stop", "stop_sequence": "stop", "tool_use": "stop",
    "max_tokens": "length", "model_context_window_exceeded": "length",
    "refusal": "abort", "pause_turn": "abort",
}


def split_system(messages: list[dict]) -> tuple[str | None, list[dict]]:
    """OpenAI-style messages -> (system text or None, alternating user/assistant turns)."""
    system: list[str] = []
    turns: list[dict] = []
    for msg in messages:
        role, content = msg.get("role"), msg.get("content", "")
        if role == "system":
            system.append(content if isinstance(content, str) else json.dumps(content))
            continue
        if role not in ("user", "assistant"):
            raise ValueError(f"anthropic: unsupported message role {role!r} (use system, user or assistant)")
        if turns and turns[-1]["role"] == role and isinstance(content, str) \
                and isinstance(turns[-1]["content"], str):
            turns[-1] = {"role": role, "content": turns[-1]["content"] + "\n\n" + content}
        else:
            turns.append({"role": role, "content": content})
    return ("\n\n".join(system) if system else None), turns


class AnthropicClient:
    """Async client for the Anthropic Messages API."""

    def __init__(self, urls: list[str] | str | None = None, *, model: str, api_key: str,
                 timeout_s: float = 120.0, max_retries: int = 3, backoff_s: float = 0.5,
                 max_concurrency: int = 64, api_version: str = API_VERSION) -> None:
        if not api_key:
            raise ValueError("anthropic: an API key is required")
        if not model:
            raise ValueError("anthropic: a model name is required (e.g. llm.actor.model=claude-sonnet-4-5)")
        headers = {"x-api-key": api_key, "anthropic-version": api_version}
        self.http = HTTPTransport(urls or [DEFAULT_URL], timeout_s=timeout_s, max_retries=max_retries,
                                  backoff_s=backoff_s, max_concurrency=max_concurrency, headers=headers)
        self.model = model

    @property
    def base_url(self) -> str:
        return self.http.urls[0]

    def build_payload(self, messages: list[dict], sampling: dict[str, Any]) -> dict:
        """The ``/v1/messages`` JSON body (exposed for tests and logging)."""
        system, turns = split_system(messages)
        sampling = {k: v for k, v in sampling.items() if v is not None}
        body: dict[str, Any] = {"model": self.model, "messages": turns,
                                "max_tokens": int(sampling.pop("max_new_tokens", DEFAULT_MAX_TOKENS))}
        if system is not None:
            body["system"] = system
        stop = sampling.pop("stop", None)
        if stop:
            body["stop_sequences"] = [stop] if isinstance(stop, str) else list(stop)
        schema = sampling.pop("json_schema", None)
        if schema is not None:
            schema = json.loads(schema) if isinstance(schema, str) else schema
            body["output_config"] = {"format": {"type": "json_schema", "schema": schema}}
        if "regex" in sampling:
            raise ValueError("anthropic: regex-constrained decoding is not supported (use json_schema)")
        for key in ("temperature", "top_p", "top_k"):
            if key in sampling:
                body[key] = sampling.pop(key)
        body.update(sampling)  # anything else (metadata, thinking, ...) as the caller spelled it
        return body

    async def chat(self, messages: list[dict], *, return_logprob: bool = False, **sampling: Any) -> Completion:
        """``POST /v1/messages``; text blocks of the reply are joined."""
        if return_logprob:
            raise ValueError("anthropic: the Messages API returns no logprobs (use provider=sglang)")
        body = self.build_payload(messages, sampling)
        t0 = time.monotonic()
        reply = await self.http.post_json("/v1/messages", body)
        if not isinstance(reply, dict) or "content" not in reply:
            raise LLMError(f"POST {self.base_url}/v1/messages: unexpected reply {str(reply)[:200]}",
                           url=self.base_url)
        text = "".join(block.get("text", "") for block in reply["content"] if block.get("type") == "text")
        usage = reply.get("usage") or {}
        return Completion(
            text=text,
            finish_reason=_STOP.get(reply.get("stop_reason"), "abort"),
            prompt_tokens=int(usage.get("input_tokens") or 0),
            completion_tokens=int(usage.get("output_tokens") or 0),
            latency_s=time.monotonic() - t0,
            raw=reply,
        )

    async def generate(self, prompt: str | None = None, *, input_ids: list[int] | None = None,
                       return_logprob: bool = False, **sampling: Any) -> Completion:
        """A raw text prompt, sent as one user turn."""
        if input_ids is not None or prompt is None:
            raise ValueError("anthropic: generate takes a text prompt; token ids are not supported")
        return await self.chat([{"role": "user", "content": prompt}], return_logprob=return_logprob, **sampling)

    async def aclose(self) -> None:
        await self.http.aclose()
