"""AFlow's parent selection: P(i) = λ/n + (1−λ)·softmax(α·(s_i − s_max)), scores ×100 (docs/architecture.md)."""
import math

import numpy as np
import pytest

from aflow_rl.envs.aflow.selection import round_means, select_parent, selection_probabilities, top_k_rounds


def test_probabilities_hand_computed():
    # ×100: [50, 40, 30]; α(s − max) = [0, −2, −4]; softmax = [1, e⁻², e⁻⁴] / (1 + e⁻² + e⁻⁴)
    # = [0.866813, 0.117310, 0.015877]; P = 0.3/3 + 0.7·softmax.
    p = selection_probabilities([0.5, 0.4, 0.3])
    np.testing.assert_allclose(p, [0.706769, 0.182117, 0.111113], atol=1e-6)
    assert p.sum() == pytest.approx(1.0)


def test_probabilities_match_formula_any_order_and_params():
    scores = [0.2, 0.9, 0.55, 0.9]
    alpha, lam = 0.5, 0.1
    s = [100 * x for x in scores]
    e = [math.exp(alpha * (x - max(s))) for x in s]
    expected = [lam / 4 + (1 - lam) * w / sum(e) for w in e]
    np.testing.assert_allclose(selection_probabilities(scores, alpha=alpha, lam=lam), expected, rtol=1e-12)


def test_probabilities_edge_cases():
    assert selection_probabilities([0.7]).tolist() == [1.0]
    np.testing.assert_allclose(selection_probabilities([0.3, 0.3]), [0.5, 0.5])
    # A far worse round keeps at least the uniform share λ/n.
    p = selection_probabilities([1.0, 0.0])
    assert p[1] == pytest.approx(0.15 + 0.7 * math.exp(-20) / (1 + math.exp(-20)))
    with pytest.raises(ValueError):
        selection_probabilities([])
    with pytest.raises(ValueError):
        selection_probabilities([0.1, float("nan")])


def test_round_means_average_validation_runs_and_skip_rejected():
    rounds = [{"round": 1, "score": 0.2}, {"round": 1, "score": 0.4},
              {"round": 2, "score": None, "status": "rejected"}, {"round": 3, "score": 0.9}]
    means = round_means(rounds)
    assert [(r["round"], round(r["score"], 6)) for r in means] == [(1, 0.3), (3, 0.9)]


def test_top_k_always_includes_round_one():
    rounds = [{"round": r, "score": s} for r, s in [(1, 0.1), (2, 0.5), (3, 0.9), (4, 0.7), (5, 0.5)]]
    assert [r["round"] for r in top_k_rounds(rounds, 3)] == [1, 3, 4]
    assert [r["round"] for r in top_k_rounds(rounds, 4)] == [1, 3, 4, 2]   # tie 0.5: earlier round
    assert [r["round"] for r in top_k_rounds(rounds, 1)] == [1]
    assert len(top_k_rounds(rounds, 10)) == 5
    # Round 1 among the best anyway: not counted twice.
    rounds[0]["score"] = 0.95
    assert [r["round"] for r in top_k_rounds(rounds, 3)] == [1, 3, 4]


def test_sampling_frequencies_follow_probabilities():
    rounds = [{"round": 1, "score": 0.3}, {"round": 2, "score": 0.5}, {"round": 3, "score": 0.4},
              {"round": 4, "score": 0.1}]
    rng = np.random.default_rng(0)
    n = 8000
    counts = {1: 0, 2: 0, 3: 0}
    for _ in range(n):
        counts[select_parent(rounds, rng, k=3)["round"]] += 1
    # Candidates: round 1 + the two best (2, 3); round 4 never drawn.
    p = dict(zip([2, 3, 1], selection_probabilities([0.5, 0.4, 0.3])))
    for rnd, c in counts.items():
        # 4.5 standard errors of a binomial proportion: a flake chance below 1e-5.
        assert abs(c / n - p[rnd]) < 4.5 * math.sqrt(p[rnd] * (1 - p[rnd]) / n), (rnd, c / n, p[rnd])


def test_select_parent_is_reproducible_with_a_seed():
    rounds = [{"round": r, "score": 0.1 * r} for r in range(1, 6)]
    a = [select_parent(rounds, np.random.default_rng(7))["round"] for _ in range(5)]
    b = [select_parent(rounds, np.random.default_rng(7))["round"] for _ in range(5)]
    assert a == b
    with pytest.raises(ValueError):
        select_parent([{"round": 2, "score": None}], np.random.default_rng(0))
