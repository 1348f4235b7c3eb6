"""What every published layout shares: reading a Hugging Face directory (config, safetensors or a
`pytorch_model.bin` read with `torch.load(weights_only=True)`: data, never code), the decoder-layer
config with the defaults its `model_type` leaves out, and the checks against our target that turn a
foreign or broken checkpoint into one line naming the field, before anything is traced.

Layer numbering (design §16): our `target_layers` and z-lab / DeepSpec `target_layer_ids` count the
*output* of decoder layer i; speculators, vLLM and EAGLE-3 count the residual stream *entering*
layer k (0 = the embedding output). So aux id = output id + 1.
"""
from __future__ import annotations

import json
import os

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import load_file

from specjax.io.checkpoint import weights_sha256


class InteropError(ValueError):
    """A published checkpoint we cannot load as it is (one line: the file, the field, why)."""


CONFIG = "config.json"

# The fields a transformers config leaves out when they equal its class defaults (speculators
# writes its decoder config with `to_diff_dict`): LlamaConfig's and Qwen3Config's defaults.
LAYER_DEFAULTS = {
    "llama": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": None, "head_dim": None, "rms_norm_eps": 1e-6,
              "rope_theta": 10000.0, "attention_bias": False, "mlp_bias": False, "hidden_act": "silu"},
    "qwen3": {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 128, "rms_norm_eps": 1e-6,
              "rope_theta": 10000.0, "attention_bias": False, "mlp_bias": False, "hidden_act": "silu"},
}


def read_json(path: str) -> dict:
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        raise InteropError(f"{path}: unreadable ({e})") from None
    if not isinstance(raw, dict):
        raise InteropError(f"{path}: not a JSON object")
    return raw


def read_config(path: str) -> dict | None:
    """The directory's config.json, or None when it has none."""
    f = os.path.join(path, CONFIG)
    return read_json(f) if os.path.isfile(f) else None


def weight_files(path: str) -> list[str]:
    """The safetensors files of a directory (one, or the shards its index lists), else pytorch_model.bin."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        shards = sorted(set(read_json(index).get("weight_map", {}).values()))
        return [os.path.join(path, s) for s in shards]
    for name in ("model.safetensors", "pytorch_model.bin"):
        if os.path.isfile(os.path.join(path, name)):
            return [os.path.join(path, name)]
    raise InteropError(f"{path}: no model.safetensors or pytorch_model.bin")


def tensor_names(path: str) -> set[str]:
    """The tensor names of a directory's safetensors (the header only; empty for a .bin)."""
    names: set[str] = set()
    for f in weight_files(path):
        if f.endswith(".safetensors"):
            try:
                with safe_open(f, "numpy") as st:
                    names.update(st.keys())
            except (SafetensorError, OSError) as e:
                raise InteropError(f"{f}: corrupt safetensors file ({e})") from None
    return names


def read_tensors(path: str) -> dict[str, np.ndarray]:
    """Every tensor of the directory as float32 numpy (bool and integer buffers keep their type)."""
    out: dict[str, np.ndarray] = {}
    for f in weight_files(path):
        if f.endswith(".safetensors"):
            try:
                raw = load_file(f)
            except (SafetensorError, OSError, ValueError) as e:
                raise InteropError(f"{f}: corrupt safetensors file ({e})") from None
        else:
            raw = _read_bin(f)
        out.update({k: (v if v.dtype.kind in "biu" else v.astype(np.float32)) for k, v in raw.items()})
    return out


def _read_bin(f: str) -> dict[str, np.ndarray]:
    try:
        import torch  # optional (the `hf` extra): only a .bin checkpoint needs it
    except ImportError:
        raise InteropError(f"{f}: a pytorch_model.bin needs torch (pip install 'specjax[hf]'), or convert it to "
                           "safetensors") from None
    try:
        sd = torch.load(f, map_location="cpu", weights_only=True)  # tensors only: a checkpoint is data, never code
    except Exception as e:  # noqa: BLE001 - torch raises many kinds for a bad file
        raise InteropError(f"{f}: unreadable as a weights-only torch checkpoint ({type(e).__name__}: {e})") from None
    out = {}
    for k, v in sd.items():
        if not isinstance(v, torch.Tensor):
            raise InteropError(f"{f}: entry {k!r} is not a tensor")
        out[k] = (v.float() if v.is_floating_point() else v).numpy()
    return out


def layer_config(raw: dict, where: str, default_type: str = "llama") -> dict:
    """A decoder-layer config with its class's defaults filled in (`LAYER_DEFAULTS`), the RoPE read
    from `rope_parameters` (transformers 5) or `rope_theta` / `rope_scaling` (4.x) into `rope_theta`
    and `rope` (its type and factors); refuses what our layers do not build: biases, another activation."""
    mt = raw.get("model_type", default_type)
    if mt not in LAYER_DEFAULTS:
        raise InteropError(f"{where}: model_type {mt!r}: the drafter's layers are built for {sorted(LAYER_DEFAULTS)}")
    c = {**LAYER_DEFAULTS[mt], **{k: v for k, v in raw.items() if v is not None or k not in LAYER_DEFAULTS[mt]}}
    c["model_type"] = mt
    if c["num_key_value_heads"] is None:
        c["num_key_value_heads"] = c["num_attention_heads"]
    if c["head_dim"] is None:
        c["head_dim"] = c["hidden_size"] // c["num_attention_heads"]
    rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    rope["rope_type"] = rope.get("rope_type", rope.pop("type", "default"))
    c["rope_theta"] = float(rope.get("rope_theta", c.get("rope_theta") or 10000.0))
    c["rope"] = rope
    for key in ("attention_bias", "mlp_bias"):
        if c.get(key):
            raise InteropError(f"{where}: {key}: true: the drafter's layers have no biases")
    if c.get("hidden_act", "silu") != "silu":
        raise InteropError(f"{where}: hidden_act {c['hidden_act']!r}: the drafter's MLP is SwiGLU (silu)")
    return c


