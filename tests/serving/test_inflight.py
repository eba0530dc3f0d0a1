"""In-flight weight updates on the engine: pause between decode steps, swap, continue (SGLang's flow).

The pause is requested from the engine's own ``on_token`` callback after exactly ``K`` sampled
tokens, so the token at which the weights change is known, and every logprob the engine reports
is checked against an independent transformers forward with the weights (and, for ``in_place``,
the KV) that token was really sampled with:

- tokens before the swap: model a, all of it;
- ``in_place`` tokens after it: model b's layers over the KV model a computed (SGLang keeps the KV);
- ``retract`` tokens after it: model b over everything (the KV is recomputed on resume).
"""
import threading
import time

import pytest
import torch

from aflow_rl.serving.generation import Engine, GenerateRequest, SamplingParams

TOL = 1e-4
K = 10                      # tokens sampled before the pause
PROMPT = list(range(3, 40))


@pytest.fixture(scope="module")
def models(tiny_model_dir, tiny_model_dir_b):
    from transformers import AutoModelForCausalLM

    return [AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
            for d in (tiny_model_dir, tiny_model_dir_b)]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    eng = Engine(tiny_model_dir, random_seed=0, prefill_chunk=16)
    eng.start()
    yield eng
    eng.shutdown()


@pytest.fixture
def fresh(engine, tiny_model_dir):
    """The engine serving model a as version "a", running, its prefix cache empty."""
    assert wait(lambda cb: engine.resume(cb))
    ok, msg = update(engine, tiny_model_dir, "a")
    assert ok, msg
    return engine


def wait(call, timeout=60.0):
    """Run ``call(callback)`` and wait for the callback; returns what it was called with."""
    box, done = [], threading.Event()
    call(lambda *args: (box.append(args), done.set()))
    assert done.wait(timeout), "the engine did not answer"
    return box[0] or True


def update(engine, path, version, timeout=60.0):
    return wait(lambda cb: engine.update_weights_from_disk(path, version, cb), timeout)


def request(max_new=30, temperature=1.0, prompt=PROMPT):
    return GenerateRequest(input_ids=list(prompt), return_logprob=True,
                           params=SamplingParams(max_new_tokens=max_new, temperature=temperature, ignore_eos=True,
                                                 sampling_seed=1))


class Run:
    """One request whose ``on_token`` runs ``at_k(engine)`` on the engine thread after K tokens."""

    def __init__(self, engine, req, at_k=None):
        self.req, self.result, self.done = req, None, threading.Event()

        def on_token(ids, lps, top):
            if len(ids) == K and at_k is not None:
                at_k(engine)

        engine.submit(req, self._finish, on_token)

    def _finish(self, result):
        self.result, self.finished_at = result, time.monotonic()
        self.done.set()

    def wait(self, timeout=60.0):
        assert self.done.wait(timeout), "the request did not finish"
        return self.result


def logprobs_of(logits, ids, temperature=1.0):
    return torch.log_softmax(logits.float() / temperature, -1).gather(1, torch.tensor(ids)[:, None])[:, 0]


