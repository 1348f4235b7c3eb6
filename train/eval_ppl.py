"""Per-token loss and perplexity of an exported (Hugging Face format) model on a corpus split,
next to a unigram baseline, so a number like "ppl 4.2" has a yardstick.

    python -m train.eval_ppl --model models/code-target --split test [--seq-len 512] [--max-tokens N]

The split's token stream is cut into consecutive windows of seq_len + 1 tokens (each target
scored once; the stream's last < seq_len tokens are not scored). The unigram baseline is fit on
the train split's tokens with add-one smoothing over the whole vocabulary.
"""
from __future__ import annotations

import argparse
import functools
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.io.checkpoint import load_model, load_tokenizer
from train import corpus, data
from train.lm import lm_token_losses, mean_window_loss
from train.common import REPO

DEFAULT_CACHE = REPO / "runs" / "token-cache"


def unigram_log_probs(train_stream: np.ndarray, vocab_size: int) -> np.ndarray:
    """[V] log p(token) from train-split counts, add-one smoothed."""
    counts = np.bincount(train_stream, minlength=vocab_size).astype(np.float64) + 1.0
    return np.log(counts / counts.sum())


def evaluate_model(model_dir: str | Path, split: str = "test", seq_len: int = 512, max_tokens: int | None = None,
                   batch_size: int = 8, manifest_path: Path | None = None, root: Path | None = None,
                   max_files: int | None = None, cache_dir: Path | None = DEFAULT_CACHE, progress: bool = True) -> dict:
    model = load_model(str(model_dir), dtype=jnp.float32)
    tok = load_tokenizer(str(model_dir))
    manifest = corpus.check(corpus.read_manifest(manifest_path or corpus.MANIFEST_PATH), root)
    windows_NxT1 = data.eval_windows(data.token_stream(tok, split, manifest, root, max_files, cache_dir),
                                     seq_len, max_tokens)
    if len(windows_NxT1) == 0:
        raise ValueError(f"the {split} split has fewer than {seq_len + 1} tokens")

    graphdef, params = nnx.split(model, nnx.Param)
    window_loss = jax.jit(lambda p, t: lm_token_losses(nnx.merge(graphdef, p), t, jnp.float32).mean(axis=-1))
    loss = mean_window_loss(functools.partial(window_loss, params), windows_NxT1, batch_size,
                            desc=f"eval {split}" if progress else None)

    train_stream = data.token_stream(tok, "train", manifest, root, max_files, cache_dir)
    logp_V = unigram_log_probs(train_stream, model.config.vocab_size)
    unigram_loss = float(-logp_V[windows_NxT1[:, 1:]].mean())
    return {"model": str(model_dir), "split": split, "seq_len": seq_len, "windows": len(windows_NxT1),
            "tokens": int(windows_NxT1[:, 1:].size), "loss": loss, "ppl": math.exp(loss),
            "unigram_loss": unigram_loss, "unigram_ppl": math.exp(unigram_loss)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, type=Path, help="exported model directory")
    ap.add_argument("--split", default="test", choices=corpus.SPLITS)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=None, help="score at most this many tokens")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE, help="token stream cache")
    args = ap.parse_args(argv)
    try:
        result = evaluate_model(args.model, args.split, args.seq_len, args.max_tokens, args.batch_size,
                                cache_dir=args.cache_dir)
    except corpus.CorpusMismatch as e:
        raise SystemExit(f"error: {e}") from None
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
