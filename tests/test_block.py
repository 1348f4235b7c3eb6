"""The block drafter (DSpark; DFlash = markov_rank 0), design §5b.

- its drafting pass (context K/V cache + one block) equals its training pass (all anchors at once);
- greedy speculative output equals autoregressive output, dense and hybrid targets, batch 1 and 4
  with ragged prompts, with and without confidence cuts (threshold and the scheduler), one trace
  per configuration, and a cut really verifies fewer nodes; static and dynamic trees from the one
  pass, and DSpark as TreeGraft's cheap drafter;
- the sampled-candidates rule with Markov sampling keeps the target's distribution (chi-square over
  1e5 rounds), and a planted bug (q reported without the Markov term) is caught;
- the scheduler and the calibration on known numbers; checkpoints and refusals;
- a reduced draft vocabulary: drafting = training pass, greedy exact, q zero outside it, the ids
  restored from the exported ranking.
"""
from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import specjax
from helpers import (assert_first_two_follow, chi_square, full_features, next_logits, prefilled_state, spread_target,
                     tiny_hybrid, tiny_target, trained_dspark)
from specjax.engine import loop as engine
from specjax.spec import verify as V
from specjax.drafters import load_drafter
from specjax.drafters.base import DraftContext
from specjax.drafters.block import BlockConfig, BlockDrafter, BlockHead, load_block_head, save_block_head, train_logits
from specjax.spec.widths import fill_to_width, schedule_keep
from train.calibration import calibrate_temperatures, ece
from specjax.models import family, transformer
from specjax.spec.sampling import SamplingParams
from specjax.spec.tree import parse_tree_spec

VOCAB = 64
W = 4
HYBRID_LAYERS = 2  # the hybrid target: tiny_hybrid(VOCAB, 2) (linear, full attention)


@pytest.fixture(scope="module")
def dense():
    """(target, head, data): the tiny DSpark drafter trained on its dense target's own outputs (shared)."""
    return trained_dspark(VOCAB, block_size=W)


@pytest.fixture(scope="module")
def hybrid_setup():
    return trained_dspark(VOCAB, hybrid_layers=HYBRID_LAYERS, steps=60, seed=1, block_size=W)


def _ragged(data, batch):
    return [data[i, :n].tolist() for i, n in zip(range(batch), (6, 9, 7, 12))]


# ----------------------------------------------------------------------------- the two passes agree

@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_drafting_pass_equals_training_pass(kind):
    target = tiny_target(VOCAB) if kind == "dense" else tiny_hybrid(VOCAB, HYBRID_LAYERS)
    cfg = BlockConfig.for_target(target.config, block_size=W, num_layers=2, markov_rank=8)
    head = BlockHead(cfg, nnx.Rngs(3))
    d = BlockDrafter(head, target)
    fam = family(target)
    toks = jnp.asarray(np.random.default_rng(0).integers(0, VOCAB, (1, 40)), jnp.int32)
    feats = full_features(target, toks, cfg.target_layers)
    anchors = jnp.asarray([[3, 17, 30]])
    _, _, h_train, base_train, _, _ = train_logits(head, target, toks, feats, anchors)
    @jax.jit
    def drafted(a):  # the prompt is the first a tokens (right-padded: one compile for every anchor)
        pre = fam.prefill(target, toks, a[None], fam.init_cache(target, 1, 64), hidden_layers=cfg.target_layers)
        return d.draft_block(d.init(toks, a[None], 64, pre), toks[:, a])[:2]

    for j, a in enumerate((3, 17, 30)):
        base, h = drafted(jnp.int32(a))
        np.testing.assert_allclose(np.asarray(base[0]), np.asarray(base_train[0, j]), atol=2e-4, rtol=1e-4)
        np.testing.assert_allclose(np.asarray(h[0]), np.asarray(h_train[0, j]), atol=2e-4, rtol=1e-4)
    # after a round: the context extended at commit with the accepted tokens' target features
    # (3 committed from anchor 14, then 4 written of which 3 kept) drafts as training does at anchor 17
    from specjax.drafters.base import Committed
    pre = fam.prefill(target, toks, jnp.asarray([14]), fam.init_cache(target, 1, 64), hidden_layers=cfg.target_layers)
    st = d.init(toks, jnp.asarray([14]), 64, pre)
    st = dataclasses.replace(st, cache=d.draft_block(st, toks[:, 14])[2])  # a proposal's scratch, overwritten
    st = d.commit(st, Committed(tokens=toks[:, 14:18], count=jnp.asarray([3]), features=feats[:, 14:18]))
    base, h = d.draft_block(st, toks[:, 17])[:2]
    np.testing.assert_allclose(np.asarray(base[0]), np.asarray(base_train[0, 1]), atol=2e-4, rtol=1e-4)


