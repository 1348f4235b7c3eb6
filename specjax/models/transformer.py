"""One dense decoder for Llama (incl. llama3 RoPE scaling), Qwen2 (q/k/v bias) and Qwen3 (q/k norm).

Parameters live in flax NNX modules; the forward is a set of free functions that take explicit
positions, an explicit block mask and a KV cache, so one forward serves prefill (causal block),
one-token decode (block of one) and tree verification (ancestor mask over the tree's nodes):

    out = forward(model, tokens, positions, cache, block_mask)   # writes K/V, never commits

The caller commits: `kvcache.advance` after decoding, `kvcache.commit_path` after a tree.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from specjax.models import attention as attention_lib, invariant, kvcache
from specjax.models.kvcache import KVCache
from specjax.models import quant
from specjax.models.config import ModelConfig
from specjax.spec import packing
from specjax.typing import BlockMask, Hidden, Logits, Positions, Tokens


# ----------------------------------------------------------------------------- parameters

# Tensor-parallel layout on a (data, model) mesh (design §10, `specjax.models.sharding`): (regex searched in
# a parameter's path, spec); the first match wins, the rest is replicated. Weights are [in, out]:
# the projections into heads / the MLP hidden split their outputs over `model`, the projections back
# split their inputs (one all-reduce each); the embedding and the LM head split the vocabulary.
# Drafters reuse it: their layers carry the same names (`Drafter.partition_rules`).
PARTITION_RULES = (
    (r"(q_proj|k_proj|v_proj|gate_proj|up_proj)/weight$", P(None, "model")),
    (r"(q_proj|k_proj|v_proj)/bias$", P("model")),
    (r"(o_proj|down_proj)/weight$", P("model", None)),
    (r"embed_tokens$", P("model", None)),
    (r"lm_head/weight$", P(None, "model")),
)

class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps


class Linear(nnx.Module):
    """y = x @ weight (+ bias). `weight` is [in, out] (the transpose of torch's)."""

    def __init__(self, d_in: int, d_out: int, *, bias: bool, rngs: nnx.Rngs, dtype):
        std = 1.0 / math.sqrt(d_in)
        self.weight = nnx.Param(std * jax.random.normal(rngs.params(), (d_in, d_out), dtype))
        self.bias = nnx.Param(jnp.zeros((d_out,), dtype)) if bias else None
        self.scale = nnx.data(None)  # [out] float32 when `weight` is int8 (`specjax.models.quant`)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        E, H, K, D = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = Linear(E, H * D, bias=cfg.qkv_bias, rngs=rngs, dtype=cfg.dtype)
        self.k_proj = Linear(E, K * D, bias=cfg.qkv_bias, rngs=rngs, dtype=cfg.dtype)
        self.v_proj = Linear(E, K * D, bias=cfg.qkv_bias, rngs=rngs, dtype=cfg.dtype)
        self.o_proj = Linear(H * D, E, bias=cfg.o_bias, rngs=rngs, dtype=cfg.dtype)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(D, cfg.rms_norm_eps, cfg.dtype)
            self.k_norm = RMSNorm(D, cfg.rms_norm_eps, cfg.dtype)
        else:
            self.q_norm = self.k_norm = None


class MLP(nnx.Module):
    def __init__(self, E: int, F: int, *, rngs: nnx.Rngs, dtype):
        self.gate_proj = Linear(E, F, bias=False, rngs=rngs, dtype=dtype)
        self.up_proj = Linear(E, F, bias=False, rngs=rngs, dtype=dtype)
        self.down_proj = Linear(F, E, bias=False, rngs=rngs, dtype=dtype)


class Layer(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype)
        self.self_attn = Attention(cfg, rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, rngs=rngs, dtype=cfg.dtype)


class Model(nnx.Module):
    """A causal LM. `config` is static; every array is an `nnx.Param`."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.config = cfg
        self.embed_tokens = nnx.Param(0.02 * jax.random.normal(rngs.params(), (cfg.vocab_size, cfg.hidden_size), cfg.dtype))
        self.layers = nnx.List([Layer(cfg, rngs) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, bias=False, rngs=rngs, dtype=cfg.dtype)
        self.embed_scale = nnx.data(None)  # [V] float32 when `embed_tokens` is int8 (`specjax.models.quant`)


def init_model(cfg: ModelConfig, seed: int = 0) -> Model:
    return Model(cfg, nnx.Rngs(seed))


def num_params(model: Model) -> int:
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


# ----------------------------------------------------------------------------- functions

def rms_norm(norm: RMSNorm, x):
    # Normalise in float32, as transformers does, then cast back.
    x32 = x.astype(jnp.float32)
    x32 = invariant.rms_normalize(x32, norm.eps)
    return norm.weight[...] * x32.astype(x.dtype)


def linear(lin: Linear, x):
    y = quant.matmul(x, lin.weight[...], quant.value(lin.scale))
    return y if lin.bias is None else y + lin.bias[...]


# RoPE and the jnp attention live in `specjax.models.attention` (a leaf module); re-exported here.
rope_inv_freq = attention_lib.rope_inv_freq
rope_cos_sin = attention_lib.rope_cos_sin
apply_rope = attention_lib.apply_rope
attend = attention_lib.attend


def forward_layer(layer: Layer, cfg: ModelConfig, idx: int, x_BxTxE, cos, sin, cache: KVCache,
                  attention: attention_lib.LayerAttention, offset_B=None, exact: bool = False,
                  pack: packing.PackIndex | None = None, rows: tuple[int, int] | None = None):
    """One decoder layer. `attention(q, cache, idx) -> [B, T, H, D]` is the forward's bound attention
    (`Attention.bind`); cos = sin = None leaves q and k un-rotated (an attention that `rotates`);
    `exact`: RoPE's products rounded (an `invariant` attention's forward).

    With `pack` (packed verification, `specjax.spec.packing`), x is [1, T, E] packed nodes of a
    block whose row layout is `rows` = (B, N): the projections and the MLP run on the T packed
    rows, q / k / v go to the row layout for RoPE, the cache write and attention, and the
    attention's output comes back packed."""
    B, T, _ = x_BxTxE.shape
    H, K, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    attn = layer.self_attn
    h = rms_norm(layer.input_layernorm, x_BxTxE)
    q = linear(attn.q_proj, h).reshape(B, T, H, D)
    k = linear(attn.k_proj, h).reshape(B, T, K, D)
    v = linear(attn.v_proj, h).reshape(B, T, K, D)
    if pack is not None:
        q, k, v = (packing.to_rows(a, pack, *rows) for a in (q, k, v))
    if attn.q_norm is not None:
        q, k = rms_norm(attn.q_norm, q), rms_norm(attn.k_norm, k)
    if cos is not None:  # None: q and k stay un-rotated (the attention applies RoPE itself)
        q, k = apply_rope(q, cos, sin, exact), apply_rope(k, cos, sin, exact)
    cache = kvcache.write(cache, idx, k, v, offset_B)
    o = attention(q, cache, idx)
    if pack is not None:
        o = packing.to_packed(o, pack)
    x_BxTxE = x_BxTxE + linear(attn.o_proj, o.reshape(B, T, H * D))
    h = rms_norm(layer.post_attention_layernorm, x_BxTxE)
    mlp = layer.mlp
    x_BxTxE = x_BxTxE + linear(mlp.down_proj, jax.nn.silu(linear(mlp.gate_proj, h)) * linear(mlp.up_proj, h))
    return x_BxTxE, cache


