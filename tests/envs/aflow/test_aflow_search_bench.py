"""``python -m aflow_rl.bench.aflow_search``: the per-problem evaluation cache, the per-round curve, the
anchor-group statistics read back from a run's episodes, and the whole bench in smoke mode (tiny models)."""
import asyncio
import json
import os

import pytest

from aflow_rl.bench import aflow_search as bench
from aflow_rl.config import AflowConfig
from aflow_rl.envs.aflow.datasets import Problem
from aflow_rl.envs.aflow.evaluator import evaluate
from aflow_rl.envs.aflow.graph import Node, Workflow
from aflow_rl.rollout.types import Trajectory, Turn
from tests.envs.aflow.test_evaluator import ScriptedExecutor


def _problems(n):
    return [Problem(id=f"p{i}", kind="gsm8k", question=f"{i} + 1 = ?", answer=str(i + 1)) for i in range(n)]


def _wf(instruction):
    return Workflow(nodes=[Node(id="n1", op="Custom", params={"instruction": instruction}, inputs=["problem"])],
                    output="n1")


def test_cached_evaluator_matches_evaluate_and_computes_each_problem_once():
    # Right on even problems only; the answer is the number after the last space of the question's "i + 1".
    def respond(prompt):
        i = int(prompt.split("+")[0].split()[-1])
        return str(i + 1) if i % 2 == 0 else "no idea"

    a = AflowConfig(eval_concurrency=2, executor_max_tokens=8)
    probs = _problems(6)
    ex = ScriptedExecutor(respond)
    cached = bench.CachedEvaluator(a, ex)
    first = asyncio.run(cached.run(_wf(""), probs[:4]))
    direct = asyncio.run(evaluate(_wf(""), probs[:4], executor=ScriptedExecutor(respond), concurrency=2,
                                  max_tokens=8))
    assert first.score == direct.score == 0.5 and cached.fresh == 4
    assert [f["id"] for f in first.failures] == [f["id"] for f in direct.failures] == ["p1", "p3"]
    calls = len(ex.prompts)
    again = asyncio.run(cached.on(probs[2:])(_wf("")))       # p2, p3 cached; p4, p5 new
    assert cached.fresh == 6 and len(ex.prompts) == calls + 2
    assert again.score == 0.5 and [r.id for r in again.per_problem] == ["p2", "p3", "p4", "p5"]
    asyncio.run(cached.run(_wf("other"), probs[:1]))         # another workflow is another key
    assert cached.fresh == 7


def test_best_so_far_keeps_the_best_through_rejected_rounds():
    results = [{"round": 1, "score": 0.2}, {"round": 2, "score": None}, {"round": 3, "score": 0.5},
               {"round": 3, "score": 0.3}, {"round": 4, "score": 0.1}]
    assert bench.best_so_far(results, 5) == [0.2, 0.2, 0.4, 0.4, 0.4]
    assert bench.best_so_far([], 2) == [None, None]


def test_anchor_stats_from_episode_files(tmp_path):
    def traj(eid, group, keys, ret, valid, child):
        return Trajectory(episode_id=eid, group_id=group,
                          metrics={"episode_return": ret, "valid": valid, "child_score": child},
                          turns=[Turn(prompt_ids=[1], response_ids=[2], logprobs=[-1.0], anchor_key=k) for k in keys])

    os.makedirs(tmp_path / "episodes")
    with open(tmp_path / "episodes" / "step_000001.jsonl", "w") as fh:
        for t in [traj("a", "g", ["R", "X"], 1.0, 1.0, 0.3), traj("b", "g", ["R", "R"], -0.2, 0.0, 0.0)]:
            fh.write(json.dumps(t.to_dict()) + "\n")
    stats = bench.anchor_stats(str(tmp_path))
    assert stats["fraction"] == pytest.approx(3 / 4)
    step = stats["steps"][0]
    assert step["later_rounds_fraction"] == pytest.approx(1 / 2)
    assert (step["return"], step["valid"], step["child_score"]) == pytest.approx((0.4, 0.5, 0.15))


