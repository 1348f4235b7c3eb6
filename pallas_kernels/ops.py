"""Dispatch: one entry point per kernel, choosing Triton on NVIDIA GPUs, interpret mode on CPU and
the jnp reference elsewhere (design §8).

    impl="auto"       Triton on an NVIDIA GPU, interpret mode on CPU, the reference otherwise
    impl="pallas"     pallas_call lowered to Triton (explicit triton.CompilerParams; without them
                      JAX 0.10 lowers GPU Pallas to Mosaic GPU). Also what a CPU machine traces
                      when it lowers for `cuda`.
    impl="interpret"  pallas_call(..., interpret=True): the kernel body run with jnp (any backend)
    impl="reference"  the jnp reference (pallas_kernels.reference)

Triton needs power-of-two block shapes: the wrappers pad query rows, head dims and tiny key
counts, and mask the padding; the tuning knobs (block_q, block_k, num_splits, num_warps,
num_stages) default to values chosen per call.
"""
from __future__ import annotations

from pallas_kernels._common import IMPLS, is_nvidia_gpu, resolve_impl
from pallas_kernels.far_attention import far_attention_pallas
from pallas_kernels.reference import (SEG_FAR, SEG_LOCAL, SEG_PAD, SEG_SINK, far_attention_reference,
                                      fold_beta, merge_attention, pack_mask, rope_inv_freq,
                                      tree_attention_reference, unpack_mask)
from pallas_kernels.tree_attention import tree_attention_pallas

__all__ = ["IMPLS", "resolve_impl", "is_nvidia_gpu", "tree_attention", "far_attention", "pack_mask",
           "unpack_mask", "merge_attention", "fold_beta", "rope_inv_freq", "SEG_PAD", "SEG_SINK",
           "SEG_LOCAL", "SEG_FAR"]


def tree_attention(q, k_cache, v_cache, lengths, mask_bits, *, layer: int | None = None,
                   return_lse: bool = False, impl: str = "auto", block_q: int | None = None,
                   block_k: int | None = None, num_splits: int | None = None,
                   num_warps: int | None = None, num_stages: int | None = None):
    """Tree attention over a KV cache: q [B, T, H, D], k/v cache [B, C, K, D] (or [L, B, C, K, D]
    with a static `layer`), lengths int32 [B], mask_bits int32 [B, T, W] (`pack_mask(block_mask)`).

    Returns out [B, T, H, D] and, with `return_lse`, the log-sum-exp [B, T, H] (float32, -inf
    where a query sees nothing) to combine with another partial attention (`merge_attention`).
    Definition: `reference.tree_attention_reference`."""
    impl = resolve_impl(impl)
    if impl == "reference":
        return tree_attention_reference(q, k_cache, v_cache, lengths, mask_bits, layer=layer,
                                        return_lse=return_lse)
    return tree_attention_pallas(q, k_cache, v_cache, lengths, mask_bits, layer=layer, return_lse=return_lse,
                                 interpret=impl == "interpret", block_q=block_q, block_k=block_k,
                                 num_splits=num_splits, num_warps=num_warps, num_stages=num_stages)


def far_attention(q, k, v, q_pos, k_pos, segment, beta, *, theta: float = 10000.0, inv_freq=None,
                  return_lse: bool = False, impl: str = "auto", block_q: int | None = None,
                  block_k: int | None = None, num_splits: int | None = None,
                  num_warps: int | None = None, num_stages: int | None = None):
    """FOLD far-memory attention (RoPE inside, per-key positions and segments, far-logit
    sharpening by beta). Definition and argument shapes: `reference.far_attention_reference`."""
    impl = resolve_impl(impl)
    if impl == "reference":
        return far_attention_reference(q, k, v, q_pos, k_pos, segment, beta, theta=theta, inv_freq=inv_freq,
                                       return_lse=return_lse)
    return far_attention_pallas(q, k, v, q_pos, k_pos, segment, beta, theta=theta, inv_freq=inv_freq,
                                return_lse=return_lse, interpret=impl == "interpret", block_q=block_q,
                                block_k=block_k, num_splits=num_splits, num_warps=num_warps,
                                num_stages=num_stages)

