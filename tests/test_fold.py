"""FOLD (design §7, specjax.models.fold): the drafter-side long-context attention policy.

- without far keys FOLD is the plain drafter (draft distributions and generated tokens);
- FOLD attention equals `far_attention_reference` on hand-built cases (a causal commit block, a tree
  with sibling branches; through the kernel in interpret mode too), and the feature drafter's
  step is wired to it;
- greedy speculative output with FOLD on equals autoregressive output (FOLD changes only the
  drafter), for the lm and the feature drafter, a ragged batch of 2 with far keys;
- bad input (window larger than the cache, negative lambda, FOLD on n-gram, bad specs) is a
  clear ValueError / usage error before anything is traced;
- tools/bench_long.py --smoke runs and writes its table.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import specjax
from helpers import compare_greedy, noisy_lm_drafter, prefix_logits_fn, tiny_target
from pallas_kernels import reference as ref
from specjax.engine import loop as engine
from specjax.models import fold, kvcache
from specjax.spec import tree as tree_lib
from specjax.drafters import FeatureConfig, FeatureDrafter, FeatureHead, LMDrafter, NgramDrafter, load_drafter
from specjax.drafters.base import DraftContext
from specjax.drafters import feature as feature_lib
from specjax.models.fold import FoldConfig
from specjax.models import transformer
from specjax.models.config import ModelConfig
from specjax.spec.sampling import SamplingParams

REPO = Path(__file__).resolve().parents[1]
VOCAB = 48
FAR = FoldConfig(sinks=2, window=16, chunk=16, sharpen=0.5)  # far keys from ~34 tokens on


@pytest.fixture(scope="module")
def target():
    return tiny_target(VOCAB)  # shared (helpers), as test_speculative's


@pytest.fixture(scope="module")
def lm_drafter():
    return noisy_lm_drafter(VOCAB)  # the target plus noise (scale 0.1, seed 9)


@pytest.fixture(scope="module")
def feature_drafter(target):
    head = FeatureHead(FeatureConfig.for_target(target.config, target_layers=(0, 1)), nnx.Rngs(3))
    return FeatureDrafter(head, target)


def _prompts(lengths, seed=0):
    rng = np.random.default_rng(seed)
    phrase = rng.integers(0, VOCAB, 11).tolist()  # some repetition: the drafter has something to read
    return [((phrase * 20)[:n // 2] + rng.integers(0, VOCAB, n - n // 2).tolist()) for n in lengths]


def _draft(target, drafter, prompts, spec="chain=2"):
    """One jitted prefill + propose: the draft tree's tokens and q at every node."""
    spec = tree_lib.parse_tree_spec(spec)
    batch = engine.prepare_prompts(prompts, VOCAB, 8, slack=spec.num_nodes + spec.max_depth + 2)
    graphdef, state = nnx.split((target, drafter))

    @jax.jit
    def run(state, tokens, lengths):
        tgt, dr = nnx.merge(graphdef, state)
        out = transformer.prefill(tgt, tokens, lengths, transformer.init_cache(tgt, tokens.shape[0], batch.capacity),
                                  hidden_layers=tuple(dr.target_layers))
        root = jnp.argmax(engine.last_logits(out.logits, lengths), -1).astype(jnp.int32)
        dstate = dr.init(tokens, lengths, batch.capacity, out)
        prop = dr.propose(dstate, root, DraftContext(spec, "topk", SamplingParams.make(0.0, 0, 1.0), jax.random.key(0)))
        return prop.tree.tokens, prop.probs

    return run(state, jnp.asarray(batch.tokens), jnp.asarray(batch.lengths))


# ----------------------------------------------------------------------------- no far keys: plain drafter

