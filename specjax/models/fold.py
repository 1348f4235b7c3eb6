"""FOLD (design §7): a training-free attention policy for drafters that read a long context.

Switched on per drafter: `LMDrafter(model, fold=FoldConfig(...))`, `FeatureDrafter(head, target,
fold=...)`, `drafter.with_fold(cfg)` (same weights; `with_fold(drafter, cfg)` here), `load_drafter(spec,
target, fold=...)`, or `python -m specjax generate ... --fold
sinks=4,window=256,lambda=0.5` (`--fold default`). Nothing is retrained; only the drafter's
attention changes, so greedy speculative output still equals the target's own.

The policy, for a block of drafter queries over a row whose drafter cache holds L committed keys
(slot c = position c) and a scratch area (the draft tree being built, or the block itself):
  sinks   committed keys at positions < `sinks`: true positions;
  local   the last `window` committed keys (positions >= L - window) and every scratch key (the
          draft, or the prefill / commit block under its causal mask): true positions;
  far     the other committed keys (n_far = max(0, L - window - sinks) of them): all at ONE shared
          position, `far_distance` (>= window) before the block's first query:
              p_far = min_t(q_pos[t]) - far_distance;
          and their logits multiplied by beta (length-aware temperature):
              "log-ratio"  beta = max(1, 1 + lambda * ln(n_far / window))      (the default)
              "log-log"    beta = max(1, ln(n_far) / ln(window))               (lambda = 0: off)
          beta = 1 without far keys or with lambda = 0.

Positions. RoPE makes a logit depend on q_pos - k_pos, so "far keys at a fixed distance from the
query" needs one far position per query; the far-memory kernel takes one position per key, shared
by the queries of a call. We place the far keys at `far_distance` before the block's FIRST query.
That is exact (every query sees them at exactly `far_distance`) for drafting, where all queries
of a call sit at one position per row (tree depth d: position L + d); for a commit block (D+1
queries) or a prefill chunk (`chunk` queries), query t sees them at far_distance + t. The choice
keeps order: with far_distance > window + (block length), far keys always look farther than every
local key of every query (default far_distance = window + chunk), and no query ever sees a
relative distance above far_distance + chunk — except to the sinks, which keep their true
positions as the design asks (they are attention sinks: their content, not their distance, is
what a head reads).

Un-rotated keys. FOLD must re-position keys, so a FOLD drafter caches keys BEFORE RoPE. FOLD is
an attention object (`FoldAttention`, a `specjax.models.attention.Attention` with `rotates = True`) that
the drafter passes to its forwards: `transformer.forward(..., attention=)` (the LM drafter;
`prefill` here runs its prompt in chunks through it) and `feature.step(..., attention=)` (the
feature drafter). The drafter keeps its `FoldConfig` as a static attribute (`drafter.fold`; the
model and head are untouched and shared with the plain drafter). With it, q and k reach the
attention un-rotated, K/V go to the same `KVCache` as before (same shapes), and attention is

    merge( far_attention(q, committed keys, per-key positions and segments, beta)   [the kernel]
           tree attention(q, scratch keys rotated at their positions, block mask) )  [lse merge]

`pallas_kernels.ops.far_attention` is the FOLD kernel (impl: `FoldConfig.impl`, default "auto" on an
NVIDIA GPU — Triton — and the jnp "reference" elsewhere; "auto"/"interpret"/"pallas"/"reference"
selectable). The scratch part cannot go through it: a tree's sibling branches are not causal
(a node sees its ancestors, not every node at a lower depth), which per-key segments cannot say;
it goes through `ops.tree_attention` (same impl) over the scratch slots, and the two partial
attentions are merged by their log-sum-exp (`ops.merge_attention`). Scratch keys' positions are
not stored: the scratch keys a query sees are its ancestors, one per position from L on (tree
nodes depth by depth; the causal block of a prefill chunk or a commit), so the k-th visible
scratch slot of any query sits at position L + k.

The LM drafter's prefill runs in chunks of `chunk` tokens (so the prompt's deeper-layer keys are
themselves computed under FOLD, each chunk treating the text before it as committed); the feature
drafter has one layer, whose keys do not depend on attention.

With n_far = 0 (context <= sinks + window) every key keeps its true position and beta = 1: the
drafter computes exactly the plain attention (up to float rounding of the two-part softmax).
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels import ops
from pallas_kernels import reference as ref
from pallas_kernels.ops import fold_beta
from specjax.models import kvcache
from specjax.models.attention import rope_inv_freq, rotate
from specjax.models import transformer

# Segment ids of the far-memory kernel (= pallas_kernels.reference.SEG_*).
SEG_PAD, SEG_SINK, SEG_LOCAL, SEG_FAR = -1, 0, 1, 2
BETA_RULES = ("log-ratio", "log-log")
IMPLS = ("auto", "pallas", "interpret", "reference")
_KEYS = {"sinks": "sinks", "window": "window", "far": "far_distance", "far_distance": "far_distance",
         "lambda": "sharpen", "sharpen": "sharpen", "beta": "beta_rule", "beta_rule": "beta_rule",
         "positions": "fold_positions", "fold_positions": "fold_positions", "chunk": "chunk", "impl": "impl"}


@dataclasses.dataclass(frozen=True)
class FoldConfig:
    """FOLD's knobs (see the module docstring). Static: part of the drafter's graphdef."""
    sinks: int = 4  # first committed keys kept at their true positions
    window: int = 256  # last committed keys kept at their true positions (plus the draft)
    far_distance: int | None = None  # far keys' distance before the block's first query; default window + chunk
    sharpen: float = 0.5  # lambda of the "log-ratio" rule; 0 disables sharpening (beta = 1)
    beta_rule: str = "log-ratio"  # or "log-log": beta = max(1, ln n_far / ln window)
    fold_positions: bool = True  # False: far keys keep their true positions (the sharpening-only ablation)
    chunk: int = 64  # prefill chunk of the LM drafter
    impl: str | None = None  # far_attention impl; None: "auto" on an NVIDIA GPU, "reference" elsewhere

    def __post_init__(self):
        for name in ("sinks", "window", "chunk"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"FOLD {name} must be an integer, got {v!r}")
        if self.sinks < 0:
            raise ValueError(f"FOLD sinks must be >= 0, got {self.sinks}")
        if self.window < 1:
            raise ValueError(f"FOLD window must be >= 1, got {self.window}")
        if self.chunk < 1:
            raise ValueError(f"FOLD chunk must be >= 1, got {self.chunk}")
        far = self.far_distance
        if far is None:
            object.__setattr__(self, "far_distance", self.window + self.chunk)
        elif isinstance(far, bool) or not isinstance(far, int):
            raise ValueError(f"FOLD far_distance must be an integer, got {far!r}")
        elif far < self.window:
            raise ValueError(f"FOLD far_distance ({far}) must be >= the window ({self.window}): far keys sit "
                             "farther than the local window")
        lam = self.sharpen
        if isinstance(lam, bool) or not isinstance(lam, (int, float)) or not math.isfinite(lam):
            raise ValueError(f"FOLD lambda (sharpen) must be a finite number, got {lam!r}")
        if lam < 0:
            raise ValueError(f"FOLD lambda (sharpen) must be >= 0 (it sharpens far-key logits), got {lam}")
        object.__setattr__(self, "sharpen", float(lam))
        if self.beta_rule not in BETA_RULES:
            raise ValueError(f"unknown FOLD beta rule {self.beta_rule!r}; choose from {', '.join(BETA_RULES)}")
        if self.beta_rule == "log-log" and self.window < 2:
            raise ValueError("FOLD beta rule 'log-log' divides by ln(window): it needs window >= 2")
        if not isinstance(self.fold_positions, bool):
            raise ValueError(f"FOLD fold_positions must be a bool, got {self.fold_positions!r}")
        if self.impl is not None and self.impl not in IMPLS:
            raise ValueError(f"unknown FOLD attention impl {self.impl!r}; choose from {', '.join(IMPLS)}")

    @classmethod
    def parse(cls, spec: str) -> "FoldConfig":
        """'default', or comma-separated key=value: sinks, window, far (far_distance), lambda
        (sharpen), beta (log-ratio | log-log), positions (on | off), chunk, impl."""
        spec = spec.strip()
        if spec in ("default", "on", ""):
            return cls()
        kw = {}
        for item in spec.split(","):
            key, eq, val = item.strip().partition("=")
            key, val = key.strip(), val.strip()
            if not eq or not val:
                raise ValueError(f"FOLD spec {spec!r}: expected key=value items, got {item!r}")
            if key not in _KEYS:
                raise ValueError(f"FOLD spec {spec!r}: unknown key {key!r}; use sinks, window, far, lambda, "
                                 "beta, positions, chunk, impl")
            field = _KEYS[key]
            if field in ("sinks", "window", "far_distance", "chunk"):
                try:
                    kw[field] = int(val)
                except ValueError:
                    raise ValueError(f"FOLD spec: {key} must be an integer, got {val!r}") from None
            elif field == "sharpen":
                try:
                    kw[field] = float(val)
                except ValueError:
                    raise ValueError(f"FOLD spec: {key} must be a number, got {val!r}") from None
            elif field == "fold_positions":
                if val.lower() not in ("on", "off", "true", "false", "1", "0"):
                    raise ValueError(f"FOLD spec: positions must be on or off, got {val!r}")
                kw[field] = val.lower() in ("on", "true", "1")
            else:
                kw[field] = val
        return cls(**kw)

    def describe(self) -> str:
        return (f"sinks={self.sinks},window={self.window},far={self.far_distance},lambda={self.sharpen:g},"
                f"beta={self.beta_rule},positions={'on' if self.fold_positions else 'off'},chunk={self.chunk}")


# ----------------------------------------------------------------------------- switching FOLD on

def check(cfg: FoldConfig | None) -> FoldConfig | None:
    """`cfg` if it is a FoldConfig or None; ValueError otherwise."""
    if cfg is not None and not isinstance(cfg, FoldConfig):
        raise ValueError(f"fold must be a FoldConfig (or None), got {type(cfg).__name__}")
    return cfg


def validate(cfg: FoldConfig | None, capacity: int) -> None:
    """Refuses (ValueError) a FOLD config that cannot apply to a drafter cache of `capacity` slots."""
    if cfg is None:
        return
    if cfg.window > capacity:
        raise ValueError(f"FOLD window ({cfg.window}) is larger than the drafter's cache capacity ({capacity}): "
                         "no key could ever be far; use a smaller window")
    if cfg.sinks > capacity:
        raise ValueError(f"FOLD sinks ({cfg.sinks}) exceed the drafter's cache capacity ({capacity})")


# ----------------------------------------------------------------------------- the policy

def resolve_impl(cfg: FoldConfig) -> str:
    if cfg.impl is not None:
        return cfg.impl
    return "auto" if ops.is_nvidia_gpu() else "reference"


def beta(n_far_B, cfg: FoldConfig):
    """The far-logit sharpening factor per row (1 without far keys or with lambda = 0)."""
    n_far = jnp.asarray(n_far_B, jnp.float32)
    if cfg.sharpen == 0:
        return jnp.ones_like(n_far)
    if cfg.beta_rule == "log-ratio":
        return fold_beta(n_far, cfg.window, cfg.sharpen)
    b = jnp.log(jnp.maximum(n_far, 1.0)) / math.log(cfg.window)
    return jnp.where(n_far > 0, jnp.maximum(1.0, b), 1.0)


def committed_keys(length_B, capacity: int, q_pos_BxT, cfg: FoldConfig):
    """Segment ids, positions and far counts of the committed cache slots [0, length):
    (segment [B, C] int32, k_pos [B, C] int32, n_far [B] int32). Slots >= length are padding."""
    c = jnp.arange(capacity, dtype=jnp.int32)[None, :]
    L = length_B.astype(jnp.int32)[:, None]
    committed = c < L
    sink = committed & (c < cfg.sinks)
    local = committed & ~sink & (c >= L - cfg.window)
    far = committed & ~sink & ~local
    seg = jnp.where(~committed, SEG_PAD, jnp.where(sink, SEG_SINK, jnp.where(local, SEG_LOCAL, SEG_FAR)))
    k_pos = jnp.broadcast_to(c, seg.shape)
    if cfg.fold_positions:
        p_far = jnp.min(q_pos_BxT, axis=1).astype(jnp.int32) - cfg.far_distance
        k_pos = jnp.where(far, p_far[:, None], k_pos)
    return seg.astype(jnp.int32), k_pos, jnp.sum(far, axis=1).astype(jnp.int32)


def scratch_positions(length_B, mask_BxTxS):
    """Positions of the scratch slots length .. length+S-1: the k-th scratch slot a query sees (its
    k-th ancestor from the root, or slot k of a causal block) sits at length + k. [B, S]; slots no
    query sees get `length` (they are masked anyway)."""
    rank = jnp.cumsum(mask_BxTxS.astype(jnp.int32), axis=2) - 1
    rank_BxS = jnp.max(jnp.where(mask_BxTxS, rank, 0), axis=1)
    return length_B.astype(jnp.int32)[:, None] + rank_BxS


class _Plan(NamedTuple):
    """What every layer of one forward shares (`FoldAttention.bind`)."""
    impl: str
    inv: jax.Array  # [D/2]
    length: jax.Array  # [B]
    q_pos: jax.Array  # [B, T]
    mask: jax.Array  # [B, T, S]
    seg: jax.Array  # [B, C]
    k_pos: jax.Array  # [B, C]
    beta: jax.Array  # [B]
    slots: jax.Array  # [B, S] scratch cache slots
    s_pos: jax.Array  # [B, S] their positions
    bits: jax.Array | None  # packed mask (kernel impls)


def _plan(length_B, capacity: int, q_pos_BxT, mask_BxTxS, cfg: FoldConfig, inv_freq) -> _Plan:

    impl = resolve_impl(cfg)
    S = mask_BxTxS.shape[2]
    length_B = length_B.astype(jnp.int32)
    seg, k_pos, n_far = committed_keys(length_B, capacity, q_pos_BxT, cfg)
    slots = jnp.clip(length_B[:, None] + jnp.arange(S)[None], 0, capacity - 1)
    return _Plan(impl, jnp.asarray(inv_freq, jnp.float32), length_B, q_pos_BxT, mask_BxTxS, seg, k_pos,
                 beta(n_far, cfg), slots, scratch_positions(length_B, mask_BxTxS),
                 None if impl == "reference" else ops.pack_mask(mask_BxTxS))


def _fold_attend(plan: _Plan, q_BxTxHxD, k_BxCxKxD, v_BxCxKxD):

    B = q_BxTxHxD.shape[0]
    o_c, lse_c = ops.far_attention(q_BxTxHxD, k_BxCxKxD, v_BxCxKxD, plan.q_pos, plan.k_pos, plan.seg, plan.beta,
                                   inv_freq=plan.inv, return_lse=True, impl=plan.impl)
    k_s = jnp.take_along_axis(k_BxCxKxD, plan.slots[:, :, None, None], axis=1)
    v_s = jnp.take_along_axis(v_BxCxKxD, plan.slots[:, :, None, None], axis=1)
    q_rot = rotate(q_BxTxHxD, plan.q_pos, plan.inv)
    k_s_rot = rotate(k_s, plan.s_pos, plan.inv)
    if plan.impl == "reference":
        o_s, lse_s = _scratch_attention(q_rot, k_s_rot, v_s, plan.mask)
    else:
        o_s, lse_s = ops.tree_attention(q_rot, k_s_rot, v_s, jnp.zeros((B,), jnp.int32), plan.bits,
                                        return_lse=True, impl=plan.impl)
    o, _ = ops.merge_attention(o_c, lse_c, o_s, lse_s)
    if _RECORD is not None:
        _RECORD.append(_attention_stats(q_BxTxHxD, k_BxCxKxD, v_BxCxKxD, plan.q_pos, plan.k_pos, plan.seg, plan.beta,
                                        plan.inv, q_rot, k_s_rot, plan.mask))
    return o.astype(q_BxTxHxD.dtype)


def fold_attention(q_BxTxHxD, k_BxCxKxD, v_BxCxKxD, length_B, q_pos_BxT, mask_BxTxS, cfg: FoldConfig, inv_freq):
    """FOLD attention of a block of T queries (before RoPE) over one layer's cache of un-rotated
    keys: committed slots [0, length) by the FOLD policy through the far-memory kernel, scratch
    slots [length, length + S) under the block mask at their true positions; merged. [B, T, H, D]."""
    plan = _plan(length_B, k_BxCxKxD.shape[1], q_pos_BxT, mask_BxTxS, cfg, inv_freq)
    return _fold_attend(plan, q_BxTxHxD, k_BxCxKxD, v_BxCxKxD)


@dataclasses.dataclass(frozen=True, eq=False)
class FoldAttention:
    """FOLD as a forward's attention (a `specjax.models.attention.Attention`): q and k reach it un-rotated
    (`rotates`: the cache holds keys before RoPE), and every layer computes `fold_attention` over
    its cache with the policy's segments, positions and beta computed once per forward (`bind`).

    `inv_freq`: the RoPE inverse frequencies [D/2] of the attention it replaces (the LM drafter's
    `transformer.rope_inv_freq(model.config)`, the target's for the feature drafter); `for_model`."""
    cfg: FoldConfig
    inv_freq: jax.Array
    rotates: ClassVar[bool] = True

    @classmethod
    def for_model(cls, cfg: FoldConfig | None, model_config) -> "FoldAttention | None":
        """FOLD attention with the RoPE of `model_config` (a `ModelConfig`); None for cfg None."""
        return None if cfg is None else cls(cfg, rope_inv_freq(model_config))

    def bind(self, cache: kvcache.KVCache, positions_BxT, block_mask_BxTxS):
        plan = _plan(cache.length, cache.capacity, positions_BxT, block_mask_BxTxS, self.cfg, self.inv_freq)

        def attention(q_BxTxHxD, cache: kvcache.KVCache, idx: int):
            return _fold_attend(plan, q_BxTxHxD, cache.k[idx], cache.v[idx])

        return attention


def _scratch_attention(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, mask_BxTxS):
    """Masked softmax attention over the scratch keys (all rotated): (out [B, T, H, D] float32,
    lse [B, T, H], -inf where a query sees nothing). `tree_attention_reference` with length 0, in
    one pass."""
    B, T, H, D = q_BxTxHxD.shape
    K = k_BxSxKxD.shape[2]
    s = jnp.einsum("btkgd,bskd->bkgts", q_BxTxHxD.reshape(B, T, K, H // K, D), k_BxSxKxD,
                   preferred_element_type=jnp.float32) / math.sqrt(D)
    vis = mask_BxTxS[:, None, None]
    s = jnp.where(vis, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isneginf(m), 0.0, m)
    e = jnp.where(vis, jnp.exp(s - m), 0.0)
    total = jnp.sum(e, axis=-1, keepdims=True)
    p = e / jnp.where(total == 0, 1.0, total)
    o = jnp.einsum("bkgts,bskd->btkgd", p, v_BxSxKxD.astype(jnp.float32)).reshape(B, T, H, D)
    lse = jnp.where(total == 0, -jnp.inf, m + jnp.log(jnp.where(total == 0, 1.0, total)))[..., 0]  # [B, K, G, T]
    return o, lse.transpose(0, 3, 1, 2).reshape(B, T, H)


# ----------------------------------------------------------------------------- the LM drafter's prefill

def prefill(model, tokens_BxP, lengths_B, cache, hidden_layers=(), *, attention: FoldAttention):
    """`transformer.prefill` under FOLD attention: the prompt in chunks of `attention.cfg.chunk`
    tokens, each chunk a causal block (`transformer.forward(..., attention=)`) over the chunks before
    it (committed). Same contract."""

    B, P = tokens_BxP.shape
    c = attention.cfg.chunk
    lengths_B = lengths_B.astype(jnp.int32)

    def run(cache, start, size):
        toks = jax.lax.dynamic_slice_in_dim(tokens_BxP, start, size, axis=1)
        pos = jnp.broadcast_to(start + jnp.arange(size, dtype=jnp.int32)[None], (B, size))
        cache = kvcache.set_length(cache, jnp.full((B,), start, jnp.int32))
        out = transformer.forward(model, toks, pos, cache, transformer.causal_mask(B, size, lengths_B - start),
                                  hidden_layers, attention=attention)
        return out.cache, (out.last_hidden, out.hidden)

    n_full, rem = divmod(P, c)
    parts_h, parts_hid = [], []
    if n_full:
        def body(cache, j):
            return run(cache, j * c, c)
        cache, (h, hid) = jax.lax.scan(body, cache, jnp.arange(n_full, dtype=jnp.int32))
        merge = lambda a: jnp.moveaxis(a, 0, 1).reshape(B, n_full * c, *a.shape[3:])  # noqa: E731
        parts_h.append(merge(h))
        parts_hid.append(tuple(merge(x) for x in hid))
    if rem:
        cache, (h, hid) = run(cache, n_full * c, rem)
        parts_h.append(h)
        parts_hid.append(hid)
    h = jnp.concatenate(parts_h, axis=1)
    hidden = tuple(jnp.concatenate([p[i] for p in parts_hid], axis=1) for i in range(len(hidden_layers)))
    return transformer.ForwardOutput(logits=transformer.lm_head(model, h), cache=kvcache.set_length(cache, lengths_B),
                                     hidden=hidden, last_hidden=h)


# ----------------------------------------------------------------------------- diagnostics

_RECORD: list | None = None


@contextlib.contextmanager
def recording():
    """While active (during tracing or eager execution), every FOLD attention call appends its
    attention statistics (`_attention_stats`) to the yielded list."""
    global _RECORD
    prev, _RECORD = _RECORD, []
    try:
        yield _RECORD
    finally:
        _RECORD = prev


def _attention_stats(q, k, v, q_pos, k_pos, seg, beta_B, inv, q_rot, k_s_rot, mask_BxTxS):
    """Attention weights of one FOLD call recomputed from the definition: the committed part's
    log-sum-exp from `far_attention_reference`, the scratch part's from `tree_attention_reference`,
    each key's weight exp(logit - lse_total). Returns, per row and query (mean over heads):
    entropy (nats), far_mass (weight on far keys), total (sum of weights: 1 up to rounding)."""

    B, T, H, D = q.shape
    K = k.shape[2]
    G = H // K
    _, lse_c = ref.far_attention_reference(q, k, v, q_pos, k_pos, seg, beta_B, inv_freq=inv, return_lse=True)
    _, lse_s = ref.tree_attention_reference(q_rot, k_s_rot, k_s_rot, jnp.zeros((B,), jnp.int32),
                                            ref.pack_mask(mask_BxTxS), return_lse=True)
    lse = jnp.logaddexp(lse_c, lse_s)  # [B, T, H]
    lse_BxKxGxT = lse.reshape(B, T, K, G).transpose(0, 2, 3, 1)[..., None]
    # committed keys: sharpened logits, as the reference computes them
    qr = rotate(q, q_pos, inv).reshape(B, T, K, G, D)
    kr = rotate(k, k_pos, inv)
    s_c = jnp.einsum("btkgd,bnkd->bkgtn", qr, kr, preferred_element_type=jnp.float32) / math.sqrt(D)
    far = seg == SEG_FAR
    s_c = jnp.where(far[:, None, None, None, :], s_c * beta_B[:, None, None, None, None], s_c)
    vis_c = ((seg != SEG_PAD)[:, None, :] & (far[:, None, :] | (k_pos[:, None, :] <= q_pos[:, :, None])))[:, None, None]
    s_s = jnp.einsum("btkgd,bskd->bkgts", q_rot.reshape(B, T, K, G, D), k_s_rot,
                     preferred_element_type=jnp.float32) / math.sqrt(D)
    vis_s = mask_BxTxS[:, None, None]

    def weights(s, vis):
        d = jnp.where(vis, s - lse_BxKxGxT, 0.0)
        return jnp.where(vis, jnp.exp(d), 0.0), d

    p_c, d_c = weights(s_c, vis_c)
    p_s, d_s = weights(s_s, vis_s)
    ent = -(jnp.sum(p_c * d_c, -1) + jnp.sum(p_s * d_s, -1))  # [B, K, G, T]
    far_mass = jnp.sum(jnp.where(far[:, None, None, None, :], p_c, 0.0), -1)
    total = jnp.sum(p_c, -1) + jnp.sum(p_s, -1)
    mean = lambda a: jnp.mean(a, axis=(1, 2))  # noqa: E731  -> [B, T]
    return {"entropy": mean(ent), "far_mass": mean(far_mass), "total": mean(total)}
