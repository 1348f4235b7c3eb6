"""Fits TAPS's path-conditioned acceptance estimates g(q, depth) for a block drafter (design §5e)
and stores them with the drafter (its row kinds' tables in `calibration.json`, read by `load_drafter`).

Validation rounds: the target's own greedy continuations of validation-split prompts (so along
each sequence every token is the target's greedy choice, as on an accepted path). A round rooted
at a generated position a sees the context before a; its tables come from the drafter's training
pass over all such anchors at once (equal to the drafting pass, `tests/test_block.py`). A node at
depth d drawn from a row that conditions on the accepted path (row 0 given the root; a conditional
row whose candidate previous token is the greedy token at a+d-1; DDTree's marginal row of depth
d) is accepted given its parent is iff its token is the greedy token at a+d. Each such row gives
its top k nodes (their own q and that label); per row kind, `calibration.fit_path_rates` bins them
by q and depth, shrinks each bin toward its depth's mean and makes it non-decreasing in q.

    python -m train.path_calibration --target models/code-target --drafter models/code-target-treeflash
"""
from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import specjax
from specjax.spec import calibration, tree as tree_lib
from specjax.io.checkpoint import load_tokenizer
from specjax.drafters import load_drafter
from specjax.drafters import block as Bk
from specjax.drafters.block import best_first
from specjax.models import family
from train.common import REPO, repo_relative


def greedy_sequences(target, prompts, new_tokens: int, batch: int = 4) -> list[list[int]]:
    out = []
    for i in range(0, len(prompts), batch):
        res = specjax.generate(target, prompts[i:i + batch], max_new_tokens=new_tokens, eos_token_id=())
        out += [p + s for p, s in zip(prompts[i:i + batch], res.sequences())]
    return out


def samples(drafter: Bk.BlockDrafter, target, seq: list[int], start: int, k: int, m: int):
    """{row kind: (q, depth, accepted)} over the rounds rooted at positions start .. len-W-1 of one
    greedy sequence."""
    W = drafter.head.config.block_size
    toks = jnp.asarray([seq], jnp.int32)
    T = toks.shape[1]
    anchors = np.arange(start, T - W)
    fam = family(target)
    out = fam.forward(target, toks, jnp.arange(T)[None], fam.init_cache(target, 1, T),
                      jnp.tril(jnp.ones((1, T, T), bool)), hidden_layers=drafter.head.config.target_layers)
    feats = Bk.target_features(out)
    tp = Bk.train_logits(drafter.head, target, toks, feats, jnp.asarray(anchors)[None])
    A = len(anchors)
    blk = Bk.BlockPass(tp.base[0], tp.hidden[0], None, tp.pre[0])
    roots = toks[0, anchors]
    nxt = np.stack([np.asarray(seq)[anchors + d] for d in range(1, W + 1)], axis=1)  # greedy tokens at depths 1..W
    kinds = ["marginal"] + (["markov"] if drafter.head.config.markov_rank else []) + (
        ["head"] if drafter.head.config.has_ar_head else [])
    res = {}
    for kind in kinds:
        rows = "marginal" if kind == "marginal" else kind
        spec = tree_lib.BestFirstTree(nodes=2, rows=rows, m=1 if kind == "marginal" else m, k=k, depth=W)
        tok, lq, _, depth = jax.jit(lambda b, r, s=spec: best_first.tables(drafter.head, drafter.target, b, r, s))(blk, roots)
        tok, q = np.asarray(tok), np.exp(np.asarray(lq))  # [A, R, K]
        if kind == "marginal":
            use = np.ones((A, W), bool)  # every depth's row
        else:  # row 0, and the row whose candidate previous token is the greedy token
            marg = jax.jit(lambda b, r: best_first.tables(drafter.head, drafter.target, b, r, tree_lib.BestFirstTree(nodes=2, k=m, depth=W)))(blk, roots)
            cand = np.asarray(marg[0])[:, :W - 1]  # [A, W-1, m]: the candidates of positions 1..W-1
            hit = cand == nxt[:, :W - 1, None]  # candidate i of position p+1 is the greedy token at depth p+1
            use = np.concatenate([np.ones((A, 1), bool), hit.reshape(A, -1)], axis=1)
        label = tok == nxt[np.arange(A)[:, None], depth[None] - 1][..., None]  # [A, R, K]
        sel = np.broadcast_to(use[..., None], tok.shape)
        d = np.broadcast_to(depth[None, :, None], tok.shape)
        res[kind] = (q[sel], d[sel], label[sel])
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=192)
    ap.add_argument("--k", type=int, default=8, help="nodes per row that give samples")
    ap.add_argument("--m", type=int, default=8, help="candidate previous tokens per position")
    ap.add_argument("--bins", type=int, default=10)
    ap.add_argument("--kind", default="functions")
    args = ap.parse_args(argv)
    from train import prompts as prompt_sets
    t0 = time.perf_counter()
    target = specjax.load_model(args.target)
    drafter = load_drafter(args.drafter, target, target_path=args.target, tuned=False)
    if not isinstance(drafter, Bk.BlockDrafter):
        sys.exit(f"error: {args.drafter} is not a block drafter")
    tok = load_tokenizer(args.target)
    prompts = [p["ids"] for p in prompt_sets.prompt_set(args.kind, tok, args.prompts, split="validation",
                                                        context_tokens=args.context)]
    seqs = greedy_sequences(target, prompts, args.new_tokens)
    pooled: dict[str, list] = {}
    for p, s in zip(prompts, seqs):
        for kind, (q, d, y) in samples(drafter, target, s, len(p), args.k, args.m).items():
            pooled.setdefault(kind, []).append((q, d, y))
    W = drafter.head.config.block_size
    command = "python -m train.path_calibration " + " ".join(argv if argv is not None else sys.argv[1:])
    for kind, parts in pooled.items():
        q, d, y = (np.concatenate([x[i] for x in parts]) for i in range(3))
        table, n = calibration.fit_path_rates(q, d, y, depths=W, bins=args.bins)
        rates = [round(float(y[d == k + 1].mean()), 4) if (d == k + 1).any() else None for k in range(W)]
        out = calibration.write_calibration(
            args.drafter, kind, calibration.Table.make(n, np.round(table, 5)), acceptance_by_depth=rates,
            sequences=len(seqs), rounds_per_sequence=args.new_tokens - W, k=args.k, m=args.m, split="validation",
            kind=args.kind, target=repo_relative(args.target), command=command,
            seconds=round(time.perf_counter() - t0, 1))
        print(f"wrote {out}: {kind}, {int(np.sum(n))} nodes")

if __name__ == "__main__":
    jax.config.update("jax_compilation_cache_dir", str(REPO / "runs" / "jax-cache"))
    main()
