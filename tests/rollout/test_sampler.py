"""The task stream resumes exactly where it stopped."""
import pytest

from aflow_rl.config import load_config
from aflow_rl.rollout.sampler import TaskSampler
from workers.swarm import make_tasks


def test_resumed_sampler_draws_the_same_tasks():
    cfg = load_config(None)
    full = TaskSampler(make_tasks, cfg, seed=7)
    batches = [full.next(3) for _ in range(4)]
    assert full.state_dict() == {"seed": 7, "position": 12}

    resumed = TaskSampler(make_tasks, cfg, seed=0)
    resumed.load_state_dict({"seed": 7, "position": 6})
    assert [resumed.next(3) for _ in range(2)] == batches[2:]
    # Different batches, and a different run seed gives different tasks.
    assert batches[0] != batches[1]
    assert TaskSampler(make_tasks, cfg, seed=8).next(3) != batches[0]


def test_factory_returning_the_wrong_count_is_an_error():
    with pytest.raises(RuntimeError, match="returned 1 tasks, expected 3"):
        TaskSampler(lambda cfg, n, seed: [{}], None, seed=0).next(3)
