"""Baseline orchestrators: single agent, rule-based decomposition, and a contextual bandit.

- ``SingleAgent`` never spawns: it works every item itself through tool calls
  (the serial execution that PARL's r_parallel fights), within the turn and
  tool-call budgets, and finishes with what it found.
- ``Heuristic`` decomposes by rule: one subagent per item (up to the
  concurrency cap), join, re-run failed items once, finish with the results.
- ``Bandit`` learns online which of those to use, and with which subagent
  profile: UCB1 over the arms single / parallel-{small, medium, large}, one
  bandit per context (suite, size bucket), rewarded with
  ``item_f1 - bandit_latency_coef * critical_steps``.
- ``Adaptive`` is a reference, not a rule users run: it reads the task's
  structure, works it alone when its own tool budget covers every lookup
  (deep chains), and otherwise fans the lookups out to one large subagent per
  parallel item and computes the aggregates itself (wide and mixed tasks). It
  measures how much a policy that conditions on the task can gain over the
  fixed rules above, i.e. the headroom the learning benchmark asks a trained
  policy to find.
- ``SpawnHack`` is an adversary, not a baseline to beat: it spawns the most
  subagents it may every turn and never lets a subtask run, the "meaningless
  spawning" that PARL's r_finish exists to make unprofitable.

All of them read only the observation's structured view (never the gold
answers) and are deterministic given the task and the episode's seed; the
bandit's choices also depend on the episodes it has seen in this process.
"""
from __future__ import annotations

import math
from typing import Any

from aflow_rl.envs.swarm.actions import Action
from aflow_rl.envs.swarm.observation import Observation
from aflow_rl.envs.swarm.decision import Decision, rule_decision
from aflow_rl.envs.swarm.tasks import task_width, tool_steps, topological_order

_TOKEN_RESERVE = 0.9  # rule policies finish once this fraction of the token budget is spent


def _finish(obs: Observation, answer: dict) -> Decision:
    return rule_decision(obs, Action("finish", answer=dict(answer)))


def _out_of_budget(v: dict) -> bool:
    """True when only the finishing turn is left (or tokens are nearly spent)."""
    return v["max_steps"] - v["step"] <= 1 or v["tokens"] >= _TOKEN_RESERVE * v["max_tokens"]


class SingleAgent:
    """Solves every item with its own tool calls, never spawning a subagent."""

    name = "single"

    def begin_episode(self, task: dict) -> None:
        pass

    def end_episode(self, task: dict, metrics: dict[str, float], rewards: dict[str, float]) -> None:
        pass

    @staticmethod
    def _progress(item: dict, known: dict[str, str], notes: dict[tuple, tuple[bool, str]]
                  ) -> tuple[str | None, Action | None, int]:
        """(answer if complete, next tool call, tool calls still needed) for one item."""
        if "op" in item:
            if not all(d in known for d in item["deps"]):
                return None, None, 0
            expr = " + ".join(known[d] for d in item["deps"])
            hit = notes.get(("calc", expr))
            if hit is not None:
                return (hit[1] if hit[0] else None), None, 0
            return None, Action("tool_call", tool="calc", args={"expr": expr}), 1
        if "ref" in item and item["ref"] not in known:
            return None, None, 0
        cur = item["start"] if "start" in item else known[item["ref"]]
        for k, attr in enumerate(item["path"]):
            hit = notes.get(("lookup", cur.strip().lower(), attr))
            if hit is None:
                return None, Action("tool_call", tool="lookup", args={"entity": cur, "attribute": attr}), \
                    len(item["path"]) - k
            if not hit[0]:
                return None, None, 0  # the knowledge base said no: the item cannot be solved this way
            cur = hit[1]
        return cur, None, 0

    async def act(self, obs: Observation) -> Decision:
        v = obs.view
        notes: dict[tuple, tuple[bool, str]] = {}
        for n in v["notes"]:
            key = ("calc", n["args"]["expr"]) if n["tool"] == "calc" else \
                ("lookup", n["args"]["entity"].strip().lower(), n["args"]["attribute"])
            notes[key] = (n["ok"], n["result"])
        known: dict[str, str] = {}
        calls_left = v["max_tool_calls"] - v["tool_calls"]
        turns_left = v["max_steps"] - v["step"] - 1  # one turn stays reserved for finish
        next_call = None
        for item in topological_order(v["items"]):
            answer, call, need = self._progress(item, known, notes)
            if answer is not None:
                known[item["id"]] = answer
            elif next_call is None and call is not None and need <= min(calls_left, turns_left):
                next_call = call  # the first unfinished item that still fits the budgets
        if next_call is None or _out_of_budget(v):
            return _finish(obs, known)
        return rule_decision(obs, next_call)


