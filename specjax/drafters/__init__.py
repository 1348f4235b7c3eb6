"""Drafters: one file each behind the protocol in `base`."""
from specjax.drafters.base import Committed, DraftContext, Drafter, Proposal
from specjax.drafters.lm import LMDrafter
from specjax.drafters.ngram import NgramDrafter

__all__ = ["Committed", "DraftContext", "Drafter", "LMDrafter", "NgramDrafter", "Proposal"]
