"""Logit parity with `transformers`: prefill of a ragged batch, step-by-step decode, a tree block
under an explicit ancestor mask, and `kvcache.commit_path` of an accepted tree path.

The specjax functions run eagerly (no jit) on the model loaded from the HF checkpoint; the
reference is the HF torch model run on each row's unpadded sequence.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax.models import kvcache
from specjax.models import transformer

from conftest import KINDS

TOL = 1e-4
KIND_NAMES = list(KINDS)
# Row lengths go past original_max_position_embeddings (32) of the llama3-scaled model.
PROMPT_LENS = (40, 7, 61)

# Two trees per batch, different per row, nodes in topological order (parent < node).
TREE_PARENTS = [
    [-1, 0, 0, 1, 2, 3, 2],  # two branches from the root, each a chain, one fork at node 2
    [-1, 0, 1, 2, 0, 4, 5],  # two disjoint chains of depth 3
    [-1, 0, 0, 0, 1, 1, 4],  # a wide root
]
# Accepted paths (node ids from the root) and how many nodes of each to keep.
PATHS = [[0, 2, 6, 0], [0, 4, 5, 6], [0, 1, 4, 6]]
N_KEEP = [3, 4, 2]


def _prompts(vocab: int, lens=PROMPT_LENS, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).tolist() for n in lens]


def _pad(prompts):
    P = max(len(p) for p in prompts)
    toks = np.zeros((len(prompts), P), np.int32)
    for b, p in enumerate(prompts):
        toks[b, : len(p)] = p
    return jnp.asarray(toks), jnp.asarray([len(p) for p in prompts], jnp.int32)


def _prefill(tiny, prompts, capacity=96):
    toks, lens = _pad(prompts)
    cache = transformer.init_cache(tiny.jx, len(prompts), capacity)
    return transformer.prefill(tiny.jx, toks, lens, cache)


def _max_diff(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


def _tree_arrays(parents_rows):
    B, N = len(parents_rows), len(parents_rows[0])
    depth = np.zeros((B, N), np.int32)
    anc = np.zeros((B, N, N), bool)  # anc[b, t, u]: u is an ancestor of t or t itself
    for b, parents in enumerate(parents_rows):
        for t, p in enumerate(parents):
            assert p < t
            anc[b, t, t] = True
            if p >= 0:
                depth[b, t] = depth[b, p] + 1
                anc[b, t] |= anc[b, p]
    return depth, anc


def _root_path(parents, node):
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


@pytest.mark.parametrize("kind", KIND_NAMES)
def test_prefill_ragged_batch_matches_hf(tiny_models, kind):
    tiny = tiny_models[kind]
    prompts = _prompts(tiny.vocab, seed=1)
    out = _prefill(tiny, prompts)
    np.testing.assert_array_equal(np.asarray(out.cache.length), [len(p) for p in prompts])
    logits = np.asarray(out.logits)
    for b, p in enumerate(prompts):
        ref = tiny.hf_logits(p)
        assert ref.shape == (len(p), tiny.vocab)
        d = _max_diff(logits[b, : len(p)], ref)
        assert d <= TOL, f"{kind} row {b}: prefill logits differ from transformers by {d:.2e}"
        assert np.all(np.isfinite(logits[b, : len(p)]))


@pytest.mark.parametrize("kind", KIND_NAMES)
def test_decode_steps_match_hf(tiny_models, kind):
    tiny = tiny_models[kind]
    prompts = _prompts(tiny.vocab, seed=2)
    out = _prefill(tiny, prompts)
    cache = out.cache
    rng = np.random.default_rng(3)
    seqs = [list(p) for p in prompts]
    for step in range(6):
        nxt = rng.integers(0, tiny.vocab, len(prompts))
        out = transformer.decode_step(tiny.jx, jnp.asarray(nxt, jnp.int32), cache)
        cache = out.cache
        assert out.logits.shape == (len(prompts), 1, tiny.vocab)
        for b in range(len(prompts)):
            seqs[b].append(int(nxt[b]))
            d = _max_diff(out.logits[b, 0], tiny.hf_last(seqs[b]))
            assert d <= TOL, f"{kind} row {b} decode step {step}: logits differ by {d:.2e}"
        np.testing.assert_array_equal(np.asarray(cache.length), [len(s) for s in seqs])


def test_llama3_rope_scaling_matters(tiny_models, tmp_path):
    """The llama3-scaled checkpoint must not be matched by plain RoPE: otherwise the parity test
    above would not be testing the scaling at all."""
    tiny = tiny_models["llama3rope"]
    cfg = tiny.jx.config
    assert cfg.rope_scaling.rope_type == "llama3"
    assert cfg.rope_scaling.factor == 8.0 and cfg.rope_scaling.original_max_position_embeddings == 32
    plain = str(tmp_path / "plain")
    shutil.copytree(tiny.path, plain)
    with open(os.path.join(plain, "config.json")) as f:
        hf = json.load(f)
    hf.pop("rope_scaling", None)
    hf["rope_parameters"] = {"rope_type": "default", "rope_theta": hf.get("rope_theta", 10000.0)}
    with open(os.path.join(plain, "config.json"), "w") as f:
        json.dump(hf, f)
    unscaled = specjax.load_model(plain)
    assert unscaled.config.rope_scaling.rope_type == "default"
    prompts = _prompts(tiny.vocab, seed=4)  # the shapes of the other tests: no new compiles
    a = _prefill(tiny, prompts).logits[2, : PROMPT_LENS[2]]
    b = _prefill(dataclasses.replace(tiny, jx=unscaled), prompts).logits[2, : PROMPT_LENS[2]]
    assert _max_diff(a, b) > 1e-2


@pytest.mark.parametrize("kind", ["llama3rope", "qwen2", "qwen3"])
def test_tree_block_matches_hf_on_every_path(tiny_models, kind):
    """A block of tree nodes with an ancestor mask and positions `length + depth` gives, at every
    node, the logits of HF on prompt + root-to-node path."""
    tiny = tiny_models[kind]
    prompts = _prompts(tiny.vocab, seed=5)
    cache = _prefill(tiny, prompts).cache
    depth, anc = _tree_arrays(TREE_PARENTS)
    B, N = depth.shape
    tree_tokens = np.random.default_rng(6).integers(0, tiny.vocab, (B, N)).astype(np.int32)
    positions = np.asarray(cache.length)[:, None] + depth
    out = transformer.forward(tiny.jx, jnp.asarray(tree_tokens), jnp.asarray(positions), cache, jnp.asarray(anc))
    # forward writes K/V but commits nothing
    np.testing.assert_array_equal(np.asarray(out.cache.length), np.asarray(cache.length))
    for b in range(B):
        for node in range(N):
            path = _root_path(TREE_PARENTS[b], node)
            seq = prompts[b] + tree_tokens[b, path].tolist()
            d = _max_diff(out.logits[b, node], tiny.hf_last(seq))
            assert d <= TOL, f"{kind} row {b} node {node} (path {path}): logits differ by {d:.2e}"


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_commit_path_then_decode_matches_hf(tiny_models, kind):
    """After a tree forward, commit_path keeps the chosen path (a different one and a different
    length per row) and the next decode steps see exactly prompt + path."""
    tiny = tiny_models[kind]
    prompts = _prompts(tiny.vocab, seed=7)
    cache = _prefill(tiny, prompts).cache
    depth, anc = _tree_arrays(TREE_PARENTS)
    B, N = depth.shape
    rng = np.random.default_rng(8)
    tree_tokens = rng.integers(0, tiny.vocab, (B, N)).astype(np.int32)
    positions = np.asarray(cache.length)[:, None] + depth
    out = transformer.forward(tiny.jx, jnp.asarray(tree_tokens), jnp.asarray(positions), cache, jnp.asarray(anc))
    for b in range(B):  # the chosen paths are real root-to-node paths
        kept = PATHS[b][: N_KEEP[b]]
        assert kept == _root_path(TREE_PARENTS[b], kept[-1])
    cache = kvcache.commit_path(out.cache, jnp.asarray(PATHS, jnp.int32), jnp.asarray(N_KEEP, jnp.int32))
    seqs = [prompts[b] + tree_tokens[b, PATHS[b][: N_KEEP[b]]].tolist() for b in range(B)]
    np.testing.assert_array_equal(np.asarray(cache.length), [len(s) for s in seqs])
    for step in range(2):
        nxt = rng.integers(0, tiny.vocab, B)
        out = transformer.decode_step(tiny.jx, jnp.asarray(nxt, jnp.int32), cache)
        cache = out.cache
        for b in range(B):
            seqs[b].append(int(nxt[b]))
            d = _max_diff(out.logits[b, 0], tiny.hf_last(seqs[b]))
            assert d <= TOL, f"{kind} row {b} step {step} after commit_path: logits differ by {d:.2e}"


def test_commit_path_moves_slots_exactly():
    """commit_path on a hand-made cache: kept path slots move to length..length+n-1, the committed
    prefix is untouched, the length advances by n_keep per row."""
    L, B, C, K, D = 2, 2, 12, 1, 1
    cache = kvcache.init(L, B, C, K, D)
    vals = jnp.arange(L * B * C, dtype=jnp.float32).reshape(L, B, C, 1, 1)
    cache = kvcache.KVCache(k=vals, v=-vals, length=jnp.asarray([3, 5], jnp.int32))
    path = jnp.asarray([[0, 3, 5], [0, 2, 4]], jnp.int32)
    new = jax.jit(kvcache.commit_path)(cache, path, jnp.asarray([3, 1], jnp.int32))
    np.testing.assert_array_equal(np.asarray(new.length), [6, 6])
    k, k0 = np.asarray(new.k)[..., 0, 0], np.asarray(vals)[..., 0, 0]
    # row 0: slots 3,4,5 <- 3+0, 3+3, 3+5
    np.testing.assert_array_equal(k[:, 0, :3], k0[:, 0, :3])
    np.testing.assert_array_equal(k[:, 0, 3:6], k0[:, 0, [3, 6, 8]])
    # row 1: keeps only the root, already in place
    np.testing.assert_array_equal(k[:, 1, :6], k0[:, 1, :6])
    np.testing.assert_array_equal(np.asarray(new.v), -np.asarray(new.k))


def test_cache_write_lands_in_place_and_drops_past_capacity():
    cache = kvcache.set_length(kvcache.init(2, 2, 6, 1, 1), jnp.asarray([1, 4], jnp.int32))
    new = jnp.arange(1, 7, dtype=jnp.float32).reshape(2, 3, 1, 1)
    out = jax.jit(kvcache.write, static_argnums=1)(cache, 1, new, -new)
    k = np.asarray(out.k)[..., 0, 0]
    np.testing.assert_array_equal(k[1], [[0, 1, 2, 3, 0, 0], [0, 0, 0, 0, 4, 5]])  # row 1: slot 6 dropped
    assert not k[0].any() and (np.asarray(out.v) == -np.asarray(out.k)).all()


def test_fixtures_exercise_biases_and_norms(tiny_models):
    """The parity tests only prove bias / q-k-norm handling if those weights are not trivial."""
    q2 = tiny_models["qwen2"].jx.layers[0].self_attn
    for proj in (q2.q_proj, q2.k_proj, q2.v_proj):
        assert float(jnp.abs(proj.bias[...]).min()) > 0
    q3 = tiny_models["qwen3"].jx.layers[1].self_attn
    for norm in (q3.q_norm, q3.k_norm):
        assert float(jnp.abs(norm.weight[...] - 1).max()) > 0.05
    assert tiny_models["llama_tied"].jx.lm_head is None
    assert tiny_models["llama"].jx.lm_head is not None
