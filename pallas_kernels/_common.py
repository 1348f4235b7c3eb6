"""Shared plumbing of the Pallas kernels: implementation choice, block sizes, the GQA row layout,
and merging partial (split-K) attentions by their log-sum-exp.

Row layout. Both kernels fold the G = H / K query heads that share one kv head into the rows of a
query tile: row r = t * G + g holds query t, head k * G + g. `to_rows` turns q [B, T, H, D] into
[B, K, R_pad, D_pad] (R = T * G padded to a multiple of the row block, D padded to a power of two
>= 16, both with zeros), `from_rows` undoes it.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

IMPLS = ("auto", "pallas", "interpret", "reference")

# Smallest block edge Triton's tl.dot accepts (M, N and K >= 16).
MIN_BLOCK = 16


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def prev_pow2(n: int) -> int:
    return 1 << (int(n).bit_length() - 1)


def is_nvidia_gpu() -> bool:
    """True when JAX's default backend is a CUDA GPU (Triton lowering applies)."""
    try:
        dev = jax.devices()[0]
    except RuntimeError:
        return False
    if dev.platform != "gpu":
        return False
    version = getattr(dev.client, "platform_version", "") or ""
    return "cuda" in version.lower() or dev.device_kind.lower().startswith("nvidia")


def resolve_impl(impl: str) -> str:
    """'auto' -> 'pallas' (Triton) on an NVIDIA GPU, 'interpret' on CPU, 'reference' elsewhere."""
    if impl not in IMPLS:
        raise ValueError(f"unknown attention impl {impl!r}; choose from {', '.join(IMPLS)}")
    if impl != "auto":
        return impl
    if is_nvidia_gpu():
        return "pallas"
    if jax.default_backend() == "cpu":
        return "interpret"
    return "reference"


@dataclasses.dataclass(frozen=True)
class Tiling:
    """Static launch configuration of one kernel call (all sizes are powers of two >= 16 where
    Triton needs it)."""
    block_q: int  # rows of a query tile
    block_k: int  # keys per inner-loop step
    num_splits: int  # key-axis splits (flash-decoding); partials merged by log-sum-exp
    chunk: int  # keys per split, a multiple of block_k
    num_warps: int
    num_stages: int


