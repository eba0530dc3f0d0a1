"""Policy turns -> padded tensors in micro-batches, and the trainer's logprobs of them.

Each :class:`~aflow_rl.rollout.types.Turn` is one sequence ``prompt + response``.
A rollout batch is split contiguously over the data-parallel ranks, then each
rank's share into micro-batches. Every rank gets the same number of
micro-batches, a multiple of the gradient accumulation steps, because every
``backward``/``step`` is a collective: one rank doing one more than another
would hang. A rank short of sequences gets a copy with an all-zero loss mask.

:func:`sequence_logprobs` recomputes the server's logprobs: the log-softmax of
the temperature-scaled logits after the grammar mask (docs/architecture.md, Serving protocol).

:func:`build_batch` comes first in an iteration: one step's episodes -> the :class:`Batch` every
rank trains on (PARL-shaped rewards, group filtering, advantages, grammar masks, reward stats).
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

import numpy as np
import torch

from aflow_rl.algos.advantages import from_trajectories, step_group_fraction, valid_group_mask
from aflow_rl.algos.parl import parl_lambdas, shaped_rewards
from aflow_rl.logprobs import policy_logprobs, rescales_logits
from aflow_rl.rollout.types import Trajectory, Turn

# A grammar mask per sequence: BoolTensor [T, V] (True = allowed), or xgrammar's
# packed int32 bitmask [T, ceil(V/32)] (32x smaller; unpacked just before use).
GrammarMask = torch.Tensor


@dataclass
class MicroBatch:
    """One forward/backward worth of sequences, right-padded.

    input_ids [B, L]: prompt then response, padded with ``pad_id``.
    attention_mask [B, L]: 1 on real tokens.
    position_ids [B, L]: 0..len-1 per row, as the server numbered them.
    logit_positions [B, T]: index ``P_b + j - 1`` of the logit that predicts
    response token ``j`` of row ``b`` (0 on padding).
    response_ids [B, T], response_mask [B, T] (float 1/0), server_logprobs [B, T],
    advantages [B, T] (each turn's advantage broadcast over its tokens).
    grammar_masks: per row a :data:`GrammarMask` or None (unconstrained).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    logit_positions: torch.Tensor
    response_ids: torch.Tensor
    response_mask: torch.Tensor
    server_logprobs: torch.Tensor
    advantages: torch.Tensor
    grammar_masks: list[GrammarMask | None] = field(default_factory=list)

    @property
    def num_sequences(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_tokens(self) -> int:
        """Real tokens (prompt + response) of the micro-batch: the forward's work."""
        return int(self.attention_mask.sum())

    @property
    def num_response_tokens(self) -> int:
        return int(self.response_mask.sum())

    def to(self, device: torch.device | str) -> "MicroBatch":
        moved = {k: getattr(self, k).to(device) for k in (
            "input_ids", "attention_mask", "position_ids", "logit_positions",
            "response_ids", "response_mask", "server_logprobs", "advantages")}
        masks = [m.to(device) if m is not None else None for m in self.grammar_masks]
        return replace(self, grammar_masks=masks, **moved)


def collate(turns: Sequence[Turn], advantages: Sequence[float], *, pad_id: int = 0,
            grammar_masks: Sequence[GrammarMask | None] | None = None,
            loss_weights: Sequence[float] | None = None) -> MicroBatch:
    """Pad ``turns`` into one :class:`MicroBatch`; ``loss_weights`` (0/1) scales each row's mask."""
    if not turns:
        raise ValueError("collate: no turns")
    B = len(turns)
    L = max(len(t.prompt_ids) + len(t.response_ids) for t in turns)
    T = max(len(t.response_ids) for t in turns)
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, L), dtype=torch.long)
    position_ids = torch.zeros((B, L), dtype=torch.long)
    logit_positions = torch.zeros((B, T), dtype=torch.long)
    response_ids = torch.full((B, T), pad_id, dtype=torch.long)
    response_mask = torch.zeros((B, T), dtype=torch.float32)
    server_logprobs = torch.zeros((B, T), dtype=torch.float32)
    adv = torch.zeros((B, T), dtype=torch.float32)
    for b, turn in enumerate(turns):
        P, R = len(turn.prompt_ids), len(turn.response_ids)
        if P == 0:
            raise ValueError("collate: a turn without prompt tokens has no logit for its first response token")
        n = P + R
        input_ids[b, :P] = torch.as_tensor(turn.prompt_ids, dtype=torch.long)
        input_ids[b, P:n] = torch.as_tensor(turn.response_ids, dtype=torch.long)
        attention_mask[b, :n] = 1
        position_ids[b, :n] = torch.arange(n)
        logit_positions[b, :R] = torch.arange(P - 1, n - 1)
        response_ids[b, :R] = torch.as_tensor(turn.response_ids, dtype=torch.long)
        weight = 1.0 if loss_weights is None else float(loss_weights[b])
        response_mask[b, :R] = weight
        server_logprobs[b, :R] = torch.as_tensor(turn.logprobs, dtype=torch.float32)
        adv[b, :R] = float(advantages[b])
    masks = list(grammar_masks) if grammar_masks is not None else [None] * B
    if len(masks) != B:
        raise ValueError(f"collate: {len(masks)} grammar masks for {B} turns")
    return MicroBatch(input_ids, attention_mask, position_ids, logit_positions, response_ids,
                      response_mask, server_logprobs, adv, masks)


