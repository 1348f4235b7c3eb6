"""`sampling.warp` with and without its vocabulary sort: ms per warp of one [1, V] row, jitted
(64 warps in one `fori_loop`), the two interleaved, median of 7. At the defaults (no top-k, no
top-p) `warp` skips the sort (`lax.cond`); `_cut` is the sorted path it used to take.

    python -m tools.bench_warp [--vocab 8192]
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from specjax.spec import sampling
from specjax.spec.sampling import SamplingParams
from tools.harness import cpu_name


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m tools.bench_warp",
                                 description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args(argv)
    x = jax.random.normal(jax.random.key(0), (1, args.vocab))
    p = SamplingParams.make(1.0)
    loop = lambda f: jax.jit(lambda x, p: jax.lax.fori_loop(0, 64, lambda i, a: a + f(x + i, p), jnp.zeros_like(x)))  # noqa: E731
    fns = {"warp (no sort)": loop(sampling.warp), "sorted cut": loop(lambda x, p: sampling._cut(x / p.temperature, p))}
    for f in fns.values():
        f(x, p).block_until_ready()
    times = {k: [] for k in fns}
    for _ in range(args.repeats):
        for k, f in fns.items():
            t = time.perf_counter()
            f(x, p).block_until_ready()
            times[k].append((time.perf_counter() - t) / 64 * 1e3)
    np.testing.assert_allclose(*(np.asarray(f(x, p)) for f in fns.values()), rtol=1e-5, atol=1e-4)
    out = {k: round(float(np.median(v)), 4) for k, v in times.items()}
    print(f"ms per warp of a [1, {args.vocab}] row ({cpu_name()}): {out}")
    return out


if __name__ == "__main__":
    main()
