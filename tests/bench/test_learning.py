"""python -m aflow_rl.bench.learning: the verdict arithmetic, and the whole benchmark in --smoke mode."""
import json
import os

import pytest

from aflow_rl.bench import learning


def row(policy, suite, seed, **m):
    base = {"item_f1": 1.0, "success": 1.0, "critical_steps": 10.0, "objective": 0.8, "spawn_count": 0.0,
            "solved_self": 0.0, "invalid_actions": 0.0, "n": 50}
    return {"policy": policy, "suite": suite, "seed": seed, **base, **m}


def test_summary_is_the_mean_and_sample_std_over_seeds():
    rows = [row("single", "mixed", 1, objective=0.80), row("single", "mixed", 2, objective=0.84),
            row("single", "mixed", 3, objective=0.82)]
    s = learning.summarize(rows)["mixed"]["single"]
    assert s["objective"] == pytest.approx(0.82) and s["objective_spread"] == pytest.approx(0.02)
    assert s["seeds"] == 3 and s["episodes"] == 150


def test_verdicts_need_a_margin_above_the_spread_and_wide_parity():
    def rows_for(trained_obj, spreads=(0.0, 0.0)):
        out = []
        for seed, d in zip((1, 2), (-1, 1)):
            for b, obj in (("single", 0.80), ("heuristic", 0.79), ("bandit", 0.77)):
                out.append(row(b, "mixed", seed, objective=obj + d * spreads[0]))
            out.append(row("trained-grpo", "mixed", seed, objective=trained_obj + d * spreads[1]))
            out.append(row("heuristic", "wide", seed, item_f1=1.0, critical_steps=9.0))
            out.append(row("trained-grpo", "wide", seed, item_f1=0.96, critical_steps=9.0))
        return out

    v = learning.verdicts(learning.summarize(rows_for(0.83)), ["grpo"])["trained-grpo"]
    assert v["mixed"]["passed"] is True and v["wide"]["passed"] is True
    assert v["mixed"]["vs"]["single"]["margin"] == pytest.approx(0.03)
    # the same margin inside a seed spread of 0.05 (two seeds at +-0.035) is no win
    v = learning.verdicts(learning.summarize(rows_for(0.83, spreads=(0.0, 0.035))), ["grpo"])["trained-grpo"]
    assert v["mixed"]["vs"]["single"]["spread"] == pytest.approx(0.0495, abs=1e-4)
    assert v["mixed"]["passed"] is False and not v["mixed"]["vs"]["single"]["beats"]
    # wide: one more critical step than the heuristic fails, F1 0.06 below fails
    r = rows_for(0.83)
    for x in r:
        if x["policy"] == "trained-grpo" and x["suite"] == "wide":
            x["critical_steps"] = 10.0
    assert learning.verdicts(learning.summarize(r), ["grpo"])["trained-grpo"]["wide"]["passed"] is False
    one_seed = [x for x in rows_for(0.83) if x["seed"] == 1]
    assert learning.verdicts(learning.summarize(one_seed), ["grpo"])["trained-grpo"]["mixed"]["passed"] is None


def test_bad_arguments_are_one_line_errors():
    with pytest.raises(SystemExit):
        learning.main(["--estimators", "ppo"])
    with pytest.raises(SystemExit):
        learning.main(["--set", "env.swarm.curriculum=[0, 5]"])        # one start step per suite of the mix


@pytest.mark.slow
def test_smoke_trains_both_estimators_and_evaluates_held_out(tmp_path, tiny_model_dir, capsys):
    out = tmp_path / "learning.json"
    assert learning.main(["--smoke", "--out", str(tmp_path / "runs"), "--json", str(out),
                          "--set", f"serving.policy.model_path={tiny_model_dir}"]) == 0
    data = json.loads(out.read_text())
    assert os.path.getsize(str(out).replace(".json", ".png")) > 10_000
    assert [r["estimator"] for r in data["runs"]] == ["grpo", "gigpo"]
    for est in ("grpo", "gigpo"):
        curve = data["curves"][est]
        assert [p["step"] for p in curve] == [1, 2] and curve[1]["wall_s"] > curve[0]["wall_s"] > 0
        assert all(set(p) >= {"reward", "objective", "item_f1", "critical_steps"} for p in curve)
    policies = {(r["policy"], r["suite"]) for r in data["rows"]}
    assert policies == {(p, s) for p in ("single", "heuristic", "bandit", "adaptive", "trained-grpo",
                                         "trained-gigpo") for s in ("wide", "deep", "mixed")}
    # the adaptive reference is reported, never part of the goal's verdict
    assert set(data["verdicts"]["trained-grpo"]["mixed"]["vs"]) == {"single", "heuristic", "bandit"}
    c = data["objective"]["c"]
    for r in data["rows"]:
        assert r["n"] == 3 and r["objective_coef"] == c
        assert r["objective"] <= r["item_f1"] - c * 1 + 1e-9          # every episode takes at least one step
    assert data["held_out"]["training_tasks"] == 4                    # 2 steps x 2 tasks, replayed
    text = capsys.readouterr().out
    assert "trained-gigpo on mixed" in text and "held-out" in text


def test_first_action_decodes_the_first_turn_and_shares_are_per_suite(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    def ep(suite, *texts):
        return {"info": {"suite": suite}, "turns": [{"response_ids": tok.encode(t)} for t in texts]}
    spawn = '{"action":"spawn","n":2,"profile":"large","subtasks":["w0","w1"]}'
    solve = '{"action": "solve", "subtask": "h0"}'
    eps = [ep("wide", spawn, solve), ep("wide", solve, spawn), ep("wide", spawn), ep("deep", solve, spawn),
           ep("mixed", "garbage"), {"info": {"suite": "mixed"}, "turns": []}]
    assert [learning.first_action(e, tok) for e in eps] == ["spawn", "solve", "spawn", "solve", "?", ""]
    # only the first turn counts: a later spawn does not make a solve-first episode spawn-first
    assert learning._spawn_first_shares(eps, tok) == {"spawn_first/wide": 2 / 3, "spawn_first/deep": 0.0,
                                                       "spawn_first/mixed": 0.0}
