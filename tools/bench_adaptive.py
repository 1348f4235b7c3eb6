"""AdaptiveSpec on the zoo (issue 21): the adaptive tree shape (lossless) next to the fixed trees of
the same drafter, and margin verification (lossy) over a grid of δ with its divergence report, in
one process.

Rows, per drafter (`--drafter NAME=DIR`, repeatable; default lm = models/code-draft):
    fixed     each of --trees, verified whole (lossless)
    adaptive  --adaptive-tree drafted, each round verified at the width that maximises expected
              tokens / second (`specjax.drafters.composite.adaptive.AdaptiveShape`), its costs profiled in this process
              at this batch size (`tools.profile_widths.profile_rows`; in the JSON's meta), with the
              drafter's `calibration.json` ("step" table) when it has one (`train.adaptive_calibration`)
    margin    the first drafter's --margin-tree under verify="margin" for each δ in --margins
              (and the adaptive shape under the same rule at --margin-adaptive δ, if given)
Columns: tokens/s, speedup over our autoregressive loop (same run), τ, mean verify width; and
against the lossless greedy output of the same prompts:
    agreement    generated positions holding the lossless token (position by position, / tokens)
    prefix       mean fraction of each completion before its first difference
    valid Python completions with which the prompt (one whole top-level function of the test split,
                 `train.prompts.whole_function_prompts`) stays valid Python: prompt + the completion
                 without its last, possibly cut, line compiles or is a valid start cut short
                 (`codeop.compile_command`)
    Δ log-lik    the target's mean log-probability per generated token of the produced text (given
                 the prompt) minus that of the lossless output (0 for a lossless method)
The table states the first δ at which the valid-Python rate falls below 93% of the lossless rate.

    python -m tools.bench_adaptive                 # code-target + code-draft (+ --drafter dspark=...)
    python -m tools.bench_adaptive --smoke         # tiny random models: checks the tool

Writes bench/bench_adaptive.{md,json,png} (`tools.harness.write_outputs`). Float32 on CPU; the CPU
model goes with every number.
"""
from __future__ import annotations

import argparse
import codeop
import functools
import gc
import os
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import specjax
from specjax.spec import tree as tree_lib
from specjax.drafters.composite.adaptive import AdaptiveShape
from specjax.spec.calibration import FILE as CALIBRATION_FILE, STEP, read_calibration
from specjax.spec.widths import adaptive_widths
from specjax.models import family
from tools.harness import (REPO, Column, batches, check_cell, generation_row, greedy_check, run_meta,
                           time_generation, with_speedup, write_outputs)
from tools.profile_widths import profile_rows
from train.common import repo_relative

VALID_FRACTION = 0.93  # the bar: valid-Python rate >= 93% of lossless


def valid_python(prompt: str, completion: str) -> bool:
    """Is prompt + completion valid Python? The prompt is a whole function; the completion's last
    line, possibly cut by the token limit, is dropped. Valid: it compiles, or it is a valid start
    cut short (`codeop`: an open string, bracket or block at the cut)."""
    lines = completion.split("\n")
    src = prompt + "\n".join(lines[:-1]) + ("\n" if len(lines) > 1 else "")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # invalid escape sequences and the like are warnings, not errors
        try:  # None: valid so far but incomplete
            codeop.compile_command(src, "<completion>", "exec")
        except (SyntaxError, ValueError, OverflowError):
            return False
    return True


def agreement(ref: list[list[int]], seqs: list[list[int]]) -> tuple[float, float]:
    """(positions equal to the reference / reference tokens, mean common-prefix fraction)."""
    same = total = 0
    prefix = []
    for a, b in zip(ref, seqs):
        n = min(len(a), len(b))
        same += sum(int(x == y) for x, y in zip(a[:n], b[:n]))
        total += len(a)
        k = next((i for i in range(n) if a[i] != b[i]), n)
        prefix.append(k / max(len(a), 1))
    return same / max(total, 1), float(np.mean(prefix))


