"""TreeGraft on the model zoo: builds each drafter pair's scheduler over actions, then benches it beside
every single drafter, the Switch, TreeGraft before actions and the hindsight oracle.

Per pair (cheap+strong: ngram+feature, ngram+lm, ngram+dspark, lm+feature; lm = models/code-draft,
feature = models/code-target-feature, dspark = models/code-target-dspark, each at its shipped settings,
`tuned.json`), `--build`:
  1. the action cost table on this machine (`tools.profile_widths.treegraft_costs`: draft seconds per
     action, verification seconds per compiled width; batch 1 and 4) -> runs/treegraft-costs/<pair>.json;
  2. the value dataset on TRAIN-split prompts (`train.value_system.collect`: labelled generations under
     the switch rule and the oracle, every action's accepted length at every round, goodput labels)
     -> runs/treegraft-values/<pair>;
  3. the distillation (`train.distill_scheduler`, held-out prompts) -> models/treegraft/<pair> (the
     scheduler of the first layout it replaces is kept under runs/treegraft-v1/<pair>, for the rows of
     TreeGraft before actions).
Then, per prompt set (TEST split), one `tools.bench` process per pair and set (`--bench`; the commands are
printed and recorded): AR; each drafter at its shipped shape and at the 16-node tree; the Switch;
TreeGraft before actions (always, and its scheduler of the first layout) at its 16-node tree; the new
TreeGraft with its distilled scheduler, the switch policy, recover and union forced, and the hindsight
oracle, all at the verify budget --tree. `--summary FILES` prints the comparison across pair-sets.

    python -m tools.bench_treegraft --build --pairs ngram+feature
    python -m tools.bench_treegraft --bench --pairs ngram+feature --sets functions,humaneval --out-dir bench/treegraft
    python -m tools.bench_treegraft --summary bench/treegraft/*.json
    python -m tools.bench_treegraft --smoke        # the pipeline on tiny random models (what the test runs)
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

from specjax.drafters import REGISTRY, drafter_kind, named_drafter
from tools.harness import REPO, run_meta
from train.common import repo_relative

PAIRS = ("ngram+feature", "ngram+lm", "ngram+dspark", "lm+feature")
SETS = ("functions", "humaneval", "docstrings", "tests")
PATHS = {"ngram": "ngram", "lm": "models/code-draft", "feature": "models/code-target-feature",
         "dspark": "models/code-target-dspark"}
BENCH_NAMES = {"ngram": "ngram", "lm": "lm", "feature": "feature@2048", "dspark": "dspark"}  # tools.bench's
BEST = {"ngram": "chain=8", "lm": "chain=6", "feature": "chain=5", "dspark": "chain=8"}  # tuned.json / headline
LEGACY_TREE = "depth=5,topk=4,nodes=16"  # TreeGraft before actions, and the 16-node tree of single drafters


def build(pair: str, target_dir: str, tree: str, *, per_set: int, new_tokens: int, steps: int, batches=(1, 4),
          root: Path = REPO, log=print, smoke=None, strong_tree: str | None = None) -> Path:
    """Cost table, value dataset, distillation; returns the exported scheduler directory. The strong
    action's tree is `strong_tree` (default: the strong drafter's best shape, BEST), as in the bench rows."""
    import specjax
    from specjax.drafters import compose
    from specjax.drafters.composite import treegraft_scheduler as sched_lib
    from tools.profile_widths import treegraft_costs
    from train import distill_scheduler, value_system
    cheap_name, _, strong_name = pair.partition("+")
    if smoke is not None:
        target, drafters, prompts = smoke
        parts = [drafters[cheap_name], drafters[strong_name]]
        train_prompts = [(p, "smoke") for p in prompts]
        models = {"setup": "smoke: tiny random models"}
    else:
        target = specjax.load_model(target_dir)
        specs = [PATHS[cheap_name], PATHS[strong_name]]
        parts = compose.load_parts([s if named_drafter(s) else str(root / s) for s in specs], target, target_path=target_dir)
        tok = specjax.load_tokenizer(target_dir)
        train_prompts = [(p["ids"], p["set"]) for p in value_system.training_prompts(tok, value_system.SETS, per_set)]
        models = {"target": {"path": repo_relative(target_dir), "sha256": value_system.sha256_of(target_dir)},
                  **{role: {"spec": s, "kind": d.name, "sha256": None if named_drafter(s) else value_system.sha256_of(root / s)}
                     for role, s, d in zip(("cheap", "strong"), specs, parts)}}
    policy = "switch" if parts[0].drafts_matches else "graft"
    tg = compose.build(compose.Stack.make([cheap_name, strong_name], "treegraft", policy=policy,
                                          strong_tree=strong_tree or BEST[strong_name]), parts)
    costs_file = root / "runs/treegraft-costs" / f"{pair}.json"
    if smoke is None and costs_file.is_file():
        costs = value_system.read_costs(costs_file)
        log(f"[bench_treegraft] {pair}: cost table {repo_relative(costs_file)} (kept)")
    else:
        costs = treegraft_costs(target, tg, tree, list(batches), context=64 if smoke else 256,
                                repeats=2 if smoke else 5, loops=4 if smoke else 16, log=log)
        costs_file.parent.mkdir(parents=True, exist_ok=True)
        costs_file.write_text(json.dumps(costs, indent=2) + "\n")
    behaviours = ("switch", "oracle") if parts[0].drafts_matches else ("graft", "oracle")
    data = value_system.collect(target, tg, tree, [p for p, _ in train_prompts], costs, max_new_tokens=new_tokens,
                                behaviours=behaviours, prompt_sets=[s for _, s in train_prompts], progress=smoke is None)
    vdir = value_system.write_dataset(root / "runs/treegraft-values" / pair, data, {
        "models": models, "prompts": {"split": "train", "sets": sorted({s for _, s in train_prompts}),
                                      "per_set": per_set, "count": len(train_prompts)},
        "config": {"tree": tree, "max_new_tokens": new_tokens, "behaviours": list(behaviours)},
        "costs": {"file": repo_relative(costs_file), **value_system.costs_for(costs, 1), "cpu": costs.get("cpu")}})
    export = root / "models/treegraft" / pair
    old = export / sched_lib.CONFIG_FILE
    if old.is_file() and json.loads(old.read_text()).get("feature_layout") == sched_lib.FEATURE_LAYOUT_V1:
        keep = root / "runs/treegraft-v1" / pair  # the first layout's scheduler: the rows of TreeGraft before actions
        if not keep.exists():
            shutil.copytree(export, keep)
    summary = distill_scheduler.distill([vdir], root / "runs/treegraft-sched" / pair, export,
                                        distill_scheduler.DistillConfig(steps=steps, eval_every=max(steps // 4, 1)),
                                        progress=smoke is None, overwrite=True)
    m = summary["heldout"]
    log(f"[bench_treegraft] {pair}: held-out goodput {m['goodput']:.1f} tokens/s = {m['vs_best_fixed']:.3f}x the best "
        f"fixed action, {m['vs_oracle']:.3f}x the oracle" + (f", {m['vs_switch']:.3f}x the Switch rule"
                                                              if "vs_switch" in m else ""))
    return export


def methods(pair: str, tree: str, sched_dir: str | None, legacy_dir: str | None, min_match: int = 3) -> list[str]:
    """tools.bench method names of one pair's rows (drafters by tools.bench's names)."""
    c, _, s = pair.partition("+")
    cn, sn = BENCH_NAMES[c], BENCH_NAMES[s]
    st = f"strong_tree={BEST[s]}"
    rows = [f"{cn} {BEST[c]}", f"{cn} {LEGACY_TREE}", f"{sn} {BEST[s]}", f"{sn} {LEGACY_TREE}"]
    if REGISTRY[drafter_kind(PATHS[c] if named_drafter(PATHS[c]) else str(REPO / PATHS[c]))].drafts_matches:  # a match drafter: the Switch's rows
        rows += [f"{cn}|{sn};min_match={min_match};model_tree={BEST[s]} {BEST[c]}",
                 f"{cn}+{sn};policy=switch;min_match={min_match};{st} {tree}"]
    rows += [f"{cn}+{sn} {LEGACY_TREE}"]  # TreeGraft before actions: graft every round
    if legacy_dir:
        rows.append(f"{cn}+{sn};policy={legacy_dir} {LEGACY_TREE}")
    rows += [f"{cn}+{sn};policy=recover;{st} {tree}", f"{cn}+{sn};policy=union;{st} {tree}"]
    if sched_dir:
        rows.append(f"{cn}+{sn};policy={sched_dir};{st} {tree}")
    rows.append(f"{cn}+{sn};policy=oracle;{st} {tree}")
    return rows


def bench_command(pair, kind, tree, sched_dir, legacy_dir, *, prompts, new_tokens, repeats, batch, out) -> list[str]:
    c, _, s = pair.partition("+")
    cmd = [sys.executable, "-m", "tools.bench", "--kind", kind, "--prompts", str(prompts), "--new-tokens",
           str(new_tokens), "--repeats", str(repeats), "--batch", str(batch), "--no-draft-ms", "--out", repo_relative(out),
           "--compile-cache", "runs/jax-cache", "--methods", ",".join(methods(pair, tree, sched_dir, legacy_dir))]
    for name in {c, s} - {"ngram"}:
        cmd += [{"lm": "--draft", "feature": "--feature", "dspark": "--dspark"}[name], PATHS[name]]
    if "feature" in (c, s):
        cmd += ["--draft-vocab", "2048"]
    costs = REPO / "runs/treegraft-costs" / f"{pair}.json"
    if costs.is_file():
        cmd += ["--treegraft-costs", repo_relative(costs)]
    return cmd


# ----------------------------------------------------------------------------- summary

def summary(files) -> list[str]:
    """Per results file (one pair and set): the scheduler's speed over the best single drafter and over
    the Switch; the geometric mean over pair-sets; the share of accepted tokens from recovered subtrees."""
    lines = ["| pair | set | batch | best single | Switch | TreeGraft before (always / sched) | new: scheduler | "
             "switch policy | recover | union | oracle (measured / modelled) | scheduler / best single | "
             "scheduler / Switch | recovered share (recover / sched) | greedy mismatches |",
             "|---|---|---:|---|---:|---|---:|---:|---:|---:|---|---:|---:|---|---:|"]
    ratios = []
    for f in files:
        d = json.loads(Path(f).read_text())
        rows = {r["method"]: r for r in d["rows"] if "tokens_per_s" in r}
        meta = d["meta"]
        pair = meta.get("pair") or Path(f).stem
        sp = lambda r: r.get("speedup") if r else None  # noqa: E731
        single = [r for m, r in rows.items() if m != "ar" and "+" not in m.split(" ")[0] and "|" not in m]
        best = max(single, key=lambda r: r["tokens_per_s"]) if single else None
        find = lambda pred: next((r for m, r in rows.items() if pred(m)), None)  # noqa: E731
        switch = find(lambda m: "|" in m.split(" ")[0])
        legacy_always = find(lambda m: "+" in m and ";" not in m.split(" ")[0])
        legacy_sched = find(lambda m: "policy=runs/treegraft-v1" in m)
        sched = find(lambda m: "policy=models/treegraft" in m)
        pol = lambda name: find(lambda m: f"policy={name};" in m or m.split(" ")[0].endswith(f"policy={name}"))  # noqa: E731
        oracle = pol("oracle")
        share = lambda r: (r or {}).get("recovered_share")  # noqa: E731
        bad = sum(r.get("check", {}).get("mismatch", 0) for r in rows.values())
        fmt = lambda x: f"{x:.2f}x" if isinstance(x, (int, float)) else "–"  # noqa: E731
        vs_best = sched["tokens_per_s"] / best["tokens_per_s"] if sched and best else None
        vs_switch = sched["tokens_per_s"] / switch["tokens_per_s"] if sched and switch else None
        if vs_best:
            ratios.append(vs_best)
        mod = (oracle or {}).get("oracle", {}).get("modelled_tokens_per_s")
        ar = rows.get("ar", {}).get("tokens_per_s")
        lines.append(
            f"| {pair} | {meta.get('kind')} | {meta.get('batch')} | "
            f"{best['method'] if best else '–'} {fmt(sp(best))} | {fmt(sp(switch))} | "
            f"{fmt(sp(legacy_always))} / {fmt(sp(legacy_sched))} | {fmt(sp(sched))} | {fmt(sp(pol('switch')))} | "
            f"{fmt(sp(pol('recover')))} | {fmt(sp(pol('union')))} | {fmt(sp(oracle))} / "
            f"{fmt(mod / ar if mod and ar else None)} | {fmt(vs_best)} | {fmt(vs_switch)} | "
            f"{share(pol('recover'))} / {share(sched)} | {bad} |")
    if ratios:
        g = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
        lines += ["", f"Geometric mean over {len(ratios)} pair-sets of the distilled scheduler over the best single "
                      f"drafter: {g:.3f}x."]
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench_treegraft",
                                 description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(REPO / "models/code-target"))
    ap.add_argument("--pairs", default=",".join(PAIRS))
    ap.add_argument("--tree", default="depth=8,topk=4,nodes=16", help="the verify budget of the new TreeGraft")
    ap.add_argument("--build", action="store_true", help="cost table, value dataset and distilled scheduler per pair")
    ap.add_argument("--value-prompts-per-set", type=int, default=8)
    ap.add_argument("--value-new-tokens", type=int, default=64)
    ap.add_argument("--distill-steps", type=int, default=2000)
    ap.add_argument("--bench", action="store_true", help="one tools.bench run per pair and prompt set")
    ap.add_argument("--sets", default=",".join(SETS))
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--out-dir", default=None, help="results folder (default bench/treegraft; --smoke: a temporary one)")
    ap.add_argument("--summary", nargs="*", default=None, metavar="JSON", help="print the summary of tools.bench files")
    ap.add_argument("--smoke", action="store_true", help="the pipeline on tiny random models: checks the tool")
    args = ap.parse_args(argv)
    if args.summary is not None:
        print("\n".join(summary(args.summary)))
        return 0
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    if args.smoke:
        import tempfile
        from tools import bench
        root = Path(args.out_dir or tempfile.mkdtemp(prefix="treegraft_smoke_"))
        smoke = bench.smoke_setup()
        tree = "depth=4,topk=3,nodes=10"
        sched = build("ngram+lm", "", tree, per_set=0, new_tokens=12, steps=40, batches=(1,), root=root, log=log,
                      smoke=smoke, strong_tree="chain=3")
        names = [m.replace("feature@2048", "lm") for m in methods("ngram+lm", tree, str(sched), None, min_match=2)]
        names = [m.replace("chain=8", "chain=4").replace("chain=6", "chain=3").replace(LEGACY_TREE, tree) for m in names]
        # the rows' kinds once each (a compile per row): single drafters at their chains, the scheduler, recover,
        # the oracle (the other policies' and the Switch's outputs are checked by tests/test_treegraft.py and
        # tests/test_switch.py; the summary leaves a column it has no row for at "–")
        names = [m for m in names if " " + tree not in m or any(k in m for k in (f"policy={sched};", "policy=recover", "policy=oracle"))]
        names = [m for m in names if "policy=switch" not in m and "policy=union" not in m and "|" not in m.split(" ")[0]]
        return bench.main(["--smoke", "--no-draft-ms", "--out", str(root / "bench"), "--methods", ",".join(names),
                           "--treegraft-costs", str(root / "runs/treegraft-costs/ngram+lm.json")])
    pairs = [p for p in args.pairs.split(",") if p]
    unknown = [p for p in pairs if p not in PAIRS]
    if unknown:
        ap.error(f"--pairs: unknown {unknown}; choose from {', '.join(PAIRS)}")
    if args.build:
        for pair in pairs:
            build(pair, args.target, args.tree, per_set=args.value_prompts_per_set, new_tokens=args.value_new_tokens,
                  steps=args.distill_steps, log=log)
    if args.bench:
        out_dir = Path(args.out_dir or REPO / "bench/treegraft")
        out_dir.mkdir(parents=True, exist_ok=True)
        for pair in pairs:
            sched = f"models/treegraft/{pair}" if (REPO / "models/treegraft" / pair / "scheduler_config.json").is_file() else None
            legacy = f"runs/treegraft-v1/{pair}" if (REPO / "runs/treegraft-v1" / pair).is_dir() else None
            for kind in args.sets.split(","):
                out = out_dir / f"{pair}_{kind}_b{args.batch}"
                cmd = bench_command(pair, kind, args.tree, sched, legacy, prompts=args.prompts,
                                    new_tokens=args.new_tokens, repeats=args.repeats, batch=args.batch, out=out)
                log("[bench_treegraft] " + " ".join(cmd[1:]))
                subprocess.run(cmd, cwd=REPO, check=False)
                if (out.with_suffix(".json")).is_file():  # the pair's name in the file, for the summary
                    d = json.loads(out.with_suffix(".json").read_text())
                    d["meta"]["pair"] = pair
                    out.with_suffix(".json").write_text(json.dumps(d, indent=2) + "\n")
    if not (args.build or args.bench):
        ap.error("give --build, --bench, --summary or --smoke")
    meta = run_meta("bench_treegraft", argv)
    log(f"[bench_treegraft] done ({meta['cpu']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
