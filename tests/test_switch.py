"""Switch (TreeGraft's switch policy, `specjax.drafters.composite.treegraft.Switch`): n-gram's chain where its match is long, a model drafter's chain elsewhere.

- greedy output equals autoregressive output with an lm drafter (batch 1 and a ragged batch of 4) and
  a feature drafter (which reads target layers: the composite hands each part its own); both drafters
  draft in the same generation; one compiled program per setup (traces counted);
- a round the model drafter drafts for every row verifies its short tree only (the verify width);
- bad input is refused with a clear ValueError before anything is traced.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
from flax import nnx

import specjax
from helpers import cheap_compiles, compare_greedy, noisy_lm_drafter, prefix_logits_fn, tiny_target, word_model_dir
from specjax.engine import loop as engine
from specjax.spec import tree as tree_lib
from specjax.drafters import FeatureConfig, FeatureDrafter, FeatureHead, NgramDrafter
from specjax.drafters.composite.treegraft import Switch

VOCAB = 64
NEW = 16


@pytest.fixture(autouse=True, scope="module")
def _cheap_compiles():
    with cheap_compiles():
        yield


@pytest.fixture(scope="module")
def target():
    return tiny_target(VOCAB)


def _prompts(batch, seed):
    """Rows that repeat (long n-gram matches) and rows that do not (the model drafter drafts)."""
    rng = np.random.default_rng(seed)
    out = []
    for i, n in enumerate((30, 9, 23, 40)[:batch]):
        out.append((rng.integers(0, VOCAB, 6).tolist() * 9)[:n] if i % 2 == 0 else rng.integers(0, VOCAB, n).tolist())
    return out


@pytest.mark.parametrize("model,batch", [("lm", 1), ("lm", 4), ("feature", 2)])
def test_greedy_equals_autoregressive_and_both_drafters_draft(target, model, batch):
    drafter = noisy_lm_drafter(VOCAB) if model == "lm" else FeatureDrafter(
        FeatureHead(FeatureConfig.for_target(target.config), nnx.Rngs(4)), target)
    sw = Switch(NgramDrafter(), drafter, model_tree="chain=2", min_match=2)
    prompts = _prompts(batch, seed=batch)
    ref = specjax.generate(target, prompts, max_new_tokens=NEW, eos_token_id=())
    got = specjax.generate(target, prompts, max_new_tokens=NEW, eos_token_id=(), drafters=[sw], tree="chain=5")
    n_exact, n_near = compare_greedy(ref.sequences(), got.sequences(), prefix_logits_fn(target, prompts))
    assert n_exact + n_near == batch
    st = dict(got.stats)
    st["switch_model_rounds"] = st["treegraft_action_strong"]
    st["switch_rounds"] = st["treegraft_action_cheap"] + st["treegraft_action_strong"]
    assert (st["switch_rounds"] == st["rounds"]).all()
    if batch == 1:
        assert 0 < st["switch_model_rounds"].sum() < st["switch_rounds"].sum(), st
    else:  # the repeating rows draft with n-gram, the others with the model
        assert (st["switch_model_rounds"][1::2] > 0).all() and (st["switch_model_rounds"] < st["switch_rounds"]).any()
    # the verified width follows the drafter of the round: 3 nodes (the model's chain) or 6 (n-gram's)
    assert (st["verified_nodes"] <= 6 * st["rounds"]).all()
    if batch == 1:
        model_rounds = int(st["switch_model_rounds"][0])
        assert int(st["verified_nodes"][0]) == 3 * model_rounds + 6 * (int(st["rounds"][0]) - model_rounds)
    traces = engine.trace_count()
    again = specjax.generate(target, _prompts(batch, seed=batch + 10), max_new_tokens=NEW, eos_token_id=(),
                             drafters=[sw], tree="chain=5")
    assert engine.trace_count() == traces  # no recompilation for new prompts of the same shapes
    assert again.sequences()
    if model == "feature":  # the same program recovers: the feature drafter scores the n-gram trie depth by depth
        sw.set_policy("recover")
        rec = specjax.generate(target, prompts, max_new_tokens=NEW, eos_token_id=(), drafters=[sw], tree="chain=5")
        assert engine.trace_count() == traces and rec.sequences() == got.sequences()
        assert (rec.stats["treegraft_action_recover"] == rec.stats["rounds"]).all()
        sw.set_policy("switch")


def test_bad_input_is_refused_before_tracing(target):
    lm = noisy_lm_drafter(VOCAB)
    traces = engine.trace_count()
    with pytest.raises(ValueError, match="must draft copied matches"):
        Switch(lm, lm)
    with pytest.raises(ValueError, match="must be a model drafter"):
        Switch(NgramDrafter(), NgramDrafter())
    with pytest.raises(ValueError, match="min_match"):
        Switch(NgramDrafter(), lm, min_match=0)
    with pytest.raises(ValueError, match="no longer n-grams"):  # n-gram matches at most max_ngram tokens
        Switch(NgramDrafter(max_ngram=4), lm, min_match=5)
    # a dynamic model tree writes its whole expansion pool past the committed cache: the engine reserves it
    dyn = tree_lib.parse_tree_spec("depth=3,topk=4,nodes=6")
    assert Switch(NgramDrafter(), lm, model_tree=dyn).check_tree(tree_lib.parse_tree_spec("chain=5"), "greedy") \
        == dyn.pool_size > 6
    sw = Switch(NgramDrafter(), lm, model_tree="chain=4")
    with pytest.raises(ValueError, match="must fit the verify tree"):
        specjax.generate(target, [[1, 2, 3]], max_new_tokens=4, drafters=[sw], tree="chain=3")
    with pytest.raises(ValueError, match="no q"):
        specjax.generate(target, [[1, 2, 3]], max_new_tokens=4, drafters=[sw], tree="chain=5", temperature=1.0,
                         verify="sampled")
    assert engine.trace_count() == traces


@pytest.fixture(scope="module")
def model_dir(target, tmp_path_factory):
    return word_model_dir(target, str(tmp_path_factory.mktemp("switch_cli")))


def test_cli_switch(capsys, model_dir):
    """`--switch MIN_MATCH` over `--drafter ngram --drafter DIR`: the target's own tokens, the switch
    counters in --json, and clear usage errors."""
    from specjax.cli import main
    text = "def add ( a , b ) : return a + b def add ( a , b ) : return"
    model = specjax.load_model(model_dir)
    ids = specjax.load_tokenizer(model_dir).encode(text).ids
    ref = specjax.generate(model, [ids], max_new_tokens=NEW, eos_token_id=()).sequences()[0]
    base = ["generate", "--model", model_dir, "--prompt", text, "--max-new-tokens", str(NEW), "--ignore-eos",
            "--drafter", "ngram", "--drafter", model_dir, "--tree", "chain=5", "--json"]
    assert main(base + ["--switch", "2", "--switch-tree", "chain=2"]) == 0
    [row] = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert row["tokens"] == ref
    assert 0 < row["treegraft"]["actions"]["strong"] < row["rounds"], row  # both drafters drafted

    def usage_error(argv, message):
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and message in err and "Traceback" not in err, err

    usage_error(base[:-1], "--switch MIN_MATCH")
    usage_error(base + ["--switch", "2", "--switch-tree", "chain=6"], "must fit the verify tree")
    usage_error(["generate", "--model", model_dir, "--prompt", "a", "--drafter", model_dir, "--drafter", "ngram",
                 "--switch", "2"], "must draft copied matches")
    usage_error(["generate", "--model", model_dir, "--prompt", "a", "--drafter", "ngram", "--switch-tree", "chain=2"],
                "needs --switch")
    usage_error(base + ["--switch", "2", "--treegraft", "always"], "give one")


def test_composites_forward_each_parts_state_partition():
    """A part's own `state_partition` lays out its field of a Switch's (TreeGraft's) state (no tracing)."""
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P
    from specjax.drafters.composite import treegraft
    from specjax.drafters import LMDrafter

    class Pinned(LMDrafter):
        def state_partition(self, state, batch):
            return {"pinned": P("model")}

    model = Pinned(noisy_lm_drafter(VOCAB).model)  # a new drafter: the shared one stays as it is
    row = jnp.zeros((3,), jnp.int32)
    state = treegraft.GraftState(cheap=(), strong={"any": row}, tau_ema=row, last_accepted=row, acc_ema=row,
                                 last_action=row, generated=row, counters={})
    sw = Switch(NgramDrafter(), model, model_tree="chain=2", min_match=2)
    spec = sw.state_partition(state, 3)
    assert spec.strong == {"pinned": P("model")} and spec.last_action == P("data")
    graft = treegraft.build([NgramDrafter(), model], "always")
    assert graft.state_partition(state, 3).strong == {"pinned": P("model")}


@pytest.mark.parametrize("model,batch", [("lm", 1), ("lm", 4), ("feature", 2)])
def test_switch_policy_is_the_former_switch(target, model, batch):
    """TreeGraft's switch policy gives the former Switch composite's outputs, rounds (so tau) and verified
    widths, row by row (the reference: tests/reference_switch.py)."""
    from reference_switch import Switch as ReferenceSwitch
    drafter = noisy_lm_drafter(VOCAB) if model == "lm" else FeatureDrafter(
        FeatureHead(FeatureConfig.for_target(target.config), nnx.Rngs(4)), target)
    prompts = _prompts(batch, seed=batch + 3)
    kw = dict(max_new_tokens=NEW, eos_token_id=(), tree="chain=5")
    ref = specjax.generate(target, prompts, drafters=[ReferenceSwitch(NgramDrafter(), drafter, model_tree="chain=2",
                                                                      min_match=2)], **kw)
    got = specjax.generate(target, prompts, drafters=[Switch(NgramDrafter(), drafter, model_tree="chain=2",
                                                             min_match=2)], **kw)
    assert got.sequences() == ref.sequences()
    for key in ("rounds", "verified_nodes", "accepted_at_depth"):
        np.testing.assert_array_equal(np.asarray(got.stats[key]), np.asarray(ref.stats[key]), err_msg=key)
    np.testing.assert_array_equal(np.asarray(got.stats["treegraft_action_strong"]),
                                  np.asarray(ref.stats["switch_model_rounds"]))
