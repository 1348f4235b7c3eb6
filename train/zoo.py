"""The zoo's manifest, `models/zoo.json`: every shipped model directory with its files' sha256 and
a stored greedy continuation, so a clone can check that what it loads is what was trained
(`tests/test_zoo.py`).

    python -m train.zoo --write      # after exporting / re-exporting a model
    python -m train.zoo --check      # what the test does, from the command line

For an LM (a Hugging Face directory) the record holds the greedy continuation of a fixed prompt;
for a feature drafter, the chain its head drafts for its target on that prompt (the head's own
weights, not the target's, decide it).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODELS = REPO / "models"
ZOO_JSON = MODELS / "zoo.json"
PROMPT = 'def parse_args(argv=None):\n    """Parse the command line."""\n    parser = argparse.ArgumentParser('
NEW_TOKENS = 24
DRAFT_CHAIN = 6
# Targets converted from a real checkpoint by `make`, never committed (ignored by git): not zoo
# entries themselves; a drafter trained on one is, and its draft chain is checked where it is built.
BUILT = {"smollm2-135m-instruct": "make smollm2"}


def target_available(name: str) -> bool:
    """A drafter's target is here: shipped, or built (`BUILT`) on this machine."""
    return (MODELS / name / "config.json").exists()


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def prompt_ids(tok) -> list[int]:
    return [0] + tok.encode(PROMPT).ids  # documents follow <|endoftext|>


def greedy_continuation(model, ids: list[int]) -> list[int]:
    import specjax
    return specjax.generate(model, [ids], max_new_tokens=NEW_TOKENS, eos_token_id=()).sequences()[0]


DRAFT_TREE = "treeflash,nodes=16,rows=head"  # a TreeFlash head's record: its tree's tokens (its rows decide them)


def draft_chain(head_dir: Path, target, ids: list[int], tree: str | None = None) -> list[int]:
    """A feature or block drafter's chain after the prompt (its proposal for the first round), or
    the tokens of the tree `tree` it proposes there (a block drafter's best-first tree)."""
    import jax
    import jax.numpy as jnp

    from specjax.spec import sampling, tree as tree_lib
    from specjax.drafters import DraftContext, load_drafter
    from specjax.models import family

    drafter = load_drafter(str(head_dir), target, tuned=False)  # the head itself, not its tuned settings
    fam = family(target)
    P = len(ids)
    out = fam.prefill(target, jnp.asarray([ids], jnp.int32), jnp.asarray([P]), fam.init_cache(target, 1, P + 32),
                      hidden_layers=tuple(drafter.target_layers))
    root = jnp.argmax(out.logits[:, P - 1], axis=-1).astype(jnp.int32)
    state = drafter.init(jnp.asarray([ids], jnp.int32), jnp.asarray([P]), P + 32, out)
    spec = drafter.resolve_tree(tree_lib.parse_tree_spec(tree or f"chain={DRAFT_CHAIN}"))
    ctx = DraftContext(spec, "topk", sampling.SamplingParams.make(0.0, 0, 1.0), jax.random.key(0))
    prop = drafter.propose(state, root, ctx)
    return [int(root[0])] + [int(t) for t in prop.tree.tokens[0, 1:]]


def record_for(d: Path, targets: dict) -> dict:
    from specjax.io.checkpoint import load_model, load_tokenizer
    from specjax.drafters import check_feature_target

    files = {p.name: _sha256(p) for p in sorted(d.iterdir()) if p.is_file() and p.name != "eval.json"}
    rec = {"files": files, "bytes": sum(p.stat().st_size for p in d.iterdir() if p.is_file())}
    if (d / "drafter_config.json").exists():
        info = json.loads((d / "train_info.json").read_text())
        target_dir = REPO / info["run"]["config"]["target"]
        check_feature_target(str(d), str(target_dir))  # a retrained target leaves its old head stale
        target = targets.setdefault(target_dir.name, load_model(str(target_dir)))
        tok = load_tokenizer(str(target_dir))
        kind = json.loads((d / "drafter_config.json").read_text())["drafter"]  # feature | block
        rec.update(kind=kind, target=target_dir.name, draft_chain=draft_chain(d, target, prompt_ids(tok)))
        dcfg = json.loads((d / "drafter_config.json").read_text())
        if dcfg.get("ar_intermediate") and not dcfg.get("boundary"):  # a TreeFlash head: its best-first tree too
            rec["draft_tree"] = draft_chain(d, target, prompt_ids(tok), DRAFT_TREE)
    else:
        model = targets.setdefault(d.name, load_model(str(d)))
        tok = load_tokenizer(str(d))
        rec.update(kind="lm", greedy=greedy_continuation(model, prompt_ids(tok)))
    return rec


