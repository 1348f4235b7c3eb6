"""TreeGraft on the model zoo: does grafting a strong drafter onto a cheap drafter's tree, when the
scheduler says so, beat either drafter alone?

For each drafter pair (cheap+strong: ngram+feature, feature+lm, ngram+lm, ngram+dspark, dspark+lm;
lm = models/code-draft, feature = models/code-target-feature, dspark = models/code-target-dspark) and each prompt set cut from the corpus's TEST split
(functions: function bodies; docstrings: docstrings / comments; tests: repetitive test code;
long: the start of the longest files), greedy, batch 1, EOS ignored:

  cheap-only, strong-only   the engine with one drafter and the verify tree (--tree);
  never / always            TreeGraft with the policy forced (one compiled program for all policies);
  scheduler                 TreeGraft with the distilled scheduler of the pair (--schedulers DIR/<pair>,
                            written by train/distill_scheduler.py; `--train-schedulers` builds them first
                            on TRAIN-split prompts with train/value_system.py);
  oracle                    per round, the better branch in hindsight (both branches run from the same
                            state by `RoundStepper`); its time is the sum of the engine's measured
                            per-round cost of the chosen branch (never / always runs on the same prompts),
                            so it is an estimate, in the same units as the rows above.

Per method: tokens/s (total generated tokens / total time of the timed calls; compilation excluded
by an untimed warm-up per prompt shape), tau (1 + accepted per round); for TreeGraft, the invoke
rate (rounds where the strong drafter ran) and the share of accepted paths (rounds accepting >= 1
token) that pass through a grafted node; the scheduler's held-out accuracy (from its
distill_info.json); and the costs of one scheduler decision, one cheap-drafter proposal and one
strong scoring pass (jitted alone, median). Every TreeGraft row is checked token for token against
the cheap-only output (all are the target's greedy output).

    python -m tools.bench_treegraft --smoke                       # tiny random models (what the test runs)
    python -m tools.bench_treegraft --train-schedulers            # the zoo; builds missing schedulers first

Writes <out>.md, <out>.json and <out>.png (default bench/bench_treegraft; `tools.harness.write_outputs`:
one row per pair, prompt set and method, and the nested "pairs" results).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import jax
import numpy as np
from flax import nnx

import specjax
from specjax.drafters.composite import treegraft_scheduler as sched_lib
from specjax.drafters import DraftContext, LMDrafter, NgramDrafter, drafter_takes, named_drafter
from specjax.spec.sampling import SamplingParams
from specjax.drafters.composite.treegraft import TreeGraft, check_scheduler_drafters
from specjax.engine.stepper import RoundStepper
from tools.harness import (REPO, Column, generation_row, output_path, run_meta, smoke_models, time_generation,
                           write_outputs)
from train.common import repo_relative

# A block drafter (DSpark) rescores exactly in one pass (`can_score`), so it can be the strong drafter;
# as the cheap one it drafts TreeGraft's dynamic candidate tree from its one backbone pass.
PAIRS = ("ngram+feature", "feature+lm", "ngram+lm", "ngram+dspark", "dspark+lm")
SETS = ("functions", "docstrings", "tests", "long")
METHODS = ("cheap-only", "strong-only", "never", "always", "scheduler", "oracle")


# ----------------------------------------------------------------------------- setups

def smoke_setup(seed: int = 0):
    """Tiny random target; lm = a noisy copy of it, feature = a random feature head, ngram.
    Evaluation and training prompts: random and repetitive token sequences."""
    from specjax.drafters import FeatureConfig, FeatureDrafter, FeatureHead
    cfg, target, draft = smoke_models(seed)
    feature = FeatureDrafter(FeatureHead(FeatureConfig.for_target(cfg), nnx.Rngs(seed + 2)), target)
    drafters = {"lm": LMDrafter(draft), "feature": feature, "ngram": NgramDrafter()}
    rng = np.random.default_rng(seed)

    def make(n, repetitive):
        out = []
        for _ in range(n):
            if repetitive:
                out.append((rng.integers(0, 64, 5).tolist() * 8)[: int(rng.integers(12, 30))])
            else:
                out.append(rng.integers(0, 64, int(rng.integers(12, 30))).tolist())
        return out
    eval_sets = {"random": make(2, False), "repetitive": make(2, True)}
    train = make(3, False) + make(3, True)
    return target, drafters, eval_sets, train


def zoo_setup(args):
    from specjax.io.checkpoint import load_tokenizer
    from specjax.drafters import load_drafter
    from train import prompts as prompt_sets
    target = specjax.load_model(args.target)
    tok = load_tokenizer(args.target)
    drafters = {"ngram": NgramDrafter()}
    for name, path in (("lm", args.draft), ("feature", args.feature), ("dspark", args.dspark)):
        if os.path.isdir(path):
            drafters[name] = load_drafter(path, target, target_path=args.target,
                                          draft_vocab=args.draft_vocab if "draft_vocab" in drafter_takes(path) else None, tuned=False)
    eval_sets = {}
    for s in args.sets.split(","):
        if s == "long":
            got = prompt_sets.long_context_prompts(tok, lengths=(args.long_tokens,), per_length=args.prompts_per_set)
            eval_sets[s] = [p["ids"] for p in got[args.long_tokens]]
        else:
            eval_sets[s] = [p["ids"] for p in prompt_sets.prompt_set(s, tok, args.prompts_per_set, split="test",
                                                                    context_tokens=args.context)]
    return target, drafters, eval_sets, tok


# ----------------------------------------------------------------------------- measurements

def engine_run(target, drafter, prompts, tree, new_tokens, repeats) -> dict:
    """The engine with one drafter, batch 1 (`tools.harness.time_generation`: an untimed warm-up per
    prompt shape, then `repeats` timed passes); TreeGraft's invoke rate and grafted share."""
    kw = dict(max_new_tokens=new_tokens, eos_token_id=(), drafters=[drafter], tree=tree)
    results, times = time_generation(target, [[p] for p in prompts], repeats, **kw)
    st = lambda k: np.concatenate([r.stats[k] for r in results]) if k in results[0].stats else None  # noqa: E731
    rounds = st("rounds")
    base = generation_row(results, times, speculative=True)
    row = {"tokens": base["tokens"], "seconds": base["seconds"], "tokens_per_s": base["tokens_per_s"],
           "rounds": int(rounds.sum()), "tau": base["tau"], "round_s": base["seconds"] / max(int(rounds.sum()), 1),
           "sequences": base["sequences"]}
    if st("treegraft_invoked") is not None:
        accepted_paths = int(st("accepted_at_depth")[:, 0].sum())
        row.update(invoke_rate=float(st("treegraft_invoked").sum() / max(rounds.sum(), 1)),
                   grafted_share=float(st("treegraft_grafted_paths").sum() / max(accepted_paths, 1)),
                   grafted_proposed_per_round=float(st("treegraft_grafted_proposed").sum() / max(rounds.sum(), 1)))
    return row


