"""AFlow's optimisation loop, with the orchestrator as the optimizer and MCTS-guided selection.

One round (AFlow, Zhang et al. 2024, Alg. 1; MetaGPT ``Optimizer._optimize_graph``):

1. round 1 evaluates the initial workflow on the validation split;
2. select the parent: ``selection: aflow`` draws it from AFlow's soft-mixed
   prior over the top-k rounds; ``mcts`` descends the tree from round 1 by
   PUCT over that prior and the experience pool's backed-up Q-values (see
   ``mcts.py``);
3. build the ``WorkflowState`` the optimizer sees: the parent's YAML and
   score, what its earlier children changed and how they scored (from the
   shared experience pool; AFlow's "experience"), and a few of its failed
   validation problems (AFlow's ``log.json`` samples);
4. the optimizer model proposes a modified workflow as JSON under
   ``WORKFLOW_SCHEMA`` (one ``generate_turn`` on the policy endpoint);
5. the child is validated: an unparseable or invalid graph, or one equal to
   its parent or to an earlier round, is rejected with its reason, never
   executed, and recorded with ``format_penalty`` as its improvement;
   otherwise it is evaluated ``validation_runs`` times and its score is the mean;
6. the experience is recorded, the round's results appended to
   ``results.json`` (one entry per validation run, as AFlow keeps them) and
   its files written under ``workflows/round_<r>/``;
7. stop after ``max_rounds`` rounds (round 1 included) or on convergence:
   the mean of the top-3 round scores unchanged for ``convergence_rounds``
   consecutive rounds (AFlow's ``check_convergence`` with z = 0).

Everything lives in one search directory::

    results.json                 per-round entries: round, score, avg_cost, total_cost, time, parent, hash, status
    experience.db                the SharedExperiencePool (also read by training workers)
    experience.jsonl             its export, refreshed at the end of a run
    best.yaml                    the best round's workflow
    workflows/round_<r>/         graph.yaml + log.json (failures) | proposal.txt + rejected.json

A killed search resumes where it stopped: ``results.json`` (written
atomically, last in each round) says which rounds are complete, the round
files and the pool hold the rest, a redone round replaces its experience
record (key ``search/<r>``), and each round draws its parent from a generator
seeded by (seed, round), so a resumed search makes the same draws.
"""
from __future__ import annotations

import datetime
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Mapping, Protocol, Sequence

import numpy as np

from aflow_rl.envs.aflow.experience import Experience, SharedExperiencePool
from aflow_rl.envs.aflow.graph import (WORKFLOW_SCHEMA, Workflow, WorkflowError, operator_docs, parse_workflow,
                                       validate, workflow_hash)
from aflow_rl.envs.aflow.mcts import SearchTree, TreeNode, TreeSelector

SEARCH_DIRNAME = "search"
POOL_FILENAME = "experience.db"
RESULTS_FILENAME = "results.json"
_TEXT_CHARS = 400      # a failed problem's question / prediction shown to the optimizer, at most
_SHOWN_CHILDREN = 8    # earlier children of the parent shown in the state (newest)
_STORED_FAILURES = 10  # failures kept per experience record (for later states)


# AFlow's question types (its prompts say "math", "code" or "qa") per dataset kind.
QUESTION_TYPES = {"gsm8k": "math", "math": "math", "humaneval": "code", "mbpp": "code", "hotpotqa": "qa",
                  "drop": "qa", "rg": "reasoning"}


def question_type(problems: Sequence[Any]) -> str:
    """AFlow's question type of the problems (``Problem``s or their dicts); '' when unknown."""
    if not problems:
        return ""
    first = problems[0]
    kind = first.get("kind", "") if isinstance(first, Mapping) else getattr(first, "kind", "")
    return QUESTION_TYPES.get(str(kind), str(kind or ""))


def search_dir(run_dir: str) -> str:
    """Where the search (and training's shared search state) lives: ``run_dir/search``."""
    return os.path.join(run_dir, SEARCH_DIRNAME)


def pool_path(run_dir: str) -> str:
    return os.path.join(search_dir(run_dir), POOL_FILENAME)


# ---------------------------------------------------------------------------
# What the optimizer sees
# ---------------------------------------------------------------------------

