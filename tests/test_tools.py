"""The benchmark tools run end to end (on tiny random models: they check the tools, not speed).

The smoke runs share their programs: the same smoke models (`tools.harness.smoke_models`), prompts in
one length bucket and 12 new tokens, so autoregressive and `lm chain=4` compile once for the bench,
the round split and AdaptiveSpec; `profile_widths --adaptive` profiles the drafter and tree that
`bench_adaptive` profiles (the persistent compilation cache of the run, tests/conftest.py, holds
them); --smoke keeps its programs in memory (no `jax.clear_caches` between methods)."""
import json

import pytest


def test_bench_smoke_writes_table_plot_and_checks_greedy(tmp_path):
    from tools import bench
    out = tmp_path / "spec"
    # block drafters (made-up profile): the scheduler, a best-first tree from the one pass, the sampled rule
    block = ["dspark chain=4 schedule", "dflash chain=4 T=1 sampled", "dspark treeflash,nodes=8,rows=markov"]
    assert bench.main(["--smoke", "--methods", ",".join(["lm chain=4"] + block), "--tree-budgets", "8",
                       "--new-tokens", "12", "--plot-budgets", "--out", str(out)]) == 0
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert [r["method"] for r in rows] == ["ar", "ar T=1", "lm chain=4"] + block
    for r in rows[3:]:  # the draft-ms and verify-width columns
        assert r["tau"] >= 1 and r["draft_ms"] > 0 and 1 <= r["mean_verify_width"] <= 8
        assert len(r["depth_acceptance"]) == 4 and 0 <= r["mean_draft_len"] <= 7
    assert rows[3]["check"]["mismatch"] == 0 and rows[3]["mean_verify_width"] < 5  # the scheduler's cuts
    assert "| dspark chain=4 schedule |" in out.with_suffix(".md").read_text()
    sampled = rows[4]  # the sampled-candidates rule, its speedup against AR at the same temperature
    assert sampled["temperature"] == 1.0 and sampled["tau"] >= 1 and "speedup" in sampled
    tree = rows[5]
    assert tree["check"]["mismatch"] == 0 and tree["mean_verify_width"] == 8 and tree["draft_ms"] > 0
    assert (tmp_path / "spec_budgets.png").stat().st_size > 0
    lm = rows[2]
    assert lm["check"]["mismatch"] == 0 and lm["check"]["exact"] + lm["check"]["near_tie"] == 4
    assert lm["tau"] > 1 and len(lm["depth_acceptance"]) == 4
    assert out.with_suffix(".png").stat().st_size > 0 and "| lm chain=4 |" in out.with_suffix(".md").read_text()


def test_bench_methods_outside_the_default_list():
    """--methods 'DRAFTER TREE' builds that drafter on that tree (equal-shape comparisons); other
    unknown names stay unknown (the CLI lists what exists)."""
    from tools import bench
    drafters = {"lm": object(), "mtp@2048": object(), "ngram": object()}
    got = bench.extra_methods(["lm chain=3", "mtp@2048 depth=4,topk=2,nodes=8", "lm chain=x", "dspark chain=8",
                               "lm", "ngram+lm depth=4,topk=2,nodes=8", "ngram+dspark chain=4", "ngram+ chain=4"],
                              drafters)
    assert [(m.name, m.drafter, m.tree, m.temperature) for m in got] == [
        ("lm chain=3", "lm", "chain=3", 0.0), ("mtp@2048 depth=4,topk=2,nodes=8", "mtp@2048", "depth=4,topk=2,nodes=8", 0.0),
        ("ngram+lm depth=4,topk=2,nodes=8", "ngram+lm", "depth=4,topk=2,nodes=8", 0.0)]
    from specjax.drafters.composite.treegraft import TreeGraft
    target, drafters, _ = bench.smoke_setup()  # 'CHEAP+STRONG': TreeGraft of the two, the strong one every round
    tg = bench.method_drafter(target, drafters, bench.extra_methods(["ngram+dspark chain=4"], drafters)[0])
    assert isinstance(tg, TreeGraft) and tg.policy == "always"
    assert (tg.cheap, tg.strong) == (drafters["ngram"], drafters["dspark"])


