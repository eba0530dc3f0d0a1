"""RL-guided search over workflows: a tree keyed by workflow hash, MCTS selection with PUCT and backup.

The tree's nodes are executed workflows (keyed by ``workflow_hash``); the
root is the round-1 workflow and a node's children are the accepted
proposals made from it. Choosing which node to expand next is where the
learned signal enters: AFlow's rule (``selection.selection_probabilities``)
only looks at scores, the experience pool also knows what expanding each
part of the tree has yielded.

**Statistics (backup).** Every non-root record of the pool is one expansion
of its parent u with outcome x = improvement (child − parent score, or the
format penalty when the proposal was rejected). An expansion of u counts as a
visit of u and of every ancestor of u, so for a node v:

    n_v, w_v = number and sum of outcomes of the records whose parent is v     (v's own expansions)
    N(v)     = Σ_{u in subtree(v)} n_u,    W(v) = Σ_{u in subtree(v)} w_u      (visits through v)
    Q(v)     = W(v) / N(v)

They are recomputed from the pool's records on every selection (one
``GROUP BY parent`` query), not kept in memory: the pool is the source of
truth, so many processes appending at once, a kill and a restart all see
the same tree statistics.

**Selection (descent).** Start at the root. At a node v the options are
"expand v" (o = v*) and each child c; with S = [s_v, s_c1, ...] their scores
(v's own score for v*):

    P(o)   = λ/|O| + (1−λ)·softmax_o(α·100·(S_o − max S))          AFlow's soft-mixed formula over S
    π(o)   = w·P(o) + (1−w)/|O|                                     prior, w = prior_weight
    N(v*)  = n_v, Q̄(v*) = w_v/n_v;   N(c), Q̄(c) = N(c), Q(c)         option visits and mean outcome
    Q̃(o)   = N(o)·Q̄(o) / (N(o) + n0)                                 shrunk toward 0 ("no expected gain");
                                                                       Q̃ = 0 when N(o) + n0 = 0
    U(o)   = Q̃(o) + c·π(o)·sqrt(max(N(v), 1)) / (1 + N(o))          PUCT, c = c_puct,
                                                                       N(v) = Σ_o N(o) = n_v + Σ_c N(c)

and take argmax_o U(o) (exact ties broken by the round's generator). Choosing
v* ends the descent: v is the node to expand. A leaf has only v*. The
``max(N(v), 1)`` lets a never-visited node's first choice follow its prior
instead of a tie of zeros. n0 (``q_prior_count``) pseudo-visits keep one
lucky expansion from dominating and start an unvisited option at 0, "no
expected gain"; an option whose expansions mostly fail drops below 0, which
is the pressure to look elsewhere. There is no learned value term: the
optimizer policy is trained critic-free (GRPO/GiGPO), so it has no value
estimate to offer, and the Monte-Carlo estimate of a node's worth, the mean
improvement of its recorded expansions, is Q̄ itself.

w = 0 removes the scores from selection altogether (a uniform prior: the
choice is driven by Q̃ and visit counts alone); w = 1 uses AFlow's prior for
exploration. ``selection: aflow`` switches the tree off for ablations and
draws the parent from AFlow's formula over the top-k rounds exactly
(``TreeSelector.distribution``, docs/architecture.md).

Several selections made before any of them is expanded (the trainer draws a
batch of parents at once) would all descend the same way; ``select_many``
counts each pending one as a virtual visit of outcome 0 along its path
(virtual loss, as in parallel MCTS), which lowers the next descent's
exploration bonus for that path.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterator, Literal, Mapping, Sequence

import numpy as np

from aflow_rl.envs.aflow.experience import QStats, SharedExperiencePool
from aflow_rl.envs.aflow.selection import ALPHA, LAMBDA, selection_probabilities, top_k_rounds

SelectionMode = Literal["aflow", "mcts"]
C_PUCT = 0.5   # env.aflow.c_puct: the exploration term's weight (Q is in score units, improvements ~0.1)


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


@dataclass
class NodeStats:
    """Backed-up statistics of one node: its own expansions (n, w) and its subtree's (N, W)."""

    own_visits: int = 0          # n_v
    own_sum: float = 0.0         # w_v
    visits: int = 0              # N(v)
    value_sum: float = 0.0       # W(v)

    @property
    def mean_improvement(self) -> float:
        """Q(v) = W(v)/N(v) (0 when unvisited)."""
        return self.value_sum / self.visits if self.visits else 0.0

    @property
    def own(self) -> QStats:
        """The "expand v" option's statistics: n_v and w_v/n_v."""
        mean = self.own_sum / self.own_visits if self.own_visits else 0.0
        return QStats(visits=self.own_visits, mean_improvement=mean)


