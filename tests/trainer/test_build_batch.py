"""build_batch: one step's episodes -> the batch every rank trains on. Hand-built trajectories, every
number worked out by hand from the formulas (GRPO arXiv 2402.03300, GiGPO arXiv 2505.10978, PARL)."""
import math

import numpy as np
import pytest

from aflow_rl.config import AlgoConfig, Config, ParlConfig
from aflow_rl.rollout.types import Trajectory, Turn
from aflow_rl.trainer.batch import build_batch


def traj(eid, gid, step_rewards, components, anchors=None, status="ok", metrics=None):
    """An episode with one turn per step reward (distinct response ids, so turns can be traced)."""
    anchors = anchors or [None] * len(step_rewards)
    turns = [Turn(prompt_ids=[1], response_ids=[100 + 10 * int(eid[1:]) + k], logprobs=[-0.5],
                  step_reward=r, anchor_key=a) for k, (r, a) in enumerate(zip(step_rewards, anchors))]
    return Trajectory(episode_id=eid, group_id=gid, turns=turns, reward_components=components,
                      status=status, metrics=metrics or {})


def config(**algo) -> Config:
    cfg = Config()
    # lambda1 = 0.5 * (1 - 5/10) = 0.25 and lambda2 = 0.2 * 0.5 = 0.1 at step 5
    cfg.algo = AlgoConfig(parl=ParlConfig(lambda1=0.5, lambda2=0.2, anneal_steps=10), **algo)
    return cfg


def grpo_episodes():
    """Group g: shaped returns [1, 0, 0, 1] at step 5, each reached differently:
    e0: 0.25 * 0.4 (r_parallel) + 1.1 (r_perf) - 0.2 (format, also placed on its first turn) = 1.0
    e1: r_perf 0, a step reward of 0.3 the env placed on its turn and did not report as a component = 0
    e2: nothing = 0;  e3: 0.1 * 5 (r_finish) + 0.5 (r_perf) = 1.0
    Group h: e4 ok, e5 failed -> one ok member left, the group is dropped.
    Group k: e6, e7 ok, e8 failed, e9 ok without turns -> e6 and e7 kept (rewards 2 and 0)."""
    return [traj("e0", "g", [-0.2, 0.0], {"r_parallel": 0.4, "r_perf": 1.1, "format": -0.2}, metrics={"n": 2}),
            traj("e1", "g", [0.3], {"r_perf": 0.0}, metrics={"n": 4}),
            traj("e2", "g", [0.0], {}),
            traj("e3", "g", [0.0, 0.0, 0.0], {"r_finish": 5.0, "r_perf": 0.5}),
            traj("e4", "h", [0.0], {"r_perf": 1.0}),
            Trajectory.failed("e5", "h", 2, "RuntimeError: boom"),
            traj("e6", "k", [0.0], {"r_perf": 2.0}),
            traj("e7", "k", [0.0], {"r_perf": 0.0}),
            Trajectory.failed("e8", "k", 2, "RuntimeError: boom"),
            Trajectory(episode_id="e9", group_id="k", reward_components={"r_perf": 9.0})]


def test_grpo_terminal_rewards_advantages_and_dropped_groups():
    batch = build_batch(grpo_episodes(), 5, config(adv_estimator="grpo", norm_std=True))
    # terminal = shaped - sum(step rewards): e0 1.0 + 0.2, e1 0 - 0.3, e2 0, e3 1.0; e6 2, e7 0
    np.testing.assert_allclose(batch.terminal_rewards, [1.2, -0.3, 0.0, 1.0, 2.0, 0.0], atol=1e-12)
    # returns [1, 0, 0, 1]: mean 0.5, sample std sqrt(1/3) -> A = +-0.5 / (sqrt(1/3) + 1e-6)
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    # group k: returns [2, 0]: mean 1, sample std sqrt(2) -> +-1 / (sqrt(2) + 1e-6)
    b = 1.0 / (math.sqrt(2) + 1e-6)
    # one advantage per turn, episode by episode: e0 (2 turns), e1, e2, e3 (3 turns), e6, e7
    np.testing.assert_allclose(batch.advantages, [a, a, -a, -a, a, a, a, b, -b], rtol=1e-12)
    assert a == pytest.approx(0.866024, abs=1e-6)
    ids = [int(t.response_ids[0]) for t in batch.turns]
    assert ids == [100, 101, 110, 120, 130, 131, 132, 160, 170]   # e4 (group h), e5, e8, e9 left out
    assert batch.grammar_masks == [None] * 9


