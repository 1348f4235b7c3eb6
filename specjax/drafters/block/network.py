"""The block drafter's network (design §5b): the shared backbone and its read-outs, as an NNX module
of parameters (`BlockHead`) and free functions over it.

One backbone forward drafts a whole block of W positions:

    context   C = norm(fc(concat of the target's hidden states at `target_layers`)) at every
              committed position; each backbone layer projects C with its own k/v weights (q/k norm,
              RoPE at positions 0..start-1) into the drafter's cache, extended at commit with the
              accepted tokens' features (like any cache, a rejected draft is never written)
    block     [anchor, MASK x (W-1)] at positions start..start+W-1: the anchor (the round's root,
              the bonus token) through the target's frozen embedding, MASK a learned vector
    layers    N decoder layers, queries from the block only, keys / values = context + block,
              non-causal inside the block
    output    final norm -> the target's frozen LM head -> base logits b_k [B, W, V]; position k
              predicts the token at start+k+1
    Markov    logits_k = b_k + W2(W1[x_{k-1}]), x_{-1} = anchor (rank r; r = 0 is DFlash): drafting
              walks the positions through this cheap head only
    confidence c_k = sigmoid(w.[h_k; W1[x_{k-1}]] / T_k), T_k the per-position temperatures of
              sequential temperature scaling (calibrated after training, stored with the drafter)
    TreeFlash h'_k = h_k + D(silu(G) * U), [U; G] = Linear([norm(E[x_{k-1}]); norm(h_k)]) on the
              pre-norm output h_k (D zero-initialised), logits = lm_head(norm(h'_k)) + Markov
              (`ar_intermediate` > 0; design §5e)

`train_logits` is the training pass over many anchors at once; the drafting passes live in
`drafter.py` (DSpark / DFlash), `dpara.py` and `best_first.py`; ReaDy's reader in `ready.py`.
MASK is a learned vector, or (`mask_token_id`, as DeepSpec, z-lab and speculators) the target's
frozen embedding of a vocabulary token; only the `vanilla` Markov head is built (the published
`gated` / `rnn` heads are refused).
"""
from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.models import attention as attention_lib
from specjax.drafters import vocab as vocab_lib
from specjax.drafters.block.config import BlockConfig
from specjax.drafters.block.ready import StateReader, state_injector
from specjax.models.kvcache import KVCache
from specjax.models import transformer
from specjax.models.transformer import MLP, Linear, RMSNorm, linear, rms_norm
from specjax.typing import Array, Int


