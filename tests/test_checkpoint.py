"""Hugging Face format I/O: save/load round trips (single file, sharded, bfloat16), transformers
loading what specjax wrote, and clear errors (naming the file and the problem) for broken input."""
from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from safetensors.numpy import load_file, save_file
from tokenizers import Tokenizer, models, pre_tokenizers

import specjax
from specjax.models import transformer
from specjax.models.config import ModelConfig, RopeScaling

from conftest import KINDS, VOCAB

KIND_NAMES = list(KINDS)


def flat_params(model) -> dict:
    return {path: np.asarray(v.get_value()) for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def assert_same_params(a, b, *, exact=True):
    fa, fb = flat_params(a), flat_params(b)
    assert fa.keys() == fb.keys()
    for k in fa:
        assert fa[k].shape == fb[k].shape and fa[k].dtype == fb[k].dtype, k
        if exact:
            np.testing.assert_array_equal(fa[k], fb[k], err_msg=str(k))


def hf_load(path):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        path, output_loading_info=True, attn_implementation="eager", dtype=torch.float32)
    for what in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        assert not info[what], f"transformers reports {what}: {info[what]}"
    return model.eval()


def hf_logits(model, ids):
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids], dtype=torch.long)).logits[0].float().numpy()


def word_tokenizer(n_tokens: int) -> Tokenizer:
    vocab = {"[UNK]": 0, **{f"w{i}": i for i in range(1, n_tokens)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    assert tok.get_vocab_size() == n_tokens
    return tok


@pytest.fixture()
def llama_copy(llama, tmp_path):
    """A private copy of the tiny llama checkpoint, free to break."""
    path = str(tmp_path / "ckpt")
    shutil.copytree(llama.path, path)
    return path


# ----------------------------------------------------------------------------- round trips

@pytest.mark.parametrize("kind", KIND_NAMES)
def test_save_load_round_trip(tiny_models, kind, tmp_path):
    tiny = tiny_models[kind]
    out = str(tmp_path / "saved")
    specjax.save_model(tiny.jx, out)
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    back = specjax.load_model(out)
    assert back.config == tiny.jx.config
    assert_same_params(back, tiny.jx)
    # the tensors written are bit-identical to what transformers wrote (tied head not duplicated)
    ours, theirs = load_file(os.path.join(out, "model.safetensors")), load_file(os.path.join(tiny.path, "model.safetensors"))
    theirs = {k: v for k, v in theirs.items() if not k.endswith("rotary_emb.inv_freq")}
    assert ours.keys() == theirs.keys()
    for k in ours:
        np.testing.assert_array_equal(ours[k], theirs[k], err_msg=k)


def test_sharded_save_loads_back(qwen3, tmp_path):
    out = str(tmp_path / "sharded")
    specjax.save_model(qwen3.jx, out, max_shard_bytes=40_000)
    files = sorted(os.listdir(out))
    shards = [f for f in files if f.startswith("model-") and f.endswith(".safetensors")]
    assert "model.safetensors" not in files and "model.safetensors.index.json" in files
    assert len(shards) >= 3
    for s in shards:
        assert os.path.getsize(os.path.join(out, s)) < 40_000 + 64 * 1024  # payload cap + header
    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        index = json.load(f)
    assert set(index["weight_map"].values()) == set(shards)
    assert_same_params(specjax.load_model(out), qwen3.jx)
    # transformers reads the sharded checkpoint too
    ids = list(range(3, 40))
    np.testing.assert_allclose(hf_logits(hf_load(out), ids), qwen3.hf_logits(ids), atol=1e-5, rtol=0)
    # the weights' digest names the tensors, not the sharding (a resumed drafter run keys on it)
    single = str(tmp_path / "single")
    specjax.save_model(qwen3.jx, single)
    assert specjax.io.checkpoint.weights_sha256(out) == specjax.io.checkpoint.weights_sha256(single)


def test_bf16_export(qwen3, tmp_path):
    out = str(tmp_path / "bf16")
    specjax.save_model(qwen3.jx, out, dtype=jnp.bfloat16)
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["torch_dtype"] == "bfloat16"
    assert all(t.dtype == ml_dtypes.bfloat16 for t in load_file(os.path.join(out, "model.safetensors")).values())
    orig = flat_params(qwen3.jx)
    as_bf16 = specjax.load_model(out, dtype=jnp.bfloat16)
    assert as_bf16.config.dtype == jnp.bfloat16
    for k, v in flat_params(as_bf16).items():
        assert v.dtype == jnp.bfloat16, k
        np.testing.assert_array_equal(v, orig[k].astype(ml_dtypes.bfloat16), err_msg=str(k))
    as_f32 = specjax.load_model(out)  # upcast on load
    for k, v in flat_params(as_f32).items():
        assert v.dtype == np.float32, k
        np.testing.assert_array_equal(v, orig[k].astype(ml_dtypes.bfloat16).astype(np.float32), err_msg=str(k))
    # transformers loads the bf16 export as well
    hf = hf_load(out)
    ids = list(range(5, 30))
    got, ref = hf_logits(hf, ids), qwen3.hf_logits(ids)
    assert np.abs(got - ref).max() < 0.5  # bf16 weights: close, not equal
    assert np.abs(got - ref).max() > 0  # and it really is the rounded model


@pytest.mark.parametrize("kind", KIND_NAMES)
def test_transformers_loads_what_save_model_wrote(tiny_models, kind, tmp_path):
    tiny = tiny_models[kind]
    out = str(tmp_path / "for_hf")
    specjax.save_model(tiny.jx, out)
    hf = hf_load(out)
    assert hf.config.model_type == tiny.hf.config.model_type
    assert hf.config.tie_word_embeddings == tiny.hf.config.tie_word_embeddings
    assert hf.config.rope_parameters["rope_type"] == tiny.hf.config.rope_parameters["rope_type"]
    ids = np.random.default_rng(0).integers(0, VOCAB, 50).tolist()  # past the llama3 original window
    np.testing.assert_allclose(hf_logits(hf, ids), tiny.hf_logits(ids), atol=1e-5, rtol=0)


def _randomise_params(model, seed):
    """Random O(1) values everywhere (init_model's biases are zero and norms one)."""
    flat = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    key = jax.random.key(seed)
    for i, (path, var) in enumerate(sorted(flat.items(), key=lambda kv: str(kv[0]))):
        x = jax.random.normal(jax.random.fold_in(key, i), var.get_value().shape, jnp.float32)
        if len(path) >= 2 and "norm" in str(path[-2]):
            val = 1.0 + 0.2 * x
        elif path[-1] == "bias":
            val = 0.5 * x
        elif path[-1] == "embed_tokens":
            val = x
        else:
            val = x / np.sqrt(x.shape[0])
        var.set_value(val)
    nnx.update(model, nnx.from_flat_state(flat))


FRESH = {
    "llama_llama3rope_bias": dict(model_type="llama", qkv_bias=True, o_bias=True,
                                  rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 32)),
    "qwen2": dict(model_type="qwen2", qkv_bias=True, rope_theta=1e6),
    "qwen3_tied": dict(model_type="qwen3", qk_norm=True, tie_word_embeddings=True),
}


@pytest.mark.parametrize("name", list(FRESH))
def test_fresh_model_saved_for_transformers(name, tmp_path):
    """A model made by specjax (not read from HF) is written so that transformers computes the
    same logits: config.json and the tensor layout are right on their own."""
    cfg = ModelConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, max_position_embeddings=256, **FRESH[name])
    model = specjax.init_model(cfg, seed=3)
    _randomise_params(model, seed=4)
    out = str(tmp_path / name)
    specjax.save_model(model, out)
    hf = hf_load(out)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, VOCAB, n).tolist() for n in (40, 7, 61)]  # the parity-test shapes
    toks = np.zeros((3, 61), np.int32)
    for b, p in enumerate(prompts):
        toks[b, : len(p)] = p
    lens = jnp.asarray([len(p) for p in prompts], jnp.int32)
    logits = np.asarray(transformer.prefill(model, jnp.asarray(toks), lens, transformer.init_cache(model, 3, 96)).logits)
    for b, p in enumerate(prompts):
        np.testing.assert_allclose(logits[b, : len(p)], hf_logits(hf, p), atol=1e-4, rtol=0)


