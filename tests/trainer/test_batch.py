"""Turns -> micro-batches, and the trainer's logprobs against a manual per-sequence computation."""
import numpy as np
import pytest
import torch

from aflow_rl.rollout.types import Trajectory, Turn
from aflow_rl.trainer.batch import (collate, flatten_turns, make_micro_batches, micro_batch_count,
                                    sequence_logprobs, turn_grammar_masks)


def make_turns(n, seed=0, vocab=1000):
    rng = np.random.default_rng(seed)
    turns = []
    for i in range(n):
        p, r = int(rng.integers(2, 7)), int(rng.integers(1, 5))
        turns.append(Turn(prompt_ids=rng.integers(3, vocab, p), response_ids=rng.integers(3, vocab, r),
                          logprobs=-rng.random(r)))
    return turns


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def manual_logprobs(model, turn, temperature, allowed=None):
    """One unpadded sequence: log_softmax(mask(logits) / T) at the positions predicting the response."""
    ids = torch.as_tensor(np.concatenate([turn.prompt_ids, turn.response_ids]), dtype=torch.long)[None]
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    P, R = len(turn.prompt_ids), len(turn.response_ids)
    lg = logits[P - 1:P - 1 + R] / temperature
    if allowed is not None:
        lg = lg.masked_fill(~allowed, float("-inf"))
    lp = torch.log_softmax(lg, -1)
    tok = torch.as_tensor(turn.response_ids, dtype=torch.long)
    p = lp.exp()
    ent = -(torch.where(p > 0, p * lp, torch.zeros_like(lp))).sum(-1)
    return lp.gather(-1, tok[:, None])[:, 0], ent


def test_collate_layout():
    turns = [Turn(prompt_ids=[5, 6, 7], response_ids=[8, 9], logprobs=[-0.1, -0.2]),
             Turn(prompt_ids=[5], response_ids=[10, 11, 12], logprobs=[-1, -2, -3])]
    mb = collate(turns, [0.5, -1.0], pad_id=0)
    assert mb.input_ids.tolist() == [[5, 6, 7, 8, 9], [5, 10, 11, 12, 0]]
    assert mb.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 3, 0]]
    assert mb.logit_positions.tolist() == [[2, 3, 0], [0, 1, 2]]       # P + j - 1
    assert mb.response_ids.tolist() == [[8, 9, 0], [10, 11, 12]]
    assert mb.response_mask.tolist() == [[1, 1, 0], [1, 1, 1]]
    assert mb.advantages.tolist() == [[0.5, 0.5, 0.0], [-1.0, -1.0, -1.0]]
    assert mb.server_logprobs[1].tolist() == pytest.approx([-1, -2, -3])
    assert mb.num_tokens == 9 and mb.num_response_tokens == 5


def test_flatten_turns_per_trajectory_or_per_turn():
    trajs = [Trajectory("e0", "g", turns=make_turns(2, seed=0)), Trajectory("e1", "g", turns=make_turns(1, seed=1))]
    turns, adv = flatten_turns(trajs, [0.5, -1.0])                     # GRPO: one per trajectory
    assert len(turns) == 3 and adv.tolist() == [0.5, 0.5, -1.0]
    assert turns[2] is trajs[1].turns[0]
    _, adv = flatten_turns(trajs, [1.0, 2.0, 3.0])                     # GiGPO: one per turn
    assert adv.tolist() == [1.0, 2.0, 3.0]
    with pytest.raises(ValueError, match="one per trajectory or one per turn"):
        flatten_turns(trajs, [1.0])


def test_micro_batches_same_count_on_every_rank_and_contiguous_shards():
    turns = make_turns(7)
    adv = np.arange(7, dtype=float)
    assert micro_batch_count(7, micro_batch_size=2, grad_accum=2, world_size=2) == 2
    assert micro_batch_count(7, micro_batch_size=2, grad_accum=3, world_size=1) == 6
    per_rank = [make_micro_batches(turns, adv, micro_batch_size=2, grad_accum=2, rank=r, world_size=2)
                for r in range(2)]
    assert [len(b) for b in per_rank] == [2, 2]
    seen = [a for mbs in per_rank for mb in mbs for a in mb.advantages[:, 0].tolist()]
    assert seen == list(range(7))                                       # rank 0 gets 0..3, rank 1 gets 4..6
    assert all(mb.num_sequences <= 2 for mbs in per_rank for mb in mbs)
    # One rank with twice the accumulation sees the same micro-batches in the same order.
    single = make_micro_batches(turns, adv, micro_batch_size=2, grad_accum=4, world_size=1)
    assert [mb.advantages[:, 0].tolist() for mb in single] == \
        [mb.advantages[:, 0].tolist() for mbs in per_rank for mb in mbs]


