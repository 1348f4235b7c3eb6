"""Hugging Face format I/O without torch: `config.json`, `model.safetensors` (or a sharded
`model.safetensors.index.json`) and `tokenizer.json`.

Every failure names the file and the problem: an unsupported model type, a missing tensor, a
tensor of the wrong shape, a corrupt file.
"""
from __future__ import annotations

import hashlib
import json
import os
import re

import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open
from safetensors.numpy import load_file, save, save_file
from tokenizers import Tokenizer

from specjax.io.gguf import build_tokenizer, read_gguf, read_metadata
from specjax.models.config import HybridConfig, ModelConfig, read_config
from specjax.models import quant, transformer
from specjax.models.hybrid import HybridModel
from specjax.models.transformer import Model


def hf_tensor_names(cfg: ModelConfig | HybridConfig) -> dict[str, tuple[tuple[str, ...], tuple[int, ...], bool]]:
    """HF tensor name -> (path of the nnx.Param in the model, HF shape, stored transposed?).

    A tensor that is not transposed is reshaped to the parameter's shape (HF's Conv1d weight
    [C, 1, K] is our [C, K])."""
    E, V = cfg.hidden_size, cfg.vocab_size
    names: dict = {"model.embed_tokens.weight": (("embed_tokens",), (V, E), False),
                   "model.norm.weight": (("norm", "weight"), (E,), False)}
    if not cfg.tie_word_embeddings:
        names["lm_head.weight"] = (("lm_head", "weight"), (V, E), True)
    hybrid = isinstance(cfg, HybridConfig)
    for i in range(cfg.num_layers):
        kind = cfg.layer_types[i] if hybrid else "full_attention"
        names.update(layer_tensor_names(cfg, kind, f"model.layers.{i}.", ("layers", i)))
    return names


def layer_tensor_names(cfg: ModelConfig | HybridConfig, kind: str, prefix: str, path: tuple) -> dict:
    """One decoder layer's tensors (`hf_tensor_names`' entries) under the HF `prefix` and the nnx `path`:
    a dense layer, or a hybrid layer of `kind` ("linear_attention": Gated DeltaNet, "full_attention":
    gated attention; dense MLP either way)."""
    E, F = cfg.hidden_size, cfg.intermediate_size
    H, K, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    p, L = prefix, path
    names: dict = {p + "input_layernorm.weight": (L + ("input_layernorm", "weight"), (E,), False),
                   p + "post_attention_layernorm.weight": (L + ("post_attention_layernorm", "weight"), (E,), False)}
    hybrid = isinstance(cfg, HybridConfig)
    if kind == "linear_attention":
        Hk, Hv, dk, dv = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
        a, A = p + "linear_attn.", L + ("linear_attn",)
        names[a + "in_proj_qkvz.weight"] = (A + ("in_proj_qkvz", "weight"), (2 * Hk * dk + 2 * Hv * dv, E), True)
        names[a + "in_proj_ba.weight"] = (A + ("in_proj_ba", "weight"), (2 * Hv, E), True)
        names[a + "conv1d.weight"] = (A + ("conv1d", "weight"), (cfg.conv_dim, 1, cfg.linear_conv_kernel_dim), False)
        names[a + "dt_bias"] = (A + ("dt_bias",), (Hv,), False)
        names[a + "A_log"] = (A + ("A_log",), (Hv,), False)
        names[a + "norm.weight"] = (A + ("norm", "weight"), (dv,), False)
        names[a + "out_proj.weight"] = (A + ("out_proj", "weight"), (E, Hv * dv), True)
    else:
        a, A = p + "self_attn.", L + ("self_attn",)
        q_out = 2 * H * D if hybrid else H * D  # the hybrid's query carries its output gate
        for proj, d_out, d_in in (("q_proj", q_out, E), ("k_proj", K * D, E), ("v_proj", K * D, E), ("o_proj", E, H * D)):
            names[a + f"{proj}.weight"] = (A + (proj, "weight"), (d_out, d_in), True)
            has_bias = cfg.attention_bias if hybrid else (cfg.qkv_bias if proj != "o_proj" else cfg.o_bias)
            if has_bias:
                names[a + f"{proj}.bias"] = (A + (proj, "bias"), (d_out,), False)
        if hybrid or cfg.qk_norm:
            names[a + "q_norm.weight"] = (A + ("q_norm", "weight"), (D,), False)
            names[a + "k_norm.weight"] = (A + ("k_norm", "weight"), (D,), False)
    for proj, d_out, d_in in (("gate_proj", F, E), ("up_proj", F, E), ("down_proj", E, F)):
        names[p + f"mlp.{proj}.weight"] = (L + ("mlp", proj, "weight"), (d_out, d_in), True)
    return names


