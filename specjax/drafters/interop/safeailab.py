"""SafeAILab's EAGLE-3 layout (`yuhuili/EAGLE3-*`): a LlamaConfig-like `config.json` with
`draft_vocab_size`, `pytorch_model.bin` (read with `torch.load(weights_only=True)`) or
`model.safetensors`, the layer's tensors under `midlayer.` and no embedding (the target's is used).

What the layout leaves implicit, as SafeAILab's code reads it: the target layers are the residual
entering layers 2, L/2 and L-3 (ours: outputs of 1, L/2-1, L-4); `head_dim` = hidden / heads;
`norm_before_residual` is false; the RoPE base is the drafter config's `rope_theta`, 10000 when
absent (its trainer always used 10000), with only linear / dynamic scaling, which we refuse.
"""
from __future__ import annotations

import os

from specjax.drafters.base import register
from specjax.drafters.interop import eagle3 as eagle3_layout
from specjax.drafters.interop.common import CONFIG, InteropError, layer_config, read_config, read_tensors, tensor_names

ARCHITECTURES = ("LlamaForCausalLMEagle3",)


@register
class SafeAILabEagle3:
    """Loads a SafeAILab EAGLE-3 directory (`load_drafter`; the CLI's `--drafter PATH`)."""
    name = "safeailab-eagle3"
    OWN = ("head",)  # the drafter it loads keeps its network in `head` (`Drafter.with_weights`)
    by_name = False

    @staticmethod
    def detect(path: str) -> bool:
        raw = read_config(path)
        if raw is None or "speculators_model_type" in raw or "draft_vocab_size" not in raw:
            return False
        if set(raw.get("architectures") or ()) & set(ARCHITECTURES):
            return True
        names = tensor_names(path)
        return any(n.startswith("midlayer.") for n in names) or (not names and os.path.isfile(
            os.path.join(path, "pytorch_model.bin")))

    @classmethod
    def load(cls, spec: str, target, *, target_path: str | None = None):
        where = os.path.join(spec, CONFIG)
        raw = read_config(spec)
        if raw.get("rope_scaling"):
            raise InteropError(f"{where}: rope_scaling {raw['rope_scaling']}: SafeAILab's linear / dynamic RoPE scaling "
                               "is not built")
        layer = layer_config({**raw, "model_type": "llama", "head_dim": None,
                              "rope_theta": raw.get("rope_theta", 10000.0), "num_hidden_layers": 1}, where)
        tensors = {(eagle3_layout.PREFIX + k[len("midlayer."):] if k.startswith("midlayer.") else k): v
                   for k, v in read_tensors(spec).items()}
        L = target.config.num_layers
        return eagle3_layout.drafter_from(tensors, layer, [2, L // 2, L - 3], False, target, where)
