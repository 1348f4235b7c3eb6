"""A slim working tree for the GPU machine: what travels there is the checkout's tracked files on disk
plus untracked, non-ignored ones, at most 64 MiB, and `models/` alone is ~274 MB. This tool narrows
the checkout with git's sparse checkout to the code and the one model a run needs, and writes the
corpus as tokens into an ignored folder to carry (the corpus is pinned to this Python's stdlib; the
GPU machine's Python carries another). Nothing tracked is changed: `off` brings every file back.

    python -m tools.slim_tree on --model models/code-target   # models/ but code-target leaves the tree;
                                                              # .slim/corpus-tokens.npz is written
    python -m tools.slim_tree size                            # MiB that would travel (must be <= 64)
    # device run: carry [".slim"], command "bash tools/gpu_train.sh"
    python -m tools.slim_tree off                             # every tracked file back

The trainers read the tokens through their `manifest` key (`train.lm.load_streams_for` takes a .npz).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

from specjax.io.checkpoint import load_tokenizer
from train.lm import load_streams_for, save_corpus_tokens
from train.common import REPO

SLIM = ".slim"  # the carried folder (ignored through .git/info/exclude)
LIMIT_MIB = 64


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, check=True, capture_output=True, text=True).stdout


def travelling_bytes() -> int:
    """Tracked files present on disk, untracked non-ignored files, and the carried folder."""
    names = git("ls-files", "-z", "--cached", "--others", "--exclude-standard").split("\0")
    total = sum((REPO / n).stat().st_size for n in names if n and (REPO / n).is_file())
    slim = REPO / SLIM
    if slim.is_dir():
        total += sum(p.stat().st_size for p in slim.rglob("*") if p.is_file())
    return total


def ignore_slim() -> None:
    exclude = REPO / ".git" / "info" / "exclude"
    exclude.parent.mkdir(parents=True, exist_ok=True)
    lines = exclude.read_text().splitlines() if exclude.exists() else []
    if f"/{SLIM}/" not in lines:
        exclude.write_text("\n".join(lines + [f"/{SLIM}/"]) + "\n")


def on(models: list[str], train_tokens: int | None) -> None:
    keep = ["/*", "!/models/*", "!/bench/*.png", "!/tools/quickstart.ipynb"] + [f"/{m.strip('/')}/" for m in models]
    git("sparse-checkout", "set", "--no-cone", *keep)
    ignore_slim()
    (REPO / SLIM).mkdir(exist_ok=True)
    tok = load_tokenizer(str(REPO / models[0]))
    streams = load_streams_for(tok, "train/manifest.json", None, None, REPO / "runs" / "token-cache")
    save_corpus_tokens(tok, streams, REPO / SLIM / "corpus-tokens.npz", train_tokens)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("action", choices=("on", "off", "size"))
    ap.add_argument("--model", action="append", default=[], help="a model directory to keep (repeat)")
    ap.add_argument("--train-tokens", type=int, default=4_000_000, help="train-split tokens carried")
    args = ap.parse_args(argv)
    if args.action == "on":
        if not args.model:
            ap.error("on: name the model the run needs (--model models/code-target)")
        on(args.model, args.train_tokens)
    elif args.action == "off":
        git("sparse-checkout", "disable")
    mib = travelling_bytes() / 2**20
    print(f"would travel: {mib:.1f} MiB (limit {LIMIT_MIB})")
    if args.action != "off" and mib > LIMIT_MIB:
        sys.exit(f"over the {LIMIT_MIB} MiB limit: keep fewer models or carry fewer tokens")


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    main()
