"""A target at each weight storage dtype (`load_model(weights=...)`, `specjax.models.quant`), side by
side in one process:

    weight MB / token   the bytes of weights one decoding step reads: every projection, the LM head
                        (the embedding when tied), norms; one embedding row is left out
    forward(T)          the target's forward over T new tokens on a cache holding --context tokens
                        (causal block, as a verification over a chain), ms, median of --repeats,
                        and its ratio to forward(1) at the same dtype: the verify cost curve
    AR tokens/s         `specjax.generate` greedy over the code prompts, batch 1 (one prompt per call,
                        after an untimed call per prompt-length bucket: `tools.harness.time_generation`)
    agreement           with float32, on the held-back code (corpus test split) and chat prompts:
                        teacher-forced top-1 on float32's own greedy continuations, and the share
                        of free-running greedy continuations identical to float32's
    memory-bound limit  the machine's streaming read bandwidth over the weight bytes per token

    python -m tools.bench_weights --target models/smollm2-135m-instruct --out bench/bench_weights_smollm2
    python -m tools.bench_weights --smoke     # a tiny random target (checks the tool; measures nothing)
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import specjax  # noqa: E402
from specjax.models import family, quant, transformer  # noqa: E402
from tools.harness import Column, median_ms, run_meta, time_generation, write_outputs  # noqa: E402


def weight_bytes_per_token(model) -> int:
    """Bytes of parameters one decoding step reads (an untied embedding counts one row, left out)."""
    total = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    if model.lm_head is not None:
        total -= model.embed_tokens[...].nbytes + (0 if model.embed_scale is None else model.embed_scale[...].nbytes)
    return int(total)


def stream_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    """Bytes/s of a jitted sum over a float32 array of `gib` GiB (XLA's threads, as the model runs)."""
    x = jnp.ones((int(gib * 2 ** 28),), jnp.float32)
    f = jax.jit(jnp.sum)
    ms = median_ms(lambda: f(x), repeats)
    return x.nbytes / (ms / 1000)


def forward_ms(model, batch: int, context: int, widths, repeats: int) -> dict[int, float]:
    """ms of one forward over T new tokens on a cache of `context` committed tokens, per T."""
    fam = family(model)
    gd, st = nnx.split(model)
    V = model.config.vocab_size
    rng = np.random.default_rng(0)
    cache = fam.init_cache(model, batch, context + max(widths) + 8)
    prompt = jnp.asarray(rng.integers(0, V, (batch, context)), jnp.int32)
    cache = fam.prefill(model, prompt, jnp.full((batch,), context, jnp.int32), cache).cache

    @jax.jit
    def fwd(st, toks, cache):
        B, T = toks.shape
        pos = cache.length[:, None] + jnp.arange(T)[None]
        return fam.forward(nnx.merge(gd, st), toks, pos, cache, transformer.causal_mask(B, T)).logits

    out = {}
    for T in widths:
        toks = jnp.asarray(rng.integers(0, V, (batch, T)), jnp.int32)
        out[T] = median_ms(lambda: fwd(st, toks, cache), repeats)
    return out


def greedy(model, prompts, new_tokens: int):
    """Each prompt's greedy continuation, batch 1 (one prompt per call)."""
    return [list(map(int, specjax.generate(model, [p], max_new_tokens=new_tokens).sequences()[0])) for p in prompts]


def teacher_forced_agreement(model, prompts, continuations) -> float:
    """Share of positions where `model`'s argmax equals the reference continuation's next token,
    the model reading prompt + the reference continuation (one prefill per prompt)."""
    fam = family(model)
    hits = total = 0
    for p, c in zip(prompts, continuations):
        ids = list(p) + list(c)
        n = len(ids)
        cap = 64 * -(-n // 64)
        toks = jnp.asarray([ids + [0] * (cap - n)], jnp.int32)
        logits = fam.prefill(model, toks, jnp.asarray([n], jnp.int32), fam.init_cache(model, 1, cap)).logits[0]
        pred = np.asarray(jnp.argmax(logits[len(p) - 1:n - 1], -1))
        hits += int(np.sum(pred == np.asarray(c)))
        total += len(c)
    return hits / max(total, 1)


def prompt_sets(args, model):
    if args.smoke:
        rng = np.random.default_rng(0)
        V = model.config.vocab_size
        return {"code": [rng.integers(0, V, 24).tolist() for _ in range(args.prompts)],
                "chat": [rng.integers(0, V, 30).tolist() for _ in range(args.prompts)]}
    from tools.bench import chat_prompts
    from train import prompts as prompt_sets_lib
    tok = specjax.load_tokenizer(args.target)
    return {"code": [p["ids"] for p in prompt_sets_lib.prompt_set("functions", tok, args.prompts, context_tokens=args.context)],
            "chat": chat_prompts(args.target, tok, args.chat_prompts, args.prompts)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=str(REPO / "models/smollm2-135m-instruct"))
    ap.add_argument("--weights", default="float32,bfloat16,int8", help="comma-separated (float32 first: the reference)")
    ap.add_argument("--widths", default="1,2,3,4,6,8,12,16,24,32", help="forward widths T")
    ap.add_argument("--batch", default="1,4", help="batch sizes of the forward curve")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--prompts", type=int, default=8, help="prompts per set (code, chat)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--chat-prompts", default=str(REPO / "bench/prompts/chat.jsonl"))
    ap.add_argument("--invariant", action=argparse.BooleanOptionalAction, default=None,
                    help="the batch-invariant attention at bf16 / int8 (load_model(invariant=...)); default: "
                         "load_model's (on for bf16 / int8)")
    ap.add_argument("--smoke", action="store_true", help="a tiny random target: checks the tool, measures nothing")
    ap.add_argument("--out", default=str(REPO / "bench/bench_weights"))
    args = ap.parse_args(argv)
    try:
        weights = [quant.check_weights(w) for w in args.weights.split(",")]
        widths = sorted({int(x) for x in args.widths.split(",")} | {1})
        batches = [int(x) for x in args.batch.split(",")]
    except ValueError as e:
        ap.error(str(e))
    if weights[0] != "float32":
        ap.error("--weights: float32 comes first (the reference of the agreement columns)")
    if args.smoke:
        from tools.harness import smoke_models
        _, base, _ = smoke_models()
        load = lambda w: quant.quantize(nnx.clone(base), w)  # noqa: E731
        args.new_tokens, args.repeats = min(args.new_tokens, 8), 1
    else:
        if not Path(args.target).is_dir():
            ap.error(f"{args.target}: no such model directory (SmolLM2: make smollm2)")
        load = lambda w: specjax.load_model(args.target, weights=w, invariant=args.invariant)  # noqa: E731

    bandwidth = None if args.smoke else stream_bandwidth()
    rows, ref = [], {}
    for w in weights:
        print(f"[bench_weights] {w} ...", file=sys.stderr, flush=True)
        model = load(w)
        sets = prompt_sets(args, model)
        row = {"weights": w, "weight_mb_per_token": weight_bytes_per_token(model) / 1e6}
        for B in batches:
            ms = forward_ms(model, B, args.context, widths, args.repeats)
            row[f"forward_ms_b{B}"] = {str(T): v for T, v in ms.items()}
            row[f"forward_ratio_b{B}"] = {str(T): v / ms[1] for T, v in ms.items()}
        code = sets["code"]
        results, secs = time_generation(model, [[p] for p in code], 1, max_new_tokens=args.new_tokens)
        row["ar_tokens_per_s"] = len(code) * args.new_tokens / secs[0]
        outs = {"code": [list(map(int, r.sequences()[0])) for r in results],
                "chat": greedy(model, sets["chat"], args.new_tokens)}
        if w == "float32":
            ref = outs
        for name in ("code", "chat"):
            row[f"agree_tf_{name}"] = teacher_forced_agreement(model, sets[name], ref[name])
            row[f"identical_{name}"] = statistics.mean(a == b for a, b in zip(outs[name], ref[name]))
        if bandwidth:
            row["memory_bound_tokens_per_s"] = bandwidth / (row["weight_mb_per_token"] * 1e6)
        rows.append(row)
        del model
        jax.clear_caches()
    f32 = rows[0]
    for r in rows:
        r["ar_vs_float32"] = r["ar_tokens_per_s"] / f32["ar_tokens_per_s"]
        if bandwidth:
            r["share_of_memory_bound"] = r["ar_tokens_per_s"] / r["memory_bound_tokens_per_s"]
    pick = [T for T in (2, 4, 8, 16, 32) if T in widths]
    cols = [Column("weights", lambda r: r["weights"]),
            Column("weight MB / token", lambda r: f"{r['weight_mb_per_token']:.1f}"),
            Column("AR tokens/s", lambda r: f"{r['ar_tokens_per_s']:.1f}"),
            Column("vs float32 AR", lambda r: f"{r['ar_vs_float32']:.2f}x")]
    if bandwidth:
        cols += [Column("memory-bound limit tok/s", lambda r: f"{r['memory_bound_tokens_per_s']:.0f}"),
                 Column("share of the limit", lambda r: f"{100 * r['share_of_memory_bound']:.0f}%")]
    for B in batches:
        cols.append(Column(f"forward(1) ms, B={B}", lambda r, B=B: f"{r[f'forward_ms_b{B}']['1']:.1f}"))
        cols.append(Column(f"forward(T)/forward(1), B={B}, T={','.join(map(str, pick))}",
                           lambda r, B=B: " / ".join(f"{r[f'forward_ratio_b{B}'][str(T)]:.2f}" for T in pick)))
    cols += [Column("top-1 agreement with float32 (code / chat)",
                    lambda r: f"{r['agree_tf_code']:.4f} / {r['agree_tf_chat']:.4f}"),
             Column("greedy identical to float32 (code / chat)",
                    lambda r: f"{r['identical_code']:.2f} / {r['identical_chat']:.2f}")]
    meta = run_meta("bench_weights", argv, setup="smoke: tiny random target" if args.smoke else f"target: {Path(args.target).name}",
                    context=args.context, prompts=args.prompts, new_tokens=args.new_tokens, repeats=args.repeats,
                    stream_bandwidth_gb_s=None if bandwidth is None else bandwidth / 1e9)

    def plot(plt, rows, meta):
        fig, axes = plt.subplots(1, len(batches), figsize=(5.5 * len(batches), 4), squeeze=False)
        for ax, B in zip(axes[0], batches):
            for r in rows:
                ax.plot(widths, [r[f"forward_ms_b{B}"][str(T)] for T in widths], marker="o", label=r["weights"])
            ax.set_xlabel("T (tokens in the forward)")
            ax.set_ylabel("ms")
            ax.set_title(f"forward(T), batch {B}, context {args.context}")
            ax.legend()
        fig.tight_layout()
        return fig

    md = write_outputs(args.out, meta, rows, cols, None if args.smoke else plot,
                       title="Weight storage dtypes: bytes per token, the verify cost curve, AR speed, agreement with float32",
                       intro=[f"Forward widths measured: {', '.join(map(str, widths))} (all in the JSON). "
                              f"Agreement: {args.prompts} code prompts (corpus test split, functions) and {args.prompts} chat "
                              f"prompts, {args.new_tokens} new tokens each."
                              + ("" if bandwidth is None else f" Streaming read bandwidth: {bandwidth / 1e9:.1f} GB/s "
                                 "(a jitted sum over 1 GiB); memory-bound limit = bandwidth / weight bytes per token.")])
    print(md.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
