"""`mtp`: multi-token prediction (design §5f), the module DeepSeek-V3 and Qwen3-Next checkpoints ship to
speculate on themselves.

An MTP module takes the target's hidden state h_p (what its LM head reads: after the final norm) and
the next token t_{p+1}:

    x = fc([norm_e(E[t_{p+1}]); norm_h(h_p)])        2E -> E, no bias
    x = layers[j](x)                                  the target family's attention decoder layer,
                                                      with a KV cache of its own
    h' = norm(x); logits = lm_head(h')                the target's LM head -> t_{p+2}

Drafting step j (the root is step 0) feeds the module's own output h' of its parent and the parent's
token, through layer j mod n (n MTP layers; Qwen3-Next and DeepSeek-V3 ship one). The embedding and the
LM head are the target's (not stored). The parameters carry Qwen3-Next's names (`mtp.fc`,
`mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`, `mtp.layers.{j}.*`, `mtp.norm`) in the target's
own safetensors (`load_mtp_head(target_dir)`) or in a directory of their own (`drafter_config.json`
{"drafter": "mtp"} + `model.safetensors`); the dense family uses the same layout.

Entries and caches, as the feature drafter's: entry p (h_p, t_{p+1}) sits at position p, so the
module's committed length is the target's minus one, and `last_hidden` (h of the last committed
position) anchors the next round's root. With n > 1 layers every layer's cache holds every committed
entry (the prompt and each commit run all n layers, and so does the root of a round); a draft node
of depth d runs layer d mod n only and sees, besides the committed entries and the root, the draft
nodes of its path that ran the same layer. `train.mtp` trains exactly this (`ttt_logits`).
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from specjax.models import attention as attention_lib
from specjax.models import kvcache
from specjax.spec import sampling
from specjax.spec import tree as tree_lib
from specjax.io.checkpoint import mtp_num_layers, mtp_tensor_names, read_mtp_tensors, write_mtp_tensors
from specjax.drafters import heads
from specjax.drafters import vocab as vocab_lib
from specjax.drafters.base import Committed, DraftContext, Proposal, register
from specjax.models.kvcache import KVCache
from specjax.models import family, hybrid, transformer
from specjax.models.config import HybridConfig
from specjax.models.transformer import Linear, linear
from specjax.typing import Array, Float

KIND = "mtp"


@dataclasses.dataclass(frozen=True)
class MTPConfig:
    """What an MTP module adds to its target's config (the layers' shapes are the target's)."""
    num_layers: int  # MTP layers (step j runs layer j mod num_layers)
    hidden_size: int  # = the target's
    vocab_size: int  # = the target's (the embedding and LM head are shared)
    target_layers: tuple[int, ...]  # (the target's last layer,): its output, after the final norm, is h

    @classmethod
    def for_target(cls, target_cfg, num_layers: int = 1) -> "MTPConfig":
        if num_layers < 1:
            raise ValueError(f"an MTP module needs at least one layer, got {num_layers}")
        return cls(num_layers=num_layers, hidden_size=target_cfg.hidden_size, vocab_size=target_cfg.vocab_size,
                   target_layers=(target_cfg.num_layers - 1,))


class MTPHead(nnx.Module):
    """The trainable part: fc, the two input norms, the decoder layers, the final norm (the target
    family's norm: the hybrid's scales by 1 + w)."""

    def __init__(self, cfg: MTPConfig, target_cfg, rngs: nnx.Rngs):
        fam = family_of(target_cfg)
        E, dt = target_cfg.hidden_size, target_cfg.dtype
        self.config = cfg
        self.target_config = target_cfg  # static: the layers are the target family's
        self.fc = Linear(2 * E, E, bias=False, rngs=rngs, dtype=dt)
        self.pre_fc_norm_embedding = fam.Norm(E, target_cfg.rms_norm_eps, dt)
        self.pre_fc_norm_hidden = fam.Norm(E, target_cfg.rms_norm_eps, dt)
        self.layers = nnx.List([fam.attention_layer_module(target_cfg, rngs) for _ in range(cfg.num_layers)])
        self.norm = fam.Norm(E, target_cfg.rms_norm_eps, dt)


