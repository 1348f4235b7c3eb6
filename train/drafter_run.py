"""What the drafter trainers (`train.feature`, `train.block`, `train.mtp`) share: the config file, the
optimizer, the run's identity (what may not change on resume), the run directory's refusals, the
orbax checkpoint manager, and for the unrolled (training-time-test) drafters, feature and MTP, the
loss over unrolled steps and the whole training loop (`run_unrolled`). Each trainer keeps its own
model, loss and export."""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import shutil
import sys
import time
import uuid
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from safetensors.numpy import load_file
from tqdm import tqdm

from specjax.models import sharding
from specjax.io.checkpoint import load_model, load_tokenizer, weights_sha256
from specjax.drafters import heads
from train import data, target_cache
from train.lm import load_streams_for
from train.common import RunRefused, resolve, repo_relative

RESUMABLE = ("steps", "checkpoint_every", "eval_every")  # may change between sessions of one run


def load_config(cls, path):
    """A trainer's frozen config dataclass from JSON (layer lists as tuples); unknown keys refused."""
    raw = json.loads(Path(path).read_text())
    for key in ("target_layers", "state_layers"):  # layer lists (a config is hashable: tuples)
        if isinstance(raw.get(key), list):
            raw[key] = tuple(raw[key])
    unknown = set(raw) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
        raise ValueError(f"{path}: unknown fields {sorted(unknown)}")
    return cls(**raw)


def config_record(cfg) -> dict:
    """The config as JSON-ready values (what `train_info.json` stores and `load_config` reads back)."""
    d = dataclasses.asdict(cfg)
    d["target_layers"] = list(d["target_layers"]) if d.get("target_layers") else None
    if isinstance(d.get("state_layers"), tuple):
        d["state_layers"] = list(d["state_layers"])
    return d


def optimizer(cfg):
    """(schedule, tx): AdamW with linear warm-up and cosine decay, global-norm clipping, weight decay
    on matrices only."""
    schedule = optax.warmup_cosine_decay_schedule(0.0, cfg.learning_rate, cfg.warmup_steps,
                                                  max(cfg.steps, cfg.warmup_steps + 1),
                                                  cfg.learning_rate * cfg.min_lr_ratio)
    tx = optax.chain(optax.clip_by_global_norm(cfg.grad_clip),
                     optax.adamw(schedule, weight_decay=cfg.weight_decay,
                                 mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)))
    return schedule, tx


def identity(cfg, target_dir: Path) -> dict:
    """What a run directory pins: the config but its resumable fields, and the target's digest.
    `_defaults` (not compared itself) lets a run directory from before a field existed resume when
    the field is at its default."""
    d = {k: v for k, v in config_record(cfg).items() if k not in RESUMABLE}
    d["target_sha256"] = weights_sha256(target_dir)
    d["_defaults"] = {f.name: f.default for f in dataclasses.fields(cfg)
                      if f.default is not dataclasses.MISSING and f.name not in RESUMABLE}
    return d


def open_run(run_dir: Path, export_dir: Path | None, ident: dict, overwrite: bool) -> None:
    """Refuses to mix runs or to replace an export (RunRefused), then records the run's identity."""
    if export_dir is not None and (export_dir / "model.safetensors").exists() and not overwrite:
        raise RunRefused(f"{export_dir} already holds a trained drafter; pass --overwrite to replace it.")
    stored = run_dir / "run.json"
    if run_dir.exists() and overwrite:
        shutil.rmtree(run_dir)
    elif stored.exists():
        old = json.loads(stored.read_text())
        defaults = ident.get("_defaults", {})
        diffs = [f"{k}: run dir has {old.get(k, defaults.get(k))!r}, now {ident.get(k)!r}"
                 for k in sorted((set(old) | set(ident)) - {"_defaults"})
                 if old.get(k, defaults.get(k)) != ident.get(k)]
        if diffs:
            raise RunRefused(f"{run_dir} belongs to a different run:\n  - " + "\n  - ".join(diffs)
                             + "\nUse another --run-dir, or --overwrite.")
    run_dir.mkdir(parents=True, exist_ok=True)
    stored.write_text(json.dumps(ident, indent=2) + "\n")


