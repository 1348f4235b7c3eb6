"""Tree attention as a Pallas kernel (flash-style online softmax over key blocks).

Queries are the T tree (or block) nodes of each row, with the G query heads of a kv head folded
into the rows of one tile; keys are the row's cache slots: the committed prefix [0, length) and
the scratch slots [length, length + 32 W) under the block mask, given as W int32 bit-words per
query (`reference.pack_mask`). The definition is `reference.tree_attention_reference`.

Grid: (batch row, kv head, query block, key split). Each program streams its split of the row's
keys from the cache in place (the full [L, B, C, K, D] cache goes in; the layer is a static index,
so no per-layer slice is copied), block by block, and stops at the row's last visible slot. With
several splits (flash-decoding) each program writes a partial output and its log-sum-exp, merged
afterwards. The key loop never reads out of bounds: the last block's start is clamped to C - BK
and the keys it revisits are masked, so the capacity need not be a multiple of the block.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _common as cm
from pallas_kernels.reference import WORD_BITS


def _kernel(len_ref, q_ref, k_ref, v_ref, bits_ref, o_ref, lse_ref, *, block_k: int, chunk: int,
            capacity: int, words: int, scale: float, precision):
    split = pl.program_id(3)
    length = len_ref[()]
    q = q_ref[...]  # [BQ, D]
    bq = q.shape[0]
    d = q.shape[1]
    bits = [bits_ref[w, :] for w in range(words)]  # W x [BQ] int32

    c0 = split * chunk
    hi = jnp.minimum(jnp.minimum(length + words * WORD_BITS, capacity), c0 + chunk)
    n_blocks = jnp.maximum(hi - c0 + block_k - 1, 0) // block_k
    lane = jax.lax.broadcasted_iota(jnp.int32, (block_k,), 0)

    def body(j, carry):
        nominal = c0 + j * block_k
        start = jnp.minimum(nominal, capacity - block_k)
        k = k_ref[pl.ds(start, block_k), :]
        v = v_ref[pl.ds(start, block_k), :]
        s = cm.qk_dot(q, k, precision) * scale  # [BQ, BK]
        idx = start + lane
        in_range = (idx >= nominal) & (idx < hi)  # a clamped last block revisits keys: skip them
        rel = idx - length  # < 0: committed prefix; >= 0: scratch slot
        word = jax.lax.shift_right_arithmetic(rel, 5)
        sel = jnp.zeros((bq, block_k), jnp.int32)
        for w in range(words):
            sel = jnp.where((word == w)[None, :], bits[w][:, None], sel)
        shift = jnp.broadcast_to((rel & (WORD_BITS - 1))[None, :], sel.shape)
        in_block = (jax.lax.shift_right_logical(sel, shift) & 1) == 1
        visible = in_range[None, :] & ((rel < 0)[None, :] | in_block)
        return cm.softmax_step(carry, s, visible, v, precision)

    carry = jax.lax.fori_loop(0, n_blocks, body, cm.softmax_init(bq, d))
    cm.softmax_finish(carry, o_ref, lse_ref)


def tree_attention_pallas(q_BxTxHxD, k_cache, v_cache, lengths_B, mask_bits_BxTxW, *, layer=None,
                          return_lse=False, interpret=False, block_q=None, block_k=None, num_splits=None,
                          num_warps=None, num_stages=None):
    """The kernel behind `ops.tree_attention` (same arguments; see `reference.tree_attention_reference`).

    interpret=False lowers to Triton (explicit `triton.CompilerParams`), interpret=True runs the
    kernel body with jnp (CPU)."""
    B, T, H, D = q_BxTxHxD.shape
    if k_cache.ndim == 4:
        if layer is not None:
            raise ValueError("layer= needs the full [L, B, C, K, D] cache")
        k_cache, v_cache, layer = k_cache[None], v_cache[None], 0
    elif layer is None:
        raise ValueError("a [L, B, C, K, D] cache needs a static layer=")
    L, Bc, C, K, Dk = k_cache.shape
    if Bc != B or Dk != D or H % K:
        raise ValueError(f"shape mismatch: q {q_BxTxHxD.shape}, cache {k_cache.shape}")
    G = H // K
    W = mask_bits_BxTxW.shape[2]
    Dp = cm.head_dim_pad(D)
    if Dp != D:  # slow path: a head dim Triton cannot tile (copies the cache layer)
        k_cache = cm.pad_axis(k_cache[layer:layer + 1], 4, Dp)
        v_cache = cm.pad_axis(v_cache[layer:layer + 1], 4, Dp)
        layer = 0
    if C < cm.MIN_BLOCK:  # a tiny cache: pad the capacity (never visible past C)
        k_cache = cm.pad_axis(k_cache[layer:layer + 1], 2, cm.MIN_BLOCK)
        v_cache = cm.pad_axis(v_cache[layer:layer + 1], 2, cm.MIN_BLOCK)
        layer, C = 0, cm.MIN_BLOCK
    tiling = cm.choose_tiling(T * G, C, B * K, gpu=not interpret, block_q=block_q, block_k=block_k,
                              num_splits=num_splits, num_warps=num_warps, num_stages=num_stages)
    bq, bk, ns = tiling.block_q, tiling.block_k, tiling.num_splits
    R = T * G
    Rp = math.ceil(R / bq) * bq
    nq = Rp // bq

    q_rows = cm.to_rows(q_BxTxHxD, K, Rp, Dp)  # [B, K, Rp, Dp]
    bits_rows = cm.rows_of_query(mask_bits_BxTxW.astype(jnp.int32), G, Rp).transpose(0, 2, 1)  # [B, W, Rp]
    out_dtype = q_BxTxHxD.dtype if ns == 1 else jnp.float32

    kernel = functools.partial(_kernel, block_k=bk, chunk=tiling.chunk, capacity=C, words=W,
                               scale=1.0 / math.sqrt(D), precision=cm.dot_precision(q_BxTxHxD.dtype))
    lay = layer
    o, lse = pl.pallas_call(
        kernel,
        grid=(B, K, nq, ns),
        in_specs=[
            pl.BlockSpec((None,), lambda b, k, i, s: (b,)),
            pl.BlockSpec((None, None, bq, Dp), lambda b, k, i, s: (b, k, i, 0)),
            pl.BlockSpec((None, None, C, None, Dp), lambda b, k, i, s: (lay, b, 0, k, 0)),
            pl.BlockSpec((None, None, C, None, Dp), lambda b, k, i, s: (lay, b, 0, k, 0)),
            pl.BlockSpec((None, W, bq), lambda b, k, i, s: (b, 0, i)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, bq, Dp), lambda b, k, i, s: (b, k, s, i, 0)),
            pl.BlockSpec((None, None, None, bq), lambda b, k, i, s: (b, k, s, i)),
        ],
        out_shape=[jax.ShapeDtypeStruct((B, K, ns, Rp, Dp), out_dtype),
                   jax.ShapeDtypeStruct((B, K, ns, Rp), jnp.float32)],
        interpret=interpret,
        compiler_params=None if interpret else cm.compiler_params(tiling),
        name="tree_attention",
    )(lengths_B.astype(jnp.int32), q_rows, k_cache, v_cache, bits_rows)

    return cm.finish_call(o, lse, T, G, D, q_BxTxHxD.dtype, return_lse)