@pytest.mark.parametrize("kind", ["lm", "feature"])
def test_no_far_keys_equals_plain_drafter(target, lm_drafter, feature_drafter, kind):
    plain = lm_drafter if kind == "lm" else feature_drafter
    prompts = _prompts([70, 37])
    tok_p, q_p = _draft(target, plain, prompts)
    # context <= sinks + window: n_far = 0 (chunk 16 < prompt: the lm drafter's prefill is chunked)
    no_far = plain.with_fold(FoldConfig(sinks=4, window=100, chunk=16, sharpen=2.0))
    # far keys, but left at their true positions and not sharpened: the plain attention again
    identity = plain.with_fold(dataclasses.replace(FAR, fold_positions=False, sharpen=0.0))
    for folded in (no_far, identity) if kind == "lm" else (no_far,):
        tok_f, q_f = _draft(target, folded, prompts)
        np.testing.assert_allclose(np.asarray(q_f), np.asarray(q_p), rtol=1e-5, atol=1e-6)
        assert (np.asarray(tok_f) == np.asarray(tok_p)).all()


def test_with_fold_shares_weights_and_leaves_original_plain(lm_drafter, feature_drafter):
    folded = LMDrafter(lm_drafter.model, fold=FAR)
    assert lm_drafter.fold is None and folded.fold == FAR
    assert folded.model.embed_tokens[...] is lm_drafter.model.embed_tokens[...]
    assert folded.with_fold(None).fold is None
    # FOLD is the drafter's attention argument, not an attribute of the shared model / head
    assert folded.model is lm_drafter.model and not hasattr(folded.model, "fold")
    assert lm_drafter.attention is None and isinstance(folded.attention, fold.FoldAttention)
    f_folded = feature_drafter.with_fold(FAR)
    assert f_folded.fold == FAR and feature_drafter.fold is None and f_folded.head is feature_drafter.head
    assert f_folded.with_fold(None).fold is None
    with pytest.raises(ValueError, match="must be a FoldConfig"):
        lm_drafter.with_fold("sinks=1")


# ----------------------------------------------------------------------------- the definition

def _case(seed, B=2, C=48, K=2, G=2, D=16):
    ks = jax.random.split(jax.random.key(seed), 4)
    k = jax.random.normal(ks[0], (B, C, K, D))
    v = jax.random.normal(ks[1], (B, C, K, D))
    return k, v, ks[2], K * G, D


fold_attention = jax.jit(fold.fold_attention, static_argnums=6)


@jax.jit(static_argnums=7)
def _expected_per_query(q, k, v, length, q_pos, mask, scratch_pos, cfg, inv):
    """far_attention_reference, one query at a time: committed keys with FOLD's segments and
    positions, then the scratch keys the query sees as local keys at their true positions."""
    T, C, S = q.shape[1], k.shape[1], mask.shape[2]
    seg, k_pos, n_far = fold.committed_keys(length, C, q_pos, cfg)
    beta = fold.beta(n_far, cfg)
    slots = jnp.clip(length[:, None] + jnp.arange(S)[None], 0, C - 1)
    k_s = jnp.take_along_axis(k, slots[:, :, None, None], axis=1)
    v_s = jnp.take_along_axis(v, slots[:, :, None, None], axis=1)
    outs = []
    for t in range(T):
        seg_t = jnp.concatenate([seg, jnp.where(mask[:, t], ref.SEG_LOCAL, ref.SEG_PAD)], axis=1)
        pos_t = jnp.concatenate([k_pos, scratch_pos], axis=1)
        outs.append(ref.far_attention_reference(q[:, t:t + 1], jnp.concatenate([k, k_s], 1), jnp.concatenate([v, v_s], 1),
                                                q_pos[:, t:t + 1], pos_t, seg_t, beta, inv_freq=inv))
    return jnp.concatenate(outs, axis=1), n_far


