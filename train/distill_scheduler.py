"""Distils the TreeGraft scheduler from a value dataset (train/value_system.py): an optax loop fits the
MLP of `specjax.drafters.composite.treegraft_scheduler` to each action's value (one output per action:
cheap, strong, graft, recover, union); TreeGraft takes the argmax.

The target of each output is the action's value centred over the record's available actions (the
argmax does not change; the common part, how many tokens any action gets, is not the scheduler's
to predict), Huber loss, unavailable actions masked out. Fit on training prompts, evaluated on
held-out PROMPTS (records of one prompt never straddle the split: rounds of one generation are
correlated): goodput (tokens / s, the dataset's cost table) of the scheduler's choices against the
Switch's rule, each fixed action and the hindsight oracle (the best action of every round), over the
held-out records. These numbers go to `distill_info.json` beside the export.

Same machinery as the other trainers: optax AdamW, orbax CheckpointManager (resumable; a run dir
made from another dataset or config is refused), tqdm, `metrics.jsonl`. The export is a directory
`python -m specjax generate --treegraft DIR` loads (scheduler_config.json with the feature layout and
the actions, model.safetensors, distill_info.json).

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
from specjax.drafters.composite.treegraft import ACTIONS
from train import value_system
from train.value_system import load_dataset

REPO = Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class DistillConfig:
    hidden: tuple[int, ...] = (32, 32)
    steps: int = 2000
    batch_size: int = 256
    learning_rate: float = 3e-3
    weight_decay: float = 1e-4
    heldout_fraction: float = 0.25
    validation_fraction: float = 0.2  # of the training prompts: the step kept is the best goodput there
    min_match: int = 3  # the Switch rule it is compared with
    seed: int = 0
    eval_every: int = 100
    checkpoint_every: int = 500

    def __post_init__(self):
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


def policy_metrics(pick: np.ndarray, data: dict, mask: np.ndarray, min_match: int) -> dict:
    """Goodput (tokens / s by the cost table) of choices `pick` on the records of `mask`, beside the
    Switch's rule, every fixed action and the hindsight oracle; the share of rounds per action."""
    acc, cost, value = data["accepted"][mask], data["cost"][mask], data["value"][mask]
    if not len(acc):
        return {"records": 0}
    avail = np.asarray(data["available"])
    good = lambda p: value_system.policy_goodput(p, acc, cost)  # noqa: E731
    oracle = good(np.argmax(value, axis=1))
    out = {"records": int(len(acc)), "goodput": good(pick[mask]), "oracle": oracle,
           "fixed": {a: good(np.full(len(acc), i)) for i, a in enumerate(ACTIONS) if avail[i]},
           "share": {a: float(np.mean(pick[mask] == i)) for i, a in enumerate(ACTIONS)}}
    if data["features"][:, sched_lib.FEATURE_NAMES.index("match_length")].any():
        out["switch"] = good(value_system.switch_rule(data["features"][mask], min_match))
    best_fixed = max(out["fixed"].values())
    out["vs_best_fixed"] = out["goodput"] / best_fixed
    out["vs_oracle"] = out["goodput"] / oracle
    if "switch" in out:
        out["vs_switch"] = out["goodput"] / out["switch"]
    return out


def _identity(cfg: DistillConfig, data_paths) -> dict:
    h = hashlib.sha256()
    for p in data_paths:
        h.update((Path(p) / "values.npz").read_bytes())
    return {"config": {**dataclasses.asdict(cfg), "hidden": list(cfg.hidden)},
            "data": [repo_relative(p) for p in data_paths], "data_sha256": h.hexdigest(),
            "feature_layout": sched_lib.FEATURE_LAYOUT, "actions": list(ACTIONS)}


def centred(value: np.ndarray, avail: np.ndarray) -> np.ndarray:
    """Each record's values minus their mean over the available actions (0 where unavailable)."""
    v = np.where(avail[None], value, 0.0)
    return np.where(avail[None], v - v.sum(1, keepdims=True) / max(int(avail.sum()), 1), 0.0).astype(np.float32)


