"""OpenAI-compatible client: request and reply shapes against a fake server."""
from __future__ import annotations

import asyncio

import pytest

from aflow_rl.llm import LLMClient, LLMError, OpenAIClient
from aflow_rl.llm.openai_compat import response_format_for


def chat_reply(content="hi", finish="stop", lps=(-0.25, -0.5)):
    return {"id": "c1", "object": "chat.completion",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                         "finish_reason": finish,
                         "logprobs": {"content": [{"token": f"t{i}", "logprob": lp, "top_logprobs": []}
                                                  for i, lp in enumerate(lps)]}}],
            "usage": {"prompt_tokens": 11, "completion_tokens": len(lps), "total_tokens": 11 + len(lps)}}


def test_chat_request_shape_and_logprobs(fake_server):
    srv = fake_server(lambda *a: (200, chat_reply()))
    client = OpenAIClient([srv.url], model="m-1", api_key="sk-test")
    assert isinstance(client, LLMClient)
    schema = {"title": "Plan step", "type": "object", "properties": {"x": {"type": "string"}}}
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    c = asyncio.run(client.chat(msgs, return_logprob=True, max_new_tokens=16, temperature=0.5,
                                json_schema=schema, top_logprobs_num=2, top_k=20))
    call = srv.calls[0]
    assert call["path"] == "/v1/chat/completions"
    assert call["headers"]["authorization"] == "Bearer sk-test"
    body = call["body"]
    assert body["model"] == "m-1" and body["messages"] == msgs  # system stays in the list for OpenAI
    assert body["max_tokens"] == 16 and "max_new_tokens" not in body
    assert body["temperature"] == 0.5 and body["top_k"] == 20
    assert body["logprobs"] is True and body["top_logprobs"] == 2
    assert body["response_format"] == {"type": "json_schema",
                                       "json_schema": {"name": "Plan_step", "schema": schema, "strict": True}}
    assert c.text == "hi" and c.finish_reason == "stop"
    assert c.logprobs == pytest.approx([-0.25, -0.5])
    assert (c.prompt_tokens, c.completion_tokens) == (11, 2)


@pytest.mark.parametrize("theirs, ours", [("length", "length"), ("abort", "abort"),
                                           ("content_filter", "abort"), ("tool_calls", "stop")])
def test_chat_finish_reasons(fake_server, theirs, ours):
    srv = fake_server(lambda *a: (200, chat_reply(finish=theirs)))
    c = asyncio.run(OpenAIClient(srv.url).chat([{"role": "user", "content": "x"}]))
    assert c.finish_reason == ours and c.logprobs is None
    assert "authorization" not in srv.calls[0]["headers"]  # no key, none sent
    assert "logprobs" not in srv.calls[0]["body"]


def test_completions_with_token_ids(fake_server):
    reply = {"choices": [{"text": " world", "finish_reason": "length",
                          "logprobs": {"tokens": ["a", "b"], "token_logprobs": [-1.0, -2.0]}}],
             "usage": {"prompt_tokens": 3, "completion_tokens": 2}}
    srv = fake_server(lambda *a: (200, reply))
    c = asyncio.run(OpenAIClient(srv.url).generate(input_ids=[1, 2, 3], return_logprob=True,
                                                   max_new_tokens=2, stop=["\n"]))
    body = srv.calls[0]["body"]
    assert srv.calls[0]["path"] == "/v1/completions"
    assert body["prompt"] == [1, 2, 3] and body["max_tokens"] == 2 and body["logprobs"] == 1
    assert body["model"] == "default" and body["stop"] == ["\n"]
    assert c.text == " world" and c.finish_reason == "length" and c.logprobs == [-1.0, -2.0]
    assert c.prompt_ids == [1, 2, 3]


def test_reply_without_choices_is_an_llm_error(fake_server):
    srv = fake_server(lambda *a: (200, {"error": "odd"}))
    with pytest.raises(LLMError, match="no choices"):
        asyncio.run(OpenAIClient(srv.url).chat([{"role": "user", "content": "x"}]))


def test_response_format_accepts_a_json_string():
    rf = response_format_for('{"type": "object"}')
    assert rf["json_schema"]["schema"] == {"type": "object"} and rf["json_schema"]["name"] == "output"
