"""The one drafter-stack builder (`specjax.drafters.compose`), shared by the CLI and `tools.bench`.

- the stack syntax: PART, CHEAP+STRONG (TreeGraft), MATCHES|MODEL (Switch), `;key=value` options,
  round-tripped through `Stack.text`; bad stacks refused naming what is wrong;
- `build` makes the composite (defaults filled in) or hands a single drafter its options through the
  contract's `with_options` (a drafter that takes none says so);
- `load_parts` gives each part the options its kind takes (a capability read from the registry);
- a composite's statistics come through the contract's `report` hook;
- nothing outside the registry checks a drafter's name.
"""
from __future__ import annotations

import pathlib
import re

import pytest

import specjax
from helpers import cheap_compiles, noisy_lm_drafter, tiny_target
from specjax.drafters import NgramDrafter, compose
from specjax.drafters.composite.treegraft import Switch
from specjax.drafters.composite.treegraft import TreeGraft
from specjax.models.fold import FoldConfig

VOCAB = 64
ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def target():
    return tiny_target(VOCAB)


@pytest.mark.parametrize("text,parts,composite,opts", [
    ("ngram", ("ngram",), None, {}),
    ("dspark;confidence=0.5", ("dspark",), None, {"confidence": "0.5"}),
    ("ngram+lm", ("ngram", "lm"), "treegraft", {}),
    ("ngram+lm;policy=never;graft_nodes=3", ("ngram", "lm"), "treegraft", {"policy": "never", "graft_nodes": 3}),
    ("ngram|feature@1024-int8;min_match=2;model_tree=depth=3,topk=2,nodes=6", ("ngram", "feature@1024-int8"),
     "switch", {"min_match": 2, "model_tree": "depth=3,topk=2,nodes=6"}),
])
def test_stack_syntax_round_trips(text, parts, composite, opts):
    s = compose.parse_stack(text)
    assert (s.parts, s.composite, s.opts) == (parts, composite, opts)
    assert compose.parse_stack(s.text()) == s


@pytest.mark.parametrize("text,message", [
    ("ngram+", "expected PART"), ("a+b+c", "expected PART"), ("ngram|lm;min_match=x", "not a valid value"),
    ("ngram|lm;policy=always", "unknown option"), ("lm;tree=chain=3", "unknown option"), ("ngram;zero_state", "unknown option"),
])
def test_bad_stacks_are_refused(text, message):
    with pytest.raises(ValueError, match=message):
        compose.parse_stack(text)


def test_build_makes_the_composite_with_its_defaults(target):
    parts = {"ngram": NgramDrafter(), "lm": noisy_lm_drafter(VOCAB)}
    sw = compose.build(compose.parse_stack("ngram|lm"), parts)
    assert isinstance(sw, TreeGraft) and sw.policy == "switch" and sw.min_match == 3 and str(sw.strong_tree) == str(
        Switch(parts["ngram"], parts["lm"]).strong_tree)
    tg = compose.build(compose.parse_stack("ngram+lm;policy=never"), parts)
    assert isinstance(tg, TreeGraft) and tg.policy == "never"
    assert compose.build(compose.parse_stack("lm"), parts) is parts["lm"]
    assert compose.build(compose.Stack.make(["ngram", "lm"], "switch", min_match=2), [parts["ngram"], parts["lm"]]).min_match == 2
    with pytest.raises(ValueError, match="'ngram' drafter takes no option confidence"):
        compose.build(compose.parse_stack("ngram;confidence=0.5"), parts)
    with pytest.raises(ValueError, match="first drafter must draft copied matches"):
        compose.build(compose.parse_stack("lm|ngram"), parts)


def test_load_parts_gives_each_part_the_options_it_takes(target, tmp_path):
    draft_dir = str(tmp_path / "draft")
    specjax.save_model(noisy_lm_drafter(VOCAB).model, draft_dir)
    fold = FoldConfig()
    ngram, lm = compose.load_parts(["ngram", draft_dir], target, fold=fold, confidence="off")
    assert isinstance(ngram, NgramDrafter) and lm.fold == fold  # FOLD for the drafter that attends only
    with pytest.raises(ValueError, match="takes no FOLD"):  # no part takes it: refused, naming the option
        compose.load_parts(["ngram"], target, fold=fold)
    with pytest.raises(ValueError, match="reduced draft vocabulary"):
        compose.load_parts(["ngram", draft_dir], target, draft_vocab=16)


def test_a_composite_reports_through_the_contract(target):
    with cheap_compiles():
        sw = Switch(NgramDrafter(), noisy_lm_drafter(VOCAB), model_tree="chain=2", min_match=2)
        out = specjax.generate(target, [[1, 2, 3, 4] * 6, [9, 8, 7]], max_new_tokens=8, eos_token_id=(),
                               drafters=[sw], tree="chain=4")
    st = out.stats
    one = sw.report(st, 1)["treegraft"]
    assert one["actions"]["strong"] == int(st["treegraft_action_strong"][1])
    assert sw.report(st)["treegraft"]["actions"]["strong"] == int(st["treegraft_action_strong"].sum())


def test_no_drafter_name_checks_outside_the_registry():
    """Code decides by capability (`gives_q`, `drafts_matches`, `drafter_takes`, `named_drafter`), never by
    comparing a drafter's name or spec with a literal."""
    pattern = re.compile(r"""(startswith\(["']ngram|[!=]= ?["'](ngram|lm|feature|mtp|dspark|dflash)["']|"""
                         r"""["'](ngram|lm|feature)["'] ?[!=]= ?)""")
    # the registry itself, and code that dispatches on a recorded kind (the exporter's layouts, the zoo's
    # records) or on a bench row's label (the peers table) rather than on a drafter
    allowed = {"specjax/drafters/__init__.py", "specjax/drafters/interop/export.py", "train/zoo.py", "tools/peers_table.py"}
    bad = []
    for folder in ("specjax", "tools", "train"):
        for f in (ROOT / folder).rglob("*.py"):
            if str(f.relative_to(ROOT)) in allowed:
                continue
            for i, line in enumerate(f.read_text().splitlines(), 1):
                if pattern.search(line):
                    bad.append(f"{f.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not bad, "drafter-name checks:\n" + "\n".join(bad)
