"""AdaptiveSpec (issue 21): the adaptive tree shape (lossless) and margin verification (lossy).

- the adaptive shape (`specjax.drafters.composite.adaptive.AdaptiveShape`) around an lm, a feature and a block drafter,
  on chains (drafting cut early), path lists and dynamic trees: greedy output equals
  autoregressive output, batch 1 and 4 ragged, one trace per configuration, and a steep cost table
  verifies fewer nodes;
- the deterministic-candidates rule on an adaptive-shaped tree (reordered by estimate, cut to a
  width) keeps the target's distribution (chi-square over 1e5 rounds); a rule that skips the
  residual is caught;
- the reordering is topological and its prefixes prefix-closed; the accepted-path bookkeeping;
  the offline calibration's file round trip; the refusals;
- verify="margin": δ = 0 is the greedy rule (and, at temperature 1, the deterministic one) exactly;
  δ > 0 accepts a token the greedy rule rejects (constructed logits); `lossless` is False; the
  CLI warns; bad margins are refused.
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
from helpers import (assert_first_two_follow, chi_square, next_logits, noisy_copy, noisy_lm_drafter, prefilled_state,
                     spread_target, tiny_target)
from specjax.drafters.composite import adaptive as A
from specjax.spec import calibration as C
from specjax.engine import loop as engine
from specjax.spec import tree as T, verify as V, widths as W
from specjax.drafters import FeatureConfig, FeatureDrafter, FeatureHead, LMDrafter, NgramDrafter
from specjax.drafters.base import Committed, DraftContext
from specjax.drafters.block import BlockConfig, BlockDrafter, BlockHead
from specjax.spec.sampling import SamplingParams

VOCAB = 64
ROWS = 100_000
SV = 8


def costs(widths, slope=0.1):
    return tuple(1.0 + slope * w for w in widths)


@pytest.fixture(scope="module")
def dense():
    return tiny_target(VOCAB), noisy_lm_drafter(VOCAB, seed=1)  # shared (helpers), as test_treegraft's


def _prompts(batch, seed=0):
    rng = np.random.default_rng(seed)
    lens = (5, 11, 17, 8)[:batch]
    return [(rng.integers(0, VOCAB, 5).tolist() * 4)[:n] for n in lens]


def _drafters(target, lm):
    head = FeatureHead(FeatureConfig.for_target(target.config, target_layers=(0, 1)), nnx.Rngs(3))
    block = BlockDrafter(BlockHead(BlockConfig.for_target(target.config, block_size=4, num_layers=1, markov_rank=8),
                                   nnx.Rngs(0)), target)
    return {"lm": lm, "feature": FeatureDrafter(head, target), "block": block}


CASES = [("lm", "chain=5", 0.05), ("lm", "depth=3,topk=3,nodes=10", None), ("lm", "[[0],[1],[0,0],[0,1],[0,0,0]]", None),
         ("feature", "chain=4", 0.05), ("block", "chain=4", None), ("block", "depth=3,topk=2,nodes=7", None)]


@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_equals_autoregressive(dense, batch):
    """Every case at batch 4 (ragged); at batch 1 the two chains whose shape is cut most."""
    target, lm = dense
    drafters = _drafters(target, lm)
    prompts = _prompts(batch)
    ref = specjax.generate(target, prompts, max_new_tokens=24).sequences()  # 24: the AR program other modules compile
    for name, tree, step in CASES if batch > 1 else [CASES[0], CASES[4]]:
        d = drafters[name]
        n = d.resolve_tree(T.parse_tree_spec(tree)).num_nodes
        a = A.AdaptiveShape(d, costs(W.adaptive_widths(n)), draft_step_s=step)
        res = specjax.generate(target, prompts, max_new_tokens=24, drafters=[a], tree=tree)
        assert res.sequences() == ref, (name, tree)
        assert res.lossless
        st = res.stats
        assert np.all(st["mean_verify_width"] <= n) and np.all(st["adaptive_nodes"] <= st["rounds"] * (n - 1))


def test_one_trace_per_configuration_and_steep_costs_verify_less(dense):
    target, lm = dense
    prompts = _prompts(4, seed=1)
    widths = W.adaptive_widths(6)
    flat = A.AdaptiveShape(lm, (1.0,) * len(widths))  # equal costs: the whole tree, every round
    steep = A.AdaptiveShape(lm, costs(widths, slope=2.0), draft_step_s=0.5)
    kw = dict(max_new_tokens=16, tree="chain=5")
    specjax.generate(target, prompts, drafters=[steep], **kw)
    n = engine.trace_count()
    r_steep = specjax.generate(target, prompts, drafters=[steep], seed=3, **kw)
    assert engine.trace_count() == n
    r_flat = specjax.generate(target, prompts, drafters=[flat], **kw)
    assert r_flat.stats["mean_verify_width"].min() == pytest.approx(6.0)
    assert r_steep.stats["mean_verify_width"].mean() < r_flat.stats["mean_verify_width"].mean()
    assert r_steep.sequences() == r_flat.sequences()


def test_order_by_score_is_topological_and_prefixes_are_subtrees(dense):
    target, lm = dense
    spec = T.parse_tree_spec("depth=4,topk=3,nodes=14")
    st = prefilled_state(lm, target, [1, 2, 3, 4], capacity=48)
    st = jax.tree.map(lambda x: jnp.broadcast_to(x, (2,) + x.shape[1:]) if x.ndim else x, st)
    prop = lm.propose(st, jnp.asarray([5, 9]), DraftContext(spec, "topk", SamplingParams.make(0.0), jax.random.key(0)))
    tree, _, perm = A.order_by_score(prop.tree)  # by cumulative log q: non-increasing along every path
    par, valid = np.asarray(tree.parents), np.asarray(tree.valid)
    for b in range(2):
        assert sorted(np.asarray(perm[b]).tolist()) == list(range(spec.num_nodes))
        for i in range(1, spec.num_nodes):
            if valid[b, i]:
                assert 0 <= par[b, i] < i  # a parent precedes its child: every prefix is a subtree
        old = {int(perm[b, i]): i for i in range(spec.num_nodes)}
        for i in range(spec.num_nodes):  # the same tree: tokens and parent tokens kept
            j = int(perm[b, i])
            assert int(tree.tokens[b, i]) == int(prop.tree.tokens[b, j])
            if valid[b, i] and i:
                assert old[int(prop.tree.parents[b, j])] == par[b, i]


def test_accepted_nodes():
    # root 0; depth 1: 1 (tok 7), 2 (tok 8); depth 2: 3 (tok 4, under 1), 4 (tok 5, under 2)
    tree = T.TreeBuffers(tokens=jnp.asarray([[3, 7, 8, 4, 5]]), parents=jnp.asarray([[-1, 0, 0, 1, 2]]),
                         depth=jnp.asarray([[0, 1, 1, 2, 2]]), valid=jnp.ones((1, 5), bool),
                         score=jnp.zeros((1, 5)), source=jnp.zeros((1, 5), jnp.int8))
    c = Committed(tokens=jnp.asarray([[3, 8, 0]]), count=jnp.asarray([2]))
    on, seen = T.accepted_nodes(tree, c.tokens, c.count)
    assert np.asarray(on[0]).tolist() == [True, False, True, False, False]
    assert np.asarray(seen[0]).tolist() == [False, True, True, False, True]  # children of the root and of node 2


def test_deterministic_rule_on_an_adaptive_tree_is_lossless():
    """An adaptive-shaped tree (an lm drafter's static tree, reordered by estimate and cut to a
    compiled width) from a drafter whose q spreads; the deterministic-candidates rule's first two
    emitted tokens follow the target over 1e5 rounds. Planted bug: the bonus drawn from p instead
    of the residual after the root's children are rejected: caught."""
    target = spread_target(SV)
    d = LMDrafter(noisy_copy(target, 0.5, 2))
    prompt, root = [1, 5, 2], 3
    spec = T.parse_tree_spec("[[0],[1],[2],[0,0],[0,1],[1,0],[0,0,0]]")
    widths = W.adaptive_widths(spec.num_nodes)
    a = A.AdaptiveShape(d, costs(widths, slope=0.05))
    st = a.prepare(prefilled_state(a, target, prompt), spec)
    prop = a.propose(st, jnp.asarray([root]), DraftContext(spec, "topk", SamplingParams.make(1.0), jax.random.key(0)))
    tree1 = prop.tree
    kept = np.asarray(tree1.valid[0])
    assert 3 <= kept.sum() < spec.num_nodes  # cut to a width
    assert int((np.asarray(tree1.parents[0])[kept] == 0).sum()) >= 2  # siblings at the root: the residual matters
    tree = jax.tree.map(lambda x: jnp.broadcast_to(x, (ROWS,) + x.shape[1:]), tree1)

    def target_logits(seq):  # one jitted prefill (eager, each length compiles every op again)
        return next_logits(target, [seq])[0]

    p0 = target_logits(prompt + [root])
    p1 = np.stack([target_logits(prompt + [root, x]) for x in range(SV)])
    toks, depth, par = (np.asarray(x[0]) for x in (tree1.tokens, tree1.depth, tree1.parents))
    logits = np.zeros((spec.num_nodes, SV), np.float32)
    logits[0] = p0
    logits[depth == 1] = p1[toks[depth == 1]]
    for i in np.nonzero(depth >= 2)[0]:  # deeper nodes: their own target rows (the test reads two tokens)
        logits[i] = target_logits(prompt + [root, int(toks[par[i]]), int(toks[i])])
    vd = jax.jit(lambda tr, lg, k: V.verify(tr, lg, k, rule="deterministic", max_depth=spec.max_depth,
                                            params=SamplingParams.make(1.0)))(
        tree, jnp.broadcast_to(jnp.asarray(logits), (ROWS,) + logits.shape), jax.random.key(9))
    n, t, b = (np.asarray(x) for x in (vd.num_accepted, vd.tokens, vd.bonus))
    first, second = np.where(n >= 1, t[:, 0], b), np.where(n >= 2, t[:, 1], b)
    assert_first_two_follow(first, second, n, p0, p1, SV)
    assert 0.1 < (n >= 1).mean() < 0.95
    soft = np.exp(p0 - p0.max()) / np.exp(p0 - p0.max()).sum()
    bug = np.asarray(jax.random.categorical(jax.random.key(5), jnp.asarray(p0, jnp.float32), shape=(ROWS,)))
    stat, _, crit = chi_square(np.bincount(np.where(n >= 1, first, bug), minlength=SV), soft)
    assert stat > 10 * crit, "the residual-skipping rule was not caught"


