"""SGLang native client: /generate request and reply shapes, finish reasons, admin calls."""
from __future__ import annotations

import asyncio
import json

import pytest

from aflow_rl.llm import LLMClient, LLMError, SGLangClient
from aflow_rl.llm.sglang import finish_reason_of, parse_generate_reply

from .conftest import generate_reply


def run(coro):
    return asyncio.run(coro)


def test_generate_with_input_ids_returns_ids_logprobs_and_version(fake_server):
    srv = fake_server(lambda *a: (200, generate_reply("hi", ids=(7, 8, 9), version="3")))
    client = SGLangClient([srv.url])
    assert isinstance(client, LLMClient)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    c = run(client.generate(input_ids=[1, 2, 3], return_logprob=True, max_new_tokens=8,
                            temperature=0.7, json_schema=schema, rid="ep1-t0", top_p=None))
    assert c.text == "hi" and c.output_ids == [7, 8, 9]
    assert c.logprobs == pytest.approx([-0.5, -1.5, -2.5])
    assert c.finish_reason == "stop" and c.weight_version == "3"
    assert c.prompt_ids == [1, 2, 3] and c.prompt_tokens == 3 and c.completion_tokens == 3

    body = srv.calls[0]["body"]
    assert srv.calls[0]["path"] == "/generate"
    assert body["input_ids"] == [1, 2, 3] and "text" not in body
    assert body["return_logprob"] is True and body["rid"] == "ep1-t0"
    sp = body["sampling_params"]
    assert sp["max_new_tokens"] == 8 and sp["temperature"] == 0.7 and "top_p" not in sp
    assert isinstance(sp["json_schema"], str) and json.loads(sp["json_schema"]) == schema
    assert "rid" not in sp


def test_generate_with_text_and_regex(fake_server):
    srv = fake_server(lambda *a: (200, generate_reply("42", ids=(4,), logprobs=False)))
    c = run(SGLangClient(srv.url).generate("2*21=", regex=r"\d+", stop=["\n"]))
    body = srv.calls[0]["body"]
    assert body["text"] == "2*21=" and "input_ids" not in body
    assert body["sampling_params"] == {"regex": r"\d+", "stop": ["\n"]}
    assert body["return_logprob"] is False
    assert c.logprobs is None and c.output_ids == [4]


@pytest.mark.parametrize("finish", ["abort", "length", "stop"])
def test_finish_reasons_reach_the_caller(fake_server, finish):
    srv = fake_server(lambda *a: (200, generate_reply(finish=finish)))
    assert run(SGLangClient(srv.url).generate("x")).finish_reason == finish


def test_finish_reason_mapping_and_missing_output_ids():
    assert finish_reason_of({"type": "length", "length": 8}) == "length"
    assert finish_reason_of("stop") == "stop"
    assert finish_reason_of(None) == "abort"       # not finished: never passed off as complete
    reply = generate_reply(ids=(3, 4))
    del reply["output_ids"]
    c = parse_generate_reply(reply)
    assert c.output_ids == [3, 4] and c.logprobs == pytest.approx([-0.5, -1.5])


def test_generate_needs_exactly_one_prompt_form():
    client = SGLangClient("http://127.0.0.1:1")
    with pytest.raises(ValueError):
        run(client.generate())
    with pytest.raises(ValueError):
        run(client.generate("a", input_ids=[1]))


def test_malformed_reply_is_an_llm_error(fake_server):
    srv = fake_server(lambda *a: (200, {"text": "no meta"}))
    with pytest.raises(LLMError, match="unexpected reply"):
        run(SGLangClient(srv.url).generate("x"))


def test_update_weights_hits_every_server_and_checks_success(fake_server):
    def ok(method, path, body, headers):
        return 200, {"success": True, "message": "loaded"}
    a, b = fake_server(ok), fake_server(ok)
    client = SGLangClient([a.url, b.url])
    replies = run(client.update_weights_from_disk("/ckpt/step_3", weight_version="3"))
    assert len(replies) == 2
    for srv in (a, b):
        assert srv.calls[0]["path"] == "/update_weights_from_disk"
        assert srv.calls[0]["body"] == {"model_path": "/ckpt/step_3", "weight_version": "3"}

    bad = fake_server(lambda *x: (200, {"success": False, "message": "shape mismatch"}))
    with pytest.raises(LLMError, match="shape mismatch") as err:
        run(SGLangClient([a.url, bad.url]).update_weights_from_disk("/ckpt/x"))
    assert bad.url in str(err.value)


