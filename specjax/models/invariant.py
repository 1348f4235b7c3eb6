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
  for any N. `rms_normalize` uses it.
- **Where a query's keys sit, and which kernel sums them.** In AR, token t's keys are the committed
  prefix and then its ancestors at consecutive slots; in a tree, the ancestors sit at their nodes'
  slots with other branches masked in between, and a float sum over slots pairs different entries
  in the two layouts. `attend` makes every sum an exact integer sum instead: q and k as integers
  of `_levels` (a q.k dot stays under 2^24, exact in float32 in any order, on any BLAS kernel), the
  softmax weights as integers split into digits whose dot with V's int8 levels stays under 2^24,
  the normaliser an int32 sum. Masked slots add exact zeros, so the layout, the block and the
  kernel do not matter, and the dots still run on BLAS.
- **Elementwise functions evaluated two ways.** XLA:CPU computes `rsqrt` and `exp` (and a fused
  cos / sin) with a vectorised routine in a loop's body and another in its remainder, so an
  element's bits depend on the array's shape. `rms_normalize` divides by a square root (exactly
  rounded everywhere), `exp` is built from adds and multiplies, and RoPE's cos / sin come from a
  table over the cache's slots (`specjax.models.attention.cos_sin(table=)`).

One-query calls are padded to `MIN_QUERIES` = 2 rows (XLA:CPU compiles a one-row fusion
differently; two rows onwards give every row identical bits). `tests/test_invariant.py` checks
both properties on this backend. `specjax.load_model` selects it (attention impl "invariant") by
default for bfloat16 / int8 weights and not at float32, because it costs (quantising K and V over every slot per call, the bit-built
`exp`) and changes the attention's numerics to int8-like K / V (design §17).

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


_F32_EXACT = 1 << 24  # every integer of magnitude up to 2^24 is a float32: sums of such stay exact in any order
_V_LEVELS = 127  # V per slot and head: integers in [-127, 127] times a scale
_W_BITS = 14  # the softmax weights: integers in [0, 2^14 - 1] times a scale


def _levels(x, axis: int, levels: int):
    """(x as integer-valued float32 in [-levels, levels], its scale along `axis` kept): symmetric
    absmax quantisation (max and division are exactly rounded: the same bits in any shape)."""
    amax = jnp.max(jnp.abs(x), axis=axis, keepdims=True)
    scale = jnp.where(amax > 0, amax / levels, 1.0)
    return jnp.clip(jnp.round(x / scale), -levels, levels), scale