def test_bench_round_smoke(tmp_path):
    from tools import bench_round
    out = tmp_path / "round"
    r = bench_round.main(["--smoke", "--out", str(out)])
    assert set(r["forward_ms"]) == {1, 5} and r["ar_ms_per_token"] > 0
    assert {(x["drafter"], x["tree"]) for x in r["rounds"]} == {(d, "chain=4") for d in ("ngram", "lm")}
    for x in r["rounds"]:
        assert x["tau"] >= 1 and x["ms_round"] > 0
        assert abs(x["speedup"] - x["tau"] * r["ar_ms_per_token"] / x["ms_round"]) < 1e-9
    assert "break-even" in out.with_suffix(".md").read_text()


def test_bench_critical_path_smoke(tmp_path):
    """python -m tools.bench_critical_path --smoke: DSpark and DPara split along their critical paths."""
    from tools import bench_critical_path
    out = tmp_path / "cp"
    r = bench_critical_path.main(["--smoke", "--out", str(out)])
    rows = {x["drafter"]: x for x in r["rows"]}
    assert set(rows) == {"dspark", "dpara"} and rows["dpara"]["dpara"] and not rows["dspark"]["dpara"]
    for x in rows.values():
        assert all(v > 0 for k, v in x["ms"].items() if k in ("whole round", "drafter backbone pass",
                                                                "drafter head (block -> draft)"))
        cp = x["critical_path"]
        assert cp["round with full overlap"] <= cp["measured round"]
    dp = rows["dpara"]["critical_path"]
    assert dp["critical path (DSpark: the sum; DPara: without the backbone)"] < dp[
        "sequential sum: backbone + head + verification forward + rest"]
    assert "critical path" in out.with_suffix(".md").read_text()


def test_profile_widths_smoke(tmp_path):
    from tools import profile_widths

    from specjax.spec.profile import costs_from_profile, load_profile
    out = tmp_path / "profile.json"
    p = profile_widths.main(["--smoke", "--batch", "1", "--tree", "chain=2", "--out", str(out)])
    assert load_profile(str(out)) == json.loads(json.dumps(p))
    assert p["tree"] == "chain=2" and p["target_sha256"] is None and p["cpu"]
    row = p["rows"]["1"]
    assert row["widths"] == [1, 2, 3] and row["draft_s"] > 0 and all(v > 0 for v in row["verify_s"])
    assert all(a <= b for a, b in zip(row["round_s"], row["round_s"][1:]))  # non-decreasing in the width
    assert all(c >= row["draft_s"] + v - 1e-12 for c, v in zip(row["round_s"], row["verify_s"]))
    assert costs_from_profile(p, 4, (1, 2, 3)) == tuple(row["round_s"])


def test_bench_adaptive_and_adaptive_profile_smoke(tmp_path):
    """python -m tools.bench_adaptive --smoke: fixed, adaptive and margin rows with their divergence
    columns; profile_widths --adaptive: every width of a small chain, with the rest of the round."""
    from tools import bench_adaptive
    from tools import profile_widths
    out = tmp_path / "adaptive"
    assert bench_adaptive.main(["--smoke", "--adaptive-tree", "lm=chain=2", "--margins", "3", "--new-tokens", "12",
                                "--out", str(out)]) == 0
    data = json.loads(out.with_suffix(".json").read_text())
    rows = {r["method"]: r for r in data["rows"]}
    assert list(rows) == ["ar", "lm chain=4", "lm adaptive chain=2", "lm chain=4 margin δ=3"]
    for name in ("lm chain=4", "lm adaptive chain=2"):
        assert rows[name]["lossless"] and rows[name]["check"]["mismatch"] == 0 and rows[name]["agreement"] == 1.0
    wide = rows["lm chain=4 margin δ=3"]
    assert wide["tau"] > rows["lm chain=4"]["tau"] and wide["agreement"] < 1.0
    assert 1 <= rows["lm adaptive chain=2"]["mean_verify_width"] <= 3
    assert "rest_s" in data["meta"]["profiles"]["lm chain=2"] and out.with_suffix(".png").stat().st_size > 0
    # the lm drafter's chain=2 at batch 1: what bench_adaptive profiled above (its programs, cached)
    p = profile_widths.main(["--smoke", "--adaptive", "--batch", "1", "--tree", "chain=2",
                             "--out", str(tmp_path / "p.json")])
    row = p["rows"]["1"]
    assert p["adaptive"] and row["widths"] == [1, 2, 3] and row["rest_s"] >= 0
    assert all(a <= b for a, b in zip(row["round_s"], row["round_s"][1:]))


