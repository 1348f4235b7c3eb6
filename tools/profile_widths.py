"""The verify-width cost table of the DSpark scheduler: seconds of one round at each compiled
verify width, profiled once per machine and batch size (`BlockDrafter(confidence="schedule")`).

For each batch size B and each verify width w of the drafter's `verify_widths(tree)`:

    draft_s      the drafter's propose + commit (one round's drafting; the same at every width),
                 on the state after a prefill of B random prompts of --context tokens and one real
                 round;
    verify_s[w]  the target's verification forward over the first w nodes of a chain (ancestor
                 mask, the drafter's hidden layers), on a cache holding --context committed tokens;
    rest_s       (--adaptive) a whole round (`engine.spec_round` in the same kind of loop, the whole
                 tree verified) minus draft_s and verify_s[N]: the walk, commits and emission;
    round_s[w]   draft_s + verify_s[w] (+ rest_s), made non-decreasing in w (a running max: a wider
                 verification never costs less, a measured dip is noise): what the scheduler
                 divides expected tokens by. Without rest_s (the DSpark scheduler's and TAPS's
                 profiles) the ratios between widths overstate what a wider round costs.

Each piece runs --loops times in one jitted `fori_loop` carrying its state (as the generation loop
runs it: buffers updated in place, no per-call dispatch; see tools.bench_round), after a warm-up
call; the figure is the median over --repeats calls, divided by --loops. The rest of a round
(verification walk, cache commits, emission) is about the same at every width; --adaptive measures
it (rest_s) and adds it to every width, the DSpark scheduler's and TAPS's profiles leave it out.

    python -m tools.profile_widths --target models/code-target --drafter models/code-target-dspark --batch 1,4
    python -m tools.profile_widths --smoke    # tiny random target and block drafter (checks the tool; with
                                              # --adaptive the smoke lm drafter, as bench_adaptive --smoke)
    python -m tools.profile_widths --adaptive --drafter models/code-draft --tree depth=5,topk=4,nodes=16
                                              # AdaptiveSpec's widths (specjax.drafters.composite.adaptive) for any drafter

    python -m tools.profile_widths --packed models/smollm2-135m-instruct-feature --target models/smollm2-135m-instruct \
        --weights int8 --tree chain=2 --batch 1,2,4,8 --out bench/packed/profile_smollm2_int8.json
                                              # packed verification's cost table (the goodput budget,
                                              # specjax.spec.packing): round seconds per packed budget T
    python -m tools.profile_widths --packed smoke --smoke --batch 2 --out /tmp/p.json

Writes JSON (default bench/verify_profile_<target name>.json), read by `specjax.spec.profile.costs_from_profile`:
    {"cpu", "device", "target", "target_sha256", "drafter", "tree", "context", "command",
     "rows": {"<B>": {"widths": [...], "round_s": [...], "draft_s": x, "verify_s": [...]}},
     "meta": {...}}    # tools.harness.run_meta: cores, date, jax / jaxlib versions, ...
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.engine import loop as engine
from specjax.spec import packing as packing_lib, tree as tree_lib
from specjax.drafters.base import DraftContext
from specjax.models import family
from specjax.spec.profile import default_profile_name
from specjax.spec.sampling import SamplingParams
from tools.harness import REPO, median_ms, run_meta, smoke_block_head, smoke_models
from train.common import repo_relative

LOOPS = 16


def median_s(fn, repeats: int) -> float:
    """Median seconds of `fn()` over `repeats` calls after a warm-up (`tools.harness.median_ms`)."""
    return median_ms(fn, max(repeats, 1)) / 1000


def random_prompts(vocab_size: int, batch: int, context: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab_size, context).tolist() for _ in range(batch)]


def draft_seconds(target, drafter, prompts, spec, repeats: int = 5, loops: int = LOOPS, mode: str = "topk",
                  policies=None):
    """Seconds of one round's drafting (the drafter's propose, then its commit of the round's
    accepted tokens): `loops` propose + commit pairs in one jitted `fori_loop` carrying the
    drafter's state, on the state after a prefill of `prompts` and one real greedy round.
    Works for any drafter (the commit replayed is that first round's). With `policies` (a composite
    whose policy is a traced setting: `set_policy`), a list: the seconds under each policy, timed by one
    compiled program (the policy is part of the state)."""
    spec = drafter.resolve_tree(tree_lib.parse_tree_spec(spec))
    D, M = spec.max_depth, 8
    V = target.config.vocab_size
    scratch = drafter.check_tree(spec, "greedy")
    slack = max(spec.num_nodes, getattr(spec, "pool_size", spec.num_nodes), scratch) + D + 2
    # Room for `loops` commits of up to D + 1 tokens on top of the prompt (each commit advances the caches).
    batch = engine.prepare_prompts(prompts, V, M + loops * (D + 1), None, slack=slack)
    graphdef, state = nnx.split((target, drafter))
    params, key = SamplingParams.make(0.0, 0, 1.0), jax.random.key(0)
    eos = jnp.zeros((0,), jnp.int32)

    @jax.jit
    def start(state, toks, lens):
        m, d = nnx.merge(graphdef, state)
        c = engine.spec_start(m, d, toks, lens, params, key, eos, capacity=batch.capacity, max_new_tokens=M,
                              spec=spec, greedy=True)
        c, out = engine.spec_round(m, d, c, params, key, eos, max_new_tokens=M, rule="greedy", spec=spec, mode="topk")
        return c, out.committed

    carry, committed = start(state, jnp.asarray(batch.tokens), jnp.asarray(batch.lengths))
    # Sampled candidates are drawn from q warped at temperature 1 (as the T=1 sampled rows run).
    ctx = DraftContext(spec, mode, params if mode == "topk" else SamplingParams.make(1.0, 0, 1.0), key)

    @jax.jit
    def run(state, dstate, root):
        _, d = nnx.merge(graphdef, state)

        def body(i, x):
            ds, acc = x
            prop = d.propose(ds, root, ctx)
            ds = d.commit(prop.state, committed)
            return ds, acc + jnp.sum(prop.tree.tokens) + jnp.sum(prop.tree.valid)

        return jax.lax.fori_loop(0, loops, body, (dstate, jnp.int32(0)))[1]

    if policies is None:
        return median_s(lambda: run(state, carry.dstate, carry.root), repeats) / loops
    out = []
    for pol in policies:
        drafter.set_policy(pol)
        _, st = nnx.split((target, drafter))
        out.append(median_s(lambda: run(st, carry.dstate, carry.root), repeats) / loops)
    return out


def round_seconds(target, drafter, prompts, spec, repeats: int = 5, loops: int = LOOPS) -> float:
    """Seconds of one whole greedy round as the generation loop runs it (`engine.spec_round`:
    draft, verification forward, walk, both commits, emission): `loops` rounds in one jitted
    `fori_loop` carrying the loop's state, after a prefill of `prompts` and one real round."""
    spec = drafter.resolve_tree(tree_lib.parse_tree_spec(spec))
    D = spec.max_depth
    M = loops * (D + 1) + 8  # no row finishes inside the timed loop
    V = target.config.vocab_size
    scratch = drafter.check_tree(spec, "greedy")
    slack = max(spec.num_nodes, getattr(spec, "pool_size", spec.num_nodes), scratch) + D + 2
    batch = engine.prepare_prompts(prompts, V, M + loops * (D + 1), None, slack=slack)
    graphdef, state = nnx.split((target, drafter))
    params, key = SamplingParams.make(0.0, 0, 1.0), jax.random.key(0)
    eos = jnp.zeros((0,), jnp.int32)

    def one(m, d, c):
        return engine.spec_round(m, d, c, params, key, eos, max_new_tokens=M, rule="greedy", spec=spec, mode="topk")[0]

    @jax.jit
    def start(state, toks, lens):
        m, d = nnx.merge(graphdef, state)
        c = engine.spec_start(m, d, toks, lens, params, key, eos, capacity=batch.capacity, max_new_tokens=M,
                              spec=spec, greedy=True)
        return one(m, d, c)

    carry = start(state, jnp.asarray(batch.tokens), jnp.asarray(batch.lengths))

    @jax.jit
    def run(state, carry):
        m, d = nnx.merge(graphdef, state)
        return jax.lax.fori_loop(0, loops, lambda i, c: one(m, d, c), carry).n_out

    return median_s(lambda: run(state, carry), repeats) / loops