def checkpoints(run_dir: Path, every: int, state):
    """(orbax CheckpointManager, state restored from its latest step or `state` as given). The
    checkpoint restores into `state`'s layout (one device, or a mesh), whichever it was saved from."""
    mngr = ocp.CheckpointManager((run_dir / "checkpoints").absolute(), options=ocp.CheckpointManagerOptions(
        max_to_keep=3, save_interval_steps=every, create=True))
    if mngr.latest_step() is not None:
        state = mngr.restore(mngr.latest_step(), args=ocp.args.StandardRestore(sharding.abstract(state)))
    return mngr, state


def mesh_from_args(ap, text: str | None):
    """The `--mesh data=D,model=M` of a trainer's command line (None without it); a bad one is the parser's error."""
    if not text:
        return None
    try:
        return sharding.parse_mesh(text)
    except ValueError as e:
        ap.error(str(e))


def on_mesh(train_fn):
    """A drafter trainer's `train(cfg, run_dir, export_dir=None, *, max_steps, overwrite, progress, mesh)`
    run on `mesh` (`specjax.models.sharding.make_mesh`; None: one device): the batch checked against the data
    axis, the whole run inside the mesh's context (the step pins the head's layout by its table)."""
    @functools.wraps(train_fn)
    def train(cfg, run_dir, export_dir=None, *, max_steps=None, overwrite=False, progress=True, mesh=None):
        check_batch(cfg.batch_size, mesh)
        with sharding.mesh_context(mesh):
            return train_fn(cfg, run_dir, export_dir, max_steps=max_steps, overwrite=overwrite, progress=progress,
                            mesh=mesh)
    return train


def check_batch(batch_size: int, mesh) -> None:
    """The batch must split over the mesh's data axis (ValueError)."""
    if mesh is not None and batch_size % sharding.axis_size(mesh, sharding.DATA):
        raise ValueError(f"batch_size {batch_size} does not split over the mesh's data axis "
                         f"({sharding.axis_size(mesh, sharding.DATA)})")


# ----------------------------------------------------------------------------- unrolled drafters (feature, MTP)

