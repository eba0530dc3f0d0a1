"""A random tiny model as the orchestrator, through the embedded server: penalised, never crashing."""
import asyncio
import importlib.util

import pytest

from aflow_rl.config import load_config
from aflow_rl.rollout.types import WorkerContext

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("aflow_rl.serving.embedded") is None
    or importlib.util.find_spec("aflow_rl.serving.manager") is None,
    reason="needs the embedded server and ServerManager")


def test_random_tiny_model_episodes(tiny_model_dir, tmp_path):
    from aflow_rl.serving.manager import ServerManager
    from workers import swarm as swarm_worker

    base = ["env.swarm.policy=model", "env.swarm.max_steps=3", "env.max_new_tokens=16",
            "serving.policy.backend=embedded", f"serving.policy.model_path={tiny_model_dir}",
            "serving.actor.backend=none", f"run.dir={tmp_path}"]
    with ServerManager(load_config(None, base).serving, str(tmp_path), roles=("policy",)) as servers:
        for constrained in ("false", "true"):
            cfg = load_config(None, base + [f"env.swarm.action_schema={constrained}"])
            ctx = WorkerContext(config=cfg, urls=servers.all_urls(), run_dir=str(tmp_path))
            swarm_worker.init_worker(ctx)
            tasks = swarm_worker.make_tasks(cfg, 2 if constrained == "false" else 1, seed=0)

            async def both():
                try:
                    return await asyncio.gather(*(swarm_worker.run_episode(t, ctx) for t in tasks))
                finally:
                    await ctx.state["policy_client"].aclose()

            for traj in asyncio.run(both()):
                assert traj.status == "ok"
                n_turns = len(traj.turns)
                assert 1 <= n_turns <= 3 and traj.metrics["steps"] == n_turns
                invalid = traj.metrics["invalid_actions"]
                assert traj.reward_components["format"] == pytest.approx(-0.1 * invalid)
                assert sum(traj.step_rewards) == pytest.approx(traj.final_reward)
                for turn in traj.turns:
                    assert len(turn.response_ids) == len(turn.logprobs) > 0
                    assert (turn.grammar is not None) == (constrained == "true")
                    assert turn.anchor_key
                if constrained == "false":
                    # a random model writing free text does not produce valid actions
                    assert invalid == n_turns and traj.final_reward < 0
