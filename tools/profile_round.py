"""Where a speculative round's time goes, op by op: one generation under `jax.profiler.trace`, every
XLA op of the compiled loop summed over the run and divided by its rounds, grouped by the engine's
named scopes (`draft`, `verify_forward`, `verify_walk`, `commit`, `emit`; from the HLO dump's
`op_name` metadata), with the slowest ops and their shapes.

    python -m tools.profile_round --target models/smollm2-135m-instruct --weights int8 \\
        --drafter dspark=models/smollm2-135m-instruct-dspark --tree chain=4 --out bench/profile_round_smollm2_int8_dspark
    python -m tools.profile_round --smoke                # tiny random models (what the test runs)

`tools.bench_round` times stages, each in its own loop; this reads the one real loop, so nothing is
hoisted or left out, at the price of the profiler's own overhead (the ms here sum to more than a
round's wall time: compare shares, not totals). The scopes need the HLO dump, which is set up before
the process's first compile (`--xla_dump_to`); `--smoke` (the test, in a process that has compiled
already) lists ops without scopes and sets no dump. One prompt, batch 1, greedy.
"""
from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import re
import sys
import tempfile
from collections import Counter, defaultdict
from pathlib import Path

from tools.harness import Column, run_meta, write_outputs

_OP = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\S+) .*?metadata=\{op_name=\"([^\"]+)\"")
_SCOPE = re.compile(r"/while/body/(\w+)")


def op_metadata(dump_dir: Path) -> dict[str, tuple[str, str]]:
    """{hlo op name: (its shape, its op_name)} from the dumped optimised HLO of the generation loop."""
    meta = {}
    for fn in glob.glob(str(dump_dir / "*generate*after_optimizations.txt")):
        for line in open(fn):
            m = _OP.match(line)
            if m:
                meta.setdefault(m.group(1), (m.group(2), m.group(3)))
    return meta


def scope_of(op_name: str) -> str:
    m = _SCOPE.search(op_name)
    if m:
        return m.group(1)
    for s in ("prefill", "draft_init", "decode"):
        if f"/{s}/" in op_name or op_name.endswith(f"/{s}"):
            return s
    return "(no scope)" if op_name else "(no metadata)"


def profile(target, drafter, prompt, tree: str, new_tokens: int, trace_dir: Path, dump_dir: Path):
    """(rounds, {op: total µs}, {op: calls}, op metadata) of one traced generation (after a warm-up)."""
    import jax

    import specjax
    kw = dict(drafters=[drafter], tree=tree, max_new_tokens=new_tokens, eos_token_id=())
    specjax.generate(target, [prompt], **kw).tokens  # compile and warm up
    with jax.profiler.trace(str(trace_dir)):
        res = specjax.generate(target, [prompt], **kw)
        res.tokens
    rounds = int(res.stats["rounds"][0])
    f = sorted(glob.glob(str(trace_dir / "plugins/profile/*/*.trace.json.gz")))[-1]
    total, calls = Counter(), Counter()
    for e in json.load(gzip.open(f))["traceEvents"]:
        a = e.get("args", {})
        if e.get("ph") == "X" and "generate" in str(a.get("hlo_module", "")) and "hlo_op" in a:
            total[a["hlo_op"]] += e.get("dur", 0)
            calls[a["hlo_op"]] += 1
    return rounds, total, calls, op_metadata(dump_dir)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.profile_round", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="models/code-target")
    ap.add_argument("--weights", default="float32", choices=("float32", "bfloat16", "int8"))
    ap.add_argument("--invariant", action=argparse.BooleanOptionalAction, default=None,
                    help="the batch-invariant attention (default: on at bfloat16 / int8, as tools.bench)")
    ap.add_argument("--drafter", default="ngram", help="'ngram' or NAME=DIR (a drafter directory of the target)")
    ap.add_argument("--tree", default="chain=4")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--top", type=int, default=20, help="the slowest ops listed")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="profile_round_"))
    dump = work / "dump"
    if not args.smoke and "--xla_dump_to" not in os.environ.get("XLA_FLAGS", ""):  # read at the first compile only
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={dump}"
                                   " --xla_dump_hlo_module_re=.*generate.*").strip()
    import specjax
    from specjax.drafters import NgramDrafter, load_drafter, named_drafter
    if args.smoke:
        from tools.harness import smoke_models
        _, target, _ = smoke_models()
        prompt, drafter, what = list(range(3, 35)), NgramDrafter(), "tiny random models (--smoke)"
        args.new_tokens = 12
    else:
        invariant = args.weights != "float32" if args.invariant is None else args.invariant
        target = specjax.load_model(args.target, weights=args.weights, invariant=invariant)
        from train import prompts as prompt_sets
        prompt = prompt_sets.prompt_set("functions", specjax.load_tokenizer(args.target), 1,
                                        context_tokens=args.context)[0]["ids"]
        if named_drafter(args.drafter):
            drafter = load_drafter(args.drafter, target, tuned=False)
        else:
            name, sep, d = args.drafter.partition("=")
            if not sep:
                ap.error(f"--drafter wants 'ngram' or NAME=DIR, got {args.drafter!r}")
            drafter = load_drafter(d, target, target_path=args.target, tuned=False)
        what = f"zoo: {Path(args.target).name}, {args.weights} weights" + (", batch-invariant" if invariant else "")
    rounds, total, calls, meta = profile(target, drafter, prompt, args.tree, args.new_tokens, work / "trace", dump)
    by_scope = defaultdict(float)
    for op, us in total.items():
        by_scope[scope_of(meta.get(op, ("", ""))[1])] += us
    loop = sum(v for k, v in by_scope.items() if k not in ("prefill", "draft_init"))
    outside = ("prefill", "draft_init")  # once per generation, not per round: no share of the loop
    rows = [{"kind": "scope", "name": k, "ms_per_round": v / 1e3 / rounds,
             "share": v / loop if loop and k not in outside else None}
            for k, v in sorted(by_scope.items(), key=lambda x: -x[1])]
    for op, us in total.most_common(args.top):
        shape, name = meta.get(op, ("", ""))
        rows.append({"kind": "op", "name": op, "shape": shape, "scope": scope_of(name), "calls_per_round": calls[op] / rounds,
                     "ms_per_round": us / 1e3 / rounds, "share": us / loop if loop and scope_of(name) not in outside else None})
    meta_out = run_meta("profile_round", argv, what=what, tree=args.tree, drafter=args.drafter, rounds=rounds,
                        new_tokens=args.new_tokens, weights=args.weights)
    cols = [Column("kind", "kind", right=False), Column("name", "name", right=False), Column("scope", "scope", right=False),
            Column("shape", "shape", right=False), Column("calls / round", "calls_per_round", "{:.1f}"),
            Column("ms / round", "ms_per_round", "{:.3f}"), Column("share of the loop", "share", "{:.1%}")]
    out = work / "profile_round_smoke" if args.smoke else Path(args.out or "bench/profile_round")  # smoke: nothing in bench/
    md = write_outputs(out, meta_out, rows, cols, title=f"A round op by op ({what}; {args.drafter} {args.tree})",
                       intro=[f"{rounds} rounds of one prompt, {args.new_tokens} new tokens; µs of each XLA op "
                              "under the profiler, summed and divided by the rounds (profiler overhead included: "
                              "read shares). Scopes from the HLO dump's op_name (`specjax.engine.loop`'s named scopes)."])
    print(md.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
