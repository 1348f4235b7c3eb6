"""The published block drafters' tensors (DFlash and DSpark: speculators, z-lab and DeepSpec all
write the same names) and our block drafter, both ways.

    published (torch [out, in])                              ours (`BlockHead`, [in, out])
    fc.weight [E, n*E]                                       fc.weight (transposed)
    hidden_norm.weight                                       context_norm.weight
    layers.i.self_attn.{q,k,v,o}_proj.weight                 layers.i.{q,k,v,o}_proj.weight (transposed)
    layers.i.self_attn.{q,k}_norm.weight                     layers.i.{q,k}_norm.weight
    layers.i.{input,post_attention}_layernorm.weight         the same
    layers.i.mlp.{gate,up,down}_proj.weight                  layers.i.mlp.* (transposed)
    norm.weight                                              norm.weight
    markov_head.markov_w1.weight [V, r]                      markov_embed [V, r]
    markov_head.markov_w2.weight [N, r]                      markov_out [r, N] (transposed)
    confidence_head.proj.{weight [1, E+r], bias [1]}         confidence_w [E+r], confidence_b []
    (MASK: the target's embedding of mask_token_id)          mask_token_id (no learned vector)

The backbone is ours exactly: context = hidden_norm(fc(features)) fed to every layer's k/v, the
block [anchor, MASK x (W-1)] attending to the context and to itself non-causally, the target's LM
head, b_k + W2(W1[x_{k-1}]) for the vanilla Markov head, and the confidence logit on
[h_k; W1[x_{k-1}]]. What differs is the slot semantics (`sample_from_anchor`) and, per layout, the
config's fields.
"""
from __future__ import annotations

import numpy as np
import jax.numpy as jnp
from flax import nnx

from specjax.drafters.block import BlockConfig, BlockDrafter, BlockHead
from specjax.drafters.interop.common import InteropError, check_target, own_rope_theta, take

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
NORMS = ("self_attn.q_norm", "self_attn.k_norm", "input_layernorm", "post_attention_layernorm")


def config_for(layer: dict, *, target_layers, block_size: int, mask_token_id, markov_rank: int, markov_type: str,
               confidence: bool, confidence_with_markov: bool, sample_from_anchor: bool, target, where: str,
               num_target_layers: int | None = None) -> BlockConfig:
    """Our config from a published block drafter's fields (`target_layers` as layer outputs)."""
    if markov_rank and markov_type != "vanilla":
        raise InteropError(f"{where}: markov_head_type {markov_type!r}: only the 'vanilla' Markov head is built")
    if confidence and not confidence_with_markov:
        raise InteropError(f"{where}: confidence_head_with_markov: false: our confidence head reads [h; W1[prev]]")
    if confidence and not markov_rank:
        raise InteropError(f"{where}: a confidence head without a Markov head (markov_rank 0) is not built")
    types = set(layer.get("layer_types") or ["full_attention"])
    if types != {"full_attention"}:
        raise InteropError(f"{where}: layer_types {sorted(types)}: the block's layers are built as full attention only")
    if layer.get("model_type") != "qwen3":
        raise InteropError(f"{where}: model_type {layer.get('model_type')!r}: the block drafter's layers are qwen3's "
                           "(per-head q/k norms)")
    if mask_token_id is None:
        raise InteropError(f"{where}: missing mask_token_id")
    layers = tuple(int(i) for i in target_layers)
    if not layers:
        raise InteropError(f"{where}: missing the target layer ids the drafter reads")
    check_target(where, hidden_size=layer["hidden_size"], vocab_size=layer["vocab_size"], layers=layers, target=target,
                 num_target_layers=num_target_layers)
    theta = own_rope_theta(layer, target, where)
    if theta is None and target.config.rope_scaling.rope_type != "default":
        raise InteropError(f"{where}: a scaled RoPE ({target.config.rope_scaling.rope_type}): the block drafter's is plain")
    try:
        return BlockConfig(hidden_size=layer["hidden_size"], num_heads=layer["num_attention_heads"],
                           num_kv_heads=layer["num_key_value_heads"], head_dim=layer["head_dim"],
                           intermediate_size=layer["intermediate_size"], num_layers=layer["num_hidden_layers"],
                           block_size=int(block_size), target_layers=layers, vocab_size=layer["vocab_size"],
                           markov_rank=int(markov_rank), confidence=bool(confidence),
                           rms_norm_eps=float(layer["rms_norm_eps"]),
                           rope_theta=float(layer["rope_theta"] if theta is None else theta),
                           mask_token_id=int(mask_token_id), sample_from_anchor=bool(sample_from_anchor))
    except ValueError as e:
        raise InteropError(f"{where}: {e}") from None


