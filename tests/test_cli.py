"""`python -m specjax generate`: output fields, batches from a JSONL file, agreement with
`specjax.generate`, EOS from the config, and usage errors (exit status 2, one message, no traceback).

Runs the CLI in-process through `main(argv)` (one subprocess smoke test checks `python -m specjax`)
on a tiny random model with a byte-level BPE tokenizer trained here.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from tokenizers import ByteLevelBPETokenizer

import specjax
from specjax.cli import main

N = 8  # one max_new_tokens everywhere, so the tests share compiled programs
EOS = "<|endoftext|>"
CORPUS = ["def add(a, b):\n    return a + b\n", "hello world, hello specjax", "import numpy as np\n",
          "for i in range(10):\n    print(i)\n"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(CORPUS * 10, vocab_size=300, special_tokens=[EOS], show_progress=False)
    cfg = specjax.ModelConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_layers=2,
                              num_heads=4, num_kv_heads=2, head_dim=16, tie_word_embeddings=True,
                              eos_token_id=tok.token_to_id(EOS), max_position_embeddings=96)
    path = str(tmp_path_factory.mktemp("tiny"))
    specjax.save_model(specjax.init_model(cfg, seed=0), path, tokenizer=tok)
    return path


@pytest.fixture(scope="module")
def loaded(model_dir):
    return specjax.load_model(model_dir), specjax.load_tokenizer(model_dir)


def run_json(capsys, *argv) -> list[dict]:
    assert main(["generate", *argv, "--json"]) == 0
    out = capsys.readouterr().out
    return [json.loads(line) for line in out.splitlines()]


def write_jsonl(path, lines) -> str:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return str(path)


def test_json_fields_and_greedy_matches_generate(capsys, model_dir, loaded):
    model, tok = loaded
    [row] = run_json(capsys, "--model", model_dir, "--prompt", "def add(a, b):", "--max-new-tokens", str(N),
                     "--ignore-eos")
    ids = tok.encode("def add(a, b):").ids
    assert row["prompt"] == "def add(a, b):"
    assert row["prompt_ids"] == ids and row["prompt_tokens"] == len(ids)
    ref = specjax.generate(model, [ids], max_new_tokens=N, eos_token_id=()).sequences()[0]
    assert row["tokens"] == ref and len(ref) == N
    assert row["text"] == tok.decode(ref)
    assert row["finish_reason"] == "length" and row["batch_size"] == 1 and row["index"] == 0
    for key in ("ms_per_token", "compile_s", "wall_s"):
        assert isinstance(row[key], float) and row[key] >= 0
    assert row["compile_s"] <= row["wall_s"] + 1e-3


def test_prompt_file_runs_one_batch(capsys, tmp_path, model_dir, loaded):
    model, tok = loaded
    prompts = ["hello", "import numpy as np", "for i in range(10):\n    print(i)"]
    f = write_jsonl(tmp_path / "p.jsonl", [json.dumps({"prompt": p, "id": i}) for i, p in enumerate(prompts)]
                    [:2] + [""] + [json.dumps({"prompt": prompts[2]})])  # a blank line is skipped
    rows = run_json(capsys, "--model", model_dir, "--prompt-file", f, "--max-new-tokens", str(N))
    assert [r["prompt"] for r in rows] == prompts and [r["index"] for r in rows] == [0, 1, 2]
    ids = [tok.encode(p).ids for p in prompts]
    ref = specjax.generate(model, ids, max_new_tokens=N).sequences()  # EOS from the config
    assert [r["tokens"] for r in rows] == ref
    assert all(r["batch_size"] == 3 for r in rows)
    assert len({(r["wall_s"], r["compile_s"]) for r in rows}) == 1  # timing is per batch


def test_sampling_is_deterministic_per_seed(capsys, model_dir, loaded):
    model, tok = loaded
    argv = ["--model", model_dir, "--prompt", "hello world", "--max-new-tokens", str(N), "--ignore-eos",
            "--temperature", "1.5", "--top-k", "50", "--top-p", "0.95", "--seed", "7"]
    a, b = run_json(capsys, *argv), run_json(capsys, *argv, "--warmup")
    assert a[0]["tokens"] == b[0]["tokens"] and b[0]["warmup"] is True
    ref = specjax.generate(model, [tok.encode("hello world").ids], max_new_tokens=N, eos_token_id=(),
                           temperature=1.5, top_k=50, top_p=0.95, seed=7).sequences()[0]
    assert a[0]["tokens"] == ref


def test_eos_defaults_to_config(capsys, tmp_path, model_dir):
    [free] = run_json(capsys, "--model", model_dir, "--prompt", "hello", "--max-new-tokens", str(N), "--ignore-eos")
    # A copy of the model whose config's EOS is the third greedy token: generation stops there.
    eos_dir = tmp_path / "eos"
    shutil.copytree(model_dir, eos_dir)
    cfg = json.loads((eos_dir / "config.json").read_text())
    cfg["eos_token_id"] = free["tokens"][2]
    (eos_dir / "config.json").write_text(json.dumps(cfg))
    [row] = run_json(capsys, "--model", str(eos_dir), "--prompt", "hello", "--max-new-tokens", str(N))
    stop = free["tokens"].index(cfg["eos_token_id"])
    assert row["tokens"] == free["tokens"][: stop + 1] and row["finish_reason"] == "eos"
    [row] = run_json(capsys, "--model", str(eos_dir), "--prompt", "hello", "--max-new-tokens", str(N), "--ignore-eos")
    assert row["tokens"] == free["tokens"] and row["finish_reason"] == "length"


def test_text_output(capsys, tmp_path, model_dir, loaded):
    model, tok = loaded
    assert main(["generate", "--model", model_dir, "--prompt", "hello", "--max-new-tokens", str(N), "--ignore-eos"]) == 0
    out, err = capsys.readouterr()
    ref = specjax.generate(model, [tok.encode("hello").ids], max_new_tokens=N, eos_token_id=()).sequences()[0]
    assert out == tok.decode(ref) + "\n"
    assert "ms/token" in err and "compile" in err
    f = write_jsonl(tmp_path / "p.jsonl", [json.dumps({"prompt": p}) for p in ("a", "b", "c")])
    assert main(["generate", "--model", model_dir, "--prompt-file", f, "--max-new-tokens", str(N)]) == 0
    out = capsys.readouterr().out
    assert "=== [0] ===" in out and "=== [2] ===" in out


BAD_LINES = {
    "bad_json": (['{"prompt": "ok"}', '{"prompt": "unterminated'], "p.jsonl:2: not valid JSON"),
    "not_object": (['{"prompt": "ok"}', '{"prompt": "ok"}', '["prompt"]'], "p.jsonl:3: expected a JSON object"),
    "missing_key": (['{"text": "x"}'], 'p.jsonl:1: missing "prompt" key'),
    "not_string": (['{"prompt": 3}'], 'p.jsonl:1: "prompt" must be a string'),
    "empty_prompt": (['{"prompt": "ok"}', '{"prompt": ""}'], "p.jsonl:2: empty prompt"),
    "no_prompts": ([""], "no prompts in the file"),
    "messages_not_list": (['{"messages": "hi"}'], 'p.jsonl:1: "messages" must be a non-empty list'),
    "message_no_role": (['{"messages": [{"content": "hi"}]}'], 'p.jsonl:1: message 0 must be an object'),
    "prompt_and_messages": (['{"prompt": "a", "messages": []}'], 'give "prompt" or "messages", not both'),
}


def expect_usage_error(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        main(["generate", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "specjax generate: error:" in err and message in err, err
    assert "Traceback" not in err


def test_chat_prompts(capsys, tmp_path, model_dir, loaded):
    """--chat renders each prompt as a user message with the model's chat template; "messages" rows
    are always rendered; a model without a template is a usage error."""
    import shutil
    chat_dir = tmp_path / "chat-model"
    shutil.copytree(model_dir, chat_dir)
    template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}")
    (chat_dir / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "eos_token": EOS}))
    model, tok = loaded
    [row] = run_json(capsys, "--model", str(chat_dir), "--prompt", "hello", "--chat", "--max-new-tokens", str(N))
    assert row["prompt"] == "<user>hello\n<assistant>"
    assert row["prompt_ids"] == tok.encode(row["prompt"]).ids
    f = write_jsonl(tmp_path / "chat.jsonl", [json.dumps({"messages": [{"role": "system", "content": "be brief"},
                                                                      {"role": "user", "content": "hi"}]}),
                                              json.dumps({"prompt": "import numpy"})])
    rows = run_json(capsys, "--model", str(chat_dir), "--prompt-file", f, "--max-new-tokens", str(N))
    assert [r["prompt"] for r in rows] == ["<system>be brief\n<user>hi\n<assistant>", "import numpy"]
    expect_usage_error(capsys, ["--model", model_dir, "--prompt", "hi", "--chat"], "no chat template")


def test_prompt_file_not_utf8(capsys, tmp_path, model_dir):
    f = tmp_path / "p.jsonl"
    f.write_bytes(b'\xef\xbb\xbf{"prompt": "a BOM is fine"}\n{"prompt": "\xff"}\n')
    expect_usage_error(capsys, ["--model", model_dir, "--prompt-file", str(f)], "p.jsonl:2: not valid UTF-8")


@pytest.mark.parametrize("case", sorted(BAD_LINES))
def test_prompt_file_errors(capsys, tmp_path, model_dir, case):
    lines, message = BAD_LINES[case]
    f = write_jsonl(tmp_path / "p.jsonl", lines)
    expect_usage_error(capsys, ["--model", model_dir, "--prompt-file", f], message)


def test_usage_errors(capsys, tmp_path, model_dir):
    missing = str(tmp_path / "nope")
    expect_usage_error(capsys, ["--model", missing, "--prompt", "hi"], f"--model {missing}: no such directory")
    (tmp_path / "empty").mkdir()
    expect_usage_error(capsys, ["--model", str(tmp_path / "empty"), "--prompt", "hi"], "no config.json")
    expect_usage_error(capsys, ["--model", model_dir, "--prompt-file", missing], "no such file")
    expect_usage_error(capsys, ["--model", model_dir, "--prompt", ""], "--prompt: empty prompt")
    # max_position_embeddings is 96: 1 + 96 does not fit, and neither does an explicit --capacity.
    expect_usage_error(capsys, ["--model", model_dir, "--prompt", "a", "--max-new-tokens", "96"],
                       "prompt too long for the cache")
    f = write_jsonl(tmp_path / "p.jsonl", [json.dumps({"prompt": "hello"}), json.dumps({"prompt": "x" * 200})])
    expect_usage_error(capsys, ["--model", model_dir, "--prompt-file", f, "--max-new-tokens", "4"],
                       "p.jsonl:2: prompt too long for the cache")
    expect_usage_error(capsys, ["--model", model_dir, "--prompt", "hello", "--max-new-tokens", "20",
                                "--capacity", "16"], "--capacity 16")
    expect_usage_error(capsys, ["--model", model_dir, "--prompt", "hi", "--top-p", "0"], "--top-p must be in (0, 1]")
    expect_usage_error(capsys, ["--model", model_dir, "--prompt", "hi", "--max-new-tokens", "0"],
                       "--max-new-tokens must be a positive integer")
    expect_usage_error(capsys, ["--model", model_dir], "one of the arguments --prompt --prompt-file is required")


def test_corrupt_model_is_a_usage_error(capsys, tmp_path, model_dir):
    bad = tmp_path / "bad"
    shutil.copytree(model_dir, bad)
    (bad / "model.safetensors").write_bytes(b"not a safetensors file")
    expect_usage_error(capsys, ["--model", str(bad), "--prompt", "hi"], "cannot load the model")


def test_python_dash_m_smoke(model_dir):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-m", "specjax", "generate", "--model", model_dir, "--prompt", "hello",
                           "--max-new-tokens", "4", "--ignore-eos", "--json"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    [row] = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(row["tokens"]) == 4
    proc = subprocess.run([sys.executable, "-m", "specjax", "generate", "--model", "/nonexistent/dir", "--prompt", "x"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2 and "no such directory" in proc.stderr and "Traceback" not in proc.stderr


def test_compilation_cache_second_process_hits(model_dir, tmp_path):
    """A second process with the same configuration loads its programs from the persistent cache
    (JAX's cache-hit events, counted in `cache_hits`) and writes the same tokens; the first wrote
    the folder's entries. `--no-compile-cache` reads none of them."""
    cache = tmp_path / "cache"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    argv = [sys.executable, "-m", "specjax", "generate", "--model", model_dir, "--prompt", "def add(a, b):",
            "--max-new-tokens", "8", "--ignore-eos", "--drafter", "ngram", "--tree", "chain=3", "--json"]

    def run(*extra):
        proc = subprocess.run(argv + list(extra), capture_output=True, text=True, env=env, timeout=240)
        assert proc.returncode == 0, proc.stderr
        [row] = [json.loads(line) for line in proc.stdout.splitlines()]
        return row

    cold = run("--compile-cache", str(cache))
    entries = {p.name for p in cache.iterdir()}
    assert cold["cache_hits"] == 0 and any(e.startswith("jit_") for e in entries)
    warm = run("--compile-cache", str(cache))
    assert warm["cache_hits"] > 0 and warm["tokens"] == cold["tokens"]
    assert len(list((cache / "programs").glob("*.jaxexport"))) == 1  # the loop, traced once, kept
    assert {p.name for p in cache.iterdir()} == entries  # nothing new to write
    off = run("--no-compile-cache")
    assert off["cache_hits"] == 0 and off["tokens"] == cold["tokens"]


def test_traced_program_store_runs_the_loop_without_tracing_it(tmp_path):
    """`enable_compilation_cache(programs=True)` (the CLI's): the generation program is exported once, and a
    process that finds it runs it without tracing the loop, with the same tokens and statistics; another
    tree is another program (its own file). The store is the caller's: off unless asked for."""
    from helpers import tiny_target
    from specjax.drafters import NgramDrafter
    from specjax.engine import loop as engine
    from specjax.io import compile_cache as cc
    target = tiny_target(64)
    prompts, kw = [[1, 2, 3, 1, 2, 3, 1, 2]], dict(max_new_tokens=6, eos_token_id=(), drafters=[NgramDrafter()])
    ref = specjax.generate(target, prompts, tree="chain=3", **kw)
    assert cc._PROGRAMS is None
    try:
        cc.enable_compilation_cache(tmp_path, programs=True)
        first = specjax.generate(target, prompts, tree="chain=3", **kw)
        files = list((tmp_path / "programs").glob("*.jaxexport"))
        assert len(files) == 1
        cc._LOADED.clear()  # as a new process would: read the file back
        before = engine.trace_count()
        again = specjax.generate(target, prompts, tree="chain=3", **kw)
        assert engine.trace_count() == before  # the loop was not traced
        assert first.sequences() == again.sequences() == ref.sequences()
        np.testing.assert_array_equal(again.stats["accepted"], ref.stats["accepted"])
        specjax.generate(target, prompts, tree="chain=2", **kw)
        assert len(list((tmp_path / "programs").glob("*.jaxexport"))) == 2
    finally:
        cc.disable_compilation_cache()
        if os.environ.get("SPECJAX_TEST_JAX_CACHE"):  # the suite's own cache (conftest), as it was
            cc.enable_compilation_cache(os.environ["SPECJAX_TEST_JAX_CACHE"], max_bytes=-1)
    assert cc._PROGRAMS is None


def test_compile_cache_folder_and_env(tmp_path, monkeypatch):
    from specjax.io import compile_cache as cc
    monkeypatch.setenv(cc.ENV, "off")
    assert cc.default_dir() is None and cc.enable_compilation_cache() is None
    monkeypatch.setenv(cc.ENV, str(tmp_path / "c"))
    assert cc.default_dir() == tmp_path / "c"
    monkeypatch.delenv(cc.ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cc.default_dir() == tmp_path / "xdg" / "specjax" / "jax-compile"
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="compilation cache folder"):
        cc.enable_compilation_cache(tmp_path / "file" / "sub")
    with pytest.raises(ValueError, match="min_compile_time_s"):
        cc.enable_compilation_cache(tmp_path / "c", min_compile_time_s=-1)


def test_compile_cache_usage_errors(capsys, model_dir, tmp_path):
    (tmp_path / "file").write_text("x")
    expect_usage_error(capsys, ["--model", model_dir, "--prompt", "hi", "--compile-cache", str(tmp_path / "file" / "c")],
                       "--compile-cache: compilation cache folder")
    with pytest.raises(SystemExit) as e:
        main(["generate", "--model", model_dir, "--prompt", "hi", "--compile-cache", str(tmp_path), "--no-compile-cache"])
    assert e.value.code == 2 and "not allowed with" in capsys.readouterr().err


def test_unusable_default_cache_folder_warns_and_runs(capsys, model_dir, tmp_path, monkeypatch):
    (tmp_path / "file").write_text("x")
    monkeypatch.setenv("SPECJAX_COMPILE_CACHE", str(tmp_path / "file" / "c"))  # the default, not a flag
    assert main(["generate", "--model", model_dir, "--prompt", "hi", "--max-new-tokens", "2"]) == 0
    err = capsys.readouterr().err
    assert "warning: no compilation cache" in err and "Traceback" not in err


def test_speculative_flags(capsys, model_dir, loaded):
    """--drafter (a model directory, and ngram) with --tree: same greedy tokens, plus tau stats."""
    model, tok = loaded
    ids = tok.encode("def add(a, b):").ids
    ref = specjax.generate(model, [ids], max_new_tokens=N, eos_token_id=()).sequences()[0]
    [row] = run_json(capsys, "--model", model_dir, "--prompt", "def add(a, b):", "--max-new-tokens", str(N),
                     "--ignore-eos", "--drafter", model_dir, "--tree", "[[0],[1],[0,0]]")
    assert row["tokens"] == ref
    assert row["tau"] == pytest.approx(3.0)  # the model drafting for itself: every draft accepted
    assert len(row["depth_acceptance"]) == 2 and row["rounds"] >= 1
    [row] = run_json(capsys, "--model", model_dir, "--prompt", "def add(a, b):", "--max-new-tokens", str(N),
                     "--ignore-eos", "--drafter", "ngram", "--tree", "chain=3")
    assert row["tokens"] == ref and row["tau"] >= 1.0
    [row] = run_json(capsys, "--model", model_dir, "--prompt", "def add(a, b):", "--max-new-tokens", str(N),
                     "--ignore-eos", "--drafter", model_dir, "--tree", "[[0],[1],[0,0]]", "--pack")
    assert row["tokens"] == ref and row["tau"] == pytest.approx(3.0)  # packed verification (design §19)


def test_speculative_usage_errors(capsys, model_dir):
    base = ["--model", model_dir, "--prompt", "x"]
    expect_usage_error(capsys, base + ["--drafter", "nowhere"], "no such directory")
    expect_usage_error(capsys, base + ["--drafter", "ngram", "--tree", "[[1]]"], "malformed")
    expect_usage_error(capsys, base + ["--tree", "chain=2"], "need a --drafter")
    expect_usage_error(capsys, base + ["--pack"], "need a --drafter")
    expect_usage_error(capsys, base + ["--drafter", "ngram", "--goodput", "nowhere.json"], "--goodput: packing: cannot read")
    expect_usage_error(capsys, base + ["--drafter", "ngram", "--verify", "sampled", "--temperature", "1"],
                       "deterministic")


# ----------------------------------------------------------------------------- block drafters (DSpark)

@pytest.fixture(scope="module")
def block_dirs(tmp_path_factory, loaded):
    """A tiny random DSpark drafter (its confidence head randomised, so cuts happen) and a DFlash one."""
    import jax
    from flax import nnx

    from specjax.drafters.block import BlockConfig, BlockHead, save_block_head
    model, _ = loaded
    out = {}
    for name, rank, boundary in (("dspark", 8, False), ("dflash", 0, False), ("dpara", 8, True)):
        head = BlockHead(BlockConfig.for_target(model.config, block_size=4, num_layers=1, markov_rank=rank,
                                                boundary=boundary), nnx.Rngs(0))
        if head.confidence_w is not None:
            w = head.confidence_w.get_value()
            head.confidence_w.set_value(0.5 * jax.random.normal(jax.random.key(3), w.shape, w.dtype))
        out[name] = str(tmp_path_factory.mktemp(name))
        save_block_head(head, out[name])
    return out


def test_block_drafter_confidence(capsys, tmp_path, monkeypatch, model_dir, loaded, block_dirs):
    """--confidence off / threshold / schedule with a block drafter: the same greedy tokens (a cut
    only removes proposals), and the verify-width and drafting stats in --json."""
    monkeypatch.chdir(tmp_path)  # no bench/verify_profile_*.json here
    model, tok = loaded
    ids = tok.encode("def add(a, b):").ids
    ref = specjax.generate(model, [ids], max_new_tokens=N, eos_token_id=()).sequences()[0]
    base = ["--model", model_dir, "--prompt", "def add(a, b):", "--max-new-tokens", str(N), "--ignore-eos",
            "--drafter", block_dirs["dspark"], "--tree", "chain=4"]
    [off] = run_json(capsys, *base)
    assert off["tokens"] == ref and off["tau"] >= 1.0
    assert off["mean_verify_width"] == pytest.approx(5.0)  # root + the whole chain, every round
    assert off["drafted"] == 4 * off["rounds"] and off["rounds"] >= 1
    [cut] = run_json(capsys, *base, "--confidence", "0.5")
    assert cut["tokens"] == ref
    assert 1.0 <= cut["mean_verify_width"] <= 5.0 and cut["drafted"] <= 4 * cut["rounds"]

    expect_usage_error(capsys, base + ["--confidence", "schedule"], "python -m tools.profile_widths")
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"tree": "chain=4", "rows": {
        "1": {"widths": [1, 2, 3, 5], "round_s": [1.0, 1.05, 1.1, 1.2]},
        "8": {"widths": [1, 2, 3, 5], "round_s": [2.0, 2.5, 3.0, 4.0]}}}))
    [sched] = run_json(capsys, *base, "--confidence", "schedule", "--verify-profile", str(profile))
    assert sched["tokens"] == ref and 1.0 <= sched["mean_verify_width"] <= 5.0
    # the default profile: bench/verify_profile_<model dir name>.json in the current directory
    (tmp_path / "bench").mkdir()
    shutil.copy(profile, tmp_path / "bench" / f"verify_profile_{os.path.basename(model_dir)}.json")
    [sched2] = run_json(capsys, *base, "--confidence", "schedule")
    assert sched2["tokens"] == sched["tokens"]
    expect_usage_error(capsys, base[:-1] + ["chain=3", "--confidence", "schedule", "--verify-profile",
                                            str(profile)], "rerun python -m tools.profile_widths")


