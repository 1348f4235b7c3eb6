"""The TreeGraft value system (design §6): what each action is worth, round by round, in goodput.

Under greedy decoding the continuation is known: it is the target's own greedy output. So at every
round of a generation, each action's tree (cheap chain, strong tree, graft, recover, union) can be
checked against that continuation without replaying branches: `TreeGraft.labelled` builds every
action every round inside the jitted loop and records, per round and row, the scheduler features,
each action's accepted length and each action's verify width (its last valid node). The generation
itself follows a behaviour policy (`--behaviours`, default the switch rule and the hindsight oracle,
so the records cover the states a good policy visits).

Cost. Each action's cost comes from a table profiled on this machine (`--costs`, written by
`python -m tools.profile_widths --treegraft ...`): draft seconds per action (propose + commit of the
composite with the action forced) plus the target's verification seconds at the action's width,
per batch size. The label of action a at a round is its contribution to the generation's goodput:

    value[a] = (accepted[a] + 1) - lam * cost[a]          (tokens)

with lam the best goodput (tokens / s) a per-round choice reaches on the dataset (Dinkelbach's rule:
lam <- sum(tokens) / sum(seconds) of the per-round argmax, iterated to its fixed point). Maximising
the sum of these values round by round maximises tokens per second over the generation, not a
difference of per-round rates; with lam fixed, an action that accepts one more token pays when it
costs less than 1 / lam seconds more.

The calibration offset of cheap-only paths (graft's ranking) is the mean, over the cheap tree nodes
the strong drafter scored, of (strong - cheap) local log q, as before.

Output: `<out>/values.npz` (one row per active batch row per round) and `<out>/provenance.json`
(models and their hashes, prompts, the cost table, lam, configuration, date).

    python -m tools.profile_widths --treegraft ngram+models/code-target-feature --tree depth=8,topk=4,nodes=16 \
        --out runs/treegraft-costs/ngram+feature.json
    python -m train.value_system --target models/code-target --cheap ngram \
        --strong models/code-target-feature --tree depth=8,topk=4,nodes=16 \
        --costs runs/treegraft-costs/ngram+feature.json --prompts-per-set 8 --max-new-tokens 64 \
        --out runs/treegraft-values/ngram+feature
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import sys
from pathlib import Path

import jax
import numpy as np
from tqdm import tqdm

from specjax.drafters.composite import treegraft_scheduler as sched_lib
from specjax.drafters.composite.treegraft import ACTIONS, TreeGraft, record_columns
from train.common import repo_relative

REPO = Path(__file__).resolve().parents[1]
SETS = ("functions", "docstrings", "tests", "long")
BEHAVIOURS = ("switch", "oracle") + ACTIONS
COST_FORMAT = "specjax-treegraft-costs-v1"


# ----------------------------------------------------------------------------- prompts

def training_prompts(tokenizer, sets=SETS, per_set: int = 16, *, context_tokens: int = 256,
                     long_tokens: int = 1024, split: str = "train") -> list[dict]:
    """[{"set", "path", "ids"}] from the corpus split (training by default): function bodies,
    docstrings, test code (train.prompts) and the start of the split's longest files ("long")."""
    from train import corpus, prompts as prompt_sets
    from train.tokenizer import EOT_ID
    out = []
    for s in sets:
        if s == "long":
            manifest = corpus.read_manifest()
            root = corpus.stdlib_root()
            files = sorted(manifest.split(split), key=lambda f: (-f.n_bytes, f.path))[:per_set]
            for f in files:
                ids = [EOT_ID] + tokenizer.encode(corpus.read_text(root, f)).ids[:long_tokens - 1]
                out.append({"set": s, "path": f.path, "ids": ids})
        elif s in prompt_sets.KINDS:
            for p in prompt_sets.prompt_set(s, tokenizer, per_set, split=split, context_tokens=context_tokens):
                out.append({"set": s, "path": p["path"], "ids": p["ids"]})
        else:
            raise ValueError(f"unknown prompt set {s!r}; choose from {', '.join(SETS)}")
    return out


