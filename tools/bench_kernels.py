"""Tree-attention kernel speed: the Pallas kernel against the jnp reference (the model's own
`attend` over `kvcache.visible_mask`) and `jax.nn.dot_product_attention`, over tree sizes and
context lengths; and the FOLD far-attention kernel against its reference.

    python -m tools.bench_kernels                  # on an NVIDIA GPU: trees 16-128 x contexts 1k-32k
    python -m tools.bench_kernels --quick          # a short subset (a first look on a GPU)
    python -m tools.bench_kernels --peak-gbps 900  # a GPU whose peak bandwidth is not in the table

Per configuration (B rows, T tree nodes, each row with `context` committed tokens and the T tree
nodes in scratch slots, GQA with H query / K kv heads, head dim D): median time of one call
(async dispatch of `--repeats` calls after a warm-up, then one wait), and the achieved memory
bandwidth: the bytes an ideal kernel must move (the visible K/V of every row, the queries and the
outputs) / time, with its fraction of the device's peak (known for H100 / H200 / A100 from
`device_kind`, else `--peak-gbps`). The kernel's largest deviation from the reference is shown too,
so a GPU run doubles as a correctness check; a float32 exactness check runs first.

On CPU the Pallas kernel only runs in interpret mode, which says nothing about speed: the tool times
the two reference paths (smaller defaults), and `--interpret` adds the interpret-mode kernel.
Writes the tables to stdout and `<out>.md`, raw numbers to `<out>.json` (default bench/bench_kernels;
`tools.harness.write_outputs`: one row per configuration and implementation, its "table" tree or far).
"""
from __future__ import annotations

import argparse
import functools
import os
import platform
import statistics
import time

import numpy as np

from tools.harness import REPO, run_meta, write_outputs

ROOT = str(REPO)

# Peak HBM bandwidth in GB/s, by substrings of jax's device_kind (first match wins).
PEAK_GBPS = [
    ("h200", 4800.0),
    ("h100 pcie", 2000.0),
    ("h100 nvl", 3900.0),
    ("h100", 3350.0),  # SXM5, "NVIDIA H100 80GB HBM3"
    ("gh200", 4000.0),
    ("a100-sxm4-80gb", 2039.0),
    ("a100 80gb pcie", 1935.0),
    ("a100-pcie-80gb", 1935.0),
    ("a100", 1555.0),  # 40 GB variants
]


def peak_gbps(device_kind: str) -> float | None:
    kind = device_kind.lower()
    for key, gbps in PEAK_GBPS:
        if key in kind:
            return gbps
    return None


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m tools.bench_kernels",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--trees", default=None, help="tree sizes T, comma-separated (GPU default 16,32,64,128; CPU 16,64)")
    p.add_argument("--contexts", default=None,
                   help="committed tokens per row (GPU default 1024,4096,16384,32768; CPU 256,1024,4096)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=None, help="query heads H (GPU default 32; CPU 8)")
    p.add_argument("--kv-heads", type=int, default=None, help="kv heads K (GPU default 8; CPU 2)")
    p.add_argument("--head-dim", type=int, default=None, help="D (GPU default 128; CPU 64)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default=None, help="GPU default bfloat16; CPU float32")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--peak-gbps", type=float, default=None, help="peak memory bandwidth (overrides the table)")
    p.add_argument("--quick", action="store_true", help="trees 16,128 x contexts 1024,32768 (GPU) / 256,1024 (CPU)")
    p.add_argument("--interpret", action="store_true", help="on CPU, also time the interpret-mode kernel")
    p.add_argument("--no-far", action="store_true", help="skip the far-attention table")
    p.add_argument("--no-dpa", action="store_true", help="skip jax.nn.dot_product_attention")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "bench_kernels"))
    return p.parse_args(argv)


def _ints(s):
    return [int(x) for x in s.split(",") if x]


def _time(fn, args, repeats):
    import jax
    jax.block_until_ready(fn(*args))  # compile + warm-up
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(3):
        t = time.perf_counter()
        out = None
        for _ in range(repeats):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t) / repeats)
    return statistics.median(times)