# ----------------------------------------------------------------------------- greedy = autoregressive

CONFIDENCES = (("off", "off"), ("cut", 0.6), ("cut", 0.8), ("cut", 0.95), ("schedule", "schedule"))


def _check_greedy(target, head, prompts, costs_for, confidences=CONFIDENCES):
    """Greedy output with confidence off, a threshold that cuts some drafts (the first of a few that
    does on these prompts), and the scheduler: each equals autoregressive output. Returns the stats."""
    ref = specjax.generate(target, prompts, max_new_tokens=24).sequences()
    spec = parse_tree_spec(f"chain={W}")
    runs = {}
    for name, conf in confidences:
        if name == "cut" and "cut" in runs:
            continue
        d = BlockDrafter(head, target, confidence=conf,
                         costs=costs_for(BlockDrafter(head, target, confidence=0.5).verify_widths(spec))
                         if conf == "schedule" else None)
        got = specjax.generate(target, prompts, max_new_tokens=24, drafters=[d])  # the default tree: chain=W
        assert got.sequences() == ref, name
        st = got.stats
        if name != "cut" or ((st["drafted"] < W * st["rounds"]) & (st["drafted"] > 0)).any():
            runs[name] = st
    return runs


@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_equals_autoregressive_dense(dense, batch):
    target, head, data = dense
    prompts = _ragged(data, batch)
    # a steep cost table: long verifies are expensive, so the scheduler cuts (batch 1: off and the
    # scheduler only, the thresholds' programs are the batch-4 run's)
    runs = _check_greedy(target, head, prompts, lambda widths: [1.0 + 0.5 * w for w in widths],
                         confidences=CONFIDENCES if batch > 1 else (CONFIDENCES[0], CONFIDENCES[-1]))
    off = runs["off"]
    assert off["tau"].max() > 1.3  # the drafter is right sometimes: acceptance is exercised
    assert (off["drafted"] == W * off["rounds"]).all() and (off["mean_verify_width"] == W + 1).all()
    if batch > 1:
        assert "cut" in runs, "no threshold cut some drafts and not others"
        assert runs["cut"]["mean_verify_width"].min() < W + 1  # a cut verifies fewer nodes
    assert runs["schedule"]["mean_verify_width"].min() < W + 1


def test_one_trace_per_configuration(dense):
    target, head, data = dense
    d = BlockDrafter(head, target, confidence=0.7)
    specjax.generate(target, _ragged(data, 2), max_new_tokens=8, drafters=[d])
    n0 = engine.trace_count()
    specjax.generate(target, [data[5, :8].tolist(), data[6, :5].tolist()], max_new_tokens=8, drafters=[d])
    specjax.generate(target, _ragged(data, 2), max_new_tokens=8, drafters=[BlockDrafter(head, target, confidence=0.7)])
    assert engine.trace_count() == n0


def test_greedy_equals_autoregressive_hybrid(hybrid_setup):
    target, head, data = hybrid_setup
    runs = _check_greedy(target, head, _ragged(data, 4), lambda widths: [1.0 + 0.5 * w for w in widths],
                         confidences=(("off", "off"), ("cut", 0.8)))
    assert runs["off"]["tau"].max() > 1.1


def test_cut_before_the_first_position_verifies_the_root_only(dense):
    target, head, data = dense
    d = BlockDrafter(head, target, confidence=0.999999)  # nothing is that confident
    prompts = _ragged(data, 2)
    got = specjax.generate(target, prompts, max_new_tokens=10, drafters=[d], tree=f"chain={W}")
    assert got.sequences() == specjax.generate(target, prompts, max_new_tokens=10).sequences()
    assert (got.stats["drafted"] == 0).all() and (got.stats["tau"] == 1).all()
    assert (got.stats["mean_verify_width"] == 1).all()