class BlockLayer(nnx.Module):
    def __init__(self, cfg: BlockConfig, rngs: nnx.Rngs, dtype):
        E, H, K, D = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.input_layernorm = RMSNorm(E, cfg.rms_norm_eps, dtype)
        self.q_proj = Linear(E, H * D, bias=False, rngs=rngs, dtype=dtype)
        self.k_proj = Linear(E, K * D, bias=False, rngs=rngs, dtype=dtype)
        self.v_proj = Linear(E, K * D, bias=False, rngs=rngs, dtype=dtype)
        self.o_proj = Linear(H * D, E, bias=False, rngs=rngs, dtype=dtype)
        self.q_norm = RMSNorm(D, cfg.rms_norm_eps, dtype)
        self.k_norm = RMSNorm(D, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(E, cfg.rms_norm_eps, dtype)
        self.mlp = MLP(E, cfg.intermediate_size, rngs=rngs, dtype=dtype)


class ARHead(nnx.Module):
    """TreeFlash's autoregressive-approximation head (design §5e): h'_k = h_k + D(silu(G) * U) with
    [U; G] = Linear([norm(E[x_{k-1}]); norm(h_k)]) (with bias), D zero-initialised (a fresh head
    changes nothing), on the backbone's pre-norm output h_k; the logits are the LM head of the
    final norm of h'_k (plus the Markov term where the drafter has one)."""

    def __init__(self, cfg: BlockConfig, rngs: nnx.Rngs, dtype):
        E, Ia = cfg.hidden_size, cfg.ar_intermediate
        self.embed_norm = RMSNorm(E, cfg.rms_norm_eps, dtype)
        self.up_gate = Linear(2 * E, 2 * Ia, bias=True, rngs=rngs, dtype=dtype)
        self.down = Linear(Ia, E, bias=False, rngs=rngs, dtype=dtype)
        self.down.weight = nnx.Param(jnp.zeros((Ia, E), dtype))


class BlockHead(nnx.Module):
    """The trainable part of the drafter (the target's embedding and LM head are borrowed).
    `draft_ids`: the draft vocabulary's token ids [N] when `cfg.draft_vocab` = N > 0 (constants, not
    trained: `vocab_ids` and `vocab_index`, each token's row or N outside)."""

    def __init__(self, cfg: BlockConfig, rngs: nnx.Rngs, dtype=jnp.float32, draft_ids=None):
        E, r = cfg.hidden_size, cfg.markov_rank
        self.config = cfg
        if cfg.draft_vocab:
            if draft_ids is None or len(draft_ids) != cfg.draft_vocab:
                raise ValueError(f"this block drafter scores a draft vocabulary of {cfg.draft_vocab} tokens: pass "
                                 f"their ids (draft_ids), got {None if draft_ids is None else len(draft_ids)}")
            self.set_draft_vocab(draft_ids)
        elif draft_ids is not None:
            raise ValueError("draft_ids go with a config's draft_vocab > 0")
        else:
            self.vocab_ids = self.vocab_index = None
        n_in, n_out = (cfg.draft_vocab + 1, cfg.draft_vocab) if cfg.draft_vocab else (cfg.vocab_size, cfg.vocab_size)
        self.fc = Linear(len(cfg.target_layers) * E, E, bias=False, rngs=rngs, dtype=dtype)
        self.context_norm = RMSNorm(E, cfg.rms_norm_eps, dtype)
        self.mask_embed = (None if cfg.mask_token_id is not None  # MASK: the target's embedding of that token
                           else nnx.Param(0.02 * jax.random.normal(rngs.params(), (E,), dtype)))
        self.layers = nnx.List([BlockLayer(cfg, rngs, dtype) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(E, cfg.rms_norm_eps, dtype)
        if r > 0:
            self.markov_embed = nnx.Param(0.02 * jax.random.normal(rngs.params(), (n_in, r), dtype))
            self.markov_out = nnx.Param(jnp.zeros((r, n_out), dtype))  # W2 = 0: starts at b_k
        else:
            self.markov_embed = self.markov_out = None
        if cfg.confidence:
            self.confidence_w = nnx.Param(jnp.zeros((E + r,), dtype))
            self.confidence_b = nnx.Param(jnp.zeros((), dtype))
        else:
            self.confidence_w = self.confidence_b = None
        self.reader = StateReader(cfg, rngs, dtype) if cfg.reads_state else None
        self.ar_head = ARHead(cfg, rngs, dtype) if cfg.has_ar_head else None
        if cfg.boundary:  # DPara: draft tokens stand in for target features they do not have yet
            self.token_proj = Linear(E, E, bias=False, rngs=rngs, dtype=dtype)
            self.token_norm = RMSNorm(E, cfg.rms_norm_eps, dtype)
        else:
            self.token_proj = self.token_norm = None

    def set_draft_vocab(self, draft_ids) -> None:
        """The draft vocabulary's constants: its ids [N] and each token's row (N outside) [V]."""
        ids = vocab_lib.check_ids(draft_ids, self.config.vocab_size)
        self.vocab_ids = vocab_lib.DraftVocab(jnp.asarray(ids))
        self.vocab_index = vocab_lib.DraftVocab(vocab_lib.index_of(ids, self.config.vocab_size))



def _cos_sin(cfg: BlockConfig, positions):
    inv = 1.0 / (cfg.rope_theta ** (jnp.arange(0, cfg.head_dim, 2, dtype=jnp.float32) / cfg.head_dim))
    return attention_lib.cos_sin(inv, positions)


def context(head: BlockHead, features_BxTxF):
    """C [B, T, E]: the fused, normalised target features of committed positions."""
    return rms_norm(head.context_norm, linear(head.fc, features_BxTxF))


def _kv(layer: BlockLayer, cfg: BlockConfig, h_BxTxE, cos, sin):
    B, T, _ = h_BxTxE.shape
    k = rms_norm(layer.k_norm, linear(layer.k_proj, h_BxTxE).reshape(B, T, cfg.num_kv_heads, cfg.head_dim))
    v = linear(layer.v_proj, h_BxTxE).reshape(B, T, cfg.num_kv_heads, cfg.head_dim)
    return attention_lib.apply_rope(k, cos, sin), v


def token_context(head: BlockHead, target, tokens_BxT):
    """DPara's stand-in context [B, T, E] of tokens whose target features do not exist yet (the
    round's root and draft): norm(P(E[x])) through the target's frozen embedding."""
    e = transformer.embed(target, tokens_BxT).astype(head.norm.weight.dtype)
    return rms_norm(head.token_norm, linear(head.token_proj, e))


def context_kv(head: BlockHead, c_BxTxE, positions_BxT):
    """Per backbone layer, the context's (k, v) [B, T, K, D] (each layer's own projections)."""
    cos, sin = _cos_sin(head.config, positions_BxT)
    return [_kv(layer, head.config, c_BxTxE, cos, sin) for layer in head.layers]


def mask_vector(head: BlockHead, target, dtype=None):
    """MASK [E]: the learned vector, or the target's frozen embedding of `mask_token_id`."""
    if head.mask_embed is not None:
        return head.mask_embed[...]
    e = transformer.embed(target, jnp.asarray([head.config.mask_token_id]))[0]
    return e.astype(dtype or head.norm.weight.dtype)  # the activations' (projections may be int8)


def block_input(head: BlockHead, target, anchors_BxA):
    """[anchor, MASK x (W-1)] per anchor, embedded: [B, A*W, E]. DPara (`boundary`): MASK x W, the
    anchor (the bonus token) is not known when its block runs; the Markov head brings it in."""
    B, A = anchors_BxA.shape
    W = head.config.block_size
    x = jnp.broadcast_to(mask_vector(head, target), (B, A, W, head.config.hidden_size))
    if not head.config.boundary:
        x = x.at[:, :, 0].set(transformer.embed(target, anchors_BxA).astype(x.dtype))
    return x.reshape(B, A * W, -1)


def backbone(head: BlockHead, x_BxQxE, positions_BxQ, attend, inject=None):
    """The N layers over Q block queries. `attend(layer_idx, q, k_block, v_block) -> o [B, Q, H, D]`
    places the block's keys beside the context's and attends (drafting: through the cache;
    training: over all anchors at once). `inject(x) -> x` (ReaDy's state read) runs on the input of
    layer `reader_layer` (num_layers: before the final norm). Returns the normalised final hidden
    state [B, Q, E] and the one before the final norm (TreeFlash's head adds to it)."""
    cfg = head.config
    B, Q, _ = x_BxQxE.shape
    cos, sin = _cos_sin(cfg, positions_BxQ)
    x = x_BxQxE
    for i, layer in enumerate(head.layers):
        if inject is not None and i == cfg.reader_layer:
            x = inject(x)
        h = rms_norm(layer.input_layernorm, x)
        q = rms_norm(layer.q_norm, linear(layer.q_proj, h).reshape(B, Q, cfg.num_heads, cfg.head_dim))
        q = attention_lib.apply_rope(q, cos, sin)
        k, v = _kv(layer, cfg, h, cos, sin)
        o = attend(i, q, k, v)
        x = x + linear(layer.o_proj, o.reshape(B, Q, -1))
        h = rms_norm(layer.post_attention_layernorm, x)
        x = x + linear(layer.mlp.down_proj, jax.nn.silu(linear(layer.mlp.gate_proj, h)) * linear(layer.mlp.up_proj, h))
    if inject is not None and cfg.reader_layer == len(head.layers):
        x = inject(x)
    return rms_norm(head.norm, x), x


def markov_embed(head: BlockHead, prev_xB):
    """W1[x_{k-1}] [..., r] (None for DFlash; with a draft vocabulary, a token outside it reads row N)."""
    if head.markov_embed is None:
        return None
    row = prev_xB if head.vocab_index is None else head.vocab_index[...][prev_xB]
    return head.markov_embed[...][row]


def base_logits(head: BlockHead, target, h_xE):
    """b_k: the target's LM head on the block's final hidden states, over the draft vocabulary when
    the drafter has one ([..., N]: only those N rows are computed), else [..., V]."""
    if head.vocab_ids is None:
        return transformer.lm_head(target, h_xE)
    return (h_xE @ vocab_lib.head_rows(target, head.vocab_ids[...]).T).astype(jnp.float32)


def widen(head: BlockHead, logits_xN):
    """Draft-vocabulary logits placed in the full vocabulary (-inf elsewhere: q is zero there)."""
    if head.vocab_ids is None:
        return logits_xN
    return vocab_lib.widen(logits_xN, head.vocab_ids[...], head.config.vocab_size)


def position_logits(head: BlockHead, base_xN, m_xR, wide: bool = True):
    """The Markov head: b_k + W2(W1[x_{k-1}]) (b_k alone for DFlash), over the full vocabulary
    (`wide`), or over the draft vocabulary's N as `base` is (training's loss)."""
    logits = base_xN if m_xR is None else base_xN + (m_xR @ head.markov_out[...]).astype(jnp.float32)
    return widen(head, logits) if wide else logits


def ar_logits(head: BlockHead, target, pre_xE, h_xE, prev_x, wide: bool = True):
    """TreeFlash's conditional logits at block positions whose previous token is `prev` (any leading
    shape, `pre` / `h` broadcast to it): lm_head(norm(pre + D(silu(G) * U))) + the Markov term."""
    ar = head.ar_head
    e = rms_norm(ar.embed_norm, transformer.embed(target, prev_x).astype(pre_xE.dtype))
    h = jnp.broadcast_to(h_xE, e.shape)
    u, g = jnp.split(linear(ar.up_gate, jnp.concatenate([e, h], axis=-1)), 2, axis=-1)
    x = jnp.broadcast_to(pre_xE, e.shape) + linear(ar.down, jax.nn.silu(g) * u)
    return position_logits(head, base_logits(head, target, rms_norm(head.norm, x)), markov_embed(head, prev_x), wide)


def row_logits(head: BlockHead, target, base_xV, pre_xE, h_xE, prev_x, wide: bool = True):
    """The logits a drafting step walks at a block position given its previous token: the Markov head
    b_k + W2(W1[x_{k-1}]) (DSpark; b_k for DFlash), or, for DPara with an autoregressive head
    (`ar_drafts`), `ar_logits` (base unused: None). Over the full vocabulary (`wide`), or over the
    draft vocabulary's N (a greedy walk takes its argmax there, then the token's id)."""
    if head.config.ar_drafts:
        return ar_logits(head, target, pre_xE, h_xE, prev_x, wide=wide)
    return position_logits(head, base_xV, markov_embed(head, prev_x), wide=wide)


def confidence_logit(head: BlockHead, h_xE, m_xR):
    """w.[h_k; W1[x_{k-1}]] + b, before the sigmoid and the calibration temperature."""
    z = jnp.concatenate([h_xE, m_xR], axis=-1) @ head.confidence_w[...] + head.confidence_b[...]
    return z.astype(jnp.float32)


class TrainPass(NamedTuple):
    logits: Any  # [B, A, W, V] the Markov head's (teacher-forced); N, not V, with a draft vocabulary (all four)
    conf: Any  # [B, A, W] confidence logits, or None
    hidden: Any  # [B, A, W, E] after the final norm
    base: Any  # [B, A, W, V] b_k
    ar: Any  # [B, A, W, V] TreeFlash's conditional logits (teacher-forced), or None without the head
    pre: Any  # [B, A, W, E] before the final norm


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockState:
    cache: KVCache  # context K/V of every backbone layer; length = the target's committed length
    drafted: Int[Array, "B"]  # draft nodes proposed (after cuts; a tree's valid nodes), summed over the row's rounds
    # ReaDy: the target's committed delta-rule states at the read layers, after the last committed
    # token [L_read, B, H_v, dk, dv] float32 (None without a reader)
    target_state: Array | None = None
    # DPara: this round's block [B, W, E] (hidden states before the final norm; chosen at the last commit among the
    # boundary blocks), and during a round the next round's candidates, one block per draft node
    # [B, N, W, E] (set by propose, consumed by commit; None between rounds)
    block: Array | None = None
    boundary: Array | None = None


class BlockPass(NamedTuple):
    base: Any  # [B, W, V] base logits b_k ([B, W, N] with a draft vocabulary: `position_logits` widens)
    hidden: Any  # [B, W, E] after the final norm
    cache: Any  # the drafter's cache with the block's K/V in its scratch slots
    pre: Any  # [B, W, E] before the final norm (TreeFlash's head reads it)


def train_logits(head: BlockHead, target, tokens_BxT, features_BxTxF, anchors_BxA, states_LxBxAxHxKxV=None,
                 lags_BxA=None) -> TrainPass:
    """Training forward over many anchors per sequence (every block in one pass).
    ReaDy: `states` are the target's committed states at each anchor (after tokens < a_j).
    DPara (`boundary`): `lags` [B, A] are the acceptance boundaries g_j (0 <= g_j < a_j): block j
    is the one precomputed while the round rooted at a_j - g_j - 1 was verified, its g_j draft tokens
    all accepted, tokens[a_j] the bonus. It sees target features of positions < a_j - g_j - 1 only,
    positions a_j - g_j - 1 .. a_j - 1 (root and accepted draft) as `token_context`, and its own W
    MASK positions; the anchor token reaches it through the Markov head alone.
    `sample_from_anchor=False`: the outputs hold the W-1 drafting slots (`drafted_slots`), position j
    predicting tokens[a_j + j + 1] as above.

    Block j starts at anchor a_j (its token tokens[a_j]), sees the context positions < a_j and its
    own W positions (non-causal). Position k predicts tokens[a_j + k + 1]; its Markov input is the
    true previous token tokens[a_j + k] (teacher forcing), as is TreeFlash's head's. Returns a
    `TrainPass` (logits, confidence logits, hidden, base logits, TreeFlash logits). Anchors need a_j >= 1 and
    a_j + W < T for their labels to exist (the caller samples them so)."""
    cfg = head.config
    B, T = tokens_BxT.shape
    A, W = anchors_BxA.shape[1], cfg.block_size
    c = context(head, features_BxTxF)
    ctx = context_kv(head, c, jnp.broadcast_to(jnp.arange(T)[None], (B, T)))
    pos_BxAxW = anchors_BxA[..., None] + jnp.arange(W)
    Q = A * W
    blk = jnp.arange(Q) // W
    sees_blk = jnp.broadcast_to((blk[:, None] == blk[None, :])[None], (B, Q, Q))
    t = jnp.arange(T)[None, None, :]
    anchor_BxQx1 = jnp.repeat(anchors_BxA, W, axis=1)[..., None]
    if cfg.boundary:
        if lags_BxA is None:
            raise ValueError("a DPara block drafter (boundary) trains on acceptance boundaries: pass lags")
        root_BxQx1 = jnp.repeat(anchors_BxA - lags_BxA - 1, W, axis=1)[..., None]
        tok_ctx = context_kv(head, token_context(head, target, tokens_BxT), jnp.broadcast_to(jnp.arange(T)[None], (B, T)))
        visible = jnp.concatenate([t < root_BxQx1, (t >= root_BxQx1) & (t < anchor_BxQx1), sees_blk], axis=-1)
    else:
        tok_ctx = None
        visible = jnp.concatenate([t < anchor_BxQx1, sees_blk], axis=-1)  # [B, Q, T + Q]

    def attend(i, q, k, v):
        kc, vc = ctx[i]
        if tok_ctx is not None:
            kc, vc = jnp.concatenate([kc, tok_ctx[i][0]], axis=1), jnp.concatenate([vc, tok_ctx[i][1]], axis=1)
        return attention_lib.attend(q, jnp.concatenate([kc, k], axis=1), jnp.concatenate([vc, v], axis=1), visible)

    if head.reader is not None and states_LxBxAxHxKxV is None:
        raise ValueError("a state-reading block drafter (ReaDy) trains on the target's states at the anchors")
    h, pre = backbone(head, block_input(head, target, jnp.take_along_axis(tokens_BxT, anchors_BxA, axis=1)),
                      pos_BxAxW.reshape(B, Q), attend, state_injector(head, states_LxBxAxHxKxV, A))
    if not cfg.sample_from_anchor:  # the anchor's slot drafts nothing: slot k (>= 1) predicts a_j + k
        h, pre = (x.reshape(B, A, W, -1)[:, :, 1:].reshape(B, A * (W - 1), -1) for x in (h, pre))
        W = cfg.drafts
        pos_BxAxW = anchors_BxA[..., None] + jnp.arange(W)
    base = base_logits(head, target, h).reshape(B, A, W, -1)
    h = h.reshape(B, A, W, -1)
    prev = jnp.take_along_axis(tokens_BxT, jnp.minimum(pos_BxAxW, T - 1).reshape(B, A * W), axis=1).reshape(B, A, W)
    m = markov_embed(head, prev)
    logits = position_logits(head, base, m, wide=False)
    conf = confidence_logit(head, h, m) if cfg.confidence else None
    ar = None if head.ar_head is None else ar_logits(head, target, pre.reshape(B, A, W, -1), h, prev, wide=False)
    return TrainPass(logits, conf, h, base, ar, pre.reshape(B, A, W, -1))


def drafted_slots(cfg: BlockConfig, x_BxWx):
    """The slots that draft ([B, W, ...] -> [B, `cfg.drafts`, ...]): all W, or W-1 without the anchor's
    (`sample_from_anchor=False`); draft position d then reads slot d + 1."""
    return x_BxWx if cfg.sample_from_anchor else x_BxWx[:, 1:]


def self_fed_walk(head: BlockHead, base_BxWxV, h_BxWxE, anchor_B, pre_BxWxE=None, target=None):
    """Greedy walk with the drafter's own previous token (how drafting runs; `row_logits`: `pre` and
    `target` for an autoregressive DPara head) over the drafting slots (`drafted_slots`): tokens
    [B, D], confidence logits [B, D] (None without the head)."""
    W = head.config.drafts
    prev, toks, confs = anchor_B, [], []
    for k in range(W):
        m = markov_embed(head, prev)
        pre_k = None if pre_BxWxE is None else pre_BxWxE[:, k]
        x = jnp.argmax(row_logits(head, target, base_BxWxV[:, k], pre_k, h_BxWxE[:, k], prev), axis=-1).astype(jnp.int32)
        if head.config.confidence:
            confs.append(confidence_logit(head, h_BxWxE[:, k], m))
        toks.append(x)
        prev = x
    return jnp.stack(toks, 1), (jnp.stack(confs, 1) if confs else None)



def target_features(out):
    """The target's hidden states at the drafter's layers, concatenated [B, T, F]."""
    return jnp.concatenate(out.hidden, axis=-1)
