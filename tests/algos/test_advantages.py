"""Numeric tests of GRPO and GiGPO advantages against hand-computed values."""
import math

import numpy as np
import pytest
import torch

from aflow_rl.algos.advantages import from_trajectories, gigpo, grpo, valid_group_mask
from aflow_rl.config import AlgoConfig
from aflow_rl.rollout.types import Trajectory, Turn

EPS = 1e-6


# ---------------------------------------------------------------------------
# GRPO
# ---------------------------------------------------------------------------


def test_grpo_with_std_groups_of_one_and_equal_rewards():
    # group a: [1, 2, 3] mean 2, deviations -1, 0, 1, sample var (1+0+1)/(3-1) = 1, std 1
    # group b: [5, 5]   all equal: deviations 0 -> 0
    # group c: [7]      one member -> 0
    adv = grpo([1.0, 2.0, 3.0, 5.0, 5.0, 7.0], ["a", "a", "a", "b", "b", "c"])
    np.testing.assert_allclose(adv, [-1 / (1 + EPS), 0.0, 1 / (1 + EPS), 0.0, 0.0, 0.0], rtol=0, atol=1e-12)


def test_grpo_without_std_is_mean_centering():
    # group a: [1, 2, 3] - 2; group b: [5, 9] - 7 = -2, 2; group c: one member -> 0
    adv = grpo([1.0, 2.0, 3.0, 5.0, 9.0, 7.0], ["a", "a", "a", "b", "b", "c"], norm_std=False)
    np.testing.assert_allclose(adv, [-1.0, 0.0, 1.0, -2.0, 2.0, 0.0], rtol=0, atol=1e-12)


def test_grpo_std_is_sample_std_like_torch():
    # two groups of 4 and 3: ddof=1 (torch.std default). With ddof=0 the values
    # would be larger by sqrt(n/(n-1)) (1.155 and 1.225), which this would catch.
    rng = np.random.default_rng(0)
    rewards = rng.normal(size=7)
    gids = [0, 0, 0, 0, 1, 1, 1]
    expected = np.empty(7)
    for sl in (slice(0, 4), slice(4, 7)):
        t = torch.tensor(rewards[sl], dtype=torch.float64)
        expected[sl] = ((t - t.mean()) / (t.std() + EPS)).numpy()
    np.testing.assert_allclose(grpo(rewards, gids), expected, rtol=1e-12, atol=1e-12)
    ddof0 = np.empty(7)
    for sl in (slice(0, 4), slice(4, 7)):
        ddof0[sl] = (rewards[sl] - rewards[sl].mean()) / (rewards[sl].std(ddof=0) + EPS)
    assert not np.allclose(grpo(rewards, gids), ddof0)


def test_grpo_degenerate_groups_are_exactly_zero_even_with_eps_zero():
    # [0.1, 0.1, 0.1]: float mean 0.10000000000000002 != 0.1, so dev/std would be ~-0.8 without the guard
    # [4.0]: one member, 0/0 without the guard; [1, 3]: dev -1, +1, std sqrt(2) -> -+1/sqrt(2)
    adv = grpo([0.1, 0.1, 0.1, 4.0, 1.0, 3.0], ["a", "a", "a", "b", "c", "c"], eps=0.0)
    np.testing.assert_array_equal(adv[:4], [0.0, 0.0, 0.0, 0.0])
    np.testing.assert_allclose(adv[4:], [-1 / math.sqrt(2), 1 / math.sqrt(2)], rtol=1e-12)


def test_grpo_mixed_and_interleaved_ids_are_compared_by_equality():
    # int 1 and str "1" are different groups; members need not be adjacent.
    # group 1:   rewards [0, 2]   mean 1,  dev -1, +1, std sqrt(2)
    # group "1": rewards [10, 20] mean 15, dev -5, +5, std 5*sqrt(2)
    adv = grpo([0.0, 10.0, 2.0, 20.0], [1, "1", 1, "1"])
    s2 = math.sqrt(2)
    np.testing.assert_allclose(adv, [-1 / (s2 + EPS), -5 / (5 * s2 + EPS), 1 / (s2 + EPS), 5 / (5 * s2 + EPS)],
                               rtol=0, atol=1e-12)
    # numpy string arrays work the same as lists
    np.testing.assert_allclose(grpo(np.array([0.0, 4.0]), np.array(["x", "x"]), norm_std=False), [-2.0, 2.0])


