"""python -m aflow_rl.bench.weight_sync --smoke: both methods sync (and verify) the real embedded
server, the report has the machine, the load and seconds per GB for each."""
import json

from aflow_rl.bench.weight_sync import main


def test_smoke_run_reports_both_methods(tmp_path, capfd):
    out = tmp_path / "ws.json"
    main(["--smoke", "--json", str(out)])
    rep = json.loads(out.read_text())
    assert rep["preset"] == "tiny" and rep["rounds"] == 1
    assert 0 < rep["params_gb"] < 0.01
    for method in ("disk", "distributed"):
        assert len(rep[method]["per_round_s"]) == 1
        assert rep[method]["s_per_gb"] == rep[method]["median_s"] / rep["params_gb"] > 0
    assert rep["machine"]["cores"] >= 1 and "load_avg_1m_start" in rep and "load_avg_1m_end" in rep
    printed = capfd.readouterr().out
    assert "| disk |" in printed and "| distributed |" in printed and "load avg" in printed