MTP_PREFIX = "mtp."  # Qwen3-Next's multi-token-prediction tensors, beside the model's own


def mtp_tensor_names(cfg: ModelConfig | HybridConfig, num_layers: int) -> dict:
    """An MTP module's tensors in Qwen3-Next's layout (`mtp.fc`, `mtp.pre_fc_norm_embedding`,
    `mtp.pre_fc_norm_hidden`, `mtp.layers.{j}.*` as the family's attention layer, `mtp.norm`), as
    `hf_tensor_names` entries whose paths are the `specjax.drafters.mtp.MTPHead`'s. The dense family
    uses the same names under the same prefix."""
    E = cfg.hidden_size
    names: dict = {"mtp.fc.weight": (("fc", "weight"), (E, 2 * E), True)}
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        names[f"mtp.{norm}.weight"] = ((norm, "weight"), (E,), False)
    for j in range(num_layers):
        names.update(layer_tensor_names(cfg, "full_attention", f"mtp.layers.{j}.", ("layers", j)))
    return names


def mtp_num_layers(tensors) -> int:
    """How many MTP layers a checkpoint's tensor names hold (0: none)."""
    found = {int(m.group(1)) for n in tensors if (m := re.match(r"mtp\.layers\.(\d+)\.", n))}
    return max(found) + 1 if found else 0


def has_weights(path) -> bool:
    """A model directory with weights: `model.safetensors` or a sharded index."""
    return any(os.path.exists(os.path.join(str(path), f)) for f in ("model.safetensors", "model.safetensors.index.json"))


def weights_sha256(path) -> str:
    """sha256 of a model directory's tensors serialised as one `model.safetensors` file, so the
    digest names the weights, not how they are sharded (a resharded export keeps its digest). MTP
    tensors (`mtp.*`) are not the model's: a checkpoint that gains its MTP layer keeps its digest, and
    the drafters trained on it stay valid."""
    single = os.path.join(str(path), "model.safetensors")
    if os.path.exists(single):
        with safe_open(single, "numpy") as f:
            has_mtp = any(k.startswith(MTP_PREFIX) for k in f.keys())
        if not has_mtp:
            with open(single, "rb") as f:
                return hashlib.sha256(f.read()).hexdigest()
    tensors = {k: v for k, v in _read_tensors(str(path)).items() if not k.startswith(MTP_PREFIX)}
    return hashlib.sha256(save(tensors, metadata={"format": "pt"})).hexdigest()


def read_mtp_tensors(path: str) -> dict[str, np.ndarray]:
    """The `mtp.*` tensors of a model directory (empty when it ships none)."""
    return {k: v for k, v in _read_tensors(str(path)).items() if k.startswith(MTP_PREFIX)}


def write_mtp_tensors(path: str, tensors: dict[str, np.ndarray]) -> None:
    """Adds (or replaces) `mtp.*` tensors in a model directory's own safetensors, as Qwen3-Next ships
    them: into `model.safetensors`, or as one more shard listed in the index of a sharded checkpoint
    (`model-mtp.safetensors`). A directory without weights gets a `model.safetensors` of these alone."""
    if any(not k.startswith(MTP_PREFIX) for k in tensors):
        raise ValueError(f"write_mtp_tensors: not MTP tensors: {sorted(k for k in tensors if not k.startswith(MTP_PREFIX))[:3]}")
    os.makedirs(path, exist_ok=True)
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            idx = json.load(f)
        weight_map = {k: v for k, v in idx["weight_map"].items() if not k.startswith(MTP_PREFIX)}
        shard = "model-mtp.safetensors"
        save_file(tensors, os.path.join(path, shard), metadata={"format": "pt"})
        weight_map.update({k: shard for k in tensors})
        idx["weight_map"] = weight_map
        with open(index, "w") as f:
            json.dump(idx, f, indent=2)
        return
    single = os.path.join(path, "model.safetensors")
    kept = {}
    if os.path.exists(single):
        kept = {k: v for k, v in load_file(single).items() if not k.startswith(MTP_PREFIX)}
    save_file({**kept, **tensors}, single, metadata={"format": "pt"})


