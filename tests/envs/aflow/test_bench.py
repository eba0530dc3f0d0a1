"""The AFlow benchmark (``python -m aflow_rl.bench.aflow``) at tiny sizes: the real embedded server,
loky pool and sandbox, small enough for the test suite."""
import json

import pytest

from aflow_rl.bench import aflow as bench


def test_benchmark_cli_writes_positive_numbers(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "aflow.json"
    rc = bench.main(["--problems", "4", "--workers", "1", "--inflight", "4", "--chunk", "2", "--repeats", "1",
                     "--max-tokens", "8", "--sandbox-calls", "2", "--sandbox-threads", "1", "--sandbox-mode", "basic",
                     "--model-path", tiny_model_dir, "--json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "machine: " in printed and "problems/s" in printed and "runs/s" in printed
    result = json.loads(out.read_text())
    assert result["machine"]["cores"] >= 1 and result["date"]
    (row,) = result["eval"]
    assert row["workers"] == 1 and row["problems"] == 4 and row["episodes"] == 2 and row["errors"] == 0
    # AnswerGenerate -> Review -> Revise: at least the answer and the review per problem.
    assert row["problems_per_s"] > 0 and row["calls_per_problem"] >= 2 and row["tokens_out_per_problem"] > 0
    assert 0 < row["problem_p50_s"] <= row["problem_p90_s"] and row["server_cores"] > 0
    (sbx,) = result["sandbox"]
    assert sbx["mode"] == "basic" and sbx["failed"] == 0
    assert sbx["runs_per_s"] > 0 and 0 < sbx["p50_s"] <= sbx["p90_s"] and sbx["cpu_per_run_s"] > 0
    assert result["eval_ratio_2_vs_1"] is None  # one worker count: no ratio to take


def test_sandbox_modes_and_percentile():
    assert bench.sandbox_modes("basic") == ("basic",)
    assert bench.sandbox_modes("jail, basic") == ("jail", "basic")
    assert bench.sandbox_modes("auto")[-1] == "basic"
    with pytest.raises(ValueError, match="not auto"):
        bench.sandbox_modes("docker")
    assert bench._percentile([3.0, 1.0, 2.0, 4.0], 0.5) == 2.0
    assert bench._percentile([3.0, 1.0, 2.0, 4.0], 0.9) == 4.0
