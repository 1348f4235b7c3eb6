"""jnp references of the Pallas kernels, with the kernels' exact signatures, and the helpers both
sides share (mask bit packing, partial-attention merging, FOLD's sharpening factor).

The references are the definitions: a kernel is correct when it equals its reference (float32,
interpret mode, tests/test_kernels.py).

Tree attention (design §4, §8) — queries are the T block/tree nodes of each row, keys the row's
cache slots: the committed prefix [0, length) plus the scratch slots [length, length + S) under a
block mask (ancestor mask of a tree, causal mask of a prefill block). Its definition is the
model's own attention, `specjax.models.attention.attend` over `specjax.models.kvcache.visible_mask`, of which
`_attend` and `_visible_mask` here are copies (this package imports nothing from specjax; the test
suite checks that the two agree bit for bit).

Far-memory attention (FOLD, design §7) — a drafter query block over keys with a per-key position
and segment id; see `far_attention_reference`.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

# Segment ids of far-memory attention keys.
SEG_PAD, SEG_SINK, SEG_LOCAL, SEG_FAR = -1, 0, 1, 2

WORD_BITS = 32


# ----------------------------------------------------------------------------- mask bits

def num_words(S: int) -> int:
    return max(1, math.ceil(S / WORD_BITS))


def pack_mask(mask_BxTxS) -> jax.Array:
    """Packs a bool block mask [B, T, S] into int32 words [B, T, ceil(S/32)]: scratch slot s of
    query t is bit (s % 32) of word s // 32 (bit 31 is the sign bit). Bits past S are 0."""
    B, T, S = mask_BxTxS.shape
    W = num_words(S)
    m = jnp.pad(mask_BxTxS.astype(jnp.uint32), ((0, 0), (0, 0), (0, W * WORD_BITS - S)))
    m = m.reshape(B, T, W, WORD_BITS)
    words = jnp.sum(m << jnp.arange(WORD_BITS, dtype=jnp.uint32), axis=-1, dtype=jnp.uint32)
    return jax.lax.bitcast_convert_type(words, jnp.int32)


def unpack_mask(bits_BxTxW, S: int | None = None) -> jax.Array:
    """The inverse of `pack_mask`: bool [B, T, S] (S defaults to 32 * W)."""
    words = jax.lax.bitcast_convert_type(bits_BxTxW, jnp.uint32)
    m = (words[..., None] >> jnp.arange(WORD_BITS, dtype=jnp.uint32)) & 1
    m = m.reshape(*bits_BxTxW.shape[:2], -1).astype(bool)
    return m if S is None else m[:, :, :S]


# ----------------------------------------------------------------------------- merging

def merge_attention(o_a, lse_a, o_b, lse_b):
    """Combines two attentions of the same queries over disjoint key sets into the attention over
    their union. o: [..., D], lse: [...] (natural-log sum of exp of the scaled logits, -inf where
    nothing was visible). Returns (o, lse) in float32; a query that saw nothing in either gets 0."""
    m = jnp.maximum(lse_a, lse_b)
    m_safe = jnp.where(jnp.isneginf(m), 0.0, m)
    wa, wb = jnp.exp(lse_a - m_safe), jnp.exp(lse_b - m_safe)
    total = wa + wb
    denom = jnp.where(total == 0, 1.0, total)
    o = (wa[..., None] * o_a.astype(jnp.float32) + wb[..., None] * o_b.astype(jnp.float32)) / denom[..., None]
    lse = jnp.where(total == 0, -jnp.inf, m_safe + jnp.log(denom))
    return o, lse


def _masked_lse(s, visible):
    s = jnp.where(visible, s, -jnp.inf)
    m = jnp.max(s, axis=-1)
    m_safe = jnp.where(jnp.isneginf(m), 0.0, m)
    total = jnp.sum(jnp.where(visible, jnp.exp(s - m_safe[..., None]), 0.0), axis=-1)
    return jnp.where(total == 0, -jnp.inf, m_safe + jnp.log(jnp.where(total == 0, 1.0, total)))


def _lse_to_BxTxH(lse_BxKxGxT):
    B, K, G, T = lse_BxKxGxT.shape
    return lse_BxKxGxT.transpose(0, 3, 1, 2).reshape(B, T, K * G)


# ----------------------------------------------------------------------------- tree attention

