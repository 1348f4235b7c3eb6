"""Where a speculative round's time goes, and the τ each method needs to pay for itself.

1. The target's forward over a block of T tokens on top of a cached prompt (T = 1 is one
   autoregressive step; T = tree nodes + 1 is a verification): ms and the ratio to T = 1.
2. For each drafter and tree: ms per round of the whole jitted loop (wall / rounds), split into
   the verification forward (from 1) and the rest (drafting, drafter commit, verification rule,
   cache commit, bookkeeping); the break-even τ (ms per round / ms per autoregressive token), the
   measured τ, and the speedup it implies (τ × AR ms/token / ms per round).

    python tools/bench_round.py                 # zoo models (random weights of the zoo's shapes if absent)
    python tools/bench_round.py --smoke         # tiny random models (what the test runs)

Medians over repeats after a warm-up call; float32. Writes bench/<out>.md and .json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import specjax  # noqa: E402
from specjax.drafters import FeatureDrafter, LMDrafter, NgramDrafter, load_drafter  # noqa: E402
from specjax.drafters.feature import FeatureConfig, FeatureHead  # noqa: E402
from specjax.models import family, transformer  # noqa: E402

DEFAULT_TREES = {"ngram": ["chain=5"], "lm": ["chain=4", "depth=5,topk=4,nodes=16"],
                 "feature": ["chain=3", "chain=5", "depth=5,topk=4,nodes=16"]}


def median_ms(fn, repeats: int) -> float:
    jax.block_until_ready(fn())  # compile + warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def forward_costs(target, prompt_len: int, blocks: list[int], repeats: int) -> dict[int, float]:
    fam = family(target)
    graphdef, state = nnx.split(target)
    B, C = 1, prompt_len + max(blocks) + 1
    toks = jnp.asarray(np.random.default_rng(0).integers(3, target.config.vocab_size, (B, prompt_len)), jnp.int32)
    cache = fam.prefill(target, toks, jnp.array([prompt_len]), fam.init_cache(target, B, C)).cache

    @jax.jit
    def block(state, cache, tokens_BxT):
        model = nnx.merge(graphdef, state)
        T = tokens_BxT.shape[1]
        pos = cache.length[:, None] + jnp.arange(T)[None]
        return fam.forward(model, tokens_BxT, pos, cache, transformer.causal_mask(B, T)).logits

    return {T: median_ms(lambda T=T: block(state, cache, jnp.full((B, T), 5, jnp.int32)), repeats) for T in blocks}


def tree_nodes(spec: str) -> int:
    from specjax import tree as tree_lib
    return tree_lib.parse_tree_spec(spec).num_nodes


def load_models(args):
    """(target, {name: drafter}, prompts, what) — the zoo if present, else random weights of its shapes."""
    if args.smoke:
        from tools.bench import smoke_models
        cfg, target, draft = smoke_models()
        head = FeatureHead(FeatureConfig.for_target(cfg), nnx.Rngs(0))
        rng = np.random.default_rng(0)
        prompts = [(rng.integers(0, 64, 6).tolist() * 8)[:40]]
        return target, {"ngram": NgramDrafter(), "lm": LMDrafter(draft), "feature": FeatureDrafter(head, target)}, \
            prompts, "tiny random models (--smoke)"
    tdir = Path(args.target)
    if (tdir / "config.json").exists():
        target = specjax.load_model(str(tdir))
        tok = specjax.load_tokenizer(str(tdir))
        from train import prompts as prompt_sets
        prompts = [c["ids"] for c in prompt_sets.prompt_set("functions", tok, args.prompts, context_tokens=args.context)]
        drafters = {"ngram": NgramDrafter()}
        for name, d in (("lm", args.draft), ("feature", args.feature)):
            if d and Path(d).is_dir():
                drafters[name] = load_drafter(d, target, target_path=str(tdir))
        return target, drafters, prompts, f"zoo: {tdir.name}"
    from train import lm
    tcfg = lm.load_config(REPO / "configs/code-target.json").model
    dcfg = lm.load_config(REPO / "configs/code-draft.json").model
    target = transformer.init_model(tcfg, 0)
    head = FeatureHead(FeatureConfig.for_target(tcfg, (1, 4, 6), 1536), nnx.Rngs(0))
    rng = np.random.default_rng(0)
    prompts = [[0] + rng.integers(3, tcfg.vocab_size, args.context - 1).tolist() for _ in range(args.prompts)]
    return target, {"ngram": NgramDrafter(), "lm": LMDrafter(transformer.init_model(dcfg, 1)),
                    "feature": FeatureDrafter(head, target)}, prompts, \
        "random weights of the zoo's shapes (no trained zoo here): costs only, tau meaningless"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(REPO / "models/code-target"))
    ap.add_argument("--draft", default=str(REPO / "models/code-draft"))
    ap.add_argument("--feature", default=None,
                    help="feature drafter (default: the target's own, TARGET-feature, where it exists; '' for none)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.feature is None:  # a feature drafter reads its own target's features: never another target's
        args.feature = f"{args.target.rstrip('/')}-feature"
    if args.smoke:
        args.new_tokens, args.repeats, args.context = 12, 1, 40
    out = Path(args.out or REPO / ("bench/bench_round_smoke" if args.smoke else "bench/bench_round"))
    target, drafters, prompts, what = load_models(args)
    # --smoke: one chain per drafter, so the few compiles stay cheap.
    trees = {name: ["chain=4"] if args.smoke else DEFAULT_TREES[name] for name in drafters}
    blocks = sorted(({1} if args.smoke else {1, 2, 4, 8, 16}) | {tree_nodes(t) for ts in trees.values() for t in ts})
    fwd = forward_costs(target, args.context, blocks, max(args.repeats * 3, 3))

    kw = dict(max_new_tokens=args.new_tokens, eos_token_id=())
    rows = []
    ar_ms = []
    for p in prompts:  # one prompt at a time: batch 1, the latency case
        ar_ms.append(median_ms(lambda p=p: specjax.generate(target, [p], **kw).tokens, args.repeats) / args.new_tokens)
    ar = statistics.median(ar_ms)
    for name, drafter in drafters.items():
        for spec in trees[name]:
            per_round, taus = [], []
            for p in prompts:
                res = specjax.generate(target, [p], drafters=[drafter], tree=spec, **kw)
                ms = median_ms(lambda p=p: specjax.generate(target, [p], drafters=[drafter], tree=spec, **kw).tokens,
                               args.repeats)
                per_round.append(ms / int(res.stats["rounds"][0]))
                taus.append(float(res.stats["tau"][0]))
            ms_round, tau = statistics.median(per_round), statistics.mean(taus)
            verify = fwd[tree_nodes(spec)]
            rows.append({"drafter": name, "tree": spec, "nodes": tree_nodes(spec), "ms_round": ms_round,
                         "verify_ms": verify, "rest_ms": ms_round - verify, "break_even_tau": ms_round / ar,
                         "tau": tau, "speedup": tau * ar / ms_round})
    result = {"what": what, "ar_ms_per_token": ar, "forward_ms": fwd, "rounds": rows,
              "context": args.context, "new_tokens": args.new_tokens, "prompts": len(prompts),
              "repeats": args.repeats, "backend": jax.default_backend(), "command": " ".join(sys.argv)}
    lines = [f"# Where a round's time goes ({what})", "",
             f"Batch 1, prompts of {args.context} tokens, {args.new_tokens} new tokens, greedy, float32, "
             f"{jax.default_backend()}; medians over {args.repeats} repeats. "
             f"Autoregressive: **{ar:.2f} ms/token**.", "",
             "| target forward over T tokens | " + " | ".join(str(T) for T in fwd) + " |",
             "|---|" + "---:|" * len(fwd),
             "| ms | " + " | ".join(f"{v:.2f}" for v in fwd.values()) + " |",
             "| × one step | " + " | ".join(f"{v / fwd[1]:.2f}" for v in fwd.values()) + " |", "",
             "| drafter | tree | nodes | ms/round | verify fwd ms | draft + rest ms | break-even τ | τ | speedup |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['drafter']} | `{r['tree']}` | {r['nodes']} | {r['ms_round']:.2f} | {r['verify_ms']:.2f} | "
                     f"{r['rest_ms']:.2f} | {r['break_even_tau']:.2f} | {r['tau']:.2f} | {r['speedup']:.2f}× |")
    lines += ["", "`nodes` counts the root (the verification block is `nodes` tokens). Speedup = τ × AR ms/token / "
              "ms/round: what the loop gains over autoregressive decoding at this τ.", "",
              f"Command: `{result['command']}`"]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    print("\n".join(lines))
    return result


if __name__ == "__main__":
    main()
