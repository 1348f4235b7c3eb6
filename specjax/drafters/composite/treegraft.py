"""TreeGraft (design §6): a cheap drafter's tree, rescored and grafted by a strong drafter when a
scheduler says it pays, as ONE composite drafter behind the ordinary protocol — the engine loop
does not know it is there.

Per round (`TreeGraft.propose`, inside the jitted loop):
  1. the cheap drafter builds a candidate tree of M nodes, larger than the verify budget N (its own
     spec: `cheap_tree`, by default a dynamic tree of about 2N nodes; for n-gram a trie of its
     best matches, of more nodes than N);
  2. the scheduler decides per row whether to invoke the strong drafter: policy "scheduler" (the
     MLP of `specjax.drafters.composite.treegraft_scheduler` over features of the cheap tree), "always" or "never". The policy
     and the calibration offset are traced values (`Setting` variables), so all policies share
     one compiled program;
  3. `lax.cond(any row wants it)`: the strong drafter scores the whole candidate tree in one pass
     (`score(state, tree)`: one tree-attention forward for lm, depth by depth for feature) — skipped
     entirely when no row wants it; for a batch, its results apply to the rows that asked only;
  4. non-destructive rescoring: each node keeps the cheap drafter's cumulative log q and gains the
     strong one's (a `SourceScores`, in the round's `RoundInfo`); the ranking score is the strong score
     where present, else the cheap score plus `calibration` per token (fit offline); ranks are
     made monotone along paths (a child never outranks its parent), so selection stays connected;
  5. graft: at each node above the verify depth, the strong drafter's top `graft_topk` tokens that
     are not yet children become candidate children (source 1 = strong); the best `graft_nodes`
     of them join the pool;
  6. the best N nodes of the pool (cheap tree + grafts) are kept by `tree.select_nodes` (the
     EAGLE-2 selection, shared with `tree._expand_dynamic`): connected, topological, parents
     remapped. Verification must use the deterministic-candidates rule (or greedy), which is
     lossless whatever drafter proposed which child: sampled rules are refused (`check_tree`).
`commit` commits both drafters every round, so the strong drafter's cache stays current whether or
not it ran. Per-row counters (invocations, grafted nodes proposed, accepted paths through a grafted
node, accepted grafted tokens) ride in the drafter state; the engine returns them via `loop_stats`.

`specjax.engine.stepper.RoundStepper` runs single rounds from the host with the policy forced per
call: the offline value system (`train/value_system.py`) and the oracle baseline of the benchmark use it.
"""
from __future__ import annotations

import dataclasses
import functools
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
from specjax.spec.sampling import SamplingParams
from specjax.spec.tree import TreeBuffers

POLICIES = ("never", "always", "scheduler")
CHEAP, STRONG = 0, 1  # TreeBuffers.source of cheap and grafted nodes
LOSSLESS_RULES = ("greedy", "deterministic")
COUNTERS = ("invoked", "grafted_proposed", "grafted_paths", "grafted_tokens")
NGRAM_MATCHES = 4  # the fewest matches in a matches drafter's default cheap trie (`TreeGraft.plan`)


class Setting(nnx.Variable):
    """A traced TreeGraft setting (policy, calibration): changing it does not recompile."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SourceScores:
    """Per-source path scores of a multi-drafter tree (TreeGraft), kept side by side: nothing one
    drafter said overwrites another's. Values are cumulative log q from the root; 0 where absent."""
    cheap: Any  # the cheap drafter's, on the nodes it proposed
    strong: Any  # the strong drafter's, on the nodes it scored or grafted
    has_cheap: Any
    has_strong: Any
    origin: Any  # index of the node in the candidate pool (cheap tree, then grafts)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RoundInfo:
    """What `propose` decided this round, for `commit`'s statistics and the value system."""
    tree: TreeBuffers  # [B, N] the verified tree
    scores: SourceScores  # its nodes' per-source path scores
    invoked: Any  # bool [B]: the strong drafter scored / grafted this row
    features: Any  # [B, F] scheduler features of the cheap tree
    n_grafted: Any  # int [B]: grafted nodes in the verified tree
    calib_sum: Any  # f32 [B]: sum over the cheap tree's scored nodes of (strong - cheap) local log q
    calib_n: Any  # f32 [B]: how many nodes that sum covers


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GraftState:
    cheap: Any
    strong: Any
    tau_ema: Any  # f32 [B]
    last_accepted: Any  # int32 [B]
    counters: dict  # name -> int32 [B]
    pending: RoundInfo | None = None  # set by propose, consumed by commit


