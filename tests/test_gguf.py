"""GGUF input (specjax.io.gguf): a small Llama GGUF written here with the `gguf` package's
writer (random weights, quantized as llama.cpp would: Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/F16/BF16/F32, q and k
rows permuted) loads to the same logits as transformers' GGUF loader; its tokenizer encodes the
test split as transformers' GGUF tokenizer does; `specjax convert` writes a directory that both
read; chat templates render as transformers renders them; bad files get clear errors."""
from __future__ import annotations

import json
from pathlib import Path
import subprocess
import sys

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize

import specjax
from specjax.io.checkpoint import load_tokenizer
from specjax.io.gguf import read_gguf
from specjax.models import transformer
from train import corpus

REPO = Path(__file__).resolve().parent.parent

V, E, F, L, H, K = 8192, 64, 128, 2, 4, 2
D = E // H
SMOLLM_TEMPLATE = (  # SmolLM2-Instruct's chat template, as its GGUF carries it
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# Each layer tensor gets its own quantization, so every block type the writer can make is read.
LAYER_QUANTS = {"attn_q": Q.Q4_0, "attn_k": Q.Q4_1, "attn_v": Q.Q5_0, "attn_output": Q.Q5_1,
                "ffn_gate": Q.Q8_0, "ffn_up": Q.F16, "ffn_down": Q.BF16}


def _permute(w, n_head):
    """llama.cpp's convert_hf_to_gguf.py `permute` of q / k rows (what the loader must undo)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _add(w, name, arr, qtype):
    arr = np.ascontiguousarray(arr, np.float32)
    if qtype == Q.F32:
        w.add_tensor(name, arr)
    elif qtype == Q.F16:
        w.add_tensor(name, arr.astype(np.float16))
    else:
        w.add_tensor(name, quantize(arr, qtype), raw_dtype=qtype)


def write_gguf(path, *, arch="llama", extra_tensor=None, tokenizer_pre="gpt2", chat_template=SMOLLM_TEMPLATE):
    tok = json.loads((REPO / "models" / "tokenizer" / "tokenizer.json").read_text())
    tokens = [t for t, _ in sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])]
    special = {a["content"] for a in tok["added_tokens"]}
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(L)
    w.add_context_length(512)
    w.add_embedding_length(E)
    w.add_feed_forward_length(F)
    w.add_head_count(H)
    w.add_head_count_kv(K)
    w.add_rope_freq_base(100000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(V)
    w.add_rope_dimension_count(D)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(tokenizer_pre)
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 1 for t in tokens])
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]])
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)
    w.add_pad_token_id(1)
    w.add_add_bos_token(False)
    if chat_template:
        w.add_chat_template(chat_template)
    g = lambda *shape: (rng.standard_normal(shape) * 0.08).astype(np.float32)  # noqa: E731
    _add(w, "token_embd.weight", g(V, E), Q.Q8_0)
    _add(w, "output_norm.weight", 1 + g(E), Q.F32)
    for i in range(L):
        shapes = {"attn_q": (H * D, E), "attn_k": (K * D, E), "attn_v": (K * D, E), "attn_output": (E, H * D),
                  "ffn_gate": (F, E), "ffn_up": (F, E), "ffn_down": (E, F)}
        for name, shape in shapes.items():
            arr = g(*shape)
            if name in ("attn_q", "attn_k"):
                arr = _permute(arr, H if name == "attn_q" else K)
            _add(w, f"blk.{i}.{name}.weight", arr, LAYER_QUANTS[name])
        _add(w, f"blk.{i}.attn_norm.weight", 1 + g(E), Q.F32)
        _add(w, f"blk.{i}.ffn_norm.weight", 1 + g(E), Q.F32)
    if extra_tensor is not None:
        name, data, qtype = extra_tensor
        w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf")


def _ours(model, ids):
    B, T = ids.shape
    out = transformer.prefill(model, jnp.asarray(ids), jnp.full((B,), T), transformer.init_cache(model, B, T))
    return np.asarray(out.logits)


def test_logits_match_transformers_gguf_loader(tiny_gguf, tmp_path):
    ids = np.random.default_rng(1).integers(3, V, (2, 24))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_gguf.parent), gguf_file=tiny_gguf.name,
                                                           dtype=torch.float32)
    with torch.no_grad():
        ref = hf(torch.as_tensor(ids)).logits.numpy()
    ours = _ours(specjax.load_model(str(tiny_gguf)), ids)
    assert np.max(np.abs(ours - ref)) <= 1e-4
    # `specjax convert` writes a Hugging Face directory: we and transformers both read it, same logits
    out = tmp_path / "converted"
    subprocess.run([sys.executable, "-m", "specjax", "convert", str(tiny_gguf), str(out)], check=True, cwd=REPO,
                   capture_output=True)
    assert {p.name for p in out.iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}
    assert np.max(np.abs(_ours(specjax.load_model(str(out)), ids) - ref)) <= 1e-4
    hf_dir = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    with torch.no_grad():
        assert np.max(np.abs(hf_dir(torch.as_tensor(ids)).logits.numpy() - ref)) <= 1e-4
    # the chat template travels in tokenizer_config.json and renders as transformers renders it
    from specjax.io.chat import render_chat
    msgs = [{"role": "user", "content": "Reverse a list in Python."}]
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(tiny_gguf.parent), gguf_file=tiny_gguf.name)
    assert render_chat(str(out), msgs) == hf_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)


def test_tokenizer_matches_transformers_gguf_tokenizer(tiny_gguf):
    ours = load_tokenizer(str(tiny_gguf))
    hf = transformers.AutoTokenizer.from_pretrained(str(tiny_gguf.parent), gguf_file=tiny_gguf.name)
    files = corpus.read_manifest().split("test")[:24]
    texts = [corpus.read_text(corpus.stdlib_root(), f)[:4000] for f in files]
    texts.append("<|endoftext|>x = 12345  # digits\n<|pad|>")
    for text in texts:
        assert ours.encode(text).ids == hf(text, add_special_tokens=False)["input_ids"]
    # and our own shipped tokenizer, which the file's vocabulary and merges came from
    shipped = load_tokenizer(str(REPO / "models" / "tokenizer"))
    assert all(ours.encode(t).ids == shipped.encode(t).ids for t in texts[:10])


def test_unpermute_inverts_llama_cpp_permutation():
    from specjax.io.gguf import _unpermute
    w = np.arange(6 * 16 * 5, dtype=np.float32).reshape(6 * 16, 5)
    np.testing.assert_array_equal(_unpermute(_permute(w, 6), 6), w)


def test_clear_errors(tmp_path, tiny_gguf):
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'falcon'"):
        read_gguf(str(write_gguf(tmp_path / "falcon.gguf", arch="falcon")))
    bs, ts = gguf.GGML_QUANT_SIZES[Q.Q8_1]
    bad = write_gguf(tmp_path / "q81.gguf", extra_tensor=("blk.0.attn_q.bias", np.zeros((H * D // bs * ts,), np.uint8), Q.Q8_1))
    with pytest.raises(ValueError, match="quantization Q8_1"):
        read_gguf(str(bad))
    with pytest.raises(ValueError, match="unsupported tokenizer.ggml.pre 'no-such-pre'"):
        load_tokenizer(str(write_gguf(tmp_path / "pre.gguf", tokenizer_pre="no-such-pre")))
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        specjax.load_model(str(tmp_path / "junk.gguf"))
    with pytest.raises(FileNotFoundError):
        specjax.load_model(str(tmp_path / "missing.gguf"))
    from specjax.io.chat import render_chat
    with pytest.raises(ValueError, match="no chat template"):
        render_chat(str(REPO / "models" / "code-target"), [{"role": "user", "content": "hi"}])
