"""The LM training script on a tiny model and a tiny corpus: learning, exact resume, refusals,
and an export that specjax and transformers load to the same logits."""
import dataclasses
import itertools
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tokenizers import Tokenizer

from specjax.io.checkpoint import load_model, load_tokenizer, weights_sha256
from specjax.models.transformer import init_cache, prefill
from train import corpus, data, eval_ppl, lm
from helpers import stdlib_sample
from train.tokenizer import EOT_ID

FULL_STEPS = 30  # 20 at seq 16, then 10 at seq 32 in micro-batches of 2


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    """A fake stdlib of real stdlib files (any Python version), its manifest, a 300-token tokenizer."""
    base = tmp_path_factory.mktemp("zoo")
    root, manifest, _ = stdlib_sample(base, {"train": 24, "validation": 3, "test": 2})
    cfg = lm.config_from_dict({
        "name": "tiny",
        "model": {"model_type": "llama", "vocab_size": 300, "hidden_size": 32, "intermediate_size": 64,
                  "num_layers": 2, "num_heads": 2, "num_kv_heads": 1, "head_dim": 16,
                  "tie_word_embeddings": True, "max_position_embeddings": 64},
        "tokenizer": str(base / "tokenizer.json"),
        "phases": [{"seq_len": 16, "steps": 20}, {"seq_len": 32, "steps": 10, "micro_batch_size": 2}],
        "batch_size": 4, "learning_rate": 1e-2, "warmup_steps": 3,
        "checkpoint_every": 5, "keep_checkpoints": 2, "eval_every": 10, "eval_seq_len": 16, "eval_tokens": 512,
        "corpus": {"manifest": str(manifest), "root": str(root)},
    })
    return {"base": base, "root": root, "manifest": manifest, "cfg": cfg}


@pytest.fixture(scope="module")
def full_run(zoo):
    """The tiny config trained straight through, exported."""
    run_dir, export_dir = zoo["base"] / "run-full", zoo["base"] / "export"
    state = lm.train(zoo["cfg"], run_dir, export_dir, progress=False)
    return {"state": state, "run_dir": run_dir, "export": export_dir}


def params_of(state):
    return jax.tree.leaves(state["params"])


def test_config_files_parse():
    # Token budgets (what a few hours of this 2-core CPU allow; the model cards give the history):
    # code-draft 7.9M; code-target 7.4M at 512 then 0.66M at 2048 (long prompts); the hybrid the
    # first 400 steps of the target's 512-token phase (3.3M, the same batches), compared with
    # code-target's checkpoint at step 400.
    budgets = {"code-target": 8_000_000, "code-draft": 7_800_000, "code-target-hybrid": 3_200_000}
    for name, tokens in budgets.items():
        cfg = lm.load_config(lm.REPO / "configs" / f"{name}.json")
        assert cfg.model.vocab_size == 8192 and cfg.batch_size == 16 and cfg.model.tie_word_embeddings
        assert cfg.phases[0].seq_len == 512 and lm.tokens_through(cfg, cfg.total_steps) >= tokens
        assert (cfg.phases[-1].seq_len == 2048) == (name != "code-target-hybrid")
        assert lm.config_from_dict(lm.config_to_dict(cfg)) == cfg
    target, hybrid = (lm.load_config(lm.REPO / "configs" / f"{n}.json") for n in ("code-target", "code-target-hybrid"))
    assert hybrid.phases[0].seq_len == target.phases[0].seq_len and hybrid.seed == target.seed
    from train import feature
    for name in ("code-target-feature", "code-target-hybrid-feature"):
        fcfg = feature.load_config(lm.REPO / "configs" / f"{name}.json")
        assert fcfg.seq_len <= 512  # short-context drafters: FOLD's ablation relies on it
    from train import block
    for name in ("code-target-dspark", "code-target-hybrid-dspark"):  # at least the feature drafters' budget
        bcfg = block.load_config(lm.REPO / "configs" / f"{name}.json")
        assert bcfg.steps * bcfg.batch_size * bcfg.seq_len >= 1_228_800


def test_data_order_is_a_function_of_seed_and_step(zoo):
    stream = np.arange(1000, dtype=np.int32)
    a = data.batch_at(stream, 16, 4, seed=0, phase=0, step_in_phase=7)
    assert a.shape == (4, 17) and (np.diff(a, axis=1) == 1).all()  # contiguous windows
    assert (a == data.batch_at(stream, 16, 4, seed=0, phase=0, step_in_phase=7)).all()
    assert not (a == data.batch_at(stream, 16, 4, seed=1, phase=0, step_in_phase=7)).all()
    # One epoch visits every window once.
    n = data.num_windows(len(stream), 16)
    starts = np.concatenate([data.batch_at(stream, 16, 1, 0, 0, s)[:, 0] for s in range(n)])
    assert sorted(starts) == list(range(0, n * 16, 16))


def test_loss_decreases(zoo, full_run):
    cfg = zoo["cfg"]
    records = [json.loads(line) for line in (full_run["run_dir"] / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [10, 20, 30]
    # Initial loss: about ln(300), the uniform distribution's.
    val = data.eval_windows(data.token_stream(Tokenizer.from_file(cfg.tokenizer), "validation",
                                              corpus.read_manifest(zoo["manifest"]), zoo["root"]),
                            cfg.eval_seq_len, cfg.eval_tokens)
    initial = lm.evaluate(cfg, lm.init_state(cfg)["params"], val)
    assert abs(initial - np.log(300)) < 0.1
    losses = [initial] + [r["val_loss"] for r in records]
    assert all(b < a for a, b in itertools.pairwise(losses))
    assert losses[-1] < initial - 1.0
    assert records[-1]["val_ppl"] == pytest.approx(np.exp(records[-1]["val_loss"]))


def test_resume_gives_the_same_params(zoo, full_run, tmp_path):
    cfg, run_dir = zoo["cfg"], tmp_path / "run"
    lm.train(cfg, run_dir, max_steps=12, progress=False)  # stops mid phase 1
    assert sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()) == [10, 12]
    state = lm.train(cfg, run_dir, progress=False)  # resumes through the phase change to the end
    assert int(state["step"]) == FULL_STEPS
    for a, b in zip(params_of(state), params_of(full_run["state"]), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_refuses_a_run_dir_of_another_config(zoo, tmp_path):
    cfg, run_dir = zoo["cfg"], tmp_path / "run"
    lm.train(cfg, run_dir, max_steps=1, progress=False)
    other = dataclasses.replace(cfg, learning_rate=3e-3)
    with pytest.raises(lm.RunRefused, match=r"learning_rate: run dir has 0.01, now 0.003"):
        lm.train(other, run_dir, progress=False)
    wider = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, intermediate_size=96))
    with pytest.raises(lm.RunRefused, match=r"model.intermediate_size"):
        lm.train(wider, run_dir, progress=False)
    with pytest.raises(lm.RunRefused, match=r"trained with batch_size 4, the config now says 8"):
        lm.train(dataclasses.replace(cfg, batch_size=8), run_dir, progress=False)
    # Observation-only fields may change on resume.
    state = lm.train(dataclasses.replace(cfg, eval_every=3, checkpoint_every=1), run_dir, max_steps=2, progress=False)
    assert int(state["step"]) == 2


def test_overwrite_guard(zoo, full_run, tmp_path):
    cfg = zoo["cfg"]
    with pytest.raises(lm.RunRefused, match="model.safetensors"):
        lm.train(cfg, tmp_path / "new-run", full_run["export"], progress=False)
    # A finished run dir resumes as a no-op, but a fresh start needs --overwrite ...
    copy = tmp_path / "copy"
    shutil.copytree(full_run["run_dir"], copy)
    assert int(lm.train(cfg, copy, max_steps=2, progress=False)["step"]) == FULL_STEPS
    # ... and discards the old checkpoints.
    state = lm.train(cfg, copy, max_steps=2, overwrite=True, progress=False)
    assert int(state["step"]) == 2
    assert str(FULL_STEPS) not in {p.name for p in (copy / "checkpoints").iterdir()}


def test_refuses_a_changed_corpus(zoo, tmp_path):
    root = tmp_path / "lib"
    shutil.copytree(zoo["root"], root)
    victim = next(root.glob("*.py"))
    victim.write_text(victim.read_text() + "\n# edited\n")
    cfg = dataclasses.replace(zoo["cfg"], corpus=lm.CorpusConfig(manifest=str(zoo["manifest"]), root=str(root)))
    with pytest.raises(corpus.CorpusMismatch, match=victim.name):
        lm.train(cfg, tmp_path / "run", progress=False)


