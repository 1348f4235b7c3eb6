"""`lm`: an independent small causal LM with the same tokenizer, with its own KV cache.

Drafting runs the drafter depth by depth over the tree (static path list or EAGLE-2 dynamic),
its nodes written to scratch slots past the committed cache. Commit re-runs the accepted tokens
as one block so the drafter's cache holds exactly the committed text.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from specjax import kvcache, sampling, tree as tree_lib
from specjax.drafters.base import Committed, DraftContext, Proposal
from specjax.models import transformer
from specjax.models.transformer import Model


class LMDrafter(nnx.Module):
    name = "lm"
    target_layers = ()

    def __init__(self, model: Model, fold=None):
        """`fold`: a `specjax.fold.FoldConfig` to draft with FOLD attention (None: plain)."""
        from specjax import fold as fold_lib
        self.model = fold_lib.attach(model, fold)  # FOLD: a weight-sharing copy with `fold` set

    @property
    def fold(self):
        return getattr(self.model, "fold", None)

    def validate(self, capacity: int) -> None:
        """Called by the engine before tracing: FOLD's window must fit the cache."""
        from specjax import fold as fold_lib
        fold_lib.validate(self.fold, capacity)

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    def init(self, prompt_BxP, lengths_B, capacity, target_out):
        cache = transformer.init_cache(self.model, prompt_BxP.shape[0], capacity)
        return transformer.prefill(self.model, prompt_BxP, lengths_B, cache).cache

    def propose(self, cache, root_B, ctx: DraftContext) -> Proposal:
        def evaluate(cache, tokens_BxF, depth, offset, mask_BxFxS, parent_slot_BxF):
            B, F = tokens_BxF.shape
            pos = jnp.broadcast_to(cache.length[:, None] + depth, (B, F))
            out = transformer.forward(self.model, tokens_BxF, pos, cache, mask_BxFxS,
                                      offset_B=jnp.full((B,), offset, jnp.int32))
            if ctx.mode == "topk":
                logq = jax.nn.log_softmax(out.logits, axis=-1)
            else:  # sampled candidates come from q warped like the target's p
                logq = sampling.warp(out.logits, ctx.params)
            return logq, out.cache

        tree, probs, cache = tree_lib.expand(ctx.spec, root_B, evaluate, cache, ctx.key, mode=ctx.mode)
        return Proposal(tree=tree, probs=probs, state=cache)

    def score(self, cache, tree: tree_lib.TreeBuffers, max_depth: int | None = None):
        """log q(·|node) at every node of someone else's tree [B, N, V], in one tree-attention pass:
        all N nodes in the scratch slots past the committed cache, each seeing its ancestors.
        The cache is not changed (the scratch K/V are dropped; commit rewrites those slots)."""
        B, N = tree.tokens.shape
        D = N - 1 if max_depth is None else max_depth
        # A node sees itself even when invalid, so no attention row is empty (a 1-token prompt).
        mask = tree_lib.ancestor_mask(tree, D) | jnp.eye(N, dtype=bool)[None]
        pos = cache.length[:, None] + tree.depth
        out = transformer.forward(self.model, tree.tokens, pos, cache, mask)
        return jax.nn.log_softmax(out.logits, axis=-1)

    def commit(self, cache, committed: Committed):
        B, T = committed.tokens.shape
        mask = transformer.causal_mask(B, T, committed.count)
        out = transformer.forward(self.model, committed.tokens, committed.positions, cache, mask)
        return kvcache.advance(out.cache, committed.count)
