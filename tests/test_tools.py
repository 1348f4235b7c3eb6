"""The benchmark tools run end to end (on tiny random models: they check the tools, not speed)."""
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))


def test_bench_smoke_writes_table_plot_and_checks_greedy(tmp_path):
    import bench
    out = tmp_path / "spec"
    assert bench.main(["--smoke", "--methods", "lm chain=4,lm chain=4 T=1 sampled", "--out", str(out)]) == 0
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert [r["method"] for r in rows] == ["ar", "ar T=1", "lm chain=4", "lm chain=4 T=1 sampled"]
    sampled = rows[3]  # the sampled-candidates rule, its speedup against AR at the same temperature
    assert sampled["temperature"] == 1.0 and sampled["tau"] >= 1 and "speedup" in sampled
    lm = rows[2]
    assert lm["check"]["mismatch"] == 0 and lm["check"]["exact"] + lm["check"]["near_tie"] == 4
    assert lm["tau"] > 1 and len(lm["depth_acceptance"]) == 4
    assert out.with_suffix(".png").stat().st_size > 0 and "| lm chain=4 |" in out.with_suffix(".md").read_text()


def test_bench_round_smoke(tmp_path):
    import bench_round
    out = tmp_path / "round"
    r = bench_round.main(["--smoke", "--out", str(out)])
    assert set(r["forward_ms"]) == {1, 5} and r["ar_ms_per_token"] > 0
    assert {(x["drafter"], x["tree"]) for x in r["rounds"]} == {(d, "chain=4") for d in ("ngram", "lm", "feature")}
    for x in r["rounds"]:
        assert x["tau"] >= 1 and x["ms_round"] > 0
        assert abs(x["speedup"] - x["tau"] * r["ar_ms_per_token"] / x["ms_round"]) < 1e-9
    assert "break-even" in out.with_suffix(".md").read_text()
