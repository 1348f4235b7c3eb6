"""Weight-only storage dtypes for a target: float32 (as loaded), bfloat16, or int8 with a float32
scale per output channel. Activations, norms, attention, the KV cache and the logits stay in the
model's compute dtype (float32 on CPU); only the projections' weights change.

    model = load_model(path, weights="int8")          # = quantize(load_model(path), "int8")

The matmuls (design §17):

- bfloat16: `x` is cast to bfloat16 and the dot accumulates in float32.
- int8: `x` is quantised per row (symmetric absmax / 127), the dot accumulates in int32 and
  the result is rescaled by the row's scale times the weight's channel scale. An integer sum
  does not depend on the order it is taken in. So a row's output is bit-identical however many
  rows share the call. A speculative loop that must equal its own AR loop token for token needs that;
  the rest of the forward must be batch-invariant too: `load_model(..., invariant=None)` selects it by default at bf16 / int8:
  `specjax.models.invariant`'s attention (design §17). The outputs here are `invariant.rounded`.
  (bfloat16 gets the matmul's property from the padding below, on XLA:CPU with oneDNN;
  `tests/test_quant.py` checks it.)

XLA:CPU runs a one-row dot in bfloat16 / int8 through a generic matrix-vector path about 8x slower
than its float32 one, and any dot of two rows or more through oneDNN (AMX / AVX-512 where the CPU
has them; bench/bench_weights_smollm2.md). Its bfloat16 kernel for exactly two rows sums in
another order than for three rows or more (three to 1,024 rows give a row bit-identical results;
two rows differ in the last bits). Greedy decoding at bfloat16 must verify exactly what AR
decodes, so calls of one or two rows are padded to three (`MIN_ROWS`). The padding rows are zeros;
they cost two rows of compute and are sliced off.

It imports only `specjax.models.invariant` (a leaf) from specjax.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.models import invariant

WEIGHT_DTYPES = ("float32", "bfloat16", "int8")
_INT8_MAX = 127.0


def check_weights(weights: str) -> str:
    if weights not in WEIGHT_DTYPES:
        raise ValueError(f"weights={weights!r}: expected one of {', '.join(WEIGHT_DTYPES)}")
    return weights


def quantize_int8(w, axis: int):
    """Symmetric int8 of `w` with one float32 scale per slice along `axis` (the output channel):
    (int8 array, scale with `axis` kept). A zero channel gets scale 1."""
    w = jnp.asarray(w, jnp.float32)
    reduce = tuple(a for a in range(w.ndim) if a != axis % w.ndim)
    amax = jnp.max(jnp.abs(w), axis=reduce, keepdims=True)
    scale = jnp.where(amax > 0, amax / _INT8_MAX, 1.0)
    q = jnp.clip(jnp.round(w / scale), -_INT8_MAX, _INT8_MAX).astype(jnp.int8)
    return q, jnp.squeeze(scale, reduce)


MIN_ROWS = 3  # see the module's note


def _rows(x):
    """x [..., K] as [N, K] with N >= MIN_ROWS (see the module's note), and a function putting a
    result [N', M] back as [..., M]."""
    lead, K = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, K)
    n = x2.shape[0]
    if n < MIN_ROWS:
        x2 = jnp.concatenate([x2, jnp.zeros((MIN_ROWS - n, K), x2.dtype)], axis=0)
    return x2, lambda y: y[:n].reshape(lead + y.shape[-1:])


def matmul(x, w, scale=None, *, transposed: bool = False):
    """x [..., K] times the weight: w [K, M] (or [M, K] with `transposed`). float32 weights take the
    plain dot; bfloat16 / int8 weights the paths above (`scale` [M] for int8). Returns x.dtype
    (float32 for the quantised paths)."""
    contract = (((1,), (1,)) if transposed else ((1,), (0,)), ((), ()))
    if w.dtype == jnp.int8:
        x2, back = _rows(x.astype(jnp.float32))
        amax = jnp.max(jnp.abs(x2), axis=-1, keepdims=True)
        xs = jnp.where(amax > 0, amax / _INT8_MAX, 1.0)
        xq = jnp.clip(jnp.round(x2 / xs), -_INT8_MAX, _INT8_MAX).astype(jnp.int8)
        acc = jax.lax.dot_general(xq, w, contract, preferred_element_type=jnp.int32)
        # rounded: the caller's add (a residual) must not fuse with the rescale into an FMA in one
        # compiled shape and not in another (batch invariance, `specjax.models.invariant`)
        return back(invariant.rounded(acc.astype(jnp.float32) * xs * scale))
    if w.dtype != x.dtype:
        x2, back = _rows(x.astype(w.dtype))
        y = invariant.rounded(jax.lax.dot_general(x2, w, contract, preferred_element_type=jnp.float32))
        return back(y).astype(x.dtype)
    return x @ (w.T if transposed else w)


def value(param):
    """An optional parameter's array (a `scale` slot is None on float32 / bf16 weights)."""
    return None if param is None else param[...]


def rows(table, scale, ids, dtype):
    """Rows `ids` of an [V, E] table stored at any weight dtype, in `dtype` (embedding lookups and
    head rows)."""
    r = jnp.take(table, ids, axis=0)
    if table.dtype == jnp.int8:
        return invariant.rounded(r.astype(jnp.float32) * jnp.take(scale, ids, axis=0)[..., None]).astype(dtype)
    return r.astype(dtype)


def weight_dtype(model) -> str:
    """The storage dtype of a model's projection weights ("float32" / "bfloat16" / "int8")."""
    return str(jnp.dtype(model.embed_tokens[...].dtype)) if hasattr(model, "embed_tokens") else "float32"


def quantize_linears(module, weights: str):
    """Every float32 2-D `weight` of a `Linear` (a module with a `scale` slot) in `module` stored as
    `weights`, in place; returns `module`. Norms and plain `nnx.Param`s stay as they are. A drafter's
    own network at a narrower dtype (`load_drafter(..., weights=)`) goes through here."""
    check_weights(weights)
    if weights == "float32":
        return module
    for _, node in list(nnx.iter_graph(module)):
        if isinstance(node, nnx.Module) and hasattr(node, "scale") and hasattr(node, "weight") \
                and node.weight is not None and node.weight[...].ndim == 2 and node.weight[...].dtype == jnp.float32:
            w, scale = _convert(node.weight[...], weights, axis=1)
            node.weight, node.scale = nnx.Param(w), None if scale is None else nnx.Param(scale)
    return module


def _convert(w, weights: str, axis: int):
    """(stored weight, its scale or None) of a float32 `w` at `weights`."""
    return quantize_int8(w, axis) if weights == "int8" else (w.astype(jnp.bfloat16), None)


def quantize(model, weights: str):
    """`model` (float32 as loaded) with its projection weights stored as `weights`, in place; returns
    it. Every 2-D `weight` of a module that has a `scale` slot (the decoder's `Linear`), the
    embedding and an untied LM head are converted; norms, convolutions and the gated delta rule's
    vectors stay as they are."""
    check_weights(weights)
    if weights == "float32":
        return model
    if weight_dtype(model) != "float32":
        raise ValueError(f"quantize: the model's weights are already {weight_dtype(model)}; load it again "
                         "in float32 to convert to another dtype")
    quantize_linears(model, weights)
    e, scale = _convert(model.embed_tokens[...], weights, axis=0)
    model.embed_tokens, model.embed_scale = nnx.Param(e), None if scale is None else nnx.Param(scale)
    return model
