"""Verify-width cost profiles: what the DSpark scheduler (`confidence="schedule"`) needs to know
about this machine.

`tools/profile_widths.py` measures, per batch size, the seconds of one speculative round at each
compiled verify width (the drafter's propose + commit, plus the target's verification forward
over w nodes) and writes a JSON file:

    {"cpu": ..., "device": ..., "target": ..., "target_sha256": ..., "drafter": ..., "tree": "chain=8",
     "context": 256, "command": ...,
     "rows": {"1": {"widths": [1, 2, 3, 5, 9], "round_s": [...], "draft_s": x, "verify_s": [...]},
              "4": {...}}}

`costs_from_profile` turns one such file into the `costs` a `BlockDrafter` takes. Pure Python.
"""
from __future__ import annotations

import json
import os
import platform

TOOL = "python -m tools.profile_widths"


def load_profile(path: str) -> dict:
    """The profile JSON at `path` (ValueError naming the file when it is not one)."""
    try:
        with open(path) as f:
            profile = json.load(f)
    except OSError as e:
        raise ValueError(f"{path}: cannot read the verify-width profile ({e.strerror or e})") from None
    except ValueError as e:
        raise ValueError(f"{path}: not a JSON verify-width profile ({e})") from None
    if not isinstance(profile, dict) or not isinstance(profile.get("rows"), dict) or not profile["rows"]:
        raise ValueError(f"{path}: not a verify-width profile (no \"rows\"; make one with {TOOL})")
    return profile


def profile_batch(profile: dict, batch: int) -> int:
    """The profiled batch size used for `batch`: the largest one <= batch, else the smallest."""
    try:
        sizes = sorted(int(b) for b in profile["rows"])
    except (KeyError, TypeError, ValueError, AttributeError):
        raise ValueError(f"not a verify-width profile (rows must be keyed by batch size; make one with {TOOL})") from None
    if not sizes:
        raise ValueError(f"the verify-width profile has no rows (make one with {TOOL})")
    below = [b for b in sizes if b <= batch]
    return below[-1] if below else sizes[0]


def costs_from_profile(profile: dict, batch: int, widths) -> tuple[float, ...]:
    """Round seconds at each of `widths` for a batch of `batch` rows, from the profiled batch size
    nearest to it (`profile_batch`). ValueError when the profile's widths differ from `widths`
    (another tree or drafter: rerun the tool)."""
    b = profile_batch(profile, batch)
    row = profile["rows"].get(str(b), profile["rows"].get(b))
    widths = tuple(int(w) for w in widths)
    try:
        have = tuple(int(w) for w in row["widths"])
        costs = tuple(float(c) for c in row["round_s"])
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"the verify-width profile's batch-{b} row lacks widths / round_s (make one with {TOOL})") from None
    if have != widths:
        tree = profile.get("tree", "?")
        raise ValueError(f"the verify-width profile (tree {tree}) covers widths {list(have)}, but this drafter and tree "
                         f"verify at {list(widths)}: rerun {TOOL} with this drafter and --tree")
    if len(costs) != len(have) or not all(c > 0 for c in costs):
        raise ValueError(f"the verify-width profile's batch-{b} row has bad round_s {list(costs)} (rerun {TOOL})")
    return costs


def costs_at_widths(profile: dict, batch: int, widths) -> tuple[float, ...]:
    """Round seconds at each of `widths` from a profile that covers them (and maybe more: a TAPS
    tree of N nodes reads the first widths of a profile made at a larger N). ValueError else."""
    b = profile_batch(profile, batch)
    row = profile["rows"].get(str(b), profile["rows"].get(b))
    try:
        have = {int(w): float(c) for w, c in zip(row["widths"], row["round_s"])}
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"the verify-width profile's batch-{b} row lacks widths / round_s (make one with {TOOL})") from None
    missing = [int(w) for w in widths if int(w) not in have]
    if missing:
        raise ValueError(f"the verify-width profile (tree {profile.get('tree', '?')}) has no widths {missing}: rerun "
                         f"{TOOL} with --tree at this node budget")
    return tuple(have[int(w)] for w in widths)


def default_profile_name(target_path: str) -> str:
    """`verify_profile_<target dir name>.json`."""
    return f"verify_profile_{os.path.basename(os.path.normpath(target_path))}.json"


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo's 'model name', else platform.processor()): recorded with
    every profile, bench and model card (the same bench differs by up to 1.5x between CPUs)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"
