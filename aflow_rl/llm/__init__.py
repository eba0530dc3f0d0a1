"""Inference clients behind one async interface (``LLMClient``).

``make_client(cfg.llm.policy, servers.urls("policy"))`` builds the client a
config asks for: SGLang native (token ids + logprobs, the training path),
OpenAI-compatible (SGLang ``/v1``, vLLM, OpenAI) or the Anthropic Messages API.

API-key rules, checked here so a missing key stops the run at start-up:

- ``api_key_env`` set: that environment variable must exist and be non-empty,
  whatever the provider; its value is sent (Bearer, or ``x-api-key``).
- ``api_key_env`` empty: no key is sent. That is an error for ``anthropic``
  and for ``openai`` on a host that is not loopback/localhost or a
  private-network IP; ``sglang`` and local/private ``openai`` servers run
  without keys.
"""
from __future__ import annotations

import os
from urllib.parse import urlsplit

from aflow_rl.config import ClientConfig, ConfigError
from aflow_rl.llm.anthropic import DEFAULT_URL as ANTHROPIC_URL
from aflow_rl.llm.anthropic import AnthropicClient
from aflow_rl.llm.base import Completion, FinishReason, LLMClient, LLMError
from aflow_rl.llm.http import HTTPTransport, is_local_url, normalize_url
from aflow_rl.llm.openai_compat import OpenAIClient
from aflow_rl.llm.sglang import SGLangClient

OPENAI_URL = "https://api.openai.com"

__all__ = ["AnthropicClient", "Completion", "FinishReason", "HTTPTransport", "LLMClient", "LLMError",
           "OpenAIClient", "SGLangClient", "make_client", "resolve_api_key"]


def _strip_v1(url: str) -> str:
    """Accept the SDK convention ``http://host/v1``: our paths already start with /v1."""
    url = normalize_url(url)
    return url[:-3] if urlsplit(url).path.endswith("/v1") else url


def resolve_api_key(cfg: ClientConfig, urls: list[str], key: str = "llm.<role>") -> str | None:
    """Apply the API-key rules of this module; raise ``ConfigError`` naming the fix."""
    if cfg.api_key_env:
        value = os.environ.get(cfg.api_key_env, "")
        if not value:
            raise ConfigError(f"{key}.api_key_env: environment variable {cfg.api_key_env} is not set "
                              f"(export {cfg.api_key_env}=... before starting, or clear {key}.api_key_env)")
        return value
    if cfg.provider == "anthropic":
        raise ConfigError(f"{key}.api_key_env: the anthropic provider needs an API key "
                          f"(set {key}.api_key_env=ANTHROPIC_API_KEY and export it)")
    if cfg.provider == "openai":
        remote = [u for u in urls if not is_local_url(u)]
        if remote:
            raise ConfigError(f"{key}.api_key_env: {remote[0]} is not a local server, so the openai "
                              f"provider needs an API key (set {key}.api_key_env=OPENAI_API_KEY and export it)")
    return None


def make_client(cfg: ClientConfig, urls: list[str], *, role: str = "") -> LLMClient:
    """Build the client for one role.

    ``urls`` are the role's server URLs (``ServerManager.urls(role)``);
    ``cfg.base_url``, when set, replaces them. ``role`` only names config keys
    in error messages.
    """
    key = f"llm.{role}" if role else "llm.<role>"
    endpoints = [cfg.base_url] if cfg.base_url else list(urls)
    if not endpoints:
        if cfg.provider == "anthropic":
            endpoints = [ANTHROPIC_URL]
        elif cfg.provider == "openai":
            endpoints = [OPENAI_URL]
        else:
            raise ConfigError(f"{key}.base_url: no server URL for the sglang provider (start servers with "
                              f"serving.{role or '<role>'}.backend, or set {key}.base_url)")
    if cfg.provider in ("openai", "anthropic"):
        endpoints = [_strip_v1(u) for u in endpoints]
    api_key = resolve_api_key(cfg, endpoints, key)
    common = dict(timeout_s=cfg.timeout_s, max_retries=cfg.max_retries, backoff_s=cfg.backoff_s,
                  max_concurrency=cfg.max_concurrency)
    if cfg.provider == "sglang":
        return SGLangClient(endpoints, api_key=api_key, model=cfg.model, balance=cfg.balance, **common)
    if cfg.provider == "openai":
        if not cfg.model and not all(is_local_url(u) for u in endpoints):
            raise ConfigError(f"{key}.model: a remote OpenAI-compatible API needs a model name")
        return OpenAIClient(endpoints, model=cfg.model, api_key=api_key, balance=cfg.balance, **common)
    if cfg.provider == "anthropic":
        if not cfg.model:
            raise ConfigError(f"{key}.model: the anthropic provider needs a model name (e.g. claude-sonnet-4-5)")
        return AnthropicClient(endpoints, model=cfg.model, api_key=api_key, **common)
    raise ConfigError(f"{key}.provider: expected sglang | openai | anthropic, got {cfg.provider!r}")
