"""The settings a shipped drafter was tuned for, recorded beside its weights (`tuned.json`), so that a
drafter loaded with no option runs as the benches found it best: its tree, its draft vocabulary, the
storage dtype of its own network and FOLD's parameters where they help. `load_drafter` fills in each
one the caller did not give (the caller's choice always wins; `tuned=False` ignores the record), and
`generate` / the CLI draft the recorded tree when none is given.

    {"format": "specjax-tuned-v1", "tree": "chain=3", "draft_vocab": 1024, "draft_weights": "int8",
     "fold": null, "tuned_on": "...", "command": "python -m tools.bench ..."}

`tuned_on` says which prompts chose them (validation prompts, never the test split) and `command`
the bench that measured them.
"""
from __future__ import annotations

import dataclasses

from specjax.models import quant
from specjax.models.fold import FoldConfig
from specjax.spec import tree as tree_lib
from specjax.spec.calibration import read_json_beside

FILE = "tuned.json"
FORMAT = "specjax-tuned-v1"


@dataclasses.dataclass(frozen=True)
class Tuned:
    tree: str | None = None
    draft_vocab: int | None = None
    draft_weights: str | None = None
    fold: str | None = None  # a --fold value (`FoldConfig.parse`: "sinks=4,window=256,lambda=0.5"), None: off
    tuned_on: str = ""
    command: str = ""

    def options(self) -> dict:
        """The `load_drafter` options it records (None where it records none)."""
        return {"draft_vocab": self.draft_vocab, "draft_weights": self.draft_weights,
                "fold": None if self.fold is None else FoldConfig.parse(self.fold)}


def read_tuned(directory: str) -> Tuned | None:
    """The drafter directory's `tuned.json` (checked), or None when it has none. ValueError naming the
    file and the field that is wrong."""
    raw, file = read_json_beside(directory, FILE)
    if raw is None:
        return None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise ValueError(f"{file}: not a {FORMAT} file")
    unknown = sorted(set(raw) - {"format", *(f.name for f in dataclasses.fields(Tuned))})
    if unknown:
        raise ValueError(f"{file}: unknown fields {unknown}")
    t = Tuned(**{k: v for k, v in raw.items() if k != "format"})
    try:
        if t.tree is not None:
            tree_lib.parse_tree_spec(t.tree)
        if t.draft_vocab is not None and (not isinstance(t.draft_vocab, int) or t.draft_vocab < 1):
            raise ValueError(f"draft_vocab must be a positive integer, got {t.draft_vocab!r}")
        if t.draft_weights is not None:
            quant.check_weights(t.draft_weights)
        if t.fold is not None:
            FoldConfig.parse(str(t.fold))
    except ValueError as e:
        raise ValueError(f"{file}: {e}") from None
    return t
