"""make_client: provider choice, URL handling and the API-key rules (errors at construction)."""
from __future__ import annotations

import asyncio

import pytest

from aflow_rl.config import ClientConfig, ConfigError
from aflow_rl.llm import AnthropicClient, OpenAIClient, SGLangClient, make_client

from .conftest import generate_reply


def test_sglang_uses_the_role_urls_and_config_knobs(fake_server):
    a = fake_server(lambda *x: (200, generate_reply()))
    b = fake_server(lambda *x: (200, generate_reply()))
    cfg = ClientConfig(provider="sglang", timeout_s=7.0, max_retries=1, max_concurrency=5, balance="round_robin")
    client = make_client(cfg, [a.url, b.url], role="policy")
    assert isinstance(client, SGLangClient)
    assert client.urls == [a.url, b.url] and client.base_url == a.url
    assert (client.http.timeout_s, client.http.max_retries, client.http.max_concurrency) == (7.0, 1, 5)

    async def four():
        return [await client.generate(input_ids=[1], return_logprob=True) for _ in range(4)]
    assert all(c.output_ids == [5, 6] for c in asyncio.run(four()))
    assert len(a.calls) == len(b.calls) == 2


def test_base_url_overrides_role_urls_and_v1_suffix_is_accepted():
    cfg = ClientConfig(provider="openai", base_url="http://127.0.0.1:9000/v1/")
    client = make_client(cfg, ["http://127.0.0.1:1"])
    assert isinstance(client, OpenAIClient) and client.urls == ["http://127.0.0.1:9000"]


def test_sglang_without_any_url_is_a_config_error():
    with pytest.raises(ConfigError, match="llm.policy.base_url"):
        make_client(ClientConfig(provider="sglang"), [], role="policy")


def test_anthropic_without_key_env_fails_at_construction():
    with pytest.raises(ConfigError, match="llm.actor.api_key_env.*ANTHROPIC_API_KEY"):
        make_client(ClientConfig(provider="anthropic", model="claude-x"), [], role="actor")


def test_named_key_env_must_be_set(monkeypatch):
    monkeypatch.delenv("AFLOW_TEST_KEY", raising=False)
    for provider in ("sglang", "openai", "anthropic"):
        cfg = ClientConfig(provider=provider, model="m", api_key_env="AFLOW_TEST_KEY")
        with pytest.raises(ConfigError, match="AFLOW_TEST_KEY is not set"):
            make_client(cfg, ["http://127.0.0.1:1"], role="actor")


def test_remote_openai_needs_a_key_local_does_not(monkeypatch):
    with pytest.raises(ConfigError, match="not a local server"):
        make_client(ClientConfig(provider="openai", model="gpt-x"), [], role="actor")  # api.openai.com
    with pytest.raises(ConfigError, match="not a local server"):
        make_client(ClientConfig(provider="openai", model="m", base_url="https://llm.example.com"), [])
    local = make_client(ClientConfig(provider="openai"), ["http://127.0.0.1:30000"])
    assert "Authorization" not in local.http.headers
    private = make_client(ClientConfig(provider="openai"), ["http://10.1.2.3:30000"])
    assert isinstance(private, OpenAIClient)


def test_key_from_env_is_sent(fake_server, monkeypatch):
    monkeypatch.setenv("AFLOW_TEST_KEY", "sk-abc")
    srv = fake_server(lambda *x: (200, {"content": [{"type": "text", "text": "hi"}], "stop_reason": "end_turn"}))
    cfg = ClientConfig(provider="anthropic", model="claude-x", api_key_env="AFLOW_TEST_KEY", base_url=srv.url)
    client = make_client(cfg, [], role="actor")
    assert isinstance(client, AnthropicClient)
    assert asyncio.run(client.chat([{"role": "user", "content": "x"}])).text == "hi"
    assert srv.calls[0]["headers"]["x-api-key"] == "sk-abc"

    cfg = ClientConfig(provider="openai", model="gpt-x", api_key_env="AFLOW_TEST_KEY")
    assert make_client(cfg, []).http.headers["Authorization"] == "Bearer sk-abc"


def test_models_are_required_where_the_api_needs_them(monkeypatch):
    monkeypatch.setenv("AFLOW_TEST_KEY", "k")
    with pytest.raises(ConfigError, match="llm.actor.model"):
        make_client(ClientConfig(provider="anthropic", api_key_env="AFLOW_TEST_KEY"), [], role="actor")
    with pytest.raises(ConfigError, match="model"):
        make_client(ClientConfig(provider="openai", api_key_env="AFLOW_TEST_KEY"), [])
