"""``python -m aflow_rl.bench.proposals`` and what it is built on: ``optimizer.judge`` (a proposal's verdict
before anything runs) and ``PolicyProposer.seeded`` (per-request sampling seeds)."""
import asyncio
import json
import math
import os

import pytest

from aflow_rl.bench import proposals as bench
from aflow_rl.envs.aflow.graph import Node, Workflow, default_workflow, workflow_hash
from aflow_rl.envs.aflow.mcts import TreeNode
from aflow_rl.envs.aflow.optimizer import Outcome, PolicyProposer, WorkflowState, judge

LIMITS = dict(max_nodes=3, max_samples=3, max_loop_rounds=2, penalty=-0.1)


def _parent():
    root = default_workflow()
    return TreeNode(hash=workflow_hash(root), round=1, score=0.0, workflow=root.to_yaml())


def _programmer():
    return Workflow(nodes=[Node(id="n1", op="Programmer", inputs=["problem"], params={})], output="n1")


def test_judge_gives_each_verdict_without_running_anything():
    parent = _parent()
    bad = judge("{not json", parent, **LIMITS)
    assert not bad.accepted and bad.child is None and bad.improvement == -0.1 and bad.reason
    same = judge(json.dumps(Workflow.from_yaml(parent.workflow).to_dict()), parent, **LIMITS)
    assert not same.accepted and same.child is not None and same.reason.startswith("unchanged")
    new = judge(json.dumps(_programmer().to_dict()), parent, **LIMITS)
    assert new.accepted and new.child_hash == workflow_hash(_programmer()) and new.child_score is None
    assert new.modification == "n1: Custom -> Programmer" and new.improvement == 0.0
    dup = judge(json.dumps(_programmer().to_dict()), parent, known={new.child_hash: 4}, **LIMITS)
    assert not dup.accepted and dup.reason == "duplicate: the same workflow as round 4" and dup.improvement == -0.1


def test_tally_shares_and_binomial_standard_errors():
    parent = _parent()
    texts = ["{", json.dumps(Workflow.from_yaml(parent.workflow).to_dict())] + [json.dumps(_programmer().to_dict())] * 2
    outcomes = [judge(t, parent, **LIMITS) for t in texts]
    t = bench.tally(outcomes, ["stop", "length", "stop", "stop"])
    assert t["n"] == 4
    assert (t["new"]["count"], t["unchanged"]["count"], t["invalid"]["count"]) == (2, 1, 1)
    assert t["new"]["share"] == 0.5 and t["new"]["se"] == pytest.approx(math.sqrt(0.5 * 0.5 / 4))   # 0.25
    assert t["unchanged"]["se"] == pytest.approx(math.sqrt(0.25 * 0.75 / 4))
    assert t["programmer"]["share"] == 0.5 and t["truncated"]["share"] == 0.25
    assert t["mean_nodes_new"] == 1.0 and t["operator_nodes"] == {"Programmer": 2}
    assert t["verdicts"] == ["invalid", "unchanged", "programmer", "programmer"]
    assert bench.share(0, 0) == {"share": 0.0, "se": 0.0, "count": 0}
    assert bench.tally([Outcome(accepted=False, reason="x")], ["stop"])["programmer"]["share"] == 0.0


def test_paired_difference_mean_and_standard_error():
    first = ["new", "invalid", "programmer", "invalid"]
    other = ["programmer", "programmer", "programmer", "invalid"]
    # d = [1, 1, 0, 0]: mean 0.5, sample sd sqrt(1/3), se sqrt(1/3) / 2
    p = bench.paired_difference(first, other, ("programmer",))
    assert p["diff"] == 0.5 and p["se"] == pytest.approx(math.sqrt(1 / 3) / 2)
    # new-or-programmer: d = [0, 1, 0, 0]: mean 0.25, sd 0.5, se 0.25
    assert bench.paired_difference(first, other, ("new", "programmer")) == pytest.approx({"diff": 0.25, "se": 0.25})
    with pytest.raises(ValueError):
        bench.paired_difference(first, other[:3], ("new",))


