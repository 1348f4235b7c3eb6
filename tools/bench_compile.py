"""Compile time of the generation programs: where it goes, and what the persistent cache saves.

Per configuration (autoregressive, lm chain, lm tree, feature tree, n-gram, TreeGraft, DSpark, and
the hybrid target), each in a fresh process, one prompt ("def add(a, b):"), 24 new tokens, batch 1:

  cold   an empty compilation-cache folder: everything is traced, lowered and compiled;
  warm   a second process on the same folder: tracing and lowering run again, XLA's compilation
         is loaded from disk (JAX's cache-hit events are counted).

Per process: seconds of tracing (jaxpr), lowering (jaxpr -> StableHLO) and XLA compilation (the
union of JAX's own compile-event spans, `jax.monitoring`, as the CLI's compile_s), the first
generate call's wall time and a second call's (the run alone), and the process's wall time.
Where the big program's size goes, per part of the round (named scopes of `specjax.engine.loop`:
prefill, draft_init, draft, verify_forward, verify_walk, commit, emit; AR: prefill, decode; `other` is the loop's own
glue): jaxpr equations of the traced program, sub-jaxprs included (a proxy for what tracing,
lowering and XLA work on). And the CLI's wall time for the issue's command
(`python -m specjax generate ... --drafter models/code-draft --tree chain=4`), cold and warm.

    python -m tools.bench_compile                     # the zoo
    python -m tools.bench_compile --configs "ar,lm chain=4"
    python -m tools.bench_compile --smoke             # tiny random models (what the test runs)

Writes <out>.md and <out>.json (default bench/bench_compile; `tools.harness.write_outputs`). Each
child process is `python -m tools.bench_compile --child ...`, run from the repository root.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tools.harness import REPO, Column, run_meta, write_outputs

T_START = time.perf_counter()

PROMPT = "def add(a, b):"
NEW_TOKENS = 24
PARTS = ("prefill", "draft_init", "draft", "verify_forward", "verify_walk", "commit", "emit", "decode")
EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "trace",
          "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
          "/jax/core/compile/backend_compile_duration": "compile"}
CACHE_HIT = "/jax/compilation_cache/cache_hits"

# name -> (target dir, drafter dirs (cheap first for TreeGraft), tree, treegraft policy or None)
CONFIGS = {
    "ar": ("models/code-target", (), None, None),
    "lm chain=4": ("models/code-target", ("models/code-draft",), "chain=4", None),
    "lm depth=5,topk=4,nodes=16": ("models/code-target", ("models/code-draft",), "depth=5,topk=4,nodes=16", None),
    "feature depth=6,topk=6,nodes=24": ("models/code-target", ("models/code-target-feature",),
                                        "depth=6,topk=6,nodes=24", None),
    "ngram chain=6": ("models/code-target", ("ngram",), "chain=6", None),
    "treegraft ngram+lm": ("models/code-target", ("ngram", "models/code-draft"), "depth=5,topk=4,nodes=16", "always"),
    "dspark chain=8": ("models/code-target", ("models/code-target-dspark",), "chain=8", None),
    "hybrid ar": ("models/code-target-hybrid", (), None, None),
    "hybrid lm chain=4": ("models/code-target-hybrid", ("models/code-draft",), "chain=4", None),
}
CLI = ["--model", "models/code-target", "--prompt", PROMPT, "--max-new-tokens", "24", "--drafter", "models/code-draft",
       "--tree", "chain=4"]


# ----------------------------------------------------------------------------- the child process

def union_seconds(spans) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(spans):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def jaxpr_parts(closed) -> dict[str, int]:
    """Equations per named part of the round, sub-jaxprs included; an equation outside every part
    takes its enclosing equation's part (`other` at the top)."""
    from jax.extend import core as jcore

    counts: dict[str, int] = {}

    def part_of(eqn, inherited):
        stack = str(eqn.source_info.name_stack)
        for p in reversed(stack.split("/")):
            if p in PARTS:
                return p
        return inherited

    def sub_jaxprs(eqn):
        for v in eqn.params.values():
            for x in (v if isinstance(v, (tuple, list)) else (v,)):
                if isinstance(x, jcore.ClosedJaxpr):
                    yield x.jaxpr
                elif isinstance(x, jcore.Jaxpr):
                    yield x

    def walk(jaxpr, inherited):
        for eqn in jaxpr.eqns:
            p = part_of(eqn, inherited)
            counts[p] = counts.get(p, 0) + 1
            for sub in sub_jaxprs(eqn):
                walk(sub, p)

    walk(closed.jaxpr, "other")
    return counts