def family_of(target_cfg):
    """The model family module of a target config (hybrid or dense)."""
    return hybrid if isinstance(target_cfg, HybridConfig) else transformer


# ----------------------------------------------------------------------------- functions

def target_hidden(target, features_BxTxE):
    """h: the target's last-layer output (its `hidden_layers` feature) through its final norm."""
    return family(target).apply_norm(target.norm, features_BxTxE)


def step(head: MTPHead, target, layer: int, tokens_BxT, h_BxTxE, positions_BxT, cache: KVCache, block_mask_BxTxS,
         offset_B=None, vocab=None, attention=attention_lib.DENSE):
    """One MTP pass of layer `layer` (static) over T entries (token, h): (h' [B,T,E], logits [B,T,V],
    cache with the entries' K/V in layer `layer` at slots length + offset ..). `vocab`: (ids [N],
    LM-head rows [N, E]) of a reduced draft vocabulary (`specjax.drafters.vocab`), or the rows [N, E]
    alone for the N logits only (training); None: the full head."""
    fam = family_of(head.target_config)
    e = fam.apply_norm(head.pre_fc_norm_embedding, transformer.embed(target, tokens_BxT))
    x = linear(head.fc, jnp.concatenate([e, fam.apply_norm(head.pre_fc_norm_hidden, h_BxTxE)], axis=-1))
    bound = attention.bind(cache, positions_BxT, block_mask_BxTxS)
    x, cache = fam.attention_decoder_layer(head.layers[layer], head.target_config, layer, x, positions_BxT, cache,
                                           bound, offset_B)
    h = fam.apply_norm(head.norm, x)
    if vocab is not None and not isinstance(vocab, tuple):  # rows only: logits over the draft vocabulary [.., N]
        return h, (h @ vocab.T).astype(jnp.float32), cache
    if vocab is not None:
        return h, vocab_lib.logits(h, *vocab, head.config.vocab_size), cache
    return h, transformer.lm_head(target, h), cache


def step_any(head: MTPHead, target, layer, *args, **kw):
    """`step` with a traced layer index (a chain's loop): one branch per layer (`lax.switch`)."""
    n = head.config.num_layers
    if isinstance(layer, int) or n == 1:
        return step(head, target, layer % n if isinstance(layer, int) else 0, *args, **kw)
    return jax.lax.switch(layer % n, [lambda *a, j=j: step(head, target, j, *a, **kw) for j in range(n)], *args)


def step_all(head: MTPHead, target, tokens_BxT, h_BxTxE, positions_BxT, cache, block_mask_BxTxS, offset_B=None,
             vocab=None):
    """Every layer over the same entries (committed entries and a round's root): layer 0's output
    and logits, the cache with every layer's K/V."""
    out = None
    for j in range(head.config.num_layers):
        h, logits, cache = step(head, target, j, tokens_BxT, h_BxTxE, positions_BxT, cache, block_mask_BxTxS, offset_B,
                                vocab)
        out = out or (h, logits)
    return out[0], out[1], cache


@dataclasses.dataclass(frozen=True)
class ChainAttention:
    """`ttt_logits`' attention (`attention.chain_attend`): T queries (anchors 0..T-1) over the causal block
    of T committed entries at slots `committed`.., plus, per visible chain block at slots c.., the one
    entry of the query's own anchor. The block mask's visible set without scoring the slots it hides:
    T + (chain blocks) scores per query, not T * (n + steps - 1). The block mask is not read."""
    committed: int  # the first slot of the layer's committed entries
    chain: tuple[int, ...] = ()  # the first slot of each visible chain block (steps of the same layer)
    rotates = False

    def bind(self, cache: KVCache, positions_BxT, block_mask_BxTxS):
        def attention(q_BxTxHxD, cache: KVCache, idx: int):
            T = q_BxTxHxD.shape[1]
            block = lambda x, s: x[idx][:, s:s + T]  # noqa: E731  (static slots of layer idx)
            return attention_lib.chain_attend(q_BxTxHxD, block(cache.k, self.committed), block(cache.v, self.committed),
                                              [block(cache.k, c) for c in self.chain],
                                              [block(cache.v, c) for c in self.chain])

        return attention


