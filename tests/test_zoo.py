"""The shipped model zoo: the tokenizer, and every model listed in models/zoo.json (files intact,
config as its training config says, the zoo tokenizer, a model card, the stored greedy
continuation / draft chain); the targets' greedy continuations of test-split prompts equal
transformers'."""
import json
from pathlib import Path

import pytest

from helpers import compare_greedy
from train import lm, zoo

REPO = Path(__file__).resolve().parents[1]
ZOO = json.loads(zoo.ZOO_JSON.read_text()) if zoo.ZOO_JSON.exists() else {"models": {}}
LMS = [n for n, r in ZOO["models"].items() if r["kind"] == "lm"]
FEATURES = [n for n, r in ZOO["models"].items() if r["kind"] in ("feature", "block", "mtp")]  # drafters on a target


def test_tokenizer_is_shipped_and_round_trips():
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(REPO / "models" / "tokenizer" / "tokenizer.json"))
    assert tok.get_vocab_size() == 8192
    assert [tok.token_to_id(t) for t in ("<|endoftext|>", "<|pad|>", "<|mask|>")] == [0, 1, 2]
    text = 'def f(x):\n    """Doc."""\n    return {"a": x ** 2}  # ünïcode\n'
    assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == text
    if ZOO["models"]:
        assert zoo._sha256(REPO / "models" / "tokenizer" / "tokenizer.json") == ZOO["tokenizer_sha256"]


def test_zoo_manifest_lists_every_shipped_model():
    assert sorted(d.name for d in zoo.model_dirs()) == sorted(ZOO["models"])


def test_shipped_lms():
    for name in LMS:
        _check_lm(name)


def test_shipped_feature_drafters():
    targets = {}  # each target loaded once for its drafters (drafting leaves it unchanged)
    for name in FEATURES:
        _check_feature(name, targets)


def _check_lm(name):
    from specjax.io.checkpoint import load_model, load_tokenizer
    d = REPO / "models" / name
    want = ZOO["models"][name]
    for fname, sha in want["files"].items():
        assert zoo._sha256(d / fname) == sha, f"{name}/{fname} differs from models/zoo.json"
    model = load_model(str(d))
    config_name = json.loads((d / "train_info.json").read_text())["run"]["config"]["name"]
    cfg = lm.load_config(REPO / "configs" / f"{config_name}.json")
    hf = json.loads((d / "config.json").read_text())
    for k, v in cfg.model.to_hf().items():
        if k != "torch_dtype":
            assert hf.get(k) == v, f"{name}: config.json {k} = {hf.get(k)!r}, configs/{config_name}.json says {v!r}"
    assert (d / "tokenizer.json").read_bytes() == (REPO / "models" / "tokenizer" / "tokenizer.json").read_bytes()
    card = (d / "README.md").read_text()
    assert "test" in card and "python -m train.lm --config configs/" in card
    assert zoo.greedy_continuation(model, zoo.prompt_ids(load_tokenizer(str(d)))) == want["greedy"]


def _check_feature(name, targets):
    from specjax.io.checkpoint import load_model, load_tokenizer
    d = REPO / "models" / name
    want = ZOO["models"][name]
    for fname, sha in want["files"].items():
        assert zoo._sha256(d / fname) == sha, f"{name}/{fname} differs from models/zoo.json"
    card = (d / "README.md").read_text()
    assert ("acceptance by position" if want["kind"] == "block" else "top-1 agreement") in card
    # the zoo stays lean: own parameters only, bf16, under 20 MB (DPara 19.7 MB with its stand-in
    # projection and autoregressive head; DSpark 17.8)
    assert want["bytes"] < 20e6
    if not zoo.target_available(want["target"]):
        assert want["target"] in zoo.BUILT  # a converted real model (make smollm2): its chain is checked where built
        _check_head_alone(d, want["kind"])
        return
    if want["target"] not in targets:
        target_dir = str(REPO / "models" / want["target"])
        targets[want["target"]] = load_model(target_dir), zoo.prompt_ids(load_tokenizer(target_dir))
    target, ids = targets[want["target"]]
    assert zoo.draft_chain(d, target, ids) == want["draft_chain"]
    if "draft_tree" in want:  # a TreeFlash head: the tree its rows give (its chain is the backbone's)
        assert zoo.draft_chain(d, target, ids, zoo.DRAFT_TREE) == want["draft_tree"]


def _check_head_alone(d, kind):
    """A drafter whose target is built, not shipped: its head still loads from its own files (every
    parameter at the shape its config gives, finite)."""
    import jax
    import numpy as np
    from flax import nnx

    from specjax.drafters.block import load_block_head
    from specjax.drafters.feature import load_feature_head
    assert kind in ("block", "feature"), kind
    head = (load_block_head if kind == "block" else load_feature_head)(str(d))
    params = jax.tree.leaves(nnx.state(head, nnx.Param))
    assert params and all(np.isfinite(np.asarray(x, np.float32)).all() for x in params), d.name
    cfg = json.loads((d / "drafter_config.json").read_text())
    assert head.config.hidden_size == cfg["hidden_size"] and tuple(head.config.target_layers) == tuple(cfg["target_layers"])


@pytest.mark.parametrize("name", ["code-target", "code-target-hybrid"])
def test_target_greedy_matches_transformers(name):
    """transformers loads the shipped weights (LlamaForCausalLM, Qwen3NextForCausalLM) and continues
    test-split prompts exactly as we do."""
    if name not in LMS:
        return  # not shipped yet: test_zoo_manifest_lists_every_shipped_model holds the listing honest
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import specjax
    from train import prompts as prompt_sets
    d = REPO / "models" / name
    model = specjax.load_model(str(d))
    tok = specjax.load_tokenizer(str(d))
    cases = prompt_sets.prompt_set("functions", tok, 4, context_tokens=128)
    ids = [c["ids"] for c in cases]
    ours = specjax.generate(model, ids, max_new_tokens=32, eos_token_id=()).tokens
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
    theirs = []
    with torch.no_grad():
        for p in ids:
            out = hf.generate(torch.tensor([p]), max_new_tokens=32, do_sample=False, eos_token_id=None,
                              pad_token_id=1, min_new_tokens=32)
            theirs.append(out[0, len(p):].tolist())
    def hf_logits(row, prefix):
        with torch.no_grad():
            return hf(torch.tensor([ids[row] + prefix])).logits[0, -1].numpy()

    exact, near = compare_greedy(theirs, [list(map(int, r)) for r in ours], hf_logits)
    assert exact + near == len(ids)


def test_shipped_schedulers():
    """models/treegraft/<pair>: files intact, and the same decisions on a fixed grid of features."""
    for name, want in ZOO.get("schedulers", {}).items():
        assert zoo.scheduler_record(REPO / "models" / "treegraft" / name) == want, name
    assert sorted(d.name for d in zoo.scheduler_dirs()) == sorted(ZOO.get("schedulers", {}))