def test_score_is_the_drafters_own_distribution(dense):
    """Rescoring its own chain gives the q it drafted from (TreeGraft's strong drafter reads it)."""
    target, head, data = dense
    d = BlockDrafter(head, target)
    prompt = jnp.asarray(data[:2, :10])
    fam = family(target)
    pre = fam.prefill(target, prompt, jnp.asarray([10, 10]), fam.init_cache(target, 2, 32),
                      hidden_layers=head.config.target_layers)
    st = d.init(prompt, jnp.asarray([10, 10]), 32, pre)
    root = jnp.asarray(data[:2, 10])
    prop = d.propose(st, root, DraftContext(parse_tree_spec(f"chain={W}"), "topk", SamplingParams.make(0.0),
                                            jax.random.key(0)))
    lq = d.score(st, prop.tree)
    np.testing.assert_allclose(np.exp(np.asarray(lq[:, :W])), np.asarray(prop.probs[:, :W]), atol=1e-5)


def test_treegraft_with_the_block_drafter_as_the_strong_one(dense):
    """TreeGraft(n-gram, DSpark): the block drafter rescores and grafts the n-gram trie (its exact
    one-pass `score`); greedy output stays the target's."""
    from specjax.drafters import NgramDrafter
    from specjax.drafters.composite.treegraft import TreeGraft
    target, head, data = dense
    prompts = _ragged(data, 2)
    tg = TreeGraft(NgramDrafter(), BlockDrafter(head, target), policy="always")
    got = specjax.generate(target, prompts, max_new_tokens=16, drafters=[tg], tree="depth=3,topk=2,nodes=6")
    assert got.sequences() == specjax.generate(target, prompts, max_new_tokens=16).sequences()
    assert got.stats["treegraft_invoked"].sum() > 0


def test_trees_from_one_pass(dense):
    """Static and dynamic trees drafted from the one backbone pass (the Markov head's exact rows per
    node): greedy output is the target's; the q of every node is what `score` gives for that node;
    and DSpark can be TreeGraft's cheap drafter (its dynamic candidate tree, an lm drafter grafting)."""
    from specjax.drafters import LMDrafter
    from specjax.drafters.composite.treegraft import TreeGraft
    target, head, data = dense
    prompts = _ragged(data, 2)
    ref = specjax.generate(target, prompts, max_new_tokens=16).sequences()
    d = BlockDrafter(head, target)
    paths = "[[0],[1],[0,0],[0,1],[1,0],[0,0,0]]"
    for spec in (paths, "depth=4,topk=2,nodes=7"):
        got = specjax.generate(target, prompts, max_new_tokens=16, drafters=[d], tree=spec)
        assert got.sequences() == ref, spec
        assert got.stats["tau"].max() > 1.3
    fam = family(target)
    prompt = jnp.asarray(data[:2, :10])
    pre = fam.prefill(target, prompt, jnp.asarray([10, 10]), fam.init_cache(target, 2, 32),
                      hidden_layers=head.config.target_layers)
    st = d.init(prompt, jnp.asarray([10, 10]), 32, pre)
    spec = parse_tree_spec(paths)
    prop = d.propose(st, jnp.asarray(data[:2, 10]), DraftContext(spec, "topk", SamplingParams.make(0.0),
                                                                 jax.random.key(0)))
    inner = np.asarray(spec.layout()[1]) < spec.max_depth  # the leaves' q is never computed
    np.testing.assert_allclose(np.exp(np.asarray(d.score(st, prop.tree)))[:, inner],
                               np.asarray(prop.probs)[:, inner], atol=1e-5)
    # sampled candidates: each inner node's q is its row warped like the target's p (here T = 0.7)
    prop = d.propose(st, jnp.asarray(data[:2, 10]), DraftContext(spec, "sample", SamplingParams.make(0.7),
                                                                 jax.random.key(1)))
    want = jax.nn.softmax(d.score(st, prop.tree) / 0.7, axis=-1)
    np.testing.assert_allclose(np.asarray(want)[:, inner], np.asarray(prop.probs)[:, inner], atol=1e-5)
    tg = TreeGraft(d, LMDrafter(target), policy="always")
    got = specjax.generate(target, prompts, max_new_tokens=16, drafters=[tg], tree="depth=3,topk=2,nodes=6")
    assert got.sequences() == ref and got.stats["treegraft_invoked"].sum() > 0
    with pytest.raises(ValueError, match="deeper than the block"):  # TreeGraft asks its cheap drafter too
        specjax.generate(target, prompts, max_new_tokens=16, drafters=[tg], tree=f"depth={W + 1},topk=2,nodes=6")


