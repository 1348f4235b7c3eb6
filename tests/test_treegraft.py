"""TreeGraft (design §6): a cheap and a strong drafter, one composite drafter in the unchanged loop.

- greedy output equals autoregressive output for every action (cheap / strong / graft / recover / union) and
  policy (always / never / switch / a one-output scheduler / a scheduler over actions), for
  lm+lm (a noisy copy of the target as the strong drafter, a tiny random model as the cheap one)
  and ngram+lm, batch 1 and a ragged batch of 4; all policies share one compiled program;
- the deterministic-candidates rule stays lossless on mixed-source trees built by `graft_tree`
  (chi-square over 1e5 rounds, as tests/test_verify.py); the union merges shared prefixes; the value
  system's records count each action's accepted length as verification does, and the oracle is exact;
- rescoring is non-destructive; grafting adds exactly the strong top tokens missing from the tree;
  the selected tree stays connected and topological (property test); `score` equals each
  drafter's own drafting distributions;
- bad input is refused with a clear ValueError before anything is traced;
- the value system and the distillation run end to end, and the CLI runs TreeGraft from their
  export.
"""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings, strategies as st

import specjax
from helpers import (cheap_compiles, chi_square, compare_greedy, noisy_lm_drafter, prefix_logits_fn, tiny_drafter_model,
                     tiny_target, word_model_dir)
from specjax.engine import loop as engine
from specjax.drafters.composite import treegraft_scheduler as sched_lib
from specjax.spec import tree as T, verify as V
from specjax.drafters import DraftContext, FeatureConfig, FeatureDrafter, FeatureHead, LMDrafter, NgramDrafter
from specjax.models import transformer
from specjax.models.config import ModelConfig
from specjax.spec.sampling import SamplingParams
from specjax.drafters.composite.treegraft import ACTIONS, STRONG, TreeGraft, graft_tree, record_columns, union_tree

VOCAB = 64
TREE = "depth=3,topk=3,nodes=8"  # the verify budget (as tools/bench_treegraft.py --smoke: shared compiles)
NEW = 12


@pytest.fixture(autouse=True, scope="module")
def _cheap_compiles():
    """XLA's optimisation passes dominate these tests' time (tiny models, many programs): skip them
    here (`helpers.cheap_compiles`), and restore the setting for the other modules."""
    with cheap_compiles():
        yield


@pytest.fixture(scope="module")
def target():
    return tiny_target(VOCAB)  # shared (helpers), as test_adaptive's


@pytest.fixture(scope="module")
def strong():
    return noisy_lm_drafter(VOCAB, seed=1)  # the target plus noise (scale 0.1), as test_adaptive's


@pytest.fixture(scope="module")
def cheap_lm():
    return LMDrafter(tiny_drafter_model(VOCAB))


def toy_scheduler(threshold=0.0):
    """Invokes the strong drafter where the row accepted nothing last round: gelu(gelu(0.5 - last)) > 0.
    Default architecture (32, 32), so it shares compiled programs with distilled schedulers."""
    s = sched_lib.Scheduler(sched_lib.SchedulerConfig())
    i = sched_lib.FEATURE_NAMES.index("last_accepted")
    k0 = np.zeros((sched_lib.NUM_FEATURES, 32), np.float32)
    k0[i, 0] = -1.0
    b0 = np.zeros(32, np.float32)
    b0[0] = 0.5
    k1 = np.zeros((32, 32), np.float32)
    k1[0, 0] = 1.0
    k2 = np.zeros((32, 1), np.float32)
    k2[0, 0] = 1.0
    for layer, k, b in zip(s.layers, (k0, k1, k2), (b0, np.zeros(32), np.zeros(1))):
        layer.kernel.set_value(jnp.asarray(k))
        layer.bias.set_value(jnp.asarray(b, jnp.float32))
    s.threshold.set_value(jnp.float32(threshold))
    return s


def _prompts(batch, seed, repetitive):
    rng = np.random.default_rng(seed)
    out = []
    for n in (7, 23, 12, 40)[:batch]:
        if repetitive:
            out.append((rng.integers(0, VOCAB, 5).tolist() * 9)[:n])
        else:
            out.append(rng.integers(0, VOCAB, n).tolist())
    return out


_logits_fn = prefix_logits_fn  # compare_greedy's reference logits (helpers)


# ----------------------------------------------------------------------------- greedy exactness

def toy_action_scheduler():
    """A scheduler over actions: recover where the row accepted nothing last round, the cheap chain elsewhere
    (one unit, as `toy_scheduler`)."""
    s = sched_lib.Scheduler(sched_lib.SchedulerConfig(kind="regression", actions=sched_lib.ACTIONS))
    i = sched_lib.FEATURE_NAMES.index("last_accepted")
    k0 = np.zeros((sched_lib.NUM_FEATURES, 32), np.float32)
    k0[i, 0] = -1.0
    b0 = np.zeros(32, np.float32)
    b0[0] = 0.5
    k1 = np.zeros((32, 32), np.float32)
    k1[0, 0] = 1.0
    k2 = np.zeros((32, len(sched_lib.ACTIONS)), np.float32)
    k2[0, sched_lib.ACTIONS.index("recover")] = 1.0
    k2[0, sched_lib.ACTIONS.index("cheap")] = -1.0
    b2 = np.full(len(sched_lib.ACTIONS), -1.0, np.float32)
    b2[[sched_lib.ACTIONS.index("recover"), sched_lib.ACTIONS.index("cheap")]] = 0.0
    for layer, k, b in zip(s.layers, (k0, k1, k2), (b0, np.zeros(32), b2)):
        layer.kernel.set_value(jnp.asarray(k))
        layer.bias.set_value(jnp.asarray(b, jnp.float32))
    return s