def oracle_run(target, tg, tree, prompts, new_tokens, cost_never, cost_always) -> dict:
    """Per round, the better branch in hindsight by tokens per second of the round, each branch
    costed at the engine's measured per-round time."""
    stepper = RoundStepper(target, tg, tree, max_new_tokens=new_tokens, eos_token_id=())
    stepper.capacity = stepper.capacity_for(prompts)
    tokens, seconds, rounds, acc, invoked, seqs = 0, 0.0, 0, 0, 0, []
    for p in prompts:
        carry = stepper.start([p])
        while not stepper.done(carry):
            c_off, i_off = stepper.step(carry, "never")
            c_on, i_on = stepper.step(carry, "always")
            a_off, a_on = int(np.asarray(i_off["accepted"])[0]), int(np.asarray(i_on["accepted"])[0])
            on = (a_on + 1) / cost_always > (a_off + 1) / cost_never
            carry, info = (c_on, i_on) if on else (c_off, i_off)
            tokens += int(np.asarray(info["emitted"])[0])
            seconds += cost_always if on else cost_never
            rounds, acc, invoked = rounds + 1, acc + (a_on if on else a_off), invoked + int(on)
        seqs += stepper.outputs(carry)
    tokens += len(prompts)  # the first token of each row comes from prefill
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / max(seconds, 1e-9), "rounds": rounds,
            "tau": 1 + acc / max(rounds, 1), "invoke_rate": invoked / max(rounds, 1), "sequences": seqs,
            "estimate": True}