def model_dirs() -> list[Path]:
    return [d for d in sorted(MODELS.iterdir())
            if d.is_dir() and d.name not in BUILT
            and ((d / "model.safetensors").exists() or (d / "model.safetensors.index.json").exists())]


SCHEDULERS = MODELS / "treegraft"


def scheduler_dirs() -> list[Path]:
    """TreeGraft's distilled schedulers, one per drafter pair (models/treegraft/<cheap+strong>)."""
    from specjax.drafters.composite.treegraft_scheduler import CONFIG_FILE
    return sorted(d for d in SCHEDULERS.iterdir() if (d / CONFIG_FILE).exists()) if SCHEDULERS.is_dir() else []


def scheduler_record(d: Path) -> dict:
    """Files' sha256, and the scheduler's decisions on a fixed grid of feature vectors (its weights
    and normalisation, not only its files, decide them)."""
    import numpy as np
    from specjax.drafters.composite.treegraft_scheduler import load_scheduler
    sched, calibration, _ = load_scheduler(str(d))
    n_in = len(sched.config.feature_names)
    grid = np.linspace(-2.0, 2.0, 8 * n_in, dtype=np.float32).reshape(8, n_in)
    return {"files": {p.name: _sha256(p) for p in sorted(d.iterdir()) if p.is_file()},
            "calibration": calibration, "decisions": [bool(x) for x in np.asarray(sched.decide(grid))]}


def write() -> dict:
    targets: dict = {}
    zoo = {"prompt": PROMPT, "new_tokens": NEW_TOKENS, "draft_chain": DRAFT_CHAIN,
           "tokenizer_sha256": _sha256(MODELS / "tokenizer" / "tokenizer.json"), "models": {}}
    # LMs first, so feature drafters find their targets loaded.
    dirs = sorted(model_dirs(), key=lambda d: (d / "drafter_config.json").exists())
    for d in dirs:
        zoo["models"][d.name] = record_for(d, targets)
        print(f"{d.name}: {zoo['models'][d.name]['bytes'] / 1e6:.1f} MB")
    zoo["schedulers"] = {d.name: scheduler_record(d) for d in scheduler_dirs()}
    ZOO_JSON.write_text(json.dumps(zoo, indent=2) + "\n")
    return zoo


def check() -> list[str]:
    """Problems with the shipped zoo (empty: all good)."""
    zoo = json.loads(ZOO_JSON.read_text())
    problems, targets = [], {}
    for name, want in zoo["models"].items():
        d = MODELS / name
        if not d.is_dir():
            problems.append(f"{name}: listed in models/zoo.json but models/{name} is missing")
            continue
        for fname, sha in want["files"].items():
            if not (d / fname).exists():
                problems.append(f"{name}/{fname}: missing")
            elif _sha256(d / fname) != sha:
                problems.append(f"{name}/{fname}: sha256 differs from models/zoo.json (corrupt or re-exported "
                                "without `python -m train.zoo --write`)")
        if problems:
            continue
        if want["kind"] != "lm" and not target_available(want["target"]):
            continue  # a built target (BUILT) not built here: the files are checked, the chain where it is
        got = record_for(d, targets)
        for key in (["greedy"] if want["kind"] == "lm" else ["draft_chain", "draft_tree"]):
            if got.get(key) != want.get(key):
                problems.append(f"{name}: {key} {got.get(key)} differs from the stored {want.get(key)}")
    for name, want in zoo.get("schedulers", {}).items():
        d = SCHEDULERS / name
        if not d.is_dir():
            problems.append(f"treegraft/{name}: listed in models/zoo.json but missing")
        elif (got := scheduler_record(d)) != want:
            problems.append(f"treegraft/{name}: differs from models/zoo.json "
                            f"({'files' if got['files'] != want['files'] else 'decisions'})")
    return problems


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true")
    mode.add_argument("--check", action="store_true")
    args = ap.parse_args(argv)
    if args.write:
        write()
        print(f"wrote {ZOO_JSON.relative_to(REPO)}")
    else:
        problems = check()
        print("\n".join(problems) or "zoo ok")
        sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