def full_forward(model, prompt, out):
    """Logprobs of ``out`` [T] from one forward of ``model`` over prompt + out."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out])).logits[0, len(prompt) - 1:-1]
    return logprobs_of(logits, out)


def mixed_forward(model_kv, model_next, prompt, out, k):
    """Logprobs of ``out[k:]`` when ``model_kv`` computed the KV of prompt + out[:k-1] and
    ``model_next`` runs from there on: what an in-place swap after k sampled tokens does."""
    n = len(prompt) + k - 1
    full = prompt + out
    with torch.no_grad():
        past = model_kv(torch.tensor([full[:n]]), use_cache=True).past_key_values
        logits = model_next(torch.tensor([full[n:-1]]), past_key_values=past,
                            position_ids=torch.arange(n, len(full) - 1)[None]).logits[0]
    return logprobs_of(logits, out[k:])


def paused_update(mode, path, version, box):
    """An ``at_k``: pause in ``mode`` and queue an update behind it; record when each answered."""
    def at_k(engine):
        engine.pause(mode, lambda: box.setdefault("paused_at", time.monotonic()))
        engine.update_weights_from_disk(path, version,
                                        lambda ok, msg: box.update(update=(ok, msg), updated_at=time.monotonic()))
    return at_k


def until(pred, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_paused_update_does_not_wait_for_the_running_request(fresh, models, tiny_model_dir_b, mode):
    box = {}
    run = Run(fresh, request(), paused_update(mode, tiny_model_dir_b, "b", box))
    until(lambda: "update" in box)
    assert box["update"][0], box["update"]
    # Applied while the request is still running: it has K tokens, not its 30, and waits paused.
    assert not run.done.is_set() and fresh.paused == mode
    time.sleep(0.3)
    assert not run.done.is_set(), "a paused engine generated"
    assert fresh.load()["running"] == (1 if mode == "in_place" else 0)
    assert fresh.load()["retracted"] == (1 if mode == "retract" else 0)
    assert wait(fresh.resume)
    res = run.wait()
    assert res.weight_version == "b" and len(res.output_ids) == 30 and res.finish_reason["type"] == "length"

    a, b = models
    got = torch.tensor(res.output_logprobs)
    out = res.output_ids
    assert (got[:K] - full_forward(a, PROMPT, out)[:K]).abs().max() < TOL          # before: model a
    after_b = full_forward(b, PROMPT, out)[K:]
    if mode == "in_place":   # model b over the KV model a computed
        assert (got[K:] - mixed_forward(a, b, PROMPT, out, K)).abs().max() < TOL
        assert (got[K:] - after_b).abs().max() > 1e-2, "the KV was recomputed, not kept"
    else:                    # retract: the KV was recomputed with model b
        assert (got[K:] - after_b).abs().max() < TOL


def test_plain_update_still_waits_for_the_running_batch(fresh, models, tiny_model_dir_b):
    box = {}

    def at_k(engine):
        engine.update_weights_from_disk(tiny_model_dir_b, "b",
                                        lambda ok, msg: box.update(update=(ok, msg), updated_at=time.monotonic()))
    run = Run(fresh, request(), at_k)
    res = run.wait()
    until(lambda: "update" in box)
    assert box["update"][0]
    assert res.weight_version == "a"   # every token came from model a
    a, _ = models
    assert (torch.tensor(res.output_logprobs) - full_forward(a, PROMPT, res.output_ids)).abs().max() < TOL
    assert box["updated_at"] >= run.finished_at and fresh.weight_version == "b"


def test_abort_pause_finishes_running_requests_and_holds_new_ones(fresh, models):
    running = Run(fresh, request(), lambda engine: engine.pause("abort", lambda: None))
    res = running.wait()
    assert res.finish_reason["type"] == "abort" and len(res.output_ids) == K
    until(lambda: fresh.paused == "abort")
    later = Run(fresh, request(max_new=5))
    time.sleep(0.5)
    assert not later.done.is_set() and fresh.load()["waiting"] == 1, "a request ran while paused"
    assert wait(fresh.resume)
    res = later.wait()
    assert res.finish_reason["type"] == "length" and len(res.output_ids) == 5
    a, _ = models
    assert (torch.tensor(res.output_logprobs) - full_forward(a, PROMPT, res.output_ids)).abs().max() < TOL


def test_paused_update_flushes_the_prefix_cache(fresh, models, tiny_model_dir_b):
    prompt = list(range(100, 160))                   # three whole chunks of 16 get cached
    first = Run(fresh, request(max_new=2, prompt=prompt)).wait()
    assert first.cached_tokens == 0 and fresh.prefix_cache.tokens >= 48
    again = Run(fresh, request(max_new=2, prompt=prompt)).wait()
    assert again.cached_tokens == 48                 # the cache works, so its flush below means something
    box = {}
    run = Run(fresh, request(), paused_update("in_place", tiny_model_dir_b, "b", box))
    until(lambda: "update" in box)
    assert box["update"][0] and fresh.prefix_cache.tokens == 0
    assert wait(fresh.resume)
    run.wait()
    after = Run(fresh, request(max_new=4, prompt=prompt)).wait()
    assert after.cached_tokens == 0 and after.weight_version == "b"
    _, b = models
    assert (torch.tensor(after.output_logprobs) - full_forward(b, prompt, after.output_ids)).abs().max() < TOL


def test_swap_from_a_state_dict(fresh, models):
    a, b = models
    ok, msg = wait(lambda cb: fresh.update_weights(lambda: b.state_dict(), "sd", cb, source="state dict"))
    assert ok, msg
    res = Run(fresh, request(max_new=6)).wait()
    assert res.weight_version == "sd"
    assert (torch.tensor(res.output_logprobs) - full_forward(b, PROMPT, res.output_ids)).abs().max() < TOL

    # A wrong shape or an unknown name changes nothing (checked before any tensor is copied).
    bad_shape = dict(a.state_dict())
    name = next(iter(bad_shape))
    bad_shape[name] = bad_shape[name][:1]
    for state, needle in ((bad_shape, "shape"), ({"no.such.weight": torch.zeros(1)}, "unexpected tensors"),
                          ({}, "non-empty state dict")):
        ok, msg = wait(lambda cb: fresh.update_weights(lambda: state, None, cb, source="bad"))
        assert not ok and needle in msg and fresh.weight_version == "sd"
    res = Run(fresh, request(max_new=6)).wait()
    assert (torch.tensor(res.output_logprobs) - full_forward(b, PROMPT, res.output_ids)).abs().max() < TOL


def test_a_loader_that_raises_is_a_failed_update(fresh):
    def boom():
        raise OSError("disk gone")

    ok, msg = wait(lambda cb: fresh.update_weights(boom, "x", cb, source="/nowhere"))
    assert not ok and "disk gone" in msg and "/nowhere" in msg and fresh.weight_version == "a"


def test_bad_pause_mode_is_refused(engine):
    with pytest.raises(ValueError, match="in_place"):
        engine.pause("drain", lambda: None)