def ttt_logits(head: MTPHead, target, tokens_BxT, h_BxTxE, steps: int, rows_NxE=None, reference: bool = False):
    """Training-time test over a packed sequence, as drafting runs it: logits [steps, B, T, V] (with
    `rows_NxE`, the LM head's rows of a reduced draft vocabulary: [steps, B, T, N] over those tokens).

    Step 1 at anchor a is the committed entry (h_a, t_{a+1}) at position a; step k > 1 is (own output
    of step k-1 at anchor a, token a+k) at position a+k-1 through layer (k-1) mod n, and sees that
    layer's committed entries up to a and the steps of its own chain that ran the same layer. Step k
    predicts token a+k+1. The entries live in one KV cache of capacity T * (n + steps - 1): each
    layer's committed entries, then one block of T slots per step past the first; the visibility is
    what the block mask would show, which `ChainAttention` scores without the slots it hides (`reference`:
    the block mask built and the dense attention over every slot under it, as a draft round runs it). Token inputs past the end are
    clamped; the caller masks their losses."""
    B, T = tokens_BxT.shape
    n = head.config.num_layers
    cfg = head.target_config
    C = T * (n + steps - 1)
    cache = kvcache.set_length(kvcache.init(n, B, C, cfg.num_kv_heads, cfg.head_dim, h_BxTxE.dtype),
                               jnp.zeros((B,), jnp.int32))
    idx = jnp.arange(T)
    causal = idx[None, :] <= idx[:, None]  # [T(anchor a), T(entry p)]: p <= a
    slot_block = np.repeat(np.arange(n + steps - 1), T)  # [C]: which block a slot is in
    slot_anchor = jnp.asarray(np.tile(np.arange(T), n + steps - 1))
    tok1 = jnp.take(tokens_BxT, jnp.minimum(idx + 1, T - 1), axis=1)
    pos0 = jnp.broadcast_to(idx, (B, T))

    def visibility(layer: int, same=None):
        """(block mask, attention) of a pass through `layer` whose own chain is the blocks `same` marks:
        the mask and the dense attention (`reference`), or no mask and `ChainAttention`."""
        chain_slots = () if same is None else tuple(int(b) * T for b in np.flatnonzero(same))
        if not reference:
            return None, ChainAttention(layer * T, chain_slots)
        seen = jnp.zeros((T, C), bool) if same is None else (jnp.asarray(same[slot_block])[None, :]
                                                               & (slot_anchor[None, :] == idx[:, None]))
        return jnp.broadcast_to(seen.at[:, layer * T:(layer + 1) * T].set(causal), (B, T, C)), attention_lib.DENSE

    out, h = [], None
    for j in range(n):  # every layer's committed entries (block j); layer 0's outputs are step 1
        mask, attn = visibility(j)
        hj, logits, cache = step(head, target, j, tok1, h_BxTxE, pos0, cache, mask, jnp.full((B,), j * T, jnp.int32),
                                 rows_NxE, attn)
        if j == 0:
            h = hj
            out.append(logits)
    for k in range(2, steps + 1):
        layer, block = (k - 1) % n, n + k - 2
        tok = jnp.take(tokens_BxT, jnp.minimum(idx + k, T - 1), axis=1)  # token a+k
        # per block: the chain blocks of steps 2..k that ran the same layer (block n + j - 2 is step j's)
        same = np.array([False] * n + [j <= k and (j - 1) % n == layer for j in range(2, steps + 1)])
        mask, attn = visibility(layer, same)  # this step's own block among the chain
        h, logits, cache = step(head, target, layer, tok, h, pos0 + k - 1, cache, mask,
                                jnp.full((B,), block * T, jnp.int32), rows_NxE, attn)
        out.append(logits)
    return jnp.stack(out)