def test_grpo_empty_and_validation():
    assert grpo([], []).shape == (0,)
    with pytest.raises(ValueError, match="group_ids has 2 entries but there are 3"):
        grpo([1.0, 2.0, 3.0], ["a", "a"])
    with pytest.raises(ValueError, match="not finite"):
        grpo([1.0, float("nan")], ["a", "a"])
    with pytest.raises(ValueError, match="1-D"):
        grpo([[1.0, 2.0]], ["a"])
    with pytest.raises(ValueError, match="not hashable"):
        grpo([1.0, 2.0], [["a"], ["a"]])


# ---------------------------------------------------------------------------
# GiGPO: one hand-built batch
# ---------------------------------------------------------------------------
#
# task group "A" (3 trajectories of lengths 3, 2, 1), task group "B" (2 of length 2):
#
#   row  traj  group  anchor  r   R_t (gamma=0.5)
#   0    a1    A      s0      0   0 + 0.5*2 = 1
#   1    a1    A      s1      1   1 + 0.5*2 = 2
#   2    a1    A      s2      2   2
#   3    a2    A      s0      0   0 + 0.5*3 = 1.5
#   4    a2    A      s1      3   3
#   5    a3    A      s0      1   1
#   6    b1    B      s0      2   2 + 0.5*0 = 2      <- "s0" also in A: must NOT merge
#   7    b1    B      x       0   0
#   8    b2    B      s0      0   0
#   9    b2    B      y       0   0
#
# Episode returns (each trajectory once): a1 = 3, a2 = 3, a3 = 1, b1 = 2, b2 = 0.
#   A: mean 7/3, dev +2/3, +2/3, -4/3, var (4/9+4/9+16/9)/2 = 4/3, std 2/sqrt(3)
#      (counting once per step would give mean (3*3+3*2+1)/6 = 8/3 instead)
#   B: mean 1, dev +1, -1, var 2, std sqrt(2)
# Step groups:
#   A/s0: R_t 1, 1.5, 1 (rows 0, 3, 5): mean 7/6, dev -1/6, +1/3, -1/6, var (1/36+4/36+1/36)/2 = 1/12
#   A/s1: R_t 2, 3 (rows 1, 4): mean 2.5, dev -0.5, +0.5, var 0.5
#   A/s2: row 2 alone -> A^S = 0
#   B/s0: R_t 2, 0 (rows 6, 8): mean 1, dev +1, -1, var 2
#         (merged with A/s0 the mean would be (1+1.5+1+2+0)/5 = 1.1)
#   B/x, B/y: rows 7, 9 alone -> A^S = 0

STEP_R = [0, 1, 2, 0, 3, 1, 2, 0, 0, 0]
TRAJ = ["a1", "a1", "a1", "a2", "a2", "a3", "b1", "b1", "b2", "b2"]
GROUP = ["A", "A", "A", "A", "A", "A", "B", "B", "B", "B"]
ANCHOR = ["s0", "s1", "s2", "s0", "s1", "s0", "s0", "x", "s0", "y"]

# mean_norm (F = 1): per row A^E and A^S from the table above
AE_MEAN = np.array([2 / 3, 2 / 3, 2 / 3, 2 / 3, 2 / 3, -4 / 3, 1, 1, -1, -1])
AS_MEAN = np.array([-1 / 6, -0.5, 0, 1 / 3, 0.5, -1 / 6, 1, 0, -1, 0])


