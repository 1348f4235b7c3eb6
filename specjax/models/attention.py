"""Attention for the models' forwards: RoPE, the jnp softmax attention, and the attention objects
a forward takes (a leaf module: it imports no model).

An attention object says how a forward's attention layers attend over the KV cache:

    attention.invariant               True: the forward is batch-invariant (`specjax.models.invariant`):
                                      RoPE's cos / sin from a table over the cache's slots and its
                                      products rounded (absent = False)
    attention.min_rows                a forward pads a shorter block to this many queries with
                                      copies of its last (batch-invariant; absent = 1)
    attention.rotates                 False: q and k reach it rotated (RoPE at their positions),
                                      and the cache holds rotated keys. True: they reach it
                                      UN-rotated, the cache holds keys before RoPE, and it applies
                                      RoPE itself (FOLD re-positions keys: `specjax.models.fold.FoldAttention`)
    fn = attention.bind(cache, positions_BxT, block_mask_BxTxS)
                                      once per forward, before the block's K/V are written (it may
                                      read the cache's `length` and shapes only): what every layer
                                      shares (the visible mask, the packed mask bits, ...)
    o_BxTxHxD = fn(q_BxTxHxD, cache, layer_idx)
                                      per layer, after the layer's K/V are written at slots
                                      `length + offset ..`: attention of the block's queries over
                                      the committed slots and the scratch slots under the block mask

`DenseAttention` is the jnp default (`attend` over `kvcache.visible_mask`); `InvariantAttention`
its batch-invariant form (`specjax.models.invariant`, `load_model`'s default at bf16 / int8 weights); `KernelAttention(impl)`
the Pallas tree-attention kernel (`pallas_kernels.ops.tree_attention`). `for_impl(name)` maps a
model's `attention_impl` (`transformer.set_attention_impl`) to one of them.
"""
from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Callable, ClassVar, Protocol

import jax
import jax.numpy as jnp

from pallas_kernels import ops  # only models that select a kernel import Pallas
from specjax.models import invariant, kvcache
from specjax.models.invariant import MIN_QUERIES
from specjax.models.kvcache import KVCache
from specjax.typing import Array, BlockMask, Float, Positions

if TYPE_CHECKING:
    from specjax.models.config import ModelConfig

LayerAttention = Callable[[jax.Array, KVCache, int], jax.Array]  # (q [B,T,H,D], cache, layer) -> [B,T,H,D]


# ----------------------------------------------------------------------------- RoPE

def rope_inv_freq(cfg: ModelConfig) -> Float[Array, "D/2"]:
    """RoPE inverse frequencies [D/2] of a model config (default, "linear" and "llama3" scaling)."""
    D = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (jnp.arange(0, D, 2, dtype=jnp.float32) / D))
    s = cfg.rope_scaling
    if s.rope_type == "linear":
        inv = inv / s.factor
    elif s.rope_type == "llama3":
        low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
        high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = jnp.where(wavelen > low_wavelen, inv / s.factor, inv)
        smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
        smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = jnp.where(medium, smoothed, scaled)
    return inv


def cos_sin(inv_freq, positions_BxT: Positions, table: int | None = None):
    """(cos, sin) [B, T, D] of RoPE at `positions` for inverse frequencies [D/2] (HF rotate_half).

    With `table` = N, cos and sin for positions 0..N-1 are a constant of the program (computed at
    trace time; `inv_freq` must be concrete) and the rows are gathered (positions must be < N): the
    values then do not depend on the block's shape. XLA:CPU evaluates a fused cos / sin with its
    vectorised or its scalar routine depending on the shape, which can differ in the last bit
    (`specjax.models.invariant`)."""
    if table is not None:
        with jax.ensure_compile_time_eval():  # a constant of the program: computed once, here
            cos_NxD, sin_NxD = cos_sin(jnp.asarray(inv_freq), jnp.arange(table, dtype=jnp.int32)[None])
        return cos_NxD[0][positions_BxT], sin_NxD[0][positions_BxT]
    freqs_BxTxF = positions_BxT[..., None].astype(jnp.float32) * inv_freq
    emb_BxTxD = jnp.concatenate([freqs_BxTxF, freqs_BxTxF], axis=-1)
    return jnp.cos(emb_BxTxD), jnp.sin(emb_BxTxD)


def rope_cos_sin(cfg: ModelConfig, positions_BxT: Positions, table: int | None = None):
    if table is None:
        return cos_sin(rope_inv_freq(cfg), positions_BxT)
    with jax.ensure_compile_time_eval():  # concrete, as `cos_sin(table=)` needs (eager ops: only here)
        inv_freq = rope_inv_freq(cfg)
    return cos_sin(inv_freq, positions_BxT, table)


def apply_rope(x_BxTxHxD, cos_BxTxD, sin_BxTxD, exact: bool = False):
    """x rotated by (cos, sin); `exact`: both products `invariant.rounded` before the add (batch
    invariance)."""
    half = x_BxTxHxD.shape[-1] // 2
    rotated = jnp.concatenate([-x_BxTxHxD[..., half:], x_BxTxHxD[..., :half]], axis=-1)
    cos, sin = cos_BxTxD[:, :, None, :], sin_BxTxD[:, :, None, :]
    if exact:
        return (invariant.rounded(x_BxTxHxD * cos) + invariant.rounded(rotated * sin)).astype(x_BxTxHxD.dtype)
    return (x_BxTxHxD * cos + rotated * sin).astype(x_BxTxHxD.dtype)


