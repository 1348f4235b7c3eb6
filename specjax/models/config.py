"""Model configuration: one frozen dataclass, read from and written to Hugging Face `config.json`."""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax.numpy as jnp

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
HYBRID_MODEL_TYPES = ("qwen3_next",)  # read into HybridConfig (specjax.models.hybrid)


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    rope_type: str = "default"  # "default" | "linear" | "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    model_type: str = "llama"
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2 (and Llama with attention_bias)
    o_bias: bool = False  # Llama with attention_bias
    qk_norm: bool = False  # Qwen3: per-head RMSNorm on q and k
    max_position_embeddings: int = 2048
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    dtype: Any = jnp.float32  # parameter and activation dtype (float32 on CPU)

    def __post_init__(self):
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported model_type {self.model_type!r}; "
                             f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if self.rope_scaling.rope_type not in ("default", "linear", "llama3"):
            raise ValueError(f"unsupported rope_type {self.rope_scaling.rope_type!r}")

    @property
    def eos_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        return tuple(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else (self.eos_token_id,)

    # ---- Hugging Face config.json ----
    @classmethod
    def from_hf(cls, hf: dict, *, source: str = "config.json", dtype=jnp.float32) -> "ModelConfig":
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"{source}: unsupported model_type {model_type!r}; "
                             f"supported: {', '.join(SUPPORTED_MODEL_TYPES + HYBRID_MODEL_TYPES)}")
        try:
            common = _hf_common(hf, source)
            theta, rope_type, rope = _hf_rope(hf)
            scaling = RopeScaling(
                rope_type=rope_type,
                factor=float(rope.get("factor", 1.0)),
                low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
                high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
                original_max_position_embeddings=int(rope.get("original_max_position_embeddings", 8192)),
            )
            if hf.get("mlp_bias", False):
                raise ValueError(f"{source}: mlp_bias=true is not supported")
            if hf.get("use_sliding_window", False):
                raise ValueError(f"{source}: sliding-window attention is not supported")
            attention_bias = bool(hf.get("attention_bias", False))
            return cls(
                **common,
                model_type=model_type,
                rope_theta=theta,
                rope_scaling=scaling,
                qkv_bias=(model_type == "qwen2") or attention_bias,
                o_bias=(model_type == "llama") and attention_bias,
                qk_norm=(model_type == "qwen3"),
                dtype=dtype,
            )
        except KeyError as e:
            raise ValueError(f"{source}: missing required field {e.args[0]!r}") from None

    def to_hf(self) -> dict:
        arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
        rope: dict[str, Any] = {"rope_theta": self.rope_theta, "rope_type": self.rope_scaling.rope_type}
        if self.rope_scaling.rope_type in ("linear", "llama3"):
            rope["factor"] = self.rope_scaling.factor
        if self.rope_scaling.rope_type == "llama3":
            rope.update(low_freq_factor=self.rope_scaling.low_freq_factor,
                        high_freq_factor=self.rope_scaling.high_freq_factor,
                        original_max_position_embeddings=self.rope_scaling.original_max_position_embeddings)
        out = {
            "architectures": [arch[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            # Written in both spellings so older and newer transformers read the same RoPE.
            "rope_parameters": rope,
            "rope_theta": self.rope_theta,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "torch_dtype": "float32",
        }
        if self.rope_scaling.rope_type != "default":
            out["rope_scaling"] = rope
        if self.model_type == "llama":
            out["attention_bias"] = self.o_bias
        if self.model_type == "qwen2":
            out["use_sliding_window"] = False
        return out


LAYER_TYPES = ("linear_attention", "full_attention")


@dataclasses.dataclass(frozen=True)
class HybridConfig:
    """A Qwen3-Next-style hybrid decoder (`model_type` "qwen3_next"): Gated DeltaNet layers and
    gated full-attention layers in the order of `layer_types`, each followed by a dense SwiGLU MLP.

    The attention fields (`num_heads`, `num_kv_heads`, `head_dim`, `rope_theta`, `rope_scaling`)
    have the same meaning as in `ModelConfig`, so code that only needs the width, the vocabulary
    and RoPE (drafters sharing the target's embedding) reads either config. Mixture-of-experts
    layers are not supported: a checkpoint is accepted only when every layer is a dense MLP
    (`num_experts` 0, or every layer listed in `mlp_only_layers`).
    """
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int  # full-attention query heads
    num_kv_heads: int
    head_dim: int
    layer_types: tuple[str, ...]  # "linear_attention" | "full_attention", one per layer
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    linear_key_head_dim: int = 16
    linear_value_head_dim: int = 16
    linear_conv_kernel_dim: int = 4
    partial_rotary_factor: float = 0.25  # RoPE on the first head_dim * factor dims of q and k
    model_type: str = "qwen3_next"
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()  # "default" only
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v/o projections of the attention layers
    max_position_embeddings: int = 2048
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    dtype: Any = jnp.float32

    def __post_init__(self):
        if self.model_type not in HYBRID_MODEL_TYPES:
            raise ValueError(f"HybridConfig: unsupported model_type {self.model_type!r}")
        if len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        bad = [t for t in self.layer_types if t not in LAYER_TYPES]
        if bad:
            raise ValueError(f"unknown layer type {bad[0]!r}; expected one of {', '.join(LAYER_TYPES)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(f"linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple of "
                             f"linear_num_key_heads ({self.linear_num_key_heads})")
        if self.linear_conv_kernel_dim < 1:
            raise ValueError("linear_conv_kernel_dim must be >= 1")
        if self.rotary_dim % 2:
            raise ValueError(f"head_dim * partial_rotary_factor = {self.rotary_dim} must be even")
        if self.rope_scaling.rope_type != "default":
            raise ValueError(f"qwen3_next: unsupported rope_type {self.rope_scaling.rope_type!r} (default only)")

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return ModelConfig.eos_ids.fget(self)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "full_attention")

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")

    @property
    def conv_dim(self) -> int:
        """Channels of the short convolution: q, k (key heads) and v (value heads), concatenated."""
        return (2 * self.linear_num_key_heads * self.linear_key_head_dim
                + self.linear_num_value_heads * self.linear_value_head_dim)

    # ---- Hugging Face config.json ----
    @classmethod
    def from_hf(cls, hf: dict, *, source: str = "config.json", dtype=jnp.float32) -> "HybridConfig":
        if hf.get("model_type") not in HYBRID_MODEL_TYPES:
            raise ValueError(f"{source}: unsupported model_type {hf.get('model_type')!r}")
        try:
            common = _hf_common(hf, source)
            n_layers = common["num_layers"]
            layer_types = hf.get("layer_types")
            if layer_types is None:
                interval = int(hf.get("full_attention_interval", 4))
                layer_types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n_layers)]
            mlp_only = set(hf.get("mlp_only_layers") or [])
            n_experts = int(hf.get("num_experts", 0) or 0)
            step = int(hf.get("decoder_sparse_step", 1) or 1)
            moe = [i for i in range(n_layers) if i not in mlp_only and n_experts > 0 and (i + 1) % step == 0]
            if moe:
                raise ValueError(f"{source}: layers {moe[:4]}{'...' if len(moe) > 4 else ''} are mixture-of-experts "
                                 f"(num_experts={n_experts}); only dense-MLP qwen3_next models are supported "
                                 "(num_experts 0, or every layer in mlp_only_layers)")
            theta, rope_type, rope = _hf_rope(hf)
            if rope_type != "default":
                raise ValueError(f"{source}: rope_type {rope_type!r} is not supported for qwen3_next (default only)")
            factor = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))
            return cls(
                **common,
                layer_types=tuple(layer_types),
                linear_num_key_heads=hf.get("linear_num_key_heads", 16),
                linear_num_value_heads=hf.get("linear_num_value_heads", 32),
                linear_key_head_dim=hf.get("linear_key_head_dim", 128),
                linear_value_head_dim=hf.get("linear_value_head_dim", 128),
                linear_conv_kernel_dim=hf.get("linear_conv_kernel_dim", 4),
                partial_rotary_factor=float(factor),
                rope_theta=theta,
                attention_bias=bool(hf.get("attention_bias", False)),
                dtype=dtype,
            )
        except KeyError as e:
            raise ValueError(f"{source}: missing required field {e.args[0]!r}") from None

    def to_hf(self) -> dict:
        return {
            "architectures": ["Qwen3NextForCausalLM"],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "layer_types": list(self.layer_types),
            "linear_num_key_heads": self.linear_num_key_heads,
            "linear_num_value_heads": self.linear_num_value_heads,
            "linear_key_head_dim": self.linear_key_head_dim,
            "linear_value_head_dim": self.linear_value_head_dim,
            "linear_conv_kernel_dim": self.linear_conv_kernel_dim,
            "num_experts": 0,  # dense MLP in every layer
            "mlp_only_layers": [],
            "decoder_sparse_step": 1,
            "hidden_act": "silu",
            "attention_bias": self.attention_bias,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta,
                                "partial_rotary_factor": self.partial_rotary_factor},
            "rope_theta": self.rope_theta,
            "partial_rotary_factor": self.partial_rotary_factor,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "torch_dtype": "float32",
        }


