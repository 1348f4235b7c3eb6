"""The sampling distribution: `sampling.warp` + `sampling.sample` against an independent numpy
implementation of temperature / top-k / top-p (the transformers order), by exact comparison and by
a chi-square goodness-of-fit test on >= 100k draws; a power check that the same test rejects
subtly wrong rules; and an end-to-end check of the first token drawn by `specjax.generate`.

The chi-square critical value: scipy is not a dependency of specjax, so the test uses the
Wilson–Hilferty approximation chi2_{df,1-a} ~= df * (1 - 2/(9 df) + z_a sqrt(2/(9 df)))^3 at
a = 1e-6 (z = 4.7534). For df in 1..15 that approximation *over*-estimates the exact quantile by
1.5-15% (exact tail probability of the approximate value: 1.6e-7 .. 7e-7), i.e. it errs on the
conservative side; the draws use fixed seeds, so the outcome is deterministic anyway, and the
small a only guards against an unlucky seed after a change of JAX's RNG. The power tests show the
statistic of a wrong rule lands orders of magnitude above this value.
"""
from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from helpers import chi_square
from specjax.spec import sampling
from specjax.spec.sampling import SamplingParams

N_DRAWS = 200_000
# Distinct logits over V = 12, in shuffled order (so the sort in warp matters).
LOGITS = np.array([0.3, -1.7, 2.0, -0.4, 1.2, -3.0, 0.9, -0.8, 1.5, 0.0, -2.5, -1.1], np.float32)
V = LOGITS.size


# ----------------------------------------------------------------------------- the reference

def softmax(x):
    x = np.asarray(x, np.float64)
    m = np.max(x[np.isfinite(x)])
    e = np.where(np.isfinite(x), np.exp(x - m), 0.0)
    return e / e.sum()


def reference_probs(logits, temperature, top_k=0, top_p=1.0, *, top_p_extra=0, top_p_on_full_softmax=False):
    """Independent numpy implementation of the target distribution: temperature scaling, then
    keep the top_k largest logits, then keep the smallest prefix of the sorted probabilities
    whose mass reaches top_p; renormalise. The keyword switches build the *wrong* rules used by
    the power test."""
    x = np.asarray(logits, np.float64) / temperature
    full = softmax(x)
    if top_k > 0:
        kth = np.sort(x)[::-1][min(top_k, x.size) - 1]
        x = np.where(x >= kth, x, -np.inf)
    probs = softmax(x)
    if top_p < 1.0:
        basis = full if top_p_on_full_softmax else probs
        order = np.argsort(-basis, kind="stable")
        cum = np.cumsum(basis[order])
        n_keep = int(np.searchsorted(cum, top_p, side="left")) + 1  # up to the first cum >= p, included
        n_keep = max(1, n_keep + top_p_extra)  # top_p_extra != 0: a wrong rule
        keep = np.zeros(x.size, bool)
        keep[order[:n_keep]] = True
        probs = np.where(keep & (probs > 0), probs, 0.0)
        probs = probs / probs.sum()
    return probs


def _check_margins(logits, temperature, top_k, top_p):
    """Keeps the test cases away from knife edges where float rounding could flip a cut."""
    x = np.sort(np.asarray(logits, np.float64) / temperature)[::-1]
    if 0 < top_k < x.size:
        assert x[top_k - 1] - x[top_k] > 1e-3
    if top_p < 1.0:
        p = softmax(np.where(np.arange(x.size) < (top_k or x.size), x, -np.inf))
        assert np.min(np.abs(np.cumsum(p) - top_p)) > 1e-3


# ----------------------------------------------------------------------------- draws

@jax.jit
def _draw(key, params):
    logits = jnp.broadcast_to(jnp.asarray(LOGITS), (N_DRAWS, V))
    return sampling.sample(key, logits, params, greedy=False)


def draw_counts(temperature, top_k, top_p, seed):
    toks = np.asarray(_draw(jax.random.key(seed), SamplingParams.make(temperature, top_k, top_p)))
    return np.bincount(toks, minlength=V)


CASES = [  # (temperature, top_k, top_p)
    (1.0, 0, 1.0),
    (0.5, 0, 1.0),
    (2.0, 0, 1.0),
    (1.0, 3, 1.0),
    (1.0, V, 1.0),
    (1.0, 40, 1.0),  # k > V: no cut
    (1.0, 0, 0.8),
    (0.7, 5, 0.9),
    (1.5, 8, 0.6),
    (3.0, 0, 0.5),
]


@pytest.fixture(scope="module")
def drawn():
    return {case: draw_counts(*case, seed=i) for i, case in enumerate(CASES)}