def unrolled_loss(logits_KxBxTxV, target, decay: float, tokens_BxT=None):
    """The loss of K unrolled draft steps (training-time test): step k at anchor a predicts token
    a+k+1, whose target distribution sits at position a+k; soft cross-entropy to the frozen target's
    distribution, or with `tokens_BxT` cross-entropy on the data's own token a+k+1. Steps weighted by
    `decay ** (k - 1)`. Returns (weighted loss, (per-step loss [K], per-step top-1 agreement with
    the target [K])).

    `target`: the target's logits [B, T, V], or an offline cache's top-k as (ids [B, T, k], log-probs
    [B, T, k]), the distribution renormalised over them: then the cross-entropy is taken sparsely,
    logsumexp(z) - sum_j p_j z[id_j], with no [B, T, V] target built; an id of -1 is left out (a
    token outside a reduced draft vocabulary: `draft_vocab_topk`)."""
    K, B, T = logits_KxBxTxV.shape[:3]
    if isinstance(target, tuple):
        ids_BxTxk, logp_BxTxk = target
        ids_BxTxk, logp_BxTxk = ids_BxTxk.astype(jnp.int32), logp_BxTxk.astype(jnp.float32)
        inside = ids_BxTxk >= 0
        p_BxTxk = jnp.where(inside, jax.nn.softmax(jnp.where(inside, logp_BxTxk, -1e30), axis=-1), 0.0)
        first_BxT = jnp.argmax(inside, axis=-1)  # the target's top-1 inside the vocabulary (the top-k is sorted)
        top_BxT = jnp.where(inside.any(-1), jnp.take_along_axis(ids_BxTxk, first_BxT[..., None], -1)[..., 0], -1)
        any_BxT = inside.any(-1)
    else:
        p_target = jax.nn.softmax(target, axis=-1)  # [B, T, V]: token t+1
    losses, agree = [], []
    for k in range(1, K + 1):
        z = logits_KxBxTxV[k - 1]
        valid = (jnp.arange(T) + k < T)[None] * jnp.ones((B, 1))
        if tokens_BxT is not None:
            ce = optax.softmax_cross_entropy_with_integer_labels(z, jnp.roll(tokens_BxT, -k - 1, axis=1))
        elif isinstance(target, tuple):
            ids, p = jnp.roll(ids_BxTxk, -k, axis=1), jnp.roll(p_BxTxk, -k, axis=1)
            picked = jnp.take_along_axis(z, jnp.maximum(ids, 0), axis=-1).astype(jnp.float32)
            ce = jax.nn.logsumexp(z.astype(jnp.float32), axis=-1) - jnp.sum(p * picked, axis=-1)
            valid = valid * jnp.roll(any_BxT, -k, axis=1)
        else:
            ce = optax.softmax_cross_entropy(z, jnp.roll(p_target, -k, axis=1))
        losses.append(jnp.sum(ce * valid) / jnp.maximum(jnp.sum(valid), 1))
        if isinstance(target, tuple):
            hit = jnp.argmax(z, -1) == jnp.roll(top_BxT, -k, axis=1)
        else:
            hit = jnp.argmax(z, -1) == jnp.argmax(jnp.roll(p_target, -k, axis=1), -1)
        agree.append(jnp.sum(hit * valid) / jnp.maximum(jnp.sum(valid), 1))
    losses, agree = jnp.stack(losses), jnp.stack(agree)
    weights = decay ** jnp.arange(K)
    return jnp.sum(weights * losses) / jnp.sum(weights), (losses, agree)


def draft_vocab_topk(ids_BxTxk, logp_BxTxk, vocab_ids_N, vocab_size: int):
    """A cached top-k over a reduced draft vocabulary: the ids as draft-vocabulary slots, -1 where a
    token is outside it (`unrolled_loss` leaves those out and renormalises over the rest)."""
    inv = jnp.full((vocab_size,), -1, jnp.int32).at[vocab_ids_N].set(jnp.arange(vocab_ids_N.shape[0], dtype=jnp.int32))
    return inv[ids_BxTxk.astype(jnp.int32)], logp_BxTxk


def draft_vocab_target(target, vocab_ids_N, vocab_size: int):
    """The target side of a loss over a reduced draft vocabulary: a cache's sparse (ids, logp) top-k
    as draft-vocabulary slots (`draft_vocab_topk`), or dense logits [.., V] gathered at the N ids."""
    if isinstance(target, tuple):
        return draft_vocab_topk(*target, vocab_ids_N, vocab_size)
    return target[..., vocab_ids_N]


def unrolled_steps(cfg, loss_of, init_params, rules):
    """(train_step, eval_step, init) of an unrolled drafter: `loss_of(params, tokens) -> (loss,
    (per-step loss, agreement))` (`unrolled_loss`), `init_params() -> the head's nnx.Param state`;
    AdamW (`optimizer`), the new state pinned to the head's layout (`rules`) on a mesh."""
    schedule, tx = optimizer(cfg)

    @functools.partial(jax.jit, donate_argnums=0)
    def train_step(state, tokens, cached=None):
        args = (state["params"], tokens) if cached is None else (state["params"], tokens, cached)
        (loss, (per_step, agree)), grads = jax.value_and_grad(loss_of, has_aux=True)(*args)
        updates, opt = tx.update(grads, state["opt_state"], state["params"])
        new = {"params": optax.apply_updates(state["params"], updates), "opt_state": opt, "step": state["step"] + 1}
        return (sharding.constrain(new, sharding.param_specs(new, rules)),  # on a mesh: one layout every step
                {"loss": loss, "per_step": per_step, "agree": agree, "lr": schedule(state["step"])})

    @jax.jit
    def eval_step(params, tokens):
        loss, (per_step, agree) = loss_of(params, tokens)
        return loss, per_step, agree

    def init():
        params = init_params()
        return {"params": params, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32)}

    return train_step, eval_step, init


