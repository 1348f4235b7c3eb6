"""Speculative decoding on the model zoo, every method side by side in one process.

For each method (autoregressive; chain and tree with each drafter; greedy and temperature 1, the
latter with the deterministic-candidates rule and, for a drafter with a distribution, the sampled one):
tokens/s, speedup over our autoregressive loop measured in the same run, tau (mean acceptance
length, bonus included) and per-depth acceptance, medians over repeats after untimed warm-up
calls (one per prompt-length bucket, so every shape is compiled before timing).

An MTP module (`--mtp`: multi-token prediction, design §5f) drafts chains of 1..4 and a dynamic tree.
Block drafters (`--dspark`, `--dflash`: DSpark and its DFlash ablation; `--ready`: ReaDy, DSpark
reading a hybrid target's recurrent states; `--dpara`: DPara, DSpark with the next block precomputed
for every acceptance boundary; `--block NAME=DIR`: any other, e.g. an ablation) draft a
chain of their block size, with the confidence cut off, at a threshold (`--dspark-threshold`) and, given a verify-width
profile of this machine (`--verify-profile`, from `python -m tools.profile_widths`), under the DSpark
scheduler; and a dynamic tree from the same one backbone pass; a state reader also drafts with
its reader on zeroed states (`zero-state` rows, the ablation). One loaded head serves every
variant. Two more columns per speculative method:
  draft ms / round   the drafter's propose + commit alone, jitted: 16 pairs in one `fori_loop`
                     carrying the drafter's state (`tools.profile_widths.draft_seconds`), on the
                     state after a prefill of the first batch of prompts and one real round;
                     median of calls after a warm-up, / 16. Greedy candidates, or sampled ones for
                     the sampled rule;
  mean verify width  tree nodes the target verified per round (root included; below the tree's
                     node count when a drafter cuts its drafts), from the engine's stats. Greedy methods are checked token for token against greedy autoregressive output; a
divergence counts as an honest near-tie only where the target's top-2 logits are within 1e-4.
With `--hf`, transformers' assisted generation (assistant_model = the same draft weights, and
prompt lookup) runs on the same prompts as the peer (batch 1, its only mode).

    python -m tools.bench                      # the zoo: models/code-target (+ code-draft, code-target-feature)
    python -m tools.bench --smoke              # tiny random models, seconds (what the test runs)
    python -m tools.bench --methods "dspark chain=8,dspark chain=8 schedule,dflash chain=8"

Writes bench/<out>.md, .json and .png (`tools.harness.write_outputs`). Float32 on CPU.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import specjax
from specjax.spec import tree as tree_lib
from specjax.drafters import BlockDrafter, LMDrafter, NgramDrafter, compose, load_drafter
from specjax.spec.profile import costs_at_widths, costs_from_profile, default_profile_name, load_profile
from specjax.spec.widths import tree_widths
from tools.harness import (REPO, Column, batches, check_cell, generation_row, greedy_check, run_meta,
                           smoke_block_head, smoke_models, time_generation, warmup_groups, with_speedup,
                           write_outputs)
from tools.profile_widths import draft_seconds
from train.common import repo_relative  # paths written down relative to the repo

DPARA_BOUNDARIES = (2, 4)  # DPara chains that precompute only the first b boundaries (the rest after the fact)
BLOCK_TREE = (6, 4, 16)  # a block drafter's tree row: depth (at most its block), top-k, nodes


@dataclasses.dataclass(frozen=True)
class Method:
    name: str
    drafter: str | None  # key into the loaded drafters; None: autoregressive
    tree: str | None = None
    temperature: float = 0.0
    verify: str | None = None  # None: the engine's default rule (greedy at T=0, deterministic candidates at T>0)
    confidence: object = "off"  # a block drafter's confidence cut: "off", a threshold, or "schedule"
    costs: tuple | None = None  # with "schedule": round seconds per verify width (a profile of this machine)
    zero_state: bool = False  # ReaDy's ablation: the state reader on zeroed states
    boundaries: int | None = None  # DPara: acceptance boundaries of a chain precomputed beside the verification
    packing: str | None = None  # packed verification (specjax.spec.packing): "pack" (per-row widths), "goodput", "goodput-cal"


def block_methods(name: str, drafter: BlockDrafter, threshold: float = 0.5, schedule_costs=None) -> list[Method]:
    """A block drafter's chain of its block size: confidence off, at `threshold` and (given costs)
    scheduled, each greedy, at T=1 deterministic and at T=1 sampled (DFlash: off only); the chain of
    half the block, greedy (where a verification of the full block costs more than its later
    positions' acceptance brings); and a
    dynamic tree from the same one pass (`BLOCK_TREE`, greedy). A state-reading drafter (ReaDy)
    also gets its ablation: the chain with the reader on zeroed states, greedy and at T=1."""
    chain = f"chain={drafter.head.config.block_size}"
    variants = [("", "off", None)]
    if drafter.head.config.confidence:
        variants.append((f" conf={threshold:g}", threshold, None))
        if schedule_costs is not None:
            variants.append((" schedule", "schedule", tuple(schedule_costs)))
    out = []
    for suffix, conf, costs in variants:
        base = f"{name} {chain}{suffix}"
        out += [Method(base, name, chain, confidence=conf, costs=costs),
                Method(f"{base} T=1", name, chain, 1.0, confidence=conf, costs=costs),
                Method(f"{base} T=1 sampled", name, chain, 1.0, verify="sampled", confidence=conf, costs=costs)]
    if "boundaries" in drafter.RUN_OPTIONS:  # DPara
        out += [Method(f"{name} {chain} boundaries={b}", name, chain, boundaries=b)
                for b in DPARA_BOUNDARIES if b < drafter.head.config.block_size]
    if "zero_state" in drafter.RUN_OPTIONS:  # ReaDy
        out += [Method(f"{name} {chain} zero-state", name, chain, zero_state=True),
                Method(f"{name} {chain} zero-state T=1", name, chain, 1.0, zero_state=True)]
    half = drafter.head.config.block_size // 2
    if half >= 2 and "zero_state" not in drafter.RUN_OPTIONS:  # a shorter chain: verifies fewer tokens a round
        out.append(Method(f"{name} chain={half}", name, f"chain={half}"))
    depth = min(BLOCK_TREE[0], drafter.head.config.block_size)
    if depth < 2:  # a one-position block has no tree to speak of
        return out
    tree = f"depth={depth},topk={BLOCK_TREE[1]},nodes={BLOCK_TREE[2]}"
    return out + [Method(f"{name} {tree}", name, tree)]


def tree_methods(name: str, drafter: BlockDrafter, budgets, taps_costs=None) -> list[Method]:
    """Best-first trees from a block drafter's one pass (design §5e), greedy, at each node budget:
    DDTree (marginal rows), TreeFlash with the Markov head's exact rows, with the TreeFlash head's
    rows (a drafter that has one), and TreeFlash + TAPS selection (a drafter with a path
    calibration; its verify budget chosen per round from `taps_costs` {width: round seconds}, when
    given, among `tree_widths(N)`)."""
    cfg = drafter.head.config
    cal = drafter.path_calibration.kinds() if drafter.path_calibration is not None else ()
    out = []
    for n in budgets:
        out.append(Method(f"{name} ddtree,nodes={n}", name, f"ddtree,nodes={n}"))
        if cfg.markov_rank:
            out.append(Method(f"{name} treeflash,nodes={n},rows=markov", name, f"treeflash,nodes={n},rows=markov"))
        if cfg.has_ar_head:
            out.append(Method(f"{name} treeflash,nodes={n},rows=head", name, f"treeflash,nodes={n},rows=head"))
        kind = "head" if cfg.has_ar_head else "markov"
        if cfg.markov_rank and kind in cal:
            tree = f"treeflash,nodes={n},rows={kind},select=taps"
            costs = None
            if taps_costs is not None:
                widths = tree_widths(n)
                if all(w in taps_costs for w in widths):
                    costs = tuple(taps_costs[w] for w in widths)
            out.append(Method(f"{name} {tree}" + (" budget" if costs else ""), name, tree, costs=costs))
    return out


def default_methods(drafters: dict, threshold: float = 0.5, schedule_costs: dict | None = None) -> list[Method]:
    out = [Method("ar", None), Method("ar T=1", None, temperature=1.0)]
    trees = {"lm": ("chain=4", "depth=5,topk=4,nodes=16"), "feature": ("chain=5", "chain=3", "depth=6,topk=6,nodes=24"),
             "ngram": ("chain=6", "depth=6,topk=3,nodes=16"),
             "mtp": ("chain=3", "chain=1", "chain=2", "chain=4", "depth=5,topk=4,nodes=16")}
    for name, drafter in drafters.items():
        if isinstance(drafter, BlockDrafter):
            out += block_methods(name, drafter, threshold, (schedule_costs or {}).get(name))
            continue
        # mtp@N: the MTP module with N draft tokens; feature-int8: the feature drafter stored at int8
        shapes = trees.get(name.partition("@")[0].removesuffix("-int8").removesuffix("-bfloat16"), ("chain=4",))
        for t in shapes:
            out.append(Method(f"{name} {t}", name, t))
        chain = shapes[0]  # the temperature-1 rows draft the first
        out.append(Method(f"{name} {chain} T=1", name, chain, 1.0))
        if drafter.gives_q:  # a drafter with a distribution q: also the sampled-candidates rule
            out.append(Method(f"{name} {chain} T=1 sampled", name, chain, 1.0, verify="sampled"))
    return out


def split_methods(text: str) -> list[str]:
    """A --methods list: names split on commas, except those inside a dynamic tree spec
    ('lm depth=5,topk=4,nodes=16' is one name)."""
    out = []
    for piece in text.split(","):
        if out and piece.startswith(("topk=", "nodes=", "m=", "k=", "depth=", "rows=", "select=")):
            out[-1] += "," + piece
        else:
            out.append(piece)
    return out


def extra_methods(names, drafters: dict) -> list[Method]:
    """`--methods` names outside the default list that read `STACK TREE`: a drafter stack in
    `specjax.drafters.compose`'s syntax over loaded drafters and a tree spec that
    `specjax.spec.tree.parse_tree_spec` takes, greedy, so any drafters can be compared at the same shape:
    'lm chain=3', 'mtp@2048 chain=5', 'dspark;confidence=0.5 chain=8';
    'ngram+dspark-int8 depth=6,topk=2,nodes=8' (TreeGraft, the strong drafter invoked every round unless
    `;policy=SCHEDULER_DIR`), TREE the verify budget;
    'ngram|feature@1024-int8;min_match=3;model_tree=chain=3 chain=6' (the Switch, TREE the n-gram's),
    also written 'ngram|feature@1024-int8 chain=6|chain=3|3' (TREE|MODEL_TREE|MIN_MATCH, as earlier
    results name their rows).
    A trailing ' pack' verifies each row's own nodes packed (`generate(packing=Packing())`), ' goodput'
    adds the goodput budget (the cost table of --packed-profile) on the drafter's own path probabilities,
    ' goodput-cal' on the adaptive shape's online-calibrated estimates (`AdaptiveShape.estimator`):
    'feature chain=4 goodput-cal'."""
    out = []
    for name in names:
        text, _, tree = name.partition(" ")
        tree, _, pk = tree.partition(" ")
        if pk not in ("", "pack", "goodput", "goodput-cal"):
            continue
        try:
            stack = compose.parse_stack(text)
        except ValueError:
            continue
        if not tree or not all(p in drafters for p in stack.parts):
            continue
        if stack.composite == "switch" and "|" in tree:  # the rows' older spelling of the Switch's options
            tree, _, rest = tree.partition("|")
            model_tree, _, min_match = rest.partition("|")
            if min_match and not min_match.isdigit():
                raise ValueError(f"method {name!r}: MIN_MATCH must be an n-gram length, got {min_match!r}")
            stack = compose.Stack.make(stack.parts, "switch", **{**stack.opts, "model_tree": model_tree or None,
                                                                   "min_match": int(min_match) if min_match else None})
        try:
            tree_lib.parse_tree_spec(tree)
            if "model_tree" in stack.opts:
                tree_lib.parse_tree_spec(stack.opts["model_tree"])
        except ValueError:
            continue
        out.append(Method(name, stack.text(), tree, packing=pk or None))
    return out


def method_drafter(target, drafters, m: Method):
    """The method's drafter (`specjax.drafters.compose.build`): `m.drafter` a stack over the loaded
    drafters, with the method's run options (a block drafter's confidence cut, DPara's boundaries,
    ReaDy's zeroed state) as the single drafter's options."""
    stack = compose.parse_stack(m.drafter)
    run = dict(confidence=None if m.confidence == "off" else m.confidence, costs=m.costs,
               zero_state=m.zero_state or None, boundaries=m.boundaries)
    if any(v is not None for v in run.values()):
        if stack.composite is not None:
            raise ValueError(f"method {m.name!r}: run options go with one drafter, not a {stack.composite}")
        stack = compose.Stack.make(stack.parts, None, **{**stack.opts, **run})
    try:
        return compose.build(stack, drafters)
    except ValueError as e:
        raise ValueError(f"method {m.name!r}: {e}") from None


def is_oracle(m: Method) -> bool:
    """TreeGraft's hindsight oracle (`CHEAP+STRONG;policy=oracle TREE`): it needs the AR row's outputs."""
    if m.drafter is None:
        return False
    stack = compose.parse_stack(m.drafter)
    return stack.composite == "treegraft" and stack.opts.get("policy") == "oracle"


def oracle_row(target, drafters, m: Method, groups, new_tokens: int, repeats: int, ar_sequences,
               costs_file: str | None = None) -> dict:
    """The hindsight oracle's row: TreeGraft `labelled` with each row's greedy continuation (the AR row's
    outputs) and an action cost table profiled here (`tools.profile_widths.treegraft_costs`, this batch
    size); per round and row the action of the best goodput contribution, lam at the fixed point of the
    first (untimed) pass's records (`train.value_system.goodput_rate`). Every action is built every round
    (it must know each one's accepted length), so its measured tokens/s is a lower bound; `modelled_tokens_per_s`
    prices its chosen actions by the cost table."""
    from specjax.drafters.composite.treegraft import ACTIONS, record_columns
    from tools.profile_widths import treegraft_costs
    from train import value_system
    stack = compose.parse_stack(m.drafter)
    opts = {**stack.opts, "policy": "graft"}
    tg = compose.build(compose.Stack.make(stack.parts, "treegraft", **opts), drafters)
    spec = tg.resolve_tree(tree_lib.parse_tree_spec(m.tree))
    B = len(groups[0])
    widths = tg.verify_widths(spec)
    table = value_system.read_costs(costs_file) if costs_file else None
    if table is None or str(B) not in table["batches"] or tuple(table["batches"][str(B)]["widths"]) != tuple(widths):
        if table is not None:
            print(f"[bench] {costs_file}: no batch {B} or other widths than {widths}: profiling here", file=sys.stderr)
        table = treegraft_costs(target, tg, spec, [B], context=256, repeats=3, log=lambda s: print(s, file=sys.stderr))
    row_c = table["batches"][str(B)]
    T = new_tokens + spec.max_depth + 1
    futs, i = [], 0
    for g in groups:
        f = np.full((len(g), T), -1, np.int32)
        for j in range(len(g)):
            seq = ar_sequences[i + j][:T]
            f[j, :len(seq)] = seq
        futs.append(f)
        i += len(g)
    draft = [d if d is not None else 1e9 for d in row_c["draft_s"]]
    lab = tg.labelled(futs[0], rounds=new_tokens, draft_s=draft, verify_s=row_c["verify_s"], widths=widths,
                      lam=1.0 / row_c["verify_s"][0])
    lab.set_policy("oracle")
    kw = dict(max_new_tokens=new_tokens, eos_token_id=(), drafters=[lab], tree=m.tree)
    names = record_columns()

    def records(results):
        acc, wid, taken = [], [], []
        for r in results:
            rec, n = np.asarray(r.stats["treegraft_records"]), np.asarray(r.stats["rounds"])
            for b in range(rec.shape[0]):
                k = min(int(n[b]), rec.shape[1])
                acc.append(rec[b, :k, [names.index(f"acc_{a}") for a in ACTIONS]].T)
                wid.append(rec[b, :k, [names.index(f"width_{a}") for a in ACTIONS]].T)
                taken.append(rec[b, :k, names.index("action")])
        return (np.concatenate(acc).astype(int), np.concatenate(wid).astype(int),
                np.concatenate(taken).astype(int))

    def one_pass():
        out = []
        for g, f in zip(groups, futs):
            lab.future.set_value(jnp.asarray(f))
            out.append(specjax.generate(target, g, **kw))
        return out

    acc, wid, _ = records(one_pass())  # untimed: compiles, and the rounds that fix lam
    cost = value_system.action_cost(wid, row_c, tg.plan(spec).available)
    lam = value_system.goodput_rate(acc, cost)
    lab.lam.set_value(jnp.float32(lam))
    times, results = [], None
    for _ in range(max(repeats, 1)):
        t0 = time.perf_counter()
        results = one_pass()
        times.append(time.perf_counter() - t0)
    row = {"method": m.name, **generation_row(results, times, speculative=True, drafter=lab)}
    acc, wid, taken = records(results)
    cost = value_system.action_cost(wid, row_c, tg.plan(spec).available)
    rows_ = np.arange(len(taken))
    row["oracle"] = {"lam_tokens_per_s": lam, "cost_table": row_c, "cpu": table["cpu"],
                     "modelled_tokens_per_s": float((acc[rows_, taken] + 1).sum() / cost[rows_, taken].sum()),
                     "modelled_fixed": {a: value_system.policy_goodput(np.full(len(taken), i), acc, cost)
                                        for i, a in enumerate(ACTIONS) if np.isfinite(cost[:, i]).all()},
                     "share": {a: float(np.mean(taken == i)) for i, a in enumerate(ACTIONS)}}
    return row


def method_packing(m: Method, batch: int, profile: str | None):
    """The method's `generate(packing=)`: None, per-row widths, or the goodput budget from `profile`."""
    from specjax.spec.packing import Packing, load_packing
    if m.packing is None:
        return None
    if m.packing == "pack":
        return Packing()
    assert m.packing in ("goodput", "goodput-cal"), m.packing
    if not profile:
        raise ValueError(f"method {m.name!r}: the goodput budget needs --packed-profile (python -m tools.profile_widths --packed ...)")
    return load_packing(profile, batch)


def method_kwargs(target, drafters, m: Method, groups, new_tokens: int, packed_profile: str | None = None):
    """(`specjax.generate` keyword arguments, the drafter or None) of a method's row."""
    kw = dict(max_new_tokens=new_tokens, temperature=m.temperature, eos_token_id=())
    drafter = None
    if m.drafter is not None:
        drafter = method_drafter(target, drafters, m)
        if m.packing == "goodput-cal":  # calibrated estimates for the budget
            from specjax.drafters.composite.adaptive import AdaptiveShape
            n = drafter.resolve_tree(tree_lib.parse_tree_spec(m.tree)).num_nodes
            drafter = AdaptiveShape.estimator(drafter, n)
        kw.update(drafters=[drafter], tree=m.tree, verify=m.verify)
        packing = method_packing(m, len(groups[0]), packed_profile)
        if packing is not None:
            kw["packing"] = packing
    return kw, drafter


def run_interleaved(target, drafters, methods, groups, new_tokens: int, repeats: int, seed: int = 0,
                    packed_profile: str | None = None, log=print) -> dict:
    """Every method's row, {name: row}, with their timed passes interleaved (--interleave): all methods
    compiled and warmed up first, then `repeats` rounds of one pass of each method in turn, so that a slow
    stretch of the machine (this 2-core VM varies by +-30% over minutes) falls on every method alike; the
    median pass per method. Programs stay compiled for the whole run (memory: a few methods of one target)."""
    setups = []
    for m in methods:
        if is_oracle(m):
            raise ValueError(f"--interleave: the oracle row {m.name!r} runs its own passes; bench it without --interleave")
        kw, d = method_kwargs(target, drafters, m, groups, new_tokens, packed_profile)
        log(f"[bench] warm-up {m.name} ...")
        for g in warmup_groups(groups):
            specjax.generate(target, g, seed=seed, **kw)
        setups.append((m, kw, d))
    times = {m.name: [] for m in methods}
    last = {}
    for r in range(max(repeats, 1)):
        for m, kw, d in setups:
            t0 = time.perf_counter()
            last[m.name] = [specjax.generate(target, g, seed=seed + i, **kw) for i, g in enumerate(groups)]
            times[m.name].append(time.perf_counter() - t0)
        log(f"[bench] repeat {r + 1}: " + ", ".join(f"{m.name} {times[m.name][-1]:.2f} s" for m, _, _ in setups))
    return {m.name: {"method": m.name, **generation_row(last[m.name], times[m.name], speculative=m.drafter is not None,
                                                         drafter=d), "pass_seconds": times[m.name]}
            for m, kw, d in setups}


def run_method(target, drafters, m: Method, groups, new_tokens: int, repeats: int, seed: int = 0,
               draft_ms: dict | None = None, packed_profile: str | None = None) -> dict:
    """One method's row (`tools.harness.time_generation` + `generation_row`). `draft_ms`: a cache
    {(drafter, confidence, tree, mode): ms} of the drafter's propose + commit timed alone (see the
    module docstring); None skips that timing. `packed_profile`: the goodput rows' cost table."""
    kw, drafter = method_kwargs(target, drafters, m, groups, new_tokens, packed_profile)
    results, times = time_generation(target, groups, repeats, seed=seed, **kw)
    row = {"method": m.name, **generation_row(results, times, speculative=m.drafter is not None, drafter=drafter)}
    if m.drafter is not None and draft_ms is not None:
        mode = "sample" if m.verify in ("sampled", "sampled_noreplace") else "topk"
        key = (m.drafter, str(m.confidence), m.costs, m.tree, mode, m.zero_state, m.boundaries)
        if key not in draft_ms:
            draft_ms[key] = 1000 * draft_seconds(target, drafter, groups[0], m.tree, repeats=max(3, repeats),
                                                 mode=mode)
        row["draft_ms"] = draft_ms[key]
    return row


def hf_assisted(target_dir, draft_dir, prompts, new_tokens, repeats, batch: int = 1, threads: int = 1) -> list[dict]:
    """transformers on the same weights and prompts: greedy (`hf ar`), prompt lookup and, with a
    same-vocabulary `draft_dir`, assisted generation, at batch 1 (its speculative modes' only one); at
    `batch` > 1 its greedy loop on left-padded batches instead (`hf ar batch B`)."""
    import torch
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(threads)  # 1: measured faster than 2 threads on this 2-core machine (bench_ar)
    tgt = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    pad = tgt.config.pad_token_id if tgt.config.pad_token_id is not None else 0
    rows = []
    variants = [("hf ar", {}), ("hf prompt-lookup", {"prompt_lookup_num_tokens": 6})]
    if draft_dir is not None:
        asst = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32).eval()
        if asst.config.vocab_size != tgt.config.vocab_size:
            rows.append({"method": "hf assisted", "unsupported": f"{Path(draft_dir).name} has another vocabulary"})
        else:
            variants.append((f"hf assisted ({Path(draft_dir).name})", {"assistant_model": asst}))
    if batch > 1:  # the speculative variants are batch-1 only (measured by a batch-1 run)
        variants = [(f"hf ar batch {batch}", {"batch": batch})]
    for name, extra in variants:
        def run(prompts=prompts, extra=extra):
            n = 0
            b = extra.get("batch", 1)
            kw = {k: v for k, v in extra.items() if k != "batch"}
            with torch.inference_mode():
                for i in range(0, len(prompts), b):
                    group = prompts[i:i + b]
                    T = max(map(len, group))
                    ids = torch.tensor([[pad] * (T - len(p)) + list(p) for p in group])
                    mask = torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in group])
                    out = tgt.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                       do_sample=False, pad_token_id=pad, **kw)
                    n += (out.shape[1] - T) * len(group)
            return n
        try:
            run(prompts[:1])  # warm-up (eager torch: nothing to compile)
        except Exception as e:  # e.g. assisted generation on a model whose cache cannot be cropped (hybrid)
            rows.append({"method": name, "unsupported": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"})
            continue
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            n = run()
            times.append(time.perf_counter() - t0)
        rows.append({"method": name, "tokens_per_s": n / statistics.median(times), "tokens": n,
                     "seconds": statistics.median(times)})
    return rows


def llama_cpp_peer(gguf_file, prompts, new_tokens, repeats, threads: int = 2) -> list[dict]:
    """llama.cpp (llama-cpp-python, the `peers` extra) on the original GGUF: its greedy loop and its
    prompt-lookup speculative decoding (`LlamaPromptLookupDecoding`), batch 1 (its Python API decodes
    one sequence). It runs the file's quantized weights, so its tokens differ from ours: speed only.
    Run in a child process (`python -m tools.llama_cpp_peer`): llama.cpp beside torch and XLA in one process
    crashed here (a segmentation fault), and a crash there must not lose the other rows."""
    import subprocess
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "prompts.json"
        spec.write_text(json.dumps({"gguf": str(gguf_file), "prompts": prompts, "new_tokens": new_tokens,
                                    "repeats": repeats, "threads": threads}))
        proc = subprocess.run([sys.executable, "-m", "tools.llama_cpp_peer", str(spec)],
                              capture_output=True, text=True, cwd=REPO)
    if proc.returncode != 0:
        why = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1][:160]
        return [{"method": "llama.cpp", "unsupported": why}]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def smoke_setup(seed=0):
    """The smoke models, n-gram, tiny random block drafters (DSpark and DFlash, block 4), and
    random repetitive prompts."""
    cfg, target, draft = smoke_models(seed)
    rng = np.random.default_rng(seed)
    prompts = [(rng.integers(0, 64, 6).tolist() * 6)[: int(rng.integers(12, 36))] for _ in range(4)]
    return target, {"lm": LMDrafter(draft), "ngram": NgramDrafter(),
                    "dspark": BlockDrafter(smoke_block_head(cfg, block_size=4, seed=seed), target),
                    "dflash": BlockDrafter(smoke_block_head(cfg, block_size=4, markov_rank=0, seed=seed), target)}, \
        prompts


def smoke_profile(widths) -> dict:
    """A made-up verify-width profile for --smoke (round seconds growing with the width)."""
    return {"tree": f"chain={widths[-1] - 1}", "cpu": "made up (smoke)",
            "rows": {"1": {"widths": list(widths), "round_s": [1e-3 * (1 + 0.15 * w) for w in widths]}}}


def schedule_costs(args, target, drafters, log=print) -> tuple[dict, str | None]:
    """({block drafter name: costs}, profile path) for the DSpark scheduler at --batch. An explicit
    --verify-profile that does not fit is an error; the default one (bench/verify_profile_<target>.json)
    is skipped with a note when missing or made for other widths."""
    out, used = {}, None
    for name, d in drafters.items():
        if not (isinstance(d, BlockDrafter) and d.head.config.confidence):
            continue
        chain = f"chain={d.head.config.block_size}"
        widths = d.with_options(confidence=args.dspark_threshold).verify_widths(tree_lib.parse_tree_spec(chain))
        if args.smoke and not args.verify_profile:
            out[name], used = costs_from_profile(smoke_profile(widths), args.batch, widths), "made up (smoke)"
            continue
        path = args.verify_profile or str(REPO / "bench" / default_profile_name(args.target))
        if not os.path.isfile(path):
            if args.verify_profile:
                raise ValueError(f"--verify-profile {path}: no such file")
            log(f"[bench] no verify-width profile {path}: no '{name} {chain} schedule' methods "
                f"(make one: python -m tools.profile_widths --target {args.target} --batch {args.batch})")
            continue
        try:
            out[name], used = costs_from_profile(load_profile(path), args.batch, widths), repo_relative(path)
        except ValueError as e:
            if args.verify_profile:
                raise
            log(f"[bench] {e}: no '{name} {chain} schedule' methods")
    return out, used


def zoo_setup(args):
    from specjax.io.checkpoint import load_tokenizer
    from train import prompts as prompt_sets
    target = specjax.load_model(args.target, weights=args.weights, invariant=args.invariant)
    tok = load_tokenizer(args.target)
    drafters, loaded = {}, {}

    def add(name, spec, **options):  # each row names its settings: a drafter's recorded defaults are not applied
        drafters[name] = load_drafter(spec, target, tuned=False, **options)
        loaded[name] = (spec, options)

    if args.draft and os.path.isdir(args.draft):
        add("lm", args.draft)
    if args.feature and os.path.isdir(args.feature):
        add("feature", args.feature, target_path=args.target)
    extra = [tuple(x.split("=", 1)) for x in args.block]
    for name, d in [("dspark", args.dspark), ("dflash", args.dflash), ("ready", args.ready), ("dpara", args.dpara)] + extra:
        if d and os.path.isdir(d):  # block drafters, where trained
            add(name, d, target_path=args.target)
    if args.mtp and os.path.isdir(args.mtp):  # an MTP module: its own directory, or the target's own mtp.* tensors
        add("mtp", args.mtp, target_path=args.target)
    elif args.mtp == "target":
        add("mtp", "mtp", target_path=args.target)
    for n in args.draft_vocab or ():  # reduced draft vocabularies: rows "mtp@N", "feature@N"
        for name in ("mtp", "feature"):
            if name in loaded:
                add(f"{name}@{n}", loaded[name][0], target_path=args.target, draft_vocab=n)
    for w in args.draft_weights or ():  # the learned drafters' own networks stored narrower: rows "dspark-int8 ..."
        for name, (spec, options) in list(loaded.items()):
            add(f"{name}-{w}", spec, **options, draft_weights=w)
    drafters["ngram"] = NgramDrafter()
    if args.kind == "chat":
        prompts = chat_prompts(args.target, tok, args.chat_prompts, args.prompts)
    elif args.kind in prompt_sets.LONG_KINDS:
        prompts = [p["ids"] for p in prompt_sets.long_prompts(args.kind, tok, args.context, args.prompts,
                                                                split=args.split, chat_model_dir=args.target)]
    else:
        prompts = [p["ids"] for p in prompt_sets.prompt_set(args.kind, tok, args.prompts, split=args.split,
                                                                context_tokens=args.context)]
    return target, drafters, prompts


def chat_prompts(target_dir, tok, path, n) -> list[list[int]]:
    """The first `n` chats of a JSONL file of {"messages": [...]} rows, rendered with the target's chat
    template (specjax.io.chat) and tokenized."""
    from specjax.io.chat import render_chat
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()][:n]
    return [tok.encode(render_chat(target_dir, r["messages"])).ids for r in rows]


