"""Speculative generation: greedy output equals autoregressive greedy output token for token
(every drafter, chain / static tree / dynamic tree, batch 1 and a ragged batch of 4), one
compilation per configuration, and clear errors for bad input before anything is traced."""
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from helpers import compare_greedy, noisy_lm_drafter, prefix_logits_fn, tiny_drafter_model, tiny_target
from specjax.engine import loop as engine
from specjax.drafters import LMDrafter, NgramDrafter
from specjax.models import transformer
from specjax.models.config import ModelConfig

VOCAB = 48
TREES = ["chain=4", "[[0],[1],[2],[0,0],[0,1],[1,0],[0,0,0],[0,0,0,0]]", "depth=4,topk=3,nodes=12"]


@pytest.fixture(scope="module")
def target():
    return tiny_target(VOCAB)  # the shared tiny target (helpers), as test_verify_width's and test_fold's


@pytest.fixture(scope="module")
def noisy_drafter():
    return noisy_lm_drafter(VOCAB)  # the target plus noise (scale 0.1, seed 9)


@pytest.fixture(scope="module")
def small_drafter():
    return LMDrafter(tiny_drafter_model(VOCAB))


def _prompts(batch, seed=0, repetitive=False):
    rng = np.random.default_rng(seed)
    out = []
    for n in (7, 23, 12, 40)[:batch]:
        if repetitive:  # a phrase repeated: prompt lookup has something to find
            phrase = rng.integers(0, VOCAB, 6).tolist()
            out.append((phrase * 8)[:n])
        else:
            out.append(rng.integers(0, VOCAB, n).tolist())
    return out


_logits_fn = prefix_logits_fn  # compare_greedy's reference logits (helpers; test_verify_width's too)


def _check_exact(target, drafter, tree, batch, repetitive=False, new=32):
    prompts = _prompts(batch, seed=batch, repetitive=repetitive)
    ref = specjax.generate(target, prompts, max_new_tokens=new)
    got = specjax.generate(target, prompts, max_new_tokens=new, drafters=[drafter], tree=tree)
    n_exact, n_near = compare_greedy(ref.sequences(), got.sequences(), _logits_fn(target, prompts))
    assert n_exact + n_near == batch
    assert (got.lengths == new).all()
    return got


@pytest.mark.parametrize("tree", TREES)
def test_lm_drafter_greedy_exact_batch4(target, noisy_drafter, tree):
    got = _check_exact(target, noisy_drafter, tree, batch=4)
    tau = got.stats["tau"]
    assert (tau > 1.2).all(), f"the noisy self-drafter should be accepted often: tau {tau}"
    assert (got.stats["rounds"] < 32).all()
    # rows accept different lengths: the batch really is ragged in acceptance too
    assert len(set(got.stats["accepted"].tolist())) > 1


@pytest.mark.parametrize("tree", TREES)
def test_ngram_drafter_greedy_exact_batch4(target, tree):
    got = _check_exact(target, NgramDrafter(), tree, batch=4, repetitive=True)
    assert got.stats["depth_acceptance"].shape[1] == engine.tree_lib.parse_tree_spec(tree).max_depth
    assert got.stats["accepted"].sum() > 0


def test_ngram_tree_is_a_trie_of_the_best_matches():
    """Context "1 2 3 1 2 4 1 2 5 1 2": the suffix "1 2" matched three times, most recent first;
    their continuations share no prefix beyond the root. Shared prefixes merge; a budget cut keeps
    the shallowest nodes (parents before children)."""
    from specjax.drafters.ngram import trie
    ctx = jnp.array([[1, 2, 3, 1, 2, 4, 1, 2, 5, 1, 2, 0, 0, 0]])
    draft, valid = NgramDrafter().lookup(ctx, jnp.array([11]), 3, 3)
    assert draft.tolist() == [[[5, 1, 2], [4, 1, 2], [3, 1, 2]]] and bool(valid.all())
    chains = jnp.array([[[1, 2, 3], [1, 2, 4], [5, 6, 7]], [[1, 2, 3], [1, 2, 3], [1, 7, 0]]])
    ok = jnp.ones((2, 3, 3), bool).at[1, 2, 2].set(False)
    t = trie(jnp.array([9, 9]), chains, ok, 12)
    assert t.tokens[0].tolist() == [9, 1, 5, 2, 6, 3, 4, 7, 0, 0, 0, 0]
    assert t.parents[0].tolist() == [-1, 0, 0, 1, 2, 3, 3, 4, -1, -1, -1, -1]
    assert t.tokens[1, :5].tolist() == [9, 1, 2, 7, 3] and t.parents[1, :5].tolist() == [-1, 0, 1, 1, 2]
    assert t.valid.sum(1).tolist() == [8, 5]  # the duplicate chain and the invalid token add nothing
    cut = trie(jnp.array([9, 9]), chains, ok, 5)
    assert cut.tokens[0].tolist() == [9, 1, 5, 2, 6] and cut.depth[0].tolist() == [0, 1, 1, 2, 2]


def test_independent_small_drafter_batch1(target, small_drafter):
    _check_exact(target, small_drafter, TREES[1], batch=1)


def test_ngram_batch1_chain(target):
    _check_exact(target, NgramDrafter(max_ngram=3), "chain=6", batch=1, repetitive=True)