def test_weight_sync_skips_an_unreachable_server_and_takes_it_back_when_it_returns(fake_server, dead_url):
    def ok(method, path, body, headers):
        return 200, {"success": True, "message": "loaded"} if path == "/update_weights_from_disk" else generate_reply()
    live = fake_server(ok)
    client = SGLangClient([live.url, dead_url], max_retries=1, backoff_s=0.01)
    replies = run(client.update_weights_from_disk("/ckpt/step_1", weight_version="1"))
    assert len(replies) == 1 and client.urls == [live.url] and client.all_urls == [live.url, dead_url]
    for _ in range(4):  # out of rotation: generation never tries it
        run(client.generate(input_ids=[1, 2]))
    assert [c["path"] for c in live.calls].count("/generate") == 4
    back = fake_server(ok, port=int(dead_url.rsplit(":", 1)[1]))  # it comes back: the next sync takes it in
    run(client.update_weights_from_disk("/ckpt/step_2", weight_version="2"))
    assert client.urls == [live.url, dead_url] and back.calls[0]["body"]["weight_version"] == "2"


def test_weight_sync_with_no_server_reachable_raises(dead_url):
    with pytest.raises(LLMError, match="no server reachable"):
        run(SGLangClient([dead_url], max_retries=0).update_weights_from_disk("/ckpt/x"))


def test_flush_abort_info_and_health(fake_server, dead_url):
    def reply(method, path, body, headers):
        if path == "/get_model_info":
            return 200, {"model_path": "/m", "is_generation": True}
        return 200, "Cache flushed.\n"  # SGLang answers /flush_cache with plain text
    a, b = fake_server(reply), fake_server(reply)
    client = SGLangClient([a.url, b.url])
    run(client.flush_cache())
    run(client.abort_request("ep7"))
    assert a.paths() == b.paths() == ["/flush_cache", "/abort_request"]
    assert a.calls[1]["body"] == {"rid": "ep7"}
    assert run(client.get_model_info())["model_path"] == "/m"
    health = run(SGLangClient([a.url, dead_url], max_retries=5).health(timeout_s=1.0))
    assert health == {a.url: True, dead_url: False}


def test_chat_goes_to_v1_chat_completions(fake_server):
    reply = {"choices": [{"message": {"content": "hello"}, "finish_reason": "length",
                          "logprobs": {"content": [{"token": "he", "logprob": -0.1},
                                                   {"token": "llo", "logprob": -0.2}]}}],
             "usage": {"prompt_tokens": 5, "completion_tokens": 2}}
    srv = fake_server(lambda *a: (200, reply))
    c = run(SGLangClient(srv.url).chat([{"role": "user", "content": "hi"}], return_logprob=True,
                                       max_new_tokens=2))
    assert srv.calls[0]["path"] == "/v1/chat/completions"
    assert srv.calls[0]["body"]["max_tokens"] == 2 and srv.calls[0]["body"]["logprobs"] is True
    assert c.text == "hello" and c.finish_reason == "length" and c.logprobs == pytest.approx([-0.1, -0.2])


def test_numpy_and_torch_input_ids_arrive_as_plain_ints(fake_server):
    """build_payload copies ids as they are; the encoder turns numpy and torch ids into JSON ints."""
    import numpy as np
    import torch

    srv = fake_server(lambda *a: (200, generate_reply()))
    client = SGLangClient([srv.url])
    for ids in (np.array([4, 5, 6]), torch.tensor([4, 5, 6]), list(torch.tensor([4, 5, 6])),
                [np.int64(4), np.int32(5), 6]):
        run(client.generate(input_ids=ids, max_new_tokens=2))
    assert [c["body"]["input_ids"] for c in srv.calls] == [[4, 5, 6]] * 4


def test_pause_and_continue_generation_hit_every_server(fake_server):
    def reply(method, path, body, headers):
        return 200, {"message": "ok", "status": "ok"}
    a, b = fake_server(reply), fake_server(reply)
    client = SGLangClient([a.url, b.url])
    run(client.pause_generation("in_place"))
    run(client.continue_generation())
    for srv in (a, b):   # SGLang's bodies
        assert [(c["path"], c["body"]) for c in srv.calls] == [("/pause_generation", {"mode": "in_place"}),
                                                               ("/continue_generation", {})]
    with pytest.raises(ValueError, match="abort, retract, in_place"):
        run(client.pause_generation("drain"))
    assert len(a.calls) == 2     # nothing sent

    refused = fake_server(lambda *x: (404, {"detail": "Not Found"}))
    client = SGLangClient([refused.url, a.url], max_retries=0)
    with pytest.raises(LLMError, match="404"):
        run(client.continue_generation())
    assert a.calls[-1]["path"] == "/continue_generation"    # the other server was still resumed
