"""The target's own continuations as drafter training data (self-distillation text): what the drafter
will be asked to predict at inference is the target's output, not the corpus's.

Two kinds of prompt, both cut from the corpus's *train* split (the bench prompts come from the test
split and `bench/prompts/chat.jsonl`, so nothing here overlaps them):
- code: `train.prompts.prompt_set` cuts (after a `def` line / at a docstring's quotes), greedy
  continuation;
- chat: one whole train-split function under an instruction (explain it, document it, test it,
  simplify it), rendered with the target's chat template (`specjax.io.chat`), greedy reply;
- questions (`--questions N`): user turns the target writes itself (Magpie, Xu et al. 2024): the
  chat template's text up to a user message's content, sampled at T=1 until the end of the turn
  (a turn cut by the token limit, or empty, is dropped; duplicates kept once), then answered
  greedily as a chat prompt. The chats the target was tuned on, as it remembers them: general
  questions, like the bench's chat prompts, where the two kinds above are all about code.

The output is one int32 token stream, `<|endoftext|> prompt continuation <|endoftext|> ...` (the
corpus stream's layout), for a drafter config's `extra_train`, plus a JSON summary beside it.

    python -m train.continuations --target models/smollm2-135m-instruct \
        --out runs/smollm2-continuations.npy --code 96 --chat 96 --new-tokens 192

A second stream of new code prompts (`--skip-code 96`: none of the 96 above) joins the first in a
cache's `--extra a.npy,b.npy`.
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


def code_prompts(tok, n: int, skip: int = 0, **where) -> list[list[int]]:
    """`n` train-split code prompts: half cut after a `def` line, half at a docstring's quotes
    (`train.prompts.prompt_set`, deterministic: a longer set starts with a shorter one), none of those
    a run with `--code skip` took, so a later run adds new prompts instead of regenerating the greedy
    continuations it already has. `where`: prompt_set's manifest / root."""
    from train import prompts
    if n < 0 or skip < 0:
        raise ValueError(f"code prompts: n and skip must be >= 0, got n={n}, skip={skip}")
    half_n, half_skip = (n + 1) // 2, (skip + 1) // 2
    kinds = [[p["ids"] for p in prompts.prompt_set(kind, tok, half_skip + half_n, split="train", context_tokens=192, **where)]
             for kind in ("functions", "docstrings")]
    used = {tuple(p) for p in (kinds[0][:half_skip] + kinds[1][:half_skip])[:skip]}  # what `--code skip` took
    return [p for ids in kinds for p in [q for q in ids if tuple(q) not in used][:half_n]][:n]


def chat_prompt_texts(target_dir: str, tok, n: int) -> list[str]:
    from specjax.io.chat import render_chat
    from train import prompts
    funcs = prompts.whole_function_prompts(tok, n, split="train", max_tokens=320)
    return [render_chat(target_dir, [{"role": "user", "content": INSTRUCTIONS[i % len(INSTRUCTIONS)].format(src=f["text"])}])
            for i, f in enumerate(funcs)]


MARK = "\u2063specjax-user-turn\u2063"  # a placeholder no template or tokenizer touches


def user_turn_prefix(target_dir: str) -> tuple[str, str]:
    """(the chat template's text before a user message's content, the text right after it): what
    Magpie feeds the model to have it write a user turn, and where that turn ends."""
    from specjax.io.chat import render_chat
    text = render_chat(target_dir, [{"role": "user", "content": MARK}], add_generation_prompt=False)
    if text.count(MARK) != 1:
        raise ValueError(f"{target_dir}: the chat template does not render a user message's content once")
    before, after = text.split(MARK)
    if not after:
        raise ValueError(f"{target_dir}: the chat template closes a user turn with nothing: no end to sample to")
    return before, after


def cut_turn(ids, end_id: int, min_tokens: int = 3) -> list[int] | None:
    """A sampled user turn's ids up to (without) `end_id`, or None where it never ended (cut by the
    token limit) or is shorter than `min_tokens`."""
    ids = list(ids)
    if end_id not in ids:
        return None
    ids = ids[:ids.index(end_id)]
    return ids if len(ids) >= min_tokens else None


