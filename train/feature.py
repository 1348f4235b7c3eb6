"""Trains an EAGLE-3 style feature drafter for a trained target (design §5).

The target is frozen: each batch runs it once for its fused hidden states (low / middle / high
layers) and its next-token distributions. The drafter is trained with training-time test: it
unrolls `ttt_steps` draft steps per anchor, each step fed its own previous hidden state as in
drafting, and learns the target's distribution (soft cross-entropy) with a loss weighted by
`depth_decay ** (step - 1)`. Same machinery as `train.lm`: optax AdamW with warm-up + cosine,
gradient clipping, an orbax CheckpointManager (resumable, same data order), tqdm, validation
metrics (loss and top-1 agreement with the target per step) to metrics.jsonl, and an export
(`drafter_config.json` + `model.safetensors`) that `specjax.drafters.load_drafter` reads.

    python -m train.feature --config configs/code-target-feature.json \
        --run-dir runs/code-target-feature --export models/code-target-feature
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.io.checkpoint import load_model
from specjax.drafters import feature as F, vocab as vocab_lib
from specjax.models import family, transformer
from train import drafter_run
from train.common import REPO, resolve

@dataclasses.dataclass(frozen=True)
class FeatureTrainConfig:
    name: str
    target: str  # the target's Hugging Face directory
    target_layers: tuple[int, ...] | None = None  # None: low / middle / high
    intermediate_size: int | None = None  # None: the target's
    ttt_steps: int = 4
    depth_decay: float = 0.8
    seq_len: int = 512
    batch_size: int = 8
    steps: int = 600
    seed: int = 0
    learning_rate: float = 5e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    checkpoint_every: int = 50
    eval_every: int = 100
    eval_tokens: int = 16384
    manifest: str = "train/manifest.json"
    corpus_root: str | None = None  # None: this interpreter's stdlib
    max_files: int | None = None  # per split (tests)
    # EAGLE-3's reduced draft vocabulary: the head is trained on the N most frequent target tokens of
    # the training stream (the target's distribution renormalised over them); the export ships the
    # ranking, so a smaller N can be chosen at load time (specjax.drafters.vocab). None: all V.
    draft_vocab: int | None = None
    # Extra training data: a .npy int32 token stream (train.continuations: the target's own
    # continuations) appended to the corpus's train split. None: the corpus alone.
    extra_train: str | None = None
    # An offline target cache of `target_layers` (`train.target_cache`): steps read the target's features and
    # top-k distribution from it instead of running the target. None: online.
    cache: str | None = None
    # Start the decoder layer from the target's top layer (`start_from_target`); ablation: False.
    init_from_target: bool = False
    # Start from a trained feature drafter of this target (its export directory: every parameter; the
    # draft ranking is the new stream's, the LM head being the target's rows): a retrain on new data
    # continues from the drafter it replaces. Its weights' digest joins the run's identity.
    init_from: str | None = None


def load_config(path) -> FeatureTrainConfig:
    return drafter_run.load_config(FeatureTrainConfig, path)


def head_config(cfg: FeatureTrainConfig, target) -> F.FeatureConfig:
    return F.FeatureConfig.for_target(target.config, cfg.target_layers, cfg.intermediate_size)


def ttt_loss(head, target, tokens_BxT, decay: float, steps: int, vocab_ids=None, cached: dict | None = None):
    """(weighted loss, per-step loss [K], per-step top-1 agreement [K]). `vocab_ids` [N]: a reduced
    draft vocabulary (the loss and the agreement over those tokens). `cached`: the batch's offline
    target cache (features, top-k), in place of the target's pass (the top-k renormalised)."""
    B, T = tokens_BxT.shape
    if cached is None:
        fam = family(target)  # a dense or a hybrid target: the same features, its own cache
        out = fam.forward(target, tokens_BxT, jnp.broadcast_to(jnp.arange(T)[None], (B, T)),
                          fam.init_cache(target, B, T), transformer.causal_mask(B, T),
                          hidden_layers=head.config.target_layers)
        feats, t_logits = jax.lax.stop_gradient(F.target_features(out)), jax.lax.stop_gradient(out.logits)
    else:
        feats = cached["features"].astype(head.fc.weight.dtype)
        t_logits = (cached["topk_ids"], cached["topk_logp"])  # sparse: no [B, T, V] target is built
    if vocab_ids is None:
        logits = F.ttt_logits(head, target, tokens_BxT, feats, steps)  # [K, B, T, V]
        return drafter_run.unrolled_loss(logits, t_logits, decay)
    rows = jax.lax.stop_gradient(vocab_lib.head_rows(target, vocab_ids))  # [N, E]
    logits = F.ttt_logits(head, target, tokens_BxT, feats, steps, rows)  # [K, B, T, N]
    return drafter_run.unrolled_loss(logits, drafter_run.draft_vocab_target(t_logits, vocab_ids, head.config.vocab_size),
                                     decay)