@pytest.mark.parametrize("pair,batch", [("lm+lm", 4), ("ngram+lm", 1)])
def test_greedy_equals_autoregressive_for_every_policy(target, strong, cheap_lm, pair, batch):
    """Every action, the former policies, the switch policy and both kinds of scheduler: the target's own
    tokens, one compiled program for all (the policy is a traced setting; a scheduler of another
    architecture is another program). Each pair at one batch (a ragged 4 and 1): the programs are the same
    code at another shape, and each compile of them costs ~7 s; the bench smoke below runs the n-gram
    pair's scheduler, recover and oracle rows at batch 1 again, test_switch the Switch at batches 1, 2, 4."""
    cheap = cheap_lm if pair == "lm+lm" else NgramDrafter()
    prompts = _prompts(batch, seed=batch, repetitive=pair == "ngram+lm")
    ref = specjax.generate(target, prompts, max_new_tokens=NEW, eos_token_id=())
    for sched in (toy_scheduler(), toy_action_scheduler()):
        tg = TreeGraft(cheap, strong, scheduler=sched, policy="always", grow=2)
        traces = None
        policies = ("scheduler",) if sched.config.actions else (
            ("always", "never", "scheduler") + ACTIONS + (("switch",) if pair == "ngram+lm" else ()))
        for policy in policies:
            tg.set_policy(policy)
            got = specjax.generate(target, prompts, max_new_tokens=NEW, eos_token_id=(), drafters=[tg], tree=TREE)
            n_exact, n_near = compare_greedy(ref.sequences(), got.sequences(), _logits_fn(target, prompts))
            assert n_exact + n_near == batch, policy
            st_ = got.stats
            rounds, invoked = st_["rounds"], st_["treegraft_invoked"]
            acts = {a: st_[f"treegraft_action_{a}"] for a in ACTIONS}
            assert (sum(acts.values()) == rounds).all()
            rep = tg.report(st_)["treegraft"]
            assert rep["actions"] == {a: int(v.sum()) for a, v in acts.items()}
            if policy == "always":
                assert (invoked == rounds).all() and (acts["graft"] == rounds).all()
                assert st_["treegraft_grafted_proposed"].sum() > 0
                # the strong drafter is the target plus noise: its grafts are accepted
                assert st_["treegraft_grafted_paths"].sum() > 0
                assert (st_["treegraft_tokens_strong"] >= st_["treegraft_grafted_paths"]).all()
                assert (st_["treegraft_grafted_paths"] <= st_["accepted_at_depth"][:, 0]).all()
            elif policy in ("never", "cheap"):
                assert (invoked == 0).all() and (st_["treegraft_grafted_proposed"] == 0).all()
            elif policy == "recover":  # the grown subtrees are accepted (the strong drafter is nearly the target)
                assert st_["treegraft_tokens_recovered"].sum() > 0 and rep["recovered_share"] > 0
            elif policy in ACTIONS:
                assert (acts[policy] == rounds).all() and (invoked == rounds).all()
            elif sched.config.actions:  # both of its actions taken
                assert 0 < acts["recover"].sum() < rounds.sum() and acts["recover"].sum() + acts["cheap"].sum() == \
                    rounds.sum()
            elif policy == "scheduler":
                assert 0 < invoked.sum() < rounds.sum(), (invoked, rounds)
            if policy in ("cheap", "strong"):  # a small action verifies its own width, not the budget
                assert (st_["verified_nodes"] < 8 * rounds).all()
            if traces is None:
                traces = engine.trace_count()
            assert engine.trace_count() == traces  # policies are traced values: one program for all


def test_union_merges_shared_prefixes():
    """union_tree: the strong chain's prefix equal to the cheap chain is the chain's own nodes (siblings stay
    distinct), the rest hangs under the last shared node."""
    root = jnp.array([5])
    chain = T.chain_tree(root, jnp.array([[1, 2, 3]]))
    strong = T.chain_tree(root, jnp.array([[1, 2, 7]]))
    u = union_tree(chain, strong, 4)
    valid = np.asarray(u.valid[0])
    assert np.asarray(u.tokens[0]).tolist() == [5, 1, 2, 3, 1, 2, 7]
    assert valid.tolist() == [True, True, True, True, False, False, True]
    assert int(u.parents[0, 6]) == 2 and int(u.depth[0, 6]) == 3  # 7 under the chain's "2"
    other = T.chain_tree(root, jnp.array([[4, 2, 3]]))  # nothing shared: a second branch under the root
    u = union_tree(chain, other, 4)
    assert np.asarray(u.valid[0]).all() and np.asarray(u.parents[0]).tolist() == [-1, 0, 1, 2, 0, 4, 5]