SYSTEM_PROMPT = (
    "You improve agentic workflows. A workflow is a graph of operator nodes that an executor model runs on "
    "{kind}problems: each node reads the problem or earlier nodes' outputs, and the output node's text is the "
    "answer. Make ONE focused modification to the given workflow (add, remove or rewire a node, or change its "
    "parameters or instruction), for example an ensemble of several answers, a review-then-revise step, "
    "a programmatic check, or a sharper instruction. Learn from what was already tried and from the failed "
    "problems. The graph must stay valid with at most {max_nodes} nodes. Reply with the complete modified "
    "workflow as JSON: {{\"nodes\": [{{\"id\", \"op\", \"inputs\", \"params\"}}], \"output\": <node id>}}, "
    "nodes n1, n2, ... in order, each reading the problem or earlier nodes, the last one the output; "
    "a node with samples > 1 feeds only ScEnsemble or MdEnsemble, and Revise reads [solution, Review of it].")


def _clip(text: Any, n: int = _TEXT_CHARS) -> str:
    text = str(text)
    return text if len(text) <= n else text[:n] + "..."


@dataclass
class WorkflowState:
    """The optimizer's observation: the parent workflow and what is known about expanding it."""

    parent_hash: str
    parent_round: int
    parent_score: float
    parent_yaml: str
    children: list[dict] = field(default_factory=list)   # modification, accepted, child_score, improvement, reason
    failures: list[dict] = field(default_factory=list)   # question, prediction, expected, error
    kind: str = ""                                       # AFlow's question type (math | code | qa | reasoning)
    max_nodes: int = 8
    compact: bool = False                                # no operator docs, shorter excerpts (small contexts)
    operators: str = field(default_factory=operator_docs)

    def messages(self) -> list[dict]:
        """Chat messages of the proposal turn."""
        kind = f"{self.kind} " if self.kind else ""
        system = SYSTEM_PROMPT.format(kind=kind, max_nodes=self.max_nodes)
        n = _TEXT_CHARS // 4 if self.compact else _TEXT_CHARS  # excerpt length
        parts = [] if self.compact else [f"Operators:\n{self.operators}"]
        parts.append(f"Workflow (validation score {self.parent_score:.3f}, maximum 1):\n{self.parent_yaml.strip()}")
        if self.children:
            lines = []
            for c in self.children:
                if c.get("accepted"):
                    verdict = "better" if (c.get("improvement") or 0) > 0 else "not better"
                    lines.append(f"- {_clip(c['modification'], n)} -> score {c['child_score']:.3f} ({verdict})")
                else:
                    lines.append(f"- {_clip(c['modification'] or 'a proposal', n)} -> rejected: "
                                 f"{_clip(c['reason'], n // 2)}")
            parts.append("Already tried from this workflow (do not repeat):\n" + "\n".join(lines))
        if self.failures:
            lines = []
            for f in self.failures:
                line = f"- Q: {_clip(f.get('question', ''), n)}\n  got: {_clip(f.get('prediction', ''), n // 2)}"
                line += f"\n  expected: {_clip(f.get('expected', ''), n // 2)}"
                if f.get("error"):
                    line += f"\n  error: {_clip(f['error'], n // 2)}"
                lines.append(line)
            parts.append("Problems this workflow got wrong:\n" + "\n".join(lines))
        parts.append("Reply with the modified workflow as JSON.")
        return [{"role": "system", "content": system}, {"role": "user", "content": "\n\n".join(parts)}]


def build_state(parent: TreeNode, pool: SharedExperiencePool, rng: np.random.Generator, *,
                failures_shown: int = 3, kind: str = "", max_nodes: int = 8, compact: bool = False) -> WorkflowState:
    """The state of ``parent``: its children's outcomes and ``failures_shown`` sampled failures, from the pool."""
    children = [{"modification": e.modification, "accepted": e.accepted, "child_score": e.child_score,
                 "improvement": e.improvement, "reason": e.reason}
                for e in pool.by_parent(parent.hash, limit=_SHOWN_CHILDREN)]
    failures: list[dict] = []
    for e in pool.by_child(parent.hash):
        if e.accepted:
            failures += e.info.get("failures", [])
    if len(failures) > failures_shown:
        # AFlow's load_log samples 3 of the round's logged errors at random.
        idx = sorted(rng.choice(len(failures), size=failures_shown, replace=False).tolist())
        failures = [failures[i] for i in idx]
    return WorkflowState(parent_hash=parent.hash, parent_round=parent.round, parent_score=parent.score,
                         parent_yaml=parent.workflow, children=children, failures=failures[:max(failures_shown, 0)],
                         kind=kind, max_nodes=max_nodes, compact=compact)


