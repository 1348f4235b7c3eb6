"""What the trainers share: the repository root, config paths resolved against it and written back
relative to it, and the refusal a run raises rather than mix runs or destroy a trained model."""
from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


class RunRefused(RuntimeError):
    """Training would mix runs or destroy a trained model; the message says why and what to do."""


def resolve(path: str | None) -> Path | None:
    """A config's path: relative to the repo root (so commands work from any directory) unless absolute."""
    return None if path is None else (REPO / path if not Path(path).is_absolute() else Path(path))


def repo_relative(path) -> str:
    """The inverse of `resolve` for what gets written down (cards, provenance, bench tables): a path
    inside the repo as relative to its root, so no machine's checkout path is recorded."""
    try:
        return str(Path(path).resolve().relative_to(REPO))
    except ValueError:
        return str(path)
