"""Numeric tests of PARL shaping: linear annealing of lambda1, lambda2 and the shaped reward."""
import numpy as np
import pytest

from aflow_rl.algos.parl import parl_lambdas, shaped_reward, shaped_rewards
from aflow_rl.config import ParlConfig
from aflow_rl.rollout.types import Trajectory

CFG = ParlConfig(lambda1=0.4, lambda2=0.2, anneal_steps=10)


@pytest.mark.parametrize("step, expected", [
    (0, (0.4, 0.2)),     # initial values
    (2, (0.32, 0.16)),   # factor 1 - 2/10 = 0.8
    (5, (0.2, 0.1)),     # half-way: factor 0.5
    (10, (0.0, 0.0)),    # end of annealing
    (15, (0.0, 0.0)),    # beyond: stays 0, never negative
])
def test_parl_lambdas_anneal_linearly_to_zero(step, expected):
    np.testing.assert_allclose(parl_lambdas(step, CFG), expected, rtol=0, atol=1e-12)


def test_parl_lambdas_zero_anneal_steps_and_bad_step():
    np.testing.assert_allclose(parl_lambdas(0, ParlConfig(lambda1=0.4, lambda2=0.2, anneal_steps=0)), (0.0, 0.0))
    with pytest.raises(ValueError, match="step must be >= 0"):
        parl_lambdas(-1, CFG)
    with pytest.raises(ValueError, match="anneal_steps must be >= 0"):
        parl_lambdas(0, ParlConfig(anneal_steps=-5))


def test_shaped_reward_weights_components():
    comps = {"r_perf": 1.0, "r_parallel": 0.5, "r_finish": 0.25, "format": -0.1}
    # step 5: lambdas (0.2, 0.1): 0.2*0.5 + 0.1*0.25 + 1.0 - 0.1 = 0.1 + 0.025 + 0.9 = 1.025
    np.testing.assert_allclose(shaped_reward(comps, 5, CFG), 1.025, rtol=0, atol=1e-12)
    # step 0: 0.4*0.5 + 0.2*0.25 + 1.0 - 0.1 = 0.2 + 0.05 + 0.9 = 1.15
    np.testing.assert_allclose(shaped_reward(comps, 0, CFG), 1.15, rtol=0, atol=1e-12)
    # after annealing only r_perf + format remain: 1.0 - 0.1 = 0.9 (format is never annealed)
    np.testing.assert_allclose(shaped_reward(comps, 20, CFG), 0.9, rtol=0, atol=1e-12)


def test_shaped_reward_missing_components_count_zero():
    # only r_perf: 2.0; only r_parallel at step 0: 0.4 * 3 = 1.2; unknown keys are ignored
    np.testing.assert_allclose(shaped_reward({"r_perf": 2.0}, 0, CFG), 2.0, rtol=0, atol=1e-12)
    np.testing.assert_allclose(shaped_reward({"r_parallel": 3.0, "latency": 99.0}, 0, CFG), 1.2, rtol=0, atol=1e-12)
    assert shaped_reward({}, 0, CFG) == 0.0


def test_shaped_rewards_over_trajectories_matches_scalar():
    comps = [{"r_perf": 1.0, "r_parallel": 0.5, "r_finish": 0.25, "format": -0.1},
             {"r_perf": 0.0, "r_finish": 1.0},
             {}]
    trajs = [Trajectory(episode_id=f"e{i}", group_id="g", reward_components=c) for i, c in enumerate(comps)]
    # step 5, lambdas (0.2, 0.1): [1.025, 0.1*1.0 = 0.1, 0]
    np.testing.assert_allclose(shaped_rewards(trajs, 5, CFG), [1.025, 0.1, 0.0], rtol=0, atol=1e-12)
    np.testing.assert_allclose(shaped_rewards(trajs, 3, CFG), [shaped_reward(c, 3, CFG) for c in comps],
                               rtol=0, atol=1e-12)
    assert shaped_rewards([], 0, CFG).shape == (0,)
