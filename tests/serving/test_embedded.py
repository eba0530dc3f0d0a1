"""The embedded server as a real subprocess, spoken to over HTTP.

Logprobs are checked against an independent transformers forward pass on the
same weights (fp32): log_softmax(mask(logits) / T) of every sampled token.
"""
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import pytest
import torch

from aflow_rl.serving.grammar import GrammarBackend, grammar_masks

TOL = 1e-4
SCHEMA = {
    "type": "object",
    "properties": {
        "action": {"enum": ["spawn", "assign", "join", "finish"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 9},
        "note": {"type": "string", "maxLength": 6},
    },
    "required": ["action", "n", "note"],
    "additionalProperties": False,
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    """A real `python -m aflow_rl.serving.embedded` process; yields its base URL."""
    port = _free_port()
    log_path = tmp_path_factory.mktemp("embedded") / "server.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "aflow_rl.serving.embedded", "--model-path", tiny_model_dir,
                                 "--port", str(port), "--random-seed", "0", "--max-batch-size", "64"],
                                stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180   # a loaded 2-core box needs minutes to import torch
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"server exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
            try:
                if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"server not healthy after 180 s:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server, timeout=60.0) as client:
        yield client


def _load(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def model_a(tiny_model_dir):
    return _load(tiny_model_dir)


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def backend(tiny_model_dir):
    return GrammarBackend.from_pretrained(tiny_model_dir)


def recompute(model, prompt_ids, output_ids, temperature, masks=None):
    """Reference logprobs of ``output_ids`` [T] from one plain forward pass over prompt + output."""
    ids = torch.tensor([prompt_ids + output_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1:-1].float()       # [T, V]
    if masks is not None:
        logits = logits.masked_fill(~masks, float("-inf"))
    t = temperature if temperature > 0 else 1.0
    return torch.log_softmax(logits / t, dim=-1).gather(1, torch.tensor(output_ids)[:, None])[:, 0]


def prompt_logprobs(model, ids):
    """Reference logprob of ids[k] given ids[:k], k >= 1: [len(ids) - 1]."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def generate(http, **payload):
    r = http.post("/generate", json=payload)
    assert r.status_code == 200, r.text
    return r.json()


def stats(http):
    return http.get("/get_server_info").json()["internal_states"][0]


# ---- routes ------------------------------------------------------------------------------------

def test_health_info_and_models(http, tiny_model_dir):
    assert http.get("/health").status_code == 200
    assert http.get("/health_generate").status_code == 200
    info = http.get("/get_model_info").json()
    assert info["model_path"] == tiny_model_dir and info["is_generation"] is True
    assert info["weight_version"] == "default"
    server = http.get("/get_server_info").json()
    assert server["context_length"] == 2048 and server["max_running_requests"] == 64
    assert http.get("/v1/models").json()["data"][0]["id"] == tiny_model_dir
    assert http.post("/flush_cache").status_code == 200


def test_openai_sdk_chat_with_logprobs(server, http, tiny_model_dir, model_a, tok):
    import openai

    client = openai.OpenAI(base_url=server + "/v1", api_key="unused", timeout=60)
    messages = [{"role": "user", "content": "Plan the task."}]
    resp = client.chat.completions.create(model=tiny_model_dir, messages=messages, max_tokens=12,
                                          temperature=0.7, logprobs=True, top_logprobs=3, seed=7)
    choice = resp.choices[0]
    content = choice.logprobs.content
    assert choice.finish_reason in ("stop", "length") and resp.usage.completion_tokens >= len(content) > 0
    for entry in content:
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and entry.logprob <= tops[0] + 1e-6
    # Same prompt (chat template) and seed on /generate: same tokens; logprobs are the model's.
    prompt = tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                        add_special_tokens=False)
    assert resp.usage.prompt_tokens == len(prompt)
    native = generate(http, input_ids=prompt, return_logprob=True,
                      sampling_params={"max_new_tokens": 12, "temperature": 0.7, "sampling_seed": 7})
    out = native["output_ids"]
    assert [e.token for e in content] == [tok.decode([t]) for t in out[:len(content)]]
    ref = recompute(model_a, prompt, out, 0.7)[:len(content)]
    assert (ref - torch.tensor([e.logprob for e in content])).abs().max().item() < TOL

    # response_format json_schema through the SDK: the content parses and validates.
    resp = client.chat.completions.create(
        model=tiny_model_dir, messages=[{"role": "user", "content": "Act."}], max_tokens=96, temperature=1.0,
        response_format={"type": "json_schema", "json_schema": {"name": "action", "schema": SCHEMA}})
    jsonschema.validate(json.loads(resp.choices[0].message.content), SCHEMA)
    assert resp.choices[0].finish_reason == "stop"


def test_openai_sdk_completions(server, tiny_model_dir):
    import openai

    client = openai.OpenAI(base_url=server + "/v1", api_key="unused", timeout=60)
    resp = client.completions.create(model=tiny_model_dir, prompt="What is 2 + 2?", max_tokens=6, logprobs=2,
                                     temperature=1.0)
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == resp.usage.completion_tokens == 6
    assert resp.choices[0].finish_reason == "length"


# ---- logprobs --------------------------------------------------------------------------------------

@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("constrained", [False, True], ids=["free", "json_schema"])
def test_concurrent_generate_logprobs_match_transformers(http, tok, model_a, backend, temperature, constrained):
    prompts = [tok.encode(f"Task {i}: " + "spawn subagents and join them " * (1 + i % 3)) for i in range(6)]
    params = {"max_new_tokens": 96, "temperature": temperature}
    if constrained:
        params["json_schema"] = json.dumps(SCHEMA)

    def one(ids):
        return generate(http, input_ids=ids, sampling_params=params, return_logprob=True)

    with ThreadPoolExecutor(len(prompts)) as pool:   # concurrent: decoded in one batch
        replies = list(pool.map(one, prompts))
    worst = 0.0
    for ids, reply in zip(prompts, replies):
        out = reply["output_ids"]
        lps = reply["meta_info"]["output_token_logprobs"]
        assert [row[1] for row in lps] == out and len(out) == reply["meta_info"]["completion_tokens"] > 0
        masks = grammar_masks({"json_schema": params["json_schema"]}, out, backend=backend) if constrained else None
        ref = recompute(model_a, ids, out, temperature, masks)
        worst = max(worst, (ref - torch.tensor([row[0] for row in lps])).abs().max().item())
        if constrained:
            assert reply["meta_info"]["finish_reason"] == {"type": "stop", "matched": tok.eos_token_id}
            jsonschema.validate(json.loads(reply["text"]), SCHEMA)
            # The mask matters: without it the same tokens have other logprobs.
            unmasked = recompute(model_a, ids, out, temperature)
            assert (unmasked - ref).abs().max().item() > 1e-2
    assert worst < TOL, worst


def test_concurrent_requests_are_decoded_in_batches(http):
    before = stats(http)["decode_steps"]
    n, new = 8, 32
    payload = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": new, "ignore_eos": True}}
    with ThreadPoolExecutor(n) as pool:
        replies = list(pool.map(lambda _: generate(http, **payload), range(n)))
    assert all(len(r["output_ids"]) == new for r in replies)
    steps = stats(http)["decode_steps"] - before
    # One at a time would take n * (new - 1) decode steps; batched they share most steps.
    assert steps < n * (new - 1) / 2, steps


def test_json_schema_samples_all_validate(http):
    replies = generate(http, input_ids=[[7 + i, 8, 9] for i in range(50)],
                       sampling_params={"max_new_tokens": 96, "temperature": 1.0, "json_schema": json.dumps(SCHEMA)})
    assert len(replies) == 50
    for reply in replies:
        assert reply["meta_info"]["finish_reason"]["type"] == "stop", reply
        jsonschema.validate(json.loads(reply["text"]), SCHEMA)
    assert len({r["text"] for r in replies}) > 5   # sampled, not one fixed answer


def test_second_request_with_the_same_schema_hits_the_grammar_cache(http):
    schema = json.dumps({"type": "object", "properties": {"cache_probe": {"type": "integer"}},
                         "required": ["cache_probe"]})

    def cache():
        return http.get("/get_server_info").json()["grammar_cache"]

    before = cache()
    generate(http, input_ids=[5, 6], sampling_params={"max_new_tokens": 4, "json_schema": schema})
    mid = cache()
    assert (mid["misses"], mid["hits"]) == (before["misses"] + 1, before["hits"])
    generate(http, input_ids=[5, 7], sampling_params={"max_new_tokens": 4, "json_schema": schema})
    after = cache()
    assert (after["misses"], after["hits"]) == (mid["misses"], mid["hits"] + 1)


def test_regex_constrained_output(http, tok):
    replies = generate(http, text=["Answer: ", "Is it?"], sampling_params={"regex": "(yes|no)", "max_new_tokens": 8})
    for reply in replies:
        assert reply["text"] in ("yes", "no")
        assert reply["output_ids"][-1] == tok.eos_token_id


def test_prefill_only_prompt_logprobs_match_transformers(http, tok, model_a):
    ids = tok.encode("Spawn four subagents, then join their results.")
    for start in (0, 3):
        reply = generate(http, input_ids=ids, sampling_params={"max_new_tokens": 0}, return_logprob=True,
                         logprob_start_len=start, top_logprobs_num=2)
        meta = reply["meta_info"]
        assert reply["output_ids"] == [] and meta["finish_reason"]["type"] == "length"
        rows = meta["input_token_logprobs"]
        assert [r[1] for r in rows] == ids[start:] and rows[0][0] is None
        ref = prompt_logprobs(model_a, ids)[start:]
        assert (ref - torch.tensor([r[0] for r in rows[1:]])).abs().max().item() < TOL
        tops = meta["input_top_logprobs"]
        assert tops[0] is None and all(len(t) == 2 and t[0][0] >= t[1][0] for t in tops[1:])


def test_batched_text_with_per_item_params_keeps_order(http):
    replies = generate(http, text=["one", "two", "three"],
                       sampling_params=[{"max_new_tokens": n, "ignore_eos": True} for n in (2, 5, 3)],
                       rid=["r-a", "r-b", "r-c"])
    assert [r["meta_info"]["completion_tokens"] for r in replies] == [2, 5, 3]
    assert [r["meta_info"]["id"] for r in replies] == ["r-a", "r-b", "r-c"]
    assert all(r["meta_info"]["finish_reason"] == {"type": "length", "length": n} for r, n in zip(replies, (2, 5, 3)))


def test_sampling_seed_is_reproducible(http):
    payload = {"input_ids": [9, 10, 11], "sampling_params": {"max_new_tokens": 12, "sampling_seed": 1234,
                                                             "ignore_eos": True}}
    assert generate(http, **payload)["output_ids"] == generate(http, **payload)["output_ids"]


# ---- stops and finish reasons ---------------------------------------------------------------------------

def test_stop_strings_stop_token_ids_and_length(http, tok):
    base = {"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True}
    greedy = generate(http, input_ids=[11, 12, 13], sampling_params=base)
    assert greedy["meta_info"]["finish_reason"] == {"type": "length", "length": 24}
    out, text = greedy["output_ids"], greedy["text"]

    # stop_token_ids: stops at the first occurrence; the token stays in output_ids, not in text.
    stop_id = out[4]
    k = out.index(stop_id)
    reply = generate(http, input_ids=[11, 12, 13], sampling_params={**base, "stop_token_ids": [stop_id]})
    assert reply["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    assert reply["output_ids"] == out[:k + 1]
    assert reply["text"] == tok.decode(out[:k])

    # stop strings: SGLang trims the matched string (and what follows) from text.
    stop = next(c for c in text[3:] if not c.isspace() and c != "\ufffd")
    reply = generate(http, input_ids=[11, 12, 13], sampling_params={**base, "stop": [stop, "never-seen"]})
    assert reply["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert reply["text"] == text[:text.index(stop)]
    assert len(reply["output_ids"]) <= len(out)


def test_stop_regex_stops_where_the_pattern_first_matches(http, tok):
    free = generate(http, input_ids=[11, 12, 13], sampling_params={"max_new_tokens": 16, "temperature": 0,
                                                                    "ignore_eos": True})["output_ids"]
    texts = [tok.decode(free[:j]) for j in range(len(free) + 1)]
    piece = texts[8][len(texts[6]):]                       # the text of tokens 6..7
    pattern = "(?:" + re.escape(piece) + ")|QQQ[0-9]"
    expected = next(j for j in range(1, len(free) + 1) if re.search(pattern, texts[j]))
    reply = generate(http, input_ids=[11, 12, 13], sampling_params={
        "max_new_tokens": 16, "temperature": 0, "ignore_eos": True, "stop_regex": [pattern]})
    assert reply["output_ids"] == free[:expected]
    assert reply["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern}
    # SGLang's detokenizer trims at output.find(matched): the pattern's literal text, rarely present.
    full = texts[expected]
    assert reply["text"] == (full[:full.find(pattern)] if pattern in full else full)


@pytest.mark.parametrize("params", [
    {"top_k": 10 ** 18, "sampling_seed": 2 ** 63 - 1},
    {"top_k": -1, "sampling_seed": -(2 ** 63), "min_p": 0.0, "n": 1, "stop_regex": [], "stream_interval": 3,
     "custom_params": {"a": 1}, "logit_bias": {}, "ebnf": ""},
])
def test_extreme_but_valid_sampling_params_are_served(http, params):
    reply = generate(http, input_ids=[3, 4], sampling_params={"max_new_tokens": 3, "ignore_eos": True, **params})
    assert reply["meta_info"]["completion_tokens"] == 3


def test_chat_takes_sglang_extras(http):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 0, "n": 1,
            "frequency_penalty": 0, "ebnf": 'root ::= "yes" | "no"', "stop_regex": ["zzz[0-9]"], "min_tokens": 0}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] in ("yes", "no")


def test_ebnf_grammar(http):
    replies = generate(http, input_ids=[[5, 6], [7, 8]],
                       sampling_params={"ebnf": 'root ::= "ab" | "cd"', "max_new_tokens": 8})
    assert {r["text"] for r in replies} <= {"ab", "cd"}


def test_sglang_frontend_programs(server):
    """SGLang's own frontend (sgl.gen with stop/regex/max_tokens/temperature/stop_regex, sgl.select,
    run_batch) against the server, in a subprocess: importing sglang patches transformers."""
    from tests.serving.sglang_reference import import_problem

    problem = import_problem()
    if problem:
        pytest.skip(problem)
    script = os.path.join(os.path.dirname(__file__), "sglang_reference.py")
    proc = subprocess.run([sys.executable, script, "frontend", server], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    first = out["first"]
    assert "\n" not in first["answer"] and "." not in first["answer"]
    assert first["answer_tokens"] <= 12
    assert out["again"]["answer"] == first["answer"]                  # temperature 0 is greedy
    for run in [first, out["again"], *out["batch"]]:
        assert re.fullmatch(r"[0-9]{3}", run["digits"]), run
        assert run["pick"] in ("yes", "no", "maybe")
        # stop_regex [0-9]: a digit ends the generation, unless it came with the last allowed token
        # (the length check comes first, as in SGLang); the exact position is test_stop_regex_stops_...
        if run["tail_finish"]["type"] == "stop":
            assert run["tail_finish"]["matched"] == "[0-9]" and re.search(r"[0-9]", run["tail"]), run
        else:
            assert run["tail_finish"]["type"] == "length" and run["tail_tokens"] == 6, run
    assert len(out["batch"]) == 3


def test_abort_request(http, server):
    result = {}

    def long_request():
        with httpx.Client(base_url=server, timeout=120) as c:
            result["reply"] = c.post("/generate", json={
                "input_ids": [3, 4, 5], "rid": "abort-me",
                "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}).json()

    thread = threading.Thread(target=long_request)
    thread.start()
    deadline = time.monotonic() + 30
    while stats(http)["running"] == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.1)
    assert http.post("/abort_request", json={"rid": "abort-me"}).status_code == 200
    thread.join(60)
    meta = result["reply"]["meta_info"]
    assert meta["id"] == "abort-me" and meta["finish_reason"]["type"] == "abort"
    assert 0 < meta["completion_tokens"] < 2000
    assert generate(http, input_ids=[1, 2], sampling_params={"max_new_tokens": 2})["meta_info"]["completion_tokens"] == 2


# ---- bad input -------------------------------------------------------------------------------------------

BAD = [
    ("/generate", b"{not json", "malformed JSON"),
    ("/generate", {"text": "a", "input_ids": [1, 2]}, "not both"),
    ("/generate", {"sampling_params": {"max_new_tokens": 2}}, "Either text or input_ids"),
    ("/generate", {"input_ids": [1, 2, 5000]}, "outside the vocabulary"),
    ("/generate", {"input_ids": [[1, 2], [3, -1]]}, "outside the vocabulary"),
    ("/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
    ("/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2047}}, "context length"),
    ("/generate", {"input_ids": [1] * 2048}, "context length"),
    ("/generate", {"text": "a", "sampling_params": {"json_schema": "{\"type\": \"nope\"}"}}, "json_schema"),
    ("/generate", {"text": "a", "sampling_params": {"json_schema": "{bad"}}, "json_schema"),
    ("/generate", {"text": "a", "sampling_params": {"regex": "(open"}}, "regex"),
    ("/generate", {"text": "a", "sampling_params": {"temperature": -0.5}}, "temperature"),
    ("/generate", {"text": "a", "sampling_params": {"bogus": 1}}, "bogus"),
    ("/generate", {"text": "a", "sampling_params": {"stop_regex": "(open"}}, "invalid stop_regex"),
    ("/generate", {"text": "a", "sampling_params": {"min_p": 0.5}}, "min_p"),
    ("/generate", {"text": "a", "image_data": "http://example.com/x.png"}, "image_data"),
    ("/generate", {"text": "a", "return_logprob": True, "logprob_start_len": 9}, "logprob_start_len"),
    ("/generate", [1, 2, 3], "JSON object"),
    ("/v1/chat/completions", {"model": "m", "messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4096},
     "context length"),
    ("/v1/completions", {"model": "m", "prompt": [1, 99999]}, "outside the vocabulary"),
    # n > 1 is served now (serving/streaming.py); a malformed n is still a 400.
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 0}, "n"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "frequency_penalty": 0.5},
     "frequency_penalty"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stop_regex": "(x"}, "stop_regex"),
    ("/abort_request", {}, "rid"),
    ("/update_weights_from_disk", {}, "model_path"),
]


@pytest.mark.parametrize("route,payload,needle", BAD, ids=[f"{r}:{n}" for r, _, n in BAD])
def test_bad_input_gets_400_and_the_server_keeps_serving(http, route, payload, needle):
    if isinstance(payload, bytes):
        r = http.post(route, content=payload, headers={"content-type": "application/json"})
    else:
        r = http.post(route, json=payload)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert needle in message, message
    ok = generate(http, input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 1})
    assert ok["meta_info"]["completion_tokens"] == 1


# ---- weight updates (last: they change the served model) --------------------------------------------------

def test_update_weights_from_disk(http, tok, model_a, tiny_model_dir, tiny_model_dir_b, tmp_path):
    ids = tok.encode("Join the results of every subagent.")
    payload = {"input_ids": ids, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
               "logprob_start_len": 0}
    before = torch.tensor([r[0] for r in generate(http, **payload)["meta_info"]["input_token_logprobs"][1:]])
    assert (before - prompt_logprobs(model_a, ids)).abs().max().item() < TOL

    r = http.post("/update_weights_from_disk", json={"model_path": tiny_model_dir_b, "weight_version": "7"})
    assert r.status_code == 200 and r.json()["success"] is True, r.text
    assert http.get("/get_model_info").json()["weight_version"] == "7"
    reply = generate(http, **payload)
    assert reply["meta_info"]["weight_version"] == "7"
    after = torch.tensor([row[0] for row in reply["meta_info"]["input_token_logprobs"][1:]])
    model_b = _load(tiny_model_dir_b)
    assert (after - prompt_logprobs(model_b, ids)).abs().max().item() < TOL
    assert (after - before).abs().max().item() > 1e-2

    # Sampled output logprobs are model b's too.
    gen = generate(http, input_ids=ids, sampling_params={"max_new_tokens": 10, "temperature": 0.7},
                   return_logprob=True)
    out = gen["output_ids"]
    ref = recompute(model_b, ids, out, 0.7)
    assert (ref - torch.tensor([r[0] for r in gen["meta_info"]["output_token_logprobs"]])).abs().max() < TOL

    # A checkpoint of another shape is refused; the old weights and version stay.
    from transformers import AutoConfig, Qwen2ForCausalLM

    config = AutoConfig.from_pretrained(tiny_model_dir)
    config.num_hidden_layers = 3
    config.layer_types = ["full_attention"] * 3
    other = str(tmp_path / "three-layers")
    Qwen2ForCausalLM(config).save_pretrained(other)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(tiny_model_dir, f), other)
    r = http.post("/update_weights_from_disk", json={"model_path": other})
    assert r.json()["success"] is False and "num_hidden_layers" in r.json()["message"]
    r = http.post("/update_weights_from_disk", json={"model_path": str(tmp_path / "missing")})
    assert r.json()["success"] is False
    assert http.get("/get_model_info").json()["weight_version"] == "7"
    again = torch.tensor([row[0] for row in generate(http, **payload)["meta_info"]["input_token_logprobs"][1:]])
    assert (again - after).abs().max().item() < TOL

    # Without an explicit version the number goes up by one.
    r = http.post("/update_weights_from_disk", json={"model_path": tiny_model_dir})
    assert r.json()["success"] is True and http.get("/get_model_info").json()["weight_version"] == "8"