def test_labelled_records_and_oracle(target, strong):
    """The value system's view: each action's accepted length counted against the known continuation
    equals what greedy verification accepts when that action is taken; the oracle (best goodput in
    hindsight) stays exact."""
    prompts = _prompts(2, seed=7, repetitive=True)
    ref = specjax.generate(target, prompts, max_new_tokens=NEW, eos_token_id=())
    fut = np.asarray(specjax.generate(target, prompts, max_new_tokens=NEW + 8, eos_token_id=()).sequences(), np.int32)
    tg = TreeGraft(NgramDrafter(), strong, policy="switch", grow=2)
    widths = tg.verify_widths(T.parse_tree_spec(TREE))
    lab = tg.labelled(fut, rounds=NEW, draft_s=[0.0, 1e-3, 2e-3, 3e-3, 1e-3], verify_s=[1e-3] * len(widths),
                      widths=widths, lam=100.0)
    for policy in ("switch", "oracle", "recover"):
        lab.set_policy(policy)
        got = specjax.generate(target, prompts, max_new_tokens=NEW, eos_token_id=(), drafters=[lab], tree=TREE)
        assert got.sequences() == ref.sequences(), policy
        rec = np.asarray(got.stats["treegraft_records"])  # [B, R, K]
        cols = record_columns()
        n = np.asarray(got.stats["rounds"])
        taken = rec[..., cols.index("action")].astype(int)
        acc = rec[..., [cols.index(f"acc_{a}") for a in ACTIONS]]
        for b in range(2):
            # the accepted length of the action taken is what the round accepted
            accepted = [acc[b, r, taken[b, r]] for r in range(n[b])]
            assert sum(accepted) == int(got.stats["accepted"][b]), (policy, b)
            assert (acc[b, :n[b]] >= 0).all() and (acc[b, :n[b]] <= T.parse_tree_spec(TREE).max_depth).all()


# ----------------------------------------------------------------------------- losslessness

ROWS = 100_000
CV = 6  # vocabulary of the synthetic tables


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def test_mixed_source_tree_is_lossless():
    """Trees built by graft_tree from two drafters' tables (rows invoking the strong drafter at
    random); the deterministic rule's first two emitted tokens follow the target exactly."""
    rng = np.random.default_rng(3)
    p0, p1 = rng.normal(size=CV) * 1.5, rng.normal(size=(CV, CV)) * 1.5  # target
    c0, c1 = rng.normal(size=CV) * 1.5, rng.normal(size=(CV, CV)) * 1.5  # cheap drafter
    s0, s1 = rng.normal(size=CV) * 1.5, rng.normal(size=(CV, CV)) * 1.5  # strong drafter
    lc0, lc1 = np.log(_softmax(c0)), np.log(_softmax(c1))
    ls0, ls1 = np.log(_softmax(s0)), np.log(_softmax(s1))
    # cheap tree: root -> its top-2, each -> its top-1 (M = 5, depth 2); noise on the cheap scores
    # varies the ranking between rows
    top_c0 = np.argsort(-lc0)[:2]
    M = 5
    tok = np.zeros((ROWS, M), np.int32)
    tok[:, 1:3] = top_c0
    tok[:, 3] = np.argmax(lc1[top_c0[0]])
    tok[:, 4] = np.argmax(lc1[top_c0[1]])
    parents = np.array([-1, 0, 0, 1, 2], np.int32)
    depth = np.array([0, 1, 1, 2, 2], np.int32)
    local_c = np.zeros((ROWS, M), np.float32)
    local_c[:, 1:3] = lc0[tok[:, 1:3]] + rng.normal(size=(ROWS, 2)) * 0.5
    local_c[:, 3] = lc1[tok[:, 1], tok[:, 3]]
    local_c[:, 4] = lc1[tok[:, 2], tok[:, 4]]
    score = local_c.copy()
    score[:, 3] += score[:, 1]
    score[:, 4] += score[:, 2]
    cheap = T.TreeBuffers(tokens=jnp.asarray(tok), parents=jnp.broadcast_to(jnp.asarray(parents), (ROWS, M)),
                          depth=jnp.broadcast_to(jnp.asarray(depth), (ROWS, M)), valid=jnp.ones((ROWS, M), bool),
                          score=jnp.asarray(np.minimum(score, 0.0)), source=jnp.zeros((ROWS, M), jnp.int8))
    strong_local = np.zeros((ROWS, M), np.float32)
    strong_local[:, 1:3] = ls0[tok[:, 1:3]]
    strong_local[:, 3] = ls1[tok[:, 1], tok[:, 3]]
    strong_local[:, 4] = ls1[tok[:, 2], tok[:, 4]]
    dist = np.where(depth[None, :] == 0, 0, 1)
    node_lq = np.where((dist == 0)[..., None], ls0[None, None, :], ls1[tok])  # [R, M, V] strong q at each node
    top_tok = np.argsort(-node_lq, axis=-1)[..., :2].astype(np.int32)
    top_lq = np.take_along_axis(node_lq, top_tok, axis=-1).astype(np.float32)
    use = rng.random(ROWS) < 0.6
    N = 6

    @jax.jit
    def build(cheap, sl, tt, tl, use):
        return graft_tree(cheap, sl, tt, tl, use, num_nodes=N, max_depth=2, graft_nodes=3, calibration=-0.3)

    tree, scores, n_grafted = build(cheap, jnp.asarray(strong_local), jnp.asarray(top_tok), jnp.asarray(top_lq),
                                    jnp.asarray(use))
    src, val = np.asarray(tree.source), np.asarray(tree.valid)
    grafted_rows = ((src == STRONG) & val).any(1)
    assert 0.3 < grafted_rows.mean() <= 0.6 + 0.01 and not grafted_rows[~use].any()
    # target logits by node: p0 at the root, p1[token] at depth 1, anything at the leaves
    toks, dep = np.asarray(tree.tokens), np.asarray(tree.depth)
    logits = np.where((dep == 0)[..., None], p0[None, None], np.where((dep == 1)[..., None], p1[toks], 0.0))
    vd = jax.jit(lambda t, lg, k: V.verify(t, lg, k, rule="deterministic", max_depth=2,
                                           params=SamplingParams.make(1.0)))(tree, jnp.asarray(logits, jnp.float32),
                                                                             jax.random.key(7))
    n, t, b, path = (np.asarray(x) for x in (vd.num_accepted, vd.tokens, vd.bonus, vd.path))
    first = np.where(n >= 1, t[:, 0], b)
    second = np.where(n >= 2, t[:, 1], b)
    stat, df, crit = chi_square(np.bincount(first, minlength=CV), _softmax(p0))
    assert stat <= crit, f"first token: chi2 {stat:.1f} > {crit:.1f} (df {df})"
    m = n >= 1
    for x1 in range(CV):
        sel = m & (first == x1)
        if sel.sum() < 2000:
            continue
        stat, df, crit = chi_square(np.bincount(second[sel], minlength=CV), _softmax(p1[x1]))
        assert stat <= crit, f"second | first={x1}: chi2 {stat:.1f} > {crit:.1f}"
    accepted_grafted = src[np.arange(ROWS), path[:, 1]] == STRONG
    assert (accepted_grafted & m).mean() > 0.05  # grafted nodes really are accepted, sometimes
    assert 0.2 < m.mean() < 0.98