def flatten_turns(trajectories: Sequence[Any], advantages: Sequence[float] | np.ndarray
                  ) -> tuple[list[Turn], np.ndarray]:
    """All policy turns of ``trajectories`` in order, with one advantage per turn.

    ``advantages`` holds one value per trajectory (GRPO: repeated over its turns)
    or one per turn in the same order (GiGPO's step rows); the two readings agree
    when every trajectory has a single turn.
    """
    advantages = np.asarray(advantages, dtype=np.float64).reshape(-1)
    turns = [turn for traj in trajectories for turn in traj.turns]
    if len(advantages) == len(turns):
        return turns, advantages
    if len(advantages) == len(trajectories):
        return turns, np.repeat(advantages, [len(traj.turns) for traj in trajectories])
    raise ValueError(f"flatten_turns: {len(advantages)} advantages for {len(trajectories)} trajectories "
                     f"with {len(turns)} turns; give one per trajectory or one per turn")


def micro_batch_count(num_sequences: int, *, micro_batch_size: int, grad_accum: int, world_size: int = 1) -> int:
    """Micro-batches per rank for one pass over ``num_sequences``: the same on every
    rank, at least one, and a multiple of ``grad_accum`` so that each pass ends on
    an optimizer step (no gradient leaks into the next rollout batch)."""
    per_rank = math.ceil(num_sequences / world_size)
    needed = max(1, math.ceil(per_rank / micro_batch_size))
    return grad_accum * math.ceil(needed / grad_accum)