def test_tokenizer_saved_and_loaded(llama, tmp_path):
    tok = word_tokenizer(VOCAB - 10)
    out = str(tmp_path / "with_tok")
    specjax.save_model(llama.jx, out, tokenizer=tok)
    assert os.path.exists(os.path.join(out, "tokenizer.json"))
    specjax.load_model(out)  # a tokenizer that fits is accepted
    back = specjax.load_tokenizer(out)
    assert back.get_vocab_size() == VOCAB - 10
    assert back.encode("w1 w7 nope").ids == [1, 7, 0]
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        specjax.load_tokenizer(llama.path)  # the fixture has none


# ----------------------------------------------------------------------------- errors

def _edit_config(path, **changes):
    file = os.path.join(path, "config.json")
    with open(file) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(file, "w") as f:
        json.dump(cfg, f)


def _rewrite_tensors(path, fn):
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    fn(tensors)
    save_file(tensors, file, metadata={"format": "pt"})
    return file


def test_unsupported_model_type(llama_copy):
    _edit_config(llama_copy, model_type="gpt2")
    with pytest.raises(ValueError) as e:
        specjax.load_model(llama_copy)
    msg = str(e.value)
    assert os.path.join(llama_copy, "config.json") in msg and "'gpt2'" in msg and "unsupported model_type" in msg


def test_config_not_json(llama_copy):
    with open(os.path.join(llama_copy, "config.json"), "w") as f:
        f.write("{ this is not json")
    with pytest.raises(ValueError, match="config.json: not valid JSON"):
        specjax.load_model(llama_copy)


