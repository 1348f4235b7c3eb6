"""Checkpoints of trained drafter heads (feature, block): a directory with `drafter_config.json`
(`{"drafter": kind, ...the head's config}`) and `model.safetensors` (the head's own parameters,
named by their NNX path; the target's embedding and LM head are never stored)."""
from __future__ import annotations

import dataclasses
import json
import os

import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file

from specjax.drafters.base import Drafter

CONFIG_FILE = "drafter_config.json"
WEIGHTS_FILE = "model.safetensors"


def save_head(head: nnx.Module, path: str, kind: str, dtype=None, only: tuple[str, ...] | None = None,
              extra: dict | None = None) -> None:
    """Writes `head.config` (and `extra` keys) and its parameters (cast to `dtype` when given, e.g.
    bf16; `only`: the parameters under these top-level names)."""
    os.makedirs(path, exist_ok=True)
    flat = nnx.to_flat_state(nnx.state(head, nnx.Param))
    cast = (lambda x: x) if dtype is None else (lambda x: jnp.asarray(x, dtype))
    tensors = {".".join(map(str, k)): np.asarray(cast(v.get_value())) for k, v in flat
               if only is None or str(k[0]) in only}
    with open(os.path.join(path, CONFIG_FILE), "w") as f:
        json.dump({"drafter": kind, **dataclasses.asdict(head.config), **(extra or {})}, f, indent=2)
    save_file(tensors, os.path.join(path, WEIGHTS_FILE))


def read_config(path: str, kind: str) -> dict:
    """The stored config (without the kind); FileNotFoundError / ValueError for another directory."""
    cfg_file = os.path.join(path, CONFIG_FILE)
    if not os.path.exists(cfg_file):
        raise FileNotFoundError(f"{cfg_file}: not a {kind}-drafter directory")
    with open(cfg_file) as f:
        raw = json.load(f)
    if raw.pop("drafter", None) != kind:
        raise ValueError(f"{cfg_file}: not a {kind} drafter")
    return raw


def load_params(head: nnx.Module, path: str, dtype, also: tuple[str, ...] = ()) -> nnx.Module:
    """Fills an (abstract) head with the stored parameters, checking names and shapes (`also`:
    further directories whose tensors fill what `path` does not hold, e.g. a TreeFlash head's backbone)."""
    file = os.path.join(path, WEIGHTS_FILE)
    tensors = {}
    for d in also + (path,):
        f = os.path.join(d, WEIGHTS_FILE)
        try:
            tensors.update(load_file(f))
        except (SafetensorError, OSError, ValueError) as e:
            raise ValueError(f"{f}: corrupt safetensors file ({e})") from None
    flat = dict(nnx.to_flat_state(nnx.state(head, nnx.Param)))
    for key, var in flat.items():
        name = ".".join(map(str, key))
        if name not in tensors:
            raise ValueError(f"{file}: missing tensor {name!r}")
        if tuple(tensors[name].shape) != tuple(var.get_value().shape):
            raise ValueError(f"{file}: tensor {name!r} has shape {tensors[name].shape}, expected {var.get_value().shape}")
        var.set_value(jnp.asarray(tensors[name].astype("float32"), dtype))
    nnx.update(head, nnx.from_flat_state(flat))
    return head


class HeadDrafter(Drafter):
    """A drafter made of a trained head (`self.head`, whose config has `vocab_size`, `hidden_size`,
    `target_layers`) on a target whose embedding and LM head it borrows: feature, block and MTP drafters."""
    OWN = ("head",)

    @staticmethod
    def check_target(cfg, target, kind: str) -> None:
        """ValueError when the head was built for another vocabulary, width or depth than `target`'s."""
        if cfg.vocab_size != target.config.vocab_size or cfg.hidden_size != target.config.hidden_size:
            raise ValueError(f"{kind} drafter was built for vocab {cfg.vocab_size} / width {cfg.hidden_size}, the "
                             f"target has {target.config.vocab_size} / {target.config.hidden_size}")
        if max(cfg.target_layers) >= target.config.num_layers:
            raise ValueError(f"{kind} drafter reads target layers {cfg.target_layers} but the target has "
                             f"{target.config.num_layers}")

    @property
    def vocab_size(self) -> int:
        return self.head.config.vocab_size

    @property
    def dtype(self):
        """The head's activation dtype: its final norm's (the projections may be stored narrower,
        `with_weights`)."""
        return self.head.norm.weight.dtype

    @property
    def target_layers(self) -> tuple[int, ...]:
        return self.head.config.target_layers
