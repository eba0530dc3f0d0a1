"""The policy's logprob kernel: one formula for what the embedded server reports while it samples and
what the trainer recomputes for the loss, so the two cannot drift apart.

SGLang's convention: ``log_softmax(mask(logits) / T)`` in fp32, where the mask is the grammar's allowed
tokens (disallowed ones get -inf) and a temperature below ``GREEDY_EPS`` means greedy decoding, whose
logprobs are reported at temperature 1. ``top_p``/``top_k`` only filter sampling, never these logprobs.
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

# SGLang treats a temperature below this as greedy (and reports logprobs at temperature 1).
GREEDY_EPS = 1e-6


def rescales_logits(model) -> bool:
    """Whether ``model`` changes its logits after the output head (soft-capping, a logit scale). Both
    the server's prefill and the trainer's fallback take logits as ``head(last hidden state)``, which
    would misreport such a model."""
    return bool(getattr(model.config, "final_logit_softcapping", None) or getattr(model, "logit_scale", None))


def is_greedy(temperature: float) -> bool:
    return temperature < GREEDY_EPS


def logprob_scale(temperature: float) -> float:
    """What the logits are divided by: the temperature, or 1 for greedy decoding."""
    return 1.0 if is_greedy(temperature) else float(temperature)


def policy_logprobs(logits: torch.Tensor, temperature: Union[float, Sequence[float]],
                    allowed: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``log_softmax(mask(logits) / T)`` over the last (vocabulary) axis, in fp32.

    ``temperature`` is one float for every row, or one per row of ``logits [N, V]`` (the server's
    batch, where each request has its own). ``allowed`` is an optional BoolTensor shaped like
    ``logits`` (True = the grammar allows the token)."""
    logits = logits.float()
    if allowed is not None:
        logits = logits.masked_fill(~allowed, float("-inf"))
    if isinstance(temperature, Sequence):
        scale: Union[float, torch.Tensor] = torch.tensor([logprob_scale(t) for t in temperature],
                                                         dtype=logits.dtype, device=logits.device).unsqueeze(-1)
    else:
        scale = logprob_scale(float(temperature))
    return torch.log_softmax(logits / scale, dim=-1)