def test_calibration_file_round_trip(tmp_path):
    """The adaptive shape's table ("step") in the one calibration file, beside a TAPS table: each trainer
    rewrites its own kind and keeps the other; the shape takes the "step" table only, of its cell grid."""
    rng = np.random.default_rng(0)
    seen = rng.integers(0, 40, (A.DEPTHS, A.BINS)).astype(float)
    hits = np.floor(seen * rng.uniform(size=(A.DEPTHS, A.BINS)))
    g = C.fit_pooled_rates(seen, hits)
    assert g.shape == (A.DEPTHS, A.BINS) and np.all(np.diff(g, axis=1) >= -1e-12) and np.all((g >= 0) & (g <= 1))
    C.write_calibration(str(tmp_path), "markov", C.Table.make(np.ones((4, 10)), np.full((4, 10), 0.5)), command="taps")
    C.write_calibration(str(tmp_path), C.STEP, C.Table.make(seen, g), drafter="x", kind="functions")
    back = C.read_calibration(str(tmp_path))
    assert set(back.kinds()) == {"markov", C.STEP}
    made = C.json_thaw(dict(back.info)["made"])
    assert made[C.STEP]["drafter"] == "x" and made["markov"]["command"] == "taps"
    n, h = back.prior(C.STEP, 50.0)
    np.testing.assert_allclose(np.asarray(h), np.clip(seen, 1, 50).reshape(-1) * g.reshape(-1), rtol=1e-6)
    d = noisy_lm_drafter(VOCAB)
    A.AdaptiveShape(d, (1.0, 2.0), calibration=back)  # its "step" table
    with pytest.raises(ValueError, match="no 'step' table"):
        A.AdaptiveShape(d, (1.0, 2.0), calibration=C.Calibration(((("markov"), back.table("markov")),)))
    assert C.read_calibration(str(tmp_path / "nothing")) is None
    with pytest.raises(ValueError, match="within"):
        C.fit_pooled_rates(seen, seen + 1)
    (tmp_path / C.FILE).write_text(json.dumps({"format": "other"}))
    with pytest.raises(ValueError, match="not a"):
        C.read_calibration(str(tmp_path))


