"""One training script for every causal LM of the model zoo; a model is a JSON config in configs/.

    python -m train.lm --config configs/code-target.json --run-dir runs/code-target \
        --export models/code-target [--max-steps N] [--overwrite]

The run dir holds `run.json` (the config plus the tokenizer and corpus hashes it was started
with), orbax checkpoints under `checkpoints/` and `metrics.jsonl` (validation loss / perplexity
every `eval_every` steps). Running the same command again resumes from the last checkpoint with
the same data order; `--max-steps N` stops (with a checkpoint) after global step N. When the last
step of the last phase is done, the model is exported in Hugging Face format (bf16 safetensors,
config.json, tokenizer.json) to `--export`.

Refused, with a message: a stdlib that differs from the corpus manifest; a run dir started with
another config, tokenizer or corpus (a changed batch size gets its own message); overwriting a
run dir with checkpoints or an export dir with model.safetensors without `--overwrite`.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import math
import shutil
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from tokenizers import Tokenizer
from tqdm import tqdm

from specjax.models import kvcache, sharding
from specjax.io.checkpoint import has_weights, save_model
from specjax.models import family, hybrid, transformer
from specjax.models.config import HYBRID_MODEL_TYPES, HybridConfig, ModelConfig, RopeScaling
from specjax.models.transformer import causal_mask, forward
from train import corpus, data
from train.common import REPO, RunRefused, resolve
from train.tokenizer import EOT_ID, PAD_ID

# Fields that only change how a run is observed or stored; anything else changes the trained model.
RESUMABLE_FIELDS = ("checkpoint_every", "keep_checkpoints", "eval_every")


# ----------------------------------------------------------------------------- configuration

@dataclasses.dataclass(frozen=True)
class Phase:
    seq_len: int
    steps: int
    # Rows per forward/backward; the batch is accumulated over batch_size / micro_batch_size of
    # them (long sequences on small memory). None: the whole batch at once.
    micro_batch_size: int | None = None


@dataclasses.dataclass(frozen=True)
class CorpusConfig:
    manifest: str = "train/manifest.json"
    root: str | None = None  # None: this interpreter's stdlib
    max_files: int | None = None  # per split; tests train on a few files


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    name: str
    model: ModelConfig | HybridConfig  # a dense decoder, or a qwen3_next hybrid (model_type)
    tokenizer: str  # path of tokenizer.json
    phases: tuple[Phase, ...]
    batch_size: int = 16
    seed: int = 0
    learning_rate: float = 1e-3
    min_lr_ratio: float = 0.1  # cosine decays to learning_rate * min_lr_ratio
    warmup_steps: int = 100
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    grad_clip: float = 1.0
    bf16_compute: bool = False  # bf16 forward/backward over float32 master weights
    checkpoint_every: int = 100
    keep_checkpoints: int = 3
    eval_every: int = 100
    eval_seq_len: int = 512
    eval_tokens: int | None = 65536  # validation targets per evaluation; None: the whole split
    corpus: CorpusConfig = CorpusConfig()

    def __post_init__(self):
        if not self.phases:
            raise ValueError("a config needs at least one phase")
        for p in self.phases:
            micro = p.micro_batch_size or self.batch_size
            if self.batch_size % micro:
                raise ValueError(f"batch_size {self.batch_size} is not a multiple of micro_batch_size {micro}")
            if p.seq_len > self.model.max_position_embeddings:
                raise ValueError(f"phase seq_len {p.seq_len} exceeds max_position_embeddings "
                                 f"{self.model.max_position_embeddings}")

    @property
    def total_steps(self) -> int:
        return sum(p.steps for p in self.phases)

    def phase_at(self, step: int) -> tuple[int, int]:
        """(phase index, step within that phase) of a 0-based global step."""
        for i, p in enumerate(self.phases):
            if step < p.steps:
                return i, step
            step -= p.steps
        raise ValueError("step past the last phase")


def config_from_dict(d: dict) -> TrainConfig:
    d = dict(d)
    m = dict(d.pop("model"))
    if isinstance(m.get("rope_scaling"), dict):
        m["rope_scaling"] = RopeScaling(**m["rope_scaling"])
    if isinstance(m.get("eos_token_id"), list):
        m["eos_token_id"] = tuple(m["eos_token_id"])
    m.setdefault("bos_token_id", EOT_ID)  # documents start after <|endoftext|>
    m.setdefault("eos_token_id", EOT_ID)
    m.setdefault("pad_token_id", PAD_ID)
    phases = tuple(Phase(**p) for p in d.pop("phases"))
    corpus_cfg = CorpusConfig(**d.pop("corpus", {}))
    if m.get("model_type") in HYBRID_MODEL_TYPES:
        m["layer_types"] = tuple(m["layer_types"])
        model_cfg = HybridConfig(**m)
    else:
        model_cfg = ModelConfig(**m)
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    if set(d) - known:
        raise ValueError(f"unknown config fields: {sorted(set(d) - known)}")
    return TrainConfig(model=model_cfg, phases=phases, corpus=corpus_cfg, **d)


def config_to_dict(cfg: TrainConfig) -> dict:
    d = dataclasses.asdict(cfg)
    d["model"].pop("dtype")  # float32 master weights always; compute dtype is bf16_compute
    d["phases"] = [dataclasses.asdict(p) for p in cfg.phases]
    if "layer_types" in d["model"]:
        d["model"]["layer_types"] = list(d["model"]["layer_types"])
    if isinstance(d["model"]["eos_token_id"], tuple):
        d["model"]["eos_token_id"] = list(d["model"]["eos_token_id"])
    return d


def load_config(path: str | Path) -> TrainConfig:
    path = Path(path)
    try:
        return config_from_dict(json.loads(path.read_text()))
    except (json.JSONDecodeError, TypeError, ValueError, KeyError) as e:
        raise ValueError(f"{path}: invalid training config ({e})") from None


# ----------------------------------------------------------------------------- model and step

def lr_schedule(cfg: TrainConfig) -> optax.Schedule:
    # Over all phases: linear warm-up from 0, then cosine down to learning_rate * min_lr_ratio.
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.learning_rate, warmup_steps=cfg.warmup_steps,
        decay_steps=max(cfg.total_steps, cfg.warmup_steps + 1), end_value=cfg.learning_rate * cfg.min_lr_ratio)


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    # No weight decay on gains (RMSNorm weights are the only 1-D parameters).
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
    return optax.chain(
        optax.clip_by_global_norm(cfg.grad_clip),
        optax.adamw(lr_schedule(cfg), b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay, mask=decay_mask),
    )


def init_model(cfg: ModelConfig | HybridConfig, seed: int = 0):
    return (hybrid if isinstance(cfg, HybridConfig) else transformer).init_model(cfg, seed)


def family_rules(cfg: ModelConfig | HybridConfig) -> tuple:
    """The model family's partition table (design §10)."""
    return (hybrid if isinstance(cfg, HybridConfig) else transformer).PARTITION_RULES


