"""Compiled verify widths (design §3b): a drafter that cuts its drafts (`Drafter.verify_widths`)
has the target verify only the smallest compiled width that holds every active row's last valid
node, chosen per round by `lax.switch` inside the one jitted program.

- greedy output equals autoregressive output token for token (dense and hybrid targets, a ragged
  batch of 3) with a drafter that cuts each row's chain at a data-dependent depth;
- the program traces once, each width's branch once;
- the stats count the verified widths (`mean_verify_width` < N), and a drafter that keeps only the
  root verifies width 1; the switch really runs the smaller forward;
- `verify` never accepts an invalid node of a chain or a tree;
- bad widths are refused before tracing.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from helpers import compare_greedy, noisy_lm_drafter, tiny_target
from specjax.engine import loop as engine
from specjax.spec import tree as tree_lib, verify as verify_lib
from specjax.drafters import Drafter
from specjax.models import hybrid, transformer
from specjax.spec.sampling import SamplingParams

import test_hybrid
import test_speculative

VOCAB = 48
CHAIN = "chain=4"
WIDTHS = (1, 2, 3, 5)


class CutDrafter(Drafter):
    """Wraps a drafter and cuts each row's draft after a depth that varies by row and round (a
    function of the root token): nodes deeper than the cut are marked invalid."""
    name = "cut"
    gives_q = True

    def __init__(self, inner: Drafter, widths=WIDTHS, salt: int = 0, keep_root_only: bool = False):
        self.inner = inner
        self.widths = tuple(widths)
        self.salt = salt
        self.keep_root_only = keep_root_only

    @property
    def vocab_size(self):
        return self.inner.vocab_size

    def verify_widths(self, spec):
        return self.widths

    def check_tree(self, spec, rule):
        return self.inner.check_tree(spec, rule)

    def validate(self, capacity):
        self.inner.validate(capacity)

    def init(self, prompt_BxP, lengths_B, capacity, target_out):
        return self.inner.init(prompt_BxP, lengths_B, capacity, target_out)

    def propose(self, state, root_B, ctx):
        prop = self.inner.propose(state, root_B, ctx)
        tree = prop.tree
        D = ctx.spec.max_depth
        cut_B = jnp.zeros_like(root_B) if self.keep_root_only else (root_B * 7 + self.salt) % (D + 1)
        valid = tree.valid & (tree.depth <= cut_B[:, None])
        return dataclasses.replace(prop, tree=dataclasses.replace(tree, valid=valid))

    def commit(self, state, committed):
        return self.inner.commit(state, committed)


# ----------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def dense_target():
    return tiny_target(VOCAB)  # shared (helpers), as test_speculative's


@pytest.fixture(scope="module")
def dense_drafter():
    return noisy_lm_drafter(VOCAB)  # the target plus noise (scale 0.1, seed 9)


@pytest.fixture(scope="module")
def hybrid_target():
    return test_hybrid._random_model(hybrid.HybridModel, test_hybrid.TARGET, 0, out_scale=test_hybrid.OUT_SCALE)


@pytest.fixture(scope="module")
def hybrid_drafter(hybrid_target):
    return test_hybrid._drafter_for(hybrid_target, 7)


def _prompts(seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, n).tolist() for n in (7, 23, 12)]  # ragged, one 32-token bucket


def _check_exact(target, drafter, logits_fn, prompts, new=24):
    ref = specjax.generate(target, prompts, max_new_tokens=new)
    got = specjax.generate(target, prompts, max_new_tokens=new, drafters=[drafter], tree=CHAIN)
    n_exact, n_near = compare_greedy(ref.sequences(), got.sequences(), logits_fn(target, prompts))
    assert n_exact + n_near == len(prompts)
    assert (got.lengths == new).all()
    return got


def _check_stats(got, N=5):
    st = got.stats
    w = st["mean_verify_width"]
    assert w.shape == (3,)
    assert ((w >= 1) & (w <= N)).all(), w
    assert (w < N).all(), f"cut drafts should verify fewer than {N} nodes on average: {w}"
    # every round verifies one of the compiled widths: the per-row sums are consistent with that
    assert (st["verified_nodes"] >= st["rounds"]).all() and (st["verified_nodes"] <= N * st["rounds"]).all()
    # a cut never accepts past its depth, yet the kept drafts are accepted
    assert st["accepted"].sum() > 0


# ----------------------------------------------------------------------------- end to end

def test_cut_chain_greedy_exact_dense(dense_target, dense_drafter):
    got = _check_exact(dense_target, CutDrafter(dense_drafter), test_speculative._logits_fn, _prompts(1))
    _check_stats(got)


def test_cut_chain_greedy_exact_hybrid(hybrid_target, hybrid_drafter):
    got = _check_exact(hybrid_target, CutDrafter(hybrid_drafter, salt=3), test_hybrid._logits_fn, _prompts(2))
    _check_stats(got)


def test_one_trace_each_branch_once(dense_target, dense_drafter, monkeypatch):
    calls = []
    real = transformer.pad_nodes
    monkeypatch.setattr(transformer, "pad_nodes", lambda c, n: (calls.append(n), real(c, n))[1])
    d = CutDrafter(dense_drafter)
    kw = dict(max_new_tokens=13, drafters=[d], tree=CHAIN)  # a configuration no other test compiles
    before = engine.trace_count()
    a = specjax.generate(dense_target, _prompts(3), **kw)
    mid = engine.trace_count()
    b = specjax.generate(dense_target, _prompts(4), **kw)  # other prompts, same bucket
    assert mid == before + 1 and engine.trace_count() == mid
    assert calls == [5] * len(WIDTHS), calls  # one branch per width, each traced once
    assert a.sequences() != b.sequences()


def test_root_only_drafts_verify_width_one(dense_target, dense_drafter):
    got = _check_exact(dense_target, CutDrafter(dense_drafter, keep_root_only=True), test_speculative._logits_fn,
                       _prompts(5), new=12)
    assert (got.stats["mean_verify_width"] == 1).all(), got.stats["mean_verify_width"]
    assert (got.stats["accepted"] == 0).all()
    assert (got.stats["rounds"] == 11).all()  # one token per round after the first


def test_one_width_counts_the_whole_tree(dense_target, dense_drafter):
    got = specjax.generate(dense_target, _prompts(1), max_new_tokens=12, drafters=[dense_drafter], tree=CHAIN)
    assert (got.stats["mean_verify_width"] == 5).all()
    assert (got.stats["verified_nodes"] == 5 * got.stats["rounds"]).all()


@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_switch_runs_the_smaller_forward(kind, dense_target, hybrid_target):
    """The branch picked for a tree whose last valid node (over active rows) is node 2 is width 3:
    its logits / node states equal the full forward's on those nodes, zero past them."""
    model = dense_target if kind == "dense" else hybrid_target
    fam = transformer if kind == "dense" else hybrid
    B, D, N = 3, 4, 5
    rng = np.random.default_rng(0)
    prompt = jnp.asarray(rng.integers(0, VOCAB, (B, 8)), jnp.int32)
    cache = fam.prefill(model, prompt, jnp.array([8, 5, 7]), fam.init_cache(model, B, 32)).cache
    tree = tree_lib.chain_tree(jnp.asarray(rng.integers(0, VOCAB, B), jnp.int32),
                               jnp.asarray(rng.integers(0, VOCAB, (B, D)), jnp.int32))
    depth_cut = jnp.array([2, 1, 4])  # row 2 keeps everything, but it is finished
    tree = dataclasses.replace(tree, valid=tree.depth <= depth_cut[:, None])
    active = jnp.array([True, True, False])
    assert int(engine.verify_need(tree, active)) == 3
    logits, hidden, tcache, width, vtree = engine._verify_forward_switch(model, fam, tree, cache, active, WIDTHS, D,
                                                                         (0,))
    assert int(width) == 3
    assert logits.shape == (B, N, VOCAB) and hidden[0].shape[:2] == (B, N)
    assert not np.asarray(vtree.valid[:, 3:]).any()
    full = fam.forward(model, tree.tokens, tree_lib.positions(tree, cache.length), cache,
                       tree_lib.ancestor_mask(tree, D), hidden_layers=(0,), parents=tree.parents)
    np.testing.assert_allclose(np.asarray(logits[:, 3:]), 0)
    np.testing.assert_allclose(np.asarray(hidden[0][:, 3:]), 0)
    # the first three nodes see only their valid ancestors in both forwards (rows 0 and 1 agree; row
    # 2 is finished, its nodes past the width were not run)
    np.testing.assert_allclose(np.asarray(logits[:2, :3]), np.asarray(full.logits[:2, :3]), atol=1e-4, rtol=1e-4)
    if kind == "hybrid":
        assert tcache.node_state.shape == full.cache.node_state.shape
        assert tcache.node_conv.shape == full.cache.node_conv.shape
        np.testing.assert_allclose(np.asarray(tcache.node_state[:, :, :3]),
                                   np.asarray(full.cache.node_state[:, :, :3]), atol=1e-4, rtol=1e-4)
        np.testing.assert_allclose(np.asarray(tcache.node_state[:, :, 3:]), 0)
    # all rows finished: width 1
    assert int(engine.verify_need(tree, jnp.zeros((B,), bool))) == 1
    # every row active: row 2 needs the whole tree
    assert int(engine.verify_need(tree, jnp.ones((B,), bool))) == 5


