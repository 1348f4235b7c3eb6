"""The drafter protocol (design §5): one small interface, one file per drafter.

A drafter is an `nnx.Module` (its parameters, if any, are `nnx.Param`s; its configuration is
static) with three pure methods over an explicit state pytree, all called inside the jitted loop:

    state = drafter.init(prompt_BxP, lengths_B, capacity, target_prefill)
    proposal = drafter.propose(state, root_B, ctx)    # a padded draft tree + q at each node
    state = drafter.commit(proposal.state, committed)  # the round's accepted tokens (+ features)

`score(state, tree, max_depth) -> log q [B, N, V]` (used when a stronger drafter rescores another's
tree, TreeGraft: `specjax.treegraft`) lives with the drafters that can do it (lm, feature; not
n-gram). It leaves the state unchanged.

Optional hooks the engine calls when present (composite drafters, TreeGraft):
    scratch = drafter.check_tree(spec, rule)   # on the host, before tracing: ValueError on a bad
                                               # setup; returns the scratch slots it needs past
                                               # each cache's committed length
    stats = drafter.loop_stats(final_state)    # extra per-row statistics ({name: [B] array})
"""
from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import jax

from specjax.sampling import SamplingParams
from specjax.tree import TreeBuffers, TreeSpec
from specjax.typing import Array, Float, Int


@dataclasses.dataclass(frozen=True)
class DraftContext:
    """Static and traced inputs of one `propose` call."""
    spec: TreeSpec  # static
    mode: str  # static: "topk" (deterministic candidates) | "sample" | "sample_noreplace"
    params: SamplingParams  # traced: how q is warped when children are sampled
    key: jax.Array
    features: Any = None  # target features at the root (feature drafters)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SourceScores:
    """Per-source path scores of a multi-drafter tree (TreeGraft), kept side by side: nothing one
    drafter said overwrites another's. Values are cumulative log q from the root; 0 where absent."""
    cheap: Float[Array, "B N"]  # the cheap drafter's, on the nodes it proposed
    strong: Float[Array, "B N"]  # the strong drafter's, on the nodes it scored or grafted
    has_cheap: Any  # bool [B, N]
    has_strong: Any  # bool [B, N]
    origin: Int[Array, "B N"]  # index of the node in the candidate pool (cheap tree, then grafts)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Proposal:
    tree: TreeBuffers
    probs: Float[Array, "B N V"] | None  # q(·|node) the node's children were drawn from
    state: Any
    scores: SourceScores | None = None  # multi-drafter trees only


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Committed:
    """What the target kept this round: the root and the accepted draft tokens, in order."""
    tokens: Int[Array, "B D+1"]  # padded with 0 past `count`
    count: Int[Array, "B"]  # accepted + 1 (the root)
    positions: Int[Array, "B D+1"]  # absolute positions of `tokens`
    features: Any = None  # target hidden states along the accepted path (feature drafters)


class Drafter(Protocol):
    name: str
    vocab_size: int | None  # None: works with any vocabulary (n-gram)
    target_layers: tuple[int, ...]  # target hidden layers it reads (feature drafters)

    def init(self, prompt_BxP, lengths_B, capacity: int, target_out) -> Any: ...
    def propose(self, state, root_B, ctx: DraftContext) -> Proposal: ...
    def commit(self, state, committed: Committed) -> Any: ...
