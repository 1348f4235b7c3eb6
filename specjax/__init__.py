"""specjax: speculative decoding of language models in JAX."""
from specjax.io.checkpoint import load_model, load_tokenizer, save_model
from specjax.io.compile_cache import disable_compilation_cache, enable_compilation_cache
from specjax.engine import GenerationResult, generate
from specjax.models.config import HybridConfig, ModelConfig
from specjax.models.hybrid import HybridModel
from specjax.models.transformer import Model, init_model

__all__ = ["GenerationResult", "HybridConfig", "HybridModel", "Model", "ModelConfig", "disable_compilation_cache",
           "enable_compilation_cache", "generate", "init_model", "load_model", "load_tokenizer", "save_model"]
