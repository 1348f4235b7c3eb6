"""A block drafter's round along its critical path: DSpark against DPara (design §5d).

DSpark's round is backbone → head → verification: the backbone needs the bonus token and the
accepted tokens' target features, so it waits for the previous verification. DPara runs the
backbone over the boundary blocks of the draft it just made, with no data dependence on the
verification forward; its critical path is head → verification, and the backbone can run beside
the verification where the device runs independent work side by side.

Per drafter, each stage in a jitted loop on the state after a real prefill and first round
(`tools.bench_round.stage_split` + `block_stages`): the whole round, the drafter's propose, its
backbone pass, its head (block → draft), the target's verification forward, the verification walk,
the drafter's commit, and the verification forward and the backbone pass in ONE loop body (what
this device saves by overlapping them). Derived (`bench_round.critical_path`): the round along the
critical path, the measured overlap saving, and the round with the backbone fully overlapped, with
the tokens/s it implies from the measured τ of a `python -m tools.bench` run (`--bench FILE.json`).

    python -m tools.bench_critical_path                                 # zoo: code-target, -dspark, -dpara
    python -m tools.bench_critical_path --bench bench/bench_spec_dpara.json
    python -m tools.bench_critical_path --smoke                         # tiny random models (the test)

Medians over repeats after a warm-up; float32. Writes bench/<out>.md and .json (`tools.harness.write_outputs`).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import specjax
from specjax.drafters import BlockDrafter, load_drafter
from specjax.drafters.block import DParaDrafter
from tools.bench_round import critical_path, stage_split
from tools.harness import REPO, run_meta, smoke_block_head, smoke_models, write_outputs
from train.common import repo_relative


def setup(args):
    """(target, {name: BlockDrafter}, prompt, label)."""
    if args.smoke:
        cfg, target, _ = smoke_models()
        drafters = {"dspark": BlockDrafter(smoke_block_head(cfg, block_size=4), target),
                    "dpara": DParaDrafter(smoke_block_head(cfg, block_size=4, boundary=True), target)}
        return target, drafters, list(range(3, 3 + args.context)), "smoke: tiny random models"
    from specjax.io.checkpoint import load_tokenizer
    from train import prompts as prompt_sets
    target = specjax.load_model(args.target)
    drafters = {}
    for x in args.drafter:
        name, _, d = x.partition("=")
        drafters[name] = load_drafter(d, target, target_path=args.target, tuned=False)
        if not isinstance(drafters[name], BlockDrafter):
            raise SystemExit(f"--drafter {x}: not a block drafter")
    prompt = prompt_sets.prompt_set("functions", load_tokenizer(args.target), 1, context_tokens=args.context)[0]["ids"]
    return target, drafters, prompt, f"zoo: {Path(args.target).name}"


def bench_rows(path) -> dict:
    """{method name: row} of a `python -m tools.bench` JSON (τ and tokens/s per method)."""
    data = json.loads(Path(path).read_text())
    return {r["method"]: r for r in data["rows"]}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m tools.bench_critical_path",
                                 description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(REPO / "models/code-target"))
    ap.add_argument("--drafter", action="append", default=None, metavar="NAME=DIR",
                    help="block drafters (default: dspark=TARGET-dspark, dpara=TARGET-dpara)")
    ap.add_argument("--tree", default=None, help="the tree (default: each drafter's chain of its block)")
    ap.add_argument("--boundaries", default="", metavar="B,B,...",
                    help="also each DPara drafter precomputing only the first B boundaries of its chain")
    ap.add_argument("--context", type=int, default=256, help="prompt tokens")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--loops", type=int, default=16)
    ap.add_argument("--bench", default=None, help="a `python -m tools.bench` JSON with '<name> <tree>' rows: τ and tokens/s")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.drafter is None:
        t = args.target.rstrip("/")
        args.drafter = [f"dspark={t}-dspark", f"dpara={t}-dpara"]
    if args.smoke:
        args.repeats, args.loops, args.context = 1, 2, 40
    out = Path(args.out or REPO / ("bench/bench_critical_path_smoke" if args.smoke else "bench/bench_critical_path"))
    target, drafters, prompt, label = setup(args)
    measured = bench_rows(args.bench) if args.bench else {}
    rows = []
    variants = [(name, d, "") for name, d in drafters.items()]
    for b in [int(x) for x in args.boundaries.split(",") if x]:
        variants += [(name, d.with_options(boundaries=b), f" boundaries={b}")
                     for name, d in drafters.items() if d.head.config.boundary]
    for name, d, suffix in variants:
        tree = args.tree or f"chain={d.head.config.block_size}"
        ms = stage_split(target, d, prompt, tree, args.repeats, loops=args.loops, steps=False)
        dpara = d.head.config.boundary
        cp = critical_path(ms, dpara)
        row = {"drafter": name + suffix, "tree": tree, "dpara": dpara, "ms": ms, "critical_path": cp}
        b = measured.get(f"{name} {tree}{suffix}")
        if b is not None:
            row.update(tau=b["tau"], tokens_per_s=b["tokens_per_s"],
                       tokens_per_s_full_overlap=b["tokens_per_s"] * cp["measured round"] / cp["round with full overlap"])
        rows.append(row)
        print(f"[critical path] {name}{suffix} {tree}: " + ", ".join(f"{k} {v:.2f}" for k, v in cp.items()), file=sys.stderr)
    meta = run_meta("bench_critical_path", argv, setup=label, context=args.context, repeats=args.repeats,
                    loops=args.loops, bench=repo_relative(args.bench) if args.bench else None)
    if meta["backend"] == "cpu":  # the device column names the CPU there (as the older files did)
        meta["device"] = f"cpu ({meta['cpu']})"
    write(rows, meta, out)
    return {"meta": meta, "rows": rows}


def write(rows, meta, out: Path) -> Path:
    """<out>.md and .json through the harness; the stage table has one column per drafter."""
    names = [f"{r['drafter']} `{r['tree']}`" for r in rows]
    lines = [f"float32 on {meta['device']}; prompt of {meta['context']} tokens; each stage in a jitted loop of "
             f"{meta['loops']}, median of {meta['repeats'] * 5} after a warm-up (ms per round).", "",
             "| stage (ms) | " + " | ".join(names) + " |", "|---|" + "---:|" * len(rows)]
    keys = ["whole round", "draft (propose)", "drafter backbone pass", "drafter head (block -> draft)",
            "target forward (verification)", "verification forward + backbone pass, one program",
            "verification walk", "drafter commit"]
    for k in keys:
        lines.append(f"| {k} | " + " | ".join(f"{r['ms'][k]:.2f}" for r in rows) + " |")
    lines += ["", "| derived (ms) | " + " | ".join(names) + " |", "|---|" + "---:|" * len(rows)]
    cps = [r["critical_path"] for r in rows]
    for k in dict.fromkeys(k for cp in cps for k in cp):
        lines.append(f"| {k} | " + " | ".join(f"{cp[k]:.2f}" if k in cp else "" for cp in cps) + " |")
    if any("tau" in r for r in rows):
        lines += ["", f"From `{meta['bench']}`:", "", "| method | τ | tokens/s measured | tokens/s with the backbone fully overlapped |",
                  "|---|---:|---:|---:|"]
        lines += [f"| {r['drafter']} {r['tree']} | {r['tau']:.2f} | {r['tokens_per_s']:.1f} | "
                  f"{r['tokens_per_s_full_overlap']:.1f} |" for r in rows if "tau" in r]
    notes = ["Critical path: DSpark's backbone waits for the verification (it needs the bonus token and the "
             "accepted tokens' features); DPara's does not (it drafts the next block for every acceptance boundary "
             "of the draft it just made). \"round with full overlap\" = measured round − min(backbone, verification "
             "forward) for DPara (DSpark: its measured round)."]
    return write_outputs(out, meta, rows, None, title=f"Critical path of a block drafter's round ({meta['setup']})",
                         intro=lines, notes=notes)

if __name__ == "__main__":
    main()
