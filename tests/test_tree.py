"""Tree buffers and specs: layouts, ancestor masks, paths, dynamic expansion, malformed specs."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.spec import tree as T


def test_static_layout_and_ancestors():
    spec = T.parse_tree_spec("[[0],[1],[0,0],[0,1],[1,0],[0,0,0]]")
    parents, depth, rank = spec.layout()
    assert parents.tolist() == [-1, 0, 0, 1, 1, 2, 3]
    assert depth.tolist() == [0, 1, 1, 2, 2, 2, 3]
    assert rank.tolist() == [0, 0, 1, 0, 1, 0, 0]
    B, N = 2, spec.num_nodes
    tree = T.TreeBuffers(tokens=jnp.zeros((B, N), jnp.int32), parents=jnp.broadcast_to(parents, (B, N)),
                         depth=jnp.broadcast_to(depth, (B, N)), valid=jnp.ones((B, N), bool),
                         score=jnp.zeros((B, N)), source=jnp.zeros((B, N), jnp.int8))
    mask = np.asarray(jax.jit(T.ancestor_mask, static_argnums=1)(tree, spec.max_depth))
    np.testing.assert_array_equal(mask[0], T.static_ancestors(parents))
    assert mask[0, 6].nonzero()[0].tolist() == [0, 1, 3, 6]
    path = np.asarray(T.path_to(tree, jnp.array([6, 4]), spec.max_depth))
    assert path[0].tolist() == [0, 1, 3, 6]
    assert path[1].tolist() == [0, 1, 4, 4]  # padded with the node itself past its depth


def test_chain_is_a_tree():
    spec = T.parse_tree_spec("chain=3")
    assert spec.layout()[0].tolist() == [-1, 0, 1, 2]
    assert spec.num_nodes == 4 and spec.max_depth == 3


@pytest.mark.parametrize("bad", ["[[0],[0,0],[1,1]]", "[[1]]", "[[0],[0]]", "[[0],[-1]]", "[]", "[[0], 3]",
                                 "[[0]", "depth=3,topk=2", "depth=0,topk=2,nodes=4", "chain=0", "tree please",
                                 "depth=2,topk=2,nodes=50"])
def test_malformed_specs_are_refused(bad):
    with pytest.raises(ValueError):
        T.parse_tree_spec(bad)


def _toy_evaluate(V):
    """A fixed 'drafter' whose q depends on (token, depth): deterministic and easy to check."""
    table = jax.nn.log_softmax(jax.random.normal(jax.random.key(3), (V, 8, V)) * 3, axis=-1)

    def evaluate(state, tokens_BxF, depth, offset, mask, parent_slot):
        assert mask.shape[1] == tokens_BxF.shape[1]
        if isinstance(offset, int):  # unrolled (and a loop's root): the slots so far
            assert mask.shape[2] == offset + tokens_BxF.shape[1]
        else:  # a loop's traced step: every evaluated slot (the tests' trees: chains of 4, dynamic 3 x 3)
            assert mask.shape[2] in (5, 1 + 2 * 3)
        return table[tokens_BxF, depth], state
    return evaluate, table


def test_dynamic_expansion_keeps_best_connected_nodes():
    V = 12
    spec = T.DynamicTree(depth=3, topk=3, nodes=8)
    evaluate, table = _toy_evaluate(V)
    root = jnp.array([1, 5])
    tree, _, _ = T.expand(spec, root, evaluate, None, jax.random.key(0))
    tree = jax.tree.map(np.asarray, tree)
    for b in range(2):
        assert tree.valid[b].all()
        for i in range(1, spec.nodes):
            p = tree.parents[b, i]
            assert 0 <= p < i  # topological and connected
            assert tree.depth[b, i] == tree.depth[b, p] + 1
            expect = tree.score[b, p] + float(table[tree.tokens[b, p], tree.depth[b, p], tree.tokens[b, i]])
            assert abs(tree.score[b, i] - expect) < 1e-5
        # Brute force: the kept scores are the best nodes of the full expansion pool.
        pool = []
        frontier = [(int(root[b]), 0.0)]
        for d in range(spec.depth):
            cands = []
            for tok, sc in frontier:
                lq = np.asarray(table[tok, d])
                for t in np.argsort(-lq)[:spec.topk]:
                    cands.append((int(t), sc + float(lq[t])))
            pool += [c[1] for c in cands]
            frontier = sorted(cands, key=lambda c: -c[1])[:spec.topk]
        best = sorted(pool, reverse=True)[:spec.nodes - 1]
        np.testing.assert_allclose(sorted(tree.score[b, 1:], reverse=True), best, rtol=1e-5)


def test_static_expansion_uses_ranked_children():
    V = 10
    spec = T.parse_tree_spec("[[0],[1],[0,0],[0,1],[1,0]]")
    evaluate, table = _toy_evaluate(V)
    tree, probs, _ = T.expand(spec, jnp.array([4]), evaluate, None, jax.random.key(0))
    toks = np.asarray(tree.tokens[0])
    top_root = np.argsort(-np.asarray(table[4, 0]))
    assert toks[1] == top_root[0] and toks[2] == top_root[1]
    top_n1 = np.argsort(-np.asarray(table[toks[1], 1]))
    assert toks[3] == top_n1[0] and toks[4] == top_n1[1]
    np.testing.assert_allclose(np.asarray(probs[0, 0]), np.exp(np.asarray(table[4, 0])), rtol=1e-5)