def load(name: str, smoke: bool):
    import specjax
    if smoke:
        from specjax.drafters import LMDrafter, NgramDrafter
        from specjax.drafters import compose
        from tools.harness import smoke_models
        _, target, draft = smoke_models()
        prompt = [3, 5, 7, 11, 13, 5, 7, 11]
        drafters = {"ar": [], "lm chain=4": [LMDrafter(draft)], "ngram chain=6": [NgramDrafter()],
                    "treegraft ngram+lm": [compose.build(compose.Stack.make(["ngram", "lm"], "treegraft"),
                                                         [NgramDrafter(), LMDrafter(draft)])]}[name]
        tree = {"ar": None, "lm chain=4": "chain=4", "ngram chain=6": "chain=6",
                "treegraft ngram+lm": "depth=3,topk=2,nodes=6"}[name]
        return target, drafters, tree, prompt
    from specjax.drafters import load_drafter, named_drafter
    from specjax.drafters import compose
    tdir, ddirs, tree, policy = CONFIGS[name]
    target = specjax.load_model(str(REPO / tdir))
    prompt = specjax.load_tokenizer(str(REPO / tdir)).encode(PROMPT).ids
    drafters = [load_drafter(d if named_drafter(d) else str(REPO / d), target, target_path=str(REPO / tdir), tuned=False) for d in ddirs]
    if policy is not None:
        drafters = [compose.build(compose.Stack.make(ddirs, "treegraft", policy=policy), drafters)]
    return target, drafters, tree, prompt


def child(args) -> dict:
    from jax import monitoring

    if args.cache != "none":
        from specjax.io.compile_cache import enable_compilation_cache
        enable_compilation_cache(args.cache)
    import specjax
    from specjax.engine import loop as engine

    t_load = time.perf_counter()
    target, drafters, tree, prompt = load(args.child, args.smoke)
    load_s = time.perf_counter() - t_load
    spans: dict[str, list] = {k: [] for k in EVENTS.values()}
    by_fun: dict[str, float] = {}
    hits = [0]

    def on_span(event, start, end, **kw):
        if event in EVENTS:
            spans[EVENTS[event]].append((start, end))
            if EVENTS[event] == "compile":
                f = kw.get("fun_name", "?")
                by_fun[f] = by_fun.get(f, 0.0) + end - start

    def on_event(event, **kw):
        if event == CACHE_HIT:
            hits[0] += 1

    kwargs = dict(max_new_tokens=NEW_TOKENS, eos_token_id=())
    if drafters:
        kwargs.update(drafters=drafters, tree=tree)
    monitoring.register_event_time_span_listener(on_span)
    monitoring.register_event_listener(on_event)
    t0 = time.perf_counter()
    first = specjax.generate(target, [prompt], **kwargs).sequences()
    first_s = time.perf_counter() - t0
    monitoring.unregister_event_time_span_listener(on_span)
    monitoring.unregister_event_listener(on_event)
    t0 = time.perf_counter()
    second = specjax.generate(target, [prompt], **kwargs).sequences()
    run_s = time.perf_counter() - t0
    assert first == second
    out = {"config": args.child, "cache": args.cache != "none", "load_s": load_s, "first_call_s": first_s,
           "run_s": run_s, "cache_hits": hits[0], "tokens": first[0],
           **{f"{k}_s": union_seconds(v) for k, v in spans.items()},
           "compile_total_s": union_seconds([s for v in spans.values() for s in v]),
           "compile_by_function_s": dict(sorted(by_fun.items(), key=lambda kv: -kv[1])[:5])}
    out["process_s"] = time.perf_counter() - T_START  # before the parts below (not part of a user's run)
    if args.parts:  # trace the big program once more (not timed) and count its equations per part
        fn = engine._generate_spec if drafters else engine._generate_ar
        seen = {}

        def spy(*a, **kw):
            seen["args"] = (a, kw)
            return fn(*a, **kw)

        name = "_generate_spec" if drafters else "_generate_ar"
        setattr(engine, name, spy)
        try:
            specjax.generate(target, [prompt], **kwargs)
        finally:
            setattr(engine, name, fn)
        a, kw = seen["args"]
        out["jaxpr_eqns_by_part"] = jaxpr_parts(fn.trace(*a, **kw).jaxpr)
    return out


# ----------------------------------------------------------------------------- the parent

