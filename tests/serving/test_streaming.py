"""``n > 1``, streaming and the prefix cache over HTTP, against a real embedded server process.

Streamed and fanned-out replies are checked against the plain (n=1, non-streaming) reply of
the same greedy request, and sampled copies against an independent transformers forward.
"""
import json
import time

import httpx
import openai
import pytest
import torch

from aflow_rl.bench.serving import start_server, stop_server
from tests.serving.test_embedded import TOL, generate, recompute, stats


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    """A real embedded server process (prefix cache on, the default); yields its base URL."""
    log = str(tmp_path_factory.mktemp("streaming") / "server.log")
    proc, url = start_server(tiny_model_dir, None, log)
    try:
        yield url
    finally:
        stop_server(proc)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server, timeout=60.0) as client:
        yield client


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def model_a(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()

LONG = "Spawn four subagents, give each one item, then join their results and answer. " * 3


def sse_events(client: httpx.Client, path: str, payload: dict) -> list:
    """POST and read the whole Server-Sent Events stream; returns the decoded data objects."""
    events = []
    with client.stream("POST", path, json=payload) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if not line:
                continue
            assert line.startswith("data: "), line
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    return events[:-1]


# ---- the prefix cache over HTTP -------------------------------------------------------------------------

def test_repeated_prefix_reports_cached_tokens_and_flush_empties_it(http, tok):
    ids = tok.encode(LONG)
    assert len(ids) > 64
    payload = {"input_ids": ids, "sampling_params": {"max_new_tokens": 4, "temperature": 0}, "return_logprob": True}
    first = generate(http, **payload)
    second = generate(http, **payload)
    assert second["meta_info"]["cached_tokens"] >= 32 * ((len(ids) - 1) // 32) > 0
    assert second["output_ids"] == first["output_ids"]
    assert second["meta_info"]["output_token_logprobs"] == first["meta_info"]["output_token_logprobs"]
    info = stats(http)
    assert info["prefix_cache"] is True and info["cached_tokens"] > 0 and info["prefix_cache_tokens"] > 0
    assert http.post("/flush_cache").status_code == 200
    third = generate(http, **payload)
    assert third["meta_info"]["cached_tokens"] == 0
    assert third["meta_info"]["output_token_logprobs"] == first["meta_info"]["output_token_logprobs"]


# ---- n > 1 --------------------------------------------------------------------------------------------

def test_generate_n_expands_prompt_major_and_shares_the_prefill(http, tok, model_a):
    prompts = [LONG, "Join the results of every subagent. " * 6]
    replies = generate(http, text=prompts, sampling_params={"n": 3, "temperature": 1.0, "max_new_tokens": 12},
                       return_logprob=True)
    assert isinstance(replies, list) and len(replies) == 6
    assert len({r["meta_info"]["id"] for r in replies}) == 6
    for k, reply in enumerate(replies):
        ids = tok.encode(prompts[k // 3])
        assert reply["meta_info"]["prompt_tokens"] == len(ids)          # prompt-major order
        out = reply["output_ids"]
        got = torch.tensor([row[0] for row in reply["meta_info"]["output_token_logprobs"]])
        assert (recompute(model_a, ids, out, 1.0) - got).abs().max().item() < TOL
        if k % 3:   # the copies after the first reuse its prompt KV
            assert reply["meta_info"]["cached_tokens"] >= 32, reply["meta_info"]
    assert len({tuple(r["output_ids"]) for r in replies}) > 2          # sampled independently
    single = generate(http, text=LONG, sampling_params={"n": 2, "max_new_tokens": 3})
    assert isinstance(single, list) and len(single) == 2               # one prompt, n > 1: a list (SGLang)


def test_chat_n_gives_n_choices(server):
    client = openai.OpenAI(base_url=server + "/v1", api_key="unused", timeout=60)
    resp = client.chat.completions.create(model="m", messages=[{"role": "user", "content": LONG}], n=3,
                                          max_tokens=8, temperature=1.0, logprobs=True, top_logprobs=2)
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert all(len(c.logprobs.content) >= 1 for c in resp.choices)
    assert resp.usage.completion_tokens == sum(len(c.logprobs.content) + (c.finish_reason == "stop")
                                               for c in resp.choices)
    plain = client.chat.completions.create(model="m", messages=[{"role": "user", "content": LONG}], max_tokens=1)
    assert resp.usage.prompt_tokens == plain.usage.prompt_tokens     # the shared prompt counts once


@pytest.mark.parametrize("payload, needle", [
    ({"text": "hi", "sampling_params": {"n": 0}}, "sampling_params.n"),
    ({"text": "hi", "sampling_params": {"n": 1000}}, "sampling_params.n"),
    ({"text": ["a", "b"], "sampling_params": [{"n": 2}, {"n": 3}]}, "the same for every prompt"),
    ({"text": "hi", "stream": "yes"}, "stream must be true or false"),
])
def test_bad_n_or_stream_is_a_400(http, payload, needle):
    r = http.post("/generate", json=payload)
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text


# ---- streaming -----------------------------------------------------------------------------------------

def test_generate_stream_matches_the_plain_reply(http, tok):
    payload = {"input_ids": tok.encode(LONG), "return_logprob": True,
               "sampling_params": {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}}
    plain = generate(http, **payload)
    events = sse_events(http, "/generate", {**payload, "stream": True})
    assert len(events) >= 2                                   # partial updates, then the final reply
    final = events[-1]
    assert final["text"] == plain["text"] and final["output_ids"] == plain["output_ids"]
    assert final["meta_info"]["output_token_logprobs"] == plain["meta_info"]["output_token_logprobs"]
    assert final["meta_info"]["finish_reason"] == {"type": "length", "length": 24}
    for ev in events[:-1]:                                    # cumulative, a prefix of the final reply
        assert ev["meta_info"]["finish_reason"] is None
        n = len(ev["output_ids"])
        assert ev["output_ids"] == plain["output_ids"][:n] and plain["text"].startswith(ev["text"])
        assert ev["meta_info"]["output_token_logprobs"] == plain["meta_info"]["output_token_logprobs"][:n]


def test_generate_stream_with_n_and_a_stop_string_never_sends_trimmed_text(http, tok):
    plain = generate(http, text=LONG, sampling_params={"max_new_tokens": 30, "temperature": 0, "ignore_eos": True})
    stop = plain["text"][6:9]                                  # a stop string the greedy output will contain
    assert len(stop) == 3
    params = {"max_new_tokens": 30, "temperature": 0, "ignore_eos": True, "stop": stop, "n": 2}
    events = sse_events(http, "/generate", {"text": LONG, "sampling_params": params, "stream": True})
    finals = {ev["index"]: ev for ev in events if ev["meta_info"]["finish_reason"] is not None}
    assert sorted(finals) == [0, 1]
    for i, final in finals.items():
        assert final["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
        assert stop not in final["text"] and plain["text"].startswith(final["text"])
        assert all(final["text"].startswith(ev["text"]) for ev in events if ev["index"] == i)


def test_chat_stream_with_the_openai_sdk(server):
    client = openai.OpenAI(base_url=server + "/v1", api_key="unused", timeout=60)
    messages = [{"role": "user", "content": LONG}]
    # The same two sequences without streaming: decoded in a batch of two alike, so equal to the bit
    # (a batch of one rounds differently in the 7th digit).
    plain = client.chat.completions.create(model="m", messages=messages, max_tokens=20, temperature=0, n=2,
                                           logprobs=True)
    stream = client.chat.completions.create(model="m", messages=messages, max_tokens=20, temperature=0, n=2,
                                            logprobs=True, stream=True, stream_options={"include_usage": True})
    text, lps, finish, usage = ["", ""], [[], []], [None, None], None
    for chunk in stream:
        assert chunk.object == "chat.completion.chunk"
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text[c.index] += c.delta.content or ""
            lps[c.index] += [e.logprob for e in (c.logprobs.content if c.logprobs else [])]
            finish[c.index] = c.finish_reason or finish[c.index]
    assert text == [c.message.content for c in plain.choices]
    assert lps == [[e.logprob for e in c.logprobs.content] for c in plain.choices]
    assert finish == [c.finish_reason for c in plain.choices]
    assert usage.completion_tokens == plain.usage.completion_tokens and usage.prompt_tokens == plain.usage.prompt_tokens


def test_a_closed_stream_aborts_its_request(http, server, tok):
    # The server is shared by this module's tests: wait until nothing earlier still runs, so the count
    # below is this request's alone.
    idle_by = time.monotonic() + 120
    while stats(http)["running"] and time.monotonic() < idle_by:
        time.sleep(0.2)
    assert stats(http)["running"] == 0, "an earlier test's request is still running"
    aborted, generated = stats(http)["aborted"], stats(http)["generated_tokens"]
    payload = {"input_ids": tok.encode("Go on and on."), "stream": True,
               "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True}}
    t0 = time.monotonic()
    with httpx.Client(base_url=server, timeout=60) as client:
        with client.stream("POST", "/generate", json=payload) as r:
            first = next(r.iter_lines())                       # the first update arrives, then we hang up
    hung_up_s = time.monotonic() - t0
    # Aborted at the next token it tries to send, not finished: the engine counts it as aborted (all
    # 1500 tokens take only ~2.4 s on a quiet machine, so "no longer running" alone would not tell an
    # abort from a completion). Wait for the count, not for "running" to drop: the first token is
    # streamed before its sequence joins the running batch, so right after the hang-up "running" can
    # read 0 for a request that is still being prefilled (seen failing in CI and here, 1 in ~6 runs).
    deadline = time.monotonic() + 20
    while stats(http)["aborted"] == aborted and time.monotonic() < deadline:
        time.sleep(0.1)
    s = stats(http)
    assert s["aborted"] == aborted + 1, (f"no abort counted within 20 s; hung up {hung_up_s:.2f} s after sending; "
                                         f"first update {first[:120]!r}; stats {s}")
    assert s["generated_tokens"] - generated < 1500, s
    while stats(http)["running"] and time.monotonic() < deadline:   # it leaves the batch in the same step
        time.sleep(0.1)
    assert stats(http)["running"] == 0


def test_a_stream_notices_a_hang_up_under_asgi_2_4_too():
    """Under ASGI spec 2.4 Starlette does not listen for the disconnect; the response does (_FanoutStream)."""
    import asyncio

    from aflow_rl.serving.streaming import _FanoutStream

    async def main():
        stop, sent = asyncio.Event(), []

        class Fan:
            aborted = 0

            def abort(self):
                self.aborted += 1
                stop.set()

        async def events():
            yield "data: 1\n\n"
            await stop.wait()                      # a generation that runs until its fan is aborted
            yield "data: aborted\n\n"

        async def receive():
            await asyncio.sleep(0.05)              # the body was read; then the client hangs up
            return {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)

        fan = Fan()
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}}
        await asyncio.wait_for(_FanoutStream(fan, events(), media_type="text/event-stream")(scope, receive, send), 10)
        return fan, sent

    fan, sent = asyncio.run(main())
    assert fan.aborted >= 1
    bodies = [m.get("body") for m in sent if m["type"] == "http.response.body"]
    assert bodies[:2] == [b"data: 1\n\n", b"data: aborted\n\n"]


def test_chat_bad_n_or_logprobs_is_a_400(http):
    msgs = [{"role": "user", "content": "hi"}]
    for payload, needle in (({"messages": msgs, "n": 0}, "n must be"), ({"messages": msgs, "n": 2, "logprobs": "y"},
                                                                        "logprobs must be true or false")):
        r = http.post("/v1/chat/completions", json=payload)
        assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text


def test_a_server_without_the_cache_answers_the_same(http, tok, tiny_model_dir, tmp_path):
    """--disable-radix-cache (SGLang's flag) over HTTP: nothing cached, the same greedy tokens and logprobs."""
    payload = {"input_ids": tok.encode(LONG), "return_logprob": True, "logprob_start_len": 40,
               "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}}
    generate(http, **payload)
    cached = generate(http, **payload)
    assert cached["meta_info"]["cached_tokens"] == 32
    proc, url = start_server(tiny_model_dir, None, str(tmp_path / "off.log"), extra_args=["--disable-radix-cache"])
    try:
        with httpx.Client(base_url=url, timeout=60) as off:
            plain = [generate(off, **payload) for _ in range(2)]
            assert off.get("/get_server_info").json()["internal_states"][0]["prefix_cache"] is False
    finally:
        stop_server(proc)
    for reply in plain:
        assert reply["meta_info"]["cached_tokens"] == 0
        assert reply["output_ids"] == cached["output_ids"]
        for key in ("output_token_logprobs", "input_token_logprobs"):
            assert reply["meta_info"][key] == cached["meta_info"][key]


# ---- /v1/completions: n and stream ---------------------------------------------------------------------

def test_completions_n_gives_prompt_major_choices_counting_each_prompt_once(server):
    client = openai.OpenAI(base_url=server + "/v1", api_key="unused", timeout=60)
    prompts = [LONG, "Join the results of every subagent. " * 4]
    kw = dict(model="m", max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    resp = client.completions.create(prompt=prompts, n=3, **kw)
    plain = [client.completions.create(prompt=p, **kw) for p in prompts]
    assert [c.index for c in resp.choices] == list(range(6))
    assert [c.text for c in resp.choices] == [plain[k // 3].choices[0].text for k in range(6)]   # greedy copies
    assert resp.usage.prompt_tokens == sum(p.usage.prompt_tokens for p in plain)                # once per prompt
    assert resp.usage.completion_tokens == 6 * 10
    assert all(c.finish_reason == "length" for c in resp.choices)


def test_completions_stream_has_sglangs_chunk_shape_and_adds_up_to_the_plain_reply(http, tok):
    # Two greedy copies decode in a batch of two with or without streaming: equal to the bit.
    base = {"model": "m", "prompt": LONG, "max_tokens": 16, "temperature": 0, "n": 2, "logprobs": 1,
            "ignore_eos": True}
    plain = http.post("/v1/completions", json=base).json()
    events = sse_events(http, "/v1/completions", {**base, "stream": True, "stream_options": {"include_usage": True}})
    *chunks, usage_chunk = events
    assert len(chunks) > 2                                     # token updates, not one final blob
    text, tokens, lps, offsets, finish = ["", ""], [[], []], [[], []], [[], []], [None, None]
    for ch in chunks:
        assert set(ch) == {"id", "object", "created", "model", "choices", "usage"} and ch["usage"] is None
        assert ch["object"] == "text_completion" and len(ch["choices"]) == 1
        c = ch["choices"][0]
        assert set(c) == {"index", "text", "logprobs", "finish_reason", "matched_stop"}
        i = c["index"]
        text[i] += c["text"]
        if c["logprobs"] is not None:
            tokens[i] += c["logprobs"]["tokens"]
            lps[i] += c["logprobs"]["token_logprobs"]
            offsets[i] += c["logprobs"]["text_offset"]
            assert len(c["logprobs"]["top_logprobs"]) == len(c["logprobs"]["tokens"])
        assert finish[i] is None                               # nothing follows a sequence's final chunk
        finish[i] = c["finish_reason"]
    ids = {i: {ch["id"] for ch in chunks if ch["choices"][0]["index"] == i} for i in (0, 1)}
    assert len(ids[0]) == len(ids[1]) == 1 and ids[0] != ids[1]   # each sequence keeps its own id (SGLang)
    for i, choice in enumerate(plain["choices"]):
        assert text[i] == choice["text"] and finish[i] == choice["finish_reason"] == "length"
        assert tokens[i] == choice["logprobs"]["tokens"] and lps[i] == choice["logprobs"]["token_logprobs"]
        assert offsets[i] == choice["logprobs"]["text_offset"]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == plain["usage"]
    assert plain["usage"]["prompt_tokens"] == len(tok.encode(LONG))   # the shared prompt counts once


def test_completions_stream_with_a_stop_string_with_the_openai_sdk(server, http):
    client = openai.OpenAI(base_url=server + "/v1", api_key="unused", timeout=60)
    plain = http.post("/v1/completions", json={"prompt": LONG, "max_tokens": 30, "temperature": 0,
                                               "ignore_eos": True}).json()["choices"][0]["text"]
    stop = plain[6:9]
    assert len(stop) == 3
    stream = client.completions.create(model="m", prompt=LONG, max_tokens=30, temperature=0, stop=stop, stream=True,
                                       extra_body={"ignore_eos": True})
    text, finish = "", None
    for chunk in stream:
        assert chunk.object == "text_completion"
        text += chunk.choices[0].text
        assert plain.startswith(text)                          # a stop string's start is held back
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "stop" and stop not in text and plain.startswith(text)


@pytest.mark.parametrize("extra, needle", [({"n": 0}, "n must be"), ({"stream": "yes"}, "stream must be true or false"),
                                           ({"stream": True, "stream_options": 3}, "stream_options must be an object"),
                                           ({"n": 2, "echo": True}, "echo")])
def test_completions_bad_n_or_stream_is_a_400(http, extra, needle):
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, **extra})
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