# ----------------------------------------------------------------------------- collection

def read_costs(path) -> dict:
    """The action cost table (tools.profile_widths --treegraft): {"actions", "batches": {B: {"draft_s",
    "widths", "verify_s"}}, ...}. Refuses another format or another action list."""
    d = json.loads(Path(path).read_text())
    if d.get("format") != COST_FORMAT or tuple(d.get("actions", ())) != ACTIONS:
        raise ValueError(f"{path}: not a TreeGraft action cost table of this specjax (format {d.get('format')!r}, "
                         f"actions {d.get('actions')}); profile it: python -m tools.profile_widths --treegraft ...")
    return d


def costs_for(table: dict, batch: int) -> dict:
    rows = table["batches"]
    if str(batch) not in rows:
        raise ValueError(f"the cost table has no batch size {batch} (it has {', '.join(rows)})")
    return rows[str(batch)]


def continuations(target, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Each prompt's greedy continuation (the target alone; EOS ignored)."""
    import specjax
    return [specjax.generate(target, [p], max_new_tokens=new_tokens, eos_token_id=()).sequences()[0] for p in prompts]


def action_cost(width_NxA, row: dict, available) -> np.ndarray:
    """Seconds of each action at its width: draft_s[a] + verify_s at the smallest compiled width that
    holds it (inf where the action is not available)."""
    widths = np.asarray(row["widths"])
    idx = np.minimum(np.searchsorted(widths, width_NxA), len(widths) - 1)
    cost = np.asarray(row["draft_s"])[None] + np.asarray(row["verify_s"])[idx]
    return np.where(np.asarray(available)[None], cost, np.inf)


def goodput_rate(acc_NxA, cost_NxA, iters: int = 50) -> float:
    """Dinkelbach's fixed point: the best tokens / s a per-round choice of action reaches on these rounds."""
    lam = float(np.sum(acc_NxA[:, 0] + 1) / np.sum(cost_NxA[:, 0])) if np.isfinite(cost_NxA[:, 0]).all() else 1.0
    for _ in range(iters):
        pick = np.argmax((acc_NxA + 1) - lam * cost_NxA, axis=1)
        rows = np.arange(len(pick))
        new = float(np.sum(acc_NxA[rows, pick] + 1) / np.sum(cost_NxA[rows, pick]))
        if abs(new - lam) < 1e-9 * max(lam, 1.0):
            break
        lam = new
    return lam


def collect(target, tg: TreeGraft, tree, prompts: list[list[int]], costs: dict, *, batch_size: int = 1,
            max_new_tokens: int = 64, behaviours=("switch", "oracle"), prompt_sets: list[str] | None = None,
            progress: bool = True) -> dict:
    """Labelled generations of every prompt under each behaviour policy; returns per-record arrays (one
    record per active row per round) and the labels (`label`)."""
    from specjax.spec import tree as tree_lib
    import specjax
    spec = tg.resolve_tree(tree_lib.parse_tree_spec(tree))
    D = spec.max_depth
    widths = tg.verify_widths(spec)
    row_costs = costs_for(costs, batch_size)
    if tuple(row_costs["widths"]) != tuple(widths):
        raise ValueError(f"the cost table was profiled for verify widths {row_costs['widths']}, this setup compiles "
                         f"{list(widths)}: profile it for this tree")
    available = tg.plan(spec).available
    for b in behaviours:
        if b not in BEHAVIOURS:
            raise ValueError(f"unknown behaviour policy {b!r}; choose from {', '.join(BEHAVIOURS)}")
    futures = continuations(target, prompts, max_new_tokens + D + 1)
    ar_s = row_costs["verify_s"][0]
    lam0 = 1.0 / max(ar_s, 1e-9)  # the oracle behaviour's rate: about an AR step's
    cols = {k: [] for k in ("records", "prompt", "round", "row", "batch_size", "behaviour", "set")}
    groups = [list(range(i, min(i + batch_size, len(prompts)))) for i in range(0, len(prompts), batch_size)]
    bar = tqdm(total=len(groups) * len(behaviours), desc="value system", disable=not progress, dynamic_ncols=True)
    calib = [0.0, 0.0]
    for beh in behaviours:
        for group in groups:
            T = max(len(futures[i]) for i in group)
            fut = np.full((len(group), T), -1, np.int32)
            for j, i in enumerate(group):
                fut[j, :len(futures[i])] = futures[i]
            lab = tg.labelled(fut, rounds=max_new_tokens, draft_s=row_costs["draft_s"], verify_s=row_costs["verify_s"],
                              widths=widths, lam=lam0)
            lab.set_policy(beh)
            out = specjax.generate(target, [prompts[i] for i in group], max_new_tokens=max_new_tokens,
                                   eos_token_id=(), drafters=[lab], tree=tree)
            for j, i in enumerate(group):
                if out.sequences()[j] != futures[i][:max_new_tokens]:
                    raise AssertionError(f"prompt {i}: the labelled generation left the target's greedy output")
            rec = np.asarray(out.stats["treegraft_records"])
            n = np.asarray(out.stats["rounds"])
            for j, i in enumerate(group):
                for r in range(min(int(n[j]), rec.shape[1])):
                    cols["records"].append(rec[j, r])
                    cols["prompt"].append(i)
                    cols["round"].append(r)
                    cols["row"].append(j)
                    cols["batch_size"].append(len(group))
                    cols["behaviour"].append(beh)
                    cols["set"].append(prompt_sets[i] if prompt_sets else "")
            bar.update(1)
    bar.close()
    names = record_columns()
    rec = np.stack(cols.pop("records")).astype(np.float32)
    F = sched_lib.NUM_FEATURES
    out = {k: np.asarray(v) for k, v in cols.items()}
    out["features"] = rec[:, :F]
    out["accepted"] = rec[:, [names.index(f"acc_{a}") for a in ACTIONS]].astype(np.int32)
    out["width"] = rec[:, [names.index(f"width_{a}") for a in ACTIONS]].astype(np.int32)
    out["taken"] = rec[:, names.index("action")].astype(np.int32)
    out["available"] = np.asarray(available, bool)
    out["calibration"] = np.float32(0.0)
    out["calib_sum"], out["calib_n"] = np.float64(calib[0]), np.float64(calib[1])
    return label(out, row_costs)


def label(d: dict, row_costs: dict) -> dict:
    """Adds `cost` [n, A] (seconds), `lam` (tokens / s) and `value` [n, A] = accepted + 1 - lam x cost."""
    d = dict(d)
    cost = action_cost(d["width"], row_costs, d["available"])
    lam = goodput_rate(d["accepted"], cost)
    d["cost"] = cost.astype(np.float32)
    d["lam"] = np.float32(lam)
    d["value"] = np.where(np.isfinite(cost), d["accepted"] + 1 - lam * cost, -1e9).astype(np.float32)
    return d


def relabel(directory, costs: dict, costs_file=None) -> dict:
    """A value dataset's labels from another cost table (the accepted lengths and widths do not depend on
    it: a re-profiled machine or a faster action relabels without regenerating); rewrites it in place."""
    directory = Path(directory)
    with np.load(directory / "values.npz") as z:
        d = {k: z[k] for k in z.files}
    prov = json.loads((directory / "provenance.json").read_text())
    B = int(prov.get("config", {}).get("batch_size", 1))
    row = costs_for(costs, B)
    d = label(d, row)
    np.savez(directory / "values.npz", **d)
    prov["lam_tokens_per_s"] = float(d["lam"])
    prov["costs"] = {**({"file": repo_relative(costs_file)} if costs_file else {}), **row, "cpu": costs.get("cpu")}
    (directory / "provenance.json").write_text(json.dumps(prov, indent=2) + "\n")
    return d


def policy_goodput(pick_N, acc_NxA, cost_NxA) -> float:
    """Tokens / s of choosing action pick_N[i] at record i (the cost table's seconds)."""
    rows = np.arange(len(pick_N))
    return float(np.sum(acc_NxA[rows, pick_N] + 1) / np.sum(cost_NxA[rows, pick_N]))


def switch_rule(features_NxF, min_match: int) -> np.ndarray:
    """The Switch's fixed policy on records: the cheap chain where the n-gram matched >= min_match tokens."""
    m = features_NxF[:, sched_lib.FEATURE_NAMES.index("match_length")]
    return np.where(m >= min_match, ACTIONS.index("cheap"), ACTIONS.index("strong"))


# ----------------------------------------------------------------------------- files

def sha256_of(path) -> str | None:
    """sha256 over a model directory's weight files (single or sharded), or None for 'ngram' / objects."""
    files = sorted(Path(str(path)).glob("model*.safetensors")) if Path(str(path)).is_dir() else []
    if not files:
        return None
    h = hashlib.sha256()
    for p in files:
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def write_dataset(out: str | Path, data: dict, provenance: dict) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    np.savez(out / "values.npz", **data)
    prov = {"created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "feature_layout": sched_lib.FEATURE_LAYOUT, "feature_names": list(sched_lib.FEATURE_NAMES),
            "actions": list(ACTIONS), "host": {"platform": platform.platform(), "device": jax.devices()[0].device_kind,
                                               "load_avg": os.getloadavg()[0]},
            "records": int(len(data["value"])), "lam_tokens_per_s": float(data["lam"]),
            "mean_accepted": {a: float(np.mean(data["accepted"][:, i])) for i, a in enumerate(ACTIONS)},
            **provenance}
    (out / "provenance.json").write_text(json.dumps(prov, indent=2) + "\n")
    return out


def load_dataset(paths) -> tuple[dict, list[dict]]:
    """Concatenates value datasets (prompt ids made unique per dataset); refuses another layout."""
    arrays, provs, offset = [], [], 0
    for p in ([paths] if isinstance(paths, (str, Path)) else paths):
        p = Path(p)
        if not (p / "values.npz").is_file():
            raise FileNotFoundError(f"{p}: no values.npz (run python -m train.value_system --out {p})")
        prov = json.loads((p / "provenance.json").read_text())
        sched_lib.check_layout(prov.get("feature_layout"), prov.get("feature_names", []), str(p / "provenance.json"))
        with np.load(p / "values.npz") as z:
            d = {k: z[k] for k in z.files}
        d["prompt"] = d["prompt"] + offset
        offset = int(d["prompt"].max()) + 1 if len(d["prompt"]) else offset
        arrays.append(d)
        provs.append(prov)
    keys = [k for k in arrays[0] if np.ndim(arrays[0][k]) >= 1 and k != "available"]
    out = {k: np.concatenate([a[k] for a in arrays]) for k in keys}
    out["available"] = np.all([a["available"] for a in arrays], axis=0)
    n = sum(float(a["calib_n"]) for a in arrays)
    out["calibration"] = np.float32(sum(float(a["calib_sum"]) for a in arrays) / n if n else 0.0)
    return out, provs


# ----------------------------------------------------------------------------- command line

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(REPO / "models/code-target"))
    ap.add_argument("--cheap", required=True, help="the cheap drafter: ngram, or a drafter directory")
    ap.add_argument("--strong", required=True, help="the strong drafter: a drafter directory (lm or feature)")
    ap.add_argument("--tree", default="depth=8,topk=4,nodes=16", help="verify tree (budget N and depth D)")
    ap.add_argument("--cheap-tree", default=None)
    ap.add_argument("--graft-nodes", type=int, default=None)
    ap.add_argument("--graft-topk", type=int, default=2)
    ap.add_argument("--sets", default=",".join(SETS))
    ap.add_argument("--prompts-per-set", type=int, default=16)
    ap.add_argument("--context", type=int, default=256, help="prompt tokens (function / docstring / test sets)")
    ap.add_argument("--long-tokens", type=int, default=1024, help="prompt tokens of the long-file set")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--behaviours", default="switch,oracle",
                    help=f"policies the generations follow (records of every action at every round either way): "
                         f"{', '.join(BEHAVIOURS)}")
    ap.add_argument("--costs", required=True, help="the action cost table (python -m tools.profile_widths --treegraft)")
    ap.add_argument("--strong-tree", default=None, help="the strong drafter's own tree (strong, union actions)")
    ap.add_argument("--grow", type=int, default=3, help="recover's subtree depth")
    ap.add_argument("--min-match", type=int, default=3, help="the switch behaviour's n-gram length")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--overwrite", action="store_true")
    args = ap.parse_args(argv)
    if (args.out / "values.npz").exists() and not args.overwrite:
        sys.exit(f"error: {args.out} already holds a value dataset; pass --overwrite to replace it")

    import specjax
    from specjax.drafters import load_drafter, named_drafter
    if not os.path.isdir(args.target):
        sys.exit(f"error: {args.target}: no target model (train the zoo: make models)")
    target = specjax.load_model(args.target)
    tok = specjax.load_tokenizer(args.target)
    try:
        cheap = load_drafter(args.cheap, target, target_path=args.target)  # the shipped defaults (tuned.json)
        strong = load_drafter(args.strong, target, target_path=args.target)
        tg = TreeGraft(cheap, strong, policy="switch" if cheap.drafts_matches else "graft", cheap_tree=args.cheap_tree,
                       graft_nodes=args.graft_nodes, graft_topk=args.graft_topk, strong_tree=args.strong_tree,
                       grow=args.grow, min_match=args.min_match)
        costs = read_costs(args.costs)
        prompts = training_prompts(tok, args.sets.split(","), args.prompts_per_set, context_tokens=args.context,
                                   long_tokens=args.long_tokens)
    except ValueError as e:
        sys.exit(f"error: {e}")
    behaviours = tuple(b for b in args.behaviours.split(",") if b != "switch" or cheap.drafts_matches)
    data = collect(target, tg, args.tree, [p["ids"] for p in prompts], costs, batch_size=args.batch_size,
                   max_new_tokens=args.max_new_tokens, behaviours=behaviours, prompt_sets=[p["set"] for p in prompts])
    from train.common import repo_relative
    prov = {"models": {"target": {"path": repo_relative(args.target), "sha256": sha256_of(args.target)},
                       "cheap": {"spec": args.cheap if named_drafter(args.cheap) else repo_relative(args.cheap),
                                 "kind": cheap.name, "sha256": sha256_of(args.cheap)},
                       "strong": {"spec": repo_relative(args.strong), "kind": strong.name,
                                  "sha256": sha256_of(args.strong)}},
            "prompts": {"split": "train", "sets": args.sets.split(","), "per_set": args.prompts_per_set,
                        "context_tokens": args.context, "long_tokens": args.long_tokens, "count": len(prompts),
                        "items": [{"set": p["set"], "path": p["path"], "tokens": len(p["ids"])} for p in prompts]},
            "config": {k: getattr(args, k) for k in ("tree", "cheap_tree", "graft_nodes", "graft_topk",
                                                     "max_new_tokens", "batch_size", "behaviours", "strong_tree",
                                                     "grow", "min_match")},
            "costs": {"file": repo_relative(args.costs), **costs_for(costs, args.batch_size),
                      "cpu": costs.get("cpu")},
            "command": "python -m train.value_system " + " ".join(argv if argv is not None else sys.argv[1:])}
    out = write_dataset(args.out, data, prov)
    v = data["value"]
    best = np.bincount(np.argmax(data["value"], axis=1), minlength=len(ACTIONS)) / max(len(v), 1)
    print(f"wrote {out}: {len(v)} records, lam {float(data['lam']):.1f} tokens/s; best action share: "
          + ", ".join(f"{a} {best[i]:.0%}" for i, a in enumerate(ACTIONS)))
    return 0


if __name__ == "__main__":
    jax.config.update("jax_compilation_cache_dir", str(REPO / "runs" / "jax-cache"))
    sys.exit(main())
