"""Tree-shaped one-pass drafting (design §5e): best-first trees over a block drafter's tables.

- `tree.best_first` (the heap in the program) equals a `heapq` reference on random tables;
- the tables: DDTree's marginal rows are the greedy chain's rows, TreeFlash's conditional rows are
  the Markov head's exact rows / the TreeFlash head's for the top-m candidates, and a child's row is
  its token's candidate row (a leaf where it has none);
- greedy output equals autoregressive output for every tree kind (ddtree, treeflash with Markov
  rows, with the TreeFlash head, TAPS selection with a per-round budget), batch 1 and 4 ragged, one
  trace per configuration, and TAPS with a steep cost table verifies fewer nodes;
- the deterministic-candidates rule on a best-first tree keeps the target's distribution
  (chi-square over 1e5 rounds); a rule that skips the residual is caught;
- the calibration fit, the TreeFlash head's checkpoint on its backbone, and the refusals.
"""
from __future__ import annotations

import heapq
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import specjax
from helpers import (assert_first_two_follow, chi_square, next_logits, prefilled_state, spread_target,
                     trained_dspark)
from specjax.engine import loop as engine
from specjax.spec import tree as T, verify as V
from specjax.drafters import load_drafter
from specjax.drafters.base import DraftContext
from specjax.drafters.block import best_first
from specjax.drafters.block import (BlockConfig, BlockDrafter, BlockHead, ar_logits, load_block_head, markov_embed,
                                    position_logits, save_block_head)
from specjax.spec.calibration import Calibration, Table, fit_path_rates
from specjax.spec.widths import budget_keep
from specjax.models import family
from specjax.spec.sampling import SamplingParams

VOCAB = 64
W = 4


def _reference(root, tok, key, lq, child, N, D):
    """best_first in plain Python with heapq: (tokens, parents, depth, score) of the popped nodes."""
    heap = [(-key[0, 0], 0, 0, 0, 0, 1, 0.0, 0.0)]  # (-key, push order, parent, row, rank, depth, parent key, parent lq)
    order = 1
    out = [(root, -1, 0, 0.0)]
    K = tok.shape[1]
    while len(out) < N and heap:
        negk, _, par, row, rank, d, pk, plq = heapq.heappop(heap)
        i = len(out)
        s, slq = -negk, plq + lq[row, rank]
        out.append((tok[row, rank], par, d, slq))
        if rank + 1 < K:
            heapq.heappush(heap, (-(pk + key[row, rank + 1]), order, par, row, rank + 1, d, pk, plq))
            order += 1
        if child[row, rank] >= 0 and d < D:
            c = child[row, rank]
            heapq.heappush(heap, (-(s + key[c, 0]), order, i, c, 0, d + 1, s, slq))
            order += 1
    return out


def test_best_first_equals_a_heap_reference():
    rng = np.random.default_rng(0)
    B, R, K, N, D = 3, 7, 3, 12, 4
    lq = -np.sort(rng.exponential(1.0, (B, R, K)), axis=-1)  # non-increasing along a row, <= 0
    key = lq * rng.uniform(0.5, 1.5, (B, R, 1))  # another ranking, still non-increasing
    tok = rng.integers(0, 50, (B, R, K))
    child = rng.integers(-1, R, (B, R, K))
    root = np.array([5, 6, 7])
    tree, path_key = jax.jit(lambda *a: T.best_first(*a, N, D))(jnp.asarray(root), jnp.asarray(tok), jnp.asarray(key),
                                                                jnp.asarray(lq), jnp.asarray(child))
    for b in range(B):
        want = _reference(root[b], tok[b], key[b], lq[b], child[b], N, D)
        n = len(want)
        assert np.asarray(tree.valid[b]).sum() == n and np.asarray(tree.valid[b, :n]).all()
        np.testing.assert_array_equal(np.asarray(tree.tokens[b, :n]), [w[0] for w in want])
        np.testing.assert_array_equal(np.asarray(tree.parents[b, :n]), [w[1] for w in want])
        np.testing.assert_array_equal(np.asarray(tree.depth[b, :n]), [w[2] for w in want])
        np.testing.assert_allclose(np.asarray(tree.score[b, :n]), [w[3] for w in want], atol=1e-5)
    k = np.asarray(path_key)
    assert (np.diff(np.where(np.asarray(tree.valid), k, -np.inf)[:, 1:], axis=1) <= 1e-6).all()  # pop order
    assert (np.asarray(tree.parents)[:, 1:] < np.arange(1, N)).all()  # topological