# One attention decoder layer on its own, for a module outside the layer stack that runs the
# family's layer over its own cache (an MTP module, `specjax.drafters.mtp`).
Norm = RMSNorm  # the family's RMSNorm parameters, and `apply_norm` their function
apply_norm = rms_norm


def attention_layer_module(cfg: ModelConfig, rngs: nnx.Rngs) -> Layer:
    """A fresh attention decoder layer of this family (HF names: `input_layernorm`, `self_attn.*`, ...)."""
    return Layer(cfg, rngs)


def attention_decoder_layer(layer: Layer, cfg: ModelConfig, idx: int, x_BxTxE, positions_BxT, cache: KVCache,
                            attention: attention_lib.LayerAttention, offset_B=None):
    """`forward_layer` with RoPE at `positions` (the layer's K/V go to `cache` layer `idx`)."""
    cos, sin = rope_cos_sin(cfg, positions_BxT)
    return forward_layer(layer, cfg, idx, x_BxTxE, cos, sin, cache, attention, offset_B)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ForwardOutput:
    logits: Logits
    cache: KVCache  # K/V of the block written at slots length..length+T-1; length unchanged
    hidden: tuple[Hidden, ...]  # outputs of the requested layers, in request order
    last_hidden: Hidden  # final hidden state after the last norm (what the LM head reads)


