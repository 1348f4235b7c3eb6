"""Packed verification (design §19, `specjax.spec.packing`): each row of a round verifies its own
nodes, and the target's dense layers run on the packed live nodes of all rows.

- the packed forward equals the row-layout forward on every live node (logits, hidden states, the
  K/V it writes), and gives 0 at absent nodes;
- greedy output equals autoregressive output at a ragged batch of 4 with per-row cuts, with and
  without the goodput budget; finished rows cost nothing (`mean_T`);
- the loop traces once and each budget's branch once;
- the goodput budget keeps the best-estimated nodes, closed under ancestors, at the budget with
  the most expected tokens per second;
- speculative sampling with ragged per-row widths and packing is lossless (chi-square on the first
  two tokens of 3e4 rows), and a planted packing bug is caught;
- bad packing is refused before tracing.
"""
from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from helpers import assert_first_two_follow, compare_greedy, first_two_chi_squares, noisy_lm_drafter, tiny_target
from specjax.drafters import Drafter, LMDrafter
from specjax.engine import loop as engine
from specjax.models import hybrid, transformer
from specjax.spec import packing, tree as tree_lib
from specjax.spec.packing import Packing

import test_hybrid
import test_speculative

VOCAB = 48
CHAIN = "chain=4"


class RowCutDrafter(Drafter):
    """Wraps a drafter: row b keeps its draft to depth (b + round) % (D + 1) (ragged per row and round),
    and gives per-node estimates `est` that fall with depth, faster in odd rows."""
    name = "rowcut"
    gives_q = True

    def __init__(self, inner: Drafter):
        self.inner = inner

    @property
    def vocab_size(self):
        return self.inner.vocab_size

    def check_tree(self, spec, rule):
        return self.inner.check_tree(spec, rule)

    def init(self, prompt_BxP, lengths_B, capacity, target_out):
        return (self.inner.init(prompt_BxP, lengths_B, capacity, target_out), jnp.zeros((), jnp.int32))

    def propose(self, state, root_B, ctx):
        inner, r = state
        prop = self.inner.propose(inner, root_B, ctx)
        tree = prop.tree
        B = root_B.shape[0]
        cut_B = (jnp.arange(B) + r) % (ctx.spec.max_depth + 1)
        tree = dataclasses.replace(tree, valid=tree.valid & (tree.depth <= cut_B[:, None]))
        rate = jnp.where(jnp.arange(B) % 2 == 0, 0.9, 0.3)[:, None]
        est = jnp.where(tree.valid, rate ** tree.depth, 0.0)
        return dataclasses.replace(prop, tree=tree, state=(prop.state, r), est=est)

    def commit(self, state, committed):
        inner, r = state
        return (self.inner.commit(inner, committed), r + 1)


@pytest.fixture(scope="module")
def target():
    return tiny_target(VOCAB)


@pytest.fixture(scope="module")
def drafter():
    return noisy_lm_drafter(VOCAB)


def _prompts(seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, n).tolist() for n in (7, 23, 12, 5)]  # ragged, one 32-token bucket


# ----------------------------------------------------------------------------- the packed forward

def test_packed_forward_equals_the_row_forward_on_live_nodes(target):
    B, D, N = 3, 4, 5
    rng = np.random.default_rng(0)
    prompt = jnp.asarray(rng.integers(0, VOCAB, (B, 8)), jnp.int32)
    cache = transformer.prefill(target, prompt, jnp.array([8, 5, 7]), transformer.init_cache(target, B, 32)).cache
    tree = tree_lib.chain_tree(jnp.asarray(rng.integers(0, VOCAB, B), jnp.int32),
                               jnp.asarray(rng.integers(0, VOCAB, (B, D)), jnp.int32))
    live = tree.depth <= jnp.array([2, 0, 4])[:, None]  # 3 + 1 + 5 = 9 live nodes
    pos, anc = tree_lib.positions(tree, cache.length), tree_lib.ancestor_mask(tree, D)
    full = transformer.forward(target, tree.tokens, pos, cache, anc, hidden_layers=(0,))
    pack = packing.pack_index(live, 12)
    assert np.asarray(pack.valid_T).sum() == 9
    assert np.asarray(pack.row_T)[:9].tolist() == [0, 0, 0, 1, 2, 2, 2, 2, 2]
    out = transformer.forward(target, tree.tokens, pos, cache, anc, hidden_layers=(0,), pack=pack)
    m = np.asarray(live)
    np.testing.assert_allclose(np.asarray(out.logits)[m], np.asarray(full.logits)[m], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(out.hidden[0])[m], np.asarray(full.hidden[0])[m], atol=1e-5, rtol=1e-5)
    assert not np.asarray(out.logits)[~m].any()
    for b in range(B):  # the K/V of live nodes land where the row forward puts them
        L = int(cache.length[b])
        for i in range(N):
            if m[b, i]:
                np.testing.assert_allclose(np.asarray(out.cache.k[:, b, L + i]), np.asarray(full.cache.k[:, b, L + i]),
                                           atol=1e-5, rtol=1e-5)