def attend(q_BxTxHxD, k_BxCxKxD, v_BxCxKxD, visible_BxTxC) -> jax.Array:
    """Softmax attention whose sums are exact integers, so a query's result has the same bits
    whatever the block, the tree layout, the slot order or the kernel: q and k as integers of
    `_levels` (9 bits each at D = 64: a q.k dot stays under 2^24, exact in float32 in any order and
    on any BLAS kernel), the scores' max order-free, `exp` bit-built, the weights e_c * v_scale_c /
    v_scale_max as `_W_BITS`-bit integers split into base-2^b digits with 2^b * 127 * C < 2^24 (one
    float32 matmul per digit against V as int8 levels: exact), the normaliser an int32 sum. Masked
    slots give exact zeros, so no view needs gathering. Equals `specjax.models.attention.attend` to the
    quantisation of q, k, v (per slot and head) and the weights (GQA: H = K * G)."""
    B, T, H, D = q_BxTxHxD.shape
    C, K = k_BxCxKxD.shape[1], k_BxCxKxD.shape[2]
    G = H // K
    if T < MIN_QUERIES:  # pad with copies of the last query (sliced off below)
        n = MIN_QUERIES - T
        q_BxTxHxD = jnp.concatenate([q_BxTxHxD] + [q_BxTxHxD[:, -1:]] * n, axis=1)
        visible_BxTxC = jnp.concatenate([visible_BxTxC] + [visible_BxTxC[:, -1:]] * n, axis=1)
    Tp = q_BxTxHxD.shape[1]
    hi = jax.lax.Precision.HIGHEST  # plain float32 products (no TF32 / bf16 passes on accelerators)
    qk_levels = int(math.isqrt(_F32_EXACT // D)) - 1
    # Every tensor in [B, K, ...] order: the dots batch over (B, K) as leading axes (a dot whose batch
    # axes are not leading, or whose output is transposed, made XLA:CPU copy or loop; design §17 has
    # the forward's cost before and after). The sums are exact integers, so the order changes no bit.
    q_BxKxTxGxD = jnp.transpose(q_BxTxHxD.astype(jnp.float32).reshape(B, Tp, K, G, D), (0, 2, 1, 3, 4))
    qi_BxKxTxGxD, qs_BxKxTxGx1 = _levels(q_BxKxTxGxD, -1, qk_levels)
    ki_BxKxCxD, ks_BxKxCx1 = _levels(jnp.transpose(k_BxCxKxD.astype(jnp.float32), (0, 2, 1, 3)), -1, qk_levels)
    acc_BxKxTxGxC = jnp.einsum("bktgd,bkcd->bktgc", qi_BxKxTxGxD, ki_BxKxCxD, precision=hi)  # exact integers
    ks_BxKx1x1xC = ks_BxKxCx1[..., 0][:, :, None, None, :]
    s = rounded(acc_BxKxTxGxC * (qs_BxKxTxGx1 / math.sqrt(D)) * ks_BxKx1x1xC)  # rounded: no FMA with the subtraction below
    valid = visible_BxTxC[:, None, :, None, :]  # [B, 1, T, 1, C]
    m = jnp.max(jnp.where(valid, s, -jnp.inf), axis=-1, keepdims=True)
    e = jnp.where(valid, exp(jnp.where(valid, s - jnp.where(jnp.isfinite(m), m, 0.0), 0.0)), 0.0)  # [0, 1]
    vi_BxKxCxD, vs_BxKxCx1 = _levels(jnp.transpose(v_BxCxKxD.astype(jnp.float32), (0, 2, 1, 3)), -1, _V_LEVELS)
    vs_BxKx1x1xC = vs_BxKxCx1[..., 0][:, :, None, None, :]
    vmax = jnp.max(jnp.where(valid, vs_BxKx1x1xC, 0.0), axis=-1, keepdims=True)
    wq = float((1 << _W_BITS) - 1)
    w_int = jnp.round(e * (vs_BxKx1x1xC / jnp.where(vmax > 0, vmax, 1.0)) * wq).astype(jnp.int32)
    z = jnp.sum(jnp.round(e * wq).astype(jnp.int32), axis=-1, keepdims=True)  # an int32 sum: exact
    if 2 * _V_LEVELS * C > _F32_EXACT:
        raise ValueError(f"the batch-invariant attention sums exactly over at most {_F32_EXACT // (2 * _V_LEVELS)} "
                         f"cache slots; this cache has {C}")
    b = int(math.log2(_F32_EXACT / (_V_LEVELS * C)))  # digit bits: a digit's dot over C slots stays under 2^24
    n = -(-_W_BITS // b)
    digits = jnp.concatenate([((w_int >> (b * i)) & ((1 << b) - 1)).astype(jnp.float32)  # least significant first
                              for i in range(n)], axis=3)  # [B, K, T, n * G, C]: one matmul reads V once
    parts = jnp.einsum("bktgc,bkcd->bktgd", digits, vi_BxKxCxD, precision=hi)  # exact integers
    out = parts[:, :, :, (n - 1) * G:]
    for i in reversed(range(n - 1)):  # x * 2^b is exact: an FMA rounds as a multiply and an add do
        out = out * float(1 << b) + parts[:, :, :, i * G:(i + 1) * G]
    out = jnp.where(z > 0, out * (vmax / jnp.where(z > 0, z, 1).astype(jnp.float32)), 0.0)  # [B, K, T, G, D]
    out = jnp.transpose(out, (0, 2, 1, 3, 4))  # [B, T, K, G, D]: small, after the dots
    return out.reshape(B, Tp, H, D)[:, :T].astype(v_BxCxKxD.dtype)