# ----------------------------------------------------------------------------- the drafter

@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MTPState:
    cache: KVCache  # the MTP layers' caches [n, ...]; length = target length - 1
    last_hidden: Float[Array, "B E"]  # h of the last committed position
    scratch: Float[Array, "B S E"]  # own output h' of each evaluated tree node, by scratch slot


@register
class MTPDrafter(heads.HeadDrafter):
    name = KIND
    by_name = True  # `mtp`: the MTP layers of the target's own checkpoint (load's target_path)
    gives_q = True
    stops_early = True

    def __init__(self, head: MTPHead, target, draft_vocab=None):
        """`draft_vocab`: token ids [N] of a reduced draft vocabulary (`specjax.drafters.vocab`:
        the LM head's N rows only; q is zero elsewhere); None: the full vocabulary."""
        self.check_target(head.config, target, KIND)
        if family_of(head.target_config) is not family(target):
            raise ValueError("the MTP module was built for another model family than the target's")
        self.head = head
        self.target = target  # shared: embedding, LM head, final norm
        self.vocab_ids, self.vocab_rows = vocab_lib.draft_vocab_vars(target, draft_vocab, head.config.vocab_size)

    @classmethod
    def load(cls, spec: str, target, *, target_path: str | None = None, draft_vocab: int | None = None) -> "MTPDrafter":
        """`mtp`: the MTP layers shipped in the target's own checkpoint (`target_path`); or an MTP
        drafter directory."""
        path = spec
        if spec == KIND:
            if target_path is None:
                raise ValueError("drafter 'mtp' drafts with the MTP layers of the target's own checkpoint: "
                                 "give the target's directory")
            path = target_path
        ids = vocab_lib.draft_ids_or_none(path, target.config.vocab_size, draft_vocab)
        return cls(load_mtp_head(path, target.config, dtype=target.config.dtype), target, ids)

    @property
    def _vocab(self):
        return None if self.vocab_ids is None else (self.vocab_ids[...], self.vocab_rows[...])

    def with_fold(self, cfg):
        if cfg is None:
            return self
        raise ValueError("FOLD is not built for the MTP drafter (its layer is the target's own attention layer; "
                         "use FOLD with an lm or feature drafter)")

    def _empty_cache(self, B, capacity):
        c = self.head.target_config
        return kvcache.init(self.head.config.num_layers, B, capacity, c.num_kv_heads, c.head_dim, self.dtype)

    def init(self, prompt_BxP, lengths_B, capacity, target_out) -> MTPState:
        B, P = prompt_BxP.shape
        h = target_hidden(self.target, target_out.hidden[0])  # [B, P, E]
        tokens = jnp.concatenate([prompt_BxP[:, 1:], jnp.zeros((B, 1), prompt_BxP.dtype)], axis=1)  # t_{p+1}
        n_B = lengths_B - 1
        pos = jnp.broadcast_to(jnp.arange(P)[None], (B, P))
        _, _, cache = step_all(self.head, self.target, tokens, h, pos, self._empty_cache(B, capacity),
                               transformer.causal_mask(B, P, n_B))
        last = jnp.take_along_axis(h, (lengths_B - 1)[:, None, None], axis=1)[:, 0]
        return MTPState(kvcache.set_length(cache, n_B), last, jnp.zeros((B, 1, self.head.config.hidden_size), h.dtype))

    def propose(self, state: MTPState, root_B, ctx: DraftContext) -> Proposal:
        spec = ctx.spec
        n = self.head.config.num_layers
        evaluated = spec.pool_size if isinstance(spec, tree_lib.DynamicTree) else spec.num_nodes
        B = root_B.shape[0]
        scratch = jnp.zeros((B, evaluated, self.head.config.hidden_size), state.last_hidden.dtype)
        slot_depth = jnp.full((evaluated,), -1, jnp.int32)

        def evaluate(st, tokens_BxF, depth, offset, mask_BxFxS, parent_slot_BxF):
            cache, scratch, slot_depth = st
            F, S = tokens_BxF.shape[1], mask_BxFxS.shape[2]
            pos = jnp.broadcast_to(cache.length[:, None] + depth, (B, F))
            off = jnp.full((B,), offset, jnp.int32)
            if isinstance(depth, int) and depth == 0:  # the root: every layer (a traced depth is >= 1)
                h_out, logits, cache = step_all(self.head, self.target, tokens_BxF, state.last_hidden[:, None], pos,
                                                cache, mask_BxFxS, off, self._vocab)
            else:
                h_in = jnp.take_along_axis(scratch, jnp.maximum(parent_slot_BxF, 0)[..., None], axis=1)
                if n > 1:  # a node sees the committed entries, the root and its path's nodes of the same layer
                    slot_depth = jax.lax.dynamic_update_slice_in_dim(slot_depth, jnp.full((F,), depth, jnp.int32),
                                                                     offset, axis=0)
                    d = slot_depth[:S]
                    mask_BxFxS = mask_BxFxS & ((d == 0) | ((d >= 0) & (d % n == depth % n)))[None, None]
                h_out, logits, cache = step_any(self.head, self.target, depth, tokens_BxF, h_in, pos, cache,
                                                mask_BxFxS, off, vocab=self._vocab)
            scratch = jax.lax.dynamic_update_slice_in_dim(scratch, h_out, offset, axis=1)
            logq = jax.nn.log_softmax(logits, -1) if ctx.mode == "topk" else sampling.warp(logits, ctx.params)
            return logq, (cache, scratch, slot_depth)

        if n > 1:
            slot_depth = slot_depth.at[0].set(0)
        tree, probs, (cache, _, _) = tree_lib.expand(spec, root_B, evaluate, (state.cache, scratch, slot_depth),
                                                     ctx.key, mode=ctx.mode, stop=ctx.stop)
        return Proposal(tree=tree, probs=probs, state=dataclasses.replace(state, cache=cache))

    def commit(self, state: MTPState, committed: Committed) -> MTPState:
        B, T = committed.tokens.shape
        h = target_hidden(self.target, committed.features)  # [B, T, E]: h at root, a1, .., a_n
        h_in = jnp.concatenate([state.last_hidden[:, None], h[:, :-1]], axis=1)
        pos = state.cache.length[:, None] + jnp.arange(T)[None]
        _, _, cache = step_all(self.head, self.target, committed.tokens, h_in, pos, state.cache,
                               transformer.causal_mask(B, T, committed.count))
        last = jnp.take_along_axis(h, jnp.maximum(committed.count - 1, 0)[:, None, None], axis=1)[:, 0]
        last = jnp.where((committed.count > 0)[:, None], last, state.last_hidden)
        return dataclasses.replace(state, cache=kvcache.advance(cache, committed.count), last_hidden=last)


