"""Drafter trainer throughput, online (the target runs every step) against offline (the step reads the
target cache, `train.target_cache`), same config, same CPU, one process: target positions per second
of train steps after warm-up, and the cache's one-off build rate from its manifest.

    python -m tools.bench_trainer --config configs/code-target-dspark.json \\
        --cache runs/cache/code-target-corpus-small --steps 8 --out bench/bench_trainer_dspark
"""
from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from tools.harness import Column, run_meta, write_outputs
from train import block, data, target_cache
from train.lm import load_streams_for
from train.common import resolve
from specjax.io.checkpoint import load_tokenizer


def time_steps(cfg, cache, steps: int, warmup: int) -> dict:
    target_dir = str(resolve(cfg.target))
    _, hcfg, _, train_step, _, init = block._fns(cfg, target_dir)
    state = init()
    streams = None if cache is not None else load_streams_for(load_tokenizer(target_dir), cfg.manifest, cfg.corpus_root,
                                                              cfg.max_files, None)
    times = []
    for step in range(warmup + steps):
        if cache is None:
            batch, cached = data.batch_at(streams.train, cfg.seq_len - 1, cfg.batch_size, cfg.seed, 0, step), None
        else:
            got = cache.batch_at(step, cfg.batch_size, cfg.seed)
            batch = got.pop("tokens")
            cached = {k: jnp.asarray(v) for k, v in got.items() if v is not None}
        t0 = time.perf_counter()
        state, m = train_step(state, jnp.asarray(batch), cached)
        jax.block_until_ready(m["loss"])
        if step >= warmup:
            times.append(time.perf_counter() - t0)
    step_s = float(np.median(times))
    return {"step_s": round(step_s, 3), "positions_per_s": round(cfg.batch_size * cfg.seq_len / step_s, 1),
            "loss": round(float(m["loss"]), 4)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 prog="python -m tools.bench_trainer")
    ap.add_argument("--config", required=True, help="a train.block config")
    ap.add_argument("--cache", required=True, help="a built target cache of the config's target layers")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    cfg = block.load_config(args.config)
    cache = target_cache.TargetCache(resolve(args.cache), str(resolve(cfg.target)))
    m = cache.manifest
    rows = []
    for mode in ("online", "offline"):
        got = time_steps(dataclasses.replace(cfg, cache=str(args.cache) if mode == "offline" else None),
                         cache if mode == "offline" else None, args.steps, args.warmup)
        rows.append({"mode": mode, "batch": cfg.batch_size, "seq_len": cfg.seq_len, **got})
    rows[1]["speedup"] = round(rows[1]["positions_per_s"] / rows[0]["positions_per_s"], 2)
    rows[0]["speedup"] = 1.0
    build = m["windows"] * m["seq_len"] / max(m["seconds"], 1e-9)
    meta = run_meta("bench_trainer", argv, config=args.config, cache=args.cache, steps=args.steps, warmup=args.warmup)
    write_outputs(args.out, meta, rows, [Column("mode", "mode", right=False), Column("batch", "batch"),
                                         Column("seq_len", "seq_len"), Column("step s (median)", "step_s"),
                                         Column("positions / s", "positions_per_s"), Column("× online", "speedup")],
                  title=f"Drafter trainer throughput: online vs the target cache ({cfg.name})",
                  intro=[f"Train steps of `{args.config}` after {args.warmup} warm-up steps, median of {args.steps}; "
                         f"offline steps read `{args.cache}` ({m['windows']} windows x {m['seq_len']} tokens, "
                         f"top-{m['topk']}, layers {m['layers']}), built once at {build:.0f} target positions/s."],
                  extra={"cache_build_positions_per_s": round(build, 1)})
    print("\n".join(f"{r['mode']}: {r['positions_per_s']} positions/s" for r in rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
