"""MCTS over workflows: backup sums, PUCT scores and the descent on a hand-built tree; the AFlow switch.

The tree (scores in brackets) and the pool's expansion records (outcome =
improvement, or the penalty -0.1 for a rejected proposal):

    R [0.3]   expansions: A +0.2, B +0.1, rejected -0.1      n = 3, w = 0.2
    ├─ A [0.5]  expansions: C +0.1, rejected -0.1            n = 2, w = 0.0
    │   └─ C [0.6]  never expanded                           n = 0
    └─ B [0.4]  expansions: rejected -0.1                    n = 1, w = -0.1
"""
import math

import numpy as np
import pytest

from aflow_rl.envs.aflow.experience import Experience, QStats, SharedExperiencePool
from aflow_rl.envs.aflow.mcts import (SearchTree, TreeNode, TreeSelector, backup, prior_probabilities, puct_scores,
                                      shrunk_q)
from aflow_rl.envs.aflow.selection import selection_probabilities


def _tree() -> SearchTree:
    tree = SearchTree()
    tree.add(TreeNode("R", 1, 0.3))
    tree.add(TreeNode("A", 2, 0.5, parent_hash="R"))
    tree.add(TreeNode("B", 3, 0.4, parent_hash="R"))
    tree.add(TreeNode("C", 4, 0.6, parent_hash="A"))
    return tree


def _pool(tmp_path) -> SharedExperiencePool:
    pool = SharedExperiencePool(str(tmp_path / "exp.db"))

    def record(parent, child, improvement):
        pool.add(Experience(parent_hash=parent, child_hash=child, accepted=bool(child), improvement=improvement,
                            child_score=0.5 if child else None, reason="" if child else "cycle"))

    record("R", "A", 0.2)
    record("R", "B", 0.1)
    record("R", "", -0.1)
    record("A", "C", 0.1)
    record("A", "", -0.1)
    record("B", "", -0.1)
    return pool


def test_tree_links_children_and_paths():
    tree = _tree()
    assert tree.root.hash == "R" and tree.nodes["R"].children == ["A", "B"]
    assert [n.hash for n in tree.path("C")] == ["R", "A", "C"]
    assert [n.hash for n in tree.nodes.values() if n.round == 3] == ["B"] and "C" in tree and len(tree) == 4
    assert tree.add(TreeNode("A", 9, 0.0)).round == 2   # a known hash keeps its node


def test_backup_sums_the_subtree(tmp_path):
    stats = TreeSelector(_pool(tmp_path)).stats(_tree())
    expected = {  # (n_v, w_v, N(v), W(v))
        "R": (3, 0.2, 6, 0.1),     # N(R) = 3 + N(A) + N(B); W(R) = 0.2 + 0.0 - 0.1
        "A": (2, 0.0, 2, 0.0),     # C is unexpanded: A's subtree holds A's own two records
        "B": (1, -0.1, 1, -0.1),
        "C": (0, 0.0, 0, 0.0),
    }
    for h, (n, w, big_n, big_w) in expected.items():
        st = stats[h]
        assert (st.own_visits, st.visits) == (n, big_n)
        assert st.own_sum == pytest.approx(w, abs=1e-12) and st.value_sum == pytest.approx(big_w, abs=1e-12)
    assert stats["R"].mean_improvement == pytest.approx(0.1 / 6)
    assert stats["R"].own.mean_improvement == pytest.approx(0.2 / 3) and stats["C"].mean_improvement == 0.0
    # Pending expansions are virtual visits of outcome 0 on the whole root path.
    virtual = backup(_tree(), {"R": QStats(3, mean_improvement=0.2 / 3)}, pending={"C": 2})
    assert [virtual[h].visits for h in "RABC"] == [5, 2, 0, 2] and virtual["R"].value_sum == pytest.approx(0.2)


