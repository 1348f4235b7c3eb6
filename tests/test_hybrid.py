"""The Qwen3-Next-style hybrid target (Gated DeltaNet + gated attention):

- logit parity with `transformers`' Qwen3NextForCausalLM (a tiny random checkpoint built here):
  prefill of a ragged batch, then token-by-token decode; save / load round trip;
- the chunked form equals the recurrent form (from a non-empty state, several chunks, ragged);
- a tree block (per-node state propagated from each node's parent) equals the chain of each
  node's root path, and `commit` of an accepted path equals decoding it;
- speculative generation on a hybrid target: greedy output identical to autoregressive with
  every drafter (an independent tiny transformer: static tree on a ragged batch of 4, dynamic tree
  on batch 1; n-gram: chain, batch 4; feature drafter: chain, batch 4), and speculative sampling
  is lossless (chi-square of the first generated tokens against the exact target distribution);
- the per-node state budget refuses oversized trees before anything is traced.
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
from flax import nnx

import specjax
from specjax.engine import loop as engine
from specjax.spec import tree as tree_lib
from specjax.drafters import FeatureConfig, FeatureDrafter, FeatureHead, LMDrafter, NgramDrafter
from specjax.models import family, hybrid, transformer
from specjax.models.config import HybridConfig, ModelConfig

from helpers import chi_square, compare_greedy

TOL = 1e-4
LIN, FULL = "linear_attention", "full_attention"

# ----------------------------------------------------------------------------- HF reference

HF_TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=8,
               linear_value_head_dim=12, linear_num_key_heads=2, linear_num_value_heads=4, num_experts=0,
               layer_types=[LIN, FULL, LIN, LIN], max_position_embeddings=256, rms_norm_eps=1e-6,
               rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
               attention_bias=True, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)


def _randomise_hf(model, seed):
    """O(1) random weights: zero-centred (1 + w) norms get 0.2 N(0, 1), the gated norm 1 + 0.2 N(0, 1),
    slow-ish decays (A in [0.02, 0.5]) so the recurrent state carries over many tokens."""
    import torch
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g)
            if name.endswith("linear_attn.norm.weight"):
                p.copy_(1.0 + 0.2 * r)
            elif name.endswith("norm.weight"):
                p.copy_(0.2 * r)
            elif name.endswith("A_log"):
                p.copy_(torch.log(0.02 + 0.48 * torch.rand(p.shape, generator=g)))
            elif name.endswith("dt_bias") or name.endswith("bias"):
                p.copy_(0.5 * r)
            elif name.endswith("conv1d.weight"):
                p.copy_(r / np.sqrt(p.shape[-1]))
            elif "embed_tokens" in name:
                p.copy_(r)
            else:
                p.copy_(r / np.sqrt(p.shape[1]))


@pytest.fixture(scope="module")
def hf_hybrid(tmp_path_factory):
    import torch
    import transformers
    torch.set_num_threads(1)
    cfg = transformers.Qwen3NextConfig(**HF_TINY)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.Qwen3NextForCausalLM(cfg).float().eval()
    _randomise_hf(model, 0)
    path = str(tmp_path_factory.mktemp("hybrid_hf") / "qwen3_next")
    model.save_pretrained(path, safe_serialization=True)
    return model, path


def _hf_logits(model, ids) -> np.ndarray:
    import torch
    with torch.no_grad():
        return model(input_ids=torch.tensor([list(map(int, ids))])).logits[0].float().numpy()


def _max_diff(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


def _pad(rows, width=None):
    P = width or max(len(r) for r in rows)
    toks = np.zeros((len(rows), P), np.int32)
    for b, r in enumerate(rows):
        toks[b, :len(r)] = r
    return jnp.asarray(toks), jnp.asarray([len(r) for r in rows], jnp.int32)


@nnx.jit(static_argnames=("capacity",))
def _prefill_then_decode(model, prompt_BxP, lengths_B, next_BxS, *, capacity):
    """Prefill logits [B, P, V] and the logits of S decode steps [B, S, V]."""
    out = hybrid.prefill(model, prompt_BxP, lengths_B, hybrid.init_cache(model, prompt_BxP.shape[0], capacity))

    def step(cache, tok_B):
        o = hybrid.decode_step(model, tok_B, cache)
        return o.cache, o.logits[:, 0]

    cache, logits = jax.lax.scan(step, out.cache, next_BxS.T)
    return out.logits, logits.transpose(1, 0, 2), cache.length


def test_config_reads_hf(hf_hybrid):
    _, path = hf_hybrid
    cfg = specjax.load_model(path).config
    assert isinstance(cfg, HybridConfig)
    assert cfg.layer_types == tuple(HF_TINY["layer_types"]) and cfg.rotary_dim == 8
    assert cfg.attention_layers == (1,) and cfg.linear_layers == (0, 2, 3)
    assert cfg.conv_dim == 2 * 2 * 8 + 4 * 12
    # full_attention_interval when layer_types is absent, as transformers reads it
    hf = {**cfg.to_hf(), "full_attention_interval": 2}
    del hf["layer_types"]
    assert HybridConfig.from_hf(hf).layer_types == (LIN, FULL, LIN, FULL)


def test_prefill_and_decode_match_hf(hf_hybrid):
    hf, path = hf_hybrid
    jx = specjax.load_model(path)
    assert isinstance(jx, hybrid.HybridModel)
    rng = np.random.default_rng(1)
    V = HF_TINY["vocab_size"]
    prompts = [rng.integers(0, V, n).tolist() for n in (13, 5, 70)]  # 70 > one 64-token chunk
    nxt = rng.integers(0, V, (3, 6))
    toks, lens = _pad(prompts)
    pre, dec, length = _prefill_then_decode(jx, toks, lens, jnp.asarray(nxt, jnp.int32), capacity=96)
    np.testing.assert_array_equal(np.asarray(length), np.asarray(lens) + 6)
    for b, p in enumerate(prompts):
        ref = _hf_logits(hf, p + nxt[b].tolist())
        d = _max_diff(pre[b, :len(p)], ref[:len(p)])
        assert d <= TOL, f"row {b}: prefill logits differ from transformers by {d:.2e}"
        d = _max_diff(dec[b], ref[len(p):])
        assert d <= TOL, f"row {b}: decode logits differ from transformers by {d:.2e}"


def test_save_load_round_trip(hf_hybrid, tmp_path):
    import transformers
    from safetensors.numpy import load_file
    hf, path = hf_hybrid
    jx = specjax.load_model(path)
    out = str(tmp_path / "saved")
    specjax.save_model(jx, out)
    a, b = load_file(os.path.join(path, "model.safetensors")), load_file(os.path.join(out, "model.safetensors"))
    assert set(a) == set(b)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    back = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").float().eval()
    assert type(back).__name__ == "Qwen3NextForCausalLM"
    ids = np.random.default_rng(2).integers(0, HF_TINY["vocab_size"], 20)
    assert _max_diff(_hf_logits(back, ids), _hf_logits(hf, ids)) <= 1e-6


def test_moe_checkpoint_is_refused(hf_hybrid, tmp_path):
    _, path = hf_hybrid
    bad = str(tmp_path / "moe")
    shutil.copytree(path, bad)
    file = os.path.join(bad, "config.json")
    with open(file) as f:
        cfg = json.load(f)
    cfg.update(num_experts=8)
    with open(file, "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match="mixture-of-experts") as e:
        specjax.load_model(bad)
    assert file in str(e.value)


# ----------------------------------------------------------------------------- forms and trees

SMALL = HybridConfig(vocab_size=40, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=2, num_kv_heads=1,
                     head_dim=16, layer_types=(FULL, LIN), linear_num_key_heads=2, linear_num_value_heads=4,
                     linear_key_head_dim=8, linear_value_head_dim=6, linear_conv_kernel_dim=4,
                     partial_rotary_factor=0.5)


def _random_model(cls, cfg, seed, **kw):
    """A model of `cls` with `_scaled_random` weights, built without running the initialisers."""
    return _scaled_random(nnx.eval_shape(lambda: cls(cfg, nnx.Rngs(0))), seed, **kw)


def _scaled_random(model, seed, out_scale=1.0, embed_scale=1.0):
    """Re-draws every parameter with O(1) scale (numpy, on the host); the residual branches'
    output projections get `out_scale` (a small value keeps the model close to a bigram model, so
    drafters sharing its embedding and head agree often)."""
    rng = np.random.default_rng(seed)
    dense = isinstance(model, transformer.Model)
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    for path, var in flat:
        name = ".".join(map(str, path))
        shape = var.get_value().shape
        r = rng.standard_normal(shape)
        if name.endswith("A_log"):
            v = np.log(rng.uniform(0.02, 0.5, shape))
        elif name.endswith("dt_bias"):
            v = 0.5 * r
        elif "norm" in name:  # zero-centred (1 + w) norms, except the gated norm and the dense model's
            v = 1.0 + 0.2 * r if dense or name.endswith("linear_attn.norm.weight") else 0.2 * r
        elif name == "embed_tokens":
            v = embed_scale * r
        elif name.endswith("conv1d.weight"):
            v = r / np.sqrt(shape[-1])
        else:
            v = r / np.sqrt(shape[0])
            if any(s in name for s in ("out_proj", "o_proj", "down_proj")):
                v = out_scale * v
        var.set_value(jnp.asarray(v, var.get_value().dtype))
    nnx.update(model, nnx.from_flat_state(flat))
    return model


@pytest.fixture(scope="module")
def small():
    return _random_model(hybrid.HybridModel, SMALL, 1)


@nnx.jit(static_argnames=("chunk_size",))
def _forms(model, prompt, lens, block, n_keep, tree_parents, tree_tokens, path, path_keep, *, chunk_size):
    cache0 = hybrid.prefill(model, prompt, lens, hybrid.init_cache(model, prompt.shape[0], 48)).cache
    B = block.shape[0]

    def step(cache, tok):
        o = hybrid.decode_step(model, tok, cache)
        return o.cache, (o.logits[:, 0], o.cache.state, o.cache.conv)

    _, (dec_logits, dec_state, dec_conv) = jax.lax.scan(step, cache0, block.T)
    ext = hybrid.extend(model, block, n_keep, cache0, chunk_size=chunk_size)
    # the tree: positions from depth, attention under the ancestor mask
    N = tree_parents.shape[1]
    depth = hybrid.tree_depth(tree_parents)
    bufs = tree_lib.TreeBuffers(tokens=tree_tokens, parents=tree_parents, depth=depth, valid=jnp.ones((B, N), bool),
                                score=jnp.zeros((B, N)), source=jnp.zeros((B, N), jnp.int8))
    tree = hybrid.forward(model, tree_tokens, tree_lib.positions(bufs, cache0.length), cache0,
                          tree_lib.ancestor_mask(bufs, N), parents=tree_parents)
    committed = hybrid.commit(tree.cache, path, path_keep)
    after = hybrid.decode_step(model, block[:, 0], committed)
    return dict(dec_logits=dec_logits.transpose(1, 0, 2), dec_state=dec_state, dec_conv=dec_conv,
                ext_logits=ext.logits, ext_state=ext.cache.state, ext_conv=ext.cache.conv, ext_len=ext.cache.length,
                tree_logits=tree.logits, tree_state=committed.state, node_state=tree.cache.node_state, tree_len=committed.length,
                after_logits=after.logits[:, 0], cache0_len=cache0.length)


@nnx.jit(static_argnames=("capacity",))
def _path_reference(model, prompt, lens, path_tokens, path_lens, extra, *, capacity):
    """Each row: prefill, then its path tokens as one chunked block, then one decode step."""
    cache = hybrid.prefill(model, prompt, lens, hybrid.init_cache(model, prompt.shape[0], capacity)).cache
    ext = hybrid.extend(model, path_tokens, path_lens, cache, chunk_size=2)
    after = hybrid.decode_step(model, extra, ext.cache)
    return ext.logits, ext.cache.state, after.logits[:, 0]


def _random_tree(rng, N):
    return [-1] + [int(rng.integers(0, i)) for i in range(1, N)]


def _root_path(parents, node):
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


def test_chunked_recurrent_and_tree_forms_agree(small):
    rng = np.random.default_rng(3)
    V, T, N = SMALL.vocab_size, 11, 12
    prompts = [rng.integers(0, V, n).tolist() for n in (9, 4)]
    prompt, lens = _pad(prompts)
    block = jnp.asarray(rng.integers(0, V, (2, T)), jnp.int32)
    n_keep = jnp.array([T, 4], jnp.int32)  # row 1: a ragged block (and a commit of 4 nodes)
    parents = [_random_tree(rng, N), [-1, 0, 1, 2, 3, 4, 5, 6, 7, 0, 9, 10]]  # row 1: a chain of 9 and a branch
    tree_tokens = jnp.asarray(rng.integers(0, V, (2, N)), jnp.int32)
    deepest = [max(range(N), key=lambda i: len(_root_path(p, i))) for p in parents]
    paths = [_root_path(p, d) for p, d in zip(parents, deepest)]
    path_arr = np.zeros((2, N), np.int32)
    for b, pth in enumerate(paths):
        path_arr[b, :len(pth)] = pth
    keep = jnp.asarray([len(p) for p in paths], jnp.int32)
    out = _forms(small, prompt, lens, block, n_keep, jnp.asarray(parents, jnp.int32), tree_tokens,
                 jnp.asarray(path_arr), keep, chunk_size=4)
    out = jax.tree.map(np.asarray, out)
    dec = out["dec_logits"]
    # chunked (3 chunks of 4, last one padded) == recurrent, on top of a prefilled state
    assert _max_diff(out["ext_logits"][0], dec[0]) <= TOL
    assert _max_diff(out["ext_logits"][1, :4], dec[1, :4]) <= TOL
    for b, n in enumerate((T, 4)):
        assert _max_diff(out["ext_state"][:, b], out["dec_state"][n - 1][:, b]) <= 1e-5
        assert _max_diff(out["ext_conv"][:, b], out["dec_conv"][n - 1][:, b]) <= 1e-5
    np.testing.assert_array_equal(out["ext_len"], out["cache0_len"] + np.array([T, 4]))
    # a tree: every node == the chain of its root path; commit == decoding the accepted path
    rows, row_toks, owners = [], [], []
    for b in range(2):
        for i in range(N):
            pth = _root_path(parents[b], i)
            rows.append(prompts[b])
            row_toks.append([int(tree_tokens[b, j]) for j in pth])
            owners.append((b, i, len(pth)))
    ref_logits, ref_state, ref_after = _path_reference(
        small, *_pad(rows), *_pad(row_toks, N), jnp.asarray([int(block[b, 0]) for b, _, _ in owners], jnp.int32),
        capacity=48)
    for r, (b, i, d) in enumerate(owners):
        diff = _max_diff(out["tree_logits"][b, i], ref_logits[r, d - 1])
        assert diff <= TOL, f"row {b} node {i}: tree logits differ from its path's chain by {diff:.2e}"
        diff = _max_diff(out["node_state"][:, b, i], np.asarray(ref_state)[:, r])
        assert diff <= 1e-5, f"row {b} node {i}: its delta-rule state differs from its path's chain by {diff:.2e}"
        if i == deepest[b]:
            assert _max_diff(out["tree_state"][:, b], np.asarray(ref_state)[:, r]) <= 1e-5
            assert _max_diff(out["after_logits"][b], ref_after[r]) <= TOL  # K/V, state and conv all committed
    np.testing.assert_array_equal(out["tree_len"], out["cache0_len"] + np.asarray(keep))


def test_chunked_form_is_exact_when_keys_align():
    """A trained model's keys align (repeated tokens, beta near 1, little decay): the chunked
    form's triangular inverse must stay exact there. (The doubling product it once used was far off
    here and made a training run's loss NaN.)"""
    from specjax.models.hybrid import delta_chunked, delta_step, unit_lower_inverse
    c = 64
    ones = np.eye(c, dtype=np.float32) + np.tril(np.ones((c, c), np.float32), -1)
    np.testing.assert_allclose(np.asarray(unit_lower_inverse(jnp.asarray(ones))), np.linalg.inv(ones), atol=1e-5)
    rng = np.random.default_rng(0)
    B, T, H, dk, dv = 1, 2 * c, 2, 16, 8
    k = rng.normal(size=(B, T, H, dk)) + 3.0  # nearly parallel keys
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    q = rng.normal(size=(B, T, H, dk)) / np.sqrt(dk)
    v = rng.normal(size=(B, T, H, dv))
    g = -0.01 * rng.random((B, T, H))
    beta = 1 / (1 + np.exp(-rng.normal(3.0, 1.0, (B, T, H))))
    q, k, v, g, beta = (jnp.asarray(x, jnp.float32) for x in (q, k, v, g, beta))
    S0 = jnp.asarray(rng.normal(size=(B, H, dk, dv)), jnp.float32)
    o, S = delta_chunked(q, k, v, g, beta, S0, chunk_size=c)
    S_ref, o_ref = S0, []
    for t in range(T):
        o_t, S_ref = delta_step(S_ref, q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t])
        o_ref.append(o_t)
    np.testing.assert_allclose(np.asarray(o), np.asarray(jnp.stack(o_ref, 1)), atol=1e-4)
    np.testing.assert_allclose(np.asarray(S), np.asarray(S_ref), atol=1e-4)


