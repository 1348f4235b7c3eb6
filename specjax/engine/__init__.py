"""The engine: `generate` and its one jitted loop (`loop`), and FOLD's attention diagnostics over a
generation (`fold_diagnostics`).

Layer: the top of the library (below the CLI); imports drafters, models and spec, never the reverse."""
from specjax.engine.loop import GenerationResult, generate, trace_count

__all__ = ["GenerationResult", "generate", "trace_count"]