# ----------------------------------------------------------------------------- sampling is lossless

ROWS = 100_000
SV = 8  # vocabulary of the sampling test


@pytest.mark.parametrize("boundary,ar", [(False, 0), (True, 4)], ids=["dspark", "dpara-ar"])
def test_sampled_rule_with_markov_sampling_is_lossless(boundary, ar):
    """100k rows draft a 2-chain by sampling through the Markov head from q; the sampled rule's
    first two emitted tokens follow the target exactly. The planted bug: the drafter reports its
    base distribution b_k as q (without the Markov term it sampled with): rejected. DPara
    (`boundary`): the same from the block its init precomputed, walked by an autoregressive head
    (`ar`: its width; q from it, the planted bug the same; DPara's Markov walk is DSpark's)."""
    target = spread_target(SV)
    cfg = BlockConfig.for_target(target.config, block_size=3, num_layers=1, markov_rank=4, boundary=boundary,
                                 ar_intermediate=ar)
    head = BlockHead(cfg, nnx.Rngs(2))
    rng = np.random.default_rng(0)
    if ar:  # a head that changes the rows (a fresh one adds zero)
        head.ar_head.down.weight.set_value(jnp.asarray(rng.normal(size=(ar, cfg.hidden_size)), jnp.float32))
    head.markov_out.set_value(jnp.asarray(rng.normal(size=(4, SV)) * 1.5, jnp.float32))
    head.markov_embed.set_value(jnp.asarray(rng.normal(size=(SV, 4)), jnp.float32))
    d = BlockDrafter.for_config(cfg)(head, target)  # DPara's head: DParaDrafter
    prompt, root = [1, 5, 2], 3
    st1 = prefilled_state(d, target, prompt)
    state = jax.tree.map(lambda x: jnp.broadcast_to(x, (ROWS,) + x.shape[1:]), st1)
    spec = parse_tree_spec("chain=2")
    params = SamplingParams.make(1.0)
    roots = jnp.full((ROWS,), root, jnp.int32)
    # the drafter and the arrays as arguments: a drafter closed over is a constant XLA folds for seconds
    prop = jax.jit(lambda dr, s, r, k: dr.propose(s, r, DraftContext(spec, "sample", params, k)))(
        d, state, roots, jax.random.key(1))
    toks = np.asarray(prop.tree.tokens)

    def target_logits(seq):  # one jitted prefill (eager, each length compiles every op again)
        return next_logits(target, [seq])[0]

    p0 = target_logits(prompt + [root])
    p1 = np.stack([target_logits(prompt + [root, x]) for x in range(SV)])
    logits = np.zeros((ROWS, 3, SV), np.float32)
    logits[:, 0], logits[:, 1] = p0, p1[toks[:, 1]]
    soft = lambda x: np.exp(x - x.max(-1, keepdims=True)) / np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)  # noqa: E731
    verify = jax.jit(lambda tree, lg, q, k: V.verify(tree, lg, k, rule="sampled", max_depth=2, params=params,
                                                     draft_probs_BxNxV=q))  # arrays as arguments, not constants

    def first_two(q):
        vd = verify(prop.tree, jnp.asarray(logits), q, jax.random.key(9))
        n, t, b = (np.asarray(x) for x in (vd.num_accepted, vd.tokens, vd.bonus))
        return np.where(n >= 1, t[:, 0], b), np.where(n >= 2, t[:, 1], b), n

    first, second, n = first_two(prop.probs)
    assert_first_two_follow(first, second, n, p0, p1, SV)
    assert 0.1 < (n >= 1).mean() < 0.95 and (n >= 2).mean() > 0.02  # both depths accept and reject
    # the planted bug: q without the Markov term
    blk = jax.jit(lambda dr, s, r: dr.block_pass(s, r))(d, state, roots)
    base = blk.base if blk.base is not None else jax.jit(transformer.lm_head)(target, blk.hidden)
    wrong = jnp.concatenate([jax.nn.softmax(base[:, :2], -1), jnp.zeros((ROWS, 1, SV))], axis=1)
    assert float(jnp.abs(wrong - prop.probs).max()) > 0.05
    first_w, second_w, n_w = first_two(wrong)
    stats = [chi_square(np.bincount(first_w, minlength=SV), soft(p0))]
    stats += [chi_square(np.bincount(second_w[(n_w >= 1) & (first_w == x1)], minlength=SV), soft(p1[x1]))
              for x1 in range(SV) if ((n_w >= 1) & (first_w == x1)).sum() >= 2000]
    assert any(s > 10 * c for s, _, c in stats), "the wrong q was not caught"


