"""The prefix cache: the trie itself, then the engine's parity with the cache on and off.

Parity is bit-for-bit (``==`` on floats), not a tolerance: the engine prefills at the same
chunk boundaries either way, so a chunk's forward sees identical inputs. The engine's
results are also checked against an independent transformers forward (TOL), so both runs
being equal cannot hide both being wrong.
"""
import threading

import pytest
import torch

from aflow_rl.serving.generation import Engine, GenerateRequest, SamplingParams
from aflow_rl.serving.prefix_cache import PrefixCache

TOL = 1e-4


# ---- the trie ----------------------------------------------------------------------------------------

def _kv(tag: float, chunk: int = 4):
    t = torch.full((1, 1, chunk, 2), tag)
    return [(t, t + 0.5)]


def _fill(cache: PrefixCache, ids: list[int]) -> None:
    for j in range(len(ids) // cache.chunk):
        cache.insert(ids, j, _kv(float(j)))


def test_match_returns_the_longest_cached_chunk_prefix():
    cache = PrefixCache(chunk=4, max_tokens=100)
    a = list(range(12))
    _fill(cache, a)
    assert cache.tokens == 12
    hit = cache.match(a + [99], max_chunks=10)
    assert [float(h[0][0][0, 0, 0, 0]) for h in hit] == [0.0, 1.0, 2.0]
    assert len(cache.match(a, max_chunks=2)) == 2                     # the caller's cap wins
    assert len(cache.match(a[:4] + [7, 7, 7, 7] + a[8:], 10)) == 1      # diverges in chunk 1
    assert cache.match([1] + a[1:], 10) == []                          # diverges in chunk 0
    assert len(cache.match(a[:7], 10)) == 1                            # only whole chunks
    # Same chunk-1 tokens after another chunk 0: a different node (keyed by its parent).
    assert cache.match([5, 5, 5, 5] + a[4:8], 10) == []


def test_insert_needs_its_prefix_and_whole_chunks():
    cache = PrefixCache(chunk=4, max_tokens=100)
    cache.insert(list(range(8)), 1, _kv(1))        # chunk 0 missing: would be unreachable
    assert cache.tokens == 0
    cache.insert(list(range(6)), 1, _kv(1))        # chunk 1 incomplete
    assert cache.tokens == 0


def test_lru_eviction_keeps_the_budget_and_drops_leaves_first():
    cache = PrefixCache(chunk=4, max_tokens=16)
    shared = [1, 2, 3, 4]
    a, b = shared + [10] * 8, shared + [20] * 8
    _fill(cache, a)                                 # 3 chunks
    _fill(cache, b)                                 # 2 more: over budget by one chunk
    assert cache.tokens == 16 and cache.evicted_tokens == 4
    # a's leaf went (least recently used); the shared root stays.
    assert len(cache.match(a, 10)) == 2 and len(cache.match(b, 10)) == 3
    cache.match(a, 10)                              # a now more recent than b's leaf
    _fill(cache, shared + [30] * 4)
    assert len(cache.match(b, 10)) == 2 and len(cache.match(a, 10)) == 2
    assert cache.flush() == 16 and cache.tokens == 0 and cache.match(a, 10) == []


def test_an_evicted_node_takes_its_descendants():
    cache = PrefixCache(chunk=2, max_tokens=6)
    _fill(cache, [1, 1, 2, 2, 3, 3])
    root = next(k for k in cache._nodes if k[0] == 0)   # keyed by the root's id 0: chunk 0
    cache._nodes.move_to_end(root, last=False)          # force it out first
    _fill(cache, [9, 9])
    assert cache.match([1, 1, 2, 2, 3, 3], 10) == [] and cache.tokens == 2


@pytest.mark.parametrize("chunk, budget", [(0, 10), (4, -1)])
def test_bad_settings_are_refused(chunk, budget):
    with pytest.raises(ValueError, match="prefix cache"):
        PrefixCache(chunk=chunk, max_tokens=budget)


# ---- the engine ---------------------------------------------------------------------------------------

def run(engine: Engine, reqs: list[GenerateRequest], timeout: float = 120.0):
    """Submit ``reqs`` in one round and wait for all results."""
    out, left, done = [None] * len(reqs), [len(reqs)], threading.Event()
    lock = threading.Lock()

    def callback(i):
        def f(res):
            out[i] = res
            with lock:
                left[0] -= 1
                if not left[0]:
                    done.set()
        return f

    engine.submit_many([(r, callback(i), None) for i, r in enumerate(reqs)])
    assert done.wait(timeout), "engine did not answer"
    return out


def greedy(ids, max_new=16, **kw):
    return GenerateRequest(input_ids=list(ids), params=SamplingParams(max_new_tokens=max_new, temperature=0.0,
                                                                      ignore_eos=True), return_logprob=True, **kw)


def sampled(ids, seed, max_new=16):
    return GenerateRequest(input_ids=list(ids), params=SamplingParams(max_new_tokens=max_new, temperature=1.0,
                                                                      sampling_seed=seed, ignore_eos=True),
                           return_logprob=True, top_logprobs_num=3)


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    on = Engine(tiny_model_dir, prefix_cache=True, prefill_chunk=16, random_seed=0)
    off = Engine(tiny_model_dir, prefix_cache=False, prefill_chunk=16, random_seed=0)
    on.start(), off.start()
    yield on, off
    on.shutdown(), off.shutdown()


def _prompts():
    g = torch.Generator().manual_seed(0)
    system = torch.randint(3, 1000, (70,), generator=g).tolist()
    return system, [system + torch.randint(3, 1000, (k,), generator=g).tolist() for k in (3, 30, 47)]


def _script(engine: Engine):
    """Turns of episodes and groups, as a rollout sends them: singles, a group of 4, a second turn."""
    system, prompts = _prompts()
    results = []
    for p in prompts:
        results += run(engine, [greedy(p)])
    results += run(engine, [greedy(prompts[1]) for _ in range(4)])                # a GRPO group
    turn2 = prompts[0] + results[0].output_ids + [7, 8, 9]
    results += run(engine, [greedy(turn2)])                                       # the episode's next turn
    results += run(engine, [sampled(prompts[2], seed=s) for s in (1, 2)])         # sampled, seeded
    results += run(engine, [greedy(prompts[2], max_new=0, logprob_start_len=5)])  # prompt logprobs
    results += run(engine, [greedy(prompts[2], max_new=4, logprob_start_len=60, top_logprobs_num=2)])
    # One round mixing cached and new prompts of other lengths: with the cache on, fewer rows share
    # each chunk's forward than with it off; the numbers must not depend on that.
    results += run(engine, [greedy(p, max_new=6) for p in prompts] + [greedy(turn2[:40] + [5] * 9, max_new=6)])
    return results


def _same(a, b):
    assert a.output_ids == b.output_ids and a.text == b.text
    assert a.output_logprobs == b.output_logprobs                     # bit-identical floats
    assert a.output_top_logprobs == b.output_top_logprobs
    assert a.input_logprobs == b.input_logprobs and a.input_top_logprobs == b.input_top_logprobs


def test_cache_on_and_off_give_identical_results(engines, tiny_model_dir):
    on, off = engines
    got, ref = _script(on), _script(off)
    for a, b in zip(got, ref):
        _same(a, b)
    assert all(r.cached_tokens == 0 for r in ref)
    cached = [r.cached_tokens for r in got]
    # prompts share 64 whole tokens (4 chunks of 16) of the 70-token system prompt
    assert cached[:3] == [0, 64, 64], cached
    # the group: the cache holds all but the last chunk; the first copy computes that chunk, the
    # other three share it in the same forward (the whole prompt, 100 tokens)
    assert cached[3:7] == [96, 100, 100, 100], cached
    assert cached[8:10] == [112, 117], cached
    assert cached[7] >= 64 and on.load()["prefix_cache_hit_rate"] > 0.5
    # prompt logprobs: the cache stops at the chunk holding logprob_start_len
    assert cached[10] == 0 and cached[11] == 48, cached
    assert cached[12:] == [64, 96, 112, 32], cached
    # and both are right: the same tokens' logprobs from a plain transformers forward
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    for r in got[:8]:
        with torch.no_grad():
            logits = model(torch.tensor([r.prompt_ids + r.output_ids])).logits[0, len(r.prompt_ids) - 1:-1]
        ref_lp = torch.log_softmax(logits, -1).gather(1, torch.tensor(r.output_ids)[:, None])[:, 0]
        assert (ref_lp - torch.tensor(r.output_logprobs)).abs().max().item() < TOL
        assert r.output_ids == logits.argmax(-1).tolist()


def test_weight_update_invalidates_the_cache(engines, tiny_model_dir, tiny_model_dir_b):
    on, off = engines
    _, prompts = _prompts()
    before = run(on, [greedy(prompts[1])])[0]
    assert run(on, [greedy(prompts[1])])[0].cached_tokens > 0
    for engine in engines:
        done, box = threading.Event(), []
        engine.update_weights_from_disk(tiny_model_dir_b, "b", lambda ok, msg: (box.append((ok, msg)), done.set()))
        assert done.wait(60) and box[0][0], box
    assert on.load()["prefix_cache_tokens"] == 0
    a, b = run(on, [greedy(prompts[1])])[0], run(off, [greedy(prompts[1])])[0]
    assert a.cached_tokens == 0 and a.weight_version == "b"
    _same(a, b)
    assert a.output_logprobs != before.output_logprobs      # model b's numbers, not stale KV of model a
    again = run(on, [greedy(prompts[1])])[0]
    assert again.cached_tokens > 0
    _same(again, b)


def test_flush_cache_empties_it(engines):
    on, _ = engines
    _, prompts = _prompts()
    run(on, [greedy(prompts[0])])
    assert on.load()["prefix_cache_tokens"] > 0
    on.flush_cache()
    # A group arriving together into an empty cache: the first copy computes, the rest share.
    group = run(on, [greedy(prompts[0]) for _ in range(3)])
    assert [r.cached_tokens for r in group] == [0, 73, 73]
    # The first token comes from the shared prefill; later ones from decode steps, where rows of
    # one batch may round differently in the 7th digit (as without any cache).
    assert group[0].output_logprobs[0] == group[1].output_logprobs[0] == group[2].output_logprobs[0]
    assert group[0].output_ids == group[1].output_ids == group[2].output_ids
