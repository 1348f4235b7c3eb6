"""Published drafters (`specjax.drafters.interop`, docs/interop.md) against the reference code:

- each format's checkpoint is written by the reference implementation itself (the `speculators`
  package's model classes, z-lab's `dflash` package, speculators' own SafeAILab converter) on a tiny
  random config over a tiny 8-layer target, loaded by `load_drafter`, and our logits equal the
  reference forward's within 1e-4 in float32 (EAGLE-3: two training-time-test steps; block
  drafters: the block's base / Markov logits and the confidence logit);
- a speculators `mtp` head on a dense Qwen3 target: the first step's logits;
- greedy `generate` with each loaded drafter equals autoregressive output, batch 1 and batch 4 with
  ragged prompts;
- our feature drafter and DSpark exported to the speculators format are read back by the package's
  own loader with the same logits, and by ours;
- the refusals: another target, an unknown type, a missing or misshapen tensor, an unbuilt option.

DeepSpec ships no package: its layout is tested here on the same tensors (DSpark's, plus the
target's embedding / LM head copies it saves), and `python -m tools.parity_deepspec` runs its own
modeling code from a repository snapshot (bench/interop_parity_deepspec.md).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.torch import load_file
from safetensors.torch import save_file as torch_save_file
from transformers import LlamaConfig, Qwen3Config

import specjax
from dflash.model import DFlashDraftModel as ZLab
from helpers import full_features
from specjax.models import kvcache
from specjax.io.checkpoint import save_model
from specjax.drafters import BlockDrafter, FeatureDrafter, MTPDrafter, drafter_kind, load_drafter
from specjax.drafters import mtp as mtp_lib
from specjax.drafters.block import BlockConfig, BlockHead, save_block_head, train_logits
from specjax.drafters.feature import FeatureConfig, FeatureHead, save_feature_head, ttt_logits
from specjax.drafters.interop import InteropError
from specjax.drafters.interop.export import export
from specjax.models import transformer
from specjax.models.config import ModelConfig

from speculators.config import SpeculatorsConfig, VerifierConfig  # the references (the interop extra)
from speculators.convert.eagle.eagle3_converter import Eagle3Converter
from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
from speculators.models.dspark import DSparkDraftModel, DSparkSpeculatorConfig
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
from speculators.models.mtp import MTPDraftModel, MTPSpeculatorConfig
from speculators.proposals.greedy import GreedyTokenProposalConfig

REPO = Path(__file__).resolve().parents[1]
V, E, H, K, D, F, L = 64, 32, 4, 2, 8, 48, 8
N_DRAFT = 24  # EAGLE-3's reduced draft vocabulary
AUX = [2, 4, 5]  # EAGLE-3 / speculators ids (entering layer k) = SafeAILab's default for L = 8; ours [1, 3, 4]
B = 4  # block size
MASK = V - 1
TOL = 1e-4


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    """The tiny 8-layer target, saved in HF format (the verifier the references' configs name)."""
    cfg = ModelConfig(vocab_size=V, hidden_size=E, intermediate_size=64, num_layers=L, num_heads=H, num_kv_heads=K,
                      head_dim=D, max_position_embeddings=512)
    d = str(tmp_path_factory.mktemp("target"))
    save_model(transformer.init_model(cfg, seed=3), d)
    return d


@pytest.fixture(scope="module")
def target(target_dir):
    return specjax.load_model(target_dir)


def _randomise_norms(m):
    torch.manual_seed(1)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if p.dim() == 1 and "norm" in n:
                p.copy_(1 + 0.2 * torch.randn_like(p))


def _verifier():
    return VerifierConfig(name_or_path=None, architectures=["LlamaForCausalLM"])


def _embedding(target):
    return torch.tensor(np.asarray(target.embed_tokens[...], np.float32))


def _inputs(seed=0, T=20):
    rng = np.random.default_rng(seed)
    return rng.integers(0, V - 1, (1, T)).astype(np.int32)


# ----------------------------------------------------------------------------- EAGLE-3

def _eagle3(target, norm_before_residual):
    """A tiny speculators Eagle3DraftModel (the package's class) with a reduced draft vocabulary."""
    torch.manual_seed(0)
    tl = LlamaConfig(vocab_size=V, hidden_size=E, intermediate_size=F, num_hidden_layers=1, num_attention_heads=H,
                     num_key_value_heads=K, head_dim=D, rms_norm_eps=1e-5, max_position_embeddings=512,
                     tie_word_embeddings=False)
    tl._attn_implementation = "eager"
    cfg = Eagle3SpeculatorConfig(
        transformer_layer_config=tl, draft_vocab_size=N_DRAFT, norm_before_residual=norm_before_residual,
        eagle_aux_hidden_state_layer_ids=AUX,
        speculators_config=SpeculatorsConfig(algorithm="eagle3", default_proposal_method="greedy",
                                             proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
                                             verifier=_verifier()))
    m = Eagle3DraftModel(cfg).float().eval()
    _randomise_norms(m)
    with torch.no_grad():
        m.embed_tokens.weight.copy_(_embedding(target))
        m.lm_head.weight.normal_(0, 0.3)
        ids = torch.sort(torch.randperm(V)[:N_DRAFT]).values
        m.d2t.copy_(ids - torch.arange(N_DRAFT))
        m.t2d.zero_()
        m.t2d[ids] = True
    return m


def _eagle3_reference(m, tokens, feats, steps=2):
    """The reference's logits of the first `steps` training-time-test steps ([steps, T-1, N]): entry t
    is (the target's aux states at t, token t+1), at position t."""
    got = []
    hook = m.lm_head.register_forward_hook(lambda mod, i, o: got.append(o))
    ids = torch.tensor(tokens[:, 1:], dtype=torch.long)
    with torch.no_grad():
        m(hidden_states=torch.tensor(np.asarray(feats[:, :-1])), input_ids=ids, document_ids=torch.zeros_like(ids),
          position_ids=torch.arange(ids.shape[1])[None], ttt_steps=steps)
    hook.remove()
    return np.stack([g[0].numpy() for g in got])


def _ours_feature(drafter, target, tokens, steps=2):
    head = drafter.head
    feats = full_features(target, jnp.asarray(tokens), head.config.target_layers)
    rows = head.lm_head[...] if head.lm_head is not None else None
    return np.asarray(ttt_logits(head, target, jnp.asarray(tokens), feats, steps, rows))[:, 0], feats


def _check_greedy(target, drafter, tree=None):
    toks = _inputs(5, 40)[0]
    for batch in (1, 4):
        prompts = [toks[:n].tolist() for n in (6, 11, 8, 14)[:batch]]
        ref = specjax.generate(target, prompts, max_new_tokens=16).sequences()
        got = specjax.generate(target, prompts, max_new_tokens=16, drafters=[drafter], tree=tree)
        assert got.sequences() == ref, batch


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_eagle3_speculators_parity(target, tmp_path, norm_before_residual):
    m = _eagle3(target, norm_before_residual)
    m.save_pretrained(str(tmp_path))
    assert drafter_kind(str(tmp_path)) == "speculators"
    d = load_drafter(str(tmp_path), target)
    assert isinstance(d, FeatureDrafter) and d.head.config.target_layers == (1, 3, 4)
    assert d.head.config.norm_before_residual == norm_before_residual and d.head.config.own_head == N_DRAFT
    tokens = _inputs()
    ours, feats = _ours_feature(d, target, tokens)
    ref = _eagle3_reference(m, tokens, feats)
    T = tokens.shape[1]
    np.testing.assert_allclose(ours[0, :T - 1], ref[0], atol=TOL, rtol=TOL)
    np.testing.assert_allclose(ours[1, :T - 2], ref[1, :T - 2], atol=TOL, rtol=TOL)  # step 2: own hidden fed back
    _check_greedy(target, d)


def test_eagle3_safeailab_parity(target, target_dir, tmp_path):
    """A SafeAILab directory (`midlayer.*`, no embedding, pytorch_model.bin) read by us and by
    speculators' own SafeAILab converter: the same logits."""
    m = _eagle3(target, False)
    sd = {(k.replace("layers.0.", "midlayer.")): v.clone() for k, v in m.state_dict().items()
          if not k.startswith(("embed_tokens", "verifier_"))}
    src = tmp_path / "safeailab"
    src.mkdir()
    torch.save(sd, src / "pytorch_model.bin")
    (src / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": E, "intermediate_size": F,
        "num_attention_heads": H, "num_key_value_heads": K, "num_hidden_layers": 1, "hidden_act": "silu",
        "rms_norm_eps": 1e-5, "max_position_embeddings": 512, "vocab_size": V, "draft_vocab_size": N_DRAFT,
        "tie_word_embeddings": False, "torch_dtype": "float32"}))
    assert drafter_kind(str(src)) == "safeailab-eagle3"
    d = load_drafter(str(src), target)
    Eagle3Converter().convert(src, tmp_path / "converted", target_dir, validate=False,
                              eagle_aux_hidden_state_layer_ids=AUX)
    cfg = Eagle3SpeculatorConfig.from_pretrained(str(tmp_path / "converted"))
    cfg.transformer_layer_config._attn_implementation = "eager"
    ref_model = Eagle3DraftModel(cfg).float().eval()
    ref_model.load_state_dict(_torch_tensors(tmp_path / "converted"), strict=False)
    with torch.no_grad():
        ref_model.embed_tokens.weight.copy_(_embedding(target))  # SafeAILab drafters use the target's
    tokens = _inputs(2)
    ours, feats = _ours_feature(d, target, tokens)
    ref = _eagle3_reference(ref_model, tokens, feats)
    T = tokens.shape[1]
    np.testing.assert_allclose(ours[0, :T - 1], ref[0], atol=TOL, rtol=TOL)
    np.testing.assert_allclose(ours[1, :T - 2], ref[1, :T - 2], atol=TOL, rtol=TOL)
    _check_greedy(target, d)