def test_config_missing_field(llama_copy):
    file = os.path.join(llama_copy, "config.json")
    with open(file) as f:
        cfg = json.load(f)
    del cfg["num_hidden_layers"]
    with open(file, "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match="config.json: missing required field 'num_hidden_layers'"):
        specjax.load_model(llama_copy)


def test_missing_files(llama_copy, tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        specjax.load_model(str(tmp_path / "nowhere"))
    os.remove(os.path.join(llama_copy, "model.safetensors"))
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        specjax.load_model(llama_copy)


def test_missing_tensor(llama_copy):
    name = "model.layers.1.mlp.up_proj.weight"
    file = _rewrite_tensors(llama_copy, lambda t: t.pop(name))
    with pytest.raises(ValueError) as e:
        specjax.load_model(llama_copy)
    assert file in str(e.value) and "missing tensor" in str(e.value) and name in str(e.value)


def test_tensor_of_wrong_shape(llama_copy):
    name = "model.layers.0.self_attn.k_proj.weight"  # [32, 64]

    def fn(t):
        t[name] = np.zeros((16, 64), np.float32)
    file = _rewrite_tensors(llama_copy, fn)
    with pytest.raises(ValueError) as e:
        specjax.load_model(llama_copy)
    msg = str(e.value)
    assert file in msg and name in msg and "(16, 64)" in msg and "(32, 64)" in msg


def test_unexpected_tensor(llama_copy):
    def fn(t):
        t["model.layers.0.self_attn.q_norm.weight"] = np.ones((16,), np.float32)  # a qwen3 tensor
    file = _rewrite_tensors(llama_copy, fn)
    with pytest.raises(ValueError) as e:
        specjax.load_model(llama_copy)
    assert file in str(e.value) and "unexpected" in str(e.value) and "q_norm" in str(e.value)


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty", "bad_header"])
def test_corrupt_safetensors(llama_copy, damage):
    file = os.path.join(llama_copy, "model.safetensors")
    with open(file, "rb") as f:
        data = f.read()
    if damage == "truncated":
        data = data[: len(data) // 2]
    elif damage == "garbage":
        data = np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes()
    elif damage == "empty":
        data = b""
    else:  # a plausible header length followed by something that is not JSON
        data = (100).to_bytes(8, "little") + b"{" + b"\x00" * 200
    with open(file, "wb") as f:
        f.write(data)
    with pytest.raises(ValueError) as e:
        specjax.load_model(llama_copy)
    assert file in str(e.value) and "corrupt" in str(e.value)


def test_sharded_errors(llama, tmp_path):
    out = str(tmp_path / "sharded")
    specjax.save_model(llama.jx, out, max_shard_bytes=40_000)
    index = os.path.join(out, "model.safetensors.index.json")
    with open(index) as f:
        shard = sorted(set(json.load(f)["weight_map"].values()))[1]
    with open(os.path.join(out, shard), "r+b") as f:
        f.truncate(100)
    with pytest.raises(ValueError) as e:
        specjax.load_model(out)
    assert os.path.join(out, shard) in str(e.value) and "corrupt" in str(e.value)
    os.remove(os.path.join(out, shard))
    with pytest.raises(FileNotFoundError) as e:
        specjax.load_model(out)
    assert os.path.join(out, shard) in str(e.value) and "missing" in str(e.value)
    with open(index, "w") as f:
        f.write("{")
    with pytest.raises(ValueError) as e:
        specjax.load_model(out)
    assert index in str(e.value) and "corrupt" in str(e.value)


def test_corrupt_tokenizer(llama_copy):
    file = os.path.join(llama_copy, "tokenizer.json")
    with open(file, "w") as f:
        f.write('{"version": "1.0", "model": {"type": "NoSuchModel"')
    for load in (specjax.load_model, specjax.load_tokenizer):
        with pytest.raises(ValueError) as e:
            load(llama_copy)
        assert file in str(e.value) and "corrupt tokenizer" in str(e.value)


def test_tokenizer_larger_than_vocabulary(llama_copy):
    file = os.path.join(llama_copy, "tokenizer.json")
    word_tokenizer(VOCAB + 10).save(file)
    with pytest.raises(ValueError) as e:
        specjax.load_model(llama_copy)
    msg = str(e.value)
    assert file in msg and f"{VOCAB + 10} tokens" in msg and str(VOCAB) in msg
    word_tokenizer(VOCAB).save(file)  # exactly the vocabulary: fine
    specjax.load_model(llama_copy)


def test_tied_head_that_differs(tiny_models, tmp_path):
    path = str(tmp_path / "tied")
    shutil.copytree(tiny_models["llama_tied"].path, path)

    def fn(t):
        t["lm_head.weight"] = t["model.embed_tokens.weight"] + 1.0
    file = _rewrite_tensors(path, fn)
    with pytest.raises(ValueError) as e:
        specjax.load_model(path)
    assert file in str(e.value) and "lm_head.weight" in str(e.value)
