"""vLLM's `speculators` format: `config.json` with `speculators_model_type` and the drafter's decoder
config in `transformer_layer_config` (written with `to_diff_dict`: fields at their class defaults
are absent), `model.safetensors` without the target's embedding or LM head.

    eagle3   -> our feature drafter. `eagle_aux_hidden_state_layer_ids` count the residual entering
                a layer (ours - 1); `norm_before_residual` absent means true (vLLM's reading);
                `draft_vocab_size` rows of the drafter's own `lm_head`, `d2t` offsets
    dspark   -> our block drafter (DSpark). `aux_hidden_state_layer_ids` (ours + 1), `mask_token_id`,
                `block_size`, `sample_from_anchor` (default true), `markov_rank`,
                `markov_head_type`, `enable_confidence_head`, `confidence_head_with_markov`
    dflash   -> our block drafter with markov_rank 0; `sample_from_anchor` default false (slot k
                predicts start+k: W-1 drafts)

    mtp      -> our MTP drafter, for a dense Qwen3 / Qwen3-Next target: `mtp_layers.0.*` renamed
                to the target checkpoint's `mtp.*` names (input_proj -> fc, token_layernorm ->
                pre_fc_norm_embedding, hidden_layernorm -> pre_fc_norm_hidden, final_layernorm -> norm)

A draft vocabulary (`draft_vocab_size` < vocab) is loaded for eagle3 only; other types (and MoE
MTP layers) are refused by name. `specjax.target_sha256` (our exports write it) is checked against
`target_path`.
"""
from __future__ import annotations

import dataclasses
import os

from specjax.drafters.base import register
from specjax.drafters.mtp import MTPDrafter, head_from_tensors
from specjax.drafters.interop import block as block_layout
from specjax.drafters.interop import eagle3 as eagle3_layout
from specjax.drafters.interop.common import (CONFIG, InteropError, check_digest, layer_config, read_config,
                                             read_tensors)

BLOCK_DEFAULTS = {"dspark": {"sample_from_anchor": True, "markov_rank": 256, "markov_head_type": "vanilla",
                             "enable_confidence_head": True, "confidence_head_with_markov": True},
                  "dflash": {"sample_from_anchor": False, "markov_rank": 0, "enable_confidence_head": False}}


