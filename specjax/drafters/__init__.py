"""Drafters: one file each behind the protocol in `base`."""
from specjax.drafters.base import Committed, DraftContext, Drafter, Proposal, SourceScores
from specjax.drafters.feature import FeatureConfig, FeatureDrafter, FeatureHead
from specjax.drafters.lm import LMDrafter
from specjax.drafters.ngram import NgramDrafter

__all__ = ["Committed", "DraftContext", "Drafter", "FeatureConfig", "FeatureDrafter", "FeatureHead", "LMDrafter", "NgramDrafter", "Proposal", "SourceScores", "load_drafter"]


def load_drafter(spec: str, target, fold=None):
    """A drafter from a command-line spec: `ngram` (or `ngram:N` for the longest n-gram), a
    feature-drafter directory (`drafter_config.json`), or a Hugging Face model directory (lm).
    `fold`: a `specjax.fold.FoldConfig` to draft with FOLD attention (lm and feature drafters)."""
    import os

    from specjax.checkpoint import load_model
    from specjax.drafters.feature import load_feature_head

    if spec == "ngram" or spec.startswith("ngram:"):
        n = spec.partition(":")[2]
        if n and not n.isdigit():
            raise ValueError(f"drafter {spec!r}: expected ngram or ngram:N")
        if fold is not None:
            raise ValueError("FOLD changes a drafter's attention; the n-gram drafter has none "
                             "(use --fold with an lm or feature drafter)")
        return NgramDrafter(max_ngram=int(n)) if n else NgramDrafter()
    if not os.path.isdir(spec):
        raise ValueError(f"drafter {spec!r}: not 'ngram' and no such directory")
    if os.path.exists(os.path.join(spec, "drafter_config.json")):
        return FeatureDrafter(load_feature_head(spec, dtype=target.config.dtype), target, fold=fold)
    return LMDrafter(load_model(spec, dtype=target.config.dtype), fold=fold)
