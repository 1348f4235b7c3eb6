"""The draft tree: padded static buffers (design §2) and everything derived from them; the specs
(static, dynamic, best-first) are in `specjax.spec.tree_spec` and re-exported here.

A tree holds at most N nodes per row, node 0 the root (the last emitted token, whose target K/V is
not in the cache yet). Nodes are in topological order (parent < child), so ancestry and paths are
computed by a loop over depth in jitted code. A chain is a tree of width 1: no separate path.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from specjax.spec.tree_spec import (ROW_KINDS, SELECTS, BestFirstTree, DynamicTree, StaticTree,  # noqa: F401
                               TreeSpec, chain, is_chain, parse_tree_spec, validate_paths)
from specjax.typing import Array, Bool, Float, Int


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TreeBuffers:
    tokens: Int[Array, "B N"]
    parents: Int[Array, "B N"]  # -1 for the root and for padding
    depth: Int[Array, "B N"]  # 0 for the root
    valid: Bool[Array, "B N"]
    score: Float[Array, "B N"]  # cumulative draft log-prob, used to rank nodes
    source: Int[Array, "B N"]  # int8: which drafter proposed the node (TreeGraft)

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]


def chain_tree(root_B, draft_BxD, logq_BxD=None, source: int = 0) -> TreeBuffers:
    """A root followed by a chain of D drafted tokens."""
    B, D = draft_BxD.shape
    N = D + 1
    idx = jnp.arange(N)
    score = jnp.zeros((B, N)) if logq_BxD is None else jnp.concatenate(
        [jnp.zeros((B, 1)), jnp.cumsum(logq_BxD, axis=1)], axis=1)
    return TreeBuffers(
        tokens=jnp.concatenate([root_B[:, None], draft_BxD], axis=1).astype(jnp.int32),
        parents=jnp.broadcast_to(idx - 1, (B, N)).astype(jnp.int32),
        depth=jnp.broadcast_to(idx, (B, N)).astype(jnp.int32),
        valid=jnp.ones((B, N), bool),
        score=score.astype(jnp.float32),
        source=jnp.full((B, N), source, jnp.int8))


def pad_nodes(tree: TreeBuffers, num_nodes: int) -> TreeBuffers:
    """The tree padded with invalid nodes to `num_nodes` (no parent, score -inf)."""
    pad = num_nodes - tree.num_nodes
    if pad < 0:
        raise ValueError(f"a tree of {tree.num_nodes} nodes does not fit {num_nodes}")
    if pad == 0:
        return tree
    B = tree.tokens.shape[0]

    def ext(x, fill):
        return jnp.concatenate([x, jnp.full((B, pad), fill, x.dtype)], axis=1)

    return TreeBuffers(tokens=ext(tree.tokens, 0), parents=ext(tree.parents, -1), depth=ext(tree.depth, 0),
                       valid=ext(tree.valid, False), score=ext(tree.score, -jnp.inf), source=ext(tree.source, 0))


def ancestor_mask(tree: TreeBuffers, max_depth: int) -> Bool[Array, "B N N"]:
    """mask[b, i, j]: node j is node i or one of its ancestors (both valid)."""
    B, N = tree.parents.shape
    eye = jnp.eye(N, dtype=bool)[None]
    parents = jnp.where(tree.valid, tree.parents, -1)

    # anc_k[i] = the k-th ancestor of i (-1 past the root); mark each one. Depth <= max_depth.
    def step(_, carry):
        mask, anc_BxN = carry
        hit = jax.nn.one_hot(anc_BxN, N, dtype=bool)  # -1 gives an all-false row
        nxt = jnp.where(anc_BxN >= 0, jnp.take_along_axis(parents, jnp.maximum(anc_BxN, 0), axis=1), -1)
        return mask | hit, nxt

    mask, _ = jax.lax.fori_loop(0, max_depth, step, (jnp.broadcast_to(eye, (B, N, N)), parents))
    return mask & tree.valid[:, :, None] & tree.valid[:, None, :]


def well_formed(tree: TreeBuffers, root_B, max_depth: int) -> TreeBuffers:
    """The tree the engine verifies, whatever a drafter proposed: node 0 is the root (the last
    emitted token: valid, no parent, depth 0); any other node stays valid only where the drafter
    marked it valid, its parent precedes it and is valid, and it lies at most `max_depth` below the
    root; depths are recomputed from the parents. A well-formed proposal comes out unchanged, so
    losslessness does not rest on a drafter's bookkeeping (a root marked invalid, for one, drops the
    root's own key from its attention row and the round emits a wrong bonus token)."""
    B, N = tree.parents.shape
    idx = jnp.arange(N, dtype=jnp.int32)[None]
    root = idx == 0
    par = tree.parents.astype(jnp.int32)
    linked = root | (tree.valid & (par >= 0) & (par < idx))
    safe = jnp.clip(par, 0, N - 1)

    def step(_, carry):  # after k steps: right for every node at most k below the root
        valid, depth = carry
        return (root | (linked & jnp.take_along_axis(valid, safe, axis=1)),
                jnp.where(root, 0, jnp.take_along_axis(depth, safe, axis=1) + 1))

    start = jnp.broadcast_to(jnp.where(root, 0, max_depth + 1), (B, N)).astype(jnp.int32)
    valid, depth = jax.lax.fori_loop(0, max_depth, step, (linked, start))
    valid = valid & (depth <= max_depth)
    return dataclasses.replace(
        tree, tokens=jnp.where(root, root_B[:, None].astype(tree.tokens.dtype), tree.tokens),
        parents=jnp.where(root, -1, tree.parents), valid=valid,
        depth=jnp.where(valid, depth, jnp.clip(tree.depth, 0, max_depth)).astype(tree.depth.dtype))


