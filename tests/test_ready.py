"""ReaDy: the block drafter reading the hybrid target's committed recurrent states (design §5c).

- `hybrid.prefix_states` gives the committed state a prefill of each prefix leaves;
- the drafting pass (state from the prefill, then from `Committed.target` after a round) equals the
  training pass (states at the anchors), and the state really changes the draft;
- a fresh reader adds nothing (U_out = 0: the DSpark drafter of the same seed, to the bit), and a
  zeroed state reads nothing;
- greedy speculative output equals autoregressive output on a tiny hybrid target, batch 1 and 4
  with ragged prompts, chain and a tree from the one pass; one trace; and through the engine's
  rounds the drafter holds the target's committed state (that of a prefill of the committed tokens);
- the sampled-candidates rule keeps the target's distribution (chi-square), and a planted bug (q
  reported from the drafter without its state read) is caught;
- refusals before tracing, and the checkpoint round trip.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import specjax
from helpers import first_two_chi_squares, tiny_hybrid, tiny_hybrid_config, tiny_target, train_block_on_own_outputs
from specjax.engine import loop as engine
from specjax.spec import verify as V
from specjax.drafters import load_drafter
from specjax.drafters.base import Committed, DraftContext
from specjax.drafters.block import (BlockConfig, BlockDrafter, BlockHead, ReadyDrafter, load_block_head, save_block_head,
                                    train_logits)
from specjax.models import family, hybrid
from specjax.spec.sampling import SamplingParams
from specjax.spec.tree import parse_tree_spec

VOCAB = 64
W = 4
EVERY = 4
HYBRID = tiny_hybrid_config(VOCAB)  # 3 layers: linear, full, linear attention


def _ready_cfg(target_cfg, **kw):
    base = dict(block_size=W, num_layers=2, markov_rank=8, state_layers="all", reader_out_rank=8)
    base.update(kw)
    return BlockConfig.for_target(target_cfg, **base)


def _loud(head, seed=0):
    """A random (nonzero) output map, so the reader's update is felt."""
    head.reader.out.set_value(0.5 * jax.random.normal(jax.random.key(seed), head.reader.out.get_value().shape))
    return head


