"""python -m aflow_rl.bench.swarm: one table, the same numbers as JSON, the design's bar."""
import json

import pytest

from aflow_rl.bench import swarm as bench


def test_cli_table_and_json(tmp_path, capsys):
    out = tmp_path / "b.json"
    assert bench.main(["--policy", "single,heuristic", "--suite", "wide,deep", "--n", "4", "--seed", "1",
                       "--json", str(out)]) == 0
    text = capsys.readouterr().out
    data = json.loads(out.read_text())
    assert [(r["policy"], r["suite"]) for r in data["rows"]] == [
        ("single", "wide"), ("single", "deep"), ("heuristic", "wide"), ("heuristic", "deep")]
    assert {"platform", "cpu", "cores"} <= set(data["machine"]) and data["args"]["n"] == 4
    for header in ("success", "item_f1", "crit_steps", "wall_ms", "tok_in", "cost_usd", "fail_rate", "retries",
                   "skip_rate", "parallel", "spawns"):
        assert header in text
    row = data["rows"][2]
    assert f"{row['critical_steps']:.2f}" in text and row["n"] == 4 and row["status_ok"] == 4
    assert "bar (wide)" in text and data["bar"]["passed"] in (True, False)
    # the same seed gives the same numbers (episodes_per_s is real time, left out)
    again = bench.run_bench(["single", "heuristic"], ["wide", "deep"], 4, 1)
    def strip(rows):
        return [{k: v for k, v in r.items() if k != "episodes_per_s"} for r in rows]
    assert strip(again["rows"]) == strip(data["rows"])


def test_bar_check():
    rows = [{"policy": "single", "suite": "wide", "item_f1": 0.9, "critical_steps": 10.0},
            {"policy": "heuristic", "suite": "wide", "item_f1": 0.9, "critical_steps": 7.0}]
    assert bench.bar_check(rows)["passed"] is True
    rows[1]["critical_steps"] = 7.5
    assert bench.bar_check(rows)["passed"] is False
    rows[1].update(critical_steps=5.0, item_f1=0.8)
    assert bench.bar_check(rows)["passed"] is False
    assert bench.bar_check(rows[:1]) is None


def test_cli_rejects_unknown_names():
    with pytest.raises(SystemExit):
        bench.main(["--policy", "oracle"])
    with pytest.raises(SystemExit):
        bench.main(["--suite", "tall"])


def test_objective_column_uses_the_recipes_latency_coefficient(tmp_path):
    out = bench.run_bench(["single", "heuristic"], ["deep"], 4, 1, config="configs/learning.yaml")
    for r in out["rows"]:
        assert r["objective_coef"] == 0.02
        # the mean objective is the mean item F1 minus c times the mean critical steps
        assert r["objective"] == pytest.approx(r["item_f1"] - 0.02 * r["critical_steps"])
    # the recipe's training mixture is dropped: each row is its suite, at the recipe's item range for it
    assert out["args"]["config"] == "configs/learning.yaml"
    again = bench.run_bench(["single"], ["deep"], 4, 1, ["env.swarm.latency_coef=0.05"], config="configs/learning.yaml")
    assert again["rows"][0]["objective"] == pytest.approx(again["rows"][0]["item_f1"] - 0.05 * again["rows"][0]["critical_steps"])


def test_pressure_sweep_reports_every_budget(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert bench.main(["--policy", "single,heuristic", "--suite", "wide", "--n", "6", "--seed", "2",
                       "--pressure", "env.swarm.max_tokens=20000,3000", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["pressure"]
    assert [(r["budget"], r["policy"]) for r in rows] == [(20000, "single"), (20000, "heuristic"),
                                                         (3000, "single"), (3000, "heuristic")]
    by = {(r["budget"], r["policy"]): r for r in rows}
    # the heuristic's subagents spend tokens fast: a tight budget ends its episodes before they finish
    assert by[(3000, "heuristic")]["item_f1"] < by[(20000, "heuristic")]["item_f1"]
    assert "max_tokens=3000" in capsys.readouterr().out
    assert bench.parse_pressure("env.swarm.max_tool_calls=8,4") == ("env.swarm.max_tool_calls", [8, 4])
    assert bench.parse_pressure("20000,5000") == ("env.swarm.max_tokens", [20000, 5000])
    with pytest.raises(SystemExit):
        bench.main(["--pressure", "env.swarm.max_tokenz=1,2"])
