"""`BlockDrafter`: DSpark (deepseek-ai/DeepSpec) and DFlash as its ablation behind the drafter
contract (design §5b). ReaDy (`ReadyDrafter`, `ready_drafter.py`) and DPara (`DParaDrafter`,
`dpara.py`) are drafters of their own over the same block network, subclasses that override the hooks
they change; `BlockDrafter.for_config` picks the class a head's config needs (its loader does).
Best-first trees are functions of the drafter (`best_first.py`).

Confidence cuts (a cut only removes proposals, so every rule stays lossless):
    off          the whole block (up to the tree's depth) is verified
    threshold t  each row's draft stops before its first position with c_k < t; the round verifies
                 the smallest compiled width holding the longest kept draft, and every row drafts
                 up to it (free: rows are padded to the width)
    schedule     the DSpark scheduler's objective: survival a_{b,i} = prod_{j<=i} c_{b,j}; expected
                 throughput (bonus + expected accepted tokens) / cost(verify width), maximised over
                 the compiled widths (`specjax.spec.widths`); `costs` are the round times per width
                 measured once per machine and batch size (`python -m tools.profile_widths`)
Trees: a static or dynamic tree spec of depth <= W is drafted from the same single backbone pass;
a node at depth d holding token x gets the children of b_d + W2(W1[x]), the Markov head's exact
conditional row (DFlash: the marginal b_d), expanded depth by depth through the head alone
(`tree.expand`). Confidence cuts apply to chains only. A cut selects one of a few compiled verify
widths (`verify_widths`, the engine's `lax.switch`, design §3b), so a shorter draft is a cheaper
verification, not a masked one.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from specjax.models import attention as attention_lib
from specjax.models import kvcache
from specjax.spec import sampling
from specjax.spec import tree as tree_lib
from specjax.spec import widths as widths_lib
from specjax.drafters import heads
from specjax.drafters.base import Committed, DraftContext, Proposal, register
from specjax.drafters.block import best_first
from specjax.drafters.block.checkpoint import load_block_head
from specjax.drafters.block.config import check_confidence, parse_confidence
from specjax.drafters.block.network import (
    BlockHead,
    BlockPass,
    BlockState,
    backbone,
    base_logits,
    block_input,
    confidence_logit,
    context,
    context_kv,
    drafted_slots,
    markov_embed,
    position_logits,
    row_logits,
    target_features,
    widen,
)
from specjax.models.kvcache import KVCache
from specjax.models import transformer
from specjax.spec.calibration import Calibration, read_calibration


@register
class BlockDrafter(heads.HeadDrafter):
    """DSpark / DFlash behind the drafter contract. `confidence`: "off", a threshold in (0, 1), or
    "schedule" (then `costs`: seconds per round at each of `widths`, profiled for this machine and
    batch size). `widths`: the compiled verify widths when cutting (default `widths.chain_widths`).
    Best-first trees (`ddtree,...` / `treeflash,...` specs, design §5e) are drafted from the same one
    backbone pass; `select=taps` needs `path_calibration` (the directory's `calibration.json`, its row kinds),
    and with `costs` (round seconds per width of `widths.tree_widths`, confidence off) chooses each round's
    verify budget."""
    name = "block"
    gives_q = True
    # the dense table for the backbone's layers; the Markov head's tables split the vocabulary as the LM head
    partition_rules = transformer.PARTITION_RULES + (
        (r"markov_embed$", jax.sharding.PartitionSpec("model", None)),
        (r"markov_out$", jax.sharding.PartitionSpec(None, "model")),
    )

    can_score = True  # its q at a node depends on the block and the node's own token only: exact, one pass
    RUN_OPTIONS = ("confidence", "costs")  # `with_options` (a subclass adds its own)

    tuned_tree: str | None = None  # the tree of its `tuned.json`, when loaded with one

    @property
    def default_tree(self) -> str:
        return self.tuned_tree or f"chain={self.head.config.drafts}"

    @default_tree.setter
    def default_tree(self, tree: str) -> None:
        self.tuned_tree = tree

    @staticmethod
    def for_config(cfg) -> type:
        """The drafter class a block head of config `cfg` needs: `DParaDrafter` for a boundary head,
        `ReadyDrafter` for one that reads the target's state, else `BlockDrafter`."""
        for sub in BlockDrafter.__subclasses__():
            if sub.takes(cfg):
                return sub
        return BlockDrafter

    @classmethod
    def takes(cls, cfg) -> bool:
        """Whether a head of config `cfg` is this class's (a subclass says which heads are its own)."""
        return not any(sub.takes(cfg) for sub in BlockDrafter.__subclasses__())

    def __init__(self, head: BlockHead, target, confidence="off", costs=None, widths=None,
                 path_calibration: Calibration | None = None):
        cfg = head.config
        self.check_target(cfg, target, "block")
        if not type(self).takes(cfg):
            raise ValueError(f"this block head needs {BlockDrafter.for_config(cfg).__name__} (a "
                             f"{'DPara' if cfg.boundary else 'ReaDy'} head), not {type(self).__name__}: "
                             "BlockDrafter.for_config(head.config) gives the class, load_drafter picks it")
        self.head = head
        self.target = target  # shared: embedding and LM head
        self.confidence = check_confidence(confidence, cfg)
        if self.confidence == "schedule":
            if costs is None:
                raise ValueError("confidence='schedule' needs costs: round seconds per verify width for this machine "
                                 "and batch size (python -m tools.profile_widths)")
        if costs is not None and not all(math.isfinite(c) and c > 0 for c in map(float, costs)):
            raise ValueError("costs must be positive round seconds per verify width")
        if costs is not None and self.confidence not in ("off", "schedule"):
            raise ValueError("costs go with confidence='schedule' (a chain) or with a TAPS tree "
                             "(select=taps, confidence off); a threshold cut takes none")
        self.path_calibration = path_calibration
        self.costs = None if costs is None else tuple(float(c) for c in costs)
        self.widths = None if widths is None else tuple(int(w) for w in widths)

    def run_options(self) -> dict:
        """The options `with_options` takes, as this drafter has them."""
        return {"confidence": self.confidence, "costs": self.costs}

    def with_options(self, **options) -> "BlockDrafter":
        """This drafter's head with other run options (those not given are kept): the confidence cut
        ("off", a threshold, "schedule" with `costs`); DPara's boundaries, ReaDy's zeroed state."""
        unknown = sorted(set(options) - set(self.RUN_OPTIONS))
        if unknown:
            owners = {o: sub.__name__ for sub in BlockDrafter.__subclasses__() for o in sub.RUN_OPTIONS
                      if o not in BlockDrafter.RUN_OPTIONS}
            raise ValueError(f"the {self.name!r} drafter takes no option {', '.join(unknown)} (it takes "
                             f"{', '.join(self.RUN_OPTIONS)}; " + "; ".join(
                                 f"{o} is {owners[o].removesuffix('Drafter')}'s" for o in unknown if o in owners) + ")")
        kw = {**self.run_options(), **{k: v for k, v in options.items() if v is not None}}
        kw["confidence"] = parse_confidence(kw["confidence"])
        out = type(self)(self.head, self.target, widths=self.widths, path_calibration=self.path_calibration, **kw)
        out.tuned_tree = self.tuned_tree
        return out

    @classmethod
    def load(cls, spec: str, target, *, confidence="off", costs=None) -> "BlockDrafter":
        """The drafter of the head in `spec`, of the class its config needs (`for_config`)."""
        head = load_block_head(spec, dtype=target.config.dtype)
        klass = BlockDrafter.for_config(head.config)
        if not issubclass(klass, cls):
            raise ValueError(f"{spec}: a head for {klass.__name__}, not {cls.__name__}")
        return klass(head, target, confidence=confidence, costs=costs, path_calibration=read_calibration(spec))

    def check_tree(self, spec, rule: str) -> int:
        W = self.head.config.drafts
        if isinstance(spec, tree_lib.BestFirstTree):
            best_first.check(self, spec, rule)
            return self.scratch_slots(spec.num_nodes)
        super().check_tree(spec, rule)
        if spec.max_depth > W:
            raise ValueError(f"tree depth {spec.max_depth} is deeper than the block drafter's block ({W} draft positions): "
                             f"use a tree of depth <= {W}")
        if not tree_lib.is_chain(spec) and self.confidence != "off":
            raise ValueError("confidence cuts apply to a chain (tree='chain=k'); a tree from the block drafter "
                             "needs confidence='off'")
        if self.confidence == "schedule" and len(self.costs) != len(self.verify_widths(spec)):
            raise ValueError(f"costs has {len(self.costs)} entries for the verify widths {self.verify_widths(spec)}")
        return self.scratch_slots(spec.num_nodes)

    def scratch_slots(self, num_nodes: int) -> int:
        """Slots past the committed context a round writes: the block's W."""
        return self.head.config.block_size

    def resolve_tree(self, spec):
        return best_first.resolve(self.head.config, spec)

    def verify_widths(self, spec) -> tuple[int, ...]:
        if isinstance(spec, tree_lib.BestFirstTree):
            return best_first.widths(self, spec)
        if self.confidence == "off" or not tree_lib.is_chain(spec):
            return (spec.num_nodes,)
        return widths_lib.check_widths(self.widths or widths_lib.chain_widths(spec.num_nodes), spec.num_nodes)

    def _empty_cache(self, B, capacity):
        c = self.head.config
        return kvcache.init(c.num_layers, B, capacity, c.num_kv_heads, c.head_dim, self.dtype)

    def _extend(self, cache: KVCache, features_BxTxF, count_B) -> KVCache:
        B, T = features_BxTxF.shape[:2]
        pos = cache.length[:, None] + jnp.arange(T)[None]
        for i, (k, v) in enumerate(context_kv(self.head, context(self.head, features_BxTxF), pos)):
            cache = kvcache.write(cache, i, k, v)
        return kvcache.advance(cache, count_B)

    def init(self, prompt_BxP, lengths_B, capacity, target_out) -> BlockState:
        B = prompt_BxP.shape[0]
        z = jnp.zeros((B,), jnp.int32)
        return BlockState(self._extend(self._empty_cache(B, capacity), target_features(target_out), lengths_B), z, None)

    def block_pass(self, state: BlockState, root_B) -> BlockPass:
        """This round's block: the backbone pass (`draft_block`; DPara: the block chosen at the last commit)."""
        return self.draft_block(state, root_B)

    def inject(self, state: BlockState):
        """What the backbone adds at its reader layer (`network.backbone`'s `inject`): None (ReaDy: its
        read of the target's committed state)."""
        return None

    def draft_block(self, state: BlockState, root_B):
        """The backbone pass: base logits [B, W, V], final hidden states [B, W, E], and the cache with
        the block's K/V in its scratch slots (length unchanged: commit overwrites them; handing it
        on, rather than the cache before, spares XLA a copy of the whole cache per round)."""
        cfg = self.head.config
        B, W = root_B.shape[0], cfg.block_size
        cache = state.cache
        pos = cache.length[:, None] + jnp.arange(W)[None]
        bound = attention_lib.DENSE.bind(cache, pos, jnp.ones((B, W, W), bool))

        def attend(i, q, k, v):
            nonlocal cache
            cache = kvcache.write(cache, i, k, v)  # scratch slots length..length+W-1
            return bound(q, cache, i)

        h, pre = backbone(self.head, block_input(self.head, self.target, root_B[:, None]), pos, attend, self.inject(state))
        h, pre = drafted_slots(cfg, h), drafted_slots(cfg, pre)  # draft position d: slot d (or d + 1)
        return BlockPass(base_logits(self.head, self.target, h), h, cache, pre)

    def propose(self, state: BlockState, root_B, ctx: DraftContext) -> Proposal:
        return self._draft(state, self.block_pass(state, root_B), root_B, ctx)

    def _draft(self, state: BlockState, blk: BlockPass, root_B, ctx: DraftContext) -> Proposal:
        cfg = self.head.config
        d = ctx.spec.max_depth
        B = root_B.shape[0]
        base, h, cache, pre = blk
        if isinstance(ctx.spec, tree_lib.BestFirstTree):
            return best_first.propose(self, state, cache, base, h, pre, root_B, ctx)
        if not tree_lib.is_chain(ctx.spec):
            return self._propose_tree(state, cache, blk, root_B, ctx)
        active = jnp.ones((B,), bool) if ctx.active is None else ctx.active
        temps = jnp.asarray(cfg.confidence_temperatures or (1.0,) * cfg.drafts, jnp.float32)
        V = self.vocab_size
        # A greedy walk over a draft vocabulary scores its N tokens only (argmax there, then the id): the
        # full-vocabulary row is -inf outside them, so the token and its log q are the same.
        narrow = ctx.mode == "topk" and self.head.vocab_ids is not None

        def walk(k, carry):  # the Markov walk, the only sequential part: one step per position, in a loop
            prev, toks, logqs, probs, confs = carry
            m = markov_embed(self.head, prev)
            at = lambda x: None if x is None else x[:, k]  # noqa: E731
            logits = row_logits(self.head, self.target, at(base), at(pre), h[:, k], prev, wide=not narrow)
            lq = jax.nn.log_softmax(logits, -1) if ctx.mode == "topk" else sampling.warp(logits, ctx.params)
            if ctx.mode == "topk":
                j = jnp.argmax(lq, -1).astype(jnp.int32)
                x = self.head.vocab_ids[...][j].astype(jnp.int32) if narrow else j
            else:  # one child per node: with and without replacement draw alike
                j = x = jax.random.categorical(jax.random.fold_in(ctx.key, k), lq, axis=-1).astype(jnp.int32)
            if cfg.confidence:
                confs = confs.at[:, k].set(jax.nn.sigmoid(confidence_logit(self.head, h[:, k], m) / temps[k]))
            q = jnp.exp(widen(self.head, lq) if narrow else lq)
            return (x, toks.at[:, k].set(x), logqs.at[:, k].set(jnp.take_along_axis(lq, j[:, None], axis=-1)[:, 0]),
                    probs.at[:, k].set(q), confs)

        init = (root_B, jnp.zeros((B, d), jnp.int32), jnp.zeros((B, d), jnp.float32),
                jnp.zeros((B, d + 1, V), jnp.float32), jnp.zeros((B, d), jnp.float32))  # the leaf's q is never used
        _, toks, logqs, probs, confs = jax.lax.fori_loop(0, d, walk, init)
        tree = tree_lib.chain_tree(root_B, toks, logqs)
        keep = self._keep(confs if cfg.confidence else None, ctx.spec, active)
        tree = dataclasses.replace(tree, valid=jnp.concatenate([jnp.ones((B, 1), bool), keep], axis=1))
        drafted = state.drafted + active.astype(jnp.int32) * jnp.sum(keep, axis=1, dtype=jnp.int32)
        st = dataclasses.replace(state, cache=cache, drafted=drafted)
        return Proposal(tree=tree, probs=probs, state=st)

    def _propose_tree(self, state: BlockState, cache, blk: BlockPass, root_B, ctx: DraftContext) -> Proposal:
        """A static or dynamic tree from the one backbone pass: a node at depth d holding token x
        gets the children of b_d + W2(W1[x]), the Markov head's exact conditional row (DFlash: the
        marginal b_d for every node of the depth; DPara with an autoregressive head: its row given x).
        `tree.expand` runs the (cheap) head depth by depth; the backbone is not run again."""
        def evaluate(st, tokens_BxF, depth, offset, mask_BxFxS, parent_slot_BxF):
            at = lambda x: None if x is None else x[:, depth][:, None]  # noqa: E731
            logits = row_logits(self.head, self.target, at(blk.base), at(blk.pre), at(blk.hidden), tokens_BxF)
            logits = jnp.broadcast_to(logits, tokens_BxF.shape + logits.shape[-1:])
            if ctx.mode == "topk":
                return jax.nn.log_softmax(logits, axis=-1), st
            return sampling.warp(logits, ctx.params), st  # sampled candidates: q warped like the target's p

        tree, probs, _ = tree_lib.expand(ctx.spec, root_B, evaluate, None, ctx.key, mode=ctx.mode)
        active = jnp.ones((root_B.shape[0],), bool) if ctx.active is None else ctx.active
        drafted = state.drafted + active.astype(jnp.int32) * jnp.sum(tree.valid[:, 1:], axis=1, dtype=jnp.int32)
        return Proposal(tree=tree, probs=probs, state=dataclasses.replace(state, cache=cache, drafted=drafted))

    def score(self, state: BlockState, tree: tree_lib.TreeBuffers, max_depth: int | None = None,
              per_depth: int | None = None):
        """log q(·|node) at every node of any tree [B, N, V], in one backbone pass: a node at depth d
        holding token x is followed by block position d, whose Markov logits are b_d + W2(W1[x])
        (the exact distribution this drafter would draft from there). Past the block (d >= W) q is
        uniform. The state is not changed."""
        W = self.head.config.drafts
        base = self.draft_block(state, tree.tokens[:, 0]).base
        d = jnp.clip(tree.depth, 0, W - 1)
        logits = position_logits(self.head, jnp.take_along_axis(base, d[..., None], axis=1),
                                 markov_embed(self.head, tree.tokens))
        lq = jax.nn.log_softmax(logits, axis=-1)
        return jnp.where((tree.depth < W)[..., None], lq, -math.log(self.vocab_size))

    def _keep(self, conf_BxD, spec, active_B):
        """Which draft positions to verify [B, D] (prefix-closed per row)."""
        if self.confidence == "off":
            return jnp.ones((active_B.shape[0], spec.max_depth), bool)
        if self.confidence == "schedule":
            return widths_lib.schedule_keep(conf_BxD, active_B, self.costs, self.verify_widths(spec))
        kept = jnp.cumprod(conf_BxD >= self.confidence, axis=1).astype(bool)  # up to the first c_k < threshold
        return widths_lib.fill_to_width(kept, active_B, self.verify_widths(spec))

    def commit(self, state: BlockState, committed: Committed) -> BlockState:
        return dataclasses.replace(state, cache=self._extend(state.cache, committed.features, committed.count))

    def loop_stats(self, state: BlockState) -> dict:
        return {"drafted": state.drafted}
