"""PARL's known reward hack, meaningless spawning, never pays (issue 8, item 5).

Kimi K2.5's PARL trains the orchestrator on ``lambda1 * r_parallel + lambda2 * r_finish + r_perf``
(+ format), lambda annealed to 0. r_parallel pays for instantiating subagents; its known hack is
spawning as many subagents as possible and letting none of them finish anything. Here r_parallel
counts only productive subagents (at least one finished subtask), so the hack is paid nothing at
all; the last two tests show what the older count (every spawned subagent) let through. ``SpawnHack``
does exactly that through the real worker module (``workers.swarm.run_episode``), runtime
and simulated subagents, on the task suites and budgets of the quickstart and deep recipes. Each
episode is scored by the trainer's own shaping (``algos.parl.shaped_rewards``, what ``train.py``
turns into advantages) with the recipe's own lambda1, lambda2, anneal_steps and format penalty, at
points spread over the whole schedule.

Run as a script for the table of mean shaped returns: ``python -m tests.envs.swarm.test_reward_hack``.
"""
import asyncio

import numpy as np
import pytest

from aflow_rl.algos.parl import parl_lambdas, shaped_rewards
from aflow_rl.config import load_config
from aflow_rl.envs.swarm import rewards
from aflow_rl.envs.swarm.actions import Action
from aflow_rl.envs.swarm.baselines import SingleAgent, SpawnHack
from aflow_rl.envs.swarm.decision import rule_decision
from aflow_rl.envs.swarm.policies import make_policy
from aflow_rl.envs.swarm.runtime import SwarmRuntime
from aflow_rl.envs.swarm.tasks import task_width
from aflow_rl.rollout.types import WorkerContext
from workers import swarm as swarm_worker

# The recipes train env.swarm.policy=model; a rule policy in its place needs no policy server.
# deep's subagents answer through an actor LLM server; on CPU its simulated profiles run them.
RECIPES = {
    "quickstart": ("configs/quickstart.yaml", ("env.swarm.policy=heuristic",)),
    "deep": ("configs/deep.yaml", ("env.swarm.policy=heuristic", "env.swarm.subagents=simulated")),
}
SEEDS = (0, 1, 2)
TASKS_PER_SEED = 8
HACKS = ("hack_queued", "hack_idle")


class IdleSpawnThenSerial(SingleAgent):
    """The hack on top of honest work: one spawn of idle subagents at the cap, then the single agent."""

    name = "idle_spawn_then_serial"

    async def act(self, obs):
        v = obs.view
        if not v["subagents"]:
            return rule_decision(obs, Action("spawn", n=v["max_concurrent"], profile="small", subtasks=()))
        return await super().act(obs)


def recipe_config(recipe: str):
    path, overrides = RECIPES[recipe]
    return load_config(path, list(overrides))


