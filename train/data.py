"""Token streams and batches: documents joined into one stream, cut into fixed-length windows.

Stream layout: `<|endoftext|> doc_1 <|endoftext|> doc_2 ...` (manifest order), so every document
starts after an <|endoftext|>, which thus doubles as a beginning-of-document token.

A window of length T+1 gives T inputs and their T next-token targets; consecutive windows share
one token. The batch at a step is a pure function of (seed, phase, step): resuming from a
checkpoint sees exactly the data it would have seen without the interruption.
"""
from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from train import corpus
from train.tokenizer import EOT_ID


def token_stream(tok: Tokenizer, split: str, manifest: corpus.Manifest, root=None, max_files=None,
                 cache_dir: Path | None = None) -> np.ndarray:
    """[N] int32 ids of a split. Tokenizing the train split takes ~40 s on 2 cores, so with a
    `cache_dir` the stream is kept as .npy, keyed by tokenizer, file list and split."""
    files = manifest.split(split)[:max_files]
    key = hashlib.sha256(tok.to_str().encode() + repr([(f.path, f.sha256) for f in files]).encode()).hexdigest()[:16]
    cached = Path(cache_dir) / f"{split}-{key}.npy" if cache_dir is not None else None
    if cached is not None and cached.exists():
        return np.load(cached)
    root = Path(root) if root is not None else corpus.stdlib_root()
    texts = [corpus.read_text(root, f) for f in files]
    ids = [np.asarray([EOT_ID] + e.ids, np.int32) for e in tok.encode_batch(texts)]
    stream = np.concatenate(ids) if ids else np.zeros((0,), np.int32)
    if cached is not None:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(".tmp.npy")
        np.save(tmp, stream)
        tmp.rename(cached)  # atomic: a killed run never leaves a truncated cache
    return stream


def num_windows(n_tokens: int, seq_len: int) -> int:
    return max((n_tokens - 1) // seq_len, 0)


@functools.lru_cache(maxsize=4)
def _epoch_order(seed: int, phase: int, epoch: int, n: int) -> np.ndarray:
    # One permutation per (seed, phase, epoch): every window once per epoch, in a fresh order.
    return np.random.default_rng([seed, phase, epoch]).permutation(n)


def batch_at(stream: np.ndarray, seq_len: int, batch_size: int, seed: int, phase: int, step_in_phase: int) -> np.ndarray:
    """[batch_size, seq_len + 1] int32: the batch of `step_in_phase` (0-based) of a phase."""
    n = num_windows(len(stream), seq_len)
    if n == 0:
        raise ValueError(f"the token stream ({len(stream)} tokens) is shorter than one window of {seq_len + 1}")
    sample = step_in_phase * batch_size + np.arange(batch_size)  # global sample index within the phase
    window = np.array([_epoch_order(seed, phase, int(s // n), n)[s % n] for s in sample])
    starts = window * seq_len
    return stream[starts[:, None] + np.arange(seq_len + 1)[None, :]]


def eval_windows(stream: np.ndarray, seq_len: int, max_tokens: int | None = None) -> np.ndarray:
    """[N, seq_len + 1]: consecutive windows from the start of the stream (each target token is
    scored once), covering at most `max_tokens` targets."""
    n = num_windows(len(stream), seq_len)
    if max_tokens is not None:
        n = min(n, max(max_tokens // seq_len, 1))
    return stream[np.arange(n)[:, None] * seq_len + np.arange(seq_len + 1)[None, :]]