# ----------------------------------------------------------------------------- scheduler, calibration

def test_scheduler_maximises_expected_throughput_over_the_widths():
    conf = jnp.asarray([[0.9, 0.9, 0.9, 0.9], [0.5, 0.5, 0.5, 0.5]])
    widths, both = (1, 2, 3, 5), jnp.ones(2, bool)
    # flat costs: the widest verify has the most expected tokens
    assert np.asarray(schedule_keep(conf, both, (1.0, 1.0, 1.0, 1.0), widths)).all()
    # verifying 4 drafts costs 3x: (2 + .9+.5 + .81+.25) / 1.2 = 3.72 at width 3 beats 3.09 at 2 and 2.01 at 5
    keep = np.asarray(schedule_keep(conf, both, (1.0, 1.1, 1.2, 3.0), widths))
    assert keep.tolist() == [[True, True, False, False]] * 2
    # verifying anything costs too much: the root alone
    assert not np.asarray(schedule_keep(conf, both, (1.0, 5.0, 6.0, 7.0), widths)).any()
    # a finished row verifies nothing, and does not count
    keep = np.asarray(schedule_keep(conf, jnp.asarray([True, False]), (1.0, 1.0, 1.0, 1.0), widths))
    assert keep[0].all() and not keep[1].any()


def test_a_threshold_cut_fills_the_width_it_needs():
    kept = jnp.asarray([[True, True, True, False], [True, False, False, False], [False] * 4])
    # the longest kept draft (3) needs width 5: every active row verifies 4 positions
    keep = np.asarray(fill_to_width(kept, jnp.asarray([True, True, True]), (1, 2, 3, 5)))
    assert keep.tolist() == [[True] * 4] * 3
    keep = np.asarray(fill_to_width(kept, jnp.asarray([False, True, True]), (1, 2, 3, 5)))
    assert keep.tolist() == [[False] * 4, [True, False, False, False], [True, False, False, False]]


def test_calibration_lowers_the_ece():
    rng = np.random.default_rng(0)
    N, Wc = 4000, 4
    z = rng.normal(2.0, 1.0, (N, Wc))  # over-confident logits
    true_p = 1 / (1 + np.exp(-z / 3.0))
    acc = np.cumprod(rng.random((N, Wc)) < true_p, axis=1)
    temps, before, after = calibrate_temperatures(z, acc)
    assert len(temps) == Wc and all(a <= b + 1e-9 for a, b in zip(after, before))
    assert after[0] < 0.5 * before[0] and 2.0 < temps[0] < 4.5
    assert ece([0.2, 0.8], [0, 1]) == pytest.approx(0.2)


