"""Distils the TreeGraft scheduler from a value dataset (train/value_system.py): an optax loop fits
the MLP of `specjax.drafters.composite.treegraft_scheduler` to the realised value of invoking the strong drafter.

Two formulations, both fit on the same split and compared on held-out PROMPTS (records of one
prompt never straddle the split — rounds of one generation are correlated):
  classification  logit of "invoking pays" (value > 0), binary cross-entropy weighted by |value|
                  (a wrong call on a round where little is at stake costs little: the weights
                  make the loss track the realised value);
  regression      the value itself (scaled by its standard deviation), Huber loss;
                  invoke where the prediction is > 0.
`--kind auto` (default) fits both and exports the one with the larger held-out realised gain
(mean over held-out rounds of value x decision, in tokens/s; ties: accuracy), and records both
sets of numbers — the justification — next to the always / never / oracle baselines.

Same machinery as the other trainers: optax AdamW, orbax CheckpointManager (resumable; a run dir
made from another dataset or config is refused), tqdm, `metrics.jsonl` per kind. The export is a
directory `python -m specjax generate --treegraft DIR` loads (scheduler_config.json with the
feature layout and the fitted calibration offset, model.safetensors, distill_info.json).

    python -m train.distill_scheduler --data runs/treegraft-values/ngram+feature \
        --run-dir runs/treegraft-sched/ngram+feature --export models/treegraft/ngram+feature
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import shutil
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from tqdm import tqdm

from specjax.drafters.composite import treegraft_scheduler as sched_lib
from train.common import repo_relative
from train.value_system import load_dataset

REPO = Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class DistillConfig:
    hidden: tuple[int, ...] = (32, 32)
    kind: str = "auto"  # auto | classification | regression
    steps: int = 2000
    batch_size: int = 256
    learning_rate: float = 3e-3
    weight_decay: float = 1e-4
    heldout_fraction: float = 0.25
    seed: int = 0
    eval_every: int = 100
    checkpoint_every: int = 500

    def __post_init__(self):
        if self.kind not in ("auto",) + sched_lib.KINDS:
            raise ValueError(f"kind must be auto, classification or regression, got {self.kind!r}")
        if not 0.0 < self.heldout_fraction < 1.0:
            raise ValueError(f"heldout_fraction must be in (0, 1), got {self.heldout_fraction}")


class RunRefused(RuntimeError):
    pass


def split_by_prompt(prompt_ids: np.ndarray, fraction: float, seed: int) -> np.ndarray:
    """Boolean mask of held-out records: a random `fraction` of the prompts (at least one, and at
    least one left for training)."""
    ids = np.unique(prompt_ids)
    if len(ids) < 2:
        raise ValueError(f"the value dataset covers {len(ids)} prompt(s): a held-out split needs at least 2")
    rng = np.random.default_rng(seed)
    n = min(max(1, int(round(fraction * len(ids)))), len(ids) - 1)
    held = rng.choice(ids, n, replace=False)
    return np.isin(prompt_ids, held)


def decision_metrics(decide: np.ndarray, value: np.ndarray) -> dict:
    """Held-out numbers of a decision rule: accuracy against value > 0, realised gain (mean of value
    x decision, tokens/s per round, relative to never invoking), and the baselines."""
    pays = value > 0
    gain = float(np.mean(value * decide)) if len(value) else 0.0
    oracle = float(np.mean(np.maximum(value, 0))) if len(value) else 0.0
    return {"accuracy": float(np.mean(decide == pays)) if len(value) else float("nan"),
            "invoke_rate": float(np.mean(decide)) if len(value) else float("nan"),
            "gain": gain, "gain_always": float(np.mean(value)) if len(value) else 0.0, "gain_never": 0.0,
            "gain_oracle": oracle, "share_of_oracle": gain / oracle if oracle > 0 else float("nan"),
            "accuracy_always": float(np.mean(pays)) if len(value) else float("nan"),
            "records": int(len(value))}


def _identity(cfg: DistillConfig, data_paths, kind: str) -> dict:
    h = hashlib.sha256()
    for p in data_paths:
        h.update((Path(p) / "values.npz").read_bytes())
    return {"config": {**dataclasses.asdict(cfg), "hidden": list(cfg.hidden), "kind": kind},
            "data": [repo_relative(p) for p in data_paths], "data_sha256": h.hexdigest(),
            "feature_layout": sched_lib.FEATURE_LAYOUT}


def fit(cfg: DistillConfig, kind: str, X, value, train_mask, run_dir: Path, identity: dict, *,
        progress: bool = True, overwrite: bool = False):
    """Fits one kind; returns (scheduler, held-out decisions on ~train_mask, metrics record)."""
    run_dir = Path(run_dir)
    stored = run_dir / "run.json"
    if run_dir.exists() and overwrite:
        shutil.rmtree(run_dir)
    elif stored.exists():
        old = json.loads(stored.read_text())
        if {k: v for k, v in old.items() if k != "config"} != {k: v for k, v in identity.items() if k != "config"} \
                or {k: v for k, v in old["config"].items() if k not in ("steps", "eval_every", "checkpoint_every")} \
                != {k: v for k, v in identity["config"].items() if k not in ("steps", "eval_every", "checkpoint_every")}:
            raise RunRefused(f"{run_dir} belongs to a different distillation (another dataset or config); "
                             "use another --run-dir or --overwrite")
    run_dir.mkdir(parents=True, exist_ok=True)
    stored.write_text(json.dumps(identity, indent=2) + "\n")

    Xtr, vtr = X[train_mask], value[train_mask]
    Xho, vho = X[~train_mask], value[~train_mask]
    sched = sched_lib.Scheduler(sched_lib.SchedulerConfig(hidden=cfg.hidden, kind=kind), seed=cfg.seed)
    mean, std = Xtr.mean(0), Xtr.std(0)
    sched.mean.set_value(jnp.asarray(mean, jnp.float32))
    sched.scale.set_value(jnp.asarray(np.where(std > 1e-6, std, 1.0), jnp.float32))
    v_scale = float(np.std(vtr)) or 1.0
    abs_mean = float(np.mean(np.abs(vtr))) or 1.0
    graphdef, params, rest = nnx.split(sched, nnx.Param, ...)
    tx = optax.adamw(optax.cosine_decay_schedule(cfg.learning_rate, max(cfg.steps, 1), 0.1),
                     weight_decay=cfg.weight_decay)

    def loss_fn(params, x, v):
        out = nnx.merge(graphdef, params, rest)(x)
        if kind == "classification":
            w = jnp.abs(v) / abs_mean
            return jnp.mean(w * optax.sigmoid_binary_cross_entropy(out, (v > 0).astype(jnp.float32)))
        return jnp.mean(optax.huber_loss(out, v / v_scale))

    @jax.jit
    def train_step(state, x, v):
        loss, grads = jax.value_and_grad(loss_fn)(state["params"], x, v)
        updates, opt = tx.update(grads, state["opt_state"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt,
                "step": state["step"] + 1}, loss

    @jax.jit
    def predict(params, x):
        return nnx.merge(graphdef, params, rest)(x)

    eval_loss = jax.jit(loss_fn)

    state = {"params": params, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32)}
    mngr = ocp.CheckpointManager((run_dir / "checkpoints").absolute(), options=ocp.CheckpointManagerOptions(
        max_to_keep=2, save_interval_steps=cfg.checkpoint_every, create=True))
    if mngr.latest_step() is not None:
        state = mngr.restore(mngr.latest_step(), args=ocp.args.StandardRestore(jax.eval_shape(lambda: state)))
    start = int(state["step"])
    rng = np.random.default_rng(cfg.seed + start)
    bs = min(cfg.batch_size, len(Xtr))
    bar = tqdm(total=cfg.steps, initial=start, desc=f"scheduler ({kind})", disable=not progress, dynamic_ncols=True)
    record = None

    def evaluate(step, loss):
        out = np.asarray(predict(state["params"], jnp.asarray(Xho)))
        m = decision_metrics(out > 0, vho)
        ho_loss = float(eval_loss(state["params"], jnp.asarray(Xho), jnp.asarray(vho))) if len(vho) else float("nan")
        return {"step": step, "kind": kind, "train_loss": loss, "heldout_loss": ho_loss, **m}

    for step in range(start, cfg.steps):
        idx = rng.integers(0, len(Xtr), bs)
        state, loss = train_step(state, jnp.asarray(Xtr[idx]), jnp.asarray(vtr[idx]))
        loss = float(loss)
        bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
        bar.update(1)
        done = step + 1
        if done % cfg.eval_every == 0 or done == cfg.steps:
            record = evaluate(done, loss)
            with (run_dir / "metrics.jsonl").open("a") as f:
                f.write(json.dumps(record) + "\n")
        mngr.save(done, args=ocp.args.StandardSave(state), force=(done == cfg.steps))
    bar.close()
    mngr.wait_until_finished()
    mngr.close()
    if record is None:
        record = evaluate(int(state["step"]), float("nan"))
    nnx.update(sched, state["params"])
    return sched, record


def distill(data_paths, run_dir, export=None, cfg: DistillConfig = DistillConfig(), *, progress=True,
            overwrite=False) -> dict:
    data_paths = [Path(p) for p in ([data_paths] if isinstance(data_paths, (str, Path)) else data_paths)]
    data, provs = load_dataset(data_paths)
    X, value = data["features"].astype(np.float32), data["value"].astype(np.float32)
    if len(value) < 4:
        raise ValueError(f"the value dataset has {len(value)} records: too few to fit a scheduler")
    held = split_by_prompt(data["prompt"], cfg.heldout_fraction, cfg.seed)
    kinds = sched_lib.KINDS if cfg.kind == "auto" else (cfg.kind,)
    results = {}
    for kind in kinds:
        sched, rec = fit(cfg, kind, X, value, ~held, Path(run_dir) / kind, _identity(cfg, data_paths, kind),
                         progress=progress, overwrite=overwrite)
        results[kind] = (sched, rec)
    best = max(kinds, key=lambda k: (results[k][1]["gain"], results[k][1]["accuracy"]))
    summary = {"chosen": best, "heldout": {k: results[k][1] for k in kinds},
               "heldout_prompts": int(len(np.unique(data["prompt"][held]))),
               "train_prompts": int(len(np.unique(data["prompt"][~held]))),
               "calibration": float(data["calibration"]),
               "data": [repo_relative(p) for p in data_paths],
               "models": [p.get("models") for p in provs], "config": {**dataclasses.asdict(cfg), "hidden": list(cfg.hidden)}}
    if export is not None:
        export = Path(export)
        sched_lib.save_scheduler(results[best][0], str(export), calibration=float(data["calibration"]),
                                 meta={"heldout_accuracy": results[best][1]["accuracy"],
                                       "heldout_gain": results[best][1]["gain"], "chosen": best,
                                       "models": summary["models"]})
        (export / "distill_info.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", nargs="+", required=True, help="value dataset directories (train.value_system --out)")
    ap.add_argument("--run-dir", required=True, type=Path)
    ap.add_argument("--export", type=Path, help="scheduler directory for --treegraft")
    ap.add_argument("--kind", default="auto", choices=["auto", *sched_lib.KINDS])
    ap.add_argument("--hidden", default="32,32")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--learning-rate", type=float, default=3e-3)
    ap.add_argument("--heldout-fraction", type=float, default=0.25)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--overwrite", action="store_true")
    args = ap.parse_args(argv)
    try:
        cfg = DistillConfig(hidden=tuple(int(h) for h in args.hidden.split(",")), kind=args.kind, steps=args.steps,
                            batch_size=args.batch_size, learning_rate=args.learning_rate,
                            heldout_fraction=args.heldout_fraction, seed=args.seed)
        summary = distill(args.data, args.run_dir, args.export, cfg, overwrite=args.overwrite)
    except (RunRefused, FileNotFoundError, ValueError) as e:
        sys.exit(f"error: {e}")
    for k, m in summary["heldout"].items():
        print(f"{k:>14}: held-out accuracy {m['accuracy']:.3f}, gain {m['gain']:+.2f} tokens/s per round "
              f"(always {m['gain_always']:+.2f}, oracle {m['gain_oracle']:+.2f}), invoke rate {m['invoke_rate']:.2f}")
    print(f"chosen: {summary['chosen']}" + (f"; exported {args.export}" if args.export else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
