"""FOLD on long contexts (design §7): tau, tokens/s and speedup against context length.

For each context length L (1k, 2k, 4k, 8k tokens; lengths beyond the target's
max_position_embeddings are skipped with a note) and each drafter (lm: models/code-draft,
feature: models/code-target-feature), four drafter variants on the same prompts, all greedy and
all checked token for token against greedy autoregressive output:

    plain            the drafter as trained
    shared position  FOLD's far keys at one shared position, beta = 1           (lambda = 0)
    sharpen only     far keys at their true positions, far logits * beta         (positions off)
    fold (both)      shared position and sharpening

plus the drafter's attention entropy and mass on far keys at its first draft step (every layer,
averaged; recomputed from the reference definition, `specjax.engine.fold_diagnostics.attention_diagnostics`).
Prompts come from `train.prompts.long_context_prompts` (the longest files of a split), cut so that
prompt + generated tokens + draft depth <= L. FOLD's window and lambda are chosen on the
validation split (`--tune`: a small grid, best mean tau of "fold (both)" per drafter, written to
<out>_tune.json and reused by later runs) and reported on the test split.

    python -m tools.bench_long --tune          # the real measurement: tune on validation, report on test
    python -m tools.bench_long                 # report only (tuned values from bench/bench_long_tune.json)
    python -m tools.bench_long --smoke         # tiny random models, seconds (what the test runs)

Writes <out>.md, .json and .png (tau against context length; `tools.harness.write_outputs`). Float32.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

import specjax
from specjax.models import fold as fold_lib
from specjax.engine import fold_diagnostics
from specjax.models.fold import FoldConfig
from specjax.drafters import NgramDrafter
from specjax.drafters.composite.treegraft import Switch
from tools.harness import (REPO, Column, batches, generation_row, greedy_check, run_meta, smoke_models,
                           time_generation, write_outputs)

VARIANTS = ("plain", "shared position", "sharpen only", "fold (both)")
TREES = {"lm": "chain=4", "feature": "chain=5"}
DEPTH_SLACK = 8  # prompt = L - new_tokens - DEPTH_SLACK: the context never passes L


def variant_config(name: str, base: FoldConfig) -> FoldConfig | None:
    if name == "plain":
        return None
    if name == "shared position":
        return dataclasses.replace(base, sharpen=0.0)
    if name == "sharpen only":
        return dataclasses.replace(base, fold_positions=False)
    return base


def diagnostic_config(name: str, base: FoldConfig) -> FoldConfig:
    """The plain drafter's attention, with far keys labelled by the same sinks and window."""
    cfg = variant_config(name, base)
    return cfg if cfg is not None else dataclasses.replace(base, fold_positions=False, sharpen=0.0)


# ----------------------------------------------------------------------------- setups

