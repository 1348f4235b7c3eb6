"""The gated delta rule of Gated DeltaNet layers (design §4), as pure functions: one step, the
chunked (WY) form over a sequence, and the tree form in which the causal mask is replaced by the
ancestor mask, so every node of a draft tree gets its exact output and state in one pass (each
root-to-node path is a chain); plus the short causal convolution over a chunk and along a tree's
ancestor paths. `specjax.models.hybrid` builds the hybrid target's layers on them."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.typing import Array, Bool, Int

CHUNK_SIZE = 64  # the chunked delta rule's chunk length (as HF's torch_chunk_gated_delta_rule)


def l2norm(x, eps: float = 1e-6):
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def delta_step(S_xHxKxV, q_xHxK, k_xHxK, v_xHxV, g_xH, beta_xH):
    """The recurrent form: one gated delta-rule step (any leading batch dims). Returns (o, S')."""
    S = S_xHxKxV * jnp.exp(g_xH)[..., None, None]
    kv_mem = jnp.einsum("...hkv,...hk->...hv", S, k_xHxK)
    delta = (v_xHxV - kv_mem) * beta_xH[..., None]
    S = S + k_xHxK[..., :, None] * delta[..., None, :]
    return jnp.einsum("...hkv,...hk->...hv", S, q_xHxK), S


def unit_lower_inverse(a_xCxC):
    """(I + N)^-1 for a unit lower-triangular I + N, by blocks: the inverses of the diagonal blocks
    of size s give those of size 2s, [[A, 0], [C, D]]^-1 = [[A^-1, 0], [-D^-1 C A^-1, D^-1]], log2 C
    levels of batched matmuls. Every intermediate is the exact inverse of a diagonal block, so it
    stays as small as the answer. (Not the doubling product (I - N)(I + N^2)(I + N^4)...: the powers
    of N grow like binomial coefficients when keys align, and the cancellation left errors far
    above entries that are at most 1; a trained hybrid's loss went NaN. Not a triangular solve either: XLA's CPU solve calls OpenBLAS, whose own thread pool
    deadlocked inside XLA's at training sizes.)"""
    c = a_xCxC.shape[-1]
    n = 1 << max(c - 1, 0).bit_length()  # next power of two; padded with the identity
    lead = a_xCxC.shape[:-2]
    a = a_xCxC
    if n != c:
        a = jnp.pad(a, [(0, 0)] * len(lead) + [(0, n - c), (0, n - c)])
        a = a + jnp.diag((jnp.arange(n) >= c).astype(a.dtype))
    inv = jnp.ones(lead + (n, 1, 1), a.dtype)  # inverses of the 1x1 diagonal blocks
    s = 1
    while s < n:
        m = n // (2 * s)
        blocks = jnp.diagonal(a.reshape(lead + (m, 2 * s, m, 2 * s)), axis1=-4, axis2=-2)  # [..., 2s, 2s, m]
        low = jnp.moveaxis(blocks, -1, -3)[..., s:, :s]  # C of each 2s block [..., m, s, s]
        a_inv, d_inv = inv[..., 0::2, :, :], inv[..., 1::2, :, :]
        off = -(d_inv @ low @ a_inv)
        top = jnp.concatenate([a_inv, jnp.zeros_like(a_inv)], axis=-1)
        bottom = jnp.concatenate([off, d_inv], axis=-1)
        inv = jnp.concatenate([top, bottom], axis=-2)  # [..., m, 2s, 2s]
        s *= 2
    return inv[..., 0, :c, :c]


def delta_chunked(q, k, v, g, beta, S0_BxHxKxV, chunk_size: int = CHUNK_SIZE, chunk_states: bool = False):
    """The chunked form (HF's torch_chunk_gated_delta_rule): T tokens per row on top of S0.

    q, k [B, T, H, dk], v [B, T, H, dv], g, beta [B, T, H], all float32; a step with g = beta = 0
    leaves the state unchanged (padding). Returns (o [B, T, H, dv], final state [B, H, dk, dv]),
    and with `chunk_states` also the state after each chunk [B, ceil(T / c), H, dk, dv] (entry i:
    after the first (i + 1) * c tokens; the last one is the final state).
    """
    B, T, H, _ = q.shape
    dv = v.shape[-1]
    c = max(1, min(chunk_size, T))
    pad = (-T) % c
    if pad:
        q, k, v = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (q, k, v))
        g, beta = (jnp.pad(x, ((0, 0), (0, pad), (0, 0))) for x in (g, beta))
    n = (T + pad) // c

    def chunks(x):  # [B, T, H, d] -> [n, B, H, c, d]
        return x.reshape(B, n, c, H, -1).transpose(1, 0, 3, 2, 4)

    q, k, v = chunks(q), chunks(k), chunks(v)
    g = g.reshape(B, n, c, H).transpose(1, 0, 3, 2)  # [n, B, H, c]
    beta = beta.reshape(B, n, c, H).transpose(1, 0, 3, 2)
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    cum = jnp.cumsum(g, axis=-1)
    lower = jnp.tril(jnp.ones((c, c), bool))
    diff = cum[..., :, None] - cum[..., None, :]
    decay = jnp.where(lower, jnp.exp(jnp.where(lower, diff, 0.0)), 0.0)  # exp(cum_i - cum_j), j <= i
    strict = jnp.tril(jnp.ones((c, c), bool), -1)
    ut = jnp.where(strict, (k_beta @ jnp.swapaxes(k, -1, -2)) * decay, 0.0) + jnp.eye(c, dtype=q.dtype)
    inv = unit_lower_inverse(ut)
    u = inv @ v_beta
    w = inv @ (k_beta * jnp.exp(cum)[..., None])
    attn = (q @ jnp.swapaxes(k, -1, -2)) * decay
    q_dec = q * jnp.exp(cum)[..., None]
    k_dec = k * jnp.exp(cum[..., -1:] - cum)[..., None]
    chunk_decay = jnp.exp(cum[..., -1])[..., None, None]

    def scan(S, xs):
        u_i, w_i, q_i, k_i, attn_i, dec_i = xs
        v_new = u_i - w_i @ S
        o = q_i @ S + attn_i @ v_new
        S = S * dec_i + jnp.swapaxes(k_i, -1, -2) @ v_new
        return S, ((o, S) if chunk_states else o)

    S, out = jax.lax.scan(scan, S0_BxHxKxV.astype(jnp.float32), (u, w, q_dec, k_dec, attn, chunk_decay))
    o = out[0] if chunk_states else out
    o = o.transpose(1, 0, 3, 2, 4).reshape(B, n * c, H, dv)[:, :T]
    if chunk_states:
        return o, S, jnp.moveaxis(out[1], 0, 1)
    return o, S


