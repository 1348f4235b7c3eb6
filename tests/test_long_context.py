"""Long prompts (issue 64): the chunked prefill and its blockwise attention, on tiny models.

- `blockwise_attend` equals `attend` under `kvcache.visible_mask` (causal and tree block masks, ragged
  lengths, a capacity that is not a multiple of the key block, rows that see nothing);
- the chunked prefill (`specjax.models.prefill`) gives the whole prefill's last logits, hidden states and
  committed cache, on a transformer and a hybrid target, rows ending in different chunks;
- `generate` with prompts longer than a chunk: greedy speculative output equals autoregressive output,
  and both equal the output of an unchunked prefill (up to near-ties); one program per length bucket;
- a prompt longer than the model's context is refused before anything is traced;
- `tools.profile_long`'s measurement of one length (prefill, decode step, verify forward) on a tiny target;
- the long prompt sets (`train.prompts.long_prompts`: long code, long chat).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from helpers import compare_greedy, noisy_lm_drafter, prefix_logits_fn, tiny_hybrid, tiny_target
from specjax.engine import loop as engine
from specjax.models import attention as attention_lib
from specjax.models import family, kvcache
from specjax.models import prefill as prefill_lib

VOCAB = 64


@pytest.mark.parametrize("capacity,key_block,S", [(40, 16, 5), (64, 16, 1), (37, 64, 7)])
def test_blockwise_attention_equals_the_dense_attention(capacity, key_block, S):
    rng = np.random.default_rng(capacity)
    B, H, K, D = 3, 4, 2, 8
    q = jnp.asarray(rng.normal(size=(B, S, H, D)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(B, capacity, K, D)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(B, capacity, K, D)), jnp.float32)
    length = jnp.asarray([0, capacity // 2, capacity - S], jnp.int32)
    mask = rng.random((B, S, S)) < 0.5  # an arbitrary block mask (a tree's, a causal one, rows seeing nothing)
    mask[1] = np.tril(np.ones((S, S), bool))
    mask[0, 0] = False  # row 0, query 0: no committed prefix and no visible scratch slot
    mask = jnp.asarray(mask)
    cache = kvcache.KVCache(k=k[None], v=v[None], length=length)
    want = attention_lib.attend(q, k, v, kvcache.visible_mask(cache, mask))
    got = attention_lib.blockwise_attend(q, k, v, length, mask, key_block)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
    assert not np.asarray(got)[0, 0].any()


@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_chunked_prefill_equals_the_whole_prefill(kind):
    model = tiny_target(VOCAB) if kind == "dense" else tiny_hybrid(VOCAB)
    fam = family(model)
    rng = np.random.default_rng(1)
    chunk, P = 32, 96
    lengths = jnp.asarray([96, 40, 17], jnp.int32)  # ending in the last, the second and the first chunk
    tokens = jnp.asarray(rng.integers(0, VOCAB, (3, P)), jnp.int32)
    layers = (0, 1)

    @jax.jit
    def both(tokens, lengths):
        whole = fam.prefill(model, tokens, lengths, fam.init_cache(model, 3, 128), layers)
        chunked = prefill_lib.prefill(fam, model, tokens, lengths, fam.init_cache(model, 3, 128), layers, chunk=chunk)
        return whole, chunked

    whole, chunked = both(tokens, lengths)
    assert chunked.logits.shape == (3, 1, VOCAB)
    np.testing.assert_allclose(np.asarray(prefill_lib.prompt_logits(chunked.logits, lengths)),
                               np.asarray(prefill_lib.prompt_logits(whole.logits, lengths)), atol=2e-4, rtol=2e-4)
    valid = np.arange(P)[None] < np.asarray(lengths)[:, None]
    for a, b in zip(chunked.hidden + (chunked.last_hidden,), whole.hidden + (whole.last_hidden,), strict=True):
        np.testing.assert_allclose(np.asarray(a)[valid], np.asarray(b)[valid], atol=2e-4, rtol=2e-4)
    kv_c, kv_w = (chunked.cache, whole.cache) if kind == "dense" else (chunked.cache.kv, whole.cache.kv)
    np.testing.assert_array_equal(np.asarray(kv_c.length), np.asarray(lengths))
    np.testing.assert_array_equal(np.asarray(kv_w.length), np.asarray(lengths))
    for b, n in enumerate(np.asarray(lengths)):
        np.testing.assert_allclose(np.asarray(kv_c.k)[:, b, :n], np.asarray(kv_w.k)[:, b, :n], atol=2e-4, rtol=2e-4)
        np.testing.assert_allclose(np.asarray(kv_c.v)[:, b, :n], np.asarray(kv_w.v)[:, b, :n], atol=2e-4, rtol=2e-4)
    if kind == "hybrid":  # the recurrent state after each row's own prompt
        np.testing.assert_allclose(np.asarray(chunked.cache.state), np.asarray(whole.cache.state), atol=2e-4, rtol=2e-4)


def test_generate_with_prompts_longer_than_a_chunk(monkeypatch):
    target = tiny_target(VOCAB)
    rng = np.random.default_rng(2)
    base = rng.integers(0, VOCAB, 12).tolist()
    prompts = [(base * 9)[:100], rng.integers(0, VOCAB, 70).tolist()]  # a ragged batch over 3 and 4 chunks
    whole = specjax.generate(target, prompts, max_new_tokens=12, eos_token_id=()).sequences()
    monkeypatch.setattr(prefill_lib, "PREFILL_CHUNK", 32)
    assert prefill_lib.prompt_bucket(100, engine.PROMPT_BUCKET) == 128
    ar = specjax.generate(target, prompts, max_new_tokens=12, eos_token_id=())
    n_exact, n_near = compare_greedy(whole, ar.sequences(), prefix_logits_fn(target, prompts))
    assert n_exact + n_near == 2
    drafter = noisy_lm_drafter(VOCAB)
    spec = specjax.generate(target, prompts, max_new_tokens=12, eos_token_id=(), drafters=[drafter], tree="chain=3")
    assert spec.sequences() == ar.sequences()  # the same prefill program: exactly the AR tokens
    assert float(np.mean(spec.stats["tau"])) > 1.0
    traces = engine.trace_count()
    other = [rng.integers(0, VOCAB, 110).tolist(), rng.integers(0, VOCAB, 99).tolist()]  # the same bucket (128)
    specjax.generate(target, other, max_new_tokens=12, eos_token_id=(), drafters=[drafter], tree="chain=3")
    assert engine.trace_count() == traces


def test_a_prompt_longer_than_the_context_is_refused_before_tracing():
    target = tiny_target(VOCAB)  # max_position_embeddings 512
    traces = engine.trace_count()
    with pytest.raises(ValueError, match=r"prompt 1 has 513 tokens, more than the model's context \(max_position"):
        specjax.generate(target, [[1, 2], [3] * 513], max_new_tokens=4)
    with pytest.raises(ValueError, match="more than the model's context"):
        specjax.generate(target, [[3] * 600], max_new_tokens=4, drafters=[noisy_lm_drafter(VOCAB)], tree="chain=2")
    assert engine.trace_count() == traces


def test_profile_long_measures_one_length(monkeypatch):
    from tools import profile_long
    monkeypatch.setattr(prefill_lib, "PREFILL_CHUNK", 32)
    row = profile_long.profile_one(tiny_target(VOCAB), list(range(3, 60)) * 2, repeats=1, steps=2)
    assert row["length"] == 114 and row["bucket"] == 128 and row["capacity"] > 128
    for key in ("prefill_s", "decode_step_ms", "verify8_ms", "peak_rss_mb", "prefill_compile_s"):
        assert row[key] > 0, key
    assert row["verify8_over_decode"] == pytest.approx(row["verify8_ms"] / row["decode_step_ms"])


def test_long_prompt_sets(tmp_path):
    """train.prompts.long_prompts on the shipped code tokenizer: long code is exactly L tokens ending at a def
    line; long chat is a module and a question in the chat template, at most L tokens; bad kinds refused."""
    import json
    from tokenizers import Tokenizer

    from train import prompts
    from train.zoo import REPO
    tok = Tokenizer.from_file(str(REPO / "models/tokenizer/tokenizer.json"))
    code = prompts.long_prompts("long-code", tok, 1024, 2)
    assert len(code) == 2 and all(len(p["ids"]) == 1024 for p in code)
    assert all(tok.decode(p["ids"][-24:]).rstrip().endswith(":") for p in code)  # the def line
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% for m in messages %}<{{ m.role }}>"
                                                                "{{ m.content }}{% endfor %}<assistant>"}))
    chat = prompts.long_prompts("long-chat", tok, 1024, 2, chat_model_dir=str(tmp_path))
    assert len(chat) == 2 and all(900 < len(p["ids"]) <= 1024 for p in chat)
    assert "What does the function" in tok.decode(chat[0]["ids"])
    with pytest.raises(ValueError, match="unknown long prompt kind"):
        prompts.long_prompts("long", tok, 1024, 1)
    with pytest.raises(ValueError, match="chat_model_dir"):
        prompts.long_prompts("long-chat", tok, 1024, 1)
