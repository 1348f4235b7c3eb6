"""The benchmark tools run end to end (on tiny random models: they check the tools, not speed)."""
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))


def test_bench_smoke_writes_table_plot_and_checks_greedy(tmp_path):
    import bench
    out = tmp_path / "spec"
    assert bench.main(["--smoke", "--methods", "lm chain=4", "--out", str(out)]) == 0
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert [r["method"] for r in rows] == ["ar", "ar T=1", "lm chain=4"]
    lm = rows[2]
    assert lm["check"]["mismatch"] == 0 and lm["check"]["exact"] + lm["check"]["near_tie"] == 4
    assert lm["tau"] > 1 and len(lm["depth_acceptance"]) == 4
    assert out.with_suffix(".png").stat().st_size > 0 and "| lm chain=4 |" in out.with_suffix(".md").read_text()