def _random_tree_mask(rng, B, T):
    parents = np.full((B, T), -1)
    for i in range(1, T):
        parents[:, i] = rng.integers(max(0, i - 4), i, B)  # a bushy tree of moderate depth
    mask = np.zeros((B, T, T), bool)
    for b in range(B):
        for i in range(T):
            j = i
            while j >= 0:
                mask[b, i, j] = True
                j = parents[b, j]
    return mask


def exactness_check(impl):
    """Float32: the kernel equals the reference to 1e-5 on a small ragged case (with splits)."""
    import jax
    import jax.numpy as jnp
    from pallas_kernels import ops
    rng = np.random.default_rng(0)
    B, T, H, K, D, C = 3, 24, 8, 2, 128, 1000
    q = jnp.asarray(rng.standard_normal((B, T, H, D)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((B, C, K, D)), jnp.float32) for _ in range(2))
    lengths = jnp.asarray([0, 517, C - T - 3], jnp.int32)
    bits = ops.pack_mask(jnp.asarray(_random_tree_mask(rng, B, T)))
    errs = {}
    for splits in (1, 4):
        got, lse = jax.jit(functools.partial(ops.tree_attention, impl=impl, num_splits=splits, return_lse=True))(
            q, k, v, lengths, bits)
        ref, ref_lse = ops.tree_attention(q, k, v, lengths, bits, impl="reference", return_lse=True)
        errs[f"tree, splits={splits}"] = (float(jnp.max(jnp.abs(got - ref)) / (jnp.max(jnp.abs(ref)) + 1e-30)),
                                          bool(np.allclose(got, ref, rtol=1e-5, atol=1e-5)))
    N = 700
    kp = jnp.asarray(rng.integers(0, 900, (B, N)), jnp.int32)
    seg = jnp.asarray(rng.integers(-1, 3, (B, N)), jnp.int32)
    qp = jnp.asarray(rng.integers(500, 900, (B, T)), jnp.int32)
    kk, vv = (jnp.asarray(rng.standard_normal((B, N, K, D)), jnp.float32) for _ in range(2))
    got = jax.jit(functools.partial(ops.far_attention, impl=impl))(q, kk, vv, qp, kp, seg, 1.7)
    ref = ops.far_attention(q, kk, vv, qp, kp, seg, 1.7, impl="reference")
    errs["far"] = (float(jnp.max(jnp.abs(got - ref)) / (jnp.max(jnp.abs(ref)) + 1e-30)),
                   bool(np.allclose(got, ref, rtol=1e-5, atol=1e-5)))
    return errs


def bench_tree(args, gpu, kernel_impl, peak):
    import jax
    import jax.numpy as jnp
    from pallas_kernels import ops
    from specjax.models import kvcache
    from specjax.models import transformer

    dtype = jnp.dtype(args.dtype)
    B, H, K, D = args.batch, args.heads, args.kv_heads, args.head_dim
    rng = np.random.default_rng(0)
    rows = []
    for ctx in args.contexts:
        C = ctx + max(args.trees)
        k = jnp.asarray(rng.standard_normal((1, B, C, K, D)), dtype)
        v = jnp.asarray(rng.standard_normal((1, B, C, K, D)), dtype)
        lengths = jnp.full((B,), ctx, jnp.int32)
        for T in args.trees:
            q = jnp.asarray(rng.standard_normal((B, T, H, D)), dtype)
            mask = jnp.asarray(_random_tree_mask(rng, B, T))
            bits = ops.pack_mask(mask)

            def reference(q, k, v, lengths, mask):  # the model's jnp path
                cache = kvcache.KVCache(k=k, v=v, length=lengths)
                return transformer.attend(q, k[0], v[0], kvcache.visible_mask(cache, mask))

            def dpa(q, k, v, lengths, mask):
                cache = kvcache.KVCache(k=k, v=v, length=lengths)
                vis = kvcache.visible_mask(cache, mask)[:, None]  # [B, 1, T, C]
                return jax.nn.dot_product_attention(q, k[0], v[0], mask=vis)

            def kernel(q, k, v, lengths, bits):
                return ops.tree_attention(q, k, v, lengths, bits, layer=0, impl=kernel_impl)

            fns = {"reference (jnp)": (jax.jit(reference), (q, k, v, lengths, mask))}
            if not args.no_dpa:
                fns["jax.nn.dot_product_attention"] = (jax.jit(dpa), (q, k, v, lengths, mask))
            if kernel_impl is not None:
                fns[f"pallas ({kernel_impl})"] = (jax.jit(kernel), (q, k, v, lengths, bits))
            nbytes = (2 * B * (ctx + T) * K * D + 2 * B * T * H * D) * dtype.itemsize + bits.size * 4
            ref_out = None
            for name, (fn, fargs) in fns.items():
                try:
                    secs = _time(fn, fargs, args.repeats)
                    out = fn(*fargs)
                except Exception as e:  # e.g. an implementation that refuses a mask
                    rows.append(dict(T=T, context=ctx, impl=name, error=f"{type(e).__name__}: {str(e)[:120]}"))
                    continue
                if ref_out is None:
                    ref_out = np.asarray(out.astype(jnp.float32))
                err = float(np.max(np.abs(np.asarray(out.astype(jnp.float32)) - ref_out)))
                gbps = nbytes / secs / 1e9
                rows.append(dict(T=T, context=ctx, impl=name, ms=secs * 1e3, gbps=gbps,
                                 peak_frac=None if peak is None else gbps / peak, max_abs_err=err))
                print(f"  T={T:4d} ctx={ctx:6d} {name:30s} {secs * 1e3:9.3f} ms {gbps:8.1f} GB/s  err {err:.2e}",
                      flush=True)
    return rows


