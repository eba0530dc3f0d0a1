"""Numeric tests of the PPO-clip loss, KL estimators and truncated importance weight (hand-computed values)."""
import math

import pytest
import torch

from aflow_rl.algos.ppo import kl_penalty, masked_mean, ppo_loss, truncated_is_weight

CLIP = dict(clip_low=0.2, clip_high=0.28)


def one_token(ratio: float, adv: float, **kw):
    """Loss and stats of a single token with the given ratio and advantage; logp carries grad."""
    logp = torch.tensor([[math.log(ratio)]], dtype=torch.float64, requires_grad=True)
    old = torch.zeros((1, 1), dtype=torch.float64)
    loss, stats = ppo_loss(logp, old, torch.tensor([adv], dtype=torch.float64), torch.ones((1, 1)), **CLIP, **kw)
    loss.backward()
    return loss.item(), stats, logp.grad.item()


@pytest.mark.parametrize("ratio,adv,expected,clipped", [
    (1.1, 1.0, -1.1, False),     # inside [0.8, 1.28]: plain -A * r
    (1.1, -2.0, 2.2, False),
    (1.5, 1.0, -1.28, True),     # above 1 + clip_high, A > 0: clipped at 1.28
    (1.5, -1.0, 1.5, False),     # above, A < 0: the unclipped term is the larger (pessimistic)
    (0.5, -1.0, 0.8, True),      # below 1 - clip_low, A < 0: clipped at 0.8
    (0.5, 1.0, -0.5, False),     # below, A > 0: unclipped
])
def test_clip_branches(ratio, adv, expected, clipped):
    loss, stats, grad = one_token(ratio, adv)
    assert loss == pytest.approx(expected, abs=1e-12)
    assert stats["clipfrac"] == (1.0 if clipped else 0.0)
    # d(-A r)/d logp = -A r where unclipped; zero where the clipped constant is taken.
    assert grad == pytest.approx(0.0 if clipped else -adv * ratio, abs=1e-12)


def test_clipfrac_is_share_of_clipped_tokens_and_mask_excludes_padding():
    logp = torch.log(torch.tensor([[1.5, 1.0, 0.5, 7.0]]))
    old = torch.zeros_like(logp)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])     # the last token is padding with an absurd ratio
    loss, stats = ppo_loss(logp, old, torch.tensor([1.0]), mask, **CLIP)
    assert stats["clipfrac"] == pytest.approx(1 / 3)
    assert float(loss) == pytest.approx((-1.28 - 1.0 - 0.5) / 3)


