"""Block drafter checkpoints: `drafter_config.json` + `model.safetensors` (own parameters only,
bf16 by default); a TreeFlash head may be stored on a backbone directory it refers to."""
from __future__ import annotations

import dataclasses
import os

import jax.numpy as jnp
from flax import nnx

from specjax.io.checkpoint import weights_sha256
from specjax.drafters import heads
from specjax.drafters import vocab as vocab_lib
from specjax.drafters.block.config import BlockConfig
from specjax.drafters.block.network import BlockHead


def save_block_head(head: BlockHead, path: str, dtype=jnp.bfloat16, backbone: str | None = None) -> None:
    """`drafter_config.json` + `model.safetensors` (own parameters only, bf16 by default).
    `backbone`: a block drafter directory holding every parameter of this head but its TreeFlash
    head (trained on that frozen backbone): only the TreeFlash head is written, and the config
    names the backbone (relative path) and pins its weights' digest."""
    if backbone is None:
        heads.save_head(head, path, "block", dtype)
        return
    if head.ar_head is None:
        raise ValueError("a backbone reference stores a TreeFlash head only: this head has none")
    check_backbone(head.config, read_config(backbone), backbone)
    heads.save_head(head, path, "block", dtype, only=("ar_head",),
                    extra={"backbone": os.path.relpath(os.path.abspath(backbone), os.path.abspath(path)),
                           "backbone_sha256": weights_sha256(backbone)})


def check_backbone(cfg: BlockConfig, backbone_cfg: BlockConfig, where: str) -> None:
    """ValueError unless `backbone_cfg` is `cfg` without its TreeFlash head."""
    if dataclasses.replace(cfg, ar_intermediate=0) != backbone_cfg:
        raise ValueError(f"backbone {where}: its block drafter config differs from this TreeFlash head's backbone")


def backbone_dir(path: str) -> str | None:
    """The backbone directory a TreeFlash head's checkpoint refers to (None: it holds every parameter)."""
    raw = heads.read_config(path, "block")
    return None if raw.get("backbone") is None else os.path.normpath(os.path.join(path, raw["backbone"]))


def read_config(path: str) -> BlockConfig:
    raw = heads.read_config(path, "block")
    raw.pop("backbone", None)
    raw.pop("backbone_sha256", None)
    raw["target_layers"] = tuple(raw["target_layers"])
    for key in ("state_layers", "state_shape"):
        if raw.get(key) is not None:
            raw[key] = tuple(raw[key])
    if raw.get("confidence_temperatures") is not None:
        raw["confidence_temperatures"] = tuple(raw["confidence_temperatures"])
    try:
        return BlockConfig(**raw)
    except TypeError as e:
        raise ValueError(f"{os.path.join(path, heads.CONFIG_FILE)}: {e}") from None


def load_block_head(path: str, dtype=jnp.float32) -> BlockHead:
    """A block drafter head; a TreeFlash head stored on a backbone (`save_block_head(backbone=)`)
    reads the backbone's parameters from there, refused when its weights' digest moved. A draft
    vocabulary's ids are the first N of the directory's token ranking."""
    cfg = read_config(path)
    ids = vocab_lib.draft_ids(path, cfg.vocab_size, cfg.draft_vocab) if cfg.draft_vocab else None
    bdir = backbone_dir(path)
    also = ()
    if bdir is not None:
        if not os.path.isdir(bdir):
            raise ValueError(f"{path}: its backbone {bdir} is missing (a TreeFlash head stores its own parameters only)")
        check_backbone(cfg, read_config(bdir), bdir)
        pinned = heads.read_config(path, "block")["backbone_sha256"]
        if weights_sha256(bdir) != pinned:
            raise ValueError(f"{path}: its backbone {bdir} holds other weights than it was trained on "
                             f"({pinned[:12]}…): retrain the TreeFlash head (python -m train.block)")
        also = (bdir,)
    head = heads.load_params(nnx.eval_shape(lambda: BlockHead(cfg, nnx.Rngs(0), dtype, ids)), path, dtype, also=also)
    if ids is not None:  # constants: made concrete again (eval_shape left them abstract)
        head.set_draft_vocab(ids)
    return head
