"""FOLD far-memory attention as a Pallas kernel (design §7); definition:
`reference.far_attention_reference`.

Keys arrive before RoPE with a position and a segment id each (0 sink, 1 local, 2 far, -1 pad).
The kernel rotates queries and keys itself from their positions (HF rotate_half: the two halves
of the head dim are loaded separately, so no in-register concatenation is needed and the logit is
q1'.k1' + q2'.k2'), multiplies far-key logits by beta, and masks: padding never, far keys
always, sinks and local keys iff k_pos <= q_pos. Same grid and online softmax as tree attention:
(batch row, kv head, query block, key split), the last key block clamped in bounds.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _common as cm
from pallas_kernels.reference import SEG_FAR, SEG_PAD, rope_inv_freq


def _rotate(x1, x2, pos, inv):
    """RoPE of the two halves of x [n, D/2] at positions pos [n] (computed in float32, cast back)."""
    f = pos.astype(jnp.float32)[:, None] * inv[None, :]
    c, s = jnp.cos(f), jnp.sin(f)
    return (x1 * c - x2 * s).astype(x1.dtype), (x2 * c + x1 * s).astype(x1.dtype)


def _kernel(beta_ref, qpos_ref, q_ref, k_ref, v_ref, kpos_ref, seg_ref, inv_ref, o_ref, lse_ref, *,
            block_k: int, chunk: int, n_keys: int, half: int, scale: float, precision):
    split = pl.program_id(3)
    beta = beta_ref[()]
    inv = inv_ref[...]
    qpos = qpos_ref[...]  # [BQ]
    q1, q2 = _rotate(q_ref[:, pl.ds(0, half)], q_ref[:, pl.ds(half, half)], qpos, inv)
    bq = q1.shape[0]
    d = v_ref.shape[-1]

    c0 = split * chunk
    hi = jnp.minimum(c0 + chunk, n_keys)
    n_blocks = jnp.maximum(hi - c0 + block_k - 1, 0) // block_k
    lane = jax.lax.broadcasted_iota(jnp.int32, (block_k,), 0)

    def body(j, carry):
        nominal = c0 + j * block_k
        start = jnp.minimum(nominal, n_keys - block_k)
        rows = pl.ds(start, block_k)
        kpos = kpos_ref[rows]
        seg = seg_ref[rows]
        k1, k2 = _rotate(k_ref[rows, pl.ds(0, half)], k_ref[rows, pl.ds(half, half)], kpos, inv)
        v = v_ref[rows, :]
        s = (cm.qk_dot(q1, k1, precision) + cm.qk_dot(q2, k2, precision)) * scale
        far = (seg == SEG_FAR)[None, :]
        s = jnp.where(far, s * beta, s)
        idx = start + lane
        in_range = (idx >= nominal) & (idx < hi)
        visible = (in_range & (seg != SEG_PAD))[None, :] & (far | (kpos[None, :] <= qpos[:, None]))
        return cm.softmax_step(carry, s, visible, v, precision)

    carry = jax.lax.fori_loop(0, n_blocks, body, cm.softmax_init(bq, d))
    cm.softmax_finish(carry, o_ref, lse_ref)


def _pad_halves(x, half_pad: int):
    """[..., D] -> [..., 2 * half_pad]: each half of the head dim zero-padded on its own."""
    *lead, D = x.shape
    x = x.reshape(*lead, 2, D // 2)
    return cm.pad_axis(x, x.ndim - 1, half_pad).reshape(*lead, 2 * half_pad)


def far_attention_pallas(q_BxTxHxD, k_BxNxKxD, v_BxNxKxD, q_pos_BxT, k_pos_BxN, segment_BxN, beta, *,
                         theta=10000.0, inv_freq=None, return_lse=False, interpret=False, block_q=None,
                         block_k=None, num_splits=None, num_warps=None, num_stages=None):
    """The kernel behind `ops.far_attention` (same arguments)."""
    B, T, H, D = q_BxTxHxD.shape
    _, N, K, Dk = k_BxNxKxD.shape
    if Dk != D or H % K or D % 2:
        raise ValueError(f"shape mismatch: q {q_BxTxHxD.shape}, k {k_BxNxKxD.shape} (even head dim needed)")
    G = H // K
    half = D // 2
    hp = cm.head_dim_pad(half)
    inv = rope_inv_freq(D, theta) if inv_freq is None else jnp.asarray(inv_freq, jnp.float32)
    inv = cm.pad_axis(inv, 0, hp)
    if 2 * hp != D:
        q_BxTxHxD = _pad_halves(q_BxTxHxD, hp)
        k_BxNxKxD = _pad_halves(k_BxNxKxD, hp)
    Dv = cm.head_dim_pad(D)
    v_BxNxKxD = cm.pad_axis(v_BxNxKxD, 3, Dv)
    k_pos_BxN = k_pos_BxN.astype(jnp.int32)
    segment_BxN = segment_BxN.astype(jnp.int32)
    if N < cm.MIN_BLOCK:  # too few keys for one block: pad with segment -1
        k_BxNxKxD = cm.pad_axis(k_BxNxKxD, 1, cm.MIN_BLOCK)
        v_BxNxKxD = cm.pad_axis(v_BxNxKxD, 1, cm.MIN_BLOCK)
        k_pos_BxN = cm.pad_axis(k_pos_BxN, 1, cm.MIN_BLOCK)
        segment_BxN = cm.pad_axis(segment_BxN, 1, cm.MIN_BLOCK, SEG_PAD)
        N = cm.MIN_BLOCK
    tiling = cm.choose_tiling(T * G, N, B * K, gpu=not interpret, block_q=block_q, block_k=block_k,
                              num_splits=num_splits, num_warps=num_warps, num_stages=num_stages)
    bq, bk, ns = tiling.block_q, tiling.block_k, tiling.num_splits
    R = T * G
    Rp = math.ceil(R / bq) * bq
    nq = Rp // bq
    Dq = 2 * hp

    q_rows = cm.to_rows(q_BxTxHxD, K, Rp, Dq)
    qpos_rows = cm.rows_of_query(q_pos_BxT.astype(jnp.int32), G, Rp)  # [B, Rp]
    beta_B = jnp.broadcast_to(jnp.asarray(beta, jnp.float32), (B,))
    out_dtype = q_BxTxHxD.dtype if ns == 1 else jnp.float32

    kernel = functools.partial(_kernel, block_k=bk, chunk=tiling.chunk, n_keys=N, half=hp,
                               scale=1.0 / math.sqrt(D), precision=cm.dot_precision(q_BxTxHxD.dtype))
    o, lse = pl.pallas_call(
        kernel,
        grid=(B, K, nq, ns),
        in_specs=[
            pl.BlockSpec((None,), lambda b, k, i, s: (b,)),
            pl.BlockSpec((None, bq), lambda b, k, i, s: (b, i)),
            pl.BlockSpec((None, None, bq, Dq), lambda b, k, i, s: (b, k, i, 0)),
            pl.BlockSpec((None, N, None, Dq), lambda b, k, i, s: (b, 0, k, 0)),
            pl.BlockSpec((None, N, None, Dv), lambda b, k, i, s: (b, 0, k, 0)),
            pl.BlockSpec((None, N), lambda b, k, i, s: (b, 0)),
            pl.BlockSpec((None, N), lambda b, k, i, s: (b, 0)),
            pl.BlockSpec((hp,), lambda b, k, i, s: (0,)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, bq, Dv), lambda b, k, i, s: (b, k, s, i, 0)),
            pl.BlockSpec((None, None, None, bq), lambda b, k, i, s: (b, k, s, i)),
        ],
        out_shape=[jax.ShapeDtypeStruct((B, K, ns, Rp, Dv), out_dtype),
                   jax.ShapeDtypeStruct((B, K, ns, Rp), jnp.float32)],
        interpret=interpret,
        compiler_params=None if interpret else cm.compiler_params(tiling),
        name="far_attention",
    )(beta_B, qpos_rows, q_rows, k_BxNxKxD, v_BxNxKxD, k_pos_BxN, segment_BxN, inv)

    return cm.finish_call(o, lse, T, G, D, q_BxTxHxD.dtype, return_lse)
