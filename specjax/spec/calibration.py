"""Calibrated acceptance g(q, depth): the probability that a draft node whose own draft probability q
(given its parent) falls in a bin, at a depth, is accepted given its parent is. One class, one file and
one format for every use:

    TAPS (design §5e)   best-first trees ranked by sum log g along each path (`log_g`), per table row
                        kind (marginal / markov / head), and the verify budget chosen per round
                        (`widths.budget_keep`); fitted by `train.path_calibration` (`fit_path_rates`)
    AdaptiveSpec        the adaptive shape's prior (`prior`), kind "step" (the node's own q given its
                        parent); fitted by `train.adaptive_calibration` (`fit_pooled_rates`)

Stored beside the drafter as `calibration.json` (`FORMAT`): {"format", "tables": {kind: {"bins",
"depths", "seen": [depth][bin] nodes observed, "rate": [depth][bin] g}}, ...what made it}. Each
trainer rewrites its own kinds and keeps the others. Departures from TAPS (arXiv 2606.00487; no code
was read): g is a binned isotonic fit of P(accepted | own draft probability, depth, parent accepted),
and the budget follows the DSpark scheduler's expected-throughput rule.
"""
from __future__ import annotations

import dataclasses
import json
import os

import jax.numpy as jnp
import numpy as np

from specjax.spec.tree import ROW_KINDS

FORMAT = "specjax-calibration-v1"
FILE = "calibration.json"
STEP = "step"  # the adaptive shape's kind: each node's own q given its parent, whatever drafted it
KINDS = ROW_KINDS + (STEP,)


@dataclasses.dataclass(frozen=True)
class Table:
    """g for one kind: `rate` [depths, bins] (flat, depth-major), non-decreasing in q per depth, fitted
    from `seen` [depths, bins] observed nodes; deeper nodes use the last depth."""
    bins: int
    depths: int
    seen: tuple
    rate: tuple

    def __post_init__(self):
        n = self.bins * self.depths
        if len(self.seen) != n or len(self.rate) != n:
            raise ValueError(f"a calibration table has {self.depths} x {self.bins} cells, got {len(self.seen)} / "
                             f"{len(self.rate)}")
        if not all(0.0 <= r <= 1.0 for r in self.rate) or min(self.seen, default=0) < 0:
            raise ValueError("a calibration table's rates must be probabilities and its counts >= 0")

    def grid(self, flat) -> np.ndarray:
        return np.asarray(flat, np.float64).reshape(self.depths, self.bins)

    @classmethod
    def make(cls, seen_DxB, rate_DxB) -> "Table":
        seen, rate = np.asarray(seen_DxB, np.float64), np.asarray(rate_DxB, np.float64)
        return cls(rate.shape[1], rate.shape[0], tuple(float(x) for x in seen.reshape(-1)),
                   tuple(float(x) for x in rate.reshape(-1)))