def test_a_checkpoint_from_a_run_brings_its_learning_curve_into_report_and_plot(tmp_path):
    run = tmp_path / "run"
    hf = run / "checkpoints" / "step_2" / "hf"
    os.makedirs(hf)
    assert bench.run_of(str(hf)) is None          # no episodes: not a training run
    os.makedirs(run / "episodes")
    for k, ret in enumerate([-0.1, 0.2]):
        t = Trajectory(episode_id=f"e{k}", group_id="g", metrics={"episode_return": ret, "valid": 1.0,
                                                                  "child_score": ret + 0.1},
                       turns=[Turn(prompt_ids=[1], response_ids=[2], logprobs=[-1.0], anchor_key="R")])
        (run / "episodes" / f"step_{k:06d}.jsonl").write_text(json.dumps(t.to_dict()) + "\n")
    assert bench.run_of(str(hf)) == str(run)
    io = {"test": 0.01, "val": 0.0, "curve": [0.0, 0.0]}
    path = _run_json(tmp_path, "t", {"0": {"io": io, "trained": _row(0.2)}},
                     train={"checkpoint": str(hf), **bench.anchor_stats(str(run))})
    result = json.loads(open(path).read())
    assert "trained optimizer: 2 steps, GiGPO turns" in bench.report(result)   # no "seconds": not trained here
    plain, with_curve = tmp_path / "plain.png", tmp_path / "curve.png"
    bench.plot({**result, "train": {}}, str(plain))
    bench.plot(result, str(with_curve))

    def width(png):   # a PNG's IHDR width: bytes 16-20, big-endian
        return int.from_bytes(png.read_bytes()[16:20], "big")

    assert width(with_curve) > width(plain)   # the second panel: the training curve


def test_summary_mean_and_spread():
    per_seed = {0: {"io": {"test": 0.1, "val": 0.0}}, 1: {"io": {"test": 0.3, "val": 0.5}}}
    s = bench.summarize(per_seed)["io"]
    assert s["test_mean"] == pytest.approx(0.2) and s["test_spread"] == pytest.approx(0.1)
    table = bench.markdown({"summary": bench.summarize(per_seed)}).splitlines()
    assert len(table) == 3 and table[2].startswith("| io | 0.200 ± 0.100 | 0.100, 0.300 | 0.000, 0.500 | Custom; Custom |")


class ChainProposer:
    """Stand-in optimizer: appends a Format node to a workflow without one, else another Custom node."""

    def seeded(self, seed):
        return self   # deterministic: nothing to seed

    async def __call__(self, state):
        from aflow_rl.envs.aflow.optimizer import Proposal

        parent = Workflow.from_yaml(state.parent_yaml)
        op = "Custom" if any(n.op == "Format" for n in parent.nodes) else "Format"
        nid = f"n{len(parent.nodes) + 1}"
        params = {"instruction": "again"} if op == "Custom" else {}
        child = Workflow(nodes=parent.nodes + [Node(id=nid, op=op, params=params, inputs=[parent.output])],
                         output=nid)
        return Proposal(text=json.dumps(child.to_dict()))


