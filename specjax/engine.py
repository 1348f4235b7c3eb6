"""`generate`: prefill plus the whole decode loop as one jitted program.

The host only validates and pads the prompts, then calls one compiled function per (batch,
prompt bucket, max_new_tokens, greedy) shape; inside it a `lax.while_loop` runs until every row
has produced an EOS or `max_new_tokens` tokens. No host round-trip per token.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax import sampling
from specjax.models import transformer
from specjax.models.transformer import Model
from specjax.sampling import SamplingParams

PROMPT_BUCKET = 32  # prompts are right-padded to a multiple of this, so lengths share compiles

_trace_count = 0


def trace_count() -> int:
    """How many times a generation program has been traced (tests check it stays put)."""
    return _trace_count


@dataclasses.dataclass(frozen=True)
class GenerationResult:
    tokens: np.ndarray  # int32 [B, max_new_tokens]; entries past `lengths` are padding
    lengths: np.ndarray  # int32 [B]: generated tokens per row, an EOS included
    stats: dict = dataclasses.field(default_factory=dict)

    def sequences(self) -> list[list[int]]:
        return [self.tokens[b, : self.lengths[b]].tolist() for b in range(len(self.lengths))]


@dataclasses.dataclass(frozen=True)
class PreparedBatch:
    tokens: np.ndarray  # int32 [B, P], right-padded
    lengths: np.ndarray  # int32 [B]
    capacity: int


def prepare_prompts(prompts: Sequence[Sequence[int]], vocab_size: int, max_new_tokens: int,
                    capacity: int | None = None, slack: int = 0) -> PreparedBatch:
    """Validates and right-pads token-id prompts. Raises ValueError before anything is traced."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or len(prompts) == 0:
        raise ValueError("prompts must be a non-empty list of token-id lists")
    if isinstance(prompts[0], (int, np.integer)):
        raise ValueError("prompts must be a list of token-id lists (got a flat list of ints; wrap it: [prompt])")
    if int(max_new_tokens) != max_new_tokens or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens}")
    rows = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            raise ValueError(f"prompt {i} is a string; tokenize it first (specjax.load_tokenizer)")
        arr = np.asarray(p)
        if arr.ndim != 1:
            raise ValueError(f"prompt {i} must be a flat sequence of token ids, got shape {arr.shape}")
        if arr.size == 0:
            raise ValueError(f"prompt {i} is empty")
        if not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"prompt {i} holds non-integer values ({arr.dtype})")
        if arr.min() < 0 or arr.max() >= vocab_size:
            bad = int(arr[(arr < 0) | (arr >= vocab_size)][0])
            raise ValueError(f"prompt {i} has token id {bad} outside the vocabulary [0, {vocab_size})")
        rows.append(arr.astype(np.int32))
    lengths = np.array([len(r) for r in rows], np.int32)
    P = PROMPT_BUCKET * math.ceil(int(lengths.max()) / PROMPT_BUCKET)
    need = int(lengths.max()) + max_new_tokens + slack
    if capacity is None:
        capacity = P + max_new_tokens + slack
    elif need > capacity:
        raise ValueError(f"the longest prompt ({lengths.max()} tokens) + max_new_tokens ({max_new_tokens})"
                         + (f" + tree slack ({slack})" if slack else "")
                         + f" = {need} exceeds the cache capacity {capacity}")
    P = min(P, capacity)
    tokens = np.zeros((len(rows), P), np.int32)
    for b, r in enumerate(rows):
        tokens[b, : len(r)] = r
    return PreparedBatch(tokens, lengths, capacity)


def _eos_array(model: Model, eos_token_id) -> np.ndarray:
    if eos_token_id is None:
        ids = model.config.eos_ids
    elif isinstance(eos_token_id, (int, np.integer)):
        ids = (int(eos_token_id),)
    else:
        ids = tuple(int(e) for e in eos_token_id)
    for e in ids:
        if not 0 <= e < model.config.vocab_size:
            raise ValueError(f"eos_token_id {e} is outside the vocabulary [0, {model.config.vocab_size})")
    return np.array(ids if ids else (-1,), np.int32)  # -1 never matches a token


def generate(model: Model, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 64,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
             eos_token_id: int | Sequence[int] | None = None, seed: int = 0,
             capacity: int | None = None) -> GenerationResult:
    """Autoregressive generation of a ragged batch of token-id prompts.

    temperature == 0 is greedy. `eos_token_id` defaults to the model config's; a row stops at
    its first EOS (which is kept in its output). `capacity` (default: just enough) sizes the KV cache.
    """
    sampling.validate(temperature, top_k, top_p)
    batch = prepare_prompts(prompts, model.config.vocab_size, max_new_tokens, capacity)
    eos = _eos_array(model, eos_token_id)
    graphdef, state = nnx.split(model)
    tokens, lengths = _generate_ar(graphdef, state, jnp.asarray(batch.tokens), jnp.asarray(batch.lengths),
                                   SamplingParams.make(temperature, top_k, top_p), jax.random.key(seed),
                                   jnp.asarray(eos), capacity=batch.capacity,
                                   max_new_tokens=int(max_new_tokens), greedy=temperature == 0)
    return GenerationResult(np.asarray(tokens), np.asarray(lengths))


def is_eos(tokens_B, eos_E):
    return jnp.any(tokens_B[:, None] == eos_E[None, :], axis=-1)


def last_logits(logits_BxTxV, lengths_B):
    return jnp.take_along_axis(logits_BxTxV, (lengths_B - 1)[:, None, None], axis=1)[:, 0]


@jax.jit(static_argnames=("graphdef", "capacity", "max_new_tokens", "greedy"))
def _generate_ar(graphdef, state, prompt_BxP, lengths_B, params: SamplingParams, key, eos_E,
                 *, capacity: int, max_new_tokens: int, greedy: bool):
    global _trace_count
    _trace_count += 1
    model = nnx.merge(graphdef, state)
    B = prompt_BxP.shape[0]
    M = max_new_tokens
    cache = transformer.init_cache(model, B, capacity)
    out = transformer.prefill(model, prompt_BxP, lengths_B, cache)
    tok_B = sampling.sample(jax.random.fold_in(key, 0), last_logits(out.logits, lengths_B), params, greedy)
    buf_BxM = jnp.zeros((B, M), jnp.int32).at[:, 0].set(tok_B)
    done_B = is_eos(tok_B, eos_E)
    n_B = jnp.ones((B,), jnp.int32)

    def cond(carry):
        i, _, _, done_B, _, _ = carry
        return (i < M) & ~jnp.all(done_B)

    def body(carry):
        i, tok_B, cache, done_B, n_B, buf_BxM = carry
        out = transformer.decode_step(model, tok_B, cache)
        tok_B = sampling.sample(jax.random.fold_in(key, i), out.logits[:, 0], params, greedy)
        tok_B = jnp.where(done_B, 0, tok_B)
        buf_BxM = buf_BxM.at[:, i].set(tok_B)
        n_B = n_B + (~done_B).astype(jnp.int32)
        done_B = done_B | is_eos(tok_B, eos_E)
        return i + 1, tok_B, out.cache, done_B, n_B, buf_BxM

    _, _, _, _, n_B, buf_BxM = jax.lax.while_loop(cond, body, (jnp.int32(1), tok_B, out.cache, done_B, n_B, buf_BxM))
    return buf_BxM, n_B
