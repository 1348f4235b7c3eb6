"""AdaptiveSpec's adaptive tree shape (lossless; arXiv 2608.20375; design §3b): a composite drafter
that wraps any drafter giving scores (lm, feature, block) and chooses, every round, how much of its
tree the target verifies.

The inner drafter drafts its tree (a chain, a path list, a dynamic or a best-first tree: the
static maximum). Each node's chance of acceptance is estimated from the drafter's own confidence
along its path, calibrated on what the target accepted in recent rounds:

    est_{b,i} = prod_{k on the path to i} min(1, rho_b * g(q_k, d_k))

    q_k    the drafter's probability of node k's token given its parent (its step of the path)
    g(q,d) the acceptance rate of nodes at depth d whose parent was accepted, by bin of q (`BINS`
           equal bins over [0, 1]; depths past `DEPTHS` share the last; pooled over rows): a
           drafter's confidence is rarely its acceptance rate (code-draft's third token is often
           accepted at q < 0.1); each depth's bin is shrunk toward the bin's rate over all depths
           (`calibration.fit_pooled_rates`) and the fit is made non-decreasing in q. The counts are
           those of an offline
           fit (the "step" table of the drafter's `calibration.json`, `specjax.spec.calibration`, written
           by `train.adaptive_calibration` on validation prompts; at most `prior_weight`
           pseudo-observations per bin; without one, a single pseudo-observation at g = q) plus
           this generation's own observations, decayed by `calibration_decay` per round
    rho_b  EMA(observed nodes accepted) / EMA(their g) on row b (`decay` per round): the row's
           recent acceptance history (a repetitive stretch of code is accepted more than g says),
           kept within `RHO_RANGE`

The nodes are put in order of their estimate (a child never precedes its parent: g <= 1, ties
broken toward the shallower), so every prefix of the tree is the prefix-closed subtree of highest
estimated acceptance. The round verifies the first w nodes of each row for the compiled width w (`widths`)
that maximises the expected tokens per second,

    (active rows [one bonus token each] + sum_b sum_{i<w} est_{b,i}) / costs[w],

`costs` being the machine's profiled round seconds per width (`tools/profile_widths.py
--adaptive`); the engine's `lax.switch` then runs the target's forward over w nodes only (a masked
node would still cost, design §3b). The number of nodes, and with it the depth and the width of the
verified tree, thus vary per round: deep and narrow where the drafter is sure, wide and shallow
where it hesitates, one token where speculation does not pay. The DSpark scheduler and TAPS's
budget (`BlockDrafter`'s `schedule` / `select=taps`) are the same objective on their own estimates.

Lossless: which nodes are kept is a function of the drafter's output and of past rounds only, never
of this round's target, so with deterministic candidates (greedy, verify="deterministic") the
verified tree is still a deterministic-candidates tree and the output is the target's. Sampled
candidates are refused: keeping a draw because of its own q biases the draws that are kept.
Departures from AdaptiveSpec: its shape policy is not public; this one is the expected-throughput
rule above.

Drafting is cut too, where the drafter drafts a chain depth by depth (`stops_early`: lm, feature)
and `draft_step_s` (the profile's draft seconds / depth) is given: after each drafted token the
chain goes on while some longer chain d' > d would raise the expected tokens per second: a round
that drafts d tokens costs costs(w) - (D - d) * draft_step_s (w the smallest compiled width >= d+1),
and the tokens not yet drafted are estimated from the newest one's, each the newest step's
conditional estimate times the one before. A one-pass (block) drafter drafts its whole tree.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax.spec import tree as tree_lib
from specjax.spec import widths as widths_lib
from specjax.drafters.base import SAMPLED_RULES, Committed, Composite, DraftContext, Drafter, Proposal, StopRule
from specjax.spec.calibration import STEP, Calibration
from specjax.typing import Array, Float, Int

DEFAULT_DECAY = 0.7  # EMA weight of the past per round (the row's history correction)
CALIBRATION_DECAY = 0.98  # weight of the past per round of this generation's acceptance-by-confidence counts
BINS = 20  # confidence bins of g(q, d)
DEPTHS = 8  # depth rows of g(q, d); deeper nodes use the last
CELLS = DEPTHS * BINS
PRIOR_WEIGHT = 50.0  # pseudo-observations per bin at most from an offline calibration
RHO_RANGE = (0.25, 4.0)  # the history correction is kept within this range


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AdaptiveState:
    inner: Any  # the inner drafter's state
    ema_hits: Float[Array, "B"]  # EMA per round of observed nodes (parent accepted) that were accepted
    ema_mass: Float[Array, "B"]  # EMA per round of the observed nodes' summed g
    seen: Float[Array, "C"]  # this generation's decayed count of nodes observed (parent accepted) per confidence bin
    hits: Float[Array, "C"]  # ... of which accepted
    tree: Any  # this round's kept tree (TreeBuffers, read at commit)
    step_bin: Int[Array, "B N"]  # each node's (depth, confidence bin) cell this round
    kept_nodes: Int[Array, "B"]  # kept draft nodes (root excluded), summed over the row's rounds
    kept_depth: Int[Array, "B"]  # the kept tree's depth, summed over the row's rounds


def order_by_score(tree: tree_lib.TreeBuffers, probs=None, rank=None):
    """The tree's nodes in order of decreasing `rank` [B, N] (default: the path score; it must not
    increase from a node to its child), the root first, invalid nodes last, ties toward the
    shallower node (so parents precede children); parents remapped; `probs` [B, N, V] permuted
    alike. Returns (tree, probs, perm [B, N]: the old index of each new node)."""
    B, N = tree.tokens.shape
    rank = tree.score if rank is None else rank
    key = jnp.where(tree.valid, rank - 1e-4 * tree.depth.astype(jnp.float32), -jnp.inf)
    key = key.at[:, 0].set(jnp.inf)
    perm = jnp.argsort(-key, axis=1, stable=True).astype(jnp.int32)  # new -> old
    inv = jax.vmap(lambda p: jnp.zeros((N,), jnp.int32).at[p].set(jnp.arange(N, dtype=jnp.int32)))(perm)  # old -> new
    take = lambda x: jnp.take_along_axis(x, perm, axis=1)  # noqa: E731
    old_par = take(tree.parents)
    parents = jnp.where(old_par >= 0, jnp.take_along_axis(inv, jnp.maximum(old_par, 0), axis=1), -1)
    out = tree_lib.TreeBuffers(tokens=take(tree.tokens), parents=parents, depth=take(tree.depth), valid=take(tree.valid),
                               score=take(tree.score), source=take(tree.source))
    if probs is not None:
        probs = jnp.take_along_axis(probs, perm[..., None], axis=1)
    return out, probs, perm


def _empty_tree(B: int, N: int) -> tree_lib.TreeBuffers:
    return tree_lib.TreeBuffers(tokens=jnp.zeros((B, N), jnp.int32), parents=jnp.full((B, N), -1, jnp.int32),
                                depth=jnp.zeros((B, N), jnp.int32), valid=jnp.zeros((B, N), bool),
                                score=jnp.zeros((B, N), jnp.float32), source=jnp.zeros((B, N), jnp.int8))


class AdaptiveShape(Composite):
    """`AdaptiveShape(drafter, costs)`: the drafter's tree, verified each round at the width that
    pays most (see the module docstring). `costs`: round seconds at each of `widths` (default
    `widths.adaptive_widths(N)` of the tree), from `python -m tools.profile_widths --adaptive` on this machine
    and batch size; `decay`: the history EMA's weight of the past; `calibration`: the offline
    calibration (a `specjax.spec.calibration.Calibration` with a "step" table of DEPTHS x BINS; None: g = q
    until observed); `calibration_decay`:
    the weight of the past per round of this generation's counts (1: no decay, what a fit uses);
    `draft_step_s`: seconds per drafted token of a depth-by-depth drafter's chain (the profile's
    draft_s / depth), which lets the chain stop early (None: draft it whole)."""
    name = "adaptive"
    gives_q = True
    PARTS = ("inner",)

    def __init__(self, inner: Drafter, costs, *, widths: tuple[int, ...] | None = None, decay: float = DEFAULT_DECAY,
                 calibration: Calibration | None = None, calibration_decay: float = CALIBRATION_DECAY,
                 draft_step_s: float | None = None):
        if not isinstance(inner, Drafter):
            raise ValueError(f"AdaptiveShape wraps a drafter (a specjax.drafters.Drafter), got {type(inner).__name__}")
        if isinstance(inner, AdaptiveShape):
            raise ValueError("the drafter is already adaptive")
        if inner.reads_own_tree:
            raise ValueError(f"the {inner.name!r} drafter (DPara) commits against the tree it proposed itself; the "
                             "adaptive shape reorders and cuts it: use it on its own")
        if not inner.gives_q:
            raise ValueError(f"the adaptive shape ranks a tree's nodes by the drafter's path log q: the "
                             f"{inner.name!r} drafter gives none (use an lm, feature or block drafter)")
        try:
            costs = tuple(float(c) for c in costs)
        except TypeError:
            raise ValueError(f"costs must be round seconds per verify width, got {costs!r}") from None
        if not costs or not all(c > 0 for c in costs):
            raise ValueError(f"costs must be positive round seconds per verify width, got {costs}")
        if not 0 <= float(decay) < 1:
            raise ValueError(f"decay must be in [0, 1), got {decay}")
        self.inner = inner
        self.costs = costs
        self.widths = None if widths is None else tuple(int(w) for w in widths)
        self.decay = float(decay)
        if calibration is not None:
            if not isinstance(calibration, Calibration):
                raise ValueError(f"calibration must be a Calibration, got {type(calibration).__name__}")
            t = calibration.table(STEP)
            if (t.depths, t.bins) != (DEPTHS, BINS):
                raise ValueError(f"the adaptive shape's calibration has {DEPTHS} x {BINS} cells, got {t.depths} x {t.bins}")
        if not 0 < float(calibration_decay) <= 1:
            raise ValueError(f"calibration_decay must be in (0, 1], got {calibration_decay}")
        self.calibration_prior = calibration
        self.calibration_decay = float(calibration_decay)
        if draft_step_s is not None and not float(draft_step_s) >= 0:
            raise ValueError(f"draft_step_s must be seconds >= 0, got {draft_step_s}")
        self.draft_step_s = None if draft_step_s is None else float(draft_step_s)

    @classmethod
    def estimator(cls, inner: Drafter, num_nodes: int, calibration: Calibration | None = None) -> "AdaptiveShape":
        """The drafter's tree verified whole (one width: no cut of its own) with the adaptive shape's
        calibrated per-node estimates in `Proposal.est`, learnt online from the acceptance it observes
        (from `calibration` when given, else from q): what packed verification's goodput budget cuts by
        (`specjax.spec.packing`; a drafter's raw q underestimates deep nodes when it is underconfident)."""
        return cls(inner, (1.0,), widths=(int(num_nodes),), calibration=calibration)

    def rebuild(self, inner: Drafter) -> "AdaptiveShape":
        return AdaptiveShape(inner, self.costs, widths=self.widths, decay=self.decay, calibration=self.calibration_prior,
                             calibration_decay=self.calibration_decay, draft_step_s=self.draft_step_s)

    def check_tree(self, spec, rule: str) -> int:
        if rule in SAMPLED_RULES:
            raise ValueError(f"the adaptive shape keeps nodes by their draft probability; sampled candidates kept "
                             f"that way are no longer draws from q: use verify='deterministic' (or greedy), not {rule!r}")
        scratch = self.inner.check_tree(spec, rule)
        inner_widths = self.inner.verify_widths(spec)
        if tuple(inner_widths) != (spec.num_nodes,):
            raise ValueError(f"the {self.inner.name!r} drafter already chooses its verify width per round "
                             f"(widths {tuple(inner_widths)}: a confidence cut or a TAPS budget); wrap it with those off")
        widths = self.verify_widths(spec)
        if len(self.costs) != len(widths):
            raise ValueError(f"costs has {len(self.costs)} entries for the verify widths {widths} "
                             f"(profile them: python -m tools.profile_widths --adaptive --tree ...)")
        return scratch

    def verify_widths(self, spec) -> tuple[int, ...]:
        return widths_lib.check_widths(self.widths or widths_lib.adaptive_widths(spec.num_nodes), spec.num_nodes)

    # -- the protocol

    def init(self, prompt_BxP, lengths_B, capacity, target_out) -> AdaptiveState:
        B = prompt_BxP.shape[0]
        one, zero = jnp.ones((B,), jnp.float32), jnp.zeros((B,), jnp.int32)
        nothing = jnp.zeros((CELLS,), jnp.float32)
        return AdaptiveState(self.inner.init(prompt_BxP, lengths_B, capacity, target_out), one, one,
                             nothing, nothing, _empty_tree(B, 1), jnp.zeros((B, 1), jnp.int32), zero, zero)

    def prepare(self, state: AdaptiveState, spec) -> AdaptiveState:
        """The round buffers sized for the tree (its kept nodes are read back at commit)."""
        B, N = state.ema_hits.shape[0], spec.num_nodes
        return dataclasses.replace(state, inner=self.inner.prepare(state.inner, spec), tree=_empty_tree(B, N),
                                   step_bin=jnp.zeros((B, N), jnp.int32))

    def rho(self, state: AdaptiveState):
        """The history correction per row [B]."""
        return jnp.clip(state.ema_hits / jnp.maximum(state.ema_mass, 1e-6), *RHO_RANGE)

    def step_log_estimates(self, state: AdaptiveState, cell_BxN, real_BxN):
        """log min(1, rho_b * g(cell)) per node (0 where not `real`): each step's acceptance estimate."""
        p = jnp.minimum(self.rho(state)[:, None] * self.calibration(state)[cell_BxN], 1.0)
        return jnp.where(real_BxN, jnp.log(p), 0.0)

    def _prior(self):
        if self.calibration_prior is None:
            centres = (jnp.arange(BINS, dtype=jnp.float32) + 0.5) / BINS
            return jnp.ones((CELLS,), jnp.float32), jnp.tile(centres, DEPTHS)
        return self.calibration_prior.prior(STEP, PRIOR_WEIGHT)

    def calibration(self, state: AdaptiveState):
        """g: the acceptance rate per (depth, confidence bin) cell [CELLS] (prior + this generation's counts)."""
        seen, hits = self._prior()
        return jnp.clip((state.hits + hits) / (state.seen + seen), 1e-4, 1.0)

    def cuts_drafting(self, spec) -> bool:
        """Does the chain stop early (a depth-by-depth drafter's chain of depth >= 3, draft_step_s given)?"""
        return (self.draft_step_s is not None and self.inner.stops_early and tree_lib.is_chain(spec)
                and spec.max_depth >= tree_lib.LOOP_MIN_DEPTH)

    def _round_costs(self, spec):
        """[D + 1]: seconds of a round drafting d = 0..D tokens of the chain and verifying them (+
        the root) at the smallest compiled width that holds them."""
        ws = np.asarray(self.verify_widths(spec))
        D, step = spec.max_depth, self.draft_step_s
        return jnp.asarray([self.costs[int(np.searchsorted(ws, d + 1))] - (D - d) * step for d in range(D + 1)],
                           jnp.float32)

    def _stop(self, state: AdaptiveState, ctx: DraftContext) -> "ChainStop":
        """`DraftContext.stop` for a chain: stop after d tokens unless one more raises expected tokens / s."""
        return ChainStop(self, state, ctx.active, self._round_costs(ctx.spec), ctx.spec.max_depth)

    def propose(self, state: AdaptiveState, root_B, ctx: DraftContext) -> Proposal:
        cut = self.cuts_drafting(ctx.spec)
        if cut:
            ctx = dataclasses.replace(ctx, stop=self._stop(state, ctx))
        prop = self.inner.propose(state.inner, root_B, ctx)
        tree = prop.tree
        B, N = tree.tokens.shape
        D = ctx.spec.max_depth
        real = tree.valid & (jnp.arange(N)[None] > 0)
        par = jnp.maximum(tree.parents, 0)
        step_q = jnp.exp(jnp.minimum(tree.score - jnp.take_along_axis(tree.score, par, axis=1), 0.0))
        step_bin = (jnp.clip(tree.depth - 1, 0, DEPTHS - 1) * BINS
                    + jnp.clip(jnp.floor(step_q * BINS).astype(jnp.int32), 0, BINS - 1))  # the node's cell
        log_g = self.step_log_estimates(state, step_bin, real)
        path = tree_lib.path_sum(log_g, tree.parents, D - 1)  # depth <= D: D - 1 ancestors' terms at most
        tree, probs, perm = order_by_score(tree, prop.probs, rank=path)
        path, step_bin = (jnp.take_along_axis(x, perm, axis=1) for x in (path, step_bin))
        est = jnp.where(tree.valid & (jnp.arange(N)[None] > 0), jnp.exp(jnp.minimum(path, 0.0)), 0.0)
        active = jnp.ones((B,), bool) if ctx.active is None else ctx.active
        costs = jnp.asarray(self.costs, jnp.float32)
        if cut:  # the steps the chain did not draft are not paid for, at any width
            drafted = jnp.max(jnp.sum(tree.valid, axis=1)) - 1
            costs = costs - (D - drafted) * self.draft_step_s
        width = widths_lib.choose_width(est, tree.valid, active, costs, self.verify_widths(ctx.spec))
        valid = widths_lib.keep_below(tree.valid, width)
        tree = dataclasses.replace(tree, valid=valid)
        act = active.astype(jnp.int32)
        kept = jnp.sum(valid[:, 1:], axis=1, dtype=jnp.int32)
        depth = jnp.max(jnp.where(valid, tree.depth, 0), axis=1).astype(jnp.int32)
        st = dataclasses.replace(state, inner=prop.state, tree=tree, step_bin=step_bin,
                                 kept_nodes=state.kept_nodes + act * kept, kept_depth=state.kept_depth + act * depth)
        return Proposal(tree=tree, probs=probs, state=st, est=jnp.where(valid, est, 0.0))

    def commit(self, state: AdaptiveState, committed: Committed) -> AdaptiveState:
        live = committed.count > 0  # a finished row's history stands still
        a = self.decay
        on_path, observed = tree_lib.accepted_nodes(state.tree, committed.tokens, committed.count)
        obs = (observed & live[:, None]).astype(jnp.float32)
        hit = (on_path & observed & live[:, None]).astype(jnp.float32)
        mass = jnp.sum(obs * self.calibration(state)[state.step_bin], axis=1)
        c = self.calibration_decay
        seen = c * state.seen + jnp.zeros((CELLS,)).at[state.step_bin.reshape(-1)].add(obs.reshape(-1))
        hits = c * state.hits + jnp.zeros((CELLS,)).at[state.step_bin.reshape(-1)].add(hit.reshape(-1))
        return dataclasses.replace(
            state, inner=self.inner.commit(state.inner, committed), seen=seen, hits=hits,
            ema_hits=jnp.where(live, a * state.ema_hits + (1 - a) * jnp.sum(hit, axis=1), state.ema_hits),
            ema_mass=jnp.where(live, a * state.ema_mass + (1 - a) * mass, state.ema_mass))

    def loop_stats(self, state: AdaptiveState) -> dict:
        B = state.kept_nodes.shape[0]
        return {**self.inner.loop_stats(state.inner), "adaptive_nodes": state.kept_nodes,
                "adaptive_depth": state.kept_depth,
                # this generation's acceptance counts by (depth, confidence bin) cell (shared by the rows) [B, CELLS]
                "adaptive_seen": jnp.broadcast_to(state.seen, (B, CELLS)),
                "adaptive_hits": jnp.broadcast_to(state.hits, (B, CELLS))}


@dataclasses.dataclass(frozen=True)
class ChainStop(StopRule):
    """The adaptive shape's stop rule for a chain drafted depth by depth (`DraftContext.stop`): after
    d tokens the chain stops unless drafting one more raises the expected tokens per second, the
    tokens not yet drafted estimated from the newest one's (each the newest step's conditional
    estimate times the one before). `cost_D` [D + 1]: a round's seconds drafting d = 0..D tokens."""
    shape: AdaptiveShape
    state: AdaptiveState
    active_B: Any
    cost_D: Any
    depth: int

    def __call__(self, d, score_BxN):
        B, N = score_BxN.shape
        active = jnp.ones((B,), bool) if self.active_B is None else self.active_B
        idx = jnp.arange(N)[None]
        real = jnp.isfinite(score_BxN) & (idx > 0)
        prev = jnp.concatenate([jnp.zeros((B, 1)), score_BxN[:, :-1]], axis=1)
        step_q = jnp.exp(jnp.minimum(jnp.where(real, score_BxN - prev, 0.0), 0.0))
        cell = jnp.clip(idx - 1, 0, DEPTHS - 1) * BINS + jnp.clip(jnp.floor(step_q * BINS).astype(jnp.int32), 0, BINS - 1)
        est = jnp.where(real, jnp.exp(jnp.cumsum(self.shape.step_log_estimates(self.state, cell, real), axis=1)), 0.0)
        act = active.astype(jnp.float32)
        tokens = jnp.sum(act * (1.0 + jnp.sum(est, axis=1)))
        last = jnp.take_along_axis(est, jnp.broadcast_to(d, (B, 1)), axis=1)[:, 0]  # the newest token's
        before = jnp.where(d > 1, jnp.take_along_axis(est, jnp.broadcast_to(d - 1, (B, 1)), axis=1)[:, 0], 1.0)
        ratio = jnp.clip(last / jnp.maximum(before, 1e-6), 0.0, 1.0)  # the newest step's conditional estimate
        k = jnp.arange(1, self.depth + 1, dtype=jnp.float32)  # tokens beyond the newest: 1 .. D
        more_K = jnp.sum(act[:, None] * last[:, None] * ratio[:, None] ** k[None], axis=0)
        gain = jnp.concatenate([jnp.zeros((1,)), jnp.cumsum(more_K)])  # gain[j]: j more tokens
        ahead = jnp.arange(self.depth + 1) - d  # tokens more if the chain stops at d' = 0..D
        best = jnp.max(jnp.where(ahead > 0, (tokens + gain[jnp.clip(ahead, 0, self.depth)]) / self.cost_D, -jnp.inf))
        return best <= tokens / self.cost_D[d]