BATCH_AxMxT1 = sharding.P(None, sharding.DATA)  # a step's micro-batches: rows over `data`


def lm_token_losses(model, tokens_BxT1, compute_dtype) -> jax.Array:
    """[B, T] next-token cross-entropy of [B, T+1] windows, through the inference code (one causal
    block on an empty cache: `forward` for a dense model, the chunked `prefill` for a hybrid), so
    training and serving share one code path."""
    cfg = model.config
    inputs_BxT, targets_BxT = tokens_BxT1[:, :-1], tokens_BxT1[:, 1:]
    B, T = inputs_BxT.shape
    if family(model) is hybrid:
        cache = hybrid.init_cache(model, B, T)
        logits_BxTxV = hybrid.prefill(model, inputs_BxT, jnp.full((B,), T, jnp.int32), cache).logits
        return optax.softmax_cross_entropy_with_integer_labels(logits_BxTxV, targets_BxT)
    cache = kvcache.init(cfg.num_layers, B, T, cfg.num_kv_heads, cfg.head_dim, compute_dtype)
    positions_BxT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None], (B, T))
    logits_BxTxV = forward(model, inputs_BxT, positions_BxT, cache, causal_mask(B, T)).logits  # float32
    return optax.softmax_cross_entropy_with_integer_labels(logits_BxTxV, targets_BxT)


def lm_loss(model, tokens_BxT1, compute_dtype) -> jax.Array:
    return lm_token_losses(model, tokens_BxT1, compute_dtype).mean()