def _read_tensors(path: str) -> dict[str, np.ndarray]:
    single = os.path.join(path, "model.safetensors")
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(single):
        files = [single]
    elif os.path.exists(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"{index}: corrupt shard index ({e!r})") from None
        files = [os.path.join(path, s) for s in sorted(set(weight_map.values()))]
    else:
        raise FileNotFoundError(f"{path}: neither model.safetensors nor model.safetensors.index.json")
    tensors: dict[str, np.ndarray] = {}
    for file in files:
        if not os.path.exists(file):
            raise FileNotFoundError(f"{file}: shard listed in the index is missing")
        try:
            tensors.update(load_file(file))
        except (SafetensorError, OSError, ValueError) as e:
            raise ValueError(f"{file}: corrupt safetensors file ({e})") from None
    return tensors


def _to_numpy_f32(t: np.ndarray) -> np.ndarray:
    # safetensors.numpy gives bf16 as ml_dtypes.bfloat16; upcast on the host.
    return np.asarray(t).astype(np.float32)


def load_model(path: str, *, dtype=jnp.float32, weights: str = "float32", invariant: bool | None = None) -> Model | HybridModel:
    """Loads a Llama / Qwen2 / Qwen3 (`Model`) or a dense-MLP Qwen3-Next (`HybridModel`)
    checkpoint in Hugging Face format (no torch needed), or a Llama / Qwen2 / Qwen3 GGUF file
    (`path` ending in .gguf: dequantized to `dtype`, see `specjax.io.gguf`).

    `weights`: the projections' storage dtype, "float32" (as stored), "bfloat16" or "int8" (one
    scale per output channel); activations stay in `dtype` (`specjax.models.quant`). Not
    bit-exact with float32: compare a speculative run with AR at the same `weights`.

    `invariant`: the batch-invariant attention (`specjax.models.invariant`; attention impl "invariant").
    With bfloat16 / int8 weights a speculative run then equals AR at the same weights token for
    token, trees included. None (the default): on exactly when `weights` is not float32, so a
    quantised target's speculative output is its own AR output unless `invariant=False` is asked
    for (then the greedy check reports the divergence). It costs: SmolLM2 int8 AR 41.0 against
    49.2 tokens/s (`bench/bench_smollm2_w_int8_invariant_code_b1.md`, design §17).

    Also reads `tokenizer.json` when present and refuses a tokenizer whose vocabulary does not
    fit the model's embedding table. Use `load_tokenizer(path)` to get the tokenizer itself.
    """
    quant.check_weights(weights)
    invariant = weights != "float32" if invariant is None else invariant
    if weights != "float32" and jnp.dtype(dtype) != jnp.float32:
        raise ValueError(f"weights={weights!r} needs dtype float32 activations, not {jnp.dtype(dtype).name}")
    if str(path).endswith(".gguf"):
        ckpt = read_gguf(str(path))
        cfg = ModelConfig.from_hf(ckpt.config, source=str(path), dtype=dtype)
        return _invariant(quant.quantize(_model_from_tensors(cfg, ckpt.tensors, str(path), dtype), weights), invariant)
    cfg = read_config(path, dtype=dtype)
    model = _model_from_tensors(cfg, _read_tensors(path), os.path.join(path, "model.safetensors"), dtype)
    tok_file = os.path.join(path, "tokenizer.json")
    if os.path.exists(tok_file):
        tok = load_tokenizer(path)
        if tok.get_vocab_size() > cfg.vocab_size:
            raise ValueError(f"{tok_file}: tokenizer has {tok.get_vocab_size()} tokens but the model's "
                             f"vocabulary is {cfg.vocab_size}")
    return _invariant(quant.quantize(model, weights), invariant)


