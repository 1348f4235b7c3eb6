"""EAGLE-3's tensors and our feature drafter, both ways (speculators and SafeAILab share them; the
SafeAILab reader renames `midlayer.` to `layers.0.` first).

    published (torch [out, in])                      ours (`FeatureHead`, [in, out])
    fc.weight [E, n*E]  (aux ids ascending)          fc.weight (transposed; blocks in our layer order)
    layers.0.input_layernorm.weight (the embedding)  embed_norm.weight
    layers.0.hidden_norm.weight                      hidden_norm.weight
    layers.0.self_attn.{q,k,v,o}_proj.weight         {q,k,v,o}_proj.weight (transposed)
    layers.0.post_attention_layernorm.weight         post_attention_layernorm.weight
    layers.0.mlp.{gate,up,down}_proj.weight          mlp.* (transposed)
    norm.weight                                      norm.weight
    lm_head.weight [N, E]; d2t [N] (offsets), t2d    own_head = N, its rows, ids = arange(N) + d2t
    embed_tokens.weight [V, E] (optional)            the target's: must equal it (we borrow it)

The first layer takes cat([input_layernorm(embedding), hidden_norm(x)]), embedding first; the
residual is x (`norm_before_residual: false`) or hidden_norm(x) (true). Step 2 on feeds back the
layer's pre-norm output, as ours does.
"""
from __future__ import annotations

import numpy as np
import jax.numpy as jnp
from flax import nnx

from specjax.drafters.feature import FeatureConfig, FeatureDrafter, FeatureHead
from specjax.drafters.interop.common import InteropError, check_target, draft_ids_from_d2t, own_rope_theta, take
from specjax.drafters.vocab import head_rows

PREFIX = "layers.0."
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def _ours(name: str) -> tuple[str, ...]:
    """Our NNX path of a published layer-0 linear."""
    return tuple(name.replace("self_attn.", "").split("."))


def config_for(layer: dict, aux_ids: list[int], own_head: int, norm_before_residual: bool, target,
               where: str) -> FeatureConfig:
    """Our config from a published drafter's decoder config and aux ids (entering-layer numbering)."""
    if layer.get("num_hidden_layers", 1) != 1:
        raise InteropError(f"{where}: num_hidden_layers {layer['num_hidden_layers']}: our feature drafter has one layer")
    if layer.get("model_type") == "qwen3":
        raise InteropError(f"{where}: a qwen3 decoder layer (per-head q/k norms): our feature drafter's layer is llama's")
    ours = tuple(sorted(int(i) - 1 for i in aux_ids))
    check_target(where, hidden_size=layer["hidden_size"], vocab_size=layer["vocab_size"], layers=ours, target=target)
    return FeatureConfig(hidden_size=layer["hidden_size"], num_heads=layer["num_attention_heads"],
                         num_kv_heads=layer["num_key_value_heads"], head_dim=layer["head_dim"],
                         intermediate_size=layer["intermediate_size"], target_layers=ours, vocab_size=layer["vocab_size"],
                         rms_norm_eps=float(layer["rms_norm_eps"]), norm_before_residual=bool(norm_before_residual),
                         rope_theta=own_rope_theta(layer, target, where), own_head=own_head)


