"""Packed verification (design §19): every row of a round verifies its own nodes, and the target's
dense layers run on the nodes that exist, packed into one flat buffer of T slots.

Today's verify-width switch (§3b) pads every row to the widest row's tree: one row with a long
n-gram match makes every row verify 9 nodes. Packing instead lays the round's live nodes (valid
nodes of active rows; a row's root is always one, so a row with nothing worth drafting is an
ordinary AR step, a finished row costs nothing) one after another:

    pack = pack_index(live_BxN, T)     slot t < count holds node (row_T[t], node_T[t]); slots past
                                       count are padding (`valid_T` False: they recompute slot 0's
                                       row and nothing they produce is kept)
    x_T  = to_packed(x_BxN, pack)      gather: row layout -> packed (embedding, before the layers)
    x_BxN = to_rows(x_T, pack, B, N)   scatter back (absent nodes 0), for attention, the cache
                                       writes and the logits

T is one of a few compiled budgets (`packed_budgets`), the smallest that holds the round's live
nodes (`lax.switch` over the budgets, each branch traced once). A family that packs
(`transformer.forward(pack=)`) runs embedding, projections, MLP and LM head on [T] rows and
attention in the row layout (each node over its own row's cache and ancestors), so the dense
compute is the nodes that exist.

The goodput budget (`choose_packed`) goes further: from per-node acceptance estimates it picks
which nodes each row verifies and the budget T, maximising expected tokens per second of the whole
batch, `(active rows + sum of kept estimates) / round_s[T]`, with `round_s` profiled on the machine
(`python -m tools.profile_widths --packed`). A node whose estimate is not worth its slot is cut; a
row may keep only its root. The cut reads drafter-side quantities only (never this round's target
logits), so a cut tree is a smaller proposal and every verification rule stays exact on it.

A leaf of `specjax.spec`: it imports nothing from the models.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from specjax.typing import Array, Bool, Float, Int


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackIndex:
    """Where each packed slot's node lives: slot t is node `node_T[t]` of row `row_T[t]`; `valid_T`
    False for padding slots (they point at node 0 of row 0 and are dropped on the way back)."""
    row_T: Int[Array, "T"]
    node_T: Int[Array, "T"]
    valid_T: Bool[Array, "T"]


def pack_index(live_BxN, T: int) -> PackIndex:
    """The packed layout of the live nodes (row-major order) in T slots; live nodes past T are
    dropped (callers pick T >= the live count)."""
    B, N = live_BxN.shape
    flat = live_BxN.reshape(-1)
    dest = jnp.where(flat, jnp.cumsum(flat) - 1, T)  # slot of each live node; T = nowhere
    src = jnp.zeros((T,), jnp.int32).at[dest].set(jnp.arange(B * N, dtype=jnp.int32), mode="drop")
    valid = jnp.arange(T) < jnp.sum(flat)
    src = jnp.where(valid, src, 0)
    return PackIndex(row_T=src // N, node_T=src % N, valid_T=valid)


def to_packed(x_BxN, pack: PackIndex):
    """Row layout [B, N, ...] -> packed [1, T, ...] (a batch of one row of T slots, so the dense
    layers see their usual [batch, tokens, features] shape)."""
    return x_BxN[pack.row_T, pack.node_T][None]


def to_rows(x_1xT, pack: PackIndex, B: int, N: int):
    """Packed [1, T, ...] -> row layout [B, N, ...]: absent nodes are 0, padding slots dropped."""
    x_T = x_1xT[0]
    row = jnp.where(pack.valid_T, pack.row_T, B)  # out of range: dropped
    out = jnp.zeros((B, N) + x_T.shape[1:], x_T.dtype)
    return out.at[row, pack.node_T].set(x_T, mode="drop")


def packed_budgets(B: int, N: int, min_rows: int = 1) -> tuple[int, ...]:
    """The compiled packed sizes for a batch of B rows of N-node trees: B (every row an AR step),
    2B, 4B, ... below B*N, and B*N (every node of every row); none below `min_rows` (a batch-invariant
    forward's smallest block)."""
    full = B * N
    out, t = [], max(B, min_rows)
    while t < full:
        out.append(t)
        t *= 2
    return tuple(out) + (full,)


def live_nodes(valid_BxN, active_B):
    """The nodes a packed round verifies: the valid nodes of active rows (a finished row: none)."""
    return valid_BxN & active_B[:, None]


def score_estimates(score_BxN, valid_BxN):
    """Per-node acceptance estimates from a tree's scores (the drafter's cumulative draft log q along
    the node's path): exp(score), root 1, invalid 0. Uncalibrated: the default where a drafter gives
    no estimates of its own (`Proposal.est`)."""
    return jnp.where(valid_BxN, jnp.exp(jnp.minimum(score_BxN.astype(jnp.float32), 0.0)), 0.0)


def choose_packed(est_BxN, live_BxN, ancestors_BxNxN, round_s, budgets: tuple[int, ...]):
    """The goodput budget: which live nodes to verify. Non-root live nodes are ranked by estimate,
    each node's taken as the smallest along its path (a node is accepted only with its ancestors; an
    estimate above its parent's is capped there) and parents before children on ties, so every top
    set is closed under ancestors; for each compiled budget T the
    top T - (active rows) are kept, and the budget with the most expected tokens per second,
    (rows + sum of kept estimates) / round_s[T], wins (the smallest on ties). Returns the kept mask
    [B, N], closed under ancestors (a node is kept only if every ancestor is), and the chosen T."""
    B, N = live_BxN.shape
    roots = live_BxN[:, 0]
    rows = jnp.sum(roots).astype(jnp.int32)
    cand = live_BxN & (jnp.arange(N)[None] > 0)
    depth = jnp.sum(ancestors_BxNxN, axis=-1)  # ancestors-or-self: root 1
    below_root = ancestors_BxNxN & (jnp.arange(N)[None, None] > 0)
    path_est = jnp.min(jnp.where(below_root, est_BxN.astype(jnp.float32)[:, None, :], jnp.inf), axis=-1)
    key = jnp.where(cand, jnp.clip(path_est, 0.0, 1.0), -1.0).reshape(-1)
    order = jnp.lexsort((depth.reshape(-1), -key))  # by estimate descending, then shallower first
    gain = jnp.concatenate([jnp.zeros((1,)), jnp.cumsum(jnp.where(key[order] >= 0, key[order], 0.0))])
    n_cand = jnp.sum(cand).astype(jnp.int32)
    ts = jnp.asarray(budgets, jnp.int32)
    k = jnp.clip(ts - rows, 0, n_cand)
    value = jnp.where(ts >= rows, (rows + gain[k]) / jnp.asarray(round_s, jnp.float32), -jnp.inf)
    i = jnp.argmax(value)
    rank = jnp.zeros((B * N,), jnp.int32).at[order].set(jnp.arange(B * N, dtype=jnp.int32))
    kept = (cand.reshape(-1) & (rank < k[i])).reshape(B, N) | roots[:, None] & (jnp.arange(N)[None] == 0)
    closed = jnp.all(jnp.where(ancestors_BxNxN, kept[:, None, :], True), axis=-1) & kept
    return closed, ts[i]


@dataclasses.dataclass(frozen=True)
class Packing:
    """How a speculative loop verifies (`generate(packing=)`): each row its own nodes, packed into
    the smallest of `budgets` (None: `packed_budgets(B, N)`) that holds them; with `round_s` (one
    second figure per budget, profiled: `load_packing`) the goodput budget also cuts nodes whose
    estimate does not pay for its slot. Hashable: a static argument of the jitted loop."""
    budgets: tuple[int, ...] | None = None
    round_s: tuple[float, ...] | None = None
    source: str = ""  # where the cost table came from (a profile path), for the record

    def __post_init__(self):
        if self.round_s is not None:
            if self.budgets is None or len(self.budgets) != len(self.round_s):
                raise ValueError("packing: round_s needs one figure per budget (and the budgets)")
            if not all(np.isfinite(s) and s > 0 for s in self.round_s):
                raise ValueError(f"packing: round_s must be positive seconds, got {self.round_s}")
        if self.budgets is not None:
            bs = tuple(self.budgets)
            if not bs or any(isinstance(b, bool) or int(b) != b or b < 1 for b in bs) or \
                    any(b <= a for a, b in zip(bs, bs[1:])):
                raise ValueError(f"packing: budgets must be strictly ascending positive node counts, got {bs}")

    @property
    def goodput(self) -> bool:
        return self.round_s is not None

    def resolve(self, B: int, N: int, min_rows: int = 1) -> tuple[int, ...]:
        """The budgets this loop compiles: the given ones (the last must be B*N), or the defaults."""
        if self.budgets is None:
            return packed_budgets(B, N, min_rows)
        if self.budgets[-1] != B * N:
            raise ValueError(f"packing: the last budget must be batch x tree nodes = {B * N} (every node of "
                             f"every row), got {self.budgets} (profiled for another batch or tree?)")
        if self.budgets[0] < min_rows:
            raise ValueError(f"packing: budgets below {min_rows} rows are not allowed for this model's attention")
        return tuple(int(b) for b in self.budgets)


def load_packing(path: str | Path, batch: int) -> Packing:
    """The goodput budget's cost table from a `tools.profile_widths --packed` profile: the row of
    `batch` (its budgets and round seconds). ValueError when the profile has no packed row for it."""
    p = Path(path)
    try:
        prof = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"packing: cannot read the profile {p}: {e}") from None
    row = prof.get("packed", {}).get(str(batch))
    if row is None:
        have = sorted(prof.get("packed", {}), key=int)
        raise ValueError(f"packing: {p} has no packed row for batch {batch} (it has {have or 'none'}); "
                         f"profile it: python -m tools.profile_widths --packed --batch {batch} ...")
    return Packing(budgets=tuple(int(b) for b in row["budgets"]), round_s=tuple(float(s) for s in row["round_s"]),
                   source=str(p))