def head_from(tensors: dict, cfg: BlockConfig, where: str, dtype=jnp.float32) -> BlockHead:
    E, H, K, D, F, r = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size,
                        cfg.markov_rank)
    V, n = cfg.vocab_size, len(cfg.target_layers)
    head = BlockHead(cfg, nnx.Rngs(0), dtype)
    put = lambda var, x: var.set_value(jnp.asarray(x, dtype))  # noqa: E731
    put(head.fc.weight, take(tensors, "fc.weight", (E, n * E), where).T)
    put(head.context_norm.weight, take(tensors, "hidden_norm.weight", (E,), where))
    put(head.norm.weight, take(tensors, "norm.weight", (E,), where))
    shapes = {"self_attn.q_proj": (H * D, E), "self_attn.k_proj": (K * D, E), "self_attn.v_proj": (K * D, E),
              "self_attn.o_proj": (E, H * D), "mlp.gate_proj": (F, E), "mlp.up_proj": (F, E), "mlp.down_proj": (E, F),
              "self_attn.q_norm": (D,), "self_attn.k_norm": (D,), "input_layernorm": (E,), "post_attention_layernorm": (E,)}
    for i, layer in enumerate(head.layers):
        for name in LINEARS:
            put(_get(layer, name).weight, take(tensors, f"layers.{i}.{name}.weight", shapes[name], where).T)
        for name in NORMS:
            put(_get(layer, name).weight, take(tensors, f"layers.{i}.{name}.weight", shapes[name], where))
    extra = sorted(k for k in tensors if k.startswith(f"layers.{cfg.num_layers}."))
    if extra:
        raise InteropError(f"{where}: tensor {extra[0]!r}: more layers than num_hidden_layers {cfg.num_layers}")
    if r:
        put(head.markov_embed, take(tensors, "markov_head.markov_w1.weight", (V, r), where))
        put(head.markov_out, take(tensors, "markov_head.markov_w2.weight", (V, r), where).T)
    if cfg.confidence:
        put(head.confidence_w, take(tensors, "confidence_head.proj.weight", (1, E + r), where)[0])
        put(head.confidence_b, take(tensors, "confidence_head.proj.bias", (1,), where)[0])
    return head


def drafter_from(tensors, cfg: BlockConfig, target, where: str, confidence="off", costs=None) -> BlockDrafter:
    try:
        return BlockDrafter(head_from(tensors, cfg, where, target.config.dtype), target, confidence=confidence,
                            costs=costs)
    except InteropError:
        raise
    except ValueError as e:
        raise InteropError(f"{where}: {e}") from None


def check_borrowed(tensors: dict, target, where: str) -> None:
    """A layout that ships copies of the target's embedding / LM head (DeepSpec): they must be this
    target's (we borrow the target's own)."""
    for name, ref in (("embed_tokens.weight", target.embed_tokens[...]),
                      ("lm_head.weight", target.embed_tokens[...] if target.lm_head is None else target.lm_head.weight[...].T)):
        if name in tensors:
            ref = np.asarray(ref, np.float32)
            t = take(tensors, name, ref.shape, where)
            if not np.allclose(t, ref, atol=1e-2, rtol=1e-2):
                raise InteropError(f"{where}: {name} differs from the target's: a drafter for other target weights")


def tensors_of(head: BlockHead) -> dict:
    """The published tensors (torch layout, float32) of our head. Refused: what no published layout
    holds (a learned MASK vector, a draft vocabulary, ReaDy's reader, DPara, a TreeFlash head)."""
    cfg = head.config
    if cfg.mask_token_id is None:
        raise InteropError("this block drafter's MASK is a learned vector: the published layouts embed a vocabulary "
                           "token (train it with mask_token_id to export it)")
    if cfg.draft_vocab or cfg.reads_state or cfg.boundary or cfg.has_ar_head:
        raise InteropError("a draft vocabulary, a state reader (ReaDy), DPara's boundary blocks or a TreeFlash head "
                           "have no published layout")
    f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
    t = {"fc.weight": f32(head.fc.weight[...]).T, "hidden_norm.weight": f32(head.context_norm.weight[...]),
         "norm.weight": f32(head.norm.weight[...])}
    for i, layer in enumerate(head.layers):
        for name in LINEARS:
            t[f"layers.{i}.{name}.weight"] = f32(_get(layer, name).weight[...]).T
        for name in NORMS:
            t[f"layers.{i}.{name}.weight"] = f32(_get(layer, name).weight[...])
    if cfg.markov_rank:
        t["markov_head.markov_w1.weight"] = f32(head.markov_embed[...])
        t["markov_head.markov_w2.weight"] = f32(head.markov_out[...]).T
    if cfg.confidence:
        t["confidence_head.proj.weight"] = f32(head.confidence_w[...])[None]
        t["confidence_head.proj.bias"] = f32(head.confidence_b[...]).reshape(1)
    return {k: np.ascontiguousarray(v) for k, v in t.items()}


def _get(module, dotted: str):
    for p in dotted.replace("self_attn.", "").split("."):
        module = getattr(module, p)
    return module
