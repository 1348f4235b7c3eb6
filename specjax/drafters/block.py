"""`block`: one-pass block drafting, DSpark (deepseek-ai/DeepSpec) and DFlash as its ablation
(design §5b).

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

Confidence cuts (a cut only removes proposals, so every rule stays lossless):
    off          the whole block (up to the tree's depth) is verified
    threshold t  each row's draft stops before its first position with c_k < t; the round verifies
                 the smallest compiled width holding the longest kept draft, and every row drafts
                 up to it (free: rows are padded to the width)
    schedule     the DSpark scheduler's objective: survival a_{b,i} = prod_{j<=i} c_{b,j}; expected
                 throughput (bonus + expected accepted tokens) / cost(verify width), maximised over
                 the compiled widths (`schedule_keep` says why not pair by pair); `costs` are the
                 round times per width measured once per machine and batch size
                 (`tools/profile_widths.py`)
Trees: a static or dynamic tree spec of depth <= W is drafted from the same single backbone pass;
a node at depth d holding token x gets the children of b_d + W2(W1[x]), the Markov head's exact
conditional row (DFlash: the marginal b_d), expanded depth by depth through the head alone
(`tree.expand`). Confidence cuts apply to chains only.

Best-first trees (design §5e; `ddtree,nodes=N,...` / `treeflash,nodes=N,...` specs) come from the
same one pass: per-depth transition tables (`BlockDrafter.tables`), then a heap in the program
(`tree.best_first`): pop the best path, push its next sibling and its first child, N-1 times.
    ddtree      marginal rows: one per depth, the row along the drafter's own greedy chain (DSpark:
                the Markov head given the chain's previous token; DFlash: b_k); every node expandable
    treeflash   conditional rows for the top m candidate previous tokens of each position (the top
                m of the marginal row above), top k children each; a node whose token is not a
                candidate is a leaf (as in ETH-DISCO/TreeFlash). rows=markov: the Markov head's
                exact rows b_k + W2(W1[x]) (free); rows=head: TreeFlash's autoregressive-
                approximation head (`ar_intermediate` > 0), trained on the frozen backbone
                    h'_k = h_k + D(silu(G) * U),  [U; G] = Linear([norm(E[x_{k-1}]); norm(h_k)])
                on the pre-norm output h_k (D zero-initialised), logits = lm_head(norm(h'_k)) + Markov
    select=taps paths ranked by the product of calibrated acceptance estimates g(q, depth)
                (`specjax.taps`: fitted by `train.path_calibration`, stored with the drafter); with
                `costs` the verify budget is chosen per round among `tree_widths(N)` (design §3b)
A TreeFlash head may be stored without its backbone (`save_block_head(backbone=DIR)`): only the head's
tensors, the backbone's directory and weights digest in its config.
Departures from TreeFlash: candidates come from the Markov-corrected greedy chain's rows (not raw
DFlash logits), the head adds the backbone's Markov term, and it trains on the DSpark objective.

ReaDy (design §5c; `state_layers` set, a hybrid target only): the block also reads the target's
committed Gated DeltaNet states S_l [H_v, dk, dv] of the read layers, after the last committed token
(`init`: the prefill's cache; `commit`: `Committed.target`; held in `BlockState.target_state`):
    q_{l,p,h} = A_l(B_l^T norm(h_p)) + e_{l,p,h}   rank `reader_rank`, e a learned query per position
    o_{l,p,h} = S_{l,h}^T q_{l,p,h}                RMSNorm over d_v, concatenated over heads and layers
    h_p <- h_p + U(o_p)                            U = U_in . U_out, rank `reader_out_rank`, U_out = 0
at the input of backbone layer `reader_layer` (`num_layers`: before the final norm). Every node of a
round's tree reads the same committed state (the nodes' own states exist only after verification).
`zero_state=True` is the ablation: the same weights on S = 0, where the reader adds exactly nothing.
Departures from the ReaDy paper (no public code): one RMSNorm weight per read layer over d_v, a
low-rank U (the paper's reader is low-rank in its query only), and the training states come from
the target's chunked pass at anchors on a grid (`hybrid.prefix_states`, `train.block`).

DPara (design §5d; `boundary=True`): the backbone leaves the round's critical path. While the target
verifies this round's draft (N nodes, root included, at positions L + depth), `boundary_pass` drafts
the next round's block for every node n at once: W MASK queries at L + depth_n + 1 .., seeing the
committed context and node n with its ancestors as stand-in context (`token_context`: norm(P(E[x])),
a learned projection of the target's embedding in place of the target features they do not have
yet), one forward over N*W queries with a block-diagonal mask. It reads nothing the verification
makes, so the two forwards have no data dependence. `commit` keeps the block of the last accepted
node (`Committed.nodes`; for a chain, count - 1), and the next round drafts from it through the
light head only: the LM head on the block, then the Markov walk from the bonus token (the block
holds no anchor: the Markov head brings it in), or with `ar_intermediate` > 0 (`ar_drafts`) the
autoregressive head h' = h + D(silu(G) * U) over [norm(E[x_{k-1}]); h] at every position, trained
with the backbone. `init` makes the first block as every later one: boundary 0 of a round rooted at
the prompt's last token. Training (`train.block`, `boundary: true`): block j at anchor a_j (the
bonus) with boundary g_j sees target features before a_j - g_j - 1 and tokens a_j - g_j - 1 ..
a_j - 1 as stand-ins. Departures (no public code): the stand-ins are token embeddings through one
projection per drafter (not per boundary); the per-node generalisation drafts trees too; DPara
does not score other drafters' trees (TreeGraft) and refuses composites that rebuild its tree.

A cut selects one of a few compiled verify widths (`verify_widths`, the engine's `lax.switch`,
design §3b), so a shorter draft is a cheaper verification, not a masked one.

Departures from DeepSpec: MASK is a learned vector, not a vocabulary token (our tokenizer has no
mask token); only the `vanilla` Markov head is built (the config key exists for `gated` / `rnn`).
"""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax import attention as attention_lib, kvcache, sampling, tree as tree_lib
from specjax.taps import PathCalibration, budget_keep, tree_widths
from specjax.drafters import heads, vocab as vocab_lib
from specjax.drafters.base import SAMPLED_RULES, Committed, DraftContext, Proposal
from specjax.kvcache import KVCache
from specjax.models import transformer
from specjax.models.transformer import MLP, Linear, RMSNorm, linear, rms_norm
from specjax.typing import Array, Int

MARKOV_KINDS = ("vanilla",)