def test_gigpo_mean_norm_hand_example():
    adv = gigpo(STEP_R, TRAJ, GROUP, ANCHOR, gamma=0.5, omega=1.0, mode="mean_norm")
    # A = A^E + A^S:
    #   a1: 2/3-1/6 = 1/2, 2/3-1/2 = 1/6, 2/3+0 = 2/3;  a2: 2/3+1/3 = 1, 2/3+1/2 = 7/6
    #   a3: -4/3-1/6 = -3/2;  b1: 1+1 = 2, 1+0 = 1;  b2: -1-1 = -2, -1+0 = -1
    np.testing.assert_allclose(adv, [1 / 2, 1 / 6, 2 / 3, 1, 7 / 6, -3 / 2, 2, 1, -2, -1], rtol=0, atol=1e-12)


def test_gigpo_omega_scales_step_term_only():
    # omega = 0.5: A = A^E + 0.5 * A^S, e.g. row 0: 2/3 - 1/12 = 7/12, row 6: 1 + 0.5 = 1.5
    adv = gigpo(STEP_R, TRAJ, GROUP, ANCHOR, gamma=0.5, omega=0.5)
    np.testing.assert_allclose(adv, AE_MEAN + 0.5 * AS_MEAN, rtol=0, atol=1e-12)
    np.testing.assert_allclose(adv[[0, 6]], [7 / 12, 1.5], rtol=0, atol=1e-12)
    # omega = 0: the episode advantage alone, equal to GRPO without std on the returns
    adv0 = gigpo(STEP_R, TRAJ, GROUP, ANCHOR, gamma=0.5, omega=0.0)
    np.testing.assert_allclose(adv0, AE_MEAN, rtol=0, atol=1e-12)
    np.testing.assert_allclose(adv0[[0, 3, 5, 6, 8]], grpo([3, 3, 1, 2, 0], list("AAABB"), norm_std=False))


def test_gigpo_mean_std_norm_hand_example():
    adv = gigpo(STEP_R, TRAJ, GROUP, ANCHOR, gamma=0.5, omega=1.0, mode="mean_std_norm")
    fa, fb = 2 / math.sqrt(3) + EPS, math.sqrt(2) + EPS                  # episode F for A and B
    fs0, fs1, fb0 = math.sqrt(1 / 12) + EPS, math.sqrt(0.5) + EPS, math.sqrt(2) + EPS  # step F
    ae = np.array([2 / 3 / fa] * 5 + [-4 / 3 / fa] + [1 / fb] * 2 + [-1 / fb] * 2)
    a_s = np.array([-1 / 6 / fs0, -0.5 / fs1, 0.0, 1 / 3 / fs0, 0.5 / fs1, -1 / 6 / fs0,
                    1 / fb0, 0.0, -1 / fb0, 0.0])
    np.testing.assert_allclose(adv, ae + a_s, rtol=1e-12, atol=1e-12)
    # spot values: row 0 = (2/3)/(2/sqrt3) + (-1/6)/sqrt(1/12) = sqrt3/3 - sqrt3/3 = 0 (up to eps)
    #              row 3 = sqrt3/3 + (1/3)*sqrt(12) = sqrt3/3 + 2*sqrt3/3 = sqrt3
    np.testing.assert_allclose(adv[[0, 3]], [0.0, math.sqrt(3)], atol=1e-5)


def test_gigpo_discounting_gamma_one_and_zero():
    # one task group, two trajectories of length 3 visiting the same anchors t0, t1, t2
    # x: r = [1, 0, 2], y: r = [0, 0, 0]; episode returns 3 and 0 -> A^E = +1.5, -1.5
    r = [1, 0, 2, 0, 0, 0]
    tr = ["x"] * 3 + ["y"] * 3
    g = ["G"] * 6
    k = ["t0", "t1", "t2"] * 2
    # gamma = 1: R_t(x) = [3, 2, 2], R_t(y) = 0 -> A^S(x) = [1.5, 1, 1], A^S(y) = -A^S(x)
    np.testing.assert_allclose(gigpo(r, tr, g, k, gamma=1.0, omega=0.0), [1.5] * 3 + [-1.5] * 3, atol=1e-12)
    np.testing.assert_allclose(gigpo(r, tr, g, k, gamma=1.0), [3, 2.5, 2.5, -3, -2.5, -2.5], atol=1e-12)
    # gamma = 0.9: R_t(x) = [1 + 0.9*1.8, 0 + 0.9*2, 2] = [2.62, 1.8, 2] -> A^S(x) = [1.31, 0.9, 1]
    np.testing.assert_allclose(gigpo(r, tr, g, k, gamma=0.9), [2.81, 2.4, 2.5, -2.81, -2.4, -2.5], atol=1e-12)
    # gamma = 0: R_t = r_t -> A^S(x) = [0.5, 0, 1]
    np.testing.assert_allclose(gigpo(r, tr, g, k, gamma=0.0), [2.0, 1.5, 2.5, -2.0, -1.5, -2.5], atol=1e-12)