def test_puct_descent_exact_numbers(tmp_path):
    sel = TreeSelector(_pool(tmp_path), prior_weight=0.5, q_prior_count=1.0, c_puct=0.5)
    descent = sel.descend(_tree())
    assert [n.hash for n in descent.path] == ["R", "A", "C"] and descent.leaf.hash == "C"
    root, a, c = descent.levels
    assert [o.hash for o in root.options] == ["R", "A", "B"] and root.chosen == 1 and not root.expand
    # π = 0.5·(0.1 + 0.7·softmax(20·([0.3, 0.5, 0.4] − 0.5))) + 0.5/3
    np.testing.assert_allclose(root.prior, [0.222223, 0.520051, 0.257725], atol=1e-6)
    # Q̃ = (N·Q̄ + 1·0)/(N + 1): R* (3, 0.2/3) -> 0.05; A (2, 0) -> 0; B (1, -0.1) -> -0.05
    np.testing.assert_allclose(root.q, [0.05, 0.0, -0.05], atol=1e-12)
    assert root.visits == [3, 2, 1]
    # U = Q̃ + 0.5·π·sqrt(6)/(1 + N)
    np.testing.assert_allclose(root.scores, [0.118042, 0.212310, 0.107824], atol=1e-6)
    assert root.scores[0] == pytest.approx(0.05 + 0.5 * root.prior[0] * math.sqrt(6) / 4, abs=1e-12)
    # At A: options A*, C with scores [0.5, 0.6]; N(A) = 2, so sqrt(2); C unvisited.
    assert [o.hash for o in a.options] == ["A", "C"] and a.visits == [2, 0] and a.chosen == 1
    np.testing.assert_allclose(a.prior, [0.366721, 0.633279], atol=1e-6)
    np.testing.assert_allclose(a.scores, [0.086437, 0.447796], atol=1e-6)
    # C is a leaf: only "expand C", and sqrt(max(0, 1)) = 1.
    assert [o.hash for o in c.options] == ["C"] and c.expand and c.scores.tolist() == pytest.approx([0.5])
    assert sel.select(_tree(), np.random.default_rng(0)).hash == "C"


def test_select_many_spreads_with_virtual_visits(tmp_path):
    sel = TreeSelector(_pool(tmp_path), prior_weight=0.5, c_puct=0.5)
    picks = [n.hash for n in sel.select_many(_tree(), 4, np.random.default_rng(0))]
    assert picks == ["C", "C", "C", "B"]
    # The fourth descent sees three pending visits of C: N(A) = 5, so B overtakes A at the root.
    root = sel.descend(_tree(), pending={"C": 3}).levels[0]
    assert root.visits == [3, 5, 1] and root.chosen == 2


def test_expansions_of_a_child_update_its_ancestors(tmp_path):
    pool, tree = _pool(tmp_path), _tree()
    sel = TreeSelector(pool, prior_weight=0.5, c_puct=0.5)
    before = sel.stats(tree)
    pool.add(Experience(parent_hash="C", child_hash="", accepted=False, improvement=-0.1, reason="cycle"))
    after = sel.stats(tree)
    for h in ("R", "A", "C"):
        assert after[h].visits == before[h].visits + 1
        assert after[h].value_sum == pytest.approx(before[h].value_sum - 0.1)
    assert after["B"] == before["B"]
    # The pool is the source of truth: a fresh handle (another process, a restart) sees the same numbers.
    fresh = TreeSelector(SharedExperiencePool(pool.path), prior_weight=0.5, c_puct=0.5).stats(tree)
    assert fresh == after


def test_aflow_mode_equals_the_formula(tmp_path):
    sel = TreeSelector(_pool(tmp_path), mode="aflow", prior_weight=0.0, top_k=3).distribution(_tree())
    # Top-3 with round 1: R (round 1), C (0.6), A (0.5); sorted best first: C, A, R.
    assert [c.hash for c in sel.candidates] == ["C", "A", "R"]
    np.testing.assert_allclose(sel.probs, selection_probabilities([0.6, 0.5, 0.3]), rtol=1e-12)
    # No pool needed in aflow mode; draws follow the formula.
    selector = TreeSelector(None, mode="aflow")
    rng = np.random.default_rng(1)
    draws = [selector.select(_tree(), rng).hash for _ in range(3000)]
    freq = np.asarray([draws.count(h) for h in ("C", "A", "R")]) / len(draws)
    np.testing.assert_allclose(freq, sel.probs, atol=0.035)
    assert [n.hash for n in selector.select_many(_tree(), 3, np.random.default_rng(1))] == draws[:3]


