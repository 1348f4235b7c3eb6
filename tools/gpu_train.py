"""The GPU training path (issue 43): on one accelerator, build the offline target cache and train block
drafters on it, then write their exports to a folder. It runs anywhere JAX runs (the test runs it on
CPU at a tiny size); on an NVIDIA GPU it is the run that fits a lent machine's minutes.

From a slim tree (`python -m tools.slim_tree on --model models/code-target`, which also writes the
corpus as tokens to .slim/corpus-tokens.npz), on the device, carrying .slim:

    python -m tools.gpu_train --target models/code-target --tokens .slim/corpus-tokens.npz \\
        --config configs/code-target-dspark.json --windows 8192 --steps 3000 --batch-size 32 --out $OUT/drafters

Each config is a `train.block` config; the run overrides its corpus (`manifest`: the tokens), cache,
steps and batch size, and records the device in `gpu_train.json` beside the exports.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import time
from pathlib import Path

import jax

from specjax.io.checkpoint import load_model, load_tokenizer
from train import block, target_cache
from train.lm import load_streams_for
from train.common import resolve


def run(target: str, tokens: str, configs: list[str], out: str, *, windows: int | None, steps: int, batch_size: int,
        seq_len: int | None = None, topk: int = 32, progress: bool = True) -> dict:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    target_dir = str(resolve(target))
    streams = load_streams_for(load_tokenizer(target_dir), tokens, None, None, None)
    cfgs = [block.load_config(c) for c in configs]
    layers = {tuple(block.head_config(c, load_model(target_dir)).target_layers) for c in cfgs}
    if len(layers) != 1:
        raise ValueError(f"the configs read different target layers {sorted(layers)}: one cache serves one set")
    seq_len = seq_len or cfgs[0].seq_len
    record = {"device": str(jax.devices()[0]), "platform": jax.devices()[0].platform, "host": platform.node(),
              "target": target, "tokens": tokens, "drafters": []}
    t0 = time.perf_counter()
    cache_dir = out / "cache"
    m = target_cache.build(target_dir, streams.train, cache_dir, layers=layers.pop(), topk=topk, seq_len=seq_len,
                           max_windows=windows, batch=max(batch_size, 8), shard_windows=max(batch_size, 64),
                           progress=progress)
    record["cache"] = {"windows": m["windows"], "positions": m["windows"] * seq_len, "seconds": m["seconds"]}
    for cfg in cfgs:
        cfg = dataclasses.replace(cfg, manifest=str(tokens), cache=str(cache_dir), steps=steps, batch_size=batch_size,
                                  seq_len=seq_len, checkpoint_every=max(steps // 4, 1), eval_every=steps)
        t1 = time.perf_counter()
        block.train(cfg, out / "runs" / cfg.name, out / cfg.name, progress=progress, overwrite=True)
        record["drafters"].append({"name": cfg.name, "steps": steps, "batch_size": batch_size,
                                   "positions": steps * batch_size * seq_len,
                                   "seconds": round(time.perf_counter() - t1, 1)})
    record["seconds"] = round(time.perf_counter() - t0, 1)
    (out / "gpu_train.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--tokens", required=True, help="the corpus as tokens (python -m tools.slim_tree on)")
    ap.add_argument("--config", action="append", required=True, help="a train.block config (repeat)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--windows", type=int, default=None, help="cache at most this many windows")
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--topk", type=int, default=32)
    args = ap.parse_args(argv)
    rec = run(args.target, args.tokens, args.config, args.out, windows=args.windows, steps=args.steps,
              batch_size=args.batch_size, seq_len=args.seq_len, topk=args.topk)
    print(json.dumps(rec, indent=1))


if __name__ == "__main__":
    main()
