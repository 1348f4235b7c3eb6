"""MTP (design §5f): the multi-token-prediction module as a drafter, its checkpoint names, its trainer.

- the drafting pass equals the training pass (`ttt_logits`), dense and hybrid, one and two layers;
- greedy speculative output equals autoregressive output (batch 1 and 4, ragged; chain and tree;
  one trace per configuration) with a tiny module trained on the target's own continuations;
- the sampled rule keeps the target's distribution (chi-square), and a planted bug (q reported
  without the target's hidden state) is caught;
- checkpoints: Qwen3-Next's `mtp.*` names and shapes as `transformers` sees them (its
  Qwen3NextForCausalLM ignores exactly them, and they have its attention layer's shapes), the
  round trip through the target's own safetensors (its digest unchanged) and a directory of its
  own, refusals;
- `train.mtp` trains, resumes to the same parameters, and exports a drafter that loads.
"""
from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import specjax
from helpers import first_two_chi_squares, spread_target, tiny_hybrid, tiny_hybrid_config, tiny_target
from specjax.engine import loop as engine
from specjax.spec import verify as V
from specjax.io.checkpoint import load_model, mtp_tensor_names, read_mtp_tensors, save_model, weights_sha256
from specjax.drafters import load_drafter
from specjax.drafters import mtp as M
from specjax.drafters.base import DraftContext
from specjax.models import family
from specjax.spec.sampling import SamplingParams
from specjax.spec.tree import parse_tree_spec

VOCAB = 64
HYBRID = tiny_hybrid_config(VOCAB)  # 3 layers: linear, full, linear attention


def _target(kind):
    return tiny_target(VOCAB) if kind == "dense" else tiny_hybrid(VOCAB)  # shared: HYBRID, seed 1


def _head(target, n=1, seed=3):
    return M.MTPHead(M.MTPConfig.for_target(target.config, n), target.config, nnx.Rngs(seed))


def _forward_hidden(target, toks_BxT, layers):
    fam = family(target)
    B, T = toks_BxT.shape
    out = fam.forward(target, toks_BxT, jnp.broadcast_to(jnp.arange(T)[None], (B, T)), fam.init_cache(target, B, T),
                      jnp.tril(jnp.ones((B, T, T), bool)), hidden_layers=layers)
    return M.target_hidden(target, out.hidden[0])


@pytest.mark.parametrize("kind,n", [("dense", 2), ("hybrid", 1)])
def test_drafting_pass_equals_training_pass(kind, n):
    """A greedy chain drafted after a prefill: q at each node equals `ttt_logits` at the anchor over
    the sequence that continues with the chain (n = 2: layers alternate by depth, each seeing its own)."""
    target = _target(kind)
    head = _head(target, n)
    d = M.MTPDrafter(head, target)
    seq = np.random.default_rng(0).integers(0, VOCAB, (1, 11))
    a, fam = 9, family(target)
    pre = fam.prefill(target, jnp.asarray(seq[:, :a + 1]), jnp.asarray([a + 1]), fam.init_cache(target, 1, 32),
                      hidden_layers=d.target_layers)
    state = d.init(jnp.asarray(seq[:, :a + 1]), jnp.asarray([a + 1]), 32, pre)
    ctx = DraftContext(parse_tree_spec("chain=4"), "topk", SamplingParams.make(0.0), jax.random.key(0))
    prop = d.propose(state, jnp.asarray(seq[:, a + 1]), ctx)
    full = jnp.asarray(np.concatenate([seq[0, :a + 1], np.asarray(prop.tree.tokens[0])])[None])
    logits = M.ttt_logits(head, target, full, _forward_hidden(target, full, d.target_layers), 4)
    np.testing.assert_allclose(np.asarray(jax.nn.softmax(logits[:, 0, a], -1)), np.asarray(prop.probs[0, :4]), atol=1e-5)