def run_child(name: str, cache: str, smoke: bool, parts: bool) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    cmd = [sys.executable, "-m", "tools.bench_compile", "--child", name, "--cache", cache, "--child-out", path]
    cmd += ["--smoke"] * smoke + ["--parts"] * parts
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"), cwd=REPO)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{name}: child failed:\n{proc.stderr[-4000:]}")
    out = json.loads(Path(path).read_text())
    os.unlink(path)
    out["wall_s"] = wall
    return out


def cli_wall(cache: str) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "specjax", "generate", *CLI, "--compile-cache", cache],
                          capture_output=True, text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"), cwd=REPO)
    if proc.returncode != 0:
        raise RuntimeError(f"CLI failed:\n{proc.stderr[-4000:]}")
    return time.perf_counter() - t0


_f = "{:.2f}"
COLUMNS = [Column("config", "config", right=False),
           Column("cache", lambda r: "warm" if r["cache_hits"] else "cold", right=False),
           Column("trace", "trace_s", _f), Column("lower", "lower_s", _f), Column("XLA compile", "compile_s", _f),
           Column("compile total", "compile_total_s", _f), Column("first call", "first_call_s", _f),
           Column("run", "run_s", _f), Column("process", "process_s", _f), Column("cache hits", "cache_hits")]


def write_compile_outputs(rows: list[dict], cli: dict | None, meta: dict, out: Path) -> Path:
    """<out>.md and .json ({"meta", "rows", "cli"}) through the harness."""
    intro = [f"{meta['platform']}, load {meta['load_avg']:.2f}. One prompt, {NEW_TOKENS} new tokens, batch 1; each row "
             "a fresh process. Seconds: trace / lower / XLA compile (unions of JAX's compile-event spans), their "
             "union, the first generate call and a second one (the run alone), the process."]
    notes = []
    parted = [r for r in rows if "jaxpr_eqns_by_part" in r]
    if parted:
        cols = list(PARTS) + ["other"]
        notes += ["Where the program's size goes: jaxpr equations of the generation program per part of the round "
                  "(sub-jaxprs included; the share of the whole in brackets).", "",
                  "| config | " + " | ".join(cols) + " | total |", "|---|" + "---:|" * (len(cols) + 1)]
        for r in parted:
            c = r["jaxpr_eqns_by_part"]
            n = sum(c.values())
            notes.append(f"| {r['config']} | " + " | ".join(f"{c.get(k, 0)} ({100 * c.get(k, 0) / n:.0f}%)" for k in cols)
                         + f" | {n} |")
    if cli:
        notes += ["", f"CLI wall time, `python -m specjax generate {' '.join(CLI)}` (process start to exit): "
                  f"cold {cli['cold_s']:.2f} s, warm (same cache folder) {cli['warm_s']:.2f} s."]
    return write_outputs(out, meta, rows, COLUMNS, title=f"Compile time of the generation programs ({meta['setup']})",
                         intro=intro, notes=notes, extra={"cli": cli})


AB_COLUMNS = [Column("config", "config", right=False), Column("new tokens", "new_tokens"),
              Column("loop", "loop_s", "{:.3f}"), Column("unrolled", "unrolled_s", "{:.3f}"),
              Column("loop / unrolled", lambda r: f"{r['loop_s'] / r['unrolled_s']:.3f}")]


def ab_child(args) -> dict:
    """One form of the loop A/B in this process: compile, then time `repeats` generate calls."""
    import specjax
    from specjax.spec import tree as tree_lib
    if args.ab_form == "unrolled":
        tree_lib.LOOP_MIN_DEPTH = 10 ** 6
    target, drafters, tree, prompt = load(args.child, args.smoke)
    kwargs = dict(max_new_tokens=args.new_tokens, eos_token_id=(), drafters=drafters, tree=tree)
    specjax.generate(target, [prompt], **kwargs)  # compiles
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        res = specjax.generate(target, [prompt], **kwargs)
        times.append(time.perf_counter() - t0)
    return {"times": times, "tokens": res.sequences()[0]}


