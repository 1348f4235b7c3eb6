"""`specjax.generate`: greedy parity with `transformers` generate, EOS handling, compile caching
(trace counts), seeded sampling, and refusal of bad input before anything is traced."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import specjax
from specjax.engine import loop as engine

from conftest import VOCAB
from helpers import NearTieWarning, compare_greedy

PROMPT_LENS = (5, 17, 9, 30)  # one 32-token bucket
OTHER_LENS = (31, 3, 12, 20)  # same bucket, other lengths
MAX_NEW = 24


def _prompts(lens, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, n).tolist() for n in lens]


def _hf_greedy(tiny, prompt, max_new, eos=None) -> list[int]:
    x = torch.tensor([prompt], dtype=torch.long)
    with torch.no_grad():
        out = tiny.hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new, do_sample=False,
                               eos_token_id=eos, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _hf_logits_fn(tiny, prompts):
    return lambda row, prefix: tiny.hf_last(list(prompts[row]) + list(prefix))


# ----------------------------------------------------------------------------- the helper itself

def test_compare_greedy_tells_near_tie_from_mismatch():
    V = 8

    def logits_fn(row, prefix):
        x = np.linspace(0.0, -3.0, V)  # token 0 clearly best...
        if len(prefix) == 2:
            x[5] = x[0] - 3e-5  # ...except at position 2, where 0 and 5 nearly tie
        return x

    assert compare_greedy([[0, 0, 0, 0]], [[0, 0, 0, 0]], logits_fn) == (1, 0)
    assert compare_greedy([0, 0, 0], [0, 0, 0], logits_fn) == (1, 0)  # a single sequence
    with pytest.warns(NearTieWarning, match="near-tie"):
        assert compare_greedy([[0, 0, 0, 0], [0, 0, 0, 1]], [[0, 0, 5, 2], [0, 0, 0, 1]], logits_fn) == (1, 1)
    with pytest.raises(AssertionError, match="mismatch at row 0, generated position 1"):
        compare_greedy([[0, 0, 0]], [[0, 1, 0]], logits_fn)  # token 1 is 0.43 below the max
    with pytest.raises(AssertionError, match="lengths"):
        compare_greedy([[0, 0, 0]], [[0, 0]], logits_fn)
    with pytest.raises(AssertionError, match="gap"):
        # a third token is not a tie even where the top two nearly tie
        compare_greedy([[0, 0, 0]], [[0, 0, 3]], logits_fn)


# ----------------------------------------------------------------------------- greedy parity

@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_greedy_matches_transformers(tiny_models, kind):
    tiny = tiny_models[kind]
    prompts = _prompts(PROMPT_LENS, seed=11)
    res = specjax.generate(tiny.jx, prompts, max_new_tokens=MAX_NEW)  # config has no EOS
    assert res.tokens.shape == (len(prompts), MAX_NEW)
    np.testing.assert_array_equal(res.lengths, [MAX_NEW] * len(prompts))
    ref = [_hf_greedy(tiny, p, MAX_NEW) for p in prompts]
    assert all(len(r) == MAX_NEW for r in ref)
    n_exact, n_near = compare_greedy(ref, res.sequences(), _hf_logits_fn(tiny, prompts))
    print(f"{kind}: {n_exact} rows identical to transformers, {n_near} honest near-tie(s)")
    assert n_exact + n_near == len(prompts)


def test_eos_stops_its_row_only(llama):
    prompts = _prompts(PROMPT_LENS, seed=11)
    free = specjax.generate(llama.jx, prompts, max_new_tokens=MAX_NEW).sequences()
    # An EOS id that greedy produces in some row but not in every row.
    eos = None
    for tok in sorted({t for row in free for t in row[1:-2]}):
        firsts = [row.index(tok) if tok in row else None for row in free]
        if any(f is not None and 0 < f < MAX_NEW - 2 for f in firsts) and any(f is None for f in firsts):
            eos = tok
            break
    assert eos is not None, "no suitable EOS candidate in the greedy outputs"
    expected_len = [row.index(eos) + 1 if eos in row else MAX_NEW for row in free]
    assert min(expected_len) < MAX_NEW and max(expected_len) == MAX_NEW

    c0 = engine.trace_count()
    res = specjax.generate(llama.jx, prompts, max_new_tokens=MAX_NEW, eos_token_id=eos)
    assert engine.trace_count() == c0  # the EOS id is data, not shape
    np.testing.assert_array_equal(res.lengths, expected_len)
    for b, seq in enumerate(res.sequences()):
        assert seq == free[b][: expected_len[b]]
        if expected_len[b] < MAX_NEW:
            assert seq[-1] == eos and eos not in seq[:-1]
            # transformers stops at the same place
            hf_seq = _hf_greedy(llama, prompts[b], MAX_NEW, eos=eos)
            assert sum(compare_greedy([hf_seq], [seq], lambda _, pre: llama.hf_last(prompts[b] + pre))) == 1
        else:
            assert eos not in seq
    # a list of EOS ids: the row stops at the first one of either
    res2 = specjax.generate(llama.jx, prompts, max_new_tokens=MAX_NEW, eos_token_id=[eos, free[0][0]])
    assert res2.lengths[0] == 1 and res2.sequences()[0] == [free[0][0]]
    for b in range(1, len(prompts)):
        assert res2.lengths[b] <= expected_len[b]


# ----------------------------------------------------------------------------- compile caching

def test_same_shapes_and_same_bucket_do_not_retrace(llama):
    c0 = engine.trace_count()
    a = specjax.generate(llama.jx, _prompts(PROMPT_LENS, seed=12), max_new_tokens=MAX_NEW)
    c1 = engine.trace_count()
    assert c1 - c0 <= 1  # 0 when an earlier test compiled this shape already
    b = specjax.generate(llama.jx, _prompts(PROMPT_LENS, seed=12), max_new_tokens=MAX_NEW)
    assert engine.trace_count() == c1
    np.testing.assert_array_equal(a.tokens, b.tokens)
    # other prompt lengths, all within the same 32-token bucket
    c = specjax.generate(llama.jx, _prompts(OTHER_LENS, seed=13), max_new_tokens=MAX_NEW)
    assert engine.trace_count() == c1
    np.testing.assert_array_equal(c.lengths, [MAX_NEW] * 4)


def test_sampling_params_do_not_retrace_and_seeds_reproduce(llama):
    prompts = _prompts(PROMPT_LENS, seed=14)
    # Start from an empty compile cache, so the first call must trace exactly once whatever ran
    # before (this also shows trace_count() is not vacuous).
    engine._generate_ar.clear_cache()
    c0 = engine.trace_count()
    a = specjax.generate(llama.jx, prompts, max_new_tokens=7, temperature=0.7, seed=1)
    assert engine.trace_count() == c0 + 1
    b = specjax.generate(llama.jx, prompts, max_new_tokens=7, temperature=1.3, seed=1)
    c = specjax.generate(llama.jx, prompts, max_new_tokens=7, temperature=1.3, top_k=5, top_p=0.9, seed=1)
    a2 = specjax.generate(llama.jx, prompts, max_new_tokens=7, temperature=0.7, seed=1)
    d = specjax.generate(llama.jx, prompts, max_new_tokens=7, temperature=0.7, seed=2)
    assert engine.trace_count() == c0 + 1
    np.testing.assert_array_equal(a.tokens, a2.tokens)  # same seed, same samples
    assert not np.array_equal(a.tokens, d.tokens)  # another seed, other samples
    assert not np.array_equal(b.tokens, c.tokens) or not np.array_equal(a.tokens, b.tokens)
    for r in (a, b, c, d):
        assert r.tokens.min() >= 0 and r.tokens.max() < VOCAB
        np.testing.assert_array_equal(r.lengths, [7] * 4)


# ----------------------------------------------------------------------------- bad input

BAD_INPUTS = {
    "beyond_capacity": (dict(prompts=[[1] * 10], max_new_tokens=30, capacity=32), "capacity"),
    "empty_prompt": (dict(prompts=[[1, 2, 3], []]), "empty"),
    "empty_batch": (dict(prompts=[]), "non-empty"),
    "negative_id": (dict(prompts=[[1, -1, 2]]), "outside the vocabulary"),
    "id_at_vocab": (dict(prompts=[[1, 2], [VOCAB]]), "outside the vocabulary"),
    "id_past_vocab": (dict(prompts=[[10 * VOCAB]]), "outside the vocabulary"),
    "string_in_batch": (dict(prompts=[[1, 2], "hello"]), "string"),
    "string_batch": (dict(prompts="hello"), "list"),
    "nested_list": (dict(prompts=[[1, 2], [[3, 4], [5, 6]]]), "flat"),
    "ragged_nested_list": (dict(prompts=[[1, [2, 3]]]), None),
    "flat_list_of_ints": (dict(prompts=[1, 2, 3]), "flat list"),
    "float_ids": (dict(prompts=[[1.0, 2.5]]), "non-integer"),
    "negative_temperature": (dict(prompts=[[1, 2]], temperature=-0.5), "temperature"),
    "nan_temperature": (dict(prompts=[[1, 2]], temperature=float("nan")), "temperature"),
    "top_p_zero": (dict(prompts=[[1, 2]], temperature=1.0, top_p=0.0), "top_p"),
    "top_p_above_one": (dict(prompts=[[1, 2]], temperature=1.0, top_p=1.5), "top_p"),
    "negative_top_k": (dict(prompts=[[1, 2]], temperature=1.0, top_k=-1), "top_k"),
    "zero_max_new_tokens": (dict(prompts=[[1, 2]], max_new_tokens=0), "max_new_tokens"),
    "eos_outside_vocab": (dict(prompts=[[1, 2]], eos_token_id=VOCAB), "eos_token_id"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_refused_before_tracing(llama, case):
    kwargs, match = BAD_INPUTS[case]
    kwargs = dict(kwargs)
    prompts = kwargs.pop("prompts")
    c0 = engine.trace_count()
    with pytest.raises(ValueError, match=match):
        specjax.generate(llama.jx, prompts, **{"max_new_tokens": 4, **kwargs})
    assert engine.trace_count() == c0


def test_capacity_that_fits_is_accepted(llama):
    """The boundary of the capacity check: prompt + max_new_tokens == capacity is fine."""
    prompts = _prompts((10, 4), seed=15)
    res = specjax.generate(llama.jx, prompts, max_new_tokens=6, capacity=16)
    np.testing.assert_array_equal(res.lengths, [6, 6])
    ref = [_hf_greedy(llama, p, 6) for p in prompts]
    n_exact, n_near = compare_greedy(ref, res.sequences(), _hf_logits_fn(llama, prompts))
    assert n_exact + n_near == 2
