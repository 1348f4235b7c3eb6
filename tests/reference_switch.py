"""The Switch composite as it was before it became TreeGraft's "switch" policy (kept as the reference the
policy is tested against, tests/test_switch.py: same outputs, verify widths and acceptance).

Switch: a match drafter's chain where its match is long, a model drafter's chain elsewhere, as ONE
composite drafter behind the ordinary protocol (the engine loop does not know it is there).

Prompt lookup (`ngram`) is free and, where the text repeats, long and right; a learned drafter is
right more often on new text but short and not free. Per round and row (`Switch.propose`, inside the
jitted loop):
  1. the match drafter drafts its chain on the verify spec (e.g. chain=6), and reports the n of the
     n-gram it matched (`match_length`);
  2. rows whose match is at least `min_match` tokens long keep that chain; the others take the model
     drafter's own, shorter tree (`model_tree`, e.g. chain=3), padded to the verify spec with
     invalid nodes;
  3. `lax.cond(any active row needs it)`: the model drafter's propose runs only then (its commit
     rewrites its cache from the committed tokens whether or not it drafted, as TreeGraft's strong
     drafter);
  4. verification runs at the smallest compiled width that holds every row's valid nodes
     (`verify_widths`: the model tree's node count and the verify spec's), so a round the model
     drafter drafts verifies its short chain only: the saving is real compute, not a mask.
Both drafters commit every round. The candidates of a row come from one drafter or the other and
are verified by greedy or the deterministic-candidates rule, lossless whichever proposed them;
sampled rules are refused (the match drafter has no q).

The same split serves production systems: Arctic Inference's suffix decoding falls back to its
EAGLE / MTP drafter when the suffix match scores low, SGLang and vLLM's n-gram proposers return no
draft where nothing matches. Here the fallback is the learned drafter, in the one compiled loop.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from specjax.spec import tree as tree_lib
from specjax.drafters.base import stat_sum, SAMPLED_RULES, Committed, Composite, DraftContext, Drafter, Proposal

MODEL = 1  # TreeBuffers.source of the model drafter's nodes (the match drafter's: 0)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SwitchState:
    matches: Any  # the match drafter's state
    model: Any  # the model drafter's state
    used_model: Any  # bool [B]: the model drafter drafted this round's tree (set by propose)
    model_rounds: Any  # int32 [B]: rounds the model drafter drafted, over the generation
    rounds: Any  # int32 [B]: rounds of an active row


class Switch(Composite):
    """`Switch(matches, model, model_tree="chain=3", min_match=3)`: the match drafter's chain (drafted
    on the verify spec) where its best match is an n-gram of at least `min_match` tokens, the model
    drafter's `model_tree` elsewhere. See the module docstring."""
    name = "switch"
    PARTS = ("matches", "model")

    def __init__(self, matches: Drafter, model: Drafter, *, model_tree: str = "chain=3", min_match: int = 3):
        if not (isinstance(matches, Drafter) and isinstance(model, Drafter)):
            raise ValueError("Switch combines two drafters (specjax.drafters.Drafter): a match drafter, then a model drafter")
        if not (matches.drafts_matches and hasattr(matches, "match_length")):
            raise ValueError(f"Switch's first drafter must draft copied matches and say how long they are "
                             f"(ngram); the {matches.name!r} drafter does not")
        if model.drafts_matches:
            raise ValueError(f"Switch's second drafter must be a model drafter (lm, feature, mtp, block), not {model.name!r}")
        if model.reads_own_tree:
            raise ValueError(f"the {model.name!r} drafter (DPara) commits against the tree it proposed itself, which "
                             "Switch skips on the rounds the match drafter drafts: use it on its own")
        longest = getattr(matches, "max_ngram", None)
        if int(min_match) < 1 or (longest is not None and int(min_match) > longest):
            raise ValueError(f"min_match must be an n-gram length in 1..{longest or 'the longest n-gram'} (the "
                             f"{matches.name!r} drafter matches no longer n-grams), got {min_match}")
        self.matches = matches
        self.model = model
        self.model_tree = tree_lib.parse_tree_spec(model_tree) if isinstance(model_tree, str) else model_tree
        self.min_match = int(min_match)

    def rebuild(self, matches, model) -> "Switch":
        return Switch(matches, model, model_tree=self.model_tree, min_match=self.min_match)

    # -- configuration (host side)

    def _model_spec(self):
        return self.model.resolve_tree(self.model_tree)

    def check_tree(self, spec, rule: str) -> int:
        """Refuses sampled rules and a model tree that does not fit the verify spec; returns the
        scratch slots the two drafters need past their committed caches."""
        if rule in SAMPLED_RULES:
            raise ValueError(f"Switch verifies trees from two drafters, one of which (n-gram) has no q: use greedy or "
                             f"verify='deterministic', not {rule!r}")
        mspec = self._model_spec()
        if mspec.num_nodes > spec.num_nodes or mspec.max_depth > spec.max_depth:
            raise ValueError(f"Switch's model tree ({mspec.num_nodes} nodes, depth {mspec.max_depth}) must fit the verify "
                             f"tree ({spec.num_nodes} nodes, depth {spec.max_depth}): give a longer verify chain")
        # the model drafter writes every node it evaluates (a dynamic tree: its whole expansion pool) past
        # its committed cache, beyond what the verify spec alone would reserve
        evaluated = mspec.pool_size if isinstance(mspec, tree_lib.DynamicTree) else mspec.num_nodes
        return max(self.matches.check_tree(spec, rule), self.model.check_tree(mspec, rule), evaluated)

    def verify_widths(self, spec) -> tuple[int, ...]:
        """The model tree's widths and the match drafter's: a round the model drafter drafts for every
        row verifies its short tree only."""
        widths = set(self.matches.verify_widths(spec)) | set(self.model.verify_widths(self._model_spec()))
        return tuple(sorted(widths))

    # -- the protocol (traced)

    def init(self, prompt_BxP, lengths_B, capacity, target_out) -> SwitchState:
        B = prompt_BxP.shape[0]
        zero = jnp.zeros((B,), jnp.int32)
        return SwitchState(
            matches=self.matches.init(prompt_BxP, lengths_B, capacity, self.part_out(target_out, self.matches)),
            model=self.model.init(prompt_BxP, lengths_B, capacity, self.part_out(target_out, self.model)),
            used_model=jnp.zeros((B,), bool), model_rounds=zero, rounds=zero)

    def prepare(self, state: SwitchState, spec) -> SwitchState:
        return dataclasses.replace(state, matches=self.matches.prepare(state.matches, spec),
                                   model=self.model.prepare(state.model, self._model_spec()))

    def propose(self, state: SwitchState, root_B, ctx: DraftContext) -> Proposal:
        N = ctx.spec.num_nodes
        B = root_B.shape[0]
        mp = self.matches.propose(state.matches, root_B, dataclasses.replace(ctx, stop=None))
        use_model = self.matches.match_length(state.matches, root_B) < self.min_match
        active = jnp.ones((B,), bool) if ctx.active is None else ctx.active
        mctx = DraftContext(self._model_spec(), ctx.mode, ctx.params, ctx.key, active=active & use_model)

        def draft():
            p = self.model.propose(state.model, root_B, mctx)
            return tree_lib.pad_nodes(p.tree, N), p.state

        def skip():  # no row drafts with the model: an all-invalid tree of the same shapes, its state as it was
            empty = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(draft)[0])
            return dataclasses.replace(empty, valid=jnp.zeros_like(empty.valid)), state.model

        mtree, mstate = jax.lax.cond(jnp.any(use_model & active), draft, skip)
        mtree = dataclasses.replace(mtree, source=jnp.where(mtree.valid, MODEL, 0).astype(jnp.int8))
        pick = lambda a, b: jnp.where(use_model.reshape((B,) + (1,) * (a.ndim - 1)), a, b)
        tree = jax.tree.map(pick, mtree, mp.tree)
        return Proposal(tree=tree, probs=None,
                        state=dataclasses.replace(state, matches=mp.state, model=mstate, used_model=use_model))

    def commit(self, state: SwitchState, committed: Committed) -> SwitchState:
        active = (committed.count > 0).astype(jnp.int32)
        return SwitchState(
            matches=self.matches.commit(state.matches, self.part_committed(committed, self.matches)),
            model=self.model.commit(state.model, self.part_committed(committed, self.model)),
            used_model=state.used_model,
            model_rounds=state.model_rounds + active * state.used_model.astype(jnp.int32),
            rounds=state.rounds + active)

    def loop_stats(self, state: SwitchState) -> dict:
        """Engine hook: rounds the model drafter drafted and rounds in all, per row, and each part's own."""
        return {**super().loop_stats(state), "switch_model_rounds": state.model_rounds, "switch_rounds": state.rounds}

    def report(self, stats, row: int | None = None) -> dict:
        rounds = max(stat_sum(stats, "rounds", row), 1)
        model = stat_sum(stats, "switch_model_rounds", row)
        return {**super().report(stats, row),  # rounds the model drafter drafted
                "switch": {"model_rounds": model, "model_round_share": round(model / rounds, 4)}}