@pytest.mark.parametrize("kind,n", [("dense", 2), ("hybrid", 1)])
def test_chain_attention_equals_the_dense_masked_attention(kind, n):
    """`ttt_logits` scores the committed block and its own chain's entries only (`ChainAttention`): the
    same logits as the dense attention over all T * (n + steps - 1) slots under the block mask, and
    the same gradient."""
    target = _target(kind)
    head = _head(target, n)
    seq = jnp.asarray(np.random.default_rng(1).integers(0, VOCAB, (2, 12)))
    h = _forward_hidden(target, seq, M.MTPDrafter(head, target).target_layers)
    fast, ref = (M.ttt_logits(head, target, seq, h, 4, reference=r) for r in (False, True))
    np.testing.assert_allclose(np.asarray(fast), np.asarray(ref), atol=2e-5, rtol=2e-5)
    gdef, params = nnx.split(head, nnx.Param)
    grads = [jax.grad(lambda p, r=r: M.ttt_logits(nnx.merge(gdef, p), target, seq, h, 4, reference=r)[..., :7].sum())(params)
             for r in (False, True)]
    for a, b in zip(jax.tree.leaves(grads[0]), jax.tree.leaves(grads[1])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4, rtol=1e-4)


def _trained(target, n=1, steps=120, seed=1):
    """A tiny module trained with train.mtp's loss on the target's own greedy continuations of
    random prompts: partial, row-varying acceptance."""
    from train.mtp import mtp_loss
    rng = np.random.default_rng(seed)
    prompts = rng.integers(0, VOCAB, (24, 6)).tolist()
    res = specjax.generate(target, prompts, max_new_tokens=34)
    data = np.array([p + s for p, s in zip(prompts, res.sequences())], np.int32)
    gdef, params = nnx.split(_head(target, n, seed), nnx.Param)
    tx = optax.adam(3e-3)

    @jax.jit
    def step(params, opt):
        g = jax.grad(lambda p: mtp_loss(nnx.merge(gdef, p), target, jnp.asarray(data), 0.8, 3)[0])(params)
        u, opt = tx.update(g, opt, params)
        return optax.apply_updates(params, u), opt

    opt = tx.init(params)
    for _ in range(steps):
        params, opt = step(params, opt)
    return nnx.merge(gdef, params), data


@pytest.fixture(scope="module")
def dense_trained():
    target = _target("dense")
    return (target,) + _trained(target)


@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_equals_autoregressive_dense(dense_trained, batch):
    target, head, data = dense_trained
    prompts = [data[i, :k].tolist() for i, k in zip(range(batch), (6, 9, 7, 12))]
    ref = specjax.generate(target, prompts, max_new_tokens=24).sequences()
    for tree in ("chain=3", "depth=3,topk=2,nodes=6") if batch == 4 else ("chain=1", "chain=4"):
        got = specjax.generate(target, prompts, max_new_tokens=24, drafters=[M.MTPDrafter(head, target)], tree=tree)
        assert got.sequences() == ref, tree
        assert got.stats["tau"].max() > 1.2, (tree, got.stats["tau"])
    if batch == 4:  # a reduced draft vocabulary: the 24 most frequent tokens of the data
        from specjax.drafters import vocab
        ids = vocab.token_ranking(data, VOCAB)[:24]
        sub = vocab.logits(jnp.ones((1, 1, target.config.hidden_size)), ids, vocab.head_rows(target, ids), VOCAB)
        full = M.transformer.lm_head(target, jnp.ones((1, 1, target.config.hidden_size)))
        np.testing.assert_allclose(np.asarray(sub[0, 0, ids]), np.asarray(full[0, 0, ids]), rtol=1e-6)
        assert int(jnp.isfinite(sub).sum()) == 24
        got = specjax.generate(target, prompts, max_new_tokens=24, drafters=[M.MTPDrafter(head, target, ids)],
                               tree="chain=3")
        assert got.sequences() == ref and got.stats["tau"].max() > 1.2, got.stats["tau"]
    n0 = engine.trace_count()  # a new drafter object, other prompts of the same bucket: no retrace
    specjax.generate(target, [p[::-1] for p in prompts], max_new_tokens=24, drafters=[M.MTPDrafter(head, target)],
                     tree=tree)
    assert engine.trace_count() == n0


