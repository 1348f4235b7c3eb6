"""A Qwen3-Next-style hybrid decoder: Gated DeltaNet (linear attention) layers and gated
full-attention layers, in the order of `config.layer_types`, each followed by a dense SwiGLU MLP.
The math follows transformers' `modeling_qwen3_next.py` (parameter names too, so Hugging Face
checkpoints map one to one):

- Gated DeltaNet: `in_proj_qkvz` / `in_proj_ba` projections (grouped by key head), a depthwise
  causal short convolution (kernel `linear_conv_kernel_dim`, SiLU) over [q, k, v], beta =
  sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias), L2-normed q and k (value heads share key
  heads in groups), the delta rule on a [H, dk, dv] state per value head

      S <- S * exp(g);  S <- S + k (beta (v - S^T k))^T;  o = S^T q / sqrt(dk)

  then a gated RMSNorm (norm(o) * silu(z)) and `out_proj`.
- Gated attention: `q_proj` gives the query and a sigmoid output gate per head, per-head q/k
  RMSNorm, RoPE on the first `head_dim * partial_rotary_factor` dims, GQA over a KV cache.
- Every RMSNorm but the gated one scales by (1 + weight) (weights are zero-centred), as in HF.

The forward is a set of free functions like `transformer`'s, over a `HybridCache` (a KV cache for
the attention layers + the committed delta-rule and convolution states of the DeltaNet layers):

    prefill(model, tokens, lengths, cache)            chunked form, commits each row's length
    extend(model, tokens, n, cache)                   chunked form on top of the committed state
    forward(model, tokens, positions, cache, block_mask, parents=...)   never commits
    commit(cache, path, n_keep)                       keeps the accepted path
    pad_nodes(cache, num_nodes)                       per-node buffers of a narrower block, padded
    decode_step(model, tokens, cache)                 recurrent form, one token, commits

`forward` treats the block as a tree (a causal block is the chain `parents = arange(T) - 1`):
node i's delta-rule state is f(state of parent(i), x_i) from the committed state, computed for
every node in one pass (`delta_tree`: the chunked form's WY representation under the ancestor
mask, exact for any tree), and its convolution window follows its ancestors. Every node's state goes into a
per-node buffer (`HybridCache.node_state` [L_lin, B, T, H, dk, dv] float32 and `node_conv`
[L_lin, B, T, K-1, C]); `commit` keeps the state of each row's last accepted node and gathers the
attention layers' K/V with `kvcache.commit_path`. No replay, no host round-trip.

Memory of the per-node buffer: `node_state_bytes(config)` bytes per tree node and row,

    L_lin * (H_v * dk * dv * 4  +  (K - 1) * C * itemsize(dtype)),   C = 2 H_k dk + H_v dv,

so a tree of N nodes over B rows holds B * N * node_state_bytes(config) bytes during
verification (e.g. Qwen3-Next-80B in bf16: 36 * (32*128*128*4 + 3*8192*2) = 77.3 MB per node and
row). `generate` refuses, before tracing, a tree whose buffer exceeds its `state_budget_bytes`
(`engine.check_state_budget`). Transiently, one layer's tree pass also holds a
[B, H, T, T, dk] float32 temporary (the decay-weighted keys) next to its [B, H, T, dk, dv] states.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from specjax.models import invariant, kvcache
from specjax.models.kvcache import KVCache
from specjax.models import transformer
from specjax.models.config import HybridConfig
from specjax.models.delta_rule import (CHUNK_SIZE, ancestor_or_self, conv_chunked, conv_tree, delta_chunked,  # noqa: F401
                                      delta_step, delta_tree, l2norm, tree_depth, unit_lower_inverse)
from specjax.models.transformer import MLP, ForwardOutput, Linear, RMSNorm, causal_mask, linear
from specjax.typing import Array, BlockMask, Float, Int, Positions, Tokens



# ----------------------------------------------------------------------------- parameters

# Tensor-parallel layout on a (data, model) mesh (design §10; see `transformer.PARTITION_RULES`):
# the DeltaNet's input projections split their outputs (key / value heads) over `model`, the
# convolution its channels, the per-head gates their heads, `out_proj` its input; the gated
# attention, the MLPs, the embedding and the LM head as in the dense family.
PARTITION_RULES = (
    (r"(in_proj_qkvz|in_proj_ba)/weight$", P(None, "model")),
    (r"conv1d/weight$", P("model", None)),
    (r"(dt_bias|A_log)$", P("model")),
    (r"out_proj/weight$", P("model", None)),
) + transformer.PARTITION_RULES

class OffsetRMSNorm(nnx.Module):
    """RMSNorm that scales by (1 + weight): HF's Qwen3NextRMSNorm (weights start at zero)."""

    def __init__(self, dim: int, eps: float, dtype):
        self.weight = nnx.Param(jnp.zeros((dim,), dtype))
        self.eps = eps