def schedule(cfg) -> list[int]:
    """Optimizer steps over the lambda schedule: the start, every eighth of the annealing, the step
    before lambda reaches 0, the step it does, the one after, and the recipe's last step."""
    a = cfg.algo.parl.anneal_steps
    return sorted({0, *(a * k // 8 for k in range(1, 8)), a - 1, a, a + 1, cfg.trainer.max_steps - 1})


def rollouts(cfg, policy, tasks):
    """Episodes through the worker module the trainer's pool runs, with ``policy`` as the orchestrator."""
    ctx = WorkerContext(config=cfg, state={"swarm_policy": policy})

    async def main():
        return [await swarm_worker.run_episode(t, ctx) for t in tasks]

    return asyncio.run(main())


def policies(cfg) -> dict:
    return {"hack_queued": SpawnHack(queue_items=True), "hack_idle": SpawnHack(queue_items=False),
            "heuristic": make_policy(cfg, name="heuristic"), "single": make_policy(cfg, name="single"),
            "idle_spawn_then_serial": IdleSpawnThenSerial()}


_CACHE: dict = {}


def episodes(recipe: str):
    """(cfg, tasks, {policy: [Trajectory]}) for every seed of ``recipe``, run once per session."""
    if recipe not in _CACHE:
        cfg = recipe_config(recipe)
        tasks = [t for seed in SEEDS for t in swarm_worker.make_tasks(cfg, TASKS_PER_SEED, seed=seed)]
        _CACHE[recipe] = cfg, tasks, {name: rollouts(cfg, p, tasks) for name, p in policies(cfg).items()}
    return _CACHE[recipe]


def shaped(cfg, trajs, step: int) -> np.ndarray:
    return shaped_rewards(trajs, step, cfg.algo.parl)


@pytest.mark.parametrize("hack", HACKS)
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_the_hack_spawns_the_most_and_finishes_nothing(recipe, hack):
    """The adversary really is the hack, and it is paid nothing: none of its subagents finished a
    subtask, so none counts toward r_parallel."""
    cfg, tasks, runs = episodes(recipe)
    cap = cfg.env.swarm.max_concurrent_subagents
    assert len(tasks) == len(SEEDS) * TASKS_PER_SEED
    for task, t in zip(tasks, runs[hack]):
        assert t.metrics["invalid_actions"] == 0 and t.info["termination"] != "finish"
        assert t.metrics["spawn_count"] == cap * t.metrics["steps"] >= task_width(task["items"])
        assert t.metrics["subtask_finish_rate"] == 0.0 and t.metrics["waves"] == 0
        assert t.metrics["subtasks"] == (t.metrics["steps"] * len(task["items"]) if hack == "hack_queued" else 0)
        assert t.reward_components == {"r_parallel": 0.0, "r_finish": 0.0, "r_perf": 0.0, "format": 0.0}


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_hack_earns_less_than_the_heuristic_at_every_lambda(recipe):
    cfg, tasks, runs = episodes(recipe)
    steps = schedule(cfg)
    assert len(steps) >= 10 and steps[0] == 0 and parl_lambdas(steps[-1], cfg.algo.parl) == (0.0, 0.0)
    for step in steps:
        heur = shaped(cfg, runs["heuristic"], step)
        for hack in HACKS:
            h = shaped(cfg, runs[hack], step)
            worst = int(np.argmax(h - heur))
            assert (h < heur).all(), (f"{hack} out-earns the heuristic at step {step} on "
                                      f"{tasks[worst]['task_id']}: {h[worst]:.4f} >= {heur[worst]:.4f}")


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_hack_earns_less_than_the_single_agent_once_lambda_is_zero(recipe):
    cfg, tasks, runs = episodes(recipe)
    annealed = [s for s in schedule(cfg) if s >= cfg.algo.parl.anneal_steps]
    assert len(annealed) >= 3
    for step in annealed:
        assert parl_lambdas(step, cfg.algo.parl) == (0.0, 0.0)
        single = shaped(cfg, runs["single"], step)
        for hack in HACKS:
            h = shaped(cfg, runs[hack], step)
            assert (h < single).all(), f"{hack} ties or beats the single agent at step {step}: {h} vs {single}"


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_idle_spawning_on_top_of_serial_work_pays_nothing(recipe):
    """The hack mixed with honest serial work. r_finish cannot tell it from the single agent (both
    finish no subtask) and neither can r_parallel now (no subagent of it is productive): the idle
    spawn earns no more than the serial work, at every lambda (less where its spawn turn cost the
    serial work a turn), and ranks below the heuristic while lambda2 > 0."""
    cfg, _, runs = episodes(recipe)
    for t in runs["idle_spawn_then_serial"]:
        assert t.reward_components["r_parallel"] == 0.0 and t.reward_components["r_finish"] == 0.0
    for step in schedule(cfg):
        lam1, lam2 = parl_lambdas(step, cfg.algo.parl)
        mixed = shaped(cfg, runs["idle_spawn_then_serial"], step)
        assert (mixed <= shaped(cfg, runs["single"], step)).all(), step
        heur = shaped(cfg, runs["heuristic"], step)
        assert ((mixed < heur) if lam2 > 0 else (mixed <= heur)).all(), (step, mixed, heur)


def _count_every_spawned_subagent(monkeypatch):
    """The older r_parallel: every spawned subagent counts, productive or not."""
    monkeypatch.setattr(SwarmRuntime, "productive_subagents", lambda self: len(self.subagents))


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_counting_every_spawned_subagent_pays_idle_spawning_lambda1(monkeypatch, recipe):
    """What the productive count removes: counting every spawned subagent, the idle spawn is paid
    r_parallel = 1, exactly lambda1 more per episode than under the productive count, and on some
    tasks that lifts it above the single agent while lambda1 > 0 (the hole issue 8's hack battery
    found)."""
    cfg = recipe_config(recipe)
    tasks = swarm_worker.make_tasks(cfg, TASKS_PER_SEED, seed=SEEDS[0])
    step = cfg.algo.parl.anneal_steps // 2
    lam1, _ = parl_lambdas(step, cfg.algo.parl)
    assert lam1 > 0
    single = shaped(cfg, rollouts(cfg, SingleAgent(), tasks), step)
    productive = shaped(cfg, rollouts(cfg, IdleSpawnThenSerial(), tasks), step)
    _count_every_spawned_subagent(monkeypatch)
    spawned = shaped(cfg, rollouts(cfg, IdleSpawnThenSerial(), tasks), step)
    np.testing.assert_allclose(spawned - productive, lam1, rtol=0, atol=1e-12)
    assert (productive <= single).all() and (spawned > single).any()


def test_the_comparison_catches_an_r_parallel_that_does_not_saturate(monkeypatch):
    """The checks above can fail: paid per subagent spawned (no saturation at the task's width, no
    productivity test), the same hack out-earns the heuristic at the start of the schedule."""
    _count_every_spawned_subagent(monkeypatch)
    monkeypatch.setattr(rewards, "r_parallel", lambda spawned, width: spawned / width if width else 0.0)
    cfg = recipe_config("quickstart")
    tasks = swarm_worker.make_tasks(cfg, TASKS_PER_SEED, seed=SEEDS[0])
    hack, heur = rollouts(cfg, SpawnHack(), tasks), rollouts(cfg, make_policy(cfg, name="heuristic"), tasks)
    assert (shaped(cfg, hack, 0) > shaped(cfg, heur, 0)).all()
    assert (shaped(cfg, hack, cfg.algo.parl.anneal_steps) < shaped(cfg, heur, cfg.algo.parl.anneal_steps)).all()


def table(recipe: str) -> str:
    """Mean shaped return per policy at each schedule point (the numbers behind the tests)."""
    cfg, tasks, runs = episodes(recipe)
    names = ["hack_queued", "hack_idle", "heuristic", "single", "idle_spawn_then_serial"]
    rows = [f"{recipe}: {len(tasks)} tasks ({cfg.env.swarm.suite}, seeds {SEEDS}), "
            f"lambda1={cfg.algo.parl.lambda1} lambda2={cfg.algo.parl.lambda2} anneal_steps={cfg.algo.parl.anneal_steps}",
            "| step | lambda1 | lambda2 | " + " | ".join(names) + " |", "|" + "---|" * (3 + len(names))]
    for step in schedule(cfg):
        lam1, lam2 = parl_lambdas(step, cfg.algo.parl)
        means = [f"{shaped(cfg, runs[n], step).mean():.4f}" for n in names]
        rows.append(f"| {step} | {lam1:.4f} | {lam2:.4f} | " + " | ".join(means) + " |")
    return "\n".join(rows)


if __name__ == "__main__":
    for name in RECIPES:
        print(table(name), end="\n\n")