def positions(tree: TreeBuffers, cache_length_B) -> Int[Array, "B N"]:
    return cache_length_B[:, None] + tree.depth


def path_to(tree: TreeBuffers, node_B, max_depth: int) -> Int[Array, "B D+1"]:
    """Root-to-node path as node ids, padded with the node itself past its depth."""
    B = node_B.shape[0]
    depth_B = jnp.take_along_axis(tree.depth, node_B[:, None], axis=1)[:, 0]
    path = jnp.broadcast_to(node_B[:, None], (B, max_depth + 1)).astype(jnp.int32)

    def step(k, carry):
        path, cur = carry
        d = depth_B - k  # the depth of `cur`
        path = jnp.where((d >= 0)[:, None] & (jnp.arange(max_depth + 1)[None] == d[:, None]), cur[:, None], path)
        cur = jnp.where(d > 0, jnp.take_along_axis(tree.parents, cur[:, None], axis=1)[:, 0], cur)
        return path, cur

    path, _ = jax.lax.fori_loop(0, max_depth + 1, step, (path, node_B.astype(jnp.int32)))
    return path


def path_sum(local_BxN, parents_BxN, max_depth: int):
    """Cumulative sums from the root: out[i] = local[i] + out[parent(i)] (root: its own local)."""
    par = jnp.maximum(parents_BxN, 0)
    has = parents_BxN >= 0
    return jax.lax.fori_loop(
        0, max_depth, lambda _, c: local_BxN + jnp.where(has, jnp.take_along_axis(c, par, axis=1), 0.0), local_BxN)


def path_min(rank_BxN, parents_BxN, max_depth: int):
    """out[i] = min(rank[i], out[parent(i)]): no node outranks an ancestor."""
    par = jnp.maximum(parents_BxN, 0)
    has = parents_BxN >= 0
    return jax.lax.fori_loop(
        0, max_depth,
        lambda _, c: jnp.where(has, jnp.minimum(rank_BxN, jnp.take_along_axis(c, par, axis=1)), rank_BxN), rank_BxN)


