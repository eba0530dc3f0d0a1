"""The swarm runtime: a task graph of subtasks run by subagents, under budgets.

The orchestrator acts in turns; each turn is one *main step*. Subagents do
their work when the orchestrator joins them: the runtime then runs the needed
subtasks in *waves*. A wave takes up to ``max_concurrent`` subagents whose next
subtask is ready (every dependency done) and runs them concurrently; each
wave closes one *stage* ``(main steps since the last stage, [steps of each
subagent in the wave])``, the unit of Kimi K2.5's critical-steps latency
``sum over stages of (S_main + max_i S_sub,i)``. Waves are a deterministic
approximation of asynchronous execution: a subagent that finishes early waits
for the wave, so critical steps are never under-counted.

Semantics, each tested with exact numbers:

- *Dependencies.* A subtask solves one task item; it depends on the live
  subtasks (queued or done) of the item's dependencies, which must exist when
  it is created (the same spawn is fine). Its inputs are their answers.
- *Retries.* A failed attempt is retried in place up to ``retries`` times; its
  steps, tokens and latency add up. ``retry_count`` counts the extra attempts.
- *Failure cascade.* A subtask whose dependency failed, was skipped or was
  cancelled is skipped (never run) and counted.
- *Mailbox.* Every finished subtask (done, failed, skipped, cancelled) posts a
  message; the orchestrator reads them in its next observation.
- *Budgets.* Orchestrator turns (``max_steps``), the orchestrator's own tool
  calls (``max_tool_calls``; subagents are bounded by their profile's
  ``max_steps``), tokens of orchestrator and subagents (``max_tokens``) and
  wall time on the episode clock (``max_wall_ms``). Exhausting one ends the
  episode (``ended`` names it); a tool call past the budget is refused.
- *Solving an item oneself* (``solve``, when enabled). The orchestrator runs the item's
  tool calls itself (one lookup per path step, one calc for a sum), exactly as the
  single agent would over that many turns: each call is one main step (the extra
  ones count against ``max_steps`` and are charged the tokens and latency of the
  turn that asked), one tool call against ``max_tool_calls`` and ``TOOL_CALL_MS``
  on the clock. It needs every dependency's answer to be known and enough turns
  and tool calls left (else InvalidAction, nothing is charged). Its answer joins
  ``results()``; subtasks may depend on it. Tools are exact, so only a wrong
  input (a subagent's silent error upstream) can make it fail.
- *Cancellation.* ``finish`` and the end of the episode cancel every queued
  subtask; a wave that runs past the wall-time budget cancels the subagents
  still running at the deadline.

The clock is virtual: simulated subagents and baseline turns advance it by
their modelled latency, real LLM calls by their measured latency.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Callable

from aflow_rl.envs.swarm.actions import Action
from aflow_rl.envs.swarm.profiles import (PROFILES, TOOL_CALL_MS, AttemptResult, SubagentExecutor, SubagentJob,
                                          orchestrator_cost)
from aflow_rl.envs.swarm.tasks import item_depths, stable_seed, tool_steps
from aflow_rl.envs.swarm.tools import ToolResult

TERMINATIONS = ("finish", "max_steps", "tool_budget", "token_budget", "wall_time")
FINAL = ("done", "failed", "skipped", "cancelled")


class InvalidAction(ValueError):
    """A well-formed action that the current state does not allow (unknown item, missing dependency, ...)."""


@dataclass
class Budgets:
    max_steps: int = 24
    max_tool_calls: int = 16
    max_tokens: int = 20000
    max_wall_ms: float = 120_000.0
    max_concurrent: int = 8
    retries: int = 1

    @classmethod
    def from_config(cls, sw: Any) -> "Budgets":
        """From ``cfg.env.swarm`` (a SwarmEnvConfig)."""
        return cls(max_steps=sw.max_steps, max_tool_calls=sw.max_tool_calls, max_tokens=sw.max_tokens,
                   max_wall_ms=1000.0 * sw.max_wall_s, max_concurrent=sw.max_concurrent_subagents,
                   retries=sw.subtask_retries)


@dataclass
class VirtualClock:
    """Episode time in milliseconds; advanced explicitly, never by sleeping."""

    now_ms: float = 0.0

    def advance(self, ms: float) -> None:
        self.now_ms += max(0.0, float(ms))


@dataclass
class Subtask:
    id: str
    item: str
    subagent: int
    deps: list[str]                 # subtask ids
    status: str = "queued"          # queued | done | failed | skipped | cancelled
    answer: str | None = None
    error: str = ""
    attempts: int = 0
    steps: int = 0
    tool_calls: int = 0
    tokens_in: int = 0
    tokens_out: int = 0
    latency_ms: float = 0.0


@dataclass
class Subagent:
    id: int
    profile: str
    queue: list[str] = field(default_factory=list)   # subtask ids, oldest first
    retired: bool = False


class SwarmRuntime:
    """State of one episode's swarm. Drive it with ``turn`` then ``apply`` per orchestrator step, then ``close``."""

    def __init__(self, items: list[dict], budgets: Budgets, executor: SubagentExecutor, *,
                 tools: Callable[[str, dict], ToolResult] | None = None, seed: int = 0, solve: bool = False):
        self.items = {it["id"]: it for it in items}
        self.depth = item_depths(items)
        self.budgets = budgets
        self.executor = executor
        self.tools = tools
        self.seed = seed
        self.clock = VirtualClock()
        self.subtasks: dict[str, Subtask] = {}
        self.subagents: list[Subagent] = []
        self.stages: list[tuple[int, list[int]]] = []
        self.main_pending = 0           # main steps not yet closed into a stage
        self.steps = 0                  # orchestrator turns
        self.tool_calls = 0
        self.tokens_in = self.tokens_out = 0
        self.cost = 0.0
        self.retry_count = 0
        self.sub_steps = 0              # all subagent steps, for work/span parallelism
        self.waves = 0
        self.notes: list[dict] = []     # the orchestrator's own tool results
        self.mailbox: list[dict] = []   # unread subagent results
        self.answer: Any = None
        self.ended: str | None = None
        self.solve_enabled = solve
        self.own_answers: dict[str, str] = {}  # items the orchestrator solved itself
        self.solved_self = 0                   # solve actions that found an answer
        self._last_turn = (0, 0, 0.0)          # tokens_in, tokens_out, latency_ms of the latest turn
        self._item_attempts: dict[str, int] = {}

    # -- orchestrator turns ---------------------------------------------------

    def turn(self, tokens_in: int, tokens_out: int, latency_ms: float) -> None:
        """Account one orchestrator turn (a main step), before its action is applied."""
        self.steps += 1
        self.main_pending += 1
        self.tokens_in += int(tokens_in)
        self.tokens_out += int(tokens_out)
        self.cost += orchestrator_cost(tokens_in, tokens_out)
        self.clock.advance(latency_ms)
        self._last_turn = (int(tokens_in), int(tokens_out), float(latency_ms))

    def check_budgets(self) -> str | None:
        """End the episode if a budget is spent (called after each turn); returns ``ended``."""
        if self.ended is None:
            if self.tokens_in + self.tokens_out > self.budgets.max_tokens:
                self.ended = "token_budget"
            elif self.clock.now_ms >= self.budgets.max_wall_ms:
                self.ended = "wall_time"
            elif self.steps >= self.budgets.max_steps:
                self.ended = "max_steps"
        return self.ended

    async def apply(self, action: Action) -> str:
        """Carry out one action; returns the outcome text. Raises InvalidAction when the state forbids it."""
        if self.ended is not None:
            raise InvalidAction(f"the episode has ended ({self.ended})")
        handler = getattr(self, f"_do_{action.kind}")
        out = handler(action)
        return await out if asyncio.iscoroutine(out) else out

    def close(self) -> None:
        """End of episode: cancel queued subtasks and close the last stage."""
        for st in self.subtasks.values():
            if st.status == "queued":
                self._finalize(st, "cancelled", error=f"cancelled at episode end ({self.ended or 'closed'})")
        for agent in self.subagents:
            agent.queue.clear()
        if self.main_pending:
            self.stages.append((self.main_pending, []))
            self.main_pending = 0

    # -- queries --------------------------------------------------------------

    def results(self) -> dict[str, str]:
        """The latest answer per item from subagents that finished their subtask, then the
        items the orchestrator solved itself (its tools are exact, so its answer wins)."""
        out: dict[str, str] = {}
        for st in self.subtasks.values():
            if st.status == "done" and st.answer is not None:
                out[st.item] = st.answer
        out.update(self.own_answers)
        return out

    def productive_subagents(self) -> int:
        """Subagents that finished at least one subtask (PARL's r_parallel counts only these)."""
        return len({st.subagent for st in self.subtasks.values() if st.status == "done"})

    def count(self, status: str) -> int:
        return sum(1 for st in self.subtasks.values() if st.status == status)

    def drain_mailbox(self) -> list[dict]:
        out, self.mailbox = self.mailbox, []
        return out

    # -- actions --------------------------------------------------------------

    def _do_spawn(self, a: Action) -> str:
        if a.n > self.budgets.max_concurrent:
            raise InvalidAction(f"spawn: n={a.n} exceeds the cap of {self.budgets.max_concurrent} concurrent subagents")
        items = self._plan_items(list(a.subtasks))
        first = len(self.subagents)
        agents = [Subagent(first + k, a.profile) for k in range(a.n)]
        self.subagents += agents
        made = [self._new_subtask(item, agents[j % a.n]) for j, item in enumerate(items)]
        where = ", ".join(f"{st.item}->#{st.subagent}" for st in made) or "no subtasks yet"
        return f"spawned {a.n} {a.profile} subagent(s) #{first}..#{first + a.n - 1}: {where}"

    def _do_assign(self, a: Action) -> str:
        if not 0 <= a.subagent < len(self.subagents) or self.subagents[a.subagent].retired:
            raise InvalidAction(f"assign: no active subagent #{a.subagent}")
        (item,) = self._plan_items([a.subtask])
        st = self._new_subtask(item, self.subagents[a.subagent])
        return f"assigned {st.item} to #{st.subagent} as {st.id}"

    async def _do_join(self, a: Action) -> str:
        unknown = [i for i in a.ids if not 0 <= i < len(self.subagents)]
        if unknown:
            raise InvalidAction(f"join: unknown subagent id(s) {unknown}; spawned: 0..{len(self.subagents) - 1}")
        targets = set(a.ids) if a.ids else {g.id for g in self.subagents}
        before = {s: self.count(s) for s in FINAL}
        waves = await self._run_until_done(self._needed(targets))
        delta = {s: self.count(s) - before[s] for s in FINAL if self.count(s) - before[s]}
        summary = ", ".join(f"{v} {k}" for k, v in delta.items()) or "nothing to run"
        return f"joined after {waves} wave(s): {summary}"

    def _do_tool_call(self, a: Action) -> str:
        if self.tool_calls >= self.budgets.max_tool_calls:
            self.ended = "tool_budget"
            return f"refused: the tool-call budget ({self.budgets.max_tool_calls}) is spent"
        if self.tools is None:
            raise InvalidAction("tool_call: this episode has no tools")
        self.tool_calls += 1
        self.clock.advance(TOOL_CALL_MS)
        res = self.tools(a.tool, dict(a.args))
        self.notes.append({"tool": a.tool, "args": dict(a.args), "ok": res.ok, "result": res.text()})
        call = ", ".join(a.args[k] for k in a.args)
        return f"{a.tool}({call}) = {res.text()}"

    def _do_replan(self, a: Action) -> str:
        if a.scope in ("remaining", "all"):
            queued = [st for st in self.subtasks.values() if st.status == "queued"]
            for st in queued:
                self._finalize(st, "cancelled", error=f"cancelled by replan({a.scope})")
            for agent in self.subagents:
                agent.queue.clear()
                agent.retired = agent.retired or a.scope == "all"
            return f"cancelled {len(queued)} queued subtask(s)" + (", retired all subagents" if a.scope == "all" else "")
        # scope == failed: re-run every item whose latest subtask failed or was skipped, on fresh subagents.
        latest: dict[str, Subtask] = {}
        for st in self.subtasks.values():
            latest[st.item] = st
        redo = [st for st in latest.values() if st.status in ("failed", "skipped")]
        if not redo:
            return "nothing to replan: no failed or skipped items"
        items = self._plan_items([st.item for st in redo])
        profile_of = {st.item: self.subagents[st.subagent].profile for st in redo}
        made = []
        for item in items:
            agent = Subagent(len(self.subagents), profile_of[item["id"]])
            self.subagents.append(agent)
            made.append(self._new_subtask(item, agent))
        return "re-spawned " + ", ".join(f"{st.item}->#{st.subagent}" for st in made)

    def _do_solve(self, a: Action) -> str:
        if not self.solve_enabled:
            raise InvalidAction("solve: this environment has no solve action (env.swarm.solve_action=false)")
        if a.subtask not in self.items:
            raise InvalidAction(f"solve: unknown item id {a.subtask!r}; items: {', '.join(self.items)}")
        item, known = self.items[a.subtask], self.results()
        missing = [d for d in item["deps"] if d not in known]
        if missing:
            raise InvalidAction(f"solve: {a.subtask} needs the answer to {', '.join(missing)} first")
        k = tool_steps(item)
        calls_left, turns_left = self.budgets.max_tool_calls - self.tool_calls, self.budgets.max_steps - self.steps + 1
        if k > calls_left or k > turns_left:
            raise InvalidAction(f"solve: {a.subtask} takes {k} tool call(s) and turn(s); "
                                f"{calls_left} tool call(s) and {turns_left} turn(s) left")
        calls = [("calc", {"expr": " + ".join(known[d] for d in item["deps"])})] if "op" in item else []
        value = None if "op" in item else (item["start"] if "start" in item else known[item["ref"]])
        made = 0
        for step in range(k):
            tool, args = calls[0] if calls else ("lookup", {"entity": value, "attribute": item["path"][step]})
            res = self._own_call(tool, args, extra_turn=made > 0)
            made += 1
            if not res.ok:
                return f"could not solve {a.subtask} after {made} tool call(s): {res.error}"
            value = res.value
        self.own_answers[a.subtask] = value
        self.solved_self += 1
        return f"solved {a.subtask} = {value} in {made} tool call(s)"

    def _own_call(self, tool: str, args: dict, *, extra_turn: bool) -> ToolResult:
        """One tool call of a solve; every call after the first is one more main step, priced
        like the turn that asked for the solve."""
        if extra_turn:
            t_in, t_out, ms = self._last_turn
            self.steps += 1
            self.main_pending += 1
            self.tokens_in += t_in
            self.tokens_out += t_out
            self.cost += orchestrator_cost(t_in, t_out)
            self.clock.advance(ms)
        self.tool_calls += 1
        self.clock.advance(TOOL_CALL_MS)
        res = self.tools(tool, dict(args)) if self.tools is not None else ToolResult(False, error="no tools")
        self.notes.append({"tool": tool, "args": dict(args), "ok": res.ok, "result": res.text()})
        return res

    def _do_finish(self, a: Action) -> str:
        self.answer = a.answer
        self.ended = "finish"
        return "finished"

    # -- task graph -----------------------------------------------------------

    def _live(self, item_id: str, pending: set[str]) -> bool:
        return item_id in pending or item_id in self.own_answers or any(st.item == item_id and st.status in ("queued", "done")
                                         for st in self.subtasks.values())

    def _plan_items(self, ids: list[str]) -> list[dict]:
        """Validate requested item ids (all or nothing) and return them in dependency order."""
        unknown = [i for i in ids if i not in self.items]
        if unknown:
            raise InvalidAction(f"unknown item id(s) {unknown}; items: {', '.join(self.items)}")
        ordered = sorted(ids, key=lambda i: self.depth[i])  # stable: keeps the caller's order per depth
        pending: set[str] = set()
        for i in ordered:
            missing = [d for d in self.items[i]["deps"] if not self._live(d, pending)]
            if missing:
                raise InvalidAction(f"{i} needs the answer to {', '.join(missing)}: spawn "
                                    f"{', '.join(missing)} first (the same spawn is fine) or replan")
            pending.add(i)
        return [self.items[i] for i in ordered]

    def _dep_subtask(self, item_id: str) -> str | None:
        """The subtask a new dependent waits for: a done one if any, else the newest queued one;
        None when only the orchestrator's own answer exists (nothing to wait for)."""
        cands = [st for st in self.subtasks.values() if st.item == item_id and st.status in ("queued", "done")]
        done = [st for st in cands if st.status == "done"]
        return (done or cands)[-1].id if cands else None

    def _new_subtask(self, item: dict, agent: Subagent) -> Subtask:
        deps = [self._dep_subtask(d) for d in item["deps"]]
        st = Subtask(id=f"s{len(self.subtasks)}", item=item["id"], subagent=agent.id,
                     deps=[d for d in deps if d is not None])
        self.subtasks[st.id] = st
        agent.queue.append(st.id)
        return st

    def _needed(self, targets: set[int]) -> set[str]:
        """Queued subtasks of the targets, plus what they wait for: dependencies and queue predecessors."""
        need = {sid for g in self.subagents if g.id in targets for sid in g.queue}
        frontier = list(need)
        while frontier:
            st = self.subtasks[frontier.pop()]
            queue = self.subagents[st.subagent].queue
            before = queue[:queue.index(st.id)] if st.id in queue else []
            for sid in [*st.deps, *before]:
                if sid not in need and self.subtasks[sid].status == "queued":
                    need.add(sid)
                    frontier.append(sid)
        return need

    def _cascade(self) -> None:
        """Skip every queued subtask whose dependency can no longer be done (transitively)."""
        changed = True
        while changed:
            changed = False
            for st in self.subtasks.values():
                if st.status != "queued":
                    continue
                bad = [d for d in st.deps if self.subtasks[d].status in ("failed", "skipped", "cancelled")]
                if bad:
                    self._finalize(st, "skipped", error=f"dependency {bad[0]} ({self.subtasks[bad[0]].item}) "
                                                        f"{self.subtasks[bad[0]].status}")
                    changed = True

    # -- execution ------------------------------------------------------------

    async def _run_until_done(self, need: set[str]) -> int:
        waves = 0
        while self.ended is None:
            self._cascade()
            need = {s for s in need if self.subtasks[s].status == "queued"}
            if not need:
                break
            ready = [g for g in self.subagents
                     if g.queue and g.queue[0] in need
                     and all(self.subtasks[d].status == "done" for d in self.subtasks[g.queue[0]].deps)]
            if not ready:  # cannot happen (dependencies are older than dependents); guard against a hang
                break
            await self._run_wave([self.subtasks[g.queue[0]] for g in ready[:self.budgets.max_concurrent]])
            waves += 1
        return waves

    async def _run_wave(self, wave: list[Subtask]) -> None:
        remaining_ms = self.budgets.max_wall_ms - self.clock.now_ms
        spent = await asyncio.gather(*(self._run_subtask(st, remaining_ms) for st in wave))
        self.stages.append((self.main_pending, [steps for steps, _ in spent]))
        self.main_pending = 0
        self.waves += 1
        self.sub_steps += sum(steps for steps, _ in spent)
        self.clock.advance(min(max((ms for _, ms in spent), default=0.0), max(remaining_ms, 0.0)))
        if any(st.status == "cancelled" for st in wave):
            self.ended = "wall_time"
        elif self.tokens_in + self.tokens_out > self.budgets.max_tokens:
            self.ended = "token_budget"

    async def _run_subtask(self, st: Subtask, remaining_ms: float) -> tuple[int, float]:
        """Run ``st`` with in-place retries; returns (steps, latency_ms) it spent in this wave."""
        agent = self.subagents[st.subagent]
        agent.queue.remove(st.id)
        profile = PROFILES[agent.profile]
        inputs = {d: self.own_answers[d] for d in self.items[st.item]["deps"] if d in self.own_answers}
        inputs.update({self.subtasks[d].item: self.subtasks[d].answer or "" for d in st.deps})
        result: AttemptResult | None = None
        for attempt in range(1 + self.budgets.retries):
            self.retry_count += attempt > 0
            # The k-th attempt at an item draws the same luck whatever the policy did before
            # (common random numbers), so policies are compared on equal footing.
            k = self._item_attempts[st.item] = self._item_attempts.get(st.item, 0) + 1
            job = SubagentJob(item=self.items[st.item], inputs=inputs, profile=profile,
                              seed=stable_seed(self.seed, st.item, k), attempt=k)
            left_ms = remaining_ms - st.latency_ms
            try:
                result = await asyncio.wait_for(self.executor.run(job), timeout=max(left_ms, 1.0) / 1000.0)
            except asyncio.TimeoutError:
                self._finalize(st, "cancelled", error="wall-time budget reached while running")
                st.latency_ms = max(remaining_ms, 0.0)
                return st.steps, st.latency_ms
            st.attempts += 1
            if result.latency_ms > left_ms:
                # The deadline falls inside this attempt: count the steps done by then, drop its answer.
                frac = max(left_ms, 0.0) / result.latency_ms
                self._charge(st, result, frac)
                self._finalize(st, "cancelled", error="wall-time budget reached while running")
                return st.steps, max(remaining_ms, 0.0)
            self._charge(st, result, 1.0)
            if result.ok:
                st.answer = result.answer
                break
            st.error = result.error
        if result is not None and result.ok:
            self._finalize(st, "done")
        else:
            self._finalize(st, "failed", error=st.error)
        return st.steps, st.latency_ms

    def _charge(self, st: Subtask, r: AttemptResult, frac: float) -> None:
        steps = int(r.steps * frac) if frac < 1.0 else r.steps
        t_in, t_out = int(r.tokens_in * frac), int(r.tokens_out * frac)
        st.steps += steps
        st.tool_calls += int(r.tool_calls * frac)
        st.tokens_in += t_in
        st.tokens_out += t_out
        st.latency_ms += r.latency_ms * frac
        self.tokens_in += t_in
        self.tokens_out += t_out
        self.cost += PROFILES[self.subagents[st.subagent].profile].cost(t_in, t_out)

    def _finalize(self, st: Subtask, status: str, error: str = "") -> None:
        st.status = status
        if error:
            st.error = error
        queue = self.subagents[st.subagent].queue
        if st.id in queue:
            queue.remove(st.id)
        self.mailbox.append({"subtask": st.id, "item": st.item, "subagent": st.subagent, "status": status,
                             "answer": st.answer if status == "done" else None, "error": st.error if status != "done" else "",
                             "attempts": st.attempts, "steps": st.steps})