def choose_tiling(rows: int, keys: int, programs: int, *, gpu: bool, block_q=None, block_k=None,
                  num_splits=None, num_warps=None, num_stages=None) -> Tiling:
    """Block sizes for `rows` query rows (per kv head) and `keys` keys (>= MIN_BLOCK after padding).

    `programs` is the number of (row, kv head, query block) programs before splitting: on a GPU the
    key axis is split until there are enough programs to fill the device (the long-context decode
    case: a few tree rows against tens of thousands of cached keys)."""
    bq = block_q or min(64, max(MIN_BLOCK, next_pow2(rows)))
    bk = block_k or 64
    bk = min(bk, prev_pow2(keys))
    if bq < MIN_BLOCK or bk < MIN_BLOCK or bq != next_pow2(bq) or bk != next_pow2(bk):
        raise ValueError(f"block sizes must be powers of two >= {MIN_BLOCK}: block_q={bq}, block_k={bk}")
    n_blocks = math.ceil(keys / bk)
    if num_splits is None:
        if gpu:
            target = 264  # ~2 waves of an H100/H200's 132 SMs
            num_splits = max(1, min(math.ceil(target / max(programs * math.ceil(rows / bq), 1)),
                                    n_blocks // 4 or 1))
        else:
            num_splits = 1
    num_splits = max(1, min(int(num_splits), n_blocks))
    chunk = math.ceil(n_blocks / num_splits) * bk
    num_splits = math.ceil(keys / chunk)
    return Tiling(block_q=bq, block_k=bk, num_splits=num_splits, chunk=chunk,
                  num_warps=num_warps or 4, num_stages=num_stages or 2)


def pad_axis(x, axis: int, size: int, value=0):
    if x.shape[axis] == size:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad, constant_values=value)


def head_dim_pad(D: int) -> int:
    return max(MIN_BLOCK, next_pow2(D))


def to_rows(q_BxTxHxD, K: int, rows_pad: int, d_pad: int):
    B, T, H, D = q_BxTxHxD.shape
    G = H // K
    x = q_BxTxHxD.reshape(B, T, K, G, D).transpose(0, 2, 1, 3, 4).reshape(B, K, T * G, D)
    return pad_axis(pad_axis(x, 2, rows_pad), 3, d_pad)


def from_rows(x_BxKxRxD, T: int, G: int, D: int):
    B, K = x_BxKxRxD.shape[:2]
    x = x_BxKxRxD[:, :, : T * G, :D].reshape(B, K, T, G, D)
    return x.transpose(0, 2, 1, 3, 4).reshape(B, T, K * G, D)


def lse_from_rows(lse_BxKxR, T: int, G: int):
    B, K = lse_BxKxR.shape[:2]
    return lse_BxKxR[:, :, : T * G].reshape(B, K, T, G).transpose(0, 2, 1, 3).reshape(B, T, K * G)


def rows_of_query(x_BxT, G: int, rows_pad: int, value=0):
    """Per-query data [B, T, ...] repeated for the G heads of each row: [B, R_pad, ...]."""
    return pad_axis(jnp.repeat(x_BxT, G, axis=1), 1, rows_pad, value)


def merge_splits(o_BxKxSxRxD, lse_BxKxSxR):
    """Merges the key-axis splits of a kernel call: (o [B, K, R, D] f32, lse [B, K, R])."""
    m = jnp.max(lse_BxKxSxR, axis=2, keepdims=True)
    m_safe = jnp.where(jnp.isneginf(m), 0.0, m)
    w = jnp.exp(lse_BxKxSxR - m_safe)  # 0 for empty splits
    total = jnp.sum(w, axis=2)
    o = jnp.sum(w[..., None] * o_BxKxSxRxD, axis=2) / jnp.where(total == 0, 1.0, total)[..., None]
    lse = jnp.where(total == 0, -jnp.inf, m_safe[:, :, 0] + jnp.log(jnp.where(total == 0, 1.0, total)))
    return o, lse


def compiler_params(tiling: Tiling):
    from jax.experimental.pallas import triton as pltriton
    return pltriton.CompilerParams(num_warps=tiling.num_warps, num_stages=tiling.num_stages)


def dot_precision(dtype):
    # Triton runs float32 dots in TF32 unless asked for HIGHEST ("ieee"); the references are exact.
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


# ----------------------------------------------------------------------------- in-kernel pieces

def softmax_init(rows: int, d: int):
    return (jnp.zeros((rows, d), jnp.float32), jnp.full((rows,), -jnp.inf, jnp.float32),
            jnp.zeros((rows,), jnp.float32))


def softmax_step(carry, s, visible, v, precision):
    """One flash-attention step: logits s [BQ, BK] (float32), visible [BQ, BK], values v [BK, D]."""
    acc, m, l = carry
    s = jnp.where(visible, s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # nothing seen yet: keep exp() finite
    p = jnp.exp(s - m_safe[:, None])
    alpha = jnp.exp(m - m_safe)
    l = alpha * l + jnp.sum(p, axis=1)
    pv = jax.lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=precision,
                             preferred_element_type=jnp.float32)
    return alpha[:, None] * acc + pv, m_new, l


def softmax_finish(carry, o_ref, lse_ref):
    acc, m, l = carry
    empty = l == 0.0
    o_ref[...] = (acc / jnp.where(empty, 1.0, l)[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(empty, -jnp.inf, m + jnp.log(jnp.where(empty, 1.0, l)))


def qk_dot(q, k, precision):
    """q [BQ, D] . k [BK, D]^T in float32."""
    return jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                               preferred_element_type=jnp.float32)


def finish_call(o, lse, T: int, G: int, D: int, dtype, return_lse: bool):
    """Kernel outputs [B, K, S, R, D] / [B, K, S, R] -> out [B, T, H, D] (+ lse [B, T, H])."""
    if o.shape[2] == 1:
        o, lse = o[:, :, 0], lse[:, :, 0]
    else:
        o, lse = merge_splits(o, lse)
    out = from_rows(o, T, G, D).astype(dtype)
    return (out, lse_from_rows(lse, T, G)) if return_lse else out
