"""The drafter contract's worked example (docs/drafter-contract.md) runs as written: registered,
loaded by name, greedy output equal to autoregressive, one trace; and the contract's data types."""
import dataclasses
import os
import re

import jax.numpy as jnp
import pytest

import specjax
from helpers import tiny_target
from specjax.engine import loop as engine
from specjax.drafters import REGISTRY, drafter_kind, load_drafter
from specjax.drafters.base import Committed, DraftContext

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "drafter-contract.md")


def _example_source() -> str:
    text = open(DOC).read()
    section = text[text.index("## Worked example"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_worked_example_is_a_lossless_drafter():
    namespace: dict = {}
    exec(compile(_example_source(), DOC, "exec"), namespace)
    assert REGISTRY["repeat"] is namespace["RepeatDrafter"] and drafter_kind("repeat") == "repeat"
    target = tiny_target(64, seed=0)
    drafter = load_drafter("repeat", target)
    prompts = [[5, 5, 5, 5, 7], [1, 2, 3]]
    ref = specjax.generate(target, prompts, max_new_tokens=12).sequences()
    before = engine.trace_count()
    out = specjax.generate(target, prompts, max_new_tokens=12, drafters=[drafter], tree="chain=3")
    again = specjax.generate(target, prompts, max_new_tokens=12, drafters=[drafter], tree="chain=3")
    assert out.sequences() == ref == again.sequences()
    assert engine.trace_count() - before == 1
    assert (out.stats["repeat_rounds"] >= 1).all()
    rounds = out.stats["repeat_rounds"]
    assert drafter.report(out.stats, 1) == {"repeat": {"rounds": int(rounds[1])}}
    assert drafter.report(out.stats) == {"repeat": {"rounds": int(rounds.sum())}}
    with pytest.raises(ValueError, match="takes no option boundaries"):
        drafter.with_options(boundaries=2)
    with pytest.raises(ValueError, match="chains only"):
        specjax.generate(target, prompts, max_new_tokens=4, drafters=[drafter], tree="depth=2,topk=2,nodes=4")
    with pytest.raises(ValueError, match="'repeat' drafter takes no confidence cut"):
        load_drafter("repeat", target, confidence=0.5)
    REGISTRY.pop("repeat")


def test_contract_data_is_typed_and_lean():
    assert "features" not in {f.name for f in dataclasses.fields(DraftContext)}
    assert "positions" not in {f.name for f in dataclasses.fields(Committed)}
    for cls in (DraftContext, Committed):
        for f in dataclasses.fields(cls):
            assert "Any" not in str(f.type), f"{cls.__name__}.{f.name} is typed {f.type}"
    assert Committed(tokens=jnp.zeros((1, 2), jnp.int32), count=jnp.ones((1,), jnp.int32)).features is None


def test_cli_and_python_names_agree():
    """Every keyword of `specjax.generate` and `load_drafter` is a `generate` flag of the same name
    (`--max-new-tokens` = max_new_tokens), but for the few that differ in kind, listed here."""
    import argparse
    import inspect

    from specjax.cli import add_generate_args
    p = argparse.ArgumentParser()
    add_generate_args(p)
    dests = {a.dest for a in p._actions}
    differ = {"model": "model", "prompts": "prompt", "drafters": "drafter",  # --drafter, repeated
              "eos_token_id": "ignore_eos",  # the model's EOS, or none
              "state_budget_bytes": None,  # Python only: a memory guard for huge hybrid trees
              "target": "model", "spec": "drafter", "target_path": "model",  # load_drafter: from --model / --drafter
              "costs": "verify_profile",  # round seconds per width, read from a profile file
              "packing": "goodput",  # --pack, or --goodput PROFILE (the cost table read from a file)
              "tuned": "untuned"}  # a drafter's recorded defaults: on unless --untuned
    for fn in (specjax.generate, load_drafter):
        for name in inspect.signature(fn).parameters:
            want = differ.get(name, name)
            assert want is None or want in dests, f"{fn.__name__}({name}=) has no --{want.replace('_', '-')} flag"


def test_engine_verifies_a_well_formed_tree_whatever_is_proposed():
    """Losslessness does not rest on a drafter's tree bookkeeping: a proposal with its root marked
    invalid, another token at the root, an orphan and a wrong depth still gives the AR output
    (before `tree.well_formed`, an invalid root dropped its own key and emitted a wrong bonus token)."""
    from specjax.spec import tree as tree_lib
    from specjax.drafters import NgramDrafter

    class Careless(NgramDrafter):
        def propose(self, state, root_B, ctx):
            p = super().propose(state, root_B, ctx)
            t = p.tree
            bad = dataclasses.replace(t, valid=t.valid.at[:, 0].set(False), tokens=t.tokens.at[:, 0].set(0),
                                      depth=t.depth.at[:, 1].set(3))
            return dataclasses.replace(p, tree=bad)

    target = tiny_target(64, seed=0)
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [1, 2, 3, 1, 2, 3, 1]]
    ref = specjax.generate(target, prompts, max_new_tokens=12).sequences()
    out = specjax.generate(target, prompts, max_new_tokens=12, drafters=[Careless()], tree="chain=3")
    assert out.sequences() == ref
    # the guard itself: a well-formed tree comes out unchanged; the faults are mended or dropped
    t = tree_lib.TreeBuffers(tokens=jnp.array([[9, 4, 5, 6, 7]]), parents=jnp.array([[-1, 0, 1, 0, 3]]),
                             depth=jnp.array([[0, 1, 2, 1, 2]]), valid=jnp.ones((1, 5), bool),
                             score=jnp.zeros((1, 5)), source=jnp.zeros((1, 5), jnp.int8))
    same = tree_lib.well_formed(t, jnp.array([9]), 2)
    assert all((getattr(same, f) == getattr(t, f)).all() for f in ("tokens", "parents", "depth", "valid"))
    bad = dataclasses.replace(t, tokens=t.tokens.at[0, 0].set(1), valid=t.valid.at[0, 0].set(False).at[0, 3].set(False),
                              depth=t.depth.at[0, 2].set(4), parents=t.parents.at[0, 1].set(2))
    fixed = tree_lib.well_formed(bad, jnp.array([9]), 2)
    # root restored; node 1 points forward (dropped), so its child 2 is an orphan (dropped); 4's parent 3 is invalid
    assert fixed.tokens[0, 0] == 9 and fixed.valid[0].tolist() == [True, False, False, False, False]
    assert tree_lib.well_formed(dataclasses.replace(t, depth=t.depth.at[0, 2].set(4)), jnp.array([9]), 2).depth[0, 2] == 2
    assert not tree_lib.well_formed(t, jnp.array([9]), 1).valid[0, 2]  # deeper than the verify depth