def sample_questions(model, tok, target_dir: str, n: int, batch: int, max_tokens: int = 96,
                     temperature: float = 1.0, first_seed: int = 1) -> tuple[list[str], int]:
    """Up to `n` distinct user questions the target writes itself (Magpie), and how many it sampled:
    batches of the user-turn prefix at `temperature` (seeds first_seed, first_seed + 1, ...) until `n`
    are kept or 4n drawn. A question is at most `max_tokens` long and short enough that, asked in the
    chat template, it fits the model's context (`max_position_embeddings`)."""
    if first_seed < 1:
        raise ValueError(f"questions: the first seed must be >= 1, got {first_seed}")
    import specjax
    from train.tokenizer import EOT_ID
    before, after = user_turn_prefix(target_dir)
    prefix = [EOT_ID] + tok.encode(before).ids
    end_id = tok.encode(after).ids[0]  # the token that closes the turn (e.g. <|im_end|>)
    from specjax.io.chat import render_chat
    overhead = 3 + len(tok.encode(render_chat(target_dir, [{"role": "user", "content": ""}])).ids)
    max_tokens = min(max_tokens, model.config.max_position_embeddings - overhead)
    if max_tokens < 4:
        raise ValueError(f"questions: the model's context ({model.config.max_position_embeddings}) leaves no room "
                         f"for a question in its chat template ({overhead} tokens)")
    kept, seen, drawn, seed = [], set(), 0, first_seed - 1
    while len(kept) < n and drawn < 4 * n:
        seed += 1
        result = specjax.generate(model, [prefix] * batch, max_new_tokens=max_tokens, capacity=max(256, len(prefix) + max_tokens),
                                  temperature=temperature, seed=seed, eos_token_id=(end_id,))
        drawn += batch
        for s in result.sequences():
            ids = cut_turn(s, end_id)
            text = tok.decode(ids).strip() if ids is not None else ""
            if text and text not in seen:
                seen.add(text)
                kept.append(text)
    return kept[:n], drawn


def build(target_dir: str, out: Path, n_code: int, n_chat: int, new_tokens: int, batch: int, samples: int = 0,
          temperature: float = 1.0, weights: str = "float32", n_questions: int = 0, skip_code: int = 0,
          question_seed: int = 1) -> dict:
    """The greedy continuation of every prompt, and `samples` more drawn at `temperature` (our own
    batched `generate`, seeds 1..samples); identical documents kept once. `weights`: the target's
    weight dtype (`load_model(weights=...)`): the outputs of the target as it is deployed, though with
    the ordinary attention, not the batch-invariant one (faster batched): a near-tie may break the other
    way, which training data allows. The summary records the seconds taken."""
    import specjax
    from specjax.io.checkpoint import load_tokenizer
    from train.tokenizer import EOT_ID

    model = specjax.load_model(target_dir, weights=weights, invariant=False)
    tok = load_tokenizer(target_dir)
    code = code_prompts(tok, n_code, skip_code)
    chat = [[EOT_ID] + tok.encode(t).ids for t in chat_prompt_texts(target_dir, tok, n_chat)] if n_chat else []
    t0 = time.perf_counter()
    questions, drawn = (sample_questions(model, tok, target_dir, n_questions, batch, first_seed=question_seed)
                        if n_questions else ([], 0))
    from specjax.io.chat import render_chat
    asked = [[EOT_ID] + tok.encode(render_chat(target_dir, [{"role": "user", "content": q}])).ids for q in questions]
    docs, generated, seen, dropped = [], {"code": 0, "chat": 0, "questions": 0}, set(), 0
    jobs = [("code", p) for p in code] + [("chat", p) for p in chat] + [("questions", p) for p in asked]
    context = model.config.max_position_embeddings
    too_long = sum(len(p) > context for _, p in jobs)  # the engine refuses them; counted, not generated
    jobs = [(kind, p) for kind, p in jobs if len(p) <= context]
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
    summary = {"target": target_dir, "code_prompts": len(code), "code_skipped": skip_code, "chat_prompts": len(chat),
               "questions": {"requested": n_questions, "asked": len(questions), "sampled": drawn,
                             "first_seed": question_seed, "first": questions[:8]},
               "generated_tokens": generated, "prompt_tokens": int(sum(len(p) for _, p in jobs)),
               "stream_tokens": int(stream.size), "new_tokens": new_tokens, "greedy": True,
               "samples_per_prompt": samples, "temperature": temperature if samples else None,
               "duplicates_dropped": dropped, "prompts_longer_than_context": too_long, "weights": weights,
               "seconds": round(time.perf_counter() - t0, 1)}
    out.with_suffix(".json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--code", type=int, default=96, help="code prompts (train split)")
    ap.add_argument("--skip-code", type=int, default=0, metavar="K",
                    help="leave out the code prompts a run with --code K took (new prompts for a second stream)")
    ap.add_argument("--chat", type=int, default=96, help="chat prompts (train-split functions under an instruction)")
    ap.add_argument("--questions", type=int, default=0,
                    help="chat prompts whose user turn the target writes itself (Magpie), answered greedily")
    ap.add_argument("--question-seed", type=int, default=1, metavar="S",
                    help="the questions' first sampling seed (seeds S, S+1, ...): a second stream of new questions "
                         "starts past the seeds the first one drew (its summary's `sampled` / --batch)")
    ap.add_argument("--new-tokens", type=int, default=192)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--samples", type=int, default=0, help="T=--temperature samples per prompt besides the greedy one")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--weights", default="float32", choices=("float32", "bfloat16", "int8"),
                    help="the target's weight dtype (as deployed; the ordinary attention, not the batch-invariant one)")
    args = ap.parse_args(argv)
    print(json.dumps(build(args.target, args.out, args.code, args.chat, args.new_tokens, args.batch, args.samples,
                           args.temperature, args.weights, args.questions, args.skip_code, args.question_seed),
                     indent=2))


if __name__ == "__main__":
    main()
