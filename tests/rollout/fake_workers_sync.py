"""The fake worker module of tests/rollout/fake_workers.py with a plain (sync) run_episode."""
from tests.rollout.fake_workers import init_worker, make_tasks  # noqa: F401  (the worker module contract)
from tests.rollout.fake_workers import run_episode_sync as run_episode  # noqa: F401