# ---------------------------------------------------------------------------
# Proposals
# ---------------------------------------------------------------------------


@dataclass
class Proposal:
    """The optimizer's reply; ``turn`` is the trainable Turn when it came from ``generate_turn``."""

    text: str
    turn: Any = None
    finish_reason: str = "stop"


class Proposer(Protocol):
    async def __call__(self, state: WorkflowState) -> Proposal: ...


class PolicyProposer:
    """Proposals from an optimizer model, constrained by the workflow JSON schema.

    With a tokenizer (SGLang native endpoint): ``generate_turn`` on token ids,
    anchor key = the parent's hash, so the Turn trains as is. Without one (an
    OpenAI-compatible or Anthropic frozen optimizer): a chat request.

    ``seed`` (token path only): the k-th proposal carries ``sampling_seed = seed * 2**20 + k``. A
    search then draws the same proposals whichever process or server runs it, and two searches with
    different seeds draw different ones. Without a seed, every process whose server starts from the
    same random seed replays the same draws: the per-seed processes of a benchmark were not
    independent samples of the optimizer (docs/benchmarks.md, H200 session 8).
    """

    def __init__(self, client: Any, tokenizer: Any = None, *, temperature: float = 1.0,
                 max_new_tokens: int = 1024, schema: dict | None = WORKFLOW_SCHEMA, seed: int | None = None):
        self.client, self.tokenizer = client, tokenizer
        self.temperature, self.max_new_tokens, self.schema = temperature, max_new_tokens, schema
        self.seed, self.calls = seed, 0

    def seeded(self, seed: int) -> "PolicyProposer":
        """The same proposer with its own sampling seeds (its count of proposals starts at 0)."""
        return PolicyProposer(self.client, self.tokenizer, temperature=self.temperature,
                              max_new_tokens=self.max_new_tokens, schema=self.schema, seed=seed)

    def _next_sampling_seed(self) -> int | None:
        if self.seed is None:
            return None
        k, self.calls = self.calls, self.calls + 1
        return int(self.seed) * 2**20 + k

    async def __call__(self, state: WorkflowState) -> Proposal:
        if self.tokenizer is not None:
            from aflow_rl.rollout.turns import generate_turn

            comp, turn = await generate_turn(self.client, self.tokenizer, state.messages(),
                                             temperature=self.temperature, max_new_tokens=self.max_new_tokens,
                                             json_schema=self.schema, anchor_key=state.parent_hash,
                                             sampling_seed=self._next_sampling_seed())
            return Proposal(text=comp.text, turn=turn, finish_reason=comp.finish_reason)
        sampling: dict[str, Any] = {"temperature": self.temperature, "max_new_tokens": self.max_new_tokens}
        if self.schema is not None:
            sampling["json_schema"] = self.schema
        comp = await self.client.chat(state.messages(), **sampling)
        return Proposal(text=comp.text, finish_reason=comp.finish_reason)


def describe_change(parent: Workflow, child: Workflow) -> str:
    """A short structural diff, the modification summary AFlow asks its optimizer to write."""
    pn, cn = {n.id: n for n in parent.nodes}, {n.id: n for n in child.nodes}
    parts = []
    for nid, n in cn.items():
        if nid not in pn:
            parts.append(f"add {nid} ({n.op} <- {', '.join(n.resolved_inputs())})")
    for nid, n in pn.items():
        if nid not in cn:
            parts.append(f"remove {nid} ({n.op})")
    for nid in pn.keys() & cn.keys():
        old, new = pn[nid], cn[nid]
        if old.op != new.op:
            parts.append(f"{nid}: {old.op} -> {new.op}")
        if old.resolved_inputs() != new.resolved_inputs():
            parts.append(f"{nid}: inputs {old.resolved_inputs()} -> {new.resolved_inputs()}")
        for key in sorted(set(old.params) | set(new.params)):
            a, b = old.param(key), new.param(key)
            if a != b and old.op == new.op:
                parts.append(f"{nid}.{key}: {_clip(repr(a), 40)} -> {_clip(repr(b), 40)}")
    if parent.output != child.output:
        parts.append(f"output: {parent.output} -> {child.output}")
    return "; ".join(sorted(parts, key=lambda p: (p.split(" ")[0] not in ("add", "remove"), p))) or "no change"