def embed(model: Model, tokens_BxT: Tokens):
    if model.embed_scale is None and model.embed_tokens[...].dtype == model.config.dtype:
        return model.embed_tokens[...][tokens_BxT]
    return quant.rows(model.embed_tokens[...], quant.value(model.embed_scale), tokens_BxT, model.config.dtype)


def lm_head(model: Model, h_BxTxE) -> Logits:
    if model.lm_head is None:
        return quant.matmul(h_BxTxE, model.embed_tokens[...], quant.value(model.embed_scale), transposed=True).astype(jnp.float32)
    return linear(model.lm_head, h_BxTxE).astype(jnp.float32)


def forward(model: Model, tokens_BxT: Tokens, positions_BxT: Positions, cache: KVCache,
            block_mask_BxTxS: BlockMask, hidden_layers: tuple[int, ...] = (),
            offset_B=None, parents=None, attention: attention_lib.Attention | None = None,
            pack: packing.PackIndex | None = None) -> ForwardOutput:
    """Runs a block of T tokens on top of each row's committed cache prefix.

    `parents` (the block's tree structure, used by recurrent targets, see `hybrid.forward`) is
    ignored: attention sees the tree through `block_mask`.

    The block's K/V go to slots `length + offset .. +T-1` (offset 0 by default). Query t sees
    every committed slot of its row and scratch slot `length + s` iff block_mask[b, t, s]
    (causal for prefill, ancestors-or-self for a tree, [[True]] for one-token decode); S = T
    unless earlier scratch blocks (a drafter's tree so far) are visible too.

    `attention` (a `specjax.models.attention.Attention`, e.g. a drafter's `specjax.models.fold.FoldAttention`)
    replaces the model's own (`model_attention`: jnp, or the kernel of `set_attention_impl`). One
    that `rotates` gets q and k un-rotated, and the block's keys are cached before RoPE.

    `pack` (`specjax.spec.packing.PackIndex`, packed verification, design §19): only the block's
    nodes that `pack` lists are computed; embedding, projections, MLP and LM head run on those T
    packed rows, attention in the row layout. The output is in the row layout, 0 at absent nodes
    (their K/V written as 0 to their scratch slots: never visible to a present node, whose block
    mask shows its ancestors only).
    """
    cfg = model.config
    attention = model_attention(model) if attention is None else attention
    T, min_rows = tokens_BxT.shape[1], getattr(attention, "min_rows", 1)
    if pack is not None:
        return _forward_packed(model, tokens_BxT, positions_BxT, cache, block_mask_BxTxS, hidden_layers,
                               offset_B, attention, pack)
    if T < min_rows:  # a batch-invariant attention's smallest block (`specjax.models.invariant`)
        def pad(a):  # copies of the last query: they see what it sees; their K/V land in scratch slots
            return jnp.concatenate([a] + [a[:, -1:]] * (min_rows - T), axis=1)
        out = forward(model, pad(tokens_BxT), pad(positions_BxT), cache, pad(block_mask_BxTxS), hidden_layers,
                      offset_B, parents, attention)
        return ForwardOutput(logits=out.logits[:, :T], cache=out.cache, hidden=tuple(h[:, :T] for h in out.hidden),
                             last_hidden=out.last_hidden[:, :T])
    x = embed(model, tokens_BxT)
    exact = getattr(attention, "invariant", False)
    cos, sin = (None, None) if attention.rotates else rope_cos_sin(cfg, positions_BxT, cache.capacity if exact else None)
    layer_attention = attention.bind(cache, positions_BxT, block_mask_BxTxS)  # before any K/V is written
    hidden = {}
    for i, layer in enumerate(model.layers):
        x, cache = forward_layer(layer, cfg, i, x, cos, sin, cache, layer_attention, offset_B, exact)
        if i in hidden_layers:
            hidden[i] = x
    h = rms_norm(model.norm, x)
    return ForwardOutput(logits=lm_head(model, h), cache=cache,
                         hidden=tuple(hidden[i] for i in hidden_layers), last_hidden=h)