def _hf_common(hf: dict, source: str) -> dict:
    """The fields every supported config.json shares (KeyError on a missing required one)."""
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{source}: hidden_act {hf['hidden_act']!r} is not supported (silu only)")
    n_heads = hf["num_attention_heads"]
    eos = hf.get("eos_token_id")
    return dict(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=n_heads,
        num_kv_heads=hf.get("num_key_value_heads") or n_heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // n_heads,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
        pad_token_id=hf.get("pad_token_id"),
    )


def _hf_rope(hf: dict) -> tuple[float, str, dict]:
    """(rope_theta, rope_type, the remaining rope parameters), from `rope_parameters` (newer
    transformers) or `rope_scaling` + top-level `rope_theta` (older)."""
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(rope.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    return theta, rope.pop("rope_type", rope.pop("type", "default")), rope


def config_from_hf(hf: dict, *, source: str = "config.json", dtype=jnp.float32) -> "ModelConfig | HybridConfig":
    """The config class a `config.json` calls for: HybridConfig for qwen3_next, else ModelConfig."""
    if hf.get("model_type") in HYBRID_MODEL_TYPES:
        return HybridConfig.from_hf(hf, source=source, dtype=dtype)
    return ModelConfig.from_hf(hf, source=source, dtype=dtype)


def read_config(path: str, dtype=jnp.float32) -> "ModelConfig | HybridConfig":
    file = os.path.join(path, "config.json")
    if not os.path.exists(file):
        raise FileNotFoundError(f"{file}: no config.json in the model directory")
    try:
        with open(file) as f:
            hf = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(hf, dict):
        raise ValueError(f"{file}: not a JSON object")
    return config_from_hf(hf, source=file, dtype=dtype)
