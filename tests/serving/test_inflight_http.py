"""SGLang's pause/continue routes and the in-flight weight sync, against a real embedded server process.

The episode test is the acceptance case of issue 13: a multi-turn episode whose second turn is
running when ``sync_weights(inflight=True)`` swaps model a (version 1) for model b (version 2).
The sync returns while that turn still runs; the turns record versions 1, 2, 2; and every
logprob matches a transformers forward with the weights that token was sampled with (turn 1:
model a; turn 3: model b, both as the trainer recomputes them; turn 2: model a up to the swap, then
model b over the KV model a computed, which is what SGLang's ``in_place`` pause keeps; with
``retract``, model b over all of it).
"""
import asyncio
import os
import shutil
import threading
import time

import httpx
import pytest
import torch

from aflow_rl.bench.serving import start_server, stop_server
from aflow_rl.llm.sglang import SGLangClient
from aflow_rl.rollout.turns import chat_prompt_ids, generate_turn, parse_weight_version
from aflow_rl.rollout.types import Turn
from aflow_rl.serving.weight_sync import WeightSyncError, sync_weights
from aflow_rl.trainer.batch import collate, sequence_logprobs
from tests.serving.test_embedded import prompt_logprobs, stats
from tests.serving.test_inflight import TOL, mixed_forward

PAUSED = {"message": "Generation paused successfully.", "status": "ok"}
CONTINUED = {"message": "Generation continued successfully.", "status": "ok"}
# Long enough to be still running when a test pauses it on a fast machine; tests abort it when done.
LONG = {"input_ids": [3, 4, 5, 6], "rid": "long", "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("inflight") / "server.log")
    proc, url = start_server(tiny_model_dir, None, log)
    try:
        yield url
    finally:
        stop_server(proc)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server, timeout=120.0) as client:
        yield client


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def models(tiny_model_dir, tiny_model_dir_b):
    from transformers import AutoModelForCausalLM

    return [AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
            for d in (tiny_model_dir, tiny_model_dir_b)]


class Background:
    """One blocking HTTP call in a thread; ``reply`` once it has answered."""

    def __init__(self, url, path, payload):
        self.reply = None
        self.thread = threading.Thread(target=self._run, args=(url, path, payload), daemon=True)
        self.thread.start()

    def _run(self, url, path, payload):
        with httpx.Client(base_url=url, timeout=180) as c:
            self.reply = c.post(path, json=payload).json()

    def join(self, timeout=120):
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the request did not finish"
        return self.reply