def _forward_packed(model: Model, tokens_BxN, positions_BxN, cache: KVCache, block_mask_BxNxS, hidden_layers,
                    offset_B, attention: attention_lib.Attention, pack: packing.PackIndex) -> ForwardOutput:
    """`forward` over the packed nodes of an N-node block (see `forward(pack=)`)."""
    cfg = model.config
    B, N = tokens_BxN.shape
    if N < getattr(attention, "min_rows", 1) or pack.valid_T.shape[0] < getattr(attention, "min_rows", 1):
        raise ValueError(f"a packed forward needs at least {attention.min_rows} nodes and slots (batch-invariant attention)")
    x = embed(model, packing.to_packed(tokens_BxN, pack))  # [1, T, E]
    exact = getattr(attention, "invariant", False)
    cos, sin = (None, None) if attention.rotates else rope_cos_sin(cfg, positions_BxN, cache.capacity if exact else None)
    layer_attention = attention.bind(cache, positions_BxN, block_mask_BxNxS)
    hidden = {}
    for i, layer in enumerate(model.layers):
        x, cache = forward_layer(layer, cfg, i, x, cos, sin, cache, layer_attention, offset_B, exact, pack, (B, N))
        if i in hidden_layers:
            hidden[i] = packing.to_rows(x, pack, B, N)
    h = rms_norm(model.norm, x)
    return ForwardOutput(logits=packing.to_rows(lm_head(model, h), pack, B, N), cache=cache,
                         hidden=tuple(hidden[i] for i in hidden_layers), last_hidden=packing.to_rows(h, pack, B, N))


PACKS = True  # `forward(pack=)` computes only the packed nodes (`specjax.spec.packing`)

ATTENTION_IMPLS = attention_lib.IMPLS


def set_attention_impl(model: Model, impl: str) -> Model:
    """Selects how `forward` computes attention for this model (returns the model, changed in place):
    "jnp" (the default: `attend` over `kvcache.visible_mask`), "invariant" (its batch-invariant
    form, `specjax.models.invariant`: what `load_model` selects at bf16 / int8 weights), or the Pallas tree-attention kernel
    via `pallas_kernels.ops.tree_attention` with impl "auto" (Triton on NVIDIA GPUs, interpret mode
    on CPU), "pallas", "interpret" or "reference". The choice is a static attribute of the module,
    so it is part of `nnx.split`'s graphdef: jitted programs specialise on it and retrace when it
    changes. A hybrid target (`specjax.models.hybrid`) accepts it too, for its gated-attention layers."""
    attention_lib.for_impl(impl)  # ValueError on an unknown impl
    model.attention_impl = impl
    return model


def model_attention(model) -> attention_lib.Attention:
    """The model's own attention (`set_attention_impl`; default "jnp"), as a `specjax.models.attention` object."""
    return attention_lib.for_impl(getattr(model, "attention_impl", "jnp"))