def test_costs_from_profile():
    import pytest

    from specjax.spec.profile import costs_from_profile, profile_batch
    rows = {str(b): {"widths": [1, 3, 5], "round_s": [b, b + 1, b + 2]} for b in (2, 4, 16)}
    p = {"tree": "chain=4", "rows": rows}
    assert [profile_batch(p, b) for b in (1, 2, 3, 4, 15, 16, 64)] == [2, 2, 2, 4, 4, 16, 16]
    assert costs_from_profile(p, 8, [1, 3, 5]) == (4.0, 5.0, 6.0)
    with pytest.raises(ValueError, match=r"rerun python (-m tools\.profile_widths|tools/profile_widths\.py)"):
        costs_from_profile(p, 8, (1, 2, 3, 5))
    with pytest.raises(ValueError, match="profile_widths"):
        costs_from_profile({"rows": {"1": {"widths": [1]}}}, 1, (1,))


def test_bench_compile_smoke(tmp_path):
    """The compile-time tool: a cold and a warm process per configuration, the warm one loading its
    programs from the cache with the same tokens, and the program's size per part of the round."""
    from tools import bench_compile
    out = tmp_path / "compile"
    assert bench_compile.main(["--smoke", "--configs", "lm chain=4", "--out", str(out)]) == 0
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    cold, warm = rows
    assert cold["cache_hits"] == 0 and warm["cache_hits"] > 0 and warm["tokens"] == cold["tokens"]
    assert cold["compile_s"] > 0 and cold["trace_s"] > 0 and cold["lower_s"] > 0
    parts = cold["jaxpr_eqns_by_part"]
    assert all(parts.get(p, 0) > 0 for p in ("prefill", "draft", "verify_forward", "verify_walk", "commit", "emit"))
    assert "| lm chain=4 | warm |" in out.with_suffix(".md").read_text()


def test_report_and_headline_in_sync_with_bench_results():
    """docs/benchmarks.md is what `python -m tools.report` writes from bench/*.json (all the schemas
    there), and README's headline block what `python -m tools.headline --render` writes from the last
    `make bench` run: rerun them after a bench run."""
    from tools import headline, report
    assert report.main(["--check"]) == 0, "stale: run python -m tools.report"
    assert headline.main(["--check"]) == 0, "stale: run python -m tools.headline --render"


def test_harness_schema_read_by_report(tmp_path):
    """A file written by the harness carries the meta every bench records, and the report reads it:
    its section, its row in the best-row table (with its date); --check sees a stale page."""
    from tools import harness, report
    meta = harness.run_meta("bench", ["--smoke", "--methods", "lm chain=4"], setup="zoo: code-target", batch=1,
                            kind="functions")
    rows = [{"method": "ar", "tokens_per_s": 10.0, "tau": 1.0, "temperature": 0.0, "speedup": 1.0, "sequences": [[1]]},
            {"method": "lm chain=4", "tokens_per_s": 15.0, "tau": 3.0, "temperature": 0.0, "speedup": 1.5},
            {"method": "ngram|lm chain=8|chain=4|3", "tokens_per_s": 18.0, "tau": 4.0, "temperature": 0.0, "speedup": 1.8}]
    cols = [harness.Column("method", "method", right=False), harness.Column("tokens/s", "tokens_per_s", "{:.1f}")]
    md = harness.write_outputs(tmp_path / "bench" / "bench_spec_x", meta, rows, cols, title="t", quiet=True)
    data = json.loads(md.with_suffix(".json").read_text())
    assert {"cpu", "cores", "date", "command", "jax", "jaxlib", "backend", "device"} <= set(data["meta"])
    assert data["meta"]["command"] == "python -m tools.bench --smoke --methods 'lm chain=4'"
    assert "sequences" not in data["rows"][0] and "| lm chain=4 | 15.0 |" in md.read_text()
    assert f"date: {meta['date']}" in md.read_text() and "Command: `python -m tools.bench" in md.read_text()
    doc = tmp_path / "doc.md"
    args = ["--bench", str(tmp_path / "bench"), "--doc", str(doc)]
    assert report.main(args + ["--check"]) == 1
    assert report.main(args) == 0 and report.main(args + ["--check"]) == 0
    text = doc.read_text()
    assert "| code-target | lm drafter | `lm chain=4` | 3.00 | 1.50x |" in text and meta["date"] in text
    assert r"| code-target | Switch | `ngram\|lm chain=8\|chain=4\|3` | 4.00 | 1.80x |" in text  # its own row (| escaped)
    assert "bench/history.png" in text and (tmp_path / "bench" / "history.png").stat().st_size > 0
    assert "### bench_spec_x.json" in text
    doc.write_text(text.replace("1.50x", "1.60x"))
    assert report.main(args + ["--check"]) == 1


