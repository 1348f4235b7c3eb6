"""Batch-invariant numerics (`specjax.models.invariant`): a query's result has the same bits decoded alone
or verified in any block or tree. What makes greedy speculative decoding at bfloat16 / int8 weights
equal its own AR loop token for token (design §17)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import tiny_target
from specjax.models import attention as attention_lib, invariant
from specjax.models import family, quant, transformer

VOCAB = 48


def test_ordered_sum_and_rms_normalize_are_row_invariant():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(20, 100)), jnp.float32)
    np.testing.assert_allclose(np.asarray(invariant.ordered_sum(x, -1))[:, 0], np.asarray(x).sum(-1), rtol=1e-5, atol=1e-5)
    f = jax.jit(lambda a: invariant.rms_normalize(a, 1e-6))
    full = np.asarray(f(x))
    for n in range(1, 20):  # XLA:CPU's own reduction changes order from 8 rows on
        np.testing.assert_array_equal(np.asarray(f(x[:n])), full[:n])
    t = np.linspace(-90.0, 10.0, 1001).astype(np.float32)
    e = np.asarray(jax.jit(invariant.exp)(jnp.asarray(t)))
    np.testing.assert_allclose(e, np.where(t < -80, 0.0, np.exp(t.astype(np.float64))), rtol=3e-7, atol=1e-30)


def _tree():
    parents = [-1, 0, 0, 1, 1, 2, 3, 5, 7, 6]
    paths = []
    for i in range(len(parents)):
        j, path = i, []
        while j >= 0:
            path.append(j)
            j = parents[j]
        paths.append(path[::-1])
    return parents, paths


def test_invariant_attention_over_a_tree_equals_the_ar_layout():
    """A tree node's attention (its ancestors at their nodes' slots, other branches masked) has the
    bits of the same query over AR's layout (the ancestors at consecutive slots), and is close to
    `attention.attend`."""
    rng = np.random.default_rng(0)
    H, K, D, C, L = 4, 2, 16, 64, 20
    parents, paths = _tree()
    N = len(parents)
    kn, vn = rng.normal(size=(2, N, K, D)).astype(np.float32)
    kp, vp = rng.normal(size=(2, L, K, D)).astype(np.float32)
    q = rng.normal(size=(1, N, H, D)).astype(np.float32)
    kc, vc = np.zeros((2, 1, C, K, D), np.float32)
    kc[0, :L], vc[0, :L], kc[0, L:L + N], vc[0, L:L + N] = kp, vp, kn, vn
    vis = np.zeros((1, N, C), bool)
    vis[:, :, :L] = True
    for i, path in enumerate(paths):
        vis[0, i, [L + j for j in path]] = True
    f = jax.jit(invariant.attend)
    tree = np.asarray(f(q, kc, vc, vis))
    ref = np.asarray(attention_lib.attend(jnp.asarray(q), jnp.asarray(kc), jnp.asarray(vc), jnp.asarray(vis)))
    np.testing.assert_allclose(tree, ref, atol=1e-2)  # q, k, v and the weights quantised; exact sums
    for i, path in enumerate(paths):
        ka, va = np.zeros((2, 1, C, K, D), np.float32)
        ka[0, :L], va[0, :L] = kp, vp
        ka[0, L:L + len(path)], va[0, L:L + len(path)] = kn[path], vn[path]
        visa = np.zeros((1, 1, C), bool)
        visa[0, 0, :L + len(path)] = True
        np.testing.assert_array_equal(np.asarray(f(q[:, i:i + 1], ka, va, visa))[0, 0], tree[0, i])


@pytest.mark.parametrize("weights", ["bfloat16", "int8"])
def test_quantized_tree_verify_equals_ar_bit_for_bit(weights):
    """At a quantised weight dtype, a tree forward's logits at each node are the bits AR decoding
    gives the same path, one token at a time (float32 logits may differ in the last bits)."""
    model = transformer.set_attention_impl(quant.quantize(nnx.clone(tiny_target(VOCAB)), weights), "invariant")
    fam = family(model)
    rng = np.random.default_rng(1)
    P = 13
    prompt = jnp.asarray(rng.integers(0, VOCAB, (1, P)), jnp.int32)
    parents, paths = _tree()
    N = len(parents)
    tok = jnp.asarray(rng.integers(0, VOCAB, (1, N)), jnp.int32)
    mask = np.zeros((1, N, N), bool)
    for i, path in enumerate(paths):
        mask[0, i, path] = True
    depth = jnp.asarray([len(p) - 1 for p in paths])[None]
    c0 = jax.jit(lambda c: fam.prefill(model, prompt, jnp.array([P]), c))(fam.init_cache(model, 1, 64)).cache
    ver = jax.jit(lambda c: fam.forward(model, tok, P + depth, c, jnp.asarray(mask)))(c0)
    step = jax.jit(lambda t, c: fam.decode_step(model, t, c))
    for i, path in enumerate(paths):
        c = c0
        for j in path:
            out = step(tok[:, j], c)
            c = out.cache
        np.testing.assert_array_equal(np.asarray(out.logits[0, 0]), np.asarray(ver.logits[0, i]), err_msg=f"node {i}")


def test_invariant_attention_refuses_a_cache_too_long_to_sum_exactly():
    q = jnp.zeros((1, 1, 2, 4))
    kv = jax.ShapeDtypeStruct((1, 70000, 1, 4), jnp.float32)
    with pytest.raises(ValueError, match="at most 66052 cache slots"):
        jax.eval_shape(invariant.attend, q, kv, kv, jax.ShapeDtypeStruct((1, 1, 70000), jnp.bool_))