@functools.partial(jax.jit, static_argnames="graphdef")
def _logprob_sum(graphdef, state, ids_1xL, n_prompt):
    """Sum of the target's log-probabilities of the tokens after the first `n_prompt` of `ids_1xL`,
    given everything before each (teacher forcing): one compiled program per sequence length."""
    target = nnx.merge(graphdef, state)
    fam = family(target)
    L = ids_1xL.shape[1]
    out = fam.prefill(target, ids_1xL, jnp.asarray([L]), fam.init_cache(target, 1, L))
    lp = jax.nn.log_softmax(out.logits[0, :-1].astype(jnp.float32), axis=-1)
    tok = jnp.take_along_axis(lp, ids_1xL[0, 1:, None], axis=-1)[:, 0]
    return jnp.sum(jnp.where(jnp.arange(L - 1) >= n_prompt - 1, tok, 0.0))


def mean_logprob(target, prompts, seqs) -> float:
    """The target's mean log-probability per generated token of `seqs` given `prompts` (teacher forcing)."""
    graphdef, state = nnx.split(target)
    tot = n = 0.0
    for p, s in zip(prompts, seqs):
        if not s:
            continue
        tot += float(_logprob_sum(graphdef, state, jnp.asarray([p + s], jnp.int32), len(p)))
        n += len(s)
    return tot / max(n, 1)


def run(target, groups, new_tokens, repeats, free: bool = True, **kw) -> dict:
    """tokens/s (median of `repeats` after a warm-up per prompt bucket), stats, sequences
    (`tools.harness.time_generation` + `generation_row`; group i runs with seed i). `free`: drop the
    compiled programs after (XLA:CPU's memory maps; --smoke keeps its few tiny ones)."""
    kw = dict(max_new_tokens=new_tokens, eos_token_id=(), **kw)
    results, times = time_generation(target, groups, repeats, seed=0, **kw)
    row = generation_row(results, times, speculative=bool(kw.get("drafters")))
    row["lossless"] = all(x.lossless for x in results)
    if free:
        jax.clear_caches()
        gc.collect()
    return row


def completions_text(tok, seqs) -> list[str]:
    from train.tokenizer import EOT_ID
    out = []
    for s in seqs:
        s = s[: s.index(EOT_ID)] if EOT_ID in s else s
        out.append(tok.decode(s) if tok is not None else "")
    return out