def test_refusals(dense):
    target, lm = dense
    widths = W.adaptive_widths(5)
    with pytest.raises(ValueError, match="path log q"):
        A.AdaptiveShape(NgramDrafter(), costs(widths))
    with pytest.raises(ValueError, match="positive"):
        A.AdaptiveShape(lm, (1.0, -1.0))
    with pytest.raises(ValueError, match="decay"):
        A.AdaptiveShape(lm, costs(widths), decay=1.0)
    a = A.AdaptiveShape(lm, costs(widths))
    with pytest.raises(ValueError, match="already adaptive"):
        A.AdaptiveShape(a, costs(widths))
    p = [[1, 2, 3]]
    with pytest.raises(ValueError, match="sampled candidates"):
        specjax.generate(target, p, drafters=[a], tree="chain=4", temperature=1.0, verify="sampled")
    with pytest.raises(ValueError, match="costs has"):
        specjax.generate(target, p, drafters=[a], tree="chain=6")
    cut = BlockDrafter(BlockHead(BlockConfig.for_target(target.config, block_size=4, num_layers=1), nnx.Rngs(0)),
                       target, confidence=0.5)
    with pytest.raises(ValueError, match="already chooses"):
        specjax.generate(target, p, drafters=[A.AdaptiveShape(cut, costs(W.adaptive_widths(5)))], tree="chain=4")


