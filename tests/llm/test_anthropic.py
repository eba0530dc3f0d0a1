"""Anthropic Messages client: headers, system split, stop reasons, against a fake server."""
from __future__ import annotations

import asyncio

import pytest

from aflow_rl.llm import AnthropicClient, LLMClient
from aflow_rl.llm.anthropic import API_VERSION, split_system


def messages_reply(text="Hello!", stop_reason="end_turn"):
    return {"id": "msg_1", "type": "message", "role": "assistant", "model": "claude-x",
            "content": [{"type": "text", "text": text}], "stop_reason": stop_reason,
            "usage": {"input_tokens": 12, "output_tokens": 3}}


def test_request_shape_headers_and_system_split(fake_server):
    srv = fake_server(lambda *a: (200, messages_reply()))
    client = AnthropicClient(srv.url, model="claude-x", api_key="sk-ant-test")
    assert isinstance(client, LLMClient)
    msgs = [{"role": "system", "content": "You plan."}, {"role": "user", "content": "task A"},
            {"role": "user", "content": "task B"}, {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "go"}]
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    c = asyncio.run(client.chat(msgs, max_new_tokens=64, temperature=0.2, stop=["END"], json_schema=schema))
    call = srv.calls[0]
    assert call["path"] == "/v1/messages"
    assert call["headers"]["x-api-key"] == "sk-ant-test"
    assert call["headers"]["anthropic-version"] == API_VERSION
    assert "authorization" not in call["headers"]
    body = call["body"]
    assert body["system"] == "You plan."
    assert body["messages"] == [{"role": "user", "content": "task A\n\ntask B"},
                                {"role": "assistant", "content": "ok"}, {"role": "user", "content": "go"}]
    assert body["max_tokens"] == 64 and body["temperature"] == 0.2 and body["stop_sequences"] == ["END"]
    assert body["output_config"] == {"format": {"type": "json_schema", "schema": schema}}
    assert c.text == "Hello!" and c.finish_reason == "stop"
    assert (c.prompt_tokens, c.completion_tokens) == (12, 3)


@pytest.mark.parametrize("stop_reason, ours", [("max_tokens", "length"), ("stop_sequence", "stop"),
                                               ("refusal", "abort")])
def test_stop_reasons(fake_server, stop_reason, ours):
    srv = fake_server(lambda *a: (200, messages_reply(stop_reason=stop_reason)))
    client = AnthropicClient(srv.url, model="claude-x", api_key="k")
    c = asyncio.run(client.generate("hi"))
    assert c.finish_reason == ours
    body = srv.calls[0]["body"]
    assert body["messages"] == [{"role": "user", "content": "hi"}] and "system" not in body
    assert body["max_tokens"] == 1024  # required by the API; a default is always sent


def test_unsupported_features_are_errors():
    client = AnthropicClient("http://127.0.0.1:1", model="claude-x", api_key="k")
    with pytest.raises(ValueError, match="logprobs"):
        asyncio.run(client.chat([{"role": "user", "content": "x"}], return_logprob=True))
    with pytest.raises(ValueError, match="token ids"):
        asyncio.run(client.generate(input_ids=[1, 2]))
    with pytest.raises(ValueError, match="regex"):
        client.build_payload([{"role": "user", "content": "x"}], {"regex": "a+"})
    with pytest.raises(ValueError, match="role"):
        split_system([{"role": "tool", "content": "x"}])
