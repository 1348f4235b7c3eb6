"""`lm`: an independent small causal LM with the same tokenizer, with its own cache.

Any model family drafts (`family(model)`: a dense transformer, or a small hybrid whose DeltaNet
layers carry a recurrent state per scratch node). Drafting runs the drafter depth by depth over
the tree (static path list or EAGLE-2 dynamic), its nodes written to scratch slots past the
committed cache (`forward(..., offset_B=)`; a hybrid also keeps each scratch node's state, see
`hybrid.reserve`). Commit re-runs the accepted tokens as one block (`extend`) so the drafter's cache
holds exactly the committed text.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.models import fold as fold_lib
from specjax.spec import sampling
from specjax.spec import tree as tree_lib
from specjax.io.checkpoint import load_model
from specjax.drafters.base import Committed, DraftContext, Drafter, Proposal, register
from specjax.models import family, quant
from specjax.models.transformer import Model


@register
class LMDrafter(Drafter):
    """An independent small causal LM with the target's tokenizer (any Hugging Face directory)."""
    name = "lm"
    attends = True
    gives_q = True
    can_score = True
    stops_early = True
    OWN = ("model",)

    def __init__(self, model: Model, fold=None):
        """`fold`: a `specjax.models.fold.FoldConfig` to draft with FOLD attention (None: plain)."""
        if fold is not None and not isinstance(model, Model):
            raise ValueError(f"FOLD replaces a dense transformer drafter's attention; the lm drafter is a "
                             f"{type(model).__name__}")
        self.model = model
        self.fold = fold_lib.check(fold)  # static: FOLD attention in every forward (None: the model's own)

    @classmethod
    def load(cls, spec: str, target, *, fold=None) -> "LMDrafter":
        return cls(load_model(spec, dtype=target.config.dtype), fold=fold)

    def with_weights(self, weights: str) -> "LMDrafter":
        """The whole model is its own: projections and embedding (`quant.quantize`), in place."""
        quant.quantize(self.model, weights)  # refuses a model already stored narrower
        return self

    def with_fold(self, cfg) -> "LMDrafter":
        """The same drafter (same model) with FOLD on (`cfg`) or off (None)."""
        out = LMDrafter(self.model, fold=cfg)
        out.default_tree = self.default_tree  # a tuned default tree (`tuned.json`) stays
        return out

    @property
    def attention(self):
        """FOLD's attention for the forwards (`specjax.models.fold.FoldAttention`), or None (the model's own)."""
        return fold_lib.FoldAttention.for_model(self.fold, self.model.config)

    @property
    def _forward_kw(self) -> dict:
        """Keyword arguments of every forward: `attention=` under FOLD (a transformer), none without."""
        return {} if self.fold is None else {"attention": self.attention}

    def validate(self, capacity: int) -> None:
        """Called by the engine before tracing: FOLD's window must fit the cache."""
        fold_lib.validate(self.fold, capacity)

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    def init(self, prompt_BxP, lengths_B, capacity, target_out):
        fam = family(self.model)
        cache = fam.init_cache(self.model, prompt_BxP.shape[0], capacity)
        if self.fold is not None:  # FOLD: the prompt in chunks under FOLD attention
                return fold_lib.prefill(self.model, prompt_BxP, lengths_B, cache, attention=self.attention).cache
        return fam.prefill(self.model, prompt_BxP, lengths_B, cache).cache

    def propose(self, cache, root_B, ctx: DraftContext) -> Proposal:
        fam = family(self.model)
        spec = ctx.spec

        def evaluate(cache, tokens_BxF, depth, offset, mask_BxFxS, parent_slot_BxF):
            B, F = tokens_BxF.shape
            pos = jnp.broadcast_to(cache.length[:, None] + depth, (B, F))
            out = fam.forward(self.model, tokens_BxF, pos, cache, mask_BxFxS, parents=parent_slot_BxF,
                              offset_B=jnp.full((B,), offset, jnp.int32), **self._forward_kw)
            if ctx.mode == "topk":
                logq = jax.nn.log_softmax(out.logits, axis=-1)
            else:  # sampled candidates come from q warped like the target's p
                logq = sampling.warp(out.logits, ctx.params)
            return logq, out.cache

        slots = spec.pool_size if isinstance(spec, tree_lib.DynamicTree) else spec.num_nodes
        tree, probs, cache = tree_lib.expand(spec, root_B, evaluate, fam.reserve(cache, slots), ctx.key, mode=ctx.mode,
                                             stop=ctx.stop)
        # Scratch K/V stay past the committed length (commit overwrites them); scratch states go.
        return Proposal(tree=tree, probs=probs, state=fam.release(cache))

    def score(self, cache, tree: tree_lib.TreeBuffers, max_depth: int | None = None, per_depth: int | None = None):
        """log q(·|node) at every node of someone else's tree [B, N, V], in one tree-attention pass:
        all N nodes in the scratch slots past the committed cache, each seeing its ancestors.
        The cache is not changed (the scratch K/V are dropped; commit rewrites those slots)."""
        B, N = tree.tokens.shape
        D = N - 1 if max_depth is None else max_depth
        # A node sees itself even when invalid, so no attention row is empty (a 1-token prompt).
        mask = tree_lib.ancestor_mask(tree, D) | jnp.eye(N, dtype=bool)[None]
        pos = cache.length[:, None] + tree.depth
        out = family(self.model).forward(self.model, tree.tokens, pos, cache, mask, parents=tree.parents,
                                         **self._forward_kw)
        return jax.nn.log_softmax(out.logits, axis=-1)

    def commit(self, cache, committed: Committed):
        return family(self.model).extend(self.model, committed.tokens, committed.count, cache,
                                         **self._forward_kw).cache
