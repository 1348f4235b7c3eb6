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

    def __init__(self, model: Model):
        self.model = model

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

    def commit(self, cache, committed: Committed):
        B, T = committed.tokens.shape
        mask = transformer.causal_mask(B, T, committed.count)
        out = transformer.forward(self.model, committed.tokens, committed.positions, cache, mask)
        return kvcache.advance(out.cache, committed.count)