def test_calibration_does_not_run_to_the_grid_bound():
    """Confidence logits that are calibrated already (T = 1) but narrow: the binned ECE is near zero
    for any near-constant probability too, so an ECE-minimising fit drifted (seed 1: T = 6.9 at
    position 1, the grid's 8.0 on SmolLM2's DSpark). The log-loss fit stays at 1 on every seed."""
    for seed in range(4):
        rng = np.random.default_rng(seed)
        z = rng.normal(0.0, 0.8, (4000, 2))
        acc = np.cumprod(rng.random((4000, 2)) < 1 / (1 + np.exp(-z)), axis=1)
        temps, _, _ = calibrate_temperatures(z, acc)
        assert all(0.8 < t < 1.25 for t in temps), (seed, temps)


# ----------------------------------------------------------------------------- checkpoints, refusals

def test_draft_weights_store_the_drafters_own_network_narrower(dense, tmp_path):
    """`load_drafter(..., draft_weights=)` (`--draft-weights`): the head's projections change dtype, the
    target it borrows from does not, the int8 head still drafts well (float32: tau 1.8 here; reading the
    activation dtype off an int8 projection gave 1.0), and the output is the target's."""
    from specjax.drafters.composite.adaptive import AdaptiveShape
    target, head, data = dense
    save_block_head(head, str(tmp_path / "blk"))
    for w in ("bfloat16", "int8"):
        d = load_drafter(str(tmp_path / "blk"), target, draft_weights=w)
        assert d.head.layers[0].mlp.up_proj.weight[...].dtype == jnp.dtype(w) and d.head.fc.weight[...].dtype == jnp.dtype(w)
        assert (d.head.fc.scale is not None) == (w == "int8") and d.dtype == jnp.float32
    assert target.layers[0].mlp.up_proj.weight[...].dtype == jnp.float32 and target.embed_tokens[...].dtype == jnp.float32
    prompts = _ragged(data, 4)
    got = specjax.generate(target, prompts, max_new_tokens=24, drafters=[d])
    assert got.sequences() == specjax.generate(target, prompts, max_new_tokens=24).sequences()
    assert got.stats["tau"].mean() > 1.4
    with pytest.raises(ValueError, match="no network of its own"):
        load_drafter("ngram", target, draft_weights="int8")
    with pytest.raises(ValueError, match="expected one of"):
        load_drafter(str(tmp_path / "blk"), target, draft_weights="fp8")
    # a composite reaches the part that has a network of its own
    wrapped = AdaptiveShape(load_drafter(str(tmp_path / "blk"), target), costs=(1.0, 2.0))
    assert wrapped.has_own_weights and wrapped.with_weights("int8") is wrapped
    assert wrapped.inner.head.fc.weight[...].dtype == jnp.int8


def test_checkpoint_round_trip_and_refusals(dense, tmp_path):
    target, head, _ = dense
    save_block_head(head, str(tmp_path / "blk"))
    raw = json.loads((tmp_path / "blk" / "drafter_config.json").read_text())
    assert raw["drafter"] == "block" and raw["block_size"] == W
    from safetensors.numpy import load_file
    assert all(str(t.dtype) == "bfloat16" for t in load_file(str(tmp_path / "blk" / "model.safetensors")).values())
    back = load_block_head(str(tmp_path / "blk"))
    for a, b in zip(jax.tree.leaves(nnx.state(head, nnx.Param)), jax.tree.leaves(nnx.state(back, nnx.Param))):
        np.testing.assert_array_equal(np.asarray(jnp.asarray(a, jnp.bfloat16).astype(jnp.float32)), np.asarray(b))
    d = load_drafter(str(tmp_path / "blk"), target, confidence="0.5")
    assert isinstance(d, BlockDrafter) and d.confidence == 0.5
    prompts = [[1, 2, 3, 4]]
    with pytest.raises(ValueError, match="confidence cuts apply to a chain"):
        specjax.generate(target, prompts, drafters=[d], tree="depth=3,topk=2,nodes=6")
    with pytest.raises(ValueError, match="deeper than the block"):
        specjax.generate(target, prompts, drafters=[d], tree=f"chain={W + 1}")
    for bad in ("high", 1.5, 0):
        with pytest.raises(ValueError, match="confidence"):
            BlockDrafter(head, target, confidence=bad)
    with pytest.raises(ValueError, match="costs"):
        BlockDrafter(head, target, confidence="schedule")
    with pytest.raises(ValueError, match="block drafter"):
        load_drafter("ngram", target, confidence=0.5)
    dflash = BlockHead(BlockConfig.for_target(target.config, block_size=W, num_layers=1, markov_rank=0), nnx.Rngs(0))
    assert dflash.markov_embed is None and dflash.confidence_w is None
    with pytest.raises(ValueError, match="no confidence head"):
        BlockDrafter(dflash, target, confidence=0.5)
    got = specjax.generate(target, prompts, max_new_tokens=8, drafters=[BlockDrafter(dflash, target)], tree="chain=3")
    assert got.sequences() == specjax.generate(target, prompts, max_new_tokens=8).sequences()
    other = tiny_target(VOCAB + 1)
    with pytest.raises(ValueError, match="vocab"):
        BlockDrafter(head, other)