# ----------------------------------------------------------------------------- rescoring and grafting

def _small_tree(tokens, parents, score, valid=None):
    tokens, parents = np.asarray([tokens], np.int32), np.asarray([parents], np.int32)
    depth = np.zeros_like(parents)
    for i in range(1, parents.shape[1]):
        depth[0, i] = depth[0, parents[0, i]] + 1
    return T.TreeBuffers(tokens=jnp.asarray(tokens), parents=jnp.asarray(parents), depth=jnp.asarray(depth),
                         valid=jnp.asarray(np.ones_like(tokens, bool) if valid is None else [valid]),
                         score=jnp.asarray([score], jnp.float32), source=jnp.zeros(tokens.shape, jnp.int8))


def test_grafting_adds_the_strong_top_tokens_missing_from_the_tree():
    graft = jax.jit(graft_tree, static_argnames=("num_nodes", "max_depth", "graft_nodes"))
    # root(10) -> 3, 5 ; 3 -> 7 (depth 2 = the verify depth: no grafts below it)
    cheap = _small_tree([10, 3, 5, 7], [-1, 0, 0, 1], [0.0, -0.5, -1.0, -1.2])
    top_tok = jnp.asarray([[[5, 9], [7, 2], [1, 4], [8, 6]]], jnp.int32)  # strong top-2 at each node
    top_lq = jnp.log(jnp.asarray([[[0.5, 0.3], [0.6, 0.2], [0.4, 0.3], [0.9, 0.1]]], jnp.float32))
    strong_local = jnp.log(jnp.asarray([[1.0, 0.1, 0.5, 0.6]], jnp.float32))
    tree, scores, n_grafted = graft(cheap, strong_local, top_tok, top_lq, jnp.asarray([True]),
                                    num_nodes=10, max_depth=2, graft_nodes=4)
    tok, par, src, val = (np.asarray(x)[0] for x in (tree.tokens, tree.parents, tree.source, tree.valid))
    kids = lambda u: sorted((int(tok[j]), int(src[j])) for j in range(len(tok)) if val[j] and par[j] == u)
    assert kids(0) == [(3, 0), (5, 0), (9, STRONG)]  # 5 was already a child: only 9 is grafted
    node3 = int(np.nonzero(val & (tok == 3))[0][0])
    node5 = int(np.nonzero(val & (tok == 5))[0][0])
    assert kids(node3) == [(2, STRONG), (7, 0)]  # 7 existed, 2 grafted
    assert kids(node5) == [(1, STRONG), (4, STRONG)]
    assert int(n_grafted[0]) == 4 and int(val.sum()) == 8  # 4 cheap + 4 grafted, 2 padding slots
    node7 = int(np.nonzero(val & (tok == 7))[0][0])
    assert kids(node7) == []  # at the verify depth: nothing grafted below
    # grafted scores: the strong cumulative log q; the strong score ranks the tree
    g9 = int(np.nonzero(val & (tok == 9))[0][0])
    assert np.isclose(float(scores.strong[0, g9]), np.log(0.3), atol=1e-6)
    assert not bool(scores.has_cheap[0, g9]) and bool(scores.has_strong[0, g9])
    # a smaller budget keeps the best grafts by strong score: 9 (0.3) and 1 (0.5 * 0.4 = 0.2)
    tree2, _, _ = graft(cheap, strong_local, top_tok, top_lq, jnp.asarray([True]), num_nodes=10, max_depth=2,
                        graft_nodes=2)
    g = sorted(int(t) for t, s, v in zip(*(np.asarray(x)[0] for x in (tree2.tokens, tree2.source, tree2.valid)))
               if v and s == STRONG)
    assert g == [1, 9]
    # a row that did not invoke the strong drafter: no grafts, cheap ranking (+ calibration)
    tree3, sc3, n3 = graft(cheap, strong_local, top_tok, top_lq, jnp.asarray([False]), num_nodes=4,
                           max_depth=2, graft_nodes=3, calibration=-0.1)
    assert int(n3[0]) == 0 and np.asarray(tree3.tokens)[0].tolist() == [10, 3, 5, 7]
    np.testing.assert_allclose(np.asarray(tree3.score)[0], [0.0, -0.6, -1.1, -1.4], atol=1e-6)
    assert not np.asarray(sc3.has_strong).any()