@pytest.mark.parametrize("block", ["commit", "tree"])
def test_fold_attention_equals_reference(block):
    k, v, kq, H, D = _case(1)
    B = k.shape[0]
    length = jnp.array([30, 21])
    cfg = FoldConfig(sinks=2, window=6, far_distance=9, chunk=4, sharpen=0.7)
    inv = ref.rope_inv_freq(D, 500.0)
    if block == "commit":  # a causal block of 4 with count 3 in row 1
        mask = transformer.causal_mask(B, 4, jnp.array([4, 3]))
        rel = jnp.arange(4)[None]
    else:  # depth 2 of the tree [[0],[1],[0,0],[1,0]]: nodes 3 and 4 on different branches
        anc = np.array([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]], bool)
        mask = jnp.broadcast_to(jnp.asarray(anc[3:5]), (B, 2, 5))
        rel = jnp.array([[2, 2]])
    T = mask.shape[1]
    q = jax.random.normal(kq, (B, T, H, D))
    q_pos = length[:, None] + rel
    # the block's K/V are in the scratch slots already (as after kvcache.write)
    node_depth = {"commit": [0, 1, 2, 3], "tree": [0, 1, 1, 2, 2]}[block]
    scratch_pos = length[:, None] + jnp.asarray(node_depth)[None]
    got = fold_attention(q, k, v, length, q_pos, mask, cfg, inv)
    seen = np.asarray(mask.any(axis=1))  # slots no query sees have no position to infer
    assert (np.asarray(fold.scratch_positions(length, mask)) == np.asarray(scratch_pos))[seen].all()
    want, n_far = _expected_per_query(q, k, v, length, q_pos, mask, scratch_pos, cfg, inv)
    assert (np.asarray(n_far) == [30 - 2 - 6, 21 - 2 - 6]).all()
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
    if block == "tree":  # the kernels (interpret mode) give the same
        got_k = fold_attention(q, k, v, length, q_pos, mask, FoldConfig(**{**cfg.__dict__, "impl": "interpret"}), inv)
        np.testing.assert_allclose(np.asarray(got_k), np.asarray(want), rtol=1e-4, atol=1e-4)
        # the sharpening-only ablation: far keys at their true positions (log-log beta, for variety)
        c2 = FoldConfig(**{**cfg.__dict__, "fold_positions": False, "beta_rule": "log-log"})
        w2, _ = _expected_per_query(q, k, v, length, q_pos, mask, scratch_pos, c2, inv)
        np.testing.assert_allclose(np.asarray(fold_attention(q, k, v, length, q_pos, mask, c2, inv)),
                                   np.asarray(w2), rtol=2e-5, atol=2e-5)


def test_committed_keys_and_beta():
    cfg = FoldConfig(sinks=2, window=4, far_distance=7, chunk=2, sharpen=0.5)
    seg, pos, n_far = fold.committed_keys(jnp.array([10, 5]), 12, jnp.array([[12, 12], [5, 6]]), cfg)
    S, L, F, P = ref.SEG_SINK, ref.SEG_LOCAL, ref.SEG_FAR, ref.SEG_PAD
    assert seg.tolist() == [[S, S, F, F, F, F, L, L, L, L, P, P], [S, S, L, L, L, P, P, P, P, P, P, P]]
    assert pos[0].tolist() == [0, 1, 5, 5, 5, 5, 6, 7, 8, 9, 10, 11]  # far keys at min q_pos - 7 = 5
    assert n_far.tolist() == [4, 0]
    np.testing.assert_allclose(fold.beta(n_far, cfg), [1 + 0.5 * np.log(4 / 4), 1.0])
    np.testing.assert_allclose(fold.beta(jnp.array([64.0]), cfg), [1 + 0.5 * np.log(16)], rtol=1e-6)
    loglog = FoldConfig(sinks=2, window=4, beta_rule="log-log")
    np.testing.assert_allclose(fold.beta(jnp.array([64.0, 2.0, 0.0]), loglog), [np.log(64) / np.log(4), 1.0, 1.0], rtol=1e-6)