def delta_tree(q, k, v, g, beta, S0_BxHxKxV, parents_BxT):
    """The tree form: node t's state is one delta step from its parent's (the committed S0 for
    parent -1). Returns (o [B, T, H, dv], the per-node states [B, T, H, dk, dv]).

    One pass, no loop over depth: every root-to-node path is a chain, so the chunked form's
    WY representation holds node by node with the causal mask replaced by the ancestor mask,
    S_t = G_t S0 + sum_{j anc-or-self of t} (G_t / G_j) k_j u_j^T, where G_t is the decay product
    along the path and the u_j solve a unit lower-triangular system (topological order) whose
    row t couples only t's ancestors. Exact for any tree; a chain is the chunked form."""
    B, T = parents_BxT.shape
    S0 = S0_BxHxKxV.astype(jnp.float32)
    if T == 1:  # one token: a single recurrent step
        o, S = delta_step(S0, q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0])
        return o[:, None], S[:, None]
    anc = ancestor_or_self(parents_BxT)[:, None]  # [B, 1, T, T]: j is t or an ancestor of t
    strict = anc & ~jnp.eye(T, dtype=bool)
    q, k, v = (x.transpose(0, 2, 1, 3) for x in (q, k, v))  # [B, H, T, d]
    g, beta = g.transpose(0, 2, 1), beta.transpose(0, 2, 1)  # [B, H, T]
    cum = jnp.einsum("bxtj,bhj->bht", anc.astype(jnp.float32), g)  # log G_t: decay summed along the path
    decay = jnp.where(anc, jnp.exp(jnp.where(anc, cum[..., :, None] - cum[..., None, :], 0.0)), 0.0)
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    ut = jnp.where(strict, (k_beta @ jnp.swapaxes(k, -1, -2)) * decay, 0.0) + jnp.eye(T, dtype=q.dtype)
    inv = unit_lower_inverse(ut)
    v_new = inv @ v_beta - (inv @ (k_beta * jnp.exp(cum)[..., None])) @ S0  # u_j [B, H, T, dv]
    o = (q * jnp.exp(cum)[..., None]) @ S0 + ((q @ jnp.swapaxes(k, -1, -2)) * decay) @ v_new
    states = (jnp.exp(cum)[..., None, None] * S0[:, :, None]
              + jnp.einsum("bhtj,bhjk,bhjv->bhtkv", decay, k, v_new))  # [B, H, T, dk, dv]
    return o.transpose(0, 2, 1, 3), states.transpose(0, 2, 1, 3, 4)


