"""The one logprob kernel the embedded server and the trainer share (aflow_rl.logprobs), against SGLang's
formula written out by hand: softmax over the allowed tokens of logits / T, greedy (T < 1e-6) at T = 1."""
import math

import pytest
import torch

from aflow_rl.logprobs import GREEDY_EPS, is_greedy, logprob_scale, policy_logprobs


def reference(row: list[float], temperature: float, allowed: list[bool] | None = None) -> list[float]:
    """log p(token) by hand, in float64: exp(l/T) over the allowed tokens' sum; -inf where disallowed."""
    t = 1.0 if temperature < 1e-6 else temperature
    keep = allowed or [True] * len(row)
    m = max(v / t for v, k in zip(row, keep) if k)   # log-sum-exp shifted by the max: T = 1e-6 overflows exp
    z = m + math.log(sum(math.exp(v / t - m) for v, k in zip(row, keep) if k))
    return [v / t - z if k else float("-inf") for v, k in zip(row, keep)]


LOGITS = torch.tensor([[2.0, -1.0, 0.5, 3.0], [0.0, 0.0, 1.0, -2.0]])


@pytest.mark.parametrize("temperature", [1.0, 0.7, 2.5, 0.0, 1e-7, GREEDY_EPS])
def test_scalar_temperature_matches_the_formula(temperature):
    got = policy_logprobs(LOGITS, temperature)
    for r in range(2):
        assert got[r].tolist() == pytest.approx(reference(LOGITS[r].tolist(), temperature), abs=1e-6)


def test_greedy_threshold_is_strict():
    assert is_greedy(0.0) and is_greedy(GREEDY_EPS / 2) and not is_greedy(GREEDY_EPS)
    assert logprob_scale(0.0) == 1.0 and logprob_scale(GREEDY_EPS) == GREEDY_EPS and logprob_scale(0.7) == 0.7


def test_per_row_temperatures_equal_rowwise_scalar_calls():
    """The server's batch: one temperature per request, greedy and sampled rows side by side."""
    temps = [0.0, 0.5]
    got = policy_logprobs(LOGITS, temps)
    for r, t in enumerate(temps):
        assert torch.equal(got[r], policy_logprobs(LOGITS[r:r + 1], t)[0])
    assert not torch.allclose(got[1], policy_logprobs(LOGITS[1:2], 1.0)[0])  # the temperature was applied


def test_grammar_mask_renormalises_over_allowed_tokens():
    allowed = torch.tensor([[True, False, True, False], [False, True, True, True]])
    got = policy_logprobs(LOGITS, 0.8, allowed)
    for r in range(2):
        want = reference(LOGITS[r].tolist(), 0.8, allowed[r].tolist())
        assert got[r][allowed[r]].tolist() == pytest.approx([w for w in want if w != float("-inf")], abs=1e-6)
        assert torch.isneginf(got[r][~allowed[r]]).all()
        assert float(got[r][allowed[r]].exp().sum()) == pytest.approx(1.0, abs=1e-6)


def test_fp32_and_batched_shapes():
    """bf16 logits come back fp32 (the trainer's [B, T, V] and the server's [N, V] alike)."""
    logits = torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    got = policy_logprobs(logits, 1.3)
    assert got.dtype == torch.float32 and got.shape == (2, 3, 5)
    assert torch.allclose(got, torch.log_softmax(logits.float() / 1.3, dim=-1))


def test_server_and_trainer_share_the_kernel():
    """No second copy of the formula: both sides import this function and this threshold."""
    import aflow_rl.serving.generation as server
    import aflow_rl.trainer.batch as trainer

    assert server.policy_logprobs is policy_logprobs and trainer.policy_logprobs is policy_logprobs
    assert not hasattr(server, "GREEDY_EPS") and not hasattr(trainer, "GREEDY_EPS")
    assert not hasattr(server, "token_logprobs")


def test_rescales_logits_flags_softcapping_and_logit_scale():
    from types import SimpleNamespace

    from aflow_rl.logprobs import rescales_logits

    plain = SimpleNamespace(config=SimpleNamespace())
    assert not rescales_logits(plain)
    assert rescales_logits(SimpleNamespace(config=SimpleNamespace(final_logit_softcapping=30.0)))
    assert rescales_logits(SimpleNamespace(config=SimpleNamespace(), logit_scale=0.5))
    assert not rescales_logits(SimpleNamespace(config=SimpleNamespace(final_logit_softcapping=None)))
