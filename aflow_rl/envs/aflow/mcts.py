"""RL-guided search over workflows: a tree keyed by workflow hash, and its parent selection.

The tree's nodes are executed workflows (keyed by ``workflow_hash``); a
node's children are the accepted proposals made from it. Choosing which node
to expand next is where the learned signal enters. AFlow's own rule
(``selection.selection_probabilities``) only looks at node scores; the
experience pool also knows what *expanding* each node has yielded so far.
With candidates C = the top-k rounds (round 1 always included, as AFlow):

    P_i   = λ/|C| + (1−λ)·softmax_i(α·100·(s_i − s_max))       AFlow's soft-mixed prior
    Q̃_i   = (N_i·Q̄_i + n0·V_i) / (N_i + n0)                    Q̄_i, N_i: mean improvement and count of
                                                                 i's recorded proposals (rejected ones
                                                                 count with their penalty); V_i: the
                                                                 value hook's estimate, 0 without one
    π^Q_i = softmax_i(α·100·(Q̃_i − max_j Q̃_j))                 Q-driven selection, same scale as P
    π_i   = w·P_i + (1−w)·π^Q_i                                  selection: mcts, w = prior_weight
    π_i   = P_i                                                  selection: aflow (the ablation)

Q̃ shrinks a node's empirical mean toward its value estimate with n0
pseudo-visits (``q_prior_count``), so a node expanded once does not dominate
on a lucky draw, and an unexpanded node starts at V_i (0: "no expected
gain"; a node whose expansions mostly fail drops below it, which is the
exploration pressure). When N_i + n0 = 0, Q̃_i = V_i. The parent is then
drawn from π, as AFlow draws from P. w = 1 gives AFlow's prior exactly,
w = 0 selection by Q alone.

The optional value hook (``value_fn``) maps the candidate nodes to the
expected improvement of expanding each (score units, like Q̄), e.g. from the
policy's value head or a reward model.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Literal, Sequence

import numpy as np

from aflow_rl.envs.aflow.experience import QStats, SharedExperiencePool
from aflow_rl.envs.aflow.selection import ALPHA, LAMBDA, SCALE, selection_probabilities, softmax, top_k_rounds

SelectionMode = Literal["aflow", "mcts"]


@dataclass
class TreeNode:
    """One executed workflow of the search."""

    hash: str
    round: int
    score: float
    parent_hash: str = ""             # "" for the root (the initial workflow)
    workflow: str = ""                # its YAML
    children: list[str] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)


ValueFn = Callable[[Sequence[TreeNode]], Sequence[float]]


class SearchTree:
    """Workflows keyed by hash, in the order they were added (the first one is the root)."""

    def __init__(self) -> None:
        self.nodes: dict[str, TreeNode] = {}

    def __len__(self) -> int:
        return len(self.nodes)

    def __iter__(self) -> Iterator[TreeNode]:
        return iter(self.nodes.values())

    def __contains__(self, wf_hash: str) -> bool:
        return wf_hash in self.nodes

    def get(self, wf_hash: str) -> TreeNode | None:
        return self.nodes.get(wf_hash)

    @property
    def root(self) -> TreeNode | None:
        return next(iter(self.nodes.values()), None)

    def add(self, node: TreeNode) -> TreeNode:
        """Insert a node (a hash already present keeps its first node) and link it to its parent."""
        if node.hash in self.nodes:
            return self.nodes[node.hash]
        self.nodes[node.hash] = node
        parent = self.nodes.get(node.parent_hash)
        if parent is not None and node.hash not in parent.children:
            parent.children.append(node.hash)
        return node

    def by_round(self, rnd: int) -> TreeNode | None:
        return next((n for n in self.nodes.values() if n.round == rnd), None)

    def path(self, wf_hash: str) -> list[TreeNode]:
        """Root-to-node ancestry of ``wf_hash`` (stops at a parent outside the tree)."""
        out, seen, node = [], set(), self.nodes.get(wf_hash)
        while node is not None and node.hash not in seen:
            seen.add(node.hash)
            out.append(node)
            node = self.nodes.get(node.parent_hash)
        return out[::-1]

    def rounds(self) -> list[dict]:
        """``{"round", "score", "hash"}`` per node: the input of ``top_k_rounds``."""
        return [{"round": n.round, "score": n.score, "hash": n.hash} for n in self.nodes.values()]

    @classmethod
    def from_pool(cls, pool: SharedExperiencePool) -> "SearchTree":
        """The tree the pool's executed records describe; rounds number nodes by first appearance.

        The initial workflow's evaluation (a root record, no parent) comes
        first in a pool the search or the trainer started, so it is round 1.
        """
        tree = cls()
        for i, n in enumerate(pool.nodes(), start=1):
            tree.add(TreeNode(hash=n["hash"], round=i, score=n["score"], parent_hash=n["parent_hash"],
                              workflow=n["workflow"], info={"evaluations": n["evaluations"]}))
        return tree


def shrunk_q(stats: QStats, value: float = 0.0, prior_count: float = 1.0) -> float:
    """``Q̃ = (N·Q̄ + n0·V) / (N + n0)``; V when N + n0 = 0."""
    denom = stats.visits + prior_count
    if denom <= 0:
        return float(value)
    return (stats.visits * stats.mean_improvement + prior_count * value) / denom


def mixed_probabilities(scores: Sequence[float], q: Sequence[float], *, prior_weight: float,
                        alpha: float = ALPHA, lam: float = LAMBDA) -> np.ndarray:
    """``π = w·P(scores) + (1−w)·softmax(α·100·(q − max q))``; see the module docstring."""
    if not 0.0 <= prior_weight <= 1.0:
        raise ValueError(f"prior_weight must be in [0, 1], got {prior_weight}")
    prior = selection_probabilities(scores, alpha=alpha, lam=lam)
    q_arr = np.asarray(q, dtype=np.float64).reshape(-1)
    if q_arr.shape != prior.shape:
        raise ValueError(f"mixed_probabilities: {len(q_arr)} Q-values for {len(prior)} scores")
    return prior_weight * prior + (1.0 - prior_weight) * softmax(alpha * SCALE * q_arr)


@dataclass
class Selection:
    """A selection's candidates (best first), their probabilities, and the parts they came from."""

    candidates: list[TreeNode]
    probs: np.ndarray
    prior: np.ndarray
    q: np.ndarray                     # Q̃ per candidate (zeros in aflow mode)
    visits: list[int]