def costs(target, tg: TreeGraft, tree, prompt) -> dict:
    """Median ms of one scheduler decision, one cheap proposal and one strong scoring pass."""
    stepper = RoundStepper(target, tg, tree, max_new_tokens=8, eos_token_id=())
    carry = stepper.start([prompt])
    spec = stepper.spec
    cspec, M, _, _ = tg.plan(spec)
    ctx = DraftContext(cspec, "topk", SamplingParams.make(1.0), jax.random.key(0))
    gc, sc = nnx.split(tg.cheap)
    gs, ss = nnx.split(tg.strong)
    cheap_fn = jax.jit(lambda s, st, root: nnx.merge(gc, s).propose(st, root, ctx).tree)
    tree_c = cheap_fn(sc, carry.dstate.cheap, carry.root)
    strong_fn = jax.jit(lambda s, st, t: nnx.merge(gs, s).score(st, t, cspec.max_depth))
    return {"scheduler_ms": 1e3 * sched_lib.measure_cost(tg.scheduler, 1, M, spec.num_nodes),
            "cheap_propose_ms": 1e3 * sched_lib.time_call(cheap_fn, sc, carry.dstate.cheap, carry.root),
            "strong_score_ms": 1e3 * sched_lib.time_call(strong_fn, ss, carry.dstate.strong, tree_c),
            "cheap_tree_nodes": M}


def build_scheduler(target, tg, tree, train_prompts, sched_dir: Path, values_dir: Path, run_dir: Path, *,
                    new_tokens, steps, provenance: dict, progress=False) -> Path:
    """Value system on training prompts, then distillation, exported to sched_dir."""
    from train import distill_scheduler, value_system
    data = value_system.collect(target, tg, tree, train_prompts, max_new_tokens=new_tokens, progress=progress)
    vdir = value_system.write_dataset(values_dir, data, {**provenance, "config": {"tree": tree,
                                                                                 "max_new_tokens": new_tokens}})
    distill_scheduler.distill([vdir], run_dir, sched_dir,
                              distill_scheduler.DistillConfig(steps=steps, eval_every=max(steps // 4, 1)),
                              progress=progress, overwrite=True)
    return sched_dir


def heldout_accuracy(sched_dir: Path):
    info = sched_dir / "distill_info.json"
    if not info.is_file():
        return None
    d = json.loads(info.read_text())
    return d["heldout"][d["chosen"]]["accuracy"]


# ----------------------------------------------------------------------------- output

def summary_lines(results: dict) -> list[str]:
    """TreeGraft (distilled scheduler) against the best single-drafter strategy (cheap-only or
    strong-only, whichever was faster on that set), and against the fixed policies, per pair and set."""
    lines = ["## Summary: TreeGraft (scheduler) over the best single drafter", "",
             "| pair | set | best single (tokens/s) | scheduler tokens/s | speedup over best single | "
             "vs never | vs always |", "|---|---|---|---:|---:|---:|---:|"]
    ratios = {"single": [], "never": [], "always": []}
    for pair, res in results.items():
        for s, row in res["sets"].items():
            if "scheduler" not in row:
                continue
            best = max(("cheap-only", "strong-only"), key=lambda m: row[m]["tokens_per_s"])
            tg = row["scheduler"]["tokens_per_s"]
            r = {"single": tg / row[best]["tokens_per_s"], "never": tg / row["never"]["tokens_per_s"],
                 "always": tg / row["always"]["tokens_per_s"]}
            for k in ratios:
                ratios[k].append(r[k])
            lines.append(f"| {pair} | {s} | {best} ({row[best]['tokens_per_s']:.1f}) | {tg:.1f} | "
                         f"{r['single']:.3f}x | {r['never']:.3f}x | {r['always']:.3f}x |")
    if ratios["single"]:
        gm = {k: float(np.exp(np.mean(np.log(v)))) for k, v in ratios.items()}
        wins = {k: sum(x > 1 for x in v) for k, v in ratios.items()}
        n = len(ratios["single"])
        lines += [f"| **average** (geometric mean of {n}) | | | | **{gm['single']:.3f}x** | {gm['never']:.3f}x | "
                  f"{gm['always']:.3f}x |", "",
                  f"The scheduler is faster than the best single drafter on {wins['single']}/{n} pair-sets, than "
                  f"never-graft on {wins['never']}/{n}, than always-graft on {wins['always']}/{n}.", ""]
    return lines


COLUMNS = [Column("pair (cheap+strong)", "pair", right=False), Column("set", "set", right=False),
           Column("method", "method", right=False), Column("tokens/s", "tokens_per_s", "{:.1f}"),
           Column("tau", "tau", "{:.2f}"), Column("invoke rate", "invoke_rate", "{:.2f}"),
           Column("grafted share", "grafted_share", "{:.2f}"),
           Column("same as cheap-only", "same_as_cheap", right=False)]


def flat_rows(results: dict) -> list[dict]:
    """One row per pair, prompt set and method (the table and the JSON's "rows")."""
    out = []
    for pair, res in results.items():
        for s, row in res["sets"].items():
            for m in METHODS:
                if m in row:
                    out.append({"pair": pair, "set": s, "method": m, **row[m]})
    return out


def plot_treegraft(results):
    def plot(plt, rows, meta):
        fig, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 4), squeeze=False)
        for ax, (pair, res) in zip(axes[0], results.items()):
            sets = list(res["sets"])
            width = 0.8 / len(METHODS)
            for i, m in enumerate(METHODS):
                vals = [res["sets"][s].get(m, {}).get("tokens_per_s", 0.0) for s in sets]
                ax.bar(np.arange(len(sets)) + i * width, vals, width, label=m)
            ax.set_xticks(np.arange(len(sets)) + 0.4 - width / 2, sets)
            ax.set_title(pair)
            ax.set_ylabel("tokens/s")
        axes[0][0].legend(fontsize=8)
        fig.suptitle(f"TreeGraft — {meta['setup']}")
        fig.tight_layout()
        return fig
    return plot


