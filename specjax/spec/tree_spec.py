"""Tree specs (design §2): what shape of draft tree a round asks for, parsed and checked on the host.

    chain=D                       a chain of D draft tokens (a static tree of width 1)
    [[0], [1], [0, 0], ...]       a static path list (Medusa / EAGLE-1 style)
    depth=D,topk=K,nodes=N        a dynamic tree (EAGLE-2 style: expand the top-K frontier D times, keep N)
    ddtree,nodes=N / treeflash,nodes=N[,...]   best-first trees from a block drafter's tables (design §5e)
"""
from __future__ import annotations

import dataclasses
import json
import re
from typing import Sequence

import numpy as np

@dataclasses.dataclass(frozen=True)
class StaticTree:
    """A Medusa / EAGLE-1 path list, compiled once on the host.

    Each path lists, from the root down, the rank of the child at each depth: [[0], [1], [0, 0]]
    is the root's top-1 and top-2 children and the top-1 child of the top-1 child.
    """
    paths: tuple[tuple[int, ...], ...]

    def __post_init__(self):
        validate_paths(self.paths)

    @property
    def num_nodes(self) -> int:
        return len(self.paths) + 1

    @property
    def max_depth(self) -> int:
        return max(len(p) for p in self.paths)

    def layout(self):
        """(parents [N], depth [N], rank [N]) as numpy, nodes sorted by depth then path."""
        order = sorted(self.paths, key=lambda p: (len(p), p))
        index = {(): 0}
        parents, depth, rank = [-1], [0], [0]
        for i, p in enumerate(order, start=1):
            index[p] = i
            parents.append(index[p[:-1]])
            depth.append(len(p))
            rank.append(p[-1])
        return np.array(parents, np.int32), np.array(depth, np.int32), np.array(rank, np.int32)

    def max_branching(self) -> int:
        return 1 + max(p[-1] for p in self.paths)


@dataclasses.dataclass(frozen=True)
class DynamicTree:
    """EAGLE-2: expand the top-k frontier by cumulative log-prob for `depth` steps, then keep the
    best `nodes - 1` drafted nodes (a connected tree, since a child never outscores its parent)."""
    depth: int
    topk: int
    nodes: int

    def __post_init__(self):
        if self.depth < 1 or self.topk < 1 or self.nodes < 2:
            raise ValueError(f"dynamic tree needs depth >= 1, topk >= 1, nodes >= 2; got {self}")
        if self.nodes - 1 > self.pool_size - 1:
            raise ValueError(f"dynamic tree keeps {self.nodes - 1} nodes but expansion only proposes "
                             f"{self.pool_size - 1} (depth={self.depth}, topk={self.topk})")

    @property
    def num_nodes(self) -> int:
        return self.nodes

    @property
    def max_depth(self) -> int:
        return self.depth

    @property
    def pool_size(self) -> int:
        # root + topk children of the root + topk*topk candidates at each further depth
        return 1 + self.topk + (self.depth - 1) * self.topk * self.topk


ROW_KINDS = ("marginal", "markov", "head")  # "auto" resolves to one of the conditional kinds per drafter
SELECTS = ("logq", "taps")


@dataclasses.dataclass(frozen=True)
class BestFirstTree:
    """A best-first tree over per-depth transition tables (design §5e), for drafters that give every
    depth's rows in one pass (block drafters): a heap over path scores pops the best frontier node,
    then pushes its next sibling and its first child, until `nodes` nodes (root included).

    `rows`: "marginal" (DDTree: one row per depth, every node expandable), or conditional rows
    (TreeFlash: one row per candidate previous token, the top `m` of the depth's marginal row;
    "markov": the Markov head's exact rows, "head": the TreeFlash head's, "auto": the head where the
    drafter has one, else the Markov head). `k`: children per row. `select`: "logq" ranks paths by
    cumulative draft log-prob; "taps" by the calibrated path acceptance estimate prod g(q, depth)
    (the drafter's stored calibration), and with a cost table the verify budget is chosen per round.
    Nodes come out in pop order: score-descending and topological, so any prefix of the nodes is a
    prefix-closed subtree."""
    nodes: int
    rows: str = "marginal"
    m: int = 1
    k: int = 8
    depth: int | None = None  # None: the drafter's (a block drafter: min(its block, nodes - 1))
    select: str = "logq"

    def __post_init__(self):
        if self.nodes < 2 or self.k < 1 or self.m < 1 or (self.depth is not None and self.depth < 1):
            raise ValueError(f"a best-first tree needs nodes >= 2, k >= 1, m >= 1, depth >= 1; got {self}")
        if self.rows not in ROW_KINDS + ("auto",):
            raise ValueError(f"best-first rows must be one of {ROW_KINDS + ('auto',)}, got {self.rows!r}")
        if self.rows == "marginal" and self.m != 1:
            raise ValueError("marginal rows (ddtree) have one row per depth: m must be 1")
        if self.select not in SELECTS:
            raise ValueError(f"best-first select must be one of {SELECTS}, got {self.select!r}")

    @property
    def num_nodes(self) -> int:
        return self.nodes

    @property
    def max_depth(self) -> int:
        return self.nodes - 1 if self.depth is None else self.depth  # unresolved: the deepest N nodes reach

    @property
    def conditional(self) -> bool:
        return self.rows != "marginal"