# ---------------------------------------------------------------------------
# Judging a proposal: validate, then evaluate
# ---------------------------------------------------------------------------

EvaluateFn = Callable[[Workflow], Awaitable[Any]]  # -> evaluator.EvalResult (score, cost, failures)


@dataclass
class Outcome:
    """What became of one proposal."""

    accepted: bool
    reason: str = ""
    child: Workflow | None = None
    child_hash: str = ""
    modification: str = ""
    child_score: float | None = None
    run_scores: list[float] = field(default_factory=list)
    improvement: float = 0.0       # child − parent, or the penalty when rejected
    cost_usd: float = 0.0
    tokens: int = 0
    failures: list[dict] = field(default_factory=list)
    seconds: float = 0.0
    error: bool = False            # the round failed (proposer or evaluator raised): nobody's proposal to judge

    @property
    def child_yaml(self) -> str:
        return self.child.to_yaml() if self.child is not None else ""


def _usd(cost: Any) -> float:
    return float(getattr(cost, "usd", cost) or 0.0)


def _tokens(cost: Any) -> int:
    return int(getattr(cost, "tokens_in", 0) + getattr(cost, "tokens_out", 0))


def _json_safe(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


async def evaluate_runs(workflow: Workflow, evaluate: EvaluateFn, runs: int) -> Outcome:
    """Evaluate ``runs`` times (AFlow's validation_n); the score is the mean of the runs."""
    t0 = time.monotonic()
    out = Outcome(accepted=True)
    for _ in range(max(1, runs)):
        res = await evaluate(workflow)
        out.run_scores.append(float(res.score))
        out.cost_usd += _usd(res.cost)
        out.tokens += _tokens(res.cost)
        out.failures += [_json_safe(f) for f in (getattr(res, "failures", None) or [])]
    out.child_score = float(np.mean(out.run_scores))
    out.seconds = time.monotonic() - t0
    return out


def judge(text: str, parent: TreeNode, *, max_nodes: int, max_samples: int, max_loop_rounds: int,
          penalty: float, known: Mapping[str, int] | None = None) -> Outcome:
    """A proposal's verdict before anything runs: parsed, validated and compared with its parent.

    Rejected (``accepted`` false, improvement = ``penalty``): unparseable or
    invalid graphs, a child equal to its parent, and with ``known`` (hash ->
    round) a workflow an earlier round already evaluated. Otherwise
    ``accepted`` with ``child``, its hash and the modification, not yet scored.
    """
    t0 = time.monotonic()
    try:
        child = parse_workflow(text)
        validate(child, max_nodes=max_nodes, max_samples=max_samples, max_loop_rounds=max_loop_rounds)
    except WorkflowError as exc:
        return Outcome(accepted=False, reason=str(exc), improvement=penalty, seconds=time.monotonic() - t0)
    child_hash = workflow_hash(child)
    try:
        modification = describe_change(Workflow.from_yaml(parent.workflow), child)
    except WorkflowError:
        modification = "new workflow"
    out = Outcome(accepted=True, child=child, child_hash=child_hash, modification=modification)
    if child_hash == parent.hash:
        out.reason = "unchanged: the proposal equals its parent"
    elif known and child_hash in known:
        out.reason = f"duplicate: the same workflow as round {known[child_hash]}"
    if out.reason:
        out.accepted, out.improvement = False, penalty
    out.seconds = time.monotonic() - t0
    return out


async def assess(text: str, parent: TreeNode, *, evaluate: EvaluateFn, runs: int, max_nodes: int,
                 max_samples: int, max_loop_rounds: int, penalty: float,
                 known: Mapping[str, int] | None = None) -> Outcome:
    """``judge`` the proposal; evaluate it (``runs`` times) only if it is accepted: valid and new."""
    t0 = time.monotonic()
    verdict = judge(text, parent, max_nodes=max_nodes, max_samples=max_samples, max_loop_rounds=max_loop_rounds,
                    penalty=penalty, known=known)
    if not verdict.accepted:
        return verdict
    child, child_hash, modification = verdict.child, verdict.child_hash, verdict.modification
    out = await evaluate_runs(child, evaluate, runs)
    out.child, out.child_hash, out.modification = child, child_hash, modification
    out.improvement = out.child_score - parent.score
    out.seconds = time.monotonic() - t0
    return out


def to_experience(outcome: Outcome, parent: TreeNode | None, *, round: int, source: str, key: str | None,
                  info: dict | None = None) -> Experience:
    """The experience record of an outcome (``parent`` None: a root evaluation)."""
    return Experience(
        parent_hash=parent.hash if parent else "", child_hash=outcome.child_hash, accepted=outcome.accepted,
        parent_score=parent.score if parent else None, child_score=outcome.child_score,
        improvement=outcome.improvement if parent else None, modification=outcome.modification,
        child_workflow=outcome.child_yaml, cost=outcome.cost_usd, run_scores=outcome.run_scores,
        reason=outcome.reason, round=round, source=source, key=key,
        info={"failures": outcome.failures[:_STORED_FAILURES], "seconds": outcome.seconds,
              "tokens": outcome.tokens, "parent_round": parent.round if parent else 0, **(info or {})})


# ---------------------------------------------------------------------------
# Results and convergence
# ---------------------------------------------------------------------------


def load_results(path: str) -> list[dict]:
    """The entries of ``results.json`` ([] when it does not exist yet)."""
    if not os.path.exists(path):
        return []
    with open(path) as fh:
        return json.load(fh)


def _write_json(path: str, data: Any) -> None:
    """Write JSON atomically: a kill leaves the old file or the new one, never half of one."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as fh:
        json.dump(data, fh, indent=2, default=str)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def check_convergence(results: Sequence[Mapping[str, Any]], *, top_k: int = 3,
                      patience: int = 5) -> tuple[bool, int | None]:
    """AFlow's stopping rule with z = 0: Y_r, the mean of the best ``top_k`` round scores up to
    round r, unchanged for ``patience`` consecutive rounds.

    Rounds without a score (rejected) count as rounds in which nothing
    changed; Y is defined once ``top_k`` rounds have scores. Returns
    (converged, the last round at which Y changed).
    """
    per_round: dict[int, list[float]] = {}
    for e in results:
        per_round.setdefault(int(e["round"]), [])
        if e.get("score") is not None:
            per_round[int(e["round"])].append(float(e["score"]))
    means: list[float] = []
    prev_y, streak, changed_at = None, 0, None
    for rnd in sorted(per_round):
        if per_round[rnd]:
            means.append(float(np.mean(per_round[rnd])))
        y = float(np.mean(sorted(means, reverse=True)[:top_k])) if len(means) >= top_k else None
        if y is not None and prev_y is not None and y == prev_y:
            streak += 1
            if streak >= patience:
                return True, changed_at
        else:
            streak, changed_at = 0, rnd
        prev_y = y
    return False, changed_at


# ---------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------


class Optimizer:
    """AFlow's loop over a search directory; see the module docstring.

    ``cfg`` is ``env.aflow`` (an ``AflowConfig``); ``proposer(state)`` returns
    a ``Proposal``; ``evaluate(workflow)`` evaluates on the validation
    problems and returns an ``EvalResult``. ``num_problems`` (the size of
    the validation split) turns a run's cost into AFlow's ``avg_cost``.
    """

    def __init__(self, cfg: Any, directory: str, *, proposer: Proposer, evaluate: EvaluateFn,
                 initial: Workflow, seed: int = 0, kind: str = "", num_problems: int = 0,
                 pool: SharedExperiencePool | None = None,
                 log: Callable[[str], None] | None = None):
        self.cfg, self.dir = cfg, directory
        self.proposer, self.evaluate, self.initial = proposer, evaluate, initial
        self.seed, self.kind, self.num_problems = int(seed), kind, int(num_problems)
        os.makedirs(os.path.join(directory, "workflows"), exist_ok=True)
        self.pool = pool or SharedExperiencePool(os.path.join(directory, POOL_FILENAME))
        self.selector = TreeSelector(self.pool, mode=cfg.selection, prior_weight=cfg.prior_weight,
                                     top_k=cfg.top_k, q_prior_count=cfg.q_prior_count, c_puct=cfg.c_puct)
        self.log = log or (lambda msg: print(msg, flush=True))
        self.results_path = os.path.join(directory, RESULTS_FILENAME)
        self.results = load_results(self.results_path)

    # -- files ----------------------------------------------------------------------------------

    def round_dir(self, rnd: int) -> str:
        return os.path.join(self.dir, "workflows", f"round_{rnd}")

    def _append(self, entries: list[dict]) -> None:
        self.results = self.results + entries
        _write_json(self.results_path, self.results)

    @property
    def completed_rounds(self) -> int:
        return max((int(e["round"]) for e in self.results), default=0)

    def tree(self) -> SearchTree:
        """The executed rounds as a tree (from ``results.json`` and the round files)."""
        tree = SearchTree()
        accepted: dict[int, list[dict]] = {}
        for e in self.results:
            if e.get("status") == "accepted":
                accepted.setdefault(int(e["round"]), []).append(e)
        for rnd in sorted(accepted):
            entries = accepted[rnd]
            with open(os.path.join(self.round_dir(rnd), "graph.yaml")) as fh:
                yaml_text = fh.read()
            tree.add(TreeNode(hash=entries[0]["hash"], round=rnd,
                              score=float(np.mean([e["score"] for e in entries])),
                              parent_hash=entries[0].get("parent_hash", ""), workflow=yaml_text))
        return tree

    def _entries(self, rnd: int, outcome: Outcome, parent: TreeNode | None, started: float) -> list[dict]:
        now = datetime.datetime.now().isoformat(timespec="seconds")
        common = {"round": rnd, "time": now, "seconds": round(time.monotonic() - started, 3),
                  "parent": parent.round if parent else None, "parent_hash": parent.hash if parent else "",
                  "hash": outcome.child_hash}
        if not outcome.accepted:
            status = "error" if outcome.error else "rejected"
            return [{**common, "score": None, "avg_cost": 0.0, "total_cost": 0.0, "status": status,
                     "reason": outcome.reason}]
        runs = len(outcome.run_scores)
        n = max(1, self.num_problems)
        return [{**common, "score": s, "avg_cost": outcome.cost_usd / runs / n,
                 "total_cost": outcome.cost_usd / runs, "status": "accepted", "run": i}
                for i, s in enumerate(outcome.run_scores)]

    def _save_round(self, rnd: int, outcome: Outcome, proposal: Proposal | None) -> None:
        d = self.round_dir(rnd)
        shutil.rmtree(d, ignore_errors=True)  # a redone round (after a kill) leaves nothing stale
        os.makedirs(d)
        if outcome.accepted:
            with open(os.path.join(d, "graph.yaml"), "w") as fh:
                fh.write(outcome.child_yaml)
            _write_json(os.path.join(d, "log.json"), outcome.failures)
        else:
            with open(os.path.join(d, "proposal.txt"), "w") as fh:
                fh.write(proposal.text if proposal is not None else "")
            _write_json(os.path.join(d, "error.json" if outcome.error else "rejected.json"),
                        {"reason": outcome.reason, "modification": outcome.modification})

    # -- rounds ---------------------------------------------------------------------------------

    async def initial_round(self) -> Outcome:
        """Round 1: evaluate the initial workflow (an invalid one stops the search)."""
        started = time.monotonic()
        a = self.cfg
        validate(self.initial, max_nodes=a.max_nodes, max_samples=a.max_samples, max_loop_rounds=a.max_loop_rounds)
        outcome = await evaluate_runs(self.initial, self.evaluate, a.validation_runs)
        outcome.child, outcome.child_hash = self.initial, workflow_hash(self.initial)
        outcome.modification = "initial workflow"
        self._save_round(1, outcome, None)
        self.pool.add(to_experience(outcome, None, round=1, source="search", key="search/1"))
        self._append(self._entries(1, outcome, None, started))
        self.log(f"round 1: initial workflow, score {outcome.child_score:.4f}")
        return outcome

    async def step(self, rnd: int) -> Outcome:
        """One optimisation round ``rnd`` (> 1)."""
        started = time.monotonic()
        a = self.cfg
        tree = self.tree()
        rng = np.random.default_rng([self.seed, rnd])  # per round: a resumed search draws the same
        parent = self.selector.select(tree, rng)
        state = build_state(parent, self.pool, rng, failures_shown=a.failures_shown, kind=self.kind,
                            max_nodes=a.max_nodes, compact=a.prompt == "compact")
        proposal = None
        try:
            proposal = await self.proposer(state)
            outcome = await assess(proposal.text, parent, evaluate=self.evaluate, runs=a.validation_runs,
                                   max_nodes=a.max_nodes, max_samples=a.max_samples,
                                   max_loop_rounds=a.max_loop_rounds, penalty=a.format_penalty,
                                   known={n.hash: n.round for n in tree})
        except Exception as exc:  # AFlow too moves on to the next round when one fails
            outcome = Outcome(accepted=False, reason=f"error: {type(exc).__name__}: {exc}", error=True)
        self._save_round(rnd, outcome, proposal)
        if not outcome.error:  # a failed request says nothing about the parent: no experience
            self.pool.add(to_experience(outcome, parent, round=rnd, source="search", key=f"search/{rnd}",
                                        info={"finish_reason": proposal.finish_reason}))
        self._append(self._entries(rnd, outcome, parent, started))
        if outcome.accepted:
            self.log(f"round {rnd}: parent round {parent.round} ({parent.score:.4f}) -> "
                     f"{outcome.child_score:.4f} [{_clip(outcome.modification, 120)}]")
        else:
            self.log(f"round {rnd}: parent round {parent.round}: rejected ({_clip(outcome.reason, 160)})")
        return outcome

    async def run(self, max_rounds: int | None = None) -> dict:
        """Run (or resume) the search until ``max_rounds`` or convergence; return a summary."""
        a = self.cfg
        limit = a.max_rounds if max_rounds is None else max_rounds
        if self.completed_rounds == 0 and limit >= 1:
            await self.initial_round()
        elif self.completed_rounds:
            # A kill between recording a round's experience and its results leaves a record of an
            # unfinished round; drop it so the redone round selects with the pool it saw the first time.
            self.pool.remove(f"search/{self.completed_rounds + 1}")
            self.log(f"resuming after round {self.completed_rounds} ({self.results_path})")
        while True:
            converged, since = (check_convergence(self.results, top_k=3, patience=a.convergence_rounds)
                                if a.convergence_rounds > 0 else (False, None))
            if converged:
                self.log(f"converged: the top 3 unchanged since round {since}")
            if converged or self.completed_rounds >= limit:
                return self.finish(converged)
            await self.step(self.completed_rounds + 1)

    def finish(self, converged: bool = False) -> dict:
        """Export the pool, write the best workflow, return the summary."""
        tree = self.tree()
        best = max(tree, key=lambda n: (n.score, -n.round), default=None)
        if best is not None:
            with open(os.path.join(self.dir, "best.yaml"), "w") as fh:
                fh.write(best.workflow)
        exported = self.pool.export(os.path.join(self.dir, "experience.jsonl"))
        rejected = len({e["round"] for e in self.results if e.get("status") == "rejected"})
        errors = len({e["round"] for e in self.results if e.get("status") == "error"})
        summary = {"rounds": self.completed_rounds, "accepted": len(tree), "rejected": rejected, "errors": errors,
                   "best_round": best.round if best else None, "best_score": best.score if best else None,
                   "best_hash": best.hash if best else None, "converged": converged, "experience": exported,
                   "total_cost": float(sum(e.get("total_cost") or 0.0 for e in self.results))}
        _write_json(os.path.join(self.dir, "summary.json"), summary)
        return summary


def initial_workflow(cfg: Any, kind: str = "") -> Workflow:
    """``env.aflow.initial_workflow`` (a YAML file) or AFlow's default for the question type ``kind``."""
    from aflow_rl.envs.aflow.graph import default_workflow

    if cfg.initial_workflow:
        with open(cfg.initial_workflow) as fh:
            return Workflow.from_yaml(fh.read())
    return default_workflow(kind)


def make_evaluate(cfg: Any, executor: Any, problems: list) -> EvaluateFn:
    """``evaluate(workflow)`` on ``problems`` with the executor and the limits of ``env.aflow``."""
    from aflow_rl.envs.aflow.evaluator import evaluate

    async def run(workflow: Workflow) -> Any:
        return await evaluate(workflow, problems, executor=executor, concurrency=cfg.eval_concurrency,
                              problem_timeout_s=cfg.problem_timeout_s, max_tokens=cfg.executor_max_tokens,
                              max_nodes=cfg.max_nodes, max_samples=cfg.max_samples,
                              max_loop_rounds=cfg.max_loop_rounds, code_timeout_s=cfg.code_timeout_s,
                              scoring_mode=cfg.scoring)

    return run
