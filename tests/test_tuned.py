"""A drafter's recorded defaults (`tuned.json`, `specjax.drafters.tuned`):

- `load_drafter` with no option runs a drafter at its recorded settings (tree, draft vocabulary, own
  weight dtype); the caller's choice still wins; `tuned=False` ignores the record; a bad record is refused
  naming the file;
- every shipped drafter with a record loads at it (the SmolLM2 drafters where their built target exists;
  elsewhere their record is checked against the head alone);
- `tools.tune_defaults --smoke` tunes and prints a record.
"""
from __future__ import annotations

import json
import pathlib

import jax
import numpy as np
import pytest
from flax import nnx

import specjax
from helpers import noisy_lm_drafter, tiny_target
from specjax.drafters import load_drafter, tuned as tuned_lib
from train import zoo

REPO = pathlib.Path(__file__).resolve().parents[1]
VOCAB = 64


def _record(d: pathlib.Path, **fields):
    (d / "tuned.json").write_text(json.dumps({"format": tuned_lib.FORMAT, **fields}))


def _own_dtypes(drafter) -> set:
    return {str(np.asarray(x).dtype) for n in drafter.OWN
            for x in jax.tree.leaves(nnx.state(getattr(drafter, n), nnx.Param))}


def test_load_drafter_uses_the_record_unless_the_caller_says_otherwise(tmp_path):
    target = tiny_target(VOCAB)
    d = tmp_path / "draft"
    specjax.save_model(noisy_lm_drafter(VOCAB).model, str(d))
    plain = load_drafter(str(d), target)
    _record(d, tree="chain=2", draft_weights="int8", tuned_on="a test", command="none")
    tuned = load_drafter(str(d), target)
    assert tuned.default_tree == "chain=2" and plain.default_tree != "chain=2"
    assert "int8" in _own_dtypes(tuned) and "int8" not in _own_dtypes(plain)
    assert "int8" not in _own_dtypes(load_drafter(str(d), target, draft_weights="float32"))  # the caller wins
    assert load_drafter(str(d), target, tuned=False).default_tree == plain.default_tree
    out = specjax.generate(target, [[1, 2, 3, 4]], max_new_tokens=6, drafters=[tuned], eos_token_id=())
    ref = specjax.generate(target, [[1, 2, 3, 4]], max_new_tokens=6, eos_token_id=())
    assert out.sequences() == ref.sequences()
    assert int(out.stats["verified_nodes"].max()) <= 3 * int(out.stats["rounds"].max())  # chain=2: 3 nodes a round
    _record(d, tree="chain=2", draft_vocab=16)
    with pytest.raises(ValueError, match="reduced draft vocabulary"):  # an lm drafter has none
        load_drafter(str(d), target)
    for bad, msg in (({"tree": "chian=2"}, "tuned.json"), ({"draft_weights": "int4"}, "tuned.json"),
                     ({"speed": 2}, "unknown fields")):
        _record(d, **bad)
        with pytest.raises(ValueError, match=msg):
            load_drafter(str(d), target)


SHIPPED = sorted(p.parent.name for p in (REPO / "models").glob("*/tuned.json"))


def test_shipped_records_exist():
    assert {"smollm2-135m-instruct-feature", "code-target-feature", "code-draft"} <= set(SHIPPED)


@pytest.mark.parametrize("name", SHIPPED)
def test_each_shipped_drafter_loads_at_its_recorded_settings(name):
    d = REPO / "models" / name
    rec = tuned_lib.read_tuned(str(d))
    assert rec.tuned_on and rec.command.startswith("python -m tools.tune_defaults")
    want = json.loads((REPO / "models" / "zoo.json").read_text())["models"][name]
    target_name = want.get("target", "code-target") if want["kind"] != "lm" else "code-target"
    if not zoo.target_available(target_name):  # a built target (make smollm2): the record against the head
        cfg = json.loads((d / "drafter_config.json").read_text())
        if rec.draft_vocab is not None:
            assert (d / "token_ranking.safetensors").exists() and rec.draft_vocab <= cfg["vocab_size"]
        return
    target = specjax.load_model(str(REPO / "models" / target_name))
    drafter = load_drafter(str(d), target, target_path=str(REPO / "models" / target_name))
    assert drafter.default_tree == (rec.tree or drafter.default_tree)
    if rec.draft_vocab is not None:
        assert int(np.asarray(drafter.vocab_ids[...]).shape[0]) == rec.draft_vocab
    if rec.draft_weights not in (None, "float32"):
        assert rec.draft_weights in _own_dtypes(drafter)


def test_tune_defaults_smoke(capsys):
    from tools import tune_defaults
    assert tune_defaults.main(["--smoke", "--trees", "chain=2;chain=3", "--new-tokens", "6"]) == 0
    out = capsys.readouterr().out
    rec = json.loads(out[out.index("\n{\n") + 1:out.rindex("}") + 1])  # the record, after the candidates' lines
    assert rec["format"] == tuned_lib.FORMAT and rec["tree"] in ("chain=2", "chain=3")
    assert "chain=2" in rec["tuned_on"] and "chain=3" in rec["tuned_on"]