def write_treegraft_outputs(results: dict, meta: dict, out: Path) -> Path:
    """<out>.md, .json ({"meta", "rows", "pairs"}) and .png through the harness."""
    load = meta.get("load_avg")
    intro = [f"Greedy, batch 1, {meta['new_tokens']} new tokens per prompt, verify tree `{meta['tree']}`, "
             f"{meta['repeats']} timed repeat(s) after an untimed warm-up; float32 on {meta['device']}"
             + (f"; load average {load:.2f}" if load is not None else "") + ". Oracle: per-round hindsight choice, "
             "costed with the engine's measured per-round time of each branch (an estimate). TreeGraft columns: "
             "invoke rate (rounds where the strong drafter ran), share of accepted paths through a grafted node, "
             "greedy output identical to cheap-only (prompts)."]
    notes = []
    for pair, res in results.items():
        c = res["costs"]
        acc = res.get("scheduler_heldout_accuracy")
        notes += [f"{pair} (cheap {pair.split('+')[0]}, strong {pair.split('+')[1]}): costs (median, jitted alone): "
                  f"scheduler decision {c['scheduler_ms']:.3f} ms, cheap proposal ({c['cheap_tree_nodes']}-node tree) "
                  f"{c['cheap_propose_ms']:.3f} ms, strong scoring pass {c['strong_score_ms']:.3f} ms; scheduler / "
                  f"cheap proposal = {c['scheduler_ms'] / max(c['cheap_propose_ms'], 1e-9):.2f}. Scheduler held-out "
                  f"accuracy: {'—' if acc is None else f'{acc:.3f}'} ({res.get('scheduler_dir') or 'no scheduler'}).", ""]
    notes += summary_lines(results)
    strip = lambda r: {k: v for k, v in r.items() if k != "sequences"}  # noqa: E731
    pairs = {p: {**{k: v for k, v in res.items() if k != "sets"},
                 "sets": {s: {m: strip(r) for m, r in d.items()} for s, d in res["sets"].items()}}
             for p, res in results.items()}
    return write_outputs(out, meta, flat_rows(results), COLUMNS, plot_treegraft(results),
                         title=f"TreeGraft benchmark ({meta['setup']})", intro=intro, notes=notes,
                         extra={"pairs": pairs})