def _torch_tensors(path):
    return {k: v.float() if v.is_floating_point() else v for k, v in load_file(os.path.join(path, "model.safetensors")).items()}


# ----------------------------------------------------------------------------- block drafters

def _qwen3_layers(num_layers=2):
    tl = Qwen3Config(vocab_size=V, hidden_size=E, intermediate_size=F, num_hidden_layers=num_layers,
                     num_attention_heads=H, num_key_value_heads=K, head_dim=D, rms_norm_eps=1e-5,
                     max_position_embeddings=512, attention_bias=False)
    tl._attn_implementation = "eager"
    return tl


def _speculators_block(target, kind, sample_from_anchor=None):
    torch.manual_seed(0)
    sc = SpeculatorsConfig(algorithm=kind, default_proposal_method="greedy", verifier=_verifier(),
                           proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=B)])
    kw = {} if sample_from_anchor is None else {"sample_from_anchor": sample_from_anchor}
    if kind == "dspark":
        cfg = DSparkSpeculatorConfig(transformer_layer_config=_qwen3_layers(), draft_vocab_size=V, block_size=B,
                                     aux_hidden_state_layer_ids=AUX, mask_token_id=MASK, markov_rank=8,
                                     speculators_config=sc, **kw)
        m = DSparkDraftModel(cfg).float().eval()
    else:
        cfg = DFlashSpeculatorConfig(transformer_layer_config=_qwen3_layers(), draft_vocab_size=V, block_size=B,
                                     aux_hidden_state_layer_ids=AUX, mask_token_id=MASK, speculators_config=sc, **kw)
        m = DFlashDraftModel(cfg).float().eval()
    _randomise_norms(m)
    with torch.no_grad():
        m.embed_tokens.weight.copy_(_embedding(target))
        lm = np.asarray(target.embed_tokens[...] if target.lm_head is None else target.lm_head.weight[...].T, np.float32)
        m.lm_head.weight.copy_(torch.tensor(lm))
        if kind == "dspark":
            m.markov_head.markov_w2.weight.normal_(0, 0.3)
            m.confidence_head.proj.weight.normal_(0, 0.3)
    return m


