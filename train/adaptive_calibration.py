"""Fits the adaptive shape's acceptance-by-confidence counts g(q) for a drafter (`specjax.drafters.composite.adaptive`)
and stores them with the drafter (the "step" table of `calibration.json`, read by the CLI's `--adaptive` and
`tools/bench_adaptive.py`).

Validation rounds: speculative greedy generation of validation-split prompts with the drafter under
`AdaptiveShape` with equal costs (every round verifies the whole tree) and no decay of the counts;
each tree is drafted as the loop drafts it, so a node's own q is the drafter's at that point. A
kept node whose parent was accepted is observed, and accepted iff it is on the accepted path; the
counts per depth and bin of q (pooled over the --tree specs) are what the generation's state
holds at its end (`adaptive_seen` / `adaptive_hits`).

    python -m train.adaptive_calibration --target models/code-target --drafter models/code-draft \
        --tree chain=6 --tree depth=5,topk=4,nodes=16
"""
from __future__ import annotations

import argparse
import sys
import time

import jax
import numpy as np

import specjax
from specjax.drafters.composite import adaptive
from specjax.spec import calibration, tree as tree_lib, widths
from specjax.io.checkpoint import load_tokenizer, weights_sha256
from specjax.drafters import load_drafter
from train.common import REPO, repo_relative


def fit_counts(target, drafter, prompts, trees, new_tokens: int, batch: int = 4) -> tuple[np.ndarray, np.ndarray]:
    """(seen, hits) [CELLS] summed over `trees` and prompt batches."""
    seen, hits = np.zeros(adaptive.CELLS), np.zeros(adaptive.CELLS)
    for tree in trees:
        n = drafter.resolve_tree(tree_lib.parse_tree_spec(tree)).num_nodes
        probe = adaptive.AdaptiveShape(drafter, (1.0,) * len(widths.adaptive_widths(n)), calibration_decay=1.0)
        for i in range(0, len(prompts), batch):
            res = specjax.generate(target, prompts[i:i + batch], max_new_tokens=new_tokens, drafters=[probe], tree=tree,
                                   eos_token_id=())
            seen += res.stats["adaptive_seen"][0]  # shared by the rows of a batch
            hits += res.stats["adaptive_hits"][0]
    return seen, hits


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--drafter", required=True, help="an lm, feature or block drafter directory")
    ap.add_argument("--tree", action="append", default=[], help="tree spec(s) to draft (default: the drafter's default)")
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--kind", default="whole_functions",
                    help="prompt set: whole_functions (train.prompts.whole_function_prompts, as tools/bench_adaptive.py) "
                         "or a train.prompts kind")
    args = ap.parse_args(argv)
    from train import prompts as prompt_sets
    t0 = time.perf_counter()
    target = specjax.load_model(args.target)
    try:
        drafter = load_drafter(args.drafter, target, target_path=args.target, tuned=False)
        trees = args.tree or [drafter.default_tree]
        for t in trees:
            drafter.check_tree(drafter.resolve_tree(tree_lib.parse_tree_spec(t)), "greedy")
    except ValueError as e:
        sys.exit(f"error: {e}")
    tok = load_tokenizer(args.target)
    if args.kind == "whole_functions":
        rows = prompt_sets.whole_function_prompts(tok, args.prompts, split="validation", max_tokens=args.context)
    else:
        rows = prompt_sets.prompt_set(args.kind, tok, args.prompts, split="validation", context_tokens=args.context)
    prompts = [p["ids"] for p in rows]
    seen, hits = fit_counts(target, drafter, prompts, trees, args.new_tokens)
    info = {"target": repo_relative(args.target), "target_sha256": weights_sha256(args.target),
            "drafter": repo_relative(args.drafter), "trees": trees, "split": "validation", "kind": args.kind,
            "prompts": len(prompts), "new_tokens": args.new_tokens,
            "command": "python -m train.adaptive_calibration " + " ".join(argv if argv is not None else sys.argv[1:]),
            "seconds": round(time.perf_counter() - t0, 1)}
    grid = (adaptive.DEPTHS, adaptive.BINS)
    seen_g, hits_g = np.round(seen, 3).reshape(grid), np.round(hits, 3).reshape(grid)
    out = calibration.write_calibration(args.drafter, calibration.STEP,
                                        calibration.Table.make(seen_g, calibration.fit_pooled_rates(seen_g, hits_g)),
                                        hits=hits_g.tolist(), **info)
    print(f"wrote {out}: {int(seen.sum())} observed nodes, {int(hits.sum())} accepted")
    for d, (n, h) in enumerate(zip(seen.reshape(adaptive.DEPTHS, -1), hits.reshape(adaptive.DEPTHS, -1))):
        if n.sum():
            print(f"  depth {d + 1}: {int(n.sum())} nodes, accepted {h.sum() / n.sum():.2f}; by q bin "
                  + " ".join(f"{a / b:.2f}" if b else "-" for a, b in zip(h, n)))


if __name__ == "__main__":
    jax.config.update("jax_compilation_cache_dir", str(REPO / "runs" / "jax-cache"))
    main()