def _measured(key, fmt):
    """A cell of a measured row; a peer that could not run says why in its tokens/s cell only."""
    return lambda r: None if "unsupported" in r or r.get(key) is None else fmt.format(r[key])


def table_columns(meta) -> list[Column]:
    return [Column("method", "method", right=False),
            Column("tokens/s", lambda r: f"unsupported: {r['unsupported']}" if "unsupported" in r
                   else f"{r['tokens_per_s']:.1f}"),
            Column("speedup vs our AR", _measured("speedup", "{:.2f}x")),
            Column(f"vs {meta.get('hf_peer') or 'transformers (not run)'}", _measured("vs_hf", "{:.2f}x")),
            Column("tau", _measured("tau", "{:.2f}")),
            Column("per-depth acceptance", _measured("depth_acceptance", "{}"), right=False),
            Column("draft ms / round", _measured("draft_ms", "{:.2f}")),
            Column("mean verify width", lambda r: None if _measured("mean_verify_width", "")(r) is None else
                   f"{r['mean_verify_width']:.2f}" + (f" (model rounds {r['model_round_share']:.2f})"
                                                      if "model_round_share" in r else "")),
            Column("mean T (nodes computed / round)", _measured("mean_T", "{:.1f}")),
            Column("greedy check (exact / near-tie / mismatch)", check_cell, right=False)]


