"""`ngram`: prompt lookup. The longest recent n-gram of the context that ends like the context
does proposes what followed it. Free, training-free, parameter-free; strong on repetitive text.

It drafts a chain (the first `min(depth, N-1)` nodes of any tree spec); q is one-hot, so every
verification rule applies.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from specjax import tree as tree_lib
from specjax.drafters.base import Committed, DraftContext, Proposal
from specjax.typing import Array, Int


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class History:
    tokens: Int[Array, "B C"]  # every committed token of the row (prompt included)
    length: Int[Array, "B"]


def _write(buf_BxC, new_BxT, start_B):
    return jax.vmap(lambda b, n, s: jax.lax.dynamic_update_slice(b, n, (s,)))(buf_BxC, new_BxT, start_B)


class NgramDrafter(nnx.Module):
    name = "ngram"
    vocab_size = None
    target_layers = ()

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"ngram sizes need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def init(self, prompt_BxP, lengths_B, capacity, target_out) -> History:
        B, P = prompt_BxP.shape
        buf = jnp.zeros((B, capacity), jnp.int32).at[:, :P].set(prompt_BxP)
        return History(buf, lengths_B.astype(jnp.int32))

    def lookup(self, ctx_BxC, len_B, depth: int):
        """The `depth` tokens that followed the most recent longest suffix match, and their validity."""
        B, C = ctx_BxC.shape
        j_C = jnp.arange(C)
        best_end = jnp.full((B,), -1, jnp.int32)
        for n in range(self.min_ngram, self.max_ngram + 1):  # longer matches override shorter ones
            suffix_Bxn = jax.vmap(lambda c, l: jax.lax.dynamic_slice(c, (jnp.maximum(l - n, 0),), (n,)))(ctx_BxC, len_B)
            match = jnp.ones((B, C), bool)
            for i in range(n):
                # a match ending at j compares ctx[j - n + 1 + i] with suffix[i]
                shifted = jnp.roll(ctx_BxC, n - 1 - i, axis=1)
                match &= shifted == suffix_Bxn[:, i:i + 1]
            ok = match & (j_C[None] >= n - 1) & (j_C[None] < len_B[:, None] - 1) & (len_B[:, None] >= n)
            end = jnp.max(jnp.where(ok, j_C[None], -1), axis=1)
            best_end = jnp.where(end >= 0, end, best_end)
        idx_BxD = best_end[:, None] + 1 + jnp.arange(depth)[None]
        valid = (best_end[:, None] >= 0) & (idx_BxD < len_B[:, None])
        toks = jnp.take_along_axis(ctx_BxC, jnp.clip(idx_BxD, 0, C - 1), axis=1)
        return jnp.where(valid, toks, 0), valid

    def propose(self, hist: History, root_B, ctx: DraftContext) -> Proposal:
        N = ctx.spec.num_nodes
        D = min(ctx.spec.max_depth, N - 1)
        ctx_tokens = _write(hist.tokens, root_B[:, None].astype(jnp.int32), hist.length)
        draft, valid = self.lookup(ctx_tokens, hist.length + 1, D)
        tree = tree_lib.chain_tree(root_B, draft)
        tree = dataclasses.replace(tree, valid=tree.valid.at[:, 1:].set(valid))
        tree = _pad_nodes(tree, N)
        return Proposal(tree=tree, probs=None, state=hist)

    def commit(self, hist: History, committed: Committed) -> History:
        toks = _write(hist.tokens, committed.tokens, hist.length)
        return History(toks, hist.length + committed.count)


def _pad_nodes(tree: tree_lib.TreeBuffers, N: int) -> tree_lib.TreeBuffers:
    pad = N - tree.num_nodes
    if pad == 0:
        return tree
    B = tree.tokens.shape[0]

    def ext(x, fill):
        return jnp.concatenate([x, jnp.full((B, pad), fill, x.dtype)], axis=1)

    return tree_lib.TreeBuffers(tokens=ext(tree.tokens, 0), parents=ext(tree.parents, -1), depth=ext(tree.depth, 0),
                                valid=ext(tree.valid, False), score=ext(tree.score, -jnp.inf),
                                source=ext(tree.source, 0))
