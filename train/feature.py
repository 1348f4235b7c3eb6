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

import argparse
import dataclasses
import functools
import json
import math
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from tqdm import tqdm

from specjax import sharding
from specjax.checkpoint import load_model, load_tokenizer
from specjax.drafters import feature as F
from specjax.models import family, transformer
from train import data, drafter_run
from train.lm import REPO, RunRefused, _resolve, load_streams_for

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


def load_config(path) -> FeatureTrainConfig:
    return drafter_run.load_config(FeatureTrainConfig, path)


def head_config(cfg: FeatureTrainConfig, target) -> F.FeatureConfig:
    return F.FeatureConfig.for_target(target.config, cfg.target_layers, cfg.intermediate_size)


def ttt_loss(head, target, tokens_BxT, decay: float, steps: int):
    """(weighted loss, per-step loss [K], per-step top-1 agreement [K])."""
    B, T = tokens_BxT.shape
    fam = family(target)  # a dense or a hybrid target: the same features, its own cache
    out = fam.forward(target, tokens_BxT, jnp.broadcast_to(jnp.arange(T)[None], (B, T)), fam.init_cache(target, B, T),
                      transformer.causal_mask(B, T), hidden_layers=head.config.target_layers)
    feats = jax.lax.stop_gradient(F.target_features(out))
    p_target = jax.lax.stop_gradient(jax.nn.softmax(out.logits, axis=-1))  # [B, T, V]: token t+1
    logits = F.ttt_logits(head, target, tokens_BxT, feats, steps)  # [K, B, T, V]
    losses, agree = [], []
    for k in range(1, steps + 1):
        # step k at anchor a predicts token a+k+1, whose target distribution sits at position a+k
        tgt = jnp.roll(p_target, -k, axis=1)
        valid = (jnp.arange(T) + k < T)[None]
        ce = optax.softmax_cross_entropy(logits[k - 1], tgt)
        losses.append(jnp.sum(ce * valid) / jnp.sum(valid * jnp.ones((B, 1))))
        hit = jnp.argmax(logits[k - 1], -1) == jnp.argmax(tgt, -1)
        agree.append(jnp.sum(hit * valid) / jnp.sum(valid * jnp.ones((B, 1))))
    losses, agree = jnp.stack(losses), jnp.stack(agree)
    weights = decay ** jnp.arange(steps)
    return jnp.sum(weights * losses) / jnp.sum(weights), (losses, agree)


@functools.lru_cache(maxsize=4)
def _fns(cfg: FeatureTrainConfig, target_dir: str):
    target = load_model(target_dir)
    hcfg = head_config(cfg, target)
    head_def = nnx.graphdef(nnx.eval_shape(lambda: F.FeatureHead(hcfg, nnx.Rngs(0))))
    tgt_def, tgt_params = nnx.split(target)
    schedule, tx = drafter_run.optimizer(cfg)

    def loss_of(params, tokens):
        return ttt_loss(nnx.merge(head_def, params), nnx.merge(tgt_def, tgt_params), tokens,
                        cfg.depth_decay, cfg.ttt_steps)

    @functools.partial(jax.jit, donate_argnums=0)
    def train_step(state, tokens):
        (loss, (per_step, agree)), grads = jax.value_and_grad(loss_of, has_aux=True)(state["params"], tokens)
        updates, opt = tx.update(grads, state["opt_state"], state["params"])
        new = {"params": optax.apply_updates(state["params"], updates), "opt_state": opt, "step": state["step"] + 1}
        return (sharding.constrain(new, sharding.param_specs(new, RULES)),  # on a mesh: one layout every step
                {"loss": loss, "per_step": per_step, "agree": agree, "lr": schedule(state["step"])})

    @jax.jit
    def eval_step(params, tokens):
        loss, (per_step, agree) = loss_of(params, tokens)
        return loss, per_step, agree

    def init():
        params = nnx.state(F.FeatureHead(hcfg, nnx.Rngs(cfg.seed)), nnx.Param)
        return {"params": params, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32)}

    return target, hcfg, head_def, train_step, eval_step, init


RULES = F.FeatureDrafter.partition_rules  # the head's layout on a mesh (design §10)