def same_rope_as_target(layer: dict, target) -> bool:
    """Whether the drafter's RoPE is the target's (then the drafter uses the target's, scaling included)."""
    tc, rope = target.config, layer["rope"]
    if rope["rope_type"] != tc.rope_scaling.rope_type or float(layer["rope_theta"]) != float(tc.rope_theta):
        return False
    if rope["rope_type"] == "default":
        return True
    sc = tc.rope_scaling
    return all(abs(float(rope.get(k, d)) - float(getattr(sc, k))) < 1e-9 for k, d in (
        ("factor", 1.0), ("low_freq_factor", 1.0), ("high_freq_factor", 4.0)))


def own_rope_theta(layer: dict, target, where: str) -> float | None:
    """None when the drafter's RoPE is the target's; its own base when it is a plain RoPE of another
    base; refused otherwise (a scaled RoPE other than the target's is not built)."""
    if same_rope_as_target(layer, target):
        return None
    if layer["rope"]["rope_type"] != "default":
        raise InteropError(f"{where}: rope type {layer['rope']['rope_type']!r} differs from the target's RoPE: a drafter's "
                           "own RoPE is built for the 'default' type only")
    return float(layer["rope_theta"])


def check_target(where: str, *, hidden_size: int, vocab_size: int, layers: tuple[int, ...], target,
                 num_target_layers: int | None = None) -> None:
    """The drafter was made for a target of this width and vocabulary, reading layers it has. Our
    ids are outputs of layers 0 .. L-2: the last one (id L-1) is taken after the final norm by the
    published code, before it by ours; an id < 0 (the embedding) is not read."""
    tc = target.config
    if hidden_size != tc.hidden_size:
        raise InteropError(f"{where}: hidden_size {hidden_size}, the target's is {tc.hidden_size}: a drafter for another target")
    if vocab_size != tc.vocab_size:
        raise InteropError(f"{where}: vocab_size {vocab_size}, the target's is {tc.vocab_size}: a drafter for another target")
    if num_target_layers is not None and int(num_target_layers) != tc.num_layers:
        raise InteropError(f"{where}: num_target_layers {num_target_layers}, the target has {tc.num_layers}: a drafter "
                           "for another target")
    bad = [i for i in layers if not 0 <= i <= tc.num_layers - 2]
    if bad:
        raise InteropError(f"{where}: target layer ids {list(layers)} (as layer outputs) are out of range for a target of "
                           f"{tc.num_layers} layers: each must be in 0..{tc.num_layers - 2}")


def check_digest(where: str, raw: dict, target_path: str | None) -> None:
    """A checkpoint we exported records the target's weights digest (`specjax.target_sha256`):
    refused when `target_path` holds other weights."""
    want = (raw.get("specjax") or {}).get("target_sha256")
    if want is None or target_path is None:
        return
    got = weights_sha256(target_path)
    if got != want:
        raise InteropError(f"{where}: specjax.target_sha256 {want[:12]}…, but {target_path} holds {got[:12]}…: a drafter "
                           "for other target weights")


def take(tensors: dict, name: str, shape: tuple[int, ...], where: str) -> np.ndarray:
    """The tensor `name`, checked against `shape`: a missing or misshapen tensor is one line."""
    if name not in tensors:
        raise InteropError(f"{where}: missing tensor {name!r}")
    t = tensors[name]
    if tuple(t.shape) != tuple(shape):
        raise InteropError(f"{where}: tensor {name!r} has shape {tuple(t.shape)}, expected {tuple(shape)}")
    return t


def draft_ids_from_d2t(d2t: np.ndarray, t2d: np.ndarray | None, vocab_size: int, where: str) -> np.ndarray:
    """Draft id j is target token j + d2t[j] (offsets, as EAGLE-3 and speculators store them); `t2d`,
    where present, must mark exactly those tokens."""
    ids = np.arange(len(d2t)) + np.asarray(d2t, np.int64)
    if ids.min() < 0 or ids.max() >= vocab_size or np.unique(ids).size != ids.size:
        raise InteropError(f"{where}: d2t maps draft ids outside the target vocabulary (0..{vocab_size - 1}) or twice")
    if t2d is not None:
        if t2d.shape != (vocab_size,) or not np.array_equal(np.flatnonzero(t2d), np.sort(ids)):
            raise InteropError(f"{where}: t2d does not mark the tokens d2t maps to")
    return ids.astype(np.int32)
