"""Issue 3's acceptance as written: the same swarm episodes (heuristic policy, simulated subagents)
through the real pool give the same results on every backend, dask's LocalCluster included."""
import pytest

from aflow_rl.config import load_config
from aflow_rl.rollout.pool import RolloutPool, make_episodes
from aflow_rl.rollout.types import WorkerContext
from workers.swarm import make_tasks


def run(backend, tmp_path, **extra):
    cfg = load_config(None, ["env.swarm.policy=heuristic", "env.swarm.subagents=simulated", "env.swarm.suite=mixed",
                             f"rollout.backend={backend}", "rollout.workers=2", "rollout.trace=false",
                             *[f"rollout.{k}={v}" for k, v in extra.items()]])
    episodes = make_episodes(make_tasks(cfg, 4, seed=11), group_size=3, prefix="s0-")
    with RolloutPool(cfg.rollout, WorkerContext(config=cfg, run_dir=str(tmp_path))) as pool:
        out = list(pool.run(episodes))
    assert len(out) == 12 and all(t.ok for t in out)
    # Everything that depends on the seeds: rewards, metrics, answer.
    return {t.episode_id: (t.reward_components, t.metrics, t.info["answer"]) for t in out}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return run("sequential", tmp_path_factory.mktemp("ref"))


@pytest.mark.parametrize("backend", ["threading", "loky"])
def test_local_backends_match_sequential(backend, reference, tmp_path):
    assert run(backend, tmp_path) == reference


def test_dask_local_cluster_matches_sequential(reference, tmp_path):
    distributed = pytest.importorskip("distributed")
    with distributed.LocalCluster(processes=True, n_workers=2, threads_per_worker=1, dashboard_address=":0") as c:
        assert run("dask", tmp_path, dask_address=c.scheduler_address) == reference