# ----------------------------------------------------------------------------- verification

@pytest.mark.parametrize("rule", ["greedy", "deterministic", "sampled"])
@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_verify_never_accepts_an_invalid_node(rule, shape):
    """The target agrees with every drafted token, yet the walk stops at the first invalid node."""
    V, B = 16, 2
    if shape == "chain":
        parents = np.array([-1, 0, 1, 2, 3])
        cut = np.array([2, 0])  # row 0 keeps depth <= 2, row 1 only the root
    else:  # root -> 1 -> 3 -> 4 and root -> 2
        parents = np.array([-1, 0, 0, 1, 3])
        cut = np.array([2, 0])
    N = len(parents)
    depth = np.zeros(N, np.int64)
    for i in range(1, N):
        depth[i] = depth[parents[i]] + 1
    tokens = np.array([[3, 5, 6, 7, 8], [4, 9, 10, 11, 12]])
    # logits at node i favour (by far) the token of node i's first child
    logits = np.full((B, N, V), -1e4, np.float32)
    for b in range(B):
        for i in range(N):
            kids = [j for j in range(N) if parents[j] == i]
            logits[b, i, tokens[b, kids[0]] if kids else 0] = 0.0
    valid = depth[None] <= cut[:, None]
    tree = tree_lib.TreeBuffers(tokens=jnp.asarray(tokens, jnp.int32),
                                parents=jnp.broadcast_to(jnp.asarray(parents, jnp.int32), (B, N)),
                                depth=jnp.broadcast_to(jnp.asarray(depth, jnp.int32), (B, N)),
                                valid=jnp.asarray(valid), score=jnp.zeros((B, N)),
                                source=jnp.zeros((B, N), jnp.int8))
    probs = jax.nn.softmax(jnp.asarray(logits), axis=-1)
    vd = verify_lib.verify(tree, jnp.asarray(logits), jax.random.key(0), rule=rule, max_depth=int(depth.max()),
                           params=SamplingParams.make(1.0, 0, 1.0), draft_probs_BxNxV=probs)
    assert np.asarray(vd.num_accepted).tolist() == cut.tolist()
    path = np.asarray(vd.path)
    for b in range(B):
        assert valid[b, path[b]].all()
    # with every node valid, the same walk goes to the bottom
    tree = dataclasses.replace(tree, valid=jnp.ones((B, N), bool))
    vd = verify_lib.verify(tree, jnp.asarray(logits), jax.random.key(0), rule=rule, max_depth=int(depth.max()),
                           params=SamplingParams.make(1.0, 0, 1.0), draft_probs_BxNxV=probs)
    assert np.asarray(vd.num_accepted).tolist() == [int(depth.max())] * B


# ----------------------------------------------------------------------------- bad widths

@pytest.mark.parametrize("widths,match", [
    ((1, 3, 2, 5), "ascending"),
    ((1, 2, 2, 5), "ascending"),
    ((0, 2, 5), "positive"),
    ((1, 2, 4), "node count 5"),
    ((1, 2, 6), "node count 5"),
    ((), "at least one"),
    ((1.5, 5), "positive integers"),
])
def test_bad_widths_are_refused_before_tracing(dense_target, dense_drafter, widths, match):
    before = engine.trace_count()
    with pytest.raises(ValueError, match=match):
        specjax.generate(dense_target, _prompts(1), max_new_tokens=8, drafters=[CutDrafter(dense_drafter, widths)],
                         tree=CHAIN)
    assert engine.trace_count() == before