class Conv(nnx.Module):
    """Depthwise causal convolution weights [C, K] (HF's Conv1d weight [C, 1, K] without the 1)."""

    def __init__(self, channels: int, kernel: int, *, rngs: nnx.Rngs, dtype):
        self.weight = nnx.Param(jax.random.normal(rngs.params(), (channels, kernel), dtype) / math.sqrt(kernel))


class GatedDeltaNet(nnx.Module):
    def __init__(self, cfg: HybridConfig, rngs: nnx.Rngs):
        E, dt = cfg.hidden_size, cfg.dtype
        Hk, Hv, dk, dv = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.in_proj_qkvz = Linear(E, 2 * Hk * dk + 2 * Hv * dv, bias=False, rngs=rngs, dtype=dt)
        self.in_proj_ba = Linear(E, 2 * Hv, bias=False, rngs=rngs, dtype=dt)
        self.conv1d = Conv(cfg.conv_dim, cfg.linear_conv_kernel_dim, rngs=rngs, dtype=dt)
        self.dt_bias = nnx.Param(jnp.ones((Hv,), dt))
        self.A_log = nnx.Param(jnp.log(jax.random.uniform(rngs.params(), (Hv,), dt, 0.5, 4.0)))
        self.norm = RMSNorm(dv, cfg.rms_norm_eps, dt)  # the gated norm: plain weight
        self.out_proj = Linear(Hv * dv, E, bias=False, rngs=rngs, dtype=dt)


class GatedAttention(nnx.Module):
    def __init__(self, cfg: HybridConfig, rngs: nnx.Rngs):
        E, H, K, D, dt = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.dtype
        b = cfg.attention_bias
        self.q_proj = Linear(E, 2 * H * D, bias=b, rngs=rngs, dtype=dt)  # query and output gate, per head
        self.k_proj = Linear(E, K * D, bias=b, rngs=rngs, dtype=dt)
        self.v_proj = Linear(E, K * D, bias=b, rngs=rngs, dtype=dt)
        self.o_proj = Linear(H * D, E, bias=b, rngs=rngs, dtype=dt)
        self.q_norm = OffsetRMSNorm(D, cfg.rms_norm_eps, dt)
        self.k_norm = OffsetRMSNorm(D, cfg.rms_norm_eps, dt)


class HybridLayer(nnx.Module):
    def __init__(self, cfg: HybridConfig, kind: str, rngs: nnx.Rngs):
        self.input_layernorm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype)
        if kind == "linear_attention":
            self.linear_attn, self.self_attn = GatedDeltaNet(cfg, rngs), None
        else:
            self.linear_attn, self.self_attn = None, GatedAttention(cfg, rngs)
        self.post_attention_layernorm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, rngs=rngs, dtype=cfg.dtype)


class HybridModel(nnx.Module):
    """A hybrid causal LM. `config` is static; every array is an `nnx.Param`. `embed_tokens` and
    `lm_head` have the dense model's layout, so `transformer.embed` / `transformer.lm_head` (and
    the drafters that share them) work on it unchanged."""

    def __init__(self, cfg: HybridConfig, rngs: nnx.Rngs):
        self.config = cfg
        self.embed_tokens = nnx.Param(0.02 * jax.random.normal(rngs.params(), (cfg.vocab_size, cfg.hidden_size), cfg.dtype))
        self.layers = nnx.List([HybridLayer(cfg, t, rngs) for t in cfg.layer_types])
        self.norm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, bias=False, rngs=rngs, dtype=cfg.dtype)
        self.embed_scale = nnx.data(None)  # as `transformer.Model`'s


def init_model(cfg: HybridConfig, seed: int = 0) -> HybridModel:
    return HybridModel(cfg, nnx.Rngs(seed))


# ----------------------------------------------------------------------------- cache

