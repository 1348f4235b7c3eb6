"""`feature`: an EAGLE-3 style drafter. One decoder layer over
`concat(norm(embed(token)), norm(feature))`, where the feature is `fc(concat of the target's hidden
states at a low, a middle and a high layer)` for the entry anchored on a committed position, and
the drafter's own output hidden state for the entries it drafts after that. It shares the target's
embedding and LM head (neither is trained).

Entry p of the drafter's cache is (feature of position p, token p+1) and predicts token p+2, so the
drafter's committed length is always the target's minus one; `last_feature` holds the target
feature of the last committed position, which anchors the next round's root entry.

The same layer functions serve drafting (with a KV cache) and training with training-time test
(`ttt_logits`: several unrolled draft steps per anchor, each seeing the true entries up to its
anchor and its own chain).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.models import attention as attention_lib
from specjax.models import fold as fold_lib
from specjax.models import kvcache
from specjax.spec import sampling
from specjax.spec import tree as tree_lib
from specjax.drafters import heads
from specjax.drafters import vocab as vocab_lib
from specjax.drafters.base import Committed, DraftContext, Proposal, register
from specjax.models.kvcache import KVCache
from specjax.models import transformer
from specjax.models.transformer import MLP, Linear, Model, RMSNorm, linear, rms_norm
from specjax.typing import Array, Float


@dataclasses.dataclass(frozen=True)
class FeatureConfig:
    hidden_size: int  # = the target's (the LM head is shared)
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    target_layers: tuple[int, ...]  # target layer outputs fused by `fc` (low, middle, high)
    vocab_size: int
    rms_norm_eps: float = 1e-5
    # EAGLE-3's options, for published drafters (`specjax.drafters.interop`): the residual is
    # hidden_norm(x) rather than x (`norm_before_residual`); the drafter's own RoPE base (None: the
    # target's RoPE); its own LM head of N rows over draft ids (`own_head` = N, the ids in `draft_ids`;
    # 0: the target's head, shared)
    norm_before_residual: bool = False
    rope_theta: float | None = None
    own_head: int = 0

    def __post_init__(self):
        if not 0 <= self.own_head <= self.vocab_size:
            raise ValueError(f"own_head must be in 0..{self.vocab_size} (0: the target's LM head), got {self.own_head}")

    @classmethod
    def for_target(cls, target_cfg, target_layers=None, intermediate_size=None) -> "FeatureConfig":
        L = target_cfg.num_layers
        layers = tuple(target_layers) if target_layers is not None else tuple(sorted({min(1, L - 1), L // 2, max(L - 2, 0)}))
        return cls(hidden_size=target_cfg.hidden_size, num_heads=target_cfg.num_heads,
                   num_kv_heads=target_cfg.num_kv_heads, head_dim=target_cfg.head_dim,
                   intermediate_size=intermediate_size or target_cfg.intermediate_size,
                   target_layers=layers, vocab_size=target_cfg.vocab_size, rms_norm_eps=target_cfg.rms_norm_eps)


class FeatureHead(nnx.Module):
    """The trainable part of the drafter."""

    def __init__(self, cfg: FeatureConfig, rngs: nnx.Rngs, dtype=jnp.float32, draft_ids=None):
        E, H, K, D = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.config = cfg
        if cfg.own_head:  # a published drafter's own LM head: its rows and the token id of each (constants)
            if draft_ids is None or len(draft_ids) != cfg.own_head:
                raise ValueError(f"this feature drafter has its own LM head of {cfg.own_head} rows: pass their token "
                                 f"ids (draft_ids), got {None if draft_ids is None else len(draft_ids)}")
            self.lm_head = nnx.Param(jnp.zeros((cfg.own_head, E), dtype))
            self.head_ids = vocab_lib.DraftVocab(jnp.asarray(vocab_lib.check_ids(draft_ids, cfg.vocab_size)))
        elif draft_ids is not None:
            raise ValueError("draft_ids go with a config's own_head > 0")
        else:
            self.lm_head = self.head_ids = None
        self.fc = Linear(len(cfg.target_layers) * E, E, bias=False, rngs=rngs, dtype=dtype)
        self.embed_norm = RMSNorm(E, cfg.rms_norm_eps, dtype)
        self.hidden_norm = RMSNorm(E, cfg.rms_norm_eps, dtype)
        self.q_proj = Linear(2 * E, H * D, bias=False, rngs=rngs, dtype=dtype)
        self.k_proj = Linear(2 * E, K * D, bias=False, rngs=rngs, dtype=dtype)
        self.v_proj = Linear(2 * E, K * D, bias=False, rngs=rngs, dtype=dtype)
        self.o_proj = Linear(H * D, E, bias=False, rngs=rngs, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(E, cfg.rms_norm_eps, dtype)
        self.mlp = MLP(E, cfg.intermediate_size, rngs=rngs, dtype=dtype)
        self.norm = RMSNorm(E, cfg.rms_norm_eps, dtype)


# ----------------------------------------------------------------------------- layer functions

def qkv(head: FeatureHead, target: Model, tokens_BxT, x_BxTxE, positions_BxT, rope: bool = True):
    """Projections of the entries (token, feature x); RoPE as the target's (rope=False: q and k
    un-rotated, for an attention that applies RoPE itself: FOLD)."""
    cfg = head.config
    B, T = tokens_BxT.shape
    h = jnp.concatenate([rms_norm(head.embed_norm, transformer.embed(target, tokens_BxT)),
                         rms_norm(head.hidden_norm, x_BxTxE)], axis=-1)  # [B, T, 2E]
    q = linear(head.q_proj, h).reshape(B, T, cfg.num_heads, cfg.head_dim)
    k = linear(head.k_proj, h).reshape(B, T, cfg.num_kv_heads, cfg.head_dim)
    v = linear(head.v_proj, h).reshape(B, T, cfg.num_kv_heads, cfg.head_dim)
    if not rope:
        return q, k, v
    if cfg.rope_theta is None:
        cos, sin = transformer.rope_cos_sin(target.config, positions_BxT)
    else:  # the drafter's own RoPE base (a published EAGLE-3 drafter's)
        inv = 1.0 / (cfg.rope_theta ** (jnp.arange(0, cfg.head_dim, 2, dtype=jnp.float32) / cfg.head_dim))
        cos, sin = attention_lib.cos_sin(inv, positions_BxT)
    return transformer.apply_rope(q, cos, sin), transformer.apply_rope(k, cos, sin), v


def finish(head: FeatureHead, target: Model, x_BxTxE, attn_BxTxHxD, vocab=None):
    """Residual, MLP, and logits through the target's head. Returns (hidden out, logits). `vocab`:
    (ids [N], LM-head rows [N, E]) of a reduced draft vocabulary (-inf logits elsewhere;
    `specjax.drafters.vocab`), or rows [N, E] alone for the N logits only (training); None: the full head."""
    B, T = x_BxTxE.shape[:2]
    res = rms_norm(head.hidden_norm, x_BxTxE) if head.config.norm_before_residual else x_BxTxE
    x = res + linear(head.o_proj, attn_BxTxHxD.reshape(B, T, -1))
    h = rms_norm(head.post_attention_layernorm, x)
    x = x + linear(head.mlp.down_proj, jax.nn.silu(linear(head.mlp.gate_proj, h)) * linear(head.mlp.up_proj, h))
    h = rms_norm(head.norm, x)
    if vocab is None:
        return x, transformer.lm_head(target, h)
    if not isinstance(vocab, tuple):  # rows only: logits over the draft vocabulary [.., N]
        return x, (h @ vocab.T).astype(jnp.float32)
    return x, vocab_lib.logits(h, vocab[0], vocab[1], head.config.vocab_size)


def fuse(head: FeatureHead, features_BxTxF):
    return linear(head.fc, features_BxTxF)


def step(head, target, tokens_BxT, x_BxTxE, positions_BxT, cache: KVCache, mask_BxTxS, offset_B=None,
         attention: attention_lib.Attention | None = None, vocab=None):
    """One drafter pass over T entries with a KV cache (drafting and commit). `attention`: a
    `specjax.models.attention.Attention` (default: the jnp one); one that `rotates` (FOLD,
    `specjax.models.fold.FoldAttention`) gets q and k un-rotated and the cache keeps keys before RoPE."""
    attention = attention_lib.DENSE if attention is None else attention
    q, k, v = qkv(head, target, tokens_BxT, x_BxTxE, positions_BxT, rope=not attention.rotates)
    layer_attention = attention.bind(cache, positions_BxT, mask_BxTxS)
    cache = kvcache.write(cache, 0, k, v, offset_B)
    attn = layer_attention(q, cache, 0)
    x, logits = finish(head, target, x_BxTxE, attn, vocab)
    return x, logits, cache


def ttt_logits(head: FeatureHead, target: Model, tokens_BxT, features_BxTxF, steps: int, rows_NxE=None):
    """Training-time test over a packed sequence: logits [steps, B, T, V] (with `rows_NxE`, the LM
    head's rows of a reduced draft vocabulary: [steps, B, T, N] over those tokens only).

    Step 1 at anchor a is the entry (feature a, token a+1); step k > 1 is (own hidden of step k-1
    at the same anchor, token a+k), at position a+k-1, and sees the step-1 entries up to a plus its
    own chain (steps 2..k at anchor a). Step k at anchor a predicts token a+k+1. Token inputs past
    the end are clamped; their losses must be masked by the caller.
    """
    B, T = tokens_BxT.shape
    idx = jnp.arange(T)
    x = fuse(head, features_BxTxF)
    keys, values, out = [], [], []
    for k in range(1, steps + 1):
        tok = jnp.take(tokens_BxT, jnp.minimum(idx + k, T - 1), axis=1)  # token a+k
        pos = jnp.broadcast_to(idx + k - 1, (B, T))
        q, kk, vv = qkv(head, target, tok, x, pos)  # [B, T, H|K, D]
        keys.append(kk)
        values.append(vv)
        o = attention_lib.chain_attend(q, keys[0], values[0], keys[1:], values[1:])  # [B, T, H, D]
        x, logits = finish(head, target, x, o, rows_NxE)
        out.append(logits)
    return jnp.stack(out)


# ----------------------------------------------------------------------------- the drafter

@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FeatureState:
    cache: KVCache  # one layer; length = target length - 1
    last_feature: Float[Array, "B F"]  # target feature at the last committed position
    scratch: Float[Array, "B S E"]  # own hidden state of each evaluated tree node, by scratch slot


def target_features(out: transformer.ForwardOutput):
    return jnp.concatenate(out.hidden, axis=-1)


@register
class FeatureDrafter(heads.HeadDrafter):
    name = "feature"
    attends = True
    gives_q = True
    can_score = True
    stops_early = True

    def __init__(self, head: FeatureHead, target: Model, fold=None, draft_vocab=None):
        """`fold`: a `specjax.models.fold.FoldConfig` to draft with FOLD attention (None: plain).
        `draft_vocab`: token ids [N] of a reduced draft vocabulary (`specjax.drafters.vocab`: the LM
        head's N rows only; q is zero elsewhere); None: the full vocabulary."""
        self.check_target(head.config, target, "feature")
        if head.config.own_head and draft_vocab is not None:
            raise ValueError("this feature drafter has its own LM head over its own draft ids: it takes no draft_vocab")
        if fold is not None and head.config.rope_theta is not None:
            raise ValueError("FOLD attends with the target's RoPE: this feature drafter has its own (rope_theta)")
        self.head = head
        self.target = target  # shared: embedding and LM head
        self.fold = fold_lib.check(fold)  # static: FOLD attention in every step (None: plain)
        self.vocab_ids, self.vocab_rows = vocab_lib.draft_vocab_vars(target, draft_vocab, head.config.vocab_size)

    @classmethod
    def load(cls, spec: str, target, *, fold=None, draft_vocab: int | None = None) -> "FeatureDrafter":
        ids = vocab_lib.draft_ids_or_none(spec, target.config.vocab_size, draft_vocab)
        return cls(load_feature_head(spec, dtype=target.config.dtype), target, fold=fold, draft_vocab=ids)

    @property
    def _vocab(self):
        if self.head.lm_head is not None:  # its own head: its rows over its ids
            return self.head.head_ids[...], self.head.lm_head[...]
        return None if self.vocab_ids is None else (self.vocab_ids[...], self.vocab_rows[...])

    def with_fold(self, cfg) -> "FeatureDrafter":
        """The same drafter (same head, target and draft vocabulary) with FOLD on (`cfg`) or off (None)."""
        ids = None if self.vocab_ids is None else np.asarray(self.vocab_ids[...])
        out = FeatureDrafter(self.head, self.target, fold=cfg, draft_vocab=ids)
        out.default_tree = self.default_tree  # a tuned default tree (`tuned.json`) stays
        return out

    @property
    def attention(self):
        """The attention of every step: FOLD's (`specjax.models.fold.FoldAttention`, the target's RoPE), or
        None (plain)."""
        return fold_lib.FoldAttention.for_model(self.fold, self.target.config)

    def validate(self, capacity: int) -> None:
        """Called by the engine before tracing: FOLD's window must fit the cache."""
        fold_lib.validate(self.fold, capacity)

    def _empty_cache(self, B, capacity):
        c = self.head.config
        return kvcache.init(1, B, capacity, c.num_kv_heads, c.head_dim, self.dtype)

    def init(self, prompt_BxP, lengths_B, capacity, target_out) -> FeatureState:
        B, P = prompt_BxP.shape
        feats = target_features(target_out)  # [B, P, F]
        # entries p = 0 .. len-2: (feature p, token p+1)
        tokens = jnp.concatenate([prompt_BxP[:, 1:], jnp.zeros((B, 1), prompt_BxP.dtype)], axis=1)
        n_B = lengths_B - 1
        cache = self._empty_cache(B, capacity)
        pos = jnp.broadcast_to(jnp.arange(P)[None], (B, P))
        _, _, cache = step(self.head, self.target, tokens, fuse(self.head, feats), pos, cache,
                           transformer.causal_mask(B, P, n_B), attention=self.attention)
        last = jnp.take_along_axis(feats, (lengths_B - 1)[:, None, None], axis=1)[:, 0]
        return FeatureState(kvcache.set_length(cache, n_B), last, jnp.zeros((B, 1, self.head.config.hidden_size)))

    def propose(self, state: FeatureState, root_B, ctx: DraftContext) -> Proposal:
        spec = ctx.spec
        evaluated = spec.pool_size if isinstance(spec, tree_lib.DynamicTree) else spec.num_nodes
        B = root_B.shape[0]
        scratch = jnp.zeros((B, evaluated, self.head.config.hidden_size), self.dtype)

        def evaluate(st, tokens_BxF, depth, offset, mask_BxFxS, parent_slot_BxF):
            cache, scratch = st
            F = tokens_BxF.shape[1]
            if isinstance(depth, int) and depth == 0:  # a traced depth (a chain's loop) is >= 1
                x_in = fuse(self.head, state.last_feature)[:, None]
            else:
                x_in = jnp.take_along_axis(scratch, jnp.maximum(parent_slot_BxF, 0)[..., None], axis=1)
            pos = jnp.broadcast_to(cache.length[:, None] + depth, (B, F))
            x_out, logits, cache = step(self.head, self.target, tokens_BxF, x_in, pos, cache, mask_BxFxS,
                                        jnp.full((B,), offset, jnp.int32), attention=self.attention, vocab=self._vocab)
            scratch = jax.lax.dynamic_update_slice_in_dim(scratch, x_out, offset, axis=1)
            logq = jax.nn.log_softmax(logits, -1) if ctx.mode == "topk" else sampling.warp(logits, ctx.params)
            return logq, (cache, scratch)

        tree, probs, (cache, _) = tree_lib.expand(spec, root_B, evaluate, (state.cache, scratch), ctx.key, mode=ctx.mode,
                                                  stop=ctx.stop)
        return Proposal(tree=tree, probs=probs, state=dataclasses.replace(state, cache=cache))

    def score(self, state: FeatureState, tree: tree_lib.TreeBuffers, max_depth: int | None = None,
              per_depth: int | None = None):
        """log q(·|node) at every node of someone else's tree [B, N, V].

        A node's input is its parent's own output hidden state, so the tree is scored depth by
        depth: max_depth + 1 passes over all N nodes (scratch slot = node id), each pass feeding
        every node its parent's hidden state from the previous pass. After pass d the nodes of
        depth <= d are exact (their ancestors' K/V and hidden states no longer change), so the
        last pass gives every node's distribution. With `per_depth` (at most that many valid nodes at
        any depth; the caller reserves N + per_depth scratch slots) each pass evaluates only its own
        depth's nodes: `_score_by_depth`. The state is not changed."""
        B, N = tree.tokens.shape
        D = N - 1 if max_depth is None else max_depth
        if per_depth is not None and per_depth < N:
            return self._score_by_depth(state, tree, D, int(per_depth))
        E = self.head.config.hidden_size
        mask = tree_lib.ancestor_mask(tree, D) | jnp.eye(N, dtype=bool)[None]
        pos = state.cache.length[:, None] + tree.depth
        x_root = fuse(self.head, state.last_feature)[:, None]  # [B, 1, E]
        is_root = (tree.parents < 0)[..., None]
        par = jnp.maximum(tree.parents, 0)[..., None]

        def one_pass(_, carry):
            hidden, _ = carry
            x_in = jnp.where(is_root, x_root, jnp.take_along_axis(hidden, par, axis=1))
            hidden, logits, _ = step(self.head, self.target, tree.tokens, x_in, pos, state.cache, mask,
                                     attention=self.attention, vocab=self._vocab)
            return hidden, logits.astype(jnp.float32)

        init = (jnp.zeros((B, N, E), x_root.dtype), jnp.zeros((B, N, self.vocab_size), jnp.float32))
        _, logits = jax.lax.fori_loop(0, D + 1, one_pass, init)
        return jax.nn.log_softmax(logits, axis=-1)

    def _score_by_depth(self, state: FeatureState, tree: tree_lib.TreeBuffers, D: int, W: int):
        """`score` in D + 1 passes of W nodes each: the nodes sorted by depth (scratch slot = rank in that
        order), pass d evaluates the window of W slots from its depth's first node, writing their K/V
        there (the window's tail, nodes of the next depths, is overwritten by their own pass before
        anything reads it) and reading its parents' hidden states from the passes before."""
        B, N = tree.tokens.shape
        E = self.head.config.hidden_size
        valid = tree.valid | (jnp.arange(N)[None] == 0)
        key = jnp.where(valid, tree.depth, D + 1) * N + jnp.arange(N)[None]
        order = jnp.argsort(key, axis=1).astype(jnp.int32)  # [B, N]: node ids by depth
        at = valid[:, None, :] & (tree.depth[:, None, :] == jnp.arange(D + 1)[None, :, None])
        counts = at.sum(-1).astype(jnp.int32)  # [B, D+1]
        start = jnp.cumsum(counts, axis=1) - counts
        S = N + W
        order_pad = jnp.concatenate([order, jnp.zeros((B, W), jnp.int32)], axis=1)  # slot -> node (past N: none)
        anc = tree_lib.ancestor_mask(tree, D) | jnp.eye(N, dtype=bool)[None]  # [B, node, ancestor node]
        anc_slots = jnp.take_along_axis(anc, jnp.broadcast_to(order_pad[:, None, :], (B, N, S)) % N, axis=2) \
            & (jnp.arange(S) < N)[None, None]  # [B, node, slot]
        x_root = fuse(self.head, state.last_feature)[:, None]
        hidden = jnp.zeros((B, N, E), x_root.dtype)
        logits = jnp.zeros((B, N, self.vocab_size), jnp.float32)
        rows = jnp.arange(B)[:, None]
        cache = state.cache
        for d in range(D + 1):
            slots = jnp.minimum(start[:, d:d + 1] + jnp.arange(W)[None], S - 1)
            ids = jnp.take_along_axis(order_pad, slots, axis=1)  # [B, W]
            ok = jnp.arange(W)[None] < counts[:, d:d + 1]
            if d == 0:
                x_in = jnp.broadcast_to(x_root, (B, W, E))
            else:
                par = jnp.maximum(jnp.take_along_axis(tree.parents, ids, axis=1), 0)
                x_in = jnp.take_along_axis(hidden, par[..., None], axis=1)
            mask = jnp.take_along_axis(anc_slots, ids[..., None], axis=1)  # [B, W, S]
            pos = cache.length[:, None] + jnp.take_along_axis(tree.depth, ids, axis=1)
            x_out, lg, cache = step(self.head, self.target, jnp.take_along_axis(tree.tokens, ids, axis=1), x_in, pos,
                                    cache, mask, start[:, d], attention=self.attention, vocab=self._vocab)
            hidden = hidden.at[rows, ids].set(jnp.where(ok[..., None], x_out, hidden[rows, ids]))
            logits = logits.at[rows, ids].set(jnp.where(ok[..., None], lg.astype(jnp.float32), logits[rows, ids]))
        return jax.nn.log_softmax(logits, axis=-1)

    def commit(self, state: FeatureState, committed: Committed) -> FeatureState:
        B, T = committed.tokens.shape
        feats = committed.features  # [B, T, F] target features at root, a1, .., a_n
        x_in = fuse(self.head, jnp.concatenate([state.last_feature[:, None], feats[:, :-1]], axis=1))
        pos = state.cache.length[:, None] + jnp.arange(T)[None]
        _, _, cache = step(self.head, self.target, committed.tokens, x_in, pos, state.cache,
                           transformer.causal_mask(B, T, committed.count), attention=self.attention)
        last = jnp.take_along_axis(feats, jnp.maximum(committed.count - 1, 0)[:, None, None], axis=1)[:, 0]
        last = jnp.where((committed.count > 0)[:, None], last, state.last_feature)
        return FeatureState(kvcache.advance(cache, committed.count), last, state.scratch)


# ----------------------------------------------------------------------------- checkpoints

def save_feature_head(head: FeatureHead, path: str, dtype=None) -> None:
    """`drafter_config.json` + `model.safetensors` of the head only (the target is not copied), cast to
    `dtype` when given (the trainer exports bf16)."""
    heads.save_head(head, path, "feature", dtype)


def load_feature_head(path: str, dtype=jnp.float32) -> FeatureHead:
    """A feature head; one with its own LM head reads its rows' token ids from the directory's ranking."""
    raw = heads.read_config(path, "feature")
    raw["target_layers"] = tuple(raw["target_layers"])
    cfg = FeatureConfig(**raw)
    ids = vocab_lib.draft_ids(path, cfg.vocab_size, cfg.own_head) if cfg.own_head else None
    head = heads.load_params(nnx.eval_shape(lambda: FeatureHead(cfg, nnx.Rngs(0), dtype, ids)), path, dtype)
    if ids is not None:  # constants: made concrete again (eval_shape left them abstract)
        head.head_ids = vocab_lib.DraftVocab(jnp.asarray(ids, jnp.int32))
    return head