def test_node_state_bytes_formula():
    L_lin, Hv, dk, dv, K, C = 1, 4, 8, 6, 4, 2 * 2 * 8 + 4 * 6
    assert hybrid.node_state_bytes(SMALL) == L_lin * (Hv * dk * dv * 4 + (K - 1) * C * 4)
    assert SMALL.conv_dim == C
    assert family(nnx.eval_shape(lambda: hybrid.HybridModel(SMALL, nnx.Rngs(0)))) is hybrid
    assert family(nnx.eval_shape(lambda: transformer.Model(ModelConfig(8, 8, 8, 1, 1, 1, 8), nnx.Rngs(0)))) is transformer


# ----------------------------------------------------------------------------- speculative generation

VOCAB = 48
TARGET = HybridConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                      head_dim=16, layer_types=(LIN, FULL), linear_num_key_heads=1, linear_num_value_heads=2,
                      linear_key_head_dim=8, linear_value_head_dim=8, partial_rotary_factor=0.5,
                      max_position_embeddings=512)
TREES = ["chain=4", "[[0],[1],[2],[0,0],[0,1],[1,0],[0,0,0],[0,0,0,0]]", "depth=4,topk=3,nodes=12"]
OUT_SCALE = 0.5  # how far the target is from a bigram model (the drafters share its bigram part)


