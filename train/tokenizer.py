"""Byte-level BPE tokenizer for the stdlib corpus, trained with `tokenizers`.

Byte level (GPT-2 style): every byte string has an encoding, so `decode(encode(text)) == text`
for any text; no normalizer, no prefix space, no offset trimming, no added BOS/EOS on encode.
Special tokens come first and so have fixed ids:

    0 <|endoftext|>   document separator (also starts every document in the training stream)
    1 <|pad|>         padding
    2 <|mask|>        mask slot (block drafters)

    python -m train.tokenizer --out models/tokenizer [--vocab-size 8192]
"""
from __future__ import annotations

import argparse
import time
from collections.abc import Iterable
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from train import corpus

SPECIAL_TOKENS = ("<|endoftext|>", "<|pad|>", "<|mask|>")
EOT_ID, PAD_ID, MASK_ID = 0, 1, 2
VOCAB_SIZE = 8192


def train_tokenizer(texts: Iterable[str], vocab_size: int = VOCAB_SIZE, length: int | None = None) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    # Offsets only; trim_offsets=False keeps them pointing at the exact bytes, spaces included.
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes, seen or not
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer, length=length)
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, f"special token {t} got id {tok.token_to_id(t)}, expected {i}"
    return tok


def decode(tok: Tokenizer, ids) -> str:
    # Keep special tokens: the text must come back exactly, whatever it contains.
    return tok.decode(list(ids), skip_special_tokens=False)


def roundtrip_failures(tok: Tokenizer, texts: Iterable[tuple[str, str]]) -> list[str]:
    """Names of the (name, text) pairs that do not come back byte for byte."""
    items = list(texts)
    encodings = tok.encode_batch([t for _, t in items])
    return [name for (name, text), enc in zip(items, encodings) if decode(tok, enc.ids).encode() != text.encode()]


def train_on_corpus(vocab_size: int = VOCAB_SIZE, manifest=None, root=None, max_files=None) -> Tokenizer:
    manifest = corpus.check(manifest, root)
    files = manifest.split("train")[:max_files]
    return train_tokenizer(corpus.iter_texts("train", manifest, root, max_files), vocab_size, length=len(files))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="directory for tokenizer.json")
    ap.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    ap.add_argument("--overwrite", action="store_true")
    args = ap.parse_args(argv)
    out = args.out / "tokenizer.json"
    if out.exists() and not args.overwrite:
        raise SystemExit(f"error: {out} exists; models trained with it would no longer match. Pass --overwrite to replace it.")
    manifest = corpus.check()
    t0 = time.perf_counter()
    tok = train_on_corpus(args.vocab_size, manifest)
    t_train = time.perf_counter() - t0
    root = corpus.stdlib_root()
    test = [(f.path, corpus.read_text(root, f)) for f in manifest.split("test")]
    failures = roundtrip_failures(tok, test)
    if failures:
        raise SystemExit(f"error: {len(failures)} test-split files do not round-trip: {failures[:5]}")
    args.out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out))
    n_tokens = sum(len(e.ids) for e in tok.encode_batch([t for _, t in test]))
    n_bytes = sum(len(t.encode()) for _, t in test)
    print(f"wrote {out}: vocab {tok.get_vocab_size()}, trained in {t_train:.1f} s on "
          f"{len(manifest.split('train'))} files; test split round-trips ({len(test)} files), "
          f"{n_bytes / n_tokens:.2f} bytes/token")


if __name__ == "__main__":
    main()
