"""Drafters: one file each behind the protocol in `base`; each registers itself (`base.register`), and
`load_drafter` finds it by kind."""
import inspect
import json
import os

from specjax.io.checkpoint import weights_sha256
from specjax.drafters import heads
from specjax.drafters.base import REGISTRY, Committed, DraftContext, Drafter, Proposal, register
from specjax.drafters.block import BlockConfig, BlockDrafter, BlockHead
from specjax.drafters.feature import FeatureConfig, FeatureDrafter, FeatureHead
from specjax.drafters.interop import FORMATS, InteropError
from specjax.drafters.lm import LMDrafter
from specjax.drafters.mtp import MTPConfig, MTPDrafter, MTPHead
from specjax.drafters.ngram import NgramDrafter
from specjax.drafters.tuned import read_tuned
from specjax.models import quant

__all__ = ["FORMATS", "InteropError", "REGISTRY", "drafter_kind", "register", "BlockConfig", "BlockDrafter", "BlockHead", "Committed", "DraftContext", "Drafter", "FeatureConfig", "FeatureDrafter", "FeatureHead", "LMDrafter", "MTPConfig", "MTPDrafter", "MTPHead", "NgramDrafter", "Proposal", "check_feature_target", "drafter_takes", "load_drafter", "named_drafter"]


def load_drafter(spec: str, target, fold=None, *, target_path: str | None = None, confidence="off", costs=None,
                 draft_vocab: int | None = None, draft_weights: str | None = None, tuned: bool = True):
    """A drafter from a command-line spec, through the registry (`base.register`): the bare name of a
    drafter that needs no directory (`ngram`, `ngram:N`; `mtp`: the MTP layers of the target's own
    checkpoint, `target_path`), a drafter directory whose `drafter_config.json` names its kind
    (feature, block, mtp), or a Hugging Face model directory (lm).
    `fold`: a `specjax.models.fold.FoldConfig` (lm and feature drafters). `confidence` / `costs`: a block
    drafter's confidence cut ("off", a threshold, or "schedule" with round seconds per verify width).
    `draft_vocab`: an MTP or feature drafter's reduced draft vocabulary, the N most frequent tokens of
    the ranking shipped beside its weights (`specjax.drafters.vocab`).
    `draft_weights`: the storage dtype of the drafter's own network's projections (float32 / bfloat16 / int8,
    `Drafter.with_weights`); the parts it borrows from the target stay as the target is loaded.
    `target_path`: the target's directory; a drafter trained on other weights (its `train_info.json`
    records the digest) is refused: shapes alone do not tell two targets of the same size apart, and a
    foreign head silently drafts badly. Every option a kind does not take is refused before loading.
    `tuned`: a drafter directory's `tuned.json` (`specjax.drafters.tuned`) fills in each of fold /
    draft_vocab / draft_weights the caller left None, and its tree becomes the drafter's default tree;
    False ignores it."""
    record = read_tuned(spec) if tuned and os.path.isdir(spec) else None
    if record is not None:  # what the caller left out (None), from the record
        rec = record.options()
        fold = rec["fold"] if fold is None else fold
        draft_vocab = rec["draft_vocab"] if draft_vocab is None else draft_vocab
        draft_weights = rec["draft_weights"] if draft_weights is None else draft_weights
    given = {"fold": fold, "confidence": None if confidence in (None, "off") else confidence,
             "costs": None if costs is None else tuple(costs), "draft_vocab": draft_vocab}
    kind = drafter_kind(spec)
    cls = REGISTRY[kind]
    if draft_weights is not None:
        quant.check_weights(draft_weights)
        if draft_weights != "float32" and not getattr(cls, "OWN", ()):
            raise ValueError(f"the {kind!r} drafter has no network of its own to store at {draft_weights} (--draft-weights)")
    takes = inspect.signature(cls.load).parameters
    for name, value in given.items():
        if value is not None and name not in takes:
            raise ValueError(f"the {kind!r} drafter takes no {OPTION_WORDS[name]}")
    if os.path.isdir(spec) and target_path is not None and kind not in {f.name for f in FORMATS}:
        check_feature_target(spec, target_path)
    kwargs = {k: v for k, v in given.items() if v is not None}
    if "target_path" in takes:
        kwargs["target_path"] = target_path
    drafter = cls.load(spec, target, **kwargs)
    if record is not None and record.tree is not None:
        drafter.default_tree = record.tree
    return drafter if draft_weights in (None, "float32") else drafter.with_weights(draft_weights)


def named_drafter(spec: str) -> bool:
    """Whether `spec` is the bare name of a drafter that needs no directory (`ngram`, `ngram:N`, `mtp`:
    a registered `by_name` kind), not a path."""
    cls = REGISTRY.get(spec.partition(":")[0])
    return not os.path.isdir(spec) and cls is not None and cls.by_name


def drafter_takes(spec: str) -> set[str]:
    """The options of `load_drafter` the kind `spec` names takes (its `load`'s keywords, and
    draft_weights where it has a network of its own): a capability, read from the registry."""
    cls = REGISTRY[drafter_kind(spec)]
    takes = set(inspect.signature(cls.load).parameters) & set(OPTION_WORDS)
    return takes | ({"draft_weights"} if getattr(cls, "OWN", ()) else set())


OPTION_WORDS = {
    "fold": "FOLD (--fold): FOLD changes a drafter's attention; it is built for the lm and feature drafters",
    "confidence": "confidence cut (--confidence): a confidence cut needs a block drafter (DSpark)",
    "costs": "verify-width costs: they go with a block drafter's confidence schedule or TAPS tree",
    "draft_vocab": "reduced draft vocabulary (--draft-vocab): it is built for the MTP and feature drafters",
    "draft_weights": "weight dtype of its own network (--draft-weights): it has none",
}


def drafter_kind(spec: str) -> str:
    """The registered kind `spec` names: a bare name (`ngram`, `ngram:N`, `mtp`), a drafter directory's
    `drafter_config.json` "drafter", a published layout a format recognises (`interop.FORMATS`:
    speculators, SafeAILab EAGLE-3, z-lab DFlash, DeepSpec), or "lm" for a model directory."""
    name = spec.partition(":")[0]
    if not os.path.isdir(spec):
        if name in REGISTRY and REGISTRY[name].by_name:
            return name
        named = sorted(k for k, c in REGISTRY.items() if c.by_name)
        raise ValueError(f"drafter {spec!r}: not one of {named} and no such directory")
    config_file = os.path.join(spec, heads.CONFIG_FILE)
    if not os.path.exists(config_file):  # a published layout (`specjax.drafters.interop`), else an HF model
        return next((fmt.name for fmt in FORMATS if fmt.detect(spec)), "lm")
    try:
        with open(config_file) as f:
            kind = json.load(f).get("drafter")
    except (OSError, ValueError, AttributeError) as e:
        raise ValueError(f"{config_file}: unreadable ({e})") from None
    if kind not in REGISTRY or kind == "lm":
        raise ValueError(f"{config_file}: unknown drafter kind {kind!r} ({', '.join(sorted(k for k in REGISTRY if k != 'lm'))})")
    return kind


def check_feature_target(head_dir: str, target_path: str) -> None:
    """Raises ValueError when the feature drafter in `head_dir` was trained on other target weights
    than those in `target_path` (no-op for a head without a recorded digest)."""
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