def test_feature_step_is_wired_to_fold_attention(target):
    """The feature drafter's FOLD step = its projections, the reference attention, its MLP/head."""
    head = FeatureHead(FeatureConfig.for_target(target.config, target_layers=(0, 1)), nnx.Rngs(4))
    attention = fold.FoldAttention.for_model(FoldConfig(sinks=1, window=5, chunk=4, sharpen=1.0), target.config)
    B, C, E = 2, 40, target.config.hidden_size
    length = jnp.array([25, 31])
    cache = kvcache.set_length(kvcache.init(1, B, C, 2, 16), length)
    cache = dataclasses_replace_k(cache, jax.random.normal(jax.random.key(5), cache.k.shape),
                                  jax.random.normal(jax.random.key(6), cache.v.shape))
    tokens = jnp.array([[3, 7], [11, 2]])
    x = jax.random.normal(jax.random.key(7), (B, 2, E))
    mask = jnp.broadcast_to(jnp.array([[True, True, False], [True, False, True]]), (B, 2, 3))  # depth 1 of a tree
    pos = jnp.broadcast_to(length[:, None] + 1, (B, 2))
    graphdef, state = nnx.split((head, target))
    step = jax.jit(lambda state, *a: feature_lib.step(*nnx.merge(graphdef, state), *a, attention=attention))
    _, logits, new_cache = step(state, tokens, x, pos, cache, mask, jnp.full((B,), 1, jnp.int32))
    q, k, v = feature_lib.qkv(head, target, tokens, x, pos, rope=False)
    written = kvcache.write(cache, 0, k, v, jnp.full((B,), 1, jnp.int32))
    # Keys cached un-rotated (RoPE would move them by O(1)); the jitted step and the eager projection
    # may round differently (2e-7 on an Intel Xeon), so equal within float32 noise.
    np.testing.assert_allclose(np.asarray(new_cache.k), np.asarray(written.k), rtol=0, atol=1e-5)
    want, _ = _expected_per_query(q, written.k[0], written.v[0], length, pos, mask, length[:, None] + jnp.array([[0, 1, 1]]),
                                  attention.cfg, transformer.rope_inv_freq(target.config))
    _, want_logits = feature_lib.finish(head, target, x, want)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(want_logits), rtol=1e-4, atol=1e-4)


def dataclasses_replace_k(cache, k, v):
    return dataclasses.replace(cache, k=k, v=v)


# ----------------------------------------------------------------------------- lossless with far keys

_logits_fn = prefix_logits_fn  # compare_greedy's reference logits (helpers)


@pytest.mark.parametrize("kind,tree", [("lm", "depth=3,topk=2,nodes=6"), ("feature", "chain=3")])
def test_greedy_equals_autoregressive_with_far_keys(target, lm_drafter, feature_drafter, kind, tree):
    prompts = _prompts([70, 101], seed=3)  # ragged; n_far 52 and 83 at the start
    drafter = (lm_drafter if kind == "lm" else feature_drafter).with_fold(FAR)
    ref_out = specjax.generate(target, prompts, max_new_tokens=20, eos_token_id=())
    got = specjax.generate(target, prompts, max_new_tokens=20, eos_token_id=(), drafters=[drafter], tree=tree)
    n_exact, n_near = compare_greedy(ref_out.sequences(), got.sequences(), _logits_fn(target, prompts))
    assert n_exact + n_near == 2 and (got.lengths == 20).all()
    assert (got.stats["rounds"] >= 1).all()
    assert (got.stats["tau"] >= 1.0).all()


# ----------------------------------------------------------------------------- bad input

def test_bad_input_errors(target, lm_drafter):
    with pytest.raises(ValueError, match="lambda .* must be >= 0"):
        FoldConfig(sharpen=-0.1)
    with pytest.raises(ValueError, match="lambda"):
        FoldConfig.parse("window=64,lambda=-1")
    with pytest.raises(ValueError, match="far_distance .* must be >= the window"):
        FoldConfig(window=64, far_distance=10)
    with pytest.raises(ValueError, match="unknown key 'windw'"):
        FoldConfig.parse("windw=3")
    with pytest.raises(ValueError, match="window must be an integer"):
        FoldConfig.parse("window=big")
    with pytest.raises(ValueError, match="beta rule"):
        FoldConfig(beta_rule="cubic")
    with pytest.raises(ValueError, match="'ngram' drafter takes no FOLD"):
        load_drafter("ngram", target, fold=FAR)
    with pytest.raises(ValueError, match="'ngram' drafter has none"):
        NgramDrafter().with_fold(FAR)
    assert FoldConfig.parse("default") == FoldConfig()
    assert FoldConfig.parse("sinks=1,window=8,lambda=0.25,beta=log-log,positions=off,far=9") == FoldConfig(
        sinks=1, window=8, sharpen=0.25, beta_rule="log-log", fold_positions=False, far_distance=9)
    # a window larger than the drafter's cache: refused by generate before anything is traced
    big = LMDrafter(lm_drafter.model, fold=FoldConfig(window=4096))
    before = engine.trace_count()
    with pytest.raises(ValueError, match=r"FOLD window \(4096\) is larger than the drafter's cache capacity"):
        specjax.generate(target, [[1, 2, 3]], max_new_tokens=4, drafters=[big])
    with pytest.raises(ValueError, match="larger than the drafter's cache capacity"):
        specjax.generate(target, [[1, 2, 3]], max_new_tokens=4, drafters=[big], capacity=512)
    assert engine.trace_count() == before