def target_weights(cfg) -> str:
    """The weight dtype a trainer loads its target at: its cache's (`train.target_cache --weights`: the
    features and labels came from the target at that dtype, so the borrowed embedding / LM head and
    the validation pass match them), float32 without a cache."""
    return target_cache.cache_weights(resolve(cfg.cache)) if getattr(cfg, "cache", None) else "float32"


def cache_identity(cfg) -> dict:
    """What a run on an offline cache adds to its identity: the cache's stream, and its target's weight
    dtype when not float32 (both may not change on resume)."""
    if not getattr(cfg, "cache", None):
        return {}
    ident = {"cache_stream_sha256": target_cache.TargetCache(resolve(cfg.cache)).manifest["stream_sha256"]}
    weights = target_weights(cfg)
    return ident if weights == "float32" else {**ident, "target_weights": weights}


def check_init_from(path: Path, target_sha256: str, kind: str) -> str:
    """The digest of `init_from`'s weights (part of the run's identity: a retrained export changes it);
    ValueError unless it is a `kind` drafter trained on this target."""
    try:
        heads.read_config(str(path), kind)
    except (FileNotFoundError, ValueError) as e:
        raise ValueError(f"init_from: {e}") from None
    info = path / "train_info.json"
    trained_on = json.loads(info.read_text()).get("run", {}).get("target_sha256") if info.exists() else None
    if trained_on is not None and trained_on != target_sha256:
        raise ValueError(f"init_from {path} was trained on other target weights ({trained_on[:12]}…)")
    return weights_sha256(path)


def start_from(head, path) -> None:
    """Copies a trained drafter's parameters into `head` wherever names and shapes match (a ReaDy head
    from a DSpark one: everything but the fresh reader; a feature head from the one it replaces: all
    of it); ValueError when nothing matches or a shared name has another shape."""
    tensors = load_file(str(Path(path) / heads.WEIGHTS_FILE))
    flat = dict(nnx.to_flat_state(nnx.state(head, nnx.Param)))
    copied = 0
    for key, var in flat.items():
        name = ".".join(map(str, key))
        if name in tensors:
            if tuple(tensors[name].shape) != tuple(var.get_value().shape):
                raise ValueError(f"init_from {path}: {name!r} has shape {tensors[name].shape}, "
                                 f"expected {var.get_value().shape}")
            var.set_value(jnp.asarray(tensors[name].astype("float32"), var.get_value().dtype))
            copied += 1
    if not copied:
        raise ValueError(f"init_from {path}: no parameter of this drafter is there")
    nnx.update(head, nnx.from_flat_state(flat))


