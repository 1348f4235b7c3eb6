"""Verification rules (design §3): walk the draft tree with the target's distributions and return
the accepted path, its length and the bonus token per row.

One walk serves every rule. At the current node u with target distribution p(·|u), the children
c1..ck of u are visited in node order with a residual r (initially p):
- deterministic candidates (children a function of the prefix only: top-k, any drafter, mixed
  trees): accept ci with probability r(ci)/Σr; on rejection zero r(ci).
- sampled candidates (children drawn from the drafter's q(·|u)): accept with min(1, r(ci)/q(ci));
  on rejection r ← max(r − q, 0); without replacement also q(ci) ← 0 (both renormalised).
- greedy: p is one-hot at argmax, so the deterministic rule accepts exactly the argmax child.
If no child is accepted, the bonus token is drawn from the final r (argmax for greedy); if the
walk reaches a leaf, from p at that leaf. The output distribution is exactly p at every step.

One rule is lossy, opt-in and never a default (AdaptiveSpec's margin verification, `margin=δ`):
- margin, greedy: at u, a child is accepted if its token is the target's argmax or its target logit
  is within δ of the argmax's: logit(argmax) − logit(c) ≤ δ (of several, the highest logit); the
  bonus is the argmax at the last accepted node. δ = 0 is the greedy rule.
- margin, temperature > 0: the deterministic-candidates walk with the acceptance probability
  relaxed to min(1, e^δ · r(c)/Σr) (residual updates unchanged). δ = 0 is the deterministic rule.
The output then differs from the target's; `LOSSLESS` says which rules keep it.
"""
from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp

from specjax.spec import sampling
from specjax.spec.sampling import SamplingParams
from specjax.spec.tree import TreeBuffers
from specjax.typing import Array, Float, Int

Rule = Literal["greedy", "deterministic", "sampled", "sampled_noreplace", "margin"]
RULES = ("greedy", "deterministic", "sampled", "sampled_noreplace", "margin")
LOSSLESS = {"greedy": True, "deterministic": True, "sampled": True, "sampled_noreplace": True, "margin": False}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Verdict:
    path: Int[Array, "B D+1"]  # accepted node ids, path[:, 0] = 0 (root); padded with the last one
    num_accepted: Int[Array, "B"]  # accepted draft tokens (the root not counted)
    bonus: Int[Array, "B"]  # the target's own token after the last accepted node
    tokens: Int[Array, "B D"]  # accepted draft tokens, padded with 0 past num_accepted


def target_probs(logits_BxNxV, params: SamplingParams, greedy: bool) -> Float[Array, "B N V"]:
    if greedy:
        return jax.nn.one_hot(jnp.argmax(logits_BxNxV, axis=-1), logits_BxNxV.shape[-1], dtype=jnp.float32)
    return jnp.exp(sampling.warp(logits_BxNxV, params))


def _normalise(x):
    s = jnp.sum(x)
    return jnp.where(s > 0, x / jnp.where(s > 0, s, 1.0), x)


