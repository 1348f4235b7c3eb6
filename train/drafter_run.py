"""What the drafter trainers (`train.feature`, `train.block`) share: the config file, the
optimizer, the run's identity (what may not change on resume), the run directory's refusals, and
the orbax checkpoint manager. Each trainer keeps its own loss, loop metrics and export."""
from __future__ import annotations

import dataclasses
import functools
import json
import shutil
from pathlib import Path

import jax
import optax
import orbax.checkpoint as ocp

from specjax import sharding
from specjax.checkpoint import weights_sha256
from train.lm import RunRefused

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
    run on `mesh` (`specjax.sharding.make_mesh`; None: one device): the batch checked against the data
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
