"""Autoregressive decoding speed: specjax.generate against transformers' generate, same weights.

    python -m tools.bench_ar                         # random 25M model, prompt 128, 128 new tokens
    python -m tools.bench_ar --model DIR             # any Llama / Qwen2 / Qwen3 checkpoint (HF format)

Greedy, float32, CPU, a fixed number of new tokens (EOS disabled on both sides), batch 1 and 4 by
default. Every configuration runs once untimed (compilation for specjax, first-call overhead for
torch), then `--repeats` timed calls; the table shows medians. Per configuration it measures

  e2e ms/token     wall time of one generate call with N new tokens, / N (prefill included);
  decode ms/token  (t(N) - t(1)) / (N - 1): the cost of one more decoding step, prefill excluded;
  tok/s            batch * N / t(N).

"ms/token" is per decoding step: one step yields one token for every row of the batch.
transformers runs eagerly under torch.inference_mode with its dynamic cache and, when it works,
its static cache (`cache_implementation="static"`; generate does not torch.compile on CPU).
The tool checks that specjax's greedy tokens equal transformers' and says so.

Writes the table to stdout and to `<out>.md`, all raw timings to `<out>.json` (default bench/bench_ar;
`tools.harness.write_outputs`).
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time

import numpy as np

from tools.harness import Column, cpu_name, run_meta, write_outputs

SIZES = {
    # d_model, layers, heads, kv heads, head_dim, intermediate, vocab (tied embeddings): the
    # code-completion target of the model zoo.
    "25m": dict(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=2, head_dim=64,
                intermediate_size=1536, vocab_size=8192),
    "tiny": dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                 intermediate_size=128, vocab_size=512),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m tools.bench_ar",
                                description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", metavar="DIR", help="checkpoint in Hugging Face format")
    src.add_argument("--random-size", choices=sorted(SIZES), default="25m",
                     help="without --model: a random model of this size, saved to a temporary directory (default 25m)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--batch-sizes", default="1,4", help="comma-separated (default 1,4)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--hf-caches", default="dynamic,static",
                   help="transformers cache implementations to time (default dynamic,static; empty: skip transformers)")
    p.add_argument("--torch-threads", type=int, default=None, metavar="N",
                   help="torch.set_num_threads(N) (default: torch's own choice). On a shared, oversubscribed "
                        "CPU, torch with several threads can be several times slower than with one")
    p.add_argument("--seed", type=int, default=0, help="random weights and prompt tokens")
    p.add_argument("--out", default="bench/bench_ar", help="writes OUT.md and OUT.json")
    args = p.parse_args(argv)
    if args.new_tokens < 2:
        p.error("--new-tokens must be at least 2 (decode ms/token is (t(N) - t(1)) / (N - 1))")
    return args


def make_random_model(size: str, seed: int, max_positions: int, path: str):
    import specjax

    cfg = specjax.ModelConfig(**SIZES[size], model_type="llama", tie_word_embeddings=True,
                              max_position_embeddings=max_positions, rms_norm_eps=1e-5)
    specjax.save_model(specjax.init_model(cfg, seed=seed), path)


def timed(fn, repeats: int) -> list[float]:
    fn()  # warm-up: compilation / first-call overhead, excluded
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def summarize(t_n: list[float], t_1: list[float], batch: int, n: int) -> dict:
    med_n, med_1 = statistics.median(t_n), statistics.median(t_1)
    return {"e2e_ms_per_token": 1000 * med_n / n, "decode_ms_per_token": 1000 * (med_n - med_1) / (n - 1),
            "tokens_per_s": batch * n / med_n, "t_n_s": t_n, "t_1_s": t_1}


def bench_specjax(model_dir, prompts, n, repeats):
    import specjax

    model = specjax.load_model(model_dir)
    kw = dict(temperature=0.0, eos_token_id=())  # greedy, EOS disabled: exactly n tokens
    t_n = timed(lambda: specjax.generate(model, prompts, max_new_tokens=n, **kw), repeats)
    t_1 = timed(lambda: specjax.generate(model, prompts, max_new_tokens=1, **kw), repeats)
    tokens = specjax.generate(model, prompts, max_new_tokens=n, **kw).tokens
    return summarize(t_n, t_1, len(prompts), n), np.asarray(tokens)


def bench_hf(model, prompts, n, repeats, cache):
    import torch

    ids = torch.tensor(np.asarray(prompts), dtype=torch.long)
    extra = {} if cache == "dynamic" else {"cache_implementation": cache}

    def run(k):
        with torch.inference_mode():
            return model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=k,
                                  min_new_tokens=k, pad_token_id=0, **extra)

    t_n = timed(lambda: run(n), repeats)
    t_1 = timed(lambda: run(1), repeats)
    tokens = run(n)[:, ids.shape[1]:].numpy()
    return summarize(t_n, t_1, len(prompts), n), tokens


def compare(ours: np.ndarray, theirs: np.ndarray) -> str:
    if ours.shape != theirs.shape:
        return f"no (shapes {ours.shape} vs {theirs.shape})"
    diff = np.argwhere(ours != theirs)
    if len(diff) == 0:
        return "yes"
    b, t = diff[np.lexsort((diff[:, 0], diff[:, 1]))][0]
    return f"no (first difference: row {b}, token {t})"


def main(argv=None) -> int:
    args = parse_args(argv)
    load_before = os.getloadavg()[0]
    batches = [int(b) for b in args.batch_sizes.split(",") if b]
    caches = [c for c in args.hf_caches.split(",") if c]
    import jax
    import specjax
    from specjax.models.config import read_config

    with tempfile.TemporaryDirectory() as tmp:
        if args.model:
            model_dir, model_name = args.model, args.model
        else:
            model_dir, model_name = tmp, f"random {args.random_size} (seed {args.seed})"
            make_random_model(args.random_size, args.seed, max(2048, args.prompt_len + args.new_tokens), tmp)
        cfg = read_config(model_dir)
        n_params = specjax.models.transformer.num_params(specjax.load_model(model_dir))
        rng = np.random.default_rng(args.seed)
        hf_model = None
        if caches:
            import torch
            import transformers
            from transformers import AutoModelForCausalLM

            transformers.logging.set_verbosity_error()
            if args.torch_threads:
                torch.set_num_threads(args.torch_threads)
            hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

        rows = []
        for B in batches:
            prompts = rng.integers(0, cfg.vocab_size, size=(B, args.prompt_len)).tolist()
            ours, our_tokens = bench_specjax(model_dir, prompts, args.new_tokens, args.repeats)
            rows.append(dict(batch=B, library="specjax", cache="static (jit)", match="-", **ours))
            print(f"batch {B} specjax: {ours['e2e_ms_per_token']:.2f} ms/token", file=sys.stderr, flush=True)
            for cache in caches:
                try:
                    res, tokens = bench_hf(hf_model, prompts, args.new_tokens, args.repeats, cache)
                except Exception as e:  # report the failure in the table instead of aborting the run
                    rows.append(dict(batch=B, library="transformers", cache=cache, error=f"{type(e).__name__}: {e}"))
                    print(f"batch {B} transformers {cache}: failed: {e}", file=sys.stderr, flush=True)
                    continue
                rows.append(dict(batch=B, library="transformers", cache=cache, match=compare(our_tokens, tokens), **res))
                print(f"batch {B} transformers {cache}: {res['e2e_ms_per_token']:.2f} ms/token", file=sys.stderr, flush=True)

    env = {"python": platform.python_version(), "jax": jax.__version__, "jax_backend": jax.default_backend(),
           "cpu_count": os.cpu_count(), "cpu": cpu_name(),
           # Other processes on the machine skew timings: the 1-minute load average before / after.
           "load_avg_1m": f"{load_before:.1f} / {os.getloadavg()[0]:.1f}"}
    if caches:
        env.update(torch=torch.__version__, transformers=transformers.__version__, torch_threads=torch.get_num_threads())
    meta = run_meta("bench_ar", argv, model=model_name, params=n_params, config=cfg.to_hf(),
                    prompt_len=args.prompt_len, new_tokens=args.new_tokens, repeats=args.repeats, env=env)
    intro = [f"Model: {model_name}: {cfg.model_type}, {n_params / 1e6:.1f}M parameters, d_model {cfg.hidden_size}, "
             f"{cfg.num_layers} layers, {cfg.num_heads}/{cfg.num_kv_heads} heads, head_dim {cfg.head_dim}, "
             f"intermediate {cfg.intermediate_size}, vocab {cfg.vocab_size}{', tied' if cfg.tie_word_embeddings else ''}  ",
             f"Workload: float32, greedy, prompt {args.prompt_len} tokens, {args.new_tokens} new tokens (EOS disabled), "
             f"median of {args.repeats} repeats after one warm-up  ",
             "Environment: " + ", ".join(f"{k} {v}" for k, v in env.items())]
    failed = lambda k, fmt: lambda r: None if "error" in r else fmt.format(r[k])  # noqa: E731
    columns = [Column("batch", "batch"), Column("library", "library", right=False), Column("cache", "cache", right=False),
               Column("e2e ms/token", lambda r: f"failed: {r['error'][:80]}" if "error" in r
                      else f"{r['e2e_ms_per_token']:.2f}"),
               Column("decode ms/token", failed("decode_ms_per_token", "{:.2f}")),
               Column("tok/s", failed("tokens_per_s", "{:.0f}")),
               Column("same greedy tokens as specjax", failed("match", "{}"), right=False)]
    notes = ["e2e ms/token = t(N) / N with prefill included; decode ms/token = (t(N) - t(1)) / (N - 1); "
             "one token = one decoding step of the whole batch; tok/s = batch * N / t(N)."]
    md = write_outputs(args.out, meta, rows, columns, title="Autoregressive decoding: specjax vs transformers",
                       intro=intro, notes=notes)
    print(md.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