def test_budgets_and_pack_index():
    assert packing.packed_budgets(4, 5) == (4, 8, 16, 20)
    assert packing.packed_budgets(1, 9, min_rows=2) == (2, 4, 8, 9)
    assert packing.packed_budgets(3, 1) == (3,)
    live = jnp.array([[True, False, True], [False, False, False], [True, True, False]])
    p = packing.pack_index(live, 6)
    assert np.asarray(p.row_T).tolist()[:4] == [0, 0, 2, 2] and np.asarray(p.node_T).tolist()[:4] == [0, 2, 0, 1]
    assert np.asarray(p.valid_T).tolist() == [True] * 4 + [False] * 2
    x = jnp.arange(9.0).reshape(3, 3)
    np.testing.assert_array_equal(np.asarray(packing.to_rows(packing.to_packed(x, p), p, 3, 3)), np.where(live, x, 0))


# ----------------------------------------------------------------------------- the goodput budget

def test_goodput_budget_keeps_the_best_nodes_closed_under_ancestors():
    B, N, D = 2, 5, 4
    root = jnp.zeros((B,), jnp.int32)
    tree = tree_lib.chain_tree(root, jnp.ones((B, D), jnp.int32))
    anc = tree_lib.ancestor_mask(tree, D)
    live = jnp.ones((B, N), bool)
    est = jnp.array([[1.0, 0.9, 0.8, 0.7, 0.6], [1.0, 0.5, 0.95, 0.94, 0.93]])  # row 1: a child above its parent
    budgets = (2, 4, 8, 10)
    # flat costs: the widest budget wins, every node kept
    kept, T = packing.choose_packed(est, live, anc, (1.0, 1.0, 1.0, 1.0), budgets)
    assert int(T) == 10 and np.asarray(kept).all()
    # steep costs past 4 slots: 2 non-root nodes, the best by estimate with their ancestors
    kept, T = packing.choose_packed(est, live, anc, (1.0, 1.1, 10.0, 10.0), budgets)
    assert int(T) == 4
    k = np.asarray(kept)
    assert k[:, 0].all() and k[0, 1] and k.sum() <= 4
    assert not k[1, 2] or k[1, 1]  # closed: node 2 of row 1 only with its parent
    # a budget below the active rows is never chosen; a row with no active root keeps nothing
    kept, T = packing.choose_packed(est, live.at[1].set(False), anc, (0.5, 1.0, 2.0, 3.0), budgets)
    assert not np.asarray(kept[1]).any() and int(T) >= 1
    # nodes not worth their slot: only the roots
    kept, T = packing.choose_packed(est * 0.01, live, anc, (1.0, 2.0, 4.0, 5.0), budgets)
    assert int(T) == 2 and np.asarray(kept).sum() == 2


# ----------------------------------------------------------------------------- end to end, greedy

def _greedy(target, drafter, packing_, prompts, new=24):
    ref = specjax.generate(target, prompts, max_new_tokens=new)
    got = specjax.generate(target, prompts, max_new_tokens=new, drafters=[drafter], tree=CHAIN, packing=packing_)
    n_exact, n_near = compare_greedy(ref.sequences(), got.sequences(), test_speculative._logits_fn(target, prompts))
    assert n_exact + n_near == len(prompts)
    return got


