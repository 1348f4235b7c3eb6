"""Trains a DSpark block drafter (DFlash with `markov_rank: 0`, ReaDy with `state_layers`) for a trained
target (design §5b, §5c).

The target is frozen: each batch runs it once for its hidden states at `target_layers` and its
next-token distributions. Per sequence `anchors` block starts are drawn (deterministically from
the seed and the step, so a resumed run sees the same anchors); block j holds [token a_j, MASK ...],
sees the target features of positions < a_j, and its position k learns token a_j + k + 1:

    loss = ce_weight * CE(true tokens) + l1_weight * sum_k w_k * |p_d - p_t|_1 + BCE(c_k, alpha_k)
    w_k = exp(-k / decay) (k = 0 .. W-1), alpha_k = 1 - |p_d - p_t|_1 / 2 (detached)

with the Markov head teacher-forced (its previous token is the true one). Validation walks each
block with the drafter's own previous token (greedy, as drafting does) and reports per position the
agreement with the target's argmax and the acceptance (all positions up to k agree; the target
conditioned on the data, not on the draft: an estimate — `tools/bench.py` measures the real one).
After training, the confidence head is calibrated on the validation blocks by sequential
temperature scaling (`train.calibration.calibrate_temperatures`); the temperatures go into
the exported `drafter_config.json`.

ReaDy (`state_layers` set; design §5c): the target pass is its chunked form with chunks of
`state_every` tokens (`hybrid.prefix_states`), which gives the read layers' states at every chunk
end; the anchors are drawn on that grid (multiples of `state_every`), so anchor a reads the state
after the tokens before a, as when a is a round's root. `init_from` starts from a trained block
drafter's parameters (a DSpark run; the reader fresh; its digest pinned in the run). The export's
`train_info.json` also has `final_zero_state`: the shipped weights with the reader on zeroed states.

Issue 43's recipe: `cache` names an offline target cache (`train.target_cache`: the target's features
and top-k next-token distribution per position, built once), so a step runs the drafter only (the
distillation target is the top-k renormalised); `deepspec_loss` takes CE, L1 and BCE as DeepSpec's
position-weighted means; `init_from_target` starts the backbone from the target's top attention layers with
`fc` passing the last read feature through.

Same machinery as `train.feature`: optax AdamW with warm-up + cosine, gradient clipping, an orbax
CheckpointManager (resumable, same data order), tqdm, metrics.jsonl, bf16 export of the drafter's
own parameters (`drafter_config.json` + `model.safetensors` + `train_info.json`).

    python -m train.block --config configs/code-target-dspark.json \
        --run-dir runs/code-target-dspark --export models/code-target-dspark
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from tqdm import tqdm

from specjax.models import sharding
from specjax.io.checkpoint import load_model, load_tokenizer
from specjax.drafters import block as Bk, vocab as vocab_lib
from specjax.models import family, hybrid, transformer
from train import calibration as calib, data, drafter_run, target_cache
from train.lm import load_streams_for
from train.common import REPO, resolve, repo_relative

@dataclasses.dataclass(frozen=True)
class BlockTrainConfig:
    name: str
    target: str  # the target's Hugging Face directory
    block_size: int = 8
    num_layers: int = 2
    markov_rank: int = 128  # 0: DFlash
    confidence: bool = True
    target_layers: tuple[int, ...] | None = None  # None: low / middle / high
    intermediate_size: int | None = None  # None: the target's
    # ReaDy (design §5c): read the hybrid target's committed Gated DeltaNet states
    state_layers: tuple[int, ...] | str | None = None  # target layers, "all", or None (DSpark / DFlash)
    reader_rank: int = 8
    reader_out_rank: int = 64
    reader_layer: int = 1
    state_every: int = 8  # the state pass's chunk: anchors sit at multiples of it (their states come free)
    init_from: str | None = None  # a trained block drafter to start from (its parameters; the reader fresh)
    # TreeFlash (design §5e): the autoregressive-approximation head, trained on a frozen backbone
    ar_intermediate: int = 0  # > 0: the head's width I
    freeze_backbone: bool = False  # train the TreeFlash head only (needs init_from: the backbone)
    # DPara (design §5d): blocks precomputed at acceptance boundaries (`init_from`: a DSpark run)
    boundary: bool = False
    lag_decay: float = 2.0  # boundary g in 0..W drawn with p(g) ~ exp(-g / lag_decay) (rounds accept few tokens)
    anchors: int = 32  # blocks per sequence
    ce_weight: float = 0.1
    l1_weight: float = 0.9
    decay: float = 4.0  # w_k = exp(-k / decay)
    seq_len: int = 512
    batch_size: int = 8
    steps: int = 300
    seed: int = 0
    learning_rate: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 30
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    checkpoint_every: int = 50
    eval_every: int = 100
    eval_tokens: int = 16384
    manifest: str = "train/manifest.json"
    corpus_root: str | None = None  # None: this interpreter's stdlib
    max_files: int | None = None  # per split (tests)
    # EAGLE-3's reduced draft vocabulary: the base logits and the Markov head over the N most frequent
    # target tokens of the training stream (the target's distribution renormalised over them; CE on the
    # tokens inside), fixed at training (the export ships the ranking). None: all V.
    draft_vocab: int | None = None
    # Extra training data: a .npy token stream (train.continuations: the target's own continuations)
    # appended to the corpus's train split `extra_repeat` times (a small stream made a real share). None: none.
    extra_train: str | None = None
    extra_repeat: int = 1
    # An offline target cache (`train.target_cache`: the target's features and top-k distribution per
    # position, built once): steps read it instead of running the target (drafter-only cost). None: online.
    cache: str | None = None
    # The loss as DeepSpec writes it (deepspec/modeling/dspark/loss.py): CE, L1 and the confidence BCE each a
    # position-weighted mean sum_k w_k x_k / sum_k w_k (True); False: the first recipe, CE and BCE plain means
    # and the L1 a weighted sum sum_k w_k L1_k (its weights add up to ~4.4 at W = 8: a larger step on the L1).
    deepspec_loss: bool = False
    # Start the backbone from the target: backbone layer i <- the i-th of the target's last n attention layers
    # (attention, norms, and the MLP where the widths match), fc passing the last read layer's feature
    # through (`start_from_target`). Ablation: False.
    init_from_target: bool = False
    # MASK slots as the target's embedding of this vocabulary token (as DeepSpec / z-lab / speculators: the
    # drafter then exports to speculators exactly); None: a learned MASK vector. `sample_from_anchor`: False,
    # the published DFlash slots (slot k predicts start+k, W-1 drafts; z-lab exports need it).
    mask_token_id: int | None = None
    sample_from_anchor: bool = True

    def __post_init__(self):
        if self.extra_repeat < 1:
            raise ValueError(f"extra_repeat must be >= 1, got {self.extra_repeat}")
        if self.state_every < 1:
            raise ValueError(f"state_every must be >= 1, got {self.state_every}")
        if isinstance(self.state_layers, str) and self.state_layers != "all":
            raise ValueError(f"state_layers must be 'all' or a list of target layers, got {self.state_layers!r}")
        if self.lag_decay <= 0:
            raise ValueError(f"lag_decay must be > 0, got {self.lag_decay}")
        if self.freeze_backbone and (not self.init_from or self.ar_intermediate < 1):
            raise ValueError("freeze_backbone trains a TreeFlash head on a trained backbone: it needs init_from "
                             "(the backbone) and ar_intermediate > 0")


def load_config(path) -> BlockTrainConfig:
    return drafter_run.load_config(BlockTrainConfig, path)


def head_config(cfg: BlockTrainConfig, target) -> Bk.BlockConfig:
    return Bk.BlockConfig.for_target(target.config, block_size=cfg.block_size, num_layers=cfg.num_layers,
                                     markov_rank=cfg.markov_rank, confidence=cfg.confidence,
                                     target_layers=cfg.target_layers, intermediate_size=cfg.intermediate_size,
                                     state_layers=cfg.state_layers or (), reader_rank=cfg.reader_rank,
                                     reader_out_rank=cfg.reader_out_rank, reader_layer=cfg.reader_layer,
                                     ar_intermediate=cfg.ar_intermediate, boundary=cfg.boundary,
                                     draft_vocab=cfg.draft_vocab or 0, mask_token_id=cfg.mask_token_id,
                                     sample_from_anchor=cfg.sample_from_anchor)


def sample_anchors(key, B: int, T: int, A: int, W: int):
    """[B, A] distinct anchors per row in [1, T - W - 1] (context non-empty, labels inside)."""
    n = T - W - 1
    if A > n:
        raise ValueError(f"{A} anchors do not fit a sequence of {T} tokens with blocks of {W}")
    u = jax.random.uniform(key, (B, n))
    return jnp.sort(jnp.argsort(u, axis=1)[:, :A], axis=1).astype(jnp.int32) + 1


def eval_anchors(B: int, T: int, A: int, W: int):
    """[B, A] evenly spaced anchors (validation)."""
    return jnp.broadcast_to(jnp.linspace(1, T - W - 1, A).astype(jnp.int32)[None], (B, A))


def grid_anchors(key, B: int, T: int, A: int, W: int, every: int, evenly: bool = False):
    """ReaDy's anchors: [B, A] distinct multiples of `every` in [every, T - W - 1] (the state pass
    gives the target's state after each multiple of `every` tokens, so these cost nothing more);
    random per row, or evenly spaced (validation)."""
    n = (T - W - 1) // every
    if A > n:
        raise ValueError(f"{A} anchors do not fit a sequence of {T} tokens on a grid of {every} with blocks of {W}: "
                         f"at most {n} (lower anchors or state_every)")
    if evenly:
        m = jnp.linspace(1, n, A).astype(jnp.int32)
        return jnp.broadcast_to(m[None] * every, (B, A))
    u = jax.random.uniform(key, (B, n))
    return ((jnp.sort(jnp.argsort(u, axis=1)[:, :A], axis=1) + 1) * every).astype(jnp.int32)


def cyclic_lags(anchors_BxA, W: int):
    """DPara's validation boundaries [B, A]: 0, 1, .., W, 0, .. over the anchors (each below its anchor)."""
    A = anchors_BxA.shape[1]
    return jnp.minimum(jnp.arange(A, dtype=jnp.int32) % (W + 1), anchors_BxA - 1)


