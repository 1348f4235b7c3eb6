"""GGUF input (llama.cpp's single-file format): the model, dequantized, and its tokenizer, rebuilt.

    ckpt = read_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")   # HF config dict, HF-named f32 tensors, tokenizer
    convert_gguf(path, out_dir)                             # config.json, model.safetensors, tokenizer*.json

`specjax.io.checkpoint.load_model("x.gguf")` reads through here; `python -m specjax convert FILE.gguf OUT_DIR`
writes a Hugging Face directory that `load_model` and transformers both read.

What a GGUF changes and this undoes:
- tensor names (`blk.{i}.attn_q.weight` ... -> `model.layers.{i}.self_attn.q_proj.weight` ...);
- quantization: every block type the `gguf` package dequantizes (Q4_0/Q4_1/Q5_0/Q5_1/Q8_0, the
  K-quants, IQ types, F16/BF16/F32) -> float32;
- llama.cpp's row permutation of q_proj and k_proj for the `llama` architecture (its converter
  interleaves each head's two rotary halves for its own RoPE layout);
- the tokenizer: vocabulary, merges, token types and special ids as metadata, rebuilt here as a
  `tokenizers` byte-level BPE with the pre-tokenizer that `tokenizer.ggml.pre` names, and the chat
  template kept for `tokenizer_config.json`.

Only `numpy`, `gguf` and `tokenizers` are used: no torch.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil

import ml_dtypes
import numpy as np
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from tqdm import tqdm
from safetensors.numpy import save_file
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

# llama.cpp architecture -> (HF model_type, HF architecture class); the tensor table below covers these.
ARCHITECTURES = {"llama": ("llama", "LlamaForCausalLM"), "qwen2": ("qwen2", "Qwen2ForCausalLM"),
                 "qwen3": ("qwen3", "Qwen3ForCausalLM")}

_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
_LAYER = {"attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
          "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
          "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
          "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
          "attn_v.bias": "self_attn.v_proj.bias", "attn_output.bias": "self_attn.o_proj.bias",
          "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
          "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
          "ffn_down.weight": "mlp.down_proj.weight"}

# GPT-2's byte <-> printable-character table, which byte-level BPE vocabularies are spelled in.
def _byte_alphabet() -> set[str]:
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    extra = [b for b in range(256) if b not in keep]
    return {chr(b) for b in keep} | {chr(256 + i) for i in range(len(extra))}


_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _pre_tokenizer(pre: str):
    """The pre-tokenizer that llama.cpp applies for `tokenizer.ggml.pre` (llama-vocab.cpp's table)."""
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("default", "gpt2", "gpt-2"):
        return gpt2
    if pre in ("smollm", "starcoder", "refact", "codeshell", "exaone", "minerva", "command-r"):
        # "\p{N}" (each digit alone), then GPT-2's split: SmolLM2's own tokenizer.json says the same.
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2])
    split = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
             "smaug-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}.get(pre)
    if split is None:
        raise ValueError(f"unsupported tokenizer.ggml.pre {pre!r}; supported: default, gpt2, smollm, starcoder, "
                         "refact, codeshell, exaone, minerva, command-r, llama3, llama-bpe, smaug-bpe, qwen2, deepseek-r1-qwen")
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


CONTROL, USER_DEFINED = 3, 4  # llama.cpp token types


def build_tokenizer(meta: dict, *, source: str = "GGUF") -> Tokenizer:
    """A `tokenizers` byte-level BPE from a GGUF's `tokenizer.ggml.*` metadata (`meta`: key -> value)."""
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"{source}: tokenizer.ggml.model is {kind!r}; only byte-level BPE ('gpt2') is supported")
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    if "tokenizer.ggml.merges" not in meta:
        raise ValueError(f"{source}: a byte-level BPE vocabulary without tokenizer.ggml.merges")
    alphabet = _byte_alphabet()
    # Every real token is spelled in the byte alphabet; a control token that is not is a llama.cpp
    # mislabel and stays out (adding it would grow the vocabulary past the embedding table).
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre", "default"))
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.decoder = decoders.ByteLevel()
    special = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types)
               if ty == CONTROL and set(t) <= alphabet]
    if special:
        tok.add_special_tokens(special)
    user = [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == USER_DEFINED]
    if user:
        tok.add_tokens(user)
    return tok


@dataclasses.dataclass(frozen=True)
class GGUFCheckpoint:
    config: dict  # Hugging Face config.json
    tensors: dict  # HF tensor name -> float32 array (HF layout)
    tokenizer: Tokenizer
    tokenizer_config: dict  # tokenizer_config.json: special tokens, chat template


def _field(reader, key):
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def read_metadata(path: str) -> dict:
    """All key/value metadata of a GGUF file (arrays as lists)."""
    reader = _reader(path)
    return {k: _field(reader, k) for k in reader.fields if not k.startswith("GGUF.")}


def _reader(path: str):
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such GGUF file")
    try:
        return GGUFReader(path)
    except Exception as e:  # the reader raises ValueError / struct errors / IndexError on a bad file
        raise ValueError(f"{path}: not a readable GGUF file ({e})") from None


