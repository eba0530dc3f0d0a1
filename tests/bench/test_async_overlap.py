"""python -m aflow_rl.bench.async_overlap: the arithmetic on synthetic records, and --smoke end to end."""
import json
import os

import pytest

from aflow_rl.bench import async_overlap as bench


def records(step_s, rollout_s, train_s, sync_s=0.0, rewards=(0.1, 0.2, 0.3, 0.4), lag=0.0):
    n = len(rewards)
    rec = {tag: [(i + 1, 100.0 + 2 * i, v) for i, v in enumerate(vals)] for tag, vals in {
        "timing/step_s": [50.0] + [step_s] * (n - 1),      # the first step is left out of the timings
        "timing/rollout_s": [40.0] + [rollout_s] * (n - 1), "timing/train_s": [train_s] * n,
        "timing/sync_s": [sync_s] * n, "rewards/mean": list(rewards), "async/staleness_mean": [lag] * n,
        "async/staleness_max": [lag] * n}.items()}
    return rec


def test_ratio_is_step_over_the_larger_of_rollout_and_train_plus_sync():
    s = bench.run_summary(records(step_s=3.0, rollout_s=2.0, train_s=2.2, sync_s=0.3))
    assert s["ideal_s"] == pytest.approx(2.5) and s["ratio"] == pytest.approx(1.2) and s["step_s"] == 3.0
    s = bench.run_summary(records(step_s=5.0, rollout_s=4.0, train_s=1.0))
    assert s["ideal_s"] == 4.0 and s["ratio"] == pytest.approx(1.25)
    assert s["wall_curve"][0] == [0.0, 0.1] and s["wall_curve"][-1] == [6.0, 0.4]
    assert s["reward_curve"] == [[1, 0.1], [2, 0.2], [3, 0.3], [4, 0.4]]


def test_summary_means_spreads_and_speedup_per_seed():
    def run(k, seed, step_s, rewards):
        return {"k": k, "seed": seed, **bench.run_summary(records(step_s, 2.0, 1.0, rewards=rewards, lag=k))}

    runs = [run(0, 0, 3.0, (0, 0, 0, 1.0)), run(1, 0, 2.0, (0, 0, 0, 0.8)),
            run(0, 1, 4.0, (0, 0, 0, 0.6)), run(1, 1, 2.0, (0, 0, 0, 0.6))]
    s = bench.summarize(runs)
    assert s["0"]["speedup"] == pytest.approx(1.0) and s["1"]["speedup"] == pytest.approx((1.5 + 2.0) / 2)
    assert s["1"]["final_reward"] == pytest.approx(0.7) and s["1"]["final_reward_spread"] == pytest.approx(0.1414, abs=1e-4)
    assert s["0"]["step_s_spread"] == pytest.approx(0.7071, abs=1e-4) and s["1"]["staleness_max"] == 1.0
    assert "1" in bench.format_report(s).splitlines()[2][:2]


@pytest.mark.slow   # two short training runs through train.py
def test_smoke_writes_json_and_png(tmp_path):
    out = tmp_path / "bench.json"
    assert bench.main(["--smoke", "--out", str(tmp_path / "runs"), "--json", str(out)]) == 0
    report = json.load(open(out))
    assert os.path.exists(tmp_path / "bench.png") and report["load_avg_before"] and report["machine"]["cores"]
    assert [(r["k"], r["seed"]) for r in report["runs"]] == [(0, 0), (1, 0)]
    assert all(len(r["reward_curve"]) == 3 and r["step_s"] > 0 for r in report["runs"])
    assert report["summary"]["0"]["staleness_max"] == 0.0 and report["summary"]["1"]["staleness_max"] <= 1.0