@dataclasses.dataclass(frozen=True)
class Calibration:
    """g(q, depth) per kind (`tables`: (kind, Table) pairs) and what made it (`info`: (key, value) pairs)."""
    tables: tuple
    info: tuple = ()

    def kinds(self) -> tuple[str, ...]:
        return tuple(k for k, _ in self.tables)

    def table(self, kind: str) -> Table:
        t = dict(self.tables).get(kind)
        if t is None:
            raise ValueError(f"this calibration has no {kind!r} table (it has {', '.join(self.kinds()) or 'none'})")
        return t

    def log_g(self, kind: str, q, depth):
        """log g at draft probability q and depth (>= 1), traced (TAPS's path keys)."""
        t = self.table(kind)
        rate = jnp.asarray(t.grid(t.rate), jnp.float32)  # [D, bins]
        b = jnp.clip(jnp.floor(q * t.bins).astype(jnp.int32), 0, t.bins - 1)
        d = jnp.clip(depth - 1, 0, t.depths - 1)
        return jnp.log(jnp.clip(rate[d, b], 1e-6, 1.0))

    def prior(self, kind: str = STEP, weight: float = 50.0):
        """(seen, hits) pseudo-counts [depths * bins] (the adaptive shape's prior): each cell's rate with as
        many observations as it has, at most `weight`, and at least one."""
        t = self.table(kind)
        n = np.clip(np.asarray(t.seen, np.float64), 1.0, weight)
        return jnp.asarray(n, jnp.float32), jnp.asarray(n * np.asarray(t.rate, np.float64), jnp.float32)

    def replace(self, kind: str, table: Table, /, **made) -> "Calibration":
        """This calibration with `kind`'s table replaced (the others kept), and what made it (`made`: the
        command, prompts, ...) recorded under "made" -> kind."""
        tables = tuple((k, t) for k, t in self.tables if k != kind) + ((kind, table),)
        info = {k: json_thaw(v) for k, v in self.info}
        info["made"] = {**info.get("made", {}), kind: made}
        return Calibration(tables, tuple((k, json_freeze(v)) for k, v in info.items()))

    def to_json(self) -> dict:
        return {"format": FORMAT, "tables": {k: {"bins": t.bins, "depths": t.depths, "seen": t.grid(t.seen).tolist(),
                                                 "rate": t.grid(t.rate).tolist()} for k, t in self.tables},
                **{k: json_thaw(v) for k, v in self.info}}

    @classmethod
    def from_json(cls, raw: dict, where: str = "calibration") -> "Calibration":
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            raise ValueError(f"{where}: not a {FORMAT} file")
        tables = []
        for kind, t in (raw.get("tables") or {}).items():
            if kind not in KINDS:
                raise ValueError(f"{where}: unknown kind {kind!r} (kinds: {', '.join(KINDS)})")
            try:
                seen, rate = np.asarray(t["seen"], np.float64), np.asarray(t["rate"], np.float64)
                if seen.shape != rate.shape or rate.shape != (int(t["depths"]), int(t["bins"])):
                    raise ValueError
                tables.append((kind, Table.make(seen, rate)))
            except (KeyError, TypeError, ValueError) as e:
                raise ValueError(f"{where}: table {kind!r} must hold [depths][bins] seen and rate ({e})") from None
        info = tuple((k, json_freeze(v)) for k, v in raw.items() if k not in ("format", "tables"))
        return cls(tuple(tables), info)


def read_calibration(directory: str) -> Calibration | None:
    """The drafter directory's `calibration.json`, or None when it has none."""
    raw, file = read_json_beside(directory, FILE)
    return None if raw is None else Calibration.from_json(raw, file)


def write_calibration(directory: str, kind: str, table: Table, /, **made) -> str:
    """`kind`'s table written into the directory's `calibration.json` (its other kinds kept, `made` recorded
    under "made" -> kind); returns the path."""
    old = read_calibration(directory) or Calibration(())
    path = os.path.join(directory, FILE)
    with open(path, "w") as f:
        json.dump(old.replace(kind, table, **made).to_json(), f, indent=1)
        f.write("\n")
    read_calibration(directory)  # it loads
    return path


def json_freeze(v):
    """A JSON value as nested tuples (hashable: a drafter's static attributes must be)."""
    if isinstance(v, dict):
        return ("__dict__", tuple((k, json_freeze(x)) for k, x in v.items()))
    if isinstance(v, list):
        return tuple(json_freeze(x) for x in v)
    return v


def json_thaw(v):
    """The inverse of `json_freeze`."""
    if isinstance(v, tuple) and len(v) == 2 and v[0] == "__dict__":
        return {k: json_thaw(x) for k, x in v[1]}
    if isinstance(v, tuple):
        return [json_thaw(x) for x in v]
    return v


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


def fit_path_rates(q_N, depth_N, accepted_N, depths: int, bins: int = 10, prior: float = 1.0):
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


def fit_pooled_rates(seen_DxB, hits_DxB, shrink: float = 5.0):
    """The adaptive shape's g [depths, bins] from counts: each depth's bin shrunk toward the bin's rate over
    all depths (itself shrunk toward g = q: one pseudo-observation at the bin's centre) by `shrink`
    pseudo-observations, then made non-decreasing in q per depth (weighted isotonic fit)."""
    n, h = np.asarray(seen_DxB, np.float64), np.asarray(hits_DxB, np.float64)
    if (h < 0).any() or (h > n + 1e-6).any():
        raise ValueError("accepted counts must be within [0, observed]")
    bins = n.shape[1]
    centres = (np.arange(bins) + 0.5) / bins
    pooled = (h.sum(0) + centres) / (n.sum(0) + 1.0)
    rate = (h + shrink * pooled[None]) / (n + shrink)
    return np.stack([isotonic(r, w + shrink) for r, w in zip(rate, n)])