def ancestor_or_self(parents_BxT) -> Bool[Array, "B T T"]:
    """mask[b, t, j]: node j is node t or one of its ancestors (parents in topological order)."""
    T = parents_BxT.shape[1]
    eye = jnp.eye(T, dtype=bool)[None]
    has_parent = (parents_BxT >= 0)[..., None]
    par = jnp.maximum(parents_BxT, 0)[..., None]

    def step(_, anc):  # after d steps, every node of depth < d has its full ancestor row
        return eye | (has_parent & jnp.take_along_axis(anc, par, axis=1))

    return jax.lax.fori_loop(0, T, step, jnp.broadcast_to(eye, parents_BxT.shape + (T,)))


def tree_depth(parents_BxT) -> Int[Array, "B T"]:
    """Depth of every node (0 for a node whose parent is -1), for topologically ordered parents."""
    T = parents_BxT.shape[1]

    def step(_, d):
        pd = jnp.take_along_axis(d, jnp.maximum(parents_BxT, 0), axis=1)
        return jnp.where(parents_BxT >= 0, pd + 1, 0)

    return jax.lax.fori_loop(0, T, step, jnp.zeros_like(parents_BxT))


def conv_chunked(x_BxTxC, conv_BxKm1xC, w_CxK, n_B):
    """Causal depthwise convolution (+ SiLU) of T inputs after the committed K-1; returns the
    outputs and the convolution state after each row's first n inputs."""
    T = x_BxTxC.shape[1]
    K = w_CxK.shape[1]
    ext = jnp.concatenate([conv_BxKm1xC.astype(x_BxTxC.dtype), x_BxTxC], axis=1)  # [B, K-1+T, C]
    out = sum(ext[:, j:j + T] * w_CxK[:, j] for j in range(K))
    new_conv = jax.vmap(lambda e, s: jax.lax.dynamic_slice_in_dim(e, s, K - 1, axis=0))(ext, n_B.astype(jnp.int32))
    return jax.nn.silu(out), new_conv


def conv_tree(x_BxTxC, conv_BxKm1xC, w_CxK, parents_BxT):
    """The convolution over a tree: node t's window is its K-1 nearest ancestors (continuing into
    the committed state above the block) and itself. Returns (outputs [B, T, C], each node's own
    convolution state [B, T, K-1, C])."""
    B, T, _ = x_BxTxC.shape
    K = w_CxK.shape[1]
    ext = jnp.concatenate([conv_BxKm1xC.astype(x_BxTxC.dtype), x_BxTxC], axis=1)  # slot K-1+t is node t
    e = jnp.broadcast_to(K - 1 + jnp.arange(T)[None], (B, T))
    idx = [e]  # idx[m]: the m-th ancestor of each node, as a slot of ext
    for _ in range(K - 1):
        is_node = e >= K - 1
        par = jnp.take_along_axis(parents_BxT, jnp.clip(e - (K - 1), 0, T - 1), axis=1)
        e = jnp.where(is_node, jnp.where(par >= 0, K - 1 + par, K - 2), e - 1)
        idx.append(jnp.maximum(e, 0))
    window = jnp.stack([jnp.take_along_axis(ext, i[..., None], axis=1) for i in reversed(idx)], axis=2)  # [B,T,K,C]
    out = jnp.einsum("btkc,ck->btc", window, w_CxK)
    return jax.nn.silu(out), window[:, :, 1:]
