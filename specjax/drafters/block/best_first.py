"""Best-first trees from one block pass, as functions of the block drafter (design §5e; `ddtree,nodes=N,...` / `treeflash,nodes=N,...`
specs): per-depth transition tables (`tables`), then a heap in the program (`tree.best_first`):
pop the best path, push its next sibling and its first child, N-1 times.

    ddtree      marginal rows: one per depth, the row along the drafter's own greedy chain (DSpark:
                the Markov head given the chain's previous token; DFlash: b_k); every node expandable
    treeflash   conditional rows for the top m candidate previous tokens of each position (the top
                m of the marginal row above), top k children each; a node whose token is not a
                candidate is a leaf (as in ETH-DISCO/TreeFlash). rows=markov: the Markov head's
                exact rows b_k + W2(W1[x]) (free); rows=head: TreeFlash's autoregressive-
                approximation head (`ar_intermediate` > 0, `network.ar_logits`), trained on the
                frozen backbone
    select=taps paths ranked by the product of calibrated acceptance estimates g(q, depth)
                (`specjax.spec.calibration`: fitted by `train.path_calibration`, stored with the drafter); with
                `costs` the verify budget is chosen per round among `widths.tree_widths(N)` (design §3b)

A TreeFlash head may be stored without its backbone (`save_block_head(backbone=DIR)`): only the
head's tensors, the backbone's directory and weights digest in its config. Departures from
TreeFlash: candidates come from the Markov-corrected greedy chain's rows (not raw DFlash logits),
the head adds the backbone's Markov term, and it trains on the DSpark objective.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from specjax.spec import tree as tree_lib
from specjax.spec import widths as widths_lib
from specjax.drafters.base import SAMPLED_RULES, DraftContext, Proposal
from specjax.drafters.block.network import BlockPass, BlockState, ar_logits, markov_embed, position_logits


def check(d, spec, rule: str) -> None:
    """ValueError on a best-first setup the block drafter `d` cannot draft."""
    cfg = d.head.config
    W = cfg.drafts
    if spec.depth is None:
        raise ValueError("an unresolved best-first tree: call the drafter's resolve_tree first")
    if cfg.ar_drafts:
        raise ValueError("a best-first tree is drafted from Markov or TreeFlash tables; this DPara drafter "
                         "drafts through its autoregressive head: use a chain, a path list or a dynamic tree")
    if rule in SAMPLED_RULES:
        raise ValueError(f"a best-first tree's children are the top-k of its tables (deterministic "
                         f"candidates): use verify='deterministic' (or greedy), not {rule!r}")
    if spec.depth > W:
        raise ValueError(f"best-first tree depth {spec.depth} is deeper than the block drafter's block "
                         f"({W} positions): set depth=<= {W}")
    if max(spec.k, spec.m) > d.vocab_size:
        raise ValueError(f"best-first k={spec.k} / m={spec.m} exceed the vocabulary ({d.vocab_size})")
    if d.confidence != "off":
        raise ValueError("confidence cuts apply to a chain; a best-first tree needs confidence='off' "
                         "(its budget: select=taps with costs)")
    kind = row_kind(cfg, spec)
    if spec.select == "taps":
        if d.path_calibration is None or kind not in d.path_calibration.kinds():
            raise ValueError(f"select=taps needs this drafter's path calibration for {kind} rows "
                             f"(calibration.json: python -m train.path_calibration)")
        if d.costs is not None and len(d.costs) != len(widths(d, spec)):
            raise ValueError(f"costs has {len(d.costs)} entries for the verify widths {widths(d, spec)}")
    elif d.costs is not None:
        raise ValueError("costs choose a best-first tree's budget with select=taps only")


def widths(d, spec) -> tuple[int, ...]:
    """TAPS with costs chooses its budget among `widths.tree_widths(N)`; else the whole tree."""
    if spec.select == "taps" and d.costs is not None:
        return widths_lib.check_widths(d.widths or widths_lib.tree_widths(spec.num_nodes), spec.num_nodes)
    return (spec.num_nodes,)


def row_kind(cfg, spec) -> str:
    """The table rows a best-first spec drafts from on a head of config `cfg` ("auto": the TreeFlash head
    where there is one, else the Markov head's exact rows); ValueError where it has none."""
    kind = spec.rows
    if kind == "auto":
        kind = "head" if cfg.has_ar_head else "markov"
    if kind == "head" and not cfg.has_ar_head:
        raise ValueError("rows=head needs a TreeFlash head (a block drafter trained with ar_intermediate > 0); "
                         "this one has none: use rows=markov (DSpark) or a ddtree")
    if kind == "markov" and cfg.markov_rank == 0:
        raise ValueError("conditional rows need a Markov head or a TreeFlash head; this block drafter (DFlash) "
                         "has neither: use a ddtree (marginal rows)")
    return kind


def resolve(cfg, spec):
    """A best-first tree without a depth reaches min(block, nodes - 1)."""
    if isinstance(spec, tree_lib.BestFirstTree) and spec.depth is None:
        return dataclasses.replace(spec, depth=min(cfg.drafts, spec.nodes - 1))
    return spec


def tables(head, target, blk: BlockPass, root_B, spec):
    """A best-first spec's transition tables from one backbone pass: (tokens, log q, child rows)
    [B, R, K] and the depth of each row's children [R] (numpy).
    Marginal rows (DDTree), one per depth d = 1..D: block position d-1's row along the drafter's
    own greedy chain (DSpark: the Markov head given the chain's previous token, exact at d = 1;
    DFlash: b_{d-1}); every node is expandable (its children: the next depth's row).
    Conditional rows (TreeFlash): row 0 lists the root's children (exact); for positions
    p = 1..D-1, one row per candidate previous token, the top m of position p-1's marginal row
    (the Markov head's exact row, or the TreeFlash head's); a node whose token is not among its
    depth's candidates is a leaf (as in ETH-DISCO/TreeFlash)."""
    D, K = spec.depth, spec.k
    B = root_B.shape[0]
    prev, marg = root_B, []
    for p in range(D):  # the greedy chain: D cheap steps of [B, V]
        lq = jax.nn.log_softmax(position_logits(head, blk.base[:, p], markov_embed(head, prev)), axis=-1)
        marg.append(lq)
        prev = jnp.argmax(lq, axis=-1).astype(jnp.int32)
    marg = jnp.stack(marg, axis=1)  # [B, D, V]
    if not spec.conditional:
        lq, tok = jax.lax.top_k(marg, K)
        child = np.where(np.arange(D) + 1 < D, np.arange(D) + 1, -1)
        return tok, lq, jnp.broadcast_to(jnp.asarray(child, jnp.int32)[None, :, None], (B, D, K)), np.arange(1, D + 1)
    m, kind = spec.m, row_kind(head.config, spec)
    _, cand = jax.lax.top_k(marg[:, :D - 1], m)  # [B, D-1, m]: the previous-token candidates of positions 1..D-1
    if kind == "head":
        first = ar_logits(head, target, blk.pre[:, 0], blk.hidden[:, 0], root_B)
        rest = ar_logits(head, target, blk.pre[:, 1:D, None], blk.hidden[:, 1:D, None], cand)
        first = jax.nn.log_softmax(first, axis=-1)
    else:
        first = marg[:, 0]
        rest = position_logits(head, blk.base[:, 1:D, None], markov_embed(head, cand))
    rows = jnp.concatenate([first[:, None], jax.nn.log_softmax(rest, axis=-1).reshape(B, (D - 1) * m, -1)], axis=1)
    lq, tok = jax.lax.top_k(rows, K)  # [B, R, K], R = 1 + (D-1) m
    pos = np.concatenate([[0], np.repeat(np.arange(1, D), m)])  # the block position of each row
    # children of a row at position p are at position p+1: their row is the match among its candidates
    nxt = jnp.take_along_axis(cand, jnp.asarray(np.minimum(pos, D - 2))[None, :, None], axis=1) if D > 1 else None
    if D == 1:
        child = jnp.full(tok.shape, -1, jnp.int32)
    else:
        hit = tok[..., None] == nxt[:, :, None, :]  # [B, R, K, m]
        idx = jnp.argmax(hit, axis=-1)
        child = jnp.where(hit.any(-1) & jnp.asarray(pos + 1 < D)[None, :, None],
                          1 + jnp.asarray(pos)[None, :, None] * m + idx, -1).astype(jnp.int32)
    return tok, lq, child, pos + 1


def propose(d, state: BlockState, cache, base, h, pre, root_B, ctx: DraftContext) -> Proposal:
    """A best-first tree (DDTree / TreeFlash, design §5e) from the one backbone pass: the tables,
    the heap in the program; TAPS ranks by calibrated acceptance estimates and, with costs,
    chooses the verify budget."""
    spec = ctx.spec
    tok, lq, child, row_depth = tables(d.head, d.target, BlockPass(base, h, cache, pre), root_B, spec)
    key = lq
    if spec.select == "taps":
        key = d.path_calibration.log_g(row_kind(d.head.config, spec) if spec.conditional else "marginal", jnp.exp(lq),
                                          jnp.asarray(row_depth)[None, :, None])
    # The barrier keeps XLA from moving the tables' computation (an LM-head matmul and top-k per
    # row) into the heap's loop, which it does when the heap keys are the log-probs themselves
    # (measured: 54 ms a round for treeflash,nodes=16,rows=head on code-target; 7 ms with it).
    tok, key, lq, child = jax.lax.optimization_barrier((tok, key, lq, child))
    tree, path_key = tree_lib.best_first(root_B, tok, key, lq, child, spec.num_nodes, spec.depth)
    active = jnp.ones((root_B.shape[0],), bool) if ctx.active is None else ctx.active
    if spec.select == "taps" and d.costs is not None:
        tree = dataclasses.replace(tree, valid=widths_lib.budget_keep(path_key, tree.valid, active, d.costs,
                                                           widths(d, spec)))
    drafted = state.drafted + active.astype(jnp.int32) * jnp.sum(tree.valid[:, 1:], axis=1, dtype=jnp.int32)
    return Proposal(tree=tree, probs=None, state=dataclasses.replace(state, cache=cache, drafted=drafted))