def forward_loop(graphdef, fam, tree, mask, layers, loops: int, pack=None):
    """A jitted `run(state, cache)`: `loops` verification forwards of `tree` in one `fori_loop` carrying
    the cache (released after each, as a round's scratch is). `pack`: a function giving the forward's
    `PackIndex` (packed verification), traced inside the program."""
    @jax.jit
    def run(state, cache):
        model = nnx.merge(graphdef, state)

        def body(i, x):
            c, acc = x
            kw = {} if pack is None else {"pack": pack()}
            out = fam.forward(model, tree.tokens + i * 0, tree_lib.positions(tree, c.length), c, mask,
                              hidden_layers=layers, parents=tree.parents, **kw)
            acc = acc + out.logits[0, 0, 0] + sum(h[0, 0, 0].astype(jnp.float32) for h in out.hidden)
            return fam.release(out.cache), acc

        return jax.lax.fori_loop(0, loops, body, (cache, jnp.float32(0)))[1]
    return run


def verify_seconds(target, layers, prompts, spec, widths, repeats: int = 5, loops: int = LOOPS) -> dict[int, float]:
    """Seconds of the target's verification forward over the first w nodes of the tree, per w:
    `loops` forwards in one jitted `fori_loop` carrying the cache (released after each, as a
    round's scratch is), on a cache holding each prompt (the committed context)."""
    spec = tree_lib.parse_tree_spec(spec)
    fam = family(target)
    graphdef, state = nnx.split(target)
    B, D, N = len(prompts), spec.max_depth, spec.num_nodes
    P = max(len(p) for p in prompts)
    toks = jnp.asarray(prompts, jnp.int32)
    lens = jnp.full((B,), P, jnp.int32)

    @jax.jit
    def prefill(state, toks, lens):  # one program, not op by op
        model = nnx.merge(graphdef, state)
        return fam.prefill(model, toks, lens, fam.init_cache(model, B, P + N + 1)).cache

    cache = prefill(state, toks, lens)
    rng = np.random.default_rng(1)
    draft = jnp.asarray(rng.integers(3, target.config.vocab_size, (B, N - 1)), jnp.int32)
    if tree_lib.is_chain(spec):
        tree = tree_lib.chain_tree(toks[:, -1], draft)
    else:  # w tree nodes cost what w chain nodes cost: one forward over w (the mask's shape costs nothing more)
        tree, D = tree_lib.chain_tree(toks[:, -1], draft), N - 1

    def make(w):
        sub = jax.tree.map(lambda x: x[:, :w], tree)
        return forward_loop(graphdef, fam, sub, tree_lib.ancestor_mask(sub, D), layers, loops)

    return {w: median_s(lambda run=make(w): run(state, cache), repeats) / loops for w in widths}