# ----------------------------------------------------------------------------- a reduced draft vocabulary

def test_draft_vocabulary(dense, tmp_path):
    """The base logits and the Markov head over N of the V tokens: the drafting pass equals the
    training pass (over the N), q is zero outside them (a token outside is never drafted, and the
    target's tokens outside are still emitted: greedy output exact), and the ids come back from the
    exported ranking. The head is the trained one restricted to the N (its Markov rows for them, zero
    for every token outside); train.block's loss and export with a draft vocabulary: test_train."""
    from specjax.drafters import vocab as vocab_lib
    target, trained, data = dense
    ranking = vocab_lib.token_ranking(data, VOCAB)
    N = 24  # the 24 most frequent tokens of the data: the target's continuations use others too
    ids = ranking[:N]
    cfg = dataclasses.replace(trained.config, draft_vocab=N)
    head = BlockHead(cfg, nnx.Rngs(0), draft_ids=ids)
    assert head.markov_embed.shape == (N + 1, cfg.markov_rank) and head.markov_out.shape == (cfg.markov_rank, N)
    flat = dict(nnx.to_flat_state(nnx.state(trained, nnx.Param)))
    for key, var in nnx.to_flat_state(nnx.state(head, nnx.Param)):
        src = flat[key].get_value()
        if key[-1] == "markov_embed":
            src = jnp.concatenate([src[ids], jnp.zeros_like(src[:1])])
        elif key[-1] == "markov_out":
            src = src[:, ids]
        var.set_value(src)
    toks = jnp.asarray(data[:1])
    assert not np.isin(np.asarray(data), ids).all()  # the target's text uses tokens outside
    # drafting pass = training pass (N-wide base logits), and the widened q is zero outside
    d = BlockDrafter(head, target)
    fam = family(target)
    feats = full_features(target, toks, cfg.target_layers)
    tp = train_logits(head, target, toks, feats, jnp.asarray([[11]]))
    assert tp.base.shape[-1] == N
    pre = fam.prefill(target, toks, jnp.asarray([11]), fam.init_cache(target, 1, 64), hidden_layers=cfg.target_layers)
    st = d.init(toks, jnp.asarray([11]), 64, pre)
    np.testing.assert_allclose(np.asarray(d.draft_block(st, toks[:, 11]).base[0]), np.asarray(tp.base[0, 0]),
                               atol=2e-4, rtol=1e-4)
    prop = d.propose(st, toks[:, 11], DraftContext(parse_tree_spec(f"chain={W}"), "topk", SamplingParams.make(0.0),
                                                   jax.random.key(0)))
    outside = ~np.isin(np.arange(VOCAB), ids)
    assert (np.asarray(prop.probs[0, :W])[:, outside] == 0).all()
    assert np.isin(np.asarray(prop.tree.tokens[0, 1:]), ids).all()
    # the greedy walk takes its argmax over the N and maps it to the id: the full row's argmax
    assert (np.asarray(prop.tree.tokens[0, 1:]) == np.argmax(np.asarray(prop.probs[0, :W]), -1)).all()
    lq = d.score(st, prop.tree)
    np.testing.assert_allclose(np.exp(np.asarray(lq[:, :W])), np.asarray(prop.probs[:, :W]), atol=1e-5)
    prompts = _ragged(data, 4)
    ref = specjax.generate(target, prompts, max_new_tokens=24).sequences()
    got = specjax.generate(target, prompts, max_new_tokens=24, drafters=[d])
    assert got.sequences() == ref and got.stats["tau"].max() > 1.1
    # a best-first tree from the one pass (its tables widen the N-wide rows too)
    assert specjax.generate(target, prompts, max_new_tokens=24, drafters=[d], tree="ddtree,nodes=6,depth=3,k=2").sequences() == ref
    # export: the ranking beside the head; the ids are its first N
    save_block_head(head, str(tmp_path / "blk"))
    with pytest.raises(FileNotFoundError, match="no token ranking"):
        load_block_head(str(tmp_path / "blk"))
    vocab_lib.save_ranking(str(tmp_path / "blk"), ranking)
    back = load_drafter(str(tmp_path / "blk"), target)
    assert np.array_equal(np.asarray(back.head.vocab_ids[...]), ids)
    np.testing.assert_allclose(np.asarray(back.draft_block(st, toks[:, 11]).base), np.asarray(d.draft_block(st, toks[:, 11]).base),
                               atol=0.05)  # bf16 weights
    with pytest.raises(ValueError, match="draft_ids"):
        BlockHead(cfg, nnx.Rngs(0))
    with pytest.raises(ValueError, match="draft_vocab must be"):
        BlockConfig.for_target(target.config, block_size=W, draft_vocab=VOCAB + 1)