def test_token_mean_vs_seq_mean():
    # Ratios 1 everywhere, so the per-token loss is -A.
    logp = torch.zeros((2, 3))
    adv = torch.tensor([[1.0, 1.0, 1.0], [4.0, 4.0, 4.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    tok, _ = ppo_loss(logp, logp, adv, mask, **CLIP, agg="token_mean")
    seq, _ = ppo_loss(logp, logp, adv, mask, **CLIP, agg="seq_mean")
    assert float(tok) == pytest.approx(-(1 + 1 + 1 + 4) / 4)       # every token counts once
    assert float(seq) == pytest.approx(-(1 + 4) / 2)               # every sequence counts once
    with pytest.raises(ValueError):
        masked_mean(logp, mask, "sum")


def test_seq_mean_skips_empty_sequences_and_empty_batch_is_zero():
    x = torch.tensor([[2.0, 4.0], [100.0, 100.0]])
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    assert float(masked_mean(x, mask, "seq_mean")) == pytest.approx(3.0)
    assert float(masked_mean(x, torch.zeros_like(x), "token_mean")) == 0.0
    assert float(masked_mean(x, torch.zeros_like(x), "seq_mean")) == 0.0


def test_advantage_per_sequence_broadcasts_like_per_token():
    g = torch.Generator().manual_seed(0)
    logp, old = torch.randn((3, 4), generator=g) * 0.3, torch.randn((3, 4), generator=g) * 0.3
    adv = torch.tensor([0.5, -1.0, 2.0])
    mask = torch.ones((3, 4))
    a, _ = ppo_loss(logp, old, adv, mask, **CLIP)
    b, _ = ppo_loss(logp, old, adv[:, None].expand(3, 4), mask, **CLIP)
    assert float(a) == pytest.approx(float(b))


def test_kl_estimators_hand_values():
    logp, ref = torch.tensor([-1.0, -0.5]), torch.tensor([-2.0, -0.5])
    assert kl_penalty(logp, ref, "k1").tolist() == pytest.approx([1.0, 0.0])
    # k3 = exp(ref - logp) - (ref - logp) - 1: exp(-1) + 1 - 1 = e^-1; 0 where equal.
    assert kl_penalty(logp, ref, "k3").tolist() == pytest.approx([math.exp(-1.0), 0.0])
    assert float(kl_penalty(torch.tensor(-3.0), torch.tensor(-1.0), "k3")) == pytest.approx(math.exp(2) - 2 - 1)
    with pytest.raises(ValueError):
        kl_penalty(logp, ref, "k2")


def test_kl_term_in_loss():
    logp = torch.tensor([[-1.0, -1.0]])
    ref = torch.tensor([[-2.0, -1.0]])
    mask = torch.ones((1, 2))
    base, _ = ppo_loss(logp, logp, torch.tensor([1.0]), mask, **CLIP)
    loss, stats = ppo_loss(logp, logp, torch.tensor([1.0]), mask, **CLIP,
                           ref_logp=ref, kl_coef=0.5, kl_estimator="k1")
    assert stats["kl"] == pytest.approx(0.5)                       # mean of k1 = [1, 0]
    assert float(loss) == pytest.approx(float(base) + 0.5 * 0.5)
    _, stats3 = ppo_loss(logp, logp, torch.tensor([1.0]), mask, **CLIP, ref_logp=ref, kl_estimator="k3")
    assert stats3["kl"] == pytest.approx(math.exp(-1.0) / 2)


def test_entropy_bonus():
    logp = torch.zeros((1, 2))
    ent = torch.tensor([[1.0, 3.0]])
    loss, stats = ppo_loss(logp, logp, torch.tensor([0.0]), torch.ones((1, 2)), **CLIP,
                           entropy=ent, entropy_coef=0.1)
    assert stats["entropy"] == pytest.approx(2.0)
    assert float(loss) == pytest.approx(-0.2)


def test_truncated_importance_weight():
    old = torch.tensor([0.0, 1.0, -1.0])
    server = torch.tensor([0.5, -1.0, -1.0])
    w = truncated_is_weight(old, server, cap=2.0)
    assert w.tolist() == pytest.approx([math.exp(-0.5), 2.0, 1.0])   # exp(2) truncated to C = 2
    assert truncated_is_weight(old, server, cap=0.0).tolist() == [1.0, 1.0, 1.0]
    assert not w.requires_grad


def test_importance_weight_scales_token_loss_and_mismatch_stat():
    logp = torch.zeros((1, 2), requires_grad=True)
    old = torch.zeros((1, 2))
    server = torch.tensor([[-0.5, 0.25]])
    w = truncated_is_weight(old, server, cap=1.5)                   # [min(e^0.5, 1.5)=1.5, e^-0.25]
    loss, stats = ppo_loss(logp, old, torch.tensor([2.0]), torch.ones((1, 2)), **CLIP,
                           is_weight=w, server_logp=server)
    assert float(loss) == pytest.approx(-2.0 * (1.5 + math.exp(-0.25)) / 2)
    assert stats["is_weight"] == pytest.approx((1.5 + math.exp(-0.25)) / 2)
    assert stats["logprob_mismatch"] == pytest.approx((0.5 + 0.25) / 2)
    loss.backward()
    assert logp.grad[0].tolist() == pytest.approx([-2.0 * 1.5 / 2, -2.0 * math.exp(-0.25) / 2])
