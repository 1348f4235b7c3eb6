"""`make demo`: complete a few real prompts from the corpus's test split with the zoo's
`code-target`, autoregressive and speculative side by side (the same text, tau, speedup).

    python tools/demo.py [--model models/code-target] [--drafter models/code-target-feature|models/code-draft|ngram]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def timed(fn):
    fn()  # compile + warm-up, untimed
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(REPO / "models/code-target"))
    ap.add_argument("--drafter", action="append", default=None,
                    help="drafter(s) to compare with (default: every zoo drafter present, and ngram)")
    ap.add_argument("--tree", default=None, help="tree spec for the speculative runs (default per drafter)")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=96)
    args = ap.parse_args(argv)
    from specjax.checkpoint import has_weights
    if not has_weights(args.model):
        print(f"{args.model}: no trained model here yet. The zoo is trained by `make models` "
              f"(hours on a 2-core CPU; see configs/ and train/README.md).", file=sys.stderr)
        return 1

    import specjax
    from specjax.drafters import load_drafter
    from train import prompts as prompt_sets

    model = specjax.load_model(args.model)
    tok = specjax.load_tokenizer(args.model)
    cases = prompt_sets.prompt_set("functions", tok, args.prompts, context_tokens=192)
    ids = [c["ids"] for c in cases]
    kw = dict(max_new_tokens=args.new_tokens, eos_token_id=())
    ar, t_ar = timed(lambda: specjax.generate(model, ids, **kw))
    n_ar = int(ar.lengths.sum())
    print(f"== {Path(args.model).name}: autoregressive, batch {len(ids)}: "
          f"{1000 * t_ar / max(ar.lengths):.1f} ms/step, {n_ar / t_ar:.0f} tokens/s ==\n")
    for c, seq in zip(cases, ar.sequences()):
        print(f"--- {c['path']} ---\n{c['text'][-300:]}\033[1m{tok.decode(seq)}\033[0m\n")

    names = args.drafter
    if names is None:
        names = [str(REPO / d) for d in ("models/code-target-feature", "models/code-draft") if (REPO / d).is_dir()]
        names.append("ngram")
    trees = {"ngram": "chain=6"}
    for name in names:
        drafter = load_drafter(name, model, target_path=args.model)
        tree = args.tree or trees.get(name, "depth=6,topk=6,nodes=24" if drafter.name == "feature" else "chain=4")
        res, t = timed(lambda: specjax.generate(model, ids, drafters=[drafter], tree=tree, **kw))
        same = res.sequences() == ar.sequences()
        print(f"== speculative, drafter {Path(name).name} ({drafter.name}), tree {tree}: "
              f"tau {float(res.stats['tau'].mean()):.2f}, {int(res.lengths.sum()) / t:.0f} tokens/s, "
              f"speedup {t_ar / t:.2f}x over autoregressive; same text as autoregressive: {same} ==")
    return 0


if __name__ == "__main__":
    sys.exit(main())