def test_run_seed_finds_the_better_workflow_without_servers(tmp_path, monkeypatch):
    """The fast end-to-end check (the CLI smoke below starts servers and is slow): every method on a
    split, with an executor that answers right only when asked for the bare final answer (Format)."""
    from aflow_rl.config import load_config

    def respond(prompt):
        i = int(prompt.split(" + 1")[0].split()[-1])
        return str(i + 1) if prompt.startswith("Problem:") and "State the final answer" in prompt else "0"

    cfg = load_config(os.path.join(os.path.dirname(__file__), "..", "..", "..", "configs", "aflow_smol.yaml"),
                      ["env.aflow.num_problems=6", "env.aflow.val_ratio=0.34"])
    monkeypatch.setattr(bench, "seed_split", lambda c, seed: (_problems(6)[:2], _problems(6)[2:]))
    evaluator = bench.CachedEvaluator(cfg.env.aflow, ScriptedExecutor(respond))
    proposers = {m: ChainProposer() for m in ("aflow", "mcts", "trained")}
    row = asyncio.run(bench.run_seed(cfg, 0, 3, evaluator, proposers, str(tmp_path)))
    assert row["io"]["test"] == 0.0 and row["io"]["curve"] == [0.0, 0.0, 0.0]
    for method in ("aflow", "mcts", "trained"):
        r = row[method]
        assert r["test"] == 1.0 and r["val"] == 1.0 and "Format" in r["ops"]
        assert r["curve"] == [0.0, 1.0, 1.0] and r["accepted"] + r["rejected"] == 3 and r["accepted"] >= 2
        assert os.path.isfile(tmp_path / "seed0" / method / "best.yaml")
    # Each workflow is computed once for all three methods (the per-problem cache): IO on all 6 problems,
    # the Format child on val (2) and test (4), and at most one deeper child (all proposers are the same).
    deeper = any(row[m]["accepted"] == 3 for m in ("aflow", "mcts", "trained"))
    assert evaluator.fresh == 6 + 2 + 4 + (2 if deeper else 0)


@pytest.mark.slow
def test_smoke_runs_every_method_and_writes_json_yaml_png(tmp_path, capsys):
    out, js = tmp_path / "bench", tmp_path / "res" / "search.json"
    assert bench.main(["--smoke", "--out", str(out), "--json", str(js)]) == 0
    result = json.loads(js.read_text())
    assert set(result["summary"]) == {"io", "aflow", "mcts", "trained"}
    (row,) = result["per_seed"].values()
    assert row["split"] == {"val": 1, "test": 2}
    for method in ("aflow", "mcts", "trained"):
        r = row[method]
        assert len(r["curve"]) == 2 and r["curve"][0] is not None
        assert r["curve"][1] is None or r["curve"][1] >= r["curve"][0]
        assert 0.0 <= r["test"] <= 1.0 and r["accepted"] + r["rejected"] + r["errors"] == 2
        assert Workflow.from_yaml(open(r["workflow"]).read()).nodes
    assert os.path.getsize(str(js).replace(".json", ".png")) > 1000
    assert "test mean" in capsys.readouterr().out
    assert result["problem_results_computed"] >= 3  # IO on all three problems at least


def test_bad_arguments_fail_with_one_line():
    with pytest.raises(SystemExit):
        bench.main(["--rounds", "0"])
    with pytest.raises(SystemExit):
        bench.main(["--checkpoint", "/nonexistent/hf"])


def test_methods_flag_reaches_the_bench_and_rejects_unknown_names(monkeypatch, tmp_path, capsys):
    seen = {}

    def fake_run_bench(config, overrides, seeds, rounds, out, checkpoint="", train_steps=0, methods=bench.METHODS):
        seen.update(methods=list(methods), checkpoint=checkpoint)
        return {"args": {"dataset": "d", "num_problems": 1, "val_ratio": 0.5, "seeds": seeds, "rounds": rounds,
                         "executor": "e", "optimizer": "o"}, "wall_s": 0.0, "machine": {}, "summary": {}}

    monkeypatch.setattr(bench, "run_bench", fake_run_bench)
    assert bench.main(["--methods", "io", "aflow", "--out", str(tmp_path)]) == 0
    assert seen["methods"] == ["io", "aflow"]
    assert bench.main(["--out", str(tmp_path)]) == 0
    assert seen["methods"] == list(bench.METHODS)
    with pytest.raises(SystemExit):
        bench.main(["--methods", "io", "random", "--out", str(tmp_path)])
    assert "invalid choice: 'random'" in capsys.readouterr().err


