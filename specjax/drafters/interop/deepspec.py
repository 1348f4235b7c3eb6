"""DeepSpec's DSpark / DFlash saves (`deepseek-ai/dspark_qwen3_*_block7`, `dflash_*`): one model
class for both (`Qwen3DSparkModel`); `config.json` is a copy of the target's Qwen3 config with the
drafter's `num_hidden_layers`, `block_size`, `target_layer_ids` (layer outputs, as ours; -1 would
be the embedding output, which we do not read), `mask_token_id`, `markov_rank` (0: DFlash),
`markov_head_type`, `enable_confidence_head`, `confidence_head_with_markov`; `model.safetensors`
also holds frozen copies of the target's `embed_tokens` and `lm_head`, checked against the target's
and not kept. Slots: k predicts start+k+1 (W drafts), for DFlash too: ours.
"""
from __future__ import annotations

import os

from specjax.drafters.base import register
from specjax.drafters.interop import block as block_layout
from specjax.drafters.interop.common import CONFIG, layer_config, read_config, read_tensors

ARCHITECTURES = ("Qwen3DSparkModel",)


@register
class DeepSpec:
    """Loads a DeepSpec DSpark / DFlash save (`load_drafter`; the CLI's `--drafter PATH`)."""
    name = "deepspec"
    OWN = ("head",)  # the drafter it loads keeps its network in `head` (`Drafter.with_weights`)
    by_name = False

    @staticmethod
    def detect(path: str) -> bool:
        raw = read_config(path)
        return (raw is not None and "speculators_model_type" not in raw
                and bool(set(raw.get("architectures") or ()) & set(ARCHITECTURES)))

    @classmethod
    def load(cls, spec: str, target, *, confidence="off", costs=None, target_path: str | None = None):
        where = os.path.join(spec, CONFIG)
        raw = read_config(spec)
        layer = layer_config({**raw, "model_type": raw.get("model_type", "qwen3")}, where, default_type="qwen3")
        rank = int(raw.get("markov_rank") or 0)
        cfg = block_layout.config_for(layer, target_layers=raw.get("target_layer_ids") or [],
                                      block_size=raw.get("block_size", 7), mask_token_id=raw.get("mask_token_id"),
                                      markov_rank=rank, markov_type=raw.get("markov_head_type", "vanilla"),
                                      confidence=bool(raw.get("enable_confidence_head")) and rank > 0,
                                      confidence_with_markov=raw.get("confidence_head_with_markov", True),
                                      sample_from_anchor=True, target=target, where=where,
                                      num_target_layers=raw.get("num_target_layers"))
        tensors = read_tensors(spec)
        block_layout.check_borrowed(tensors, target, where)
        return block_layout.drafter_from(tensors, cfg, target, where, confidence, costs)