def head_from(tensors: dict, layer: dict, aux_ids: list[int], norm_before_residual: bool, target, where: str,
              dtype=jnp.float32) -> FeatureHead:
    """A `FeatureHead` from EAGLE-3 tensors (names as speculators writes them)."""
    V, E = layer["vocab_size"], layer["hidden_size"]
    if "lm_head.weight" not in tensors:
        raise InteropError(f"{where}: missing tensor 'lm_head.weight' (an EAGLE-3 drafter's own LM head)")
    N = tensors["lm_head.weight"].shape[0]
    if "d2t" in tensors:
        ids = draft_ids_from_d2t(take(tensors, "d2t", (N,), where), tensors.get("t2d"), V, where)
    elif N == V:
        ids = np.arange(V, dtype=np.int32)
    else:
        raise InteropError(f"{where}: lm_head has {N} rows (< vocab {V}) but no d2t maps them to target tokens")
    cfg = config_for(layer, aux_ids, N, norm_before_residual, target, where)
    n, H, K, D, F = len(cfg.target_layers), cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    if "embed_tokens.weight" in tensors:  # we borrow the target's: a trained embedding would be silently dropped
        emb = take(tensors, "embed_tokens.weight", (V, E), where)
        if not np.allclose(emb, np.asarray(target.embed_tokens[...], np.float32), atol=1e-2, rtol=1e-2):
            raise InteropError(f"{where}: embed_tokens differs from the target's embedding: a drafter with its own "
                               "embedding is not built (ours borrows the target's)")
    for key in ("input_norm.weight", "fc_norm.0.weight"):
        if key in tensors:
            raise InteropError(f"{where}: tensor {key!r} (norm_before_fc / fc_norm) is not built")
    head = FeatureHead(cfg, nnx.Rngs(0), dtype, ids)
    # fc: the published input blocks are in ascending aux order, ours in `target_layers` order (sorted too)
    fc = take(tensors, "fc.weight", (E, n * E), where)
    head.fc.weight.set_value(jnp.asarray(fc.T, dtype))
    shapes = {"self_attn.q_proj": (H * D, 2 * E), "self_attn.k_proj": (K * D, 2 * E), "self_attn.v_proj": (K * D, 2 * E),
              "self_attn.o_proj": (E, H * D), "mlp.gate_proj": (F, E), "mlp.up_proj": (F, E), "mlp.down_proj": (E, F)}
    for name in LINEARS:
        w = take(tensors, f"{PREFIX}{name}.weight", shapes[name], where)
        _get(head, _ours(name)).weight.set_value(jnp.asarray(w.T, dtype))
    for theirs, ours in (("layers.0.input_layernorm", head.embed_norm), ("layers.0.hidden_norm", head.hidden_norm),
                         ("layers.0.post_attention_layernorm", head.post_attention_layernorm), ("norm", head.norm)):
        ours.weight.set_value(jnp.asarray(take(tensors, f"{theirs}.weight", (E,), where), dtype))
    head.lm_head.set_value(jnp.asarray(take(tensors, "lm_head.weight", (N, E), where), dtype))
    return head


def drafter_from(tensors, layer, aux_ids, norm_before_residual, target, where) -> FeatureDrafter:
    return FeatureDrafter(head_from(tensors, layer, aux_ids, norm_before_residual, target, where,
                                    dtype=target.config.dtype), target)


def tensors_of(head: FeatureHead, target, with_embedding: bool = True) -> tuple[dict, np.ndarray]:
    """EAGLE-3 tensors (torch layout, float32) of our head, and the sorted draft ids: its own head's
    rows, or the target LM head's rows of its draft vocabulary (all V when it has none)."""
    cfg = head.config
    f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
    if head.lm_head is not None:
        ids, rows = np.asarray(head.head_ids[...]), f32(head.lm_head[...])
    else:
        ids = np.arange(cfg.vocab_size, dtype=np.int32)
        rows = f32(head_rows(target, ids))
    order = np.argsort(ids, kind="stable")
    ids, rows = ids[order], rows[order]
    if cfg.rope_theta is not None:
        raise InteropError("this feature drafter has its own RoPE base: export writes the target's")
    if list(cfg.target_layers) != sorted(cfg.target_layers):
        raise InteropError(f"target_layers {cfg.target_layers} are not ascending: EAGLE-3 concatenates its features in "
                           "ascending layer order")
    t = {"fc.weight": f32(head.fc.weight[...]).T, "norm.weight": f32(head.norm.weight[...]),
         "layers.0.input_layernorm.weight": f32(head.embed_norm.weight[...]),
         "layers.0.hidden_norm.weight": f32(head.hidden_norm.weight[...]),
         "layers.0.post_attention_layernorm.weight": f32(head.post_attention_layernorm.weight[...]),
         "lm_head.weight": rows}
    for name in LINEARS:
        t[f"{PREFIX}{name}.weight"] = f32(_get(head, _ours(name)).weight[...]).T
    if with_embedding:
        t["embed_tokens.weight"] = f32(target.embed_tokens[...])
    if len(ids) < cfg.vocab_size:
        t["d2t"] = (ids - np.arange(len(ids))).astype(np.int64)
        t2d = np.zeros(cfg.vocab_size, bool)
        t2d[ids] = True
        t["t2d"] = t2d
    return {k: np.ascontiguousarray(v) for k, v in t.items()}, ids


def _get(module, path):
    for p in path:
        module = getattr(module, p)
    return module