def _drafter_for(target: hybrid.HybridModel, seed: int) -> LMDrafter:
    """An independent one-layer transformer with the target's embedding and LM head (so the two
    agree often, not always); its own layers are random."""
    cfg = ModelConfig(vocab_size=target.config.vocab_size, hidden_size=target.config.hidden_size,
                      intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16)
    draft = _random_model(transformer.Model, cfg, seed, out_scale=OUT_SCALE)
    draft.embed_tokens.set_value(target.embed_tokens.get_value())
    draft.lm_head.weight.set_value(target.lm_head.weight.get_value())
    draft.norm.weight.set_value(1.0 + target.norm.weight.get_value())  # (1 + w) convention -> plain w
    return LMDrafter(draft)


@pytest.fixture(scope="module")
def target():
    return _random_model(hybrid.HybridModel, TARGET, 0, out_scale=OUT_SCALE)


@pytest.fixture(scope="module")
def lm_drafter(target):
    return _drafter_for(target, 7)


def _prompts(batch, seed=0, repetitive=False, vocab=VOCAB):
    rng = np.random.default_rng(seed)
    out = []
    for n in (7, 23, 12, 30)[:batch]:  # one 32-token bucket
        if repetitive:
            phrase = rng.integers(0, vocab, 5).tolist()
            out.append((phrase * 8)[:n])
        else:
            out.append(rng.integers(0, vocab, n).tolist())
    return out