class Heuristic:
    """One subagent per item, join, one replan of failures, finish.

    Profile rule: ``large`` unless told otherwise. The orchestrator cannot check
    a subagent's answer without redoing its work, so a rule that must not lose
    quality takes the profile that never reports a wrong answer; the bandit
    learns when a cheaper profile is good enough.
    """

    name = "heuristic"

    def __init__(self, profile: str | None = None):
        self.profile = profile

    def begin_episode(self, task: dict) -> None:
        pass

    def end_episode(self, task: dict, metrics: dict[str, float], rewards: dict[str, float]) -> None:
        pass

    def choose_profile(self, items: list[dict]) -> str:
        return self.profile or "large"

    async def act(self, obs: Observation) -> Decision:
        v = obs.view
        items = v["items"]
        results = v["results"]
        if _out_of_budget(v) or all(it["id"] in results for it in items):
            return _finish(obs, results)
        if any(g["queue"] for g in v["subagents"]):
            return rule_decision(obs, Action("join", ids=()))
        if not v["subtasks"]:
            ids = tuple(it["id"] for it in topological_order(items))
            n = min(len(ids), v["max_concurrent"])
            return rule_decision(obs, Action("spawn", n=n, profile=self.choose_profile(items), subtasks=ids))
        # Everything ran. Re-run failures once (more subtasks than items means we already did), if a
        # replan, its join and the finish still fit.
        latest = {st["item"]: st["status"] for st in v["subtasks"]}
        failed = any(s in ("failed", "skipped") for s in latest.values())
        retried = len(v["subtasks"]) > len(items)
        if failed and not retried and v["max_steps"] - v["step"] >= 3:
            return rule_decision(obs, Action("replan", scope="failed"))
        return _finish(obs, results)


class Adaptive:
    """Works a task alone when its own budgets cover it, else delegates the lookups and sums itself.

    Serial when every tool call the task needs fits the orchestrator's own tool
    calls and turns (a subagent per hop only adds orchestration steps); otherwise
    one ``large`` subagent per item of the widest level takes all the lookup items
    (chains stay whole: a subagent works its queue in order), a join collects them,
    and the orchestrator computes the ``op`` items from their answers with its own
    calc calls, which costs one tool step instead of another subagent wave.
    """

    name = "adaptive"

    def __init__(self) -> None:
        self._single = SingleAgent()

    def begin_episode(self, task: dict) -> None:
        pass

    def end_episode(self, task: dict, metrics: dict[str, float], rewards: dict[str, float]) -> None:
        pass

    @staticmethod
    def fits_alone(v: dict) -> bool:
        """Whether the whole task fits the own tool-call and turn budgets (decided on the first turn)."""
        need = sum(tool_steps(it) for it in v["items"])
        return need <= min(v["max_tool_calls"], v["max_steps"] - 1)

    async def act(self, obs: Observation) -> Decision:
        v = obs.view
        if not v["subtasks"] and (v["step"] > 0 or self.fits_alone(v)):
            return await self._single.act(obs)   # serial from the first turn: stay serial
        results = dict(v["results"])
        if _out_of_budget(v) or all(it["id"] in results for it in v["items"]):
            return _finish(obs, results)
        if any(g["queue"] for g in v["subagents"]):
            return rule_decision(obs, Action("join", ids=()))
        lookups = [it for it in topological_order(v["items"]) if "op" not in it]
        if not v["subtasks"]:
            n = min(task_width(lookups), v["max_concurrent"])
            return rule_decision(obs, Action("spawn", n=n, profile="large",
                                             subtasks=tuple(it["id"] for it in lookups)))
        calcs = {n["args"]["expr"]: n for n in v["notes"] if n["tool"] == "calc"}
        for item in topological_order(v["items"]):
            if "op" not in item or item["id"] in results or not all(d in results for d in item["deps"]):
                continue
            expr = " + ".join(results[d] for d in item["deps"])
            note = calcs.get(expr)
            if note is None:
                return rule_decision(obs, Action("tool_call", tool="calc", args={"expr": expr}))
            if note["ok"]:
                results[item["id"]] = note["result"]
        return _finish(obs, results)