M_P, K_P, G_P, N_P, D_P, B_P = 10, 2, 4, 8, 3, 3


@jax.jit
def _graft_random(cheap, sl, tt, tl, use):
    return graft_tree(cheap, sl, tt, tl, use, num_nodes=N_P, max_depth=D_P, graft_nodes=G_P, calibration=-0.2)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**31 - 1))
def test_selection_is_connected_and_topological(seed):
    rng = np.random.default_rng(seed)
    parents = np.full((B_P, M_P), -1, np.int32)
    depth = np.zeros((B_P, M_P), np.int32)
    tokens = np.zeros((B_P, M_P), np.int32)
    score = np.zeros((B_P, M_P), np.float32)
    for b in range(B_P):
        for i in range(1, M_P):
            cand = [j for j in range(i) if depth[b, j] < D_P + 1]
            parents[b, i] = rng.choice(cand)
            depth[b, i] = depth[b, parents[b, i]] + 1
            score[b, i] = score[b, parents[b, i]] + np.log(rng.uniform(0.05, 1.0))
        tokens[b] = rng.permutation(20)[:M_P]  # distinct tokens: distinct siblings
    valid = rng.random((B_P, M_P)) < 0.85
    cheap = T.TreeBuffers(tokens=jnp.asarray(tokens), parents=jnp.asarray(parents), depth=jnp.asarray(depth),
                          valid=jnp.asarray(valid), score=jnp.asarray(score), source=jnp.zeros((B_P, M_P), jnp.int8))
    top_tok = np.stack([[rng.permutation(20)[:K_P] for _ in range(M_P)] for _ in range(B_P)]).astype(np.int32)
    top_lq = np.sort(np.log(rng.uniform(0.01, 0.5, (B_P, M_P, K_P))), axis=-1)[..., ::-1].astype(np.float32)
    strong_local = np.log(rng.uniform(0.05, 1.0, (B_P, M_P))).astype(np.float32)
    use = rng.random(B_P) < 0.5
    tree, scores, _ = _graft_random(cheap, jnp.asarray(strong_local), jnp.asarray(top_tok), jnp.asarray(top_lq),
                                    jnp.asarray(use))
    tok, par, dep, val, sc, org = (np.asarray(x) for x in (tree.tokens, tree.parents, tree.depth, tree.valid,
                                                           tree.score, scores.origin))
    for b in range(B_P):
        assert val[b, 0] and par[b, 0] == -1 and org[b, 0] == 0
        assert len(set(org[b].tolist())) == N_P  # no pool node kept twice
        for i in range(1, N_P):
            if not val[b, i]:
                continue
            p = par[b, i]
            assert 0 <= p < i and val[b, p]  # connected, topological
            assert dep[b, i] == dep[b, p] + 1 and dep[b, i] <= D_P
            assert sc[b, i] <= sc[b, p] + 1e-6  # a child never outranks its parent
        sib = [(par[b, i], tok[b, i]) for i in range(1, N_P) if val[b, i]]
        assert len(sib) == len(set(sib))  # distinct tokens among siblings
        if not use[b]:
            assert not (val[b] & (np.asarray(tree.source)[b] == STRONG)).any()


def test_rescoring_is_non_destructive(target, strong, cheap_lm):
    tg = TreeGraft(cheap_lm, strong, policy="always", calibration=-0.25)
    spec = T.parse_tree_spec(TREE)
    p = tg.plan(spec)
    cspec, M = p.cheap_spec, p.M
    batch = engine.prepare_prompts(_prompts(2, seed=11, repetitive=False), VOCAB, 8, slack=64)
    graphdef, _ = nnx.split((target, tg))
    ctx = DraftContext(spec, "topk", SamplingParams.make(1.0), jax.random.key(0))

    @jax.jit
    def run(state, toks, lens):
        model, g = nnx.merge(graphdef, state)
        out = transformer.prefill(model, toks, lens, transformer.init_cache(model, toks.shape[0], batch.capacity))
        dstate = g.init(toks, lens, batch.capacity, out)
        root = jnp.argmax(engine.last_logits(out.logits, lens), -1).astype(jnp.int32)
        prop = g.propose(dstate, root, ctx)
        own = g.cheap.propose(dstate.cheap, root, DraftContext(cspec, "topk", ctx.params, ctx.key))
        return prop.tree, prop.state.pending.scores, own.tree

    for policy in ("always", "never"):
        tg.set_policy(policy)
        tree, sc, own = run(nnx.state((target, tg)), jnp.asarray(batch.tokens), jnp.asarray(batch.lengths))
        val, org, src = np.asarray(tree.valid), np.asarray(sc.origin), np.asarray(tree.source)
        cheap_nodes = val & (src == 0)
        own_score = np.take_along_axis(np.asarray(own.score), np.minimum(org, M - 1), axis=1)
        # every cheap node still carries the cheap drafter's own cumulative log q
        assert np.asarray(sc.has_cheap)[cheap_nodes].all()
        np.testing.assert_allclose(np.asarray(sc.cheap)[cheap_nodes], own_score[cheap_nodes], atol=1e-5)
        own_tok = np.take_along_axis(np.asarray(own.tokens), np.minimum(org, M - 1), axis=1)
        assert (np.asarray(tree.tokens)[cheap_nodes] == own_tok[cheap_nodes]).all() and (org[cheap_nodes] < M).all()
        if policy == "always":
            assert np.asarray(sc.has_strong)[val].all()
            np.testing.assert_allclose(np.asarray(tree.score)[val], np.asarray(sc.strong)[val], atol=1e-5)
            assert not np.allclose(np.asarray(sc.strong)[cheap_nodes], np.asarray(sc.cheap)[cheap_nodes])
            assert (val & (src == STRONG)).any() and not np.asarray(sc.has_cheap)[val & (src == STRONG)].any()
        else:
            assert not np.asarray(sc.has_strong).any() and not (src == STRONG).any()
            expect = own_score - 0.25 * np.asarray(tree.depth)
            np.testing.assert_allclose(np.asarray(tree.score)[val], expect[val], atol=1e-5)