def test_batch_stats_cover_every_ok_episode_and_count_the_left_out():
    batch = build_batch(grpo_episodes(), 5, config())
    s = batch.stats
    assert s["charts/parl_lambda1"] == pytest.approx(0.25) and s["charts/parl_lambda2"] == pytest.approx(0.1)
    assert s["pool/skipped_episodes"] == 4.0                      # e4, e5, e8, e9
    # rewards/mean is over every ok episode (the dropped e4 and turnless e9 too): shaped
    # e0 1, e1 0, e2 0, e3 1, e4 1, e6 2, e7 0, e9 9 -> mean 14/8
    shaped = np.array([1, 0, 0, 1, 1, 2, 0, 9], dtype=float)
    assert s["rewards/mean"] == pytest.approx(shaped.mean()) and s["rewards/std"] == pytest.approx(shaped.std(ddof=1))
    assert s["rewards/r_perf/mean"] == pytest.approx((1.1 + 0 + 0.5 + 1 + 2 + 0 + 9) / 7)
    assert s["episode/n"] == pytest.approx(3.0)


def test_gigpo_keeps_step_rewards_on_their_turns_and_adds_the_terminal_to_the_last():
    # t1: step rewards [-0.5, 0], shaped 1.5 - 0.5 = 1.0 -> terminal 1.5, rows [-0.5, 1.5]
    # t2: shaped 3 -> rows [3]. gamma 0.5: R_t t1 = [-0.5 + 0.5 * 1.5, 1.5] = [0.25, 1.5], t2 [3]
    # episode returns 1 and 3 -> A^E = -1, +1 (mean_norm); anchor s0: 0.25 vs 3 -> -1.375, +1.375;
    # s1 alone -> 0.  A = A^E + A^S: t1 [-2.375, -1], t2 [2.375]
    trajs = [traj("e1", "g", [-0.5, 0.0], {"r_perf": 1.5, "format": -0.5}, anchors=["s0", "s1"]),
             traj("e2", "g", [0.0], {"r_perf": 3.0}, anchors=["s0"])]
    batch = build_batch(trajs, 0, config(adv_estimator="gigpo", gamma=0.5, omega=1.0, gigpo_mode="mean_norm"))
    np.testing.assert_allclose(batch.terminal_rewards, [1.5, 3.0], atol=1e-12)
    np.testing.assert_allclose(batch.advantages, [-2.375, -1.0, 2.375], atol=1e-12)
    # step groups: s0 holds 2 of the 3 turns, s1 is alone
    assert batch.stats["gigpo/step_group_fraction"] == pytest.approx(2 / 3)


def test_step_group_fraction_counts_turns_sharing_an_anchor_within_their_group():
    from aflow_rl.algos.advantages import step_group_fraction

    trajs = [traj("e1", "g", [0, 0, 0], {}, anchors=["a", "b", None]),
             traj("e2", "g", [0, 0], {}, anchors=["a", "c"]),
             traj("e3", "h", [0], {}, anchors=["b"])]       # same key, another group: not b's group
    assert step_group_fraction(trajs) == pytest.approx(2 / 6)  # only the two "a" turns of group g
    assert step_group_fraction([]) == 0.0
    # GRPO batches report it too (no anchors in grpo_episodes: no step groups)
    assert build_batch(grpo_episodes(), 5, config()).stats["gigpo/step_group_fraction"] == 0.0


def test_a_step_with_no_valid_group_gives_an_empty_batch():
    trajs = [traj("e1", "g", [0.0], {"r_perf": 1.0}), Trajectory.failed("e2", "g", 2, "x"),
             traj("e3", "h", [0.0], {"r_perf": 1.0})]
    batch = build_batch(trajs, 0, config())
    assert batch.turns == [] and batch.advantages.shape == (0,) and batch.grammar_masks == []
    assert batch.stats["pool/skipped_episodes"] == 3.0 and batch.stats["rewards/mean"] == 1.0


def test_turns_with_a_grammar_need_a_backend():
    trajs = [traj("e1", "g", [0.0], {"r_perf": 1.0}), traj("e2", "g", [0.0], {})]
    trajs[0].turns[0].grammar = {"regex": "(yes|no)"}
    with pytest.raises(ValueError, match="no GrammarBackend was given"):
        build_batch(trajs, 0, config())


def test_grammar_masks_are_the_servers_rebuilt(tiny_model_dir):
    from transformers import AutoTokenizer

    from aflow_rl.serving.grammar import GrammarBackend, grammar_bitmasks

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    backend = GrammarBackend.from_pretrained(tiny_model_dir)
    grammar = {"regex": "(yes|no)"}
    trajs = []
    for i, word in enumerate(["yes", "no"]):
        resp = tok.encode(word, add_special_tokens=False) + [tok.eos_token_id]
        turn = Turn(prompt_ids=[5], response_ids=resp, logprobs=[0.0] * len(resp), grammar=grammar)
        trajs.append(Trajectory(episode_id=f"e{i}", group_id="g", turns=[turn], reward_components={"r_perf": i}))
    batch = build_batch(trajs, 0, config(), backend)
    for turn, mask in zip(batch.turns, batch.grammar_masks):
        assert mask.tolist() == grammar_bitmasks(grammar, turn.response_ids, backend=backend).tolist()