# ----------------------------------------------------------------------------- checkpoints

def mtp_tensors(head: MTPHead, dtype=None) -> dict[str, np.ndarray]:
    """The head's parameters under Qwen3-Next's `mtp.*` names, in HF layout ([out, in] matrices)."""
    flat = dict(nnx.to_flat_state(nnx.state(head, nnx.Param)))
    out = {}
    for name, (path, shape, transposed) in mtp_tensor_names(head.target_config, head.config.num_layers).items():
        arr = jnp.asarray(flat[path].get_value())
        arr = np.asarray(arr if dtype is None else arr.astype(dtype))
        out[name] = np.ascontiguousarray(arr.T if transposed else arr.reshape(shape))
    return out


def head_from_tensors(tensors: dict, target_cfg, where: str, dtype=None) -> MTPHead:
    """An `MTPHead` for `target_cfg` filled from `mtp.*` tensors (names and shapes checked)."""
    n = mtp_num_layers(tensors)
    if n == 0:
        raise ValueError(f"{where}: no MTP layers (no mtp.layers.* tensors)")
    cfg = MTPConfig.for_target(target_cfg, n)
    head = nnx.eval_shape(lambda: MTPHead(cfg, target_cfg, nnx.Rngs(0)))
    flat = dict(nnx.to_flat_state(nnx.state(head, nnx.Param)))
    names = mtp_tensor_names(target_cfg, n)
    unexpected = sorted(set(tensors) - set(names))
    if unexpected:
        raise ValueError(f"{where}: unexpected MTP tensors for this target: {unexpected[:5]}")
    dtype = target_cfg.dtype if dtype is None else dtype
    for name, (path, shape, transposed) in names.items():
        if name not in tensors:
            raise ValueError(f"{where}: missing tensor {name!r}")
        t = np.asarray(tensors[name]).astype(np.float32)
        if tuple(t.shape) != shape:
            raise ValueError(f"{where}: tensor {name!r} has shape {tuple(t.shape)}, expected {shape}")
        flat[path].set_value(jnp.asarray(t.T if transposed else t.reshape(flat[path].get_value().shape), dtype))
    nnx.update(head, nnx.from_flat_state(flat))
    return head