def test_greedy_equals_autoregressive_hybrid_two_layers():
    """A hybrid target (the module is its gated-attention layer) with two MTP layers, ragged batch 4
    (a chain; trees on the hybrid target are the tree-verification tests' business, MTP trees the
    dense test's)."""
    target = _target("hybrid")
    head, data = _trained(target, n=2, steps=60)
    prompts = [data[i, :k].tolist() for i, k in zip(range(4), (6, 9, 7, 12))]
    ref = specjax.generate(target, prompts, max_new_tokens=24).sequences()
    got = specjax.generate(target, prompts, max_new_tokens=24, drafters=[M.MTPDrafter(head, target)], tree="chain=4")
    assert got.sequences() == ref
    assert got.stats["tau"].max() > 1.1, got.stats["tau"]


# ----------------------------------------------------------------------------- sampling is lossless

ROWS = 100_000
SV = 8


def test_sampled_rule_is_lossless_and_a_q_without_the_hidden_state_is_caught():
    """100k rows sample a 2-chain from q; the sampled rule's first two emitted tokens follow the
    target. Planted bug: q reported by the same module with the target's hidden state zeroed
    (the draft itself read it): caught."""
    target = spread_target(SV, seed=4)  # O(1) logits: a spread distribution
    head = _head(target, 1, seed=2)
    head.fc.weight.set_value(head.fc.weight.get_value() * 3)  # a q that spreads and reads h
    d = M.MTPDrafter(head, target)
    prompt, root = [1, 5, 2, 6, 3], 3
    fam = family(target)
    pre = fam.prefill(target, jnp.asarray([prompt]), jnp.asarray([5]), fam.init_cache(target, 1, 16),
                      hidden_layers=d.target_layers)
    state1 = d.init(jnp.asarray([prompt]), jnp.asarray([5]), 16, pre)

    def rows(st):
        b = lambda x, ax: jnp.broadcast_to(x, x.shape[:ax] + (ROWS,) + x.shape[ax + 1:])  # noqa: E731
        cache = dataclasses.replace(st.cache, k=b(st.cache.k, 1), v=b(st.cache.v, 1), length=b(st.cache.length, 0))
        return dataclasses.replace(st, cache=cache, last_hidden=b(st.last_hidden, 0), scratch=b(st.scratch, 0))

    spec, params = parse_tree_spec("chain=2"), SamplingParams.make(1.0)
    roots = jnp.full((ROWS,), root, jnp.int32)
    # the drafter as an argument: a drafter closed over is a constant XLA folds for seconds
    propose = jax.jit(lambda dr, s, r, k: dr.propose(s, r, DraftContext(spec, "sample", params, k)))
    prop = propose(d, rows(state1), roots, jax.random.key(1))
    seqs = jnp.asarray([prompt + [root, x] for x in range(SV)])
    tl = np.asarray(fam.prefill(target, seqs, jnp.full((SV,), 7), fam.init_cache(target, SV, 8)).logits, np.float64)
    p0, p1 = tl[0, 5], tl[:, 6]
    verify = jax.jit(lambda tree, logits, q, k: V.verify(tree, logits, k, rule="sampled", max_depth=2, params=params,
                                                         draft_probs_BxNxV=q))

    def stats(q, tree=prop.tree):
        logits = np.zeros((ROWS, 3, SV), np.float32)
        logits[:, 0], logits[:, 1] = p0, p1[np.asarray(tree.tokens)[:, 1]]
        vd = verify(tree, jnp.asarray(logits), q, jax.random.key(9))
        n, t, b = (np.asarray(x) for x in (vd.num_accepted, vd.tokens, vd.bonus))
        return first_two_chi_squares(np.where(n >= 1, t[:, 0], b), np.where(n >= 2, t[:, 1], b), n, p0, p1, SV), n

    good, n = stats(prop.probs)
    for stat, df, crit in good:
        assert stat <= crit, f"chi2 {stat:.1f} > {crit:.1f} (df {df})"
    assert len(good) >= 3 and 0.05 < (n >= 1).mean() < 0.95 and (n >= 2).mean() > 0.01
    blind = dataclasses.replace(state1, last_hidden=jnp.zeros_like(state1.last_hidden))
    wrong = propose(d, rows(blind), roots, jax.random.key(1)).probs
    assert float(jnp.abs(wrong - prop.probs).max()) > 0.05
    bad, _ = stats(wrong)
    assert any(s > 10 * c for s, _, c in bad), "the q without the hidden state was not caught"
    # a reduced draft vocabulary (half the tokens): q is zero elsewhere, the output still the target's
    ids = np.arange(0, SV, 2)
    small = M.MTPDrafter(head, target, draft_vocab=ids)
    prop = propose(small, rows(state1), roots, jax.random.key(1))
    assert float(jnp.abs(prop.probs[..., 1::2]).max()) == 0 and set(np.unique(prop.tree.tokens[:, 1:])) <= set(ids)
    good, n = stats(prop.probs, prop.tree)
    for stat, df, crit in good:
        assert stat <= crit, f"reduced vocabulary: chi2 {stat:.1f} > {crit:.1f} (df {df})"
    assert len(good) >= 3 and (n >= 1).mean() > 0.05