def parse_drafters(items) -> list[tuple[str, str]]:
    out = []
    for x in items:
        name, eq, d = x.partition("=")
        if not eq or not name or not d:
            raise ValueError(f"--drafter {x!r}: expected NAME=DIR")
        out.append((name, d))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench_adaptive",
                                 description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(REPO / "models/code-target"))
    ap.add_argument("--drafter", action="append", default=[], metavar="NAME=DIR",
                    help="a drafter with scores (lm / feature / block directory); repeatable (default lm=models/code-draft)")
    ap.add_argument("--trees", action="append", default=[], metavar="NAME=SPEC;SPEC",
                    help="fixed trees of drafter NAME, ';'-separated (default lm: chain=4;chain=6;depth=5,topk=4,nodes=16)")
    ap.add_argument("--adaptive-tree", action="append", default=[], metavar="NAME=SPEC;SPEC",
                    help="trees the adaptive shape drafts for NAME (default lm: chain=6;depth=5,topk=4,nodes=16)")
    ap.add_argument("--margins", default="0,0.25,0.5,1,2,4", help="δ grid of the margin rule")
    ap.add_argument("--margin-tree", default=None, help="the first drafter's tree for the margin rows (default its first fixed tree)")
    ap.add_argument("--margin-adaptive", type=float, default=None, help="also the adaptive shape under the margin rule at this δ")
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="tiny random models: checks the tool, measures nothing real")
    ap.add_argument("--out", default=str(REPO / "bench/bench_adaptive"))
    args = ap.parse_args(argv)
    try:
        margins = [float(x) for x in args.margins.split(",") if x.strip()]
        drafter_dirs = parse_drafters(args.drafter)
    except ValueError as e:
        ap.error(str(e))
    if any(m < 0 for m in margins):
        ap.error("--margins must be >= 0")

    def tree_map(items, default):
        out = dict(default)
        for x in items:
            name, eq, specs = x.partition("=")
            if not eq:
                ap.error(f"{x!r}: expected NAME=SPEC;SPEC")
            out[name] = [s for s in specs.split(";") if s]
        return out

    tok = None
    if args.smoke:
        from tools.bench import smoke_setup
        target, all_drafters, prompts = smoke_setup()
        drafters = {"lm": all_drafters["lm"]}
        defaults = {"lm": ["chain=4"]}
        adaptive_defaults = {"lm": ["depth=3,topk=3,nodes=9"]}
        args.new_tokens, args.repeats = min(args.new_tokens, 16), 1
        margins = margins[:2]
        texts = [""] * len(prompts)
    else:
        from specjax.io.checkpoint import load_tokenizer
        from specjax.drafters import load_drafter
        from train import prompts as prompt_sets
        if not os.path.isdir(args.target):
            ap.error(f"{args.target}: no target model (make models)")
        target = specjax.load_model(args.target)
        tok = load_tokenizer(args.target)
        drafter_dirs = drafter_dirs or [("lm", str(REPO / "models/code-draft"))]
        drafters = {}
        for name, d in drafter_dirs:
            try:
                drafters[name] = load_drafter(d, target, target_path=args.target, tuned=False)
            except (OSError, ValueError) as e:
                ap.error(f"--drafter {name}={d}: {e}")
        defaults = {"lm": ["chain=4", "chain=6", "depth=5,topk=4,nodes=16"]}
        adaptive_defaults = {"lm": ["chain=6", "depth=5,topk=4,nodes=16"]}
        rows = prompt_sets.whole_function_prompts(tok, args.prompts, max_tokens=args.context)
        prompts = [r["ids"] for r in rows]
        texts = [r["text"] for r in rows]
    fixed = tree_map(args.trees, defaults)
    adaptive = tree_map(args.adaptive_tree, adaptive_defaults)
    for name in list(fixed) + list(adaptive):
        if name not in drafters:
            ap.error(f"trees given for {name!r}, which is not a --drafter")
    groups = batches(prompts, args.batch)
    flat = [p for g in groups for p in g]
    texts = texts[: len(flat)]
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731

    rows = []
    log("[bench_adaptive] ar ...")
    ar = run(target, groups, args.new_tokens, args.repeats, not args.smoke)
    ar.update(method="ar", kind="ar")
    rows.append(ar)
    ref = ar["sequences"]
    profiles, calibrations = {}, {}

    def adaptive_drafter(name, d, spec_text):
        spec = d.resolve_tree(tree_lib.parse_tree_spec(spec_text))
        widths = adaptive_widths(spec.num_nodes)
        key = (name, spec_text)
        if key not in profiles:
            log(f"[bench_adaptive] profiling {name} {spec_text} at widths {widths} ...")
            probe = AdaptiveShape(d, (1.0,) * len(widths))
            prof = profile_rows(target, probe, [args.batch], spec, widths, min(args.context, 64) if args.smoke else args.context,
                                2 if args.smoke else 5, 4 if args.smoke else 16, log=log, whole_round=True,
                                free=not args.smoke)
            profiles[key] = prof[str(args.batch)]
        cal = read_calibration(dict(drafter_dirs)[name]) if not args.smoke else None
        cal = cal if cal is not None and STEP in cal.kinds() else None
        calibrations[name] = None if cal is None else repo_relative(os.path.join(dict(drafter_dirs)[name], CALIBRATION_FILE))
        step = profiles[key]["draft_s"] / spec.max_depth  # a depth-by-depth chain may stop early
        return AdaptiveShape(d, profiles[key]["round_s"], calibration=cal, draft_step_s=step)

    for name, d in drafters.items():
        for t in fixed.get(name, []):
            log(f"[bench_adaptive] {name} {t} ...")
            r = run(target, groups, args.new_tokens, args.repeats, not args.smoke, drafters=[d], tree=t)
            r.update(method=f"{name} {t}", kind="fixed", drafter=name, tree=t)
            rows.append(r)
        for t in adaptive.get(name, []):
            log(f"[bench_adaptive] {name} adaptive {t} ...")
            r = run(target, groups, args.new_tokens, args.repeats, not args.smoke,
                    drafters=[adaptive_drafter(name, d, t)], tree=t)
            r.update(method=f"{name} adaptive {t}", kind="adaptive", drafter=name, tree=t)
            rows.append(r)
    first = next(iter(drafters))
    mtree = args.margin_tree or (fixed.get(first) or ["chain=4"])[0]
    for delta in margins:
        log(f"[bench_adaptive] {first} {mtree} margin {delta:g} ...")
        r = run(target, groups, args.new_tokens, args.repeats, not args.smoke, drafters=[drafters[first]], tree=mtree,
                verify="margin",
                margin=delta)
        r.update(method=f"{first} {mtree} margin δ={delta:g}", kind="margin", drafter=first, tree=mtree, margin=delta)
        rows.append(r)
    if args.margin_adaptive is not None and adaptive.get(first):
        t = adaptive[first][0]
        r = run(target, groups, args.new_tokens, args.repeats, not args.smoke,
                drafters=[adaptive_drafter(first, drafters[first], t)],
                tree=t, verify="margin", margin=args.margin_adaptive)
        r.update(method=f"{first} adaptive {t} margin δ={args.margin_adaptive:g}", kind="margin+adaptive",
                 drafter=first, tree=t, margin=args.margin_adaptive)
        rows.append(r)

    # Divergence from the lossless greedy output.
    ref_text = completions_text(tok, ref)
    ref_valid = [valid_python(p, c) for p, c in zip(texts, ref_text)] if tok is not None else [True] * len(ref)
    ref_lp = mean_logprob(target, flat, ref)
    for r in rows:
        with_speedup(r, ar)
        r["agreement"], r["prefix"] = agreement(ref, r["sequences"])
        text = completions_text(tok, r["sequences"])
        valid = ([valid_python(p, c) for p, c in zip(texts, text)] if tok is not None
                 else [s == a for s, a in zip(r["sequences"], ref)])  # smoke: no tokenizer, exact rows
        r["valid_python"] = float(np.mean(valid))
        r["valid_vs_lossless"] = r["valid_python"] / max(float(np.mean(ref_valid)), 1e-9)
        r["delta_loglik"] = mean_logprob(target, flat, r["sequences"]) - ref_lp
        if r["kind"] in ("fixed", "adaptive"):
            r["check"] = greedy_check(target, flat, ref, r["sequences"])
    below = [r["margin"] for r in rows if r["kind"] == "margin" and r["valid_vs_lossless"] < VALID_FRACTION]
    meta = run_meta("bench_adaptive", argv,
                    setup="smoke: tiny random models" if args.smoke else f"zoo: {Path(args.target).name}",
                    n_prompts=len(flat), new_tokens=args.new_tokens, batch=args.batch, repeats=args.repeats,
                    drafters={n: repo_relative(d) for n, d in drafter_dirs} if not args.smoke else {},
                    lossless_valid_python=float(np.mean(ref_valid)), margin_tree=mtree,
                    first_margin_below_93pct_valid=min(below) if below else None,
                    profiles={f"{n} {t}": p for (n, t), p in profiles.items()}, calibrations=calibrations)
    print(write_adaptive_outputs(rows, meta, Path(args.out)).read_text())
    bad = [r["method"] for r in rows if r.get("check", {}).get("mismatch")]
    if bad:
        print(f"GREEDY MISMATCH in {bad}", file=sys.stderr)
        return 1
    return 0