def rotate(x_BxTxHxD, positions_BxT: Positions, inv_freq):
    """x rotated by RoPE at `positions` (inverse frequencies [D/2])."""
    return apply_rope(x_BxTxHxD, *cos_sin(inv_freq, positions_BxT))


# ----------------------------------------------------------------------------- softmax attention

def attend(q_BxTxHxD, k_BxCxKxD, v_BxCxKxD, visible_BxTxC) -> Float[Array, "B T H D"]:
    """Softmax attention of T queries over C cache slots (GQA: H = K * G). The reference that the
    Pallas tree-attention kernel replaces."""
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


def chain_attend(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, chain_k=(), chain_v=()) -> Float[Array, "B T H D"]:
    """Training-time test's attention (the feature and MTP trainers): query t over the causal block of
    the T committed entries (k, v: entry s visible when s <= t) and, per chain step j, the one entry
    `chain_k[j][:, t]` of its own anchor. T + len(chain) scores per query: what the dense attention
    under the drafting block mask computes, without scoring the slots that mask hides."""
    B, T, H, D = q_BxTxHxD.shape
    K = k_BxTxKxD.shape[2]
    qg = q_BxTxHxD.reshape(B, T, K, H // K, D)
    causal_TxT = jnp.arange(T)[None, :] <= jnp.arange(T)[:, None]
    s1 = jnp.einsum("btkgd,bskd->bkgts", qg, k_BxTxKxD, preferred_element_type=jnp.float32) / math.sqrt(D)
    diag = [jnp.einsum("btkgd,btkd->bkgt", qg, kj, preferred_element_type=jnp.float32)[..., None] / math.sqrt(D)
            for kj in chain_k]
    p = jax.nn.softmax(jnp.concatenate([jnp.where(causal_TxT, s1, -jnp.inf)] + diag, axis=-1), axis=-1)
    o = jnp.einsum("bkgts,bskd->btkgd", p[..., :T].astype(v_BxTxKxD.dtype), v_BxTxKxD)
    for j, vj in enumerate(chain_v):
        o = o + (p[..., T + j].transpose(0, 3, 1, 2)[..., None] * vj[:, :, :, None, :]).astype(o.dtype)
    return o.reshape(B, T, H, D)


# ----------------------------------------------------------------------------- attention objects

class Attention(Protocol):
    """What a forward's `attention=` argument is (see the module docstring)."""
    rotates: bool

    def bind(self, cache: KVCache, positions_BxT: Positions, block_mask_BxTxS: BlockMask) -> LayerAttention: ...


@dataclasses.dataclass(frozen=True)
class DenseAttention:
    """The jnp default: `attend` over `kvcache.visible_mask` (computed once per forward)."""
    rotates: ClassVar[bool] = False
    invariant: ClassVar[bool] = False

    def bind(self, cache: KVCache, positions_BxT, block_mask_BxTxS) -> LayerAttention:
        visible_BxTxC = kvcache.visible_mask(cache, block_mask_BxTxS)

        def attention(q_BxTxHxD, cache: KVCache, idx: int):
            return attend(q_BxTxHxD, cache.k[idx], cache.v[idx], visible_BxTxC)

        return attention


@dataclasses.dataclass(frozen=True)
class KernelAttention:
    """The Pallas tree-attention kernel (`pallas_kernels.ops.tree_attention`, impl "auto" |
    "pallas" | "interpret" | "reference"); the block mask is packed once per forward."""
    impl: str = "auto"
    rotates: ClassVar[bool] = False

    def bind(self, cache: KVCache, positions_BxT, block_mask_BxTxS) -> LayerAttention:

        bits_BxTxW = ops.pack_mask(block_mask_BxTxS)  # shared by every layer

        def attention(q_BxTxHxD, cache: KVCache, idx: int):
            # The whole [L, B, C, K, D] cache goes in with a static layer: no per-layer slice copy.
            return ops.tree_attention(q_BxTxHxD, cache.k, cache.v, cache.length, bits_BxTxW, layer=idx, impl=self.impl)

        return attention


@dataclasses.dataclass(frozen=True)
class InvariantAttention:
    """Batch-invariant softmax attention (`specjax.models.invariant.attend`): a query gets the same bits
    decoded alone or verified in any block or tree. Each query's visible slots are compacted once per
    forward. What `load_model` selects by default for a target at bfloat16 / int8 weights.
    `invariant`: the forward takes RoPE's cos / sin from a table over the cache's slots (`cos_sin`)
    and rounds its products (`apply_rope`);
    `min_rows`: a one-token forward runs as a block of two (XLA:CPU compiles one-row fusions
    differently: with FMAs where the block's do not)."""
    rotates: ClassVar[bool] = False
    invariant: ClassVar[bool] = True
    min_rows: ClassVar[int] = MIN_QUERIES  # a forward pads a one-token block to this

    def bind(self, cache: KVCache, positions_BxT, block_mask_BxTxS) -> LayerAttention:
        visible_BxTxC = kvcache.visible_mask(cache, block_mask_BxTxS)

        def attention(q_BxTxHxD, cache: KVCache, idx: int):
            return invariant.attend(q_BxTxHxD, cache.k[idx], cache.v[idx], visible_BxTxC)

        return attention


def blockwise_attend(q_BxTxHxD, k_BxCxKxD, v_BxCxKxD, length_B, block_mask_BxTxS, key_block: int):
    """`attend` under `kvcache.visible_mask(length, block_mask)` without its [B, T, C] mask or [T, C] scores:
    an online softmax over key blocks of `key_block` slots (flash attention's recurrence), and only over
    the blocks some query sees (slots below max(length) + S): a chunk of a long prefill reads the cache up
    to its own end, not the whole capacity. Scores of one block at a time: memory T x key_block per head."""
    B, T, H, D = q_BxTxHxD.shape
    C, K = k_BxCxKxD.shape[1], k_BxCxKxD.shape[2]
    S = block_mask_BxTxS.shape[2]
    G = H // K
    kb = min(key_block, C)
    q_BxKxGxTxD = q_BxTxHxD.reshape(B, T, K, G, D).transpose(0, 2, 3, 1, 4).astype(jnp.float32) / math.sqrt(D)
    n_blocks = (jnp.max(length_B) + S + kb - 1) // kb  # blocks holding any visible slot
    n_blocks = jnp.minimum(n_blocks, (C + kb - 1) // kb)

    def body(j, carry):
        m, l, acc = carry
        start = jnp.minimum(j * kb, C - kb)  # the last block is shifted back to fit the capacity ...
        slot_X = start + jnp.arange(kb)
        k = jax.lax.dynamic_slice_in_dim(k_BxCxKxD, start, kb, axis=1).astype(jnp.float32)
        v = jax.lax.dynamic_slice_in_dim(v_BxCxKxD, start, kb, axis=1).astype(jnp.float32)
        rel_BxX = slot_X[None] - length_B[:, None]
        idx_BxTxX = jnp.broadcast_to(jnp.clip(rel_BxX, 0, S - 1)[:, None], (B, T, kb))
        in_block_BxTxX = jnp.take_along_axis(block_mask_BxTxS, idx_BxTxX, axis=2) & ((rel_BxX >= 0) & (rel_BxX < S))[:, None]
        vis_BxTxX = ((rel_BxX < 0)[:, None] | in_block_BxTxX) & (slot_X >= j * kb)[None, None]  # ... its overlap counted once
        s = jnp.einsum("bkgtd,bxkd->bkgtx", q_BxKxGxTxD, k)
        s = jnp.where(vis_BxTxX[:, None, None], s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(-1))
        safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.where(vis_BxTxX[:, None, None], jnp.exp(s - safe[..., None]), 0.0)
        corr = jnp.where(jnp.isfinite(m), jnp.exp(m - safe), 0.0)
        return m_new, l * corr + p.sum(-1), acc * corr[..., None] + jnp.einsum("bkgtx,bxkd->bkgtd", p, v)

    init = (jnp.full((B, K, G, T), -jnp.inf, jnp.float32), jnp.zeros((B, K, G, T), jnp.float32),
            jnp.zeros((B, K, G, T, D), jnp.float32))
    _, l, acc = jax.lax.fori_loop(0, n_blocks, body, init)
    out = jnp.where(l[..., None] > 0, acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)  # nothing visible: 0
    return out.transpose(0, 3, 1, 2, 4).reshape(B, T, H, D).astype(v_BxCxKxD.dtype)


@dataclasses.dataclass(frozen=True)
class BlockwiseAttention:
    """`blockwise_attend`: what a long prompt's chunked prefill attends with (`specjax.models.prefill`):
    bounded memory, and a chunk's cost grows with its own end, not with the cache's capacity."""
    key_block: int = 512
    rotates: ClassVar[bool] = False
    invariant: ClassVar[bool] = False

    def bind(self, cache: KVCache, positions_BxT, block_mask_BxTxS) -> LayerAttention:
        length_B = cache.length

        def attention(q_BxTxHxD, cache: KVCache, idx: int):
            return blockwise_attend(q_BxTxHxD, cache.k[idx], cache.v[idx], length_B, block_mask_BxTxS, self.key_block)

        return attention


DENSE = DenseAttention()
INVARIANT = InvariantAttention()
BLOCKWISE = BlockwiseAttention()
IMPLS = ("jnp", "invariant", "auto", "pallas", "interpret", "reference")


def for_impl(impl: str) -> Attention:
    """The attention object of an `attention_impl` name: "jnp" -> DENSE, "invariant" -> INVARIANT,
    else KernelAttention(impl)."""
    if impl not in IMPLS:
        raise ValueError(f"unknown attention impl {impl!r}; choose from {', '.join(IMPLS)}")
    return {"jnp": DENSE, "invariant": INVARIANT}.get(impl) or KernelAttention(impl)