def test_run_seed_runs_only_the_methods_given(tmp_path, monkeypatch):
    from aflow_rl.config import load_config

    cfg = load_config(os.path.join(os.path.dirname(__file__), "..", "..", "..", "configs", "aflow_smol.yaml"),
                      ["env.aflow.num_problems=6", "env.aflow.val_ratio=0.34"])
    monkeypatch.setattr(bench, "seed_split", lambda c, seed: (_problems(6)[:2], _problems(6)[2:]))
    evaluator = bench.CachedEvaluator(cfg.env.aflow, ScriptedExecutor(lambda prompt: "0"))
    row = asyncio.run(bench.run_seed(cfg, 0, 2, evaluator, {"mcts": ChainProposer()}, str(tmp_path)))
    assert set(row) == {"io", "split", "mcts"}


def _run_json(tmp_path, name, rows_per_seed, train=None):
    result = {"args": {"dataset": "d", "num_problems": 6, "val_ratio": 0.34, "seeds": [], "rounds": 2,
                       "executor": "e", "optimizer": "o"}, "wall_s": 5.0, "machine": {"cpu": "x"},
              "problem_results_computed": 3, "train": train or {},
              "per_seed": rows_per_seed, "summary": bench.summarize(rows_per_seed)}
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(result))
    return str(path)


def _row(test, curve=(0.1, 0.2)):
    return {"test": test, "val": curve[-1], "curve": list(curve), "nodes": 1, "ops": ["Programmer"]}


def test_merge_joins_runs_per_method_and_seed_and_labels_trained_rows(tmp_path, capsys):
    io = {"test": 0.01, "val": 0.0, "curve": [0.0, 0.0]}
    a = _run_json(tmp_path, "a", {"0": {"io": io, "aflow": _row(0.2)}, "1": {"io": io, "aflow": _row(0.4)}})
    g = _run_json(tmp_path, "g", {"0": {"io": io, "trained": _row(0.1)}, "1": {"io": io, "trained": _row(0.3)}},
                  train={"steps": 6, "seconds": 200.0, "fraction": 0.8})
    r = _run_json(tmp_path, "r", {"0": {"io": io, "trained": _row(0.5)}})
    out = tmp_path / "m" / "merged.json"
    assert bench.main(["--merge", a, f"{g}=trained_gigpo", f"{r}=trained_grpo", "--json", str(out)]) == 0
    merged = json.loads(out.read_text())
    s = merged["summary"]
    assert list(s) == ["io", "aflow", "trained_gigpo", "trained_grpo"]
    assert s["aflow"]["test_mean"] == pytest.approx(0.3) and s["aflow"]["test_spread"] == pytest.approx(0.1)
    assert s["trained_gigpo"]["test"] == [0.1, 0.3] and s["trained_grpo"]["test"] == [0.5]
    assert merged["args"]["seeds"] == [0, 1] and merged["problem_results_computed"] == 9
    assert merged["train"] == {"trained_gigpo": {"steps": 6, "seconds": 200.0, "fraction": 0.8}}
    assert os.path.getsize(str(out).replace(".json", ".png")) > 1000
    printed = capsys.readouterr().out
    assert "trained_gigpo optimizer: 6 steps in 200 s" in printed and "trained_grpo" in printed


def test_merge_refuses_runs_that_disagree_or_collide(tmp_path):
    a = _run_json(tmp_path, "a", {"0": {"io": {"test": 0.01, "val": 0.0}, "mcts": _row(0.2)}})
    other_io = _run_json(tmp_path, "b", {"0": {"io": {"test": 0.02, "val": 0.0}, "aflow": _row(0.2)}})
    with pytest.raises(SystemExit, match="io differs from an earlier run"):
        bench.merge([a, other_io])
    t1 = _run_json(tmp_path, "t1", {"0": {"io": {"test": 0.01, "val": 0.0}, "trained": _row(0.2)}})
    t2 = _run_json(tmp_path, "t2", {"0": {"io": {"test": 0.01, "val": 0.0}, "trained": _row(0.3)}})
    with pytest.raises(SystemExit, match="'trained' from two runs"):
        bench.merge([t1, t2])
    with pytest.raises(SystemExit):
        bench.main(["--merge", a])            # no --json