@drafter_run.on_mesh
def train(cfg: FeatureTrainConfig, run_dir, export_dir=None, *, max_steps=None, overwrite=False, progress=True, mesh=None):
    """Trains (or resumes) the drafter; exports when finished. `mesh` (`specjax.sharding.make_mesh`):
    the batch over its `data` axis, the head tensor parallel over `model` (the frozen target is
    replicated); the checkpoints are the same, and restore on any layout."""
    run_dir = Path(run_dir)
    export_dir = Path(export_dir) if export_dir is not None else None
    target_dir = _resolve(cfg.target)
    identity = drafter_run.identity(cfg, target_dir)
    drafter_run.open_run(run_dir, export_dir, identity, overwrite)

    target, hcfg, head_def, train_step, eval_step, init = _fns(cfg, str(target_dir))
    tok = load_tokenizer(str(target_dir))
    streams = load_streams_for(tok, cfg.manifest, cfg.corpus_root, cfg.max_files, run_dir / "token-cache")
    val = data.eval_windows(streams.validation, cfg.seq_len - 1, cfg.eval_tokens)  # [N, seq_len]

    state = sharding.place_params(init(), RULES, mesh)
    mngr, state = drafter_run.checkpoints(run_dir, cfg.checkpoint_every, state)
    start, stop = int(state["step"]), cfg.steps if max_steps is None else min(max_steps, cfg.steps)
    bar = tqdm(total=cfg.steps, initial=start, desc=cfg.name, disable=not progress, dynamic_ncols=True)
    t_last, n_tok = time.perf_counter(), 0
    record = None
    for step in range(start, stop):
        batch = data.batch_at(streams.train, cfg.seq_len - 1, cfg.batch_size, cfg.seed, 0, step)  # [B, seq_len]
        state, m = train_step(state, jnp.asarray(batch) if mesh is None else sharding.place(batch, sharding.BATCH, mesh))
        loss = float(m["loss"])
        if not math.isfinite(loss):
            raise FloatingPointError(f"loss is {loss} at step {step + 1}")
        n_tok += batch.size
        bar.set_postfix(loss=f"{loss:.3f}", acc1=f"{float(m['agree'][0]):.2f}",
                        tok_s=f"{n_tok / (time.perf_counter() - t_last):.0f}", refresh=False)
        bar.update(1)
        done = step + 1
        if done % cfg.eval_every == 0 or done == cfg.steps:
            record = evaluate(eval_step, state["params"], val, cfg.batch_size)
            record.update(step=done, train_loss=loss, lr=float(m["lr"]))
            with (run_dir / "metrics.jsonl").open("a") as f:
                f.write(json.dumps(record) + "\n")
            bar.write(f"step {done}: val loss {record['val_loss']:.4f}, top-1 agreement by step {record['val_agree']}")
            t_last, n_tok = time.perf_counter(), 0
        mngr.save(done, args=ocp.args.StandardSave(state), force=(done == stop))
    bar.close()
    mngr.wait_until_finished()
    mngr.close()
    if int(state["step"]) == cfg.steps and export_dir is not None:
        if record is None:
            record = evaluate(eval_step, state["params"], val, cfg.batch_size)
        F.save_feature_head(nnx.merge(head_def, state["params"]), str(export_dir))
        (export_dir / "train_info.json").write_text(json.dumps(train_info(cfg, identity, record), indent=2) + "\n")
        print(f"exported {export_dir}")
    return state


def train_info(cfg: FeatureTrainConfig, identity: dict, record: dict) -> dict:
    """The export's `train_info.json`: the whole config (what `train.model_card` and `train.zoo`
    read), the target's weights digest, the positions trained on, the final validation record."""
    config = drafter_run.config_record(cfg)
    return {"run": {"config": config, "target_sha256": identity["target_sha256"]},
            "tokens_trained": cfg.steps * cfg.batch_size * cfg.seq_len, "final": record}


def evaluate(eval_step, params, windows, batch_size) -> dict:
    n = (len(windows) // batch_size) * batch_size or len(windows)
    losses, per, agree = [], [], []
    for i in range(0, n, batch_size):
        loss, p, a = eval_step(params, jnp.asarray(windows[i:i + batch_size]))
        losses.append(float(loss))
        per.append(np.asarray(p))
        agree.append(np.asarray(a))
    return {"val_loss": float(np.mean(losses)), "val_step_loss": np.mean(per, 0).round(4).tolist(),
            "val_agree": np.mean(agree, 0).round(4).tolist()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, type=Path)
    ap.add_argument("--run-dir", required=True, type=Path)
    ap.add_argument("--export", type=Path)
    ap.add_argument("--max-steps", type=int)
    ap.add_argument("--overwrite", action="store_true")
    ap.add_argument("--mesh", help=sharding.MESH_HELP)
    args = ap.parse_args(argv)
    mesh = drafter_run.mesh_from_args(ap, args.mesh)
    try:
        train(load_config(args.config), args.run_dir, args.export, max_steps=args.max_steps, overwrite=args.overwrite,
              mesh=mesh)
    except (RunRefused, FileNotFoundError, ValueError) as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    jax.config.update("jax_compilation_cache_dir", str(REPO / "runs" / "jax-cache"))
    main()