def _states_at(target, toks, anchors):
    _, st = jax.jit(hybrid.prefix_states, static_argnums=2)(target, toks, EVERY)  # all linear layers: what `cfg` reads
    return jnp.take_along_axis(st, (anchors // EVERY)[None, :, :, None, None, None], axis=2)


def _forward(target, toks, layers):  # the target over a causal block (jitted: eager hybrid ops are slow)
    B, T = toks.shape
    fam = family(target)
    return jax.jit(lambda m, t: fam.forward(m, t, jnp.broadcast_to(jnp.arange(T)[None], (B, T)),
                                            fam.init_cache(m, B, T), jnp.tril(jnp.ones((B, T, T), bool)),
                                            hidden_layers=layers))(target, toks)


@pytest.fixture(scope="module")
def target():
    return tiny_hybrid(VOCAB)  # HYBRID, seed 1 (shared)


def test_prefix_states_are_the_committed_states(target):
    toks = jnp.asarray(np.random.default_rng(0).integers(0, VOCAB, (2, 40)), jnp.int32)
    out, st = jax.jit(hybrid.prefix_states, static_argnums=(2, 3))(target, toks, EVERY, (0, 2))
    assert st.shape == (2, 2, 40 // EVERY + 1, 2, 8, 8)
    np.testing.assert_array_equal(np.asarray(st[:, :, 0]), 0.0)  # entry 0: the empty state
    fam = family(target)
    prefill = jax.jit(lambda m, a: fam.prefill(m, toks, jnp.stack([a, a]), fam.init_cache(m, 2, 64)).cache.state)
    for a in (4, 12, 40):
        # float32 noise of the two paths: up to 1.13e-6 as the tests compile (XLA's classic CPU emitters)
        np.testing.assert_allclose(np.asarray(st[:, :, a // EVERY]), np.asarray(prefill(target, jnp.int32(a))),
                                   atol=2e-6)
    ref = _forward(target, toks, (0, 2))
    np.testing.assert_allclose(np.asarray(out.logits), np.asarray(ref.logits), atol=1e-4)
    for a, b in zip(out.hidden, ref.hidden):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4)


def test_drafting_pass_equals_training_pass(target):
    cfg = _ready_cfg(target.config)
    head = _loud(BlockHead(cfg, nnx.Rngs(3)))
    d = ReadyDrafter(head, target)
    assert d.head.config.reads_state and cfg.state_layers == (0, 2) and d.state_index == (0, 1)
    fam = family(target)
    toks = jnp.asarray(np.random.default_rng(0).integers(0, VOCAB, (1, 40)), jnp.int32)
    feats = jnp.concatenate(_forward(target, toks, cfg.target_layers).hidden, -1)
    anchors = jnp.asarray([[4, 16, 28]])
    S = _states_at(target, toks, anchors)
    train = jax.jit(lambda s: train_logits(head, target, toks, feats, anchors, s)[2:4])
    h_train, base_train = train(S)
    h_zero, _ = train(jnp.zeros_like(S))
    assert float(jnp.abs(h_train - h_zero).max()) > 0.1  # the state changes the draft

    @jax.jit
    def drafted(a):
        pre = fam.prefill(target, toks, a[None], fam.init_cache(target, 1, 64), hidden_layers=cfg.target_layers)
        return d.draft_block(d.init(toks, a[None], 64, pre), toks[:, a])[:2]

    # The two passes reach the states by different float32 paths (chunked prefill vs the training
    # pass's states): up to 3e-4 apart on an Intel Xeon; the state's own effect above is > 0.1.
    for j, a in enumerate((4, 16, 28)):
        base, h = drafted(jnp.int32(a))
        np.testing.assert_allclose(np.asarray(base[0]), np.asarray(base_train[0, j]), atol=1e-3, rtol=1e-4)
        np.testing.assert_allclose(np.asarray(h[0]), np.asarray(h_train[0, j]), atol=1e-3, rtol=1e-4)
    # a round: 13 committed, the target extends by 3 (its committed state now after 16 tokens), and
    # the drafter reads that state from `Committed.target` and drafts as training does at anchor 16
    @jax.jit
    def after_a_round():
        pre = fam.prefill(target, toks, jnp.asarray([13]), fam.init_cache(target, 1, 64),
                          hidden_layers=cfg.target_layers)
        st = d.init(toks, jnp.asarray([13]), 64, pre)
        ext = hybrid.extend(target, toks[:, 13:17], jnp.asarray([3]), pre.cache, hidden_layers=cfg.target_layers)
        st = d.commit(st, Committed(tokens=toks[:, 13:17], count=jnp.asarray([3]), features=feats[:, 13:17], target=ext.cache))
        return d.draft_block(st, toks[:, 16])[0]

    base = after_a_round()
    np.testing.assert_allclose(np.asarray(base[0]), np.asarray(base_train[0, 1]), atol=2e-4, rtol=1e-4)


def test_a_fresh_reader_adds_nothing_and_a_zeroed_state_reads_nothing(target):
    ready = BlockHead(_ready_cfg(target.config), nnx.Rngs(5))
    dspark = BlockHead(dataclasses.replace(ready.config, state_layers=(), state_shape=None), nnx.Rngs(5))
    fam = family(target)
    toks = jnp.asarray(np.random.default_rng(1).integers(0, VOCAB, (2, 20)), jnp.int32)
    pre = jax.jit(lambda m: fam.prefill(m, toks, jnp.asarray([20, 11]), fam.init_cache(m, 2, 40),
                                        hidden_layers=ready.config.target_layers))(target)

    def block(head, **kw):
        d = BlockDrafter.for_config(head.config)(head, target, **kw)
        return np.asarray(jax.jit(lambda p: d.draft_block(d.init(toks, jnp.asarray([20, 11]), 40, p), toks[:, 5])[0])(pre))

    ref = block(dspark)
    np.testing.assert_array_equal(block(ready), ref)  # the reader starts as a no-op (same seed: same rest)
    _loud(ready)
    assert np.abs(block(ready) - ref).max() > 0.1
    np.testing.assert_allclose(block(ready, zero_state=True), ref, atol=1e-6)  # zeroed state: U(0) = 0


def _trained(target, steps=60, seed=1):
    """A tiny ReaDy drafter trained (train.block's loss, states at grid anchors) on the target's own
    greedy continuations: partial, row-varying acceptance."""
    from train.block import BlockTrainConfig, grid_anchors
    head = BlockHead(_ready_cfg(target.config, num_layers=1, reader_out_rank=8), nnx.Rngs(seed))
    tc = BlockTrainConfig(name="t", target="t", anchors=6, state_every=EVERY, state_layers="all")
    return train_block_on_own_outputs(target, head, tc, lambda key, B, T: grid_anchors(key, B, T, 6, W, EVERY),
                                      steps, seed, VOCAB)


@pytest.fixture(scope="module")
def trained(target):
    return _trained(target)


@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_equals_autoregressive(target, trained, batch):
    head, data = trained
    assert float(jnp.abs(head.reader.out[...]).max()) > 0  # the reader learned something
    prompts = [data[i, :n].tolist() for i, n in zip(range(batch), (6, 9, 7, 12))]
    ref = specjax.generate(target, prompts, max_new_tokens=24).sequences()
    got = specjax.generate(target, prompts, max_new_tokens=24, drafters=[ReadyDrafter(head, target)])
    assert got.sequences() == ref
    assert got.stats["tau"].max() > 1.1
    if batch == 1:
        return
    tree = specjax.generate(target, prompts, max_new_tokens=24, drafters=[ReadyDrafter(head, target)],
                            tree=f"depth={W},topk=2,nodes=7")
    assert tree.sequences() == ref
    n0 = engine.trace_count()  # a new drafter object, other prompts of the same bucket: no retrace
    specjax.generate(target, [p[::-1] for p in prompts], max_new_tokens=24, drafters=[ReadyDrafter(head, target)])
    assert engine.trace_count() == n0


def test_the_drafter_holds_the_targets_committed_state_round_by_round(target, trained):
    """Through the engine's own rounds (tree-form verification, `hybrid.commit`), ragged rows: after
    every round the drafter's state is the state a prefill of the row's committed tokens leaves
    (prompt + emitted tokens but the last, the next round's root)."""
    head, data = trained
    d = ReadyDrafter(head, target)
    prompts = [data[0, :6].tolist(), data[1, :11].tolist()]
    pb = engine.prepare_prompts(prompts, VOCAB, 16, slack=3 * W + 4)
    spec, params, eos = parse_tree_spec(f"chain={W}"), SamplingParams.make(0.0), jnp.zeros((0,), jnp.int32)
    kw = dict(max_new_tokens=16, spec=spec)
    start = jax.jit(lambda m, dr, p, n: engine.spec_start(m, dr, p, n, params, jax.random.key(0), eos,
                                                          capacity=pb.capacity, greedy=True, **kw))
    step = jax.jit(lambda m, dr, c: engine.spec_round(m, dr, c, params, jax.random.key(0), eos, rule="greedy",
                                                      mode="topk", **kw)[0])
    fam = family(target)
    state_of = jax.jit(lambda m, t, n: fam.prefill(m, t, n, fam.init_cache(m, 1, 64)).cache.state)
    carry = start(target, d, jnp.asarray(pb.tokens), jnp.asarray(pb.lengths))
    for _ in range(3):
        carry = step(target, d, carry)
        for b, p in enumerate(prompts):
            committed = p + np.asarray(carry.buf[b, :int(carry.n_out[b]) - 1]).tolist()
            assert len(committed) == int(carry.cache.length[b])
            want = state_of(target, jnp.asarray([committed + [0] * (64 - len(committed))]), jnp.asarray([len(committed)]))
            np.testing.assert_allclose(np.asarray(carry.dstate.target_state[:, b]), np.asarray(want[:, 0]), atol=1e-4)
    assert int(carry.stats.accepted.sum()) > 0  # some round accepted drafts: the commit path moved the state


# ----------------------------------------------------------------------------- sampling is lossless

ROWS = 100_000
SV = 8


def test_sampled_rule_is_lossless_and_a_q_without_the_state_read_is_caught():
    """100k rows draft a 2-chain by sampling from q (the Markov head over base logits that read the
    target's state); the sampled rule's first two emitted tokens follow the target exactly. The
    planted bug: q reported from the same drafter on a zeroed state (the draft itself read the
    state): rejected."""
    tcfg = dataclasses.replace(HYBRID, vocab_size=SV, max_position_embeddings=64)
    target = hybrid.init_model(tcfg, seed=4)
    target.embed_tokens.set_value(target.embed_tokens.get_value() * 30)  # O(1) logits: a spread distribution
    head = BlockHead(_ready_cfg(tcfg, block_size=3, num_layers=1, markov_rank=4, reader_layer=1), nnx.Rngs(2))
    rng = np.random.default_rng(0)
    head.markov_out.set_value(jnp.asarray(rng.normal(size=(4, SV)) * 1.5, jnp.float32))
    head.markov_embed.set_value(jnp.asarray(rng.normal(size=(SV, 4)), jnp.float32))
    head.reader.out.set_value(jnp.asarray(rng.normal(size=head.reader.out.get_value().shape) * 3.0, jnp.float32))
    d = ReadyDrafter(head, target)
    prompt, root = [1, 5, 2, 6, 3], 3
    fam = family(target)
    pre = jax.jit(lambda m: fam.prefill(m, jnp.asarray([prompt]), jnp.asarray([5]), fam.init_cache(m, 1, 16),
                                        hidden_layers=head.config.target_layers))(target)
    def rows(st):  # the one-row state for ROWS rows (batch: axis 1 of the cache's K/V and of the states)
        ax1 = lambda x: jnp.broadcast_to(x, x.shape[:1] + (ROWS,) + x.shape[2:])  # noqa: E731
        ax0 = lambda x: jnp.broadcast_to(x, (ROWS,) + x.shape[1:])  # noqa: E731
        cache = dataclasses.replace(st.cache, k=ax1(st.cache.k), v=ax1(st.cache.v), length=ax0(st.cache.length))
        return dataclasses.replace(st, cache=cache, drafted=ax0(st.drafted), target_state=ax1(st.target_state))

    init = jax.jit(lambda dr, p: rows(dr.init(jnp.asarray([prompt]), jnp.asarray([5]), 16, p)))
    state = init(d, pre)
    spec, params = parse_tree_spec("chain=2"), SamplingParams.make(1.0)
    roots = jnp.full((ROWS,), root, jnp.int32)
    # the drafter and the arrays as arguments (not static, not closed over): a constant is folded for seconds
    propose = jax.jit(lambda dr, s, r, k: dr.propose(s, r, DraftContext(spec, "sample", params, k)))
    prop = propose(d, state, roots, jax.random.key(1))
    toks = np.asarray(prop.tree.tokens)

    seqs = jnp.asarray([prompt + [root, x] for x in range(SV)])  # the target on every 2-token draft, one pass
    tl = np.asarray(jax.jit(lambda t: fam.prefill(target, t, jnp.full((SV,), 7), fam.init_cache(target, SV, 8)).logits)(
        seqs), np.float64)
    p0, p1 = tl[0, 5], tl[:, 6]
    logits = np.zeros((ROWS, 3, SV), np.float32)
    logits[:, 0], logits[:, 1] = p0, p1[toks[:, 1]]
    verify = jax.jit(lambda tree, lg, q, k: V.verify(tree, lg, k, rule="sampled", max_depth=2, params=params,
                                                     draft_probs_BxNxV=q))

    def first_two(q):
        vd = verify(prop.tree, jnp.asarray(logits), q, jax.random.key(9))
        n, t, b = (np.asarray(x) for x in (vd.num_accepted, vd.tokens, vd.bonus))
        return np.where(n >= 1, t[:, 0], b), np.where(n >= 2, t[:, 1], b), n

    def stats(q):
        first, second, n = first_two(q)
        return first_two_chi_squares(first, second, n, p0, p1, SV), n

    good, n = stats(prop.probs)
    for stat, df, crit in good:
        assert stat <= crit, f"chi2 {stat:.1f} > {crit:.1f} (df {df})"
    assert len(good) >= 3 and 0.1 < (n >= 1).mean() < 0.95 and (n >= 2).mean() > 0.02
    # the q of a drafter blind to the recurrent state (what `zero_state=True` gives: its init and commit
    # zero the state the reader sees; propose reads whatever the state holds): the same program
    blind = dataclasses.replace(state, target_state=jnp.zeros_like(state.target_state))
    wrong = propose(d, blind, roots, jax.random.key(1)).probs
    assert float(jnp.abs(wrong - prop.probs).max()) > 0.05
    bad, _ = stats(wrong)
    assert any(s > 10 * c for s, _, c in bad), "the q without the state read was not caught"


# ----------------------------------------------------------------------------- refusals, checkpoints

def test_refusals_and_checkpoint_round_trip(target, tmp_path):
    cfg = _ready_cfg(target.config)
    dense = tiny_target(VOCAB)
    with pytest.raises(ValueError, match="no linear-attention layers"):
        _ready_cfg(dense.config)
    with pytest.raises(ValueError, match=r"\[1\] are not Gated DeltaNet layers"):
        _ready_cfg(target.config, state_layers=(0, 1))
    with pytest.raises(ValueError, match="reader_layer must be in 0..2"):
        _ready_cfg(target.config, reader_layer=3)
    with pytest.raises(ValueError, match="needs state_shape"):
        dataclasses.replace(cfg, state_shape=None)
    head = BlockHead(cfg, nnx.Rngs(0))
    other = hybrid.init_model(dataclasses.replace(HYBRID, linear_key_head_dim=4), seed=0)
    with pytest.raises(ValueError, match="states of shape"):
        ReadyDrafter(head, other)
    swapped = hybrid.init_model(dataclasses.replace(HYBRID, layer_types=("linear_attention", "linear_attention",
                                                                         "full_attention")), seed=0)
    with pytest.raises(ValueError, match=r"layers \[2\] of the target are not Gated DeltaNet"):
        ReadyDrafter(head, swapped)
    dspark = BlockHead(BlockConfig.for_target(target.config, block_size=W, num_layers=1, markov_rank=8), nnx.Rngs(0))
    with pytest.raises(ValueError, match="takes no option zero_state"):  # the ablation is ReaDy's
        BlockDrafter(dspark, target).with_options(zero_state=True)
    _loud(head)
    save_block_head(head, str(tmp_path / "ready"), dtype=jnp.float32)
    back = load_block_head(str(tmp_path / "ready"))
    assert back.config == cfg
    np.testing.assert_array_equal(np.asarray(back.reader.out[...]), np.asarray(head.reader.out[...]))
    assert isinstance(load_drafter(str(tmp_path / "ready"), target), BlockDrafter)
    with pytest.raises(ValueError, match="not Gated DeltaNet layers .those are none"):
        load_drafter(str(tmp_path / "ready"), dense)  # a dense target of the same width: refused, not traced