def _speculators_block_reference(m, kind, tokens, feats, anchor, sample_from_anchor):
    """The reference's block at `anchor` through its own training forward (`_backbone_forward`), the
    Markov term and the confidence head: (base or Markov logits [W, V], confidence [W] or None)."""
    T = tokens.shape[1]
    ids = torch.tensor(tokens, dtype=torch.long)
    loss_mask = torch.zeros(1, T)
    loss_mask[0, anchor] = 1
    with torch.no_grad():
        hid, logits, _, _, idx = m._backbone_forward(torch.tensor(np.asarray(feats)), ids, loss_mask,
                                                     torch.zeros(1, T, E), torch.zeros(1, T, dtype=torch.long),
                                                     max_anchors=1)
        logits = logits.view(1, B, -1)
        if kind != "dspark":
            return logits[0].numpy(), None
        bt = ids[0, idx].view(1, B)
        prev = bt if sample_from_anchor else torch.cat([bt[:, :1], bt[:, :-1]], 1)
        emb = m.markov_head.prev_embeddings(prev)
        logits = logits + m.markov_head.block_bias(prev_token_ids=prev, hidden_states=hid.view(1, B, -1), prev_emb=emb)
        conf = m.confidence_head(torch.cat([hid.view(1, B, -1), emb], -1))
    return logits[0].numpy(), conf.reshape(-1).numpy()