def save_mtp_head(head: MTPHead, path: str, dtype=jnp.bfloat16, *, into_target: bool = False) -> None:
    """Writes the head's `mtp.*` tensors: into a target directory's own safetensors (`into_target`,
    as Qwen3-Next ships it), or into a directory of its own with `drafter_config.json`."""

    tensors = mtp_tensors(head, dtype)
    if into_target:
        write_mtp_tensors(path, tensors)
        return
    os.makedirs(path, exist_ok=True)
    cfg = dataclasses.asdict(head.config)
    cfg["target_layers"] = list(cfg["target_layers"])
    with open(os.path.join(path, heads.CONFIG_FILE), "w") as f:
        json.dump({"drafter": KIND, **cfg}, f, indent=2)
    save_file(tensors, os.path.join(path, heads.WEIGHTS_FILE), metadata={"format": "pt"})


def load_mtp_head(path: str, target_cfg, dtype=None) -> MTPHead:
    """The MTP module of `path`: a target directory whose safetensors ship `mtp.*` tensors, or a
    directory of its own (`drafter_config.json` {"drafter": "mtp"})."""

    if os.path.exists(os.path.join(path, heads.CONFIG_FILE)):
        raw = heads.read_config(path, KIND)
        if raw.get("hidden_size") != target_cfg.hidden_size or raw.get("vocab_size") != target_cfg.vocab_size:
            raise ValueError(f"{path}: MTP module for width {raw.get('hidden_size')} / vocab {raw.get('vocab_size')}, "
                             f"the target has {target_cfg.hidden_size} / {target_cfg.vocab_size}")
    try:
        tensors = read_mtp_tensors(path)
    except FileNotFoundError as e:
        raise ValueError(str(e)) from None
    return head_from_tensors(tensors, target_cfg, path, dtype)


def merge_into_target(mtp_dir: str, target_dir: str) -> None:
    """Copies a trained module's `mtp.*` tensors (a directory of its own) into the target's own
    safetensors, as a Qwen3-Next checkpoint ships them; the target's weight digest is unchanged.
    The token ranking (a reduced draft vocabulary's) goes beside them, where there is one."""

    tensors = read_mtp_tensors(mtp_dir)
    if not tensors:
        raise ValueError(f"{mtp_dir}: no mtp.* tensors")
    write_mtp_tensors(target_dir, tensors)
    ranking = os.path.join(mtp_dir, vocab_lib.RANKING_FILE)
    if os.path.exists(ranking):
        shutil.copyfile(ranking, os.path.join(target_dir, vocab_lib.RANKING_FILE))