def _eagle3(path, raw, target, where, confidence, costs):
    if confidence not in (None, "off") or costs is not None:
        raise InteropError(f"{where}: an EAGLE-3 drafter takes no confidence cut (it is a block drafter's)")
    layer = layer_config(raw.get("transformer_layer_config") or {}, where, default_type="qwen3")
    for key in ("norm_before_fc", "fc_norm", "norm_output"):
        if raw.get(key):
            raise InteropError(f"{where}: {key}: true is not built (our EAGLE-3 layer has the plain first-layer norms)")
    ths = raw.get("target_hidden_size")
    if ths is not None and ths != layer["hidden_size"]:
        raise InteropError(f"{where}: target_hidden_size {ths} != hidden_size {layer['hidden_size']}: not built")
    tc = target.config
    ids = raw.get("eagle_aux_hidden_state_layer_ids") or [2, tc.num_layers // 2, tc.num_layers - 3]  # vLLM's default
    if any(int(i) < 1 for i in ids):
        raise InteropError(f"{where}: eagle_aux_hidden_state_layer_ids {ids}: id 0 (the embedding output) is not read")
    nbr = raw.get("norm_before_residual", True)  # vLLM assumes true when a speculators config lacks the key
    return eagle3_layout.drafter_from(read_tensors(path), layer, ids, nbr, target, where)


def _block(kind):
    def load(path, raw, target, where, confidence, costs):
        layer = layer_config(raw.get("transformer_layer_config") or {}, where, default_type="qwen3")
        d = {**BLOCK_DEFAULTS[kind], **raw}
        aux = d.get("aux_hidden_state_layer_ids")
        if not aux:
            raise InteropError(f"{where}: missing aux_hidden_state_layer_ids")
        if any(int(i) < 1 for i in aux):
            raise InteropError(f"{where}: aux_hidden_state_layer_ids {aux}: id 0 (the embedding output) is not read")
        if d.get("sliding_window_non_causal"):
            raise InteropError(f"{where}: sliding-window layers are not built")
        cfg = block_layout.config_for(layer, target_layers=[int(i) - 1 for i in aux], block_size=d.get("block_size", 8),
                                      mask_token_id=d.get("mask_token_id"), markov_rank=d.get("markov_rank") or 0,
                                      markov_type=d.get("markov_head_type", "vanilla"),
                                      confidence=bool(d.get("enable_confidence_head")) and bool(d.get("markov_rank")),
                                      confidence_with_markov=d.get("confidence_head_with_markov", True),
                                      sample_from_anchor=d["sample_from_anchor"], target=target, where=where)
        if d.get("draft_vocab_size") not in (None, layer["vocab_size"]):
            raise InteropError(f"{where}: draft_vocab_size {d['draft_vocab_size']} < vocab {layer['vocab_size']}: a "
                               f"{kind} drafter's reduced vocabulary is not loaded (its Markov rows would not match ours)")
        temps = (raw.get("specjax") or {}).get("confidence_temperatures")
        if temps is not None and cfg.confidence:  # our export's calibration rides along
            cfg = _replace(cfg, confidence_temperatures=tuple(float(t) for t in temps), where=where)
        return block_layout.drafter_from(read_tensors(path), cfg, target, where, confidence, costs)
    return load


MTP_NAMES = {"input_proj": "fc", "token_layernorm": "pre_fc_norm_embedding", "hidden_layernorm": "pre_fc_norm_hidden",
             "final_layernorm": "norm"}


def _mtp(path, raw, target, where, confidence, costs):
    """A Qwen3 / Qwen3-Next (dense) MTP head: the target family's own decoder layer after
    fc([norm(embed(t+1)); norm(h_t)]), the target's shared head. The layer shapes are the target's;
    the config is checked against it, the tensors by name and shape."""
    if confidence not in (None, "off") or costs is not None:
        raise InteropError(f"{where}: an MTP drafter takes no confidence cut (it is a block drafter's)")
    layer = raw.get("transformer_layer_config") or {}
    tc = target.config
    mt = layer.get("model_type")
    if mt != tc.model_type:
        raise InteropError(f"{where}: transformer_layer_config.model_type {mt!r}, the target's is {tc.model_type!r}: "
                           "an MTP layer is the target family's own")
    for key, ours in (("hidden_size", tc.hidden_size), ("vocab_size", tc.vocab_size)):
        if key in layer and layer[key] != ours:
            raise InteropError(f"{where}: {key} {layer[key]}, the target's is {ours}: a drafter for another target")
    if layer.get("num_experts"):
        raise InteropError(f"{where}: num_experts {layer['num_experts']}: MoE MTP layers are not built")
    tensors = {}
    for k, v in read_tensors(path).items():
        if k.startswith("verifier_"):
            continue
        parts = k.split(".")
        if parts[:2] != ["mtp_layers", "0"]:
            raise InteropError(f"{where}: tensor {k!r}: one MTP layer (mtp_layers.0.*) is built")
        rest = ".".join(parts[2:])
        head, _, tail = rest.partition(".")
        tensors[f"mtp.{MTP_NAMES[head]}.{tail}" if head in MTP_NAMES else f"mtp.layers.0.{rest}"] = v
    try:
        return MTPDrafter(head_from_tensors(tensors, tc, where), target)
    except InteropError:
        raise
    except ValueError as e:
        raise InteropError(str(e)) from None


TYPES = {"eagle3": _eagle3, "dspark": _block("dspark"), "dflash": _block("dflash"), "mtp": _mtp}


def _replace(cfg, where, **kw):
    try:
        return dataclasses.replace(cfg, **kw)
    except ValueError as e:
        raise InteropError(f"{where}: {e}") from None


@register
class Speculators:
    """Loads a speculators-format directory (`load_drafter`; the CLI's `--drafter PATH`)."""
    name = "speculators"
    OWN = ("head",)  # the drafter it loads keeps its network in `head` (`Drafter.with_weights`)
    by_name = False

    @staticmethod
    def detect(path: str) -> bool:
        raw = read_config(path)
        return raw is not None and "speculators_model_type" in raw

    @classmethod
    def load(cls, spec: str, target, *, confidence="off", costs=None, target_path: str | None = None):
        where = os.path.join(spec, CONFIG)
        raw = read_config(spec)
        kind = raw.get("speculators_model_type")
        if kind not in TYPES:
            raise InteropError(f"{where}: speculators_model_type {kind!r} is not loaded (known: {', '.join(sorted(TYPES))})")
        check_digest(where, raw, target_path)
        return TYPES[kind](spec, raw, target, where, confidence, costs)