def _visible_mask(lengths_B, capacity: int, block_mask_BxTxS):
    """`specjax.models.kvcache.visible_mask`: query t sees slot c iff c < length, or the block mask bit
    (t, c - length) is set for 0 <= c - length < S. [B, T, C]."""
    B, T, S = block_mask_BxTxS.shape
    rel_BxC = jnp.arange(capacity)[None, :] - lengths_B[:, None]
    prefix_BxC = rel_BxC < 0
    in_block_BxC = (rel_BxC >= 0) & (rel_BxC < S)
    idx_BxTxC = jnp.broadcast_to(jnp.clip(rel_BxC, 0, S - 1)[:, None, :], (B, T, capacity))
    block_BxTxC = jnp.take_along_axis(block_mask_BxTxS, idx_BxTxC, axis=2)
    return prefix_BxC[:, None, :] | (in_block_BxC[:, None, :] & block_BxTxC)


def _attend(q_BxTxHxD, k_BxCxKxD, v_BxCxKxD, visible_BxTxC):
    """`specjax.models.attention.attend`: softmax attention of T queries over C slots (GQA: H = K * G)."""
    B, T, H, D = q_BxTxHxD.shape
    K = k_BxCxKxD.shape[2]
    q_BxTxKxGxD = q_BxTxHxD.reshape(B, T, K, H // K, D)
    s_BxKxGxTxC = jnp.einsum("btkgd,bckd->bkgtc", q_BxTxKxGxD, k_BxCxKxD,
                             preferred_element_type=jnp.float32) / math.sqrt(D)
    s_BxKxGxTxC = jnp.where(visible_BxTxC[:, None, None], s_BxKxGxTxC, -jnp.inf)
    p = jax.nn.softmax(s_BxKxGxTxC, axis=-1)
    p = jnp.where(visible_BxTxC[:, None, None], p, 0.0)  # rows with nothing visible give 0, not NaN
    out_BxTxKxGxD = jnp.einsum("bkgtc,bckd->btkgd", p.astype(v_BxCxKxD.dtype), v_BxCxKxD)
    return out_BxTxKxGxD.reshape(B, T, H, D)


def tree_attention_reference(q_BxTxHxD, k_cache, v_cache, lengths_B, mask_bits_BxTxW, *,
                             layer: int | None = None, return_lse: bool = False):
    """Tree / block attention over a KV cache, by definition.

    q: [B, T, H, D] (after RoPE); k_cache, v_cache: one layer [B, C, K, D], or all layers
    [L, B, C, K, D] with a static `layer`; lengths: int32 [B] committed slots per row;
    mask_bits: int32 [B, T, W] (`pack_mask` of the [B, T, S] block mask, S <= 32 W).

    Query t of row b sees slot c iff c < length[b], or 0 <= c - length[b] < S and the block mask
    bit (t, c - length[b]) is set; softmax of q.k / sqrt(D) over what it sees; a query that sees
    nothing returns 0. Returns out [B, T, H, D] (q's dtype), and with `return_lse` also the
    log-sum-exp [B, T, H] (float32, -inf where nothing is visible) for `merge_attention`.
    """
    if layer is not None:
        k_cache, v_cache = k_cache[layer], v_cache[layer]
    visible_BxTxC = _visible_mask(lengths_B.astype(jnp.int32), k_cache.shape[1], unpack_mask(mask_bits_BxTxW))
    out = _attend(q_BxTxHxD, k_cache, v_cache, visible_BxTxC)
    if not return_lse:
        return out
    D = q_BxTxHxD.shape[-1]
    B, T, H, _ = q_BxTxHxD.shape
    K = k_cache.shape[2]
    s = jnp.einsum("btkgd,bckd->bkgtc", q_BxTxHxD.reshape(B, T, K, H // K, D), k_cache,
                   preferred_element_type=jnp.float32) / math.sqrt(D)
    return out, _lse_to_BxTxH(_masked_lse(s, visible_BxTxC[:, None, None]))


# ----------------------------------------------------------------------------- far-memory attention

def rope_inv_freq(head_dim: int, theta: float = 10000.0) -> jax.Array:
    """Default RoPE inverse frequencies [D/2], as `specjax.models.attention.rope_inv_freq` for rope_type default."""
    return 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))


