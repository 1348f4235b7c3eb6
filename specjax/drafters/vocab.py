"""A reduced draft vocabulary (EAGLE-3's d2t): a drafter that borrows the target's LM head scores
only the N target tokens most frequent in its training data.

The LM head is most of a cheap drafter's step (code-target's MTP step: 4.2M of 7.7M multiply-adds
are the 8192-row head), and a few thousand tokens carry nearly all of a code corpus. The drafter's
logits over those N rows are exactly the full head's logits there; the other tokens get -inf, so
q is zero outside the draft vocabulary: the verification rules stay lossless (a token q never
proposes is never accepted by q's test; the residual max(p - q, 0) gives it its full p).

A drafter directory ships the ranking of all V tokens (`token_ranking.safetensors`, int32 [V], most
frequent first, ties by id) and N is chosen at load time (`load_drafter(..., draft_vocab=N)`).
"""
from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import load_file, save_file
from specjax.models import quant

RANKING_FILE = "token_ranking.safetensors"


class DraftVocab(nnx.Variable):
    """The draft vocabulary's token ids and LM-head rows: constants of the drafter, not trained."""


def token_ranking(token_ids, vocab_size: int) -> np.ndarray:
    """All `vocab_size` ids by descending count in `token_ids` (any int array), ties by id: int32 [V]."""
    counts = np.bincount(np.asarray(token_ids, np.int64).ravel(), minlength=vocab_size)[:vocab_size]
    return np.lexsort((np.arange(vocab_size), -counts)).astype(np.int32)


def save_ranking(path: str, ranking: np.ndarray) -> None:
    os.makedirs(path, exist_ok=True)
    save_file({"token_ids": np.asarray(ranking, np.int32)}, os.path.join(path, RANKING_FILE))


def read_ranking(path: str, vocab_size: int) -> np.ndarray:
    """The stored ranking, checked to be a permutation of the target's vocabulary."""
    file = os.path.join(path, RANKING_FILE)
    if not os.path.exists(file):
        raise FileNotFoundError(f"{file}: no token ranking, so no reduced draft vocabulary "
                                "(train.mtp writes one with its export)")
    ids = load_file(file)["token_ids"]
    if ids.shape != (vocab_size,) or not np.array_equal(np.sort(ids), np.arange(vocab_size)):
        raise ValueError(f"{file}: not a ranking of the target's {vocab_size} tokens")
    return ids.astype(np.int32)


def draft_ids(path: str, vocab_size: int, n: int) -> np.ndarray:
    """The `n` most frequent tokens of the ranking in `path` (a clear error for a bad `n`)."""
    if not isinstance(n, (int, np.integer)) or not 1 <= n <= vocab_size:
        raise ValueError(f"draft vocabulary {n!r}: expected a token count in 1..{vocab_size}")
    return read_ranking(path, vocab_size)[:n]


def draft_ids_or_none(path: str, vocab_size: int, n: int | None) -> np.ndarray | None:
    """`draft_ids`, or None (the full vocabulary) when `n` is None."""
    return None if n is None else draft_ids(path, vocab_size, n)


def head_rows(target, ids) -> jnp.ndarray:
    """The target LM head's rows for `ids`: [N, E] (the head is h @ rows.T on them)."""
    ids = jnp.asarray(ids)
    dtype = target.config.dtype
    if target.lm_head is None:  # tied: the embedding
        return quant.rows(target.embed_tokens[...], quant.value(target.embed_scale), ids, dtype)
    # [E, V]: its columns, with their channel scales
    return quant.rows(target.lm_head.weight[...].T, quant.value(target.lm_head.scale), ids, dtype)


def widen(sub_xN, ids_N, vocab_size: int):
    """Logits over the draft vocabulary [..., N] placed in the full vocabulary [..., V] (f32), -inf elsewhere."""
    full = jnp.full(sub_xN.shape[:-1] + (vocab_size,), -jnp.inf, jnp.float32)
    return full.at[..., ids_N].set(sub_xN.astype(jnp.float32))


def logits(h_BxTxE, ids_N, rows_NxE, vocab_size: int):
    """Logits [B, T, V] (f32): the head's over the draft vocabulary, -inf elsewhere."""
    return widen(h_BxTxE @ rows_NxE.T, ids_N, vocab_size)


def index_of(ids_N, vocab_size: int):
    """Each token's row in the draft vocabulary, N for a token outside it: int32 [V]."""
    ids = jnp.asarray(ids_N, jnp.int32)
    return jnp.full((vocab_size,), ids.shape[0], jnp.int32).at[ids].set(jnp.arange(ids.shape[0], dtype=jnp.int32))


def draft_vocab_vars(target, draft_vocab, vocab_size: int):
    """(ids, rows) `DraftVocab` variables of a drafter's reduced vocabulary (token ids [N] and the
    LM head's rows [N, E]), checked; (None, None) for the full vocabulary (`draft_vocab` None)."""
    if draft_vocab is None:
        return None, None
    ids = check_ids(draft_vocab, vocab_size)
    return DraftVocab(jnp.asarray(ids, jnp.int32)), DraftVocab(head_rows(target, ids))


def check_ids(draft_vocab, vocab_size: int) -> np.ndarray:
    """The draft vocabulary's token ids as int32 [N]; ValueError unless they are distinct ids of the vocabulary."""
    ids = np.asarray(draft_vocab)
    V = vocab_size
    if ids.ndim != 1 or not 1 <= ids.size <= V or ids.min() < 0 or ids.max() >= V or np.unique(ids).size != ids.size:
        raise ValueError(f"draft vocabulary: expected distinct token ids in 0..{V - 1}, got shape {ids.shape}")
    return ids.astype(np.int32)
