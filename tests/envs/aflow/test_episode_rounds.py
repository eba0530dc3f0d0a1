"""Multi-round AFlow training episodes (env.aflow.episode_rounds): propose -> evaluate -> propose from the
result, one turn per round, anchor keys = the workflow each round proposed from, and the GiGPO step
groups they form across a group's episodes. Stand-in policy and evaluator (no servers)."""
import asyncio
import json
import os

import numpy as np
import pytest

from aflow_rl.envs.aflow.graph import Node, Workflow, workflow_hash
from aflow_rl.rollout.types import Trajectory, Turn
from tests.envs.aflow.test_search import ROOT, FakeEvaluate, FakePolicy


def _chain(parent: Workflow, tag: str) -> str:
    nodes = parent.nodes + [Node(id=tag, op="Custom", params={"instruction": tag}, inputs=[parent.output])]
    return json.dumps(Workflow(nodes=nodes, output=tag).to_dict())


def _score(wf: Workflow) -> float:
    return int(workflow_hash(wf)[:8], 16) / 2 ** 32  # FakeEvaluate's score


def _run(tmp_path, tiny_model_dir, monkeypatch, texts_for, rounds=2, episodes=2):
    from transformers import AutoTokenizer

    import workers.aflow as worker
    from aflow_rl.config import load_config
    from aflow_rl.envs.aflow import episode
    from aflow_rl.rollout.pool import make_episodes
    from aflow_rl.rollout.types import WorkerContext

    cfg = load_config(os.path.join(ROOT, "configs", "aflow.yaml"),
                      [f"run.dir={tmp_path}", "env.aflow.num_problems=10", f"env.aflow.episode_rounds={rounds}"])
    monkeypatch.setattr(episode, "make_evaluate", lambda a, executor, problems: FakeEvaluate())
    (task,) = worker.make_tasks(cfg, 1, 3)
    root = Workflow.from_yaml(task["parent_yaml"])
    policy = FakePolicy(texts_for(root))
    ctx = WorkerContext(config=cfg, urls={}, run_dir=str(tmp_path),
                        state={"aflow_ready": True, "actor_client": None, "policy_client": policy,
                               "tokenizer": AutoTokenizer.from_pretrained(tiny_model_dir)})

    async def run_all():
        return [await worker.run_episode(ep, ctx) for ep in make_episodes([task], episodes)]

    return root, asyncio.run(run_all())


def test_rounds_chain_from_the_better_result(tmp_path, tiny_model_dir, monkeypatch):
    from aflow_rl.envs.aflow.episode import anchor_group_fraction, later_round_group_fraction, rewards

    # Find a child that beats the root and one that does not, under the stand-in scores.
    def texts(root):
        rs = _score(root)
        better = next(t for t in (f"b{i}" for i in range(200)) if _score(Workflow.from_dict(json.loads(
            _chain(root, t)))) > rs)
        child = Workflow.from_dict(json.loads(_chain(root, better)))
        texts.root, texts.child = root, child
        # episode 0: a better child, then a grandchild from it; episode 1: broken twice (stays on the root)
        return [_chain(root, better), _chain(child, "g1"), "{broken", "{broken too"]

    root, (ep0, ep1) = _run(tmp_path, tiny_model_dir, monkeypatch, texts)
    child = texts.child
    assert [len(t.turns) for t in (ep0, ep1)] == [2, 2]
    assert [t.anchor_key for t in ep0.turns] == [workflow_hash(root), workflow_hash(child)]
    assert [t.anchor_key for t in ep1.turns] == [workflow_hash(root)] * 2
    # Round rewards: turn 0 carries round 0's as its step reward; the last round's is the terminal one.
    rs, cs = _score(root), _score(child)
    r0 = rewards(rs, cs, -0.1)
    assert ep0.turns[0].step_reward == pytest.approx(r0["r_perf"])
    assert ep0.turns[1].step_reward == 0.0
    gs = _score(Workflow.from_dict(json.loads(_chain(child, "g1"))))
    assert ep0.reward_components["r_perf"] == pytest.approx((gs - cs) + gs)
    assert ep0.metrics["episode_return"] == pytest.approx(r0["r_perf"] + (gs - cs) + gs)
    assert ep1.turns[0].step_reward == pytest.approx(-rs - 0.1)
    assert ep1.final_reward == pytest.approx(-rs - 0.1) and ep1.metrics["valid"] == 0.0
    assert ep0.metrics["episode_improvement"] == pytest.approx(max(gs, cs) - rs)
    # Step groups: the root state holds 3 of the 4 turns (ep0 round 0, ep1 rounds 0 and 1).
    assert anchor_group_fraction([ep0, ep1]) == pytest.approx(3 / 4)
    assert later_round_group_fraction([ep0, ep1]) == pytest.approx(1 / 2)


