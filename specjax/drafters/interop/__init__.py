"""Published drafters in their own layouts (design §16; docs/interop.md): one module per format, each
a loader registered by kind (`specjax.drafters.base.register`) with a `detect(path)` that
`drafter_kind` asks of a directory without our `drafter_config.json`:

    speculators.py   vLLM's speculators format: eagle3, dspark, dflash
    safeailab.py     SafeAILab EAGLE-3 (`midlayer.*`, pytorch_model.bin or safetensors)
    zlab.py          z-lab DFlash (the `dflash` package's layout)
    deepspec.py      DeepSpec DSpark / DFlash saves

and the tensor mappings they share (`eagle3.py`: our feature drafter; `block.py`: our block
drafter), with `export.py` writing ours in the speculators format (`python -m specjax.drafters.interop.export`).
A new format adds a module here and its import below.
"""
from specjax.drafters.interop import deepspec, safeailab, speculators, zlab  # noqa: F401 - each registers its loader
from specjax.drafters.interop.common import InteropError

FORMATS = (speculators.Speculators, safeailab.SafeAILabEagle3, zlab.ZLabDFlash, deepspec.DeepSpec)

__all__ = ["FORMATS", "InteropError"]