class TreeSelector:
    """Parent selection over a ``SearchTree``: AFlow's rule, or AFlow's prior mixed with Q-values."""

    def __init__(self, pool: SharedExperiencePool | None = None, *, mode: SelectionMode = "mcts",
                 prior_weight: float = 0.5, top_k: int = 3, q_prior_count: float = 1.0,
                 value_fn: ValueFn | None = None, alpha: float = ALPHA, lam: float = LAMBDA):
        if mode not in ("aflow", "mcts"):
            raise ValueError(f"selection mode must be aflow or mcts, got {mode!r}")
        if mode == "mcts" and pool is None:
            raise ValueError("mcts selection needs the experience pool for its Q-values")
        if not 0.0 <= prior_weight <= 1.0:
            raise ValueError(f"prior_weight must be in [0, 1], got {prior_weight}")
        self.pool, self.mode, self.prior_weight, self.top_k = pool, mode, float(prior_weight), int(top_k)
        self.q_prior_count, self.value_fn, self.alpha, self.lam = float(q_prior_count), value_fn, alpha, lam

    def distribution(self, tree: SearchTree) -> Selection:
        """Candidates (top-k rounds, sorted best first) and the probability of drawing each."""
        top = top_k_rounds(tree.rounds(), self.top_k)
        if not top:
            raise ValueError("no executed workflow to select a parent from")
        top.sort(key=lambda r: (-r["score"], r["round"]))
        cands = [tree.nodes[r["hash"]] for r in top]
        scores = [c.score for c in cands]
        prior = selection_probabilities(scores, alpha=self.alpha, lam=self.lam)
        if self.mode == "aflow":
            return Selection(cands, prior, prior, np.zeros(len(cands)), [0] * len(cands))
        stats = [self.pool.parent_stats(c.hash) for c in cands]
        values = list(self.value_fn(cands)) if self.value_fn is not None else [0.0] * len(cands)
        if len(values) != len(cands):
            raise ValueError(f"value_fn returned {len(values)} values for {len(cands)} candidates")
        q = np.asarray([shrunk_q(s, float(v), self.q_prior_count) for s, v in zip(stats, values)])
        probs = mixed_probabilities(scores, q, prior_weight=self.prior_weight, alpha=self.alpha, lam=self.lam)
        return Selection(cands, probs, prior, q, [s.visits for s in stats])

    def select(self, tree: SearchTree, rng: np.random.Generator) -> TreeNode:
        """Draw the node to expand next."""
        sel = self.distribution(tree)
        return sel.candidates[int(rng.choice(len(sel.candidates), p=sel.probs))]