@pytest.mark.parametrize("kind", ["lm", "feature", "feature-by-depth"])
def test_score_equals_the_drafters_own_distributions(target, strong, kind):
    """One scoring pass over a tree gives the same q at every node as the drafter's own
    depth-by-depth drafting of that tree (static tree: its propose returns q per node); the feature
    drafter's passes of one depth's nodes each (`per_depth`) too."""
    drafter = strong if kind == "lm" else FeatureDrafter(
        FeatureHead(FeatureConfig.for_target(target.config), nnx.Rngs(4)), target)
    spec = T.parse_tree_spec("[[0],[1],[0,0],[0,1],[1,0],[0,0,0]]")
    prompts = _prompts(2, seed=5, repetitive=False)
    batch = engine.prepare_prompts(prompts, VOCAB, 8, slack=16)
    graphdef, state = nnx.split((target, drafter))

    @jax.jit
    def run(state, toks, lens):
        model, d = nnx.merge(graphdef, state)
        cache = transformer.init_cache(model, toks.shape[0], batch.capacity)
        out = transformer.prefill(model, toks, lens, cache, hidden_layers=tuple(d.target_layers))
        dstate = d.init(toks, lens, batch.capacity, out)
        root = jnp.argmax(engine.last_logits(out.logits, lens), -1).astype(jnp.int32)
        prop = d.propose(dstate, root, DraftContext(spec, "topk", SamplingParams.make(1.0), jax.random.key(0)))
        if kind == "feature-by-depth":  # scratch for N + per_depth slots: the engine's slack covers it here
            return prop.probs, jnp.exp(d.score(dstate, prop.tree, spec.max_depth, per_depth=3))
        return prop.probs, jnp.exp(d.score(dstate, prop.tree, spec.max_depth))

    own, scored = (np.asarray(x) for x in run(state, jnp.asarray(batch.tokens), jnp.asarray(batch.lengths)))
    inner = own.sum(-1) > 0.5  # nodes the drafter expanded (leaves are never evaluated by propose)
    assert inner.sum() == 2 * 6  # every node above the last depth, both rows
    np.testing.assert_allclose(scored[inner], own[inner], atol=2e-5)


# ----------------------------------------------------------------------------- bad input

def test_bad_input_is_refused_before_tracing(target, strong, cheap_lm, tmp_path):
    before = engine.trace_count()
    other = LMDrafter(transformer.init_model(ModelConfig(vocab_size=VOCAB + 1, hidden_size=32, intermediate_size=64,
                                                         num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16)))
    with pytest.raises(ValueError, match="share one vocabulary"):
        TreeGraft(other, strong)
    with pytest.raises(ValueError, match="must be a model drafter"):
        TreeGraft(cheap_lm, NgramDrafter())
    no_score = type("NoScore", (LMDrafter,), {"can_score": False})(strong.model)
    with pytest.raises(ValueError, match="cannot score"):
        TreeGraft(cheap_lm, no_score, policy="recover")
    with pytest.raises(ValueError, match="only in the evaluation"):
        TreeGraft(cheap_lm, strong, policy="oracle")
    with pytest.raises(ValueError, match="unknown TreeGraft policy"):
        TreeGraft(cheap_lm, strong, policy="sometimes")
    with pytest.raises(ValueError, match="switch policy reads the cheap drafter's match length"):
        TreeGraft(cheap_lm, strong, policy="switch")
    with pytest.raises(ValueError, match="grow must be a positive integer"):
        TreeGraft(cheap_lm, strong, grow=0)
    with pytest.raises(ValueError, match="needs a scheduler"):
        TreeGraft(cheap_lm, strong, policy="scheduler")
    p = _prompts(1, seed=0, repetitive=False)
    gen = lambda tg, **kw: specjax.generate(target, p, max_new_tokens=8, drafters=[tg], **{"tree": TREE, **kw})
    with pytest.raises(ValueError, match="graft budget 20 does not fit the verify tree"):
        gen(TreeGraft(cheap_lm, strong, graft_nodes=20))
    with pytest.raises(ValueError, match="graft budget 30 does not fit"):
        # an explicit n-gram chain: the default n-gram trie (43 nodes here) offers enough candidates
        gen(TreeGraft(NgramDrafter(), strong, graft_nodes=30, cheap_tree="chain=3"), tree="depth=3,topk=8,nodes=40")
    with pytest.raises(ValueError, match="larger than the verify budget"):
        gen(TreeGraft(cheap_lm, strong, cheap_tree="depth=3,topk=3,nodes=6"))
    with pytest.raises(ValueError, match="no deeper than the verify tree"):
        gen(TreeGraft(cheap_lm, strong, cheap_tree="depth=5,topk=3,nodes=12"))
    with pytest.raises(ValueError, match="deterministic-candidates rule"):
        gen(TreeGraft(cheap_lm, strong), tree="chain=3", temperature=1.0, verify="sampled")
    with pytest.raises(ValueError, match="deterministic-candidates rule"):
        gen(TreeGraft(cheap_lm, strong), temperature=1.0, verify="sampled_noreplace")
    with pytest.raises(ValueError, match="vocabulary"):  # the engine's own check still applies
        specjax.generate(target, p, drafters=[TreeGraft(other, LMDrafter(other.model))], tree=TREE)
    with pytest.raises(ValueError, match="calibration must be a finite"):
        TreeGraft(NgramDrafter(), strong, calibration=float("-inf"))
    with pytest.raises(ValueError, match="calibration must be finite"):
        sched_lib.save_scheduler(toy_scheduler(), str(tmp_path / "nan"), calibration=float("nan"))
    # a scheduler checkpoint for another feature layout
    d = tmp_path / "sched"
    sched_lib.save_scheduler(toy_scheduler(), str(d))
    cfg = json.loads((d / sched_lib.CONFIG_FILE).read_text())
    cfg["feature_layout"], cfg["feature_names"] = "treegraft-features-v0", cfg["feature_names"][:-1]
    (d / sched_lib.CONFIG_FILE).write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="feature layout 'treegraft-features-v0'"):
        sched_lib.load_scheduler(str(d))
    with pytest.raises(ValueError, match="not a TreeGraft scheduler directory"):
        sched_lib.load_scheduler(str(tmp_path))
    assert engine.trace_count() == before