def test_cli_fold_flag(tmp_path, capsys, monkeypatch):
    from tokenizers import ByteLevelBPETokenizer

    from specjax.cli import main
    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(["def add(a, b):\n    return a + b\n" * 3] * 5, vocab_size=280, special_tokens=["<|endoftext|>"],
                            show_progress=False)
    cfg = ModelConfig(vocab_size=288, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
                      head_dim=16, tie_word_embeddings=True, max_position_embeddings=128)
    path = str(tmp_path / "m")
    specjax.save_model(specjax.init_model(cfg, seed=0), path, tokenizer=tok)
    prompt = "def add(a, b):\n    return a + b\n" * 4
    base = ["generate", "--model", path, "--prompt", prompt, "--max-new-tokens", "6", "--ignore-eos", "--json"]
    # (a run with --fold is the engine path tested above; here: the flag reaches the drafter)
    from specjax.drafters import compose as compose_mod  # the CLI loads its drafters through compose
    seen = []

    def spy(spec, target, fold=None, **kw):
        seen.append(fold)
        return load_drafter(spec, target, fold=fold, **kw)

    monkeypatch.setattr(compose_mod, "load_drafter", spy)
    with pytest.raises(SystemExit) as e:  # refused by generate's check, before tracing
        main(base + ["--drafter", path, "--fold", "sinks=1,window=1000,lambda=0.25"])
    assert e.value.code == 2 and seen == [FoldConfig(sinks=1, window=1000, sharpen=0.25)]
    assert "larger than the drafter's cache capacity" in capsys.readouterr().err
    monkeypatch.undo()

    def usage_error(argv, needle):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert needle in err and "Traceback" not in err

    usage_error(base + ["--fold", "default"], "needs a --drafter")
    usage_error(base + ["--drafter", "ngram", "--fold", "default"], "'ngram' drafter takes no FOLD")
    usage_error(base + ["--drafter", path, "--fold", "lambda=-2"], "must be >= 0")


# ----------------------------------------------------------------------------- the benchmark tool

def test_bench_long_smoke(tmp_path):
    """The tool end to end on tiny random models (one variant, one length run and one skipped, to
    keep the test short; `--smoke` alone runs every variant and both drafters)."""
    from tools import bench_long
    out = tmp_path / "long"
    assert bench_long.main(["--smoke", "--drafters", "lm", "--lengths", "160,512", "--variants", "fold (both)",
                            "--tree-lm", "chain=2", "--ngram", "--switch", "--tree-ngram", "chain=3",
                            "--out", str(out)]) == 0
    data = json.loads(out.with_suffix(".json").read_text())
    md = out.with_suffix(".md").read_text()
    assert [(r["drafter"], r["length"], r["variant"]) for r in data["rows"]] == [
        ("ngram", 160, "plain"), ("lm", 160, "fold (both)"), ("ngram|lm", 160, "plain"), ("ngram|lm", 160, "fold (both)")]
    for r in data["rows"]:
        assert r["tau"] >= 1.0 and r["speedup"] > 0 and r["mismatch"] == 0 and r["exact"] + r["near_tie"] == 2
        assert r["decode_tokens_per_s"] > 0 and r["prefill_s"] > 0 and r["decode_speedup"] > 0
    (r,) = [r for r in data["rows"] if r["drafter"] == "lm"]
    assert r["n_far"] > 0 and 0.0 < r["far_mass"] < 1.0 and r["entropy"] > 0 and abs(r["attn_total"] - 1) < 1e-4
    assert "| lm | 160 |" in md and "context 512 skipped: beyond the target's max_position_embeddings (300)" in md
    assert out.with_suffix(".png").stat().st_size > 0
