"""AFlow's parent selection: soft-mixed probabilities over the top-k rounds.

AFlow (Zhang et al., 2024, Sec. 3.3; MetaGPT ``DataUtils.select_round``)
picks the workflow to modify next from the best rounds so far, mixing a
uniform distribution (exploration) with a softmax over scores
(exploitation). docs/architecture.md (Algorithms) fixes the formula:

    P(i) = λ/n + (1 − λ)·softmax(α·(s_i − s_max)),   scores ×100, α = 0.2, λ = 0.3

over the top-k rounds, round 1 (the initial workflow) always among them.
A *round* here is any mapping with ``round`` (int) and ``score`` (float in
[0, 1]); several entries of one round (AFlow writes one per validation run)
are averaged first, as AFlow's ``_load_scores`` does.

    rng = np.random.default_rng(0)
    parent = select_parent([{"round": 1, "score": 0.4}, {"round": 2, "score": 0.6}], rng)
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Mapping, Sequence

import numpy as np

ALPHA = 0.2    # AFlow's softmax temperature on ×100 scores
LAMBDA = 0.3   # AFlow's share of the uniform distribution
SCALE = 100.0  # AFlow multiplies [0, 1] scores by 100 before the softmax


def softmax(x: Sequence[float] | np.ndarray) -> np.ndarray:
    """Numerically stable softmax of a 1-D array (shifted by its max, as AFlow does)."""
    x = np.asarray(x, dtype=np.float64)
    w = np.exp(x - np.max(x))
    return w / w.sum()


def selection_probabilities(scores: Sequence[float] | np.ndarray, *, alpha: float = ALPHA,
                            lam: float = LAMBDA) -> np.ndarray:
    """``P(i) = λ/n + (1−λ)·softmax(α·(100·s_i − 100·s_max))`` for scores in [0, 1].

    Returns one probability per score, in the order given; they sum to 1.
    """
    s = np.asarray(scores, dtype=np.float64).reshape(-1) * SCALE
    n = len(s)
    if n == 0:
        raise ValueError("selection_probabilities: no scores to select from")
    if not np.all(np.isfinite(s)):
        raise ValueError(f"selection_probabilities: scores must be finite, got {list(scores)}")
    return lam / n + (1.0 - lam) * softmax(alpha * (s - s.max()))


def round_means(rounds: Sequence[Mapping[str, Any]]) -> list[dict]:
    """One ``{"round", "score", ...}`` per round, scores averaged over its entries.

    Entries without a score (rejected rounds) are skipped. Other keys of the
    first entry of a round are kept (hash, parent, ...).
    """
    groups: OrderedDict[int, list[Mapping[str, Any]]] = OrderedDict()
    for item in rounds:
        if item.get("score") is None:
            continue
        groups.setdefault(int(item["round"]), []).append(item)
    out = []
    for rnd, items in groups.items():
        merged = dict(items[0])
        merged["round"] = rnd
        merged["score"] = float(np.mean([float(it["score"]) for it in items]))
        out.append(merged)
    return out


def top_k_rounds(rounds: Sequence[Mapping[str, Any]], k: int) -> list[dict]:
    """The best ``k`` rounds by mean score, round 1 always included (AFlow's ``get_top_rounds``).

    Round 1 comes first when present, then the others by descending score
    (ties: the earlier round first), until ``k`` rounds are taken.
    """
    if k < 1:
        raise ValueError(f"top_k_rounds: k must be at least 1, got {k}")
    means = round_means(rounds)
    first = [r for r in means if r["round"] == 1]
    rest = sorted((r for r in means if r["round"] != 1), key=lambda r: (-r["score"], r["round"]))
    return (first + rest)[:k]


def select_parent(rounds: Sequence[Mapping[str, Any]], rng: np.random.Generator, *, k: int = 3,
                  alpha: float = ALPHA, lam: float = LAMBDA) -> dict:
    """Draw the parent round: the top-``k`` rounds, then one by ``selection_probabilities``."""
    candidates = top_k_rounds(rounds, k)
    if not candidates:
        raise ValueError("select_parent: no scored round to select from")
    # AFlow sorts by score before drawing; the probabilities do not depend on the
    # order, but a fixed order makes a seeded draw reproducible across equal inputs.
    candidates.sort(key=lambda r: (-r["score"], r["round"]))
    probs = selection_probabilities([r["score"] for r in candidates], alpha=alpha, lam=lam)
    return candidates[int(rng.choice(len(candidates), p=probs))]