def test_greedy_equals_autoregressive_with_per_row_widths(target, drafter):
    got = _greedy(target, RowCutDrafter(drafter), Packing(), _prompts(1))
    st = got.stats
    assert st["accepted"].sum() > 0
    w = st["mean_verify_width"]
    assert (w >= 1).all() and (w < 5).all() and len(set(np.round(w, 3))) > 1, w  # ragged per row
    assert 4 <= st["mean_T"] < 20  # the compiled budgets, not 4 rows x 5 nodes every round


def test_greedy_equals_autoregressive_with_the_goodput_budget(target, drafter):
    budgets = packing.packed_budgets(4, 5)
    steep = Packing(budgets=budgets, round_s=(1.0, 1.3, 3.0, 4.0))
    got = _greedy(target, RowCutDrafter(drafter), steep, _prompts(2))
    per_row = _greedy(target, RowCutDrafter(drafter), Packing(), _prompts(2))
    assert got.stats["mean_T"] < per_row.stats["mean_T"]  # the budget cut nodes the cut drafts kept
    # the well-estimated rows (even: 0.9 per level) keep more of their drafts than the odd ones (0.3)
    w = got.stats["verified_nodes"] / got.stats["rounds"]
    assert w[[0, 2]].mean() > w[[1, 3]].mean()


def test_goodput_on_calibrated_estimates(target, drafter):
    """`AdaptiveShape.estimator`: the tree verified whole by the wrapper, its online-calibrated estimates in
    `Proposal.est` for the budget to cut by; greedy output still the target's own."""
    from specjax.drafters.composite.adaptive import AdaptiveShape
    est = AdaptiveShape.estimator(drafter, 5)
    assert est.verify_widths(tree_lib.parse_tree_spec(CHAIN)) == (5,)
    mild = Packing(budgets=packing.packed_budgets(4, 5), round_s=(1.0, 1.1, 1.3, 1.4))
    got = _greedy(target, est, mild, _prompts(7))
    assert 4 < got.stats["mean_T"] < 20 and got.stats["accepted"].sum() > 0


def test_finished_rows_cost_nothing(target, drafter):
    """Rows of 4, 12, 24 new tokens in one batch: after a row finishes, rounds pack fewer nodes."""
    prompts = _prompts(3)
    full = specjax.generate(target, prompts, max_new_tokens=24, drafters=[drafter], tree=CHAIN, packing=Packing())
    assert full.stats["mean_T"] <= 20
    eos = full.sequences()[0][3]  # row 0 stops at its 4th token, the others may too
    got = specjax.generate(target, prompts, max_new_tokens=24, drafters=[drafter], tree=CHAIN, packing=Packing(),
                           eos_token_id=eos)
    ref = specjax.generate(target, prompts, max_new_tokens=24, eos_token_id=eos)
    assert got.sequences() == ref.sequences()
    assert got.stats["mean_T"] < full.stats["mean_T"]


def test_one_trace_each_budget_once(target, drafter, monkeypatch):
    calls = []
    real = packing.pack_index
    monkeypatch.setattr(packing, "pack_index", lambda live, T: (calls.append(T), real(live, T))[1])
    kw = dict(max_new_tokens=11, drafters=[RowCutDrafter(drafter)], tree=CHAIN, packing=Packing())
    before = engine.trace_count()
    a = specjax.generate(target, _prompts(4), **kw)
    mid = engine.trace_count()
    b = specjax.generate(target, _prompts(5), **kw)  # other prompts, same bucket
    assert mid == before + 1 and engine.trace_count() == mid
    assert calls == [4, 8, 16, 20], calls  # one branch per budget, each traced once
    assert a.sequences() != b.sequences()


# ----------------------------------------------------------------------------- sampling

SV, ROWS = 8, 30_000


def _spread_pair():
    from helpers import noisy_copy, spread_target
    target = spread_target(SV)
    return target, LMDrafter(noisy_copy(target, 0.5, 3))


