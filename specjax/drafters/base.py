"""The drafter contract (design §5): one small interface, one file per drafter.

A drafter is an `nnx.Module` subclass of `Drafter` (its parameters, if any, are `nnx.Param`s; its
configuration is static) with three pure methods over an explicit state pytree, all called inside
the jitted loop:

    state = drafter.init(prompt_BxP, lengths_B, capacity, target_prefill)
    proposal = drafter.propose(state, root_B, ctx)    # a padded draft tree + q at each node
    state = drafter.commit(proposal.state, committed)  # what the target kept this round

Everything else the engine, TreeGraft, the CLI and the benches ask of a drafter is declared here
with its default, so a new drafter writes only what it does differently:

capabilities (class attributes, read on the host; never a check of the drafter's name)
    gives_q              `Proposal.probs` holds the q its children were drawn from, so the
                         sampled-candidates rules apply (n-gram: False, deterministic candidates)
    can_score            `score(state, tree, max_depth)` rescores another drafter's tree (TreeGraft's
                         strong drafter)
    target_layers        target hidden layers it reads (feature drafters); `Committed.features`
    attends              it has attention that FOLD can replace (`with_fold`; lm, feature)
    stops_early          it honours `DraftContext.stop` on chains (drafts depth by depth and can end
                         early, saving the steps it does not run; lm, feature)
    reads_own_tree       its commit reads `Committed.nodes` against the tree it proposed itself (DPara's
                         per-node precomputed blocks): a composite that rebuilds or reorders the tree
                         (TreeGraft, the adaptive shape) refuses it
    drafts_matches       its candidates are copied matches (n-gram), free and unscored: TreeGraft takes
                         its trie as the cheap tree as is (no larger-than-budget expansion by q)
    default_tree         the tree spec used when the caller gives none (default "chain=4"; a block
                         drafter: its block)
    partition_rules      its parameters' layout on a (data, model) mesh: (regex on the parameter's
                         path, PartitionSpec) pairs (design §10, `specjax.models.sharding`); default: the dense
                         family's table, whose names (q_proj, mlp/down_proj, ...) the drafters' layers share

hooks (host side, before tracing)
    resolve_tree(spec) -> the spec with what the drafter decides filled in (a best-first tree's depth:
                         a block drafter's block); default: the spec as given
    check_tree(spec, rule) -> scratch slots it needs past each cache's committed length; raises
                         ValueError on a setup it cannot draft (default: sampled rules need gives_q)
    validate(capacity)   its own checks against the cache capacity (default: none)
    with_fold(cfg)       the same drafter (same weights) with FOLD on (cfg) or off (None)
    with_weights(dtype)  the drafter with its own network's projection weights stored as dtype
                         (float32 / bfloat16 / int8, `specjax.models.quant`), in place; the parts it
                         borrows from the target stay as the target has them. `OWN` names the
                         attributes holding its own network (default none: nothing to store)
    verify_widths(spec) -> the static tree widths (node counts, root included, ascending, the last
                         spec.num_nodes) the program compiles verification for; each round verifies
                         the smallest that holds every active row's last valid node (`lax.switch`,
                         design §3b). Default (spec.num_nodes,): one width, no switch. A drafter that
                         cuts its drafts (trailing nodes invalid) returns several, e.g. (1, 3, 5, 9)

hooks (traced)
    prepare(state, spec) -> state                      after init, before the first round: buffers sized
                                                        for the tree (default: the state as it is)
    score(state, tree, max_depth, per_depth) -> log q [B, N, V]   (can_score drafters only)
    loop_stats(final_state) -> {name: [B] array}        extra per-row statistics (default: none)
    report(stats, row) -> {section: value}               its statistics of one row, JSON-ready, on the host
    with_options(**options) -> Drafter                   per-run options of its own (default: none taken)
    state_partition(state, batch) -> PartitionSpecs     its state's layout on a mesh (a prefix of the
                                                        state; default `sharding.batch_partition`: KV
                                                        caches as the target's, batch-major arrays over
                                                        `data`, the rest replicated)
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import PyTree

from specjax.models import sharding
from specjax.models.kvcache import KVCache
from specjax.models import quant, transformer
from specjax.models.hybrid import HybridCache
from specjax.spec.sampling import SamplingParams
from specjax.spec.tree import BestFirstTree, TreeBuffers, TreeSpec
from specjax.typing import Array, Bool, Float, Int, PRNGKey

SAMPLED_RULES = ("sampled", "sampled_noreplace")


class StopRule:
    """A declared per-round hook of a depth-by-depth chain: after its d-th token (traced d >= 1;
    `score_BxN`: cumulative log q so far, -inf past d) the chain may stop; the nodes past it stay
    invalid and their drafting steps are not run. The adaptive shape gives one (`adaptive.ChainStop`);
    drafters with `stops_early` honour it (lm, feature, MTP)."""

    def __call__(self, d, score_BxN) -> Bool[Array, ""]:
        raise TypeError(f"{type(self).__name__} does not define __call__")


def stat_sum(stats, key: str, row: int | None = None) -> int:
    """A per-row statistic of `GenerationResult.stats` at one row, or summed over all rows (None)."""
    v = np.asarray(stats[key])
    return int(v.sum() if row is None else v[row])


@dataclasses.dataclass(frozen=True)
class DraftContext:
    """Static and traced inputs of one `propose` call."""
    spec: TreeSpec  # static
    mode: str  # static: "topk" (deterministic candidates) | "sample" | "sample_noreplace"
    params: SamplingParams  # traced: how q is warped when children are sampled
    key: PRNGKey
    active: Bool[Array, "B"] | None = None  # rows still generating (None: all); a finished row's draft is never verified
    stop: StopRule | None = None  # a chain drafted depth by depth may stop early (None: draft the whole tree)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Proposal:
    tree: TreeBuffers
    probs: Float[Array, "B N V"] | None  # q(·|node) the node's children were drawn from
    state: PyTree  # the drafter's state after drafting
    # per-node acceptance estimates (calibrated, e.g. the adaptive shape's), read by packed verification's
    # goodput budget (`specjax.spec.packing`); None: exp(tree.score), the drafter's own path probability
    est: Float[Array, "B N"] | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Committed:
    """What the target kept this round: the root and the accepted draft tokens, in order, and the
    target's committed state after the round."""
    tokens: Int[Array, "B D+1"]  # padded with 0 past `count`
    count: Int[Array, "B"]  # accepted + 1 (the root); 0 for a finished row
    # target hidden states along the accepted path, the drafter's `target_layers` concatenated (None: it reads none)
    features: Float[Array, "B D+1 F"] | None = None
    # The target's cache after this round's commit: a `KVCache` (length = committed tokens), or for a
    # hybrid target a `HybridCache` whose `state` / `conv` are the recurrent and convolution states
    # after the last accepted token (design §5; ReaDy reads them).
    target: KVCache | HybridCache | None = None
    # tree node indices of `tokens` in this round's proposed tree (the accepted path, root = 0; valid
    # below `count`): a drafter that precomputed something per node of its own tree reads it (DPara)
    nodes: Int[Array, "B D+1"] | None = None