def test_budget_keeps_the_best_prefix():
    key = jnp.log(jnp.asarray([[1.0, 0.9, 0.8, 0.1, 0.1, 0.05, 0.05, 0.01]]))
    valid, active = jnp.ones((1, 8), bool), jnp.ones((1,), bool)
    widths = (2, 4, 8)
    flat = budget_keep(key, valid, active, (1.0, 1.0, 1.0), widths)  # flat costs: the widest
    assert np.asarray(flat).sum() == 8
    steep = budget_keep(key, valid, active, (1.0, 1.2, 3.0), widths)  # (1+.9)/1, (1+1.8)/1.2=2.33, (1+2.1)/3
    np.testing.assert_array_equal(np.asarray(steep[0]), [True] * 4 + [False] * 4)


# ----------------------------------------------------------------------------- a trained tiny drafter

@pytest.fixture(scope="module")
def dense():
    """A tiny DSpark drafter trained on the target's own greedy continuations, with a TreeFlash head
    on it (random, non-zero: its rows differ from the Markov head's) and a path calibration."""
    target, head, data = trained_dspark(VOCAB, block_size=W)  # test_block's (shared)
    tf = BlockHead(BlockConfig.for_target(target.config, block_size=W, num_layers=1, markov_rank=16,
                                          ar_intermediate=16), nnx.Rngs(1))
    nnx.update(tf, nnx.state(head, nnx.Param))  # the backbone: the trained head's parameters
    tf.ar_head.down.weight.set_value(0.1 * jax.random.normal(jax.random.key(2), tf.ar_head.down.weight.shape))
    table = np.clip(np.linspace(0.2, 0.95, 10)[None] * np.asarray([1.0, 0.9, 0.8, 0.7])[:, None], 0, 1)
    cal = Calibration(tuple((k, Table.make(np.ones_like(table), table)) for k in ("marginal", "markov", "head")))
    return target, head, tf, cal, data


def _ragged(data, batch):
    return [data[i, :n].tolist() for i, n in zip(range(batch), (6, 9, 7, 12))]


def _state(d, target, data, n=10):
    fam = family(target)
    prompt = jnp.asarray(data[:2, :n])
    pre = fam.prefill(target, prompt, jnp.asarray([n, n]), fam.init_cache(target, 2, 32),
                      hidden_layers=d.head.config.target_layers)
    return d.init(prompt, jnp.asarray([n, n]), 32, pre), jnp.asarray(data[:2, n])


