"""llama.cpp's rows of `python -m tools.bench`, in a process of their own (`tools.bench.llama_cpp_peer` runs
`python -m tools.llama_cpp_peer FILE.json`):
reads {"gguf", "prompts", "new_tokens", "repeats", "threads"} from the JSON file given, prints the
rows as one JSON line. Greedy (top_k 1) and prompt lookup (`LlamaPromptLookupDecoding`, 6 tokens),
EOS ignored as in our rows: every prompt gets `new_tokens`."""
import json
import statistics
import sys
import time
from pathlib import Path


def main(path: str) -> None:
    import llama_cpp
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    spec = json.loads(Path(path).read_text())
    prompts, new_tokens = spec["prompts"], spec["new_tokens"]
    ctx = max(map(len, prompts)) + new_tokens + 16
    rows = []
    for name, draft in [("llama.cpp ar", None), ("llama.cpp prompt-lookup", "lookup")]:
        llm = Llama(model_path=spec["gguf"], n_ctx=ctx, n_threads=spec["threads"], n_threads_batch=spec["threads"],
                    verbose=False, draft_model=LlamaPromptLookupDecoding(num_pred_tokens=6) if draft else None)

        def run(prompts=prompts, llm=llm):
            for p in prompts:
                for i, _ in enumerate(llm.generate(list(p), top_k=1, top_p=1.0, temp=0.0, reset=True)):
                    if i + 1 == new_tokens:
                        break
            return new_tokens * len(prompts)
        run(prompts[:1])  # warm-up
        times = []
        for _ in range(spec["repeats"]):
            t0 = time.perf_counter()
            n = run()
            times.append(time.perf_counter() - t0)
        quant = Path(spec["gguf"]).stem.rsplit(".", 1)[-1]
        rows.append({"method": f"{name} ({quant} weights)", "tokens_per_s": n / statistics.median(times), "tokens": n,
                     "seconds": statistics.median(times), "llama_cpp_version": llama_cpp.__version__})
        del llm
    print(json.dumps(rows))


if __name__ == "__main__":
    main(sys.argv[1])