# ----------------------------------------------------------------------------- the published layouts' options

@pytest.mark.parametrize("mask_token_id,from_anchor", [(5, True), (5, False), (None, False)])
def test_token_mask_and_anchor_slot_variants(mask_token_id, from_anchor):
    """`mask_token_id` (MASK = the target's embedding of a token, no learned vector) and
    `sample_from_anchor=False` (slot k predicts start+k: W-1 drafts, as z-lab DFlash): the drafting
    pass equals the training pass, and greedy output equals autoregressive output."""
    target = tiny_target(VOCAB)
    cfg = dataclasses.replace(BlockConfig.for_target(target.config, block_size=W, num_layers=2, markov_rank=8),
                              mask_token_id=mask_token_id, sample_from_anchor=from_anchor)
    head = BlockHead(cfg, nnx.Rngs(4))
    assert (head.mask_embed is None) == (mask_token_id is not None)
    assert cfg.drafts == (W if from_anchor else W - 1)
    d = BlockDrafter(head, target)
    toks = jnp.asarray(np.random.default_rng(1).integers(0, VOCAB, (1, 40)), jnp.int32)
    feats = full_features(target, toks, cfg.target_layers)
    tp = train_logits(head, target, toks, feats, jnp.asarray([[5, 20]]))
    assert tp.base.shape[2] == cfg.drafts
    fam = family(target)
    for j, a in enumerate((5, 20)):
        pre = fam.prefill(target, toks, jnp.asarray([a]), fam.init_cache(target, 1, 64), hidden_layers=cfg.target_layers)
        base, h = d.draft_block(d.init(toks, jnp.asarray([a]), 64, pre), toks[:, a])[:2]
        np.testing.assert_allclose(np.asarray(base[0]), np.asarray(tp.base[0, j]), atol=2e-4, rtol=1e-4)
        np.testing.assert_allclose(np.asarray(h[0]), np.asarray(tp.hidden[0, j]), atol=2e-4, rtol=1e-4)
    prompts = [toks[0, :n].tolist() for n in (6, 9)]
    ref = specjax.generate(target, prompts, max_new_tokens=16).sequences()
    assert specjax.generate(target, prompts, max_new_tokens=16, drafters=[d]).sequences() == ref
    with pytest.raises(ValueError, match="deeper than"):
        specjax.generate(target, prompts, max_new_tokens=4, drafters=[d], tree=f"chain={W + (1 if from_anchor else 0)}")


def test_published_options_are_checked():
    target = tiny_target(VOCAB)
    cfg = BlockConfig.for_target(target.config, block_size=W, num_layers=1, markov_rank=8)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        dataclasses.replace(cfg, mask_token_id=VOCAB)
    with pytest.raises(ValueError, match="DSpark / DFlash only"):
        dataclasses.replace(cfg, sample_from_anchor=False, boundary=True)