@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HybridCache:
    """The committed state of a hybrid model, plus (after `forward`) the per-node scratch states.

    `length` (committed tokens per row) is the attention cache's: one count for every layer.
    """
    kv: KVCache  # the full-attention layers only: [L_attn, B, C, K, D]
    state: Float[Array, "L_lin B H dk dv"]  # committed delta-rule state (float32)
    conv: Float[Array, "L_lin B K-1 C"]  # committed convolution inputs: the last K-1, oldest first
    node_state: Float[Array, "L_lin B T H dk dv"] | None = None  # per node of the last forward block
    node_conv: Float[Array, "L_lin B T K-1 C"] | None = None

    @property
    def length(self) -> Int[Array, "B"]:
        return self.kv.length

    @property
    def capacity(self) -> int:
        return self.kv.capacity

    @property
    def batch(self) -> int:
        return self.kv.batch


def init_cache(model: HybridModel, batch: int, capacity: int) -> HybridCache:
    cfg = model.config
    L_lin = len(cfg.linear_layers)
    Hv, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    kv = kvcache.init(len(cfg.attention_layers), batch, capacity, cfg.num_kv_heads, cfg.head_dim, cfg.dtype)
    return HybridCache(kv=kv, state=jnp.zeros((L_lin, batch, Hv, dk, dv), jnp.float32),
                       conv=jnp.zeros((L_lin, batch, cfg.linear_conv_kernel_dim - 1, cfg.conv_dim), cfg.dtype))


def cache_partition(cache: HybridCache) -> HybridCache:
    """The cache's layout on a mesh: rows over `data`; the attention layers' KV heads, the delta-rule
    states' value heads and the convolution's channels over `model` (as the layers that make them)."""
    per_node = None if cache.node_state is None else P(None, "data", None, "model")
    node_conv = None if cache.node_conv is None else P(None, "data", None, None, "model")
    return HybridCache(kv=kvcache.partition(cache.kv), state=P(None, "data", "model"), conv=P(None, "data", None, "model"),
                       node_state=per_node, node_conv=node_conv)


def node_state_bytes(cfg: HybridConfig) -> int:
    """Bytes of the per-node state buffer for one tree node of one row (all DeltaNet layers):
    the float32 delta-rule state [H_v, dk, dv] and the K-1 convolution inputs [K-1, C]."""
    L_lin = len(cfg.linear_layers)
    state = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
    conv = (cfg.linear_conv_kernel_dim - 1) * cfg.conv_dim * jnp.dtype(cfg.dtype).itemsize
    return L_lin * (state + conv)


def cache_bytes(cfg: HybridConfig, batch: int, capacity: int) -> int:
    """Bytes of the committed cache: attention K/V at `capacity` plus the recurrent states."""
    itemsize = jnp.dtype(cfg.dtype).itemsize
    kv = 2 * len(cfg.attention_layers) * batch * capacity * cfg.num_kv_heads * cfg.head_dim * itemsize
    return kv + batch * node_state_bytes(cfg)


def commit(cache: HybridCache, path_BxP: Int[Array, "B P"], n_keep_B) -> HybridCache:
    """After `forward` over a tree: keeps the accepted path (node ids, root first) of each row.

    The attention layers' K/V of `path[:, :n_keep]` become contiguous (`kvcache.commit_path`), the
    delta-rule and convolution states become those of node `path[b, n_keep - 1]`; a row with
    n_keep = 0 keeps its state. The per-node buffers are dropped.
    """
    if cache.node_state is None:
        raise ValueError("commit needs the per-node states of a forward block; run forward first")
    n_keep_B = n_keep_B.astype(jnp.int32)
    last_B = jnp.take_along_axis(path_BxP, jnp.maximum(n_keep_B - 1, 0)[:, None], axis=1)[:, 0]
    last_B = jnp.clip(last_B, 0, cache.node_state.shape[2] - 1)
    keep_B = n_keep_B > 0

    def select(nodes_LxBxTx, committed_LxBx):
        picked = jax.vmap(lambda x, i: x[:, i], in_axes=(1, 0), out_axes=1)(nodes_LxBxTx, last_B)
        keep = keep_B.reshape((1, -1) + (1,) * (committed_LxBx.ndim - 2))
        return jnp.where(keep, picked.astype(committed_LxBx.dtype), committed_LxBx)

    return HybridCache(kv=kvcache.commit_path(cache.kv, path_BxP, n_keep_B),
                       state=select(cache.node_state, cache.state),
                       conv=select(cache.node_conv, cache.conv))


# ----------------------------------------------------------------------------- functions