def fold_beta(n_far, window, lam):
    """FOLD's far-key sharpening factor beta = max(1, 1 + lam * ln(n_far / window)) (1 without far
    keys). Works on Python numbers and arrays (e.g. n_far per row [B])."""
    n_far = jnp.asarray(n_far, jnp.float32)
    ratio = jnp.maximum(n_far, 1.0) / jnp.asarray(window, jnp.float32)
    beta = jnp.maximum(1.0, 1.0 + jnp.asarray(lam, jnp.float32) * jnp.log(ratio))
    return jnp.where(n_far > 0, beta, 1.0)


def _rope(x_BxTxHxD, pos_BxT, inv_freq):
    """x rotated at `pos` (HF rotate_half; `specjax.models.attention.rotate`)."""
    freqs = pos_BxT[..., None].astype(jnp.float32) * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    cos, sin = jnp.cos(emb)[:, :, None, :], jnp.sin(emb)[:, :, None, :]
    half = x_BxTxHxD.shape[-1] // 2
    rotated = jnp.concatenate([-x_BxTxHxD[..., half:], x_BxTxHxD[..., :half]], axis=-1)
    return (x_BxTxHxD * cos + rotated * sin).astype(x_BxTxHxD.dtype)


def far_attention_reference(q_BxTxHxD, k_BxNxKxD, v_BxNxKxD, q_pos_BxT, k_pos_BxN, segment_BxN, beta, *,
                            theta: float = 10000.0, inv_freq=None, return_lse: bool = False):
    """FOLD far-memory attention, by definition (design §7).

    Inputs, all before RoPE:
      q: [B, T, H, D] drafter queries at positions q_pos [B, T];
      k, v: [B, N, K, D] keys/values (GQA: H = K * G) at positions k_pos [B, N];
      segment: int32 [B, N]: 0 sink, 1 local, 2 far, -1 padding;
      beta: scalar or [B]: the far-logit sharpening factor (`fold_beta`);
      theta / inv_freq: RoPE (HF rotate_half convention); inv_freq [D/2] overrides theta (scaled
        RoPE variants), default `rope_inv_freq(D, theta)`.

    q and k are rotated by their own positions (far keys all carry one shared position, chosen by
    the caller), logits are q.k / sqrt(D), far-key logits are multiplied by beta. Key n is visible
    to query t iff segment[n] != -1 and (segment[n] == 2 or k_pos[n] <= q_pos[t]): far keys are
    always visible, sinks and local keys causally. Softmax over the visible keys; a query that sees
    nothing returns 0. Returns out [B, T, H, D] (q's dtype) and, with `return_lse`, the
    log-sum-exp [B, T, H] of the (sharpened) logits.
    """
    B, T, H, D = q_BxTxHxD.shape
    K = k_BxNxKxD.shape[2]
    inv = rope_inv_freq(D, theta) if inv_freq is None else jnp.asarray(inv_freq, jnp.float32)
    q = _rope(q_BxTxHxD, q_pos_BxT, inv)
    k = _rope(k_BxNxKxD, k_pos_BxN, inv)
    s = jnp.einsum("btkgd,bnkd->bkgtn", q.reshape(B, T, K, H // K, D), k,
                   preferred_element_type=jnp.float32) / math.sqrt(D)
    far_BxN = segment_BxN == SEG_FAR
    beta_B = jnp.broadcast_to(jnp.asarray(beta, jnp.float32), (B,))
    s = jnp.where(far_BxN[:, None, None, None, :], s * beta_B[:, None, None, None, None], s)
    visible_BxTxN = (segment_BxN != SEG_PAD)[:, None, :] & (
        far_BxN[:, None, :] | (k_pos_BxN[:, None, :] <= q_pos_BxT[:, :, None]))
    vis = visible_BxTxN[:, None, None]
    p = jax.nn.softmax(jnp.where(vis, s, -jnp.inf), axis=-1)
    p = jnp.where(vis, p, 0.0)
    out = jnp.einsum("bkgtn,bnkd->btkgd", p.astype(v_BxNxKxD.dtype), v_BxNxKxD).reshape(B, T, H, D)
    out = out.astype(q_BxTxHxD.dtype)
    if not return_lse:
        return out
    return out, _lse_to_BxTxH(_masked_lse(s, vis))
