"""MCTS parent selection: prior weight 0 is Q-driven, 1 and `aflow` mode are AFlow's formula."""
import numpy as np
import pytest

from aflow_rl.envs.aflow.experience import Experience, QStats, SharedExperiencePool
from aflow_rl.envs.aflow.mcts import SearchTree, TreeNode, TreeSelector, mixed_probabilities, shrunk_q
from aflow_rl.envs.aflow.selection import selection_probabilities, softmax


def _tree() -> SearchTree:
    tree = SearchTree()
    tree.add(TreeNode("R", 1, 0.3))
    tree.add(TreeNode("A", 2, 0.9, parent_hash="R"))
    tree.add(TreeNode("B", 3, 0.5, parent_hash="R"))
    tree.add(TreeNode("C", 4, 0.1, parent_hash="A"))
    return tree


def _pool(tmp_path) -> SharedExperiencePool:
    """Expanding A has gone badly (−0.2 on average), B well (+0.1), R never."""
    pool = SharedExperiencePool(str(tmp_path / "exp.db"))
    for imp in (-0.3, -0.1):
        pool.add(Experience(parent_hash="A", child_hash="x", accepted=True, child_score=0.9 + imp, improvement=imp))
    pool.add(Experience(parent_hash="B", child_hash="y", accepted=True, child_score=0.6, improvement=0.1))
    return pool


def test_tree_links_children_and_paths():
    tree = _tree()
    assert tree.root.hash == "R" and tree.nodes["R"].children == ["A", "B"]
    assert [n.hash for n in tree.path("C")] == ["R", "A", "C"]
    assert tree.by_round(3).hash == "B" and "C" in tree and len(tree) == 4
    assert tree.add(TreeNode("A", 9, 0.0)).round == 2   # a known hash keeps its node


def test_aflow_mode_equals_the_formula(tmp_path):
    sel = TreeSelector(_pool(tmp_path), mode="aflow", prior_weight=0.0, top_k=3).distribution(_tree())
    # Top-3 with round 1: R (round 1), A (0.9), B (0.5); sorted best first: A, B, R.
    assert [c.hash for c in sel.candidates] == ["A", "B", "R"]
    np.testing.assert_allclose(sel.probs, selection_probabilities([0.9, 0.5, 0.3]), rtol=1e-12)
    # No pool needed at all in aflow mode.
    np.testing.assert_allclose(TreeSelector(None, mode="aflow").distribution(_tree()).probs, sel.probs)


def test_prior_weight_one_equals_the_formula(tmp_path):
    sel = TreeSelector(_pool(tmp_path), mode="mcts", prior_weight=1.0).distribution(_tree())
    np.testing.assert_allclose(sel.probs, selection_probabilities([0.9, 0.5, 0.3]), rtol=1e-12)


def test_prior_weight_zero_is_q_driven(tmp_path):
    pool = _pool(tmp_path)
    sel = TreeSelector(pool, mode="mcts", prior_weight=0.0, q_prior_count=1.0).distribution(_tree())
    # Q̃ = (N·Q̄ + n0·0)/(N + n0): A = 2·(−0.2)/3, B = 0.1/2, R = 0 (never expanded).
    np.testing.assert_allclose(sel.q, [-0.4 / 3, 0.05, 0.0], atol=1e-12)
    np.testing.assert_allclose(sel.probs, softmax(0.2 * 100 * sel.q), rtol=1e-12)
    assert sel.visits == [2, 1, 0]
    # The best-scoring node A is the least likely: its expansions lose; scores play no part.
    assert np.argmax(sel.probs) == 1 and np.argmin(sel.probs) == 0
    rescored = _tree()
    for node in rescored:
        node.score = {"R": 0.35, "A": 0.95, "B": 0.4}.get(node.hash, node.score)
    np.testing.assert_allclose(TreeSelector(pool, prior_weight=0.0).distribution(rescored).probs, sel.probs)


def test_mixture_is_linear_in_prior_weight(tmp_path):
    pool, tree = _pool(tmp_path), _tree()
    p0 = TreeSelector(pool, prior_weight=0.0).distribution(tree).probs
    p1 = TreeSelector(pool, prior_weight=1.0).distribution(tree).probs
    p = TreeSelector(pool, prior_weight=0.3).distribution(tree).probs
    np.testing.assert_allclose(p, 0.3 * p1 + 0.7 * p0, rtol=1e-12)
    assert p.sum() == pytest.approx(1.0)


def test_value_hook_fills_unvisited_nodes(tmp_path):
    pool, tree = _pool(tmp_path), _tree()
    seen = []

    def value_fn(nodes):
        seen.append([n.hash for n in nodes])
        return [0.0, 0.0, 0.3]   # the policy expects expanding R to gain 0.3

    sel = TreeSelector(pool, prior_weight=0.0, value_fn=value_fn).distribution(tree)
    assert seen == [["A", "B", "R"]]
    assert sel.q[2] == pytest.approx(0.3) and np.argmax(sel.probs) == 2


def test_shrinkage_and_mixture_formulas():
    assert shrunk_q(QStats(visits=3, mean_improvement=0.2), 0.5, 1.0) == pytest.approx((0.6 + 0.5) / 4)
    assert shrunk_q(QStats(), 0.4, 0.0) == 0.4              # N + n0 = 0: the value estimate
    assert shrunk_q(QStats(visits=2, mean_improvement=0.1), 0.9, 0.0) == pytest.approx(0.1)
    q = [0.0, 0.05]
    expected = 0.5 * selection_probabilities([0.2, 0.6]) + 0.5 * softmax(20 * np.asarray(q))
    np.testing.assert_allclose(mixed_probabilities([0.2, 0.6], q, prior_weight=0.5), expected)
    with pytest.raises(ValueError):
        mixed_probabilities([0.2], [0.1, 0.2], prior_weight=0.5)
    with pytest.raises(ValueError):
        TreeSelector(None, mode="mcts")


def test_select_draws_from_the_distribution(tmp_path):
    pool, tree = _pool(tmp_path), _tree()
    selector = TreeSelector(pool, prior_weight=0.0)
    probs = selector.distribution(tree).probs
    rng = np.random.default_rng(1)
    draws = [selector.select(tree, rng).hash for _ in range(3000)]
    freq = np.asarray([draws.count(h) for h in ("A", "B", "R")]) / len(draws)
    np.testing.assert_allclose(freq, probs, atol=0.035)


def test_tree_from_pool(tmp_path):
    pool = SharedExperiencePool(str(tmp_path / "exp.db"))
    pool.add(Experience(parent_hash="", child_hash="R", accepted=True, child_score=0.3, child_workflow="r: 1"))
    pool.add(Experience(parent_hash="R", child_hash="", accepted=False, improvement=-0.1, reason="cycle"))
    pool.add(Experience(parent_hash="R", child_hash="A", accepted=True, child_score=0.6, improvement=0.3))
    tree = SearchTree.from_pool(pool)
    assert [(n.hash, n.round) for n in tree] == [("R", 1), ("A", 2)]
    assert tree.root.workflow == "r: 1" and tree.nodes["R"].children == ["A"]
