"""Weight storage dtypes (`specjax.models.quant`, `load_model(weights=...)`): the int8 matmul is
row-invariant (a row's output does not depend on the rows beside it), quantised targets stay close
to float32, and a speculative loop at a given weight dtype equals the AR loop at that dtype."""
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import specjax
from helpers import noisy_lm_drafter, tiny_hybrid, tiny_target
from specjax.drafters import vocab as vocab_lib
from specjax.models import family, quant, transformer

VOCAB = 48


def _quantized(model, weights):
    return quant.quantize(nnx.clone(model), weights)


def _all_logits(model, tokens_BxT):
    """The model's logits at every position of `tokens_BxT` (one prefill)."""
    fam = family(model)
    B, T = tokens_BxT.shape
    return np.asarray(fam.prefill(model, tokens_BxT, jnp.full((B,), T, jnp.int32),
                                  fam.init_cache(model, B, 32)).logits)


def test_int8_matmul_is_row_invariant_and_close():
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.normal(size=(64, 40)) / 8, jnp.float32)
    x = jnp.asarray(rng.normal(size=(8, 64)), jnp.float32)
    q, s = quant.quantize_int8(w, axis=1)
    assert q.dtype == jnp.int8 and s.shape == (40,)
    y8 = quant.matmul(x, q, s)
    for n in (1, 2, 5):  # one row takes the padded path; every row equals its value in the batch of 8
        np.testing.assert_array_equal(np.asarray(quant.matmul(x[:n], q, s)), np.asarray(y8[:n]))
    ref = np.asarray(x @ w)
    assert np.max(np.abs(np.asarray(y8) - ref)) < 0.03 * np.max(np.abs(ref))
    qt, st = quant.quantize_int8(w.T, axis=0)  # the tied head's layout: [V, E] rows
    np.testing.assert_array_equal(np.asarray(quant.matmul(x, qt, st, transposed=True)), np.asarray(y8))
    wb = w.astype(jnp.bfloat16)
    yb = quant.matmul(x, wb)
    assert yb.dtype == jnp.float32 and np.max(np.abs(np.asarray(yb) - ref)) < 0.02 * np.max(np.abs(ref))
    for n in (1, 2, 5):  # bf16 too (one and two rows are padded to MIN_ROWS: XLA:CPU's two-row kernel sums differently)
        np.testing.assert_array_equal(np.asarray(quant.matmul(x[:n], wb)), np.asarray(yb[:n]))


@pytest.mark.parametrize("weights", ["bfloat16", "int8"])
def test_quantized_target_close_to_float32(weights):
    target = tiny_target(VOCAB)
    q = _quantized(target, weights)
    assert quant.weight_dtype(q) == weights and quant.weight_dtype(target) == "float32"
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, VOCAB, (2, 12)), jnp.int32)
    a, b = _all_logits(target, tokens), _all_logits(q, tokens)
    agree = np.mean(np.argmax(a, -1) == np.argmax(b, -1))
    assert agree > 0.8, agree
    rows = vocab_lib.head_rows(q, jnp.arange(5))
    assert rows.dtype == jnp.float32 and rows.shape == (5, target.config.hidden_size)
    with pytest.raises(ValueError, match="already"):
        quant.quantize(q, "int8")


@pytest.mark.parametrize("weights", ["bfloat16", "int8"])
def test_quantized_speculative_equals_ar_at_the_same_dtype(weights):
    """Token for token, no near-tie allowance: with the batch-invariant attention
    (`specjax.models.invariant`) a tree verifies exactly what AR decodes."""
    target = transformer.set_attention_impl(_quantized(tiny_target(VOCAB), weights), "invariant")
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, VOCAB, n).tolist() for n in (9, 21, 14, 30)]
    ref = specjax.generate(target, prompts, max_new_tokens=24)
    for tree in ("depth=3,topk=2,nodes=8", "chain=4"):
        got = specjax.generate(target, prompts, max_new_tokens=24, drafters=[noisy_lm_drafter(VOCAB)], tree=tree)
        assert got.sequences() == ref.sequences(), tree


def test_int8_hybrid_forward():
    model = tiny_hybrid()
    q = _quantized(model, "int8")
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, model.config.vocab_size, (1, 10)), jnp.int32)
    assert q.layers[0].linear_attn.in_proj_qkvz.weight[...].dtype == jnp.int8
    ref, got = _all_logits(model, tokens), _all_logits(q, tokens)
    assert np.mean(np.argmax(ref, -1) == np.argmax(got, -1)) > 0.8


def test_load_model_weights_option(llama):
    # the batch-invariant attention is on by default at bf16 / int8 (exact speculation), off at float32
    assert specjax.load_model(llama.path, weights="bfloat16").attention_impl == "invariant"
    assert getattr(specjax.load_model(llama.path, weights="bfloat16", invariant=False), "attention_impl", "jnp") != "invariant"
    assert getattr(specjax.load_model(llama.path), "attention_impl", "jnp") != "invariant"
    q = specjax.load_model(llama.path, weights="int8")
    assert q.attention_impl == "invariant"
    assert q.layers[0].mlp.up_proj.weight[...].dtype == jnp.int8
    assert q.layers[0].mlp.up_proj.scale[...].shape == (llama.jx.config.intermediate_size,)
    assert q.lm_head.weight[...].dtype == jnp.int8  # untied head
    with pytest.raises(ValueError, match="expected one of"):
        specjax.load_model(llama.path, weights="fp8")
    with pytest.raises(ValueError, match="float32 activations"):
        specjax.load_model(llama.path, weights="int8", dtype=jnp.bfloat16)