def _invariant(model, invariant: bool):
    return transformer.set_attention_impl(model, "invariant") if invariant else model


def _model_from_tensors(cfg, tensors: dict, where: str, dtype) -> Model | HybridModel:
    """The model of `cfg` with its parameters set from HF-named `tensors` (names and shapes checked)."""
    model_cls = HybridModel if isinstance(cfg, HybridConfig) else Model
    model = nnx.eval_shape(lambda: model_cls(cfg, nnx.Rngs(0)))
    state = nnx.state(model, nnx.Param)
    flat = dict(nnx.to_flat_state(state))
    names = hf_tensor_names(cfg)
    if cfg.tie_word_embeddings and "lm_head.weight" in tensors:
        names_extra = {"lm_head.weight"}  # some exporters write the tied head too; it must match
        if not np.array_equal(tensors["lm_head.weight"], tensors["model.embed_tokens.weight"]):
            raise ValueError(f"{where}: tie_word_embeddings is true but lm_head.weight differs from the embedding")
    else:
        names_extra = set()
    unexpected = set(tensors) - set(names) - names_extra
    unexpected = {n for n in unexpected if not n.endswith("rotary_emb.inv_freq") and not n.startswith("mtp.")}
    if unexpected:
        raise ValueError(f"{where}: unexpected tensors for {cfg.model_type}: {sorted(unexpected)[:5]}")
    for name, (param_path, shape, transposed) in names.items():
        if name not in tensors:
            raise ValueError(f"{where}: missing tensor {name!r}")
        t = tensors[name]
        if tuple(t.shape) != shape:
            raise ValueError(f"{where}: tensor {name!r} has shape {tuple(t.shape)}, expected {shape}")
        arr = _to_numpy_f32(t)
        arr = arr.T if transposed else arr.reshape(flat[param_path].get_value().shape)
        flat[param_path].set_value(jnp.asarray(arr, dtype=dtype))
    nnx.update(model, nnx.from_flat_state(flat))
    return model


def load_tokenizer(path: str) -> Tokenizer:
    if str(path).endswith(".gguf"):
        return build_tokenizer(read_metadata(str(path)), source=str(path))
    file = os.path.join(path, "tokenizer.json")
    if not os.path.exists(file):
        raise FileNotFoundError(f"{file}: no tokenizer.json in the model directory")
    try:
        return Tokenizer.from_file(file)
    except Exception as e:  # tokenizers raises a plain Exception on a bad file
        raise ValueError(f"{file}: corrupt tokenizer ({e})") from None


def save_model(model: Model | HybridModel, path: str, *, tokenizer: Tokenizer | None = None, dtype=None,
               max_shard_bytes: int | None = None) -> None:
    """Writes `config.json` + `model.safetensors` (sharded with an index past `max_shard_bytes`),
    and `tokenizer.json` when given. `dtype` (e.g. jnp.bfloat16) converts on export."""
    cfg = model.config
    os.makedirs(path, exist_ok=True)
    flat = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    tensors = {}
    for name, (param_path, shape, transposed) in hf_tensor_names(cfg).items():
        arr = jnp.asarray(flat[param_path].get_value())
        if dtype is not None:
            arr = arr.astype(dtype)
        arr = np.asarray(arr)
        tensors[name] = np.ascontiguousarray(arr.T if transposed else arr.reshape(shape))
    hf = cfg.to_hf()
    if dtype is not None:
        hf["torch_dtype"] = jnp.dtype(dtype).name
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f, indent=2)
    if max_shard_bytes is None or sum(t.nbytes for t in tensors.values()) <= max_shard_bytes:
        save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    else:
        shards, cur, size = [], {}, 0
        for name, t in tensors.items():
            if cur and size + t.nbytes > max_shard_bytes:
                shards.append(cur)
                cur, size = {}, 0
            cur[name] = t
            size += t.nbytes
        shards.append(cur)
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, os.path.join(path, fname), metadata={"format": "pt"})
            weight_map.update({n: fname for n in shard})
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
                       "weight_map": weight_map}, f, indent=2)
    if tokenizer is not None:
        tokenizer.save(os.path.join(path, "tokenizer.json"))