def start_from_target(head: F.FeatureHead, target) -> None:
    """The decoder layer from the target's top layer (issue 43), where shapes allow: q/k/v read
    [norm(E[x]); norm(feature)] (2E wide), so their feature half takes the target layer's projection
    and their embedding half starts at zero; `hidden_norm` the layer's input norm; o_proj, the
    post-attention norm, the MLP (where the widths match) and the final norm the target's; `fc`
    passes the last read layer's hidden state through."""
    cfg, tcfg = head.config, target.config
    src = target.layers[tcfg.num_layers - 1]
    attn = getattr(src, "self_attn", None)
    if attn is None or (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) != (tcfg.num_heads, tcfg.num_kv_heads, tcfg.head_dim):
        raise ValueError("init_from_target needs a dense target whose attention shapes the drafter shares")
    E = cfg.hidden_size
    copy = lambda x: jnp.array(x, head.fc.weight.dtype)  # noqa: E731  (a copy: the training state is donated)
    for name in ("q_proj", "k_proj", "v_proj"):
        w = getattr(attn, name).weight.get_value()  # [E, out]
        getattr(head, name).weight.set_value(jnp.concatenate([jnp.zeros_like(w), w]).astype(head.fc.weight.dtype))
    head.o_proj.weight.set_value(copy(attn.o_proj.weight.get_value()))
    head.hidden_norm.weight.set_value(copy(src.input_layernorm.weight.get_value()))
    head.post_attention_layernorm.weight.set_value(copy(src.post_attention_layernorm.weight.get_value()))
    head.norm.weight.set_value(copy(target.norm.weight.get_value()))
    if cfg.intermediate_size == tcfg.intermediate_size:
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(head.mlp, name).weight.set_value(copy(getattr(src.mlp, name).weight.get_value()))
    L = len(cfg.target_layers)
    head.fc.weight.set_value(jnp.zeros((L * E, E), head.fc.weight.dtype).at[(L - 1) * E:].set(jnp.eye(E)))


@functools.lru_cache(maxsize=4)
def _fns(cfg: FeatureTrainConfig, target_dir: str, vocab_ids: tuple[int, ...] | None = None, weights: str = "float32"):
    target = load_model(target_dir, weights=weights)
    hcfg = head_config(cfg, target)
    head_def = nnx.graphdef(nnx.eval_shape(lambda: F.FeatureHead(hcfg, nnx.Rngs(0))))
    tgt_def, tgt_params = nnx.split(target)

    def loss_of(params, tokens, cached=None):
        return ttt_loss(nnx.merge(head_def, params), nnx.merge(tgt_def, tgt_params), tokens,
                        cfg.depth_decay, cfg.ttt_steps, None if vocab_ids is None else jnp.asarray(vocab_ids), cached)

    def init_params():
        head = F.FeatureHead(hcfg, nnx.Rngs(cfg.seed))
        if cfg.init_from_target:
            start_from_target(head, target if weights == "float32" else load_model(target_dir))  # from the float weights
        if cfg.init_from:
            drafter_run.start_from(head, resolve(cfg.init_from))
        return nnx.state(head, nnx.Param)

    train_step, eval_step, init = drafter_run.unrolled_steps(cfg, loss_of, init_params, RULES)
    return target, hcfg, head_def, train_step, eval_step, init


RULES = F.FeatureDrafter.partition_rules  # the head's layout on a mesh (design §10)


@drafter_run.on_mesh
def train(cfg: FeatureTrainConfig, run_dir, export_dir=None, *, max_steps=None, overwrite=False, progress=True, mesh=None):
    """Trains (or resumes) the drafter; exports when finished. `mesh` (`specjax.models.sharding.make_mesh`):
    the batch over its `data` axis, the head tensor parallel over `model` (the frozen target is
    replicated); the checkpoints are the same, and restore on any layout."""
    target_dir = str(resolve(cfg.target))
    ranking, ids = (drafter_run.draft_ranking(cfg, drafter_run.train_stream(cfg, run_dir), target_dir)
                    if cfg.draft_vocab is not None else (None, None))  # the N most frequent tokens of the stream
    _, _, head_def, train_step, eval_step, init = _fns(cfg, target_dir, ids, drafter_run.target_weights(cfg))

    def save(params, d):
        # bf16 like the other drafters' exports
        F.save_feature_head(nnx.merge(head_def, params), str(d), jnp.bfloat16)
        if ranking is not None:
            vocab_lib.save_ranking(str(d), ranking)

    return drafter_run.run_unrolled(cfg, run_dir, export_dir, train_step, eval_step, init, RULES, save,
                                    max_steps=max_steps, overwrite=overwrite, progress=progress, mesh=mesh,
                                    kind="feature")


def main(argv=None):
    drafter_run.main(__doc__, load_config, train, argv)


if __name__ == "__main__":
    jax.config.update("jax_compilation_cache_dir", str(REPO / "runs" / "jax-cache"))
    main()