def verify_packed_seconds(target, layers, prompts, num_nodes: int, budgets, repeats: int = 5,
                          loops: int = LOOPS) -> dict[int, float]:
    """Seconds of the target's packed verification forward (`transformer.forward(pack=)`, design §19)
    with T live nodes, per compiled budget T: the rows' chains of N nodes cut to T nodes in all, as
    even as the rows allow (row b keeps ceil or floor of T / B), on a cache holding each prompt."""
    fam = family(target)
    graphdef, state = nnx.split(target)
    B, N = len(prompts), num_nodes
    P = max(len(p) for p in prompts)
    toks = jnp.asarray(prompts, jnp.int32)
    lens = jnp.full((B,), P, jnp.int32)

    @jax.jit
    def prefill(state, toks, lens):
        model = nnx.merge(graphdef, state)
        return fam.prefill(model, toks, lens, fam.init_cache(model, B, P + N + 1)).cache

    cache = prefill(state, toks, lens)
    rng = np.random.default_rng(1)
    tree = tree_lib.chain_tree(toks[:, -1], jnp.asarray(rng.integers(3, target.config.vocab_size, (B, N - 1)), jnp.int32))
    mask = tree_lib.ancestor_mask(tree, N - 1)

    def make(T):
        n_B = np.minimum(T // B + (np.arange(B) < T % B), N)
        live = jnp.asarray(np.arange(N)[None] < n_B[:, None])
        return forward_loop(graphdef, fam, tree, mask, layers, loops, pack=lambda: packing_lib.pack_index(live, T))

    runs = {T: make(T) for T in budgets}
    for T in budgets:  # compile + warm up
        jax.block_until_ready(runs[T](state, cache))
    times = {T: [] for T in budgets}
    for _ in range(max(repeats, 1)):  # interleaved: a slow stretch of the machine hits every budget alike
        for T in budgets:
            t0 = time.perf_counter()
            jax.block_until_ready(runs[T](state, cache))
            times[T].append(time.perf_counter() - t0)
    return {T: statistics.median(times[T]) / loops for T in budgets}


def linear_fit(xs, ys) -> list[float]:
    """Least-squares a + b x at each x, b clipped at 0 (a packed forward's seconds grow with its rows; the
    fit smooths this machine's +-30% noise between budgets, which a running max would lock in)."""
    x, y = np.asarray(xs, float), np.asarray(ys, float)
    if len(x) < 2:
        return y.tolist()
    b, a = np.polyfit(x, y, 1)
    b = max(b, 0.0)
    a = float(np.mean(y - b * x))
    return (a + b * x).tolist()


def packed_rows(target, drafter, batches, spec, context: int, repeats: int, loops: int = LOOPS, log=print,
                free: bool = True) -> dict:
    """The goodput budget's cost table (`specjax.spec.packing.load_packing`): {str(B): {"budgets",
    "round_s", "draft_s", "verify_s", "rest_s"}} per batch size. round_s[T] = draft + packed verify at
    T (its least-squares line over the budgets, timed interleaved) + the rest of a round (a whole round
    with every row's tree verified, minus its draft and its verification forward: the walk, commits,
    emission), non-decreasing in T."""
    rows = {}
    for B in batches:
        prompts = random_prompts(target.config.vocab_size, B, context, seed=B)
        budgets = packing_lib.packed_budgets(B, spec.num_nodes, engine.min_rows(target))
        draft = draft_seconds(target, drafter, prompts, spec, repeats, loops)
        ver = verify_packed_seconds(target, tuple(drafter.target_layers), prompts, spec.num_nodes, budgets, repeats, loops)
        full = verify_seconds(target, tuple(drafter.target_layers), prompts, spec, (spec.num_nodes,), repeats, loops)
        rest = max(round_seconds(target, drafter, prompts, spec, repeats, loops) - draft - full[spec.num_nodes], 0.0)
        fit = linear_fit(budgets, [ver[T] for T in budgets])
        round_s = np.maximum.accumulate([draft + v + rest for v in fit]).tolist()
        rows[str(B)] = {"budgets": list(budgets), "round_s": round_s, "draft_s": draft,
                        "verify_s": [ver[T] for T in budgets], "verify_fit_s": fit, "rest_s": rest,
                        "unpacked_verify_s": full[spec.num_nodes]}
        log(f"[profile_widths] packed, batch {B}: draft {1000 * draft:.2f} ms, rest {1000 * rest:.2f} ms, verify "
            + ", ".join(f"T={T} {1000 * ver[T]:.2f}" for T in budgets)
            + f" ms (unpacked {B}x{spec.num_nodes}: {1000 * full[spec.num_nodes]:.2f} ms)")
        if free:
            jax.clear_caches()
    return rows


def packed_table(profile: dict) -> list[str]:
    lines = [f"packed verification profile: {profile['target']} ({profile.get('weights', 'float32')}) + "
             f"{profile['drafter']}, tree {profile['tree']}, context {profile['context']} ({profile['cpu']})", "",
             "| batch | draft ms | rest ms | unpacked B x N verify ms | packed verify ms at T |", "|---:|---:|---:|---:|---|"]
    for b, r in profile["packed"].items():
        lines.append(f"| {b} | {1000 * r['draft_s']:.2f} | {1000 * r['rest_s']:.2f} | {1000 * r['unpacked_verify_s']:.2f} | "
                     + ", ".join(f"{T}: {1000 * v:.2f}" for T, v in zip(r["budgets"], r["verify_s"])) + " |")
    return lines


def profile_rows(target, drafter, batches, spec, widths, context: int, repeats: int, loops: int = LOOPS,
                 log=print, whole_round: bool = False, free: bool = True) -> dict:
    """{str(B): {"widths", "round_s", "draft_s", "verify_s"[, "rest_s"]}} for each batch size.
    `whole_round`: also time whole rounds (`round_seconds`, the drafter as given) and add what is
    neither the draft nor the verification forward (the walk, commits, emission: `rest_s`, the same
    at every width) to round_s, so a width's cost is a whole round's."""
    rows = {}
    for B in batches:
        prompts = random_prompts(target.config.vocab_size, B, context, seed=B)
        draft = draft_seconds(target, drafter, prompts, spec, repeats, loops)
        ver = verify_seconds(target, tuple(drafter.target_layers), prompts, spec, widths, repeats, loops)
        rest = 0.0
        if whole_round:  # the drafter as given verifies its widest width (equal costs), so the rest is what remains
            rest = max(round_seconds(target, drafter, prompts, spec, repeats, loops) - draft - ver[widths[-1]], 0.0)
        # A wider verification never costs less (timing noise aside): round_s is non-decreasing in w.
        round_s = np.maximum.accumulate([draft + ver[w] + rest for w in widths]).tolist()
        rows[str(B)] = {"widths": list(widths), "round_s": round_s, "draft_s": draft,
                        "verify_s": [ver[w] for w in widths]}
        if whole_round:
            rows[str(B)]["rest_s"] = rest
        log(f"[profile_widths] batch {B}: draft {1000 * draft:.2f} ms, verify "
            + ", ".join(f"w={w} {1000 * ver[w]:.2f}" for w in widths) + " ms"
            + (f", rest of the round {1000 * rest:.2f} ms" if whole_round else ""))
        if free:  # drop this batch size's programs (XLA:CPU's memory maps); --smoke keeps its tiny ones
            jax.clear_caches()
    return rows


def treegraft_costs(target, tg, spec, batches, context: int, repeats: int, loops: int = LOOPS, log=print) -> dict:
    """TreeGraft's action cost table (train/value_system.py reads it): per batch size, draft seconds per
    action (`draft_seconds` of the composite with the action forced: its propose, the scheduler's
    features and both commits; an action that does not fit the setup: null) and the target's
    verification seconds at each of the composite's compiled widths."""
    from specjax.drafters.composite.treegraft import ACTIONS
    from train.value_system import COST_FORMAT
    spec = tg.resolve_tree(tree_lib.parse_tree_spec(spec) if isinstance(spec, str) else spec)
    widths = tg.verify_widths(spec)
    available = tg.plan(spec).available
    keep, rows = tg.policy, {}
    for B in batches:
        prompts = random_prompts(target.config.vocab_size, B, context, seed=B)
        acts = [a for a, ok in zip(ACTIONS, available) if ok]
        tg.set_policy(acts[0])
        secs = dict(zip(acts, draft_seconds(target, tg, prompts, spec, repeats, loops, policies=acts)))
        draft = [secs.get(a) for a in ACTIONS]  # an action that does not fit the setup: None
        tg.set_policy(keep)
        ver = verify_seconds(target, tuple(tg.target_layers), prompts, spec, widths, repeats, loops)
        rows[str(B)] = {"widths": list(widths), "draft_s": draft, "verify_s": [ver[w] for w in widths]}
        log(f"[profile_widths] treegraft batch {B}: draft " + ", ".join(
            f"{a} {1000 * d:.2f}" for a, d in zip(ACTIONS, draft) if d is not None) + " ms; verify "
            + ", ".join(f"w={w} {1000 * ver[w]:.2f}" for w in widths) + " ms")
    meta = run_meta("profile_widths", None)
    return {"format": COST_FORMAT, "actions": list(ACTIONS), "cpu": meta["cpu"], "device": meta["device"],
            "tree": str(spec), "context": context, "repeats": repeats, "loops": loops, "batches": rows, "meta": meta}


def table(profile: dict) -> list[str]:
    rows = profile["rows"]
    widths = next(iter(rows.values()))["widths"]
    lines = [f"verify-width profile: {profile['target']} + {profile['drafter']}, tree {profile['tree']}, "
             f"context {profile['context']} ({profile['cpu']}; {profile['device']})", "",
             "| batch | draft ms | " + " | ".join(f"w={w} verify / round ms" for w in widths) + " |",
             "|---:|---:|" + "---:|" * len(widths)]
    for b, r in rows.items():
        lines.append(f"| {b} | {1000 * r['draft_s']:.2f} | " + " | ".join(
            f"{1000 * v:.2f} / {1000 * c:.2f}" for v, c in zip(r["verify_s"], r["round_s"])) + " |")
    return lines


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m tools.profile_widths",
                                 description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(REPO / "models/code-target"))
    ap.add_argument("--drafter", default=None, help="block drafter directory (default: TARGET-dspark)")
    ap.add_argument("--batch", default="1,4", help="comma-separated batch sizes (default 1,4)")
    ap.add_argument("--tree", default=None, help="chain=k (default: chain=<the drafter's block size>) or a TAPS tree, e.g. treeflash,nodes=32,select=taps")
    ap.add_argument("--context", type=int, default=256, help="committed tokens in the caches (default 256)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--loops", type=int, default=LOOPS, help="iterations per timed jitted call")
    ap.add_argument("--adaptive", action="store_true",
                    help="profile the adaptive shape's widths (specjax.spec.widths.adaptive_widths) for any drafter "
                         "(lm, feature, block) and --tree (default: the drafter's default tree)")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny random target and block drafter (with --adaptive: the smoke lm drafter, the one "
                         "bench_adaptive --smoke profiles): checks the tool")
    ap.add_argument("--treegraft", default=None, metavar="STACK",
                    help="TreeGraft's action cost table instead (train/value_system.py --costs): a stack CHEAP+STRONG "
                         "with its options, e.g. 'ngram+models/code-target-feature;strong_tree=chain=5', verify --tree")
    ap.add_argument("--out", default=None, help="JSON file (default bench/verify_profile_<target name>.json)")
    ap.add_argument("--packed", default=None, metavar="STACK",
                    help="the goodput budget's packed cost table instead (specjax.spec.packing.load_packing): a drafter "
                         "stack in specjax.drafters.compose's syntax, e.g. models/smollm2-135m-instruct-feature, and --tree")
    ap.add_argument("--weights", default="float32", choices=("float32", "bfloat16", "int8"),
                    help="the target's weights with --packed (default float32)")
    args = ap.parse_args(argv)
    if args.treegraft:
        return _treegraft_main(ap, args, argv)
    if args.packed:
        return _packed_main(ap, args, argv)
    try:
        batches = sorted({int(b) for b in args.batch.split(",") if b.strip()})
    except ValueError:
        ap.error(f"--batch {args.batch}: expected comma-separated integers")
    if not batches or min(batches) < 1:
        ap.error(f"--batch {args.batch}: expected positive batch sizes")

    from specjax.drafters.block import BlockDrafter
    if args.smoke:
        cfg, target, draft = smoke_models()
        if args.adaptive:  # the noisy-copy lm drafter: the programs `bench_adaptive --smoke` profiles
            from specjax.drafters import LMDrafter
            drafter = LMDrafter(draft)
        else:
            drafter = BlockDrafter(smoke_block_head(cfg), target, confidence=0.5)
        args.context, args.repeats, args.loops = min(args.context, 64), min(args.repeats, 2), min(args.loops, 4)
        target_name, drafter_name, sha = "smoke", "smoke", None
    else:
        import specjax
        from specjax.io.checkpoint import weights_sha256
        from specjax.drafters import load_drafter
        args.drafter = args.drafter or f"{args.target.rstrip('/')}-dspark"
        if not os.path.isdir(args.target):
            ap.error(f"--target {args.target}: no such directory")
        if not os.path.isdir(args.drafter):
            ap.error(f"--drafter {args.drafter}: no such directory (train one: python -m train.block)")
        target = specjax.load_model(args.target)
        try:
            drafter = load_drafter(args.drafter, target, target_path=args.target,
                                   confidence="off" if args.adaptive else 0.5, tuned=False)
        except ValueError as e:
            ap.error(f"--drafter {args.drafter}: {e}")
        if not isinstance(drafter, BlockDrafter) and not args.adaptive:
            ap.error(f"--drafter {args.drafter}: not a block drafter (profile another drafter's widths with --adaptive)")
        target_name, drafter_name, sha = repo_relative(args.target), repo_relative(args.drafter), weights_sha256(args.target)
    if args.adaptive:
        from specjax.drafters.composite.adaptive import AdaptiveShape
        from specjax.spec.widths import adaptive_widths
        tree = args.tree or drafter.default_tree
        try:
            n = drafter.resolve_tree(tree_lib.parse_tree_spec(tree)).num_nodes
            drafter = AdaptiveShape(drafter, (1.0,) * len(adaptive_widths(n)))
        except ValueError as e:
            ap.error(f"--adaptive --tree {tree}: {e}")
    tree = args.tree or drafter.default_tree
    try:
        spec = drafter.resolve_tree(tree_lib.parse_tree_spec(tree))
        if isinstance(spec, tree_lib.BestFirstTree) and not args.adaptive:  # TAPS's budget: the widths of tree_widths(N), confidence off
            from specjax.spec.widths import tree_widths
            drafter = type(drafter)(drafter.head, target, path_calibration=drafter.path_calibration,
                                   costs=(1.0,) * len(tree_widths(spec.num_nodes)) if spec.select == "taps" else None)
        drafter.check_tree(spec, "greedy")
        widths = drafter.verify_widths(spec)
    except ValueError as e:
        ap.error(f"--tree {tree}: {e}")
    if args.context + spec.num_nodes + 1 > target.config.max_position_embeddings:
        ap.error(f"--context {args.context}: does not fit the target's {target.config.max_position_embeddings} positions")

    rows = profile_rows(target, drafter, batches, spec, widths, args.context, args.repeats, args.loops,
                        log=lambda s: print(s, file=sys.stderr, flush=True), whole_round=args.adaptive,
                        free=not args.smoke)
    meta = run_meta("profile_widths", argv)
    profile = {"cpu": meta["cpu"], "device": meta["device"], "backend": meta["backend"],
               "target": target_name, "target_sha256": sha, "drafter": drafter_name, "tree": tree,
               "adaptive": bool(args.adaptive),
               "context": args.context, "repeats": args.repeats, "loops": args.loops,
               "command": meta["command"], "rows": rows, "meta": meta}
    out = Path(args.out or REPO / "bench" / default_profile_name(target_name if args.smoke else args.target))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(profile, indent=2) + "\n")
    print("\n".join(table(profile)))
    print(f"wrote {out}")
    return profile