def _walk_row(tokens_N, parents_N, valid_N, p_NxV, q_NxV, key, *, max_depth: int, rule: Rule, relax=1.0):
    """`relax` (e^δ, the margin rule at temperature > 0; 1 is lossless) scales the deterministic
    rule's acceptance probability."""
    N = tokens_N.shape[0]
    sampled = rule in ("sampled", "sampled_noreplace")

    def visit(u, key):
        """Visits u's children; returns (accepted child or -1, final residual r)."""
        r = p_NxV[u]
        q = q_NxV[u] if sampled else r

        def child(j, st):
            r, q, acc = st
            t = tokens_N[j]
            is_child = valid_N[j] & (parents_N[j] == u) & (acc < 0) & (j > 0)
            if sampled:
                prob = jnp.where(q[t] > 0, jnp.minimum(1.0, r[t] / jnp.where(q[t] > 0, q[t], 1.0)), 0.0)
            else:
                prob = jnp.minimum(1.0, relax * r[t] / jnp.maximum(jnp.sum(r), 1e-30))
            u01 = jax.random.uniform(jax.random.fold_in(key, j))
            accept = is_child & (u01 < prob)
            reject = is_child & ~accept
            if sampled:
                r_new = _normalise(jnp.maximum(r - q, 0.0))
                # A fully spent residual means q covered p where it is positive: keep p's shape.
                r_new = jnp.where(jnp.sum(r_new) > 0, r_new, r)
                q_new = _normalise(q.at[t].set(0.0)) if rule == "sampled_noreplace" else q
            else:
                r_new, q_new = r.at[t].set(0.0), q
            r = jnp.where(reject, r_new, r)
            q = jnp.where(reject, q_new, q)
            return r, q, jnp.where(accept, j, acc)

        r, _, acc = jax.lax.fori_loop(1, N, child, (r, q, jnp.int32(-1)))
        return acc, r

    def step(d, st):
        cur, going, path, n, r, key = st
        key, sub = jax.random.split(key)
        acc, r_here = visit(cur, sub)
        moved = going & (acc >= 0)
        r = jnp.where(going, r_here, r)  # residual at the node where the walk stops
        cur = jnp.where(moved, acc, cur)
        path = path.at[d + 1].set(cur)
        return cur, moved, path, n + moved.astype(jnp.int32), r, key

    path0 = jnp.zeros((max_depth + 1,), jnp.int32)
    init = (jnp.int32(0), jnp.bool_(True), path0, jnp.int32(0), p_NxV[0], key)
    cur, going, path, n, r, key = jax.lax.fori_loop(0, max_depth, step, init)
    # A walk still going after max_depth stands at a leaf: its residual is p there.
    r = jnp.where(going, p_NxV[cur], r)
    key, sub = jax.random.split(key)
    if rule == "greedy":
        bonus = jnp.argmax(r).astype(jnp.int32)
    else:
        r = _normalise(r)
        bonus = jax.random.categorical(sub, jnp.log(jnp.where(r > 0, r, 1e-38)) + jnp.where(r > 0, 0, -jnp.inf)).astype(jnp.int32)
    return path, n, bonus


def _walk_greedy_row(tokens_N, parents_N, valid_N, argmax_N, *, max_depth: int):
    """The greedy rule without distributions: follow the child whose token is the target's argmax.
    O(depth x N) scalar work instead of vocabulary-sized residual updates."""
    N = tokens_N.shape[0]
    not_root = jnp.arange(N) > 0

    def step(d, st):
        cur, going, path, n = st
        match = valid_N & not_root & (parents_N == cur) & (tokens_N == argmax_N[cur])
        moved = going & jnp.any(match)
        cur = jnp.where(moved, jnp.argmax(match).astype(jnp.int32), cur)
        return cur, moved, path.at[d + 1].set(cur), n + moved.astype(jnp.int32)

    init = (jnp.int32(0), jnp.bool_(True), jnp.zeros((max_depth + 1,), jnp.int32), jnp.int32(0))
    cur, _, path, n = jax.lax.fori_loop(0, max_depth, step, init)
    return path, n, argmax_N[cur]


def _walk_margin_row(tokens_N, parents_N, valid_N, argmax_N, gap_N, margin, *, max_depth: int):
    """The greedy margin rule (lossy): follow the child with the highest target logit among those
    within `margin` of the argmax at its parent (`gap_N`: logit(argmax at parent) - logit(token))."""
    N = tokens_N.shape[0]
    not_root = jnp.arange(N) > 0
    ok_N = valid_N & not_root & ((gap_N <= margin) | (tokens_N == argmax_N[jnp.maximum(parents_N, 0)]))

    def step(d, st):
        cur, going, path, n = st
        match = ok_N & (parents_N == cur)
        moved = going & jnp.any(match)
        best = jnp.argmin(jnp.where(match, gap_N, jnp.inf)).astype(jnp.int32)
        cur = jnp.where(moved, best, cur)
        return cur, moved, path.at[d + 1].set(cur), n + moved.astype(jnp.int32)

    init = (jnp.int32(0), jnp.bool_(True), jnp.zeros((max_depth + 1,), jnp.int32), jnp.int32(0))
    cur, _, path, n = jax.lax.fori_loop(0, max_depth, step, init)
    return path, n, argmax_N[cur]