def runtime_ab(names: list[str], smoke: bool, repeats: int, new_tokens: int, rounds: int = 2) -> list[dict]:
    """The looped depths' runtime against the unrolled form (`tree.LOOP_MIN_DEPTH`): each form in
    its own processes (a jitted program is cached by its static arguments, which do not see the
    switch), alternated loop / unrolled `rounds` times; medians of all timed calls."""
    import statistics
    out = []
    for name in names:
        times, tokens = {"loop": [], "unrolled": []}, {}
        for _ in range(rounds):
            for form in times:
                with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
                    path = f.name
                cmd = [sys.executable, "-m", "tools.bench_compile", "--child", name, "--ab-form", form,
                       "--repeats", str(repeats), "--new-tokens", str(new_tokens), "--child-out", path]
                proc = subprocess.run(cmd + ["--smoke"] * smoke, capture_output=True, text=True,
                                      env=dict(os.environ, JAX_PLATFORMS="cpu"), cwd=REPO)
                if proc.returncode != 0:
                    raise RuntimeError(f"{name} ({form}): child failed:\n{proc.stderr[-4000:]}")
                r = json.loads(Path(path).read_text())
                os.unlink(path)
                times[form] += r["times"]
                tokens[form] = r["tokens"]
        if tokens["loop"] != tokens["unrolled"]:
            raise RuntimeError(f"{name}: the two forms wrote other tokens")
        out.append({"config": name, "new_tokens": new_tokens, "calls": len(times["loop"]),
                    **{f"{f}_s": statistics.median(v) for f, v in times.items()}})
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m tools.bench_compile",
                                 description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default=None, help=f"comma-separated names (a dynamic tree keeps its commas) from {list(CONFIGS)}")
    ap.add_argument("--smoke", action="store_true", help="tiny random models: checks the tool, measures nothing real")
    ap.add_argument("--no-cli", action="store_true", help="skip the CLI wall-time rows")
    ap.add_argument("--out", default=None)
    ap.add_argument("--runtime-ab", default=None, metavar="CONFIGS",
                    help="instead: time each config's generate call with its depths looped and unrolled "
                         "(tree.LOOP_MIN_DEPTH), each form in its own processes, alternated (medians)")
    ap.add_argument("--repeats", type=int, default=5, help="with --runtime-ab: timed calls per process")
    ap.add_argument("--new-tokens", type=int, default=128, help="with --runtime-ab")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--cache", default="none", help=argparse.SUPPRESS)
    ap.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--parts", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ab-form", default=None, choices=["loop", "unrolled"], help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        Path(args.child_out).write_text(json.dumps(ab_child(args) if args.ab_form else child(args)))
        return 0
    from tools.bench import split_methods
    known = ("ar", "lm chain=4", "ngram chain=6", "treegraft ngram+lm") if args.smoke else tuple(CONFIGS)
    if args.runtime_ab:
        names = split_methods(args.runtime_ab)
        if any(n not in known for n in names):
            ap.error(f"unknown configs {names}; choose from {list(known)}")
        rows = runtime_ab(names, args.smoke, args.repeats, args.new_tokens)
        meta = run_meta("bench_compile", argv, setup="smoke: tiny random models" if args.smoke else "zoo")
        intro = [f"Load {meta['load_avg']:.2f}: median seconds of one generate call (batch 1, one prompt, EOS ignored), "
                 "each form in its own processes, alternated."]
        if args.out:
            print(write_outputs(args.out, meta, rows, AB_COLUMNS, title="Looped depths vs the unrolled expansion",
                                intro=intro).read_text())
        else:
            from tools.harness import markdown_table, meta_header
            print("\n".join(meta_header(meta) + [""] + intro + [""] + markdown_table(AB_COLUMNS, rows)))
        return 0
    names = split_methods(args.configs) if args.configs else list(known)
    bad = [n for n in names if n not in known]
    if bad:
        ap.error(f"unknown configs {bad}; choose from {list(known)}")
    out = Path(args.out or REPO / ("bench/bench_compile_smoke" if args.smoke else "bench/bench_compile"))
    rows = []
    root = Path(tempfile.mkdtemp(prefix="specjax-compile-"))
    try:
        for name in names:
            cache = root / name.replace(" ", "_").replace("=", "").replace(",", "_")
            print(f"[bench_compile] {name} ...", file=sys.stderr, flush=True)
            cold = run_child(name, str(cache), args.smoke, parts=True)
            warm = run_child(name, str(cache), args.smoke, parts=False)
            if warm["tokens"] != cold["tokens"]:
                raise RuntimeError(f"{name}: the warm process wrote other tokens")
            rows += [cold, warm]
        cli = None
        if not (args.smoke or args.no_cli):
            cache = root / "cli"
            cli = {"cold_s": cli_wall(str(cache)), "warm_s": cli_wall(str(cache))}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    meta = run_meta("bench_compile", argv, setup="smoke: tiny random models" if args.smoke else "zoo",
                    new_tokens=NEW_TOKENS)
    print(write_compile_outputs(rows, cli, meta, out).read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
