"""The target distribution: temperature, top-k and top-p applied to logits, in the order
transformers applies them (temperature, then top-k, then top-p). Verification rules and plain
sampling share these functions, so "the distribution p" means one thing everywhere.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.typing import Array, Float, Int


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Traced scalars, so changing them never recompiles. Greedy decoding is a static choice
    made by the caller (temperature == 0), not a value here."""
    temperature: Float[Array, ""]
    top_k: Int[Array, ""]  # 0 = off
    top_p: Float[Array, ""]  # 1 = off

    @classmethod
    def make(cls, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> "SamplingParams":
        return cls(jnp.float32(temperature), jnp.int32(top_k), jnp.float32(top_p))


def validate(temperature: float, top_k: int, top_p: float) -> None:
    if not (temperature >= 0):
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if int(top_k) != top_k or top_k < 0:
        raise ValueError(f"top_k must be a non-negative integer, got {top_k}")
    if not (0 < top_p <= 1):
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


def warp(logits_xV: Float[Array, "... V"], params: SamplingParams) -> Float[Array, "... V"]:
    """Log-probabilities of the target distribution; removed tokens get -inf. Without top-k and
    top-p (the default) no sort runs: a `lax.cond` skips the cut, whose vocabulary-sized sort is
    the dearest part of a sampled draft step on CPU (`tools/bench.py`'s draft ms of sampled rows)."""
    x = logits_xV.astype(jnp.float32) / jnp.maximum(params.temperature, 1e-6)
    return jax.lax.cond((params.top_k <= 0) & (params.top_p >= 1.0), lambda x: jax.nn.log_softmax(x, axis=-1),
                        lambda x: _cut(x, params), x)


def _cut(x, params: SamplingParams):
    """log-softmax of temperature-scaled logits after the top-k and top-p cuts."""
    V = x.shape[-1]
    sorted_desc = -jnp.sort(-x, axis=-1)
    # top-k: keep logits >= the k-th largest (ties kept, as transformers does).
    k = jnp.where(params.top_k > 0, jnp.minimum(params.top_k, V), V)
    kth = jnp.take(sorted_desc, k - 1, axis=-1)[..., None]
    x = jnp.where(x >= kth, x, -jnp.inf)
    # top-p: keep the smallest prefix of the sorted distribution whose mass reaches top_p
    # (the token that crosses it included); at least one token always survives.
    sorted_desc = jnp.where(sorted_desc >= kth, sorted_desc, -jnp.inf)
    probs = jax.nn.softmax(sorted_desc, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep_sorted = (mass_before < params.top_p) | (jnp.arange(V) == 0)
    # The cut-off is the smallest kept logit; everything below it goes.
    cutoff = jnp.min(jnp.where(keep_sorted, sorted_desc, jnp.inf), axis=-1, keepdims=True)
    x = jnp.where(x >= cutoff, x, -jnp.inf)
    return jax.nn.log_softmax(x, axis=-1)


def sample(key, logits_xV, params: SamplingParams, greedy: bool) -> Int[Array, "..."]:
    if greedy:
        return jnp.argmax(logits_xV, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, warp(logits_xV, params), axis=-1).astype(jnp.int32)