REGISTRY: dict[str, type] = {}


def register(cls):
    """Class decorator: the drafter kind `cls.name` is loaded by `cls.load` (`load_drafter`: a
    directory whose `drafter_config.json` says `"drafter": name`, or the bare name where the class
    sets `by_name`)."""
    if REGISTRY.get(cls.name, cls) is not cls:
        raise ValueError(f"drafter kind {cls.name!r} is registered twice ({REGISTRY[cls.name].__name__}, {cls.__name__})")
    REGISTRY[cls.name] = cls
    return cls


class Drafter(nnx.Module):
    """Base class of every drafter: the declared capabilities and optional hooks, with defaults."""
    name: ClassVar[str] = "drafter"
    vocab_size: int | None = None  # None: works with any vocabulary (n-gram)
    target_layers: tuple[int, ...] = ()
    gives_q: ClassVar[bool] = False
    can_score: ClassVar[bool] = False
    attends: ClassVar[bool] = False
    drafts_matches: ClassVar[bool] = False
    stops_early: ClassVar[bool] = False
    reads_own_tree: ClassVar[bool] = False
    default_tree: ClassVar[str] = "chain=4"  # a drafter may make it a property (a block drafter: its block)
    partition_rules: ClassVar[tuple] = transformer.PARTITION_RULES
    by_name: ClassVar[bool] = False  # `load_drafter(name)` loads it without a directory (ngram, mtp)
    OWN: ClassVar[tuple[str, ...]] = ()  # attributes holding its own network (`with_weights`)

    @classmethod
    def load(cls, spec: str, target, **options) -> "Drafter":
        """The drafter `spec` names (a directory, or the bare name of a `by_name` class), for `target`.
        The keywords it declares are the `load_drafter` options it takes (fold, confidence, costs,
        draft_vocab, target_path); `load_drafter` refuses any other before anything is read."""
        raise TypeError(f"the {cls.name!r} drafter is built in Python, not loaded (it defines no load)")

    # -- the protocol (traced)

    def init(self, prompt_BxP, lengths_B, capacity: int, target_out) -> PyTree:
        raise TypeError(f"{type(self).__name__} does not define init")

    def propose(self, state, root_B, ctx: DraftContext) -> Proposal:
        raise TypeError(f"{type(self).__name__} does not define propose")

    def commit(self, state, committed: Committed) -> PyTree:
        raise TypeError(f"{type(self).__name__} does not define commit")

    # -- optional hooks, with their defaults

    def prepare(self, state, spec: TreeSpec) -> PyTree:
        """Traced once, after `init` and before the first round: the state with whatever it keeps
        per tree node sized for `spec` (the adaptive shape's round buffers). Default: unchanged."""
        return state

    def score(self, state, tree: TreeBuffers, max_depth: int | None = None, per_depth: int | None = None):
        """log q(·|node) at every node of another drafter's tree [B, N, V]; the state is unchanged.
        `per_depth`: at most that many valid nodes at any depth (a drafter that scores depth by depth may
        evaluate only those, with N + per_depth scratch slots; others ignore it)."""
        raise ValueError(f"the {self.name!r} drafter cannot score another drafter's tree (can_score=False)")

    def resolve_tree(self, spec: TreeSpec) -> TreeSpec:
        """On the host before tracing: the spec with what this drafter decides filled in."""
        return spec

    def check_tree(self, spec: TreeSpec, rule: str) -> int:
        """On the host before tracing: ValueError on a setup this drafter cannot draft; returns the
        scratch slots it needs past its cache's committed length beyond the tree's own (0)."""
        if isinstance(spec, BestFirstTree):
            raise ValueError(f"a best-first tree (ddtree / treeflash) is drafted from a block drafter's per-depth "
                             f"tables; the {self.name!r} drafter gives none (use a chain, a path list or a dynamic tree)")
        if rule in SAMPLED_RULES and not self.gives_q:
            raise ValueError(f"the {self.name!r} drafter proposes deterministic candidates (no q to sample from); "
                             f"use verify='deterministic', not {rule!r}")
        return 0

    def validate(self, capacity: int) -> None:
        """On the host before tracing: checks against the cache capacity (e.g. FOLD's window)."""

    def with_fold(self, cfg) -> "Drafter":
        """The same drafter (same weights) with FOLD on (`cfg`, a `specjax.models.fold.FoldConfig`) or off (None)."""
        if cfg is None:
            return self
        raise ValueError(f"FOLD changes a drafter's attention; the {self.name!r} drafter has none "
                         "(use it with an lm or feature drafter)")

    @property
    def has_own_weights(self) -> bool:
        return bool(self.OWN)

    def with_weights(self, weights: str) -> "Drafter":
        """This drafter with the projection weights of its own network (`OWN`) stored as `weights`, in
        place (`quant.quantize_linears`); returns it. The target's parts it borrows are not touched.
        Losslessness does not depend on it: the target verifies whatever is drafted."""
        quant.check_weights(weights)
        if weights != "float32":
            if not self.has_own_weights:
                raise ValueError(f"the {self.name!r} drafter has no network of its own to store at {weights}")
            for n in self.OWN:
                quant.quantize_linears(getattr(self, n), weights)
        return self

    def verify_widths(self, spec: TreeSpec) -> tuple[int, ...]:
        """On the host before tracing: the tree widths (node counts, root included, ascending and
        unique, the last == spec.num_nodes) the program compiles the target's verification for.
        Each round runs the smallest width that holds every active row's last valid node, so a
        drafter that cuts its drafts (marks trailing nodes invalid in `Proposal.tree.valid`) saves
        the target's compute on the cut nodes (design §3b). Default: one width, the whole tree."""
        return (spec.num_nodes,)

    def loop_stats(self, state) -> dict:
        """Extra per-row statistics of a whole generation, from the final state ({name: [B] array})."""
        return {}

    def report(self, stats, row: int | None = None) -> dict:
        """On the host after a generation: this drafter's own statistics of one row (None: all rows
        summed), as a JSON-ready {section: {name: value}} (the CLI's --json and the bench read them
        here, never by key). `stats`: `GenerationResult.stats` (`stat_sum` reads one). Default: none."""
        return {}

    def with_options(self, **options) -> "Drafter":
        """On the host: this drafter with per-run options of its own (`specjax.drafters.compose`'s
        single-drafter options: a block drafter's confidence cut, DPara's boundaries, ReaDy's zeroed
        state). Default: takes none."""
        if options:
            raise ValueError(f"the {self.name!r} drafter takes no option {', '.join(sorted(options))}")
        return self

    def state_partition(self, state, batch: int):
        """Traced: PartitionSpecs for the state on a (data, model) mesh, a prefix of its pytree
        (`specjax.models.sharding.constrain` pins the loop's drafter state to it every round)."""
        return sharding.batch_partition(state, batch)