def test_dpara_drafter_and_boundaries(capsys, model_dir, loaded, block_dirs):
    """A DPara drafter from the command line, its chain's first 2 boundaries precomputed: the greedy tokens."""
    model, tok = loaded
    ref = specjax.generate(model, [tok.encode("def add(a, b):").ids], max_new_tokens=N, eos_token_id=()).sequences()[0]
    base = ["--model", model_dir, "--prompt", "def add(a, b):", "--max-new-tokens", str(N), "--ignore-eos",
            "--drafter", block_dirs["dpara"]]
    [out] = run_json(capsys, *base, "--boundaries", "2")
    assert out["tokens"] == ref
    expect_usage_error(capsys, base[:-1] + [block_dirs["dspark"], "--boundaries", "2"], "DPara")
    expect_usage_error(capsys, base + ["--boundaries", "0"], ">= 1")


def test_block_drafter_confidence_usage_errors(capsys, tmp_path, model_dir, block_dirs):
    base = ["--model", model_dir, "--prompt", "x"]
    expect_usage_error(capsys, base + ["--drafter", "ngram", "--confidence", "0.5"], "needs a block drafter")
    expect_usage_error(capsys, base + ["--drafter", model_dir, "--confidence", "0.5"], "needs a block drafter")
    expect_usage_error(capsys, base + ["--drafter", model_dir, "--confidence", "schedule"], "needs a block drafter")
    expect_usage_error(capsys, base + ["--drafter", block_dirs["dflash"], "--confidence", "0.5"], "no confidence head")
    expect_usage_error(capsys, base + ["--drafter", block_dirs["dspark"], "--confidence", "2"], "in (0, 1)")
    expect_usage_error(capsys, base + ["--drafter", block_dirs["dspark"], "--confidence", "high"], "threshold")
    expect_usage_error(capsys, base + ["--confidence", "0.5"], "needs a block --drafter")
    expect_usage_error(capsys, base + ["--drafter", block_dirs["dspark"], "--verify-profile", "p.json"],
                       "only with --confidence schedule")
    expect_usage_error(capsys, base + ["--drafter", block_dirs["dspark"], "--confidence", "schedule",
                                       "--verify-profile", str(tmp_path / "nope.json")], "no such file")
    expect_usage_error(capsys, base + ["--drafter", block_dirs["dspark"], "--confidence", "schedule",
                                       "--tree", "depth=3,topk=2,nodes=6"], "cuts a chain")


