"""Batch-invariant numerics: a query's result does not depend on the block it is verified in.

Greedy speculative decoding is exact only if the target's logits for a token are the same bits
whether the token is decoded alone (AR: one query) or verified inside a block of T queries (a
chain, a tree). At float32 the two differ in the last bits and greedy output has matched AR on
every prompt we measured. At bfloat16 / int8 weights (`specjax.models.quant`) the activations are
rounded before each matmul, and a last-bit difference upstream moves a value across a rounding
boundary: the logits then differ visibly and the greedy output diverges (design §17). This
module removes the sources of that difference outside the matmuls:

- **Reductions whose order depends on the number of rows.** XLA:CPU reduces a [N, E] array row by
  row for small N and across rows (vectorised) from N = 8, and its dots pick kernels by shape.
  `ordered_sum` sums in one fixed pairwise order (the axis zero-padded to a power of two, then
  halved by explicit adds), which the compiler may not reassociate: every row gets the same bits
  for any N. `rms_norm` reductions and the invariant attention use it.
- **Where a query's keys sit.** In AR, token t's keys are the committed prefix and then its
  ancestors at consecutive slots. In a tree, the ancestors sit at the slots of their nodes, with
  other branches' slots masked in between. Summing over slots in slot order with masked entries as
  exact zeros is still not enough (pairwise sums pair different entries). So `attend` first gathers
  each query's visible slots, in slot order, to the front of a per-query view (`compact`): the
  prefix, then the ancestors by depth, exactly AR's layout. The sums run over that view.
- **Elementwise functions evaluated two ways.** XLA:CPU computes `rsqrt` and `exp` (and a fused
  cos / sin) with a vectorised routine in a loop's body and another in its remainder, so an
  element's bits depend on the array's shape. `rms_normalize` divides by a square root (exactly
  rounded everywhere), `exp` is built from adds and multiplies, and RoPE's cos / sin come from a
  table over the cache's slots (`specjax.attention.cos_sin(table=)`).

One-query calls are padded to `MIN_QUERIES` = 2 rows (XLA:CPU compiles a one-row fusion
differently; two rows onwards give every row identical bits). `tests/test_invariant.py` checks
both properties on this backend. It is opt-in (`specjax.load_model(..., invariant=True)`, attention
impl "invariant") because it costs: the sums run without BLAS (design §17,
`bench/bench_smollm2_w_int8_invariant_code_b1.md`).

A leaf module: it imports nothing from specjax.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

MIN_QUERIES = 2


def ordered_sum(x, axis: int):
    """Sum of `x` over `axis` (kept, size 1) in a fixed pairwise order: zero-padded to a power of
    two, then `x[:h] + x[h:]` until one entry is left. Adding an exact zero leaves a float as it is,
    so the padding changes nothing."""
    axis = axis % x.ndim
    n = x.shape[axis]
    p = 1 << max(0, (n - 1).bit_length())
    if p != n:
        pad = [(0, 0)] * x.ndim
        pad[axis] = (0, p - n)
        x = jnp.pad(x, pad)
    while x.shape[axis] > 1:
        h = x.shape[axis] // 2
        x = jax.lax.slice_in_dim(x, 0, h, axis=axis) + jax.lax.slice_in_dim(x, h, 2 * h, axis=axis)
    return x


def rounded(x):
    """float32 `x` rounded to 22 mantissa bits (one bit less than float32). XLA keeps the op, and it
    is integer work to LLVM: a product that passes through it is rounded before any add that
    follows, so no FMA can form across it. XLA:CPU fuses `a * b + c` into an FMA in some compiled
    shapes and not in others (and removes optimisation barriers before it fuses)."""
    return jax.lax.reduce_precision(x, exponent_bits=8, mantissa_bits=22)


def bf16_exact(x):
    """x rounded to bfloat16 precision, held in float32: the product of two such values is exact,
    so an FMA over it rounds as the separate multiply and add do."""
    return jax.lax.reduce_precision(x.astype(jnp.float32), exponent_bits=8, mantissa_bits=7)


def rms_normalize(x32, eps: float):
    """x32 / sqrt(mean(x32 ** 2) + eps) over the last axis: the squares `rounded`, the sum in
    `ordered_sum`'s order, and a square root and a division where `rsqrt` would take XLA:CPU's
    vectorised approximation in some shapes and its scalar one in others (the barrier keeps XLA
    from rewriting x / sqrt(v) as x * rsqrt(v))."""
    ms = rounded(ordered_sum(rounded(x32 * x32), -1) / x32.shape[-1])
    return x32 / jax.lax.optimization_barrier(jnp.sqrt(ms + eps))


_LN2 = (0.693145751953125, 1.4285906217992306e-06, 1.6198153929281034e-11)  # ln 2, 16 bits each: k * part is exact
_EXP_TAYLOR = (1.0, 1.0, 0.5, 1 / 6, 1 / 24, 1 / 120, 1 / 720, 1 / 5040)


def exp(x):
    """exp(x) for float32 x <= 80 (relative error ~1e-7; 0 below -80) from adds, multiplies and a
    power of two built from its bits, so every element gets the same bits whichever loop of a
    fusion computes it: XLA:CPU's own `exp` takes a vectorised routine or libm's depending on the
    shape. (One elementwise chain: LLVM contracts its multiply-adds alike in either loop.)"""
    small = x < -80.0  # exp(-80) ~ 2e-35: 0, and no subnormal results
    x = jnp.where(small, 0.0, x)
    k = jnp.round(x * (1 / math.log(2)))
    r = x
    for part in _LN2:
        r = r - k * jnp.float32(part)
    p = jnp.full_like(r, _EXP_TAYLOR[-1])
    for c in reversed(_EXP_TAYLOR[:-1]):
        p = p * r + c
    two_k = jax.lax.bitcast_convert_type((k.astype(jnp.int32) + 127) << 23, jnp.float32)  # 2^k, |k| <= 116
    return jnp.where(small, 0.0, p * two_k)


def compact(visible_BxTxC):
    """Each query's visible slots, in slot order, moved to the front: (slot_BxTxC, valid_BxTxC) with
    slot[b, t, j] the j-th visible slot of query t and valid[b, t, j] = j < its count."""
    C = visible_BxTxC.shape[-1]
    slot_BxTxC = jnp.argsort(~visible_BxTxC, axis=-1, stable=True).astype(jnp.int32)
    count_BxT = jnp.sum(visible_BxTxC, axis=-1, dtype=jnp.int32)
    return slot_BxTxC, jnp.arange(C, dtype=jnp.int32)[None, None, :] < count_BxT[..., None]


def attend(q_BxTxHxD, k_BxCxKxD, v_BxCxKxD, slot_BxTxC, valid_BxTxC) -> jax.Array:
    """Softmax attention of T queries over their compacted views (`compact`), every sum in
    `ordered_sum`'s order; equals `specjax.attention.attend` up to float rounding (GQA: H = K * G)."""
    B, T, H, D = q_BxTxHxD.shape
    if T < MIN_QUERIES:  # pad with copies of the last query (sliced off below)
        n = MIN_QUERIES - T
        q_BxTxHxD = jnp.concatenate([q_BxTxHxD] + [q_BxTxHxD[:, -1:]] * n, axis=1)
        slot_BxTxC = jnp.concatenate([slot_BxTxC] + [slot_BxTxC[:, -1:]] * n, axis=1)
        valid_BxTxC = jnp.concatenate([valid_BxTxC] + [valid_BxTxC[:, -1:]] * n, axis=1)
    Tp = q_BxTxHxD.shape[1]
    K = k_BxCxKxD.shape[2]
    G = H // K
    # Operands in bfloat16: a product of two is exact in float32, so an add fused with it into an
    # FMA rounds the same as one that is not (XLA:CPU fuses in some shapes and not in others).
    q_BxTxKxGxD = bf16_exact(q_BxTxHxD.reshape(B, Tp, K, G, D) / math.sqrt(D))  # scaled first: s is a plain sum
    take = jax.vmap(lambda a_CxKxD, s_TxC: a_CxKxD[s_TxC])  # per row: [T, C, K, D] in view order
    k_BxTxCxKxD = take(bf16_exact(k_BxCxKxD), slot_BxTxC)
    v_BxTxCxKxD = take(bf16_exact(v_BxCxKxD), slot_BxTxC)
    s_BxTxCxKxG = ordered_sum(q_BxTxKxGxD[:, :, None] * k_BxTxCxKxD[:, :, :, :, None], -1)[..., 0]
    valid = valid_BxTxC[..., None, None]
    m = jnp.max(jnp.where(valid, s_BxTxCxKxG, -jnp.inf), axis=2, keepdims=True)  # max: order-free
    e = jnp.where(valid, exp(jnp.where(valid, s_BxTxCxKxG - jnp.where(jnp.isfinite(m), m, 0.0), 0.0)), 0.0)
    z = ordered_sum(e, 2)
    p_BxTxCxKxG = bf16_exact(e / jnp.where(z > 0, z, 1.0))  # rows with nothing visible give 0
    o_BxTxKxGxD = ordered_sum(p_BxTxCxKxG[..., None] * v_BxTxCxKxD[:, :, :, :, None], 2)[:, :, 0]
    return o_BxTxKxGxD.reshape(B, Tp, H, D)[:, :T].astype(v_BxCxKxD.dtype)