# ----------------------------------------------------------------------------- main

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench_treegraft",
                                 description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(REPO / "models/code-target"))
    ap.add_argument("--draft", default=str(REPO / "models/code-draft"), help="the lm drafter")
    ap.add_argument("--feature", default=str(REPO / "models/code-target-feature"), help="the feature drafter")
    ap.add_argument("--dspark", default=str(REPO / "models/code-target-dspark"), help="the block drafter (DSpark)")
    ap.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                    help="the feature drafter's reduced draft vocabulary (the N most frequent tokens it ships)")
    ap.add_argument("--pairs", default=",".join(PAIRS), help="cheap+strong pairs (default: %(default)s)")
    ap.add_argument("--sets", default=",".join(SETS))
    ap.add_argument("--prompts-per-set", type=int, default=8)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--long-tokens", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--tree", default="depth=5,topk=4,nodes=16", help="verify tree (budget and depth)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--schedulers", default=str(REPO / "models/treegraft"), help="DIR/<pair>: distilled schedulers")
    ap.add_argument("--train-schedulers", action="store_true",
                    help="build missing schedulers first (value system on train-split prompts + distillation)")
    ap.add_argument("--value-prompts-per-set", type=int, default=8)
    ap.add_argument("--distill-steps", type=int, default=2000)
    ap.add_argument("--smoke", action="store_true", help="tiny random models: checks the tool, measures nothing real")
    ap.add_argument("--out", default=None, help="output stem (default bench/bench_treegraft[_smoke])")
    ap.add_argument("--render", default=None, metavar="JSON",
                    help="rewrite <stem>.md/.png from a stored <stem>.json (no measurement)")
    args = ap.parse_args(argv)
    if args.render:  # rewrite the table and plot from a stored run, measuring nothing
        stored = json.loads(Path(args.render).read_text())
        print(write_treegraft_outputs(stored["pairs"], stored["meta"], output_path(args.render, "")).read_text())
        return 0
    out = Path(args.out or REPO / ("bench/bench_treegraft_smoke" if args.smoke else "bench/bench_treegraft"))

    if args.smoke:
        target, drafters, eval_sets, train_prompts = smoke_setup()
        args.new_tokens, args.repeats, args.tree = min(args.new_tokens, 12), 1, "depth=3,topk=3,nodes=8"
        sched_root = out.parent / (out.name + "_schedulers")
        args.train_schedulers, args.distill_steps = True, min(args.distill_steps, 60)
    else:
        if not os.path.isdir(args.target):
            ap.error(f"{args.target}: no target model (train the zoo: make models)")
        target, drafters, eval_sets, tok = zoo_setup(args)
        sched_root = Path(args.schedulers)
        train_prompts = None
    results = {}
    for pair in args.pairs.split(","):
        cheap_name, _, strong_name = pair.partition("+")
        if cheap_name not in drafters or strong_name not in drafters:
            print(f"[bench_treegraft] skipping {pair}: drafter missing", file=sys.stderr)
            continue
        cheap, strong = drafters[cheap_name], drafters[strong_name]
        sched_dir = sched_root / pair
        paths = {"lm": args.draft, "feature": args.feature, "dspark": args.dspark, "ngram": "ngram"}
        stale = None  # a scheduler distilled for other weights of these drafters (a drafter retrained since)
        if not args.smoke and (sched_dir / sched_lib.CONFIG_FILE).is_file():
            try:
                check_scheduler_drafters(sched_lib.load_scheduler(str(sched_dir))[2],
                                         [paths[cheap_name], paths[strong_name]], str(sched_dir))
            except ValueError as e:
                stale = str(e)
        if stale and not args.train_schedulers:
            ap.error(f"{stale}\n(add --train-schedulers to re-distil it here)")
        if (stale or not (sched_dir / sched_lib.CONFIG_FILE).is_file()) and args.train_schedulers:
            print(f"[bench_treegraft] {pair}: building the scheduler ...", file=sys.stderr, flush=True)
            if train_prompts is None:
                from train.value_system import training_prompts
                train_prompts = [p["ids"] for p in training_prompts(tok, SETS, args.value_prompts_per_set,
                                                                     context_tokens=args.context,
                                                                     long_tokens=args.long_tokens)]
            if args.smoke:
                values_dir, run_dir = sched_root / f"{pair}-values", sched_root / f"{pair}-run"
                prov = {"models": {"setup": "smoke: tiny random models"}}
            else:
                from train.value_system import sha256_of
                values_dir, run_dir = REPO / "runs/treegraft-values" / pair, REPO / "runs/treegraft-sched" / pair
                prov = {"models": {"target": {"path": repo_relative(args.target), "sha256": sha256_of(args.target)},
                                   **{role: {"spec": repo_relative(paths[n]) if not named_drafter(paths[n]) else n, "kind": n,
                                             "sha256": sha256_of(paths[n]),
                                             **({"draft_vocab": args.draft_vocab} if "draft_vocab" in drafter_takes(paths[n]) else {})}
                                      for role, n in (("cheap", cheap_name), ("strong", strong_name))}},
                        "prompts": {"split": "train", "sets": list(SETS), "per_set": args.value_prompts_per_set,
                                    "context_tokens": args.context, "long_tokens": args.long_tokens}}
            build_scheduler(target, TreeGraft(cheap, strong, policy="never"), args.tree, train_prompts, sched_dir,
                            values_dir, run_dir, new_tokens=args.new_tokens, steps=args.distill_steps,
                            provenance=prov, progress=not args.smoke)
        if (sched_dir / sched_lib.CONFIG_FILE).is_file():
            sched, calibration, _ = sched_lib.load_scheduler(str(sched_dir))
            tg = TreeGraft(cheap, strong, scheduler=sched, policy="scheduler", calibration=calibration)
        else:
            sched_dir = None
            tg = TreeGraft(cheap, strong, policy="never")
        res = {"sets": {}, "scheduler_dir": None if sched_dir is None else repo_relative(sched_dir),
               "scheduler_heldout_accuracy": None if sched_dir is None else heldout_accuracy(sched_dir)}
        for s, prompts in eval_sets.items():
            if not prompts:
                continue
            print(f"[bench_treegraft] {pair} / {s} ...", file=sys.stderr, flush=True)
            row = {"cheap-only": engine_run(target, cheap, prompts, args.tree, args.new_tokens, args.repeats),
                   "strong-only": engine_run(target, strong, prompts, args.tree, args.new_tokens, args.repeats)}
            for policy in ("never", "always") + (("scheduler",) if sched_dir is not None else ()):
                tg.set_policy(policy)
                row[policy] = engine_run(target, tg, prompts, args.tree, args.new_tokens, args.repeats)
            row["oracle"] = oracle_run(target, tg, args.tree, prompts, args.new_tokens,
                                       row["never"]["round_s"], row["always"]["round_s"])
            ref = row["cheap-only"]["sequences"]
            for m in ("strong-only", "never", "always", "scheduler", "oracle"):
                if m in row:
                    row[m]["same_as_cheap"] = f"{sum(a == b for a, b in zip(ref, row[m]['sequences']))}/{len(ref)}"
            res["sets"][s] = row
        res["costs"] = costs(target, tg, args.tree, next(iter(eval_sets.values()))[0])
        results[pair] = res
    if not results:
        print("no drafter pair could run", file=sys.stderr)
        return 1
    meta = run_meta("bench_treegraft", argv,
                    setup="smoke: tiny random models" if args.smoke else f"zoo: {Path(args.target).name}",
                    tree=args.tree, new_tokens=args.new_tokens, repeats=args.repeats)
    print(write_treegraft_outputs(results, meta, out).read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