def backup(tree: SearchTree, own: Mapping[str, QStats], pending: Mapping[str, int] | None = None,
           virtual_value: float = 0.0) -> dict[str, NodeStats]:
    """N and W of every node of ``tree`` from its nodes' own expansion statistics (see the module docstring).

    ``own``: parent hash -> ``QStats`` of the records made from it (``pool.q_values()``);
    parents outside the tree are ignored. ``pending``: node hash -> expansions
    selected but not yet recorded, each counted as one visit of outcome
    ``virtual_value``.
    """
    stats = {node.hash: NodeStats() for node in tree}
    for node in tree:
        q = own.get(node.hash, QStats())
        extra = int((pending or {}).get(node.hash, 0))
        n, w = q.visits + extra, q.visits * q.mean_improvement + extra * virtual_value
        stats[node.hash].own_visits, stats[node.hash].own_sum = n, w
        if n:
            # Backup: each expansion of ``node`` is a visit of every node on its root path.
            for anc in tree.path(node.hash):
                stats[anc.hash].visits += n
                stats[anc.hash].value_sum += w
    return stats


def shrunk_q(stats: Any, prior_count: float = 1.0) -> float:
    """``Q̃ = N·Q̄ / (N + n0)``; 0 when N + n0 = 0.

    ``stats``: anything with ``visits`` and ``mean_improvement`` (``QStats``, ``NodeStats``)."""
    denom = stats.visits + prior_count
    if denom <= 0:
        return 0.0
    return stats.visits * stats.mean_improvement / denom


def prior_probabilities(scores: Sequence[float], *, prior_weight: float, alpha: float = ALPHA,
                        lam: float = LAMBDA) -> np.ndarray:
    """``π = w·P(scores) + (1−w)/n``: AFlow's soft-mixed formula, mixed with the uniform prior by ``w``."""
    if not 0.0 <= prior_weight <= 1.0:
        raise ValueError(f"prior_weight must be in [0, 1], got {prior_weight}")
    p = selection_probabilities(scores, alpha=alpha, lam=lam)
    return prior_weight * p + (1.0 - prior_weight) / len(p)


def puct_scores(q: Sequence[float], prior: Sequence[float], visits: Sequence[int], c_puct: float) -> np.ndarray:
    """``U(o) = Q̃(o) + c·π(o)·sqrt(max(Σ N, 1))/(1 + N(o))`` for the options of one node."""
    q_arr, p_arr = np.asarray(q, dtype=np.float64), np.asarray(prior, dtype=np.float64)
    n = np.asarray(visits, dtype=np.float64)
    return q_arr + c_puct * p_arr * math.sqrt(max(float(n.sum()), 1.0)) / (1.0 + n)


@dataclass
class Selection:
    """AFlow's selection distribution: candidates (top-k rounds, best first) and their probabilities."""

    candidates: list[TreeNode]
    probs: np.ndarray


@dataclass
class Level:
    """One step of a descent: the options at ``node`` (``options[0]`` is "expand node") and the choice."""

    node: TreeNode
    options: list[TreeNode]
    prior: np.ndarray
    q: np.ndarray          # Q̃ per option
    visits: list[int]      # N per option
    scores: np.ndarray     # U per option
    chosen: int

    @property
    def expand(self) -> bool:
        return self.chosen == 0


@dataclass
class Descent:
    """A root-to-leaf descent; ``leaf`` is the node to expand."""

    levels: list[Level] = field(default_factory=list)

    @property
    def path(self) -> list[TreeNode]:
        return [lv.node for lv in self.levels]

    @property
    def leaf(self) -> TreeNode:
        return self.levels[-1].node