def accepted_nodes(tree: TreeBuffers, tokens_BxT, count_B):
    """(on_path, observed) [B, N]: the valid nodes on the accepted path (root included), and the valid
    non-root nodes whose parent is on it (those whose acceptance this round tells something). The
    path is read from the committed tokens (`tokens_BxT`: the root, then the accepted tokens; `count_B`
    of them valid): siblings carry distinct tokens, so the tokens name the accepted nodes."""
    B, N = tree.tokens.shape
    T = tokens_BxT.shape[1]
    n = jnp.maximum(count_B - 1, 0)
    on = jnp.arange(N)[None] == 0
    par = jnp.maximum(tree.parents, 0)
    for d in range(1, T):  # depth by depth: a node at depth d holding the d-th accepted token, child of the path
        on_parent = jnp.take_along_axis(on, par, axis=1) & (tree.parents >= 0)
        on = on | (tree.valid & (tree.depth == d) & on_parent & (tree.tokens == tokens_BxT[:, d:d + 1]) & (d <= n)[:, None])
    observed = tree.valid & (tree.parents >= 0) & jnp.take_along_axis(on, par, axis=1)
    return on, observed


# ----------------------------------------------------------------------------- expansion

def static_ancestors(parents_N: np.ndarray) -> np.ndarray:
    """Host-side ancestor-or-self matrix of a static layout. [N, N] bool."""
    N = len(parents_N)
    anc = np.eye(N, dtype=bool)
    for i in range(1, N):
        anc[i] |= anc[parents_N[i]]
    return anc


def _children_tokens(key, logq_BxFxV, count: int, mode: str):
    """The `count` ranked child tokens of each evaluated node: top-k, or draws from q."""
    if mode == "topk":
        _, tok = jax.lax.top_k(logq_BxFxV, count)
    elif mode == "sample":  # with replacement
        tok = jax.random.categorical(key, logq_BxFxV[..., None, :], axis=-1,
                                     shape=logq_BxFxV.shape[:-1] + (count,))
    elif mode == "sample_noreplace":  # Gumbel top-k draws without replacement
        g = jax.random.gumbel(key, logq_BxFxV.shape)
        _, tok = jax.lax.top_k(jnp.where(jnp.isfinite(logq_BxFxV), logq_BxFxV + g, -jnp.inf), count)
    else:
        raise ValueError(f"unknown child mode {mode!r}")
    return tok.astype(jnp.int32)


def expand(spec: TreeSpec, root_B, evaluate, state, key, *, mode: str = "topk", source: int = 0, stop=None):
    """Builds a draft tree depth by depth.

    `evaluate(state, tokens_BxF, depth, offset, mask_BxFxS, parent_slot_BxF) -> (logq_BxFxV, state)`
    runs the drafter on F new nodes of one depth placed at scratch slots `offset .. offset+F-1`,
    each seeing the scratch slots [0, S) marked in `mask` (its ancestors and itself);
    `parent_slot` is the scratch slot of each node's parent (-1 for the root), for drafters that
    feed a node's own hidden state to its children (EAGLE). `depth` and `offset` are Python ints,
    except in a tree of depth >= `LOOP_MIN_DEPTH` that is a chain or dynamic: its depths past the
    root run in one `fori_loop`, where they are traced int32 scalars (>= 1) and the mask spans every
    slot the expansion evaluates (N for a chain, 1 + (D-1)·topk for a dynamic tree; the slots after
    a node are not visible). `stop(d, score_BxN) -> bool []` (chains of depth >= LOOP_MIN_DEPTH
    only; others draft whole): after the d-th token the chain stops if it says so, the nodes past
    d invalid and their steps not run (a `while_loop`). Returns
    (TreeBuffers [B, N], draft probabilities q at each node [B, N, V] or None, state).
    """
    if isinstance(spec, BestFirstTree):
        raise ValueError("a best-first tree (ddtree / treeflash) is drafted from per-depth tables "
                         "(`tree.best_first`), by a drafter that gives them: a block drafter")
    if isinstance(spec, StaticTree):
        if stop is not None and is_chain(spec) and spec.max_depth >= LOOP_MIN_DEPTH:
            return _expand_chain(spec, root_B, evaluate, state, key, mode, source, stop)
        return _expand_static(spec, root_B, evaluate, state, key, mode, source)
    if mode != "topk":
        raise ValueError("a dynamic tree ranks candidates by score: sampled candidates need a static tree")
    if spec.depth >= LOOP_MIN_DEPTH:
        return _expand_dynamic_loop(spec, root_B, evaluate, state, source)
    return _expand_dynamic(spec, root_B, evaluate, state, source)