@pytest.mark.parametrize("case", CASES)
def test_warp_equals_reference_exactly(case):
    temperature, top_k, top_p = case
    _check_margins(LOGITS, *case)
    got = np.exp(np.asarray(sampling.warp(jnp.asarray(LOGITS), SamplingParams.make(*case)), np.float64))
    np.testing.assert_allclose(got, reference_probs(LOGITS, *case), rtol=0, atol=2e-6)


@pytest.mark.parametrize("case", CASES)
def test_sample_distribution_chi_square(drawn, case):
    counts = drawn[case]
    assert counts.sum() == N_DRAWS
    stat, df, crit = chi_square(counts, reference_probs(LOGITS, *case))
    assert df >= 1
    assert stat <= crit, f"{case}: chi2 = {stat:.1f} > {crit:.1f} (df {df})"


def test_top_k_one_is_argmax():
    counts = draw_counts(1.0, 1, 1.0, seed=99)
    assert counts[np.argmax(LOGITS)] == N_DRAWS


# The power check: the same draws, tested against plausible wrong rules, must be rejected.
WRONG_RULES = {
    "temperature ignored": ((0.7, 5, 0.9), dict(temperature=1.0)),
    "temperature ignored (hot)": ((2.0, 0, 1.0), dict(temperature=1.0)),
    "top-k off by one": ((1.0, 3, 1.0), dict(top_k=4)),
    "top-p drops the crossing token": ((1.0, 0, 0.8), dict(top_p_extra=-1)),
    "top-p keeps one token too many": ((0.7, 5, 0.9), dict(top_p_extra=1)),
    "top-p on the pre-top-k softmax": ((1.5, 8, 0.6), dict(top_p_on_full_softmax=True)),
    "top-p ignored": ((3.0, 0, 0.5), dict(top_p=1.0)),
    "top-k ignored": ((1.0, 3, 1.0), dict(top_k=0)),
}


@pytest.mark.parametrize("name", list(WRONG_RULES))
def test_chi_square_rejects_wrong_rules(drawn, name):
    case, change = WRONG_RULES[name]
    args = dict(zip(("temperature", "top_k", "top_p"), case))
    wrong = reference_probs(LOGITS, **{**args, **change})
    right = reference_probs(LOGITS, *case)
    assert np.abs(wrong - right).max() > 1e-3  # the wrong rule really is different here
    stat, df, crit = chi_square(drawn[case], wrong)
    assert stat > 10 * crit, f"{name}: chi2 = {stat:.1f} does not reject (critical {crit:.1f})"


# ----------------------------------------------------------------------------- end to end

E2E_ROWS = 20_000


def _e2e_prompt(tiny, top_k):
    """A fixed prompt whose top-k cut is not a near-tie (so HF's and specjax's logits agree on it)."""
    rng = np.random.default_rng(21)
    for _ in range(50):
        prompt = rng.integers(0, tiny.vocab, 6).tolist()
        x = np.sort(tiny.hf_last(prompt))[::-1]
        if x[top_k - 1] - x[top_k] > 1e-2:
            return prompt
    raise AssertionError("no prompt with a clear top-k margin")


def test_generate_first_token_distribution(llama):
    """20k identical prompts in one batch, one seed: every row draws its own first token; their
    histogram must follow the warped distribution of the HF model's own last-prompt logits."""
    prompt = _e2e_prompt(llama, top_k=5)
    hf_logits = llama.hf_last(prompt)
    for temperature, top_k, top_p, seed in ((0.7, 5, 1.0, 0), (1.3, 0, 0.8, 1)):
        _check_margins(hf_logits, temperature, top_k, top_p)  # no cut that float noise could flip
        res = specjax.generate(llama.jx, [prompt] * E2E_ROWS, max_new_tokens=1, temperature=temperature,
                               top_k=top_k, top_p=top_p, seed=seed, capacity=len(prompt) + 1)
        np.testing.assert_array_equal(res.lengths, np.ones(E2E_ROWS))
        counts = np.bincount(res.tokens[:, 0], minlength=llama.vocab)
        probs = reference_probs(hf_logits, temperature, top_k, top_p)
        stat, df, crit = chi_square(counts, probs)
        assert df >= 2, "the warped distribution should not be (almost) deterministic here"
        assert stat <= crit, f"T={temperature} k={top_k} p={top_p}: chi2 = {stat:.1f} > {crit:.1f} (df {df})"
        # and it is not simply the unwarped model distribution
        stat_raw, _, crit_raw = chi_square(counts, softmax(hf_logits))
        assert stat_raw > crit_raw