def test_mesh_flag(capsys, model_dir, loaded):
    """--mesh data=1,model=1 runs the sharded program on this process's one device (the 8-device
    meshes run in tests/test_sharding.py); a bad mesh is a usage error."""
    model, tok = loaded
    [row] = run_json(capsys, "--model", model_dir, "--prompt", "def add(a, b):", "--max-new-tokens", str(N),
                     "--ignore-eos", "--mesh", "data=1,model=1")
    ids = tok.encode("def add(a, b):").ids
    assert row["tokens"] == specjax.generate(model, [ids], max_new_tokens=N, eos_token_id=()).sequences()[0]
    expect_usage_error(capsys, ["--model", model_dir, "--prompt", "hi", "--mesh", "data=2,tensor=4"],
                       "--mesh: mesh 'data=2,tensor=4': expected axes")
    expect_usage_error(capsys, ["--model", model_dir, "--prompt", "hi", "--mesh", "data=2,model=4"],
                       "--mesh: a mesh of data=2 x model=4 needs 8 devices; 1 are available")


def test_a_bad_value_prints_one_line_and_the_usage_line(capsys, model_dir):
    """A bad value: the error naming it and the one-line usage, not the whole option list."""
    for argv in (["--model", model_dir, "--prompt", "hi", "--top-p", "0"],
                 ["--model", model_dir, "--prompt", "hi", "--weights", "int4"]):
        expect_usage_error(capsys, argv, "")
        with pytest.raises(SystemExit):
            main(["generate", *argv])
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 2 and lines[0].startswith("usage: specjax generate --model DIR"), lines