def test_headline_is_one_run(tmp_path, monkeypatch):
    """`make bench`'s outputs from a target's headline file: bench/headline.{json,md,png} and README's block,
    stamped with the run's CPU and date; every row's greedy check shown; --check sees a stale block. The
    bench command of each target names its drafters at their recorded settings (no bench is run here)."""
    from tools import harness, headline
    monkeypatch.setattr(headline, "OUT", tmp_path)
    meta = harness.run_meta("bench", ["--methods", "lm chain=6"], setup="zoo: code-target", batch=1, n_prompts=8,
                            new_tokens=96, kind="functions")
    check = {"exact": 8, "near_tie": 0, "mismatch": 0}
    rows = [{"method": "ar", "tokens_per_s": 10.0, "tau": 1.0, "speedup": 1.0},
            {"method": "lm chain=6", "tokens_per_s": 15.0, "tau": 4.0, "speedup": 1.5, "check": check},
            {"method": "ngram|feature@2048 chain=8|chain=5|3", "tokens_per_s": 20.0, "tau": 5.0, "speedup": 2.0,
             "check": check, "model_round_share": 0.4}]
    (tmp_path / "headline_code-target.json").write_text(json.dumps({"meta": meta, "rows": rows}))
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{headline.START}\nold\n{headline.END}\nrest\n")
    assert headline.main(["--check", "--readme", str(readme)]) == 1
    assert headline.main(["--render", "--readme", str(readme)]) == 0
    assert headline.main(["--check", "--readme", str(readme)]) == 0
    text = readme.read_text()
    assert text.startswith("intro\n") and text.endswith(f"{headline.END}\nrest\n")
    assert f"on {meta['cpu']}" in text and meta["date"][:10] in text
    assert "| code-target | `lm chain=6` | 15.0 | 4.00 | 1.50x | 8 / 0 / 0 |" in text
    assert r"`ngram\|feature@2048 chain=8\|chain=5\|3`" in text
    assert (tmp_path / "headline.png").stat().st_size > 0 and "headline.png" in (tmp_path / "headline.md").read_text()
    args, methods = headline.bench_command(headline.TARGETS[0], 8, 96)
    assert methods[:2] == ["ar", "ngram chain=8"] and any(m.startswith("ngram|feature") for m in methods)
    assert "--out" in args and "bench/headline_code-target" in args