def offset_rms_norm(norm: OffsetRMSNorm, x):
    x32 = x.astype(jnp.float32)
    x32 = invariant.rms_normalize(x32, norm.eps)
    return (x32 * (1.0 + norm.weight[...].astype(jnp.float32))).astype(x.dtype)


def gated_rms_norm(norm: RMSNorm, x, gate):
    x32 = x.astype(jnp.float32)
    x32 = invariant.rms_normalize(x32, norm.eps)
    h = norm.weight[...] * x32.astype(x.dtype)
    return (h * jax.nn.silu(gate.astype(jnp.float32))).astype(x.dtype)


def rope_cos_sin(cfg: HybridConfig, positions_BxT: Positions):
    """cos/sin [B, T, rotary_dim] of the partial RoPE."""
    R = cfg.rotary_dim
    inv = 1.0 / (cfg.rope_theta ** (jnp.arange(0, R, 2, dtype=jnp.float32) / R))
    freqs = positions_BxT[..., None].astype(jnp.float32) * inv
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_partial_rope(x_BxTxHxD, cos_BxTxR, sin_BxTxR):
    R = cos_BxTxR.shape[-1]
    rot, rest = x_BxTxHxD[..., :R], x_BxTxHxD[..., R:]
    half = R // 2
    rotated = jnp.concatenate([-rot[..., half:], rot[..., :half]], axis=-1)
    cos, sin = cos_BxTxR[:, :, None, :].astype(x_BxTxHxD.dtype), sin_BxTxR[:, :, None, :].astype(x_BxTxHxD.dtype)
    return jnp.concatenate([rot * cos + rotated * sin, rest], axis=-1).astype(x_BxTxHxD.dtype)


def _deltanet_inputs(la: GatedDeltaNet, cfg: HybridConfig, h_BxTxE):
    """Projections: conv input [B, T, C] (q, k, v flattened), z [B, T, Hv, dv], b and a [B, T, Hv]."""
    B, T, _ = h_BxTxE.shape
    Hk, Hv, dk, dv = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    r = Hv // Hk
    qkvz = linear(la.in_proj_qkvz, h_BxTxE).reshape(B, T, Hk, 2 * dk + 2 * r * dv)
    q, k = qkvz[..., :dk], qkvz[..., dk:2 * dk]
    v, z = qkvz[..., 2 * dk:2 * dk + r * dv], qkvz[..., 2 * dk + r * dv:]
    ba = linear(la.in_proj_ba, h_BxTxE).reshape(B, T, Hk, 2 * r)
    b, a = ba[..., :r].reshape(B, T, Hv), ba[..., r:].reshape(B, T, Hv)
    mixed = jnp.concatenate([q.reshape(B, T, Hk * dk), k.reshape(B, T, Hk * dk), v.reshape(B, T, Hv * dv)], axis=-1)
    return mixed, z.reshape(B, T, Hv, dv), b, a


