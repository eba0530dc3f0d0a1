"""PPO-clip policy loss for sampled LLM responses (docs/architecture.md, Algorithms).

Per token t of a response, with ratio ``r_t = exp(logp_t - old_logp_t)`` and
advantage ``A_t``:

    pg_t   = max(-A_t * r_t, -A_t * clip(r_t, 1 - clip_low, 1 + clip_high))   # PPO-clip, pessimistic
    pg_t  *= w_t                               # truncated importance weight (train/inference mismatch)
    loss_t = pg_t + kl_coef * KL_t - entropy_coef * H_t

``clip_low``/``clip_high`` are the asymmetric epsilons of DAPO's clip-higher
(arXiv 2503.14476). ``KL_t`` is Schulman's k1 or k3 estimator of
KL(pi_theta || pi_ref) from the sampled token (http://joschu.net/blog/kl-approx.html).
``w_t = min(exp(logp_old_trainer - logp_server), C)`` corrects for the sampler
(SGLang) and the trainer computing slightly different probabilities for the same
weights (truncated importance sampling, as in "Your Efficient RL Framework
Secretly Brings You Off-Policy RL Training", Yao et al. 2025).

Tensors are ``[B, T]`` (sequences x response tokens, right-padded); ``mask`` is 1
on real response tokens.
"""
from __future__ import annotations

from typing import Literal

import torch

Agg = Literal["token_mean", "seq_mean"]


def masked_mean(x: torch.Tensor, mask: torch.Tensor, agg: Agg = "token_mean") -> torch.Tensor:
    """Aggregate ``x`` [B, T] over the valid tokens of ``mask`` [B, T].

    token_mean: sum over all valid tokens / their count (long responses weigh more).
    seq_mean: mean over sequences of each sequence's token mean (every response
    weighs the same). Sequences without valid tokens are left out; with no valid
    token at all the result is 0 (a zero-weight micro-batch still has a graph).
    """
    mask = mask.to(x.dtype)
    if agg == "token_mean":
        return (x * mask).sum() / mask.sum().clamp(min=1.0)
    if agg == "seq_mean":
        tokens = mask.sum(-1)                                     # [B]
        per_seq = (x * mask).sum(-1) / tokens.clamp(min=1.0)      # [B]
        has = (tokens > 0).to(x.dtype)
        return (per_seq * has).sum() / has.sum().clamp(min=1.0)
    raise ValueError(f"loss_agg must be token_mean or seq_mean, got {agg!r}")


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from tokens sampled by pi.

    k1 = logp - ref_logp (unbiased, can be negative);
    k3 = exp(ref_logp - logp) - (ref_logp - logp) - 1 (unbiased, always >= 0).
    """
    if estimator == "k1":
        return logp - ref_logp
    if estimator == "k3":
        log_ratio = ref_logp - logp
        return torch.exp(log_ratio) - log_ratio - 1.0
    raise ValueError(f"kl_estimator must be k1 or k3, got {estimator!r}")


def truncated_is_weight(old_logp_trainer: torch.Tensor, server_logp: torch.Tensor, cap: float) -> torch.Tensor:
    """``min(exp(old_logp_trainer - server_logp), cap)`` per token, without gradient.

    The tokens were sampled from the server's distribution while the PPO ratio is
    taken against the trainer's; this weight re-targets the sample. ``cap <= 0``
    disables the correction (all ones).
    """
    with torch.no_grad():
        if cap <= 0:
            return torch.ones_like(old_logp_trainer)
        return torch.exp(old_logp_trainer - server_logp).clamp(max=cap)


def ppo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
             clip_low: float, clip_high: float, agg: Agg = "token_mean",
             ref_logp: torch.Tensor | None = None, kl_coef: float = 0.0, kl_estimator: str = "k3",
             entropy: torch.Tensor | None = None, entropy_coef: float = 0.0,
             is_weight: torch.Tensor | None = None,
             server_logp: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO-clip loss with optional KL, entropy bonus and importance weight.

    logp: [B, T] current policy logprobs (with grad); old_logp: [B, T] the trainer's
    logprobs before the update (``logp_old_trainer``); advantages: [B] (broadcast
    over tokens) or [B, T]; mask: [B, T] valid response tokens; ref_logp, entropy,
    is_weight, server_logp: [B, T] or None. ``server_logp`` only feeds the
    ``logprob_mismatch`` statistic.

    Returns the scalar loss and float stats: ``loss``, ``policy``, ``kl``,
    ``entropy``, ``clipfrac`` (share of tokens where the clipped branch is taken),
    ``ratio`` (mean), ``is_weight`` (mean), ``logprob_mismatch`` (mean
    |old_logp_trainer - server_logp|). policy/kl/entropy use ``agg`` so that
    ``loss = policy + kl_coef * kl - entropy_coef * entropy``; the rest are token means.
    """
    if advantages.dim() == 1:
        advantages = advantages[:, None]
    advantages = advantages.expand_as(logp).to(logp.dtype)
    mask = mask.to(logp.dtype)

    ratio = torch.exp(logp - old_logp)                                        # [B, T]
    pg_unclipped = -advantages * ratio
    pg_clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    pg = torch.maximum(pg_unclipped, pg_clipped)                              # pessimistic bound
    if is_weight is not None:
        pg = pg * is_weight.detach()
    policy = masked_mean(pg, mask, agg)
    loss = policy

    stats: dict[str, float] = {}
    if ref_logp is not None:
        kl = kl_penalty(logp, ref_logp.detach(), kl_estimator)
        kl_agg = masked_mean(kl, mask, agg)
        if kl_coef:
            loss = loss + kl_coef * kl_agg
        stats["kl"] = float(kl_agg.detach())
    else:
        stats["kl"] = 0.0
    if entropy is not None:
        ent_agg = masked_mean(entropy, mask, agg)
        if entropy_coef:
            loss = loss - entropy_coef * ent_agg
        stats["entropy"] = float(ent_agg.detach())
    else:
        stats["entropy"] = 0.0

    with torch.no_grad():
        stats["loss"] = float(loss)
        stats["policy"] = float(policy)
        stats["clipfrac"] = float(masked_mean((pg_clipped > pg_unclipped).to(logp.dtype), mask))
        stats["ratio"] = float(masked_mean(ratio, mask))
        stats["is_weight"] = float(masked_mean(is_weight, mask)) if is_weight is not None else 1.0
        stats["logprob_mismatch"] = (float(masked_mean((old_logp - server_logp).abs(), mask))
                                     if server_logp is not None else 0.0)
    return loss, stats