def _first_two(target, drafter, packing_, seeds=1):
    """The first two tokens of `seeds` x ROWS rows, the accepted drafts per row, and the target's
    logits after the prompt and after prompt + a for every token a."""
    prompt = [3, 1, 4, 1, 5]
    toks, ns = [], []
    for seed in range(seeds):
        r = specjax.generate(target, [prompt] * ROWS, max_new_tokens=2, temperature=1.0, seed=seed,
                             drafters=[RowCutDrafter(drafter)], tree="chain=3", verify="deterministic",
                             packing=packing_)
        toks.append(r.tokens)
        ns.append(r.stats["accepted"])
    seqs = [prompt] + [prompt + [a] for a in range(SV)]
    tok = jnp.asarray([s + [0] * (len(prompt) + 1 - len(s)) for s in seqs], jnp.int32)
    lens = jnp.asarray([len(s) for s in seqs], jnp.int32)
    out = transformer.prefill(target, tok, lens, transformer.init_cache(target, len(seqs), 16))
    logits = np.asarray(out.logits, np.float64)[np.arange(len(seqs)), np.asarray(lens) - 1]
    return np.concatenate(toks), np.concatenate(ns), logits


def test_sampling_with_ragged_packed_widths_is_lossless(monkeypatch):
    monkeypatch.setattr(engine, "PROMPT_BUCKET", 8)  # 2e4 rows: keep the padded prompt short
    target, drafter = _spread_pair()
    budgets = packing.packed_budgets(ROWS, 4)
    goodput = Packing(budgets=budgets, round_s=tuple(1.0 + 0.2 * i for i in range(len(budgets))))
    toks, n, logits = _first_two(target, drafter, goodput)
    assert 0.1 < (n >= 1).mean() < 0.9  # both acceptance and rejection, ragged widths
    p0, p1 = logits[0], logits[1:]
    first, second = toks[:, 0], toks[:, 1]
    every = np.full(len(first), 2)  # the second token given the first, whichever round drew it
    assert_first_two_follow(first, second, every, p0, p1, SV)
    # a planted bug: the packed logits land one node off (a node verified with its parent's logits)
    real = packing.to_rows
    monkeypatch.setattr(packing, "to_rows", lambda x, p, B, N: real(x, dataclasses.replace(
        p, node_T=jnp.minimum(p.node_T + 1, N - 1)), B, N))
    jax.clear_caches()  # trace the loop again, with the bug
    toks_b, n_b, _ = _first_two(target, drafter, goodput, seeds=1)
    stats = first_two_chi_squares(toks_b[:, 0], toks_b[:, 1], np.full(len(toks_b), 2), p0, p1, SV)
    assert any(stat > crit for stat, _, crit in stats), "a packing that shifts nodes was not caught"


# ----------------------------------------------------------------------------- refusals

def test_bad_packing_is_refused(target, drafter, tmp_path):
    kw = dict(max_new_tokens=4, drafters=[drafter], tree=CHAIN)
    p = _prompts(6)
    with pytest.raises(ValueError, match="must be a specjax.spec.packing.Packing"):
        specjax.generate(target, p, packing="rows", **kw)
    with pytest.raises(ValueError, match="last budget must be batch x tree nodes = 20"):
        specjax.generate(target, p, packing=Packing(budgets=(4, 8)), **kw)
    with pytest.raises(ValueError, match="strictly ascending"):
        Packing(budgets=(8, 4))
    with pytest.raises(ValueError, match="one figure per budget"):
        Packing(budgets=(4, 20), round_s=(1.0,))
    with pytest.raises(ValueError, match="positive seconds"):
        Packing(budgets=(4, 20), round_s=(1.0, 0.0))
    with pytest.raises(ValueError, match="need at least one drafter"):
        specjax.generate(target, p, max_new_tokens=4, packing=Packing())
    hyb = test_hybrid._random_model(hybrid.HybridModel, test_hybrid.TARGET, 0)
    with pytest.raises(ValueError, match="does not pack its forward"):
        specjax.generate(hyb, [[1, 2, 3]], max_new_tokens=4, drafters=[test_hybrid._drafter_for(hyb, 7)],
                         tree=CHAIN, packing=Packing())
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    with pytest.raises(ValueError, match="packed verification runs on one device"):
        specjax.generate(target, p, packing=Packing(), mesh=mesh, **kw)
    prof = tmp_path / "p.json"
    prof.write_text(json.dumps({"packed": {"4": {"budgets": [4, 8, 16, 20], "round_s": [1.0, 1.2, 1.5, 2.0]}}}))
    assert packing.load_packing(prof, 4).round_s == (1.0, 1.2, 1.5, 2.0)
    with pytest.raises(ValueError, match="no packed row for batch 2"):
        packing.load_packing(prof, 2)
