"""Target models. `transformer`: Llama / Qwen2 / Qwen3 dense decoders."""
