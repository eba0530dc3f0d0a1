"""bench.rollout_pool runs the shipped client and the reference client through a real pool."""
import pytest

from aflow_rl.bench import rollout_pool


def test_plan_parsing():
    assert rollout_pool.parse_plan(["64:2", "1024:4", "8"]) == [(64, 2), (1024, 4), (8, 2)]
    with pytest.raises(SystemExit, match="--plan: 'x:2' is not CONCURRENCY:WORKERS"):
        rollout_pool.parse_plan(["x:2"])


def test_smoke_run_measures_every_client_in_one_pool(tmp_path, capfd):
    out = tmp_path / "r.json"
    assert rollout_pool.main(["--plan", "8:1", "--clients", "shipped", "shipped_aiohttp", "raw", "--repeats", "2",
                              "--waves", "2", "--latency", "0.05", "--json", str(out)]) == 0
    import json

    rows = json.loads(out.read_text())["results"]
    # Interleaved: A B C A B C, each row with its own numbers.
    assert [(r["client"], r["rep"]) for r in rows] == [(c, k) for k in (1, 2) for c in ("shipped", "shipped_aiohttp", "raw")]
    for r in rows:
        assert r["episodes"] == 16 and r["ideal_per_s"] == 160.0
        assert 0 < r["pct_of_ideal"] <= 101 and r["latency_p50_s"] >= 0.05
        assert r["worker_cpu_ms_per_episode"] > 0
    captured = capfd.readouterr()  # file descriptors: the worker processes' output lands here too
    assert "machine:" in captured.out and "worker_cpu_ms_per_episode" in captured.out
    assert "Unclosed" not in captured.err, captured.err[-2000:]