# ----------------------------------------------------------------------------- offline pipeline + CLI

def _cost_table(tg):
    """A cost table of made-up seconds (the shape tools.profile_widths --treegraft writes): actions that
    run the strong drafter cost more, wider verification costs more."""
    from train.value_system import COST_FORMAT
    widths = tg.verify_widths(T.parse_tree_spec(TREE))
    return {"format": COST_FORMAT, "actions": list(ACTIONS), "batches": {"1": {
        "widths": list(widths), "draft_s": [1e-4, 2e-3, 2.5e-3, 4e-3, 2e-3], "verify_s": [1e-3 * (1 + w / 8) for w in widths]}}}


@pytest.fixture(scope="module")
def distilled(target, strong, tmp_path_factory):
    from train import distill_scheduler, value_system
    root = tmp_path_factory.mktemp("tg_value")
    tg = TreeGraft(NgramDrafter(), strong, policy="switch", grow=2)
    prompts = _prompts(3, seed=21, repetitive=True) + _prompts(2, seed=22, repetitive=False)
    costs = _cost_table(tg)
    data = value_system.collect(target, tg, TREE, prompts, costs, max_new_tokens=NEW, progress=False,
                                prompt_sets=["rep"] * 3 + ["rand"] * 2)
    out = value_system.write_dataset(root / "values", data, {"models": {"target": "tiny"}, "config": {"tree": TREE}})
    summary = distill_scheduler.distill([out], root / "run", root / "sched",
                                        distill_scheduler.DistillConfig(steps=30, eval_every=15, batch_size=64,
                                                                        min_match=3),
                                        progress=False)
    return root, data, summary, costs


def test_value_system_and_distillation_end_to_end(target, strong, distilled):
    from train import distill_scheduler, value_system
    root, data, summary, costs = distilled
    n, A = len(data["value"]), len(ACTIONS)
    assert n > 10 and data["features"].shape == (n, sched_lib.NUM_FEATURES)
    assert data["accepted"].shape == data["width"].shape == data["value"].shape == (n, A)
    assert set(np.unique(data["behaviour"])) == {"switch", "oracle"}
    # labels: goodput contributions at the fixed point lam of the per-round best choice
    cost = value_system.action_cost(data["width"], costs["batches"]["1"], data["available"])
    np.testing.assert_allclose(data["value"], data["accepted"] + 1 - float(data["lam"]) * cost, rtol=1e-4)
    pick = np.argmax(data["value"], axis=1)
    assert value_system.policy_goodput(pick, data["accepted"], cost) == pytest.approx(float(data["lam"]), rel=1e-4)
    for a in range(A):  # the oracle's rate bounds every fixed action's
        assert value_system.policy_goodput(np.full(n, a), data["accepted"], cost) <= float(data["lam"]) * (1 + 1e-6)
    # the union holds the cheap chain: it accepts at least what the chain accepts
    assert (data["accepted"][:, ACTIONS.index("union")] >= data["accepted"][:, ACTIONS.index("cheap")]).all()
    prov = json.loads((root / "values" / "provenance.json").read_text())
    assert prov["feature_names"] == list(sched_lib.FEATURE_NAMES) and prov["records"] == n and prov["created"]
    loaded, _ = value_system.load_dataset([root / "values"])
    assert len(loaded["value"]) == n
    # held-out goodput of the scheduler beside the Switch's rule, each fixed action and the oracle
    m = summary["heldout"]
    assert summary["heldout_prompts"] >= 1 and summary["train_prompts"] >= 1
    assert m["oracle"] >= m["goodput"] - 1e-6 and m["oracle"] >= m["switch"] - 1e-6 and set(m["fixed"]) <= set(ACTIONS)
    assert (root / "run" / "metrics.jsonl").is_file()
    assert any(p.name.isdigit() for p in (root / "run" / "checkpoints").iterdir())
    sched, calibration, meta = sched_lib.load_scheduler(str(root / "sched"))
    assert sched.config.actions == ACTIONS and "heldout" in meta
    # a finished run resumes as a no-op; a run dir from another dataset is refused
    distill_scheduler.distill([root / "values"], root / "run", None,
                              distill_scheduler.DistillConfig(steps=30, eval_every=15, batch_size=64), progress=False)
    with pytest.raises(distill_scheduler.RunRefused):
        distill_scheduler.distill([root / "values"], root / "run", None,
                                  distill_scheduler.DistillConfig(steps=30, hidden=(8,), batch_size=64), progress=False)
    # the distilled scheduler drives the engine (greedy output unchanged)
    from specjax.drafters.composite import treegraft
    tg = treegraft.build([NgramDrafter(), strong], str(root / "sched"))
    # a scheduler distilled for other weights of the strong drafter is refused (a drafter retrained since)
    from safetensors.numpy import save_file
    from specjax.io.checkpoint import weights_sha256
    strong_dir = root / "strong"
    strong_dir.mkdir(exist_ok=True)
    save_file({"w": np.zeros(3, np.float32)}, str(strong_dir / "model.safetensors"))
    sched_lib.save_scheduler(sched, str(root / "sched-digest"), meta={"models": [
        {"cheap": {"spec": "ngram", "sha256": None}, "strong": {"spec": "models/x", "sha256": "0" * 64}}]})
    with pytest.raises(ValueError, match="the strong drafter .* was distilled for models/x 000000000000"):
        treegraft.build([NgramDrafter(), strong], str(root / "sched-digest"), specs=["ngram", str(strong_dir)])
    sched_lib.save_scheduler(sched, str(root / "sched-digest"), meta={"models": [
        {"cheap": {"spec": "ngram", "sha256": None}, "strong": {"spec": "x", "sha256": weights_sha256(strong_dir)}}]})
    treegraft.build([NgramDrafter(), strong], str(root / "sched-digest"), specs=["ngram", str(strong_dir)])
    p = _prompts(1, seed=1, repetitive=True)
    ref = specjax.generate(target, p, max_new_tokens=NEW, eos_token_id=())
    got = specjax.generate(target, p, max_new_tokens=NEW, eos_token_id=(), drafters=[tg], tree=TREE)
    assert got.sequences() == ref.sequences()


