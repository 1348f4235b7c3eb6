"""z-lab's DFlash layout (`z-lab/*-DFlash-*`, the `dflash` package): a Qwen3 `config.json` with
`block_size` (top level, or in `dflash_config`), `dflash_config` {`mask_token_id`,
`target_layer_ids`} (layer outputs, as ours), `num_target_layers`; `model.safetensors` with the
backbone only (the target's embedding and LM head are used).

Slots: the block is [bonus, MASK x (W-1)] and slot k predicts the token at start+k, so W-1 drafts
(`sample_from_anchor=False`). Refused: DFlash2 (candidate selector, convolutions), a causal or
sliding-window block, an input embedding scale, output multiplier or logit soft-cap other than 1 / none.
"""
from __future__ import annotations

import os

from specjax.drafters.base import register
from specjax.drafters.interop import block as block_layout
from specjax.drafters.interop.common import CONFIG, InteropError, layer_config, read_config, read_tensors


def _draft_value(raw: dict, name: str, default=None):
    return (raw.get("dflash_config") or {}).get(name, raw.get(name, default))


@register
class ZLabDFlash:
    """Loads a z-lab DFlash directory (`load_drafter`; the CLI's `--drafter PATH`)."""
    name = "zlab-dflash"
    OWN = ("head",)  # the drafter it loads keeps its network in `head` (`Drafter.with_weights`)
    by_name = False

    @staticmethod
    def detect(path: str) -> bool:
        raw = read_config(path)
        if raw is None or "speculators_model_type" in raw:
            return False
        arch = set(raw.get("architectures") or ())
        return "dflash_config" in raw or bool(arch & {"DFlashDraftModel", "DFlash2DraftModel"})

    @classmethod
    def load(cls, spec: str, target, *, target_path: str | None = None):
        where = os.path.join(spec, CONFIG)
        raw = read_config(spec)
        if "DFlash2DraftModel" in (raw.get("architectures") or ()):
            raise InteropError(f"{where}: DFlash2DraftModel (candidate selector, convolutions) is not built")
        if raw.get("is_causal"):
            raise InteropError(f"{where}: is_causal: true: the block attends to itself non-causally in ours")
        for key, neutral in (("input_embedding_scale", 1.0), ("output_multiplier", 1.0), ("final_logit_softcapping", None)):
            if _draft_value(raw, key, neutral) != neutral:
                raise InteropError(f"{where}: {key} {_draft_value(raw, key)}: not built")
        layer = layer_config({**raw, "model_type": raw.get("model_type", "qwen3")}, where, default_type="qwen3")
        ids = _draft_value(raw, "target_layer_ids")
        if not ids:
            raise InteropError(f"{where}: missing dflash_config.target_layer_ids")
        cfg = block_layout.config_for(layer, target_layers=ids, block_size=_draft_value(raw, "block_size", 16),
                                      mask_token_id=_draft_value(raw, "mask_token_id"), markov_rank=0,
                                      markov_type="vanilla", confidence=False, confidence_with_markov=True,
                                      sample_from_anchor=False, target=target, where=where,
                                      num_target_layers=raw.get("num_target_layers"))
        return block_layout.drafter_from(read_tensors(spec), cfg, target, where)