def bench_far(args, gpu, kernel_impl, peak):
    import jax
    import jax.numpy as jnp
    from pallas_kernels import ops

    dtype = jnp.dtype(args.dtype)
    B, H, K, D = args.batch, args.heads, args.kv_heads, args.head_dim
    T = 8  # a drafter's query block
    rng = np.random.default_rng(1)
    rows = []
    for N in args.contexts:
        q = jnp.asarray(rng.standard_normal((B, T, H, D)), dtype)
        k = jnp.asarray(rng.standard_normal((B, N, K, D)), dtype)
        v = jnp.asarray(rng.standard_normal((B, N, K, D)), dtype)
        window = min(512, N // 4)
        seg = np.full((B, N), ops.SEG_FAR)
        seg[:, :4] = ops.SEG_SINK
        seg[:, N - window:] = ops.SEG_LOCAL
        k_pos = np.where(seg == ops.SEG_FAR, N - 2 * window, np.arange(N)[None])
        q_pos = np.arange(N - T, N)[None].repeat(B, 0)
        beta = ops.fold_beta(int((seg[0] == ops.SEG_FAR).sum()), window, 0.3)
        fargs = (q, k, v, jnp.asarray(q_pos, jnp.int32), jnp.asarray(k_pos, jnp.int32), jnp.asarray(seg, jnp.int32), beta)
        fns = {"reference (jnp)": jax.jit(functools.partial(ops.far_attention, impl="reference"))}
        if kernel_impl is not None:
            fns[f"pallas ({kernel_impl})"] = jax.jit(functools.partial(ops.far_attention, impl=kernel_impl))
        nbytes = (2 * B * N * K * D + 2 * B * T * H * D) * dtype.itemsize + 8 * B * N
        ref_out = None
        for name, fn in fns.items():
            secs = _time(fn, fargs, args.repeats)
            out = np.asarray(fn(*fargs).astype(jnp.float32))
            ref_out = out if ref_out is None else ref_out
            err = float(np.max(np.abs(out - ref_out)))
            gbps = nbytes / secs / 1e9
            rows.append(dict(T=T, context=N, impl=name, ms=secs * 1e3, gbps=gbps,
                             peak_frac=None if peak is None else gbps / peak, max_abs_err=err))
            print(f"  far N={N:6d} {name:30s} {secs * 1e3:9.3f} ms {gbps:8.1f} GB/s  err {err:.2e}", flush=True)
    return rows


def _table(rows, key_cols):
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    has_peak = any(r.get("peak_frac") is not None for r in rows)
    has_kernel = any(i.startswith("pallas") for i in impls)
    unit = "ms / GB/s (% of peak)" if has_peak else "ms / GB/s"
    head = "| " + " | ".join(key_cols) + " | " + " | ".join(f"{i}: {unit}" for i in impls) + " |"
    head += " kernel max abs err |" if has_kernel else ""
    lines = [head, "|" + "---|" * (len(key_cols) + len(impls) + has_kernel)]
    keys = list(dict.fromkeys(tuple(r[c] for c in key_cols) for r in rows))
    for key in keys:
        cells = []
        err = ""
        for impl in impls:
            r = next((r for r in rows if r["impl"] == impl and tuple(r[c] for c in key_cols) == key), None)
            if r is None:
                cells.append("")
            elif "error" in r:
                cells.append("fails")
            else:
                pct = "" if r["peak_frac"] is None else f" ({100 * r['peak_frac']:.0f}%)"
                cells.append(f"{r['ms']:.3f} / {r['gbps']:.3g}{pct}")
                if impl.startswith("pallas"):
                    err = f"{r['max_abs_err']:.1e}"
        lines.append("| " + " | ".join(str(k) for k in key) + " | " + " | ".join(cells) + " |"
                     + (f" {err} |" if has_kernel else ""))
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    import jax
    from pallas_kernels import ops

    gpu = ops.is_nvidia_gpu()
    dev = jax.devices()[0]
    args.trees = _ints(args.trees) if args.trees else ([16, 128] if args.quick else [16, 32, 64, 128] if gpu else [16, 64])
    args.contexts = _ints(args.contexts) if args.contexts else (
        ([1024, 32768] if gpu else [256, 1024]) if args.quick else
        ([1024, 4096, 16384, 32768] if gpu else [256, 1024, 4096]))
    args.heads = args.heads or (32 if gpu else 8)
    args.kv_heads = args.kv_heads or (8 if gpu else 2)
    args.head_dim = args.head_dim or (128 if gpu else 64)
    args.dtype = args.dtype or ("bfloat16" if gpu else "float32")
    kernel_impl = "pallas" if gpu else ("interpret" if args.interpret else None)
    peak = args.peak_gbps or (peak_gbps(dev.device_kind) if gpu else None)
    print(f"device: {dev.device_kind} ({dev.platform}); peak {peak} GB/s; kernel: {kernel_impl}", flush=True)

    check = exactness_check(kernel_impl) if kernel_impl else {}
    for name, (rel, ok) in check.items():
        print(f"  float32 exactness ({name}): max rel err {rel:.2e} {'OK' if ok else 'MISMATCH'}", flush=True)
    tree_rows = bench_tree(args, gpu, kernel_impl, peak)
    far_rows = [] if args.no_far else bench_far(args, gpu, kernel_impl, peak)

    meta = run_meta("bench_kernels", argv, platform=dev.platform, machine=platform.machine(), dtype=args.dtype,
                    peak_gbps=peak, args={**vars(args), "out": os.path.relpath(args.out, ROOT)},
                    exactness={k: dict(max_rel_err=r, ok=o) for k, (r, o) in check.items()})
    md = [f"{args.dtype}, batch {args.batch}, H={args.heads} K={args.kv_heads} D={args.head_dim} on {dev.device_kind} "
          f"({dev.platform}, {platform.machine()}); peak bandwidth {peak or 'unknown'} GB/s. Median of 3 x "
          f"{args.repeats} calls. GB/s counts the bytes an ideal kernel moves (each row's visible K/V, q, out).", ""]
    if check:
        md += ["Float32 exactness vs the reference: " + ", ".join(
            f"{k} {'OK' if ok else 'MISMATCH'} (max rel err {rel:.1e})" for k, (rel, ok) in check.items()), ""]
    if kernel_impl is None:
        md += ["No NVIDIA GPU: the Pallas kernel is not timed (interpret mode says nothing about speed; "
               "`--interpret` adds it anyway).", ""]
    md += ["## Tree attention (T tree nodes over `context` committed tokens)", "", _table(tree_rows, ["T", "context"])]
    if far_rows:
        md += ["", "## FOLD far attention (8 queries over N keys, RoPE in the kernel)", "", _table(far_rows, ["context"])]
    rows = [{"table": "tree", **r} for r in tree_rows] + [{"table": "far", **r} for r in far_rows]
    path = write_outputs(args.out, meta, rows, None, title="Tree-attention kernel benchmark", intro=md)
    print("\n" + path.read_text())
    print(f"wrote {args.out}.md and {args.out}.json")

if __name__ == "__main__":
    main()