def mean_window_loss(window_loss_fn, windows_NxT1: np.ndarray, batch_size: int, desc: str | None = None) -> float:
    """Mean per-token loss of equal-length windows, in fixed-size batches (the last one padded,
    so one compiled shape serves every batch). `window_loss_fn`: [b, T+1] -> [b] mean losses."""
    total = 0.0
    for i in tqdm(range(0, len(windows_NxT1), batch_size), desc=desc, disable=desc is None):
        chunk = windows_NxT1[i:i + batch_size]
        padded = np.concatenate([chunk, np.zeros((batch_size - len(chunk),) + chunk.shape[1:], chunk.dtype)])
        total += float(np.asarray(window_loss_fn(jnp.asarray(padded)))[:len(chunk)].sum())
    return total / max(len(windows_NxT1), 1)


def _compute_params(params, compute_dtype):
    # bf16 compute: cast float32 master weights for the forward; gradients flow back to float32.
    return params if compute_dtype == jnp.float32 else jax.tree.map(lambda p: p.astype(compute_dtype), params)


def _compile_key(cfg: TrainConfig) -> TrainConfig:
    # The config without the fields that do not enter the compiled functions.
    return dataclasses.replace(cfg, name="", tokenizer="", corpus=CorpusConfig(), **{f: 0 for f in RESUMABLE_FIELDS})


def _step_fns(cfg: TrainConfig):
    """(graphdef, optimizer, jitted train step, jitted eval loss) for a config; cached so that
    several runs of one config in a process (tests, resumes) compile once."""
    return _step_fns_cached(_compile_key(cfg))


@functools.lru_cache(maxsize=8)
def _step_fns_cached(cfg: TrainConfig):
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: init_model(cfg.model, cfg.seed)))
    tx = make_optimizer(cfg)
    schedule = lr_schedule(cfg)
    compute_dtype = jnp.bfloat16 if cfg.bf16_compute else jnp.float32

    def loss_of(params, tokens_BxT1):
        return lm_loss(nnx.merge(graphdef, _compute_params(params, compute_dtype)), tokens_BxT1, compute_dtype)

    rules = family_rules(cfg.model)

    @functools.partial(jax.jit, donate_argnums=0)
    def train_step(state, batch_AxMxT1):
        """One optimizer step over A accumulated micro-batches of M rows ([A, M, T+1]). On a mesh
        (`--mesh`): rows over `data` (XLA all-reduces the gradients), parameters and their Adam
        moments laid out by the family's partition table, pinned so every step keeps one layout."""
        def micro(grad_sum, tokens_MxT1):
            loss, grads = jax.value_and_grad(loss_of)(state["params"], tokens_MxT1)
            return jax.tree.map(jnp.add, grad_sum, grads), loss

        zeros = jax.tree.map(jnp.zeros_like, state["params"])
        grad_sum, losses_A = jax.lax.scan(micro, zeros, batch_AxMxT1)
        grads = jax.tree.map(lambda g: g / batch_AxMxT1.shape[0], grad_sum)
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        new_state = {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state,
                     "step": state["step"] + 1}
        new_state = sharding.constrain(new_state, sharding.param_specs(new_state, rules))
        metrics = {"loss": losses_A.mean(), "grad_norm": optax.tree.norm(grads), "lr": schedule(state["step"])}
        return new_state, metrics

    @jax.jit
    def eval_loss(params, tokens_BxT1):  # [B] mean loss per window
        model = nnx.merge(graphdef, _compute_params(params, compute_dtype))
        return lm_token_losses(model, tokens_BxT1, compute_dtype).mean(axis=-1)

    return graphdef, tx, train_step, eval_loss


@functools.lru_cache(maxsize=8)
def _init_params_fn(cfg: TrainConfig):
    # Under jit: one compilation instead of one per parameter's random draw.
    return jax.jit(lambda: nnx.state(init_model(cfg.model, cfg.seed), nnx.Param))


def _init_params(cfg: TrainConfig):
    return _init_params_fn(_compile_key(cfg))()


def init_state(cfg: TrainConfig) -> dict:
    _, tx, _, _ = _step_fns(cfg)
    params = _init_params(cfg)
    return {"params": params, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32)}


