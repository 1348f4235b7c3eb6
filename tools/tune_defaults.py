"""Tunes a shipped drafter's defaults on validation prompts and records them beside its weights
(`tuned.json`, `specjax.drafters.tuned`): every candidate (tree x draft vocabulary x own weight dtype)
is timed greedy in one process against the autoregressive row, on prompts of the validation split (code)
or chats the benches do not use (`--chat-prompts` lines past the test ones); the fastest candidate
whose output equals AR's is written, with the table and the command.

    python -m tools.tune_defaults --target models/code-target --drafter models/code-target-feature \
        --trees 'chain=3;chain=5' --draft-vocab 2048 --prompts 8 --new-tokens 96 --write

`--smoke` runs it on tiny random models (the test). A candidate that does not apply (a draft vocabulary
for a drafter without one) is refused by `load_drafter` before anything is timed.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from pathlib import Path

from tools.harness import batches, generation_row, greedy_check, run_meta, time_generation, with_speedup


def candidates(trees, vocabs, weights):
    """(tree, draft_vocab, draft_weights) for every combination (None: the drafter's own)."""
    return list(itertools.product(trees, vocabs or [None], weights or [None]))


def tune(target, load, prompts, cands, *, new_tokens: int, repeats: int, batch: int = 1, log=print):
    """Rows for AR and every candidate (`load(draft_vocab, draft_weights)` gives the drafter), and the
    best candidate's row: the most tokens/s among those whose greedy output equals AR's."""
    groups = batches(prompts, batch)
    kw = dict(max_new_tokens=new_tokens, eos_token_id=())
    res, times = time_generation(target, groups, repeats, **kw)
    ar = {"method": "ar", **generation_row(res, times, speculative=False)}
    ar["speedup"] = 1.0
    log(f"ar: {ar['tokens_per_s']:.1f} tokens/s")
    rows, loaded = [ar], {}
    for tree, vocab, weights in cands:
        key = (vocab, weights)
        if key not in loaded:
            loaded[key] = load(vocab, weights)
        d = loaded[key]
        res, times = time_generation(target, groups, repeats, drafters=[d], tree=tree, **kw)
        row = with_speedup({"method": f"{tree} vocab={vocab or 'full'} weights={weights or 'float32'}",
                            "tree": tree, "draft_vocab": vocab, "draft_weights": weights,
                            **generation_row(res, times, speculative=True, drafter=d)}, ar)
        row["check"] = greedy_check(target, prompts, ar["sequences"], row["sequences"])
        log(f"{row['method']}: {row['tokens_per_s']:.1f} tokens/s ({row['speedup']:.2f}x), tau {row['tau']:.2f}, "
            f"check {row['check']}")
        rows.append(row)
    exact = [r for r in rows[1:] if r["check"]["mismatch"] == 0]
    best = max(exact, key=lambda r: r["tokens_per_s"]) if exact else None
    return rows, best


def record(best: dict, meta: dict, rows: list[dict], tuned_on: str) -> dict:
    from specjax.drafters import tuned as tuned_lib
    return {"format": tuned_lib.FORMAT, "tree": best["tree"], "draft_vocab": best["draft_vocab"],
            "draft_weights": best["draft_weights"], "fold": None,
            "tuned_on": f"{tuned_on}; {meta['cpu']}, {meta['date'][:10]}; {best['speedup']:.2f}x over AR, tau "
                        f"{best['tau']:.2f} (candidates: " + "; ".join(
                            f"{r['method']} {r['speedup']:.2f}x" for r in rows[1:]) + ")",
            "command": meta["command"]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=None)
    ap.add_argument("--drafter", default=None, help="the drafter directory whose tuned.json is written")
    ap.add_argument("--trees", default="chain=3;chain=4;chain=5", help="candidate trees, ';'-separated")
    ap.add_argument("--draft-vocab", default="", help="candidate draft vocabularies, comma-separated (default: full)")
    ap.add_argument("--draft-weights", default="", help="candidate own-weight dtypes, comma-separated (default: float32)")
    ap.add_argument("--weights", default="float32", choices=("float32", "bfloat16", "int8"), help="the target's")
    ap.add_argument("--kind", default="functions", help="validation code prompts (a train.prompts kind), 'chat' (chats "
                    "the test benches do not use), or several joined by '+' (the prompts split between them)")
    ap.add_argument("--chat-prompts", default="bench/prompts/chat.jsonl")
    ap.add_argument("--chat-skip", type=int, default=8, help="chats the test benches use, skipped (default 8)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--write", action="store_true", help="write the best candidate to DRAFTER/tuned.json")
    ap.add_argument("--out", default=None, help="also write the rows (JSON) here")
    ap.add_argument("--smoke", action="store_true", help="tiny random models, 2 prompts (the test)")
    args = ap.parse_args(argv)
    trees = [t for t in args.trees.split(";") if t]
    vocabs = [int(v) for v in args.draft_vocab.split(",") if v]
    weights = [w for w in args.draft_weights.split(",") if w]

    import specjax
    from specjax.drafters import load_drafter
    if args.smoke:
        from tools.harness import smoke_models
        _, target, draft = smoke_models()
        from specjax.drafters import LMDrafter
        prompts = [list(range(3, 30)), list(range(5, 40))]
        tuned_on = "tiny random models (--smoke)"

        def load(vocab, w):
            d = LMDrafter(draft)
            return d if w in (None, "float32") else d.with_weights(w)
    else:
        if not (args.target and args.drafter and os.path.isdir(args.drafter)):
            ap.error("--target and --drafter (a drafter directory) are needed, or --smoke")
        invariant = args.weights != "float32"
        target = specjax.load_model(args.target, weights=args.weights, invariant=invariant)
        tok = specjax.load_tokenizer(args.target)
        kinds = args.kind.split("+")  # e.g. functions+chat: half the prompts of each
        per = [args.prompts // len(kinds) + (i < args.prompts % len(kinds)) for i in range(len(kinds))]
        prompts, said = [], []
        for kind, n in zip(kinds, per):
            if kind == "chat":
                from specjax.io.chat import render_chat
                lines = [json.loads(x) for x in Path(args.chat_prompts).read_text().splitlines() if x.strip()]
                chats = lines[args.chat_skip:args.chat_skip + n]
                prompts += [tok.encode(render_chat(args.target, r["messages"])).ids for r in chats]
                said.append(f"{len(chats)} chats of {args.chat_prompts} past the {args.chat_skip} the test benches use")
            else:
                from train import prompts as prompt_sets
                prompts += [p["ids"] for p in prompt_sets.prompt_set(kind, tok, n, split="validation")]
                said.append(f"{n} validation-split {kind} prompts")
        tuned_on = f"{' and '.join(said)}, {args.new_tokens} new tokens, target weights {args.weights}"

        def load(vocab, w):
            return load_drafter(args.drafter, target, target_path=args.target, draft_vocab=vocab, draft_weights=w,
                                tuned=False)
    rows, best = tune(target, load, prompts, candidates(trees, vocabs, weights), new_tokens=args.new_tokens,
                      repeats=args.repeats)
    meta = run_meta("tune_defaults", argv, prompts=len(prompts), new_tokens=args.new_tokens)
    if args.out:
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": [{k: v for k, v in r.items() if k != "sequences"}
                                                                    for r in rows]}, indent=1) + "\n")
    if best is None:
        print("no candidate reproduced AR's output: nothing recorded", file=sys.stderr)
        return 1
    rec = record(best, meta, rows, tuned_on)
    print(json.dumps(rec, indent=1))
    if args.write:
        if args.smoke:
            ap.error("--write needs a drafter directory, not --smoke")
        Path(args.drafter, "tuned.json").write_text(json.dumps(rec, indent=1) + "\n")
        print(f"wrote {args.drafter}/tuned.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