LOOP_MIN_DEPTH = 3  # chains and dynamic trees this deep expand their depths past the root in a loop
# (shallower ones would compile as many drafter steps either way; the unrolled forms stay for them)


def _expand_chain(spec: StaticTree, root_B, evaluate, state, key, mode, source, stop=None):
    """A chain (one node per depth): the root evaluated once, then depths 1 .. D-1 in one
    `fori_loop`, so the drafter's step is traced, lowered and compiled twice instead of D times.
    Inside the loop `depth` and `offset` are traced int32 scalars and every node's mask covers all
    N scratch slots (the slots after it are not visible). Same tree and q as the unrolled form.
    With `stop`, a `while_loop` that ends once `stop(d, score)` holds after the d-th token (the
    undrafted nodes keep score -inf: invalid)."""
    N, D, B = spec.num_nodes, spec.max_depth, root_B.shape[0]

    def pick(logq_BxV, d):
        tok = _children_tokens(jax.random.fold_in(key, d), logq_BxV[:, None], 1, mode)[:, 0, 0]
        return tok, jnp.take_along_axis(logq_BxV, tok[:, None], axis=-1)[:, 0]

    logq, state = evaluate(state, root_B[:, None], 0, 0, jnp.ones((B, 1, 1), bool), jnp.full((B, 1), -1, jnp.int32))
    tok, lq = pick(logq[:, 0], 0)
    tokens = jnp.zeros((B, N), jnp.int32).at[:, 0].set(root_B).at[:, 1].set(tok)
    score = jnp.full((B, N), 0.0 if stop is None else -jnp.inf, jnp.float32).at[:, 0].set(0.0).at[:, 1].set(lq)
    probs = jnp.zeros((B, N, logq.shape[-1]), jnp.float32).at[:, 0].set(jnp.exp(logq[:, 0]))

    def body(d, carry):
        tokens, score, probs, state = carry
        mask = jnp.broadcast_to((jnp.arange(N) <= d)[None, None], (B, 1, N))
        node = jax.lax.dynamic_slice_in_dim(tokens, d, 1, axis=1)
        logq, state = evaluate(state, node, d, d, mask, jnp.full((B, 1), d - 1, jnp.int32))
        tok, lq = pick(logq[:, 0], d)
        tokens = jax.lax.dynamic_update_slice_in_dim(tokens, tok[:, None], d + 1, axis=1)
        prev = jax.lax.dynamic_slice_in_dim(score, d, 1, axis=1)
        score = jax.lax.dynamic_update_slice_in_dim(score, prev + lq[:, None], d + 1, axis=1)
        probs = jax.lax.dynamic_update_slice_in_dim(probs, jnp.exp(logq).astype(probs.dtype), d, axis=1)
        return tokens, score, probs, state

    if stop is None:
        tokens, score, probs, state = jax.lax.fori_loop(1, D, body, (tokens, score, probs, state))
    else:
        def cond(carry):
            d, _, score, _, _ = carry
            return (d < D) & ~stop(d, score)

        _, tokens, score, probs, state = jax.lax.while_loop(
            cond, lambda c: (c[0] + 1,) + body(c[0], c[1:]), (jnp.int32(1), tokens, score, probs, state))
    return _static_buffers(spec, tokens, score, source), probs, state


def _static_buffers(spec: StaticTree, tokens_BxN, score_BxN, source) -> TreeBuffers:
    """A static layout's tree buffers around expanded tokens and scores (a node is valid iff its
    score is finite)."""
    parents, depth, _ = spec.layout()
    B, N = tokens_BxN.shape
    return TreeBuffers(
        tokens=tokens_BxN,
        parents=jnp.broadcast_to(jnp.asarray(parents), (B, N)),
        depth=jnp.broadcast_to(jnp.asarray(depth), (B, N)),
        valid=jnp.isfinite(score_BxN),
        score=score_BxN,
        source=jnp.full((B, N), source, jnp.int8))