def causal_mask(batch: int, T: int, lengths_B=None) -> BlockMask:
    """Causal block mask; with `lengths`, keys at or past a row's length are hidden (right padding)."""
    m = jnp.tril(jnp.ones((T, T), bool))[None].repeat(batch, 0)
    if lengths_B is not None:
        m = m & (jnp.arange(T)[None, None, :] < lengths_B[:, None, None])
    return m


CHUNK_ATTENTION = True  # a chunked prefill's `extend` takes attention=BLOCKWISE (`specjax.models.prefill`)


def init_cache(model: Model, batch: int, capacity: int) -> KVCache:
    cfg = model.config
    return kvcache.init(cfg.num_layers, batch, capacity, cfg.num_kv_heads, cfg.head_dim, cfg.dtype)


def prefill(model: Model, tokens_BxP: Tokens, lengths_B, cache: KVCache, hidden_layers=()) -> ForwardOutput:
    """Right-padded prompts written from slot 0; commits each row's own length.

    Returns the output with `cache.length == lengths`; logits at padded positions are garbage.
    """
    B, P = tokens_BxP.shape
    cache = kvcache.set_length(cache, jnp.zeros((B,), jnp.int32))
    positions = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32)[None], (B, P))
    out = forward(model, tokens_BxP, positions, cache, causal_mask(B, P, lengths_B), hidden_layers)
    return dataclasses.replace(out, cache=kvcache.set_length(out.cache, lengths_B))


def commit(cache: KVCache, path_BxP, n_keep_B) -> KVCache:
    """After a forward over a tree: keeps the accepted path (`kvcache.commit_path`)."""
    return kvcache.commit_path(cache, path_BxP, n_keep_B)


def cache_partition(cache: KVCache) -> KVCache:
    """The cache's layout on a mesh (rows over `data`, KV heads over `model`)."""
    return kvcache.partition(cache)


def pad_nodes(cache: KVCache, num_nodes: int) -> KVCache:
    """The cache of a `forward` over the first w nodes of a tree, shaped as one over `num_nodes`
    nodes (the engine's verify-width switch): a KV cache's shape is its capacity, so unchanged."""
    return cache


def node_state_bytes(cfg: ModelConfig) -> int:
    """Per-node recurrent state of a tree block: none (K/V live in the cache's scratch slots)."""
    return 0


def cache_bytes(cfg: ModelConfig, batch: int, capacity: int) -> int:
    return 2 * cfg.num_layers * batch * capacity * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(cfg.dtype).itemsize


def decode_step(model: Model, tokens_B, cache: KVCache, hidden_layers=()) -> ForwardOutput:
    """One token per row at position `cache.length`; commits it (length += 1)."""
    B = tokens_B.shape[0]
    out = forward(model, tokens_B[:, None], cache.length[:, None], cache, jnp.ones((B, 1, 1), bool), hidden_layers)
    return dataclasses.replace(out, cache=kvcache.advance(out.cache, jnp.ones((B,), jnp.int32)))


def reserve(cache: KVCache, slots: int) -> KVCache:
    """Scratch for a drafter's tree built block by block (`forward(..., offset_B=)`): the K/V of
    scratch nodes live in the cache's own slots past `length`, so nothing to add."""
    return cache


def extend(model: Model, tokens_BxT: Tokens, n_B, cache: KVCache, hidden_layers=(), **forward_kw) -> ForwardOutput:
    """Each row's first n tokens of the right-padded block, on top of its committed cache, committed
    (length += n): a causal block. Logits at padded positions are garbage."""
    B, T = tokens_BxT.shape
    positions = cache.length[:, None] + jnp.arange(T, dtype=jnp.int32)[None]
    out = forward(model, tokens_BxT, positions, cache, causal_mask(B, T, n_B), hidden_layers, **forward_kw)
    return dataclasses.replace(out, cache=kvcache.advance(out.cache, n_B))


def release(cache: KVCache) -> KVCache:
    """The counterpart of `reserve`: nothing to drop (scratch K/V past `length` are simply overwritten)."""
    return cache