def test_eos_stops_each_row(target, noisy_drafter):
    prompts = _prompts(4, seed=4)
    ref = specjax.generate(target, prompts, max_new_tokens=24)
    eos = int(ref.sequences()[1][5])  # a token row 1 emits early
    ar = specjax.generate(target, prompts, max_new_tokens=24, eos_token_id=eos)
    sp = specjax.generate(target, prompts, max_new_tokens=24, eos_token_id=eos, drafters=[noisy_drafter],
                          tree=TREES[0])
    assert sp.sequences() == ar.sequences()
    assert sp.lengths[1] <= 6 and sp.sequences()[1][-1] == eos


def test_one_compilation_per_configuration(target, noisy_drafter):
    kw = dict(max_new_tokens=16, drafters=[noisy_drafter], tree="chain=3")
    specjax.generate(target, _prompts(2, seed=1), **kw)
    before = engine.trace_count()
    specjax.generate(target, _prompts(2, seed=2), **kw)  # other prompts, same bucket
    specjax.generate(target, _prompts(2, seed=1), temperature=0.8, **kw)
    specjax.generate(target, _prompts(2, seed=1), temperature=0.5, top_k=5, seed=3, **kw)
    assert engine.trace_count() == before + 1  # greedy -> sampling is one new program; values are traced


def test_sampling_is_reproducible(target, noisy_drafter):
    kw = dict(max_new_tokens=16, drafters=[noisy_drafter], tree=TREES[1], temperature=1.0)
    a = specjax.generate(target, _prompts(2), seed=1, **kw)
    b = specjax.generate(target, _prompts(2), seed=1, **kw)
    c = specjax.generate(target, _prompts(2), seed=2, **kw)
    assert a.sequences() == b.sequences() and a.sequences() != c.sequences()


def test_bad_input_is_refused_before_tracing(target, noisy_drafter):
    before = engine.trace_count()
    other_vocab = LMDrafter(transformer.init_model(ModelConfig(vocab_size=VOCAB + 1, hidden_size=32,
                            intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16)))
    p = _prompts(1)
    with pytest.raises(ValueError, match="vocabulary"):
        specjax.generate(target, p, drafters=[other_vocab])
    with pytest.raises(ValueError, match="capacity"):
        specjax.generate(target, p, max_new_tokens=8, drafters=[noisy_drafter], tree="chain=8", capacity=20)
    with pytest.raises(ValueError, match="malformed"):
        specjax.generate(target, p, drafters=[noisy_drafter], tree="[[0],[2]]")
    with pytest.raises(ValueError, match="temperature"):
        specjax.generate(target, p, drafters=[noisy_drafter], temperature=-0.5)
    with pytest.raises(ValueError, match="temperature"):
        specjax.generate(target, p, drafters=[noisy_drafter], verify="sampled")
    with pytest.raises(ValueError, match="unknown verification"):
        specjax.generate(target, p, drafters=[noisy_drafter], verify="lenient", temperature=1.0)
    with pytest.raises(ValueError, match="deterministic"):
        specjax.generate(target, p, drafters=[NgramDrafter()], verify="sampled", temperature=1.0)
    with pytest.raises(ValueError, match="static tree"):
        specjax.generate(target, p, drafters=[noisy_drafter], verify="sampled", temperature=1.0,
                         tree="depth=3,topk=2,nodes=5")
    assert engine.trace_count() == before


@pytest.mark.parametrize("mode", ["topk", "sample"])
def test_chain_loop_drafts_what_the_unrolled_chain_drafts(target, noisy_drafter, monkeypatch, mode):
    """A chain's depths, and a dynamic tree's depths past the root, run in one `fori_loop` (traced
    depth, full-width masks): the tree, its scores and q equal the unrolled expansion's, for the lm
    and the feature (EAGLE) drafter."""
    import itertools

    import jax
    from flax import nnx
    from specjax.spec import sampling, tree as tree_lib
    from specjax.drafters import FeatureDrafter
    from specjax.drafters.base import DraftContext
    from specjax.drafters.feature import FeatureConfig, FeatureHead
    from specjax.models import family
    head = FeatureHead(FeatureConfig.for_target(target.config, target_layers=(0, 1)), nnx.Rngs(3))
    prompt = jnp.asarray(_prompts(2, seed=3)[0][:7] * 2).reshape(2, 7)
    lengths = jnp.asarray([7, 5])
    fam = family(target)
    pre = fam.prefill(target, prompt, lengths, fam.init_cache(target, 2, 64), hidden_layers=(0, 1))
    specs = ["chain=5"] + (["depth=4,topk=3,nodes=10"] if mode == "topk" else [])  # dynamic trees rank top-k
    for spec, d in itertools.product(specs, (noisy_drafter, FeatureDrafter(head, target))):
        ctx = DraftContext(tree_lib.parse_tree_spec(spec), mode, sampling.SamplingParams.make(0.8), jax.random.key(2))
        state = d.init(prompt, lengths, 64, pre)
        looped = d.propose(state, prompt[:, 0], ctx)
        monkeypatch.setattr(tree_lib, "LOOP_MIN_DEPTH", 10 ** 6)
        unrolled = d.propose(state, prompt[:, 0], ctx)
        monkeypatch.undo()
        for f in ("tokens", "parents", "depth", "valid"):
            np.testing.assert_array_equal(np.asarray(getattr(looped.tree, f)), np.asarray(getattr(unrolled.tree, f)))
        np.testing.assert_allclose(np.asarray(looped.tree.score), np.asarray(unrolled.tree.score), atol=1e-5)
        if unrolled.probs is not None:
            np.testing.assert_allclose(np.asarray(looped.probs), np.asarray(unrolled.probs), atol=1e-6)