def _expand_static(spec: StaticTree, root_B, evaluate, state, key, mode, source):
    if is_chain(spec) and spec.max_depth >= LOOP_MIN_DEPTH:  # a chain: steps in a loop
        return _expand_chain(spec, root_B, evaluate, state, key, mode, source)
    parents, depth, rank = spec.layout()
    anc = static_ancestors(parents)
    N, D, B = spec.num_nodes, spec.max_depth, root_B.shape[0]
    starts = [int(np.searchsorted(depth, d)) for d in range(D + 2)]
    tokens = jnp.zeros((B, N), jnp.int32).at[:, 0].set(root_B)
    score = jnp.zeros((B, N), jnp.float32)
    probs = None
    for d in range(D):
        s, e, ce = starts[d], starts[d + 1], starts[d + 2]  # nodes at depth d: [s, e); children: [e, ce)
        mask = jnp.broadcast_to(jnp.asarray(anc[s:e, :e]), (B, e - s, e))
        parent_slot = jnp.broadcast_to(jnp.asarray(parents[s:e]), (B, e - s))  # slot == node id here
        logq, state = evaluate(state, tokens[:, s:e], d, s, mask, parent_slot)  # [B, F, V]
        if probs is None:
            probs = jnp.zeros((B, N, logq.shape[-1]), jnp.float32)
        probs = probs.at[:, s:e].set(jnp.exp(logq))
        count = int(rank[e:ce].max()) + 1
        kids = _children_tokens(jax.random.fold_in(key, d), logq, count, mode)  # [B, F, count]
        par_local = jnp.asarray(parents[e:ce] - s)
        child_tok = kids[:, par_local, jnp.asarray(rank[e:ce])]  # [B, ce-e]
        child_logq = jnp.take_along_axis(logq[:, par_local], child_tok[..., None], axis=-1)[..., 0]
        tokens = tokens.at[:, e:ce].set(child_tok)
        score = score.at[:, e:ce].set(score[:, jnp.asarray(parents[e:ce])] + child_logq)
    return _static_buffers(spec, tokens, score, source), probs, state


def _expand_dynamic(spec: DynamicTree, root_B, evaluate, state, source):
    B, k, D, N = root_B.shape[0], spec.topk, spec.depth, spec.nodes
    P = spec.pool_size
    E = 1 + (D - 1) * k  # evaluated nodes: the root and k frontier nodes per depth below D
    pool_tok = jnp.zeros((B, P), jnp.int32).at[:, 0].set(root_B)
    pool_par = jnp.full((B, P), -1, jnp.int32)
    pool_depth = jnp.zeros((B, P), jnp.int32)
    pool_score = jnp.zeros((B, P), jnp.float32)
    # Ancestor-or-self mask over evaluated scratch slots; slot 0 is the root.
    eval_anc = jnp.zeros((B, E, E), bool).at[:, 0, 0].set(True)
    logq, state = evaluate(state, root_B[:, None], 0, 0, eval_anc[:, :1, :1], jnp.full((B, 1), -1, jnp.int32))
    top_v, top_t = jax.lax.top_k(logq[:, 0], k)  # [B, k]
    pool_tok = pool_tok.at[:, 1:1 + k].set(top_t)
    pool_par = pool_par.at[:, 1:1 + k].set(0)
    pool_depth = pool_depth.at[:, 1:1 + k].set(1)
    pool_score = pool_score.at[:, 1:1 + k].set(top_v)
    front_pool = jnp.broadcast_to(jnp.arange(1, 1 + k), (B, k))  # pool ids of the frontier
    front_parent_slot = jnp.zeros((B, k), jnp.int32)  # eval slot of each frontier node's parent
    write = 1 + k
    for d in range(1, D):
        off = 1 + (d - 1) * k  # eval slots of this frontier: [off, off + k)
        slots = off + jnp.arange(k)
        par_rows = jnp.take_along_axis(eval_anc, front_parent_slot[..., None], axis=1)  # [B, k, E]
        rows = par_rows | jax.nn.one_hot(slots, E, dtype=bool)[None]
        eval_anc = eval_anc.at[:, off:off + k].set(rows)
        f_tok = jnp.take_along_axis(pool_tok, front_pool, axis=1)
        f_score = jnp.take_along_axis(pool_score, front_pool, axis=1)
        logq, state = evaluate(state, f_tok, d, off, eval_anc[:, off:off + k, :off + k], front_parent_slot)
        top_v, top_t = jax.lax.top_k(logq, k)  # [B, k, k]
        cand_score = (f_score[..., None] + top_v).reshape(B, k * k)
        cand_tok = top_t.reshape(B, k * k)
        cand_par = jnp.repeat(front_pool, k, axis=1)
        sl = slice(write, write + k * k)
        pool_tok = pool_tok.at[:, sl].set(cand_tok)
        pool_par = pool_par.at[:, sl].set(cand_par)
        pool_depth = pool_depth.at[:, sl].set(d + 1)
        pool_score = pool_score.at[:, sl].set(cand_score)
        if d + 1 < D:
            _, best = jax.lax.top_k(cand_score, k)  # next frontier, as candidate ids
            front_pool = write + best
            front_parent_slot = off + best // k
        write += k * k
    tree, _ = select_nodes(pool_tok, pool_par, pool_depth, pool_score, N, source=source)
    return tree, None, state


