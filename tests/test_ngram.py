"""The n-gram drafter (prompt lookup): a match near the context's end continues periodically, so a
period-p loop drafts the full depth (not p tokens); a match further back than the depth drafts
exactly what followed it; chain and trie proposals carry the right validity; speculative greedy
generation with it equals autoregressive greedy generation (chain and trie)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from helpers import cheap_compiles, compare_greedy, prefix_logits_fn, tiny_target
from specjax.spec import tree as T
from specjax.drafters import DraftContext, NgramDrafter
from specjax.drafters.ngram import History
from specjax.spec.sampling import SamplingParams

VOCAB = 32
NEW = 20


def _lookup(ctx, length, depth, branches=1, **kw):
    buf = jnp.asarray([list(ctx) + [0] * 4], jnp.int32)  # padding past the length is never read
    draft, valid = NgramDrafter(**kw).lookup(buf, jnp.array([length]), depth, branches)
    return np.asarray(draft[0]).tolist(), np.asarray(valid[0]).tolist()


def test_a_periodic_context_drafts_the_full_depth():
    # "5 6 7" repeated: the best match (the 4-gram "6 7 5 6") ends 3 tokens back
    draft, valid = _lookup([5, 6, 7, 5, 6, 7, 5, 6], 8, 6)
    assert draft == [[7, 5, 6, 7, 5, 6]] and valid == [[True] * 6]
    # period 1 and period 2
    assert _lookup([4, 9, 9, 9], 4, 5) == ([[9] * 5], [[True] * 5])
    assert _lookup([1, 3, 8, 3, 8, 3], 6, 5) == ([[8, 3, 8, 3, 8]], [[True] * 5])
    # every match continues with its own period: 3 (end 7), 6 (end 4), 9 (end 1)
    draft, valid = _lookup([1, 2, 3, 1, 2, 4, 1, 2, 5, 1, 2], 11, 7, 3)
    assert draft == [[5, 1, 2, 5, 1, 2, 5], [4, 1, 2, 5, 1, 2, 4], [3, 1, 2, 4, 1, 2, 5]]
    assert valid == [[True] * 7] * 3


def test_a_match_further_back_than_the_depth_is_unchanged():
    # the suffix "9" matched 9 tokens back: the 6 tokens after it, as before
    assert _lookup([9, 1, 2, 3, 4, 5, 6, 7, 8, 9], 10, 6) == ([[1, 2, 3, 4, 5, 6]], [[True] * 6])
    # depth == period: exactly what followed, no wrap
    assert _lookup([1, 2, 3, 1, 2, 4, 1, 2, 5, 1, 2], 11, 3, 3)[0] == [[5, 1, 2], [4, 1, 2], [3, 1, 2]]
    # no match at all: nothing valid (a missing branch too)
    draft, valid = _lookup([1, 2, 3, 4], 4, 3, 2)
    assert draft == [[0, 0, 0]] * 2 and valid == [[False] * 3] * 2
    draft, valid = _lookup([5, 6, 7, 5, 6, 7, 5, 6], 8, 4, 3)
    assert valid == [[True] * 4, [True] * 4, [False] * 4]  # only two match ends (4 and 1)


def _propose(ctx, spec):
    """NgramDrafter.propose on one row whose history is ctx[:-1] and root ctx[-1]."""
    spec = T.parse_tree_spec(spec)
    hist = History(jnp.asarray([list(ctx[:-1]) + [0] * 16], jnp.int32), jnp.array([len(ctx) - 1], jnp.int32))
    dctx = DraftContext(spec, "topk", SamplingParams.make(0.0), jax.random.key(0))
    tree = jax.jit(lambda h, r: NgramDrafter().propose(h, r, dctx).tree)(hist, jnp.array([ctx[-1]], jnp.int32))
    return {f: np.asarray(getattr(tree, f)[0]) for f in ("tokens", "parents", "depth", "valid", "score")}


def test_chain_and_trie_proposals_of_a_loop():
    loop = [5, 6, 7, 5, 6, 7, 5, 6]
    t = _propose(loop, "chain=6")
    assert t["tokens"].tolist() == [6, 7, 5, 6, 7, 5, 6] and t["valid"].all()
    t = _propose([1, 2, 3, 4], "chain=3")  # nothing to look up: only the root is valid
    assert t["valid"].tolist() == [True, False, False, False]
    # a trie of the 3 best matches of "1 2 3 1 2 4 1 2 5 1 2", depth 4: each continues periodically
    # (5 1 2 5 / 4 1 2 5 / 3 1 2 4), merged nowhere below the root; cut to 10 nodes by (depth, rank)
    t = _propose([1, 2, 3, 1, 2, 4, 1, 2, 5, 1, 2], "depth=4,topk=3,nodes=10")
    v = t["valid"]
    assert v.all()
    assert t["tokens"].tolist() == [2, 5, 4, 3, 1, 1, 1, 2, 2, 2]
    assert t["parents"].tolist() == [-1, 0, 0, 0, 1, 2, 3, 4, 5, 6]
    # pseudo log q: 0 along the best match, -log(1 + k) along the k-th; never above the parent
    np.testing.assert_allclose(t["score"], -np.log1p([0, 0, 1, 2, 0, 1, 2, 0, 1, 2]), atol=1e-6)
    assert all(t["score"][i] <= t["score"][t["parents"][i]] for i in range(1, 10))
    # a period-3 loop: both matches draft the same periodic chain, merged into one full-depth path
    t = _propose(loop, "depth=6,topk=3,nodes=12")
    assert t["valid"].sum() == 7 and t["tokens"][t["valid"]].tolist() == [6, 7, 5, 6, 7, 5, 6]
    assert t["depth"][t["valid"]].tolist() == list(range(7))


# ----------------------------------------------------------------------------- greedy exactness

@pytest.fixture(scope="module")
def target():
    with cheap_compiles():  # tiny programs: skip XLA's passes
        yield tiny_target(VOCAB)


# loops of periods 3, 5 and 2, of different lengths (a ragged batch); the random target falls into
# short loops of its own (periods 1 and 2 here), which the drafter then drafts past their period
PROMPTS = [[3, 9, 4] * 4, [7, 1, 2, 8, 5] * 3 + [7], [11, 12] * 5]


def _logits_fn(model):
    return prefix_logits_fn(model, PROMPTS)  # compare_greedy's reference logits (helpers)


@pytest.fixture(scope="module")
def reference(target):
    return specjax.generate(target, PROMPTS, max_new_tokens=NEW, eos_token_id=())


@pytest.mark.parametrize("tree", ["chain=6", "depth=6,topk=3,nodes=10"])
def test_greedy_equals_autoregressive(target, reference, tree):
    got = specjax.generate(target, PROMPTS, max_new_tokens=NEW, eos_token_id=(), drafters=[NgramDrafter()], tree=tree)
    n_exact, n_near = compare_greedy(reference.sequences(), got.sequences(), _logits_fn(target))
    assert n_exact + n_near == len(PROMPTS)
    assert (got.lengths == NEW).all()
    if tree.startswith("chain"):
        # tokens accepted at depth 6, past the period-1 and period-2 loops the target fell into:
        # a chain cut at the context's end drafts at most `period` tokens there
        assert got.stats["accepted_at_depth"][:, -1].sum() > 0, got.stats["accepted_at_depth"]


def test_treegraft_default_cheap_tree_is_a_trie_of_matches(target):
    """TreeGraft with the n-gram as its cheap drafter drafts a trie of max(4, ceil(N/D)) matches
    (k chains under the root: k*D+1 node slots, more than the verify budget N), not one chain."""
    from specjax.drafters import LMDrafter
    from specjax.drafters.ngram import branches_of
    from specjax.drafters.composite.treegraft import TreeGraft
    tg = TreeGraft(NgramDrafter(), LMDrafter(target))
    for verify, k in (("depth=3,topk=3,nodes=8", 4), ("depth=3,topk=8,nodes=40", 14), ("chain=4", 4)):
        spec = T.parse_tree_spec(verify)
        p = tg.plan(spec)
        cspec, M, G = p.cheap_spec, p.M, p.G
        D = spec.max_depth
        assert branches_of(cspec) == k and cspec.max_depth == D and M == k * D + 1 > spec.num_nodes, verify
        assert G == spec.num_nodes - 1