def make_micro_batches(turns: Sequence[Turn], advantages: Sequence[float] | np.ndarray, *,
                       micro_batch_size: int, grad_accum: int = 1, rank: int = 0, world_size: int = 1,
                       pad_id: int = 0,
                       grammar_masks: Sequence[GrammarMask | None] | None = None) -> list[MicroBatch]:
    """This rank's micro-batches of a rollout batch (the same ``turns`` on every rank).

    ``advantages`` has one value per turn. Turns without response tokens are
    dropped. Rank ``r`` takes a contiguous slice, so micro-batch ``i`` of rank ``r``
    with ``world_size`` ranks holds the same sequences as micro-batch
    ``r * n + i`` of one rank with ``world_size`` times the accumulation: the
    data-parallel and the accumulated update are the same.
    """
    advantages = np.asarray(advantages, dtype=np.float64).reshape(-1)
    if len(advantages) != len(turns):
        raise ValueError(f"make_micro_batches: {len(advantages)} advantages for {len(turns)} turns")
    masks = list(grammar_masks) if grammar_masks is not None else [None] * len(turns)
    keep = [i for i, t in enumerate(turns) if len(t.response_ids) > 0]
    if not keep:
        raise ValueError("make_micro_batches: no turn has response tokens")
    turns = [turns[i] for i in keep]
    advantages = advantages[keep]
    masks = [masks[i] for i in keep]

    n_micro = micro_batch_count(len(turns), micro_batch_size=micro_batch_size,
                                grad_accum=grad_accum, world_size=world_size)
    # Rank shares differ by at most one sequence; split each as evenly as possible.
    shares = np.array_split(np.arange(len(turns)), world_size)
    mine = shares[rank]
    batches = []
    for part in np.array_split(mine, n_micro):
        idx = [int(i) for i in part]
        weights = [1.0] * len(idx)
        if not idx:
            # Same collective calls on every rank: a stand-in sequence that adds no loss.
            idx, weights = [int(mine[0]) if len(mine) else 0], [0.0]
        batches.append(collate([turns[i] for i in idx], advantages[idx], pad_id=pad_id,
                               grammar_masks=[masks[i] for i in idx], loss_weights=weights))
    return batches


def turn_grammar_masks(turns: Sequence[Turn], backend: Any) -> list[GrammarMask | None]:
    """The packed xgrammar masks the server applied to each turn (None where it had no grammar).

    ``backend`` is an :class:`aflow_rl.serving.grammar.GrammarBackend` for the policy's
    tokenizer; a response that breaks its grammar raises ``ValueError``.
    """
    from aflow_rl.serving.grammar import grammar_bitmasks

    return [grammar_bitmasks(t.grammar, t.response_ids, backend=backend) if t.grammar else None for t in turns]


def _allowed(mask: GrammarMask, vocab_size: int) -> torch.Tensor:
    """A :data:`GrammarMask` as BoolTensor [T, vocab_size]; ids beyond the mask's vocabulary are disallowed."""
    if mask.dtype != torch.bool:
        from aflow_rl.serving.grammar import unpack_bitmask

        mask = unpack_bitmask(mask, min(vocab_size, mask.shape[-1] * 32))
    if mask.shape[-1] > vocab_size:
        raise ValueError(f"grammar mask covers {mask.shape[-1]} token ids, the model has {vocab_size}")
    if mask.shape[-1] < vocab_size:
        mask = torch.nn.functional.pad(mask, (0, vocab_size - mask.shape[-1]), value=False)
    return mask


_NO_ROWWISE_KEEP: set[type] = set()    # model classes whose logits_to_keep takes no [B, T] index


def _inner(model: Any) -> Any:
    return getattr(model, "module", model)     # a DeepSpeed engine wraps the Hugging Face model


def response_logits(model: Any, batch: MicroBatch) -> torch.Tensor:
    """``[B, T, V]``: the logits at ``batch.logit_positions``, the ones that predict response tokens.

    Transformers versions that index the hidden states with a [B, T] ``logits_to_keep`` row by row
    compute only those. Older 5.x releases (5.17, measured) index every row with the whole
    [B, T] index and return ``[B, B, T, V]``: B times the work. For such a model class the logits
    come from the last hidden state (after the final norm) at those positions through the output
    head instead, the same numbers (tests/trainer/test_batch.py).
    """
    B, T = batch.response_ids.shape
    kw = dict(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids,
              use_cache=False)
    cls = type(_inner(model))
    if cls not in _NO_ROWWISE_KEEP:
        out = model(**kw, logits_to_keep=batch.logit_positions)
        logits = out.logits if hasattr(out, "logits") else out[0]
        if logits.dim() == 3 and logits.shape[:2] == (B, T):
            return logits
        if not (logits.dim() == 4 and logits.shape[:3] == (B, B, T)):
            raise RuntimeError(f"model returned logits {tuple(logits.shape)} for positions {(B, T)}: "
                               "expected [B, T, V] from a [B, T] logits_to_keep")
        _NO_ROWWISE_KEEP.add(cls)
        del out, logits
    if rescales_logits(_inner(model)):
        raise RuntimeError(f"{cls.__name__} rescales its logits after the output head and this transformers "
                           f"returns [B, B, T, V] for a [B, T] logits_to_keep; upgrade transformers")
    out = model(**kw, logits_to_keep=1, output_hidden_states=True)
    hidden = out.hidden_states[-1]                                               # [B, S, H], normed
    picked = hidden.gather(1, batch.logit_positions.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))
    return _inner(model).get_output_embeddings()(picked)