# ----------------------------------------------------------------------------- checkpoints

def test_qwen3_next_names_and_shapes_as_transformers_sees_them(tmp_path):
    """A tiny Qwen3-Next checkpoint that ships its MTP layer: transformers' Qwen3NextForCausalLM
    loads it, ignoring exactly the `mtp.*` tensors (its `_keys_to_ignore_on_load_unexpected`), with
    the same logits as without them; the MTP layer's tensors have the shapes of transformers' own
    full-attention layer; our loader drafts from the target directory (`--drafter mtp`) and the
    target's digest is unchanged."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    target = _target("hybrid")
    path = str(tmp_path / "hybrid")
    save_model(target, path)
    digest = weights_sha256(path)
    head = _head(target, 1, seed=7)
    M.save_mtp_head(head, path, dtype=jnp.float32, into_target=True)
    assert weights_sha256(path) == digest
    ours = read_mtp_tensors(path)
    assert set(ours) == set(mtp_tensor_names(target.config, 1))

    import re
    model, info = transformers.Qwen3NextForCausalLM.from_pretrained(path, output_loading_info=True,
                                                                     dtype=torch.float32)
    patterns = model._keys_to_ignore_on_load_unexpected
    assert not info["missing_keys"]
    assert not info["unexpected_keys"] and not info["mismatched_keys"]
    theirs = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    from safetensors.numpy import load_file
    stored = load_file(f"{path}/model.safetensors")
    ignored = {k for k in stored if k not in theirs}
    assert ignored == set(ours) and all(any(re.match(p, k) for p in patterns) for k in ignored)
    full = HYBRID.layer_types.index("full_attention")
    E = HYBRID.hidden_size
    for name, arr in ours.items():
        if name.startswith("mtp.layers.0."):
            assert arr.shape == theirs[f"model.layers.{full}." + name[len("mtp.layers.0."):]], name
        elif name == "mtp.fc.weight":
            assert arr.shape == (E, 2 * E)
        else:
            assert arr.shape == (E,), name
    toks = np.asarray([[3, 9, 4, 1, 7, 30]])
    with torch.no_grad():
        hf = model(torch.tensor(toks)).logits.numpy()
    mine = load_model(path)
    fam = family(mine)
    out = fam.prefill(mine, jnp.asarray(toks), jnp.asarray([6]), fam.init_cache(mine, 1, 8))
    np.testing.assert_allclose(np.asarray(out.logits), hf, atol=1e-4)

    d = load_drafter("mtp", mine, target_path=path)  # drafts as the module written (the drafting is tested above)
    for a, b in zip(jax.tree.leaves(nnx.state(d.head, nnx.Param)), jax.tree.leaves(nnx.state(head, nnx.Param))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_own_directory_round_trip_and_refusals(tmp_path):
    target = _target("dense")
    head = _head(target, 2, seed=5)
    own = tmp_path / "own"
    M.save_mtp_head(head, str(own))  # bf16, Qwen3-Next names, dense layer layout
    cfg = json.loads((own / "drafter_config.json").read_text())
    assert cfg["drafter"] == "mtp" and cfg["num_layers"] == 2
    stored = read_mtp_tensors(str(own))
    assert {str(v.dtype) for v in stored.values()} == {"bfloat16"}
    assert "mtp.layers.1.self_attn.q_proj.weight" in stored and "mtp.pre_fc_norm_hidden.weight" in stored
    d = load_drafter(str(own), target)
    assert isinstance(d, M.MTPDrafter) and d.head.config.num_layers == 2
    for a, b in zip(jax.tree.leaves(nnx.state(d.head, nnx.Param)), jax.tree.leaves(nnx.state(head, nnx.Param))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(jnp.asarray(b, jnp.bfloat16).astype(jnp.float32)))
    # refusals before tracing
    with pytest.raises(ValueError, match="vocab"):
        load_drafter(str(own), tiny_target(VOCAB * 2))
    with pytest.raises(ValueError, match="target's directory"):
        load_drafter("mtp", target)
    bare = tmp_path / "bare"
    save_model(target, str(bare))
    with pytest.raises(ValueError, match="no MTP layers"):
        load_drafter("mtp", target, target_path=str(bare))
    from specjax.models import fold
    with pytest.raises(ValueError, match="FOLD"):
        load_drafter(str(own), target, fold=fold.FoldConfig())
    with pytest.raises(ValueError, match="model family"):
        M.MTPDrafter(head, _target("hybrid"))
    bad = dict(stored)
    bad["mtp.fc.weight"] = bad["mtp.fc.weight"][:, :10]
    with pytest.raises(ValueError, match="mtp.fc.weight"):
        M.head_from_tensors(bad, target.config, "x")
    with pytest.raises(ValueError, match="unexpected"):
        M.head_from_tensors({**stored, "mtp.extra.weight": np.zeros(3)}, target.config, "x")
    with pytest.raises(ValueError, match="MTP tensors"):
        from specjax.io.checkpoint import write_mtp_tensors
        write_mtp_tensors(str(bare), {"model.norm.weight": np.zeros(3)})
    with pytest.raises(ValueError, match="at least one layer"):
        M.MTPConfig.for_target(target.config, 0)
    # a reduced draft vocabulary: the ranking shipped beside the weights, N checked
    from specjax.drafters import vocab
    with pytest.raises(FileNotFoundError, match="token ranking"):
        load_drafter(str(own), target, draft_vocab=8)
    vocab.save_ranking(str(own), np.arange(VOCAB)[::-1])
    d = load_drafter(str(own), target, draft_vocab=8)
    np.testing.assert_array_equal(np.asarray(d.vocab_ids[...]), np.arange(VOCAB - 1, VOCAB - 9, -1))
    for n in (0, VOCAB + 1):
        with pytest.raises(ValueError, match="draft vocabulary"):
            load_drafter(str(own), target, draft_vocab=n)
    with pytest.raises(ValueError, match="built for the MTP and feature drafters"):
        load_drafter("ngram", target, draft_vocab=8)
    vocab.save_ranking(str(own), np.zeros(VOCAB))
    with pytest.raises(ValueError, match="not a ranking"):
        load_drafter(str(own), target, draft_vocab=8)
    with pytest.raises(ValueError, match="distinct token ids"):
        M.MTPDrafter(head, target, draft_vocab=[1, 1])


def test_one_mtp_layer_merged_into_a_sharded_checkpoint(tmp_path):
    """A sharded target gains a `model-mtp.safetensors` shard in its index; loading and digest as before."""
    target = _target("dense")
    path = str(tmp_path / "sharded")
    save_model(target, path, max_shard_bytes=100_000)
    digest = weights_sha256(path)
    M.save_mtp_head(_head(target), path, into_target=True)
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert index["weight_map"]["mtp.fc.weight"] == "model-mtp.safetensors"
    assert weights_sha256(path) == digest
    load_model(path)
    assert isinstance(load_drafter("mtp", target, target_path=path), M.MTPDrafter)
