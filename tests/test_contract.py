"""The drafter contract's worked example (docs/drafter-contract.md) runs as written: registered,
loaded by name, greedy output equal to autoregressive, one trace; and the contract's data types."""
import dataclasses
import os
import re

import jax.numpy as jnp
import pytest

import specjax
from helpers import tiny_target
from specjax import engine
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
              "costs": "verify_profile"}  # round seconds per width, read from a profile file
    for fn in (specjax.generate, load_drafter):
        for name in inspect.signature(fn).parameters:
            want = differ.get(name, name)
            assert want is None or want in dests, f"{fn.__name__}({name}=) has no --{want.replace('_', '-')} flag"
