"""Validation (self-fed acceptance by position, as `train.block` reports it) of trained block
drafters on one set of anchors: each drafter on the same validation blocks, so DSpark (trained on
anchors anywhere) and ReaDy (trained on the state grid) are compared on equal terms.

    python -m tools.eval_block_anchors --target models/code-target-hybrid \
        --drafters models/code-target-hybrid-dspark,models/code-target-hybrid-ready --every 8
"""
from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from specjax.io.checkpoint import load_model, load_tokenizer
from specjax.drafters import BlockDrafter, check_feature_target
from specjax.drafters.block import load_block_head
from tools.harness import REPO, Column, run_meta, write_outputs
from train import block, data
from train.lm import load_streams_for


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m tools.eval_block_anchors",
                                 description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--drafters", required=True, help="comma-separated block-drafter directories")
    ap.add_argument("--every", type=int, default=8, help="anchors on this grid (ReaDy's state grid)")
    ap.add_argument("--anchors", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--eval-tokens", type=int, default=16384)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--zero-state", action="store_true", help="also each state reader on zeroed states")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args(argv)
    target = load_model(args.target)
    tok = load_tokenizer(args.target)
    streams = load_streams_for(tok, "train/manifest.json", None, None, REPO / "runs" / "eval-token-cache")
    val = data.eval_windows(streams.validation, args.seq_len - 1, args.eval_tokens)
    rows = []
    for d in args.drafters.split(","):
        head = load_block_head(d)
        BlockDrafter.for_config(head.config)(head, target)  # the head's checks against this target (width, vocabulary, state shape)
        check_feature_target(d, args.target)  # and the weights it was trained on
        W = head.config.block_size
        variants = [False] + ([True] if args.zero_state and head.config.reads_state else [])
        for zero in variants:
            step = jax.jit(lambda h, t, toks, zero=zero: block.eval_blocks(  # models as arguments, not constants
                h, t, toks, block.grid_anchors(None, toks.shape[0], toks.shape[1], args.anchors, W, args.every,
                                               evenly=True), args.every, zero)[:2])
            agree, accepted = [], []
            n = len(val) // args.batch * args.batch or len(val)
            for i in range(0, n, args.batch):
                ag, acc = step(head, target, jnp.asarray(val[i:i + args.batch]))
                agree.append(np.asarray(ag).reshape(-1, W))
                accepted.append(np.asarray(acc).reshape(-1, W))
            agree, accepted = np.concatenate(agree), np.concatenate(accepted)
            row = {"drafter": d + (" (zeroed state)" if zero else ""), "blocks": int(len(agree)),
                   "agree": agree.mean(0).round(4).tolist(), "accept": accepted.mean(0).round(4).tolist(),
                   "tau_estimate": round(1.0 + float(accepted.sum(1).mean()), 3)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:  # <out>.json (the path given, a stem: .json added when missing) and <out>.md
        cols = [Column("drafter", "drafter", right=False), Column("blocks", "blocks"),
                Column("agree by position", lambda r: str(r["agree"]), right=False),
                Column("accept by position", lambda r: str(r["accept"]), right=False),
                Column("tau estimate", "tau_estimate", "{:.3f}")]
        write_outputs(args.out, run_meta("eval_block_anchors", argv, target=args.target, every=args.every,
                                         anchors=args.anchors, seq_len=args.seq_len, eval_tokens=args.eval_tokens),
                      rows, cols, title="Block drafters on one set of anchors (validation)")


if __name__ == "__main__":
    main()
