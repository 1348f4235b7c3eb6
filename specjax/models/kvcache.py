"""The KV cache: one registered dataclass pytree for every attention layer of a model.

Rows of one batch hold different lengths. A forward over a block of T tokens writes their K/V at
slots `length .. length+T-1` of each row (`write`) without advancing `length`; the caller then
commits: `advance` for plain decoding, `commit_path` for a verified tree (design §4), which gathers
the accepted nodes' slots into place and advances each row by its own amount.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jax.sharding import PartitionSpec as P

from specjax.typing import Array, Float, Int, Lengths


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    k: Float[Array, "L B C K D"]
    v: Float[Array, "L B C K D"]
    length: Int[Array, "B"]  # committed tokens per row; slots >= length are scratch

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    @property
    def batch(self) -> int:
        return self.k.shape[1]


def partition(cache: KVCache) -> KVCache:
    """The cache's layout on a (data, model) mesh (design §10): rows over `data`, KV heads over
    `model` (as the attention heads that write them); `specjax.models.sharding` fits it to the shapes."""
    kv = P(None, "data", None, "model", None)
    return KVCache(k=kv, v=kv, length=P("data"))


def init(num_layers: int, batch: int, capacity: int, kv_heads: int, head_dim: int,
         dtype=jnp.float32) -> KVCache:
    shape = (num_layers, batch, capacity, kv_heads, head_dim)
    return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
                   length=jnp.zeros((batch,), jnp.int32))


def write(cache: KVCache, layer: int, k_BxTxKxD, v_BxTxKxD, offset_B=None) -> KVCache:
    """Writes one layer's new K/V at slots `length + offset` of each row (length is not advanced).

    `offset` (default 0) places a block after earlier scratch blocks, as a drafter does when it
    expands its tree depth by depth. One scatter into the whole [L, B, C, K, D] buffer, updated in
    place. (Slicing the layer out and setting it back made XLA copy the buffer in a standalone jitted
    step, a cost that grew with the capacity; inside the engine's loop both forms cost the same.)
    Slots past the capacity are dropped (the engine sizes the cache so that none are)."""
    start_B = cache.length if offset_B is None else cache.length + offset_B
    B, T = k_BxTxKxD.shape[:2]
    slot_BxT = start_B[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    row_BxT = jnp.broadcast_to(jnp.arange(B, dtype=jnp.int32)[:, None], (B, T))
    k = cache.k.at[layer, row_BxT, slot_BxT].set(k_BxTxKxD.astype(cache.k.dtype), mode="drop")
    v = cache.v.at[layer, row_BxT, slot_BxT].set(v_BxTxKxD.astype(cache.v.dtype), mode="drop")
    return dataclasses.replace(cache, k=k, v=v)


def advance(cache: KVCache, n_B: Lengths) -> KVCache:
    """Keeps the first n slots written after `length` in each row."""
    return dataclasses.replace(cache, length=cache.length + n_B.astype(jnp.int32))


def set_length(cache: KVCache, length_B: Lengths) -> KVCache:
    return dataclasses.replace(cache, length=length_B.astype(jnp.int32))


def commit_path(cache: KVCache, path_BxP: Int[Array, "B P"], n_keep_B: Lengths) -> KVCache:
    """Moves the slots `length + path[b, i]` (i < P) to `length + i` and advances by n_keep.

    `path` holds block-relative indices (tree node ids); entries at i >= n_keep are ignored
    (they may be anything in range). Used after tree verification: the accepted root-to-leaf
    path's K/V become contiguous, the rejected branches fall beyond the new length.
    """
    P = path_BxP.shape[1]
    src_BxP = jnp.clip(cache.length[:, None] + path_BxP, 0, cache.capacity - 1)
    keep_BxP = jnp.arange(P)[None, :] < n_keep_B[:, None]
    # Rejected entries (and any slot past the capacity) are sent out of range and dropped.
    dst_BxP = jnp.where(keep_BxP, cache.length[:, None] + jnp.arange(P)[None, :], cache.capacity)
    row_BxP = jnp.broadcast_to(jnp.arange(cache.batch, dtype=jnp.int32)[:, None], src_BxP.shape)

    def move(buf_LxBxCxKxD):
        # A gather then one scatter into the whole buffer (updated in place, as in `write`).
        gathered_LxBxPxKxD = buf_LxBxCxKxD[:, row_BxP, src_BxP]  # read before any write
        return buf_LxBxCxKxD.at[:, row_BxP, dst_BxP].set(gathered_LxBxPxKxD, mode="drop")

    return KVCache(k=move(cache.k), v=move(cache.v), length=cache.length + n_keep_B.astype(jnp.int32))


def visible_mask(cache: KVCache, block_mask_BxTxS) -> Array:
    """Which cache slots each of the T block queries sees: the row's committed prefix plus the
    scratch slots `length .. length+S-1` under `block_mask` (causal for prefill, ancestors for a
    tree; S = T unless earlier scratch blocks are visible too). [B, T, C]."""
    B, T, S = block_mask_BxTxS.shape
    slot_C = jnp.arange(cache.capacity)
    rel_BxC = slot_C[None, :] - cache.length[:, None]
    prefix_BxC = rel_BxC < 0
    in_block_BxC = (rel_BxC >= 0) & (rel_BxC < S)
    idx_BxTxC = jnp.broadcast_to(jnp.clip(rel_BxC, 0, S - 1)[:, None, :], (B, T, cache.capacity))
    block_BxTxC = jnp.take_along_axis(block_mask_BxTxS, idx_BxTxC, axis=2)
    return prefix_BxC[:, None, :] | (in_block_BxC[:, None, :] & block_BxTxC)