def test_tables_are_the_heads_rows(dense):
    target, head, tf, _, data = dense
    d = BlockDrafter(tf, target)
    st, root = _state(d, target, data)
    blk = d.draft_block(st, root)
    # DDTree: each depth's row along the greedy chain
    spec = d.resolve_tree(T.parse_tree_spec("ddtree,nodes=8,k=3"))
    tok, lq, child, depth = best_first.tables(d.head, d.target, blk, root, spec)
    prev = root
    for p in range(W):
        row = jax.nn.log_softmax(position_logits(tf, blk.base[:, p], markov_embed(tf, prev)), -1)
        v, t = jax.lax.top_k(row, 3)
        np.testing.assert_array_equal(np.asarray(tok[:, p]), np.asarray(t))
        np.testing.assert_allclose(np.asarray(lq[:, p]), np.asarray(v), atol=1e-5)
        prev = t[:, 0]
    np.testing.assert_array_equal(np.asarray(child[0, :, 0]), [1, 2, 3, -1])
    np.testing.assert_array_equal(depth, [1, 2, 3, 4])
    # the greedy chain's rows, and the previous-token candidates of positions 1..W-1 (top 3 of the row above)
    marg, prev = [], root
    for p in range(W):
        marg.append(jax.nn.log_softmax(position_logits(tf, blk.base[:, p], markov_embed(tf, prev)), -1))
        prev = jnp.argmax(marg[-1], -1)
    cand = [None] + [jax.lax.top_k(marg[p - 1], 3)[1] for p in range(1, W)]
    for rows in ("markov", "head"):
        spec = d.resolve_tree(T.parse_tree_spec(f"treeflash,nodes=8,m=3,k=3,rows={rows}"))
        tok, lq, child, depth = best_first.tables(d.head, d.target, blk, root, spec)
        assert tok.shape == (2, 1 + (W - 1) * 3, 3)
        np.testing.assert_array_equal(depth, [1] + [2] * 3 + [3] * 3 + [4] * 3)
        c = np.asarray(child)
        for r in range(tok.shape[1]):  # each row from its (position, candidate previous token)
            p = 0 if r == 0 else 1 + (r - 1) // 3
            prev = root if r == 0 else cand[p][:, (r - 1) % 3]
            if rows == "markov":
                logits = position_logits(tf, blk.base[:, p], markov_embed(tf, prev))
            else:
                logits = ar_logits(tf, target, blk.pre[:, p], blk.hidden[:, p], prev)
            v, t = jax.lax.top_k(jax.nn.log_softmax(logits, -1), 3)
            np.testing.assert_array_equal(np.asarray(tok[:, r]), np.asarray(t))
            np.testing.assert_allclose(np.asarray(lq[:, r]), np.asarray(v), atol=1e-4)
            for b in range(2):  # a child's row: its token's candidate row at the next position, else a leaf
                for j in range(3):
                    if p + 1 >= W:
                        assert c[b, r, j] == -1
                        continue
                    hits = np.nonzero(np.asarray(cand[p + 1][b]) == int(tok[b, r, j]))[0]
                    assert c[b, r, j] == (1 + p * 3 + hits[0] if len(hits) else -1)


SPECS = ("ddtree,nodes=8", "treeflash,nodes=8,rows=markov", "treeflash,nodes=10,m=3,k=3,rows=head",
         "treeflash,nodes=8,select=taps")


@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_equals_autoregressive(dense, batch):
    target, head, tf, cal, data = dense
    prompts = _ragged(data, batch)
    ref = specjax.generate(target, prompts, max_new_tokens=16).sequences()
    plain = BlockDrafter(head, target)
    for spec in SPECS if batch > 1 else SPECS[:2]:
        d = BlockDrafter(tf, target, path_calibration=cal) if "head" in spec or "taps" in spec else plain
        got = specjax.generate(target, prompts, max_new_tokens=16, drafters=[d], tree=spec)
        assert got.sequences() == ref, spec
        assert got.stats["tau"].max() > 1.3, spec
    # TAPS with a steep cost table: the budget is chosen per round, below the tree's size
    spec = "treeflash,nodes=8,select=taps"
    d = BlockDrafter(tf, target, path_calibration=cal, costs=(1.0, 1.5, 4.0, 12.0))  # widths 2, 4, 8 ... 8
    assert d.verify_widths(d.resolve_tree(T.parse_tree_spec(spec))) == (2, 4, 8)
    d = BlockDrafter(tf, target, path_calibration=cal, costs=(1.0, 1.5, 6.0))
    got = specjax.generate(target, prompts, max_new_tokens=16, drafters=[d], tree=spec)
    assert got.sequences() == ref
    assert got.stats["mean_verify_width"].max() < 8


def test_one_trace_per_configuration(dense):
    target, head, tf, cal, data = dense
    d = BlockDrafter(head, target)
    specjax.generate(target, _ragged(data, 2), max_new_tokens=8, drafters=[d], tree="ddtree,nodes=8")
    n0 = engine.trace_count()
    specjax.generate(target, [data[5, :8].tolist(), data[6, :5].tolist()], max_new_tokens=8, drafters=[d],
                     tree="ddtree,nodes=8")
    specjax.generate(target, _ragged(data, 2), max_new_tokens=8, drafters=[BlockDrafter(head, target)],
                     tree=T.parse_tree_spec("ddtree,nodes=8"))
    assert engine.trace_count() == n0


