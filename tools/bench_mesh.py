"""Cost of the sharded program per configuration (design §10): one device vs meshes (8,1), (2,4),
(1,8) of simulated CPU devices, for generation (autoregressive and speculative, the zoo's targets)
and for the LM trainer's step.

    python -m tools.bench_mesh [--devices 8] [--meshes 8x1,2x4,1x8] [--new-tokens 32] [--repeats 3] \
        [--out bench/bench_mesh]

**Not a speed claim.** The simulated devices are threads of one CPU sharing its cores: a mesh here
pays the partitioned program's collectives and its smaller, less efficient kernels, and gains
nothing. The table tells what the sharding costs in overhead on one host and that every
configuration compiles once and gives the same tokens; speed on real accelerators is measured there
(`tools/bench_gpu.sh` on a lent GPU). The device count is set before jax is imported (`tools.harness`
imports it only when called). Writes <out>.md and .json (`tools.harness.write_outputs`: "rows" the
generation rows, "train" the trainer's).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from tools.harness import REPO, Column, run_meta, write_outputs


def _set_devices(n: int) -> None:
    if "jax" in sys.modules:
        raise RuntimeError("the device count must be set before jax is imported")
    flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f)
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m tools.bench_mesh",
                                 description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--meshes", default="8x1,2x4,1x8", help="DATAxMODEL,... (each a product of --devices)")
    ap.add_argument("--target", action="append", default=None, metavar="NAME=DIR[,DRAFTER_DIR...]",
                    help="default: dense=models/code-target with code-draft and code-target-feature, "
                         "hybrid=models/code-target-hybrid with code-target-hybrid-feature")
    ap.add_argument("--prompts", type=int, default=8, help="test-split code prompts: the batch (divisible by every data axis)")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--train-config", default="configs/code-draft.json", help="the LM trainer's step: this config's model")
    ap.add_argument("--train-steps", type=int, default=5)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "bench_mesh")
    args = ap.parse_args(argv)
    _set_devices(args.devices)

    import jax.numpy as jnp
    import numpy as np

    import specjax
    from specjax.models import sharding
    from specjax.io.checkpoint import load_tokenizer
    from specjax.drafters import load_drafter
    from train import lm, prompts as prompt_sets

    meshes = [None] + [tuple(int(x) for x in m.split("x")) for m in args.meshes.split(",")]
    label = lambda m: "one device" if m is None else f"({m[0]},{m[1]})"
    targets = args.target or ["dense=models/code-target,models/code-draft,models/code-target-feature",
                              "hybrid=models/code-target-hybrid,models/code-target-hybrid-feature"]
    rows = []
    for spec in targets:
        tname, dirs = spec.split("=", 1)
        tdir, *ddirs = [str(REPO / d) if not os.path.isabs(d) else d for d in dirs.split(",")]
        target = specjax.load_model(tdir)
        tok = load_tokenizer(tdir)
        prompts = [p["ids"] for p in prompt_sets.prompt_set("functions", tok, args.prompts, context_tokens=128)]
        methods = [("ar", None)] + [(Path(d).name, load_drafter(d, target, target_path=tdir, tuned=False)) for d in ddirs]
        for mname, drafter in methods:
            ref = None
            for m in meshes:
                mesh = None if m is None else sharding.make_mesh(*m)
                kw = dict(max_new_tokens=args.new_tokens, mesh=mesh)
                if drafter is not None:
                    kw["drafters"] = [drafter]
                before = specjax.engine.loop.trace_count()
                t0 = time.perf_counter()
                out = specjax.generate(target, prompts, **kw)
                first_s = time.perf_counter() - t0
                times = []
                for _ in range(args.repeats):
                    t0 = time.perf_counter()
                    out = specjax.generate(target, prompts, **kw)
                    times.append(time.perf_counter() - t0)
                tokens = int(out.lengths.sum())
                ref = out.sequences() if ref is None else ref
                row = {"target": tname, "method": mname, "mesh": label(m), "compile_and_first_s": round(first_s, 2),
                       "median_s": float(np.median(times)), "tokens_per_s": tokens / float(np.median(times)),
                       "traces": specjax.engine.loop.trace_count() - before, "same_tokens": out.sequences() == ref}
                if drafter is not None:
                    row["tau"] = float(np.mean(out.stats["tau"]))
                rows.append(row)
                print(json.dumps(row), flush=True)

    # The LM trainer's step on random tokens (compile excluded), per mesh.
    cfg = lm.load_config(REPO / args.train_config)
    _, _, train_step, _ = lm._step_fns(cfg)
    p = cfg.phases[0]
    micro = p.micro_batch_size or cfg.batch_size
    rng = np.random.default_rng(0)
    train_rows = []
    for m in meshes:
        mesh = None if m is None else sharding.make_mesh(*m)
        with sharding.mesh_context(mesh):
            state = sharding.place_params(lm.init_state(cfg), lm.family_rules(cfg.model), mesh)
            times = []
            for i in range(args.train_steps + 1):
                batch = rng.integers(3, cfg.model.vocab_size, (cfg.batch_size // micro, micro, p.seq_len + 1)).astype(np.int32)
                batch = jnp.asarray(batch) if mesh is None else sharding.place(batch, lm.BATCH_AxMxT1, mesh)
                t0 = time.perf_counter()
                state, metrics = train_step(state, batch)
                float(metrics["loss"])
                times.append(time.perf_counter() - t0)
        row = {"config": args.train_config, "mesh": label(m), "compile_and_first_s": round(times[0], 2),
               "step_s_median": float(np.median(times[1:])), "seq_len": p.seq_len, "batch_size": cfg.batch_size}
        train_rows.append(row)
        print(json.dumps(row), flush=True)

    meta = run_meta("bench_mesh", argv, devices=args.devices, new_tokens=args.new_tokens, prompts=args.prompts,
                    repeats=args.repeats)
    intro = ["**Not a speed claim**: the simulated devices share one CPU's cores; a mesh here adds collectives and "
             "smaller kernels and gains nothing. What the table shows: each configuration compiles once (traces), "
             "gives one device's tokens, and what the partitioned program costs in overhead on one host.", "",
             f"{args.devices} simulated CPU devices; float32; batch {args.prompts} code prompts (test split), "
             f"{args.new_tokens} new tokens, median of {args.repeats} runs after a first (compiling) one."]
    base = {(r["target"], r["method"]): r["tokens_per_s"] for r in rows if r["mesh"] == "one device"}
    columns = [Column("target", "target", right=False), Column("method", "method", right=False),
               Column("mesh", "mesh", right=False), Column("tokens/s", "tokens_per_s", "{:.1f}"),
               Column("vs one device", lambda r: f"{r['tokens_per_s'] / base[(r['target'], r['method'])]:.2f}x"),
               Column("tau", "tau", "{:.2f}"), Column("compile + first run s", "compile_and_first_s"),
               Column("traces", "traces"), Column("same tokens", lambda r: "yes" if r["same_tokens"] else "NO",
                                                  right=False)]
    one = train_rows[0]["step_s_median"]
    notes = [f"LM trainer step (`{args.train_config}`: batch {train_rows[0]['batch_size']} x seq "
             f"{train_rows[0]['seq_len']}, random tokens, median of {args.train_steps} steps after the compiling one):", "",
             "| mesh | step s | vs one device | compile + first step s |", "|---|---:|---:|---:|"]
    for r in train_rows:
        notes.append(f"| {r['mesh']} | {r['step_s_median']:.3f} | {r['step_s_median'] / one:.2f}x | {r['compile_and_first_s']} |")
    write_outputs(args.out, meta, rows, columns, title=f"Sharded generation and training on {args.devices} simulated "
                  "CPU devices", intro=intro, notes=notes, extra={"train": train_rows})

if __name__ == "__main__":
    main()