def _width_cell(r):
    if "mean_verify_width" not in r:
        return None
    return f"{r['mean_verify_width']:.2f}" + (f" (depth {r['mean_adaptive_depth']:.2f})" if "mean_adaptive_depth" in r else "")


COLUMNS = [Column("method", "method", right=False),
           Column("lossless", lambda r: "yes" if r["lossless"] else "**no**", right=False),
           Column("tokens/s", "tokens_per_s", "{:.1f}"), Column("speedup vs our AR", "speedup", "{:.2f}x"),
           Column("tau", "tau", "{:.2f}"), Column("mean verify width", _width_cell),
           Column("agreement", "agreement", "{:.3f}"), Column("prefix", "prefix", "{:.3f}"),
           Column("valid Python (vs lossless)", lambda r: f"{r['valid_python']:.2f} ({r['valid_vs_lossless']:.2f})"),
           Column("Δ log-lik / token", "delta_loglik", "{:+.3f}"),
           Column("greedy check", check_cell, right=False)]


def plot_adaptive(plt, rows, meta):
    fig, axes = plt.subplots(1, 2, figsize=(15, 4.5), gridspec_kw={"wspace": 0.7})
    ar = next(r for r in rows if r["kind"] == "ar")
    margin = sorted([r for r in rows if r["kind"] == "margin"], key=lambda r: r["margin"])
    if margin:
        axes[0].plot([1 - r["agreement"] for r in margin], [r["tokens_per_s"] for r in margin], marker="o",
                     label=f"margin rule ({margin[0]['drafter']} {margin[0]['tree']})")
        for r in margin:
            axes[0].annotate(f"δ={r['margin']:g}", (1 - r["agreement"], r["tokens_per_s"]), fontsize=7)
        axes[1].plot([r["margin"] for r in margin], [r["valid_vs_lossless"] for r in margin], marker="o", label="valid Python / lossless")
        axes[1].plot([r["margin"] for r in margin], [r["agreement"] for r in margin], marker="s", label="token agreement")
        axes[1].axhline(VALID_FRACTION, ls="--", lw=0.8, color="gray")
    for r in rows:
        if r["kind"] in ("fixed", "adaptive", "margin+adaptive"):
            axes[0].scatter([1 - r["agreement"]], [r["tokens_per_s"]], marker="^" if r["kind"] == "fixed" else "*",
                            s=60, label=r["method"])
    axes[0].axhline(ar["tokens_per_s"], ls=":", color="k", lw=0.8, label="autoregressive")
    axes[0].set_xlabel("divergence from lossless greedy output (1 - token agreement)")
    axes[0].set_ylabel("tokens/s")
    axes[0].legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.02, 1.0))  # in the gap between the panels
    axes[1].set_xlabel("margin δ (logits)")
    axes[1].set_ylabel("fraction")
    if margin:
        axes[1].legend(fontsize=7)
    else:
        axes[1].set_title("no margin rows run (--margins '')", fontsize=8)
    fig.suptitle(f"AdaptiveSpec — {meta['setup']} ({meta['cpu']})")
    fig.subplots_adjust(left=0.05, right=0.98, top=0.9, bottom=0.12)
    return fig