def test_bench_weights_and_peers_table_smoke(tmp_path):
    """python -m tools.bench_weights --smoke (float32 and int8 of the smoke target), then
    python -m tools.peers_table on it and a made-up bench file (no compilation)."""
    from tools import bench_weights, peers_table
    out = tmp_path / "weights"
    assert bench_weights.main(["--smoke", "--weights", "float32,int8", "--widths", "1,2", "--batch", "1",
                               "--prompts", "1", "--out", str(out)]) == 0
    data = json.loads(out.with_suffix(".json").read_text())
    f32, i8 = data["rows"]
    assert (f32["weights"], i8["weights"]) == ("float32", "int8")
    assert i8["weight_mb_per_token"] < 0.4 * f32["weight_mb_per_token"]
    assert f32["agree_tf_code"] == 1.0 and f32["identical_chat"] == 1.0 and 0 <= i8["agree_tf_chat"] <= 1
    assert set(f32["forward_ratio_b1"]) == {"1", "2"} and f32["forward_ratio_b1"]["1"] == 1.0
    meta = {"kind": "functions", "batch": 1, "weights": "float32"}
    rows = [{"method": "ar", "tokens_per_s": 10.0, "tau": 1.0, "temperature": 0.0},
            {"method": "ngram chain=6", "tokens_per_s": 15.0, "tau": 2.0, "temperature": 0.0},
            {"method": "ngram|feature chain=6|chain=3|2", "tokens_per_s": 16.0, "tau": 2.5, "temperature": 0.0},
            {"method": "hf ar", "tokens_per_s": 5.0},
            {"method": "llama.cpp ar (Q4_1 weights)", "unsupported": "exit status -11"}]
    (tmp_path / "b.json").write_text(json.dumps({"meta": meta, "rows": rows}))
    (tmp_path / "b8.json").write_text(json.dumps({"meta": {**meta, "weights": "int8"}, "rows": [
        {"method": "ar", "tokens_per_s": 12.0, "tau": 1.0, "temperature": 0.0}]}))
    assert peers_table.main(["--bench", str(tmp_path / "b.json"), str(tmp_path / "b8.json"),
                             "--weights-bench", str(out.with_suffix(".json")), "--out", str(tmp_path / "peers")]) == 0
    table = {r["row"]: r for r in json.loads((tmp_path / "peers.json").read_text())["rows"]}
    assert table["our AR (int8)"]["vs_f32_ar"] == 1.2 and table["our AR (int8)"]["vs_own_ar"] == 1.0
    assert table["our n-gram (float32): ngram chain=6"]["vs_own_ar"] == 1.5
    assert table["our n-gram (float32): ngram chain=6"]["weight_mb_per_token"] == f32["weight_mb_per_token"] / 2
    assert table["hf ar"]["tau"] == 1.0 and table["llama.cpp ar (Q4_1 weights)"]["unsupported"]
    # a Switch (n-gram | learned) is its own row, never "our best learned drafter" nor "our n-gram"
    assert table["our best n-gram + learned composite (float32): ngram|feature chain=6|chain=3|2"]["tau"] == 2.5
    assert not any(k.startswith("our best learned drafter") for k in table)
    # a run on another CPU is never divided by this CPU's float32 AR (nor by its bandwidth), only by its own run's AR
    (tmp_path / "b8x.json").write_text(json.dumps({"meta": {**meta, "weights": "int8", "cpu": "Other CPU"}, "rows": [
        {"method": "ar", "tokens_per_s": 20.0, "tau": 1.0, "temperature": 0.0},
        {"method": "ngram chain=6", "tokens_per_s": 30.0, "tau": 2.0, "temperature": 0.0}]}))
    assert peers_table.main(["--bench", str(tmp_path / "b.json"), str(tmp_path / "b8x.json"),
                             "--weights-bench", str(out.with_suffix(".json")), "--out", str(tmp_path / "peers2")]) == 0
    other = [r for r in json.loads((tmp_path / "peers2.json").read_text())["rows"] if r["cpu"] == "Other CPU"]
    assert {r["row"] for r in other} == {"our AR (int8)", "our n-gram (int8): ngram chain=6"}
    assert all(r["vs_f32_ar"] is None for r in other) and [r["vs_own_ar"] for r in other] == [1.0, 1.5]
    assert all(r["memory_bound_tokens_per_s"] is None for r in other)  # the bandwidth is another machine's
    # two runs of one setting on one CPU: the table is the latest run's, not a union of both
    (tmp_path / "b_old.json").write_text(json.dumps({"meta": {**meta, "date": "2026-01-01"}, "rows": [
        {"method": "ar", "tokens_per_s": 9.0, "tau": 1.0, "temperature": 0.0},
        {"method": "ngram chain=4", "tokens_per_s": 99.0, "tau": 2.0, "temperature": 0.0}]}))
    (tmp_path / "b_new.json").write_text(json.dumps({"meta": {**meta, "date": "2026-02-01"}, "rows": rows}))
    assert peers_table.main(["--bench", str(tmp_path / "b_new.json"), str(tmp_path / "b_old.json"),
                             "--weights-bench", str(out.with_suffix(".json")), "--out", str(tmp_path / "peers3")]) == 0
    rows3 = json.loads((tmp_path / "peers3.json").read_text())["rows"]
    assert all(r["source"].endswith("b_new.json") for r in rows3)
    assert not any("ngram chain=4" in r["row"] for r in rows3) and len([r for r in rows3 if r["row"].startswith("our AR")]) == 1


