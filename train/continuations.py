"""The target's own continuations as drafter training data (self-distillation text): what the drafter
will be asked to predict at inference is the target's output, not the corpus's.

Two kinds of prompt, both cut from the corpus's *train* split (the bench prompts come from the test
split and `train/chat_prompts.jsonl`, so nothing here overlaps them):
- code: `train.prompts.prompt_set` cuts (after a `def` line / at a docstring's quotes), greedy
  continuation;
- chat: one whole train-split function under an instruction (explain it, document it, test it,
  simplify it), rendered with the target's chat template (`specjax.chat`), greedy reply.

The output is one int32 token stream, `<|endoftext|> prompt continuation <|endoftext|> ...` (the
corpus stream's layout), for a drafter config's `extra_train`, plus a JSON summary beside it.

    python -m train.continuations --target models/smollm2-135m-instruct \
        --out runs/smollm2-continuations.npy --code 96 --chat 96 --new-tokens 192
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

INSTRUCTIONS = (
    "Explain what this Python function does, step by step:\n\n```python\n{src}```",
    "Write a docstring for this Python function:\n\n```python\n{src}```",
    "Write pytest unit tests for this function:\n\n```python\n{src}```",
    "Rewrite this Python function to be shorter and clearer:\n\n```python\n{src}```",
)


def chat_prompt_texts(target_dir: str, tok, n: int) -> list[str]:
    from specjax.chat import render_chat
    from train import prompts
    funcs = prompts.whole_function_prompts(tok, n, split="train", max_tokens=320)
    return [render_chat(target_dir, [{"role": "user", "content": INSTRUCTIONS[i % len(INSTRUCTIONS)].format(src=f["text"])}])
            for i, f in enumerate(funcs)]


def build(target_dir: str, out: Path, n_code: int, n_chat: int, new_tokens: int, batch: int, samples: int = 0,
          temperature: float = 1.0, weights: str = "float32") -> dict:
    """The greedy continuation of every prompt, and `samples` more drawn at `temperature` (our own
    batched `generate`, seeds 1..samples); identical documents kept once. `weights`: the target's
    weight dtype (`load_model(weights=...)`): the outputs of the target as it is deployed, though with
    the ordinary attention, not the batch-invariant one (faster batched): a near-tie may break the other
    way, which training data allows. The summary records the seconds taken."""
    import specjax
    from specjax.checkpoint import load_tokenizer
    from train import prompts
    from train.tokenizer import EOT_ID

    model = specjax.load_model(target_dir, weights=weights, invariant=False)
    tok = load_tokenizer(target_dir)
    code = []
    for kind in ("functions", "docstrings"):
        code += [p["ids"] for p in prompts.prompt_set(kind, tok, (n_code + 1) // 2, split="train", context_tokens=192)]
    code = code[:n_code]
    chat = [[EOT_ID] + tok.encode(t).ids for t in chat_prompt_texts(target_dir, tok, n_chat)] if n_chat else []
    docs, generated, seen, dropped = [], {"code": 0, "chat": 0}, set(), 0
    t0 = time.perf_counter()
    jobs = [("code", p) for p in code] + [("chat", p) for p in chat]
    for i in tqdm(range(0, len(jobs), batch), desc="continuations", unit="batch"):
        part = jobs[i:i + batch]
        runs = [specjax.generate(model, [p for _, p in part], max_new_tokens=new_tokens, capacity=1024)]
        runs += [specjax.generate(model, [p for _, p in part], max_new_tokens=new_tokens, capacity=1024,
                                  temperature=temperature, seed=k) for k in range(1, samples + 1)]
        for result in runs:
            for (kind, p), s in zip(part, result.sequences()):
                doc = ([EOT_ID] if p[0] != EOT_ID else []) + list(p) + list(s)
                if tuple(doc) in seen:
                    dropped += 1
                    continue
                seen.add(tuple(doc))
                docs.append(np.asarray(doc, np.int32))
                generated[kind] += len(s)
    stream = np.concatenate(docs)
    out.parent.mkdir(parents=True, exist_ok=True)
    np.save(out, stream)
    summary = {"target": target_dir, "code_prompts": len(code), "chat_prompts": len(chat),
               "generated_tokens": generated, "prompt_tokens": int(sum(len(p) for _, p in jobs)),
               "stream_tokens": int(stream.size), "new_tokens": new_tokens, "greedy": True,
               "samples_per_prompt": samples, "temperature": temperature if samples else None,
               "duplicates_dropped": dropped, "weights": weights,
               "seconds": round(time.perf_counter() - t0, 1)}
    out.with_suffix(".json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--code", type=int, default=96, help="code prompts (train split)")
    ap.add_argument("--chat", type=int, default=96, help="chat prompts (train-split functions under an instruction)")
    ap.add_argument("--new-tokens", type=int, default=192)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--samples", type=int, default=0, help="T=--temperature samples per prompt besides the greedy one")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--weights", default="float32", choices=("float32", "bfloat16", "int8"),
                    help="the target's weight dtype (as deployed; the ordinary attention, not the batch-invariant one)")
    args = ap.parse_args(argv)
    print(json.dumps(build(args.target, args.out, args.code, args.chat, args.new_tokens, args.batch, args.samples,
                           args.temperature, args.weights), indent=2))


if __name__ == "__main__":
    main()