def _ours_block(d, target, tokens, anchor):
    feats = full_features(target, jnp.asarray(tokens), d.head.config.target_layers)
    tp = train_logits(d.head, target, jnp.asarray(tokens), feats, jnp.asarray([[anchor]]))
    return tp, feats


@pytest.mark.parametrize("kind,sample_from_anchor", [("dspark", None), ("dflash", None), ("dflash", True)])
def test_block_speculators_parity(target, tmp_path, kind, sample_from_anchor):
    m = _speculators_block(target, kind, sample_from_anchor)
    m.save_pretrained(str(tmp_path))
    d = load_drafter(str(tmp_path), target)
    assert isinstance(d, BlockDrafter)
    from_anchor = kind == "dspark" if sample_from_anchor is None else sample_from_anchor
    assert d.head.config.sample_from_anchor == from_anchor and d.head.config.mask_token_id == MASK
    tokens, anchor = _inputs(3), 7
    tp, feats = _ours_block(d, target, tokens, anchor)
    ref, conf = _speculators_block_reference(m, kind, tokens, feats, anchor, from_anchor)
    off = 0 if from_anchor else 1  # without the anchor's slot our position j is the reference's slot j + 1
    ours = np.asarray(tp.logits[0, 0] if kind == "dspark" else tp.base[0, 0])
    np.testing.assert_allclose(ours, ref[off:], atol=TOL, rtol=TOL)
    if conf is not None:
        np.testing.assert_allclose(np.asarray(tp.conf[0, 0]), conf[off:], atol=TOL, rtol=TOL)
    _check_greedy(target, d)


