"""DPara (design §5d): the block drafter with its next block precomputed for every acceptance
boundary while the target verifies.

- the boundary pass (drafting) equals the training pass at the same boundaries: the first round's
  block at init and the block a commit selects after 2 and after 4 accepted tokens;
- greedy speculative output equals autoregressive output, batch 1 and 4 with ragged prompts,
  chains with and without a confidence cut and a dynamic tree (one block per draft node), one
  trace per configuration; the drafter trained by `train.block` (boundary blocks) on a tiny target;
- the sampled rule's losslessness with DPara's Markov sampling is in test_block (parametrized);
- the refusals (the trainer end to end: test_train).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import specjax
from helpers import full_features, tiny_target, train_block_on_own_outputs
from specjax.drafters.base import Committed
from specjax.drafters.block import BlockConfig, BlockDrafter, BlockHead, DParaDrafter, train_logits
from specjax.models import family

VOCAB = 64
W = 4


@pytest.fixture(scope="module", params=[0, 16], ids=["markov", "ar-head"])
def trained(request):
    """A tiny DPara drafter trained with train.block's loss (boundary blocks) on the target's own
    outputs; its light head the Markov head, or an autoregressive head of width 16."""
    from train.block import BlockTrainConfig, sample_anchors, sample_lags
    target = tiny_target(VOCAB)
    cfg = BlockConfig.for_target(target.config, block_size=W, num_layers=1, markov_rank=16, boundary=True,
                                 ar_intermediate=request.param)
    tc = BlockTrainConfig(name="t", target="t", anchors=8, boundary=True)
    anchors = lambda key, B, T: sample_anchors(key, B, T, 8, W)  # noqa: E731  (lags: cyclic, below each anchor)
    head, data = train_block_on_own_outputs(target, BlockHead(cfg, nnx.Rngs(0)), tc, anchors, 80, 0, VOCAB)
    assert sample_lags(jax.random.key(0), jnp.asarray([[1, 9]]), W, 2.0)[0, 0] == 0  # a boundary below its anchor
    return target, head, data


def test_boundary_pass_equals_training_pass():
    target = tiny_target(VOCAB)
    cfg = BlockConfig.for_target(target.config, block_size=W, num_layers=2, markov_rank=8, boundary=True)
    head = BlockHead(cfg, nnx.Rngs(3))
    d = DParaDrafter(head, target)
    fam = family(target)
    toks = jnp.asarray(np.random.default_rng(0).integers(0, VOCAB, (1, 40)), jnp.int32)
    feats = full_features(target, toks, cfg.target_layers)

    @jax.jit
    def init(a):  # the prompt is the first a tokens (right-padded: one compile for every a)
        pre = fam.prefill(target, toks, a[None], fam.init_cache(target, 1, 64), hidden_layers=cfg.target_layers)
        return d.init(toks, a[None], 64, pre)

    # init: the round rooted at the prompt's last token, boundary 0 (the bonus at the prompt length)
    tp = train_logits(head, target, toks, feats, jnp.asarray([[10, 30]]), lags_BxA=jnp.asarray([[0, 0]]))
    for j, a in enumerate((10, 30)):
        np.testing.assert_allclose(np.asarray(init(jnp.int32(a)).block[0]), np.asarray(tp.pre[0, j]), atol=2e-5)
    # two rounds: drafts toks[14:19] then toks[17:22] (root + 4), accepted 2 then 4; the bonus of each
    # is the next root. The blocks selected are training's at anchors 17 (boundary 2) and 22 (boundary 4).
    st = init(jnp.int32(14))
    chain = jnp.tril(jnp.ones((1, 5, 5), bool))
    tp = train_logits(head, target, toks, feats, jnp.asarray([[17, 22]]), lags_BxA=jnp.asarray([[2, 4]]))
    for j, (root, count) in enumerate(((14, 3), (17, 5))):
        blocks, cache = d.boundary_pass(st.cache, toks[:, root:root + 5], jnp.arange(5)[None], chain)
        st = d.commit(dataclasses.replace(st, cache=cache, boundary=blocks),
                      Committed(tokens=toks[:, root:root + 5], count=jnp.asarray([count]),
                                features=feats[:, root:root + 5]))
        assert st.boundary is None and int(st.cache.length[0]) == root + count
        np.testing.assert_allclose(np.asarray(st.block[0]), np.asarray(tp.pre[0, j]), atol=2e-5)


def test_greedy_equals_autoregressive(trained):
    """Batch 4 with ragged prompts: chain, confidence cut, boundaries=2 (a chain precomputes
    boundaries 0, 1; a round accepting more makes its block after the fact), a dynamic tree and, for
    the Markov head, a best-first tree (one block per node); batch 1: the chain."""
    target, head, data = trained
    prompts = [data[i, :n].tolist() for i, n in zip(range(4), (6, 9, 7, 12))]
    ref = specjax.generate(target, prompts, max_new_tokens=24).sequences()
    runs = [("off", None, None), (0.6, None, None), ("off", None, 2), ("off", "depth=3,topk=2,nodes=7", None)]
    if not head.config.ar_drafts:
        runs.append(("off", "ddtree,nodes=6", None))
    taus = []
    for conf, tree, b in runs:
        got = specjax.generate(target, prompts, max_new_tokens=24,
                               drafters=[DParaDrafter(head, target, confidence=conf, boundaries=b)], tree=tree)
        assert got.sequences() == ref, (conf, tree, b)
        taus.append(float(np.mean(got.stats["tau"])))
    assert max(taus) > 1.3  # the boundary blocks draft: tokens are accepted
    one = specjax.generate(target, prompts[1:2], max_new_tokens=24, drafters=[DParaDrafter(head, target)])
    assert one.sequences() == ref[1:2]


def test_one_trace_per_configuration(trained):
    from specjax.engine import loop as engine
    target, head, data = trained
    d = DParaDrafter(head, target)
    before = engine.trace_count()
    for n in (6, 9):
        specjax.generate(target, [data[0, :n].tolist()], max_new_tokens=16, drafters=[d])
    assert engine.trace_count() - before <= 1


def test_refusals(trained):
    from specjax.drafters.composite.adaptive import AdaptiveShape
    from specjax.drafters.composite.treegraft import TreeGraft
    target, head, _ = trained
    d = DParaDrafter(head, target)
    dspark = BlockDrafter(BlockHead(dataclasses.replace(head.config, boundary=False, ar_intermediate=0), nnx.Rngs(0)),
                          target)
    with pytest.raises(ValueError, match="commits against the tree it proposed itself"):
        TreeGraft(d, dspark)
    with pytest.raises(ValueError, match="commits against the tree it proposed itself"):  # as the strong part too
        TreeGraft(specjax.drafters.NgramDrafter(), d)
    with pytest.raises(ValueError, match="adaptive shape reorders"):
        AdaptiveShape(d, (1.0, 2.0))
    with pytest.raises(ValueError, match="DSpark / DFlash backbone"):
        dataclasses.replace(head.config, state_layers=(0,), state_shape=(1, 2, 2))
    if head.config.ar_drafts:
        with pytest.raises(ValueError, match="autoregressive head"):
            specjax.generate(target, [[1, 2, 3]], max_new_tokens=4, drafters=[d], tree="ddtree,nodes=4")
    with pytest.raises(ValueError, match="score another drafter's tree"):
        d.score(None, None)
    with pytest.raises(ValueError, match="takes no option boundaries"):  # a DSpark drafter has none
        dspark.with_options(boundaries=2)
    with pytest.raises(ValueError, match="needs DParaDrafter"):  # a DPara head is DParaDrafter's
        BlockDrafter(head, target)


def test_boundaries_beyond_the_precomputed_ones_give_the_same_block():
    """With boundaries=2, a round that accepts 3 draft tokens makes the block of its last accepted
    node after the verification: the same block as when every boundary is precomputed."""
    target = tiny_target(VOCAB)
    cfg = BlockConfig.for_target(target.config, block_size=W, num_layers=1, markov_rank=8, boundary=True)
    head = BlockHead(cfg, nnx.Rngs(4))
    fam = family(target)
    toks = jnp.asarray(np.random.default_rng(1).integers(0, VOCAB, (1, 30)), jnp.int32)
    pre = fam.prefill(target, toks, jnp.asarray([12]), fam.init_cache(target, 1, 64), hidden_layers=cfg.target_layers)
    feats = full_features(target, toks, cfg.target_layers)
    blocks = []
    for b in (None, 2):
        blocks.append(np.asarray(jax.jit(lambda pre, feats, b=b: after_a_round(head, target, toks, pre, feats, b))(
            pre, feats)))
    np.testing.assert_allclose(blocks[1], blocks[0], atol=2e-5)


def after_a_round(head, target, toks, pre, feats, b):
    """The block a commit selects after a round rooted at position 12 accepted 3 of toks[13:17]."""
    d = DParaDrafter(head, target, boundaries=b)
    st = d.init(toks, jnp.asarray([12]), 64, pre)
    n = 5 if b is None else b
    chain = jnp.tril(jnp.ones((1, 5, 5), bool))[:, :n, :n]
    bl, cache = d.boundary_pass(st.cache, toks[:, 12:12 + n], jnp.arange(n)[None], chain)
    st = d.commit(dataclasses.replace(st, cache=cache, boundary=bl),
                  Committed(tokens=toks[:, 12:17], count=jnp.asarray([4]), features=feats[:, 12:17]))
    return st.block
