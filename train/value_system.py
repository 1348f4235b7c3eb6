"""The TreeGraft value system (design §6): what invoking the strong drafter is worth, round by round.

On training-split prompts, each round starts from one state and runs BOTH branches from it with
`specjax.engine.stepper.RoundStepper` (the engine's round, jitted once, the policy a traced value):
"never" (cheap tree only) and "always" (the strong drafter rescores and grafts). Each record
holds the scheduler features of the round's cheap tree (`specjax.drafters.composite.treegraft_scheduler.FEATURE_NAMES`), each
branch's accepted tokens and each branch's measured time. The generation then continues from
one branch (`--continue-with`: random by default, so the states visited mix both policies).

Timing method. Each branch is one call of the jitted single-round function; its time is measured
on the host around the call with `jax.block_until_ready` on every output (the first call of each
branch, which compiles, is a separate untimed warm-up; with `--timing-repeats R` each branch runs
R times from the same state and the minimum is kept). The two branches alternate which runs first.
Shapes are static, so a branch's cost does not depend on the data: the per-round spread is
measurement noise (a loaded CPU). The value label therefore uses each branch's MEDIAN round time
over the whole run (same batch size):

    value = (accepted_on + 1) / median_time_on - (accepted_off + 1) / median_time_off   [tokens/s]

the change in the row's tokens per second from invoking in this round. The raw per-round times
and a `value_raw` label computed from them are stored too.

The calibration offset of cheap-only paths (a per-token log-prob offset) is fit here as well: the
mean, over the cheap tree nodes the strong drafter scored, of (strong - cheap) local log q.

Output: `<out>/values.npz` (arrays, one row per active batch row per round) and
`<out>/provenance.json` (models and their hashes, prompts, configuration, timing summary, date).

    python -m train.value_system --target models/code-target --cheap ngram \
        --strong models/code-target-feature --tree depth=5,topk=4,nodes=16 \
        --sets functions,docstrings,tests,long --prompts-per-set 16 --max-new-tokens 64 \
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
import time
from pathlib import Path

import jax
import numpy as np
from tqdm import tqdm

from specjax.drafters.composite import treegraft_scheduler as sched_lib
from specjax.drafters.composite.treegraft import TreeGraft
from specjax.engine.stepper import RoundStepper

REPO = Path(__file__).resolve().parents[1]
SETS = ("functions", "docstrings", "tests", "long")
CONTINUE = ("random", "never", "always", "oracle")
TIMING_METHOD = ("host wall time around one jitted single-round call per branch (block_until_ready on all "
                 "outputs), compile excluded (untimed warm-up), branches alternate order, min over "
                 "timing_repeats calls; labels use each branch's median round time over the run")


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

def _timed(stepper: RoundStepper, carry, policy: str, repeats: int):
    best, result = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = stepper.step(carry, policy)
        jax.block_until_ready(result)
        best = min(best, time.perf_counter() - t0)
    return result, best


def collect(target, tg: TreeGraft, tree, prompts: list[list[int]], *, batch_size: int = 1, max_new_tokens: int = 64,
            continue_with: str = "random", timing_repeats: int = 1, seed: int = 0, max_rounds: int | None = None,
            prompt_sets: list[str] | None = None, progress: bool = True) -> dict:
    """Runs both branches of every round; returns per-record arrays (one record per active row per
    round) plus per-round times. Greedy, EOS ignored (fixed-length generations)."""
    if continue_with not in CONTINUE:
        raise ValueError(f"continue_with must be one of {CONTINUE}, got {continue_with!r}")
    rng = np.random.default_rng(seed)
    stepper = RoundStepper(target, tg, tree, max_new_tokens=max_new_tokens, eos_token_id=())
    stepper.capacity = stepper.capacity_for(prompts)  # one cache shape: one compiled round for every prompt
    cols = {k: [] for k in ("features", "accepted_off", "accepted_on", "time_off", "time_on", "prompt", "round",
                            "row", "batch_size", "grafted_path_on", "n_grafted_on", "set")}
    calib = [0.0, 0.0]
    groups = [list(range(i, min(i + batch_size, len(prompts)))) for i in range(0, len(prompts), batch_size)]
    bar = tqdm(total=len(groups), desc="value system", disable=not progress, dynamic_ncols=True)
    warm = set()
    for gi, group in enumerate(groups):
        carry = stepper.start([prompts[i] for i in group])
        B = len(group)
        if B not in warm:  # compile both branches (untimed)
            for p in ("never", "always"):
                jax.block_until_ready(stepper.step(carry, p))
            warm.add(B)
        r = 0
        while not stepper.done(carry) and (max_rounds is None or r < max_rounds):
            order = ("never", "always") if r % 2 == 0 else ("always", "never")
            res = {}
            for p in order:
                res[p] = _timed(stepper, carry, p, timing_repeats)
            (c_off, i_off), t_off = res["never"]
            (c_on, i_on), t_on = res["always"]
            i_off = {k: np.asarray(v) for k, v in i_off.items()}
            i_on = {k: np.asarray(v) for k, v in i_on.items()}
            calib[0] += float(i_on["calib_sum"][i_on["active"]].sum())
            calib[1] += float(i_on["calib_n"][i_on["active"]].sum())
            for b in np.nonzero(i_off["active"])[0]:
                cols["features"].append(i_off["features"][b])
                cols["accepted_off"].append(int(i_off["accepted"][b]))
                cols["accepted_on"].append(int(i_on["accepted"][b]))
                cols["time_off"].append(t_off)
                cols["time_on"].append(t_on)
                cols["prompt"].append(group[b])
                cols["round"].append(r)
                cols["row"].append(int(b))
                cols["batch_size"].append(B)
                cols["grafted_path_on"].append(bool(i_on["grafted_path"][b]))
                cols["n_grafted_on"].append(int(i_on["n_grafted"][b]))
                cols["set"].append(prompt_sets[group[b]] if prompt_sets else "")
            if continue_with == "random":
                on = rng.random() < 0.5
            elif continue_with == "oracle":
                on = (i_on["accepted"] + 1).sum() / t_on > (i_off["accepted"] + 1).sum() / t_off
            else:
                on = continue_with == "always"
            carry = c_on if on else c_off
            r += 1
        bar.update(1)
    bar.close()
    out = {k: np.asarray(v) for k, v in cols.items() if k != "features"}
    out["features"] = (np.stack(cols["features"]).astype(np.float32) if cols["features"]
                       else np.zeros((0, sched_lib.NUM_FEATURES), np.float32))
    out["calib_sum"], out["calib_n"] = np.float64(calib[0]), np.float64(calib[1])
    out["calibration"] = np.float32(calib[0] / calib[1]) if calib[1] else np.float32(0.0)
    return label(out)


def label(d: dict) -> dict:
    """Adds `value` (median branch times per batch size) and `value_raw` (this round's times)."""
    d = dict(d)
    value = np.zeros(len(d["accepted_off"]), np.float64)
    d["median_time_off"] = np.zeros_like(value)
    d["median_time_on"] = np.zeros_like(value)
    for B in np.unique(d["batch_size"]):
        m = d["batch_size"] == B
        t_off, t_on = np.median(d["time_off"][m]), np.median(d["time_on"][m])
        value[m] = (d["accepted_on"][m] + 1) / t_on - (d["accepted_off"][m] + 1) / t_off
        d["median_time_off"][m], d["median_time_on"][m] = t_off, t_on
    d["value"] = value.astype(np.float32)
    d["value_raw"] = ((d["accepted_on"] + 1) / d["time_on"] - (d["accepted_off"] + 1) / d["time_off"]).astype(np.float32)
    return d


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
            "timing_method": TIMING_METHOD, "host": {"platform": platform.platform(),
                                                     "device": jax.devices()[0].device_kind,
                                                     "load_avg": os.getloadavg()[0]},
            "records": int(len(data["value"])), "calibration": float(data["calibration"]),
            "median_round_s": {"never": float(np.median(data["time_off"])) if len(data["value"]) else None,
                               "always": float(np.median(data["time_on"])) if len(data["value"]) else None},
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
    keys = [k for k in arrays[0] if np.ndim(arrays[0][k]) >= 1]
    out = {k: np.concatenate([a[k] for a in arrays]) for k in keys}
    n = sum(float(a["calib_n"]) for a in arrays)
    out["calibration"] = np.float32(sum(float(a["calib_sum"]) for a in arrays) / n if n else 0.0)
    return out, provs


# ----------------------------------------------------------------------------- command line

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(REPO / "models/code-target"))
    ap.add_argument("--cheap", required=True, help="the cheap drafter: ngram, or a drafter directory")
    ap.add_argument("--strong", required=True, help="the strong drafter: a drafter directory (lm or feature)")
    ap.add_argument("--tree", default="depth=5,topk=4,nodes=16", help="verify tree (budget N and depth D)")
    ap.add_argument("--cheap-tree", default=None)
    ap.add_argument("--graft-nodes", type=int, default=None)
    ap.add_argument("--graft-topk", type=int, default=2)
    ap.add_argument("--sets", default=",".join(SETS))
    ap.add_argument("--prompts-per-set", type=int, default=16)
    ap.add_argument("--context", type=int, default=256, help="prompt tokens (function / docstring / test sets)")
    ap.add_argument("--long-tokens", type=int, default=1024, help="prompt tokens of the long-file set")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--continue-with", choices=CONTINUE, default="random")
    ap.add_argument("--timing-repeats", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
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
        cheap = load_drafter(args.cheap, target, target_path=args.target, tuned=False)
        strong = load_drafter(args.strong, target, target_path=args.target, tuned=False)
        tg = TreeGraft(cheap, strong, policy="never", cheap_tree=args.cheap_tree, graft_nodes=args.graft_nodes,
                       graft_topk=args.graft_topk)
        prompts = training_prompts(tok, args.sets.split(","), args.prompts_per_set, context_tokens=args.context,
                                   long_tokens=args.long_tokens)
    except ValueError as e:
        sys.exit(f"error: {e}")
    data = collect(target, tg, args.tree, [p["ids"] for p in prompts], batch_size=args.batch_size,
                   max_new_tokens=args.max_new_tokens, continue_with=args.continue_with,
                   timing_repeats=args.timing_repeats, seed=args.seed, prompt_sets=[p["set"] for p in prompts])
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
                                                     "max_new_tokens", "batch_size", "continue_with",
                                                     "timing_repeats", "seed")},
            "command": "python -m train.value_system " + " ".join(argv if argv is not None else sys.argv[1:])}
    out = write_dataset(args.out, data, prov)
    v = data["value"]
    print(f"wrote {out}: {len(v)} records, invoking pays in {np.mean(v > 0):.1%} of rounds, "
          f"mean value {np.mean(v):+.2f} tokens/s, calibration {float(data['calibration']):+.3f}")
    return 0


if __name__ == "__main__":
    jax.config.update("jax_compilation_cache_dir", str(REPO / "runs" / "jax-cache"))
    sys.exit(main())