def test_ablation_table_reads_runs_at_equal_steps_and_refuses_other_validation(tmp_path):
    import json
    from tools import ablation_table, report

    configs = tmp_path / "configs"
    configs.mkdir()
    base = {"name": "abl-a", "target": "t", "block_size": 8, "seq_len": 64, "batch_size": 2, "eval_tokens": 128,
            "cache": "c", "steps": 20, "init_from_target": True}
    (configs / "abl-a.json").write_text(json.dumps(base))
    runs = []
    for name, cfg, agree in (("a", base, 0.4), ("b", {**base, "name": "abl-b", "init_from_target": False}, 0.3)):
        d = tmp_path / name
        d.mkdir()
        (d / "run.json").write_text(json.dumps(cfg))
        (d / "metrics.jsonl").write_text("".join(json.dumps(
            {"step": s, "val_loss": 5.0, "val_agree": [agree, 0.1, 0.05, 0.01], "val_accept": [agree, 0.05, 0.0],
             "val_tau_estimate": 1 + agree}) + "\n" for s in (10, 20)))
        runs.append(f"{name}={d}")
    out = tmp_path / "ablation_t"
    ablation_table.main(["--run", runs[0], "--run", runs[1], "--steps", "10", "--title", "T", "--model", "m",
                         "--configs", str(configs), "--out", str(out)])
    data = json.loads(out.with_suffix(".json").read_text())
    assert [r["variant"] for r in data["rows"]] == ["a", "b"]
    assert data["rows"][1]["what"] == "init_from_target=false" and data["rows"][1]["positions"] == 10 * 2 * 64
    assert data["rows"][0]["command"].startswith("python -m train.block --config ")  # ran on to step 20: no --max-steps
    assert "--max-steps" not in data["rows"][0]["command"] and data["rows"][1]["command"] is None  # b: no config
    assert report.classify(data)[0] == "ablation"
    from train import model_card
    card = model_card.ablation_section(tmp_path / "m", bench_dir=tmp_path)  # the card of the model it names
    assert "| b | init_from_target=false | 10 | 0.300 / 0.100 / 0.050 / 0.010 | 0.300 / 0.050 / 0.000 | 1.300 |" in card
    assert model_card.ablation_section(tmp_path / "other", bench_dir=tmp_path) == ""
    assert "earlier training" not in card  # the model has no train_info: nothing to compare
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "train_info.json").write_text(json.dumps({"run_dir": str(tmp_path / "a")}))
    assert "earlier training" not in model_card.ablation_section(tmp_path / "m", bench_dir=tmp_path)
    (tmp_path / "m" / "train_info.json").write_text(json.dumps({"run_dir": "runs/m-v3"}))  # retrained since
    assert "an earlier training of this drafter, not this export's (`runs/m-v3`)" in \
        model_card.ablation_section(tmp_path / "m", bench_dir=tmp_path)
    (tmp_path / "b" / "run.json").write_text(json.dumps({**base, "eval_tokens": 256}))
    with pytest.raises(SystemExit, match="validates differently"):
        ablation_table.main(["--run", runs[0], "--run", runs[1], "--steps", "10", "--title", "T",
                             "--configs", str(configs), "--out", str(out)])


def test_profile_round_smoke():
    """The op-level profile of a round runs and sums its ops per round (scopes need a fresh process's dump)."""
    from tools import profile_round
    assert profile_round.main(["--smoke"]) == 0
    assert profile_round.scope_of("jit(_generate_spec)/while/body/draft/while/body/dot_general") == "draft"
    assert profile_round.scope_of("jit(_generate_spec)/prefill/dot_general") == "prefill"
    assert profile_round.scope_of("") == "(no metadata)"