def write_adaptive_outputs(rows, meta, out: Path) -> Path:
    """<out>.md, .json and .png through the harness (`tools.harness.write_outputs`)."""
    intro = [f"{meta['n_prompts']} prompts (whole functions, test split), {meta['new_tokens']} new tokens each, batch "
             f"{meta['batch']}, median of {meta['repeats']} repeats after a warm-up; float32 on {meta['device']}; "
             f"load average {meta['load_avg']:.2f}."]
    first = meta["first_margin_below_93pct_valid"]
    margins = any(r.get("kind") == "margin" for r in rows)
    notes = [f"Lossless greedy output compiles in {meta['lossless_valid_python']:.0%} of completions."
             + ("" if not margins else f" The valid-Python rate first drops below 93% of lossless at δ = {first:g}."
                if first is not None else " No δ of the grid drops the valid-Python rate below 93% of lossless."),
             "Greedy check: exact / near-tie / mismatch against autoregressive output (lossless rows only). "
             "Mean verify width: target nodes per round, root included (the adaptive rows: and the verified tree's mean depth)."]
    return write_outputs(out, meta, rows, COLUMNS, plot_adaptive,
                         title=f"AdaptiveSpec: adaptive tree shape and margin verification ({meta['setup']})",
                         intro=intro, notes=notes)

if __name__ == "__main__":
    sys.exit(main())