def smoke_setup(args):
    """A tiny random target (positions up to 300), a noisy copy of it as the lm drafter, a random
    feature head; synthetic prompts (a repeated phrase, then noise) for both splits."""
    from flax import nnx

    from specjax.drafters import FeatureConfig, FeatureDrafter, FeatureHead, LMDrafter
    V = 64
    cfg, target, draft = smoke_models(0, max_positions=300, noise=0.05)
    head = FeatureHead(FeatureConfig.for_target(cfg, target_layers=(0, 1)), nnx.Rngs(3))
    drafters = {"lm": LMDrafter(draft), "feature": FeatureDrafter(head, target)}

    def prompts(split):
        rng = np.random.default_rng({"validation": 1, "test": 2}[split])
        out = {}
        for L in args.lengths:
            rows = []
            for _ in range(args.prompts):
                phrase = rng.integers(0, V, 13).tolist()
                rows.append({"path": "synthetic", "ids": ((phrase * L)[: L // 2] + rng.integers(0, V, L).tolist())[:L]})
            out[L] = rows
        return out

    return target, drafters, prompts


def zoo_setup(args):
    from specjax.io.checkpoint import load_tokenizer
    from specjax.drafters import load_drafter
    from train import prompts as prompt_sets
    target = specjax.load_model(args.target, weights=args.weights)
    tok = load_tokenizer(args.target)
    drafters = {}
    for name, path in (("lm", args.draft), ("feature", args.feature)):
        if path and os.path.isdir(path):
            drafters[name] = load_drafter(path, target, target_path=args.target, tuned=args.tuned)
            tuned_tree = getattr(drafters[name], "default_tree", None) if args.tuned else None
            if tuned_tree is not None and not args.tree_given[name]:
                args.trees[name] = str(tuned_tree)

    def prompts(split):
        if args.kind == "long":
            return prompt_sets.long_context_prompts(tok, tuple(args.lengths), per_length=args.prompts, split=split)
        # long code / long chat (issue 64): each prompt already fits L with the new tokens and the draft depth
        return {L: prompt_sets.long_prompts(args.kind, tok, L - args.new_tokens - DEPTH_SLACK, args.prompts, split=split,
                                            chat_model_dir=args.target) for L in args.lengths}

    return target, drafters, prompts


# ----------------------------------------------------------------------------- measuring

def cut(prompt_sets: dict, L: int, new_tokens: int) -> list[list[int]]:
    p = L - new_tokens - DEPTH_SLACK
    return [r["ids"][:p] for r in prompt_sets.get(L, [])]


def groups_of(prompts, size):
    return batches(prompts, size)


def timed(target, groups, new_tokens, repeats, drafter=None, tree=None, warm=True):
    """tokens/s, tau and the sequences (`tools.harness.time_generation` + `generation_row`); `warm`:
    one untimed call on the first group first (compiles); repeats 0 runs one pass."""
    kw = dict(max_new_tokens=new_tokens, eos_token_id=())
    if drafter is not None:
        kw.update(drafters=[drafter], tree=tree)
    results, times = time_generation(target, groups, repeats, warmup="first" if warm else None, **kw)
    return generation_row(results, times, speculative=drafter is not None, drafter=drafter)


def prefill_seconds(target, groups, repeats: int = 2) -> float:
    """Seconds of the target's prefill alone (its first token) over all `groups`, warm, median of `repeats`:
    what each generation spends before decoding (`specjax.models.prefill`, as `generate` runs it)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from specjax.engine import loop as engine
    from specjax.models import family
    from specjax.models import prefill as prefill_lib
    fam = family(target)
    graphdef, state = nnx.split(target)

    @jax.jit
    def run(state, tokens, lengths):
        m = nnx.merge(graphdef, state)
        out = prefill_lib.prefill(fam, m, tokens, lengths, fam.init_cache(m, tokens.shape[0], tokens.shape[1] + 16))
        return prefill_lib.prompt_logits(out.logits, lengths).argmax(-1)

    batches_ = [engine.prepare_prompts(g, target.config.vocab_size, 1) for g in groups]
    jax.block_until_ready(run(state, jnp.asarray(batches_[0].tokens), jnp.asarray(batches_[0].lengths)))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for b in batches_:
            jax.block_until_ready(run(state, jnp.asarray(b.tokens), jnp.asarray(b.lengths)))
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def with_decode_speed(row: dict, prefill_s: float, n_rows: int) -> dict:
    """Decode tokens/s: the tokens after each row's first (the prefill's) over the pass's seconds less the
    target's prefill (a drafter's own prefill stays in: it is part of its cost)."""
    row["prefill_s"] = prefill_s
    row["decode_tokens_per_s"] = (row["tokens"] - n_rows) / max(row["seconds"] - prefill_s, 1e-9)
    return row


def tune(target, drafters, prompt_sets, args, base: FoldConfig) -> dict:
    """Grid over (window, lambda) on validation prompts: the best mean tau of "fold (both)"."""
    max_pos = target.config.max_position_embeddings
    lengths = [L for L in args.lengths if L <= max_pos and prompt_sets.get(L)]
    chosen, rows = {}, []
    for name, drafter in drafters.items():
        best = None
        plain = [timed(target, groups_of(cut(prompt_sets, L, args.new_tokens), args.batch), args.new_tokens, 0,
                       drafter, args.trees[name], warm=False)["tau"] for L in lengths]
        rows.append({"drafter": name, "window": None, "lambda": None, "taus": plain, "mean_tau": float(np.mean(plain))})
        for window in args.tune_windows:
            for lam in args.tune_lambdas:
                cfg = dataclasses.replace(base, window=window, sharpen=lam, far_distance=window + base.chunk)
                d = drafter.with_fold(cfg)
                taus = [timed(target, groups_of(cut(prompt_sets, L, args.new_tokens), args.batch), args.new_tokens, 0,
                              d, args.trees[name], warm=False)["tau"] for L in lengths]
                score = float(np.mean(taus))
                rows.append({"drafter": name, "window": window, "lambda": lam, "taus": taus, "mean_tau": score})
                print(f"[tune] {name} window={window} lambda={lam}: tau {taus}", file=sys.stderr, flush=True)
                if best is None or score > best[0]:
                    best = (score, window, lam)
        chosen[name] = {"window": best[1], "lambda": best[2], "mean_tau": best[0], "plain_mean_tau": float(np.mean(plain))}
    return {"lengths": lengths, "chosen": chosen, "grid": rows}


# ----------------------------------------------------------------------------- outputs

COLUMNS = [Column("drafter", "drafter", right=False), Column("context L", "length"),
           Column("prompt tokens", "prompt_tokens"), Column("variant", "variant", right=False),
           Column("tau", "tau", "{:.3f}"), Column("tokens/s", "tokens_per_s", "{:.1f}"),
           Column("speedup vs AR", "speedup", "{:.2f}x"),
           Column("decode tokens/s", "decode_tokens_per_s", "{:.1f}"), Column("decode speedup", "decode_speedup", "{:.2f}x"),
           Column("attn entropy (nats)", "entropy", "{:.3f}"),
           Column("far-key mass", "far_mass", "{:.3f}"), Column("n_far at first draft", "n_far"),
           Column("greedy check (exact / near-tie / mismatch)",
                  lambda r: f"{r['exact']} / {r['near_tie']} / {r['mismatch']}", right=False)]


def plot_long(plt, rows, meta):
    names = sorted({r["drafter"] for r in rows}) or ["none"]
    speed = any(r.get("decode_tokens_per_s") for r in rows)
    fig, axes = plt.subplots(2 if speed else 1, len(names), figsize=(5.5 * len(names), 8 if speed else 4), squeeze=False)
    for i, (key, label) in enumerate([("tau", "tau (mean acceptance length)"),
                                      ("decode_tokens_per_s", "decode tokens/s")][:2 if speed else 1]):
        for ax, name in zip(axes[i], names):
            for v in VARIANTS:
                pts = sorted((r["length"], r[key]) for r in rows if r["drafter"] == name and r["variant"] == v
                             and r.get(key) is not None)
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=v)
            if key != "tau":  # AR at each length, for reference
                ar = sorted({(r["length"], r["ar_decode_tokens_per_s"]) for r in rows if r.get("ar_decode_tokens_per_s")})
                if ar:
                    ax.plot(*zip(*ar), marker="x", linestyle="--", color="gray", label="AR")
            ax.set_xscale("log", base=2)
            ticks = sorted({r["length"] for r in rows})
            ax.set_xticks(ticks, [str(t) for t in ticks])
            ax.minorticks_off()
            ax.set_xlabel("context length (tokens)")
            ax.set_ylabel(label)
            ax.set_title(f"{name}")
            ax.legend()
    fig.suptitle(f"Long contexts: tau and decode speed against context length — {meta['setup']}")
    fig.tight_layout()
    return fig


def write_long_outputs(rows, notes, meta, out: Path) -> Path:
    """<out>.md, .json ({"meta", "rows", "notes"}) and .png through the harness."""
    intro = [f"Test split; {meta['n_prompts']} prompts per length, {meta['new_tokens']} new tokens each, batch "
             f"{meta['batch']}, greedy; median of {meta['repeats']} timed repeats "
             f"{'after a warm-up' if meta.get('warmup', True) else 'without a warm-up (tokens/s include compilation)'}; "
             f"{meta.get('weights', 'float32')} weights on {meta['device']}, prompts: {meta.get('kind', 'long')}; load "
             f"average {meta['load_avg']:.2f}. Decode tokens/s: the tokens after each row's first over the pass less the "
             f"target's prefill (timed alone). Context L = prompt + generated "
             f"tokens + draft depth <= L. Speedup is over our autoregressive loop at the same length, same process.",
             "", f"FOLD parameters: {meta['params']}"]
    if notes:
        intro += [""] + [f"- {n}" for n in notes]
    return write_outputs(out, meta, rows, COLUMNS, plot_long, title=f"FOLD on long contexts ({meta['setup']})",
                         intro=intro, extra={"notes": notes})


TUNE_COLUMNS = [Column("drafter", "drafter", right=False),
                Column("window", lambda r: r["window"] if r["window"] is not None else "plain", "{}"),
                Column("lambda", "lambda"), Column("tau per length", lambda r: str([round(t, 3) for t in r["taus"]]),
                                                   right=False),
                Column("mean tau", "mean_tau", "{:.3f}")]


def write_tune(result, base, out: Path, meta: dict) -> Path:
    """<out>.md and .json ({"meta", "rows": the grid, "lengths", "chosen"}; `--params` reads "chosen")."""
    intro = [f"Lengths {result['lengths']}; variant \"fold (both)\"; sinks={base.sinks}, chunk={base.chunk}, "
             f"far = window + chunk, beta rule {base.beta_rule}. Row with no window: the plain drafter."]
    notes = ["Chosen: " + ", ".join(f"{k}: window {v['window']}, lambda {v['lambda']} (mean tau {v['mean_tau']:.3f}"
                                    f" vs plain {v['plain_mean_tau']:.3f})" for k, v in result["chosen"].items())]
    return write_outputs(out, meta, result["grid"], TUNE_COLUMNS, title="FOLD tuning on the validation split",
                         intro=intro, notes=notes, extra={"lengths": result["lengths"], "chosen": result["chosen"]})


# ----------------------------------------------------------------------------- main

def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m tools.bench_long",
                                 description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(REPO / "models/code-target"))
    ap.add_argument("--draft", default=str(REPO / "models/code-draft"), help="lm drafter directory")
    ap.add_argument("--feature", default=str(REPO / "models/code-target-feature"), help="feature drafter directory")
    ap.add_argument("--drafters", default=None, help="comma-separated subset of lm,feature (default: those present)")
    ap.add_argument("--lengths", default=None, help="context lengths (default 1024,2048,4096,8192; smoke 160,256,512)")
    ap.add_argument("--prompts", type=int, default=None, help="prompts per length (default 4; smoke 2)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--new-tokens", type=int, default=None, help="default 64 (smoke 12)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--weights", default="float32", choices=("float32", "bfloat16", "int8"),
                    help="the target's projection weights (load_model(weights=)); bf16 / int8 with the batch-invariant "
                         "attention, so every row equals AR at the same weights")
    ap.add_argument("--kind", default="long", choices=("long", "long-code", "long-chat"),
                    help="long: the start of the longest test files (cut to L); long-code / long-chat: "
                         "train.prompts.long_prompts (a module up to a def line; a module and a question, chat template)")
    ap.add_argument("--tuned", action="store_true", help="load each drafter at its shipped settings (tuned.json: draft "
                    "vocabulary, draft weights, and its tree unless --tree-lm / --tree-feature is given)")
    ap.add_argument("--ngram", action="store_true", help="also the n-gram drafter's row (--tree-ngram)")
    ap.add_argument("--switch", action="store_true",
                    help="also the Switch (ngram|DRAFTER, min_match 3) over each drafter, plain and with FOLD")
    ap.add_argument("--tree-ngram", default="chain=8")
    ap.add_argument("--tree-lm", default=None, help=f"default {TREES['lm']} (--tuned: the drafter's tuned tree)")
    ap.add_argument("--tree-feature", default=None, help=f"default {TREES['feature']} (--tuned: the drafter's tuned tree)")
    ap.add_argument("--sinks", type=int, default=None, help="default 4 (smoke 2)")
    ap.add_argument("--window", type=int, default=None, help="default 256 (smoke 32); --tune chooses it")
    ap.add_argument("--lambda", dest="lam", type=float, default=None, help="default 0.5; --tune chooses it")
    ap.add_argument("--chunk", type=int, default=None, help="lm drafter prefill chunk (default 64; smoke 16)")
    ap.add_argument("--beta", default="log-ratio", choices=list(fold_lib.BETA_RULES))
    ap.add_argument("--impl", default=None, choices=list(fold_lib.IMPLS),
                    help="far_attention impl (default: Triton on an NVIDIA GPU, the jnp reference elsewhere)")
    ap.add_argument("--no-warmup", action="store_true",
                    help="no untimed warm-up call per method: tau is the same, tokens/s then includes compilation "
                         "(for long contexts on a slow machine, where a prefill takes a minute)")
    ap.add_argument("--tune-only", action="store_true", help="with --tune: write the tuning and stop (the report "
                                                                 "runs later, at other lengths, and reads it)")
    ap.add_argument("--tune", action="store_true", help="choose window and lambda on the validation split first")
    ap.add_argument("--tune-windows", default=None, help="default 128,256 (smoke 16,32)")
    ap.add_argument("--tune-lambdas", default="0,0.25,0.5,1")
    ap.add_argument("--tune-prompts", type=int, default=None, help="validation prompts per length (default 2; smoke 1)")
    ap.add_argument("--params", default=None,
                    help="tuned values to use (default <out>_tune.json when it exists and --tune is not given)")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"comma-separated subset of: {', '.join(VARIANTS)} (default: all)")
    ap.add_argument("--smoke", action="store_true", help="tiny random models: checks the tool, measures nothing real")
    ap.add_argument("--out", default=str(REPO / "bench/bench_long"))
    args = ap.parse_args(argv)

    smoke = args.smoke
    args.lengths = [int(x) for x in (args.lengths or ("160,256,512" if smoke else "1024,2048,4096,8192")).split(",")]
    args.prompts = args.prompts or (2 if smoke else 4)
    args.new_tokens = args.new_tokens or (12 if smoke else 64)
    if smoke:
        args.repeats = min(args.repeats, 1)
    args.tree_given = {"lm": args.tree_lm is not None, "feature": args.tree_feature is not None}
    args.trees = {"lm": args.tree_lm or TREES["lm"], "feature": args.tree_feature or TREES["feature"]}
    variants = [v.strip() for v in args.variants.split(",")]
    if any(v not in VARIANTS for v in variants):
        ap.error(f"--variants: choose from {', '.join(VARIANTS)}")
    args.tune_windows = [int(x) for x in (args.tune_windows or ("16,32" if smoke else "128,256")).split(",")]
    args.tune_lambdas = [float(x) for x in args.tune_lambdas.split(",")]
    base = FoldConfig(sinks=args.sinks if args.sinks is not None else (2 if smoke else 4),
                      window=args.window or (32 if smoke else 256),
                      sharpen=args.lam if args.lam is not None else 0.5,
                      chunk=args.chunk or (16 if smoke else 64), beta_rule=args.beta, impl=args.impl)
    out = Path(args.out)
    tune_out = out.with_name(out.name + "_tune")

    if smoke:
        target, drafters, prompt_sets = smoke_setup(args)
    else:
        if not os.path.isdir(args.target):
            ap.error(f"{args.target}: no target model (train the zoo first: see train/README.md)")
        target, drafters, prompt_sets = zoo_setup(args)
    if args.drafters:
        keep = args.drafters.split(",")
        missing = [k for k in keep if k not in drafters]
        if missing:
            ap.error(f"--drafters: not available: {missing} (have {sorted(drafters)})")
        drafters = {k: drafters[k] for k in keep}
    if not drafters:
        ap.error("no lm or feature drafter found (--draft / --feature)")
    max_pos = target.config.max_position_embeddings
    notes = []

    # per-drafter FOLD parameters: tuned on validation, or a previous tuning, or the flags
    per_drafter = {k: base for k in drafters}
    params_src = "flags / defaults (not tuned)"
    if args.tune:
        n_test = args.prompts
        args.prompts = args.tune_prompts or (1 if smoke else 2)  # prompt_sets reads args.prompts
        result = tune(target, drafters, prompt_sets("validation"), args, base)
        args.prompts = n_test
        md = write_tune(result, base, tune_out, run_meta("bench_long", argv, setup="smoke: tiny random models"
                                                         if smoke else f"zoo: {Path(args.target).name}"))
        if args.tune_only:
            print(md.read_text())
            return 0
        tuned, params_src = result["chosen"], f"tuned on validation ({tune_out.with_suffix('.md').name})"
    elif args.params or tune_out.with_suffix(".json").exists():
        path = Path(args.params) if args.params else tune_out.with_suffix(".json")
        tuned, params_src = json.loads(path.read_text())["chosen"], f"tuned on validation ({path.name})"
    else:
        tuned = {}
    for k, v in tuned.items():
        if k in per_drafter:
            per_drafter[k] = dataclasses.replace(base, window=v["window"], sharpen=v["lambda"],
                                                 far_distance=v["window"] + base.chunk)

    test = prompt_sets("test")
    rows = []
    for L in args.lengths:
        if L > max_pos:
            notes.append(f"context {L} skipped: beyond the target's max_position_embeddings ({max_pos})")
            continue
        prompts = cut(test, L, args.new_tokens)
        if not prompts:
            notes.append(f"context {L} skipped: no test-split file is that long")
            continue
        groups = groups_of(prompts, args.batch)
        flat = [p for g in groups for p in g]
        print(f"[bench_long] L={L}: autoregressive ...", file=sys.stderr, flush=True)
        pre_s = prefill_seconds(target, groups)
        ar = with_decode_speed(timed(target, groups, args.new_tokens, args.repeats, warm=not args.no_warmup), pre_s, len(flat))

        def add(name, v, d, tree, cfg, diag_drafter):
            print(f"[bench_long] L={L}: {name} {v} ...", file=sys.stderr, flush=True)
            r = with_decode_speed(timed(target, groups, args.new_tokens, args.repeats, d, tree, warm=not args.no_warmup),
                                  pre_s, len(flat))
            diag = (fold_diagnostics.attention_diagnostics(target, diag_drafter, flat[: min(len(flat), 2)])
                    if diag_drafter is not None else {"entropy": None, "far_mass": None, "total": None})
            vcfg = variant_config(v, cfg) if cfg is not None else None
            rows.append({"drafter": name, "length": L, "prompt_tokens": len(flat[0]), "variant": v,
                         "fold": None if vcfg is None else vcfg.describe(), "tau": r["tau"],
                         "tokens_per_s": r["tokens_per_s"], "speedup": r["tokens_per_s"] / ar["tokens_per_s"],
                         "ar_tokens_per_s": ar["tokens_per_s"], "decode_tokens_per_s": r["decode_tokens_per_s"],
                         "decode_speedup": r["decode_tokens_per_s"] / ar["decode_tokens_per_s"],
                         "ar_decode_tokens_per_s": ar["decode_tokens_per_s"], "prefill_s": pre_s,
                         "entropy": diag["entropy"], "far_mass": diag["far_mass"], "attn_total": diag["total"],
                         "n_far": max(0, len(flat[0]) - cfg.window - cfg.sinks) if cfg is not None else None,
                         **{k: v for k, v in greedy_check(target, flat, ar["sequences"], r["sequences"]).items()}})

        if args.ngram:
            add("ngram", "plain", NgramDrafter(), args.tree_ngram, None, None)
        for name, drafter in drafters.items():
            cfg = per_drafter[name]
            for v in variants:
                add(name, v, drafter.with_fold(variant_config(v, cfg)), args.trees[name], cfg,
                    drafter.with_fold(diagnostic_config(v, cfg)))
            if args.switch:  # the Switch over this drafter, plain and with FOLD on its model part
                for v in ("plain", "fold (both)"):
                    sw = Switch(NgramDrafter(), drafter.with_fold(variant_config(v, cfg)), model_tree=args.trees[name],
                                min_match=3)
                    add(f"ngram|{name}", v, sw, args.tree_ngram, cfg, None)
        Path(str(out) + ".partial.json").write_text(json.dumps(rows) + "\n")  # a stopped run keeps its lengths
    meta = run_meta("bench_long", argv, setup="smoke: tiny random models" if smoke else f"zoo: {Path(args.target).name}",
                    n_prompts=args.prompts, new_tokens=args.new_tokens, batch=args.batch, repeats=args.repeats,
                    params="; ".join(f"{k}: {c.describe()}" for k, c in per_drafter.items()) + f" — {params_src}",
                    warmup=not args.no_warmup, trees={k: args.trees[k] for k in drafters}, weights=args.weights,
                    kind=args.kind)
    md = write_long_outputs(rows, notes, meta, out)
    Path(str(out) + ".partial.json").unlink(missing_ok=True)
    print(md.read_text())
    bad = [(r["drafter"], r["length"], r["variant"]) for r in rows if r["mismatch"]]
    if bad:  # FOLD changes only the drafter: greedy output must not move (near-ties aside)
        print(f"GREEDY MISMATCH (check for near-ties) in {bad}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