def test_dflash_zlab_parity(target, tmp_path):
    """z-lab's `dflash` package: its DFlashDraftModel saved and run as `dflash_generate` runs it
    ([bonus, MASK x (W-1)], slots 1.. predict start+1..)."""
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=V, hidden_size=E, intermediate_size=F, num_hidden_layers=2, num_attention_heads=H,
                      num_key_value_heads=K, head_dim=D, rms_norm_eps=1e-5, max_position_embeddings=512,
                      attention_bias=False, num_target_layers=L, block_size=B,
                      dflash_config={"mask_token_id": MASK, "target_layer_ids": [1, 3, 4]})
    cfg.architectures = ["DFlashDraftModel"]
    m = ZLab(cfg).eval()
    _randomise_norms(m)
    m.save_pretrained(str(tmp_path))
    assert drafter_kind(str(tmp_path)) == "zlab-dflash"
    d = load_drafter(str(tmp_path), target)
    tokens, s = _inputs(4), 9
    tp, feats = _ours_block(d, target, tokens, s)
    emb = _embedding(target)
    noise = emb[torch.tensor([[int(tokens[0, s])] + [MASK] * (B - 1)])]
    with torch.no_grad():
        h = m(position_ids=torch.arange(s + B)[None], noise_embedding=noise,
              target_hidden=torch.tensor(np.asarray(feats[:, :s])))
        lm = torch.tensor(np.asarray(target.embed_tokens[...] if target.lm_head is None else target.lm_head.weight[...].T,
                                     np.float32))
        ref = (h[:, 1:] @ lm.T)[0].numpy()
    np.testing.assert_allclose(np.asarray(tp.base[0, 0]), ref, atol=TOL, rtol=TOL)
    _check_greedy(target, d)


def test_deepspec_layout(target, tmp_path):
    """DeepSpec's save: the DSpark tensors under the same names plus frozen copies of the target's
    embedding and LM head, a Qwen3 config with its fields; checked against speculators' DSpark (whose
    forward equals DeepSpec's: tools.parity_deepspec runs DeepSpec's own code)."""
    m = _speculators_block(target, "dspark")
    sd = {k: v.clone() for k, v in m.state_dict().items() if not k.startswith("verifier_")}
    torch_save_file(sd, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3DSparkModel"], "model_type": "qwen3", "vocab_size": V, "hidden_size": E,
        "intermediate_size": F, "num_hidden_layers": 2, "num_attention_heads": H, "num_key_value_heads": K, "head_dim": D,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "num_target_layers": L, "block_size": B,
        "target_layer_ids": [1, 3, 4], "mask_token_id": MASK, "num_anchors": 8, "enable_confidence_head": True,
        "confidence_head_with_markov": True, "markov_rank": 8, "markov_head_type": "vanilla",
        "layer_types": ["full_attention"] * 2, "tie_word_embeddings": False}))
    assert drafter_kind(str(tmp_path)) == "deepspec"
    _rewrite(tmp_path, num_target_layers=L + 4)  # a drafter for a deeper target
    with pytest.raises(InteropError, match="num_target_layers 12, the target has 8"):
        load_drafter(str(tmp_path), target)
    _rewrite(tmp_path, num_target_layers=L)
    d = load_drafter(str(tmp_path), target)
    tokens, anchor = _inputs(6), 8
    tp, feats = _ours_block(d, target, tokens, anchor)
    ref, conf = _speculators_block_reference(m, "dspark", tokens, feats, anchor, True)
    np.testing.assert_allclose(np.asarray(tp.logits[0, 0]), ref, atol=TOL, rtol=TOL)
    np.testing.assert_allclose(np.asarray(tp.conf[0, 0]), conf, atol=TOL, rtol=TOL)
    _check_greedy(target, d)


# ----------------------------------------------------------------------------- export

def test_export_feature_round_trip(target, target_dir, tmp_path):
    head = FeatureHead(FeatureConfig.for_target(target.config, target_layers=(1, 3, 4)), nnx.Rngs(2))
    save_feature_head(head, str(tmp_path / "ours"))
    cfg = export(str(tmp_path / "ours"), target_dir, str(tmp_path / "exported"), dtype="float32")
    assert cfg["norm_before_residual"] is False and cfg["eagle_aux_hidden_state_layer_ids"] == AUX
    sc = Eagle3SpeculatorConfig.from_pretrained(str(tmp_path / "exported"))  # the package's own loader
    sc.transformer_layer_config._attn_implementation = "eager"
    m = Eagle3DraftModel(sc).float().eval()
    missing, _ = m.load_state_dict(_torch_tensors(tmp_path / "exported"), strict=False)
    assert not [k for k in missing if not k.startswith("verifier_")]
    tokens = _inputs(7)
    ours, feats = _ours_feature(FeatureDrafter(head, target), target, tokens)
    ref = _eagle3_reference(m, tokens, feats)
    T = tokens.shape[1]
    np.testing.assert_allclose(ours[0, :T - 1], ref[0], atol=TOL, rtol=TOL)
    np.testing.assert_allclose(ours[1, :T - 2], ref[1, :T - 2], atol=TOL, rtol=TOL)
    back = load_drafter(str(tmp_path / "exported"), target, target_path=target_dir)  # and ours reads it back
    np.testing.assert_allclose(_ours_feature(back, target, tokens)[0][0], ours[0], atol=TOL, rtol=TOL)