def plot_rows(plt, rows, meta):
    """Speedup and tau per method (the rows with tokens/s)."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    rows = [r for r in rows if "tokens_per_s" in r]
    names = [r["method"] for r in rows]
    axes[0].barh(names, [r.get("speedup", 0) for r in rows])
    axes[0].axvline(1.0, color="k", lw=0.8)
    axes[0].set_xlabel("speedup over autoregressive (same process)")
    axes[1].barh(names, [r.get("tau", 1) for r in rows], color="tab:orange")
    axes[1].set_xlabel("tau (mean acceptance length)")
    fig.suptitle(f"specjax speculative decoding — {meta['setup']}")
    fig.tight_layout()
    return fig


def _weights_phrase(meta) -> str:
    w = meta.get("weights", "float32")
    inv = ", batch-invariant attention" if meta.get("invariant") else ""
    return ("float32" if w == "float32" else f"target weights {w} (activations float32)") + inv


def write_bench_outputs(rows, meta, out: Path) -> Path:
    """bench/<out>.md, .json and .png through the harness (`tools.harness.write_outputs`)."""
    intro = [f"{meta['n_prompts']} prompts ({meta['kind']}), {meta['new_tokens']} new tokens each, batch {meta['batch']}, "
             f"median of {meta['repeats']} repeats after a warm-up"
             + (" (interleaved: one pass of each method in turn)" if meta.get("interleaved") else "")
             + f"; {_weights_phrase(meta)} on {meta['device']}; "
             f"load average {meta['load_avg']:.2f}."]
    notes = ["Draft ms / round: the drafter's propose + commit alone, jitted (16 in one `fori_loop` on the state "
             "after a prefill of the first batch and one round; median after a warm-up). Mean verify width: tree "
             "nodes the target verified per round, root included (below the tree's size when drafts are cut)."
             + (f" DSpark schedule costs: {meta['verify_profile']}." if meta.get("verify_profile") else "")
             + (f" Goodput rows' packed cost table: {meta['packed_profile']}." if meta.get("packed_profile") else "")
             + (" Mean T: nodes the target's verification forward computed per round (batch x width; packed rows: the"
                " compiled budget)." if any("mean_T" in r for r in rows) else "")]
    return write_outputs(out, meta, rows, table_columns(meta), plot_rows,
                         title=f"Speculative decoding benchmark ({meta['setup']})", intro=intro,
                         notes=notes)


def plot_budgets(rows, meta, out: Path):
    """tau and tokens/s against the node budget, one line per best-first method (and each chain
    of the same run as a horizontal reference): `<out>_budgets.png`."""
    import re
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    lines: dict[str, list] = {}
    refs = []
    for r in rows:
        if "tokens_per_s" not in r or r.get("temperature", 0) != 0:
            continue
        m = re.search(r"nodes=(\d+)", r["method"])
        if m and ("ddtree" in r["method"] or "treeflash" in r["method"]):
            lines.setdefault(re.sub(r"nodes=\d+,?", "", r["method"]).rstrip(","), []).append((int(m.group(1)), r))
        elif "chain=" in r["method"] and " conf=" not in r["method"] and "zero-state" not in r["method"]:
            refs.append(r)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, pts in lines.items():
        pts.sort(key=lambda x: x[0])
        xs = [n for n, _ in pts]
        axes[0].plot(xs, [r["tau"] for _, r in pts], marker="o", label=name)
        axes[1].plot(xs, [r["tokens_per_s"] for _, r in pts], marker="o", label=name)
    for r in refs:
        axes[0].axhline(r["tau"], ls="--", lw=0.8, color="gray")
        axes[1].axhline(r["tokens_per_s"], ls="--", lw=0.8, color="gray")
        axes[1].annotate(r["method"], (axes[1].get_xlim()[0], r["tokens_per_s"]), fontsize=7, color="gray")
    ar = [r for r in rows if r.get("method") == "ar" and "tokens_per_s" in r]
    if ar:
        axes[1].axhline(ar[0]["tokens_per_s"], ls=":", lw=0.8, color="k")
    for ax, label in zip(axes, ("tau (mean acceptance length)", "tokens/s")):
        ax.set_xlabel("node budget (root included)")
        ax.set_ylabel(label)
        ax.set_xscale("log", base=2)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"best-first trees vs node budget — {meta['setup']} ({meta.get('cpu')})")
    fig.tight_layout()
    fig.savefig(out.with_name(out.name + "_budgets.png"), dpi=110)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m tools.bench",
                                 description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(REPO / "models/code-target"))
    ap.add_argument("--draft", default=str(REPO / "models/code-draft"), help="lm drafter ('' for none)")
    ap.add_argument("--feature", default=None,
                    help="feature drafter (default: the target's own, TARGET-feature, where it exists; '' for none)")
    ap.add_argument("--dspark", default=None,
                    help="DSpark block drafter (default: TARGET-dspark where it exists; '' for none)")
    ap.add_argument("--dflash", default=None,
                    help="DFlash block drafter, the DSpark ablation without the Markov / confidence heads "
                         "(default: TARGET-dflash where it exists; '' for none)")
    ap.add_argument("--ready", default=None,
                    help="ReaDy block drafter, DSpark reading the hybrid target's recurrent states "
                         "(default: TARGET-ready where it exists; '' for none)")
    ap.add_argument("--dpara", default=None,
                    help="DPara block drafter, DSpark with its next block precomputed for every acceptance boundary "
                         "(default: TARGET-dpara where it exists; '' for none)")
    ap.add_argument("--mtp", default=None,
                    help="MTP module (default: TARGET-mtp where it exists; 'target' for the mtp.* tensors in the target's "
                         "own checkpoint; '' for none)")
    ap.add_argument("--draft-vocab", default=None, metavar="N,N,...",
                    help="also the MTP module with reduced draft vocabularies of these sizes (methods 'mtp@N ...': "
                         "the N most frequent training tokens' LM-head rows only)")
    ap.add_argument("--draft-weights", default=None, metavar="DTYPE,...",
                    help="also every learned drafter with its own network's projections stored as DTYPE (bfloat16 / "
                         "int8; methods 'NAME-DTYPE ...', e.g. 'dspark-int8 chain=4'); the target's parts it borrows "
                         "stay at --weights")
    ap.add_argument("--block", action="append", default=[], metavar="NAME=DIR",
                    help="another block drafter under a method name of its own (repeatable), e.g. an ablation: "
                         "--block ready-l6=runs/ready-l6-export")
    ap.add_argument("--dspark-threshold", type=float, default=0.5,
                    help="confidence threshold of the 'dspark ... conf=T' methods (default 0.5)")
    ap.add_argument("--verify-profile", default=None,
                    help="verify-width profile for the 'dspark ... schedule' methods (default: "
                         "bench/verify_profile_<target name>.json where it exists; python -m tools.profile_widths)")
    ap.add_argument("--no-draft-ms", action="store_true", help="skip timing each drafter's propose + commit alone")
    ap.add_argument("--tree-budgets", default=None, metavar="N,N,...",
                    help="best-first trees (ddtree / treeflash / TAPS) of the block drafters at these node budgets")
    ap.add_argument("--taps-profile", default=None,
                    help="a verify-width profile of a TAPS tree (python -m tools.profile_widths --tree ...select=taps): "
                         "the TAPS rows choose their verify budget per round")
    ap.add_argument("--plot-budgets", action="store_true", help="also plot tau and tokens/s against the node budget")
    ap.add_argument("--kind", default="functions",
                    choices=["functions", "docstrings", "tests", "humaneval", "chat", "long-code", "long-chat"],
                    help="code prompts cut from the test split, or 'chat': --chat-prompts rendered with the target's "
                         "chat template, or 'long-code' / 'long-chat': --context tokens each (train.prompts.long_prompts: "
                         "a module up to a def line; a module and a question about it in the chat template)")
    ap.add_argument("--split", default="test", choices=["test", "validation"],
                    help="the corpus split code prompts are cut from (default test; 'validation' for a drafter's "
                         "in-loop agreement on the target's own continuations of validation prompts)")
    ap.add_argument("--chat-prompts", default=str(REPO / "bench/prompts/chat.jsonl"),
                    help='with --kind chat: a JSONL file of {"messages": [...]} rows')
    ap.add_argument("--llama-cpp", default=None, metavar="FILE.gguf",
                    help="also llama.cpp (llama-cpp-python) on this GGUF: greedy and prompt lookup, batch 1, speed only")
    ap.add_argument("--hf-threads", type=int, default=1, help="torch threads of the --hf rows (default 1)")
    ap.add_argument("--invariant", action=argparse.BooleanOptionalAction, default=None,
                    help="the target's batch-invariant attention (load_model(invariant=...)): bf16 / int8 rows then "
                         "equal AR token for token, at a cost. Default: on with --weights bfloat16 / int8, off at float32")
    ap.add_argument("--weights", default="float32", choices=("float32", "bfloat16", "int8"),
                    help="the target's weight storage (load_model(weights=...)); every row, AR included, runs at it, "
                         "so the greedy check compares with AR at the same dtype")
    ap.add_argument("--prompts", type=int, default=50)
    ap.add_argument("--context", type=int, default=256, help="prompt tokens")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--methods", default=None, help="comma-separated method names (default: all; a dynamic tree's commas stay in its name); "
                    "'DRAFTER TREE' with any loaded drafter and tree spec also works, e.g. 'lm chain=3'")
    ap.add_argument("--hf", action="store_true", help="also transformers' assisted generation (batch 1)")
    ap.add_argument("--treegraft-costs", default=None, metavar="JSON",
                    help="the action cost table a TreeGraft oracle row prices actions with (tools.profile_widths "
                         "--treegraft; default: profiled in the run)")
    ap.add_argument("--packed-profile", default=None, metavar="JSON",
                    help="the cost table of the ' goodput' rows (python -m tools.profile_widths --packed ...; its row for --batch)")
    ap.add_argument("--interleave", action="store_true",
                    help="compile every method first, then time one pass of each method in turn, --repeats times "
                         "(a slow stretch of the machine falls on every row alike); median pass per method")
    ap.add_argument("--smoke", action="store_true", help="tiny random models: checks the tool, measures nothing real")
    ap.add_argument("--out", default=str(REPO / "bench/bench_spec"))
    ap.add_argument("--compile-cache", default=None, metavar="DIR",
                    help="JAX's persistent compilation cache folder: a rerun loads its programs instead of compiling "
                         "them (the timed passes run after warm-up either way: the numbers do not change)")
    args = ap.parse_args(argv)
    if args.compile_cache:
        from specjax.io.compile_cache import enable_compilation_cache
        enable_compilation_cache(args.compile_cache)
    if args.feature is None:  # a feature drafter reads its own target's features: never another target's
        args.feature = f"{args.target.rstrip('/')}-feature"
    if args.dspark is None:  # block drafters read their own target's features too
        args.dspark = f"{args.target.rstrip('/')}-dspark"
    if args.dflash is None:
        args.dflash = f"{args.target.rstrip('/')}-dflash"
    if args.ready is None:
        args.ready = f"{args.target.rstrip('/')}-ready"
    if args.dpara is None:
        args.dpara = f"{args.target.rstrip('/')}-dpara"
    if args.mtp is None:
        args.mtp = f"{args.target.rstrip('/')}-mtp"
    for x in args.block:
        name, eq, d = x.partition("=")
        if not eq or not name or not d or any(c in name for c in " ,="):
            ap.error(f"--block {x!r}: expected NAME=DIR (a name without spaces or commas)")
        if name in ("lm", "feature", "ngram", "dspark", "dflash", "ready", "dpara", "mtp"):
            ap.error(f"--block {x!r}: {name!r} names a built-in drafter; pick another name")
        if not os.path.isdir(d):
            ap.error(f"--block {x!r}: no such directory")
    if args.draft_vocab:
        try:
            args.draft_vocab = [int(x) for x in args.draft_vocab.split(",")]
        except ValueError:
            ap.error(f"--draft-vocab {args.draft_vocab}: expected comma-separated token counts")
    if args.draft_weights:
        args.draft_weights = [w.strip() for w in args.draft_weights.split(",")]
        bad = [w for w in args.draft_weights if w not in ("bfloat16", "int8")]
        if bad:
            ap.error(f"--draft-weights {','.join(bad)}: expected bfloat16 and/or int8")
    if not 0 < args.dspark_threshold < 1:
        ap.error(f"--dspark-threshold must be in (0, 1), got {args.dspark_threshold}")

    if args.smoke:
        target, drafters, prompts = smoke_setup()
        args.new_tokens, args.repeats = min(args.new_tokens, 16), 1
    else:
        if not os.path.isdir(args.target):
            ap.error(f"{args.target}: no target model (train the zoo: make models)")
        target, drafters, prompts = zoo_setup(args)
    try:
        costs, profile_used = schedule_costs(args, target, drafters,
                                             log=lambda s: print(s, file=sys.stderr, flush=True))
    except ValueError as e:
        ap.error(str(e))
    methods = default_methods(drafters, args.dspark_threshold, costs)
    if args.tree_budgets:
        try:
            budgets = [int(x) for x in args.tree_budgets.split(",")]
        except ValueError:
            ap.error(f"--tree-budgets {args.tree_budgets}: expected comma-separated node counts")
        taps = None
        if args.taps_profile:
            try:
                prof = load_profile(args.taps_profile)
                widths = tree_widths(max(budgets))
                taps = dict(zip(widths, costs_at_widths(prof, args.batch, widths)))
            except ValueError as e:
                ap.error(f"--taps-profile {args.taps_profile}: {e}")
            profile_used = ((profile_used + "; ") if profile_used else "") + "TAPS: " + repo_relative(args.taps_profile)
        for name, d in drafters.items():
            if isinstance(d, BlockDrafter):
                methods += tree_methods(name, d, budgets, taps)
    if args.methods:
        keep = set(split_methods(args.methods))
        methods += extra_methods(sorted(keep - {m.name for m in methods}), drafters)
        unknown = sorted(keep - {m.name for m in methods})
        if unknown:
            ap.error(f"--methods: no method named {unknown}; with these drafters and options: "
                     + ", ".join(m.name for m in methods))
        kept = [m for m in methods if m.name in keep]
        temps = {0.0} | {m.temperature for m in kept}  # the AR baseline of each temperature a kept row runs at
        methods = [m for m in methods if m.name in keep or (m.drafter is None and m.temperature in temps)]
    groups = batches(prompts, args.batch)
    flat = [p for g in groups for p in g]
    rows, ar, meta_hf = [], {}, None
    draft_ms = None if args.no_draft_ms else {}
    pre = None
    if args.interleave:
        try:
            pre = run_interleaved(target, drafters, methods, groups, args.new_tokens, args.repeats,
                                  packed_profile=args.packed_profile, log=lambda s: print(s, file=sys.stderr, flush=True))
        except ValueError as e:
            ap.error(str(e))
    for m in methods:
        print(f"[bench] {m.name} ...", file=sys.stderr, flush=True)
        if pre is not None:
            row = pre[m.name]
        elif is_oracle(m):
            row = oracle_row(target, drafters, m, groups, args.new_tokens, args.repeats, ar[0.0]["sequences"],
                             args.treegraft_costs)
        else:
            row = run_method(target, drafters, m, groups, args.new_tokens, args.repeats, draft_ms=draft_ms,
                             packed_profile=args.packed_profile)
        row["temperature"] = m.temperature
        if m.drafter is None:
            ar[m.temperature] = row
        with_speedup(row, ar[m.temperature])
        if m.temperature == 0 and m.drafter is not None:
            row["check"] = greedy_check(target, flat, ar[0.0]["sequences"], row["sequences"])
        rows.append(row)
        partial = Path(str(args.out) + ".partial.json")  # a crash later keeps what was measured
        partial.write_text(json.dumps([{k: v for k, v in r.items() if k != "sequences"} for r in rows]) + "\n")
        # Free this method's executables: XLA:CPU maps each one in thousands of pieces, and the
        # hybrid target's programs exhausted the kernel's map limit (65530) by the 8th method.
        # (--smoke keeps its few tiny programs: other smoke runs in the process reuse them.)
        if not args.smoke and pre is None:
            jax.clear_caches()
            gc.collect()
    if (args.hf or args.llama_cpp) and not args.smoke:
        hf_rows = []
        if args.hf:
            hf_rows = hf_assisted(args.target, args.draft if args.draft and os.path.isdir(args.draft) else None,
                                  [p for p in flat], args.new_tokens, args.repeats, batch=args.batch,
                                  threads=args.hf_threads)
        if args.llama_cpp and args.batch > 1:
            hf_rows.append({"method": "llama.cpp", "unsupported": "batch 1 only (llama-cpp-python decodes one sequence)"})
        elif args.llama_cpp:
            hf_rows += llama_cpp_peer(args.llama_cpp, flat, args.new_tokens, args.repeats)
        for r in hf_rows:
            if "tokens_per_s" in r:
                with_speedup(r, ar[0.0])
        # The peer to beat: transformers' fastest speculative variant on the same prompts.
        peers = [r for r in hf_rows if "tokens_per_s" in r and r["method"].startswith("hf ") and r["method"] != "hf ar"
                 and " batch " not in r["method"]]
        # No speculative variant runs (transformers refuses assisted generation on stateful
        # models such as Qwen3-Next): the peer is its plain greedy loop, and the header says so.
        # At batch > 1 the peer is its batched greedy loop (its speculative variants are batch-1 only).
        peers = peers or [r for r in hf_rows if r["method"].startswith("hf ar") and "tokens_per_s" in r]
        if peers:
            best = max(peers, key=lambda r: r["tokens_per_s"])
            for r in rows:
                if r["temperature"] == 0:
                    r["vs_hf"] = r["tokens_per_s"] / best["tokens_per_s"]
            meta_hf = best["method"] + (" (its speculative variants are unsupported here)"
                                        if best["method"] == "hf ar" else "")
        rows += hf_rows
    kind = args.kind if args.split == "test" or args.kind in ("chat", "humaneval") else f"{args.kind}, {args.split} split"
    meta = run_meta("bench", argv, setup="smoke: tiny random models" if args.smoke else f"zoo: {Path(args.target).name}",
                    kind="random" if args.smoke else kind, n_prompts=len(flat), new_tokens=args.new_tokens,
                    batch=args.batch, repeats=args.repeats, hf_peer=meta_hf, verify_profile=profile_used,
                    dspark_threshold=args.dspark_threshold, weights=args.weights,
                    invariant=args.weights != "float32" if args.invariant is None else args.invariant,
                    interleaved=bool(args.interleave), packed_profile=args.packed_profile)
    md = write_bench_outputs(rows, meta, Path(args.out))
    Path(str(args.out) + ".partial.json").unlink(missing_ok=True)
    if args.plot_budgets:
        plot_budgets(rows, meta, md.with_suffix(""))
    print(md.read_text())
    bad = [r["method"] for r in rows if r.get("check", {}).get("mismatch")]
    if bad:
        print(f"GREEDY MISMATCH in {bad}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
