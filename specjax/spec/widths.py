"""Verify widths (design §3b): the few widths a program compiles the target's verification for, and
the one rule that picks a width each round.

A cut that only masks nodes saves nothing, so a drafter that verifies less than its whole tree
(DSpark's confidence scheduler, TAPS's budget, AdaptiveSpec's adaptive shape) keeps a prefix of its
nodes in an order where every prefix is a prefix-closed subtree, and marks the rest invalid; the
engine then runs the smallest compiled width holding every active row's last valid node
(`lax.switch`). All three choose the width the same way, from their own acceptance estimates:

    expected tokens(w) = active rows (one bonus token each) + sum_b sum_{0 < i < w} est_{b,i}
    width = argmax_w expected tokens(w) / costs[w]        (the smallest on ties)

`costs` are the machine's round seconds at each compiled width, profiled once per machine and batch
size (`python -m tools.profile_widths`). The width lists differ by the shape they serve: a chain's
depth in steps 1, 2, 3, 5, 9, ...; a best-first tree's budget in powers of two; the adaptive shape
every width of a small tree.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

CHAIN_STEPS = (1, 2, 3, 5, 9, 17, 33)
TREE_STEPS = (2, 4, 8, 16, 32, 64)
EVERY_WIDTH = 9  # adaptive trees up to this many nodes compile every width


def chain_widths(num_nodes: int) -> tuple[int, ...]:
    """Compiled widths for a cut chain of `num_nodes` nodes: 1, 2, 3, 5, 9, 17, 33 below N, and N."""
    return tuple(w for w in CHAIN_STEPS if w < num_nodes) + (num_nodes,)


def tree_widths(num_nodes: int) -> tuple[int, ...]:
    """Compiled widths for a best-first tree whose budget is chosen per round: 2, 4, 8, ... below N, and N."""
    return tuple(w for w in TREE_STEPS if w < num_nodes) + (num_nodes,)


def adaptive_widths(num_nodes: int) -> tuple[int, ...]:
    """Compiled widths of an adaptive tree: every width up to `EVERY_WIDTH` nodes (a chain's depth is
    chosen exactly), else those of a chain."""
    if num_nodes <= EVERY_WIDTH:
        return tuple(range(1, num_nodes + 1))
    return chain_widths(num_nodes)


def check_widths(widths, num_nodes: int) -> tuple[int, ...]:
    """Verify widths checked on the host (ValueError), as ints: positive integers (node counts, root
    included), strictly ascending, the last the tree's `num_nodes`."""
    try:
        ws = tuple(widths)
    except TypeError:
        raise ValueError(f"verify_widths must be a tuple of node counts, got {widths!r}") from None
    if not ws:
        raise ValueError("verify_widths must hold at least one width (the tree's node count)")
    for w in ws:
        if isinstance(w, bool) or not isinstance(w, (int, np.integer)) or w < 1:
            raise ValueError(f"verify_widths must be positive integers (node counts, root included), got {ws}")
    ws = tuple(int(w) for w in ws)
    if any(b <= a for a, b in zip(ws, ws[1:])):
        raise ValueError(f"verify_widths must be strictly ascending (unique), got {ws}")
    if ws[-1] != num_nodes:
        raise ValueError(f"the last verify width must be the tree's node count {num_nodes}, got {ws}")
    return ws


def choose_width(est_BxN, valid_BxN, active_B, costs_W, widths: tuple[int, ...]):
    """The compiled width maximising expected tokens per second: node i (0 < i < w) of a row is
    accepted with probability est_{b,i} (nodes in an order where every prefix is prefix-closed);
    every active row adds a bonus token. Returns the width (int32 scalar; the smallest on ties)."""
    N = est_BxN.shape[1]
    live = valid_BxN & active_B[:, None] & (jnp.arange(N)[None] > 0)
    gain = jnp.concatenate([jnp.zeros((1,)), jnp.cumsum(jnp.sum(jnp.where(live, est_BxN, 0.0), axis=0))])
    ws = jnp.asarray(widths, jnp.int32)
    bonus = jnp.maximum(jnp.sum(active_B), 1).astype(jnp.float32)
    return ws[jnp.argmax((bonus + gain[ws]) / jnp.asarray(costs_W, jnp.float32))]


def keep_below(valid_BxN, width):
    """The valid mask cut to the first `width` nodes of every row."""
    return valid_BxN & (jnp.arange(valid_BxN.shape[1])[None] < width)


def schedule_keep(conf_BxD, active_B, costs_W, widths: tuple[int, ...]):
    """The DSpark scheduler on a chain: which draft positions to verify [B, D].

    Survival a_{b,k} = prod_{j<=k} c_{b,j} is the probability that row b accepts through position
    k: the chain's node k + 1 is accepted with it. DSpark admits (row, position) pairs by decreasing
    survival while expected throughput rises; here a round costs what its compiled width costs (rows
    are padded to it), so `choose_width` picks the width and every active row verifies its draft up
    to it (positions below the width cost nothing more). Finished rows verify nothing."""
    B, D = conf_BxD.shape
    est_BxN = jnp.concatenate([jnp.zeros((B, 1)), jnp.cumprod(conf_BxD, axis=1)], axis=1)
    width = choose_width(est_BxN, jnp.ones((B, D + 1), bool), active_B, costs_W, widths)
    return (jnp.arange(D)[None] < width - 1) & active_B[:, None]


def budget_keep(key_BxN, valid_BxN, active_B, costs_W, widths: tuple[int, ...]):
    """TAPS's verify budget on a best-first tree (pop order: any prefix is a prefix-closed subtree):
    node i is accepted with estimated probability exp(key_i), the calibrated acceptance estimates
    multiplied along its path. Returns the new valid mask [B, N]."""
    est_BxN = jnp.exp(jnp.minimum(key_BxN, 0.0))
    return keep_below(valid_BxN, choose_width(est_BxN, valid_BxN, active_B, costs_W, widths))


def fill_to_width(keep_BxD, active_B, widths: tuple[int, ...]):
    """A threshold cut's kept drafts, extended to the compiled width they need: the round verifies the
    smallest width holding the longest kept draft anyway, so every active row's positions below it
    cost nothing more (a static program pads rows to the width)."""
    D = keep_BxD.shape[1]
    longest = jnp.max(jnp.where(active_B, jnp.sum(keep_BxD, axis=1), 0))
    ws = jnp.asarray(widths)
    width = ws[jnp.sum(ws < longest + 1)]  # the smallest width >= root + longest
    return (jnp.arange(D)[None] < width - 1) & active_B[:, None]
