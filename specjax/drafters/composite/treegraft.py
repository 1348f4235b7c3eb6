"""TreeGraft (design §6): several drafters of different cost build one tree per round, a scheduler picks
per row what each round drafts, as ONE composite drafter behind the ordinary protocol (the engine loop
does not know it is there). The Switch is one fixed policy of it.

Actions (`ACTIONS`), per round and row, each a padded tree within the verify budget N (the verify spec):
  cheap    the cheap drafter's own chain at the verify depth (the n-gram: its best match; a model
           drafter: the greedy path of its candidate tree);
  strong   the strong drafter's own tree from the root (`strong_tree`, the Switch's fallback);
  graft    the strong drafter rescores the cheap candidate tree (one `score` pass) and grafts its top
           tokens as leaves; the best N nodes are kept (`graft_tree`, non-destructive: SourceScores);
  recover  graft, plus a subtree the strong drafter grows `grow` levels deep from the best-ranked node
           of the rescored tree (the node with the most expected accepted tokens, (depth + 1) x its path
           probability under the strong drafter: the root when it trusts no cheap path): whole paths
           the cheap drafter never explored. Growth runs the strong drafter's `score` on the path to that
           node, a token at a time, so any drafter that can score grows exactly what it would draft
           from there (lm and feature: their own greedy continuation; a block drafter scores each node
           from its block and token, so its growth is its own Markov continuation);
  union    the cheap chain and the strong tree merged at the root (shared prefixes once).
Every action's work runs only when some active row takes it (`lax.cond`): the strong drafter's own
tree for strong / union, its scoring pass for graft / recover, the growth for recover. Verification
runs at the smallest compiled width that holds every row's tree (`verify_widths`: each action's node
count), so a cheap round costs a cheap round.

Policies (`POLICIES`, a traced setting: one compiled program for all): a fixed action; "switch" (the
cheap chain where the n-gram matched at least `min_match` tokens, the strong tree elsewhere: the
former Switch composite); "scheduler" (an MLP over `treegraft_scheduler.tree_features`, one value
per action, argmax over the actions this setup allows; a scheduler of the first layout, one output,
keeps its meaning: graft where it says invoke, the cheap tree ranked alone elsewhere); "always" /
"never" (graft with and without the strong drafter: TreeGraft before actions); "oracle" (evaluation
only, `labelled`: the action with the best goodput in hindsight, from the known greedy continuation).

Verification uses the deterministic-candidates rule (or greedy), lossless whatever drafter proposed
which child: sampled rules are refused (`check_tree`). `commit` commits both drafters every round,
so each cache stays current whether or not it drafted. Per-row counters (rounds per action, strong
invocations, accepted tokens per source: cheap, strong grafts / trees, recovered subtrees) ride in the
state; the engine returns them via `loop_stats`.

`labelled(...)` is the offline value system's view (train/value_system.py): every action is built
every round, its accepted length counted against the known greedy continuation, and one record per
round and row (features, accepted length and width of every action) kept in the state.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.io.checkpoint import weights_sha256
from specjax.drafters.composite import treegraft_scheduler as sched_lib
from specjax.spec import tree as tree_lib
from specjax.drafters.base import stat_sum, Committed, Composite, DraftContext, Drafter, Proposal
from specjax.spec.tree import TreeBuffers

ACTIONS = sched_lib.ACTIONS  # ("cheap", "strong", "graft", "recover", "union")
A_CHEAP, A_STRONG, A_GRAFT, A_RECOVER, A_UNION = range(len(ACTIONS))
POLICIES = ACTIONS + ("never", "always", "switch", "scheduler", "oracle")
CHEAP, STRONG, GROWN = 0, 1, 2  # TreeBuffers.source: cheap nodes, the strong drafter's (grafts, its tree), recovered
LOSSLESS_RULES = ("greedy", "deterministic")
SOURCES = ("cheap", "strong", "recovered")
COUNTERS = (("invoked", "grafted_proposed", "grafted_paths") + tuple(f"tokens_{s}" for s in SOURCES)
            + tuple(f"action_{a}" for a in ACTIONS))
NGRAM_MATCHES = 4  # the fewest matches in a matches drafter's default cheap trie (`TreeGraft.plan`)


class Setting(nnx.Variable):
    """A traced TreeGraft setting (policy, calibration, the value system's tables): no recompilation."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SourceScores:
    """Per-source path scores of a multi-drafter tree, kept side by side: nothing one drafter said
    overwrites another's. Values are cumulative log q from the root; 0 where absent."""
    cheap: Any  # the cheap drafter's, on the nodes it proposed
    strong: Any  # the strong drafter's, on the nodes it scored, grafted or grew
    has_cheap: Any
    has_strong: Any
    origin: Any  # index of the node in the candidate pool (cheap tree, then grafts, then grown)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Grown:
    """The recover action's subtree: a chain of the strong drafter's tokens under node `start` of the
    cheap tree (its cumulative log q from the root in `score`)."""
    tokens: Any  # int32 [B, L]
    start: Any  # int32 [B]
    score: Any  # f32 [B, L]
    valid: Any  # bool [B, L]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RoundInfo:
    """What `propose` decided this round, for `commit`'s statistics and the value system."""
    tree: TreeBuffers  # [B, N] the verified tree
    scores: SourceScores  # its graft / recover nodes' per-source path scores
    action: Any  # int32 [B]
    invoked: Any  # bool [B]: the strong drafter ran for this row (its tree, a scoring pass or growth)
    features: Any  # [B, F] scheduler features
    n_grafted: Any  # int [B]: strong-drafter nodes in the verified tree
    calib_sum: Any  # f32 [B]: sum over the cheap tree's scored nodes of (strong - cheap) local log q
    calib_n: Any  # f32 [B]: how many nodes that sum covers
    record: Any = None  # f32 [B, K] (labelled): features, accepted length and width of every action


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GraftState:
    cheap: Any
    strong: Any
    tau_ema: Any  # f32 [B]
    last_accepted: Any  # int32 [B]
    acc_ema: Any  # f32 [B, 2]: recent accepted tokens from cheap and from strong-drafter nodes
    last_action: Any  # int32 [B]
    generated: Any  # int32 [B]: tokens emitted so far (the root of this round is the last)
    counters: dict  # name -> int32 [B]
    records: Any = None  # f32 [B, R, K] (labelled)
    pending: RoundInfo | None = None  # set by propose, consumed by commit


# ----------------------------------------------------------------------------- tree functions

def graft_tree(cheap: TreeBuffers, strong_local, top_tok, top_lq, use_B, *, num_nodes: int, max_depth: int,
               graft_nodes: int, calibration=0.0, grown=None):
    """Rescore, graft and select (steps 4-6 of the module docstring), a pure function.

    cheap: the cheap drafter's candidate tree [B, M] (score = its cumulative log q);
    strong_local: [B, M] the strong drafter's log q of each node's token given its parent;
    top_tok, top_lq: [B, M, k] the strong drafter's top-k tokens and log q at each node;
    use_B: bool [B], rows where the strong drafter ran (elsewhere its inputs are ignored);
    grown: None, or the recover action's subtree (`Grown`): a chain of the strong drafter's own tokens
      under one node of the cheap tree, ranked with that node (kept before the shallower grafts).
    Returns (TreeBuffers [B, num_nodes], SourceScores [B, num_nodes], grafted nodes kept [B]).
    """
    B, M = cheap.tokens.shape
    N, D, G = num_nodes, max_depth, graft_nodes
    k = top_tok.shape[-1]
    cheap = tree_lib.well_formed(cheap, cheap.tokens[:, 0], D)
    valid = cheap.valid
    root = jnp.arange(M)[None] == 0
    use = use_B[:, None]
    strong_cum = tree_lib.path_sum(jnp.where(root, 0.0, strong_local.astype(jnp.float32)), cheap.parents, D)
    rank = jnp.where(use, strong_cum, cheap.score + jnp.where(cheap.depth > 0, calibration * cheap.depth, 0.0))
    rank = jnp.where(valid, tree_lib.path_min(rank, cheap.parents, D), -jnp.inf)

    L = 0 if grown is None else grown.tokens.shape[1]
    if L:
        # The grown chain follows the cheap tree while its tokens are there (a grown token that is already a
        # child is that child: siblings stay distinct), then hangs new nodes (pool M+G+i) under the last.
        par, inside = grown.start.astype(jnp.int32), jnp.ones((B,), bool)
        gr_par, gr_new, gr_rank = [], [], []
        r = jnp.take_along_axis(rank, grown.start[:, None], axis=1)[:, 0]
        for i in range(L):
            t = grown.tokens[:, i]
            hit = valid & (cheap.parents == par[:, None]) & (cheap.tokens == t[:, None]) & inside[:, None]
            dup = hit.any(1)
            child = jnp.argmax(hit, axis=1).astype(jnp.int32)
            gr_par.append(par)
            gr_new.append(~dup)
            r = jnp.where(dup, jnp.minimum(r, jnp.take_along_axis(rank, child[:, None], axis=1)[:, 0]), r)
            gr_rank.append(r)
            par = jnp.where(dup, child, M + G + i).astype(jnp.int32)
            inside = inside & dup
        gr_par, gr_new, gr_rank = jnp.stack(gr_par, 1), jnp.stack(gr_new, 1), jnp.stack(gr_rank, 1)
    if G > 0:
        # is_child[b, u, j]: the strong top token j at node u is already a child of u
        kid = valid[:, None, None, :] & (cheap.parents[:, None, None, :] == jnp.arange(M)[None, :, None, None])
        is_child = jnp.any(kid & (cheap.tokens[:, None, None, :] == top_tok[..., None]), axis=-1)  # [B, M, k]
        ok = use[..., None] & valid[..., None] & (cheap.depth < D)[..., None] & ~is_child & jnp.isfinite(top_lq)
        for i in range(L):  # nor a token the grown chain puts under that node
            at = (jnp.arange(M)[None, :, None] == gr_par[:, i, None, None]) & (gr_par[:, i] < M)[:, None, None]
            ok &= ~(at & (top_tok == grown.tokens[:, i, None, None]) & (gr_new[:, i] & grown.valid[:, i])[:, None, None])
        cand = jnp.where(ok, strong_cum[..., None] + top_lq, -jnp.inf).reshape(B, M * k)
        g_score, g_idx = jax.lax.top_k(cand, G)
        g_par = (g_idx // k).astype(jnp.int32)
        g_tok = jnp.take_along_axis(top_tok.reshape(B, M * k), g_idx, axis=1).astype(jnp.int32)
        g_depth = jnp.take_along_axis(cheap.depth, g_par, axis=1) + 1
        g_valid = jnp.isfinite(g_score)
        g_rank = jnp.minimum(g_score, jnp.take_along_axis(rank, g_par, axis=1))
    else:
        g_score = g_rank = jnp.zeros((B, 0), jnp.float32)
        g_par = g_tok = g_depth = jnp.zeros((B, 0), jnp.int32)
        g_valid = jnp.zeros((B, 0), bool)
    if L:  # the grown chain's new nodes, after the grafts
        gr_valid = grown.valid & use & gr_new
        g_tok = jnp.concatenate([g_tok, grown.tokens.astype(jnp.int32)], axis=1)
        g_par = jnp.concatenate([g_par, gr_par], axis=1)
        g_depth = jnp.concatenate([g_depth, jnp.take_along_axis(cheap.depth, grown.start[:, None], axis=1)
                                   + 1 + jnp.arange(L)[None]], axis=1)
        g_valid = jnp.concatenate([g_valid, gr_valid], axis=1)
        g_score = jnp.concatenate([g_score, jnp.where(gr_valid, grown.score, -jnp.inf)], axis=1)
        g_rank = jnp.concatenate([g_rank, jnp.where(gr_valid, gr_rank, -jnp.inf)], axis=1)
    pad = max(N - (M + G + L), 0)  # a pool smaller than the budget is padded with invalid nodes
    cat = lambda a, b, fill: jnp.concatenate([a, b, jnp.full((B, pad), fill, a.dtype)], axis=1)
    p_valid = cat(valid, g_valid, False)
    p_rank = cat(rank, g_rank, -jnp.inf)
    tree, keep = tree_lib.select_nodes(
        cat(cheap.tokens.astype(jnp.int32), g_tok, 0), cat(cheap.parents, g_par, -1),
        cat(cheap.depth, g_depth, 0), p_rank, N, valid=p_valid,
        source=cat(cheap.source.astype(jnp.int8), jnp.concatenate(
            [jnp.full((B, G), STRONG, jnp.int8), jnp.full((B, L), GROWN, jnp.int8)], axis=1), CHEAP))
    gather = lambda x: jnp.take_along_axis(x, keep, axis=1)
    has_cheap = cat(valid, jnp.zeros((B, G + L), bool), False)
    has_strong = cat(valid & use, g_valid, False)
    scores = SourceScores(
        cheap=gather(jnp.where(has_cheap, cat(cheap.score, jnp.zeros((B, G + L)), 0.0), 0.0)),
        strong=gather(jnp.where(has_strong, cat(strong_cum, g_score, 0.0), 0.0)),
        has_cheap=gather(has_cheap) & tree.valid, has_strong=gather(has_strong) & tree.valid, origin=keep)
    n_grafted = jnp.sum(tree.valid & (tree.source != CHEAP), axis=1).astype(jnp.int32)
    return tree, scores, n_grafted




def greedy_path(tree: TreeBuffers, max_depth: int) -> TreeBuffers:
    """The chain [B, D+1] that follows, from the root, the best-scored valid child at each depth (a
    model drafter's own greedy chain inside its candidate tree); invalid past its last node."""
    B, M = tree.tokens.shape
    cur = jnp.zeros((B,), jnp.int32)
    alive = jnp.ones((B,), bool)
    toks, scores, valid = [tree.tokens[:, 0]], [jnp.zeros((B,), jnp.float32)], [jnp.ones((B,), bool)]
    for _ in range(max_depth):
        kids = tree.valid & (tree.parents == cur[:, None]) & jnp.isfinite(tree.score)
        best = jnp.argmax(jnp.where(kids, tree.score, -jnp.inf), axis=1)
        alive = alive & kids.any(1)
        cur = jnp.where(alive, best, cur).astype(jnp.int32)
        toks.append(jnp.take_along_axis(tree.tokens, cur[:, None], axis=1)[:, 0])
        scores.append(jnp.where(alive, jnp.take_along_axis(tree.score, cur[:, None], axis=1)[:, 0], -jnp.inf))
        valid.append(alive)
    chain = tree_lib.chain_tree(tree.tokens[:, 0], jnp.stack(toks[1:], 1).astype(jnp.int32))
    return dataclasses.replace(chain, valid=jnp.stack(valid, 1), score=jnp.stack(scores, 1).astype(jnp.float32),
                               source=jnp.full(chain.tokens.shape, CHEAP, jnp.int8))


def union_tree(chain: TreeBuffers, strong: TreeBuffers, strong_nodes: int) -> TreeBuffers:
    """The cheap chain [B, D+1] and the first `strong_nodes` nodes of the strong tree merged at the
    root: [B, D + strong_nodes]. A strong node whose path from the root equals the chain's is the
    chain's node (it is dropped, its children hang under the chain's node), so siblings stay distinct."""
    B, C = chain.tokens.shape
    D = C - 1
    S = strong_nodes
    par_s = strong.parents[:, :S]
    dup = [jnp.ones((B,), bool)]  # the root is shared
    new_par = [jnp.full((B,), -1, jnp.int32)]
    for i in range(1, S):
        p = jnp.maximum(par_s[:, i], 0)
        d = strong.depth[:, i]
        p_dup = jnp.take_along_axis(jnp.stack(dup + [jnp.zeros((B,), bool)] * (S - i), 1), p[:, None], axis=1)[:, 0]
        same = (jnp.take_along_axis(chain.tokens, jnp.minimum(d, D)[:, None], axis=1)[:, 0] == strong.tokens[:, i]) \
            & jnp.take_along_axis(chain.valid, jnp.minimum(d, D)[:, None], axis=1)[:, 0] & (d <= D)
        dup.append(p_dup & same & strong.valid[:, i])
        # under a dropped node: the chain's node of the parent's depth; else the parent's place after the chain
        new_par.append(jnp.where(p_dup, jnp.minimum(d - 1, D), D + p).astype(jnp.int32))
    dup_s = jnp.stack(dup, 1)[:, 1:]
    cat = lambda a, b: jnp.concatenate([a, b], axis=1)
    return TreeBuffers(tokens=cat(chain.tokens, strong.tokens[:, 1:S]).astype(jnp.int32),
                       parents=cat(chain.parents, jnp.stack(new_par, 1)[:, 1:]).astype(jnp.int32),
                       depth=cat(chain.depth, strong.depth[:, 1:S]),
                       valid=cat(chain.valid, strong.valid[:, 1:S] & ~dup_s),
                       score=cat(chain.score, strong.score[:, 1:S]).astype(jnp.float32),
                       source=cat(jnp.full((B, C), CHEAP, jnp.int8), jnp.full((B, S - 1), STRONG, jnp.int8)))


def accepted_length(tree: TreeBuffers, future_BxD, max_depth: int):
    """Tokens greedy verification accepts from `tree` when the target's continuation after the root is
    `future_BxD` (-1: unknown): the depth of the deepest valid node whose path matches it."""
    d = jnp.clip(tree.depth - 1, 0, future_BxD.shape[1] - 1)
    ok = tree.valid & (tree.depth > 0) & (tree.tokens == jnp.take_along_axis(future_BxD, d, axis=1))
    ok = ok | (jnp.arange(tree.tokens.shape[1])[None] == 0)
    ok = tree_lib.path_min(ok.astype(jnp.float32), tree.parents, max_depth) > 0
    return jnp.max(jnp.where(ok, tree.depth, 0), axis=1).astype(jnp.int32)


def last_width(tree: TreeBuffers):
    """Nodes up to the last valid one, root included: the width a row's tree needs verified."""
    N = tree.tokens.shape[1]
    return (jnp.max(jnp.where(tree.valid, jnp.arange(N)[None], 0), axis=1) + 1).astype(jnp.int32)


def sources_on_path(tree: TreeBuffers, committed: Committed):
    """Accepted tokens per source [B, 3] (cheap, strong, recovered), from the committed tokens."""
    on, _ = tree_lib.accepted_nodes(tree, committed.tokens, committed.count)
    on = on & (jnp.arange(tree.tokens.shape[1])[None] > 0)
    return jnp.stack([jnp.sum(on & (tree.source == s), axis=1) for s in (CHEAP, STRONG, GROWN)], 1).astype(jnp.int32)


# ----------------------------------------------------------------------------- the composite drafter

@dataclasses.dataclass(frozen=True)
class Plan:
    """What a verify spec makes of the actions (host side, static)."""
    cheap_spec: Any  # the cheap drafter's candidate tree
    M: int  # its nodes
    G: int  # graft slots
    k: int  # the strong drafter's top tokens per node
    chain_depth: int  # the cheap chain's depth
    strong_spec: Any  # the strong drafter's own tree
    strong_nodes: int
    union_nodes: int
    available: tuple  # bool per action
    per_depth: int  # the most valid nodes of the cheap tree at one depth (the strong drafter's scoring passes)


class TreeGraft(Composite):
    """A cheap and a strong drafter (cheapest first) drafting one tree per round; see the module docstring.

    policy: an action, "switch", "scheduler", "always", "never" (POLICIES);
    scheduler: a `treegraft_scheduler.Scheduler` (policy "scheduler");
    cheap_tree: the cheap drafter's candidate tree for graft / recover (default: a dynamic tree of ~2N
      nodes at the verify depth; for n-gram, a trie of max(4, ceil(N/D)) matches at the verify depth);
    strong_tree: the strong drafter's own tree for strong / union (default: its default tree, or a chain at the
      verify depth where that does not fit);
    graft_nodes: grafted candidates per round, at most N-1 (default: min(N-1, M*graft_topk));
    graft_topk: the strong drafter's top tokens considered at each node;
    grow: recover's subtree depth (tokens the strong drafter grows from the best node);
    min_match: the switch policy's n-gram length from which the cheap chain is trusted;
    calibration: per-token log-prob offset added to cheap-only paths' scores (fit offline);
    tau_decay: the EMA decay of the scheduler's recent-acceptance features.
    """
    name = "treegraft"
    PARTS = ("cheap", "strong")
    PRIMARY = "strong"  # its default tree and tree resolution

    def __init__(self, cheap, strong, *, scheduler: sched_lib.Scheduler | None = None, policy: str = "always",
                 calibration: float = 0.0, cheap_tree=None, strong_tree=None, graft_nodes: int | None = None,
                 graft_topk: int = 2, grow: int = 3, min_match: int = 3, tau_decay: float = 0.7, label=None):
        if not (isinstance(cheap, Drafter) and isinstance(strong, Drafter)):
            raise ValueError("TreeGraft combines two drafters (specjax.drafters.Drafter): a cheap one, then a strong one")
        if isinstance(cheap, TreeGraft) or isinstance(strong, TreeGraft):
            raise ValueError("TreeGraft combines two plain drafters (cheap, strong), not another TreeGraft")
        if strong.drafts_matches:
            raise ValueError(f"TreeGraft's strong drafter must be a model drafter (lm, feature, mtp, block), not "
                             f"{strong.name!r}: copied matches are the cheap drafter's")
        for d in (cheap, strong):
            if d.reads_own_tree:
                raise ValueError(f"the {d.name!r} drafter (DPara) commits against the tree it proposed itself, which "
                                 "TreeGraft replaces or skips on other rounds: use it on its own")
            if type(d).prepare is not Drafter.prepare:  # e.g. the adaptive shape, a composite itself
                raise ValueError(f"TreeGraft combines drafters whose state needs no per-tree sizing; the {d.name!r} "
                                 "drafter has its own prepare hook (wrap the plain drafter instead)")
        vc, vs = cheap.vocab_size, strong.vocab_size
        if vc is not None and vs is not None and vc != vs:
            raise ValueError(f"TreeGraft drafters must share one vocabulary: the cheap {cheap.name!r} drafter has "
                             f"{vc} tokens, the strong {strong.name!r} drafter {vs}")
        if policy not in POLICIES:
            raise ValueError(f"unknown TreeGraft policy {policy!r}; choose from {', '.join(POLICIES)}")
        if policy == "scheduler" and scheduler is None:
            raise ValueError("TreeGraft policy 'scheduler' needs a scheduler (load one with "
                             "specjax.drafters.composite.treegraft_scheduler.load_scheduler)")
        self.matches = bool(cheap.drafts_matches and hasattr(cheap, "match_length"))
        longest = getattr(cheap, "max_ngram", None)
        if policy == "switch" and not self.matches:
            raise ValueError(f"the switch policy reads the cheap drafter's match length: its cheap drafter must draft "
                             f"copied matches and say how long they are (ngram); the {cheap.name!r} drafter does not")
        if int(min_match) < 1 or (longest is not None and int(min_match) > longest):
            raise ValueError(f"min_match must be an n-gram length in 1..{longest or 'the longest n-gram'} (the "
                             f"{cheap.name!r} drafter matches no longer n-grams), got {min_match}")
        if policy in ("graft", "recover", "always") and not strong.can_score:
            raise ValueError(f"the {strong.name!r} drafter cannot score another drafter's tree, so it cannot graft or "
                             "recover; give it the actions cheap, strong or union (or policy switch)")
        if int(graft_topk) != graft_topk or graft_topk < 0:
            raise ValueError(f"graft_topk must be a non-negative integer, got {graft_topk}")
        if graft_nodes is not None and (int(graft_nodes) != graft_nodes or graft_nodes < 0):
            raise ValueError(f"graft_nodes must be a non-negative integer, got {graft_nodes}")
        if int(grow) != grow or grow < 1:
            raise ValueError(f"grow must be a positive integer (tokens the strong drafter grows), got {grow}")
        if not 0.0 <= tau_decay < 1.0:
            raise ValueError(f"tau_decay must be in [0, 1), got {tau_decay}")
        if not np.isfinite(calibration):
            raise ValueError(f"calibration must be a finite per-token log-prob offset, got {calibration} (a scheduler "
                             "fitted before this check with a reduced-vocabulary drafter: re-distil it)")
        scheduler = scheduler if scheduler is not None else sched_lib.Scheduler()
        sched_lib.check_layout(scheduler.config.feature_layout, scheduler.config.feature_names, "TreeGraft scheduler")
        self.cheap = cheap
        self.strong = strong
        self.scheduler = scheduler
        self.policy_code = Setting(jnp.int32(POLICIES.index(policy)))
        self.calibration = Setting(jnp.float32(calibration))
        self.cheap_tree = None if cheap_tree is None else tree_lib.parse_tree_spec(cheap_tree)
        self.strong_tree = tree_lib.parse_tree_spec(strong_tree) if isinstance(strong_tree, str) else strong_tree
        self.graft_nodes = None if graft_nodes is None else int(graft_nodes)
        self.graft_topk = int(graft_topk)
        self.grow = int(grow)
        self.min_match = int(min_match)
        self.tau_decay = float(tau_decay)
        self.label = label  # None, or a `Labels` (the value system's and the oracle's view)
        if policy == "oracle":
            self._check_oracle()

    # -- configuration (host side)

    def settings(self) -> dict:
        return dict(scheduler=self.scheduler, policy=self.policy, calibration=float(self.calibration.get_value()),
                    cheap_tree=self.cheap_tree, strong_tree=self.strong_tree, graft_nodes=self.graft_nodes,
                    graft_topk=self.graft_topk, grow=self.grow, min_match=self.min_match, tau_decay=self.tau_decay,
                    label=self.label)

    def rebuild(self, cheap, strong) -> "TreeGraft":
        return TreeGraft(cheap, strong, **self.settings())

    def labelled(self, future_BxT, *, rounds: int, draft_s, verify_s, widths, lam: float) -> "TreeGraft":
        """This TreeGraft as the offline value system sees it: every action built every round, each one's
        accepted length counted against `future_BxT` (the target's greedy output of each row, -1 past
        its end), a record per round kept (`records` in `loop_stats`), and the policy "oracle" allowed: per
        row, the action of the best (accepted + 1) - lam x cost, cost = draft_s[action] + verify_s[the
        action's width among `widths`] (seconds, profiled on the machine)."""
        if len(draft_s) != len(ACTIONS) or len(verify_s) != len(widths):
            raise ValueError(f"labelled: draft_s needs one cost per action ({len(ACTIONS)}), verify_s one per width")
        lab = Labels(rounds=int(rounds), widths=tuple(int(w) for w in widths))
        tg = TreeGraft(self.cheap, self.strong, **{**self.settings(), "label": lab})
        tg.future = Setting(jnp.asarray(future_BxT, jnp.int32))
        tg.draft_s = Setting(jnp.asarray(draft_s, jnp.float32))
        tg.verify_s = Setting(jnp.asarray(verify_s, jnp.float32))
        tg.lam = Setting(jnp.float32(lam))
        return tg

    def _check_oracle(self):
        if self.label is None:
            raise ValueError("the oracle policy knows the target's continuation: it exists only in the evaluation "
                             "(TreeGraft.labelled, train/value_system.py)")

    @property
    def policy(self) -> str:
        return POLICIES[int(self.policy_code.get_value())]

    def set_policy(self, policy: str) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown TreeGraft policy {policy!r}; choose from {', '.join(POLICIES)}")
        if policy == "oracle":
            self._check_oracle()
        self.policy_code.set_value(jnp.int32(POLICIES.index(policy)))

    def plan(self, spec) -> Plan:
        """The actions' trees for a verify spec. Raises ValueError where they do not fit together."""
        N, D = spec.num_nodes, spec.max_depth
        cspec = self.cheap_tree
        matches = self.cheap.drafts_matches
        if cspec is None:
            if matches:
                # A trie of the best matches, not the best match's chain alone: candidates the strong
                # drafter's scores choose among. k chains under the root bound a trie of k matches
                # (`ngram.branches_of`), k*D+1 nodes with no merging: enough to fill the verify budget
                # and more (at least 4), no slot beyond what k matches can fill. A path list, not a
                # dynamic spec: nothing is expanded by q.
                k = max(NGRAM_MATCHES, -(-N // D))
                cspec = tree_lib.StaticTree(tuple((i,) + (0,) * j for i in range(k) for j in range(D)))
            else:
                k = spec.topk if isinstance(spec, tree_lib.DynamicTree) else 4
                while 1 + k + (D - 1) * k * k < N + 2:
                    k += 1
                pool = 1 + k + (D - 1) * k * k
                cspec = tree_lib.DynamicTree(D, k, min(2 * N, pool))
        M = cspec.num_nodes
        if cspec.max_depth > D:
            raise ValueError(f"TreeGraft's cheap tree reaches depth {cspec.max_depth} but the verify tree only "
                             f"{D}: use a cheap tree no deeper than the verify tree")
        if not matches and M <= N:
            raise ValueError(f"TreeGraft's cheap tree ({M} nodes) must be larger than the verify budget ({N} nodes): "
                             "the strong drafter's scores choose among more candidates than are verified")
        k = self.graft_topk
        G = min(N - 1, M * k) if self.graft_nodes is None else self.graft_nodes
        if G > N - 1:
            raise ValueError(f"graft budget {G} does not fit the verify tree: at most N-1 = {N - 1} grafted nodes "
                             f"can be verified (tree of {N} nodes)")
        if G > M * k:
            raise ValueError(f"graft budget {G} does not fit the cheap tree: its {M} nodes offer at most "
                             f"{M} x graft_topk {k} = {M * k} graft candidates")
        V = self.vocab_size
        if V is not None and k > V:
            raise ValueError(f"graft_topk {k} exceeds the vocabulary ({V})")
        chain_depth = D if matches else cspec.max_depth
        given = self.strong_tree
        sspec = self.strong.resolve_tree(given if given is not None else tree_lib.parse_tree_spec(self.strong.default_tree))
        if given is None and (sspec.num_nodes > N or sspec.max_depth > D):  # its default does not fit: a chain that does
            sspec = self.strong.resolve_tree(tree_lib.parse_tree_spec(f"chain={min(D, N - 1)}"))
        if sspec.num_nodes > N or sspec.max_depth > D:
            raise ValueError(f"TreeGraft's strong tree ({sspec.num_nodes} nodes, depth {sspec.max_depth}) must fit the "
                             f"verify tree ({N} nodes, depth {D}): give a larger verify tree")
        S = sspec.num_nodes
        union = chain_depth + S
        can = self.strong.can_score
        available = (True, True, can, can, union <= N)
        if isinstance(cspec, tree_lib.DynamicTree):  # depth 1: topk nodes; deeper: topk children of topk frontier nodes
            per_depth = min(M - 1, cspec.topk * cspec.topk)
        else:
            per_depth = int(np.bincount(cspec.layout()[1]).max())
        return Plan(cspec, M, G, k, chain_depth, sspec, S, union, available, per_depth)

    def check_tree(self, spec, rule: str) -> int:
        """Engine hook, on the host before tracing: refuses sampled rules and a bad plan; returns the
        scratch slots the drafters need past their committed caches."""
        if isinstance(spec, tree_lib.BestFirstTree):
            raise ValueError("TreeGraft verifies a chain, a path list or a dynamic tree; a best-first tree (ddtree / "
                             "treeflash) is a block drafter's own (pass the block drafter alone)")
        if rule not in LOSSLESS_RULES:
            raise ValueError(f"TreeGraft verifies trees whose nodes come from two drafters, one of which may have no q: "
                             f"it needs the deterministic-candidates rule (verify='deterministic', or greedy at "
                             f"temperature 0), not {rule!r}")
        p = self.plan(spec)
        fixed = self.policy
        if fixed in ACTIONS and not p.available[ACTIONS.index(fixed)]:
            raise ValueError(f"TreeGraft's {fixed!r} action does not fit this setup: the cheap chain and the strong "
                             f"tree together take {p.union_nodes} nodes, the verify tree has {spec.num_nodes}")
        own = [self.cheap.check_tree(p.cheap_spec, rule), self.strong.check_tree(p.strong_spec, rule)]
        if self.strong.can_score:
            own.append(self.strong.check_tree(p.cheap_spec, rule))
        evaluated = p.cheap_spec.pool_size if isinstance(p.cheap_spec, tree_lib.DynamicTree) else p.M
        s_eval = p.strong_spec.pool_size if isinstance(p.strong_spec, tree_lib.DynamicTree) else p.strong_nodes
        # the strong drafter's passes write up to per_depth slots past the cheap tree's, and growth a chain past D + 1
        return max(evaluated, p.M + p.per_depth, spec.num_nodes, s_eval, p.chain_depth + 2, *own)

    def verify_widths(self, spec) -> tuple[int, ...]:
        """Each action's node count (the cheap chain, the strong tree, the union where it fits) and the
        whole budget (graft, recover): a round whose rows all take a small action verifies it only."""
        p = self.plan(spec)
        ws = {p.chain_depth + 1, spec.num_nodes}
        ws |= set(w for w in self.strong.verify_widths(p.strong_spec) if w <= spec.num_nodes)
        if p.available[A_UNION]:
            ws.add(p.union_nodes)
        return tuple(sorted(ws))

    # -- the protocol (traced)

    def init(self, prompt_BxP, lengths_B, capacity, target_out) -> GraftState:
        B = prompt_BxP.shape[0]
        lab = self.label
        return GraftState(
            cheap=self.cheap.init(prompt_BxP, lengths_B, capacity, self.part_out(target_out, self.cheap)),
            strong=self.strong.init(prompt_BxP, lengths_B, capacity, self.part_out(target_out, self.strong)),
            tau_ema=jnp.ones((B,), jnp.float32), last_accepted=jnp.zeros((B,), jnp.int32),
            acc_ema=jnp.zeros((B, 2), jnp.float32), last_action=jnp.full((B,), A_CHEAP, jnp.int32),
            generated=jnp.ones((B,), jnp.int32),
            counters={c: jnp.zeros((B,), jnp.int32) for c in COUNTERS},
            records=None if lab is None else jnp.zeros((B, lab.rounds, record_size()), jnp.float32))

    def _strong_pass(self, sstate, ctree: TreeBuffers, depth: int, k: int, per_depth: int):
        lq = self.strong.score(sstate, ctree, depth, per_depth=per_depth)  # [B, M, V]
        B, M = ctree.tokens.shape
        par = jnp.maximum(ctree.parents, 0)
        local = lq[jnp.arange(B)[:, None], par, ctree.tokens]
        local = jnp.where(ctree.parents >= 0, local, 0.0).astype(jnp.float32)
        if k == 0:
            return local, jnp.zeros((B, M, 0), jnp.int32), jnp.zeros((B, M, 0), jnp.float32)
        top_lq, top_tok = jax.lax.top_k(lq, k)
        return local, top_tok.astype(jnp.int32), top_lq.astype(jnp.float32)

    def _grow(self, sstate, ctree: TreeBuffers, strong_cum, D: int) -> Grown:
        """The recover action's subtree: from the node of the most expected accepted tokens, (depth + 1)
        x exp(strong path score) (the root: 1), `grow` tokens of the strong drafter's own greedy chain,
        each from a `score` pass over the path so far (a chain of D + 1 nodes)."""
        B, M = ctree.tokens.shape
        L = self.grow
        ok = ctree.valid & (ctree.depth < D) & jnp.isfinite(strong_cum)
        gain = jnp.where(ok, (ctree.depth + 1) * jnp.exp(jnp.minimum(strong_cum, 0.0)), -1.0)
        start = jnp.argmax(gain.at[:, 0].set(1.0), axis=1).astype(jnp.int32)
        d0 = jnp.take_along_axis(ctree.depth, start[:, None], axis=1)[:, 0]
        path = tree_lib.path_to(ctree, start, D)  # [B, D+1]
        idx = jnp.arange(D + 1)[None]
        toks = jnp.where(idx <= d0[:, None], jnp.take_along_axis(ctree.tokens, path, axis=1), 0).astype(jnp.int32)
        chain = tree_lib.chain_tree(toks[:, 0], toks[:, 1:])

        def step(i, carry):
            toks, lqs = carry
            t = dataclasses.replace(chain, tokens=toks)
            lq = self.strong.score(sstate, t, D, per_depth=1)  # [B, D+1, V]: a chain, one node per depth
            at = jnp.minimum(d0 + i, D)  # the node the i-th grown token hangs under
            row = jnp.take_along_axis(lq, at[:, None, None], axis=1)[:, 0]
            tok = jnp.argmax(row, axis=-1).astype(jnp.int32)
            put = (idx == (at + 1)[:, None]) & (d0 + i < D)[:, None]
            toks = jnp.where(put, tok[:, None], toks)
            lqs = lqs.at[:, i].set(jnp.take_along_axis(row, tok[:, None], axis=1)[:, 0].astype(jnp.float32))
            return toks, lqs

        toks, lqs = jax.lax.fori_loop(0, L, step, (toks, jnp.zeros((B, L), jnp.float32)))
        depth_i = d0[:, None] + 1 + jnp.arange(L)[None]
        grown_tok = jnp.take_along_axis(toks, jnp.minimum(depth_i, D), axis=1)
        base = jnp.take_along_axis(strong_cum, start[:, None], axis=1)
        return Grown(tokens=grown_tok, start=start, score=base + jnp.cumsum(lqs, axis=1), valid=depth_i <= D)

    def features(self, ctree, N, state: GraftState, match_B, active_B):
        """[B, NUM_FEATURES] (treegraft_scheduler.FEATURE_NAMES): the cheap tree's, then the n-gram match
        length, its distinct continuations, recent acceptance per source, the last action, active rows."""
        base = sched_lib.tree_features(ctree, N, state.tau_ema, state.last_accepted)
        M = ctree.tokens.shape[1]
        has_kid = jnp.any((ctree.parents[:, None, :] == jnp.arange(M)[None, :, None]) & ctree.valid[:, None, :], axis=2)
        leaves = jnp.sum(ctree.valid & ~has_kid & (jnp.arange(M)[None] > 0), axis=1)
        return sched_lib.extra_features(base, match_B, leaves, state.acc_ema, state.last_action, active_B)

    def propose(self, state: GraftState, root_B, ctx: DraftContext) -> Proposal:
        if ctx.mode != "topk":
            raise ValueError("TreeGraft proposes deterministic candidates only (see check_tree)")
        spec = ctx.spec
        N, D = spec.num_nodes, spec.max_depth
        p = self.plan(spec)
        B = root_B.shape[0]
        active = jnp.ones((B,), bool) if ctx.active is None else ctx.active
        lab = self.label
        cp = self.cheap.propose(state.cheap, root_B, DraftContext(p.cheap_spec, "topk", ctx.params, ctx.key,
                                                                   active=active))
        ctree = tree_lib.well_formed(cp.tree, root_B, p.cheap_spec.max_depth)
        if self.matches:  # the n-gram's own chain (free), and how long a match it copies
            chain = self.cheap.propose(state.cheap, root_B, DraftContext(tree_lib.parse_tree_spec(f"chain={D}"), "topk", ctx.params,
                                                                         ctx.key, active=active)).tree
            chain = dataclasses.replace(chain, source=jnp.full(chain.tokens.shape, CHEAP, jnp.int8))
            match = self.cheap.match_length(state.cheap, root_B).astype(jnp.int32)
        else:
            chain = greedy_path(ctree, p.chain_depth)
            match = jnp.zeros((B,), jnp.int32)
        features = self.features(ctree, N, state, match, active)
        avail = jnp.asarray(p.available)
        code = self.policy_code.get_value()
        pol = lambda name: code == POLICIES.index(name)
        sched = self.scheduler
        if sched.config.actions:  # one value per action: argmax over the available ones
            sched_action = jnp.argmax(jnp.where(avail[None], sched.values(features), -jnp.inf), axis=1)
            sched_use = jnp.ones((B,), bool)
        else:  # the first layout's scheduler: invoke (graft) or not (the cheap tree ranked alone)
            sched_action = jnp.full((B,), A_GRAFT)
            sched_use = sched.decide(features[:, :len(sched.config.feature_names)])
        switch_action = jnp.where(match >= self.min_match, A_CHEAP, A_STRONG)
        action = jnp.where(pol("scheduler"), sched_action,
                           jnp.where(pol("switch"), switch_action,
                                     jnp.where(pol("never") | pol("always"), A_GRAFT,
                                               jnp.minimum(code, len(ACTIONS) - 1)))).astype(jnp.int32)
        use = jnp.where(pol("scheduler"), sched_use, ~pol("never"))  # graft rows: the strong drafter rescores

        def need(*acts):  # some active row takes one of `acts` (the value system builds every action)
            if lab is not None:
                return jnp.bool_(True)
            return jnp.any(active & jnp.isin(action, jnp.asarray(acts)) & (use | ~jnp.isin(action, jnp.asarray(
                (A_GRAFT, A_RECOVER)))))

        # the strong drafter's own tree (strong, union)
        sctx = DraftContext(p.strong_spec, ctx.mode, ctx.params, ctx.key,
                            active=active if lab is not None else active & jnp.isin(action, jnp.asarray((A_STRONG, A_UNION))))

        def draft():
            q = self.strong.propose(state.strong, root_B, sctx)
            return tree_lib.pad_nodes(q.tree, N), q.state

        def skip_draft():
            empty = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(draft)[0])
            return dataclasses.replace(empty, valid=jnp.zeros_like(empty.valid)), state.strong

        stree, sstate = jax.lax.cond(need(A_STRONG, A_UNION), draft, skip_draft)
        stree = dataclasses.replace(stree, source=jnp.where(stree.valid, STRONG, CHEAP).astype(jnp.int8))

        # graft / recover: the scoring pass over the cheap candidate tree, the growth, the selection; all of
        # it skipped when no active row grafts or recovers (the strong pass alone also when none invokes it)
        M, k = p.M, p.k
        graft_rows = use & jnp.isin(action, jnp.asarray((A_GRAFT, A_RECOVER)))
        if lab is not None:
            graft_rows = jnp.ones((B,), bool) & jnp.asarray(self.strong.can_score)
        kw = dict(num_nodes=N, max_depth=D, graft_nodes=p.G, calibration=self.calibration.get_value())

        def graft_branch():
            zeros = lambda: (jnp.zeros((B, M), jnp.float32), jnp.zeros((B, M, k), jnp.int32),  # noqa: E731
                             jnp.zeros((B, M, k), jnp.float32))
            if self.strong.can_score:
                strong_local, top_tok, top_lq = jax.lax.cond(
                    need(A_GRAFT, A_RECOVER), lambda: self._strong_pass(state.strong, ctree, p.cheap_spec.max_depth, k,
                                                                    p.per_depth),
                    zeros)
            else:
                strong_local, top_tok, top_lq = zeros()
            gtree, scores, _ = graft_tree(ctree, strong_local, top_tok, top_lq, graft_rows, **kw)
            rtree, rscores = gtree, scores
            if self.strong.can_score and p.available[A_RECOVER]:
                Dc, L = p.cheap_spec.max_depth, self.grow
                strong_cum = tree_lib.path_sum(jnp.where(jnp.arange(M)[None] == 0, 0.0, strong_local), ctree.parents, Dc)
                no_grow = lambda: Grown(jnp.zeros((B, L), jnp.int32), jnp.zeros((B,), jnp.int32),  # noqa: E731
                                        jnp.zeros((B, L), jnp.float32), jnp.zeros((B, L), bool))
                grown = jax.lax.cond(need(A_RECOVER), lambda: self._grow(state.strong, ctree, strong_cum, D), no_grow)
                rtree, rscores, _ = graft_tree(ctree, strong_local, top_tok, top_lq, graft_rows, grown=grown, **kw)
            par = jnp.maximum(ctree.parents, 0)
            cheap_local = ctree.score - jnp.take_along_axis(ctree.score, par, axis=1)
            scored = (ctree.valid & (ctree.parents >= 0) & graft_rows[:, None] & jnp.isfinite(strong_local)
                      & jnp.isfinite(cheap_local))
            diff = jnp.where(scored, strong_local - cheap_local, 0.0)
            return gtree, scores, rtree, rscores, diff.sum(1), scored.sum(1).astype(jnp.float32)

        def no_graft():
            shapes = jax.eval_shape(graft_branch)
            out = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes)
            return (dataclasses.replace(out[0], valid=jnp.zeros_like(out[0].valid)), out[1],
                    dataclasses.replace(out[2], valid=jnp.zeros_like(out[2].valid))) + out[3:]

        any_graft = jnp.bool_(True) if lab is not None else jnp.any(active & jnp.isin(action, jnp.asarray((A_GRAFT, A_RECOVER))))
        gtree, scores, rtree, rscores, calib_sum, calib_n = jax.lax.cond(any_graft, graft_branch, no_graft)
        chain_n = tree_lib.pad_nodes(chain, N)
        utree = (tree_lib.pad_nodes(union_tree(chain, stree, p.strong_nodes), N) if p.available[A_UNION] else chain_n)
        trees = (chain_n, stree, gtree, rtree, utree)

        record = None
        if lab is not None:  # the value system: every action's accepted length and width against the continuation
            g = state.generated
            T = self.future.get_value().shape[1]
            at = g[:, None] + jnp.arange(D)[None]  # the output index of the token at depth d + 1
            fut = jnp.where(at < T, jnp.take_along_axis(self.future.get_value(), jnp.minimum(at, T - 1), axis=1), -1)
            acc = jnp.stack([accepted_length(t, fut, D) for t in trees], 1)  # [B, A]
            width = jnp.stack([last_width(t) for t in trees], 1)
            ws = jnp.asarray(lab.widths)
            w_idx = jnp.minimum(jnp.searchsorted(ws, width), len(lab.widths) - 1)
            cost = self.draft_s.get_value()[None] + self.verify_s.get_value()[w_idx]
            value = jnp.where(avail[None], (acc + 1) - self.lam.get_value() * cost, -jnp.inf)
            action = jnp.where(pol("oracle"), jnp.argmax(value, axis=1), action).astype(jnp.int32)
            use = jnp.where(pol("oracle"), True, use)
            record = jnp.concatenate([features, acc.astype(jnp.float32), width.astype(jnp.float32),
                                      action[:, None].astype(jnp.float32)], axis=1)

        stacked = jax.tree.map(lambda *xs: jnp.stack(xs, 1), *trees)  # [B, A, N]
        tree = jax.tree.map(lambda x: jnp.take_along_axis(x, action.reshape((B, 1) + (1,) * (x.ndim - 2)), axis=1)[:, 0],
                            stacked)
        is_graft = (action == A_GRAFT)[:, None]
        scores = jax.tree.map(lambda r, g_: jnp.where(is_graft, g_, r), rscores, scores)
        invoked = active & ((action == A_STRONG) | (action == A_UNION)
                            | (jnp.isin(action, jnp.asarray((A_GRAFT, A_RECOVER))) & use))
        n_grafted = jnp.sum(tree.valid & (tree.source != CHEAP), axis=1).astype(jnp.int32)
        info = RoundInfo(tree=tree, scores=scores, action=action, invoked=invoked, features=features,
                         n_grafted=n_grafted, calib_sum=calib_sum, calib_n=calib_n, record=record)
        return Proposal(tree=tree, probs=None,
                        state=dataclasses.replace(state, cheap=cp.state, strong=sstate, pending=info))

    def commit(self, state: GraftState, committed: Committed) -> GraftState:
        cheap = self.cheap.commit(state.cheap, self.part_committed(committed, self.cheap))
        strong = self.strong.commit(state.strong, self.part_committed(committed, self.strong))
        active = committed.count > 0
        a = active.astype(jnp.int32)
        d = self.tau_decay
        tau_ema = jnp.where(active, d * state.tau_ema + (1 - d) * committed.count, state.tau_ema)
        last = jnp.where(active, committed.count - 1, state.last_accepted).astype(jnp.int32)
        counters, acc_ema, last_action, records = state.counters, state.acc_ema, state.last_action, state.records
        if state.pending is not None:
            info = state.pending
            by_source = sources_on_path(info.tree, committed)  # [B, 3]
            add = dict(invoked=info.invoked.astype(jnp.int32), grafted_proposed=info.n_grafted,
                       grafted_paths=(by_source[:, 1:].sum(1) > 0).astype(jnp.int32),
                       **{f"tokens_{s}": by_source[:, i] for i, s in enumerate(SOURCES)},
                       **{f"action_{n}": (info.action == i).astype(jnp.int32) for i, n in enumerate(ACTIONS)})
            counters = {c: counters[c] + a * add[c] for c in COUNTERS}
            got = jnp.stack([by_source[:, 0], by_source[:, 1:].sum(1)], 1).astype(jnp.float32)
            acc_ema = jnp.where(active[:, None], d * acc_ema + (1 - d) * got, acc_ema)
            last_action = jnp.where(active, info.action, last_action).astype(jnp.int32)
            if records is not None and info.record is not None:
                R = records.shape[1]
                i = jnp.minimum(sum(state.counters[f"action_{n}"] for n in ACTIONS), R - 1)  # this row's round
                put = (jnp.arange(R)[None] == i[:, None]) & active[:, None]
                records = jnp.where(put[..., None], info.record[:, None], records)
        return GraftState(cheap=cheap, strong=strong, tau_ema=tau_ema.astype(jnp.float32), last_accepted=last,
                          acc_ema=acc_ema, last_action=last_action,
                          generated=state.generated + committed.count.astype(jnp.int32), counters=counters,
                          records=records, pending=None)

    def loop_stats(self, state: GraftState) -> dict:
        """Engine hook: per-row counters over the whole generation, and each drafter's own (labelled:
        the records too, [B, R, K])."""
        out = {**super().loop_stats(state), **{f"treegraft_{c}": v for c, v in state.counters.items()}}
        if state.records is not None:
            out["treegraft_records"] = state.records
        return out

    def report(self, stats, row: int | None = None) -> dict:
        rounds = max(stat_sum(stats, "rounds", row), 1)
        invoked = stat_sum(stats, "treegraft_invoked", row)
        tokens = {s: stat_sum(stats, f"treegraft_tokens_{s}", row) for s in SOURCES}
        total = max(sum(tokens.values()), 1)
        return {**super().report(stats, row), "treegraft": {
            "policy": self.policy,
            "invoked": invoked,  # rounds where the strong drafter ran
            "invoke_rate": round(invoked / rounds, 4),
            "actions": {a: stat_sum(stats, f"treegraft_action_{a}", row) for a in ACTIONS},  # rounds per action
            # rounds the strong drafter's own tree was verified (the Switch's "model rounds")
            "model_round_share": round(stat_sum(stats, "treegraft_action_strong", row) / rounds, 4),
            "accepted_tokens": tokens,  # accepted draft tokens by the source of their node
            "recovered_share": round(tokens["recovered"] / total, 4),
            "grafted_proposed": stat_sum(stats, "treegraft_grafted_proposed", row),  # strong nodes verified
            "grafted_accepted_paths": stat_sum(stats, "treegraft_grafted_paths", row)}}


@dataclasses.dataclass(frozen=True)
class Labels:
    """Static shape of the value system's records: rounds kept per row, the compiled verify widths."""
    rounds: int
    widths: tuple


def record_size() -> int:
    """Columns of one record: the features, then accepted length and width per action, then the action taken."""
    return sched_lib.NUM_FEATURES + 2 * len(ACTIONS) + 1


def record_columns() -> list[str]:
    return (list(sched_lib.FEATURE_NAMES) + [f"acc_{a}" for a in ACTIONS] + [f"width_{a}" for a in ACTIONS]
            + ["action"])


def check_scheduler_drafters(meta: dict, specs: Sequence[str], where: str) -> None:
    """Raises ValueError when the scheduler in `where` was distilled for other drafter weights than the
    directories in `specs` (cheap first, then strong) hold: its values were measured on those drafters'
    acceptance and cost, so a retrained drafter needs a re-distilled scheduler. The distillation records
    each drafter's weight digest (`meta["models"]`, one entry per value dataset); a drafter given by name
    (`ngram`) or recorded without a digest is not checked."""
    recorded = [m for m in meta.get("models", []) if isinstance(m, dict) and "strong" in m]
    if not recorded:
        return
    mismatch = []
    for m in recorded:
        bad = []
        for role, spec in zip(("cheap", "strong"), specs):
            want = (m.get(role) or {}).get("sha256")
            if want is None or not os.path.isfile(os.path.join(str(spec), "model.safetensors")):
                continue
            have = weights_sha256(spec)
            if have != want:
                bad.append(f"the {role} drafter {spec} holds weights {have[:12]}…, it was distilled for "
                           f"{(m.get(role) or {}).get('spec')} {want[:12]}…")
        if not bad:
            return
        mismatch = bad
    raise ValueError(f"{where}: {'; '.join(mismatch)} (re-distil it for these drafters: python -m tools.bench_treegraft "
                     "--train-schedulers, or python -m train.value_system then python -m train.distill_scheduler)")




def build(drafters: Sequence, policy: str, *, specs: Sequence[str] | None = None, **kwargs) -> TreeGraft:
    """TreeGraft from a policy name (POLICIES) or a scheduler directory. `specs`: the drafters'
    command-line specs (directories); a scheduler distilled for other weights is refused."""
    if len(drafters) != 2:
        raise ValueError(f"TreeGraft combines exactly two drafters (cheap first, then strong), got {len(drafters)}")
    if policy in POLICIES:
        return TreeGraft(drafters[0], drafters[1], policy=policy, **kwargs)
    sched, calibration, meta = sched_lib.load_scheduler(policy)
    if specs is not None:
        check_scheduler_drafters(meta, specs, policy)
    return TreeGraft(drafters[0], drafters[1], scheduler=sched, policy="scheduler", calibration=calibration, **kwargs)


def Switch(matches: Drafter, model: Drafter, *, model_tree: str = "chain=3", min_match: int = 3) -> TreeGraft:
    """The Switch (`MATCHES|MODEL`): TreeGraft under its fixed policy "switch": the match drafter's chain
    (at the verify depth) where its best match is an n-gram of at least `min_match` tokens, the model
    drafter's `model_tree` elsewhere."""
    if not (isinstance(matches, Drafter) and isinstance(model, Drafter)):
        raise ValueError("Switch combines two drafters (specjax.drafters.Drafter): a match drafter, then a model drafter")
    if not (matches.drafts_matches and hasattr(matches, "match_length")):
        raise ValueError(f"Switch's first drafter must draft copied matches and say how long they are "
                         f"(ngram); the {matches.name!r} drafter does not")
    if model.drafts_matches:
        raise ValueError(f"Switch's second drafter must be a model drafter (lm, feature, mtp, block), not {model.name!r}")
    return TreeGraft(matches, model, policy="switch", strong_tree=model_tree, min_match=min_match)