def test_gigpo_single_trajectory_group_and_none_anchor():
    # group P has one trajectory -> A^E = 0, and its step groups all have one member -> A^S = 0
    # group Q: q1 r = [1, 1], q2 r = [0, 0]; anchors: q1 (None, "k"), q2 (None, "k")
    #   returns 2 and 0 -> A^E = +1, -1; gamma=1: R_t q1 = [2, 1], q2 = [0, 0]
    #   None anchors never group (row 2 and 4 alone -> 0); "k": 1 vs 0 -> +0.5, -0.5
    r = [5, 7, 1, 1, 0, 0]
    tr = ["p", "p", "q1", "q1", "q2", "q2"]
    g = ["P", "P", "Q", "Q", "Q", "Q"]
    k = ["u", "v", None, "k", None, "k"]
    np.testing.assert_allclose(gigpo(r, tr, g, k), [0, 0, 1, 1.5, -1, -1.5], atol=1e-12)
    np.testing.assert_allclose(gigpo(r, tr, g, k, mode="mean_std_norm")[:2], [0, 0], atol=1e-12)


def test_gigpo_is_equivariant_to_trajectory_order_and_id_types():
    # reorder whole trajectories (b2, a3, a1, b1, a2) and use int/tuple ids: same advantages, permuted
    blocks = {"a1": [0, 1, 2], "a2": [3, 4], "a3": [5], "b1": [6, 7], "b2": [8, 9]}
    perm = blocks["b2"] + blocks["a3"] + blocks["a1"] + blocks["b1"] + blocks["a2"]
    tid = {"a1": 11, "a2": 12, "a3": 13, "b1": 21, "b2": 22}
    adv = gigpo([STEP_R[i] for i in perm], [tid[TRAJ[i]] for i in perm], [ord(GROUP[i]) for i in perm],
                [(ANCHOR[i], 0) for i in perm], gamma=0.5, mode="mean_std_norm")
    ref = gigpo(STEP_R, TRAJ, GROUP, ANCHOR, gamma=0.5, mode="mean_std_norm")
    np.testing.assert_allclose(adv, ref[perm], rtol=1e-12, atol=1e-12)


def test_gigpo_validation_errors():
    ok = dict(step_rewards=[1.0, 2.0], traj_ids=["t", "t"], group_ids=["g", "g"], anchor_keys=["a", "b"])
    assert gigpo([], [], [], []).shape == (0,)
    with pytest.raises(ValueError, match="traj_ids has 1 entries"):
        gigpo(**{**ok, "traj_ids": ["t"]})
    with pytest.raises(ValueError, match="anchor_keys has 3 entries"):
        gigpo(**{**ok, "anchor_keys": ["a", "b", "c"]})
    with pytest.raises(ValueError, match="trajectory 't' are not contiguous"):
        gigpo([1.0, 2.0, 3.0], ["t", "u", "t"], ["g"] * 3, ["a", "b", "c"])
    with pytest.raises(ValueError, match="exactly one task group"):
        gigpo(**{**ok, "group_ids": ["g", "h"]})
    with pytest.raises(ValueError, match="mode must be one of"):
        gigpo(**ok, mode="std")
    with pytest.raises(ValueError, match="gamma must be in"):
        gigpo(**ok, gamma=1.5)
    with pytest.raises(ValueError, match="not finite"):
        gigpo(**{**ok, "step_rewards": [1.0, float("inf")]})
    with pytest.raises(ValueError, match=r"anchor_keys\[1\] = \['b'\] is not hashable"):
        gigpo(**{**ok, "anchor_keys": ["a", ["b"]]})