def until(pred, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_pause_in_place_holds_everything_until_continue(http, server):
    long = Background(server, "/generate", LONG)
    until(lambda: stats(http)["running"] == 1)
    r = http.post("/pause_generation", json={"mode": "in_place"})
    assert r.status_code == 200 and r.json() == PAUSED
    assert stats(http)["paused"] == "in_place"
    tokens = stats(http)["generated_tokens"]
    short = Background(server, "/generate", {"input_ids": [7, 8], "sampling_params": {"max_new_tokens": 2}})
    time.sleep(0.5)
    s = stats(http)
    assert s["generated_tokens"] == tokens and s["running"] == 1 and s["waiting"] == 1   # nothing ran
    assert long.thread.is_alive() and short.thread.is_alive()
    r = http.post("/continue_generation", json={})
    assert r.status_code == 200 and r.json() == CONTINUED
    assert short.join()["meta_info"]["completion_tokens"] == 2
    assert stats(http)["paused"] is None
    stop_and_check_it_ran_on(http, long, tokens)


def stop_and_check_it_ran_on(http, long, tokens_when_paused):
    """The long request generates again (it was not lost in the pause); then abort it."""
    until(lambda: stats(http)["generated_tokens"] > tokens_when_paused + 20)
    assert http.post("/abort_request", json={"rid": "long"}).status_code == 200
    meta = long.join()["meta_info"]
    assert meta["finish_reason"]["type"] == "abort" and meta["completion_tokens"] > 20


def test_pause_defaults_to_abort_and_bad_modes_are_400(http, server):
    long = Background(server, "/generate", LONG)
    until(lambda: stats(http)["running"] == 1)
    r = http.post("/pause_generation", content=b"")          # no body: SGLang's default mode, abort
    assert r.status_code == 200 and r.json() == PAUSED
    meta = long.join()["meta_info"]
    assert meta["finish_reason"]["type"] == "abort" and meta["completion_tokens"] < 2000
    assert stats(http)["paused"] == "abort"
    assert http.post("/continue_generation", json={"torch_empty_cache": True}).json() == CONTINUED
    for body, needle in (({"mode": "drain"}, "mode must be one of abort, retract, in_place"),
                         ({"mode": 3}, "mode must be one of"),
                         (["in_place"], "JSON object")):
        r = http.post("/pause_generation", json=body)
        assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
    r = http.post("/continue_generation", json={"torch_empty_cache": "maybe"})
    assert r.status_code == 400 and "torch_empty_cache" in r.json()["error"]["message"]
    assert stats(http)["paused"] is None


def probe(model, tok):
    ids = tok.encode('{"action": "finish", "answer": "probe"}', add_special_tokens=False)[:16]
    return ids, prompt_logprobs(model, ids).numpy()


async def long_turn(client, tok, messages, max_new_tokens):
    """rollout/turns.generate_turn with ignore_eos, so the turn surely runs across the update."""
    prompt_ids = chat_prompt_ids(tok, messages)
    comp = await client.generate(input_ids=prompt_ids, return_logprob=True, max_new_tokens=max_new_tokens,
                                 temperature=1.0, ignore_eos=True)
    return comp, Turn(prompt_ids=prompt_ids, response_ids=comp.output_ids, logprobs=comp.logprobs,
                      policy_version=parse_weight_version(comp.weight_version), finish_reason=comp.finish_reason)


async def straddling_episode(url, tok, dirs, models, mode):
    """Three turns; the weights change from version 1 (a) to 2 (b) while the second runs."""
    client = SGLangClient([url], timeout_s=120.0, max_retries=0)
    try:
        ids, expected = probe(models[0], tok)
        await sync_weights(client, dirs[0], 1, probe_ids=ids, expected_logprobs=expected, tol=1e-3, inflight=True,
                           pause_mode=mode)
        messages = [{"role": "user", "content": "Split the task and spawn subagents."}]
        comp1, turn1 = await generate_turn(client, tok, messages, temperature=1.0, max_new_tokens=8)
        messages += [{"role": "assistant", "content": comp1.text}, {"role": "user", "content": "Join them."}]
        start = (await client.http.get_json("/get_server_info"))["internal_states"][0]["generated_tokens"]
        second = asyncio.create_task(long_turn(client, tok, messages, 600))
        while (await client.http.get_json("/get_server_info"))["internal_states"][0]["generated_tokens"] < start + 5:
            await asyncio.sleep(0.01)
        ids, expected = probe(models[1], tok)
        timing = await sync_weights(client, dirs[1], 2, probe_ids=ids, expected_logprobs=expected, tol=1e-3,
                                    inflight=True, pause_mode=mode)
        running_after_sync = not second.done()
        comp2, turn2 = await second
        messages += [{"role": "assistant", "content": comp2.text}, {"role": "user", "content": "Answer."}]
        _, turn3 = await generate_turn(client, tok, messages, temperature=1.0, max_new_tokens=8)
        return [turn1, turn2, turn3], running_after_sync, timing
    finally:
        await client.aclose()


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_episode_straddling_an_in_flight_update(server, tok, models, tiny_model_dir, tiny_model_dir_b, mode):
    turns, running_after_sync, timing = asyncio.run(
        straddling_episode(server, tok, (tiny_model_dir, tiny_model_dir_b), models, mode))
    assert running_after_sync, "the sync waited for the running turn"
    assert [t.policy_version for t in turns] == [1, 2, 2]
    assert timing["probe_mismatch"] < 1e-3
    a, b = models

    def trainer_logprobs(turn, model):
        """What the trainer recomputes for ``turn`` with ``model``'s weights (trainer/batch.py)."""
        with torch.no_grad():
            logp, _ = sequence_logprobs(model, collate([turn], [0.0]), temperature=1.0)
        return logp[0]

    # Entirely before the swap (version 1, model a) and entirely after it (version 2, model b).
    assert (torch.tensor(turns[0].logprobs) - trainer_logprobs(turns[0], a)).abs().max() < TOL
    assert (torch.tensor(turns[2].logprobs) - trainer_logprobs(turns[2], b)).abs().max() < TOL
    # Across it: model a's numbers up to the swap, then model b's layers over model a's KV
    # (in_place) or over KV model b recomputed (retract).
    prompt, out = turns[1].prompt_ids.tolist(), turns[1].response_ids.tolist()
    lp = torch.tensor(turns[1].logprobs)
    off_a = ((lp - trainer_logprobs(turns[1], a)).abs() > TOL).nonzero()
    k = int(off_a[0]) if len(off_a) else len(out)    # the first token not sampled by model a
    assert 5 <= k < len(out) - 5, f"the swap came after {k} of {len(out)} tokens"
    all_b = trainer_logprobs(turns[1], b)[k:]
    if mode == "in_place":
        assert (lp[k:] - mixed_forward(a, b, prompt, out, k)).abs().max() < TOL
        assert (lp[k:] - all_b).abs().max() > 1e-2   # the KV was kept, not redone
    else:
        assert (lp[k:] - all_b).abs().max() < TOL


def test_failed_in_flight_update_still_continues(http, server, tiny_model_dir, tmp_path):
    from transformers import AutoConfig, Qwen2ForCausalLM

    config = AutoConfig.from_pretrained(tiny_model_dir)
    config.num_hidden_layers = 3
    config.layer_types = ["full_attention"] * 3
    other = str(tmp_path / "three-layers")
    Qwen2ForCausalLM(config).save_pretrained(other)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(tiny_model_dir, f), other)
    before = http.get("/get_model_info").json()["weight_version"]
    long = Background(server, "/generate", LONG)
    until(lambda: stats(http)["running"] == 1)

    async def sync():
        client = SGLangClient([server], max_retries=0)
        try:
            await sync_weights(client, other, 9, probe_ids=[1, 2, 3], inflight=True, timeout_s=60)
        finally:
            await client.aclose()

    with pytest.raises(WeightSyncError, match="num_hidden_layers"):
        asyncio.run(sync())
    assert stats(http)["paused"] is None
    assert http.get("/get_model_info").json()["weight_version"] == before
    stop_and_check_it_ran_on(http, long, stats(http)["generated_tokens"])
