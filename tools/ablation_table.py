"""A training-recipe ablation at equal steps, read from the runs' own records: each run directory's
`run.json` (the config it trained with) and `metrics.jsonl` (its validation passes, every
`eval_every` steps). No model is run here; the numbers are the trainers' own validation records.

    python -m tools.ablation_table --run init-target=runs/smollm2-135m-instruct-dspark-v2 \\
        --run scratch=runs/ablation/smollm2-dspark-scratch --steps 250,500 \\
        --title "SmolLM2 DSpark: initialised from the target vs scratch" --model smollm2-135m-instruct-dspark \\
        --out bench/ablation_smollm2_dspark_init

A row per run and step: what differs from the first run's config (the variant), the target positions
seen (steps x batch x sequence), the validation agreement with the target by position, and for block
drafters the estimated acceptance of the drafter's own greedy walk and its τ estimate. Runs compared
must share the validation setup (`eval_tokens`, `seq_len`, the cache, the target) or the tool refuses.
Each row carries the trainer command that makes its run (the config is found by its `name` under
`configs/`); an equal-steps comparison may stop one run early with `--max-steps`. With `--model`,
`train.model_card` shows the table in that model's card.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tools import harness

SAME = ("target", "seq_len", "eval_tokens", "cache", "batch_size")  # what makes two validation passes comparable
IGNORE = ("name", "steps", "checkpoint_every", "eval_every", "_defaults", "target_sha256", "manifest")


def trainer_of(cfg: dict) -> str:
    """The train/ module a run's config belongs to."""
    if "block_size" in cfg:
        return "block"
    if "ttt_steps" in cfg:
        return "feature"
    return "mtp"


def config_path(cfg: dict, configs: Path) -> Path | None:
    """The tracked config whose `name` is this run's (None when none is)."""
    for p in sorted(configs.glob("*.json")):
        try:
            if json.loads(p.read_text()).get("name") == cfg.get("name"):
                return p
        except json.JSONDecodeError:
            continue
    return None


def read_run(run_dir: Path) -> tuple[dict, dict[int, dict]]:
    """(config, {step: validation record}) of a run directory."""
    for f in ("run.json", "metrics.jsonl"):
        if not (run_dir / f).is_file():
            raise SystemExit(f"error: {run_dir} has no {f} (a trainer's run directory has both after its first validation)")
    cfg = json.loads((run_dir / "run.json").read_text())
    evals = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            if "step" in r and "val_loss" in r:
                evals[int(r["step"])] = r
    return cfg, evals


def differences(cfg: dict, base: dict) -> str:
    """The config keys where `cfg` differs from `base`, as `key=value` (empty: the base itself)."""
    keys = [k for k in dict.fromkeys([*base, *cfg]) if k not in IGNORE and base.get(k) != cfg.get(k)]
    return ", ".join(f"{k}={json.dumps(cfg.get(k))}" for k in keys)


def rows_of(runs: list[tuple[str, Path]], steps: list[int], configs: Path) -> list[dict]:
    read = [(name, d, *read_run(d)) for name, d in runs]
    base = read[0][2]
    for name, d, cfg, _ in read[1:]:
        bad = [k for k in SAME if cfg.get(k) != base.get(k)]
        if bad:
            raise SystemExit(f"error: {d} validates differently from {read[0][1]} ({', '.join(bad)} differ); "
                             "an ablation compares runs on the same validation")
    rows, last = [], max(steps)
    for step in steps:
        for name, d, cfg, evals in read:
            if step not in evals:
                raise SystemExit(f"error: {d} has no validation at step {step} (it has {sorted(evals)})")
            r = evals[step]
            p = config_path(cfg, configs)
            total = cfg.get("steps") or (json.loads(p.read_text()).get("steps") if p else None)  # run.json may omit it
            cmd = (f"python -m train.{trainer_of(cfg)} --config {p.as_posix()} --run-dir {d.as_posix()}"
                   + (f" --max-steps {last}" if max(evals) == last and (total is None or last < total) else "")
                   ) if p else None  # a run stopped at the compared step was stopped there with --max-steps
            row = {"variant": name, "what": differences(cfg, base) or "(the base run)", "steps": step,
                   "positions": step * cfg["batch_size"] * cfg["seq_len"],
                   "agree": " / ".join(f"{a:.3f}" for a in r["val_agree"][:4]),
                   "agree0": round(r["val_agree"][0], 4)}
            if "val_accept" in r:
                row["accept"] = " / ".join(f"{a:.3f}" for a in r["val_accept"][:3])
                row["tau_est"] = r["val_tau_estimate"]
            row["val_loss"] = round(r["val_loss"], 4)
            row["command"] = cmd
            rows.append(row)
    return rows


COLUMNS = [harness.Column("variant", "variant", right=False), harness.Column("what differs", "what", right=False),
           harness.Column("steps", "steps"), harness.Column("positions", "positions", "{:,}"),
           harness.Column("agreement 1..4 (block: by position; unrolled: by step)", "agree", right=False),
           harness.Column("acceptance @0/1/2", "accept", right=False), harness.Column("τ estimate", "tau_est", "{:.3f}"),
           harness.Column("val loss", "val_loss", "{:.4f}")]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", action="append", required=True, metavar="NAME=RUN_DIR",
                    help="a trainer's run directory; the first is the base the others differ from")
    ap.add_argument("--steps", required=True, help="comma-separated steps every run validated at")
    ap.add_argument("--title", required=True)
    ap.add_argument("--note", default="", help="a paragraph under the table")
    ap.add_argument("--model", help="the zoo model whose card shows this ablation (`train.model_card` reads it)")
    ap.add_argument("--configs", type=Path, default=Path("configs"))
    ap.add_argument("--out", required=True, type=Path, help="results stem: writes STEM.json and STEM.md")
    args = ap.parse_args(argv)
    runs = []
    for spec in args.run:
        name, sep, d = spec.partition("=")
        if not sep or not name or not d:
            ap.error(f"--run wants NAME=RUN_DIR, got {spec!r}")
        runs.append((name, Path(d)))
    try:
        steps = [int(s) for s in args.steps.split(",") if s.strip()]
    except ValueError:
        ap.error(f"--steps wants integers, got {args.steps!r}")
    rows = rows_of(runs, steps, args.configs)
    meta = harness.run_meta("ablation_table", argv, title=args.title, model=args.model,
                            what="validation records of the trainers (no model run by this command)")
    commands = "Runs: " + "; ".join(dict.fromkeys(harness.code_span(r["command"]) for r in rows if r["command"]))
    harness.write_outputs(args.out, meta, rows, COLUMNS, title=args.title,
                          notes=[*([args.note, ""] if args.note else []), commands])


if __name__ == "__main__":
    sys.exit(main())