def test_a_child_no_better_than_its_parent_is_not_followed(tmp_path, tiny_model_dir, monkeypatch):
    def texts(root):
        rs = _score(root)
        worse = next(t for t in (f"w{i}" for i in range(200)) if _score(Workflow.from_dict(json.loads(
            _chain(root, t)))) <= rs)
        return [_chain(root, worse), _chain(root, "second")]

    root, (ep,) = _run(tmp_path, tiny_model_dir, monkeypatch, texts, episodes=1)
    assert [t.anchor_key for t in ep.turns] == [workflow_hash(root)] * 2
    assert [r["parent_hash"] for r in ep.info["rounds"]] == [workflow_hash(root)] * 2


def test_one_round_is_the_single_proposal_episode(tmp_path, tiny_model_dir, monkeypatch):
    root, eps = _run(tmp_path, tiny_model_dir, monkeypatch, lambda root: [_chain(root, "a"), _chain(root, "b")],
                     rounds=1)
    for ep in eps:
        assert len(ep.turns) == 1 and ep.turns[0].step_reward == 0.0
        assert ep.final_reward == pytest.approx(ep.metrics["episode_return"])


def _traj(group, keys):
    return Trajectory(episode_id=f"{group}/{keys}", group_id=group,
                      turns=[Turn(prompt_ids=[1], response_ids=[2], logprobs=[-1.0], anchor_key=k) for k in keys])


def test_anchor_group_fraction_matches_gigpo_step_groups():
    from aflow_rl.algos.advantages import gigpo
    from aflow_rl.envs.aflow.episode import anchor_group_fraction

    trajs = [_traj("g1", ["A", "B"]), _traj("g1", ["A", "C"]), _traj("g2", ["B", None]), _traj("g2", ["C", "C"])]
    # g1: A twice (2 turns in a group of 2), B and C alone; g2: B alone, None alone, C twice -> 4 of 8.
    assert anchor_group_fraction(trajs) == pytest.approx(4 / 8)
    # Cross-check: a turn has a non-zero step advantage only inside a step group of >= 2 with unequal returns;
    # with distinct returns, the turns with A^S != 0 are exactly those the fraction counts.
    rewards = np.array([1.0, 2.0, 3.0, 5.0, 7.0, 11.0, 13.0, 17.0])
    keys = [k for t in trajs for k in (turn.anchor_key for turn in t.turns)]
    a_e_only = gigpo(rewards, [0, 0, 1, 1, 2, 2, 3, 3], ["g1"] * 4 + ["g2"] * 4, [None] * 8, omega=1.0)
    full = gigpo(rewards, [0, 0, 1, 1, 2, 2, 3, 3], ["g1"] * 4 + ["g2"] * 4, keys, omega=1.0)
    in_groups = np.abs(full - a_e_only) > 1e-9
    assert in_groups.sum() / len(keys) == pytest.approx(anchor_group_fraction(trajs))
    assert anchor_group_fraction([]) == 0.0