def test_same_workflow_counts_draws_that_parse_to_one_workflow(tmp_path):
    parent = _parent()
    prog = json.dumps(_programmer().to_dict())
    first = [judge(t, parent, **LIMITS) for t in [prog, "{", "{", prog]]
    other = [judge(t, parent, **LIMITS) for t in [prog, "{", prog, "{"]]
    # draw 0: the same workflow; draw 1: both unparseable (not "the same workflow"); 2, 3: different
    assert bench.same_workflow(first, other) == bench.share(1, 4)
    path = tmp_path / "p.yaml"
    path.write_text(_programmer().to_yaml())
    node = bench.load_parent(f"{path}=0.25")
    assert node.score == 0.25 and node.hash == workflow_hash(_programmer())
    assert bench.load_parent(str(path)).score == 0.0
    with pytest.raises(ValueError, match="--parent .*missing.yaml"):
        bench.load_parent(str(tmp_path / "missing.yaml"))
    with pytest.raises(ValueError, match="--parent"):
        bench.load_parent(f"{path}=high")


class CapturingClient:
    """Records each /generate call's keywords; answers with an empty JSON object."""

    def __init__(self):
        self.calls = []

    async def generate(self, **kw):
        from aflow_rl.llm.base import Completion

        self.calls.append(kw)
        return Completion(text="{}", output_ids=[1], logprobs=[-0.5], finish_reason="stop")


def test_seeded_proposer_sends_its_own_sampling_seed_per_proposal(monkeypatch):
    import aflow_rl.rollout.turns as turns

    monkeypatch.setattr(turns, "chat_prompt_ids", lambda tok, messages: [1, 2, 3])
    root = default_workflow()
    state = WorkflowState(parent_hash=workflow_hash(root), parent_round=1, parent_score=0.0,
                          parent_yaml=root.to_yaml())
    client = CapturingClient()
    base = PolicyProposer(client, object(), temperature=1.0, max_new_tokens=8, schema=None)

    async def run(p, n):
        for _ in range(n):
            await p(state)

    asyncio.run(run(base, 1))
    assert "sampling_seed" not in client.calls[-1]                       # unseeded: the server's generator
    seven = base.seeded(7)
    asyncio.run(run(seven, 3))
    assert [c["sampling_seed"] for c in client.calls[1:]] == [7 * 2**20, 7 * 2**20 + 1, 7 * 2**20 + 2]
    asyncio.run(run(base.seeded(7), 1))                                  # a fresh copy starts at k = 0 again
    asyncio.run(run(base.seeded(8), 1))
    assert client.calls[4]["sampling_seed"] == 7 * 2**20 and client.calls[5]["sampling_seed"] == 8 * 2**20
    assert base.calls == 0 and seven.calls == 3


def test_parse_policies_names_the_problem(tiny_model_dir, tmp_path):
    assert bench.parse_policies([f"a={tiny_model_dir}", tiny_model_dir]) == {"a": tiny_model_dir,
                                                                              "policy1": tiny_model_dir}
    with pytest.raises(ValueError, match="no HF model at"):
        bench.parse_policies([f"a={tmp_path}"])
    with pytest.raises(ValueError, match="given twice"):
        bench.parse_policies([f"a={tiny_model_dir}", f"a={tiny_model_dir}"])


def test_smoke_same_model_twice_draws_the_same_proposals(tiny_model_dir, tmp_path, capsys):
    """A real embedded server per policy: the same weights under two labels, on common sampling seeds,
    give the same proposals, so a difference between two policies is the weights', not the draw's."""
    js = tmp_path / "res" / "proposals.json"
    parent = tmp_path / "programmer.yaml"
    parent.write_text(_programmer().to_yaml())
    assert bench.main(["--smoke", "--policy", f"a={tiny_model_dir}", "--policy", f"b={tiny_model_dir}",
                       "--parent", f"{parent}=0.1", "--out", str(tmp_path / "out"), "--json", str(js)]) == 0
    result = json.loads(js.read_text())
    a, b = result["policies"]["a"], result["policies"]["b"]
    assert a["n"] == b["n"] == bench.SMOKE_SAMPLES
    assert a["examples"] == b["examples"] and a["new"] == b["new"] and a["invalid"] == b["invalid"]
    assert a["new"]["count"] + a["unchanged"]["count"] + a["invalid"]["count"] == bench.SMOKE_SAMPLES
    assert b["vs_first"]["programmer"] == {"diff": 0.0, "se": 0.0} and "vs_first" not in a
    from_p = a["from"]["programmer.yaml"]
    assert from_p["n"] == bench.SMOKE_SAMPLES and from_p == b["from"]["programmer.yaml"]
    assert 0.0 <= from_p["same_workflow_as_round1"]["share"] <= 1.0
    assert "b - a (paired)" in capsys.readouterr().out
    assert os.path.isfile(tmp_path / "out" / "a_server.log")