# ----------------------------------------------------------------------------- sampling is lossless

ROWS = 100_000
SV = 8


def test_deterministic_rule_on_a_best_first_tree_is_lossless():
    """A best-first tree (the TreeFlash head's rows) from a tiny drafter whose rows spread; the
    deterministic-candidates rule's first two emitted tokens follow the target over 1e5 rounds.
    The planted bug: the bonus drawn from p instead of the residual after the root's children are
    rejected: caught."""
    target = spread_target(SV)
    cfg = BlockConfig.for_target(target.config, block_size=3, num_layers=1, markov_rank=4, ar_intermediate=8)
    head = BlockHead(cfg, nnx.Rngs(2))
    head.ar_head.down.weight.set_value(jax.random.normal(jax.random.key(3), head.ar_head.down.weight.shape))
    d = BlockDrafter(head, target)
    prompt, root = [1, 5, 2], 3
    st = prefilled_state(d, target, prompt)
    spec = d.resolve_tree(T.parse_tree_spec("treeflash,nodes=7,m=2,k=3,rows=head"))
    prop = d.propose(st, jnp.asarray([root]), DraftContext(spec, "topk", SamplingParams.make(1.0), jax.random.key(0)))
    tree1 = prop.tree
    assert int((np.asarray(tree1.parents[0]) == 0).sum()) >= 2  # siblings at the root: the residual matters
    tree = jax.tree.map(lambda x: jnp.broadcast_to(x, (ROWS,) + x.shape[1:]), tree1)

    def target_logits(seq):  # one jitted prefill (eager, each length compiles every op again)
        return next_logits(target, [seq])[0]

    p0 = target_logits(prompt + [root])
    p1 = np.stack([target_logits(prompt + [root, x]) for x in range(SV)])
    toks, depth = np.asarray(tree1.tokens[0]), np.asarray(tree1.depth[0])
    logits = np.zeros((spec.num_nodes, SV), np.float32)
    logits[0] = p0
    logits[depth == 1] = p1[toks[depth == 1]]
    soft = lambda x: np.exp(x - x.max(-1, keepdims=True)) / np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)  # noqa: E731
    vd = jax.jit(lambda tr, lg, k: V.verify(tr, lg, k, rule="deterministic", max_depth=spec.max_depth,
                                            params=SamplingParams.make(1.0)))(
        tree, jnp.broadcast_to(jnp.asarray(logits), (ROWS,) + logits.shape), jax.random.key(9))
    n, t, b = (np.asarray(x) for x in (vd.num_accepted, vd.tokens, vd.bonus))
    first, second = np.where(n >= 1, t[:, 0], b), np.where(n >= 2, t[:, 1], b)
    assert_first_two_follow(first, second, n, p0, p1, SV)
    assert 0.1 < (n >= 1).mean() < 0.95
    bug = np.asarray(jax.random.categorical(jax.random.key(5), jnp.asarray(p0, jnp.float32), shape=(ROWS,)))
    stat, _, crit = chi_square(np.bincount(np.where(n >= 1, first, bug), minlength=SV), soft(p0))
    assert stat > 10 * crit, "the residual-skipping rule was not caught"


# ----------------------------------------------------------------------------- calibration, checkpoints, refusals

def test_path_rates_fit():
    rng = np.random.default_rng(0)
    q = rng.uniform(0, 1, 20000)
    d = rng.integers(1, 4, 20000)
    acc = rng.uniform(0, 1, 20000) < q * (1.0 - 0.1 * d)  # true g = q (1 - 0.1 d)
    table, counts = fit_path_rates(q, d, acc, depths=4, bins=10)
    assert table.shape == (4, 10) and (np.diff(table, axis=1) >= 0).all()  # isotonic in q
    mid = (np.arange(10) + 0.5) / 10
    for k in range(3):
        np.testing.assert_allclose(table[k], mid * (1 - 0.1 * (k + 1)), atol=0.05)
    np.testing.assert_array_equal(table[3], table[2])  # depth 4 unseen: depth 3's
    assert counts[:3].sum() == 20000


