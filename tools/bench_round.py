"""Where a speculative round's time goes, and the τ each method needs to pay for itself.

1. The target's forward over a block of T tokens on top of a cached prompt (T = 1 is one
   autoregressive step; T = tree nodes + 1 is a verification), timed in a loop of 16 that carries
   the cache: ms and the ratio to T = 1.
2. For each drafter and tree: ms per round of the whole jitted loop (decode phase: the wall time
   of a generation minus that of its prefill alone, over the rounds), split into
   the verification forward (from 1) and the rest (drafting, drafter commit, verification rule,
   cache commit, bookkeeping); the break-even τ (ms per round / ms per autoregressive token), the
   measured τ, and the speedup it implies (τ × AR ms/token / ms per round).
3. Per-stage split of one round (`--split`, each stage jitted alone on the state after a real
   prefill and first round of the first prompt): draft (`propose`), of which the drafter's forwards
   (depth × one step: a `chain=2` minus a `chain=1` proposal, so the per-call dispatch cancels); the target's verification forward (ancestor mask
   included); the verification walk; the target's cache commit; the drafter's commit; and one
   whole round jitted as in the loop. "bookkeeping" = whole round − target forward − the drafter's
   own forwards (depth × one step, plus its commit): what is neither model's forward.

    python -m tools.bench_round                 # zoo models (random weights of the zoo's shapes if absent)
    python -m tools.bench_round --smoke         # tiny random models (what the test runs)
    python -m tools.bench_round --split-only    # only the per-stage split (3), lm chain=4 by default

Medians over repeats after a warm-up call; float32 unless `--weights` (bf16 / int8 storage, with the
batch-invariant attention by default, as `tools.bench`). Writes bench/<out>.md and .json
(`tools.harness.write_outputs`: "rows" are the rounds of 2; the forward costs, the split and the
autoregressive ms/token beside them).
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import specjax
from specjax.drafters import BlockDrafter, FeatureDrafter, LMDrafter, NgramDrafter, drafter_takes, load_drafter
from specjax.drafters.feature import FeatureConfig, FeatureHead
from specjax.models import family, transformer
from tools.harness import REPO, Column, median_ms, run_meta, smoke_models, write_outputs

DEFAULT_TREES = {"ngram": ["chain=5"], "lm": ["chain=4", "depth=5,topk=4,nodes=16"],
                 "feature": ["chain=3", "chain=5", "depth=5,topk=4,nodes=16"], "dspark": ["chain=4", "chain=8"]}


def forward_costs(target, prompt_len: int, blocks: list[int], repeats: int, loops: int = 16) -> dict[int, float]:
    """ms of one target forward over a block of T tokens on top of a cached prompt, per T: measured in
    a jitted `fori_loop` of `loops` forwards carrying the cache (as the generation loop runs them;
    a forward timed alone as its own call costs more: dispatch, and a copy of the non-donated cache)."""
    fam = family(target)
    graphdef, state = nnx.split(target)
    B, C = 1, prompt_len + max(blocks) + 1
    toks = jnp.asarray(np.random.default_rng(0).integers(3, target.config.vocab_size, (B, prompt_len)), jnp.int32)

    @jax.jit
    def prefill(state, toks):  # one program (not op by op): the cached prompt
        model = nnx.merge(graphdef, state)
        return fam.prefill(model, toks, jnp.full((B,), prompt_len, jnp.int32), fam.init_cache(model, B, C)).cache

    cache = prefill(state, toks)

    @jax.jit
    def block(state, cache, tokens_BxT):
        model = nnx.merge(graphdef, state)
        T = tokens_BxT.shape[1]

        def body(i, x):
            cache, acc = x
            pos = cache.length[:, None] + jnp.arange(T)[None]
            out = fam.forward(model, tokens_BxT + i * 0, pos, cache, transformer.causal_mask(B, T))
            return fam.release(out.cache), acc + out.logits[0, 0, 0]

        return jax.lax.fori_loop(0, loops, body, (cache, jnp.float32(0)))[1]

    return {T: median_ms(lambda T=T: block(state, cache, jnp.full((B, T), 5, jnp.int32)), repeats) / loops
            for T in blocks}


def tree_nodes(spec: str) -> int:
    from specjax.spec import tree as tree_lib
    return tree_lib.parse_tree_spec(spec).num_nodes


def load_models(args):
    """(target, {name: drafter}, prompts, what) — the zoo if present, else random weights of its shapes."""
    if args.smoke:
        cfg, target, draft = smoke_models()
        rng = np.random.default_rng(0)
        prompts = [(rng.integers(0, 64, 6).tolist() * 8)[:32]]  # one prompt bucket, as the other smoke runs
        # two drafters (a table-lookup one and a model one) keep the test's compiles few
        return target, {"ngram": NgramDrafter(), "lm": LMDrafter(draft)}, prompts, "tiny random models (--smoke)"
    tdir = Path(args.target)
    if (tdir / "config.json").exists():
        target = specjax.load_model(str(tdir), weights=args.weights, invariant=args.invariant)
        tok = specjax.load_tokenizer(str(tdir))
        from train import prompts as prompt_sets
        prompts = [c["ids"] for c in prompt_sets.prompt_set("functions", tok, args.prompts, context_tokens=args.context)]
        drafters = {"ngram": NgramDrafter()}
        for name, d in (("lm", args.draft), ("feature", args.feature), ("dspark", args.dspark)):
            if d and Path(d).is_dir():
                drafters[name] = load_drafter(d, target, target_path=str(tdir),
                                              **({"draft_vocab": args.draft_vocab} if "draft_vocab" in drafter_takes(d) and args.draft_vocab else {}), tuned=False)
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


def stage_split(target, drafter, prompt, spec_str: str, repeats: int, loops: int = 16,
                steps: bool = True) -> dict[str, float]:
    """ms per round of each stage of a greedy round, measured IN a loop (see the module docstring, 3):
    each stage runs `loops` times in one jitted `fori_loop` that carries its state, as the
    generation loop does (buffers updated in place, weights hot in cache), after a prefill and
    one real round of `prompt`. A stage timed alone as its own jitted call is not comparable: it
    pays a dispatch and copies its non-donated buffers, and on this CPU an autoregressive step
    timed alone costs far more than one in the loop."""
    from specjax.engine import loop as engine
    from specjax.spec import tree as tree_lib, verify as verify_lib
    from specjax.drafters.base import Committed, DraftContext
    from specjax.spec.sampling import SamplingParams

    spec = drafter.resolve_tree(tree_lib.parse_tree_spec(spec_str))
    D, M, R = spec.max_depth, 64, loops
    V = target.config.vocab_size
    scratch = drafter.check_tree(spec, "greedy")
    slack = max(spec.num_nodes, getattr(spec, "pool_size", spec.num_nodes), scratch) + D + 2
    # Room for R commits of D + 1 tokens on top of the prompt (the commit loops advance the caches).
    batch = engine.prepare_prompts([prompt], V, M + R * (D + 1), None, slack=slack)
    graphdef, state = nnx.split((target, drafter))
    params, key = SamplingParams.make(0.0, 0, 1.0), jax.random.key(0)
    eos = jnp.zeros((0,), jnp.int32)
    fam = family(target)
    layers = tuple(drafter.target_layers)
    ctx = lambda sp: DraftContext(sp, "topk", params, key)  # noqa: E731

    def committed_of(carry, vd, tout, cache):
        root = carry.root
        feats = None
        if layers:
            feats = jnp.take_along_axis(jnp.concatenate(tout.hidden, axis=-1), vd.path[..., None], axis=1)
        return Committed(tokens=jnp.concatenate([root[:, None], vd.tokens], 1), count=vd.num_accepted + 1,
                         features=feats, target=cache)

    @jax.jit
    def start(state, toks, lens):
        m, d = nnx.merge(graphdef, state)
        c = engine.spec_start(m, d, toks, lens, params, key, eos, capacity=batch.capacity, max_new_tokens=M,
                              spec=spec, greedy=True)
        return engine.spec_round(m, d, c, params, key, eos, max_new_tokens=M, rule="greedy", spec=spec,
                                 mode="topk")[0]

    carry = start(state, jnp.asarray(batch.tokens), jnp.asarray(batch.lengths))

    def looped(body):
        """A jitted R-iteration loop of `body(state, x, i) -> x` (x: the stage's carried state)."""
        @jax.jit
        def run(state, x):
            return jax.lax.fori_loop(0, R, lambda i, x: body(state, x, i), x)
        return run

    def touch(x, i):  # a loop-variant zero, so XLA cannot hoist a stage out of its loop
        return x + (i * 0).astype(x.dtype)

    def round_body(state, c, i):
        m, d = nnx.merge(graphdef, state)
        new = engine.spec_round(m, d, c, params, key, eos, max_new_tokens=M + R * (D + 1), rule="greedy",
                                spec=spec, mode="topk")[0]
        return new

    def between_rounds(st):
        """(the state as a round leaves it, a value that keeps what propose made for commit alive):
        DPara's boundary blocks exist inside a round only, and their shape follows the tree."""
        blocks = getattr(st, "boundary", None)
        if blocks is None:
            return st, jnp.int32(0)
        return dataclasses.replace(st, boundary=None), (jnp.sum(blocks) > 0).astype(jnp.int32)

    def propose_body(sp):
        def body(state, x, i):
            _, d = nnx.merge(graphdef, state)
            dstate, acc = x
            prop = d.propose(dstate, carry.root, ctx(sp))
            st, alive = between_rounds(prop.state)
            return st, acc + jnp.sum(prop.tree.tokens) + alive
        return body

    @jax.jit
    def first_round(state, carry):
        """The next round's pieces, one program (not op by op): the proposal, the target's forward over
        its tree, the verdict and what the drafter commits; every stage loop starts from them."""
        m, d = nnx.merge(graphdef, state)
        prop = d.propose(carry.dstate, carry.root, ctx(spec))
        tree = prop.tree
        tout = fam.forward(m, tree.tokens, tree_lib.positions(tree, carry.cache.length), carry.cache,
                           tree_lib.ancestor_mask(tree, D), hidden_layers=layers, parents=tree.parents)
        vd = verify_lib.verify(tree, tout.logits, key, rule="greedy", max_depth=D, params=params)
        return prop, tout, committed_of(carry, vd, tout, fam.commit(tout.cache, vd.path, vd.num_accepted + 1))

    d0 = nnx.merge(graphdef, state)[1]
    prop, tout, committed = first_round(state, carry)
    tree = prop.tree
    cache0 = carry.cache

    def forward_body(state, x, i):
        m, _ = nnx.merge(graphdef, state)
        cache, acc = x
        out = fam.forward(m, touch(tree.tokens, i), tree_lib.positions(tree, cache.length), cache,
                          tree_lib.ancestor_mask(tree, D), hidden_layers=layers, parents=tree.parents)
        return fam.release(out.cache), acc + out.logits[0, 0, 0]

    def walk_body(state, acc, i):
        v = verify_lib.verify(tree, tout.logits + acc * 0, key, rule="greedy", max_depth=D, params=params)
        return acc + v.num_accepted.sum().astype(jnp.float32)

    def dcommit_body(state, dstate, i):
        _, d = nnx.merge(graphdef, state)
        new = d.commit(dstate, committed)
        return dataclasses.replace(new, boundary=dstate.boundary) if getattr(dstate, "boundary", None) is not None else new

    reps = max(repeats * 5, 5)
    per = lambda fn, *a: median_ms(lambda: fn(*a), reps) / R  # noqa: E731
    zero = jnp.float32(0)
    ms = {"whole round": per(looped(round_body), state, carry),
          "draft (propose)": per(looped(propose_body(spec)), state, (between_rounds(prop.state)[0], jnp.int32(0))),

          "target forward (verification)": per(looped(forward_body), state, (cache0, zero)),
          "verification walk": per(looped(walk_body), state, zero),
          "drafter commit": per(looped(dcommit_body), state, prop.state)}
    if steps:  # one drafter step: a chain=2 minus a chain=1 proposal (the per-call dispatch cancels)
        for k in (1, 2):
            ms[f"chain={k} proposal"] = per(looped(propose_body(tree_lib.chain(k))), state,
                                           (between_rounds(prop.state)[0], jnp.int32(0)))
    if isinstance(d0, BlockDrafter):
        ms.update(block_stages(graphdef, state, carry, prop, tree, cache0, looped, touch, per, fam, layers, D, ctx(spec)))
    if not steps:
        return ms
    # one drafter step: the marginal cost of one more depth
    ms["one drafter step"] = max(ms["chain=2 proposal"] - ms["chain=1 proposal"], 0.0)
    ms["draft forwards (depth x one step)"] = D * ms["one drafter step"]
    ms["rest (target commit, emission, loop)"] = (ms["whole round"] - ms["draft (propose)"]
                                                 - ms["target forward (verification)"] - ms["verification walk"]
                                                 - ms["drafter commit"])
    ms["bookkeeping"] = (ms["whole round"] - ms["target forward (verification)"]
                         - ms["draft forwards (depth x one step)"] - ms["drafter commit"])
    return ms


def block_stages(graphdef, state, carry, prop, tree, cache0, looped, touch, per, fam, layers, D, ctx) -> dict[str, float]:
    """A block drafter's round split along its critical path (`stage_split`'s loops, same state):
    its backbone pass (DSpark: the block through the backbone and the LM head, on the path; DPara:
    the boundary pass over the draft's nodes, off it), its head (DSpark: the Markov walk from the
    block; DPara: the LM head on the chosen block and the walk), and the target's verification
    forward and the backbone pass in ONE loop body with no data dependence between them: below their
    sum where the device runs them side by side."""
    import dataclasses

    from specjax.spec import tree as tree_lib
    from specjax.drafters.block import BlockPass
    d0 = nnx.merge(graphdef, state)[1]
    dpara = d0.head.config.boundary
    n = d0.precomputed(ctx.spec) if dpara else 0  # DPara: the nodes whose blocks are precomputed
    anc = tree_lib.ancestor_mask(tree, D)

    def backbone(d, dcache, i):
        if dpara:
            h, dcache = d.boundary_pass(dcache, touch(tree.tokens[:, :n], i), tree.depth[:, :n], anc[:, :n, :n])
            return dcache, jnp.sum(h)
        b = d.draft_block(dataclasses.replace(carry.dstate, cache=dcache), touch(carry.root, i))
        return b.cache, jnp.sum(b.base)  # its LM head too: DSpark's base logits come out of its backbone pass

    def backbone_body(state, x, i):
        dcache, acc = x
        dcache, s = backbone(nnx.merge(graphdef, state)[1], dcache, i)
        return dcache, acc + s

    blk0 = jax.jit(lambda state, dstate, root: nnx.merge(graphdef, state)[1].block_pass(dstate, root))(
        state, carry.dstate, carry.root)  # one program, not op by op

    def head_body(state, x, i):
        _, d = nnx.merge(graphdef, state)
        dstate, acc = x
        root = touch(carry.root, i)
        blk = d.block_pass(dstate, root) if dpara else BlockPass(blk0.base, blk0.hidden, dstate.cache, blk0.pre)
        p = d._draft(dstate, blk, root, ctx)
        return p.state, acc + jnp.sum(p.tree.tokens)

    def both_body(state, x, i):
        m, d = nnx.merge(graphdef, state)
        tcache, dcache, acc = x
        out = fam.forward(m, touch(tree.tokens, i), tree_lib.positions(tree, tcache.length), tcache, anc,
                          hidden_layers=layers, parents=tree.parents)
        dcache, s = backbone(d, dcache, i)
        return fam.release(out.cache), dcache, acc + out.logits[0, 0, 0] + s

    dcache0 = prop.state.cache
    zero = jnp.float32(0)
    return {"drafter backbone pass": per(looped(backbone_body), state, (dcache0, zero)),
            "drafter head (block -> draft)": per(looped(head_body), state, (carry.dstate, jnp.int32(0))),
            "verification forward + backbone pass, one program": per(looped(both_body), state, (cache0, dcache0, zero))}


def critical_path(ms: dict, dpara: bool) -> dict[str, float]:
    """A block drafter's round along its critical path, from `stage_split` + `block_stages` (ms):
    `measured` the whole round as this device ran it; `sequential` backbone + head + verification
    forward + the rest (walk, commits, emission); `overlap saving` what running the verification
    forward and the backbone pass in one program saved against their sum here; `with full overlap`
    DPara's round if the backbone ran entirely beside the verification forward (measured round −
    min(backbone, forward)); DSpark's backbone waits for the verification, so its round stays."""
    fwd, bb = ms["target forward (verification)"], ms["drafter backbone pass"]
    rest = ms["whole round"] - ms["draft (propose)"] - fwd
    head = ms["drafter head (block -> draft)"]
    out = {"measured round": ms["whole round"],
           "sequential sum: backbone + head + verification forward + rest": bb + head + fwd + rest,
           "critical path (DSpark: the sum; DPara: without the backbone)": (0.0 if dpara else bb) + head + fwd + rest,
           "overlap saving measured (forward + backbone - one program)": fwd + bb - ms["verification forward + backbone pass, one program"]}
    out["round with full overlap"] = ms["whole round"] - (min(bb, fwd) if dpara else 0.0)
    return out


def split_table(rows: list[dict]) -> list[str]:
    keys = list(rows[0]["ms"])
    lines = ["| stage (ms) | " + " | ".join(f"{r['drafter']} `{r['tree']}`" for r in rows) + " |",
             "|---|" + "---:|" * len(rows)]
    for k in keys:
        lines.append(f"| {k} | " + " | ".join(f"{r['ms'][k]:.2f}" for r in rows) + " |")
    lines.append("| bookkeeping / target forward | " + " | ".join(
        f"{r['ms']['bookkeeping'] / r['ms']['target forward (verification)']:.2f}" for r in rows) + " |")
    return lines


ROUND_COLUMNS = [Column("drafter", "drafter", right=False), Column("tree", lambda r: f"`{r['tree']}`", right=False),
                 Column("nodes", "nodes"), Column("ms/round", "ms_round", "{:.2f}"),
                 Column("verify fwd ms", "verify_ms", "{:.2f}"), Column("draft + rest ms", "rest_ms", "{:.2f}"),
                 Column("break-even τ", "break_even_tau", "{:.2f}"), Column("τ", "tau", "{:.2f}"),
                 Column("speedup", "speedup", "{:.2f}×")]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m tools.bench_round",
                                 description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(REPO / "models/code-target"))
    ap.add_argument("--draft", default=str(REPO / "models/code-draft"))
    ap.add_argument("--feature", default=None,
                    help="feature drafter (default: the target's own, TARGET-feature, where it exists; '' for none)")
    ap.add_argument("--dspark", default=None, help="a block (DSpark) drafter directory of the target (rows `dspark`)")
    ap.add_argument("--draft-vocab", type=int, default=None,
                    help="the feature drafter's reduced draft vocabulary (as `tools.bench --draft-vocab`)")
    ap.add_argument("--weights", default="float32", choices=("float32", "bfloat16", "int8"),
                    help="the target's weight storage (load_model(weights=...)); AR and every round run at it")
    ap.add_argument("--invariant", action=argparse.BooleanOptionalAction, default=None,
                    help="the target's batch-invariant attention (default: on at bfloat16 / int8, as tools.bench)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--split", default="lm:chain=4,ngram:chain=5,feature:chain=5",
                    help="drafter:tree pairs of the per-stage split ('' for none)")
    ap.add_argument("--split-only", action="store_true", help="only the per-stage split")
    ap.add_argument("--trees", default=None, metavar="NAME:SPEC;...",
                    help="the rounds timed in (2), e.g. 'ngram:chain=6;dspark:chain=8' (default: each drafter's "
                         "DEFAULT_TREES)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.feature is None:  # a feature drafter reads its own target's features: never another target's
        args.feature = f"{args.target.rstrip('/')}-feature"
    if args.invariant is None:
        args.invariant = args.weights != "float32"
    if args.smoke:
        args.new_tokens, args.repeats, args.context = 12, 1, 32
    out = Path(args.out or REPO / ("bench/bench_round_smoke" if args.smoke else "bench/bench_round"))
    target, drafters, prompts, what = load_models(args)
    if args.weights != "float32":
        what += f", {args.weights} weights" + (", batch-invariant attention" if args.invariant else "")
    split = []
    for item in filter(None, ("lm:chain=4" if args.smoke else args.split).split(",")):
        name, _, spec = item.partition(":")
        if name in drafters:
            split.append({"drafter": name, "tree": spec, "ms": stage_split(target, drafters[name], prompts[0], spec,
                                                                            args.repeats)})
    split_lines = [] if not split else [
        "## One round, stage by stage", "",
        "Each stage runs 16 times in one jitted `fori_loop` carrying its state (as in the generation loop), "
        f"after a prefill and one real round of the first prompt; ms per iteration, medians of "
        f"{max(args.repeats * 5, 5)} calls. Bookkeeping = whole round − target forward − the drafter's own "
        "forwards (depth × one step, and its commit).", ""] + split_table(split) + [""]
    if args.split_only:
        meta = run_meta("bench_round", argv, what=what, context=args.context, repeats=args.repeats,
                        weights=args.weights, invariant=args.invariant)
        md = write_outputs(out, meta, split, None, title=f"One round, stage by stage ({what})",
                           intro=split_lines[2:], extra={"split": split})
        print(md.read_text())
        return {"split": split}
    # --smoke: one chain per drafter, so the few compiles stay cheap.
    trees = {name: ["chain=4"] if args.smoke else DEFAULT_TREES[name] for name in drafters}
    if args.trees and not args.smoke:
        trees = {}
        for item in filter(None, (t.strip() for t in args.trees.split(";"))):
            name, sep, spec = item.partition(":")
            if not sep or name not in drafters:
                ap.error(f"--trees {item!r}: expected NAME:SPEC with NAME one of {sorted(drafters)}")
            trees.setdefault(name, []).append(spec)
    blocks = sorted(({1} if args.smoke else {1, 2, 4, 8, 16}) | {tree_nodes(t) for ts in trees.values() for t in ts})
    fwd = forward_costs(target, args.context, blocks, max(args.repeats * 3, 3))

    kw = dict(max_new_tokens=args.new_tokens, eos_token_id=())
    kw1 = dict(max_new_tokens=1, eos_token_id=())  # prefill + the first token: no decode step, no round

    def decode_ms(p, **extra):
        """ms of the decode phase: the whole generation minus its prefill (measured alone)."""
        whole = median_ms(lambda: specjax.generate(target, [p], **extra, **kw).tokens, args.repeats)
        if args.smoke:  # tiny models measure nothing real: spare the test the prefill programs' compiles
            return whole
        prefill = median_ms(lambda: specjax.generate(target, [p], **extra, **kw1).tokens, args.repeats)
        return whole - prefill

    rows = []
    ar_ms = []
    for p in prompts:  # one prompt at a time: batch 1, the latency case
        ar_ms.append(decode_ms(p) / (args.new_tokens - 1))
    ar = statistics.median(ar_ms)
    for name, drafter in drafters.items():
        for spec in trees.get(name, []):
            per_round, taus = [], []
            for p in prompts:
                res = specjax.generate(target, [p], drafters=[drafter], tree=spec, **kw)
                ms = decode_ms(p, drafters=[drafter], tree=spec)
                per_round.append(ms / int(res.stats["rounds"][0]))
                taus.append(float(res.stats["tau"][0]))
            ms_round, tau = statistics.median(per_round), statistics.mean(taus)
            verify = fwd[tree_nodes(spec)]
            rows.append({"drafter": name, "tree": spec, "nodes": tree_nodes(spec), "ms_round": ms_round,
                         "verify_ms": verify, "rest_ms": ms_round - verify, "break_even_tau": ms_round / ar,
                         "tau": tau, "speedup": tau * ar / ms_round})
    meta = run_meta("bench_round", argv, what=what, context=args.context, new_tokens=args.new_tokens,
                    prompts=len(prompts), repeats=args.repeats, weights=args.weights, invariant=args.invariant)
    result = {"meta": meta, "what": what, "ar_ms_per_token": ar, "forward_ms": fwd, "rounds": rows, "split": split}
    dtype = args.weights + (" weights, batch-invariant attention" if args.invariant else "")
    intro = [f"Batch 1, prompts of {args.context} tokens, {args.new_tokens} new tokens, greedy, {dtype}, "
             f"{meta['backend']}; medians over {args.repeats} repeats. Decode phase only: "
             "every ms below is a whole generation's minus its prefill's (the same call with max_new_tokens=1). "
             f"Autoregressive: **{ar:.2f} ms/token**.", "",
             "| target forward over T tokens | " + " | ".join(str(T) for T in fwd) + " |",
             "|---|" + "---:|" * len(fwd),
             "| ms | " + " | ".join(f"{v:.2f}" for v in fwd.values()) + " |",
             "| × one step | " + " | ".join(f"{v / fwd[1]:.2f}" for v in fwd.values()) + " |"]
    notes = ["`nodes` counts the root (the verification block is `nodes` tokens). Speedup = τ × AR ms/token / "
             "ms/round: what the loop gains over autoregressive decoding at this τ.", ""] + split_lines
    md = write_outputs(out, meta, rows, ROUND_COLUMNS, title=f"Where a round's time goes ({what})", intro=intro,
                       notes=notes, extra={"ar_ms_per_token": ar, "forward_ms": fwd, "split": split})
    print(md.read_text())
    return result


if __name__ == "__main__":
    main()