TreeSpec = StaticTree | DynamicTree | BestFirstTree

_BEST_FIRST_KEYS = {"ddtree": {"nodes", "k", "depth", "select"},
                    "treeflash": {"nodes", "m", "k", "depth", "rows", "select"}}


def _parse_best_first(kind: str, items: list[str], spec: str) -> BestFirstTree:
    kv = {}
    for item in items:
        key, eq, val = item.partition("=")
        if not eq or key in kv:
            raise ValueError(f"malformed tree spec {spec!r}: {item!r} is not key=value (or repeats a key)")
        kv[key] = val
    bad = set(kv) - _BEST_FIRST_KEYS[kind]
    if bad or "nodes" not in kv:
        raise ValueError(f"malformed tree spec {spec!r}: {kind} takes nodes=N and optionally "
                         f"{', '.join(sorted(_BEST_FIRST_KEYS[kind] - {'nodes'}))}"
                         + (f" (not {', '.join(sorted(bad))})" if bad else ""))
    ints = {}
    for key in ("nodes", "m", "k", "depth"):
        if key in kv:
            if not kv[key].isdigit():
                raise ValueError(f"malformed tree spec {spec!r}: {key} must be a positive integer")
            ints[key] = int(kv[key])
    if kind == "ddtree":
        return BestFirstTree(rows="marginal", select=kv.get("select", "logq"), **ints)
    return BestFirstTree(rows=kv.get("rows", "auto"), select=kv.get("select", "logq"), **{"m": 4, "k": 4, **ints})


def validate_paths(paths) -> None:
    if not isinstance(paths, (list, tuple)) or not paths:
        raise ValueError("a tree path list must be a non-empty list of paths, e.g. [[0], [1], [0, 0]]")
    seen = set()
    for p in paths:
        if not isinstance(p, (list, tuple)) or not p:
            raise ValueError(f"malformed tree path {p!r}: each path is a non-empty list of child ranks")
        if not all(isinstance(r, (int, np.integer)) and not isinstance(r, bool) and r >= 0 for r in p):
            raise ValueError(f"malformed tree path {p!r}: ranks must be non-negative integers")
        t = tuple(int(r) for r in p)
        if t in seen:
            raise ValueError(f"malformed tree path list: {list(t)} appears twice")
        seen.add(t)
    for t in seen:
        if len(t) > 1 and t[:-1] not in seen:
            raise ValueError(f"malformed tree path list: {list(t)} has no parent path {list(t[:-1])}")
        if t[-1] > 0 and t[:-1] + (t[-1] - 1,) not in seen:
            raise ValueError(f"malformed tree path list: {list(t)} needs its elder sibling "
                             f"{list(t[:-1] + (t[-1] - 1,))} (ranks at a node must be 0, 1, 2, …)")


def chain(depth: int) -> StaticTree:
    return StaticTree(tuple(tuple([0] * d) for d in range(1, depth + 1)))


def is_chain(spec) -> bool:
    """A static tree with one node per depth."""
    return isinstance(spec, StaticTree) and spec.num_nodes == spec.max_depth + 1


def parse_tree_spec(spec: str | Sequence | TreeSpec) -> TreeSpec:
    """'chain=5', 'depth=6,topk=8,nodes=32' (dynamic), a JSON path list '[[0],[1],[0,0]]', or a
    best-first tree (block drafters): 'ddtree,nodes=16[,k=8,depth=8,select=logq|taps]' (marginal rows)
    or 'treeflash,nodes=16[,m=4,k=4,depth=8,rows=auto|markov|head,select=logq|taps]' (conditional)."""
    if isinstance(spec, (StaticTree, DynamicTree, BestFirstTree)):
        return spec
    if isinstance(spec, (list, tuple)):
        return StaticTree(tuple(tuple(int(r) for r in p) for p in _checked_paths(spec)))
    if not isinstance(spec, str):
        raise ValueError(f"tree spec must be a string, a path list or a TreeSpec, got {type(spec).__name__}")
    s = spec.strip()
    if s.startswith("["):
        try:
            paths = json.loads(s)
        except json.JSONDecodeError as e:
            raise ValueError(f"malformed tree path list {spec!r}: {e}") from None
        return parse_tree_spec(paths)
    head, _, rest = s.partition(",")
    if head in _BEST_FIRST_KEYS:
        return _parse_best_first(head, rest.split(",") if rest else [], spec)
    m = re.fullmatch(r"chain=(\d+)", s)
    if m:
        if int(m.group(1)) < 1:
            raise ValueError("chain length must be >= 1")
        return chain(int(m.group(1)))
    try:
        kv = dict(item.split("=") for item in s.split(","))
        if set(kv) != {"depth", "topk", "nodes"}:
            raise ValueError
        return DynamicTree(int(kv["depth"]), int(kv["topk"]), int(kv["nodes"]))
    except ValueError as e:
        if str(e):
            raise
        raise ValueError(f"malformed tree spec {spec!r}: expected 'chain=D', 'depth=D,topk=K,nodes=N', "
                         f"'ddtree,nodes=N', 'treeflash,nodes=N' or a JSON path list") from None


def _checked_paths(paths):
    validate_paths(paths)
    return paths