@dataclasses.dataclass(frozen=True)
class BlockConfig:
    hidden_size: int  # = the target's (embedding and LM head are shared)
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    num_layers: int
    block_size: int  # W: positions drafted per forward
    target_layers: tuple[int, ...]
    vocab_size: int
    markov_rank: int = 128  # r; 0 = DFlash (no Markov head, no confidence head)
    markov: str = "vanilla"
    confidence: bool = True
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    confidence_temperatures: tuple[float, ...] | None = None  # per position, from calibration
    # ReaDy (design §5c): the recurrent-state reader, on when `state_layers` is not empty
    state_layers: tuple[int, ...] = ()  # the target's Gated DeltaNet layers whose committed state is read
    state_shape: tuple[int, int, int] | None = None  # (H_v, dk, dv) of the target's delta-rule state
    reader_rank: int = 8  # rank of the query map A(B^T norm(h))
    reader_out_rank: int = 64  # rank of the zero-initialised output map U
    reader_layer: int = 1  # the backbone layer whose input gets h + U(o) (num_layers: before the final norm)
    # TreeFlash (design §5e): the autoregressive-approximation head, on when ar_intermediate > 0
    ar_intermediate: int = 0  # I of [U; G] = Linear([norm(E[x_{k-1}]); h_k]) (2E -> 2I), D: I -> E
    # DPara (design §5d): the next round's block precomputed for every acceptance boundary while the
    # target verifies; the draft tokens enter the context as token embeddings through `token_proj`
    boundary: bool = False
    # EAGLE-3's reduced draft vocabulary (`specjax.drafters.vocab`): N > 0 scores the N most frequent target
    # tokens of the training stream (the drafter's token ranking) in the base logits and the Markov head
    # (W1 gets one more row, for every token outside); q is zero elsewhere. Fixed at training. 0: all V.
    draft_vocab: int = 0

    def __post_init__(self):
        if not 0 <= self.draft_vocab <= self.vocab_size:
            raise ValueError(f"draft_vocab must be in 0..{self.vocab_size} (0: the full vocabulary), got {self.draft_vocab}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.markov_rank < 0:
            raise ValueError(f"markov_rank must be >= 0 (0: DFlash), got {self.markov_rank}")
        if self.markov not in MARKOV_KINDS:
            raise ValueError(f"markov head {self.markov!r} is not built; choose from {MARKOV_KINDS}")
        if self.confidence and self.markov_rank == 0:
            raise ValueError("the confidence head reads the Markov embedding: it needs markov_rank > 0")
        t = self.confidence_temperatures
        if t is not None and len(t) != self.block_size:
            raise ValueError(f"confidence_temperatures has {len(t)} entries for block_size {self.block_size}")
        if self.ar_intermediate < 0:
            raise ValueError(f"ar_intermediate must be >= 0 (0: no TreeFlash head), got {self.ar_intermediate}")
        if self.boundary and self.state_layers:
            raise ValueError("boundary-precomputed drafting (DPara) is built for a DSpark / DFlash backbone: "
                             "not with a state reader (ReaDy)")
        if self.state_layers:
            if self.state_shape is None or len(self.state_shape) != 3:
                raise ValueError("a state reader (state_layers) needs state_shape (H_v, dk, dv) of the target's state")
            if len(set(self.state_layers)) != len(self.state_layers):
                raise ValueError(f"state_layers {self.state_layers} repeats a layer")
            if self.reader_rank < 1 or self.reader_out_rank < 1:
                raise ValueError(f"reader ranks must be >= 1, got {self.reader_rank} / {self.reader_out_rank}")
            if not 0 <= self.reader_layer <= self.num_layers:
                raise ValueError(f"reader_layer must be in 0..{self.num_layers} (the backbone layer whose input is "
                                 f"updated; {self.num_layers}: before the final norm), got {self.reader_layer}")

    @property
    def has_ar_head(self) -> bool:
        """TreeFlash: conditional rows from the autoregressive-approximation head."""
        return self.ar_intermediate > 0

    @property
    def ar_drafts(self) -> bool:
        """DPara with an autoregressive head: the head (`ar_logits`) drafts every position, trained with
        the backbone (its light head); without one the Markov head does."""
        return self.boundary and self.has_ar_head

    @property
    def reads_state(self) -> bool:
        """ReaDy: the block reads the target's committed recurrent states."""
        return bool(self.state_layers)

    @classmethod
    def for_target(cls, target_cfg, *, block_size=8, num_layers=2, markov_rank=128, confidence=True,
                   target_layers=None, intermediate_size=None, state_layers=(), reader_rank=8, reader_out_rank=64,
                   reader_layer=1, ar_intermediate=0, boundary=False, draft_vocab=0) -> "BlockConfig":
        """`state_layers`: () for DSpark / DFlash; target layer indices of Gated DeltaNet layers, or
        "all" (every one), for ReaDy (a hybrid target only)."""
        L = target_cfg.num_layers
        layers = tuple(target_layers) if target_layers is not None else tuple(sorted({min(1, L - 1), L // 2, max(L - 2, 0)}))
        state_layers = state_layers or ()
        state_shape = None
        if isinstance(state_layers, str) and state_layers != "all":
            raise ValueError(f"state_layers must be 'all' or a list of target layers, got {state_layers!r}")
        if state_layers:
            linear = tuple(getattr(target_cfg, "linear_layers", ()))
            if not linear:
                raise ValueError("a state reader (ReaDy) reads a hybrid target's Gated DeltaNet states; this target "
                                 "has no linear-attention layers")
            state_layers = linear if state_layers == "all" else tuple(int(x) for x in state_layers)
            missing = [x for x in state_layers if x not in linear]
            if missing:
                raise ValueError(f"state_layers {missing} are not Gated DeltaNet layers of the target (those are {linear})")
            state_shape = (target_cfg.linear_num_value_heads, target_cfg.linear_key_head_dim,
                           target_cfg.linear_value_head_dim)
        return cls(hidden_size=target_cfg.hidden_size, num_heads=target_cfg.num_heads,
                   num_kv_heads=target_cfg.num_kv_heads, head_dim=target_cfg.head_dim,
                   intermediate_size=intermediate_size or target_cfg.intermediate_size, num_layers=num_layers,
                   block_size=block_size, target_layers=layers, vocab_size=target_cfg.vocab_size,
                   markov_rank=markov_rank, confidence=confidence and markov_rank > 0,
                   rms_norm_eps=target_cfg.rms_norm_eps, state_layers=tuple(state_layers), state_shape=state_shape,
                   reader_rank=reader_rank, reader_out_rank=reader_out_rank, reader_layer=reader_layer,
                   ar_intermediate=ar_intermediate, boundary=boundary, draft_vocab=draft_vocab or 0)


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


class StateReader(nnx.Module):
    """ReaDy's reader (design §5c), per read layer l: a low-rank query map B_l [E, r], A_l
    [r, H*dk], a learned query e_l [W, H, dk] per block position, the RMSNorm weight over d_v of the
    read-outs, and the output map U = U_in [L*H*dv, r_out] . U_out [r_out, E] (U_out zero: a fresh
    reader adds nothing, so a DSpark checkpoint can be its starting point)."""

    def __init__(self, cfg: BlockConfig, rngs: nnx.Rngs, dtype):
        E, r, ro, W = cfg.hidden_size, cfg.reader_rank, cfg.reader_out_rank, cfg.block_size
        H, K, V = cfg.state_shape
        L = len(cfg.state_layers)
        self.norm = RMSNorm(E, cfg.rms_norm_eps, dtype)
        self.query_down = nnx.Param(jax.random.normal(rngs.params(), (L, E, r), dtype) / math.sqrt(E))
        self.query_up = nnx.Param(jax.random.normal(rngs.params(), (L, r, H * K), dtype) / math.sqrt(r * K))
        self.query_pos = nnx.Param(jax.random.normal(rngs.params(), (L, W, H, K), dtype) / math.sqrt(K))
        self.out_norm = nnx.Param(jnp.ones((L, V), dtype))
        self.out_in = nnx.Param(jax.random.normal(rngs.params(), (L * H * V, ro), dtype) / math.sqrt(L * H * V))
        self.out = nnx.Param(jnp.zeros((ro, E), dtype))


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
        self.mask_embed = nnx.Param(0.02 * jax.random.normal(rngs.params(), (E,), dtype))
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


# ----------------------------------------------------------------------------- layer functions

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
    e = transformer.embed(target, tokens_BxT).astype(head.token_proj.weight.dtype)
    return rms_norm(head.token_norm, linear(head.token_proj, e))


def context_kv(head: BlockHead, c_BxTxE, positions_BxT):
    """Per backbone layer, the context's (k, v) [B, T, K, D] (each layer's own projections)."""
    cos, sin = _cos_sin(head.config, positions_BxT)
    return [_kv(layer, head.config, c_BxTxE, cos, sin) for layer in head.layers]


def block_input(head: BlockHead, target, anchors_BxA):
    """[anchor, MASK x (W-1)] per anchor, embedded: [B, A*W, E]. DPara (`boundary`): MASK x W, the
    anchor (the bonus token) is not known when its block runs; the Markov head brings it in."""
    B, A = anchors_BxA.shape
    W = head.config.block_size
    x = jnp.broadcast_to(head.mask_embed[...], (B, A, W, head.config.hidden_size))
    if not head.config.boundary:
        x = x.at[:, :, 0].set(transformer.embed(target, anchors_BxA).astype(x.dtype))
    return x.reshape(B, A * W, -1)


def read_states(head: BlockHead, h_BxAxWxE, states_LxBxAxHxKxV):
    """ReaDy's residual update U(o) [B, A, W, E] for A blocks of W positions, each block reading
    its own committed states S [L, B, A, H, dk, dv] (float32): per read layer l, head h and
    position p, q = A_l(B_l^T norm(h_p)) + e_{l,p,h}, o = S_{l,h}^T q, RMSNorm over d_v,
    concatenated over heads and layers, projected by U. A zero state reads zero: U(0) = 0."""
    rd, cfg = head.reader, head.config
    B, A, W, E = h_BxAxWxE.shape
    L = len(cfg.state_layers)
    H, K, V = cfg.state_shape
    n = rms_norm(rd.norm, h_BxAxWxE).astype(jnp.float32)
    q = jnp.einsum("bawe,ler->lbawr", n, rd.query_down[...].astype(jnp.float32))
    q = jnp.einsum("lbawr,lrm->lbawm", q, rd.query_up[...].astype(jnp.float32)).reshape(L, B, A, W, H, K)
    q = q + rd.query_pos[...].astype(jnp.float32)[:, None, None]
    o = jnp.einsum("lbahkv,lbawhk->lbawhv", states_LxBxAxHxKxV.astype(jnp.float32), q)
    o = o * jax.lax.rsqrt(jnp.mean(o * o, axis=-1, keepdims=True) + cfg.rms_norm_eps)
    o = o * rd.out_norm[...].astype(jnp.float32)[:, None, None, None, None]
    o = o.transpose(1, 2, 3, 0, 4, 5).reshape(B, A, W, L * H * V).astype(h_BxAxWxE.dtype)
    return (o @ rd.out_in[...]) @ rd.out[...]


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


def state_injector(head: BlockHead, states_LxBxAxHxKxV, A: int):
    """`backbone`'s `inject` for A blocks per row reading `states` (None: no reader)."""
    if head.reader is None:
        return None
    W = head.config.block_size

    def inject(x_BxQxE):
        B, _, E = x_BxQxE.shape
        return x_BxQxE + read_states(head, x_BxQxE.reshape(B, A, W, E), states_LxBxAxHxKxV).reshape(B, A * W, E)

    return inject


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


def row_logits(head: BlockHead, target, base_xV, pre_xE, h_xE, prev_x):
    """The logits a drafting step walks at a block position given its previous token: the Markov head
    b_k + W2(W1[x_{k-1}]) (DSpark; b_k for DFlash), or, for DPara with an autoregressive head
    (`ar_drafts`), `ar_logits` (base unused: None)."""
    if head.config.ar_drafts:
        return ar_logits(head, target, pre_xE, h_xE, prev_x)
    return position_logits(head, base_xV, markov_embed(head, prev_x))


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
    base = base_logits(head, target, h).reshape(B, A, W, -1)
    h = h.reshape(B, A, W, -1)
    prev = jnp.take_along_axis(tokens_BxT, jnp.minimum(pos_BxAxW, T - 1).reshape(B, Q), axis=1).reshape(B, A, W)
    m = markov_embed(head, prev)
    logits = position_logits(head, base, m, wide=False)
    conf = confidence_logit(head, h, m) if cfg.confidence else None
    ar = None if head.ar_head is None else ar_logits(head, target, pre.reshape(B, A, W, -1), h, prev, wide=False)
    return TrainPass(logits, conf, h, base, ar, pre.reshape(B, A, W, -1))


def self_fed_walk(head: BlockHead, base_BxWxV, h_BxWxE, anchor_B, pre_BxWxE=None, target=None):
    """Greedy walk with the drafter's own previous token (how drafting runs; `row_logits`: `pre` and
    `target` for an autoregressive DPara head): tokens [B, W], confidence logits [B, W] (None without
    the head)."""
    W = head.config.block_size
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


# ----------------------------------------------------------------------------- scheduling

def schedule_keep(conf_BxD, active_B, costs_W, widths: tuple[int, ...]):
    """The DSpark scheduler in a static program: which draft positions to verify [B, D].

    Survival a_{b,k} = prod_{j<=k} c_{b,j} is the probability that row b accepts through position
    k, so verifying positions < j yields sum_b sum_{k<j} a_{b,k} accepted tokens in expectation, plus
    one bonus token per active row. DSpark admits (row, position) pairs by decreasing survival while
    expected throughput rises and stops at the first drop: a rule for an engine whose cost grows with
    every verified token. Here a round's cost is that of its compiled verify width (rows are padded
    to it), so the same objective is maximised over the widths: expected tokens / costs[w] for each
    compiled width w, the best one wins (the smallest on ties), and every active row verifies its
    draft up to it (positions below the width cost nothing more). Finished rows verify nothing."""
    B, D = conf_BxD.shape
    surv_BxD = jnp.cumprod(conf_BxD, axis=1) * active_B[:, None]
    gain_J = jnp.concatenate([jnp.zeros((1,)), jnp.cumsum(jnp.sum(surv_BxD, axis=0))])  # verify positions < j
    n_pos_W = jnp.clip(jnp.asarray(widths) - 1, 0, D)
    bonus = jnp.maximum(jnp.sum(active_B), 1).astype(jnp.float32)
    throughput_W = (bonus + gain_J[n_pos_W]) / jnp.asarray(costs_W, jnp.float32)
    keep_len = n_pos_W[jnp.argmax(throughput_W)]
    return (jnp.arange(D)[None] < keep_len) & active_B[:, None]


def fill_to_width(keep_BxD, active_B, widths: tuple[int, ...]):
    """A threshold cut's kept drafts, extended to the compiled verify width they need: the round
    verifies the smallest width holding the longest kept draft anyway, so every active row's
    positions below it cost nothing more (a static program pads rows to the width)."""
    D = keep_BxD.shape[1]
    longest = jnp.max(jnp.where(active_B, jnp.sum(keep_BxD, axis=1), 0))
    ws = jnp.asarray(widths)
    width = ws[jnp.sum(ws < longest + 1)]  # the smallest width >= root + longest
    return (jnp.arange(D)[None] < width - 1) & active_B[:, None]


def is_chain(spec) -> bool:
    """A static tree with one node per depth."""
    return isinstance(spec, tree_lib.StaticTree) and spec.num_nodes == spec.max_depth + 1


def default_widths(num_nodes: int) -> tuple[int, ...]:
    """Compiled verify widths for a cut chain of `num_nodes` nodes: 1, 2, 3, 5, 9, 17 ... below N, and N."""
    return tuple(w for w in (1, 2, 3, 5, 9, 17, 33) if w < num_nodes) + (num_nodes,)


# ----------------------------------------------------------------------------- the drafter

@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockState:
    cache: KVCache  # context K/V of every backbone layer; length = the target's committed length
    drafted: Int[Array, "B"]  # draft nodes proposed (after cuts; a tree's valid nodes), summed over the row's rounds
    # ReaDy: the target's committed delta-rule states at the read layers, after the last committed
    # token [L_read, B, H_v, dk, dv] float32 (None without a reader)
    target_state: Any = None
    # DPara: this round's block [B, W, E] (hidden states before the final norm; chosen at the last commit among the
    # boundary blocks), and during a round the next round's candidates, one block per draft node
    # [B, N, W, E] (set by propose, consumed by commit; None between rounds)
    block: Any = None
    boundary: Any = None


def target_features(out):
    return jnp.concatenate(out.hidden, axis=-1)


class BlockDrafter(heads.HeadDrafter):
    """DSpark / DFlash / ReaDy behind the drafter contract. `confidence`: "off", a threshold in (0, 1), or
    "schedule" (then `costs`: seconds per round at each of `widths`, profiled for this machine and
    batch size). `widths`: the compiled verify widths when cutting (default `default_widths`).
    `zero_state`: ReaDy's ablation, the reader on zeroed states (a ReaDy head only).
    Best-first trees (`ddtree,...` / `treeflash,...` specs, design §5e) are drafted from the same one
    backbone pass; `select=taps` needs `path_calibration` (the directory's `path_calibration.json`),
    and with `costs` (round seconds per width of `tree_widths`, confidence off) chooses each round's
    verify budget."""
    name = "block"
    gives_q = True
    # the dense table for the backbone's layers; the Markov head's tables split the vocabulary as the LM head
    partition_rules = transformer.PARTITION_RULES + (
        (r"markov_embed$", jax.sharding.PartitionSpec("model", None)),
        (r"markov_out$", jax.sharding.PartitionSpec(None, "model")),
    )

    @property
    def can_score(self) -> bool:
        """Its q at a node depends on the block and the node's own token only: exact, one pass. DPara
        cannot: its block is precomputed from its own previous draft (it drafts its own trees only)."""
        return not self.head.config.boundary

    @property
    def reads_own_tree(self) -> bool:
        """DPara's commit picks the next block by the accepted node of its own proposed tree
        (`Committed.nodes`): a composite that rebuilds or reorders the tree cannot wrap it."""
        return self.head.config.boundary

    @property
    def default_tree(self) -> str:
        return f"chain={self.head.config.block_size}"

    def __init__(self, head: BlockHead, target, confidence="off", costs=None, widths=None, zero_state=False,
                 path_calibration: PathCalibration | None = None, boundaries: int | None = None):
        cfg = head.config
        self.check_target(cfg, target, "block")
        if boundaries is not None and (not cfg.boundary or int(boundaries) < 1):
            raise ValueError("boundaries (how many acceptance boundaries of a chain DPara precomputes) is a DPara "
                             f"option, >= 1; got {boundaries!r} for a {'DPara' if cfg.boundary else 'non-DPara'} drafter")
        self.boundaries = None if boundaries is None else int(boundaries)
        self.state_index = check_state_target(cfg, target)  # ReaDy: the read layers' indices in the target's state
        if zero_state and not cfg.reads_state:
            raise ValueError("zero_state is ReaDy's ablation (the reader on a zeroed state); this block drafter "
                             "reads no target state")
        self.zero_state = bool(zero_state)
        self.head = head
        self.target = target  # shared: embedding and LM head
        self.confidence = check_confidence(confidence, cfg)
        if self.confidence == "schedule":
            if costs is None:
                raise ValueError("confidence='schedule' needs costs: round seconds per verify width for this machine "
                                 "and batch size (python tools/profile_widths.py)")
        if costs is not None and not all(math.isfinite(c) and c > 0 for c in map(float, costs)):
            raise ValueError("costs must be positive round seconds per verify width")
        if costs is not None and self.confidence not in ("off", "schedule"):
            raise ValueError("costs go with confidence='schedule' (a chain) or with a TAPS tree "
                             "(select=taps, confidence off); a threshold cut takes none")
        self.path_calibration = path_calibration
        self.costs = None if costs is None else tuple(float(c) for c in costs)
        self.widths = None if widths is None else tuple(int(w) for w in widths)

    @property
    def reads_target_state(self) -> bool:
        return self.head.config.reads_state

    def _read_state(self, target_cache):
        """The read layers' committed delta-rule states [L_read, B, H, dk, dv] (None without a
        reader; zeros for the zeroed-state ablation)."""
        if not self.head.config.reads_state:
            return None
        st = target_cache.state[jnp.asarray(self.state_index)].astype(jnp.float32)
        return jnp.zeros_like(st) if self.zero_state else st

    def row_kind(self, spec) -> str:
        """The table rows a best-first spec drafts from on this drafter ("auto": the TreeFlash head
        where there is one, else the Markov head's exact rows); ValueError where it has none."""
        cfg = self.head.config
        kind = spec.rows
        if kind == "auto":
            kind = "head" if cfg.has_ar_head else "markov"
        if kind == "head" and not cfg.has_ar_head:
            raise ValueError("rows=head needs a TreeFlash head (a block drafter trained with ar_intermediate > 0); "
                             "this one has none: use rows=markov (DSpark) or a ddtree")
        if kind == "markov" and cfg.markov_rank == 0:
            raise ValueError("conditional rows need a Markov head or a TreeFlash head; this block drafter (DFlash) "
                             "has neither: use a ddtree (marginal rows)")
        return kind

    def resolve_tree(self, spec):
        """A best-first tree without a depth reaches min(block, nodes - 1)."""
        if isinstance(spec, tree_lib.BestFirstTree) and spec.depth is None:
            return dataclasses.replace(spec, depth=min(self.head.config.block_size, spec.nodes - 1))
        return spec

    def check_tree(self, spec, rule: str) -> int:
        W = self.head.config.block_size
        if isinstance(spec, tree_lib.BestFirstTree):
            if spec.depth is None:
                raise ValueError("an unresolved best-first tree: call the drafter's resolve_tree first")
            if self.head.config.ar_drafts:
                raise ValueError("a best-first tree is drafted from Markov or TreeFlash tables; this DPara drafter "
                                 "drafts through its autoregressive head: use a chain, a path list or a dynamic tree")
            if rule in SAMPLED_RULES:
                raise ValueError(f"a best-first tree's children are the top-k of its tables (deterministic "
                                 f"candidates): use verify='deterministic' (or greedy), not {rule!r}")
            if spec.depth > W:
                raise ValueError(f"best-first tree depth {spec.depth} is deeper than the block drafter's block "
                                 f"({W} positions): set depth=<= {W}")
            if max(spec.k, spec.m) > self.vocab_size:
                raise ValueError(f"best-first k={spec.k} / m={spec.m} exceed the vocabulary ({self.vocab_size})")
            if self.confidence != "off":
                raise ValueError("confidence cuts apply to a chain; a best-first tree needs confidence='off' "
                                 "(its budget: select=taps with costs)")
            kind = self.row_kind(spec)
            if spec.select == "taps":
                if self.path_calibration is None or kind not in self.path_calibration.kinds():
                    raise ValueError(f"select=taps needs this drafter's path calibration for {kind} rows "
                                     f"(path_calibration.json: python -m train.path_calibration)")
                if self.costs is not None and len(self.costs) != len(self.verify_widths(spec)):
                    raise ValueError(f"costs has {len(self.costs)} entries for the verify widths "
                                     f"{self.verify_widths(spec)}")
            elif self.costs is not None:
                raise ValueError("costs choose a best-first tree's budget with select=taps only")
            return self.scratch_slots(spec.num_nodes)
        super().check_tree(spec, rule)
        if spec.max_depth > W:
            raise ValueError(f"tree depth {spec.max_depth} is deeper than the block drafter's block ({W} positions): "
                             f"use a tree of depth <= {W}")
        if not is_chain(spec) and self.confidence != "off":
            raise ValueError("confidence cuts apply to a chain (tree='chain=k'); a tree from the block drafter "
                             "needs confidence='off'")
        if self.confidence == "schedule" and len(self.costs) != len(self.verify_widths(spec)):
            raise ValueError(f"costs has {len(self.costs)} entries for the verify widths {self.verify_widths(spec)}")
        return self.scratch_slots(spec.num_nodes)

    def scratch_slots(self, num_nodes: int) -> int:
        """Slots past the committed context a round writes: the block's W (DSpark); DPara: a stand-in
        slot per draft node and a block of W per node."""
        W = self.head.config.block_size
        return num_nodes * (W + 1) if self.head.config.boundary else W

    def verify_widths(self, spec) -> tuple[int, ...]:
        if isinstance(spec, tree_lib.BestFirstTree):
            if spec.select == "taps" and self.costs is not None:
                widths = self.widths or tree_widths(spec.num_nodes)
                if widths[-1] != spec.num_nodes:
                    raise ValueError(f"verify widths {widths} must end at the tree's {spec.num_nodes} nodes")
                return widths
            return (spec.num_nodes,)
        if self.confidence == "off" or not is_chain(spec):
            return (spec.num_nodes,)
        widths = self.widths or default_widths(spec.num_nodes)
        if widths[-1] != spec.num_nodes:
            raise ValueError(f"verify widths {widths} must end at the tree's {spec.num_nodes} nodes")
        return widths

    def _empty_cache(self, B, capacity):
        c = self.head.config
        return kvcache.init(c.num_layers, B, capacity, c.num_kv_heads, c.head_dim, self.head.fc.weight.dtype)

    def _extend(self, cache: KVCache, features_BxTxF, count_B) -> KVCache:
        B, T = features_BxTxF.shape[:2]
        pos = cache.length[:, None] + jnp.arange(T)[None]
        for i, (k, v) in enumerate(context_kv(self.head, context(self.head, features_BxTxF), pos)):
            cache = kvcache.write(cache, i, k, v)
        return kvcache.advance(cache, count_B)

    def init(self, prompt_BxP, lengths_B, capacity, target_out) -> BlockState:
        B = prompt_BxP.shape[0]
        if self.head.config.reads_state and getattr(target_out, "cache", None) is None:
            raise ValueError("a ReaDy drafter reads the target's state after the prefill: target_out.cache is None")
        z = jnp.zeros((B,), jnp.int32)
        feats = target_features(target_out)
        if not self.head.config.boundary:
            return BlockState(self._extend(self._empty_cache(B, capacity), feats, lengths_B), z,
                              self._read_state(target_out.cache))
        # DPara: the first round's block as every later one is made, the boundary a = 0 of a round
        # rooted at the prompt's last token (context: the features before it; the token: a stand-in)
        last_B = jnp.maximum(lengths_B - 1, 0)
        cache = self._extend(self._empty_cache(B, capacity), feats, last_B)
        tok_Bx1 = jnp.take_along_axis(prompt_BxP, last_B[:, None], axis=1)
        blocks, cache = self.boundary_pass(cache, tok_Bx1, jnp.zeros((B, 1), jnp.int32), jnp.ones((B, 1, 1), bool))
        cache = self._extend(cache, jnp.take_along_axis(feats, last_B[:, None, None], axis=1), (lengths_B > 0).astype(jnp.int32))
        return BlockState(cache, z, None, block=blocks[:, 0])

    def boundary_pass(self, cache: KVCache, tokens_BxN, depth_BxN, ancestors_BxNxN):
        """DPara's backbone pass (design §5d): for every node n of this round's draft tree, the block
        the next round drafts from if n is the last accepted node: W MASK queries at positions
        length + depth_n + 1 .., seeing the committed context and, as `token_context` stand-ins at
        slots length + (0..N-1), node n and its ancestors (the root and the accepted draft); one
        forward over N*W queries under a block-diagonal mask. It reads nothing verification makes, so
        XLA is free to run it beside the target's verification forward. Returns the blocks' hidden
        states before the final norm [B, N, W, E] and the cache with the stand-ins and blocks in its scratch slots
        (length unchanged; commit overwrites them)."""
        head, cfg = self.head, self.head.config
        B, N = tokens_BxN.shape
        W = cfg.block_size
        tok_pos = cache.length[:, None] + depth_BxN
        tok_kv = context_kv(head, token_context(head, self.target, tokens_BxN), tok_pos)
        pos = (tok_pos[:, :, None] + 1 + jnp.arange(W)).reshape(B, N * W)
        node = jnp.arange(N * W) // W
        sees_blk = jnp.broadcast_to((node[:, None] == node[None, :])[None], (B, N * W, N * W))
        mask = jnp.concatenate([jnp.repeat(ancestors_BxNxN, W, axis=1), sees_blk], axis=-1)  # [B, NW, N + NW]
        bound = attention_lib.DENSE.bind(cache, pos, mask)
        after = jnp.full((B,), N, jnp.int32)

        def attend(i, q, k, v):
            nonlocal cache
            cache = kvcache.write(cache, i, *tok_kv[i])  # stand-ins at slots length .. length+N-1
            cache = kvcache.write(cache, i, k, v, offset_B=after)  # the blocks after them
            return bound(q, cache, i)

        x = jnp.broadcast_to(head.mask_embed[...], (B, N * W, cfg.hidden_size))
        _, pre = backbone(head, x, pos, attend)
        return pre.reshape(B, N, W, -1), cache

    def block_pass(self, state: BlockState, root_B) -> BlockPass:
        """This round's block: DSpark's backbone pass (`draft_block`); DPara's block chosen at the last
        commit, through the LM head (the backbone does not run on the round's critical path)."""
        if not self.head.config.boundary:
            return self.draft_block(state, root_B)
        if state.block is None:
            raise ValueError("this DPara drafter's state holds no block: make it with this drafter's init")
        h = rms_norm(self.head.norm, state.block)
        base = None if self.head.config.ar_drafts else base_logits(self.head, self.target, h)  # the AR head makes its own
        return BlockPass(base, h, state.cache, state.block)

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

        if cfg.reads_state and state.target_state is None:
            raise ValueError("this ReaDy drafter's state holds no target state: make it with this drafter's init")
        inject = None if state.target_state is None else state_injector(self.head, state.target_state[:, :, None], 1)
        h, pre = backbone(self.head, block_input(self.head, self.target, root_B[:, None]), pos, attend, inject)
        return BlockPass(base_logits(self.head, self.target, h), h, cache, pre)

    def propose(self, state: BlockState, root_B, ctx: DraftContext) -> Proposal:
        prop = self._draft(state, self.block_pass(state, root_B), root_B, ctx)
        if not self.head.config.boundary:
            return prop
        t = prop.tree  # DPara: the next round's candidate blocks, one per node of this draft
        n = self.precomputed(ctx.spec)
        blocks, cache = self.boundary_pass(prop.state.cache, t.tokens[:, :n], t.depth[:, :n],
                                           tree_lib.ancestor_mask(t, ctx.spec.max_depth)[:, :n, :n])
        return dataclasses.replace(prop, state=dataclasses.replace(prop.state, cache=cache, boundary=blocks))

    def precomputed(self, spec) -> int:
        """DPara: how many nodes of a round's tree get their next block beside the verification: every
        node, or on a chain with `boundaries` = b the first b (acceptance boundaries 0 .. b-1); a round
        that accepts more runs the boundary pass of its accepted path after the verification."""
        if self.boundaries is None or not is_chain(spec):
            return spec.num_nodes
        return min(self.boundaries, spec.num_nodes)

    def _draft(self, state: BlockState, blk: BlockPass, root_B, ctx: DraftContext) -> Proposal:
        cfg = self.head.config
        d = ctx.spec.max_depth
        B = root_B.shape[0]
        base, h, cache, pre = blk
        if isinstance(ctx.spec, tree_lib.BestFirstTree):
            return self._propose_best_first(state, cache, base, h, pre, root_B, ctx)
        if not is_chain(ctx.spec):
            return self._propose_tree(state, cache, blk, root_B, ctx)
        active = jnp.ones((B,), bool) if ctx.active is None else ctx.active
        temps = jnp.asarray(cfg.confidence_temperatures or (1.0,) * cfg.block_size, jnp.float32)
        V = self.vocab_size

        def walk(k, carry):  # the Markov walk, the only sequential part: one step per position, in a loop
            prev, toks, logqs, probs, confs = carry
            m = markov_embed(self.head, prev)
            at = lambda x: None if x is None else x[:, k]  # noqa: E731
            logits = row_logits(self.head, self.target, at(base), at(pre), h[:, k], prev)
            lq = jax.nn.log_softmax(logits, -1) if ctx.mode == "topk" else sampling.warp(logits, ctx.params)
            if ctx.mode == "topk":
                x = jnp.argmax(lq, -1).astype(jnp.int32)
            else:  # one child per node: with and without replacement draw alike
                x = jax.random.categorical(jax.random.fold_in(ctx.key, k), lq, axis=-1).astype(jnp.int32)
            if cfg.confidence:
                confs = confs.at[:, k].set(jax.nn.sigmoid(confidence_logit(self.head, h[:, k], m) / temps[k]))
            return (x, toks.at[:, k].set(x), logqs.at[:, k].set(jnp.take_along_axis(lq, x[:, None], axis=-1)[:, 0]),
                    probs.at[:, k].set(jnp.exp(lq)), confs)

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

    def tables(self, blk: BlockPass, root_B, spec):
        """A best-first spec's transition tables from one backbone pass: (tokens, log q, child rows)
        [B, R, K] and the depth of each row's children [R] (numpy).
        Marginal rows (DDTree), one per depth d = 1..D: block position d-1's row along the drafter's
        own greedy chain (DSpark: the Markov head given the chain's previous token, exact at d = 1;
        DFlash: b_{d-1}); every node is expandable (its children: the next depth's row).
        Conditional rows (TreeFlash): row 0 lists the root's children (exact); for positions
        p = 1..D-1, one row per candidate previous token, the top m of position p-1's marginal row
        (the Markov head's exact row, or the TreeFlash head's); a node whose token is not among its
        depth's candidates is a leaf (as in ETH-DISCO/TreeFlash)."""
        head, cfg = self.head, self.head.config
        D, K = spec.depth, spec.k
        B = root_B.shape[0]
        prev, marg = root_B, []
        for p in range(D):  # the greedy chain: D cheap steps of [B, V]
            lq = jax.nn.log_softmax(position_logits(head, blk.base[:, p], markov_embed(head, prev)), axis=-1)
            marg.append(lq)
            prev = jnp.argmax(lq, axis=-1).astype(jnp.int32)
        marg = jnp.stack(marg, axis=1)  # [B, D, V]
        if not spec.conditional:
            lq, tok = jax.lax.top_k(marg, K)
            child = np.where(np.arange(D) + 1 < D, np.arange(D) + 1, -1)
            return tok, lq, jnp.broadcast_to(jnp.asarray(child, jnp.int32)[None, :, None], (B, D, K)), np.arange(1, D + 1)
        m, kind = spec.m, self.row_kind(spec)
        _, cand = jax.lax.top_k(marg[:, :D - 1], m)  # [B, D-1, m]: the previous-token candidates of positions 1..D-1
        if kind == "head":
            first = ar_logits(head, self.target, blk.pre[:, 0], blk.hidden[:, 0], root_B)
            rest = ar_logits(head, self.target, blk.pre[:, 1:D, None], blk.hidden[:, 1:D, None], cand)
            first = jax.nn.log_softmax(first, axis=-1)
        else:
            first = marg[:, 0]
            rest = position_logits(head, blk.base[:, 1:D, None], markov_embed(head, cand))
        rows = jnp.concatenate([first[:, None], jax.nn.log_softmax(rest, axis=-1).reshape(B, (D - 1) * m, -1)], axis=1)
        lq, tok = jax.lax.top_k(rows, K)  # [B, R, K], R = 1 + (D-1) m
        pos = np.concatenate([[0], np.repeat(np.arange(1, D), m)])  # the block position of each row
        # children of a row at position p are at position p+1: their row is the match among its candidates
        nxt = jnp.take_along_axis(cand, jnp.asarray(np.minimum(pos, D - 2))[None, :, None], axis=1) if D > 1 else None
        if D == 1:
            child = jnp.full(tok.shape, -1, jnp.int32)
        else:
            hit = tok[..., None] == nxt[:, :, None, :]  # [B, R, K, m]
            idx = jnp.argmax(hit, axis=-1)
            child = jnp.where(hit.any(-1) & jnp.asarray(pos + 1 < D)[None, :, None],
                              1 + jnp.asarray(pos)[None, :, None] * m + idx, -1).astype(jnp.int32)
        return tok, lq, child, pos + 1

    def _propose_best_first(self, state: BlockState, cache, base, h, pre, root_B, ctx: DraftContext) -> Proposal:
        """A best-first tree (DDTree / TreeFlash, design §5e) from the one backbone pass: the tables,
        the heap in the program; TAPS ranks by calibrated acceptance estimates and, with costs,
        chooses the verify budget."""
        spec = ctx.spec
        tok, lq, child, row_depth = self.tables(BlockPass(base, h, cache, pre), root_B, spec)
        key = lq
        if spec.select == "taps":
            key = self.path_calibration.log_g(self.row_kind(spec) if spec.conditional else "marginal", jnp.exp(lq),
                                              jnp.asarray(row_depth)[None, :, None])
        # The barrier keeps XLA from moving the tables' computation (an LM-head matmul and top-k per
        # row) into the heap's loop, which it does when the heap keys are the log-probs themselves
        # (measured: 54 ms a round for treeflash,nodes=16,rows=head on code-target; 7 ms with it).
        tok, key, lq, child = jax.lax.optimization_barrier((tok, key, lq, child))
        tree, path_key = tree_lib.best_first(root_B, tok, key, lq, child, spec.num_nodes, spec.depth)
        active = jnp.ones((root_B.shape[0],), bool) if ctx.active is None else ctx.active
        if spec.select == "taps" and self.costs is not None:
            tree = dataclasses.replace(tree, valid=budget_keep(path_key, tree.valid, active, self.costs,
                                                               self.verify_widths(spec)))
        drafted = state.drafted + active.astype(jnp.int32) * jnp.sum(tree.valid[:, 1:], axis=1, dtype=jnp.int32)
        return Proposal(tree=tree, probs=None, state=dataclasses.replace(state, cache=cache, drafted=drafted))

    def score(self, state: BlockState, tree: tree_lib.TreeBuffers, max_depth: int | None = None):
        """log q(·|node) at every node of any tree [B, N, V], in one backbone pass: a node at depth d
        holding token x is followed by block position d, whose Markov logits are b_d + W2(W1[x])
        (the exact distribution this drafter would draft from there). Past the block (d >= W) q is
        uniform. The state is not changed."""
        W = self.head.config.block_size
        if self.head.config.boundary:
            raise ValueError("a DPara drafter drafts from a block precomputed for its own previous draft: it cannot "
                             "score another drafter's tree (can_score=False)")
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
            return schedule_keep(conf_BxD, active_B, self.costs, self.verify_widths(spec))
        kept = jnp.cumprod(conf_BxD >= self.confidence, axis=1).astype(bool)  # up to the first c_k < threshold
        return fill_to_width(kept, active_B, self.verify_widths(spec))

    def commit(self, state: BlockState, committed: Committed) -> BlockState:
        st = dataclasses.replace(state, cache=self._extend(state.cache, committed.features, committed.count))
        if self.head.config.boundary:  # DPara: the next block is the one of the last accepted node
            if state.boundary is None:
                raise ValueError("a DPara drafter commits after its own propose (the boundary blocks are made there)")
            last = jnp.maximum(committed.count - 1, 0)[:, None]
            node = last if committed.nodes is None else jnp.take_along_axis(committed.nodes, last, axis=1)
            n = state.boundary.shape[1]
            block = jnp.take_along_axis(state.boundary, jnp.minimum(node, n - 1)[:, :, None, None], axis=1)[:, 0]
            if n < committed.tokens.shape[1]:  # a chain's boundaries past the precomputed ones: after the fact
                beyond = (node[:, 0] >= n) & (committed.count > 0)
                T = committed.tokens.shape[1]

                def late(_):
                    path = jnp.arange(T)[None, :] <= jnp.arange(T)[:, None]
                    blocks, _ = self.boundary_pass(state.cache, committed.tokens, jnp.broadcast_to(jnp.arange(T), (
                        committed.tokens.shape[0], T)), jnp.broadcast_to(path[None], (committed.tokens.shape[0], T, T)))
                    return jnp.take_along_axis(blocks, node[:, :, None, None], axis=1)[:, 0]

                block = jnp.where(beyond[:, None, None], jax.lax.cond(jnp.any(beyond), late, lambda _: block, None), block)
            block = jnp.where((committed.count > 0)[:, None, None], block, state.block)  # a finished row stands still
            st = dataclasses.replace(st, block=block, boundary=None)
        if state.target_state is not None:  # a finished row's committed state stands still, like its cache
            if committed.target is None:
                raise ValueError("a ReaDy drafter commits the target's committed state: Committed.target is None")
            st = dataclasses.replace(st, target_state=self._read_state(committed.target))
        return st

    def loop_stats(self, state: BlockState) -> dict:
        return {"drafted": state.drafted}


def check_state_target(cfg: BlockConfig, target) -> tuple[int, ...]:
    """ReaDy: the read layers' indices among the target's Gated DeltaNet layers (its state's first
    axis); ValueError when the target has no such layers or another state shape. () for DSpark."""
    if not cfg.reads_state:
        return ()
    linear = tuple(getattr(target.config, "linear_layers", ()))
    missing = [x for x in cfg.state_layers if x not in linear]
    if missing:
        raise ValueError(f"this ReaDy drafter reads the recurrent state of target layers {cfg.state_layers}, but "
                         f"layers {missing} of the target are not Gated DeltaNet layers (those are {linear or 'none'})")
    tc = target.config
    shape = (tc.linear_num_value_heads, tc.linear_key_head_dim, tc.linear_value_head_dim)
    if tuple(cfg.state_shape) != shape:
        raise ValueError(f"this ReaDy drafter reads states of shape {tuple(cfg.state_shape)}, the target's are {shape}")
    return tuple(linear.index(x) for x in cfg.state_layers)


def parse_confidence(confidence):
    """"off" (or None) | "schedule" | a threshold in (0, 1) (a number or a numeric string); ValueError else."""
    if confidence in (None, "off", "schedule"):
        return confidence or "off"
    try:
        t = float(confidence)
    except (TypeError, ValueError):
        raise ValueError(f"confidence must be 'off', 'schedule' or a threshold in (0, 1), got {confidence!r}") from None
    if not 0 < t < 1:
        raise ValueError(f"confidence threshold must be in (0, 1), got {confidence!r}")
    return t


def check_confidence(confidence, cfg: BlockConfig):
    """`parse_confidence`, and a cut needs the confidence head (DFlash has none)."""
    c = parse_confidence(confidence)
    if c != "off" and not cfg.confidence:
        raise ValueError("this block drafter has no confidence head (DFlash): use confidence='off'")
    return c


# ----------------------------------------------------------------------------- calibration

def ece(prob_N, label_N, bins: int = 10) -> float:
    """Expected calibration error of probabilities against 0/1 labels (equal-width bins)."""
    prob_N, label_N = np.asarray(prob_N, np.float64), np.asarray(label_N, np.float64)
    idx = np.minimum((prob_N * bins).astype(int), bins - 1)
    err = 0.0
    for b in range(bins):
        sel = idx == b
        if sel.any():
            err += sel.mean() * abs(prob_N[sel].mean() - label_N[sel].mean())
    return float(err)


def survival_ece(conf_logits_NxW, accepted_NxW, temperatures=None) -> list[float]:
    """Per position k, the ECE of the cumulative product prod_{j<=k} sigmoid(z_j / T_j) against the
    label "positions 0..k all accepted" (T = 1 without temperatures)."""
    z = np.asarray(conf_logits_NxW, np.float64)
    t = np.ones(z.shape[1]) if temperatures is None else np.asarray(temperatures, np.float64)
    surv = np.cumprod(1.0 / (1.0 + np.exp(-z / t)), axis=1)
    return [ece(surv[:, k], np.asarray(accepted_NxW)[:, k]) for k in range(z.shape[1])]


def calibrate_temperatures(conf_logits_NxW, accepted_NxW, grid=None) -> tuple[tuple[float, ...], list[float], list[float]]:
    """Sequential temperature scaling: for k = 0..W-1 in order, the temperature T_k (from `grid`)
    minimising the ECE of the cumulative product prod_{j<=k} sigmoid(z_j / T_j) against the
    cumulative acceptance label (positions 0..k all accepted), T_0..T_{k-1} fixed.
    Returns (temperatures, ECE before, ECE after) per position."""
    z = np.asarray(conf_logits_NxW, np.float64)
    y = np.asarray(accepted_NxW, np.float64)
    grid = np.asarray(grid if grid is not None else np.exp(np.linspace(np.log(0.25), np.log(8.0), 49)))
    sig = lambda a: 1.0 / (1.0 + np.exp(-a))  # noqa: E731
    temps, before, after = [], [], []
    surv_raw, surv = np.ones(len(z)), np.ones(len(z))
    for k in range(z.shape[1]):
        surv_raw = surv_raw * sig(z[:, k])
        before.append(ece(surv_raw, y[:, k]))
        errs = [ece(surv * sig(z[:, k] / t), y[:, k]) for t in grid]
        t = float(grid[int(np.argmin(errs))])
        temps.append(round(t, 4))
        surv = surv * sig(z[:, k] / t)
        after.append(ece(surv, y[:, k]))
    return tuple(temps), before, after


# ----------------------------------------------------------------------------- checkpoints

def save_block_head(head: BlockHead, path: str, dtype=jnp.bfloat16, backbone: str | None = None) -> None:
    """`drafter_config.json` + `model.safetensors` (own parameters only, bf16 by default).
    `backbone`: a block drafter directory holding every parameter of this head but its TreeFlash
    head (trained on that frozen backbone): only the TreeFlash head is written, and the config
    names the backbone (relative path) and pins its weights' digest."""
    if backbone is None:
        heads.save_head(head, path, "block", dtype)
        return
    from specjax.checkpoint import weights_sha256
    if head.ar_head is None:
        raise ValueError("a backbone reference stores a TreeFlash head only: this head has none")
    check_backbone(head.config, read_config(backbone), backbone)
    heads.save_head(head, path, "block", dtype, only=("ar_head",),
                    extra={"backbone": os.path.relpath(os.path.abspath(backbone), os.path.abspath(path)),
                           "backbone_sha256": weights_sha256(backbone)})


def check_backbone(cfg: BlockConfig, backbone_cfg: BlockConfig, where: str) -> None:
    """ValueError unless `backbone_cfg` is `cfg` without its TreeFlash head."""
    if dataclasses.replace(cfg, ar_intermediate=0) != backbone_cfg:
        raise ValueError(f"backbone {where}: its block drafter config differs from this TreeFlash head's backbone")


def backbone_dir(path: str) -> str | None:
    """The backbone directory a TreeFlash head's checkpoint refers to (None: it holds every parameter)."""
    raw = heads.read_config(path, "block")
    return None if raw.get("backbone") is None else os.path.normpath(os.path.join(path, raw["backbone"]))


def read_config(path: str) -> BlockConfig:
    raw = heads.read_config(path, "block")
    raw.pop("backbone", None)
    raw.pop("backbone_sha256", None)
    raw["target_layers"] = tuple(raw["target_layers"])
    for key in ("state_layers", "state_shape"):
        if raw.get(key) is not None:
            raw[key] = tuple(raw[key])
    if raw.get("confidence_temperatures") is not None:
        raw["confidence_temperatures"] = tuple(raw["confidence_temperatures"])
    try:
        return BlockConfig(**raw)
    except TypeError as e:
        raise ValueError(f"{os.path.join(path, heads.CONFIG_FILE)}: {e}") from None


def load_block_head(path: str, dtype=jnp.float32) -> BlockHead:
    """A block drafter head; a TreeFlash head stored on a backbone (`save_block_head(backbone=)`)
    reads the backbone's parameters from there, refused when its weights' digest moved. A draft
    vocabulary's ids are the first N of the directory's token ranking."""
    cfg = read_config(path)
    ids = vocab_lib.draft_ids(path, cfg.vocab_size, cfg.draft_vocab) if cfg.draft_vocab else None
    bdir = backbone_dir(path)
    also = ()
    if bdir is not None:
        from specjax.checkpoint import weights_sha256
        if not os.path.isdir(bdir):
            raise ValueError(f"{path}: its backbone {bdir} is missing (a TreeFlash head stores its own parameters only)")
        check_backbone(cfg, read_config(bdir), bdir)
        pinned = heads.read_config(path, "block")["backbone_sha256"]
        if weights_sha256(bdir) != pinned:
            raise ValueError(f"{path}: its backbone {bdir} holds other weights than it was trained on "
                             f"({pinned[:12]}…): retrain the TreeFlash head (python -m train.block)")
        also = (bdir,)
    head = heads.load_params(nnx.eval_shape(lambda: BlockHead(cfg, nnx.Rngs(0), dtype, ids)), path, dtype, also=also)
    if ids is not None:  # constants: made concrete again (eval_shape left them abstract)
        head.set_draft_vocab(ids)
    return head
