"""The TreeGraft scheduler (design §6): a small MLP over features of the cheap drafter's tree that
decides, per row and per round, whether invoking the strong drafter is worth its cost.

Features (`FEATURE_NAMES`, layout `FEATURE_LAYOUT`), all computed inside the jitted loop from the
cheap tree's buffers (so they exist for every drafter, the n-gram one included) and the row's
history:
  top1_d{d}      exp(best cumulative log q at depth d - best at depth d-1): the best path's
                 continuation probability at depth d (1 for a valid n-gram node, 0 past the tree);
  entropy_d{d}   entropy of the children of the best node at depth d-1, from the tree's own
                 children plus one bucket for the mass not in the tree (a lower bound of the
                 drafter's entropy; 0 for an n-gram chain, not for its trie);
  path_mass      sum of exp(cumulative log q) over the best N-1 nodes (N: the verify budget) —
                 the expected number of accepted tokens if the cheap drafter were right;
  tau_ema        exponential moving average of the row's tau (accepted + 1) over recent rounds;
  last_accepted  tokens accepted in the row's previous round;
  batch_size     B (one invocation costs the same for 1 row or all rows of the batch).

A checkpoint stores the layout name and the feature names; loading one made for another layout
is refused. Checkpoints are written by `train/distill_scheduler.py`: `scheduler_config.json` +
`model.safetensors`.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file

from specjax.spec.tree import TreeBuffers

ACTIONS = ("cheap", "strong", "graft", "recover", "union")  # TreeGraft's actions (specjax.drafters.composite.treegraft)
FEATURE_LAYOUT_V1 = "treegraft-features-v1"  # the first layout: one output (invoke the strong drafter or not)
FEATURE_LAYOUT = "treegraft-features-v2"
FEATURE_DEPTH = 8  # depths 1..8 get top-1 / entropy features; deeper nodes are ignored
FEATURE_NAMES_V1 = tuple([f"top1_d{d}" for d in range(1, FEATURE_DEPTH + 1)]
                         + [f"entropy_d{d}" for d in range(1, FEATURE_DEPTH + 1)]
                         + ["path_mass", "tau_ema", "last_accepted", "batch_size"])
FEATURE_NAMES = FEATURE_NAMES_V1 + ("match_length", "leaves", "acc_cheap_ema", "acc_strong_ema") + tuple(
    f"last_{a}" for a in ACTIONS) + ("active_share",)
NUM_FEATURES = len(FEATURE_NAMES)
CONFIG_FILE = "scheduler_config.json"
WEIGHTS_FILE = "model.safetensors"
FORMAT = "specjax-treegraft-scheduler"
KINDS = ("classification", "regression")


def tree_features(tree: TreeBuffers, budget: int, tau_ema_B, last_accepted_B) -> jax.Array:
    """[B, NUM_FEATURES] scheduler features of a cheap tree (see the module docstring)."""
    B, M = tree.tokens.shape
    valid = tree.valid & ((tree.parents >= 0) | (jnp.arange(M)[None] == 0))
    score = jnp.where(valid, tree.score, -jnp.inf)
    depths = jnp.arange(FEATURE_DEPTH + 1)
    at_depth = valid[:, None, :] & (tree.depth[:, None, :] == depths[None, :, None])  # [B, D+1, M]
    masked = jnp.where(at_depth, score[:, None, :], -jnp.inf)
    best = jnp.max(masked, axis=-1).at[:, 0].set(0.0)  # [B, D+1]
    best_node = jnp.argmax(masked, axis=-1).at[:, 0].set(0)  # [B, D+1]
    has = jnp.isfinite(best)
    step = jnp.where(has[:, 1:] & has[:, :-1], best[:, 1:] - jnp.where(has[:, :-1], best[:, :-1], 0.0), -jnp.inf)
    top1 = jnp.exp(jnp.minimum(step, 0.0))  # 0 where depth d has no node

    # children of the best node at depth d-1, d = 1..D: local probabilities p = exp(score - parent score)
    parent_best = best_node[:, :-1]  # [B, D]
    kids = valid[:, None, :] & (tree.parents[:, None, :] == parent_best[..., None])  # [B, D, M]
    local = jnp.where(kids, jnp.exp(jnp.minimum(score[:, None, :] - best[:, :-1, None], 0.0)), 0.0)
    local = jnp.where(has[:, :-1, None], local, 0.0)
    rest = jnp.clip(1.0 - local.sum(-1), 0.0, 1.0)
    xlogx = lambda p: jnp.where(p > 0, p * jnp.log(jnp.where(p > 0, p, 1.0)), 0.0)
    entropy = jnp.where(kids.any(-1) & has[:, :-1], -(xlogx(local).sum(-1) + xlogx(rest)), 0.0)

    node_mass = jnp.where(valid & (jnp.arange(M)[None] > 0), jnp.exp(jnp.minimum(score, 0.0)), 0.0)
    n_best = max(1, min(budget - 1, M - 1))
    path_mass = jax.lax.top_k(node_mass, n_best)[0].sum(-1)
    cols = [top1, entropy, path_mass[:, None], tau_ema_B[:, None].astype(jnp.float32),
            last_accepted_B[:, None].astype(jnp.float32), jnp.full((B, 1), float(B), jnp.float32)]
    return jnp.concatenate(cols, axis=1).astype(jnp.float32)


def extra_features(base_BxF, match_B, leaves_B, acc_ema_Bx2, last_action_B, active_B) -> jax.Array:
    """The second layout's columns after the first's (`tree_features`): the n-gram's match length (0 for
    a model drafter), the cheap tree's leaves (distinct matches of an n-gram trie), recent accepted
    tokens from cheap and from strong nodes, the last action (one-hot), the share of active rows."""
    B = base_BxF.shape[0]
    share = jnp.broadcast_to(jnp.mean(active_B.astype(jnp.float32)), (B, 1))
    cols = [base_BxF, match_B[:, None].astype(jnp.float32), leaves_B[:, None].astype(jnp.float32),
            acc_ema_Bx2.astype(jnp.float32), jax.nn.one_hot(last_action_B, len(ACTIONS), dtype=jnp.float32), share]
    return jnp.concatenate(cols, axis=1).astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    hidden: tuple[int, ...] = (32, 32)
    kind: str = "classification"  # output: logit of "invoking pays" | predicted value (normalised)
    feature_layout: str = FEATURE_LAYOUT
    feature_names: tuple[str, ...] = FEATURE_NAMES
    actions: tuple[str, ...] = ()  # one value per action (argmax); () = the first layout's one output

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"scheduler kind must be one of {KINDS}, got {self.kind!r}")
        if self.actions and (self.kind != "regression" or tuple(self.actions) != ACTIONS):
            raise ValueError(f"a scheduler over actions predicts one value per action {ACTIONS} (kind regression), got "
                             f"{self.actions} ({self.kind})")
        if not self.hidden or any(int(h) < 1 for h in self.hidden):
            raise ValueError(f"scheduler hidden sizes must be positive, got {self.hidden}")


class Stat(nnx.Variable):
    """Fitted, not trained: input normalisation and the decision threshold."""


class Dense(nnx.Module):
    def __init__(self, d_in: int, d_out: int, rng: np.random.Generator):
        # numpy init (LeCun normal): building a scheduler compiles nothing
        self.kernel = nnx.Param(jnp.asarray(rng.normal(0.0, 1.0 / np.sqrt(d_in), (d_in, d_out)), jnp.float32))
        self.bias = nnx.Param(jnp.zeros((d_out,), jnp.float32))

    def __call__(self, x):
        return x @ self.kernel[...] + self.bias[...]


class Scheduler(nnx.Module):
    """MLP: normalised features -> one output per row (invoke where output > threshold), or, with
    `config.actions`, one value per action (`values`; TreeGraft takes the argmax)."""

    def __init__(self, cfg: SchedulerConfig = SchedulerConfig(), seed: int = 0):
        F = len(cfg.feature_names)
        rng = np.random.default_rng(seed)
        self.config = cfg
        self.mean = Stat(jnp.zeros((F,), jnp.float32))
        self.scale = Stat(jnp.ones((F,), jnp.float32))
        self.threshold = Stat(jnp.zeros((), jnp.float32))
        dims = (F,) + tuple(int(h) for h in cfg.hidden) + (max(len(cfg.actions), 1),)
        self.layers = nnx.List([Dense(a, b, rng) for a, b in zip(dims[:-1], dims[1:])])

    def __call__(self, features_BxF) -> jax.Array:
        x = (features_BxF - self.mean[...]) / self.scale[...]
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = jax.nn.gelu(x)
        return x[..., 0]

    def values(self, features_BxF) -> jax.Array:
        """[B, A] predicted value of each action (a scheduler over actions)."""
        x = (features_BxF - self.mean[...]) / self.scale[...]
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = jax.nn.gelu(x)
        return x

    def decide(self, features_BxF) -> jax.Array:
        return self(features_BxF) > self.threshold[...]


def check_layout(layout: str, names, where: str) -> None:
    """Refuses a layout this specjax does not compute (the first layout's features are the second's
    first columns: its schedulers read those)."""
    if (layout, tuple(names)) not in ((FEATURE_LAYOUT, FEATURE_NAMES), (FEATURE_LAYOUT_V1, FEATURE_NAMES_V1)):
        raise ValueError(
            f"{where}: the scheduler was trained on feature layout {layout!r} ({len(names)} features) but this "
            f"specjax computes {FEATURE_LAYOUT!r} ({NUM_FEATURES} features: {', '.join(FEATURE_NAMES)}); "
            "its inputs would mean something else. Rebuild the value dataset and retrain it "
            "(python -m train.value_system, then python -m train.distill_scheduler).")


def save_scheduler(sched: Scheduler, path: str, *, calibration: float = 0.0, meta: dict | None = None) -> None:
    """`scheduler_config.json` (layout, names, architecture, threshold, calibration offset, meta) +
    `model.safetensors` (the MLP and the input normalisation)."""
    if not np.isfinite(calibration):
        raise ValueError(f"calibration must be finite, got {calibration}")
    os.makedirs(path, exist_ok=True)
    flat = nnx.to_flat_state(nnx.state(sched, (nnx.Param, Stat)))
    tensors = {".".join(map(str, k)): np.asarray(v.get_value()) for k, v in flat}
    cfg = sched.config
    with open(os.path.join(path, CONFIG_FILE), "w") as f:
        json.dump({"format": FORMAT, "feature_layout": cfg.feature_layout, "feature_names": list(cfg.feature_names),
                   "hidden": list(cfg.hidden), "kind": cfg.kind, "actions": list(cfg.actions), "threshold": float(sched.threshold[...]),
                   "calibration": float(calibration), "meta": meta or {}}, f, indent=2)
    save_file(tensors, os.path.join(path, WEIGHTS_FILE))


def load_scheduler(path: str) -> tuple[Scheduler, float, dict]:
    """(scheduler, calibration offset, meta). Refuses another feature layout with a clear error."""
    cfg_file = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(cfg_file):
        raise ValueError(f"{path}: not a TreeGraft scheduler directory (no {CONFIG_FILE})")
    try:
        raw = json.loads(open(cfg_file).read())
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_file}: not valid JSON ({e.msg})") from None
    if raw.get("format") != FORMAT:
        raise ValueError(f"{cfg_file}: not a TreeGraft scheduler (format {raw.get('format')!r})")
    check_layout(raw.get("feature_layout"), raw.get("feature_names", []), cfg_file)
    cfg = SchedulerConfig(hidden=tuple(raw["hidden"]), kind=raw["kind"], feature_layout=raw["feature_layout"],
                          feature_names=tuple(raw["feature_names"]), actions=tuple(raw.get("actions", ())))
    sched = Scheduler(cfg)
    file = os.path.join(path, WEIGHTS_FILE)
    try:
        tensors = load_file(file)
    except (SafetensorError, OSError, ValueError) as e:
        raise ValueError(f"{file}: unreadable safetensors file ({e})") from None
    flat = dict(nnx.to_flat_state(nnx.state(sched, (nnx.Param, Stat))))
    for key, var in flat.items():
        name = ".".join(map(str, key))
        if name not in tensors or tuple(tensors[name].shape) != tuple(var.get_value().shape):
            raise ValueError(f"{file}: tensor {name!r} missing or of the wrong shape")
        var.set_value(jnp.asarray(tensors[name], jnp.float32))
    nnx.update(sched, nnx.from_flat_state(flat))
    sched.threshold.set_value(jnp.float32(raw.get("threshold", 0.0)))
    return sched, float(raw.get("calibration", 0.0)), raw.get("meta", {})


# ----------------------------------------------------------------------------- cost

def time_call(fn, *args, repeats: int = 20) -> float:
    """Median seconds of a jitted call (compiled first, outside the timing)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def measure_cost(sched: Scheduler, batch: int, tree_nodes: int, budget: int, repeats: int = 50) -> float:
    """Median seconds of one scheduler decision (features of a [batch, tree_nodes] tree + MLP),
    jitted alone. Compare with a drafter step (tools/bench_treegraft.py reports the ratio); inside
    the engine loop it fuses with the round, so this is an upper bound."""
    rng = np.random.default_rng(0)
    parents = np.concatenate([[-1], rng.integers(0, np.arange(1, tree_nodes))]).astype(np.int32)
    depth = np.zeros(tree_nodes, np.int32)
    for i in range(1, tree_nodes):
        depth[i] = depth[parents[i]] + 1
    score = -np.cumsum(rng.random(tree_nodes)).astype(np.float32)
    score[0] = 0.0
    bc = lambda x: jnp.broadcast_to(jnp.asarray(x), (batch, tree_nodes))
    tree = TreeBuffers(tokens=bc(np.arange(tree_nodes, dtype=np.int32)), parents=bc(parents), depth=bc(depth),
                       valid=bc(np.ones(tree_nodes, bool)), score=bc(score), source=bc(np.zeros(tree_nodes, np.int8)))
    graphdef, state = nnx.split(sched)

    @jax.jit
    def decide(state, tree, tau, last):
        s = nnx.merge(graphdef, state)
        f = tree_features(tree, budget, tau, last)
        if len(s.config.feature_names) > f.shape[1]:
            z = jnp.zeros((batch,), jnp.int32)
            f = extra_features(f, z, z, jnp.zeros((batch, 2)), z, jnp.ones((batch,), bool))
        return s.values(f) if s.config.actions else s.decide(f)

    return time_call(decide, state, tree, jnp.ones((batch,)), jnp.zeros((batch,), jnp.int32), repeats=repeats)