def test_treeflash_checkpoint_on_its_backbone_and_refusals(dense, tmp_path):
    from specjax.io.checkpoint import weights_sha256
    target, head, tf, cal, data = dense
    bdir, tdir = tmp_path / "backbone", tmp_path / "treeflash"
    save_block_head(head, str(bdir))
    save_block_head(tf, str(tdir), backbone=str(bdir))
    (tdir / "calibration.json").write_text(json.dumps(cal.to_json()))
    raw = json.loads((tdir / "drafter_config.json").read_text())
    assert raw["backbone"] == "../backbone" and raw["backbone_sha256"] == weights_sha256(bdir)
    from safetensors.numpy import load_file
    assert all(k.startswith("ar_head.") for k in load_file(str(tdir / "model.safetensors")))
    d = load_drafter(str(tdir), target)
    assert d.head.config.has_ar_head and d.path_calibration.kinds() == ("marginal", "markov", "head")
    back = load_block_head(str(tdir))
    for (k, a), (_, b) in zip(nnx.to_flat_state(nnx.state(back, nnx.Param)), nnx.to_flat_state(nnx.state(tf, nnx.Param))):
        np.testing.assert_allclose(np.asarray(a.get_value()), np.asarray(b.get_value(), jnp.bfloat16).astype(np.float32),
                                   atol=1e-6, err_msg=str(k))
    prompts = _ragged(data, 2)
    ref = specjax.generate(target, prompts, max_new_tokens=8).sequences()
    assert specjax.generate(target, prompts, max_new_tokens=8, drafters=[d], tree="treeflash,nodes=8,select=taps").sequences() == ref
    # the backbone retrained: refused
    save_block_head(head, str(bdir), dtype=jnp.float32)
    with pytest.raises(ValueError, match="other weights"):
        load_block_head(str(tdir))
    plain = BlockDrafter(head, target)
    dflash = BlockDrafter(BlockHead(BlockConfig.for_target(target.config, block_size=W, num_layers=1, markov_rank=0,
                                                           confidence=False), nnx.Rngs(0)), target)
    cases = [
        (plain, "treeflash,nodes=8,rows=head", {}, "TreeFlash head"),
        (dflash, "treeflash,nodes=8", {}, "neither"),
        (plain, "ddtree,nodes=8,depth=5", {}, "deeper than the block"),
        (plain, "ddtree,nodes=8", {"temperature": 1.0, "verify": "sampled"}, "deterministic candidates"),
        (plain, "ddtree,nodes=8,select=taps", {}, "path calibration"),
        (BlockDrafter(head, target, costs=(1.0, 2.0)), "ddtree,nodes=8", {}, "select=taps only"),
        (BlockDrafter(head, target, confidence=0.5), "ddtree,nodes=8", {}, "confidence='off'"),
        (specjax.drafters.NgramDrafter(), "ddtree,nodes=8", {}, "block drafter"),
    ]
    for drafter, spec, kw, msg in cases:
        with pytest.raises(ValueError, match=msg):
            specjax.generate(target, prompts, max_new_tokens=4, drafters=[drafter], tree=spec, **kw)
    for bad, msg in [("ddtree", "nodes=N"), ("ddtree,nodes=8,m=2", "not m"), ("treeflash,nodes=8,rows=x", "rows"),
                     ("treeflash,nodes=8,select=best", "select"), ("ddtree,nodes=x", "positive integer"),
                     ("ddtree,nodes=8,nodes=9", "repeats")]:
        with pytest.raises(ValueError, match=msg):
            T.parse_tree_spec(bad)
    with pytest.raises(ValueError, match="best-first"):
        T.expand(T.parse_tree_spec("ddtree,nodes=8"), jnp.zeros((1,), jnp.int32), None, None, jax.random.key(0))
