"""TAPS-style path-conditioned selection for best-first trees (design §5e): calibrated acceptance
estimates g(q, depth) multiplied along each path, and the verify budget chosen per round.

A best-first tree (`tree.best_first`) ranked by sum log g comes out in pop order, so any prefix of
its nodes is the prefix-closed subtree of highest estimated acceptance; `widths.budget_keep` picks,
per round, the compiled verify width (`widths.tree_widths`, design §3b) that maximises expected tokens per
second from the machine's profiled cost table, as the DSpark scheduler does for chains.
`PathCalibration` holds g per row kind (fitted by `train.path_calibration` on greedy validation
rounds with `fit_path_calibration`; stored as `path_calibration.json` beside the drafter).
Departures from TAPS (arXiv 2606.00487; no code was read): g is a binned isotonic fit of
P(accepted | own draft probability, depth, parent accepted), and the budget follows the DSpark
scheduler's expected-throughput rule.
"""
from __future__ import annotations

import dataclasses
import json
import os

import jax.numpy as jnp
import numpy as np

from specjax.spec.tree import ROW_KINDS


@dataclasses.dataclass(frozen=True)
class PathCalibration:
    """TAPS's calibrated acceptance g(q, depth) per row kind (design §5e): `tables` holds
    (kind, table) pairs, table[d-1][b] the probability that a node at depth d whose own draft
    probability q falls in bin b (of `bins` equal bins over [0, 1]) is accepted given its parent is,
    non-decreasing in q (isotonic), fitted on validation rounds (`train.path_calibration`)."""
    tables: tuple
    bins: int
    info: tuple = ()

    def kinds(self) -> tuple[str, ...]:
        return tuple(k for k, _ in self.tables)

    def log_g(self, kind: str, q, depth):
        t = jnp.asarray(dict(self.tables)[kind], jnp.float32)  # [D, bins]
        b = jnp.clip(jnp.floor(q * self.bins).astype(jnp.int32), 0, self.bins - 1)
        d = jnp.clip(depth - 1, 0, t.shape[0] - 1)
        return jnp.log(jnp.clip(t[d, b], 1e-6, 1.0))

    def to_json(self) -> dict:
        return {"format": PATH_CALIBRATION_FORMAT, "bins": self.bins, "tables": {k: [list(r) for r in t] for k, t in self.tables},
                **dict(self.info)}

    @classmethod
    def from_json(cls, raw: dict, where: str = "path calibration") -> "PathCalibration":
        if raw.get("format") != PATH_CALIBRATION_FORMAT:
            raise ValueError(f"{where}: not a {PATH_CALIBRATION_FORMAT} file")
        bins = int(raw["bins"])
        tables = []
        for kind, t in raw["tables"].items():
            if kind not in ROW_KINDS:
                raise ValueError(f"{where}: unknown row kind {kind!r}")
            a = np.asarray(t, np.float64)
            if a.ndim != 2 or a.shape[1] != bins or not ((a >= 0) & (a <= 1)).all():
                raise ValueError(f"{where}: table {kind!r} must be [depth][{bins}] probabilities")
            tables.append((kind, tuple(tuple(float(x) for x in r) for r in a)))
        info = tuple((k, json_freeze(v)) for k, v in raw.items() if k not in ("format", "bins", "tables"))
        return cls(tuple(tables), bins, info)


PATH_CALIBRATION_FORMAT = "specjax-path-calibration-v1"
PATH_CALIBRATION_FILE = "path_calibration.json"


def json_freeze(v):
    """A JSON value as nested tuples (hashable: a drafter's static attributes must be)."""
    if isinstance(v, dict):
        return tuple((k, json_freeze(x)) for k, x in v.items())
    if isinstance(v, list):
        return tuple(json_freeze(x) for x in v)
    return v


def read_path_calibration(path: str) -> PathCalibration | None:
    """The drafter directory's `path_calibration.json`, or None when it has none."""
    raw, file = read_json_beside(path, PATH_CALIBRATION_FILE)
    return None if raw is None else PathCalibration.from_json(raw, file)


def read_json_beside(directory: str, name: str):
    """(the JSON object in `directory/name`, its path), or (None, path) when there is no such file;
    ValueError naming the file when it is unreadable."""
    file = os.path.join(directory, name)
    if not os.path.exists(file):
        return None, file
    try:
        with open(file) as f:
            return json.load(f), file
    except (OSError, ValueError) as e:
        raise ValueError(f"{file}: unreadable ({e})") from None


def isotonic(y_N, w_N):
    """Weighted least-squares non-decreasing fit (pool adjacent violators)."""
    vals, wts, counts = [], [], []
    for y, w in zip(map(float, y_N), map(float, w_N)):
        vals.append(y)
        wts.append(w)
        counts.append(1)
        while len(vals) > 1 and vals[-2] > vals[-1]:
            w2 = wts[-2] + wts[-1]
            v = (vals[-2] * wts[-2] + vals[-1] * wts[-1]) / w2
            c = counts[-2] + counts[-1]
            vals[-2:], wts[-2:], counts[-2:] = [v], [w2], [c]
    return np.repeat(vals, counts)


def fit_path_calibration(q_N, depth_N, accepted_N, depths: int, bins: int = 10, prior: float = 1.0):
    """g(q, depth) [depths, bins]: per depth, the acceptance frequency of nodes by bin of their own
    draft probability q, given their parent was accepted; each bin shrunk toward the depth's mean
    by `prior` pseudo-observations, then made non-decreasing in q (weighted isotonic fit). Depths
    past the last observed one reuse it. Returns (table, counts [depths, bins])."""
    q, d, y = np.asarray(q_N, np.float64), np.asarray(depth_N), np.asarray(accepted_N, np.float64)
    b = np.clip((q * bins).astype(int), 0, bins - 1)
    table, counts = np.zeros((depths, bins)), np.zeros((depths, bins), int)
    last = None
    for k in range(depths):
        sel = d == k + 1
        if not sel.any():
            if last is None:
                raise ValueError("path calibration: no node at depth 1")
            table[k] = last
            continue
        mean = y[sel].mean()
        n = np.bincount(b[sel], minlength=bins)
        acc = np.bincount(b[sel], weights=y[sel], minlength=bins)
        rate = (acc + prior * mean) / (n + prior)
        table[k] = last = np.clip(isotonic(rate, n + prior), 1e-4, 1.0)
        counts[k] = n
    return table, counts