def test_export_loads_in_specjax_and_transformers(zoo, full_run):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    export = full_run["export"]
    assert {"config.json", "model.safetensors", "tokenizer.json", "train_info.json"} <= {p.name for p in export.iterdir()}
    hf_cfg = json.loads((export / "config.json").read_text())
    assert hf_cfg["torch_dtype"] == "bfloat16" and hf_cfg["eos_token_id"] == EOT_ID

    model = load_model(str(export))
    # The export is the trained float32 weights rounded to bf16.
    trained = full_run["state"]["params"]
    for a, b in zip(jax.tree.leaves(nnx.state(model, nnx.Param)), jax.tree.leaves(trained), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(jnp.asarray(b).astype(jnp.bfloat16).astype(jnp.float32)))

    tokens = np.asarray(data.batch_at(np.arange(3, 300, dtype=np.int32), 20, 2, 0, 0, 0))
    out = prefill(model, jnp.asarray(tokens), jnp.full((2,), tokens.shape[1], jnp.int32),
                  init_cache(model, 2, tokens.shape[1]))
    hf = transformers.LlamaForCausalLM.from_pretrained(str(export), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.from_numpy(tokens).long()).logits.numpy()
    np.testing.assert_allclose(np.asarray(out.logits), ref, atol=1e-4, rtol=1e-4)


def test_eval_ppl(zoo, full_run):
    r = eval_ppl.evaluate_model(full_run["export"], split="validation", seq_len=16, manifest_path=zoo["manifest"],
                                root=zoo["root"], cache_dir=None, progress=False)
    assert r["tokens"] == r["windows"] * 16 > 0
    assert np.isfinite(r["loss"]) and r["ppl"] == pytest.approx(np.exp(r["loss"]))
    assert 1 < r["unigram_ppl"] < 300
    info = json.loads((full_run["export"] / "train_info.json").read_text())
    assert info["steps"] == FULL_STEPS


def test_model_card(zoo, full_run):
    from train import model_card
    card, record = model_card.lm_card(full_run["export"], manifest_path=zoo["manifest"], root=zoo["root"],
                                      cache_dir=None, progress=False)
    assert record["steps"] == FULL_STEPS and not record["interim"] and record["tokens_trained"] == 20 * 4 * 16 + 10 * 4 * 32
    assert f"{record['test']['ppl']:.2f}" in card and "python -m train.lm --config configs/tiny.json" in card
    assert "Interim" not in card
    # --compare: another export's measured test row next to this one's (same test tokens only)
    other = full_run["export"].parent / "other-export"
    other.mkdir(exist_ok=True)
    (other / "eval.json").write_text(json.dumps({**record, "name": "other", "params": 1_000_000,
                                                 "test": {**record["test"], "ppl": 99.5}}))
    card, _ = model_card.lm_card(full_run["export"], manifest_path=zoo["manifest"], root=zoo["root"], cache_dir=None,
                                 progress=False, reuse_test=record["test"], compare=(other,))
    assert "| `other` | 1.00M |" in card and "99.50 |" in card and "--compare" in card
    (other / "eval.json").write_text(json.dumps({**record, "test": {**record["test"], "tokens": 7}}))
    with pytest.raises(ValueError, match="other test tokens"):
        model_card.lm_card(full_run["export"], manifest_path=zoo["manifest"], root=zoo["root"], cache_dir=None,
                           progress=False, reuse_test=record["test"], compare=(other,))


def test_cli(zoo, full_run, tmp_path, capsys):
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(lm.config_to_dict(zoo["cfg"])))
    run_dir = tmp_path / "run"
    lm.main(["--config", str(config), "--run-dir", str(run_dir), "--max-steps", "1"])
    assert "stopped at step 1 of 30" in capsys.readouterr().out
    # an interim export of the unfinished run, marked as such; the run resumes untouched
    lm.main(["--config", str(config), "--run-dir", str(run_dir), "--export", str(tmp_path / "interim"), "--export-latest"])
    info = json.loads((tmp_path / "interim" / "train_info.json").read_text())
    assert info["interim"] and info["steps"] == 1 and info["tokens_trained"] == 4 * 16
    assert load_model(str(tmp_path / "interim")).config.vocab_size == 300
    with pytest.raises(SystemExit, match="error: .*--overwrite"):
        lm.main(["--config", str(config), "--run-dir", str(run_dir), "--export", str(tmp_path / "interim"), "--export-latest"])
    changed = {**lm.config_to_dict(zoo["cfg"]), "batch_size": 2}
    config.write_text(json.dumps(changed))
    with pytest.raises(SystemExit, match="error: .* trained with batch_size 4"):
        lm.main(["--config", str(config), "--run-dir", str(run_dir)])
    with pytest.raises(SystemExit, match="error: .*model.safetensors"):
        lm.main(["--config", str(config), "--run-dir", str(tmp_path / "other"), "--export", str(full_run["export"])])


# ----------------------------------------------------------------------------- feature drafter

def _feature_cfg(zoo, full_run, **kw):
    from train import feature
    base = dict(name="tiny-feature", target=str(full_run["export"]), ttt_steps=3, seq_len=32, batch_size=4,
                steps=12, learning_rate=3e-3, warmup_steps=2, checkpoint_every=4, eval_every=6, eval_tokens=256,
                manifest=str(zoo["manifest"]), corpus_root=str(zoo["root"]))
    base.update(kw)
    return feature.FeatureTrainConfig(**base)


def test_two_sessions_of_one_process_in_one_second_keep_their_own_timing_lines(tmp_path):
    """A stop and its resume in one process, within a second, are two sessions (two lines)."""
    from train import drafter_run
    a, b = drafter_run.session_key(), drafter_run.session_key()
    assert a != b
    drafter_run.record_session(tmp_path, 0, 5, 1.0, 1.0, a)
    drafter_run.record_session(tmp_path, 5, 9, 1.0, 1.0, b)
    drafter_run.record_session(tmp_path, 5, 12, 2.0, 2.0, b)  # b's next checkpoint replaces its line
    assert [t["steps"] for t in drafter_run.session_timing(tmp_path)["sessions"]] == [[0, 5], [5, 12]]