# ----------------------------------------------------------------------------- margin verification (lossy)

def _chain(tokens):
    return T.chain_tree(jnp.asarray([tokens[0]]), jnp.asarray([tokens[1:]]))


def test_margin_accepts_within_delta_constructed():
    """Root logits: token 5 at 3.0 (the argmax), token 7 at 2.5; the draft proposes 7 then 2. The
    greedy rule rejects 7; the margin rule at δ = 0 too; at δ = 0.6 it accepts 7, then checks 2
    against node 1's row (argmax 2: accepted), and the bonus is node 2's argmax."""
    V_ = 10
    logits = np.zeros((1, 3, V_), np.float32)
    logits[0, 0, 5], logits[0, 0, 7] = 3.0, 2.5
    logits[0, 1, 2] = 1.0
    logits[0, 2, 9] = 1.0
    tree = _chain([1, 7, 2])
    lg, key = jnp.asarray(logits), jax.random.key(0)
    g = V.verify(tree, lg, key, rule="greedy", max_depth=2)
    m0 = V.verify(tree, lg, key, rule="margin", max_depth=2, margin=0.0, greedy=True)
    m1 = V.verify(tree, lg, key, rule="margin", max_depth=2, margin=0.6, greedy=True)
    assert int(g.num_accepted[0]) == 0 and int(g.bonus[0]) == 5
    assert int(m0.num_accepted[0]) == 0 and int(m0.bonus[0]) == 5
    assert int(m1.num_accepted[0]) == 2 and np.asarray(m1.tokens[0]).tolist() == [7, 2] and int(m1.bonus[0]) == 9
    # Of two children within the margin, the higher target logit wins.
    two = T.TreeBuffers(tokens=jnp.asarray([[1, 7, 6]]), parents=jnp.asarray([[-1, 0, 0]]),
                        depth=jnp.asarray([[0, 1, 1]]), valid=jnp.ones((1, 3), bool), score=jnp.zeros((1, 3)),
                        source=jnp.zeros((1, 3), jnp.int8))
    lg2 = lg.at[0, 0, 6].set(2.8)
    assert int(V.verify(two, lg2, key, rule="margin", max_depth=1, margin=1.0, greedy=True).tokens[0, 0]) == 6