def evaluate(cfg: TrainConfig, params, windows_NxT1: np.ndarray, batch_size: int | None = None) -> float:
    """Mean per-token loss over the windows (all windows have the same length)."""
    _, _, _, eval_loss = _step_fns(cfg)
    return mean_window_loss(functools.partial(eval_loss, params), windows_NxT1, batch_size or cfg.batch_size)


def step_batch(cfg: TrainConfig, stream: np.ndarray, step: int) -> np.ndarray:
    """[A, M, T+1] for a 0-based global step: the batch, split into micro-batches."""
    phase_idx, local = cfg.phase_at(step)
    phase = cfg.phases[phase_idx]
    batch = data.batch_at(stream, phase.seq_len, cfg.batch_size, cfg.seed, phase_idx, local)
    micro = phase.micro_batch_size or cfg.batch_size
    return batch.reshape(cfg.batch_size // micro, micro, phase.seq_len + 1)


# ----------------------------------------------------------------------------- run directory

def _sha256_file(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def run_identity(cfg: TrainConfig) -> dict:
    return {"config": config_to_dict(cfg),
            "tokenizer_sha256": _sha256_file(resolve(cfg.tokenizer)),
            "manifest_sha256": corpus.manifest_sha256(resolve(cfg.corpus.manifest))}


def _has_checkpoints(run_dir: Path) -> bool:
    ckpt = run_dir / "checkpoints"
    return ckpt.exists() and any(p.name.isdigit() for p in ckpt.iterdir())


def _differences(stored: dict, current: dict, prefix="") -> list[str]:
    out = []
    for k in sorted(set(stored) | set(current)):
        a, b = stored.get(k), current.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _differences(a, b, f"{prefix}{k}.")
        elif a != b:
            out.append(f"{prefix}{k}: run dir has {a!r}, now {b!r}")
    return out


def _latest_step(run_dir: Path) -> int:
    ckpt = run_dir / "checkpoints"
    steps = [int(p.name) for p in ckpt.iterdir() if p.name.isdigit()] if ckpt.exists() else []
    return max(steps, default=0)


def reschedule_problem(old_phases: list[dict], new_phases: list[dict], done: int) -> str | None:
    """Why a run `done` steps in cannot move to `new_phases` (None: it can). Only phase lengths may
    change: the same phases (sequence lengths) in the same order, every finished phase as it was,
    and the current one no shorter than what it has already run. Completed steps then keep their
    batches (a batch is a function of seed, phase and step within the phase)."""
    if [p["seq_len"] for p in old_phases] != [p["seq_len"] for p in new_phases]:
        return "a schedule change may only change phase lengths, not the phases' sequence lengths or their number"
    start = 0
    for i, (a, b) in enumerate(zip(old_phases, new_phases)):
        if done >= start + a["steps"]:  # finished phase
            if a["steps"] != b["steps"]:
                return f"phase {i} is finished ({a['steps']} steps); its length cannot change"
        elif done > start and b["steps"] < done - start:
            return f"phase {i} has already run {done - start} steps; it cannot be cut to {b['steps']}"
        start += a["steps"]
    return None


def check_resume(run_dir: Path, identity: dict, reschedule: bool = False) -> None:
    """Refuses to continue a run dir that was started with anything that changes the model.
    With `reschedule`, phase lengths may change (see `reschedule_problem`)."""
    stored = json.loads((run_dir / "run.json").read_text())
    s_cfg, c_cfg = stored["config"], identity["config"]
    if reschedule:
        problem = reschedule_problem(s_cfg["phases"], c_cfg["phases"], _latest_step(run_dir))
        if problem:
            raise RunRefused(f"{run_dir}: cannot reschedule: {problem}")
        s_cfg = {**s_cfg, "phases": [{**a, "steps": b["steps"]} for a, b in zip(s_cfg["phases"], c_cfg["phases"])]}
    how = f"Use another --run-dir, or --overwrite to discard {run_dir} and start again."
    if s_cfg.get("batch_size") != c_cfg.get("batch_size"):
        raise RunRefused(f"{run_dir} was trained with batch_size {s_cfg.get('batch_size')}, the config now says "
                         f"{c_cfg.get('batch_size')}: resuming would change the data order and the optimizer's "
                         f"steps. Restore batch_size {s_cfg.get('batch_size')} to resume. {how}")
    ignore = lambda c: {k: v for k, v in c.items() if k not in RESUMABLE_FIELDS}
    strip_micro = lambda c: {**c, "phases": [{k: v for k, v in p.items() if k != "micro_batch_size"} for p in c["phases"]]}
    diffs = _differences(strip_micro(ignore(s_cfg)), strip_micro(ignore(c_cfg)), "config.")
    for key in ("tokenizer_sha256", "manifest_sha256"):
        if stored.get(key) != identity[key]:
            diffs.append(f"{key}: run dir has {stored.get(key)}, now {identity[key]}")
    if diffs:
        raise RunRefused(f"{run_dir} belongs to a different run:\n  - " + "\n  - ".join(diffs) + f"\n{how}")


def prepare_run_dir(cfg: TrainConfig, run_dir: Path, export_dir: Path | None, overwrite: bool,
                    reschedule: bool = False) -> dict:
    identity = run_identity(cfg)
    if export_dir is not None and has_weights(export_dir) and not overwrite:
        raise RunRefused(f"{export_dir} already holds a trained model (model.safetensors); "
                         f"pass --overwrite to replace it, or choose another --export.")
    if run_dir.exists() and (_has_checkpoints(run_dir) or (run_dir / "run.json").exists()):
        if overwrite:
            shutil.rmtree(run_dir)
        elif (run_dir / "run.json").exists():
            check_resume(run_dir, identity, reschedule)
        else:
            raise RunRefused(f"{run_dir} has checkpoints but no run.json; pass --overwrite to discard it.")
    run_dir.mkdir(parents=True, exist_ok=True)
    stored = run_dir / "run.json"
    if stored.exists():
        # Keep the original identity, refreshing only the fields that may change on resume.
        old = json.loads(stored.read_text())
        if [p["steps"] for p in old["config"]["phases"]] != [p["steps"] for p in identity["config"]["phases"]]:
            # Only reachable with --reschedule: keep the history, the schedule below is the new one.
            old.setdefault("schedule_changes", []).append(
                {"at_step": _latest_step(run_dir), "old_phases": old["config"]["phases"],
                 "new_phases": identity["config"]["phases"]})
        old["config"].update({k: identity["config"][k] for k in RESUMABLE_FIELDS})
        old["config"]["phases"] = identity["config"]["phases"]
        identity = old
    stored.write_text(json.dumps(identity, indent=2) + "\n")
    return identity


def checkpoint_manager(cfg: TrainConfig, run_dir: Path) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(max_to_keep=cfg.keep_checkpoints,
                                           save_interval_steps=cfg.checkpoint_every, create=True)
    return ocp.CheckpointManager((run_dir / "checkpoints").absolute(), options=options)


# ----------------------------------------------------------------------------- training

@dataclasses.dataclass(frozen=True)
class Streams:
    train: np.ndarray  # [N] int32
    validation: np.ndarray  # [M] int32


def load_streams(cfg: TrainConfig, tok: Tokenizer, cache_dir: Path | None) -> Streams:
    return load_streams_for(tok, cfg.corpus.manifest, cfg.corpus.root, cfg.corpus.max_files, cache_dir)


def tokenizer_sha256(tok: Tokenizer) -> str:
    return hashlib.sha256(tok.to_str().encode()).hexdigest()


def save_corpus_tokens(tok: Tokenizer, streams: Streams, path, max_train: int | None = None) -> None:
    """The corpus's streams in this tokenizer as one .npz (uint16 where the vocabulary fits), for a
    machine whose Python carries another stdlib (the corpus is pinned to this one's): a trainer
    whose `manifest` names the .npz reads the streams from it (`load_streams_for`)."""
    dtype = np.uint16 if tok.get_vocab_size() <= 65536 else np.int32
    np.savez_compressed(path, train=streams.train[:max_train].astype(dtype), validation=streams.validation.astype(dtype),
                        tokenizer_sha256=np.asarray(tokenizer_sha256(tok)))


def load_streams_for(tok: Tokenizer, manifest: str, root: str | None, max_files: int | None,
                     cache_dir: Path | None) -> Streams:
    """Train and validation token streams of the corpus, checked against its manifest; or, when
    `manifest` names a .npz (`save_corpus_tokens`), the streams stored there, checked against the
    tokenizer they were made with."""
    if str(manifest).endswith(".npz"):
        z = np.load(resolve(manifest))
        if str(z["tokenizer_sha256"]) != tokenizer_sha256(tok):
            raise ValueError(f"{manifest}: tokenized with another tokenizer than the target's")
        return Streams(train=z["train"].astype(np.int32), validation=z["validation"].astype(np.int32))
    root = resolve(root)
    checked = corpus.check(corpus.read_manifest(resolve(manifest)), root)
    get = lambda split: data.token_stream(tok, split, checked, root, max_files, cache_dir)
    return Streams(train=get("train"), validation=get("validation"))


SHARD_BYTES = 24 << 20  # the repo ships no file over 30 MiB: bigger exports are sharded (HF index)


def export(cfg: TrainConfig, params, tok: Tokenizer, export_dir: Path, info: dict) -> None:
    """Hugging Face format: bf16 model.safetensors, config.json, tokenizer.json (+ train_info.json)."""
    graphdef, _, _, _ = _step_fns(cfg)
    model = nnx.merge(graphdef, params)
    save_model(model, str(export_dir), tokenizer=tok, dtype=jnp.bfloat16, max_shard_bytes=SHARD_BYTES)
    (export_dir / "train_info.json").write_text(json.dumps(info, indent=2) + "\n")


def train(cfg: TrainConfig, run_dir: str | Path, export_dir: str | Path | None = None, *,
          max_steps: int | None = None, overwrite: bool = False, progress: bool = True,
          reschedule: bool = False, mesh=None) -> dict:
    """Trains (or resumes) up to `max_steps` (default: all phases); exports when finished.
    Returns the final train state. `mesh` (a `jax.sharding.Mesh`, `specjax.models.sharding.make_mesh`):
    data parallel over its `data` axis (the batch and every micro-batch must divide by it), tensor
    parallel over `model` by the family's partition table; checkpoints are the same orbax
    checkpoints (saved sharded; a run may resume on another mesh or on one device)."""
    if mesh is not None:
        mesh = sharding.check_mesh(mesh)
        data_axis = sharding.axis_size(mesh, sharding.DATA)
        for p in cfg.phases:
            if (p.micro_batch_size or cfg.batch_size) % data_axis:
                raise ValueError(f"micro-batches of {p.micro_batch_size or cfg.batch_size} rows do not split over the "
                                 f"mesh's data axis ({data_axis})")
    with sharding.mesh_context(mesh):
        return _train(cfg, run_dir, export_dir, max_steps=max_steps, overwrite=overwrite, progress=progress,
                      reschedule=reschedule, mesh=mesh)


def _train(cfg: TrainConfig, run_dir, export_dir, *, max_steps, overwrite, progress, reschedule, mesh) -> dict:
    run_dir, export_dir = Path(run_dir), (Path(export_dir) if export_dir is not None else None)
    tok_path = resolve(cfg.tokenizer)
    if not tok_path.exists():
        raise FileNotFoundError(f"{tok_path}: no tokenizer; train it with `python -m train.tokenizer --out {tok_path.parent}`")
    tok = Tokenizer.from_file(str(tok_path))
    if tok.get_vocab_size() > cfg.model.vocab_size:
        raise ValueError(f"{tok_path}: {tok.get_vocab_size()} tokens do not fit the model's vocab_size {cfg.model.vocab_size}")
    identity = prepare_run_dir(cfg, run_dir, export_dir, overwrite, reschedule)
    streams = load_streams(cfg, tok, run_dir / "token-cache")
    _, _, train_step, _ = _step_fns(cfg)
    val_windows = data.eval_windows(streams.validation, cfg.eval_seq_len, cfg.eval_tokens)

    # Committed to the device (or laid out on the mesh) like a restored state, so a resumed run
    # reuses the compiled step; a checkpoint restores into this layout, whichever it was saved from.
    state = sharding.place_params(init_state(cfg), family_rules(cfg.model), mesh)
    mngr = checkpoint_manager(cfg, run_dir)
    if mngr.latest_step() is not None:
        state = mngr.restore(mngr.latest_step(), args=ocp.args.StandardRestore(sharding.abstract(state)))
    start = int(state["step"])
    stop = cfg.total_steps if max_steps is None else min(max_steps, cfg.total_steps)

    metrics_file = run_dir / "metrics.jsonl"
    bar = tqdm(total=cfg.total_steps, initial=start, desc=cfg.name, disable=not progress, dynamic_ncols=True)
    rates, val_loss = [], None  # tokens/s of each step since the last evaluation
    for step in range(start, stop):
        batch = step_batch(cfg, streams.train, step)
        t0 = time.perf_counter()
        state, m = train_step(state, jnp.asarray(batch) if mesh is None else sharding.place(batch, BATCH_AxMxT1, mesh))
        loss = float(m["loss"])  # also waits for the step, so tokens/s is honest
        if not math.isfinite(loss):
            raise FloatingPointError(f"loss is {loss} at step {step + 1}; last checkpoint: {mngr.latest_step()}")
        rates.append(cfg.batch_size * (batch.shape[-1] - 1) / (time.perf_counter() - t0))
        # Median: the steps that compile (the first, a phase change) do not drag the number down.
        bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{np.median(rates):.0f}", refresh=False)
        bar.update(1)
        done = step + 1
        if done % cfg.eval_every == 0 or done == cfg.total_steps:
            val_loss = evaluate(cfg, state["params"], val_windows)
            record = {"step": done, "train_loss": loss, "val_loss": val_loss, "val_ppl": math.exp(val_loss),
                      "lr": float(m["lr"]), "grad_norm": float(m["grad_norm"]),
                      "tokens_per_s": float(np.median(rates)), "seq_len": batch.shape[-1] - 1}
            with metrics_file.open("a") as f:
                f.write(json.dumps(record) + "\n")
            bar.write(f"step {done}: train loss {loss:.4f}, val loss {val_loss:.4f}, val ppl {math.exp(val_loss):.2f}")
            rates = []
        mngr.save(done, args=ocp.args.StandardSave(state), force=(done == stop))
    bar.close()
    mngr.wait_until_finished()
    mngr.close()

    if int(state["step"]) == cfg.total_steps and export_dir is not None:
        if val_loss is None:
            val_loss = evaluate(cfg, state["params"], val_windows)
        info = {"run": identity, "steps": cfg.total_steps, "val_loss": val_loss, "val_ppl": math.exp(val_loss),
                "tokens_trained": tokens_through(cfg, cfg.total_steps)}
        export(cfg, state["params"], tok, export_dir, info)
        print(f"exported {export_dir} (val loss {val_loss:.4f}, ppl {math.exp(val_loss):.2f})")
    elif int(state["step"]) < cfg.total_steps:
        print(f"stopped at step {int(state['step'])} of {cfg.total_steps}; run the same command to resume")
    return state


def tokens_through(cfg: TrainConfig, steps: int) -> int:
    """Training tokens (predicted positions) seen in the first `steps` global steps."""
    total = 0
    for p in cfg.phases:
        n = min(max(steps, 0), p.steps)
        total += n * cfg.batch_size * p.seq_len
        steps -= p.steps
    return total


def export_latest(cfg: TrainConfig, run_dir: str | Path, export_dir: str | Path, *, overwrite: bool = False,
                  note: str | None = None) -> dict:
    """Exports the run's latest checkpoint before training has ended (a model for work that
    cannot wait for the last step). `train_info.json` says `"interim": true` and the steps and
    tokens it has seen; the run itself is untouched and resumes as before."""
    run_dir, export_dir = Path(run_dir), Path(export_dir)
    if not (run_dir / "run.json").exists():
        raise RunRefused(f"{run_dir}: no run.json; nothing to export")
    identity = run_identity(cfg)
    # Phase lengths may differ (a run exported from a copy kept before a --reschedule): exporting
    # a checkpoint does not depend on the schedule, only on what the steps so far were.
    check_resume(run_dir, identity, reschedule=True)
    if has_weights(export_dir) and not overwrite:
        raise RunRefused(f"{export_dir} already holds a model (model.safetensors); pass --overwrite to replace it.")
    tok = Tokenizer.from_file(str(resolve(cfg.tokenizer)))
    mngr = checkpoint_manager(cfg, run_dir)
    step = mngr.latest_step()
    if step is None:
        raise RunRefused(f"{run_dir}: no checkpoint yet")
    state = mngr.restore(step, args=ocp.args.StandardRestore(sharding.abstract(jax.eval_shape(lambda: init_state(cfg)))))
    mngr.close()
    streams = load_streams(cfg, tok, run_dir / "token-cache")
    val_loss = evaluate(cfg, state["params"], data.eval_windows(streams.validation, cfg.eval_seq_len, cfg.eval_tokens))
    info = {"run": json.loads((run_dir / "run.json").read_text()), "steps": step, "total_steps": cfg.total_steps,
            "interim": step < cfg.total_steps, "val_loss": val_loss, "val_ppl": math.exp(val_loss),
            "tokens_trained": tokens_through(cfg, step)}
    if note:
        info["note"] = note  # what this export is, for its model card (e.g. a checkpoint kept on purpose)
    export(cfg, state["params"], tok, export_dir, info)
    print(f"exported step {step} of {cfg.total_steps} to {export_dir} (val loss {val_loss:.4f}, ppl {math.exp(val_loss):.2f})")
    return info


def benchmark(cfg: TrainConfig, steps: int, phase: int = 0) -> dict:
    """Tokens/s of the train step on random tokens, excluding compilation (run dir untouched)."""
    _, _, train_step, _ = _step_fns(cfg)
    state = init_state(cfg)
    p = cfg.phases[phase]
    micro = p.micro_batch_size or cfg.batch_size
    rng = np.random.default_rng(0)
    batch = lambda: jnp.asarray(rng.integers(3, cfg.model.vocab_size, (cfg.batch_size // micro, micro, p.seq_len + 1)), jnp.int32)
    t0 = time.perf_counter()
    state, m = train_step(state, batch())
    float(m["loss"])
    compile_s = time.perf_counter() - t0
    times = []
    for _ in tqdm(range(steps), desc=f"bench {cfg.name}"):
        b = batch()
        t = time.perf_counter()
        state, m = train_step(state, b)
        float(m["loss"])
        times.append(time.perf_counter() - t)
    tokens = cfg.batch_size * p.seq_len
    return {"seq_len": p.seq_len, "batch_size": cfg.batch_size, "bf16_compute": cfg.bf16_compute,
            "compile_s": compile_s, "step_s_median": float(np.median(times)),
            "tokens_per_s": tokens / float(np.median(times)), "steps": steps}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, type=Path)
    ap.add_argument("--run-dir", type=Path, help="checkpoints, run.json, metrics.jsonl")
    ap.add_argument("--export", type=Path, help="Hugging Face export directory, written when training ends")
    ap.add_argument("--max-steps", type=int, help="stop after this global step (resumable)")
    ap.add_argument("--overwrite", action="store_true", help="discard an existing run dir / export")
    ap.add_argument("--reschedule", action="store_true",
                    help="resume with changed phase lengths (recorded in run.json; LR follows the new total)")
    ap.add_argument("--export-latest", action="store_true",
                    help="only export the run dir's latest checkpoint to --export (marked interim if unfinished)")
    ap.add_argument("--note", help="with --export-latest: what this export is (goes to train_info.json and the card)")
    ap.add_argument("--bench", type=int, metavar="STEPS", help="only measure train-step throughput")
    ap.add_argument("--bf16-compute", choices=["true", "false"], help="with --bench: override the config")
    ap.add_argument("--mesh", help=sharding.MESH_HELP)
    args = ap.parse_args(argv)
    cfg = load_config(args.config)
    mesh = None
    if args.mesh:
        try:
            mesh = sharding.parse_mesh(args.mesh)
        except ValueError as e:
            ap.error(str(e))
    if args.bench:
        if args.bf16_compute:
            cfg = dataclasses.replace(cfg, bf16_compute=args.bf16_compute == "true")
        print(json.dumps(benchmark(cfg, args.bench)))
        return
    if args.run_dir is None:
        ap.error("--run-dir is required")
    try:
        if args.export_latest:
            if args.export is None:
                ap.error("--export-latest needs --export")
            export_latest(cfg, args.run_dir, args.export, overwrite=args.overwrite, note=args.note)
            return
        train(cfg, args.run_dir, args.export, max_steps=args.max_steps, overwrite=args.overwrite,
              reschedule=args.reschedule, mesh=mesh)
    except (RunRefused, corpus.CorpusMismatch, FileNotFoundError, ValueError) as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    # Compiling the 25M model's step takes minutes on a small CPU; a resume should not pay it again.
    jax.config.update("jax_compilation_cache_dir", str(REPO / "runs" / "jax-cache"))
    main()