def test_short_rank_gets_zero_weight_stand_in_and_empty_responses_are_dropped():
    turns = make_turns(2)
    turns.append(Turn(prompt_ids=[4, 5], response_ids=[], logprobs=[]))
    mbs = make_micro_batches(turns, [1.0, 2.0, 3.0], micro_batch_size=1, grad_accum=2, rank=1, world_size=2)
    assert len(mbs) == 2
    assert mbs[0].num_response_tokens > 0 and mbs[0].advantages[0, 0] == 2.0
    assert mbs[1].num_response_tokens == 0 and mbs[1].num_sequences == 1   # stand-in: no loss
    with pytest.raises(ValueError, match="advantages"):
        make_micro_batches(turns, [1.0], micro_batch_size=1)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sequence_logprobs_match_manual(tiny, temperature):
    turns = make_turns(5, seed=1)
    mb = collate(turns, [0.0] * 5)
    logp, ent = sequence_logprobs(tiny, mb, temperature)
    for b, turn in enumerate(turns):
        want_lp, want_ent = manual_logprobs(tiny, turn, temperature)
        R = len(turn.response_ids)
        assert logp[b, :R].tolist() == pytest.approx(want_lp.tolist(), abs=1e-5)
        assert ent[b, :R].tolist() == pytest.approx(want_ent.tolist(), abs=1e-4)
        assert logp[b, R:].abs().sum() == 0 and ent[b, R:].abs().sum() == 0


def random_masks(turns, vocab_size, seed):
    """A random BoolTensor [R, V] grammar mask per turn (30% of tokens) that allows the sampled tokens."""
    g = torch.Generator().manual_seed(seed)
    masks = []
    for t in turns:
        allowed = torch.rand((len(t.response_ids), vocab_size), generator=g) < 0.3
        allowed[torch.arange(len(t.response_ids)), torch.as_tensor(t.response_ids, dtype=torch.long)] = True
        masks.append(allowed)
    return masks


def pack(mask):
    """A BoolTensor mask as xgrammar's int32 bitmask (bit k of word w = token 32w + k)."""
    bits = mask.reshape(mask.shape[0], -1, 32).to(torch.int64) << torch.arange(32)
    return bits.sum(-1).to(torch.int64).to(torch.int32)


def test_sequence_logprobs_with_masks_bool_and_packed(tiny):
    turns = make_turns(3, seed=2)
    masks = random_masks(turns, tiny.config.vocab_size, seed=0)
    masks[1] = None                                                    # an unconstrained turn
    mb = collate(turns, [0.0] * 3, grammar_masks=masks)
    logp, ent = sequence_logprobs(tiny, mb, 0.8)
    for b, t in enumerate(turns):
        want_lp, want_ent = manual_logprobs(tiny, t, 0.8, masks[b])
        R = len(t.response_ids)
        assert logp[b, :R].tolist() == pytest.approx(want_lp.tolist(), abs=1e-5)
        assert ent[b, :R].tolist() == pytest.approx(want_ent.tolist(), abs=1e-4)
    # The same masks packed as xgrammar bitmasks.
    packed = [None if m is None else pack(m) for m in masks]
    logp2, _ = sequence_logprobs(tiny, mb, 0.8, packed)
    assert torch.allclose(logp, logp2)
    # A sampled token its mask forbids is an error, not a silent -inf.
    bad = [m.clone() if m is not None else None for m in masks]
    bad[0][0, int(turns[0].response_ids[0])] = False
    with pytest.raises(ValueError, match="not allowed"):
        sequence_logprobs(tiny, mb, 0.8, bad)


