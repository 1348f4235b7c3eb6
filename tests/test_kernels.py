"""Pallas kernels (design §8): interpret-mode results equal the jnp references, the kernels lower
to Triton custom calls for `cuda` on a CPU-only jaxlib, and speculative generation with the tree
attention kernel in the model gives the jnp path's greedy tokens.

Interpret-mode compiles dominate the cost, so the hypothesis sweeps draw the static shapes from a
few configurations (each compiled once: the kernel and its reference in one jitted function) and
everything data-dependent — tree shapes, ragged lengths (0 included), masks, FOLD layouts — freely.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import event, given, settings, strategies as st

from pallas_kernels import ops, reference
from specjax.spec import tree as tree_lib
from specjax.models import transformer
from specjax.models.config import ModelConfig

SWEEP = settings(max_examples=20, deadline=None, derandomize=True, database=None, print_blob=True)
RTOL, ATOL = 1e-5, 2e-6
TRITON = "__gpu$xla.gpu.triton"

def test_pallas_kernels_import_nothing_from_specjax():
    """pallas_kernels is self-contained: specjax depends on it, never the other way round."""
    import subprocess
    import sys
    code = ("import pallas_kernels, pallas_kernels.ops, pallas_kernels.reference, sys; "
            "bad = sorted(m for m in sys.modules if m.startswith('specjax')); assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


# ----------------------------------------------------------------------------- tree attention

# (B, T tree nodes, S scratch slots >= T, H, K, D, capacity C, block_k, num_splits). Capacities are
# not multiples of the key block; G = H / K covers 1, 2 and 4; S > 32 needs two mask words; the
# third has two query blocks (T * G = 96 rows).
TREE_CONFIGS = [
    (2, 16, 16, 4, 4, 64, 75, 16, 1),
    (3, 12, 20, 8, 4, 128, 100, 32, 2),
    (2, 24, 40, 8, 2, 64, 131, 32, 3),
]
TREE_KINDS = ("chain", "wide", "deep", "random")


def _parents(kind: str, n: int, rng) -> np.ndarray:
    """Parent index of each of n nodes in topological order (node 0 the root)."""
    p = np.full(n, -1, np.int32)
    for i in range(1, n):
        if kind == "chain":
            p[i] = i - 1
        elif kind == "wide":  # every node a child of the root
            p[i] = 0
        elif kind == "deep":  # two long branches
            p[i] = max(0, i - 2)
        else:
            p[i] = rng.integers(0, i)
    return p


def _tree_mask(kind, B, T, S, rng, zero_row):
    """Block mask [B, T, S]: the tree's ancestor mask (some padding nodes) over the last T scratch
    slots; the first S - T slots are earlier scratch blocks (a drafter's tree so far), visible at
    random."""
    parents, valid = [], []
    for b in range(B):
        n = T if b % 2 == 0 else int(rng.integers(1, T + 1))  # a padded tree in odd rows
        parents.append(np.concatenate([_parents(kind, n, rng), -np.ones(T - n, np.int32)]))
        valid.append(np.arange(T) < n)
    parents, valid = np.stack(parents), np.stack(valid)
    depth = np.zeros((B, T), np.int32)
    for i in range(1, T):
        depth[:, i] = np.where(parents[:, i] >= 0, depth[np.arange(B), np.maximum(parents[:, i], 0)] + 1, 0)
    tree = tree_lib.TreeBuffers(tokens=jnp.zeros((B, T), jnp.int32), parents=jnp.asarray(parents),
                                depth=jnp.asarray(depth), valid=jnp.asarray(valid),
                                score=jnp.zeros((B, T)), source=jnp.zeros((B, T), jnp.int8))
    anc = np.asarray(tree_lib.ancestor_mask(tree, max(T - 1, 1)))
    earlier = rng.random((B, T, S - T)) < 0.6
    mask = np.concatenate([earlier & valid[:, :, None], anc], axis=2)
    if zero_row is not None:  # one query that sees no scratch slot at all
        mask[zero_row, T - 1] = False
    return mask


@functools.partial(jax.jit, static_argnames=("block_k", "num_splits"))
def _tree_both(q, k, v, lengths, bits, block_k, num_splits):
    ref = ops.tree_attention(q, k, v, lengths, bits, impl="reference", return_lse=True)
    got = ops.tree_attention(q, k, v, lengths, bits, impl="interpret", return_lse=True, block_k=block_k,
                             num_splits=num_splits)
    return ref, got


def _assert_close(got, ref, what):
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=RTOL, atol=ATOL, err_msg=what)


def _assert_lse(got, ref):
    got, ref = np.asarray(got), np.asarray(ref)
    assert (np.isneginf(got) == np.isneginf(ref)).all()
    fin = np.isfinite(ref)
    np.testing.assert_allclose(got[fin], ref[fin], rtol=RTOL, atol=ATOL, err_msg="lse")


@SWEEP
@given(config=st.sampled_from(TREE_CONFIGS), kind=st.sampled_from(TREE_KINDS),
       seed=st.integers(0, 2**31 - 1), zero_length_row=st.booleans(), empty_query=st.booleans())
def test_tree_attention_matches_reference(config, kind, seed, zero_length_row, empty_query):
    B, T, S, H, K, D, C, block_k, splits = config
    event(f"G={H // K} D={D} splits={splits} {kind}")
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, C - S + 1, B)
    zero_b = int(rng.integers(0, B))
    if zero_length_row:
        lengths[zero_b] = 0
    mask = _tree_mask(kind, B, T, S, rng, zero_row=zero_b if empty_query else None)
    q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((B, T, H, D), (B, C, K, D), (B, C, K, D)))
    bits = ops.pack_mask(jnp.asarray(mask))
    (ref, ref_lse), (got, got_lse) = _tree_both(q, k, v, jnp.asarray(lengths, jnp.int32), bits, block_k, splits)
    _assert_close(got, ref, f"{config} {kind} lengths={lengths}")
    _assert_lse(got_lse, ref_lse)
    if zero_length_row and empty_query:  # a query that sees nothing at all: exactly 0, lse -inf
        assert (np.asarray(got)[zero_b, T - 1] == 0).all() and np.isneginf(np.asarray(got_lse)[zero_b, T - 1]).all()


def test_reference_is_the_models_attention():
    """The reference is `attend` over `kvcache.visible_mask`, the model's own path (here against a
    hand-written mask, with the whole-cache `layer=` form)."""
    rng = np.random.default_rng(1)
    L, B, T, S, H, K, D, C = 2, 2, 3, 5, 4, 2, 16, 12
    q = jnp.asarray(rng.standard_normal((B, T, H, D)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((L, B, C, K, D)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((L, B, C, K, D)), jnp.float32)
    lengths = np.array([4, 0])
    block = rng.random((B, T, S)) < 0.5
    vis = np.zeros((B, T, C), bool)
    for b in range(B):
        vis[b, :, : lengths[b]] = True
        vis[b, :, lengths[b]: lengths[b] + S] = block[b]
    want = transformer.attend(q, k[1], v[1], jnp.asarray(vis))
    got = reference.tree_attention_reference(q, k, v, jnp.asarray(lengths, jnp.int32),
                                             ops.pack_mask(jnp.asarray(block)), layer=1)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_pack_mask_roundtrip():
    rng = np.random.default_rng(0)
    roundtrip = jax.jit(lambda m: (ops.pack_mask(m), ops.unpack_mask(ops.pack_mask(m), m.shape[2])))
    for S in (1, 31, 32, 33, 70):
        mask = rng.random((2, 3, S)) < 0.5
        bits, back = roundtrip(jnp.asarray(mask))
        assert bits.dtype == jnp.int32 and bits.shape == (2, 3, -(-S // 32))
        np.testing.assert_array_equal(np.asarray(back), mask)
        s = np.arange(S)  # bit s % 32 of word s // 32
        words = np.asarray(bits).view(np.uint32)
        np.testing.assert_array_equal((words[:, :, s // 32] >> (s % 32)) & 1, mask)


def test_merge_partial_attentions():
    """Prefix-only plus scratch-only partial attentions (each with its lse, from the kernel) merge
    into the full attention; so do two reference halves of far attention."""
    rng = np.random.default_rng(2)
    B, T, S, H, K, D, C = 3, 6, 6, 4, 2, 64, 40
    lengths = np.array([20, 0, 34])
    q = jnp.asarray(rng.standard_normal((B, T, H, D)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((B, C, K, D)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((B, C, K, D)), jnp.float32)
    mask = rng.random((B, T, S)) < 0.5
    mask[0, 2] = False
    bits = ops.pack_mask(jnp.asarray(mask))
    full = ops.tree_attention(q, k, v, jnp.asarray(lengths, jnp.int32), bits, impl="reference")

    @jax.jit
    def parts(q, k, v, lengths, bits):
        prefix = ops.tree_attention(q, k, v, lengths, jnp.zeros_like(bits), impl="interpret", return_lse=True)
        idx = lengths[:, None] + jnp.arange(S)[None]  # the scratch slots moved to the front
        k_s = jnp.take_along_axis(k, idx[:, :, None, None], axis=1)
        v_s = jnp.take_along_axis(v, idx[:, :, None, None], axis=1)
        scratch = ops.tree_attention(q, k_s, v_s, jnp.zeros_like(lengths), bits, impl="interpret", return_lse=True)
        return prefix, scratch

    (o1, l1), (o2, l2) = parts(q, k, v, jnp.asarray(lengths, jnp.int32), bits)
    assert np.isneginf(np.asarray(l1)[1]).all()  # row 1 has no prefix
    merged, _ = ops.merge_attention(o1, l1, o2, l2)
    _assert_close(merged, full, "merged tree attention")

    # Far attention: keys split into two halves.
    N = 30
    kk = jnp.asarray(rng.standard_normal((B, N, K, D)), jnp.float32)
    vv = jnp.asarray(rng.standard_normal((B, N, K, D)), jnp.float32)
    q_pos = jnp.asarray(rng.integers(10, 30, (B, T)), jnp.int32)
    k_pos = jnp.asarray(rng.integers(0, 30, (B, N)), jnp.int32)
    seg = jnp.asarray(rng.integers(-1, 3, (B, N)), jnp.int32)

    @jax.jit
    def far_halves(q, kk, vv, q_pos, k_pos, seg):
        whole = reference.far_attention_reference(q, kk, vv, q_pos, k_pos, seg, 1.3)
        a, b = ([reference.far_attention_reference(q, kk[:, sl], vv[:, sl], q_pos, k_pos[:, sl], seg[:, sl], 1.3,
                                                   return_lse=True) for sl in (slice(0, 11), slice(11, None))])
        return whole, ops.merge_attention(*a, *b)[0]

    whole, merged = far_halves(q, kk, vv, q_pos, k_pos, seg)
    _assert_close(merged, whole, "merged far attention")


# ----------------------------------------------------------------------------- far attention

# (B, T queries, H, K, D, N keys, block_k, num_splits)
FAR_CONFIGS = [
    (2, 4, 4, 2, 64, 50, 16, 1),
    (1, 8, 4, 4, 128, 77, 32, 2),
    (3, 3, 4, 1, 64, 21, 16, 3),
]


def _fold_layout(N, T, rng, n_sink, window, n_far, shuffle):
    """One row's FOLD keys: sinks at their positions, far keys at one shared position, the local
    window (its last T keys the draft block itself) at true positions, then padding."""
    n_ctx = n_sink + n_far + window
    q_pos = n_ctx - T + np.arange(T)  # the queries are the last T local positions (the draft)
    far_pos = max(n_ctx - 2 * window, 0)  # a fixed distance >= window behind the local window
    k_pos = np.concatenate([np.arange(n_sink), np.full(n_far, far_pos), n_sink + n_far + np.arange(window)])
    seg = np.concatenate([np.full(n_sink, reference.SEG_SINK), np.full(n_far, reference.SEG_FAR),
                          np.full(window, reference.SEG_LOCAL)])
    pad = N - len(k_pos)
    k_pos = np.concatenate([k_pos, rng.integers(0, n_ctx + 5, pad)])  # padding may carry any position
    seg = np.concatenate([seg, np.full(pad, reference.SEG_PAD)])
    if shuffle:
        perm = rng.permutation(N)
        k_pos, seg = k_pos[perm], seg[perm]
    return q_pos, k_pos, seg


@functools.partial(jax.jit, static_argnames=("block_k", "num_splits"))
def _far_both(q, k, v, q_pos, k_pos, seg, beta, inv_freq, block_k, num_splits):
    ref = ops.far_attention(q, k, v, q_pos, k_pos, seg, beta, inv_freq=inv_freq, impl="reference", return_lse=True)
    got = ops.far_attention(q, k, v, q_pos, k_pos, seg, beta, inv_freq=inv_freq, impl="interpret",
                            return_lse=True, block_k=block_k, num_splits=num_splits)
    return ref, got


@SWEEP
@given(config=st.sampled_from(FAR_CONFIGS), seed=st.integers(0, 2**31 - 1), empty_far=st.booleans(),
       shuffle=st.booleans(), random_segments=st.booleans(), lam=st.sampled_from([0.0, 0.3, 1.0]),
       theta=st.sampled_from([10000.0, 1e6]))
def test_far_attention_matches_reference(config, seed, empty_far, shuffle, random_segments, lam, theta):
    B, T, H, K, D, N, block_k, splits = config
    event(f"G={H // K} D={D} splits={splits} empty_far={empty_far} random_segments={random_segments}")
    rng = np.random.default_rng(seed)
    q_pos, k_pos, seg, n_far = [], [], [], []
    for b in range(B):
        window = int(rng.integers(T, max(T + 1, N // 3)))
        n_sink = int(rng.integers(0, 5))
        far = 0 if (empty_far and b == 0) else int(rng.integers(0, N - window - n_sink + 1))
        if b == B - 1 and B > 1 and not empty_far:  # an all-padding row: every query sees nothing
            window, n_sink, far = T, 0, 0
        qp, kp, sg = _fold_layout(N, T, rng, n_sink, window, far, shuffle)
        if b == B - 1 and B > 1 and not empty_far:
            sg[:] = reference.SEG_PAD
        if random_segments and b == 0:
            sg = rng.integers(-1, 3, N)
            kp = rng.integers(0, int(qp.max()) + 10, N)
        q_pos.append(qp), k_pos.append(kp), seg.append(sg), n_far.append(int((sg == reference.SEG_FAR).sum()))
    beta = ops.fold_beta(jnp.asarray(n_far), window=8, lam=lam)
    q = jnp.asarray(rng.standard_normal((B, T, H, D)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((B, N, K, D)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((B, N, K, D)), jnp.float32)
    to = lambda x: jnp.asarray(np.stack(x), jnp.int32)  # noqa: E731
    (ref, ref_lse), (got, got_lse) = _far_both(q, k, v, to(q_pos), to(k_pos), to(seg), beta,
                                                   ops.rope_inv_freq(D, theta), block_k, splits)
    _assert_close(got, ref, f"{config} seed={seed}")
    _assert_lse(got_lse, ref_lse)
    if B > 1 and not empty_far:
        assert (np.asarray(got)[B - 1] == 0).all()


def test_far_attention_definition():
    """The reference's semantics on a hand-made case: RoPE makes logits depend on relative
    positions only, far keys are always visible and sharpened by beta, padding is ignored, and
    fold_beta follows max(1, 1 + lam ln(n_far / W))."""
    rng = np.random.default_rng(3)
    D = 64
    q = jnp.asarray(rng.standard_normal((1, 1, 1, D)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((1, 4, 1, D)), jnp.float32)
    v = jnp.asarray(np.eye(4, D)[None, :, None], jnp.float32)
    seg = jnp.array([[reference.SEG_SINK, reference.SEG_FAR, reference.SEG_LOCAL, reference.SEG_PAD]])
    k_pos = jnp.array([[0, 50, 7, 0]])

    def probs(q_pos, k_pos, beta):
        out = reference.far_attention_reference(q, k, v, jnp.array([[q_pos]]), k_pos, seg, beta)
        return np.asarray(out)[0, 0, 0, :4]

    p = probs(10, k_pos, 1.0)
    assert p[3] == 0 and p[:3].min() > 0 and abs(p.sum() - 1) < 1e-6
    np.testing.assert_allclose(probs(110, k_pos + 100, 1.0), p, rtol=1e-4, atol=1e-6)  # shift invariance
    assert probs(5, k_pos, 1.0)[2] == 0  # a local key past the query is hidden; the far key (50) is not
    assert probs(5, k_pos, 1.0)[1] > 0
    # beta scales the far logit: compare with a hand computation.
    qr = reference._rope(q, jnp.array([[10]]), reference.rope_inv_freq(D))
    kr = reference._rope(k, k_pos, reference.rope_inv_freq(D))
    logit = np.asarray(jnp.einsum("bthd,bnhd->n", qr, kr)) / np.sqrt(D)
    logit[1] *= 2.0
    want = np.exp(logit[:3] - logit[:3].max())
    np.testing.assert_allclose(probs(10, k_pos, 2.0)[:3], want / want.sum(), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(reference.fold_beta(jnp.array([0, 4, 8, 80]), 8, 0.5)),
                               [1.0, 1.0, 1.0, 1 + 0.5 * np.log(10)], rtol=1e-6)


def test_padded_shapes():
    """Shapes Triton cannot tile directly are padded: a head dim of 80 (tree) and of 16 (far: RoPE
    halves of 8, padded half by half), a cache capacity and a key count below one block."""
    rng = np.random.default_rng(4)
    B, T, H, K = 2, 3, 4, 2
    q80 = jnp.asarray(rng.standard_normal((B, T, H, 80)), jnp.float32)
    k80, v80 = (jnp.asarray(rng.standard_normal((B, 10, K, 80)), jnp.float32) for _ in range(2))
    lengths = jnp.array([7, 2], jnp.int32)
    bits = ops.pack_mask(jnp.asarray(rng.random((B, T, 3)) < 0.5))
    q16 = jnp.asarray(rng.standard_normal((B, T, H, 16)), jnp.float32)
    k16, v16 = (jnp.asarray(rng.standard_normal((B, 5, K, 16)), jnp.float32) for _ in range(2))
    q_pos = jnp.asarray(rng.integers(0, 9, (B, T)), jnp.int32)
    k_pos = jnp.asarray(rng.integers(0, 9, (B, 5)), jnp.int32)
    seg = jnp.asarray(rng.integers(-1, 3, (B, 5)), jnp.int32)

    @jax.jit
    def both(tree_args, far_args):
        return ([ops.tree_attention(*tree_args, impl=impl) for impl in ("reference", "interpret")]
                + [ops.far_attention(*far_args, 1.4, impl=impl) for impl in ("reference", "interpret")])

    tree_ref, tree_got, far_ref, far_got = both((q80, k80, v80, lengths, bits), (q16, k16, v16, q_pos, k_pos, seg))
    _assert_close(tree_got, tree_ref, "tree D=80, C=10")
    _assert_close(far_got, far_ref, "far D=16, N=5")


# ----------------------------------------------------------------------------- lowering for cuda

def _lower_cuda(f, *args):
    """Lowers f for `cuda` on this (CPU) machine; returns the StableHLO text and the Triton
    modules the Pallas lowering produced (each verified)."""
    from jax._src.pallas.triton import pallas_call_registration as reg

    modules, original = [], reg.lowering.lower_jaxpr_to_triton_module

    def capture(*a, **kw):
        result = original(*a, **kw)
        modules.append(result.module)
        return result

    reg.lowering.lower_jaxpr_to_triton_module = capture
    try:
        lowered = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
    finally:
        reg.lowering.lower_jaxpr_to_triton_module = original
    for m in modules:
        with m.context:
            assert m.operation.verify()
    return lowered.as_text(), modules


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_tree_attention_lowers_to_triton(dtype):
    L, B, T, H, K, D, C, S = 2, 2, 13, 8, 2, 128, 1000, 20
    f = functools.partial(ops.tree_attention, layer=1, impl="pallas", return_lse=True)
    args = (jnp.zeros((B, T, H, D), dtype), jnp.zeros((L, B, C, K, D), dtype), jnp.zeros((L, B, C, K, D), dtype),
            jnp.zeros((B,), jnp.int32), jnp.zeros((B, T, -(-S // 32)), jnp.int32))
    text, modules = _lower_cuda(f, *args)
    assert TRITON in text and "tt.dot" in str(modules[0])
    assert "mosaic" not in text.lower()


def test_far_attention_lowers_to_triton():
    B, T, H, K, D, N = 1, 4, 4, 1, 64, 300
    f = functools.partial(ops.far_attention, impl="pallas")
    args = (jnp.zeros((B, T, H, D)), jnp.zeros((B, N, K, D)), jnp.zeros((B, N, K, D)),
            jnp.zeros((B, T), jnp.int32), jnp.zeros((B, N), jnp.int32), jnp.zeros((B, N), jnp.int32), 1.5)
    text, modules = _lower_cuda(f, *args)
    assert TRITON in text and "cos" in str(modules[0]) and "tt.dot" in str(modules[0])


def test_model_forward_lowers_to_triton():
    cfg = ModelConfig(vocab_size=48, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16)
    model = transformer.set_attention_impl(transformer.init_model(cfg), "pallas")
    cache = transformer.init_cache(model, 2, 40)

    def f(tokens, lengths, cache):
        return transformer.prefill(model, tokens, lengths, cache).logits

    text, modules = _lower_cuda(f, jnp.zeros((2, 8), jnp.int32), jnp.array([8, 5]), cache)
    assert text.count(TRITON) == cfg.num_layers and len(modules) == cfg.num_layers


# ----------------------------------------------------------------------------- in the model

def test_set_attention_impl():
    cfg = ModelConfig(vocab_size=16, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=16)
    model = transformer.init_model(cfg)
    with pytest.raises(ValueError, match="unknown attention impl"):
        transformer.set_attention_impl(model, "triton")
    with pytest.raises(ValueError, match="unknown attention impl"):
        ops.tree_attention(None, None, None, None, None, impl="cuda")
    assert transformer.set_attention_impl(model, "interpret") is model
    from specjax.models import attention
    assert transformer.model_attention(model) == attention.KernelAttention("interpret")  # one mechanism
    jaxpr = str(jax.make_jaxpr(lambda t: transformer.prefill(model, t, jnp.array([3]),
                                                             transformer.init_cache(model, 1, 8)).logits)(
        jnp.zeros((1, 3), jnp.int32)))
    assert "pallas_call" in jaxpr


def test_speculative_greedy_exact_with_kernel():
    """specjax.generate with an LM drafter, both models on the tree-attention kernel (interpret
    mode: the target's tree verification, the drafter's depth-by-depth expansion with earlier
    scratch blocks visible, both prefills and commits), gives the jnp path's tokens exactly."""
    import specjax
    from specjax.drafters import LMDrafter

    V = 48
    cfg = ModelConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, max_position_embeddings=512)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, V, 7).tolist(), rng.integers(0, V, 19).tolist()]

    def run(impl):
        target = transformer.set_attention_impl(transformer.init_model(cfg, seed=0), impl)
        # The target with noise on every weight: it agrees often but not always.
        draft = transformer.set_attention_impl(transformer.init_model(cfg, seed=0), impl)
        state = nnx.state(draft, nnx.Param)
        leaves, treedef = jax.tree.flatten(state)
        keys = jax.random.split(jax.random.key(9), len(leaves))
        nnx.update(draft, jax.tree.unflatten(treedef, [x + 0.1 * jnp.std(x) * jax.random.normal(k, x.shape)
                                                       for x, k in zip(leaves, keys)]))
        return specjax.generate(target, prompts, max_new_tokens=12, drafters=[LMDrafter(draft)], tree="chain=3")

    ref, got = run("jnp"), run("interpret")
    assert (ref.lengths == 12).all()
    np.testing.assert_array_equal(got.tokens, ref.tokens)
    np.testing.assert_array_equal(got.lengths, ref.lengths)
    np.testing.assert_array_equal(got.stats["accepted"], ref.stats["accepted"])
    assert 0 < ref.stats["accepted"].sum() < 3 * ref.stats["rounds"].sum()  # partial acceptance