def run_unrolled(cfg, run_dir, export_dir, train_step, eval_step, init, rules, save_head, *, max_steps=None,
                 overwrite=False, progress=True, mesh=None, cache_layers=None, kind=None):
    """The training loop of a drafter trained with `unrolled_loss` (feature, MTP): resumable (orbax,
    same data order), validation records to metrics.jsonl, and at the last step the export:
    `save_head(params, export_dir)` + `train_info.json`. `train_step(state, tokens) -> (state, metrics)`,
    `eval_step(params, tokens) -> (loss, per-step loss, agreement)`, `init() -> state`; `rules`: the
    head's layout on `mesh`; `cache_layers`: the target layers it reads from a cache (default
    `cfg.target_layers`); `kind`: the drafter kind a config's `init_from` must hold (its digest joins
    the run's identity; `init()` copies it)."""
    run_dir = Path(run_dir)
    export_dir = Path(export_dir) if export_dir is not None else None
    target_dir = resolve(cfg.target)
    ident = identity(cfg, target_dir)
    if getattr(cfg, "init_from", None):
        ident["init_from_sha256"] = check_init_from(resolve(cfg.init_from), ident["target_sha256"], kind)
    ident.update(cache_identity(cfg))
    open_run(run_dir, export_dir, ident, overwrite)
    streams = load_streams_for(load_tokenizer(str(target_dir)), cfg.manifest, cfg.corpus_root, cfg.max_files,
                               run_dir / "token-cache")
    train_tokens = train_stream(cfg, run_dir, streams)
    val = data.eval_windows(streams.validation, cfg.seq_len - 1, cfg.eval_tokens)  # [N, seq_len]

    cache = None
    if getattr(cfg, "cache", None):  # the offline target cache (train.target_cache) of the drafter's layers
        layers = cache_layers if cache_layers is not None else tuple(cfg.target_layers or ()) or None
        cache = target_cache.TargetCache(resolve(cfg.cache), str(target_dir), layers)
        if cache.manifest["seq_len"] != cfg.seq_len:
            raise ValueError(f"cache {cfg.cache} holds windows of {cache.manifest['seq_len']} tokens; seq_len is {cfg.seq_len}")

    state = sharding.place_params(init(), rules, mesh)
    mngr, state = checkpoints(run_dir, cfg.checkpoint_every, state)
    start, stop = int(state["step"]), cfg.steps if max_steps is None else min(max_steps, cfg.steps)
    bar = tqdm(total=cfg.steps, initial=start, desc=cfg.name, disable=not progress, dynamic_ncols=True)
    t_run = t_last = time.perf_counter()
    n_tok, train_s, session = 0, 0.0, session_key()
    record = None
    for step in range(start, stop):
        if cache is None:
            batch, cached = data.batch_at(train_tokens, cfg.seq_len - 1, cfg.batch_size, cfg.seed, 0, step), None
        else:
            batch, cached = cache.step_batch(step, cfg.batch_size, cfg.seed, mesh, states=False)
        t0 = time.perf_counter()
        state, m = train_step(state, jnp.asarray(batch) if mesh is None else sharding.place(batch, sharding.BATCH, mesh),
                              cached)
        loss = float(m["loss"])
        train_s += time.perf_counter() - t0
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
        if done % cfg.checkpoint_every == 0 and done < stop:
            record_session(run_dir, start, done, train_s, time.perf_counter() - t_run, session)
    bar.close()
    mngr.wait_until_finished()
    mngr.close()
    record_session(run_dir, start, stop, train_s, time.perf_counter() - t_run, session)
    if int(state["step"]) == cfg.steps and export_dir is not None:
        if record is None:
            record = evaluate(eval_step, state["params"], val, cfg.batch_size)
        save_head(state["params"], export_dir)
        info = {**train_info(cfg, ident, record), "timing": session_timing(run_dir), "run_dir": repo_relative(run_dir)}
        (export_dir / "train_info.json").write_text(json.dumps(info, indent=2) + "\n")
        print(f"exported {export_dir}")
    return state


def train_stream(cfg, run_dir, streams=None) -> np.ndarray:
    """The training token stream [N]: the corpus's train split in the target's tokenization, then the
    `extra_train` stream when the config names one (the target's own continuations), `extra_repeat`
    times where the config has that key (oversampled: a small stream made a real share)."""
    if streams is None:
        streams = load_streams_for(load_tokenizer(str(resolve(cfg.target))), cfg.manifest, cfg.corpus_root,
                                   cfg.max_files, Path(run_dir) / "token-cache")
    extra = getattr(cfg, "extra_train", None)
    if not extra:
        return streams.train
    path = resolve(extra)
    if not Path(path).is_file():
        raise FileNotFoundError(f"extra_train {path}: no such token stream (make it with python -m train.continuations)")
    extra = np.tile(np.load(path).astype(streams.train.dtype), getattr(cfg, "extra_repeat", 1))
    return np.concatenate([streams.train, extra])