def verify(tree: TreeBuffers, target_logits_BxNxV, key, *, rule: Rule, max_depth: int,
           params: SamplingParams | None = None, draft_probs_BxNxV=None, margin=0.0, greedy: bool | None = None) -> Verdict:
    """Runs the rule on every row. `draft_probs` (q at each node, the distribution its children
    were drawn from) is required by the sampled-candidate rules only. `margin` (δ >= 0, traced) and
    `greedy` (temperature 0 or not, static) are read by the lossy "margin" rule only."""
    if rule not in RULES:
        raise ValueError(f"unknown verification rule {rule!r}; choose from {', '.join(RULES)}")
    if rule == "margin":
        if greedy is None:
            raise ValueError("rule 'margin' needs greedy= (temperature 0 or not)")
        return _verify_margin(tree, target_logits_BxNxV, key, max_depth=max_depth, params=params, margin=margin,
                              greedy=greedy)
    greedy = rule == "greedy"
    if not greedy and params is None:
        raise ValueError(f"rule {rule!r} needs sampling params (temperature, top_k, top_p)")
    sampled = rule in ("sampled", "sampled_noreplace")
    if sampled and draft_probs_BxNxV is None:
        raise ValueError(f"rule {rule!r} needs the drafter's probabilities at each node")
    if greedy:
        argmax = jnp.argmax(target_logits_BxNxV, axis=-1).astype(jnp.int32)
        walk = jax.vmap(lambda t, par, v, a: _walk_greedy_row(t, par, v, a, max_depth=max_depth))
        path, n, bonus = walk(tree.tokens, tree.parents, tree.valid, argmax)
    else:
        p = target_probs(target_logits_BxNxV, params, greedy)
        q = draft_probs_BxNxV if sampled else p
        keys = jax.random.split(key, tree.tokens.shape[0])
        walk = jax.vmap(lambda t, par, v, p, q, k: _walk_row(t, par, v, p, q, k, max_depth=max_depth, rule=rule))
        path, n, bonus = walk(tree.tokens, tree.parents, tree.valid, p, q, keys)
    toks = jnp.take_along_axis(tree.tokens, path[:, 1:], axis=1)
    toks = jnp.where(jnp.arange(max_depth)[None] < n[:, None], toks, 0)
    return Verdict(path=path, num_accepted=n, bonus=bonus, tokens=toks)


def _verify_margin(tree: TreeBuffers, logits_BxNxV, key, *, max_depth: int, params, margin, greedy: bool) -> Verdict:
    """AdaptiveSpec's margin verification (lossy; see the module docstring)."""
    margin = jnp.maximum(jnp.asarray(margin, jnp.float32), 0.0)
    if greedy:
        argmax = jnp.argmax(logits_BxNxV, axis=-1).astype(jnp.int32)
        par = jnp.maximum(tree.parents, 0)
        at_parent = jnp.take_along_axis(logits_BxNxV, par[..., None], axis=1)  # [B, N, V]: the parent's row
        gap = (jnp.max(at_parent, axis=-1) - jnp.take_along_axis(at_parent, tree.tokens[..., None], axis=-1)[..., 0])
        walk = jax.vmap(lambda t, pa, v, a, g: _walk_margin_row(t, pa, v, a, g, margin, max_depth=max_depth))
        path, n, bonus = walk(tree.tokens, tree.parents, tree.valid, argmax, gap)
    else:
        if params is None:
            raise ValueError("rule 'margin' at temperature > 0 needs sampling params")
        p = target_probs(logits_BxNxV, params, False)
        keys = jax.random.split(key, tree.tokens.shape[0])
        walk = jax.vmap(lambda t, pa, v, p, k: _walk_row(t, pa, v, p, p, k, max_depth=max_depth, rule="deterministic",
                                                         relax=jnp.exp(margin)))
        path, n, bonus = walk(tree.tokens, tree.parents, tree.valid, p, keys)
    toks = jnp.take_along_axis(tree.tokens, path[:, 1:], axis=1)
    toks = jnp.where(jnp.arange(max_depth)[None] < n[:, None], toks, 0)
    return Verdict(path=path, num_accepted=n, bonus=bonus, tokens=toks)
