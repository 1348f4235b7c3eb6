"""`make demo`: complete real prompts from the corpus's test split with the zoo's `code-target`,
autoregressive and speculative side by side (the same text, tau, measured speedup).

First at batch 1 with the configuration that `bench/bench_spec.json` measured fastest on this
kind of machine (the bench's greedy winner; lm chain=4 where no bench is present), then the same
configuration at batch 4, then the other zoo drafters at batch 1. Every speedup is measured here,
now; where speculation does not pay, the demo says so.

    python -m tools.demo [--model models/code-target] [--drafter models/code-draft|models/code-target-feature|ngram]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from tools.harness import REPO

DRAFTERS = {"lm": "models/code-draft", "feature": "models/code-target-feature", "ngram": "ngram"}
FALLBACK = ("lm", "chain=4")


def timed(fn):
    fn()  # compile + warm-up, untimed
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def bench_winner(bench_json: Path) -> tuple[str, str, str]:
    """(drafter kind, tree, where it came from): the fastest greedy method of the bench table."""
    try:
        rows = json.loads(bench_json.read_text())["rows"]
    except (OSError, ValueError, KeyError):
        return (*FALLBACK, "no bench table here: the default")
    best = None
    for r in rows:
        kind, _, tree = r["method"].partition(" ")
        if kind not in DRAFTERS or not tree or "T=" in tree or r.get("temperature", 0) != 0:
            continue
        if best is None or r["speedup"] > best["speedup"]:
            best = r
    if best is None:
        return (*FALLBACK, "the bench table has no speculative greedy row: the default")
    kind, _, tree = best["method"].partition(" ")
    return kind, tree, f"{bench_json.relative_to(REPO)}: {best['speedup']:.2f}x at batch 1 there"


def verdict(speedup: float) -> str:
    if speedup >= 1.05:
        return f"speculation pays: {speedup:.2f}x"
    if speedup > 0.95:
        return f"speculation does not pay here: {speedup:.2f}x (within noise of autoregressive)"
    return f"speculation does not pay here: {speedup:.2f}x, slower than autoregressive decoding"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.demo",
                                 description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(REPO / "models/code-target"))
    ap.add_argument("--drafter", action="append", default=None,
                    help="drafter(s) to show (default: the bench's winner first, then every zoo drafter present)")
    ap.add_argument("--tree", default=None, help="tree spec for the speculative runs (default per drafter)")
    ap.add_argument("--prompts", type=int, default=4, help="prompts (the batch of the batch-4 line)")
    ap.add_argument("--new-tokens", type=int, default=96)
    args = ap.parse_args(argv)
    from specjax.io.checkpoint import has_weights
    if not has_weights(args.model):
        print(f"{args.model}: no trained model here yet. The zoo is trained by `make models` "
              f"(hours on a 2-core CPU; see configs/ and train/README.md).", file=sys.stderr)
        return 1

    import specjax
    from specjax.drafters import load_drafter, named_drafter
    from train import prompts as prompt_sets

    model = specjax.load_model(args.model)
    tok = specjax.load_tokenizer(args.model)
    cases = prompt_sets.prompt_set("functions", tok, args.prompts, context_tokens=192)
    ids = [c["ids"] for c in cases]
    kw = dict(max_new_tokens=args.new_tokens, eos_token_id=())
    kind, tree, why = bench_winner(REPO / "bench/bench_spec.json")
    order = [kind] + [k for k in DRAFTERS if k != kind]
    names = args.drafter or [DRAFTERS[k] for k in order if named_drafter(DRAFTERS[k]) or (REPO / DRAFTERS[k]).is_dir()]

    def run(drafter, tree, prompts):
        return timed(lambda: specjax.generate(model, prompts, drafters=[drafter] if drafter else (),
                                              tree=tree if drafter else None, **kw))

    def line(label, drafter, tree, prompts, ar, t_ar):
        res, t = run(drafter, tree, prompts)
        same = res.sequences() == ar.sequences()
        print(f"== {label}: tau {float(res.stats['tau'].mean()):.2f}, {int(res.lengths.sum()) / t:.0f} tokens/s "
              f"(autoregressive {int(ar.lengths.sum()) / t_ar:.0f}); {verdict(t_ar / t)}; "
              f"same text as autoregressive: {same} ==")
        return res

    print(f"== {Path(args.model).name}, batch 1, {args.new_tokens} new tokens, float32; "
          f"configuration: {kind} {tree} ({why}) ==\n")
    drafters = {}
    for name in names:
        d = load_drafter(str(REPO / name) if not named_drafter(name) and not Path(name).is_dir() else name, model,
                         target_path=args.model)
        drafters[name] = d
    first = names[0]
    # Batch 1: one prompt at a time, its text shown once.
    ar1 = [run(None, None, [p]) for p in ids[:2]]
    for c, (ar, _) in zip(cases, ar1):
        print(f"--- {c['path']} ---\n{c['text'][-300:]}\033[1m{tok.decode(ar.sequences()[0])}\033[0m\n")
    t_ar1 = sum(t for _, t in ar1)
    n_ar1 = sum(int(a.lengths.sum()) for a, _ in ar1)
    for name in names:
        d = drafters[name]
        t_name = args.tree or d.default_tree  # the drafter's recorded (tuned) tree where it has one
        runs = [run(d, t_name, [p]) for p in ids[:2]]
        t = sum(t for _, t in runs)
        same = all(r.sequences() == a.sequences() for (r, _), (a, _) in zip(runs, ar1))
        tau = sum(float(r.stats["tau"].mean()) for r, _ in runs) / len(runs)
        print(f"== batch 1, {d.name} {t_name}: tau {tau:.2f}, {n_ar1 / t:.0f} tokens/s (autoregressive "
              f"{n_ar1 / t_ar1:.0f}); {verdict(t_ar1 / t)}; same text as autoregressive: {same} ==")
        if name == first:  # the winner at batch 4 right after its batch-1 line
            ar4, t_ar4 = run(None, None, ids)
            line(f"batch {len(ids)}, {d.name} {t_name}", d, t_name, ids, ar4, t_ar4)
    return 0


if __name__ == "__main__":
    sys.exit(main())
