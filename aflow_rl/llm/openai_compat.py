"""OpenAI-compatible client: ``/v1/chat/completions`` and ``/v1/completions``.

Works with SGLang's and vLLM's ``/v1`` routes, the embedded server, and
OpenAI itself. Sampling keywords use SGLang's names and are translated:
``max_new_tokens`` -> ``max_tokens``, ``json_schema`` -> ``response_format``
(``{"type": "json_schema", ...}``), ``top_logprobs_num`` -> ``top_logprobs``;
anything else (``top_k``, ``regex``, ``seed``, ...) is sent as given, which
SGLang and vLLM accept as extensions and OpenAI may reject with a 400.

Token ids do not come back through this API; logprobs do when asked.
"""
from __future__ import annotations

import json
import time
from typing import Any

from aflow_rl.llm.base import Completion, FinishReason, LLMError
from aflow_rl.llm.http import Balance, HTTPTransport

# OpenAI's finish reasons -> ours. content_filter cuts the answer short: not a clean stop.
_FINISH = {"stop": "stop", "eos": "stop", "tool_calls": "stop", "function_call": "stop",
           "length": "length", "abort": "abort", "content_filter": "abort"}


def response_format_for(schema: Any) -> dict:
    """A JSON schema (dict or JSON string) -> OpenAI's ``response_format``."""
    if isinstance(schema, str):
        schema = json.loads(schema)
    name = schema.get("title", "output") if isinstance(schema, dict) else "output"
    # OpenAI allows [a-zA-Z0-9_-] in the name; a free-form title would be rejected.
    name = "".join(ch if ch.isalnum() or ch in "_-" else "_" for ch in str(name))[:64] or "output"
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def _translate(sampling: dict[str, Any]) -> dict[str, Any]:
    """SGLang-style sampling keywords -> OpenAI body fields (None values dropped)."""
    body: dict[str, Any] = {}
    for key, value in sampling.items():
        if value is None:
            continue
        if key == "max_new_tokens":
            body["max_tokens"] = value
        elif key == "json_schema":
            body["response_format"] = response_format_for(value)
        elif key == "top_logprobs_num":
            continue  # handled with return_logprob
        else:
            body[key] = value
    return body


def _finish(reason: Any) -> FinishReason:
    # A reason we do not know is treated as an abort; a missing one (some small
    # compatible servers omit it) as a normal stop.
    return _FINISH.get(reason, "abort" if reason else "stop")  # type: ignore[return-value]


def _first_choice(reply: Any, url: str, path: str) -> dict:
    try:
        return reply["choices"][0]
    except (KeyError, IndexError, TypeError):
        raise LLMError(f"POST {url}{path}: reply has no choices: {str(reply)[:200]}", url=url) from None


async def chat_completion(http: HTTPTransport, model: str, messages: list[dict], *,
                          return_logprob: bool = False, sampling: dict[str, Any] | None = None) -> Completion:
    """``POST /v1/chat/completions`` through ``http``; shared by the SGLang client."""
    sampling = dict(sampling or {})
    body: dict[str, Any] = {"model": model, "messages": messages, **_translate(sampling)}
    if return_logprob:
        body["logprobs"] = True
        if sampling.get("top_logprobs_num"):
            body["top_logprobs"] = int(sampling["top_logprobs_num"])
    t0 = time.monotonic()
    reply = await http.post_json("/v1/chat/completions", body)
    choice = _first_choice(reply, http.urls[0], "/v1/chat/completions")
    logprobs = None
    if return_logprob:
        content = ((choice.get("logprobs") or {}).get("content")) or []
        logprobs = [float(tok["logprob"]) for tok in content]
    usage = reply.get("usage") or {}
    return Completion(
        text=(choice.get("message") or {}).get("content") or "",
        finish_reason=_finish(choice.get("finish_reason")),
        logprobs=logprobs,
        prompt_tokens=int(usage.get("prompt_tokens") or 0),
        completion_tokens=int(usage.get("completion_tokens") or 0),
        latency_s=time.monotonic() - t0,
        raw=reply,
    )


class OpenAIClient:
    """Async client for OpenAI-compatible servers (chat and legacy completions)."""

    def __init__(self, urls: list[str] | str, *, model: str = "", api_key: str | None = None,
                 timeout_s: float = 120.0, max_retries: int = 3, backoff_s: float = 0.5,
                 max_concurrency: int = 64, balance: Balance = "least_in_flight") -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = HTTPTransport(urls, timeout_s=timeout_s, max_retries=max_retries, backoff_s=backoff_s,
                                  max_concurrency=max_concurrency, headers=headers, balance=balance)
        # SGLang and the embedded server accept any name for their one model; OpenAI needs a real one.
        self.model = model or "default"

    @property
    def base_url(self) -> str:
        return self.http.urls[0]

    @property
    def urls(self) -> list[str]:
        return self.http.urls

    async def chat(self, messages: list[dict], *, return_logprob: bool = False, **sampling: Any) -> Completion:
        """``POST /v1/chat/completions``; logprobs of the sampled tokens when asked."""
        return await chat_completion(self.http, self.model, messages, return_logprob=return_logprob,
                                     sampling=sampling)

    async def generate(self, prompt: str | None = None, *, input_ids: list[int] | None = None,
                       return_logprob: bool = False, **sampling: Any) -> Completion:
        """``POST /v1/completions`` with a text prompt or a token-id prompt."""
        if (prompt is None) == (input_ids is None):
            raise ValueError("generate: pass exactly one of prompt (text) or input_ids")
        body: dict[str, Any] = {"model": self.model,
                                "prompt": prompt if input_ids is None else [int(t) for t in input_ids],
                                **_translate(sampling)}
        if return_logprob:
            # Legacy completions take an int: how many top alternatives per token. The
            # sampled token's logprob comes with any value; 0 is falsy to some servers.
            body["logprobs"] = max(1, int(sampling.get("top_logprobs_num") or 0))
        t0 = time.monotonic()
        reply = await self.http.post_json("/v1/completions", body)
        choice = _first_choice(reply, self.base_url, "/v1/completions")
        logprobs = None
        if return_logprob:
            token_lps = (choice.get("logprobs") or {}).get("token_logprobs") or []
            logprobs = [float(lp) for lp in token_lps if lp is not None]
        usage = reply.get("usage") or {}
        return Completion(
            text=choice.get("text") or "",
            finish_reason=_finish(choice.get("finish_reason")),
            logprobs=logprobs,
            prompt_ids=list(input_ids) if input_ids is not None else None,
            prompt_tokens=int(usage.get("prompt_tokens") or 0),
            completion_tokens=int(usage.get("completion_tokens") or 0),
            latency_s=time.monotonic() - t0,
            raw=reply,
        )

    async def aclose(self) -> None:
        await self.http.aclose()
