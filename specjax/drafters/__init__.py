"""Drafters: one file each behind the protocol in `base`."""
from specjax.drafters.base import Committed, DraftContext, Drafter, Proposal
from specjax.drafters.feature import FeatureConfig, FeatureDrafter, FeatureHead
from specjax.drafters.lm import LMDrafter
from specjax.drafters.ngram import NgramDrafter

__all__ = ["Committed", "DraftContext", "Drafter", "FeatureConfig", "FeatureDrafter", "FeatureHead", "LMDrafter", "NgramDrafter", "Proposal"]