def _expand_dynamic_loop(spec: DynamicTree, root_B, evaluate, state, source):
    """`_expand_dynamic` with depths 1 .. D-1 (each k frontier nodes: one shape) in one `fori_loop`:
    the drafter's step is traced, lowered and compiled twice instead of D times. Inside the loop
    `depth` and `offset` are traced and each frontier node's mask spans all E evaluated slots (its
    ancestors and itself set). Same pool, hence the same tree, as the unrolled form."""
    B, k, D, N = root_B.shape[0], spec.topk, spec.depth, spec.nodes
    P = spec.pool_size
    E = 1 + (D - 1) * k
    eval_anc = jnp.zeros((B, E, E), bool).at[:, 0, 0].set(True)
    logq, state = evaluate(state, root_B[:, None], 0, 0, eval_anc[:, :1, :1], jnp.full((B, 1), -1, jnp.int32))
    top_v, top_t = jax.lax.top_k(logq[:, 0], k)  # [B, k]
    pool_tok = jnp.zeros((B, P), jnp.int32).at[:, 0].set(root_B).at[:, 1:1 + k].set(top_t)
    pool_par = jnp.full((B, P), -1, jnp.int32).at[:, 1:1 + k].set(0)
    pool_depth = jnp.zeros((B, P), jnp.int32).at[:, 1:1 + k].set(1)
    pool_score = jnp.zeros((B, P), jnp.float32).at[:, 1:1 + k].set(top_v)
    front_pool = jnp.broadcast_to(jnp.arange(1, 1 + k, dtype=jnp.int32), (B, k))
    front_parent_slot = jnp.zeros((B, k), jnp.int32)

    def body(d, carry):
        pool_tok, pool_par, pool_depth, pool_score, eval_anc, front_pool, front_parent_slot, state = carry
        off = 1 + (d - 1) * k  # eval slots of this frontier: [off, off + k)
        write = 1 + k + (d - 1) * k * k  # pool slots of its candidates: [write, write + k*k)
        slots = off + jnp.arange(k)
        par_rows = jnp.take_along_axis(eval_anc, front_parent_slot[..., None], axis=1)  # [B, k, E]
        rows = par_rows | jax.nn.one_hot(slots, E, dtype=bool)[None]
        eval_anc = jax.lax.dynamic_update_slice_in_dim(eval_anc, rows, off, axis=1)
        f_tok = jnp.take_along_axis(pool_tok, front_pool, axis=1)
        f_score = jnp.take_along_axis(pool_score, front_pool, axis=1)
        logq, state = evaluate(state, f_tok, d, off, rows, front_parent_slot)
        top_v, top_t = jax.lax.top_k(logq, k)  # [B, k, k]
        cand_score = (f_score[..., None] + top_v).reshape(B, k * k)
        put = lambda buf, x: jax.lax.dynamic_update_slice_in_dim(buf, x.astype(buf.dtype), write, axis=1)  # noqa: E731
        pool_tok = put(pool_tok, top_t.reshape(B, k * k))
        pool_par = put(pool_par, jnp.repeat(front_pool, k, axis=1))
        pool_depth = put(pool_depth, jnp.full((B, k * k), d + 1, jnp.int32))
        pool_score = put(pool_score, cand_score)
        _, best = jax.lax.top_k(cand_score, k)  # next frontier, as candidate ids (unused after depth D-1)
        return (pool_tok, pool_par, pool_depth, pool_score, eval_anc, (write + best).astype(jnp.int32),
                (off + best // k).astype(jnp.int32), state)

    carry = (pool_tok, pool_par, pool_depth, pool_score, eval_anc, front_pool, front_parent_slot, state)
    pool_tok, pool_par, pool_depth, pool_score, _, _, _, state = jax.lax.fori_loop(1, D, body, carry)
    tree, _ = select_nodes(pool_tok, pool_par, pool_depth, pool_score, N, source=source)
    return tree, None, state


def select_nodes(tokens, parents, depth, score, num_nodes: int, *, valid=None, rank=None, source=0):
    """Keeps the root and the best `num_nodes - 1` nodes of a candidate pool.

    The pool ([B, P], P >= num_nodes) is in topological order (parent index < child index), root
    at 0, parents -1 for the root. Nodes are ranked by `rank` (default: `score`), invalid ones
    (`valid` False) last; a small depth penalty breaks ties toward parents, so when every node's
    rank is at most its parent's (cumulative log-probs) the kept set is a connected tree even
    when a child's log q is exactly 0. Kept nodes stay in pool order (topological), parents are
    remapped; a kept node whose parent was not kept, or whose score is -inf, comes out invalid.
    `source`: an int, or a [B, P] array gathered like the other fields.
    Returns (TreeBuffers [B, num_nodes], keep [B, num_nodes]: the pool index of each node).
    """
    B, P = tokens.shape
    N = num_nodes
    if P < N:
        raise ValueError(f"cannot keep {N} nodes of a pool of {P}")
    rank = score if rank is None else rank
    rank_key = (rank - 1e-4 * depth)[:, 1:]  # the root is always kept: rank the others
    if valid is not None:
        rank_key = jnp.where(valid[:, 1:], rank_key, -jnp.inf)
    _, keep = jax.lax.top_k(rank_key, N - 1)
    keep = keep + 1
    keep = jnp.concatenate([jnp.zeros((B, 1), keep.dtype), jnp.sort(keep, axis=1)], axis=1)  # [B, N], topological
    new_index = jnp.full((B, P), -1, jnp.int32)
    new_index = jax.vmap(lambda ni, kp: ni.at[kp].set(jnp.arange(N, dtype=jnp.int32)))(new_index, keep)
    old_par = jnp.take_along_axis(parents, keep, axis=1)
    new_par = jnp.where(old_par >= 0, jnp.take_along_axis(new_index, jnp.maximum(old_par, 0), axis=1), -1)
    kept_score = jnp.take_along_axis(score, keep, axis=1)
    ok = jnp.isfinite(kept_score) & ((new_par >= 0) | (jnp.arange(N)[None] == 0))
    if valid is not None:
        ok &= jnp.take_along_axis(valid, keep, axis=1)
    src = (jnp.full((B, N), source, jnp.int8) if isinstance(source, (int, np.integer))
           else jnp.take_along_axis(source, keep, axis=1).astype(jnp.int8))
    tree = TreeBuffers(
        tokens=jnp.take_along_axis(tokens, keep, axis=1),
        parents=new_par,
        depth=jnp.take_along_axis(depth, keep, axis=1),
        valid=ok,
        score=kept_score,
        source=src)
    return tree, keep.astype(jnp.int32)


# ----------------------------------------------------------------------------- best-first trees

def best_first(root_B, tok_BxRxK, key_BxRxK, logq_BxRxK, child_row_BxRxK, num_nodes: int, max_depth: int,
               source: int = 0):
    """The best-first tree over transition tables (DDTree; TreeFlash's tables), in the program.

    Row r of the tables lists K ranked children (tokens, heap keys, draft log-probs); row 0 lists
    the root's children; `child_row[b, r, j]` is the row that lists the children of child j of row r
    (-1: it is a leaf). Keys must be non-increasing along a row and at most 0 (log-probabilities, or
    log acceptance estimates), so a child never outranks its parent or its elder sibling. A node's
    heap key is the sum of its path's keys; each of the N-1 steps pops the best entry of a
    fixed-size array (2N-1 slots: the root's first child, then a sibling and a child slot per pop),
    makes it node i, and pushes its next sibling and its first child (within `max_depth`).
    Ties go to the entry pushed first. Returns (TreeBuffers [B, N] in pop order: score-descending,
    hence topological, `score` the cumulative draft log-prob, a node invalid where the heap ran
    dry; cumulative heap keys [B, N])."""
    B, R, K = tok_BxRxK.shape
    N = num_nodes
    C = 2 * N - 1
    neg = jnp.float32(-jnp.inf)

    def one(root, tok, key, lq, crow):
        heap = dict(key=jnp.full((C,), neg).at[0].set(key[0, 0]), base=jnp.zeros((C,), jnp.float32),
                    lqb=jnp.zeros((C,), jnp.float32), par=jnp.zeros((C,), jnp.int32), row=jnp.zeros((C,), jnp.int32),
                    rank=jnp.zeros((C,), jnp.int32), depth=jnp.ones((C,), jnp.int32))  # base / lqb: the parent's sums
        nodes = dict(tok=jnp.zeros((N,), jnp.int32).at[0].set(root), par=jnp.full((N,), -1, jnp.int32),
                     depth=jnp.zeros((N,), jnp.int32), valid=jnp.zeros((N,), bool).at[0].set(True),
                     score=jnp.zeros((N,), jnp.float32), key=jnp.zeros((N,), jnp.float32))

        def body(i, carry):
            heap, nodes = carry
            e = jnp.argmax(heap["key"])
            s = heap["key"][e]
            ok = jnp.isfinite(s)
            row, rank, d = heap["row"][e], heap["rank"][e], heap["depth"][e]
            base, lqb = heap["base"][e], heap["lqb"][e]
            lq_e = lqb + lq[row, rank]
            nodes = dict(tok=nodes["tok"].at[i].set(jnp.where(ok, tok[row, rank], 0)),
                         par=nodes["par"].at[i].set(jnp.where(ok, heap["par"][e], -1)),
                         depth=nodes["depth"].at[i].set(jnp.where(ok, d, 0)), valid=nodes["valid"].at[i].set(ok),
                         score=nodes["score"].at[i].set(jnp.where(ok, lq_e, neg)),
                         key=nodes["key"].at[i].set(jnp.where(ok, s, neg)))
            r1 = jnp.minimum(rank + 1, K - 1)
            sib_key = jnp.where(ok & (rank + 1 < K), base + key[row, r1], neg)
            cr = crow[row, rank]
            crc = jnp.maximum(cr, 0)
            kid_key = jnp.where(ok & (cr >= 0) & (d < max_depth), s + key[crc, 0], neg)
            put = {"key": (sib_key, kid_key), "base": (base, s), "lqb": (lqb, lq_e),
                   "par": (heap["par"][e], i), "row": (row, crc), "rank": (r1, 0), "depth": (d, d + 1)}
            heap = {name: heap[name].at[2 * i - 1].set(jnp.asarray(a, heap[name].dtype))
                    .at[2 * i].set(jnp.asarray(b, heap[name].dtype)) for name, (a, b) in put.items()}
            heap["key"] = heap["key"].at[e].set(neg)
            return heap, nodes

        _, nodes = jax.lax.fori_loop(1, N, body, (heap, nodes))
        return nodes

    out = jax.vmap(one)(root_B.astype(jnp.int32), tok_BxRxK.astype(jnp.int32), key_BxRxK.astype(jnp.float32),
                        logq_BxRxK.astype(jnp.float32), child_row_BxRxK.astype(jnp.int32))
    tree = TreeBuffers(tokens=out["tok"], parents=out["par"], depth=out["depth"], valid=out["valid"],
                       score=out["score"], source=jnp.full((B, N), source, jnp.int8))
    return tree, out["key"]