# ----------------------------------------------------------------------------- hybrid targets

def _hybrid_model(impl):
    from specjax.models import hybrid
    from specjax.models.config import HybridConfig
    cfg = HybridConfig(vocab_size=40, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=2,
                       num_kv_heads=1, head_dim=16, layer_types=("linear_attention", "full_attention"),
                       linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8,
                       linear_value_head_dim=8, partial_rotary_factor=0.5)
    return transformer.set_attention_impl(hybrid.init_model(cfg, seed=3), impl)


def test_hybrid_attention_layers_use_the_kernel():
    """A hybrid target's gated-attention layers run on the tree-attention kernel (interpret mode
    here) with the same prefill and tree-verification logits as jnp attention, and lower to
    Triton for `cuda`."""
    from specjax.models import hybrid

    prompts, lengths = jnp.array([[5, 7, 9, 11, 3, 2], [4, 8, 1, 0, 0, 0]]), jnp.array([6, 3])
    parents_N, depth_N, _ = tree_lib.StaticTree(((0,), (1,), (0, 0), (0, 1), (1, 0))).layout()
    B, N = 2, len(parents_N)
    tree = tree_lib.TreeBuffers(
        tokens=jnp.broadcast_to(jnp.arange(N, dtype=jnp.int32) + 10, (B, N)),
        parents=jnp.broadcast_to(jnp.asarray(parents_N), (B, N)), depth=jnp.broadcast_to(jnp.asarray(depth_N), (B, N)),
        valid=jnp.ones((B, N), bool), score=jnp.zeros((B, N)), source=jnp.zeros((B, N), jnp.int8))

    @nnx.jit  # one compiled program each: eager dispatch of the interpret-mode kernel is slow
    def run(model):
        out = hybrid.prefill(model, prompts, lengths, hybrid.init_cache(model, B, 24))
        verify = hybrid.forward(model, tree.tokens, tree_lib.positions(tree, out.cache.length), out.cache,
                                tree_lib.ancestor_mask(tree, 2), parents=tree.parents)
        return out.logits, verify.logits

    ref, got = run(_hybrid_model("jnp")), run(_hybrid_model("interpret"))
    for r, g in zip(ref, got):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=2e-5, atol=2e-5)
    model = _hybrid_model("pallas")
    text, modules = _lower_cuda(lambda t, n: hybrid.prefill(model, t, n, hybrid.init_cache(model, 2, 24)).logits,
                                prompts, lengths)
    assert text.count(TRITON) == 1 and len(modules) == 1  # one full-attention layer