# ----------------------------------------------------------------------------- tree functions

def graft_tree(cheap: TreeBuffers, strong_local, top_tok, top_lq, use_B, *, num_nodes: int, max_depth: int,
               graft_nodes: int, calibration=0.0):
    """Rescore, graft and select (steps 4-6 of the module docstring), a pure function.

    cheap: the cheap drafter's candidate tree [B, M] (score = its cumulative log q);
    strong_local: [B, M] the strong drafter's log q of each node's token given its parent;
    top_tok, top_lq: [B, M, k] the strong drafter's top-k tokens and log q at each node;
    use_B: bool [B], rows where the strong drafter ran (elsewhere its inputs are ignored).
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

    if G > 0:
        # is_child[b, u, j]: the strong top token j at node u is already a child of u
        kid = valid[:, None, None, :] & (cheap.parents[:, None, None, :] == jnp.arange(M)[None, :, None, None])
        is_child = jnp.any(kid & (cheap.tokens[:, None, None, :] == top_tok[..., None]), axis=-1)  # [B, M, k]
        ok = use[..., None] & valid[..., None] & (cheap.depth < D)[..., None] & ~is_child & jnp.isfinite(top_lq)
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
    pad = max(N - (M + G), 0)  # a pool smaller than the budget is padded with invalid nodes
    cat = lambda a, b, fill: jnp.concatenate([a, b, jnp.full((B, pad), fill, a.dtype)], axis=1)
    p_valid = cat(valid, g_valid, False)
    p_rank = cat(rank, g_rank, -jnp.inf)
    tree, keep = tree_lib.select_nodes(
        cat(cheap.tokens.astype(jnp.int32), g_tok, 0), cat(cheap.parents, g_par, -1),
        cat(cheap.depth, g_depth, 0), p_rank, N, valid=p_valid,
        source=cat(cheap.source.astype(jnp.int8), jnp.full((B, G), STRONG, jnp.int8), CHEAP))
    gather = lambda x: jnp.take_along_axis(x, keep, axis=1)
    has_cheap = cat(valid, jnp.zeros((B, G), bool), False)
    has_strong = cat(valid & use, g_valid, False)
    scores = SourceScores(
        cheap=gather(jnp.where(has_cheap, cat(cheap.score, jnp.zeros((B, G)), 0.0), 0.0)),
        strong=gather(jnp.where(has_strong, cat(strong_cum, g_score, 0.0), 0.0)),
        has_cheap=gather(has_cheap) & tree.valid, has_strong=gather(has_strong) & tree.valid, origin=keep)
    n_grafted = jnp.sum(tree.valid & (tree.source == STRONG), axis=1).astype(jnp.int32)
    return tree, scores, n_grafted


def grafted_on_path(info: RoundInfo, committed: Committed):
    """(accepted path passes a grafted node [B], accepted grafted nodes [B]), from the committed
    tokens (`tree.accepted_nodes`)."""
    on, _ = tree_lib.accepted_nodes(info.tree, committed.tokens, committed.count)
    n = jnp.sum(on & (info.tree.source == STRONG), axis=1).astype(jnp.int32)
    return n > 0, n


# ----------------------------------------------------------------------------- the composite drafter

class TreeGraft(Composite):
    """A cheap and a strong drafter (cheapest first) drafting one tree; see the module docstring.

    cheap_tree: the cheap drafter's candidate tree spec (default: a dynamic tree of ~2N nodes at
      the verify depth; for n-gram, a trie of max(4, ceil(N/D)) matches at the verify depth);
    graft_nodes: grafted candidates per round, at most N-1 (default: min(N-1, M*graft_topk));
    graft_topk: the strong drafter's top tokens considered at each node;
    calibration: per-token log-prob offset added to cheap-only paths' scores (fit offline);
    tau_decay: the EMA decay of the scheduler's recent-tau feature.
    """
    name = "treegraft"
    PARTS = ("cheap", "strong")
    PRIMARY = "strong"  # its default tree and tree resolution

    def __init__(self, cheap, strong, *, scheduler: sched_lib.Scheduler | None = None, policy: str = "always",
                 calibration: float = 0.0, cheap_tree=None, graft_nodes: int | None = None, graft_topk: int = 2,
                 tau_decay: float = 0.7):
        if not strong.can_score:
            raise ValueError(f"the {strong.name!r} drafter cannot score another drafter's tree; it may only be "
                             "TreeGraft's cheap drafter (the first one)")
        if isinstance(cheap, TreeGraft) or isinstance(strong, TreeGraft):
            raise ValueError("TreeGraft combines two plain drafters (cheap, strong), not another TreeGraft")
        for d in (cheap, strong):
            if d.reads_own_tree:
                raise ValueError(f"the {d.name!r} drafter (DPara) commits against the tree it proposed itself; "
                                 "TreeGraft grafts a new tree: use it on its own")
            if type(d).prepare is not Drafter.prepare:  # e.g. the adaptive shape, a composite itself
                raise ValueError(f"TreeGraft combines drafters whose state needs no per-tree sizing; the {d.name!r} "
                                 "drafter has its own prepare hook (wrap the plain drafter instead)")
        vc, vs = cheap.vocab_size, strong.vocab_size
        if vc is not None and vs is not None and vc != vs:
            raise ValueError(f"TreeGraft drafters must share one vocabulary: the cheap {cheap.name!r} drafter has "
                             f"{vc} tokens, the strong {strong.name!r} drafter {vs}")
        if policy not in POLICIES:
            raise ValueError(f"unknown TreeGraft policy {policy!r}; choose from {', '.join(POLICIES)} "
                             "(the oracle exists only in the evaluation: train/value_system.py)")
        if policy == "scheduler" and scheduler is None:
            raise ValueError("TreeGraft policy 'scheduler' needs a scheduler (load one with "
                             "specjax.drafters.composite.treegraft_scheduler.load_scheduler)")
        if int(graft_topk) != graft_topk or graft_topk < 0:
            raise ValueError(f"graft_topk must be a non-negative integer, got {graft_topk}")
        if graft_nodes is not None and (int(graft_nodes) != graft_nodes or graft_nodes < 0):
            raise ValueError(f"graft_nodes must be a non-negative integer, got {graft_nodes}")
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
        self.graft_nodes = None if graft_nodes is None else int(graft_nodes)
        self.graft_topk = int(graft_topk)
        self.tau_decay = float(tau_decay)

    # -- configuration (host side)

    def rebuild(self, cheap, strong) -> "TreeGraft":
        return TreeGraft(cheap, strong, scheduler=self.scheduler, policy=self.policy,
                         calibration=float(self.calibration.get_value()), cheap_tree=self.cheap_tree,
                         graft_nodes=self.graft_nodes, graft_topk=self.graft_topk, tau_decay=self.tau_decay)

    @property
    def policy(self) -> str:
        return POLICIES[int(self.policy_code.get_value())]

    def set_policy(self, policy: str) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown TreeGraft policy {policy!r}; choose from {', '.join(POLICIES)}")
        self.policy_code.set_value(jnp.int32(POLICIES.index(policy)))

    def plan(self, spec):
        """(cheap tree spec, M cheap nodes, G graft slots, k top tokens) for a verify spec.
        Raises ValueError where they do not fit together."""
        N, D = spec.num_nodes, spec.max_depth
        cspec = self.cheap_tree
        matches = self.cheap.drafts_matches
        if cspec is None:
            if matches:
                # A trie of the best matches, not the best match's chain alone: candidates the
                # strong drafter's scores choose among (a chain gives it one path to confirm or
                # cut). k chains under the root bound a trie of k matches (`ngram.branches_of`: the
                # root's branching), k*D+1 nodes with no merging: enough matches that the trie can
                # fill the verify budget and more (at least 4, as the dynamic default's topk), no
                # node slot beyond what k matches can fill (the strong drafter scores every slot).
                # A path list, not a dynamic spec: nothing is expanded by q, so `check_tree` must
                # not count a dynamic spec's expansion pool as scratch.
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
        # a matches drafter's candidates cost nothing and are few where the text does not repeat:
        # any cheap tree will do (the strong drafter's grafts fill the verify budget)
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
        return cspec, M, G, k

    def check_tree(self, spec, rule: str) -> int:
        """Engine hook, on the host before tracing: refuses sampled rules and a bad plan; returns
        the scratch slots the drafters need past their committed caches."""
        if isinstance(spec, tree_lib.BestFirstTree):
            raise ValueError("TreeGraft verifies a chain, a path list or a dynamic tree; a best-first tree (ddtree / "
                             "treeflash) is a block drafter's own (pass the block drafter alone)")
        if rule not in LOSSLESS_RULES:
            raise ValueError(f"TreeGraft verifies trees whose nodes come from two drafters: it needs the "
                             f"deterministic-candidates rule (verify='deterministic', or greedy at temperature 0), "
                             f"not {rule!r}")
        cspec, M, _, _ = self.plan(spec)
        # each drafter's own checks on the tree it drafts or scores (e.g. a block drafter's depth bound)
        own = max(self.cheap.check_tree(cspec, rule), self.strong.check_tree(cspec, rule))
        evaluated = cspec.pool_size if isinstance(cspec, tree_lib.DynamicTree) else M
        return max(evaluated, M, spec.num_nodes, own)

    # -- the protocol (traced)

    def init(self, prompt_BxP, lengths_B, capacity, target_out) -> GraftState:
        B = prompt_BxP.shape[0]
        return GraftState(
            cheap=self.cheap.init(prompt_BxP, lengths_B, capacity, self.part_out(target_out, self.cheap)),
            strong=self.strong.init(prompt_BxP, lengths_B, capacity, self.part_out(target_out, self.strong)),
            tau_ema=jnp.ones((B,), jnp.float32), last_accepted=jnp.zeros((B,), jnp.int32),
            counters={c: jnp.zeros((B,), jnp.int32) for c in COUNTERS})

    def _strong_pass(self, sstate, ctree: TreeBuffers, depth: int, k: int):
        lq = self.strong.score(sstate, ctree, depth)  # [B, M, V]
        B, M = ctree.tokens.shape
        par = jnp.maximum(ctree.parents, 0)
        local = lq[jnp.arange(B)[:, None], par, ctree.tokens]
        local = jnp.where(ctree.parents >= 0, local, 0.0).astype(jnp.float32)
        if k == 0:
            return local, jnp.zeros((B, M, 0), jnp.int32), jnp.zeros((B, M, 0), jnp.float32)
        top_lq, top_tok = jax.lax.top_k(lq, k)
        return local, top_tok.astype(jnp.int32), top_lq.astype(jnp.float32)

    def propose(self, state: GraftState, root_B, ctx: DraftContext) -> Proposal:
        if ctx.mode != "topk":
            raise ValueError("TreeGraft proposes deterministic candidates only (see check_tree)")
        spec = ctx.spec
        N, D = spec.num_nodes, spec.max_depth
        cspec, M, G, k = self.plan(spec)
        B = root_B.shape[0]
        cp = self.cheap.propose(state.cheap, root_B, DraftContext(cspec, "topk", ctx.params, ctx.key,
                                                                   active=ctx.active))
        ctree = tree_lib.well_formed(cp.tree, root_B, D)
        features = sched_lib.tree_features(ctree, N, state.tau_ema, state.last_accepted)
        code = self.policy_code.get_value()
        want = jnp.where(code == POLICIES.index("scheduler"), self.scheduler.decide(features),
                         jnp.broadcast_to(code == POLICIES.index("always"), (B,)))
        skip = lambda: (jnp.zeros((B, M), jnp.float32), jnp.zeros((B, M, k), jnp.int32), jnp.zeros((B, M, k), jnp.float32))
        strong_local, top_tok, top_lq = jax.lax.cond(
            jnp.any(want), lambda: self._strong_pass(state.strong, ctree, cspec.max_depth, k), skip)
        tree, scores, n_grafted = graft_tree(ctree, strong_local, top_tok, top_lq, want, num_nodes=N, max_depth=D,
                                             graft_nodes=G, calibration=self.calibration.get_value())
        # calibration statistic: strong minus cheap local log q over the cheap tree's scored nodes (finite
        # ones: a strong drafter with a reduced draft vocabulary gives -inf to the tokens outside it)
        par = jnp.maximum(ctree.parents, 0)
        cheap_local = ctree.score - jnp.take_along_axis(ctree.score, par, axis=1)
        scored = (ctree.valid & (ctree.parents >= 0) & want[:, None] & jnp.isfinite(strong_local)
                  & jnp.isfinite(cheap_local))
        diff = jnp.where(scored, strong_local - cheap_local, 0.0)
        info = RoundInfo(tree=tree, scores=scores, invoked=want, features=features, n_grafted=n_grafted,
                         calib_sum=diff.sum(1), calib_n=scored.sum(1).astype(jnp.float32))
        return Proposal(tree=tree, probs=None, state=dataclasses.replace(state, cheap=cp.state, pending=info))

    def commit(self, state: GraftState, committed: Committed) -> GraftState:
        cheap = self.cheap.commit(state.cheap, self.part_committed(committed, self.cheap))
        strong = self.strong.commit(state.strong, self.part_committed(committed, self.strong))
        active = committed.count > 0
        a = active.astype(jnp.int32)
        d = self.tau_decay
        tau_ema = jnp.where(active, d * state.tau_ema + (1 - d) * committed.count, state.tau_ema)
        last = jnp.where(active, committed.count - 1, state.last_accepted).astype(jnp.int32)
        counters = state.counters
        if state.pending is not None:
            info = state.pending
            through, n_tok = grafted_on_path(info, committed)
            add = dict(invoked=info.invoked.astype(jnp.int32), grafted_proposed=info.n_grafted,
                       grafted_paths=through.astype(jnp.int32), grafted_tokens=n_tok)
            counters = {c: counters[c] + a * add[c] for c in COUNTERS}
        return GraftState(cheap=cheap, strong=strong, tau_ema=tau_ema.astype(jnp.float32), last_accepted=last,
                          counters=counters, pending=None)

    def loop_stats(self, state: GraftState) -> dict:
        """Engine hook: per-row counters over the whole generation, and each drafter's own."""
        return {**super().loop_stats(state), **{f"treegraft_{c}": v for c, v in state.counters.items()}}

    def report(self, stats, row: int | None = None) -> dict:
        rounds = max(stat_sum(stats, "rounds", row), 1)
        invoked = stat_sum(stats, "treegraft_invoked", row)
        return {**super().report(stats, row), "treegraft": {
            "invoked": invoked,  # rounds where the strong drafter ran
            "invoke_rate": round(invoked / rounds, 4),
            "grafted_proposed": stat_sum(stats, "treegraft_grafted_proposed", row),  # grafted nodes verified
            "grafted_accepted_paths": stat_sum(stats, "treegraft_grafted_paths", row),  # accepted paths through a graft
            "grafted_accepted_tokens": stat_sum(stats, "treegraft_grafted_tokens", row)}}


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


def build(drafters: Sequence, treegraft: str, *, specs: Sequence[str] | None = None, **kwargs) -> TreeGraft:
    """TreeGraft from a `--treegraft` value: 'always', 'never' or a scheduler directory. `specs`: the
    drafters' command-line specs (directories); a scheduler distilled for other weights is refused."""
    if len(drafters) != 2:
        raise ValueError(f"TreeGraft combines exactly two drafters (cheap first, then strong), got {len(drafters)}")
    if treegraft in ("always", "never"):
        return TreeGraft(drafters[0], drafters[1], policy=treegraft, **kwargs)
    sched, calibration, meta = sched_lib.load_scheduler(treegraft)
    if specs is not None:
        check_scheduler_drafters(meta, specs, treegraft)
    return TreeGraft(drafters[0], drafters[1], scheduler=sched, policy="scheduler", calibration=calibration, **kwargs)