class Composite(Drafter):
    """A drafter built over others (AdaptiveShape over one, TreeGraft and Switch over two): `PARTS` names the
    attributes holding what it wraps, `rebuild(**parts)` makes the same composite over other parts.
    Everything the contract declares is forwarded from the parts unless the composite overrides it,
    so wrapping a drafter never drops a capability or a hook:

        vocab_size        the parts' one vocabulary (None only if every part works with any)
        target_layers     the union of the parts' (the engine gathers them once for all)
        attends           any part's (FOLD composes through: `with_fold` reaches each part that attends)
        has_own_weights   any part's (`with_weights` reaches each part that has a network of its own)
        partition_rules   every part's rules (regexes on the parameter path also match under the part's
                          attribute), so a wrapped drafter is sharded on a mesh as the bare one
        resolve_tree, default_tree, verify_widths   the primary part's (`PRIMARY`, default the first)
        check_tree        every part's (the scratch they need: the most any asks)
        validate          every part's
        loop_stats        every part's, merged (a name two parts share: prefixed with the attribute)
        report            every part's sections, merged (a composite adds its own)
        state_partition   every part's, for its field of the composite's state; the composite's own
                          fields by the default (`sharding.batch_partition`)

    A composite's state is a registered dataclass with one field per part, named as the part's
    attribute (what `loop_stats` and `state_partition` read).
    """
    PARTS: ClassVar[tuple[str, ...]] = ()
    PRIMARY: ClassVar[str] = ""  # the part whose tree hooks are forwarded (default: the first)

    def primary(self) -> Drafter:
        return getattr(self, self.PRIMARY or self.PARTS[0])

    def parts(self) -> tuple[Drafter, ...]:
        return tuple(getattr(self, n) for n in self.PARTS)

    def rebuild(self, **parts) -> "Composite":
        """The same composite (same settings) over other parts (e.g. with FOLD on)."""
        raise TypeError(f"{type(self).__name__} does not define rebuild")

    def part_out(self, target_out, part: Drafter):
        """The target's prefill output as `part` reads it: the hidden states of its own
        `target_layers` (the engine gathers the union of the parts' layers once)."""
        if not self.target_layers:
            return target_out
        return dataclasses.replace(target_out, hidden=tuple(
            target_out.hidden[self.target_layers.index(layer)] for layer in part.target_layers))

    def part_committed(self, committed: Committed, part: Drafter) -> Committed:
        """`committed` as `part` reads it: the features of its own `target_layers` only."""
        if committed.features is None or not self.target_layers:
            return committed
        chunks = jnp.split(committed.features, len(self.target_layers), axis=-1)
        feats = (jnp.concatenate([chunks[self.target_layers.index(layer)] for layer in part.target_layers], axis=-1)
                 if part.target_layers else None)
        return dataclasses.replace(committed, features=feats)

    @property
    def vocab_size(self):
        sizes = {p.vocab_size for p in self.parts()} - {None}
        if len(sizes) > 1:
            raise ValueError(f"the drafters {type(self).__name__} combines have different vocabularies: {sorted(sizes)}")
        return sizes.pop() if sizes else None

    @property
    def target_layers(self) -> tuple[int, ...]:
        return tuple(sorted(set().union(*(p.target_layers for p in self.parts()))))

    @property
    def attends(self) -> bool:
        return any(p.attends for p in self.parts())

    @property
    def partition_rules(self) -> tuple:
        rules = []
        for p in self.parts():
            rules += [r for r in p.partition_rules if r not in rules]
        return tuple(rules)

    @property
    def default_tree(self) -> str:
        return self.primary().default_tree

    def resolve_tree(self, spec: TreeSpec) -> TreeSpec:
        return self.primary().resolve_tree(spec)

    def check_tree(self, spec: TreeSpec, rule: str) -> int:
        return max(p.check_tree(spec, rule) for p in self.parts())

    def validate(self, capacity: int) -> None:
        for p in self.parts():
            p.validate(capacity)

    def verify_widths(self, spec: TreeSpec) -> tuple[int, ...]:
        return self.primary().verify_widths(spec)

    def with_fold(self, cfg) -> "Drafter":
        """FOLD on (or off) in every part that attends; ValueError when none does."""
        if cfg is not None and not self.attends:
            raise ValueError(f"FOLD changes a drafter's attention; none of the drafters {type(self).__name__} "
                             f"combines ({', '.join(repr(p.name) for p in self.parts())}) has any")
        return self.rebuild(**{n: (p.with_fold(cfg) if p.attends else p) for n, p in zip(self.PARTS, self.parts())})

    @property
    def has_own_weights(self) -> bool:
        return any(p.has_own_weights for p in self.parts())

    def with_weights(self, weights: str) -> "Drafter":
        """`with_weights` on every part that has a network of its own (in place); returns the composite."""
        quant.check_weights(weights)
        if weights != "float32" and not self.has_own_weights:
            raise ValueError(f"none of the drafters {type(self).__name__} combines "
                             f"({', '.join(repr(p.name) for p in self.parts())}) has a network of its own")
        for p in self.parts():
            if p.has_own_weights:
                p.with_weights(weights)
        return self

    def state_partition(self, state, batch: int):
        spec = sharding.batch_partition(state, batch)
        return dataclasses.replace(spec, **{n: p.state_partition(getattr(state, n), batch)
                                            for n, p in zip(self.PARTS, self.parts())})

    def loop_stats(self, state) -> dict:
        out: dict = {}
        for n, p in zip(self.PARTS, self.parts()):
            for k, v in p.loop_stats(getattr(state, n)).items():
                out[f"{n}_{k}" if k in out else k] = v
        return out

    def report(self, stats, row: int | None = None) -> dict:
        out: dict = {}
        for p in self.parts():
            out.update(p.report(stats, row))
        return out