@pytest.fixture(scope="module")
def model_dir(target, tmp_path_factory):
    """The target saved with a word-level tokenizer of its tiny vocabulary: the CLI's programs are
    the ones the tests above compiled (same configuration and shapes)."""
    return word_model_dir(target, str(tmp_path_factory.mktemp("tg_cli")))


def test_cli_treegraft(capsys, model_dir, distilled):
    from specjax.cli import main
    root = distilled[0]
    model = specjax.load_model(model_dir)
    ids = specjax.load_tokenizer(model_dir).encode("def add ( a , b ) : return a + b").ids
    ref = specjax.generate(model, [ids], max_new_tokens=NEW, eos_token_id=()).sequences()[0]
    base = ["generate", "--model", model_dir, "--prompt", "def add ( a , b ) : return a + b", "--max-new-tokens",
            str(NEW), "--ignore-eos", "--drafter", "ngram", "--drafter", model_dir, "--tree", TREE, "--json"]
    for how in ("always", "recover", str(root / "sched")):
        assert main(base + ["--treegraft", how]) == 0
        [row] = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
        assert row["tokens"] == ref
        tg = row["treegraft"]
        assert set(tg) == {"policy", "invoked", "invoke_rate", "actions", "model_round_share", "accepted_tokens",
                           "recovered_share", "grafted_proposed", "grafted_accepted_paths"}
        assert sum(tg["actions"].values()) == row["rounds"]
        if how == "always":
            assert tg["invoked"] == row["rounds"] and tg["grafted_accepted_paths"] >= 1  # the target drafts itself

    def usage_error(argv, message):
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and message in err and "Traceback" not in err, err

    base = base[:-1]
    usage_error(base, "add --treegraft")
    usage_error(["generate", "--model", model_dir, "--prompt", "a", "--drafter", "ngram", "--treegraft", "always"],
                "exactly two --drafter")
    usage_error(base + ["--treegraft", str(root)], "not a TreeGraft scheduler directory")
    usage_error(base + ["--treegraft", "always", "--graft-nodes", "50"], "graft budget")
    usage_error(base + ["--treegraft", "always", "--temperature", "1", "--verify", "sampled", "--tree", "chain=3"],
                "deterministic-candidates")
    usage_error(["generate", "--model", model_dir, "--prompt", "a", "--drafter", "ngram", "--graft-nodes", "2"],
                "need --treegraft")
    usage_error(base + ["--treegraft", "oracle"], "only in the evaluation")


@pytest.mark.slow
def test_bench_smoke(tmp_path):
    """The pipeline on tiny models: cost table, value dataset, distilled scheduler, then the rows (every one
    the target's own tokens; tools.bench exits 1 on a greedy mismatch) and the summary."""
    from tools import bench_treegraft
    assert bench_treegraft.main(["--smoke", "--out-dir", str(tmp_path)]) == 0
    assert (tmp_path / "models/treegraft/ngram+lm/scheduler_config.json").is_file()
    js = json.loads((tmp_path / "bench.json").read_text())
    methods = {r["method"] for r in js["rows"]}
    assert any("policy=oracle" in m for m in methods) and any("policy=recover" in m for m in methods)
    assert all(r["check"]["mismatch"] == 0 for r in js["rows"] if "check" in r)
    lines = bench_treegraft.summary([tmp_path / "bench.json"])
    assert len(lines) == 3 and "| 0 |" in lines[-1]