@pytest.mark.parametrize("kind", ["dspark", "dflash"])
def test_export_block_round_trip(target, target_dir, tmp_path, kind):
    rank = 8 if kind == "dspark" else 0
    cfg = BlockConfig.for_target(target.config, block_size=B, num_layers=2, markov_rank=rank, target_layers=(1, 3, 4),
                                 mask_token_id=MASK, confidence=rank > 0)
    head = BlockHead(cfg, nnx.Rngs(5))
    if rank:
        head.markov_out.set_value(0.3 * jnp.asarray(np.random.default_rng(0).standard_normal((8, V)), jnp.float32))
        head.confidence_w.set_value(0.3 * jnp.ones((E + 8,)))
    save_block_head(head, str(tmp_path / "ours"), dtype=jnp.float32)
    out = export(str(tmp_path / "ours"), target_dir, str(tmp_path / "exported"), dtype="float32")
    assert out["speculators_model_type"] == kind and out["sample_from_anchor"] is True
    assert out["aux_hidden_state_layer_ids"] == AUX and out["mask_token_id"] == MASK
    config_cls, model_cls = ((DSparkSpeculatorConfig, DSparkDraftModel) if rank else
                             (DFlashSpeculatorConfig, DFlashDraftModel))
    sc = config_cls.from_pretrained(str(tmp_path / "exported"))
    sc.transformer_layer_config._attn_implementation = "eager"
    m = model_cls(sc).float().eval()
    m.load_state_dict(_torch_tensors(tmp_path / "exported"), strict=False)
    with torch.no_grad():
        m.embed_tokens.weight.copy_(_embedding(target))
        m.lm_head.weight.copy_(torch.tensor(np.asarray(target.lm_head.weight[...].T, np.float32)))
    tokens, anchor = _inputs(8), 6
    tp, feats = _ours_block(BlockDrafter(head, target), target, tokens, anchor)
    ref, conf = _speculators_block_reference(m, kind, tokens, feats, anchor, True)
    np.testing.assert_allclose(np.asarray(tp.logits[0, 0] if rank else tp.base[0, 0]), ref, atol=TOL, rtol=TOL)
    if rank:
        np.testing.assert_allclose(np.asarray(tp.conf[0, 0]), conf, atol=TOL, rtol=TOL)
    back = load_drafter(str(tmp_path / "exported"), target, target_path=target_dir)
    np.testing.assert_allclose(np.asarray(_ours_block(back, target, tokens, anchor)[0].logits), np.asarray(tp.logits),
                               atol=TOL, rtol=TOL)


def test_export_refuses_a_learned_mask(target, target_dir, tmp_path):
    head = BlockHead(BlockConfig.for_target(target.config, block_size=B, num_layers=1, target_layers=(1, 3, 4)),
                     nnx.Rngs(0))
    save_block_head(head, str(tmp_path / "ours"))
    with pytest.raises(InteropError, match="learned vector"):
        export(str(tmp_path / "ours"), target_dir, str(tmp_path / "exported"))


# ----------------------------------------------------------------------------- refusals

