"""`ngram`: prompt lookup. The longest recent n-gram of the context that ends like the context
does proposes what followed it. Free, training-free, parameter-free; strong on repetitive text.

A chain spec drafts the continuation of the best match (longest n-gram, then most recent). A
match ending at `end` sits `period = len - 1 - end` tokens before the context's last token; its
continuation is `ctx[end + 1 + (d mod period)]` for d = 0..depth-1: the tokens that followed the
match, and past the context's end the same tokens again. That is prompt lookup applied to its own
draft (the match repeats `period` tokens later, so what follows the context is what followed the
match, drafted tokens included): a period-p loop ("... a b c a b c a b") drafts the full depth,
not p tokens, and a match further back than the depth drafts exactly what followed it.

A tree spec drafts a trie: the continuations of the `branches` best matches (a dynamic spec's
`topk`, a path list's widest branching), merged where they share a prefix, nodes ordered by depth
then match rank and cut to the spec's node budget (parents always precede children, so the cut
tree stays connected). Node scores are a pseudo cumulative log q, since the n-gram has no q: 0
along the best match (as a chain's), -log(1 + k) along the k-th best match's own branch — a child
never outscores its parent, so TreeGraft's ranking and scheduler features read a trie like any
drafter's tree. The candidates are deterministic: verify with greedy or the
deterministic-candidates rule (the engine refuses the sampled rules for this drafter).
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from specjax.spec import tree as tree_lib
from specjax.drafters.base import Committed, DraftContext, Drafter, Proposal, register
from specjax.typing import Array, Int


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class History:
    tokens: Int[Array, "B C"]  # every committed token of the row (prompt included)
    length: Int[Array, "B"]


def _write(buf_BxC, new_BxT, start_B):
    return jax.vmap(lambda b, n, s: jax.lax.dynamic_update_slice(b, n, (s,)))(buf_BxC, new_BxT, start_B)


@register
class NgramDrafter(Drafter):
    name = "ngram"
    by_name = True
    # Its candidates are matches of the context, not draws from a q: no scores to expand a tree by
    # (a tree spec asks for a trie of the best matches, `branches_of`), and free to draft. TreeGraft
    # reads it to pick the cheap candidate tree. (gives_q = False, the base default, says only that
    # the sampled rules do not apply.)
    drafts_matches: ClassVar[bool] = True

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"ngram sizes need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    @classmethod
    def load(cls, spec: str, target) -> "NgramDrafter":
        """`ngram`, or `ngram:N` for the longest n-gram N."""
        n = spec.partition(":")[2]
        if n and not n.isdigit():
            raise ValueError(f"drafter {spec!r}: expected ngram or ngram:N")
        return cls(max_ngram=int(n)) if n else cls()

    def init(self, prompt_BxP, lengths_B, capacity, target_out) -> History:
        B, P = prompt_BxP.shape
        buf = jnp.zeros((B, capacity), jnp.int32).at[:, :P].set(prompt_BxP)
        return History(buf, lengths_B.astype(jnp.int32))

    def _best_matches(self, ctx_BxC, len_B, branches: int):
        """The `branches` best suffix matches (longest n-gram first, then most recent): their rank
        n * C + end (-1: no match) and end index, each [B, K]."""
        B, C = ctx_BxC.shape
        j_C = jnp.arange(C)
        rank_BxC = jnp.full((B, C), -1, jnp.int32)  # per match end: n * C + end for its longest n
        for n in range(self.min_ngram, self.max_ngram + 1):
            suffix_Bxn = jax.vmap(lambda c, l: jax.lax.dynamic_slice(c, (jnp.maximum(l - n, 0),), (n,)))(ctx_BxC, len_B)
            match = jnp.ones((B, C), bool)
            for i in range(n):
                # a match ending at j compares ctx[j - n + 1 + i] with suffix[i]
                shifted = jnp.roll(ctx_BxC, n - 1 - i, axis=1)
                match &= shifted == suffix_Bxn[:, i:i + 1]
            ok = match & (j_C[None] >= n - 1) & (j_C[None] < len_B[:, None] - 1) & (len_B[:, None] >= n)
            rank_BxC = jnp.where(ok, n * C + j_C[None], rank_BxC)
        return jax.lax.top_k(rank_BxC, branches)

    def lookup(self, ctx_BxC, len_B, depth: int, branches: int = 1):
        """The `depth` tokens after each of the `branches` best suffix matches (longest n-gram
        first, then most recent) [B, K, D], continued periodically past the context's end (module
        docstring), and their validity (False only for a match that does not exist)."""
        C = ctx_BxC.shape[1]
        rank_BxK, end_BxK = self._best_matches(ctx_BxC, len_B, branches)
        # a match `period` tokens back continues periodically past the context's end (module
        # docstring); a real match has end <= len - 2, so period >= 1 (the max only guards non-matches)
        period_BxK = jnp.maximum(len_B[:, None] - 1 - end_BxK, 1)
        idx_BxKxD = end_BxK[..., None] + 1 + jnp.arange(depth)[None, None] % period_BxK[..., None]
        valid = jnp.broadcast_to(rank_BxK[..., None] >= 0, idx_BxKxD.shape)
        toks = jnp.take_along_axis(ctx_BxC[:, None], jnp.clip(idx_BxKxD, 0, C - 1), axis=2)
        return jnp.where(valid, toks, 0), valid

    def match_length(self, hist: History, root_B) -> Int[Array, "B"]:
        """The n of the best match `propose` drafts from this round (the longest n-gram the context,
        root included, ends with and that occurred before; 0: none): how far the match can be
        trusted (TreeGraft's switch policy and scheduler read it)."""
        C = hist.tokens.shape[1]
        rank_Bx1, _ = self._best_matches(self._context(hist, root_B), hist.length + 1, 1)
        return jnp.where(rank_Bx1[:, 0] >= 0, rank_Bx1[:, 0] // C, 0)

    @staticmethod
    def _context(hist: History, root_B):
        return _write(hist.tokens, root_B[:, None].astype(jnp.int32), hist.length)

    def propose(self, hist: History, root_B, ctx: DraftContext) -> Proposal:
        spec = ctx.spec
        N = spec.num_nodes
        D = min(spec.max_depth, N - 1)
        K = min(branches_of(spec), N - 1)
        draft_BxKxD, valid_BxKxD = self.lookup(self._context(hist, root_B), hist.length + 1, D, K)
        if K == 1:
            tree = tree_lib.chain_tree(root_B, draft_BxKxD[:, 0])
            tree = dataclasses.replace(tree, valid=tree.valid.at[:, 1:].set(valid_BxKxD[:, 0]))
            return Proposal(tree=tree_lib.pad_nodes(tree, N), probs=None, state=hist)
        return Proposal(tree=trie(root_B, draft_BxKxD, valid_BxKxD, N), probs=None, state=hist)

    def commit(self, hist: History, committed: Committed) -> History:
        toks = _write(hist.tokens, committed.tokens, hist.length)
        return History(toks, hist.length + committed.count)


def branches_of(spec) -> int:
    """How many matches a tree spec asks for: 1 for a chain, a dynamic spec's topk, a path list's
    widest branching."""
    if isinstance(spec, tree_lib.DynamicTree):
        return spec.topk
    parents, _, _ = spec.layout()
    return int(np.bincount(parents[1:]).max()) if len(parents) > 1 else 1


def trie(root_B, draft_BxKxD, valid_BxKxD, num_nodes: int) -> tree_lib.TreeBuffers:
    """K candidate chains under one root, merged where they share a prefix, as a padded tree of
    `num_nodes` nodes: node (k, d) is kept where chain k is the first with its prefix up to depth
    d; nodes sorted by (depth, k) and cut to the budget. Score: -log(1 + k) on chain k's own nodes
    (0 on the best chain; never above the parent's, whose chain ranks no lower)."""
    B, K, D = draft_BxKxD.shape
    N = min(num_nodes, K * D + 1)  # padded to num_nodes at the end
    same = (draft_BxKxD[:, :, None] == draft_BxKxD[:, None, :]) & valid_BxKxD[:, None, :]  # [B, K, K', D]
    same_prefix = jnp.cumprod(same.astype(jnp.int32), axis=-1).astype(bool) & valid_BxKxD[:, :, None]
    first = jnp.argmax(same_prefix, axis=2)  # [B, K, D]: the first chain sharing (k, d)'s prefix
    unique = valid_BxKxD & (first == jnp.arange(K)[None, :, None])
    key = jnp.where(unique, jnp.arange(D)[None, None] * K + jnp.arange(K)[None, :, None], D * K)  # [B, K, D]
    order = jnp.argsort(key.reshape(B, K * D), axis=1)[:, :N - 1]  # flat (k, d) of nodes 1..N-1
    kept = jnp.take_along_axis(key.reshape(B, K * D), order, axis=1) < D * K
    node_of = jnp.full((B, K * D), N, jnp.int32)  # flat (k, d) -> node id (N: not kept)
    node_of = jax.vmap(lambda n, o, v: n.at[o].set(jnp.where(v, jnp.arange(1, N, dtype=jnp.int32), N)))(
        node_of, order, kept)
    k_of, d_of = order // D, order % D
    # the parent of unique node (k, d) is the node of its prefix: chain first[k, d-1] at depth d-1
    parent_chain = jnp.take_along_axis(first.reshape(B, K * D), k_of * D + jnp.maximum(d_of - 1, 0), axis=1)
    parent = jnp.where(d_of == 0, 0, jnp.take_along_axis(node_of, parent_chain * D + d_of - 1, axis=1))
    kept &= parent < N
    tokens = jnp.take_along_axis(draft_BxKxD.reshape(B, K * D), order, axis=1)
    cat = lambda root, rest: jnp.concatenate([root, rest], axis=1)
    B1 = (B, 1)
    tree = tree_lib.TreeBuffers(
        tokens=cat(root_B[:, None].astype(jnp.int32), jnp.where(kept, tokens, 0).astype(jnp.int32)),
        parents=cat(jnp.full(B1, -1, jnp.int32), jnp.where(kept, parent, -1).astype(jnp.int32)),
        depth=cat(jnp.zeros(B1, jnp.int32), jnp.where(kept, d_of + 1, 0).astype(jnp.int32)),
        valid=cat(jnp.ones(B1, bool), kept),
        score=cat(jnp.zeros(B1), jnp.where(kept, -jnp.log1p(k_of.astype(jnp.float32)), -jnp.inf)),
        source=jnp.zeros((B, N), jnp.int8))
    return tree_lib.pad_nodes(tree, num_nodes)