class TreeSelector:
    """Parent selection over a ``SearchTree``: MCTS descent (``mcts``) or AFlow's rule (``aflow``).

    ``prior_weight`` (w), ``q_prior_count`` (n0), ``c_puct`` (c) and
    are the terms of the module docstring's formulas;
    ``top_k`` is AFlow's candidate count (``aflow`` mode only: the tree
    search reaches every node).
    """

    def __init__(self, pool: SharedExperiencePool | None = None, *, mode: SelectionMode = "mcts",
                 prior_weight: float = 0.5, top_k: int = 3, q_prior_count: float = 1.0,
                 alpha: float = ALPHA, lam: float = LAMBDA,
                 c_puct: float = C_PUCT):
        if mode not in ("aflow", "mcts"):
            raise ValueError(f"selection mode must be aflow or mcts, got {mode!r}")
        if mode == "mcts" and pool is None:
            raise ValueError("mcts selection needs the experience pool for its Q-values")
        if not 0.0 <= prior_weight <= 1.0:
            raise ValueError(f"prior_weight must be in [0, 1], got {prior_weight}")
        if c_puct < 0:
            raise ValueError(f"c_puct must be >= 0, got {c_puct}")
        self.pool, self.mode, self.prior_weight, self.top_k = pool, mode, float(prior_weight), int(top_k)
        self.q_prior_count, self.alpha, self.lam = float(q_prior_count), alpha, lam
        self.c_puct = float(c_puct)

    # -- AFlow's rule (selection: aflow) ----------------------------------------------------------

    def distribution(self, tree: SearchTree) -> Selection:
        """AFlow's distribution: the top-k rounds (sorted best first) and ``selection_probabilities``."""
        top = top_k_rounds(tree.rounds(), self.top_k)
        if not top:
            raise ValueError("no executed workflow to select a parent from")
        top.sort(key=lambda r: (-r["score"], r["round"]))
        cands = [tree.nodes[r["hash"]] for r in top]
        probs = selection_probabilities([c.score for c in cands], alpha=self.alpha, lam=self.lam)
        return Selection(cands, probs)

    # -- the tree search (selection: mcts) ----------------------------------------------------------

    def stats(self, tree: SearchTree, pending: Mapping[str, int] | None = None) -> dict[str, NodeStats]:
        """Backed-up N, W of every node, from the pool's records (plus ``pending`` virtual visits)."""
        return backup(tree, self.pool.q_values(), pending)

    def level(self, tree: SearchTree, node: TreeNode, stats: Mapping[str, NodeStats],
              rng: np.random.Generator | None = None) -> Level:
        """The options at ``node``, their prior, Q̃, visits and PUCT scores, and the choice."""
        options = [node] + [tree.nodes[h] for h in node.children if h in tree.nodes]
        option_stats = [stats[node.hash].own] + [stats[c.hash] for c in options[1:]]
        prior = prior_probabilities([o.score for o in options], prior_weight=self.prior_weight,
                                    alpha=self.alpha, lam=self.lam)
        q = np.asarray([shrunk_q(st, self.q_prior_count) for st in option_stats])
        visits = [int(st.visits) for st in option_stats]
        scores = puct_scores(q, prior, visits, self.c_puct)
        best = np.flatnonzero(scores >= scores.max() - 1e-12)
        chosen = int(best[0]) if rng is None or len(best) == 1 else int(rng.choice(best))
        return Level(node, options, prior, q, visits, scores, chosen)

    def descend(self, tree: SearchTree, rng: np.random.Generator | None = None,
                pending: Mapping[str, int] | None = None) -> Descent:
        """Root-to-leaf descent by PUCT; the leaf is the node to expand."""
        root = tree.root
        if root is None:
            raise ValueError("no executed workflow to select a parent from")
        stats = self.stats(tree, pending)
        out, node, seen = Descent(), root, set()
        while node.hash not in seen:  # the tree is acyclic; the guard keeps a corrupt one finite
            seen.add(node.hash)
            lv = self.level(tree, node, stats, rng)
            out.levels.append(lv)
            if lv.expand:
                break
            node = lv.options[lv.chosen]
        return out

    def select(self, tree: SearchTree, rng: np.random.Generator) -> TreeNode:
        """The node to expand next: the descent's leaf (mcts) or a draw from AFlow's distribution (aflow)."""
        if self.mode == "aflow":
            sel = self.distribution(tree)
            return sel.candidates[int(rng.choice(len(sel.candidates), p=sel.probs))]
        return self.descend(tree, rng).leaf

    def select_many(self, tree: SearchTree, n: int, rng: np.random.Generator) -> list[TreeNode]:
        """``n`` nodes to expand before any result comes back; mcts counts each earlier pick as a virtual visit."""
        if self.mode == "aflow":
            return [self.select(tree, rng) for _ in range(n)]
        pending: dict[str, int] = {}
        out = []
        for _ in range(n):
            leaf = self.descend(tree, rng, pending).leaf
            pending[leaf.hash] = pending.get(leaf.hash, 0) + 1
            out.append(leaf)
        return out
