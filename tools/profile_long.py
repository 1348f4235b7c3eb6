"""The engine at long context (issue 64): per prompt length, the prefill (time to first token, prompt tokens/s),
one autoregressive decode step and one verification forward of 8 nodes over the long cache, and the
process's peak memory. Each length runs in its own process (`--one L`), so its peak resident memory is
its own.

    python -m tools.profile_long --model models/smollm2-135m-instruct --weights int8 --lengths 256,1024,2048,4096,8192
    python -m tools.profile_long --smoke      # a tiny random model: checks the tool

Every step is jitted and timed warm (compiled first; compile seconds reported apart), median of
--repeats; the decode step and the verify forward take the cache donated (as the engine's loop updates
it in place). Prompts: `train.prompts.long_context_prompts` (the start of the longest test-split files).
Writes <out>.md / .json (`tools.harness.write_outputs`; CPU model and command in the header).
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from tools.harness import REPO, run_meta

VERIFY_NODES = 8


def _median_time(fn, repeats: int) -> float:
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return float(np.median(ts))


def profile_one(model, prompt_ids: list[int], *, repeats: int, steps: int) -> dict:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from specjax.models import family
    from specjax.models import prefill as prefill_lib
    from specjax.engine.loop import PROMPT_BUCKET
    fam = family(model)
    if not hasattr(fam, "CHUNK_ATTENTION"):
        raise SystemExit("profile_long times a transformer target (its verify forward over a KV cache)")
    L = len(prompt_ids)
    P = prefill_lib.prompt_bucket(L, PROMPT_BUCKET)
    capacity = P + 4 * (VERIFY_NODES + steps)
    tokens = np.zeros((1, P), np.int32)
    tokens[0, :L] = prompt_ids
    tokens, lengths = jnp.asarray(tokens), jnp.asarray([L], jnp.int32)
    graphdef, state = nnx.split(model)

    @jax.jit
    def prefill(state, tokens, lengths):
        m = nnx.merge(graphdef, state)
        out = prefill_lib.prefill(fam, m, tokens, lengths, fam.init_cache(m, 1, capacity))
        return jnp.argmax(prefill_lib.prompt_logits(out.logits, lengths), -1).astype(jnp.int32), out.cache

    @jax.jit(donate_argnums=(2,))
    def decode(state, tok_B, cache):
        m = nnx.merge(graphdef, state)
        out = fam.decode_step(m, tok_B, cache)
        return jnp.argmax(out.logits[:, 0], -1).astype(jnp.int32), out.cache

    @jax.jit(donate_argnums=(2,))
    def verify(state, nodes_BxT, cache):  # a chain of nodes over the committed cache, K/V in scratch, not committed
        m = nnx.merge(graphdef, state)
        T = nodes_BxT.shape[1]
        pos = cache.length[:, None] + jnp.arange(T, dtype=jnp.int32)[None]
        out = fam.forward(m, nodes_BxT, pos, cache, jnp.tril(jnp.ones((1, T, T), bool)))
        return jnp.argmax(out.logits, -1).astype(jnp.int32), out.cache  # length unchanged: the next call rewrites the scratch

    row = {"length": L, "bucket": P, "capacity": capacity}
    t = time.perf_counter()
    compiled = prefill.lower(state, tokens, lengths).compile()
    row["prefill_compile_s"] = time.perf_counter() - t
    first = compiled(state, tokens, lengths)
    jax.block_until_ready(first)
    row["prefill_s"] = _median_time(lambda: jax.block_until_ready(compiled(state, tokens, lengths)), repeats)
    row["prefill_tokens_per_s"] = L / row["prefill_s"]
    row["ttft_s"] = row["prefill_s"]  # the first token is the prefill's argmax: nothing else runs before it
    tok, cache = first

    def timed_steps(fn, x, cache, feed_back: bool):
        """Compile seconds (the first call), then the median ms of `steps` calls, the donated cache fed back
        (and the output as the next input when `feed_back`: decoding's next token)."""
        t = time.perf_counter()
        y, cache = fn(state, x, cache)
        jax.block_until_ready(y)
        compile_s, ts = time.perf_counter() - t, []
        for _ in range(steps):
            s = time.perf_counter()
            y, cache = fn(state, y if feed_back else x, cache)
            jax.block_until_ready(y)
            ts.append(time.perf_counter() - s)
        return compile_s, 1e3 * float(np.median(ts)), y, cache

    row["decode_compile_s"], row["decode_step_ms"], tok, cache = timed_steps(decode, tok, cache, True)
    nodes = jnp.broadcast_to(tok[:, None], (1, VERIFY_NODES)).astype(jnp.int32)
    row["verify_compile_s"], row[f"verify{VERIFY_NODES}_ms"], _, cache = timed_steps(verify, nodes, cache, False)
    row[f"verify{VERIFY_NODES}_over_decode"] = row[f"verify{VERIFY_NODES}_ms"] / row["decode_step_ms"]
    row["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return row


def _load(args):
    import specjax
    from tools.harness import smoke_models
    if args.smoke:
        target = smoke_models()[1]
        rng = np.random.default_rng(0)
        return target, lambda L: rng.integers(0, target.config.vocab_size, L).tolist()
    from train import prompts as prompts_lib
    model = specjax.load_model(args.model, weights=args.weights)
    tok = specjax.load_tokenizer(args.model)

    def prompt(L):
        got = prompts_lib.long_context_prompts(tok, lengths=(L,), per_length=1)[L]
        if not got:
            raise SystemExit(f"no test-split file reaches {L} tokens")
        return got[0]["ids"]
    return model, prompt


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(REPO / "models/smollm2-135m-instruct"))
    ap.add_argument("--weights", default="int8", choices=("float32", "bfloat16", "int8"))
    ap.add_argument("--lengths", default=None, help="default 256,1024,2048,4096,8192 (smoke 64,200)")
    ap.add_argument("--repeats", type=int, default=2, help="timed prefills per length (after one warm run)")
    ap.add_argument("--steps", type=int, default=10, help="timed decode steps / verify forwards per length")
    ap.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # one length, JSON on stdout
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default=str(REPO / "bench/long/profile_smollm2_int8"))
    args = ap.parse_args(argv)
    if args.one is not None:
        model, prompt = _load(args)
        print(json.dumps(profile_one(model, prompt(args.one), repeats=args.repeats, steps=args.steps)))
        return 0
    lengths = [int(x) for x in (args.lengths or ("64,200" if args.smoke else "256,1024,2048,4096,8192")).split(",")]
    rows = []
    for L in lengths:
        cmd = [sys.executable, "-m", "tools.profile_long", "--one", str(L), "--model", args.model, "--weights",
               args.weights, "--repeats", str(args.repeats), "--steps", str(args.steps)] + (["--smoke"] if args.smoke else [])
        r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        if r.returncode:
            print(r.stderr[-3000:], file=sys.stderr)
            return r.returncode
        rows.append(json.loads(r.stdout.strip().splitlines()[-1]))
        print(f"[profile_long] {rows[-1]}", file=sys.stderr, flush=True)
    base = rows[0]["prefill_tokens_per_s"]
    for r in rows:
        r["prefill_rate_vs_first"] = r["prefill_tokens_per_s"] / base
    meta = run_meta("profile_long", argv)
    meta.update(model=args.model if not args.smoke else "smoke", weights=args.weights)
    lines = [f"# The engine at long context ({'smoke' if args.smoke else Path(args.model).name}, {args.weights} weights)", "",
             f"CPU: {meta['cpu']}; date {meta.get('date', '')}.", "", f"Command: `{meta.get('command', '')}`", "",
             "Batch 1, warm (compile apart), median of the timed runs; verify = one forward of a chain of "
             f"{VERIFY_NODES} nodes over the cache; peak RSS of the length's own process.", "",
             "| prompt tokens | prefill s (TTFT) | prefill tokens/s | vs shortest | prefill compile s | decode step ms | "
             f"verify {VERIFY_NODES} ms | verify / decode | peak RSS MB |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['length']} | {r['prefill_s']:.2f} | {r['prefill_tokens_per_s']:.0f} | "
                     f"{r['prefill_rate_vs_first']:.2f}x | {r['prefill_compile_s']:.1f} | {r['decode_step_ms']:.1f} | "
                     f"{r[f'verify{VERIFY_NODES}_ms']:.1f} | {r[f'verify{VERIFY_NODES}_over_decode']:.2f} | "
                     f"{r['peak_rss_mb']:.0f} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