def sample_lags(key, anchors_BxA, W: int, decay: float):
    """DPara's training boundaries [B, A]: g in 0..W with p(g) ~ exp(-g / decay), each below its anchor
    (block j's round was rooted at a_j - g_j - 1 >= 0)."""
    g = jax.random.categorical(key, -jnp.arange(W + 1, dtype=jnp.float32) / decay, shape=anchors_BxA.shape)
    return jnp.minimum(g.astype(jnp.int32), anchors_BxA - 1)


def anchors_for(cfg: BlockTrainConfig, hcfg: Bk.BlockConfig, key, B: int, T: int, evenly: bool = False):
    """The anchors of a batch: anywhere (DSpark / DFlash) or on the state grid (ReaDy)."""
    W = hcfg.block_size
    if hcfg.reads_state:
        return grid_anchors(key, B, T, cfg.anchors, W, cfg.state_every, evenly)
    return eval_anchors(B, T, cfg.anchors, W) if evenly else sample_anchors(key, B, T, cfg.anchors, W)


def _target_pass(target, tokens_BxT, hcfg: Bk.BlockConfig, anchors_BxA, every: int):
    """(features, logits, states at the anchors or None), all without gradient. ReaDy: the states are
    the read layers' committed states when the anchor is the round's root (after tokens < a_j),
    [L_read, B, A, H, dk, dv], from one chunked pass (`hybrid.prefix_states`)."""
    B, T = tokens_BxT.shape
    layers = hcfg.target_layers
    sg = jax.lax.stop_gradient
    if hcfg.reads_state:  # anchors must sit on the grid of `every` (`anchors_for`): an anchor a reads entry a // every
        out, states = hybrid.prefix_states(target, tokens_BxT, every, hidden_layers=layers,
                                           read=Bk.check_state_target(hcfg, target))  # [L_read, B, T // every + 1, H, dk, dv]
        at = jnp.take_along_axis(states, (anchors_BxA // every)[None, :, :, None, None, None], axis=2)
        return sg(Bk.target_features(out)), sg(out.logits), sg(at)
    fam = family(target)  # a dense or a hybrid target: the same features, its own cache
    out = fam.forward(target, tokens_BxT, jnp.broadcast_to(jnp.arange(T)[None], (B, T)), fam.init_cache(target, B, T),
                      transformer.causal_mask(B, T), hidden_layers=layers)
    return sg(Bk.target_features(out)), sg(out.logits), None


def _cached_pass(cached: dict, hcfg: Bk.BlockConfig, anchors_BxA, every: int):
    """`_target_pass` from an offline cache's batch (`train.target_cache`): the stored features, the
    top-k as logits (-inf elsewhere), the states at the anchors."""
    tlogits = target_cache.dense_logits(cached["topk_ids"], cached["topk_logp"], hcfg.vocab_size)
    states = cached.get("states")
    if hcfg.reads_state:
        if states is None:
            raise ValueError("this cache holds no recurrent states: build it with --state-layers for ReaDy")
        states = jnp.take_along_axis(states.astype(jnp.float32), (anchors_BxA // every)[None, :, :, None, None, None], axis=2)
    return cached["features"], tlogits, states


def block_loss(head, target, tokens_BxT, anchors_BxA, cfg: BlockTrainConfig, zero_state: bool = False, lags_BxA=None,
               cached: dict | None = None):
    """(loss, metrics): the DSpark objective on teacher-forced blocks (`zero_state`: ReaDy's
    ablation, the reader on zeroed states; `lags`: DPara's acceptance boundaries, default
    `cyclic_lags`; `cached`: the batch's offline target cache, in place of the target's pass)."""
    hc = head.config
    W = hc.drafts  # = block_size, or W-1 without the anchor's slot (its outputs dropped by train_logits)
    if cached is None:
        feats, tlogits, states = _target_pass(target, tokens_BxT, hc, anchors_BxA, cfg.state_every)
    else:
        feats, tlogits, states = _cached_pass(cached, hc, anchors_BxA, cfg.state_every)
    if zero_state:
        states = jnp.zeros_like(states)
    if hc.boundary and lags_BxA is None:
        lags_BxA = cyclic_lags(anchors_BxA, W)
    tp = Bk.train_logits(head, target, tokens_BxT, feats, anchors_BxA, states, lags_BxA)  # [B, A, W, V]
    logits, conf = tp.logits, tp.conf
    if cfg.freeze_backbone:  # the TreeFlash head alone learns: the DSpark objective on its conditional rows
        logits, conf = tp.ar, None
    elif hc.ar_drafts:  # DPara's autoregressive head drafts: it learns with the backbone
        logits = tp.ar
    B, A = anchors_BxA.shape
    pos = (anchors_BxA[..., None] + jnp.arange(W)).reshape(B, A * W)  # target at a+k predicts a+k+1
    t_logits = jnp.take_along_axis(tlogits, pos[..., None], axis=1)
    labels = jnp.take_along_axis(tokens_BxT, pos + 1, axis=1).reshape(B, A, W)
    inside = jnp.ones(labels.shape, bool)
    if head.vocab_ids is not None:  # over the draft vocabulary: the target renormalised, CE on the labels inside
        t_logits = t_logits[..., head.vocab_ids[...]]
        labels = head.vocab_index[...][labels]
        inside = labels < hc.draft_vocab
    # A cache's top-k (-inf outside it) may hold no token of the draft vocabulary at a position: no target
    # distribution there, so that position leaves the L1 and confidence terms (else the softmax is NaN).
    has = jnp.isfinite(t_logits).any(-1).reshape(B, A, W)
    p_t = jax.nn.softmax(jnp.where(jnp.isfinite(t_logits), t_logits, -1e30), -1).reshape(B, A, W, -1)
    logp = jax.nn.log_softmax(logits, -1)
    label_logp = jnp.take_along_axis(logp, jnp.minimum(labels, logp.shape[-1] - 1)[..., None], axis=-1)[..., 0]
    l1 = jnp.sum(jnp.abs(jnp.exp(logp) - p_t), axis=-1)  # [B, A, W]
    # the mean over (B, A) of the positions with a target (exactly jnp.mean's value when every position has one)
    mean_BA = lambda x: jnp.mean(jnp.where(has, x, 0.0), axis=(0, 1)) * (B * A / jnp.maximum(jnp.sum(has, axis=(0, 1)), 1))  # noqa: E731
    w = jnp.exp(-jnp.arange(W) / cfg.decay)
    if cfg.deepspec_loss:  # position-weighted means, as DeepSpec
        wi = w * inside
        ce = -jnp.sum(jnp.where(inside, label_logp, 0.0) * w) / jnp.maximum(jnp.sum(wi), 1e-6)
        l1_term = jnp.sum(w * mean_BA(l1)) / jnp.sum(w)
    else:
        ce = -jnp.sum(jnp.where(inside, label_logp, 0.0)) / jnp.maximum(jnp.sum(inside), 1)
        l1_term = jnp.sum(w * mean_BA(l1))
    loss = cfg.ce_weight * ce + cfg.l1_weight * l1_term
    bce = jnp.float32(0)
    if conf is not None:
        alpha = jax.lax.stop_gradient(1 - 0.5 * l1)
        per = optax.sigmoid_binary_cross_entropy(conf, alpha)  # [B, A, W]
        bce = (jnp.sum(w * mean_BA(per)) / jnp.sum(w) if cfg.deepspec_loss
               else jnp.mean(jnp.where(has, per, 0.0)) * (has.size / jnp.maximum(jnp.sum(has), 1)))
        loss = loss + bce
    agree = jnp.mean(jnp.argmax(logits, -1) == jnp.argmax(p_t, -1), axis=(0, 1))
    metrics = {"ce": ce, "l1": mean_BA(l1), "bce": bce, "agree_tf": agree}
    if cfg.freeze_backbone:  # against the backbone's own (Markov) rows: top-1 agreement and top-4 coverage
        t_arg = jnp.argmax(p_t, -1)
        cover = lambda lg: jnp.mean(jnp.any(jax.lax.top_k(lg, 4)[1] == t_arg[..., None], -1), axis=(0, 1))  # noqa: E731
        metrics.update(agree_tf_markov=jnp.mean(jnp.argmax(tp.logits, -1) == t_arg, axis=(0, 1)),
                       top4_tf=cover(logits), top4_tf_markov=cover(tp.logits))
    return loss, metrics


def eval_blocks(head, target, tokens_BxT, anchors_BxA, every: int, zero_state: bool = False, lags_BxA=None):
    """Self-fed greedy walk per block: (agree [B, A, W], accepted [B, A, W], confidence logits or None).
    `zero_state`: ReaDy's ablation, the reader on zeroed states; `lags`: DPara's boundaries."""
    hc = head.config
    W = hc.drafts
    feats, tlogits, states = _target_pass(target, tokens_BxT, hc, anchors_BxA, every)
    if zero_state:
        states = jnp.zeros_like(states)
    _, _, h, base, _, pre = Bk.train_logits(head, target, tokens_BxT, feats, anchors_BxA, states, lags_BxA)
    B, A = anchors_BxA.shape
    anchor_tok = jnp.take_along_axis(tokens_BxT, anchors_BxA, axis=1)
    toks, conf = Bk.self_fed_walk(head, base.reshape(B * A, W, -1), h.reshape(B * A, W, -1), anchor_tok.reshape(-1),
                                  pre.reshape(B * A, W, -1), target)
    pos = (anchors_BxA[..., None] + jnp.arange(W)).reshape(B, A * W)
    t_arg = jnp.argmax(jnp.take_along_axis(tlogits, pos[..., None], axis=1), -1).reshape(B, A, W)
    agree = toks.reshape(B, A, W) == t_arg
    accepted = jnp.cumprod(agree, axis=-1).astype(bool)
    return agree, accepted, (None if conf is None else conf.reshape(B, A, W))


@functools.lru_cache(maxsize=4)
def _fns(cfg: BlockTrainConfig, target_dir: str, vocab_ids: tuple[int, ...] | None = None, weights: str = "float32"):
    """`vocab_ids`: the draft vocabulary's token ids (`draft_vocab`), constants of the head beside its parameters;
    `weights`: the target's weight dtype (its cache's: `drafter_run.target_weights`)."""
    target = load_model(target_dir, weights=weights)
    hcfg = head_config(cfg, target)
    new_head = lambda seed: Bk.BlockHead(hcfg, nnx.Rngs(seed), draft_ids=vocab_ids)  # noqa: E731
    head0 = new_head(0)
    head_def, consts = nnx.graphdef(head0), nnx.state(head0, vocab_lib.DraftVocab)

    def head_of(params):
        return nnx.merge(head_def, params, consts)

    tgt_def, tgt_params = nnx.split(target)
    schedule, tx = drafter_run.optimizer(cfg)

    def frozen(path) -> bool:  # a TreeFlash run trains its head only
        return cfg.freeze_backbone and "ar_head" not in jax.tree_util.keystr(path)

    def loss_of(params, tokens, anchors, zero_state=False, lags=None, cached=None):
        params = jax.tree_util.tree_map_with_path(lambda p, x: jax.lax.stop_gradient(x) if frozen(p) else x, params)
        return block_loss(head_of(params), nnx.merge(tgt_def, tgt_params), tokens, anchors, cfg, zero_state,
                          lags, cached)

    @functools.partial(jax.jit, donate_argnums=0)
    def train_step(state, tokens, cached=None):
        B, T = tokens.shape
        key = jax.random.fold_in(jax.random.key(cfg.seed), state["step"])
        anchors = anchors_for(cfg, hcfg, key, B, T)
        lags = sample_lags(jax.random.fold_in(key, 1), anchors, hcfg.block_size, cfg.lag_decay) if hcfg.boundary else None
        (loss, m), grads = jax.value_and_grad(loss_of, has_aux=True)(state["params"], tokens, anchors, False, lags,
                                                                     cached)
        updates, opt = tx.update(grads, state["opt_state"], state["params"])
        new = optax.apply_updates(state["params"], updates)
        new = jax.tree_util.tree_map_with_path(lambda p, n, o: o if frozen(p) else n, new, state["params"])
        new = {"params": new, "opt_state": opt, "step": state["step"] + 1}
        return (sharding.constrain(new, sharding.param_specs(new, RULES)),  # on a mesh: one layout every step
                {"loss": loss, **m, "lr": schedule(state["step"])})

    @functools.partial(jax.jit, static_argnames="zero_state")
    def eval_step(params, tokens, zero_state=False):
        B, T = tokens.shape
        anchors = anchors_for(cfg, hcfg, None, B, T, evenly=True)
        lags = cyclic_lags(anchors, hcfg.block_size) if hcfg.boundary else None
        loss, m = loss_of(params, tokens, anchors, zero_state, lags)
        agree, accepted, conf = eval_blocks(head_of(params), nnx.merge(tgt_def, tgt_params), tokens, anchors,
                                            cfg.state_every, zero_state, lags)
        return loss, m, agree, accepted, conf, lags

    def init():
        head = new_head(cfg.seed)
        if cfg.init_from_target:
            start_from_target(head, target if weights == "float32" else load_model(target_dir))  # from the float weights
        if cfg.init_from:
            drafter_run.start_from(head, resolve(cfg.init_from))
        params = nnx.state(head, nnx.Param)
        return {"params": params, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32)}

    return target, hcfg, head_of, train_step, eval_step, init


def start_from_target(head: Bk.BlockHead, target) -> None:
    """The backbone from the target's top attention layers (issue 43's initialisation): backbone layer
    i takes the i-th of the target's last n attention layers (a dense target: its top n layers; a
    hybrid: its top n full-attention layers, the Gated DeltaNet layers between them having no
    attention to give) with its attention projections, norms and (where the widths match) MLP; `fc`
    passes the last read layer's hidden state through (identity on its slice, zero elsewhere), so at
    step 0 the context is that feature, normalised. A hybrid's gated attention gives the query half of
    its q_proj (the output gate is dropped), its q/k norms, and its (1 + w) norms as plain scales; its
    partial rotary becomes the drafter's full rotary, so the copy is a start, not the same function.
    A llama target has no q/k norms: the drafter's stay at one."""
    cfg, tcfg = head.config, target.config
    n = len(head.layers)
    if (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) != (tcfg.num_heads, tcfg.num_kv_heads, tcfg.head_dim):
        raise ValueError("init_from_target needs the target's attention shapes in the backbone")
    attn_layers = [i for i, layer in enumerate(target.layers) if getattr(layer, "self_attn", None) is not None]
    if len(attn_layers) < n:
        raise ValueError(f"init_from_target: the target has {len(attn_layers)} attention layers, the backbone {n}")
    H, D = tcfg.num_heads, tcfg.head_dim

    def scale(norm):  # a norm's effective per-channel scale, as a fresh array (the training state is donated)
        w = jnp.array(norm.weight.get_value(), jnp.float32)  # a copy
        return (1.0 + w) if isinstance(norm, hybrid.OffsetRMSNorm) else w

    for layer, src_i in zip(head.layers, attn_layers[-n:]):
        src = target.layers[src_i]
        attn, dt = src.self_attn, layer.q_proj.weight.dtype
        wq = attn.q_proj.weight.get_value()
        if wq.shape[1] == 2 * H * D:  # gated attention: per head [query D | gate D]
            wq = wq.reshape(wq.shape[0], H, 2 * D)[..., :D].reshape(wq.shape[0], H * D)
        layer.q_proj.weight.set_value(jnp.array(wq, dt))
        for name in ("k_proj", "v_proj", "o_proj"):
            getattr(layer, name).weight.set_value(jnp.array(getattr(attn, name).weight.get_value(), dt))
        for name in ("input_layernorm", "post_attention_layernorm"):
            getattr(layer, name).weight.set_value(scale(getattr(src, name)).astype(getattr(layer, name).weight.dtype))
        for name in ("q_norm", "k_norm"):
            if getattr(attn, name, None) is not None:
                getattr(layer, name).weight.set_value(scale(getattr(attn, name)).astype(getattr(layer, name).weight.dtype))
        if cfg.intermediate_size == tcfg.intermediate_size:
            for name in ("gate_proj", "up_proj", "down_proj"):
                getattr(layer.mlp, name).weight.set_value(jnp.array(getattr(src.mlp, name).weight.get_value()))
    E, L = cfg.hidden_size, len(cfg.target_layers)
    head.fc.weight.set_value(jnp.zeros((L * E, E), head.fc.weight.dtype).at[(L - 1) * E:].set(jnp.eye(E)))


def evaluate(eval_step, params, windows, batch_size, zero_state=False) -> tuple[dict, np.ndarray | None, np.ndarray]:
    """(record, confidence logits [N, W] or None, accepted [N, W]) over the validation windows."""
    n = (len(windows) // batch_size) * batch_size or len(windows)
    losses, l1, agree_tf, agree, accepted, conf, extra, lags = [], [], [], [], [], [], {}, []
    for i in range(0, n, batch_size):
        loss, m, ag, acc, cf, lg = eval_step(params, jnp.asarray(windows[i:i + batch_size]), zero_state=zero_state)
        losses.append(float(loss))
        l1.append(np.asarray(m["l1"]))
        agree_tf.append(np.asarray(m["agree_tf"]))
        for name in ("agree_tf_markov", "top4_tf", "top4_tf_markov"):
            if name in m:
                extra.setdefault(name, []).append(np.asarray(m[name]))
        W = ag.shape[-1]
        agree.append(np.asarray(ag).reshape(-1, W))
        accepted.append(np.asarray(acc).reshape(-1, W))
        if cf is not None:
            conf.append(np.asarray(cf).reshape(-1, W))
        if lg is not None:
            lags.append(np.asarray(lg).reshape(-1))
    agree, accepted = np.concatenate(agree), np.concatenate(accepted)
    rec = {"val_loss": float(np.mean(losses)), "val_l1": np.mean(l1, 0).round(4).tolist(),
           "val_agree_teacher_forced": np.mean(agree_tf, 0).round(4).tolist(),
           "val_agree": agree.mean(0).round(4).tolist(), "val_accept": accepted.mean(0).round(4).tolist(),
           "val_tau_estimate": round(1.0 + float(accepted.sum(1).mean()), 3), "val_blocks": int(len(agree))}
    names = {"agree_tf_markov": "val_agree_teacher_forced_markov", "top4_tf": "val_top4_teacher_forced",
             "top4_tf_markov": "val_top4_teacher_forced_markov"}  # a TreeFlash run: its head's rows and the backbone's
    rec.update({names[k]: np.mean(v, 0).round(4).tolist() for k, v in extra.items()})
    if lags:  # DPara: the estimate per acceptance boundary the block was precomputed at
        lags = np.concatenate(lags)
        rec["val_tau_estimate_by_boundary"] = [round(1.0 + float(accepted[lags == g].sum(1).mean()), 3)
                                               for g in range(int(lags.max()) + 1) if (lags == g).any()]
    return rec, (np.concatenate(conf) if conf else None), accepted


RULES = Bk.BlockDrafter.partition_rules  # the head's layout on a mesh (design §10)


@drafter_run.on_mesh
def train(cfg: BlockTrainConfig, run_dir, export_dir=None, *, max_steps=None, overwrite=False, progress=True, mesh=None):
    """Trains (or resumes) the drafter; exports when finished. `mesh` (`specjax.models.sharding.make_mesh`):
    the batch over its `data` axis, the head tensor parallel over `model` (the frozen target is
    replicated); the checkpoints are the same, and restore on any layout."""
    run_dir = Path(run_dir)
    export_dir = Path(export_dir) if export_dir is not None else None
    target_dir = resolve(cfg.target)
    identity = drafter_run.identity(cfg, target_dir)
    if cfg.state_layers:
        hcfg_check = head_config(cfg, load_model(str(target_dir)))  # bad reader keys: refused before the run dir
        n = (cfg.seq_len - hcfg_check.block_size - 1) // cfg.state_every
        if cfg.anchors > n:
            raise ValueError(f"{cfg.anchors} anchors do not fit windows of {cfg.seq_len} tokens on a state grid of "
                             f"{cfg.state_every} with blocks of {hcfg_check.block_size}: at most {n}")
    if cfg.init_from:  # the starting weights are part of the run (a retrained export changes its digest)
        identity["init_from_sha256"] = drafter_run.check_init_from(resolve(cfg.init_from), identity["target_sha256"], "block")
    identity.update(drafter_run.cache_identity(cfg))  # a resumed run refuses a changed cache
    drafter_run.open_run(run_dir, export_dir, identity, overwrite)

    tok = load_tokenizer(str(target_dir))
    streams = load_streams_for(tok, cfg.manifest, cfg.corpus_root, cfg.max_files, run_dir / "token-cache")
    stream = drafter_run.train_stream(cfg, run_dir, streams)  # the corpus, then extra_train
    ranking, ids = drafter_run.draft_ranking(cfg, stream, target_dir)
    target, hcfg, head_of, train_step, eval_step, init = _fns(cfg, str(target_dir), ids, drafter_run.target_weights(cfg))
    val = data.eval_windows(streams.validation, cfg.seq_len - 1, cfg.eval_tokens)  # [N, seq_len]
    cache = target_cache.TargetCache(resolve(cfg.cache), str(target_dir), hcfg.target_layers) if cfg.cache else None
    if cache is not None and cache.manifest["seq_len"] != cfg.seq_len:
        raise ValueError(f"cache {cfg.cache} holds windows of {cache.manifest['seq_len']} tokens; seq_len is {cfg.seq_len}")
    if cache is not None and hcfg.reads_state:  # ReaDy reads the cache's states: the same layers, the same grid
        have = (cache.manifest.get("state_layers") or [], cache.manifest.get("state_every"))
        if have != (list(hcfg.state_layers), cfg.state_every):
            raise ValueError(f"cache {cfg.cache} holds the states of layers {have[0]} every {have[1]} tokens; this "
                             f"drafter reads layers {list(hcfg.state_layers)} every {cfg.state_every}")

    state = sharding.place_params(init(), RULES, mesh)
    mngr, state = drafter_run.checkpoints(run_dir, cfg.checkpoint_every, state)
    start, stop = int(state["step"]), cfg.steps if max_steps is None else min(max_steps, cfg.steps)
    bar = tqdm(total=cfg.steps, initial=start, desc=cfg.name, disable=not progress, dynamic_ncols=True)
    t_run, t_last, n_tok, train_s = time.perf_counter(), time.perf_counter(), 0, 0.0
    session = drafter_run.session_key()
    record = None
    for step in range(start, stop):
        if cache is None:
            batch, cached = data.batch_at(stream, cfg.seq_len - 1, cfg.batch_size, cfg.seed, 0, step), None  # [B, seq_len]
        else:
            batch, cached = cache.step_batch(step, cfg.batch_size, cfg.seed, mesh, states=hcfg.reads_state)
        t0 = time.perf_counter()
        state, m = train_step(state, jnp.asarray(batch) if mesh is None else sharding.place(batch, sharding.BATCH, mesh),
                              cached)
        loss = float(m["loss"])
        train_s += time.perf_counter() - t0
        if not math.isfinite(loss):
            raise FloatingPointError(f"loss is {loss} at step {step + 1}")
        n_tok += batch.size
        bar.set_postfix(loss=f"{loss:.3f}", agree0=f"{float(m['agree_tf'][0]):.2f}",
                        tok_s=f"{n_tok / (time.perf_counter() - t_last):.0f}", refresh=False)
        bar.update(1)
        done = step + 1
        if done % cfg.eval_every == 0 or done == cfg.steps:
            record, _, _ = evaluate(eval_step, state["params"], val, cfg.batch_size)
            record.update(step=done, train_loss=loss, lr=float(m["lr"]))
            with (run_dir / "metrics.jsonl").open("a") as f:
                f.write(json.dumps(record) + "\n")
            bar.write(f"step {done}: val loss {record['val_loss']:.4f}, acceptance by position {record['val_accept']}")
            t_last, n_tok = time.perf_counter(), 0
        mngr.save(done, args=ocp.args.StandardSave(state), force=(done == stop))
        if done % cfg.checkpoint_every == 0 and done < stop:
            drafter_run.record_session(run_dir, start, done, train_s, time.perf_counter() - t_run, session)
    bar.close()
    mngr.wait_until_finished()
    mngr.close()
    drafter_run.record_session(run_dir, start, stop, train_s, time.perf_counter() - t_run, session)
    if int(state["step"]) == cfg.steps and export_dir is not None:
        export(cfg, identity, head_of, eval_step, state["params"], val, export_dir, run_dir, ranking)
    return state


def export(cfg, identity, head_of, eval_step, params, val, export_dir: Path, run_dir: Path, ranking=None) -> None:
    """Calibrates the confidence head, then writes the drafter. The calibration sees the weights as
    shipped (rounded to bf16), fits the temperatures on the even validation blocks and reports the
    ECE on the odd ones (held out); the final record is of the shipped weights too."""
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(x.dtype), params)
    record, conf, accepted = evaluate(eval_step, params, val, cfg.batch_size)
    head = head_of(params)
    calibration = None
    backbone = str(resolve(cfg.init_from)) if cfg.freeze_backbone else None
    if backbone is not None:  # the backbone is unchanged: its calibration stands, and only the head is written
        head.config = dataclasses.replace(head.config, confidence_temperatures=Bk.read_config(backbone).confidence_temperatures)
        conf = None
    if conf is not None:
        temps, _, _ = calib.calibrate_temperatures(conf[0::2], accepted[0::2])
        head.config = dataclasses.replace(head.config, confidence_temperatures=temps)
        calibration = {"temperatures": list(temps), "objective": "log_loss", "fit_blocks": int(len(conf[0::2])),
                       "heldout_blocks": int(len(conf[1::2])),
                       "ece_before": np.round(calib.survival_ece(conf[1::2], accepted[1::2]), 4).tolist(),
                       "ece_after": np.round(calib.survival_ece(conf[1::2], accepted[1::2], temps), 4).tolist()}
    Bk.save_block_head(head, str(export_dir), backbone=backbone)
    if ranking is not None:  # the draft vocabulary's ids: the first draft_vocab of it
        vocab_lib.save_ranking(str(export_dir), ranking)
    timing = drafter_run.session_timing(run_dir)["sessions"]
    train_s = sum(t["train_step_s"] for t in timing)
    tokens = cfg.steps * cfg.batch_size * cfg.seq_len
    config = drafter_run.config_record(cfg)
    info = {"run": {"config": config, "target_sha256": identity["target_sha256"],
                    "target_weights": identity.get("target_weights", "float32")}, "tokens_trained": tokens,
            "block_positions_trained": cfg.steps * cfg.batch_size * cfg.anchors * cfg.block_size,
            "timing": {"train_step_s": round(train_s, 1), "wall_s": round(sum(t["wall_s"] for t in timing), 1),
                       "tokens_per_s": round(tokens / max(train_s, 1e-9), 1), "sessions": timing},
            "final": record, "calibration": calibration, "run_dir": repo_relative(run_dir)}
    if head.config.reads_state:  # ReaDy's ablation on the shipped weights: the reader on zeroed states
        info["final_zero_state"], _, _ = evaluate(eval_step, params, val, cfg.batch_size, zero_state=True)
    (export_dir / "train_info.json").write_text(json.dumps(info, indent=2) + "\n")
    print(f"exported {export_dir}")


def main(argv=None):
    drafter_run.main(__doc__, load_config, train, argv)


if __name__ == "__main__":
    jax.config.update("jax_compilation_cache_dir", str(REPO / "runs" / "jax-cache"))
    main()