@nnx.jit
def _last_logits(model, toks, lens):
    out = hybrid.prefill(model, toks, lens, hybrid.init_cache(model, toks.shape[0], toks.shape[1]))
    return jnp.take_along_axis(out.logits, (lens - 1)[:, None, None], axis=1)[:, 0]


def _logits_fn(model, prompts):
    def fn(row, prefix):
        ids = prompts[row] + list(prefix)
        toks, lens = _pad([ids], 32 * -(-len(ids) // 32))
        return np.asarray(_last_logits(model, toks, lens)[0])
    return fn


_AR_CACHE: dict = {}


def _check_exact(target, drafter, tree, batch, repetitive=False, new=24):
    prompts = _prompts(batch, seed=batch, repetitive=repetitive)
    key = (batch, repetitive, new)
    if key not in _AR_CACHE:  # autoregressive decode_step is checked against transformers above
        _AR_CACHE[key] = specjax.generate(target, prompts, max_new_tokens=new)
    ref = _AR_CACHE[key]
    got = specjax.generate(target, prompts, max_new_tokens=new, drafters=[drafter], tree=tree)
    n_exact, n_near = compare_greedy(ref.sequences(), got.sequences(), _logits_fn(target, prompts))
    assert n_exact + n_near == batch
    assert (got.lengths == new).all()
    return got


@pytest.mark.parametrize("tree,batch", [(TREES[1], 4), (TREES[2], 1)])
def test_lm_drafter_greedy_exact(target, lm_drafter, tree, batch):
    got = _check_exact(target, lm_drafter, tree, batch)
    tau = got.stats["tau"]
    assert (tau > 1.3).all(), f"the drafter shares the target's bigram part and should be accepted often: tau {tau}"
    if batch > 1:
        assert len(set(got.stats["accepted"].tolist())) > 1  # rows accept different lengths


def test_ngram_drafter_greedy_exact(target):
    got = _check_exact(target, NgramDrafter(), TREES[0], 4, repetitive=True)
    assert got.stats["accepted"].sum() > 0


def test_feature_drafter_greedy_exact(target):
    """The EAGLE-3 style drafter reads the hybrid target's hidden states and shares its embedding
    and LM head; an untrained head is rarely right, but the output must still be exact."""
    head = FeatureHead(FeatureConfig.for_target(target.config, target_layers=(0, 1)), nnx.Rngs(3))
    _check_exact(target, FeatureDrafter(head, target), TREES[0], 4)


def test_hybrid_lm_drafter(target):
    """A small hybrid drafts too (`LMDrafter` runs any family): expanding its tree depth by depth,
    each scratch node one recurrent step from its parent's stored state, gives the same q as its
    one-pass tree form (`score`), and the output stays exact."""
    drafter = LMDrafter(_random_model(hybrid.HybridModel, TARGET, 11, out_scale=OUT_SCALE))
    drafter.model.embed_tokens.set_value(target.embed_tokens.get_value())
    drafter.model.lm_head.weight.set_value(target.lm_head.weight.get_value())
    spec = tree_lib.parse_tree_spec(TREES[1])
    toks, lens = _pad(_prompts(2), 32)
    graphdef, state = nnx.split(drafter)

    @jax.jit
    def q_both(state, toks, lens):
        d = nnx.merge(graphdef, state)
        cache = d.init(toks, lens, 64, None)
        ctx = engine.DraftContext(spec, "sample", specjax.spec.sampling.SamplingParams.make(1.0, 0, 1.0), jax.random.key(0))
        prop = d.propose(cache, toks[:, 0], ctx)
        inner = (prop.tree.depth < spec.max_depth)[..., None]  # the nodes drafting evaluated (not the leaves)
        return (jnp.where(inner, jnp.log(prop.probs), 0.0), jnp.where(inner, d.score(cache, prop.tree, spec.max_depth), 0.0),
                prop.state.length, cache.length)

    drafted, scored, length_after, length_before = q_both(state, toks, lens)
    np.testing.assert_allclose(np.asarray(drafted), np.asarray(scored), atol=2e-4)
    np.testing.assert_array_equal(length_after, length_before)  # propose commits nothing
    got = _check_exact(target, drafter, TREES[0], 4)
    assert got.stats["accepted"].sum() > 0


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _Echo:
    at_prefill: jax.Array  # [B] a value computed from the target's committed recurrent state at init
    at_first: jax.Array  # [B] the same after the first round's commit
    first_count: jax.Array  # [B] tokens the first round committed
    seed: jax.Array  # [B] what the next draft is made from


class _EchoStateDrafter(specjax.drafters.Drafter):
    """A toy drafter that reads `Committed.target` (the hybrid target's committed recurrent state)
    and drafts tokens made from it; `loop_stats` echoes what it read."""
    name = "echo-state"

    def __init__(self, vocab):
        self.vocab_size = vocab

    @staticmethod
    def value(cache):  # one number per row from the delta-rule state of every DeltaNet layer
        return jnp.sum(jnp.abs(cache.state), axis=(0, 2, 3, 4))

    def init(self, prompt_BxP, lengths_B, capacity, target_out):
        v = self.value(target_out.cache)
        return _Echo(at_prefill=v, at_first=jnp.zeros_like(v), first_count=jnp.zeros_like(lengths_B), seed=v)

    def propose(self, st, root_B, ctx):
        D = ctx.spec.max_depth
        draft = (jnp.floor(st.seed * 1000).astype(jnp.int32)[:, None] + jnp.arange(D)[None]) % self.vocab_size
        return specjax.drafters.Proposal(tree=tree_lib.chain_tree(root_B, draft), probs=None, state=st)

    def commit(self, st, committed):
        v = self.value(committed.target)
        first = st.first_count == 0
        return _Echo(at_prefill=st.at_prefill, at_first=jnp.where(first, v, st.at_first),
                     first_count=jnp.where(first, committed.count, st.first_count), seed=v)

    def loop_stats(self, st):
        return {"echo_prefill": st.at_prefill, "echo_first": st.at_first, "echo_first_count": st.first_count}


def test_drafter_reads_committed_target_state(target):
    """`Committed.target` carries the hybrid target's committed state after each round (and the
    prefill's at init): a toy drafter echoes a value computed from it, the value matches the state
    of a fresh prefill over the same committed tokens, and the output stays exact."""
    prompts = _prompts(4, seed=4)
    got = _check_exact(target, _EchoStateDrafter(VOCAB), "chain=3", 4)
    rows = [(p, "echo_prefill", b) for b, p in enumerate(prompts)]
    rows += [(p + got.sequences()[b][:int(got.stats["echo_first_count"][b])], "echo_first", b)
             for b, p in enumerate(prompts)]
    toks, lens = _pad([ids for ids, _, _ in rows], 64)  # one batch, one compile

    @nnx.jit
    def values(model, toks, lens):
        cache = hybrid.prefill(model, toks, lens, hybrid.init_cache(model, toks.shape[0], toks.shape[1])).cache
        return _EchoStateDrafter.value(cache)

    expect = np.asarray(values(target, toks, lens))
    for (_, key, b), want in zip(rows, expect):
        np.testing.assert_allclose(got.stats[key][b], want, rtol=1e-4)


def test_state_budget_refuses_big_trees(target, lm_drafter):
    before = engine.trace_count()
    per_node = hybrid.node_state_bytes(TARGET)
    p = _prompts(4)
    with pytest.raises(ValueError, match="per-node recurrent-state buffer") as e:
        specjax.generate(target, p, max_new_tokens=4, drafters=[lm_drafter], tree="chain=4",
                         state_budget_bytes=4 * 5 * per_node - 1)
    assert f"{4 * 5 * per_node:,} bytes" in str(e.value) and "state_budget_bytes" in str(e.value)
    with pytest.raises(ValueError, match="state_budget_bytes must be"):
        specjax.generate(target, p, max_new_tokens=4, drafters=[lm_drafter], state_budget_bytes=-1)
    assert engine.trace_count() == before
    # the default budget: max(1 GiB, the committed cache)
    assert engine.check_state_budget(target, 4, 5, 64) == 4 * 5 * per_node
    big = dataclasses.replace(TARGET, linear_num_value_heads=64, linear_key_head_dim=128, linear_value_head_dim=128)
    big_model = nnx.eval_shape(lambda: hybrid.HybridModel(big, nnx.Rngs(0)))
    with pytest.raises(ValueError, match="default: max"):
        engine.check_state_budget(big_model, 64, 64, 64)  # 64 x 64 x 8.4 MB > 1 GiB
    assert engine.check_state_budget(lm_drafter.model, 64, 64, 64) == 0  # attention-only: no per-node state


# ----------------------------------------------------------------------------- sampling losslessness

SAMPLE_VOCAB = 16
SAMPLE_TARGET = HybridConfig(vocab_size=SAMPLE_VOCAB, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=2,
                             num_kv_heads=1, head_dim=8, layer_types=(LIN, FULL), linear_num_key_heads=1,
                             linear_num_value_heads=2, linear_key_head_dim=4, linear_value_head_dim=4,
                             partial_rotary_factor=0.5)
ROWS, SEEDS = 20_000, 5


def test_speculative_sampling_is_lossless(monkeypatch):
    """First three generated tokens of 1e5 rows of speculative sampling (deterministic-candidate
    rule, temperature 1) against the exact target distribution: the joint of tokens 1-2 (the
    tree verified on the prefilled state) and of tokens 2-3 (token 3 often comes from the next
    round, on top of a committed per-node state)."""
    monkeypatch.setattr(engine, "PROMPT_BUCKET", 8)  # 1e5 rows: keep the padded prompt short
    V = SAMPLE_VOCAB
    target = _random_model(hybrid.HybridModel, SAMPLE_TARGET, 4, out_scale=1.0, embed_scale=0.7)
    drafter = _drafter_for(target, 8)
    prompt = [3, 1, 4, 1, 5, 9]
    toks = []
    for seed in range(SEEDS):
        r = specjax.generate(target, [prompt] * ROWS, max_new_tokens=3, temperature=1.0, seed=seed,
                             drafters=[drafter], tree="[[0],[1],[0,0]]", verify="deterministic")
        assert (r.lengths == 3).all()
        toks.append(r.tokens)
        stats = r.stats
    toks = np.concatenate(toks)
    acc = stats["accepted"] / np.maximum(stats["rounds"], 1)
    assert 0.1 < acc.mean() < 1.5, f"the test needs both acceptance and rejection: {acc.mean():.2f} accepted per round"
    # exact distributions: p(t1), p(t2 | t1), p(t3 | t1, t2), by batched prefill of every prefix
    prefixes = [prompt] + [prompt + [a] for a in range(V)] + [prompt + [a, b] for a in range(V) for b in range(V)]
    logits = np.asarray(_last_logits(target, *_pad(prefixes, 8)), np.float64)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    p1, p2, p3 = probs[0], probs[1:1 + V], probs[1 + V:].reshape(V, V, V)  # p(t1), p(t2|t1), p(t3|t1,t2)
    joint12 = p1[:, None] * p2
    joint23 = np.einsum("ab,abc->bc", joint12, p3)
    for name, (i, j), expected in (("tokens 1-2", (0, 1), joint12), ("tokens 2-3", (1, 2), joint23)):
        counts = np.bincount(toks[:, i] * V + toks[:, j], minlength=V * V)
        stat, df, crit = chi_square(counts, expected.reshape(-1))
        assert stat <= crit, f"{name}: chi2 {stat:.1f} > {crit:.1f} (df {df})"
    # and the test has power: sampling token 2 from p(. | t1) of the wrong prefix is caught
    wrong = np.einsum("a,b->ab", p1, p2.mean(0))
    stat, _, crit = chi_square(np.bincount(toks[:, 0] * V + toks[:, 1], minlength=V * V), wrong.reshape(-1))
    assert stat > crit
