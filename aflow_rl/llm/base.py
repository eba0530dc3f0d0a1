"""The one async interface every inference client implements.

Environments and workers depend on this module only; which provider sits
behind it (SGLang native, OpenAI-compatible, Anthropic) is a config choice.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

FinishReason = Literal["stop", "length", "abort"]


class LLMError(RuntimeError):
    """An inference request failed for good (after retries); the message names the URL."""

    def __init__(self, message: str, *, url: str = "", status: int | None = None):
        super().__init__(message)
        self.url = url
        self.status = status


@dataclass
class Completion:
    """One generation.

    output_ids / logprobs are filled by providers that expose tokens (SGLang
    native always does; logprobs only when requested). finish_reason is
    ``stop`` | ``length`` | ``abort`` so the caller can tell a truncated or
    aborted answer from a complete one.
    """

    text: str
    finish_reason: FinishReason = "stop"
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    prompt_ids: list[int] | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    weight_version: str | None = None
    latency_s: float = 0.0
    raw: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class LLMClient(Protocol):
    """Async client. ``generate`` takes a raw prompt (text or token ids);
    ``chat`` takes OpenAI-style messages. Sampling keywords follow SGLang's
    ``sampling_params``: max_new_tokens, temperature, top_p, top_k, stop,
    json_schema (a JSON string or dict), regex."""

    base_url: str

    async def generate(self, prompt: str | None = None, *, input_ids: list[int] | None = None,
                       return_logprob: bool = False, **sampling: Any) -> Completion: ...

    async def chat(self, messages: list[dict], *, return_logprob: bool = False,
                   **sampling: Any) -> Completion: ...

    async def aclose(self) -> None: ...