def draft_ranking(cfg, stream, target_dir) -> tuple[np.ndarray | None, tuple[int, ...] | None]:
    """(ranking of all V tokens by count in the training stream, the first `cfg.draft_vocab` of it) for
    a config with a reduced draft vocabulary (EAGLE-3's d2t); (None, None) without one. A config with
    an offline cache ranks the cache's windows (what it trains on: the target's own continuations
    included), not `stream`."""
    if not getattr(cfg, "draft_vocab", None):
        return None, None
    if getattr(cfg, "cache", None):
        stream = target_cache.TargetCache(resolve(cfg.cache)).tokens()
    from specjax.drafters import vocab as vocab_lib
    ranking = vocab_lib.token_ranking(stream, load_model(str(target_dir)).config.vocab_size)
    return ranking, tuple(int(i) for i in ranking[:cfg.draft_vocab])


def record_session(run_dir, start: int, stop: int, train_s: float, wall_s: float, session: str) -> None:
    """Writes this session's steps and seconds to `timing.jsonl`: a line per session that trained (a
    resumed run adds one; a finished run run again, to re-export it, none). `session`: this session's
    key; its line is replaced, so a trainer calls this at every checkpoint and a session killed
    mid-run (a stopped process) keeps its time up to its last checkpoint, the steps a resume starts
    from (the steps after it are trained, and counted, again)."""
    if stop <= start:
        return
    f = Path(run_dir) / "timing.jsonl"
    lines = [json.loads(line) for line in f.read_text().splitlines()] if f.exists() else []
    lines = [t for t in lines if t.get("session") != session]
    lines.append({"steps": [start, stop], "train_step_s": round(train_s, 1), "wall_s": round(wall_s, 1), "session": session})
    tmp = f.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(t) + "\n" for t in lines))
    tmp.replace(f)


def session_key() -> str:
    """A key for this training session's line in `timing.jsonl`: its start time and process, and a random
    part, so two sessions one process starts within the same second (a stop and its resume) stay apart."""
    return f"{time.strftime('%Y-%m-%dT%H:%M:%S', time.gmtime())}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def session_timing(run_dir) -> dict:
    """The run's time over its sessions (`timing.jsonl`: a line per session, a resumed run adds one)."""
    f = Path(run_dir) / "timing.jsonl"
    sessions = [json.loads(line) for line in f.read_text().splitlines()] if f.exists() else []
    return {"train_step_s": round(sum(t["train_step_s"] for t in sessions), 1),
            "wall_s": round(sum(t["wall_s"] for t in sessions), 1), "sessions": sessions}


def train_info(cfg, ident: dict, record: dict) -> dict:
    """The export's `train_info.json`: the whole config (what `train.model_card` and `train.zoo`
    read), the target's weights digest, the positions trained on, the final validation record."""
    run = {"config": config_record(cfg), "target_sha256": ident["target_sha256"],
           "target_weights": ident.get("target_weights", "float32")}
    if "init_from_sha256" in ident:  # the weights the run started from (a continued drafter)
        run["init_from_sha256"] = ident["init_from_sha256"]
    return {"run": run,
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


def main(doc: str, load_config, train, argv=None) -> None:
    """The command line of a drafter trainer (feature, block, MTP): --config, --run-dir, --export,
    --max-steps, --overwrite, --mesh; a refused run or a bad config is a one-line error."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, type=Path)
    ap.add_argument("--run-dir", required=True, type=Path)
    ap.add_argument("--export", type=Path)
    ap.add_argument("--max-steps", type=int)
    ap.add_argument("--overwrite", action="store_true")
    ap.add_argument("--mesh", help=sharding.MESH_HELP)
    args = ap.parse_args(argv)
    mesh = mesh_from_args(ap, args.mesh)
    try:
        train(load_config(args.config), args.run_dir, args.export, max_steps=args.max_steps, overwrite=args.overwrite,
              mesh=mesh)
    except (RunRefused, FileNotFoundError, ValueError) as e:
        sys.exit(f"error: {e}")