def _deltanet_qkvgb(la: GatedDeltaNet, cfg: HybridConfig, conv_out_BxTxC, b, a):
    """After the convolution: float32 q, k (L2-normed, repeated to the value heads, q scaled),
    v, the log-decay g and beta."""
    B, T, _ = conv_out_BxTxC.shape
    Hk, Hv, dk, dv = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    x = conv_out_BxTxC.astype(jnp.float32)
    q = x[..., :Hk * dk].reshape(B, T, Hk, dk)
    k = x[..., Hk * dk:2 * Hk * dk].reshape(B, T, Hk, dk)
    v = x[..., 2 * Hk * dk:].reshape(B, T, Hv, dv)
    q, k = jnp.repeat(q, Hv // Hk, axis=2), jnp.repeat(k, Hv // Hk, axis=2)
    q = l2norm(q) / math.sqrt(dk)
    k = l2norm(k)
    beta = jax.nn.sigmoid(b).astype(jnp.float32)
    g = -jnp.exp(la.A_log[...].astype(jnp.float32)) * jax.nn.softplus(a.astype(jnp.float32) + la.dt_bias[...].astype(jnp.float32))
    return q, k, v, g, beta


def _deltanet_out(la: GatedDeltaNet, o_BxTxHxV, z_BxTxHxV, dtype):
    B, T = o_BxTxHxV.shape[:2]
    o = gated_rms_norm(la.norm, o_BxTxHxV.astype(dtype), z_BxTxHxV)
    return linear(la.out_proj, o.reshape(B, T, -1))


def attention_layer(at: GatedAttention, cfg: HybridConfig, h_BxTxE, cos, sin, kv: KVCache, idx: int, attention,
                    offset_B=None):
    """Gated attention over the committed prefix + the block. `attention(q, kv, idx)`: the forward's
    bound attention (`transformer.model_attention(model).bind(...)`, see `transformer.set_attention_impl`)."""
    B, T, _ = h_BxTxE.shape
    H, K, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    qg = linear(at.q_proj, h_BxTxE).reshape(B, T, H, 2 * D)
    q, gate = qg[..., :D], qg[..., D:].reshape(B, T, H * D)
    q = offset_rms_norm(at.q_norm, q)
    k = offset_rms_norm(at.k_norm, linear(at.k_proj, h_BxTxE).reshape(B, T, K, D))
    v = linear(at.v_proj, h_BxTxE).reshape(B, T, K, D)
    q, k = apply_partial_rope(q, cos, sin), apply_partial_rope(k, cos, sin)
    kv = kvcache.write(kv, idx, k, v, offset_B)
    o = attention(q, kv, idx)
    o = o.reshape(B, T, H * D) * jax.nn.sigmoid(gate)
    return linear(at.o_proj, o), kv


def _mlp(layer: HybridLayer, x):
    h = offset_rms_norm(layer.post_attention_layernorm, x)
    mlp = layer.mlp
    return x + linear(mlp.down_proj, jax.nn.silu(linear(mlp.gate_proj, h)) * linear(mlp.up_proj, h))


# One attention decoder layer on its own (an MTP module's; see `transformer.attention_decoder_layer`).
Norm = OffsetRMSNorm
apply_norm = offset_rms_norm


def attention_layer_module(cfg: HybridConfig, rngs: nnx.Rngs) -> HybridLayer:
    """A fresh gated-attention decoder layer (Qwen3-Next's `full_attention` layer)."""
    return HybridLayer(cfg, "full_attention", rngs)


def attention_decoder_layer(layer: HybridLayer, cfg: HybridConfig, idx: int, x_BxTxE, positions_BxT, cache: KVCache,
                            attention, offset_B=None):
    """A gated-attention decoder layer with partial RoPE at `positions` (K/V to `cache` layer `idx`)."""
    cos, sin = rope_cos_sin(cfg, positions_BxT)
    h = offset_rms_norm(layer.input_layernorm, x_BxTxE)
    out, cache = attention_layer(layer.self_attn, cfg, h, cos, sin, cache, idx, attention, offset_B)
    return _mlp(layer, x_BxTxE + out), cache


# The embedding and LM head are the transformer's (same parameter names, tied or not).
embed = transformer.embed
lm_head = transformer.lm_head


def _run(model: HybridModel, tokens_BxT, positions_BxT, cache: HybridCache, block_mask_BxTxS, hidden_layers,
         linear_fn, offset_B=None):
    """The layer stack. `linear_fn(la, j, mixed, z, b, a, state, conv) -> (out, extra)` runs DeltaNet
    layer j (its index among the linear layers) and returns whatever the caller collects."""
    cfg = model.config
    x = embed(model, tokens_BxT)
    cos, sin = rope_cos_sin(cfg, positions_BxT)
    # the model's own attention (transformer.set_attention_impl works on hybrids too), bound once
    attention = transformer.model_attention(model).bind(cache.kv, positions_BxT, block_mask_BxTxS)
    kv, extras, hidden = cache.kv, [], {}
    lin_index = {layer: j for j, layer in enumerate(cfg.linear_layers)}
    attn_index = {layer: j for j, layer in enumerate(cfg.attention_layers)}
    for i, layer in enumerate(model.layers):
        h = offset_rms_norm(layer.input_layernorm, x)
        if layer.linear_attn is not None:
            j = lin_index[i]
            mixed, z, b, a = _deltanet_inputs(layer.linear_attn, cfg, h)
            out, extra = linear_fn(layer.linear_attn, j, mixed, z, b, a, cache.state[j], cache.conv[j])
            extras.append(extra)
        else:
            out, kv = attention_layer(layer.self_attn, cfg, h, cos, sin, kv, attn_index[i], attention,
                                      offset_B)
        x = _mlp(layer, x + out)
        if i in hidden_layers:
            hidden[i] = x
    h = offset_rms_norm(model.norm, x)
    return h, kv, extras, tuple(hidden[i] for i in hidden_layers)


def forward(model: HybridModel, tokens_BxT: Tokens, positions_BxT: Positions, cache: HybridCache,
            block_mask_BxTxS: BlockMask, hidden_layers: tuple[int, ...] = (), parents=None,
            offset_B=None) -> ForwardOutput:
    """Runs a block of T nodes on top of each row's committed state; never commits.

    `parents[b, t]` is node t's parent within the block (-1: its parent is the committed state);
    None means a causal chain (`arange(T) - 1`). Nodes must be in topological order (parent < t).
    The attention layers see the committed prefix plus the block under `block_mask` (their K/V go
    to slots `length .. length+T-1`), as in `transformer.forward`; the DeltaNet layers follow
    `parents`. The returned cache holds every node's delta-rule and convolution state in
    `node_state` / `node_conv`, for `commit`.

    With `offset_B` (a drafter expanding its tree depth by depth, see `reserve`): the block's nodes
    go to scratch slots `offset .. offset+T-1` (attention K/V at `length + offset + t`, states into
    the reserved `node_state` / `node_conv` at slot `offset + t`), and `parents[b, t]` is the scratch
    slot of the node's parent in an EARLIER block (-1: the committed state): one recurrent step
    from the parent's stored state per node.
    """
    cfg = model.config
    B, T = tokens_BxT.shape
    if offset_B is not None:
        return _forward_scratch(model, tokens_BxT, positions_BxT, cache, block_mask_BxTxS, hidden_layers, parents,
                                offset_B)
    if parents is None:
        parents = jnp.arange(T, dtype=jnp.int32)[None] - 1
    parents_BxT = jnp.broadcast_to(jnp.asarray(parents, jnp.int32), (B, T))

    def linear_fn(la, j, mixed, z, b, a, state, conv):
        conv_out, node_conv = conv_tree(mixed, conv, la.conv1d.weight[...], parents_BxT)
        q, k, v, g, beta = _deltanet_qkvgb(la, cfg, conv_out, b, a)
        o, node_state = delta_tree(q, k, v, g, beta, state, parents_BxT)
        return _deltanet_out(la, o, z, mixed.dtype), (node_state, node_conv)

    h, kv, extras, hidden = _run(model, tokens_BxT, positions_BxT, cache, block_mask_BxTxS, hidden_layers, linear_fn)
    if extras:
        node_state = jnp.stack([e[0] for e in extras])
        node_conv = jnp.stack([e[1] for e in extras])
    else:
        node_state = jnp.zeros((0, B, T) + cache.state.shape[2:], jnp.float32)
        node_conv = jnp.zeros((0, B, T) + cache.conv.shape[2:], cache.conv.dtype)
    out_cache = dataclasses.replace(cache, kv=kv, node_state=node_state, node_conv=node_conv)
    return ForwardOutput(logits=lm_head(model, h), cache=out_cache, hidden=hidden, last_hidden=h)


def pad_nodes(cache: HybridCache, num_nodes: int) -> HybridCache:
    """The cache of a `forward` over the first w nodes of a tree, shaped as one over `num_nodes`
    nodes (the engine's verify-width switch): `node_state` / `node_conv` zero-padded along the node
    axis (2) to `num_nodes`. The padded nodes were not run; `commit` never picks them (they are
    invalid, so never on an accepted path)."""
    if cache.node_state is None:
        raise ValueError("pad_nodes needs the per-node states of a forward block; run forward first")
    w = cache.node_state.shape[2]
    if w > num_nodes:
        raise ValueError(f"cannot pad a block of {w} nodes to {num_nodes}")

    def pad(x):
        return jnp.pad(x, [(0, 0), (0, 0), (0, num_nodes - w)] + [(0, 0)] * (x.ndim - 3))

    return dataclasses.replace(cache, node_state=pad(cache.node_state), node_conv=pad(cache.node_conv))


def reserve(cache: HybridCache, slots: int) -> HybridCache:
    """The cache with empty per-node buffers of `slots` scratch slots, for `forward(..., offset_B=)`."""
    L, B = cache.state.shape[:2]
    return dataclasses.replace(cache, node_state=jnp.zeros((L, B, slots) + cache.state.shape[2:], jnp.float32),
                               node_conv=jnp.zeros((L, B, slots) + cache.conv.shape[2:], cache.conv.dtype))


def release(cache: HybridCache) -> HybridCache:
    """The cache without its per-node buffers (what `reserve` added): the committed state only."""
    return dataclasses.replace(cache, node_state=None, node_conv=None)


def _forward_scratch(model: HybridModel, tokens_BxT, positions_BxT, cache: HybridCache, block_mask_BxTxS,
                     hidden_layers, parents_BxT, offset_B) -> ForwardOutput:
    """`forward` with `offset_B`: each node one recurrent step from its parent's scratch state."""
    cfg = model.config
    B, T = tokens_BxT.shape
    if cache.node_state is None:
        raise ValueError("forward(..., offset_B=) writes per-node states into scratch slots: reserve them first "
                         "(hybrid.reserve(cache, slots))")
    par_BxT = jnp.broadcast_to(jnp.asarray(parents_BxT, jnp.int32), (B, T))
    has_par = par_BxT >= 0
    rows = jnp.arange(B)[:, None]
    slot_BxT = offset_B.astype(jnp.int32)[:, None] + jnp.arange(T, dtype=jnp.int32)[None]
    single = jnp.full((B * T, 1), -1, jnp.int32)  # every node is a block of one on top of its own start state

    def start(nodes_BxSx, committed_Bx):  # each node's start state: its parent's, or the committed one
        picked = nodes_BxSx[rows, jnp.maximum(par_BxT, 0)]
        keep = has_par.reshape((B, T) + (1,) * (committed_Bx.ndim - 1))
        return jnp.where(keep, picked.astype(committed_Bx.dtype), committed_Bx[:, None])

    def linear_fn(la, j, mixed, z, b, a, state, conv):
        S0 = start(cache.node_state[j], state).reshape((B * T,) + state.shape[1:])
        c0 = start(cache.node_conv[j], conv).reshape((B * T,) + conv.shape[1:])
        C = mixed.shape[-1]
        conv_out, node_conv = conv_tree(mixed.reshape(B * T, 1, C), c0, la.conv1d.weight[...], single)
        q, k, v, g, beta = _deltanet_qkvgb(la, cfg, conv_out.reshape(B, T, C), b, a)
        q, k, v, g, beta = (x.reshape((B * T, 1) + x.shape[2:]) for x in (q, k, v, g, beta))
        o, node_state = delta_tree(q, k, v, g, beta, S0, single)
        o = o.reshape((B, T) + o.shape[2:])
        return _deltanet_out(la, o, z, mixed.dtype), (node_state.reshape((B, T) + node_state.shape[2:]),
                                                      node_conv.reshape((B, T) + node_conv.shape[2:]))

    h, kv, extras, hidden = _run(model, tokens_BxT, positions_BxT, cache, block_mask_BxTxS, hidden_layers, linear_fn,
                                 offset_B)
    node_state, node_conv = cache.node_state, cache.node_conv
    for j, (st, cv) in enumerate(extras):
        node_state = node_state.at[j, rows, slot_BxT].set(st, mode="drop")
        node_conv = node_conv.at[j, rows, slot_BxT].set(cv.astype(node_conv.dtype), mode="drop")
    out_cache = dataclasses.replace(cache, kv=kv, node_state=node_state, node_conv=node_conv)
    return ForwardOutput(logits=lm_head(model, h), cache=out_cache, hidden=hidden, last_hidden=h)


def extend(model: HybridModel, tokens_BxT: Tokens, n_B, cache: HybridCache, hidden_layers: tuple[int, ...] = (),
           chunk_size: int = CHUNK_SIZE) -> ForwardOutput:
    """The chunked form: each row's first n tokens of the right-padded block, on top of its
    committed state, committed (length += n). Logits at padded positions are garbage."""
    cfg = model.config
    B, T = tokens_BxT.shape
    n_B = jnp.asarray(n_B, jnp.int32)
    positions = cache.length[:, None] + jnp.arange(T, dtype=jnp.int32)[None]
    valid_BxT = jnp.arange(T)[None] < n_B[:, None]

    def linear_fn(la, j, mixed, z, b, a, state, conv):
        conv_out, new_conv = conv_chunked(mixed, conv, la.conv1d.weight[...], n_B)
        q, k, v, g, beta = _deltanet_qkvgb(la, cfg, conv_out, b, a)
        # Padding steps leave the state alone: no decay (g = 0), no write (beta = 0).
        g, beta = jnp.where(valid_BxT[..., None], g, 0.0), jnp.where(valid_BxT[..., None], beta, 0.0)
        o, new_state = delta_chunked(q, k, v, g, beta, state, chunk_size)
        return _deltanet_out(la, o, z, mixed.dtype), (new_state, new_conv)

    h, kv, extras, hidden = _run(model, tokens_BxT, positions, cache, causal_mask(B, T, n_B), hidden_layers, linear_fn)
    state = jnp.stack([e[0] for e in extras]) if extras else cache.state
    conv = jnp.stack([e[1] for e in extras]).astype(cache.conv.dtype) if extras else cache.conv
    out_cache = HybridCache(kv=kvcache.advance(kv, n_B), state=state, conv=conv)
    return ForwardOutput(logits=lm_head(model, h), cache=out_cache, hidden=hidden, last_hidden=h)


def prefix_states(model: HybridModel, tokens_BxT: Tokens, every: int, hidden_layers: tuple[int, ...] = (),
                  read: tuple[int, ...] | None = None):
    """A full-sequence forward from the empty state (the chunked form, chunks of `every` tokens) that
    also returns DeltaNet states at the chunk ends: `states[l, b, i]` is the delta-rule state of the
    l-th linear layer in `read` (indices among the linear layers; None: all) after the first i * every
    tokens of row b (i = 0: the empty state), i.e. the committed state a drafter sees when the token
    at position i * every is the round's root (ReaDy's training, design §5c). Returns (ForwardOutput
    without a cache, states [len(read), B, T // every + 1, H, dk, dv]). The outputs are `forward`'s
    on a causal block (same math, chunked differently)."""
    cfg = model.config
    B, T = tokens_BxT.shape
    if every < 1:
        raise ValueError(f"every must be >= 1, got {every}")
    cache = init_cache(model, B, T)
    n_B = jnp.full((B,), T, jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None], (B, T))

    read = tuple(range(len(cfg.linear_layers))) if read is None else tuple(read)

    def linear_fn(la, j, mixed, z, b, a, state, conv):
        conv_out, _ = conv_chunked(mixed, conv, la.conv1d.weight[...], n_B)
        q, k, v, g, beta = _deltanet_qkvgb(la, cfg, conv_out, b, a)
        o, _, chunk_S = delta_chunked(q, k, v, g, beta, state, every, chunk_states=True)
        kept = None
        if j in read:  # only the layers asked for are kept ([B, H, dk, dv] per chunk end adds up)
            kept = jnp.concatenate([state[:, None].astype(jnp.float32), chunk_S[:, :T // every]], axis=1)
        return _deltanet_out(la, o, z, mixed.dtype), kept

    h, _, extras, hidden = _run(model, tokens_BxT, positions, cache, causal_mask(B, T), hidden_layers, linear_fn)
    by_layer = dict(zip(range(len(extras)), extras))
    states = (jnp.stack([by_layer[j] for j in read]) if read
              else jnp.zeros((0, B, T // every + 1) + cache.state.shape[2:], jnp.float32))
    return ForwardOutput(logits=lm_head(model, h), cache=None, hidden=hidden, last_hidden=h), states


def reset(cache: HybridCache) -> HybridCache:
    """An empty cache of the same shapes (length 0, zero states)."""
    return HybridCache(kv=kvcache.set_length(cache.kv, jnp.zeros_like(cache.kv.length)),
                       state=jnp.zeros_like(cache.state), conv=jnp.zeros_like(cache.conv))


def prefill(model: HybridModel, tokens_BxP: Tokens, lengths_B, cache: HybridCache, hidden_layers=()) -> ForwardOutput:
    """Right-padded prompts from an empty state (chunked form); commits each row's own length."""
    return extend(model, tokens_BxP, lengths_B, reset(cache), hidden_layers)


def decode_step(model: HybridModel, tokens_B, cache: HybridCache, hidden_layers=()) -> ForwardOutput:
    """One token per row at position `cache.length` (recurrent form); commits it."""
    B = tokens_B.shape[0]
    out = forward(model, tokens_B[:, None], cache.length[:, None], cache, jnp.ones((B, 1, 1), bool), hidden_layers,
                  parents=jnp.full((B, 1), -1, jnp.int32))
    c = out.cache  # a block of one node: its K/V are already in place, its state is the new state
    committed = HybridCache(kv=kvcache.advance(c.kv, jnp.ones((B,), jnp.int32)), state=c.node_state[:, :, 0],
                            conv=c.node_conv[:, :, 0].astype(c.conv.dtype))
    return dataclasses.replace(out, cache=committed)


def num_params(model: HybridModel) -> int:
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
