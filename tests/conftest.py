"""Shared fixtures: tiny random Hugging Face models (Llama, Llama with llama3 RoPE scaling, Llama
with tied embeddings, Qwen2, Qwen3), built with `transformers`, saved once per session with
`save_pretrained` (safetensors, float32) and loaded both ways: the torch model (the reference)
and the specjax model.

Every parameter is re-drawn with O(1) scale before saving (HF's 0.02-std init gives near-uniform
logits, near-ties everywhere and zero biases): biases and q/k-norm weights are non-zero, so the
tests see them.
"""
from __future__ import annotations

import dataclasses
import os

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One intra-op thread for torch (the reference models; read when torch is imported): the models are
# small, and under `make test` two xdist workers share two cores, where a second thread only
# spin-waits (test_zoo's transformers check of a shipped target: ~45 s with 2 threads under load,
# ~7 s with 1). Subprocesses inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# the CLI's persistent compilation cache stays off in tests (the tests that check it pass a folder)
os.environ["SPECJAX_COMPILE_CACHE"] = "off"
# The tests run tiny models, where compiling costs far more than running: XLA's CPU backend skips
# LLVM's optimisation passes (machine-code quality only; XLA's own HLO passes still run, and every
# test compares programs compiled alike), and emits fusions with its classic emitters, not the
# newer fusion emitters (which took 2-3x the compile time of a speculative-decoding program here:
# ~3.6 s against ~1.5 s; the tokens are the same). Set before jax is imported; subprocesses and
# xdist workers inherit it.
_FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
_CLASSIC_EMITTERS = "--xla_cpu_use_fusion_emitters=false"


def _xla_accepts(flags: str) -> bool:
    """Whether this jaxlib knows `flags` (XLA aborts the process on an unknown flag): one short
    subprocess, run once per session by the first process that imports this file."""
    import subprocess
    import sys
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    try:
        return subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env, capture_output=True,
                               timeout=120).returncode == 0
    except subprocess.TimeoutExpired:
        return False


if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    _flags = (os.environ.get("XLA_FLAGS", "") + " " + _FAST_COMPILE).strip()
    if _xla_accepts(_flags + " " + _CLASSIC_EMITTERS):
        _flags += " " + _CLASSIC_EMITTERS
    os.environ["XLA_FLAGS"] = _flags

import numpy as np
import pytest

# One persistent compilation cache for the whole run, shared by the xdist workers: a program that a
# module compiled (and `_free_executables` dropped), or that the other worker compiled, loads from
# disk instead of being compiled again (tracing still runs, so the tests that count traces are
# unchanged). The folder is made by the first process that imports this file (the controller under
# xdist; the workers inherit the variable) and removed when that process's session ends.
_SUITE_CACHE_ENV = "SPECJAX_TEST_JAX_CACHE"
if not os.environ.get(_SUITE_CACHE_ENV):
    import tempfile
    os.environ[_SUITE_CACHE_ENV] = tempfile.mkdtemp(prefix="specjax-test-jax-cache-")
    _OWNS_SUITE_CACHE = True
else:
    _OWNS_SUITE_CACHE = False


def _use_suite_cache():
    from specjax.io.compile_cache import enable_compilation_cache
    enable_compilation_cache(os.environ[_SUITE_CACHE_ENV], max_bytes=-1)


def pytest_sessionfinish(session, exitstatus):
    if _OWNS_SUITE_CACHE:
        import shutil
        shutil.rmtree(os.environ[_SUITE_CACHE_ENV], ignore_errors=True)

VOCAB = 160
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
            rms_norm_eps=1e-6, rope_theta=10000.0, bos_token_id=None, eos_token_id=None,
            pad_token_id=None, tie_word_embeddings=False)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}

# name -> (HF architecture, config overrides)
KINDS = {
    "llama": ("llama", {}),
    "llama3rope": ("llama", {"rope_scaling": LLAMA3_ROPE}),
    "llama_tied": ("llama", {"tie_word_embeddings": True}),
    "qwen2": ("qwen2", {"use_sliding_window": False}),
    "qwen3": ("qwen3", {"use_sliding_window": False}),
}


@dataclasses.dataclass
class Tiny:
    name: str
    path: str  # the save_pretrained directory (treat as read-only; copy it to modify)
    hf: object  # the transformers model (float32, eval mode, eager attention)
    jx: object  # the specjax model loaded from `path`

    @property
    def vocab(self) -> int:
        return self.jx.config.vocab_size

    def hf_logits(self, ids) -> np.ndarray:
        """Full-sequence logits [T, V] of the HF model on one unpadded sequence."""
        import torch
        with torch.no_grad():
            out = self.hf(input_ids=torch.tensor([list(map(int, ids))], dtype=torch.long))
        return out.logits[0].float().numpy()

    def hf_last(self, ids) -> np.ndarray:
        return self.hf_logits(ids)[-1]


def _randomise(model, seed: int) -> None:
    import torch
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # all RMSNorms, the q/k norms included
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:  # Linear weights [out, in]
                p.copy_(torch.randn(p.shape, generator=g) / np.sqrt(p.shape[1]))


def build_hf_model(kind: str, path: str, seed: int = 0):
    """Builds a tiny random HF model of `kind`, saves it to `path`, returns the torch model."""
    import torch
    import transformers
    arch, overrides = KINDS[kind]
    cfg_cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
               "qwen3": transformers.Qwen3Config}[arch]
    model_cls = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
                 "qwen3": transformers.Qwen3ForCausalLM}[arch]
    cfg = cfg_cls(**{**TINY, **overrides})
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(cfg).float().eval()
    _randomise(model, seed)
    if cfg.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    model.save_pretrained(path, safe_serialization=True)
    assert os.path.exists(os.path.join(path, "model.safetensors"))
    return model


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Tiny]:
    import torch
    import transformers
    import specjax
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(1)  # tiny models: more threads only spin, and slow everything else down
    root = tmp_path_factory.mktemp("tiny_hf")
    out = {}
    for i, kind in enumerate(KINDS):
        path = str(root / kind)
        hf = build_hf_model(kind, path, seed=100 + i)
        out[kind] = Tiny(kind, path, hf, specjax.load_model(path))
    return out


@pytest.fixture(scope="session")
def llama(tiny_models) -> Tiny:
    return tiny_models["llama"]


@pytest.fixture(scope="session")
def qwen3(tiny_models) -> Tiny:
    return tiny_models["qwen3"]


@pytest.fixture(autouse=True, scope="module")
def _free_executables():
    """Frees each test module's compiled programs when it ends: XLA:CPU maps every executable in
    many pieces, and one worker's programs over the whole suite reached the kernel's map limit
    (vm.max_map_count, 65530: a segfault while compiling). Programs shared within a module stay.
    Each module starts with the run's persistent compilation cache on (a test may have moved it)."""
    _use_suite_cache()
    yield
    import gc

    import jax
    jax.clear_caches()
    gc.collect()