def sequence_logprobs(model: Any, batch: MicroBatch, temperature: float,
                      grammar_masks: Sequence[GrammarMask | None] | None = None, *,
                      entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprobs and entropies of the response tokens, as the server computed them.

    ``model`` is a DeepSpeed engine or a Hugging Face causal LM. Only the logits
    that predict response tokens are materialised (``logits_to_keep`` with the
    [B, T] positions). Then the server's kernel, :func:`aflow_rl.logprobs.policy_logprobs`:
    ``log_softmax(masked_logits / temperature)`` in fp32, at temperature 1 below the greedy threshold.
    ``grammar_masks`` (default: ``batch.grammar_masks``) has one :data:`GrammarMask`
    or None per row. Returns ``logp`` [B, T] and ``entropy`` [B, T] of the masked,
    tempered distribution, both 0 on padding; entropy carries a gradient only with
    ``entropy_grad`` (it costs a second [B, T, V] graph).
    """
    masks = batch.grammar_masks if grammar_masks is None else list(grammar_masks)
    logits = response_logits(model, batch)
    B, T = batch.response_ids.shape
    V = logits.shape[-1]
    allowed = None
    if masks and any(m is not None for m in masks):
        allowed = torch.ones((B, T, V), dtype=torch.bool, device=logits.device)
        for b, m in enumerate(masks):
            if m is not None:
                m = _allowed(m.to(logits.device), V)
                allowed[b, :m.shape[0]] = m
        valid = batch.response_mask > 0
        picked = allowed.gather(-1, batch.response_ids.unsqueeze(-1)).squeeze(-1)   # [B, T]
        if bool((valid & ~picked).any()):
            b, t = (valid & ~picked).nonzero()[0].tolist()
            raise ValueError(f"response token {int(batch.response_ids[b, t])} (row {b}, position {t}) "
                             "is not allowed by its grammar mask")
    logp_all = policy_logprobs(logits, temperature, allowed)                   # [B, T, V], the server's formula
    logp = logp_all.gather(-1, batch.response_ids.unsqueeze(-1)).squeeze(-1)   # [B, T]
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        # where(), not masked products: 0 * -inf would put NaN into the backward pass.
        finite = torch.isfinite(logp_all)
        safe = torch.where(finite, logp_all, torch.zeros_like(logp_all))
        entropy = -(safe.exp() * safe).sum(-1)                                 # [B, T]
    pad = batch.response_mask <= 0
    # Multiply, don't index: stand-in rows (mask 0) keep their graph.
    logp = logp * (~pad)
    entropy = entropy * (~pad)
    return logp, entropy


# ---------------------------------------------------------------------------
# One step's episodes -> the batch every rank trains on
# ---------------------------------------------------------------------------


@dataclass
class Batch:
    """One optimizer step's training data, built on rank 0 and shared with every rank.

    turns: [N] the policy turns of the kept episodes, episode by episode, in time order.
    advantages: [N] float64, one per turn (GRPO repeats the episode's value over its turns).
    grammar_masks: [N] the packed mask the server applied to each turn, or None.
    terminal_rewards: [K] per kept episode, the PARL-shaped return minus its step rewards.
    stats: reward scalars under the metric tags of docs/architecture.md.
    """

    turns: list[Turn]
    advantages: np.ndarray
    grammar_masks: list[GrammarMask | None]
    terminal_rewards: np.ndarray
    stats: dict[str, float] = field(default_factory=dict)


def build_batch(trajs: Sequence[Trajectory], step: int, cfg: Any, grammar: Any = None) -> Batch:
    """The :class:`Batch` of one step's episodes ``trajs`` at optimizer step ``step`` (0-based).

    1. PARL-shaped reward per episode (``cfg.algo.parl``, lambdas annealed by ``step``).
    2. Failed or turnless episodes leave their group; groups left with fewer than 2 are dropped
       (:func:`~aflow_rl.algos.advantages.valid_group_mask`).
    3. Terminal reward = shaped reward minus the step rewards the environment already placed on
       the turns, so every estimator sees exactly the shaped return while GiGPO's step returns
       still see where step rewards happened.
    4. Advantages by ``cfg.algo.adv_estimator`` (:func:`~aflow_rl.algos.advantages.from_trajectories`),
       flattened to one per turn; the grammar masks rebuilt with ``grammar`` (a
       :class:`~aflow_rl.serving.grammar.GrammarBackend`; needed only when a turn has a grammar).
    """
    shaped = shaped_rewards(trajs, step, cfg.algo.parl)                                    # [B]
    keep = valid_group_mask([t.group_id for t in trajs], [t.ok and bool(t.turns) for t in trajs])
    kept = [t for t, k in zip(trajs, keep, strict=True) if k]
    terminal = np.asarray([s - float(t.step_rewards.sum()) for t, s, k in zip(trajs, shaped, keep, strict=True) if k],
                          dtype=np.float64)                                               # [K]
    advs = from_trajectories(cfg.algo, kept, terminal)
    turns = [turn for t in kept for turn in t.turns]
    if grammar is None and any(t.grammar for t in turns):
        raise ValueError("build_batch: turns carry a grammar but no GrammarBackend was given to rebuild "
                         "their masks; pass GrammarBackend.from_pretrained(policy model path)")
    stats = reward_stats(trajs, shaped, keep, parl_lambdas(step, cfg.algo.parl))
    stats["gigpo/step_group_fraction"] = step_group_fraction(kept)   # the turns GiGPO's step groups reach
    return Batch(turns=turns, advantages=np.concatenate(advs) if advs else np.zeros(0),
                 grammar_masks=turn_grammar_masks(turns, grammar), terminal_rewards=terminal, stats=stats)


def reward_stats(trajs: Sequence[Trajectory], shaped: np.ndarray, keep: np.ndarray,
                 lambdas: tuple[float, float]) -> dict[str, float]:
    """Scalars of one step's episodes: shaped reward mean/std and each component's mean over the
    ok episodes, their numeric metrics (``episode/*``), the episodes left out of the batch, the
    PARL lambdas."""
    ok = [i for i, t in enumerate(trajs) if t.ok]
    stats: dict[str, float] = {
        "pool/skipped_episodes": float(len(trajs) - int(np.sum(keep))),   # left their group or in a short one
        "charts/parl_lambda1": lambdas[0], "charts/parl_lambda2": lambdas[1],
    }
    if not ok:
        return stats
    r = np.asarray([shaped[i] for i in ok])
    stats["rewards/mean"], stats["rewards/std"] = float(r.mean()), float(r.std(ddof=1)) if len(r) > 1 else 0.0
    comps, metrics = defaultdict(list), defaultdict(list)
    for i in ok:
        for k, v in trajs[i].reward_components.items():
            comps[k].append(float(v))
        for k, v in trajs[i].metrics.items():
            if isinstance(v, (int, float)):
                metrics[k].append(float(v))
    stats.update({f"rewards/{k}/mean": float(np.mean(v)) for k, v in comps.items()})
    stats.update({f"episode/{k}": float(np.mean(v)) for k, v in metrics.items()})
    return stats