def _packed_main(ap, args, argv) -> dict:
    import specjax
    from specjax.drafters import LMDrafter, compose
    from specjax.io.checkpoint import weights_sha256
    batches = sorted({int(b) for b in args.batch.split(",") if b.strip()})
    if not args.out:
        ap.error("--packed needs --out")
    if args.smoke:
        cfg, target, draft = smoke_models()
        drafter, sha, name = LMDrafter(draft), None, "smoke"
        args.context, args.repeats, args.loops = min(args.context, 64), min(args.repeats, 2), min(args.loops, 4)
    else:
        target = specjax.load_model(args.target, weights=args.weights)
        try:
            stack = compose.parse_stack(args.packed)
            drafter = compose.build(stack, compose.load_parts(stack.parts, target, target_path=args.target))
        except ValueError as e:
            ap.error(f"--packed {args.packed}: {e}")
        sha, name = weights_sha256(args.target), repo_relative(args.target)
    tree = args.tree or drafter.default_tree
    try:
        spec = drafter.resolve_tree(tree_lib.parse_tree_spec(tree))
        drafter.check_tree(spec, "greedy")
    except ValueError as e:
        ap.error(f"--tree {tree}: {e}")
    rows = packed_rows(target, drafter, batches, spec, args.context, args.repeats, args.loops,
                       log=lambda s: print(s, file=sys.stderr, flush=True), free=not args.smoke)
    meta = run_meta("profile_widths", argv)
    profile = {"cpu": meta["cpu"], "device": meta["device"], "backend": meta["backend"], "target": name,
               "target_sha256": sha, "weights": args.weights, "drafter": args.packed or "smoke", "tree": tree,
               "context": args.context, "repeats": args.repeats, "loops": args.loops, "command": meta["command"],
               "packed": rows, "meta": meta}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(profile, indent=2) + "\n")
    print("\n".join(packed_table(profile)))
    print(f"wrote {out}")
    return profile


def _treegraft_main(ap, args, argv) -> dict:
    import specjax
    from specjax.drafters import compose
    batches = sorted({int(b) for b in args.batch.split(",") if b.strip()})
    if not args.out or not args.tree:
        ap.error("--treegraft needs --tree (the verify budget) and --out")
    target = specjax.load_model(args.target)
    try:
        stack = compose.parse_stack(args.treegraft)
        if stack.composite != "treegraft":
            raise ValueError(f"{args.treegraft!r} is not a TreeGraft stack (CHEAP+STRONG)")
        tg = compose.build(stack, compose.load_parts(stack.parts, target, target_path=args.target))  # the shipped defaults
    except ValueError as e:
        ap.error(f"--treegraft {args.treegraft}: {e}")
    table_ = treegraft_costs(target, tg, args.tree, batches, args.context, args.repeats, args.loops,
                             log=lambda s: print(s, file=sys.stderr, flush=True))
    table_.update(target=repo_relative(args.target), stack=args.treegraft,
                  command="python -m tools.profile_widths " + " ".join(argv if argv is not None else sys.argv[1:]))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(table_, indent=2) + "\n")
    print(f"wrote {out}")
    return table_


if __name__ == "__main__":
    main()