def test_margin_zero_is_the_lossless_rule_on_random_trees():
    rng = np.random.default_rng(0)
    B, N, V_ = 64, 7, 12
    spec = T.parse_tree_spec("[[0],[1],[0,0],[0,1],[1,0],[0,0,0]]")
    parents, depth, _ = spec.layout()
    tree = T.TreeBuffers(tokens=jnp.asarray(rng.integers(0, V_, (B, N)), jnp.int32),
                         parents=jnp.broadcast_to(jnp.asarray(parents), (B, N)),
                         depth=jnp.broadcast_to(jnp.asarray(depth), (B, N)), valid=jnp.ones((B, N), bool),
                         score=jnp.zeros((B, N)), source=jnp.zeros((B, N), jnp.int8))
    logits = jnp.asarray(rng.normal(size=(B, N, V_)) * 2, jnp.float32)
    # Make many drafted tokens the argmax of their parent's row, so paths get long.
    am = jnp.argmax(logits, axis=-1)
    tree = dataclasses.replace(tree, tokens=jnp.where(jnp.asarray(rng.uniform(size=(B, N)) < 0.6),
                                                      jnp.take_along_axis(am, jnp.maximum(tree.parents, 0), 1),
                                                      tree.tokens).astype(jnp.int32))
    key = jax.random.key(1)
    for greedy, rule in ((True, "greedy"), (False, "deterministic")):
        params = None if greedy else SamplingParams.make(1.0)
        ref = V.verify(tree, logits, key, rule=rule, max_depth=spec.max_depth, params=params)
        got = V.verify(tree, logits, key, rule="margin", max_depth=spec.max_depth, params=params, margin=0.0,
                       greedy=greedy)
        for f in ("num_accepted", "bonus", "tokens", "path"):
            assert np.array_equal(np.asarray(getattr(ref, f)), np.asarray(getattr(got, f))), (rule, f)
        wide = V.verify(tree, logits, key, rule="margin", max_depth=spec.max_depth, params=params, margin=3.0,
                        greedy=greedy)
        assert np.asarray(wide.num_accepted).mean() > np.asarray(ref.num_accepted).mean()


def test_margin_in_generate_and_its_refusals(dense):
    target, lm = dense
    prompts = _prompts(4, seed=2)
    ref = specjax.generate(target, prompts, max_new_tokens=16).sequences()
    r0 = specjax.generate(target, prompts, max_new_tokens=16, drafters=[lm], tree="chain=3", verify="margin", margin=0.0)
    assert r0.sequences() == ref and r0.lossless is False
    r1 = specjax.generate(target, prompts, max_new_tokens=16, drafters=[lm], tree="chain=3", verify="margin", margin=4.0)
    assert r1.stats["tau"].mean() > r0.stats["tau"].mean() and not r1.lossless
    assert specjax.generate(target, prompts, max_new_tokens=16, drafters=[lm], tree="chain=3").lossless
    p = [[1, 2, 3]]
    with pytest.raises(ValueError, match="needs margin"):
        specjax.generate(target, p, drafters=[lm], verify="margin")
    with pytest.raises(ValueError, match="margin= is read by"):
        specjax.generate(target, p, drafters=[lm], margin=1.0)
    with pytest.raises(ValueError, match=">= 0"):
        specjax.generate(target, p, drafters=[lm], verify="margin", margin=-1.0)
    with pytest.raises(ValueError, match="need at least one drafter"):
        specjax.generate(target, p, margin=1.0)


def test_cli_margin_warns_and_adaptive_needs_a_profile(capsys, tmp_path):
    from tokenizers import ByteLevelBPETokenizer

    from specjax.cli import main
    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(["def add(a, b):\n    return a + b\n"] * 20, vocab_size=280, special_tokens=["<|endoftext|>"],
                            show_progress=False)
    cfg = specjax.ModelConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                              num_kv_heads=1, head_dim=16, max_position_embeddings=64)
    path = str(tmp_path / "m")
    specjax.save_model(specjax.init_model(cfg, seed=0), path, tokenizer=tok)
    base = ["generate", "--model", path, "--prompt", "def add(a, b):", "--max-new-tokens", "6", "--ignore-eos",
            "--drafter", path, "--tree", "chain=3", "--json"]
    assert main(base + ["--verify", "margin", "--margin", "0.5"]) == 0
    out = capsys.readouterr()
    assert "lossy" in out.err and json.loads(out.out.splitlines()[0])["lossless"] is False
    for argv, msg in ((["--margin", "1"], "--verify margin only"), (["--verify", "margin"], "needs --margin"),
                      (["--adaptive"], "needs this machine's verify-width cost profile")):
        with pytest.raises(SystemExit) as e:
            main(base + argv)
        assert e.value.code == 2 and msg in capsys.readouterr().err
    widths = W.adaptive_widths(4)
    prof = tmp_path / "p.json"
    prof.write_text(json.dumps({"rows": {"1": {"widths": list(widths), "round_s": list(costs(widths)), "draft_s": 0.3}}}))
    assert main(base + ["--adaptive", "--verify-profile", str(prof)]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[0])["lossless"] is True