def _rewrite(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (path / "config.json").write_text(json.dumps(cfg))


def test_refusals(target, target_dir, tmp_path):
    m = _speculators_block(target, "dspark")
    m.save_pretrained(str(tmp_path))
    raw = json.loads((tmp_path / "config.json").read_text())
    cases = [
        (dict(speculators_model_type="medusa"), "speculators_model_type 'medusa'"),
        (dict(markov_head_type="gated"), "markov_head_type 'gated'"),
        (dict(aux_hidden_state_layer_ids=[2, 4, 9]), "out of range"),
        (dict(transformer_layer_config={**raw["transformer_layer_config"], "hidden_size": 48}), "hidden_size 48"),
        (dict(transformer_layer_config={**raw["transformer_layer_config"], "vocab_size": 128}), "vocab_size 128"),
        (dict(specjax={"target_sha256": "0" * 64}), "target_sha256"),
    ]
    for change, message in cases:
        _rewrite(tmp_path, **change)
        with pytest.raises(InteropError, match=message):
            load_drafter(str(tmp_path), target, target_path=target_dir)
        (tmp_path / "config.json").write_text(json.dumps(raw))
    sd = _torch_tensors(tmp_path)
    torch_save_file({k: v for k, v in sd.items() if k != "norm.weight"}, str(tmp_path / "model.safetensors"))
    with pytest.raises(InteropError, match="missing tensor 'norm.weight'"):
        load_drafter(str(tmp_path), target)
    torch_save_file({**sd, "norm.weight": torch.ones(E + 1)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(InteropError, match=r"'norm.weight' has shape \(33,\)"):
        load_drafter(str(tmp_path), target)
    # the CLI: one line, exit 2, before anything is traced (this drafter is for the tiny target, not code-target)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    torch_save_file(sd, str(tmp_path / "model.safetensors"))
    r = subprocess.run([sys.executable, "-m", "specjax", "generate", "--model", str(REPO / "models/code-target"),
                        "--drafter", str(tmp_path), "--prompt", "def f(x):", "--max-new-tokens", "2"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "hidden_size 32" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_mtp_speculators_parity(tmp_path):
    """A speculators `mtp` checkpoint (the package's MTPDraftModel) on a dense Qwen3 target: the first
    step's logits equal the reference forward's; greedy output equals AR."""
    torch.manual_seed(0)
    tl = Qwen3Config(vocab_size=V, hidden_size=E, intermediate_size=F, num_hidden_layers=2, num_attention_heads=H,
                     num_key_value_heads=K, head_dim=D, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
                     max_position_embeddings=512)
    sc = SpeculatorsConfig(algorithm="mtp", default_proposal_method="greedy", verifier=_verifier(),
                           proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)])
    m = MTPDraftModel(MTPSpeculatorConfig(transformer_layer_config=tl, speculators_config=sc)).float().eval()
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(0.2 * torch.randn_like(p))
    m.save_pretrained(str(tmp_path))
    target = transformer.init_model(ModelConfig(vocab_size=V, hidden_size=E, intermediate_size=F, num_layers=2,
                                                num_heads=H, num_kv_heads=K, head_dim=D, model_type="qwen3",
                                                qk_norm=True, rms_norm_eps=1e-6, max_position_embeddings=512), seed=1)
    target.embed_tokens.set_value(jnp.asarray(m.embed_tokens.weight.detach().numpy()))
    target.lm_head.weight.set_value(jnp.asarray(m.lm_head.weight.detach().numpy().T))
    d = load_drafter(str(tmp_path), target)
    assert isinstance(d, MTPDrafter)
    T = 12
    ids = torch.randint(0, V, (1, T))
    hs = torch.randn(1, T, E)
    with torch.no_grad():
        ref = m(input_ids=ids, hidden_states=hs)[0][0].numpy()  # step 0: [1, T-?, V]
    n = T - 4
    cache = kvcache.set_length(kvcache.init(1, 1, n, K, D, jnp.float32), jnp.zeros((1,), jnp.int32))
    _, ours, _ = mtp_lib.step(d.head, target, 0, jnp.asarray(ids.numpy()[:, 1:1 + n]), jnp.asarray(hs.numpy())[:, :n],
                              jnp.arange(n)[None], cache, transformer.causal_mask(1, n))
    np.testing.assert_allclose(np.asarray(ours)[0], ref[0, :n], atol=TOL, rtol=TOL)
    _check_greedy(target, d)