# ---------------------------------------------------------------------------
# Trainer-facing helpers
# ---------------------------------------------------------------------------


def test_valid_group_mask_drops_failed_and_small_groups():
    # a: 2 ok of 3 -> keep the 2 ok; b: 1 ok of 2 -> drop the group; c: 2 ok -> keep
    mask = valid_group_mask(list("aaabbcc"), [True, False, True, True, False, True, True])
    np.testing.assert_array_equal(mask, [True, False, True, False, False, True, True])


def _traj(eid, gid, step_rewards, anchors):
    turns = [Turn(prompt_ids=[1], response_ids=[2], logprobs=[-0.5], anchor_key=a, step_reward=s)
             for s, a in zip(step_rewards, anchors)]
    return Trajectory(episode_id=eid, group_id=gid, turns=turns)


def test_from_trajectories_grpo_broadcasts_episode_advantage():
    # returns = step sums + terminal: t1 = 0.5 + 1 = 1.5, t2 = 0 + 0 = 0, t3 = 0 + 3 = 3 (group g)
    # mean 1.5, dev 0, -1.5, 1.5, sample std 1.5 -> A = 0, -1, 1 (up to eps)
    trajs = [_traj("t1", "g", [0.5, 0.0], ["s", "s"]), _traj("t2", "g", [0.0], ["s"]),
             _traj("t3", "g", [0.0, 0.0, 0.0], ["s"] * 3)]
    out = from_trajectories(AlgoConfig(adv_estimator="grpo"), trajs, [1.0, 0.0, 3.0])
    assert [len(a) for a in out] == [2, 1, 3]
    np.testing.assert_allclose(np.concatenate(out), [0, 0, -1, 1, 1, 1], atol=1e-5)


def test_from_trajectories_gigpo_puts_terminal_reward_on_last_turn():
    # rows: t1 [0, 0+1], t2 [0+3]; anchors t1 (s0, s1), t2 (s0); gamma = 0.5
    # returns 1 and 3 -> A^E = -1, +1; R_t: t1 [0.5*1, 1] = [0.5, 1], t2 [3]
    # s0: 0.5 vs 3 -> mean 1.75, dev -1.25, +1.25; s1 alone -> 0
    # (terminal reward on the first turn would give R_t t1 = [1, 0] and s0 devs -1, +1)
    trajs = [_traj("t1", "g", [0.0, 0.0], ["s0", "s1"]), _traj("t2", "g", [0.0], ["s0"])]
    out = from_trajectories(AlgoConfig(adv_estimator="gigpo", gamma=0.5, omega=1.0), trajs, [1.0, 3.0])
    np.testing.assert_allclose(out[0], [-2.25, -1], atol=1e-12)
    np.testing.assert_allclose(out[1], [2.25], atol=1e-12)
    assert from_trajectories(AlgoConfig(), [], []) == []
    with pytest.raises(ValueError, match="has no turns"):
        from_trajectories(AlgoConfig(), [Trajectory(episode_id="e", group_id="g")], [1.0])


def test_gigpo_repeated_state_within_a_trajectory_joins_its_anchor_group():
    # one trajectory revisits state "s" (a loop), another visits it once; gamma = 1, one task group
    # z1: r = [0, 0, 1], anchors (s, s, e) -> R_t = [1, 1, 1], return 1
    # z2: r = [0, 4],    anchors (s, f)    -> R_t = [4, 4],    return 4
    # A^E = -1.5, +1.5; group s: R_t 1, 1, 4 (rows 0, 1, 3): mean 2, dev -1, -1, +2; e, f alone -> 0
    adv = gigpo([0, 0, 1, 0, 4], ["z1"] * 3 + ["z2"] * 2, ["G"] * 5, ["s", "s", "e", "s", "f"])
    np.testing.assert_allclose(adv, [-2.5, -2.5, -1.5, 3.5, 1.5], atol=1e-12)