class SpawnHack:
    """Adversarial baseline: PARL's "meaningless spawning" hack of r_parallel (never a real orchestrator).

    Every turn it spawns as many subagents as the concurrency cap allows,
    handing them the task's items (``queue_items``) or nothing, and it never
    joins, so no subtask ever runs; it never finishes either, and the episode
    ends when a budget runs out (its queued subtasks are then cancelled). It
    collects the whole instantiation reward, r_parallel = 1, and nothing else:
    no subtask is done (r_finish = 0) and no answer is found (r_perf = 0). The
    shaped reward must rank it below the heuristic at every lambda and below
    the single agent once lambda is 0 (tests/envs/swarm/test_reward_hack.py).
    """

    name = "spawn_hack"

    def __init__(self, queue_items: bool = True, profile: str = "small"):
        self.queue_items, self.profile = queue_items, profile

    def begin_episode(self, task: dict) -> None:
        pass

    def end_episode(self, task: dict, metrics: dict[str, float], rewards: dict[str, float]) -> None:
        pass

    async def act(self, obs: Observation) -> Decision:
        v = obs.view
        ids = tuple(it["id"] for it in topological_order(v["items"])) if self.queue_items else ()
        return rule_decision(obs, Action("spawn", n=max(1, int(v["max_concurrent"])), profile=self.profile,
                                         subtasks=ids))


ARMS = ("single", "parallel-small", "parallel-medium", "parallel-large")


def bandit_context(task: dict) -> str:
    """What the bandit conditions on: the suite and whether the task is small or large."""
    return f"{task.get('suite', '?')}/{'n<=4' if len(task['items']) <= 4 else 'n>4'}"


class Bandit:
    """UCB1 per context over serial vs parallel execution and the subagent profile (learns online).

    Several episodes may run at once in one worker (asyncio), so the arm of
    each open episode is kept by episode id.
    """

    name = "bandit"

    def __init__(self, latency_coef: float = 0.02, ucb_c: float = 0.1):
        self.latency_coef, self.ucb_c = latency_coef, ucb_c
        self.counts: dict[str, list[int]] = {}
        self.sums: dict[str, list[float]] = {}
        self._open: dict[str, tuple[str, int]] = {}   # episode id -> (context, arm)
        self._single, self._parallel = SingleAgent(), {a: Heuristic(a.split("-")[1]) for a in ARMS[1:]}

    def choose(self, ctx: str) -> int:
        counts = self.counts.setdefault(ctx, [0] * len(ARMS))
        sums = self.sums.setdefault(ctx, [0.0] * len(ARMS))
        for a, c in enumerate(counts):
            if c == 0:
                return a  # try every arm once, in order
        total = sum(counts)
        ucb = [sums[a] / counts[a] + self.ucb_c * math.sqrt(math.log(total) / counts[a]) for a in range(len(ARMS))]
        return max(range(len(ARMS)), key=lambda a: (ucb[a], -a))

    def update(self, ctx: str, arm: int, reward: float) -> None:
        self.counts.setdefault(ctx, [0] * len(ARMS))[arm] += 1
        self.sums.setdefault(ctx, [0.0] * len(ARMS))[arm] += reward

    def begin_episode(self, task: dict) -> None:
        ctx = bandit_context(task)
        self._open[str(task.get("episode_id", task["task_id"]))] = (ctx, self.choose(ctx))

    async def act(self, obs: Observation) -> Decision:
        key = obs.view["episode_id"]
        if key not in self._open:
            self.begin_episode({"task_id": key, "suite": obs.view["suite"], "items": obs.view["items"]})
        arm = ARMS[self._open[key][1]]
        return await (self._single.act(obs) if arm == "single" else self._parallel[arm].act(obs))

    def end_episode(self, task: dict, metrics: dict[str, float], rewards: dict[str, float]) -> None:
        opened = self._open.pop(str(task.get("episode_id", task["task_id"])), None)
        if opened is None:
            return
        reward = metrics.get("item_f1", 0.0) - self.latency_coef * metrics.get("critical_steps", 0.0)
        self.update(opened[0], opened[1], reward)

    def table(self) -> dict[str, dict[str, float]]:
        """Mean reward per context and arm (what the bandit has learned), for reports."""
        return {ctx: {ARMS[a]: round(self.sums[ctx][a] / c, 4) for a, c in enumerate(counts) if c}
                for ctx, counts in self.counts.items()}


def make_baseline(name: str, cfg: Any) -> Any:
    if name == "single":
        return SingleAgent()
    if name == "heuristic":
        return Heuristic()
    if name == "adaptive":
        return Adaptive()
    if name == "bandit":
        return Bandit(latency_coef=cfg.env.swarm.bandit_latency_coef, ucb_c=cfg.env.swarm.bandit_ucb_c)
    raise ValueError(f"env.swarm.policy: unknown policy {name!r}; choose model, single, heuristic, bandit or adaptive")
