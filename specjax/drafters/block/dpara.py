"""DPara (design §5d; `BlockConfig.boundary=True`): the backbone leaves the round's critical path.

While the target verifies this round's draft (N nodes, root included, at positions L + depth),
`boundary_pass` drafts the next round's block for every node n at once: W MASK queries at
L + depth_n + 1 .., seeing the committed context and node n with its ancestors as stand-in context
(`network.token_context`: norm(P(E[x])), a learned projection of the target's embedding in place
of the target features they do not have yet), one forward over N*W queries with a block-diagonal
mask. It reads nothing the verification makes, so the two forwards have no data dependence.
`commit` keeps the block of the last accepted node (`Committed.nodes`; for a chain, count - 1), and
the next round drafts from it through the light head only: the LM head on the block, then the
Markov walk from the bonus token (the block holds no anchor: the Markov head brings it in), or with
`ar_intermediate` > 0 (`ar_drafts`) the autoregressive head h' = h + D(silu(G) * U) over
[norm(E[x_{k-1}]); h] at every position, trained with the backbone. `init` makes the first block as
every later one: boundary 0 of a round rooted at the prompt's last token.

Training (`train.block`, `boundary: true`): block j at anchor a_j (the bonus) with boundary g_j sees
target features before a_j - g_j - 1 and tokens a_j - g_j - 1 .. a_j - 1 as stand-ins
(`network.train_logits(lags=)`). Departures (no public code): the stand-ins are token embeddings
through one projection per drafter (not per boundary); the per-node generalisation drafts trees
too; DPara does not score other drafters' trees (TreeGraft) and refuses composites that rebuild its
tree (`reads_own_tree`).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.models import attention as attention_lib
from specjax.models import kvcache
from specjax.spec import tree as tree_lib
from specjax.drafters.base import Committed, DraftContext, Proposal, register
from specjax.drafters.block.drafter import BlockDrafter
from specjax.drafters.block.network import (BlockPass, BlockState, backbone, base_logits, context_kv, mask_vector,
                                            target_features, token_context)
from specjax.models.kvcache import KVCache
from specjax.models.transformer import rms_norm


@register
class DParaDrafter(BlockDrafter):
    """DPara over the block network (a head with `boundary=True`): the boundary pass beside the
    verification, and the block the next round drafts from. `boundaries`: on a chain, how many
    acceptance boundaries are precomputed beside the verification (default: every one)."""
    name = "dpara"
    can_score = False  # its block is precomputed from its own previous draft: it drafts its own trees only
    reads_own_tree = True  # commit picks the next block by the accepted node of its own tree (`Committed.nodes`)
    RUN_OPTIONS = BlockDrafter.RUN_OPTIONS + ("boundaries",)

    @classmethod
    def takes(cls, cfg) -> bool:
        return bool(cfg.boundary)

    def __init__(self, head, target, confidence="off", costs=None, widths=None, path_calibration=None,
                 boundaries: int | None = None):
        super().__init__(head, target, confidence=confidence, costs=costs, widths=widths,
                         path_calibration=path_calibration)
        if boundaries is not None and int(boundaries) < 1:
            raise ValueError(f"boundaries (how many acceptance boundaries of a chain DPara precomputes) is >= 1; "
                             f"got {boundaries!r}")
        self.boundaries = None if boundaries is None else int(boundaries)

    def run_options(self) -> dict:
        return {**super().run_options(), "boundaries": self.boundaries}

    def scratch_slots(self, num_nodes: int) -> int:
        """A stand-in slot per draft node and a block of W per node."""
        return num_nodes * (self.head.config.block_size + 1)

    def init(self, prompt_BxP, lengths_B, capacity, target_out) -> BlockState:
        return self.dpara_init(prompt_BxP, lengths_B, self._empty_cache(prompt_BxP.shape[0], capacity),
                               target_features(target_out))

    def block_pass(self, state, root_B) -> BlockPass:
        return self.chosen_block(state)

    def propose(self, state, root_B, ctx: DraftContext) -> Proposal:
        return self.with_boundaries(super().propose(state, root_B, ctx), ctx)

    def score(self, state, tree, max_depth=None, per_depth=None):
        raise ValueError("a DPara drafter drafts from a block precomputed for its own previous draft: it cannot "
                         "score another drafter's tree (can_score=False)")

    def commit(self, state, committed: Committed):
        """The cache extended, and the next block: the one of the last accepted node."""
        return self.dpara_commit(state, super().commit(state, committed), committed)

    def boundary_pass(self, cache: KVCache, tokens_BxN, depth_BxN, ancestors_BxNxN):
        """DPara's backbone pass (design §5d): for every node n of this round's draft tree, the block
        the next round drafts from if n is the last accepted node: W MASK queries at positions
        length + depth_n + 1 .., seeing the committed context and, as `token_context` stand-ins at
        slots length + (0..N-1), node n and its ancestors (the root and the accepted draft); one
        forward over N*W queries under a block-diagonal mask. It reads nothing verification makes, so
        XLA is free to run it beside the target's verification forward. Returns the blocks' hidden
        states before the final norm [B, N, W, E] and the cache with the stand-ins and blocks in its scratch slots
        (length unchanged; commit overwrites them)."""
        head, cfg = self.head, self.head.config
        B, N = tokens_BxN.shape
        W = cfg.block_size
        tok_pos = cache.length[:, None] + depth_BxN
        tok_kv = context_kv(head, token_context(head, self.target, tokens_BxN), tok_pos)
        pos = (tok_pos[:, :, None] + 1 + jnp.arange(W)).reshape(B, N * W)
        node = jnp.arange(N * W) // W
        sees_blk = jnp.broadcast_to((node[:, None] == node[None, :])[None], (B, N * W, N * W))
        mask = jnp.concatenate([jnp.repeat(ancestors_BxNxN, W, axis=1), sees_blk], axis=-1)  # [B, NW, N + NW]
        bound = attention_lib.DENSE.bind(cache, pos, mask)
        after = jnp.full((B,), N, jnp.int32)

        def attend(i, q, k, v):
            nonlocal cache
            cache = kvcache.write(cache, i, *tok_kv[i])  # stand-ins at slots length .. length+N-1
            cache = kvcache.write(cache, i, k, v, offset_B=after)  # the blocks after them
            return bound(q, cache, i)

        x = jnp.broadcast_to(mask_vector(head, self.target), (B, N * W, cfg.hidden_size))
        _, pre = backbone(head, x, pos, attend)
        return pre.reshape(B, N, W, -1), cache

    def precomputed(self, spec) -> int:
        """DPara: how many nodes of a round's tree get their next block beside the verification: every
        node, or on a chain with `boundaries` = b the first b (acceptance boundaries 0 .. b-1); a round
        that accepts more runs the boundary pass of its accepted path after the verification."""
        if self.boundaries is None or not tree_lib.is_chain(spec):
            return spec.num_nodes
        return min(self.boundaries, spec.num_nodes)

    def dpara_init(self, prompt_BxP, lengths_B, empty: KVCache, feats_BxTxF):
        """The first round's block as every later one is made, the boundary a = 0 of a round rooted
        at the prompt's last token (context: the features before it; the token: a stand-in)."""
        B = prompt_BxP.shape[0]
        last_B = jnp.maximum(lengths_B - 1, 0)
        cache = self._extend(empty, feats_BxTxF, last_B)
        tok_Bx1 = jnp.take_along_axis(prompt_BxP, last_B[:, None], axis=1)
        blocks, cache = self.boundary_pass(cache, tok_Bx1, jnp.zeros((B, 1), jnp.int32), jnp.ones((B, 1, 1), bool))
        cache = self._extend(cache, jnp.take_along_axis(feats_BxTxF, last_B[:, None, None], axis=1),
                             (lengths_B > 0).astype(jnp.int32))
        return BlockState(cache, jnp.zeros((B,), jnp.int32), None, block=blocks[:, 0])

    def chosen_block(self, state) -> BlockPass:
        """This round's block, chosen at the last commit, through the LM head (the backbone does not
        run on the round's critical path)."""
        if state.block is None:
            raise ValueError("this DPara drafter's state holds no block: make it with this drafter's init")
        h = rms_norm(self.head.norm, state.block)
        base = None if self.head.config.ar_drafts else base_logits(self.head, self.target, h)  # the AR head makes its own
        return BlockPass(base, h, state.cache, state.block)

    def with_boundaries(self, prop: Proposal, ctx: DraftContext) -> Proposal:
        """The proposal with the next round's candidate blocks, one per node of this draft."""
        t = prop.tree
        n = self.precomputed(ctx.spec)
        blocks, cache = self.boundary_pass(prop.state.cache, t.tokens[:, :n], t.depth[:, :n],
                                           tree_lib.ancestor_mask(t, ctx.spec.max_depth)[:, :n, :n])
        return dataclasses.replace(prop, state=dataclasses.replace(prop.state, cache=cache, boundary=blocks))

    def dpara_commit(self, state, st, committed: Committed):
        """`st` (the state with its cache extended) holding the next block: the one of the last
        accepted node (a chain's node past the precomputed ones: its boundary pass after the fact)."""
        if state.boundary is None:
            raise ValueError("a DPara drafter commits after its own propose (the boundary blocks are made there)")
        last = jnp.maximum(committed.count - 1, 0)[:, None]
        node = last if committed.nodes is None else jnp.take_along_axis(committed.nodes, last, axis=1)
        n = state.boundary.shape[1]
        block = jnp.take_along_axis(state.boundary, jnp.minimum(node, n - 1)[:, :, None, None], axis=1)[:, 0]
        if n < committed.tokens.shape[1]:  # a chain's boundaries past the precomputed ones: after the fact
            beyond = (node[:, 0] >= n) & (committed.count > 0)
            B, T = committed.tokens.shape

            def late(_):
                path = jnp.arange(T)[None, :] <= jnp.arange(T)[:, None]
                blocks, _ = self.boundary_pass(state.cache, committed.tokens, jnp.broadcast_to(jnp.arange(T), (B, T)),
                                               jnp.broadcast_to(path[None], (B, T, T)))
                return jnp.take_along_axis(blocks, node[:, :, None, None], axis=1)[:, 0]

            block = jnp.where(beyond[:, None, None], jax.lax.cond(jnp.any(beyond), late, lambda _: block, None), block)
        block = jnp.where((committed.count > 0)[:, None, None], block, state.block)  # a finished row stands still
        return dataclasses.replace(st, block=block, boundary=None)