def test_prior_weight_zero_is_q_driven(tmp_path):
    pool = _pool(tmp_path)
    sel = TreeSelector(pool, prior_weight=0.0, c_puct=0.5)
    levels = sel.descend(_tree()).levels
    np.testing.assert_allclose(levels[0].prior, [1 / 3] * 3, rtol=1e-12)   # scores play no part
    rescored = _tree()
    for node in rescored:
        node.score = {"R": 0.9, "A": 0.1, "B": 0.2, "C": 0.0}[node.hash]
    again = sel.descend(rescored).levels
    assert [lv.node.hash for lv in again] == [lv.node.hash for lv in levels] == ["R", "B"]
    np.testing.assert_allclose(again[0].scores, levels[0].scores, rtol=1e-12)
    # Without the exploration term selection is greedy in Q̃: R* (0.05) over A (0) and B (-0.05).
    greedy = TreeSelector(pool, prior_weight=0.0, c_puct=0.0).descend(_tree())
    assert greedy.leaf.hash == "R" and greedy.levels[0].scores.tolist() == pytest.approx([0.05, 0.0, -0.05])


def test_prior_weight_one_is_aflows_prior_over_the_options(tmp_path):
    level = TreeSelector(_pool(tmp_path), prior_weight=1.0).descend(_tree()).levels[0]
    np.testing.assert_allclose(level.prior, selection_probabilities([0.3, 0.5, 0.4]), rtol=1e-12)


def test_unvisited_options_start_at_zero_and_n0_shrinks_toward_it(tmp_path):
    # No learned value term: an unvisited option's Q̃ is 0, a visited one's is N·Q̄/(N + n0).
    selector = TreeSelector(_pool(tmp_path), prior_weight=0.5, c_puct=0.5, q_prior_count=1.0)
    level, stats = selector.descend(_tree()).levels[0], selector.stats(_tree())
    for opt, q in zip(level.options[1:], level.q[1:]):
        st = stats[opt.hash]
        assert q == pytest.approx(st.visits * st.mean_improvement / (st.visits + 1.0))
    with pytest.raises(TypeError):
        TreeSelector(selector.pool, value_fn=lambda nodes: [0.0] * len(nodes))  # the hook is gone


def test_formulas_and_argument_checks():
    assert shrunk_q(QStats(visits=3, mean_improvement=0.2), 1.0) == pytest.approx(0.6 / 4)
    assert shrunk_q(QStats(), 0.0) == 0.0                   # N + n0 = 0: no expected gain
    assert shrunk_q(QStats(visits=2, mean_improvement=0.1), 0.0) == pytest.approx(0.1)
    expected = 0.25 * selection_probabilities([0.2, 0.6]) + 0.75 * 0.5
    np.testing.assert_allclose(prior_probabilities([0.2, 0.6], prior_weight=0.25), expected, rtol=1e-12)
    np.testing.assert_allclose(puct_scores([0.1, 0.0], [0.5, 0.5], [3, 1], 2.0),
                               [0.1 + 2 * 0.5 * 2 / 4, 2 * 0.5 * 2 / 2], rtol=1e-12)
    np.testing.assert_allclose(puct_scores([0.0], [1.0], [0], 1.0), [1.0])   # sqrt(max(0, 1))
    with pytest.raises(ValueError):
        TreeSelector(None, mode="mcts")
    with pytest.raises(ValueError):
        TreeSelector(None, mode="aflow", prior_weight=1.5)
    with pytest.raises(ValueError):
        TreeSelector(None, mode="greedy")
    with pytest.raises(ValueError):
        TreeSelector(None, mode="aflow", c_puct=-1)


def test_empty_tree_has_nothing_to_select(tmp_path):
    with pytest.raises(ValueError):
        TreeSelector(_pool(tmp_path)).descend(SearchTree())
    with pytest.raises(ValueError):
        TreeSelector(None, mode="aflow").distribution(SearchTree())


def test_tree_from_pool(tmp_path):
    pool = SharedExperiencePool(str(tmp_path / "exp.db"))
    pool.add(Experience(parent_hash="", child_hash="R", accepted=True, child_score=0.3, child_workflow="r: 1"))
    pool.add(Experience(parent_hash="R", child_hash="", accepted=False, improvement=-0.1, reason="cycle"))
    pool.add(Experience(parent_hash="R", child_hash="A", accepted=True, child_score=0.6, improvement=0.3))
    tree = SearchTree.from_pool(pool)
    assert [(n.hash, n.round) for n in tree] == [("R", 1), ("A", 2)]
    assert tree.root.workflow == "r: 1" and tree.nodes["R"].children == ["A"]
    # The root's two expansions back up into it: N = 2, W = -0.1 + 0.3.
    stats = TreeSelector(pool).stats(tree)
    assert stats["R"].visits == 2 and stats["R"].value_sum == pytest.approx(0.2)