def _hf_config(meta: dict, arch: str, n_tensors_output: bool, path: str) -> dict:
    model_type, cls = ARCHITECTURES[arch]
    g = lambda k, default=None: meta.get(f"{arch}.{k}", default)  # noqa: E731
    need = ("block_count", "embedding_length", "feed_forward_length", "attention.head_count")
    missing = [f"{arch}.{k}" for k in need if g(k) is None]
    if missing:
        raise ValueError(f"{path}: GGUF metadata lacks {missing}")
    E, H = int(g("embedding_length")), int(g("attention.head_count"))
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = int(g("vocab_size") or (len(tokens) if tokens is not None else 0))
    scaling = g("rope.scaling.type")
    if scaling not in (None, "none"):
        raise ValueError(f"{path}: RoPE scaling {scaling!r} in a GGUF is not supported")
    cfg = {"architectures": [cls], "model_type": model_type, "vocab_size": vocab, "hidden_size": E,
           "intermediate_size": int(g("feed_forward_length")), "num_hidden_layers": int(g("block_count")),
           "num_attention_heads": H, "num_key_value_heads": int(g("attention.head_count_kv", H)),
           "head_dim": int(g("attention.key_length", E // H)), "hidden_act": "silu",
           "rms_norm_eps": float(g("attention.layer_norm_rms_epsilon", 1e-6)),
           "rope_theta": float(g("rope.freq_base", 10000.0)),
           "max_position_embeddings": int(g("context_length", 2048)),
           "tie_word_embeddings": not n_tensors_output, "torch_dtype": "float32"}
    for key, name in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                      ("padding_token_id", "pad_token_id")):
        if meta.get(f"tokenizer.ggml.{key}") is not None:
            cfg[name] = int(meta[f"tokenizer.ggml.{key}"])
    if model_type == "llama":
        cfg["attention_bias"] = False
        cfg["mlp_bias"] = False
    return cfg


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute` (convert_hf_to_gguf.py): rows per head go back from
    interleaved rotary pairs to HF's two halves."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_gguf(path: str, *, progress: bool = False) -> GGUFCheckpoint:
    """Reads and dequantizes a GGUF checkpoint (see the module docstring). Errors name the file and
    the problem: not a GGUF, an unsupported architecture, quantization type or tensor."""
    reader = _reader(path)
    meta = {k: _field(reader, k) for k in reader.fields if not k.startswith("GGUF.")}
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"{path}: unsupported GGUF architecture {arch!r}; supported: {', '.join(ARCHITECTURES)}")
    names = {t.name for t in reader.tensors}
    cfg = _hf_config(meta, arch, "output.weight" in names, path)
    tensors = {}
    it = reader.tensors
    if progress:
        it = tqdm(it, desc=f"dequantizing {os.path.basename(path)}", unit="tensor")
    for t in it:
        if t.name in _TOP:
            hf = _TOP[t.name]
        elif t.name.startswith("blk.") and t.name.split(".", 2)[2] in _LAYER:
            _, i, rest = t.name.split(".", 2)
            hf = f"model.layers.{int(i)}.{_LAYER[rest]}"
        else:
            raise ValueError(f"{path}: tensor {t.name!r} of a {arch} GGUF is not supported")
        qtype = GGMLQuantizationType(t.tensor_type)
        try:
            arr = dequantize(t.data, qtype)
        except NotImplementedError:
            raise ValueError(f"{path}: tensor {t.name!r} uses quantization {qtype.name}, which the gguf "
                             "package cannot dequantize") from None
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dimensions fastest-first
        arr = np.asarray(arr, np.float32).reshape(shape)
        if arch == "llama" and hf.endswith(("q_proj.weight", "k_proj.weight")):
            arr = _unpermute(arr, cfg["num_attention_heads"] if "q_proj" in hf else cfg["num_key_value_heads"])
        tensors[hf] = np.ascontiguousarray(arr)
    if any(k.endswith("o_proj.bias") for k in tensors) and arch == "llama":
        cfg["attention_bias"] = True
    tokenizer = build_tokenizer(meta, source=path)
    tokens = meta["tokenizer.ggml.tokens"]
    tok_cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
               "model_max_length": cfg["max_position_embeddings"],
               "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
               "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False))}
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
        if meta.get(f"tokenizer.ggml.{key}") is not None:
            tok_cfg[name] = tokens[int(meta[f"tokenizer.ggml.{key}"])]
    if meta.get("tokenizer.chat_template"):
        tok_cfg["chat_template"] = meta["tokenizer.chat_template"]
    return GGUFCheckpoint(cfg, tensors, tokenizer, tok_cfg)


def convert_gguf(path: str, out_dir: str, *, dtype: str = "float32", progress: bool = True) -> str:
    """Writes a Hugging Face directory (`config.json`, `model.safetensors`, `tokenizer.json`,
    `tokenizer_config.json`) for a GGUF file. `dtype`: "float32" (exact: every dequantized value is
    a float32) or "bfloat16". Written into a temporary sibling and renamed at the end, so an
    interrupted conversion never leaves a directory that looks complete. Returns `out_dir`."""
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be float32 or bfloat16, not {dtype!r}")
    ckpt = read_gguf(path, progress=progress)
    tmp = out_dir.rstrip("/") + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    tensors = ckpt.tensors
    if dtype == "bfloat16":
        tensors = {k: v.astype(ml_dtypes.bfloat16) for k, v in tensors.items()}
    save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump({**ckpt.config, "torch_dtype": dtype}, f, indent=2)
    ckpt.tokenizer.save(os.path.join(tmp, "tokenizer.json"))
    with open(os.path.join(tmp, "tokenizer_config.json"), "w") as f:
        json.dump(ckpt.tokenizer_config, f, indent=2)
    with open(os.path.join(tmp, "generation_config.json"), "w") as f:
        json.dump({k: ckpt.config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in ckpt.config},
                  f, indent=2)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.rename(tmp, out_dir)
    return out_dir
