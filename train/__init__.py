"""Data and training pipeline for the specjax model zoo (design §9).

    python -m train.corpus --write-manifest | --check     the CPython stdlib corpus and its splits
    python -m train.tokenizer --out models/tokenizer      byte-level BPE, 8192 tokens
    python -m train.lm --config configs/code-target.json --run-dir runs/code-target --export models/code-target
    python -m train.eval_ppl --model models/code-target --split test
"""