def test_logprobs_gradient_is_finite_under_masks(tiny):
    turns = make_turns(2, seed=3)
    V = tiny.config.vocab_size
    masks = [torch.zeros((len(t.response_ids), V), dtype=torch.bool) for t in turns]
    for m, t in zip(masks, turns):
        m[torch.arange(len(t.response_ids)), torch.as_tensor(t.response_ids, dtype=torch.long)] = True
        m[:, :4] = True
    mb = collate(turns, [1.0, 1.0], grammar_masks=masks)
    tiny.zero_grad()
    logp, ent = sequence_logprobs(tiny, mb, 1.0, entropy_grad=True)
    (logp.sum() + ent.sum()).backward()
    grads = [p.grad for p in tiny.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    tiny.zero_grad()


def test_grammar_masks_from_xgrammar(tiny_model_dir, tiny):
    from transformers import AutoTokenizer

    from aflow_rl.serving.grammar import GrammarBackend, grammar_masks

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    backend = GrammarBackend.from_pretrained(tiny_model_dir)
    grammar = {"regex": "(yes|no)"}
    response = tok.encode("yes", add_special_tokens=False) + [tok.eos_token_id]
    turn = Turn(prompt_ids=tok.encode("answer:", add_special_tokens=False), response_ids=response,
                logprobs=[0.0] * len(response), grammar=grammar)
    plain = Turn(prompt_ids=[5, 6], response_ids=[7], logprobs=[0.0])
    packed = turn_grammar_masks([turn, plain], backend)
    assert packed[1] is None and packed[0].dtype == torch.int32
    mb = collate([turn, plain], [0.0, 0.0], grammar_masks=packed)
    logp, _ = sequence_logprobs(tiny, mb, 1.0)
    want, _ = manual_logprobs(tiny, turn, 1.0, grammar_masks(grammar, response, backend=backend))
    assert logp[0, :len(response)].tolist() == pytest.approx(want.tolist(), abs=1e-5)
    assert logp[0, -1].item() == pytest.approx(0.0, abs=1e-6)   # after "yes" only eos is allowed


class _WholeIndexKeep(torch.nn.Module):
    """A causal LM whose ``logits_to_keep`` indexes every row with the whole [B, T] index, as
    transformers 5.17 does: ``hidden[:, idx]`` -> logits [B, B, T, V]."""

    def __init__(self, lm):
        super().__init__()
        self.lm, self.config, self.calls = lm, lm.config, []

    def get_output_embeddings(self):
        return self.lm.get_output_embeddings()

    def forward(self, logits_to_keep=0, output_hidden_states=False, **kw):
        self.calls.append(logits_to_keep if isinstance(logits_to_keep, int) else "rows")
        out = self.lm(logits_to_keep=0, output_hidden_states=True, **kw)
        if isinstance(logits_to_keep, torch.Tensor):
            out.logits = self.lm.get_output_embeddings()(out.hidden_states[-1][:, logits_to_keep])
        return out


def test_logits_from_hidden_states_where_logits_to_keep_takes_no_row_index(tiny):
    """The fallback for older transformers gives the row-wise path's logprobs, entropies and gradients."""
    from aflow_rl.trainer import batch as batch_mod

    turns = make_turns(4, seed=3)
    mb = collate(turns, [0.0] * 4)
    want_lp, want_ent = sequence_logprobs(tiny, mb, 0.7, entropy_grad=True)
    (want_lp.sum() + want_ent.sum()).backward()
    want_grad = tiny.get_output_embeddings().weight.grad.clone()
    tiny.zero_grad()
    old = _WholeIndexKeep(tiny)
    assert type(old) not in batch_mod._NO_ROWWISE_KEEP
    try:
        lp, ent = sequence_logprobs(old, mb, 0.7, entropy_grad=True)
        assert old.calls == ["rows", 1] and type(old) in batch_mod._NO_ROWWISE_KEEP
        (lp.sum() + ent.sum()).backward()
        assert torch.allclose(lp, want_lp, atol=1e-5) and torch.allclose(ent, want_ent, atol=1e-4)
        assert torch.allclose(tiny.get_output_embeddings().weight.grad, want_grad, atol=1e-5)
        sequence_logprobs(old, mb, 0.7)
        assert old.calls == ["rows", 1, 1]          # known now: one forward per call
    finally:
        batch_mod._NO_ROWWISE_KEEP.discard(type(old))
        tiny.zero_grad()


def test_logits_of_an_unexpected_shape_are_an_error(tiny):
    class Flat(_WholeIndexKeep):
        def forward(self, **kw):
            out = self.lm(input_ids=kw["input_ids"])
            return out                              # [B, S, V]: logits_to_keep ignored

    mb = collate(make_turns(2, seed=4), [0.0] * 2)
    with pytest.raises(RuntimeError, match=r"expected \[B, T, V\] from a \[B, T\] logits_to_keep"):
        sequence_logprobs(Flat(tiny), mb, 1.0)
