"""A long prompt's prefill in chunks (issue 64): bounded memory, one compiled program per length bucket.

`prefill(fam, model, tokens_BxP, lengths_B, cache, hidden_layers, chunk=)` is the family's own `prefill`
for a prompt of at most `chunk` tokens. A longer one (P a multiple of `chunk`, as `prompt_bucket` pads
it) runs the family's `prefill` on the first chunk, then `extend` on each further chunk in a `lax.scan`
(one chunk's program, traced once, whatever the length): each row commits its own tokens of the chunk
(none once its prompt has ended). A transformer's chunks attend with `attention.BLOCKWISE` (an online
softmax over the cache's key blocks up to the chunk's end: no [T, C] score matrix, and the cost of chunk
i grows with i, not with the capacity); a hybrid target's recurrent layers are chunked by its `extend`.

What it returns differs from a whole-prompt prefill in one field: `logits` holds each row's last prompt
position only ([B, 1, V]; a [B, P, V] array at 8k tokens and a 49k vocabulary is 1.6 GB a row), which
is what the engine reads (`prompt_logits`). `hidden` and `last_hidden` cover every position, as the
drafters' `init` reads them.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from specjax.models import attention as attention_lib
from specjax.models import kvcache

PREFILL_CHUNK = 512  # tokens per chunk; a prompt bucket above it is a multiple of it


def prompt_bucket(n: int, bucket: int, chunk: int | None = None) -> int:
    """The padded prompt length of a longest prompt of `n` tokens: a multiple of `bucket` up to `chunk`,
    a multiple of `chunk` above it (a chunked prefill scans whole chunks; fewer programs for long prompts)."""
    chunk = PREFILL_CHUNK if chunk is None else chunk
    step = bucket if n <= chunk else chunk
    return step * math.ceil(n / step)


def prompt_logits(logits_BxTxV, lengths_B):
    """Each row's logits at its last prompt position: from a whole prompt's [B, P, V] or a chunked
    prefill's [B, 1, V] (a whole prompt is at least one bucket of several tokens)."""
    if logits_BxTxV.shape[1] == 1:
        return logits_BxTxV[:, 0]
    return jnp.take_along_axis(logits_BxTxV, (lengths_B - 1)[:, None, None], axis=1)[:, 0]


def prefill(fam, model, tokens_BxP, lengths_B, cache, hidden_layers=(), *, chunk: int | None = None):
    """The family's prefill, in chunks of `chunk` tokens (default `PREFILL_CHUNK`, read at trace time) when the
    prompt block is longer (see the module)."""
    chunk = PREFILL_CHUNK if chunk is None else chunk
    B, P = tokens_BxP.shape
    if P <= chunk:
        return fam.prefill(model, tokens_BxP, lengths_B, cache, hidden_layers)
    if P % chunk:
        raise ValueError(f"a chunked prefill needs the prompt block ({P}) padded to a multiple of {chunk}")
    n = P // chunk
    lengths_B = jnp.asarray(lengths_B, jnp.int32)
    kw = {"attention": attention_lib.BLOCKWISE} if getattr(fam, "CHUNK_ATTENTION", False) else {}
    if kw:  # the first chunk too: an empty cache (length 0), then `extend` as every later chunk
        first = fam.extend(model, tokens_BxP[:, :chunk], jnp.minimum(lengths_B, chunk),
                           kvcache.set_length(cache, jnp.zeros((B,), jnp.int32)), hidden_layers, **kw)
    else:  # a hybrid target's prefill resets its recurrent state
        first = fam.prefill(model, tokens_BxP[:, :chunk], jnp.minimum(lengths_B, chunk), cache, hidden_layers)

    def last_of(logits_BxCxV, start):  # the row's last prompt position, where it falls in this chunk
        i_B = lengths_B - 1 - start
        here_B = (i_B >= 0) & (i_B < chunk)
        got = jnp.take_along_axis(logits_BxCxV, jnp.clip(i_B, 0, chunk - 1)[:, None, None], axis=1)[:, 0]
        return here_B, got

    here, last = last_of(first.logits, 0)
    last_BxV = jnp.where(here[:, None], last, jnp.zeros_like(last))
    rest_NxBxC = tokens_BxP[:, chunk:].reshape(B, n - 1, chunk).transpose(1, 0, 2)

    def step(carry, xs):
        cache, last_BxV = carry
        i, toks_BxC = xs
        start = i * chunk
        out = fam.extend(model, toks_BxC, jnp.clip(lengths_B - start, 0, chunk), cache, hidden_layers, **kw)
        here, got = last_of(out.logits, start)
        return (out.cache, jnp.where(here[:, None], got, last_BxV)), (out.hidden, out.last_hidden)

    (cache, last_BxV), (hidden, last_hidden) = jax.lax.scan(
        step, (first.cache, last_BxV), (jnp.arange(1, n, dtype=jnp.int32), rest_NxBxC))

    def join(a_BxCx, b_NxBxCx):  # the first chunk's positions, then the scanned chunks' in order
        b = jnp.moveaxis(b_NxBxCx, 0, 1).reshape((B, (n - 1) * chunk) + b_NxBxCx.shape[3:])
        return jnp.concatenate([a_BxCx, b], axis=1)

    return dataclasses.replace(first, logits=last_BxV[:, None], cache=cache,
                               hidden=tuple(join(a, b) for a, b in zip(first.hidden, hidden)),
                               last_hidden=join(first.last_hidden, last_hidden))
