"""Verification rules are lossless: the first two emitted tokens of a round follow the target's
distribution exactly, for every rule, on trees whose candidates come from a drafter (top-k or
sampled with / without replacement). Exact joint distribution vs >= 2e5 rounds, chi-square.
A rule with a known bug (the bonus drawn from p instead of the residual) must fail the same test.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import chi_square
from specjax.spec import tree as T
from specjax.spec import verify as V
from specjax.spec.sampling import SamplingParams

VOCAB = 5
ROWS = 200_000
# root -> 3 children; each depth-1 node -> 2 children: N = 10, depth 2
SPEC = T.StaticTree(((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)))


def _tables(seed):
    rng = np.random.default_rng(seed)
    # Target and drafter distributions as functions of the token path (as a real LM's are):
    # at the root, and at a depth-1 node by its token.
    p0, p1 = rng.normal(size=VOCAB) * 1.5, rng.normal(size=(VOCAB, VOCAB)) * 1.5
    q0, q1 = rng.normal(size=VOCAB) * 1.5, rng.normal(size=(VOCAB, VOCAB)) * 1.5
    return p0, p1, q0, q1


def softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _build_rows(seed, mode):
    """Draft trees for ROWS rounds, with target logits and q at every node."""
    p0, p1, q0, q1 = _tables(seed)
    rng = np.random.default_rng(seed + 1)
    parents, depth, rank = SPEC.layout()
    N = SPEC.num_nodes
    toks = np.zeros((ROWS, N), np.int32)
    qp0, qp1 = softmax(q0), softmax(q1)

    def children(q_rows, count):  # q_rows [R, V] -> [R, count]
        if mode == "topk":
            return np.argsort(-np.log(q_rows), axis=1, kind="stable")[:, :count]
        if mode == "sample":
            u = rng.random((q_rows.shape[0], count, 1))
            return (u > np.cumsum(q_rows, 1)[:, None, :]).sum(-1)
        g = rng.gumbel(size=q_rows.shape) + np.log(q_rows)  # without replacement
        return np.argsort(-g, axis=1)[:, :count]

    toks[:, 1:4] = children(np.broadcast_to(qp0, (ROWS, VOCAB)), 3)
    for i, node in enumerate((1, 2, 3)):
        toks[:, 4 + 2 * i: 6 + 2 * i] = children(qp1[toks[:, node]], 2)
    logits = np.zeros((ROWS, N, VOCAB), np.float32)
    q = np.zeros((ROWS, N, VOCAB), np.float32)
    logits[:, 0], q[:, 0] = p0, qp0
    logits[:, 1:4], q[:, 1:4] = p1[toks[:, 1:4]], qp1[toks[:, 1:4]]
    logits[:, 4:] = 0.0  # leaves: any distribution (the walk's bonus at depth 2 is not checked)
    tree = T.TreeBuffers(tokens=jnp.asarray(toks), parents=jnp.broadcast_to(jnp.asarray(parents), (ROWS, N)),
                         depth=jnp.broadcast_to(jnp.asarray(depth), (ROWS, N)), valid=jnp.ones((ROWS, N), bool),
                         score=jnp.zeros((ROWS, N)), source=jnp.zeros((ROWS, N), jnp.int8))
    expected = softmax(p0)[:, None] * softmax(p1)  # joint of the first two emitted tokens
    return tree, jnp.asarray(logits), jnp.asarray(q), expected


@functools.partial(jax.jit, static_argnames="rule")
def _verify(tree, logits, q, key, rule):
    return V.verify(tree, logits, key, rule=rule, max_depth=2, params=SamplingParams.make(1.0),
                    draft_probs_BxNxV=q)


def _first_two(vd):
    n, t, b = (np.asarray(x) for x in (vd.num_accepted, vd.tokens, vd.bonus))
    first = np.where(n >= 1, t[:, 0], b)
    second = np.where(n >= 2, t[:, 1], b)
    return first, second, n


@pytest.mark.parametrize("rule,mode", [("deterministic", "topk"), ("sampled", "sample"),
                                       ("sampled_noreplace", "sample_noreplace"),
                                       ("deterministic", "sample_noreplace")])
def test_rule_is_lossless(rule, mode):
    tree, logits, q, expected = _build_rows(7, mode)
    vd = _verify(tree, logits, q, jax.random.key(11), rule)
    first, second, n = _first_two(vd)
    # Rows that accepted nothing emit only the bonus: check the first token over all rows ...
    stat, df, crit = chi_square(np.bincount(first, minlength=VOCAB), expected.sum(1))
    assert stat <= crit, f"{rule}/{mode}: first token chi2 {stat:.1f} > {crit:.1f} (df {df})"
    # ... and the joint of the first two over rows that accepted at least one token, reweighted:
    # given the first token, the second follows p1(.|first) whichever node was accepted.
    m = n >= 1
    for x1 in range(VOCAB):
        sel = m & (first == x1)
        if sel.sum() < 2000:
            continue
        stat, df, crit = chi_square(np.bincount(second[sel], minlength=VOCAB), softmax(_tables(7)[1][x1]))
        assert stat <= crit, f"{rule}/{mode}: second token | first={x1}: chi2 {stat:.1f} > {crit:.1f}"
    assert 0.2 < m.mean() < 0.98  # the test exercises both acceptance and rejection


def test_a_rule_that_skips_the_residual_fails():
    """The classic bug: after rejecting every child, draw the bonus from p instead of the residual."""
    tree, logits, q, expected = _build_rows(7, "topk")
    vd = _verify(tree, logits, q, jax.random.key(11), "deterministic")
    first, _, n = _first_two(vd)
    p0 = expected.sum(1)
    buggy_bonus = np.asarray(jax.random.categorical(jax.random.key(5), jnp.log(jnp.asarray(p0)), shape=(ROWS,)))
    buggy_first = np.where(n >= 1, first, buggy_bonus)
    stat, df, crit = chi_square(np.bincount(buggy_first, minlength=VOCAB), p0)
    assert stat > 10 * crit, f"the residual-skipping rule was not caught: chi2 {stat:.1f} <= 10 x {crit:.1f}"


def test_greedy_accepts_exactly_the_argmax_path():
    tree, logits, q, _ = _build_rows(3, "topk")
    small = jax.tree.map(lambda x: x[:64], tree)
    vd = V.verify(small, logits[:64], jax.random.key(0), rule="greedy", max_depth=2)
    toks, lg = np.asarray(small.tokens), np.asarray(logits[:64])
    parents = np.asarray(small.parents[0])
    for b in range(64):
        node, path = 0, [0]
        while True:
            a = lg[b, node].argmax()
            kids = [j for j in range(1, len(parents)) if parents[j] == node and toks[b, j] == a]
            if not kids:
                break
            node = kids[0]
            path.append(node)
        assert int(vd.num_accepted[b]) == len(path) - 1
        assert int(vd.bonus[b]) == lg[b, node].argmax()
        assert np.asarray(vd.path[b, :len(path)]).tolist() == path


def test_unknown_rule_and_missing_inputs():
    tree, logits, q, _ = _build_rows(3, "topk")
    small = jax.tree.map(lambda x: x[:2], tree)
    with pytest.raises(ValueError, match="unknown verification rule"):
        V.verify(small, logits[:2], jax.random.key(0), rule="lenient", max_depth=2)
    with pytest.raises(ValueError, match="drafter's probabilities"):
        V.verify(small, logits[:2], jax.random.key(0), rule="sampled", max_depth=2, params=SamplingParams.make(1.0))
