"""Pallas kernels for specjax (design §8): tree attention over a KV cache and FOLD far-memory
attention, each with a jnp reference (`pallas_kernels.reference`) that defines it.

    from pallas_kernels import ops
    bits = ops.pack_mask(block_mask)                               # bool [B, T, S] -> int32 words
    out = ops.tree_attention(q, k_cache, v_cache, lengths, bits)   # impl="auto" | "pallas" | "interpret" | "reference"
    out = ops.far_attention(q, k, v, q_pos, k_pos, segment, beta)

`specjax.models.transformer.set_attention_impl(model, impl)` makes a model's forward use the tree
attention kernel.
"""
from pallas_kernels.ops import (IMPLS, SEG_FAR, SEG_LOCAL, SEG_PAD, SEG_SINK, far_attention, fold_beta,
                                merge_attention, pack_mask, resolve_impl, rope_inv_freq, tree_attention,
                                unpack_mask)

__all__ = ["IMPLS", "SEG_FAR", "SEG_LOCAL", "SEG_PAD", "SEG_SINK", "far_attention", "fold_beta",
           "merge_attention", "pack_mask", "resolve_impl", "rope_inv_freq", "tree_attention", "unpack_mask"]