def test_feature_drafter_trains_resumes_and_drafts_losslessly(zoo, full_run):
    import specjax
    from specjax.drafters import FeatureDrafter, load_drafter
    from train import feature

    cfg = _feature_cfg(zoo, full_run)
    straight = feature.train(cfg, zoo["base"] / "feat-straight", zoo["base"] / "feat-export", progress=False)
    metrics = [json.loads(l) for l in (zoo["base"] / "feat-straight" / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2 and metrics[-1]["val_loss"] < metrics[0]["val_loss"] + 0.5
    assert len(metrics[-1]["val_agree"]) == 3
    # stopped at 5 and resumed: the same parameters as straight through
    feature.train(cfg, zoo["base"] / "feat-resume", max_steps=5, progress=False)
    resumed = feature.train(cfg, zoo["base"] / "feat-resume", progress=False)
    for a, b in zip(jax.tree.leaves(straight["params"]), jax.tree.leaves(resumed["params"])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    # a session per stretch of steps; the finished run run again (a re-export) adds none
    timing = zoo["base"] / "feat-resume" / "timing.jsonl"
    assert [json.loads(l)["steps"] for l in timing.read_text().splitlines()] == [[0, 5], [5, cfg.steps]]
    feature.train(cfg, zoo["base"] / "feat-resume", progress=False)
    assert len(timing.read_text().splitlines()) == 2
    # refusals: another config in the same run dir; overwriting an export
    with pytest.raises(lm.RunRefused, match="different run"):
        feature.train(_feature_cfg(zoo, full_run, ttt_steps=2), zoo["base"] / "feat-resume", progress=False)
    with pytest.raises(lm.RunRefused, match="overwrite"):
        feature.train(cfg, zoo["base"] / "feat-other", zoo["base"] / "feat-export", progress=False)
    # the export drafts for its target, losslessly
    target = load_model(str(full_run["export"]))
    drafter = load_drafter(str(zoo["base"] / "feat-export"), target, target_path=str(full_run["export"]))
    assert isinstance(drafter, FeatureDrafter)
    # the same target shapes with other weights (a retrained target, a sibling model): refused
    other = zoo["base"] / "other-target"
    shutil.copytree(full_run["export"], other, dirs_exist_ok=True)
    weights = next(other.glob("*.safetensors"))
    raw = bytearray(weights.read_bytes())
    raw[-1] ^= 1  # the last byte is tensor data: still a valid file, one weight changed
    weights.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="trained on target weights"):
        load_drafter(str(zoo["base"] / "feat-export"), load_model(str(other)), target_path=str(other))
    info = json.loads((zoo["base"] / "feat-export" / "train_info.json").read_text())
    (zoo["base"] / "feat-config.json").write_text(json.dumps(info["run"]["config"]))
    assert feature.load_config(zoo["base"] / "feat-config.json") == cfg  # the whole config, card and zoo read it
    assert info["tokens_trained"] == cfg.steps * cfg.batch_size * cfg.seq_len
    from train import model_card
    card, _ = model_card.feature_card(zoo["base"] / "feat-export")
    assert f"configs/{cfg.name}.json" in card
    # continued from the export (`init_from`): step 0 holds its weights; its digest joins the identity
    from safetensors.numpy import load_file
    cont = _feature_cfg(zoo, full_run, init_from=str(zoo["base"] / "feat-export"))
    start = feature.train(cont, zoo["base"] / "feat-cont", max_steps=0, progress=False)
    stored = load_file(str(zoo["base"] / "feat-export" / "model.safetensors"))
    for key, value in nnx.to_flat_state(start["params"]):
        np.testing.assert_array_equal(np.asarray(value.get_value()), stored[".".join(map(str, key))].astype(np.float32))
    ident = json.loads((zoo["base"] / "feat-cont" / "run.json").read_text())
    assert ident["init_from_sha256"] == weights_sha256(zoo["base"] / "feat-export")
    assert "Continued from" in model_card._continued_from(dataclasses.asdict(cont), ident, 100)
    with pytest.raises(ValueError, match="not a feature"):  # a target is no feature drafter to start from
        feature.train(_feature_cfg(zoo, full_run, init_from=str(full_run["export"])), zoo["base"] / "feat-bad",
                      max_steps=0, progress=False)
    prompts = [[EOT_ID, 5, 9, 14, 30, 31], [EOT_ID, 40, 41, 42]]
    ref = specjax.generate(target, prompts, max_new_tokens=12)
    got = specjax.generate(target, prompts, max_new_tokens=12, drafters=[drafter], tree="chain=3")
    assert got.sequences() == ref.sequences()


# ----------------------------------------------------------------------------- MTP module

def test_mtp_module_trains_resumes_exports_and_drafts_losslessly(zoo, full_run):
    """`train.mtp` on the tiny target (its loop is `train.feature`'s, `drafter_run.run_unrolled`):
    learns, stops and resumes to the same parameters, exports bf16 `mtp.*` tensors and a card, and
    the export drafts losslessly; the token-CE objective trains too."""
    import specjax
    from specjax.drafters import MTPDrafter, load_drafter
    from train import model_card, mtp

    base = dict(name="tiny-mtp", target=str(full_run["export"]), num_layers=1, ttt_steps=2, seq_len=32, batch_size=4,
                steps=6, learning_rate=3e-3, warmup_steps=1, checkpoint_every=3, eval_every=6, eval_tokens=128,
                manifest=str(zoo["manifest"]), corpus_root=str(zoo["root"]))
    cfg = mtp.MTPTrainConfig(**base)
    straight = mtp.train(cfg, zoo["base"] / "mtp-straight", zoo["base"] / "mtp-export", progress=False)
    metrics = [json.loads(l) for l in (zoo["base"] / "mtp-straight" / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics[-1]["val_agree"]) == 2 and metrics[-1]["val_loss"] < np.log(300)
    mtp.train(cfg, zoo["base"] / "mtp-resume", max_steps=3, progress=False)
    resumed = mtp.train(cfg, zoo["base"] / "mtp-resume", progress=False)
    for a, b in zip(jax.tree.leaves(straight["params"]), jax.tree.leaves(resumed["params"])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="loss"):
        mtp.MTPTrainConfig(**{**base, "loss": "mse"})
    target = load_model(str(full_run["export"]))
    toks = jnp.asarray(np.random.default_rng(0).integers(0, target.config.vocab_size, (2, 12)))
    loss, (per_step, agree) = mtp.mtp_loss(load_drafter(str(zoo["base"] / "mtp-export"), target).head, target, toks,
                                           0.8, 2, "tokens")  # the token-CE objective: a finite loss
    assert np.isfinite(float(loss)) and per_step.shape == (2,) and agree.shape == (2,)
    drafter = load_drafter(str(zoo["base"] / "mtp-export"), target, target_path=str(full_run["export"]), draft_vocab=64)
    assert isinstance(drafter, MTPDrafter) and drafter.vocab_ids[...].shape == (64,)  # the export's token ranking
    card, _ = model_card.mtp_card(zoo["base"] / "mtp-export")
    assert "configs/tiny-mtp.json" in card and "mtp.fc" in card
    prompts = [[EOT_ID, 5, 9, 14, 30, 31], [EOT_ID, 40, 41, 42]]
    ref = specjax.generate(target, prompts, max_new_tokens=12)
    got = specjax.generate(target, prompts, max_new_tokens=12, drafters=[drafter], tree="chain=3")
    assert got.sequences() == ref.sequences()


# ----------------------------------------------------------------------------- block drafter (DSpark)

def _block_cfg(zoo, full_run, **kw):
    from train import block
    base = dict(name="tiny-dspark", target=str(full_run["export"]), block_size=4, num_layers=1, markov_rank=8,
                anchors=4, seq_len=32, batch_size=4, steps=8, learning_rate=3e-3, warmup_steps=2,
                checkpoint_every=3, eval_every=4, eval_tokens=256, manifest=str(zoo["manifest"]),
                corpus_root=str(zoo["root"]))
    base.update(kw)
    return block.BlockTrainConfig(**base)


def test_block_drafter_trains_resumes_calibrates_and_drafts_losslessly(zoo, full_run):
    import specjax
    from specjax.drafters import BlockDrafter, load_drafter
    from train import block, model_card

    cfg = _block_cfg(zoo, full_run)
    straight = block.train(cfg, zoo["base"] / "blk-straight", zoo["base"] / "blk-export", progress=False)
    metrics = [json.loads(l) for l in (zoo["base"] / "blk-straight" / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2 and len(metrics[-1]["val_accept"]) == 4
    assert metrics[-1]["val_loss"] < metrics[0]["val_loss"] + 0.5
    block.train(cfg, zoo["base"] / "blk-resume", max_steps=5, progress=False)  # stopped at 5, resumed
    resumed = block.train(cfg, zoo["base"] / "blk-resume", progress=False)
    for a, b in zip(jax.tree.leaves(straight["params"]), jax.tree.leaves(resumed["params"])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    with pytest.raises(lm.RunRefused, match="different run"):
        block.train(_block_cfg(zoo, full_run, anchors=3), zoo["base"] / "blk-resume", progress=False)
    info = json.loads((zoo["base"] / "blk-export" / "train_info.json").read_text())
    assert len(info["calibration"]["temperatures"]) == 4 and info["timing"]["tokens_per_s"] > 0
    assert info["calibration"]["objective"] == "log_loss"
    assert info["block_positions_trained"] == 8 * 4 * 4 * 4
    card, _ = model_card.block_card(zoo["base"] / "blk-export")
    assert "acceptance by position" in card and f"configs/{cfg.name}.json" in card
    target = load_model(str(full_run["export"]))
    drafter = load_drafter(str(zoo["base"] / "blk-export"), target, target_path=str(full_run["export"]), confidence=0.3)
    assert isinstance(drafter, BlockDrafter) and drafter.head.config.confidence_temperatures is not None
    prompts = [[EOT_ID, 5, 9, 14, 30, 31], [EOT_ID, 40, 41, 42]]
    ref = specjax.generate(target, prompts, max_new_tokens=12)
    got = specjax.generate(target, prompts, max_new_tokens=12, drafters=[drafter], tree="chain=4")
    assert got.sequences() == ref.sequences()
    (zoo["base"] / "blk-config.json").write_text(json.dumps(info["run"]["config"]))
    assert block.load_config(zoo["base"] / "blk-config.json") == cfg
    # TreeFlash: a head trained on the frozen export; only the head moves and only it is written
    from safetensors.numpy import load_file
    tf_cfg = _block_cfg(zoo, full_run, name="tiny-treeflash", init_from=str(zoo["base"] / "blk-export"),
                        freeze_backbone=True, ar_intermediate=16, steps=4, eval_every=4)
    tf_state = block.train(tf_cfg, zoo["base"] / "tf-run", zoo["base"] / "tf-export", progress=False)
    tf_params = dict(nnx.to_flat_state(tf_state["params"]))
    backbone = load_file(str(zoo["base"] / "blk-export" / "model.safetensors"))
    for key, var in tf_params.items():
        name = ".".join(map(str, key))
        if name.startswith("ar_head."):
            continue
        np.testing.assert_array_equal(np.asarray(var.get_value()), backbone[name].astype(np.float32), err_msg=name)
    assert float(np.abs(np.asarray(tf_params[("ar_head", "down", "weight")].get_value())).max()) > 0  # it learned
    assert all(k.startswith("ar_head.") for k in load_file(str(zoo["base"] / "tf-export" / "model.safetensors")))
    tf_info = json.loads((zoo["base"] / "tf-export" / "train_info.json").read_text())
    assert len(tf_info["final"]["val_top4_teacher_forced_markov"]) == 4 and tf_info["calibration"] is None
    card, _ = model_card.block_card(zoo["base"] / "tf-export")
    assert "TreeFlash head" in card and "pinned" in card
    tf = load_drafter(str(zoo["base"] / "tf-export"), target, target_path=str(full_run["export"]))
    assert tf.head.config.confidence_temperatures == drafter.head.config.confidence_temperatures
    got = specjax.generate(target, prompts, max_new_tokens=12, drafters=[tf], tree="treeflash,nodes=6,m=2,k=2")
    assert got.sequences() == ref.sequences()
    with pytest.raises(ValueError, match="freeze_backbone"):
        _block_cfg(zoo, full_run, freeze_backbone=True, ar_intermediate=16)
    # DPara: boundary blocks, initialised from the DSpark export (its token projection fresh)
    dp_cfg = _block_cfg(zoo, full_run, name="tiny-dpara", init_from=str(zoo["base"] / "blk-export"), boundary=True,
                        anchors=5, steps=4, eval_every=4)  # 5 anchors: validation cycles boundaries 0..4
    block.train(dp_cfg, zoo["base"] / "dp-run", zoo["base"] / "dp-export", progress=False)
    dp_info = json.loads((zoo["base"] / "dp-export" / "train_info.json").read_text())
    assert len(dp_info["final"]["val_tau_estimate_by_boundary"]) == 5  # boundaries 0..W
    card, _ = model_card.block_card(zoo["base"] / "dp-export")
    assert "DPara" in card and "by acceptance boundary" in card
    dp = load_drafter(str(zoo["base"] / "dp-export"), target, target_path=str(full_run["export"]))
    assert dp.head.config.boundary and dp.reads_own_tree and not dp.can_score
    got = specjax.generate(target, prompts, max_new_tokens=12, drafters=[dp], tree="chain=4")
    assert got.sequences() == ref.sequences()
    with pytest.raises(ValueError, match="lag_decay"):
        _block_cfg(zoo, full_run, boundary=True, lag_decay=0)


def test_target_cache_builds_resumes_and_trains_a_block_drafter(zoo, full_run):
    """The offline target cache (issue 43): built once, resumed after a stop to the same bytes, read
    back as the target's own features and top-k; a block drafter trains on it (DeepSpec's weighted
    mean, the backbone from the target) to the online loss at step 0 when k = V, and drafts losslessly."""
    import specjax
    from specjax.io.checkpoint import load_tokenizer
    from specjax.drafters import load_drafter
    from specjax.models import transformer
    from specjax.drafters import vocab as vocab_lib
    from train import block, drafter_run, model_card, target_cache

    target_dir = str(full_run["export"])
    streams = lm.load_streams_for(load_tokenizer(target_dir), str(zoo["manifest"]), str(zoo["root"]), None, None)
    out = zoo["base"] / "cache"
    kw = dict(layers=(0, 1), topk=300, seq_len=32, shard_windows=4, batch=4, max_windows=10, progress=False)
    m = target_cache.build(target_dir, streams.train, out, **kw)
    assert m["done"] == m["shards"] == 3 and m["windows"] == 10
    first = (out / "shard-00002" / "features.npy").read_bytes()
    shutil.rmtree(out / "shard-00002")  # a build stopped before its last shard
    man = json.loads((out / "manifest.json").read_text())
    (out / "manifest.json").write_text(json.dumps({**man, "done": 2}))
    with pytest.raises(ValueError, match="unfinished"):
        target_cache.TargetCache(out)
    target_cache.build(target_dir, streams.train, out, **kw)  # continues at shard 2
    assert (out / "shard-00002" / "features.npy").read_bytes() == first
    with pytest.raises(ValueError, match="other"):
        target_cache.build(target_dir, streams.train, out, **{**kw, "topk": 8})
    cache = target_cache.TargetCache(out, target_dir, (0, 1))
    b = cache.batch([0, 9])
    target = load_model(target_dir)
    toks = jnp.asarray(b["tokens"])
    ref = transformer.forward(target, toks, jnp.broadcast_to(jnp.arange(32)[None], (2, 32)),
                              transformer.init_cache(target, 2, 32), transformer.causal_mask(2, 32), hidden_layers=(0, 1))
    np.testing.assert_allclose(np.asarray(b["features"], np.float32), np.concatenate(ref.hidden, -1), rtol=2e-2, atol=2e-2)
    np.testing.assert_array_equal(b["topk_ids"][..., 0], np.argmax(np.asarray(ref.logits), -1))
    # the cached loss is the online loss (k = V: the whole distribution; features in bf16)
    cfg = _block_cfg(zoo, full_run, name="tiny-dspark-cache", target_layers=(0, 1), deepspec_loss=True,
                     init_from_target=True, intermediate_size=64, seq_len=32)
    _, hcfg, head_of, _, _, init = block._fns(cfg, target_dir)
    head = head_of(init()["params"])
    top = target.layers[1]  # one backbone layer from the target's top layer; fc passes layer 1's feature through
    np.testing.assert_array_equal(np.asarray(head.layers[0].q_proj.weight[...]), np.asarray(top.self_attn.q_proj.weight[...]))
    np.testing.assert_array_equal(np.asarray(head.layers[0].mlp.down_proj.weight[...]), np.asarray(top.mlp.down_proj.weight[...]))
    np.testing.assert_array_equal(np.asarray(head.fc.weight[...])[32:], np.eye(32))
    anchors = block.anchors_for(cfg, hcfg, None, 2, 32, evenly=True)
    online, _ = block.block_loss(head, target, toks, anchors, cfg)
    cached = {k: jnp.asarray(v) for k, v in b.items() if k != "tokens" and v is not None}
    offline, _ = block.block_loss(head, target, toks, anchors, cfg, cached=cached)
    np.testing.assert_allclose(float(offline), float(online), rtol=2e-2)
    # the feature (EAGLE-3) trainer reads the same cache: the same loss at step 0, then a cached run
    from train import feature
    fcfg = _feature_cfg(zoo, full_run, name="tiny-feature-cache", target_layers=(0, 1), steps=2, eval_every=2)
    _, _, head_def, _, _, finit = feature._fns(fcfg, target_dir)
    fhead = nnx.merge(head_def, finit()["params"])
    f_online = feature.ttt_loss(fhead, target, toks, fcfg.depth_decay, fcfg.ttt_steps)[0]
    f_offline = feature.ttt_loss(fhead, target, toks, fcfg.depth_decay, fcfg.ttt_steps, cached=cached)[0]
    np.testing.assert_allclose(float(f_offline), float(f_online), rtol=2e-2)
    # a reduced draft vocabulary over a cache is ranked on the cache's windows (what the run trains on)
    np.testing.assert_array_equal(cache.tokens(), target_cache.windows_of(streams.train, 32, 10).reshape(-1))
    vcfg = dataclasses.replace(fcfg, cache=str(out), init_from_target=True, draft_vocab=48)
    ranking, ids = drafter_run.draft_ranking(vcfg, streams.validation, target_dir)
    np.testing.assert_array_equal(ranking, vocab_lib.token_ranking(cache.tokens(), target.config.vocab_size))
    assert ids == tuple(int(i) for i in ranking[:48])
    fstate = feature.train(vcfg, zoo["base"] / "feat-cache", progress=False)
    assert int(fstate["step"]) == 2
    _, _, _, _, _, tinit = feature._fns(dataclasses.replace(fcfg, init_from_target=True), target_dir)
    thead = nnx.merge(head_def, tinit()["params"])  # the feature half of q from the target's top layer
    np.testing.assert_array_equal(np.asarray(thead.q_proj.weight[...])[32:], np.asarray(top.self_attn.q_proj.weight[...]))
    assert not np.asarray(thead.q_proj.weight[...])[:32].any()
    # the MTP trainer reads the target's last layer, a subset of the stored ones: the online loss at step 0
    from train import mtp
    mcfg = mtp.MTPTrainConfig(name="tiny-mtp-cache", target=target_dir, ttt_steps=2, seq_len=32, batch_size=4, steps=2,
                              eval_every=2, eval_tokens=128, manifest=str(zoo["manifest"]), corpus_root=str(zoo["root"]),
                              init_from_target=True)
    _, mhead_def, _, _, minit = mtp._fns(mcfg, target_dir)
    mhead = nnx.merge(mhead_def, minit()["params"])  # the MTP layer is the target's top layer; fc passes h through
    np.testing.assert_array_equal(np.asarray(mhead.layers[0].self_attn.q_proj.weight[...]), np.asarray(top.self_attn.q_proj.weight[...]))
    np.testing.assert_array_equal(np.asarray(mhead.fc.weight[...])[32:], np.eye(32))
    sub = target_cache.TargetCache(out, target_dir, (1,)).batch([0, 9])
    np.testing.assert_array_equal(np.asarray(sub["features"]), np.asarray(b["features"])[..., 32:])
    mcached = {k: jnp.asarray(v) for k, v in sub.items() if k != "tokens" and v is not None}
    m_online = mtp.mtp_loss(mhead, target, toks, mcfg.depth_decay, mcfg.ttt_steps)[0]
    m_offline = mtp.mtp_loss(mhead, target, toks, mcfg.depth_decay, mcfg.ttt_steps, cached=mcached)[0]
    np.testing.assert_allclose(float(m_offline), float(m_online), rtol=2e-2)
    # the reduced draft vocabulary in training: the online loss at step 0 over those tokens, then a cached run
    # whose export ships the cache's ranking, and drafts losslessly with it
    vids = jnp.asarray(ranking[:48])
    m_online = mtp.mtp_loss(mhead, target, toks, mcfg.depth_decay, mcfg.ttt_steps, vocab_ids=vids)[0]
    m_offline = mtp.mtp_loss(mhead, target, toks, mcfg.depth_decay, mcfg.ttt_steps, cached=mcached, vocab_ids=vids)[0]
    np.testing.assert_allclose(float(m_offline), float(m_online), rtol=2e-2)
    mvcfg = dataclasses.replace(mcfg, cache=str(out), draft_vocab=48)
    assert int(mtp.train(mvcfg, zoo["base"] / "mtp-cache", zoo["base"] / "mtp-cache-export", progress=False)["step"]) == 2
    np.testing.assert_array_equal(vocab_lib.read_ranking(str(zoo["base"] / "mtp-cache-export"), target.config.vocab_size),
                                  ranking)
    mcard = model_card.mtp_card(zoo["base"] / "mtp-cache-export")[0]
    top1 = np.concatenate([np.asarray(cache.batch([i])["topk_ids"])[..., 0].ravel() for i in range(len(cache))])
    share = np.isin(top1, ranking[:48]).mean()
    assert "Reduced draft vocabulary" in mcard and f"at {share:.1%} of positions" in mcard
    mdrafter = load_drafter(str(zoo["base"] / "mtp-cache-export"), target, target_path=target_dir, draft_vocab=48)
    prompts = [[EOT_ID, 5, 9, 14, 30, 31], [EOT_ID, 40, 41, 42]]
    ref = specjax.generate(target, prompts, max_new_tokens=12).sequences()  # one AR reference for both drafters
    assert specjax.generate(target, prompts, max_new_tokens=12, drafters=[mdrafter], tree="chain=3").sequences() == ref
    with pytest.raises(ValueError, match="needs loss"):
        dataclasses.replace(mcfg, loss="tokens", draft_vocab=48)
    cfg = dataclasses.replace(cfg, cache=str(out), steps=4, eval_every=4)
    state = block.train(cfg, zoo["base"] / "blk-cache", zoo["base"] / "blk-cache-export", progress=False)
    assert int(state["step"]) == 4
    drafter = load_drafter(str(zoo["base"] / "blk-cache-export"), target, target_path=target_dir)
    assert specjax.generate(target, prompts, max_new_tokens=12, drafters=[drafter], tree="chain=4").sequences() == ref


def test_a_session_stopped_mid_run_keeps_its_time_to_the_last_checkpoint(tmp_path):
    """The trainers write their session's line of `timing.jsonl` at every checkpoint (replacing it),
    so a process stopped mid-run leaves its time up to the checkpoint its resume starts from."""
    from train import drafter_run
    drafter_run.record_session(tmp_path, 0, 50, 10.0, 11.0, "a")
    drafter_run.record_session(tmp_path, 0, 100, 20.0, 22.0, "a")  # the next checkpoint; then the process is stopped
    drafter_run.record_session(tmp_path, 100, 150, 9.0, 10.0, "b")  # the resumed session, to the end
    drafter_run.record_session(tmp_path, 150, 150, 0.0, 1.0, "c")  # a re-export: no steps, no line
    t = drafter_run.session_timing(tmp_path)
    assert [x["steps"] for x in t["sessions"]] == [[0, 100], [100, 150]]
    assert t["train_step_s"] == 29.0 and t["wall_s"] == 32.0


def test_card_rebuilds_every_continuations_command_of_a_cache(tmp_path):
    """A cache whose `--extra` joined two streams: the card's "Built with" gives one
    train.continuations command per stream (with --questions where the stream has them), then the cache's."""
    from train import model_card
    a, b, c = tmp_path / "code.npy", tmp_path / "questions.npy", tmp_path / "questions2.npy"
    base = {"code_prompts": 4, "chat_prompts": 2, "new_tokens": 8, "weights": "int8"}
    a.with_suffix(".json").write_text(json.dumps(base))
    b.with_suffix(".json").write_text(json.dumps({**base, "code_prompts": 0, "chat_prompts": 0, "code_skipped": 4,
                                                  "questions": {"requested": 16, "asked": 12}}))
    c.with_suffix(".json").write_text(json.dumps({**base, "code_prompts": 0, "chat_prompts": 0,
                                                  "questions": {"requested": 8, "asked": 8, "first_seed": 101}}))
    m = {"layers": [0, 1], "windows": 3, "weights": "int8",
         "mix": {"extra": f"{a},{b},{c}", "corpus_tokens": 100, "extra_repeat": 1}}
    cmds = model_card._cache_commands({"target": "t", "cache": "c"}, m).split("` then `")
    assert cmds == [f"python -m train.continuations --target t --out {a} --code 4 --chat 2 --new-tokens 8 --weights int8",
                    f"python -m train.continuations --target t --out {b} --code 0 --chat 0 --new-tokens 8 --skip-code 4 "
                    "--questions 16 --weights int8",
                    f"python -m train.continuations --target t --out {c} --code 0 --chat 0 --new-tokens 8 "
                    "--questions 8 --question-seed 101 --weights int8",
                    f"python -m train.target_cache --target t --layers 0,1 --out c --windows 3 --corpus-tokens 100 "
                    f"--extra {a},{b},{c} --extra-repeat 1 --weights int8"]


def test_cache_extra_streams_join_in_order(tmp_path):
    from train import target_cache
    np.save(tmp_path / "a.npy", np.arange(5, dtype=np.int32))
    np.save(tmp_path / "b.npy", np.arange(10, 13, dtype=np.int64))
    got = target_cache.extra_stream(f"{tmp_path / 'a.npy'},{tmp_path / 'b.npy'}")
    assert got.dtype == np.int32 and got.tolist() == [0, 1, 2, 3, 4, 10, 11, 12]
    with pytest.raises(ValueError, match="no file"):
        target_cache.extra_stream(",")


def test_a_cache_built_at_int8_distils_the_int8_target(zoo, full_run):
    """`train.target_cache --weights int8` (issue 45): the cache holds the int8 target's features and
    top-k (the target as deployed), its manifest says so, a rebuild at another dtype is refused, and a
    trainer on it loads its target at int8 (embedding, LM head and validation match the labels)."""
    import specjax
    from specjax.io.checkpoint import load_tokenizer
    from specjax.drafters import load_drafter
    from specjax.models import quant, transformer
    from train import block, drafter_run, target_cache

    target_dir = str(full_run["export"])
    streams = lm.load_streams_for(load_tokenizer(target_dir), str(zoo["manifest"]), str(zoo["root"]), None, None)
    out = zoo["base"] / "cache-int8"
    kw = dict(layers=(0, 1), topk=8, seq_len=32, shard_windows=4, batch=4, max_windows=8, progress=False)
    m = target_cache.build(target_dir, streams.train, out, weights="int8", **kw)
    assert m["weights"] == "int8" and target_cache.cache_weights(out) == "int8"
    with pytest.raises(ValueError, match="other"):
        target_cache.build(target_dir, streams.train, out, **kw)  # float32 over an int8 cache
    b = target_cache.TargetCache(out, target_dir, (0, 1)).batch([0, 1])
    t8 = load_model(target_dir, weights="int8")
    ref = transformer.forward(t8, jnp.asarray(b["tokens"]), jnp.broadcast_to(jnp.arange(32)[None], (2, 32)),
                              transformer.init_cache(t8, 2, 32), transformer.causal_mask(2, 32))
    np.testing.assert_array_equal(b["topk_ids"][..., 0], np.argmax(np.asarray(ref.logits), -1))
    cfg = _block_cfg(zoo, full_run, name="tiny-dspark-int8", target_layers=(0, 1), intermediate_size=64, seq_len=32,
                     cache=str(out), steps=2, eval_every=2, init_from_target=True)  # initialised from the float weights
    # a position whose cached top-k holds no draft-vocabulary token leaves the L1 / confidence terms (no NaN)
    vids = tuple(range(16))
    _, _, vhead_of, _, _, vinit = block._fns(dataclasses.replace(cfg, draft_vocab=16), target_dir, vids, "int8")
    cached = {k: jnp.asarray(v) for k, v in b.items() if k != "tokens" and v is not None}
    outside = cached["topk_ids"].at[:, :].set(jnp.arange(100, 108)[None, None])  # every position outside the 16
    anchors = block.anchors_for(cfg, block.head_config(cfg, t8), None, 2, 32, evenly=True)
    for ids in (cached["topk_ids"], outside):
        loss, m = block.block_loss(vhead_of(vinit()["params"]), t8, jnp.asarray(b["tokens"]), anchors, cfg,
                                   cached={**cached, "topk_ids": ids})
        assert np.isfinite(float(loss)) and np.isfinite(np.asarray(m["l1"])).all()
    assert drafter_run.target_weights(cfg) == "int8"
    assert quant.weight_dtype(block._fns(cfg, target_dir, None, drafter_run.target_weights(cfg))[0]) == "int8"
    block.train(cfg, zoo["base"] / "blk-int8", zoo["base"] / "blk-int8-export", progress=False)
    info = json.loads((zoo["base"] / "blk-int8-export" / "train_info.json").read_text())
    assert info["run"]["target_weights"] == "int8"
    drafter = load_drafter(str(zoo["base"] / "blk-int8-export"), t8, target_path=target_dir)
    prompts = [[EOT_ID, 5, 9, 14, 30, 31]]
    assert (specjax.generate(t8, prompts, max_new_tokens=10, drafters=[drafter], tree="chain=4").sequences()
            == specjax.generate(t8, prompts, max_new_tokens=10).sequences())


def test_gpu_training_path_runs_from_corpus_tokens(zoo, full_run, tmp_path):
    """tools.gpu_train at a tiny size on CPU: the corpus as tokens (what a slim tree carries, read
    through the config's `manifest`), the cache built, a block drafter trained on it and exported."""
    from specjax.io.checkpoint import load_tokenizer
    from specjax.drafters import load_drafter
    from tools import gpu_train

    target_dir = str(full_run["export"])
    tok = load_tokenizer(target_dir)
    tokens = tmp_path / "corpus-tokens.npz"
    lm.save_corpus_tokens(tok, lm.load_streams_for(tok, str(zoo["manifest"]), str(zoo["root"]), None, None), tokens)
    cfg = _block_cfg(zoo, full_run, name="tiny-gpu-dspark", target_layers=(0, 1), deepspec_loss=True)
    (tmp_path / "cfg.json").write_text(json.dumps(dataclasses.asdict(cfg)))
    rec = gpu_train.run(target_dir, str(tokens), [str(tmp_path / "cfg.json")], str(tmp_path / "out"), windows=8, steps=2,
                        batch_size=2, progress=False)
    assert rec["cache"]["positions"] == 8 * 32 and rec["drafters"][0]["positions"] == 2 * 2 * 32
    info = json.loads((tmp_path / "out" / "tiny-gpu-dspark" / "train_info.json").read_text())
    assert info["run"]["config"]["cache"] == str(tmp_path / "out" / "cache")
    load_drafter(str(tmp_path / "out" / "tiny-gpu-dspark"), load_model(target_dir), target_path=target_dir)
    with pytest.raises(ValueError, match="another tokenizer"):
        lm.load_streams_for(Tokenizer.from_str(tok.to_str().replace('"<|endoftext|>"', '"<|eot|>"')), str(tokens),
                            None, None, None)


# ----------------------------------------------------------------------------- hybrid target

def test_hybrid_target_trains_exports_and_matches_transformers(zoo, tmp_path):
    """The same trainer runs a qwen3_next hybrid config: it learns, exports, and the export gives
    transformers' logits; a feature drafter trains on it."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from specjax.models import hybrid
    from train import drafter_run, feature, model_card

    d = lm.config_to_dict(zoo["cfg"])
    d["name"] = "tiny-hybrid"
    d["model"] = {"model_type": "qwen3_next", "vocab_size": 300, "hidden_size": 32, "intermediate_size": 64,
                  "num_layers": 4, "num_heads": 2, "num_kv_heads": 1, "head_dim": 16,
                  "layer_types": ["linear_attention"] * 3 + ["full_attention"],
                  "linear_num_key_heads": 2, "linear_num_value_heads": 2, "linear_key_head_dim": 8,
                  "linear_value_head_dim": 8, "tie_word_embeddings": True, "max_position_embeddings": 64}
    d["phases"] = [{"seq_len": 16, "steps": 12}]
    cfg = lm.config_from_dict(d)
    assert lm.config_from_dict(json.loads(json.dumps(lm.config_to_dict(cfg)))) == cfg
    state = lm.train(cfg, tmp_path / "run", tmp_path / "export", progress=False)
    metrics = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["val_loss"] < np.log(300)  # learned something from the uniform start

    model = load_model(str(tmp_path / "export"))
    assert isinstance(model, hybrid.HybridModel)
    for a, b in zip(jax.tree.leaves(nnx.state(model, nnx.Param)), jax.tree.leaves(state["params"]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(jnp.asarray(b).astype(jnp.bfloat16).astype(jnp.float32)))
    tokens = np.asarray(data.batch_at(np.arange(3, 300, dtype=np.int32), 20, 2, 0, 0, 0))
    out = hybrid.prefill(model, jnp.asarray(tokens), jnp.full((2,), tokens.shape[1], jnp.int32),
                         hybrid.init_cache(model, 2, tokens.shape[1]))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "export"), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.from_numpy(tokens).long()).logits.numpy()
    np.testing.assert_allclose(np.asarray(out.logits), ref, atol=1e-4, rtol=1e-4)

    # with a reduced draft vocabulary (EAGLE-3's d2t) and extra training data (train.continuations' stream)
    extra = np.asarray([EOT_ID] + list(range(3, 60)) * 2, np.int32)
    np.save(tmp_path / "extra.npy", extra)
    fcfg = feature.FeatureTrainConfig(name="tiny-hybrid-feature", target=str(tmp_path / "export"), ttt_steps=2,
                                      seq_len=16, batch_size=4, steps=4, warmup_steps=1, checkpoint_every=2,
                                      eval_every=4, eval_tokens=128, manifest=str(zoo["manifest"]),
                                      corpus_root=str(zoo["root"]), draft_vocab=96, extra_train=str(tmp_path / "extra.npy"))
    assert len(drafter_run.train_stream(fcfg, tmp_path / "feat")) == len(extra) + len(
        drafter_run.train_stream(dataclasses.replace(fcfg, extra_train=None), tmp_path / "feat"))
    feature.train(fcfg, tmp_path / "feat", tmp_path / "feat-export", progress=False)
    assert (tmp_path / "feat-export" / "token_ranking.safetensors").exists()
    import specjax
    from specjax.drafters import load_drafter
    drafter = load_drafter(str(tmp_path / "feat-export"), model, draft_vocab=48)
    assert drafter.vocab_ids[...].shape == (48,)
    prompts = [[EOT_ID, 5, 9, 14, 30, 31], [EOT_ID, 40, 41, 42]]
    ref_seq = specjax.generate(model, prompts, max_new_tokens=10).sequences()
    assert specjax.generate(model, prompts, max_new_tokens=10, drafters=[drafter], tree="chain=3").sequences() == ref_seq
    card, _ = model_card.feature_card(tmp_path / "feat-export")
    assert "Reduced draft vocabulary" in card and "own continuations" in card

    # ReaDy on the same hybrid: states at the anchors from the chunked pass, the zeroed-state
    # ablation in train_info.json, the card's reader section, lossless drafting; with a draft
    # vocabulary fixed at training and the extra stream repeated
    from train import block
    rcfg = block.BlockTrainConfig(name="tiny-hybrid-ready", target=str(tmp_path / "export"), block_size=4, num_layers=1,
                                  markov_rank=8, state_layers="all", reader_out_rank=8, state_every=2, anchors=4,
                                  seq_len=16, batch_size=4, steps=4, warmup_steps=1, checkpoint_every=2, eval_every=4,
                                  eval_tokens=128, manifest=str(zoo["manifest"]), corpus_root=str(zoo["root"]),
                                  draft_vocab=96, extra_train=str(tmp_path / "extra.npy"), extra_repeat=3)
    assert len(drafter_run.train_stream(rcfg, tmp_path / "feat")) == 3 * len(extra) + len(
        drafter_run.train_stream(dataclasses.replace(rcfg, extra_train=None), tmp_path / "feat"))
    block.train(rcfg, tmp_path / "ready", tmp_path / "ready-export", progress=False)
    info = json.loads((tmp_path / "ready-export" / "train_info.json").read_text())
    assert len(info["final_zero_state"]["val_accept"]) == 4 and info["run"]["config"]["state_layers"] == "all"
    card, _ = model_card.block_card(tmp_path / "ready-export")
    assert "Recurrent-state reader" in card and "[0, 1, 2]" in card
    assert "Reduced draft vocabulary" in card and "repeated 3 times" in card
    ready = load_drafter(str(tmp_path / "ready-export"), model, target_path=str(tmp_path / "export"))
    assert ready.head.config.reads_state and ready.state_index == (0, 1, 2)
    assert ready.head.vocab_ids[...].shape == (96,) and ready.head.markov_embed.shape == (97, 8)
    assert specjax.generate(model, prompts, max_new_tokens=10, drafters=[ready]).sequences() == ref_seq

    # ReaDy on an offline cache built with its read layers' states (issue 43): the online loss at step 0
    # (k = V: the whole distribution), a cached run, and a refusal when the cache holds other layers
    from train import target_cache
    ccfg = dataclasses.replace(rcfg, name="tiny-hybrid-ready-cache", draft_vocab=None, extra_train=None, extra_repeat=1)
    _, chcfg, chead_of, _, _, cinit = block._fns(ccfg, str(tmp_path / "export"))
    cache_dir = tmp_path / "ready-cache-data"
    target_cache.build(str(tmp_path / "export"), drafter_run.train_stream(ccfg, tmp_path / "feat"), cache_dir,
                       layers=chcfg.target_layers, topk=300, seq_len=16, shard_windows=4, batch=4, max_windows=8,
                       state_layers=chcfg.state_layers, state_every=2, progress=False)
    cb = target_cache.TargetCache(cache_dir, str(tmp_path / "export"), chcfg.target_layers).batch([0, 5])
    assert cb["states"].shape[:3] == (3, 2, 9)  # [L_s, B, 16 / 2 + 1]
    ctoks = jnp.asarray(cb["tokens"])
    canchors = block.anchors_for(ccfg, chcfg, None, 2, 16, evenly=True)
    chead = chead_of(cinit()["params"])
    online, _ = block.block_loss(chead, model, ctoks, canchors, ccfg)
    offline, _ = block.block_loss(chead, model, ctoks, canchors, ccfg,
                                  cached={k: jnp.asarray(v) for k, v in cb.items() if k != "tokens"})
    np.testing.assert_allclose(float(offline), float(online), rtol=2e-2)
    cstate = block.train(dataclasses.replace(ccfg, cache=str(cache_dir), steps=2, eval_every=2), tmp_path / "ready-c",
                         progress=False)
    assert int(cstate["step"]) == 2
    manifest = json.loads((cache_dir / "manifest.json").read_text())
    (cache_dir / "manifest.json").write_text(json.dumps({**manifest, "stream_sha256": "0" * 64}))
    with pytest.raises(lm.RunRefused, match="cache_stream_sha256"):  # a resumed run refuses another cache
        block.train(dataclasses.replace(ccfg, cache=str(cache_dir), steps=4, eval_every=2), tmp_path / "ready-c",
                    progress=False)
    (cache_dir / "manifest.json").write_text(json.dumps({**manifest, "state_layers": [0]}))
    with pytest.raises(ValueError, match="holds the states of layers"):
        block.train(dataclasses.replace(ccfg, cache=str(cache_dir), steps=2), tmp_path / "ready-c2", progress=False)


def test_reschedule_changes_phase_lengths_only(zoo, tmp_path):
    """--reschedule: a run may get shorter or longer phases (recorded in run.json), never other
    phases, and never lose steps it has already run; without the flag any change is refused."""
    cfg = zoo["cfg"]
    run_dir = tmp_path / "run"
    lm.train(cfg, run_dir, max_steps=6, progress=False)
    shorter = dataclasses.replace(cfg, phases=(lm.Phase(16, 8), lm.Phase(32, 4, micro_batch_size=2)))
    with pytest.raises(lm.RunRefused, match="different run"):
        lm.train(shorter, run_dir, max_steps=7, progress=False)
    for bad, why in ((dataclasses.replace(cfg, phases=(lm.Phase(16, 5), cfg.phases[1])), "already run 6 steps"),
                     (dataclasses.replace(cfg, phases=(lm.Phase(16, 8), lm.Phase(24, 4))), "sequence lengths")):
        with pytest.raises(lm.RunRefused, match=why):
            lm.train(bad, run_dir, reschedule=True, progress=False)
    state = lm.train(shorter, run_dir, tmp_path / "export", reschedule=True, progress=False)
    assert int(state["step"]) == 12
    stored = json.loads((run_dir / "run.json").read_text())
    assert stored["schedule_changes"][0]["at_step"] == 6 and [p["steps"] for p in stored["config"]["phases"]] == [8, 4]
    info = json.loads((tmp_path / "export" / "train_info.json").read_text())
    assert info["steps"] == 12 and info["tokens_trained"] == 8 * 4 * 16 + 4 * 4 * 32
    assert lm.reschedule_problem([{"seq_len": 16, "steps": 20}], [{"seq_len": 16, "steps": 30}], 20) is not None
    from train import model_card  # the card tells the schedule's history
    history = model_card._schedule_history(info["run"]["schedule_changes"])
    assert "at step 6: 20@16 + 10@32 → 8@16 + 4@32" in history and "--reschedule" in history


def test_a_run_from_before_a_new_defaulted_field_resumes(tmp_path):
    """A run directory written before a config field existed resumes while the field is at its
    default, and is refused once it is not (drafter_run's identity records the defaults)."""
    from train import drafter_run
    run = tmp_path / "run"
    run.mkdir()
    old = {"name": "x", "anchors": 4, "target_sha256": "abc"}
    (run / "run.json").write_text(json.dumps(old))
    ident = {**old, "reader_rank": 8, "_defaults": {"reader_rank": 8}}
    drafter_run.open_run(run, None, ident, overwrite=False)
    (run / "run.json").write_text(json.dumps(old))
    with pytest.raises(lm.RunRefused, match="reader_rank: run dir has 8, now 16"):
        drafter_run.open_run(run, None, {**ident, "reader_rank": 16}, overwrite=False)


def test_block_backbone_starts_from_a_hybrid_targets_attention_layers():
    """`init_from_target` on a hybrid: the backbone takes the top full-attention layers (the Gated
    DeltaNet layers have none), the query half of the gated q_proj, and the (1 + w) norms as scales."""
    from helpers import tiny_hybrid_config
    from specjax.drafters import block as Bk
    from specjax.models import hybrid
    from train import block
    tcfg = tiny_hybrid_config(64, 4, layer_types=("linear_attention", "full_attention", "linear_attention",
                                                  "full_attention"))
    target = hybrid.init_model(tcfg, seed=2)
    for layer in target.layers:  # non-zero offsets, so a (1 + w) scale differs from w
        layer.input_layernorm.weight.set_value(jnp.full((64,), 0.25))
        if layer.self_attn is not None:
            layer.self_attn.q_norm.weight.set_value(jnp.full((16,), -0.5))
    hcfg = Bk.BlockConfig.for_target(tcfg, block_size=4, num_layers=2, target_layers=(0, 2))
    head = Bk.BlockHead(hcfg, nnx.Rngs(0))
    block.start_from_target(head, target)
    for layer, src in zip(head.layers, (target.layers[1], target.layers[3])):
        wq = np.asarray(src.self_attn.q_proj.weight[...]).reshape(64, 4, 32)[..., :16].reshape(64, 64)
        np.testing.assert_array_equal(np.asarray(layer.q_proj.weight[...]), wq.astype(np.asarray(layer.q_proj.weight[...]).dtype))
        np.testing.assert_array_equal(np.asarray(layer.k_proj.weight[...]), np.asarray(src.self_attn.k_proj.weight[...]))
        np.testing.assert_allclose(np.asarray(layer.input_layernorm.weight[...]), 1.25)
        np.testing.assert_allclose(np.asarray(layer.q_norm.weight[...]), 0.5)
        np.testing.assert_array_equal(np.asarray(layer.mlp.up_proj.weight[...]), np.asarray(src.mlp.up_proj.weight[...]))
    with pytest.raises(ValueError, match="attention layers"):
        block.start_from_target(Bk.BlockHead(dataclasses.replace(hcfg, num_layers=3), nnx.Rngs(0)), target)


def test_unrolled_loss_from_a_sparse_top_k_equals_the_dense_one():
    """The feature / MTP trainers take a cache's top-k sparsely (no [B, T, V] target): the same loss
    and agreement as the dense renormalised top-k, over the full and over a reduced draft vocabulary."""
    from train import drafter_run, target_cache
    rng = np.random.default_rng(0)
    K, B, T, V, k = 3, 2, 12, 40, 6
    z = jnp.asarray(rng.normal(size=(K, B, T, V)), jnp.float32)
    tl = rng.normal(size=(B, T, V)) * 2
    ids = np.argsort(-tl, -1)[..., :k].astype(np.int32)
    logp = np.take_along_axis(tl - np.log(np.exp(tl).sum(-1, keepdims=True)), ids, -1).astype(np.float16)
    dense = target_cache.dense_logits(jnp.asarray(ids), jnp.asarray(logp), V)
    ref, (ref_l, ref_a) = drafter_run.unrolled_loss(z, dense, 0.8)
    got, (got_l, got_a) = drafter_run.unrolled_loss(z, (jnp.asarray(ids), jnp.asarray(logp)), 0.8)
    np.testing.assert_allclose(float(got), float(ref), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(got_l), np.asarray(ref_l), rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(got_a), np.asarray(ref_a))
    vocab_ids = jnp.asarray(np.sort(rng.permutation(V)[:30]))  # some top-k tokens fall outside
    dense_n = dense[..., vocab_ids]
    ok = np.isfinite(np.asarray(dense_n)).any(-1).all()
    assert ok  # every position keeps a token of its top-k inside (the dense reference is defined)
    ref, (ref_l, ref_a) = drafter_run.unrolled_loss(z[..., :30], dense_n, 0.8)
    got, (got_l, got_a) = drafter_run.unrolled_loss(
        z[..., :30], drafter_run.draft_vocab_topk(jnp.asarray(ids), jnp.asarray(logp), vocab_ids, V), 0.8)
    np.testing.assert_allclose(float(got), float(ref), rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(got_a), np.asarray(ref_a))


def test_continuations_questions_the_target_writes_itself(zoo, full_run, tmp_path):
    """train.continuations --questions (Magpie): the template's text before a user message's content
    is sampled at T=1 to the end of the turn, each kept turn is answered as a chat prompt; a turn that
    never ends is dropped; a template without a user turn to end is refused."""
    from train import continuations as C
    chat_dir = tmp_path / "chat-target"
    shutil.copytree(full_run["export"], chat_dir)
    cfg_file = chat_dir / "tokenizer_config.json"
    tcfg = json.loads(cfg_file.read_text()) if cfg_file.exists() else {}
    tcfg["chat_template"] = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                             "{% if add_generation_prompt %}<assistant>{% endif %}")
    cfg_file.write_text(json.dumps(tcfg))
    assert C.user_turn_prefix(str(chat_dir)) == ("<user>", "\n")
    assert C.cut_turn([5, 6, 7, 9, 1], 9) == [5, 6, 7] and C.cut_turn([5, 6, 7], 9) is None
    assert C.cut_turn([5, 9], 9) is None  # too short to be a question
    summary = C.build(str(chat_dir), tmp_path / "q.npy", 0, 0, new_tokens=8, batch=4, n_questions=3)
    q = summary["questions"]
    assert q["requested"] == 3 and 1 <= q["asked"] <= 3 and q["sampled"] >= 4 and len(set(q["first"])) == q["asked"]
    assert q["first_seed"] == 1
    with pytest.raises(ValueError, match="first seed must be >= 1"):
        C.sample_questions(None, None, str(chat_dir), 3, 4, first_seed=0)
    assert summary["generated_tokens"]["questions"] > 0 and summary["chat_prompts"] == 0
    tok = load_tokenizer(str(chat_dir))
    stream = np.load(tmp_path / "q.npy").tolist()
    first = tok.encode(f"<user>{q['first'][0]}\n<assistant>").ids
    assert any(stream[i:i + len(first)] == first for i in range(len(stream)))  # asked as a chat prompt
    tcfg["chat_template"] = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    cfg_file.write_text(json.dumps(tcfg))
    with pytest.raises(ValueError, match="closes a user turn with nothing"):
        C.user_turn_prefix(str(chat_dir))


def test_a_card_counts_every_stage_a_drafter_was_continued_from(tmp_path):
    """Three stages (init_from twice): the card's start paragraph sums every earlier stage's positions and
    Reproduce trains them oldest first, each exporting where the next one starts (no model is built)."""
    from train import model_card

    def stage(name, tokens, init_from=None):
        d = tmp_path / name
        d.mkdir()
        cfg = {"name": name, "steps": 1, "batch_size": 1, "seq_len": 1, "ttt_steps": 2, "cache": "runs/cache/c",
               **({"init_from": str(init_from)} if init_from else {})}
        (d / "train_info.json").write_text(json.dumps({"run": {"config": cfg}, "tokens_trained": tokens,
                                                       "run_dir": f"runs/{name}", "final": {"val_agree": [0.5, 0.4]},
                                                       "timing": {"train_step_s": 60.0}}))
        return d

    s1 = stage("f-stage1", 1000)
    s2 = stage("f-stage2", 200, init_from=s1)
    cfg3 = {"name": "f", "init_from": str(s2)}
    text = model_card._continued_from(cfg3, {"init_from_sha256": "ab" * 32}, 30)
    assert "trained 200 positions" in text and f"after 1 earlier stage(s) (`{s1}`: 1,000 positions)" in text
    assert "saw 1,230 positions in all" in text
    assert model_card._stage_command(cfg3).splitlines() == [
        f"python -m train.feature --config configs/f-stage1.json --run-dir runs/f-stage1 --export {s1}",
        f"python -m train.feature --config configs/f-stage2.json --run-dir runs/f-stage2 --export {s2}"]