def fit(cfg: DistillConfig, data: dict, train_mask, run_dir: Path, identity: dict, *, progress: bool = True,
        overwrite: bool = False):
    """Fits the scheduler; returns (scheduler, held-out metrics record)."""
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

    avail = np.asarray(data["available"], bool)
    X = data["features"].astype(np.float32)
    Y = centred(data["value"], avail)
    # a validation split of the training prompts picks the step kept (the labels are noisy: a round's best
    # action is partly luck, and the MLP fits it); the held-out prompts stay unseen
    train_ids = np.unique(data["prompt"][train_mask])
    val_mask = np.zeros_like(train_mask)
    if len(train_ids) >= 3:
        val_mask = train_mask & split_by_prompt(np.where(train_mask, data["prompt"], train_ids[0]),
                                                cfg.validation_fraction, cfg.seed + 1)
        if val_mask.all() or not (train_mask & ~val_mask).any():
            val_mask = np.zeros_like(train_mask)
    fit_mask = train_mask & ~val_mask
    Xtr, Ytr = X[fit_mask], Y[fit_mask]
    sched = sched_lib.Scheduler(sched_lib.SchedulerConfig(hidden=cfg.hidden, kind="regression", actions=ACTIONS),
                                seed=cfg.seed)
    mean, std = Xtr.mean(0), Xtr.std(0)
    sched.mean.set_value(jnp.asarray(mean, jnp.float32))
    sched.scale.set_value(jnp.asarray(np.where(std > 1e-6, std, 1.0), jnp.float32))
    y_scale = float(np.std(Ytr[:, avail])) or 1.0
    w = jnp.asarray(avail, jnp.float32)
    graphdef, params, rest = nnx.split(sched, nnx.Param, ...)
    tx = optax.adamw(optax.cosine_decay_schedule(cfg.learning_rate, max(cfg.steps, 1), 0.1),
                     weight_decay=cfg.weight_decay)

    def loss_fn(params, x, y):
        out = nnx.merge(graphdef, params, rest).values(x)
        return jnp.sum(w * optax.huber_loss(out, y / y_scale)) / (jnp.sum(w) * x.shape[0])

    @jax.jit
    def train_step(state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(state["params"], x, y)
        updates, opt = tx.update(grads, state["opt_state"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt,
                "step": state["step"] + 1}, loss

    @jax.jit
    def predict(params, x):
        return nnx.merge(graphdef, params, rest).values(x)

    state = {"params": params, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32)}
    mngr = ocp.CheckpointManager((run_dir / "checkpoints").absolute(), options=ocp.CheckpointManagerOptions(
        max_to_keep=2, save_interval_steps=cfg.checkpoint_every, create=True))
    if mngr.latest_step() is not None:
        state = mngr.restore(mngr.latest_step(), args=ocp.args.StandardRestore(jax.eval_shape(lambda: state)))
    start = int(state["step"])
    rng = np.random.default_rng(cfg.seed + start)
    bs = min(cfg.batch_size, len(Xtr))
    bar = tqdm(total=cfg.steps, initial=start, desc="scheduler", disable=not progress, dynamic_ncols=True)
    record = None

    def evaluate(step, loss):
        out = np.asarray(predict(state["params"], jnp.asarray(X)))
        pick = np.argmax(np.where(avail[None], out, -np.inf), axis=1)
        return {"step": step, "train_loss": loss, "heldout": policy_metrics(pick, data, ~train_mask, cfg.min_match),
                "validation": policy_metrics(pick, data, val_mask, cfg.min_match),
                "train": policy_metrics(pick, data, fit_mask, cfg.min_match)}

    kept = None  # (validation goodput, step, params) of the best evaluation

    for step in range(start, cfg.steps):
        idx = rng.integers(0, len(Xtr), bs)
        state, loss = train_step(state, jnp.asarray(Xtr[idx]), jnp.asarray(Ytr[idx]))
        loss = float(loss)
        bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
        bar.update(1)
        done = step + 1
        if done % cfg.eval_every == 0 or done == cfg.steps:
            record = evaluate(done, loss)
            with (run_dir / "metrics.jsonl").open("a") as f:
                f.write(json.dumps(record) + "\n")
            score = record["validation"].get("goodput", 0.0)
            if kept is None or score > kept[0]:
                kept = (score, done, state["params"], record)
        mngr.save(done, args=ocp.args.StandardSave(state), force=(done == cfg.steps))
    bar.close()
    mngr.wait_until_finished()
    mngr.close()
    if record is None:
        record = evaluate(int(state["step"]), float("nan"))
    if kept is not None and val_mask.any():
        _, step_kept, params_kept, record = kept
        record = {**record, "kept_step": step_kept}
        nnx.update(sched, params_kept)
    else:
        nnx.update(sched, state["params"])
    return sched, record


def distill(data_paths, run_dir, export=None, cfg: DistillConfig = DistillConfig(), *, progress=True,
            overwrite=False) -> dict:
    data_paths = [Path(p) for p in ([data_paths] if isinstance(data_paths, (str, Path)) else data_paths)]
    data, provs = load_dataset(data_paths)
    if len(data["value"]) < 4:
        raise ValueError(f"the value dataset has {len(data['value'])} records: too few to fit a scheduler")
    held = split_by_prompt(data["prompt"], cfg.heldout_fraction, cfg.seed)
    sched, rec = fit(cfg, data, ~held, Path(run_dir), _identity(cfg, data_paths), progress=progress,
                     overwrite=overwrite)
    summary = {"heldout": rec["heldout"], "train": rec["train"],
               "heldout_prompts": int(len(np.unique(data["prompt"][held]))),
               "train_prompts": int(len(np.unique(data["prompt"][~held]))),
               "lam_tokens_per_s": [p.get("lam_tokens_per_s") for p in provs],
               "data": [repo_relative(p) for p in data_paths],
               "models": [p.get("models") for p in provs], "config": {**dataclasses.asdict(cfg), "hidden": list(cfg.hidden)}}
    if export is not None:
        export = Path(export)
        sched_lib.save_scheduler(sched, str(export), calibration=float(data["calibration"]),
                                 meta={"heldout": rec["heldout"], "models": summary["models"]})
        (export / "distill_info.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", nargs="+", required=True, help="value dataset directories (train.value_system --out)")
    ap.add_argument("--run-dir", required=True, type=Path)
    ap.add_argument("--export", type=Path, help="scheduler directory for --treegraft")
    ap.add_argument("--hidden", default="32,32")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--learning-rate", type=float, default=3e-3)
    ap.add_argument("--heldout-fraction", type=float, default=0.25)
    ap.add_argument("--min-match", type=int, default=3, help="the Switch rule it is compared with")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--overwrite", action="store_true")
    args = ap.parse_args(argv)
    try:
        cfg = DistillConfig(hidden=tuple(int(h) for h in args.hidden.split(",")), steps=args.steps, min_match=args.min_match,
                            batch_size=args.batch_size, learning_rate=args.learning_rate,
                            heldout_fraction=args.heldout_fraction, seed=args.seed)
        summary = distill(args.data, args.run_dir, args.export, cfg, overwrite=args.overwrite)
    except (RunRefused, FileNotFoundError, ValueError) as e:
        sys.exit(f"error: {e}")
    m = summary["heldout"]
    print(f"held-out goodput {m['goodput']:.1f} tokens/s: {m['vs_best_fixed']:.3f}x the best fixed action, "
          f"{m['vs_oracle']:.3f}x the oracle" + (f", {m['vs_switch']:.3f}x the Switch rule" if "vs_switch" in m else "")
          + "; actions " + ", ".join(f"{a} {v:.0%}" for a, v in m["share"].items()))
    if args.export:
        print(f"exported {args.export}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
