"""Drafters: one file each behind the protocol in `base`."""
from specjax.drafters.base import Committed, DraftContext, Drafter, Proposal, SourceScores
from specjax.drafters.block import BlockConfig, BlockDrafter, BlockHead
from specjax.drafters.feature import FeatureConfig, FeatureDrafter, FeatureHead
from specjax.drafters.lm import LMDrafter
from specjax.drafters.mtp import MTPConfig, MTPDrafter, MTPHead
from specjax.drafters.ngram import NgramDrafter

__all__ = ["BlockConfig", "BlockDrafter", "BlockHead", "Committed", "DraftContext", "Drafter", "FeatureConfig", "FeatureDrafter", "FeatureHead", "LMDrafter", "MTPConfig", "MTPDrafter", "MTPHead", "NgramDrafter", "Proposal", "SourceScores", "check_feature_target", "load_drafter"]


def load_drafter(spec: str, target, fold=None, *, target_path: str | None = None, confidence="off", costs=None,
                 draft_vocab: int | None = None):
    """A drafter from a command-line spec: `ngram` (or `ngram:N` for the longest n-gram), `mtp` (the
    MTP layers shipped in the target's own checkpoint, `target_path`), a feature-, block- or
    MTP-drafter directory (`drafter_config.json`, its "drafter" key says which), or a Hugging Face
    model directory (lm).
    `confidence` / `costs`: a block drafter's confidence cut ("off", a threshold, or "schedule" with
    round seconds per verify width; see `specjax.drafters.block.BlockDrafter`).
    `fold`: a `specjax.fold.FoldConfig` to draft with FOLD attention (lm and feature drafters).
    `draft_vocab`: an MTP or feature drafter's reduced draft vocabulary, the N most frequent tokens of the
    ranking shipped beside its weights (`specjax.drafters.vocab`); None: the full vocabulary.
    `target_path`: the target's directory; a feature or block drafter reads that target's hidden states, so
    one trained on other weights (its `train_info.json` records the digest) is refused: shapes
    alone do not tell two targets of the same size apart, and a foreign head silently drafts badly."""
    import os

    import json

    from specjax.checkpoint import load_model
    from specjax.drafters.block import load_block_head
    from specjax.drafters.feature import load_feature_head
    from specjax.drafters.mtp import load_mtp_head

    if spec == "mtp":
        if target_path is None:
            raise ValueError("drafter 'mtp' drafts with the MTP layers of the target's own checkpoint: "
                             "give the target's directory")
        if fold is not None or confidence not in (None, "off") or costs is not None:
            raise ValueError("the MTP drafter takes neither FOLD nor a confidence cut")
        return MTPDrafter(load_mtp_head(target_path, target.config, dtype=target.config.dtype), target,
                          _draft_vocab(target_path, target, draft_vocab))
    if draft_vocab is not None and not (os.path.isdir(spec) and _kind(spec) in ("mtp", "feature")):
        raise ValueError("a reduced draft vocabulary is built for the MTP drafter and the feature drafter; this one is not")
    if spec == "ngram" or spec.startswith("ngram:"):
        if confidence not in (None, "off") or costs is not None:
            raise ValueError("a confidence cut needs a block drafter (DSpark); the n-gram drafter is not")
        n = spec.partition(":")[2]
        if n and not n.isdigit():
            raise ValueError(f"drafter {spec!r}: expected ngram or ngram:N")
        if fold is not None:
            raise ValueError("FOLD changes a drafter's attention; the n-gram drafter has none "
                             "(use --fold with an lm or feature drafter)")
        return NgramDrafter(max_ngram=int(n)) if n else NgramDrafter()
    if not os.path.isdir(spec):
        raise ValueError(f"drafter {spec!r}: not 'ngram' and no such directory")
    config_file = os.path.join(spec, "drafter_config.json")
    kind = None
    if os.path.exists(config_file):
        try:
            with open(config_file) as f:
                kind = json.load(f).get("drafter")
        except (OSError, ValueError, AttributeError) as e:
            raise ValueError(f"{config_file}: unreadable ({e})") from None
        if kind not in ("feature", "block", "mtp"):
            raise ValueError(f"{config_file}: unknown drafter kind {kind!r} (feature, block or mtp)")
        if target_path is not None:
            check_feature_target(spec, target_path)
    if kind != "block" and (confidence not in (None, "off") or costs is not None):
        raise ValueError("a confidence cut needs a block drafter (DSpark); this one is not")
    if kind == "block":
        if fold is not None:
            raise ValueError("FOLD is not built for block drafters (use it with an lm or feature drafter)")
        from specjax.taps import read_path_calibration
        return BlockDrafter(load_block_head(spec, dtype=target.config.dtype), target, confidence=confidence,
                            costs=costs, path_calibration=read_path_calibration(spec))
    if kind == "mtp":
        if fold is not None:
            raise ValueError("FOLD is not built for the MTP drafter (use it with an lm or feature drafter)")
        return MTPDrafter(load_mtp_head(spec, target.config, dtype=target.config.dtype), target,
                          _draft_vocab(spec, target, draft_vocab))
    if kind == "feature":
        return FeatureDrafter(load_feature_head(spec, dtype=target.config.dtype), target, fold=fold,
                              draft_vocab=_draft_vocab(spec, target, draft_vocab))
    return LMDrafter(load_model(spec, dtype=target.config.dtype), fold=fold)


def _kind(path: str):
    import json
    import os
    try:
        with open(os.path.join(path, "drafter_config.json")) as f:
            return json.load(f).get("drafter")
    except (OSError, ValueError, AttributeError):
        return None


def _draft_vocab(path: str, target, n: int | None):
    from specjax.drafters.vocab import draft_ids
    return None if n is None else draft_ids(path, target.config.vocab_size, n)


def check_feature_target(head_dir: str, target_path: str) -> None:
    """Raises ValueError when the feature drafter in `head_dir` was trained on other target weights
    than those in `target_path` (no-op for a head without a recorded digest)."""
    import json
    import os

    from specjax.checkpoint import weights_sha256

    info_file = os.path.join(head_dir, "train_info.json")
    if not os.path.exists(info_file):
        return
    try:
        with open(info_file) as f:
            trained_on = json.load(f).get("run", {}).get("target_sha256")
    except (OSError, ValueError, AttributeError) as e:
        raise ValueError(f"{info_file}: unreadable ({e})") from None
    if trained_on is None:
        return
    actual = weights_sha256(target_path)
    if actual != trained_on:
        raise ValueError(f"drafter {head_dir} was trained on target weights {trained_on[:12]}…, but "
                         f"{target_path} holds {actual[:12]}… (train one for this target: python -m train.feature / train.block / train.mtp)")
