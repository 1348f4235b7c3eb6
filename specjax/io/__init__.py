"""Reading and writing: Hugging Face checkpoints (`checkpoint`), GGUF files (`gguf`), chat templates
(`chat`) and JAX's persistent compilation cache (`compile_cache`).

Layer: above `specjax.models` (a checkpoint builds a model), below the drafters."""
