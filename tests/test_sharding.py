"""Sharded generation and training (design §10) on simulated CPU devices.

XLA reads the device count once, when jax is imported, so the mesh checks run in subprocesses
(`tests/mesh_worker.py`) with `--xla_force_host_platform_device_count`; this process keeps its one
device. Tensor parallelism splits sums (an all-reduce adds partial products in another order): the
tiny random models' logits are O(1), far from ties at float32 noise, so greedy tokens are compared
exactly (a difference names its row); the training loss curves within 1e-4 (measured: 1e-6).
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from specjax.models import sharding

HERE = Path(__file__).resolve().parent
WORKER = HERE / "mesh_worker.py"
LOSS_TOL = 1e-4


def _env(devices: int, **extra) -> dict:
    env = dict(os.environ)
    flags = " ".join(f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f)
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}".strip()
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _records(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def _run(args, devices: int, timeout: int = 600) -> list[dict]:
    p = subprocess.run([sys.executable, str(WORKER), *args], env=_env(devices), capture_output=True, text=True,
                       timeout=timeout)
    assert p.returncode == 0, p.stderr[-4000:]
    return _records(p.stdout)


# ----------------------------------------------------------------------------- on the host


def test_mesh_strings_and_refusals():
    assert sharding.parse_mesh_shape("data=2,model=4") == {"data": 2, "model": 4}
    assert sharding.parse_mesh_shape("model=8") == {"data": 1, "model": 8}
    for bad, msg in [("data=2,tensor=4", "expected axes"), ("data=0", "positive integer"), ("data=x", "positive"),
                     ("data=2,data=2", "twice"), ("", "data=D,model=M"), ("data", "expected axes")]:
        with pytest.raises(ValueError, match=msg):
            sharding.parse_mesh_shape(bad)
    with pytest.raises(ValueError, match="needs 8 devices; 1 are available.*device_count"):
        sharding.make_mesh(2, 4)
    with pytest.raises(ValueError, match="jax.sharding.Mesh"):
        sharding.check_mesh("data=1")


def test_fit_drops_what_does_not_divide():
    P = sharding.P
    mesh = {"data": 2, "model": 4}
    assert sharding.fit(P(None, "model"), (64, 128), mesh) == P(None, "model")
    assert sharding.fit(P(None, "data", None, "model", None), (2, 8, 40, 2, 16), mesh) == P(None, "data")
    assert sharding.fit(P("model"), (6,), mesh) == P()  # 6 rows over 4 devices: replicated
    assert sharding.fit(P(("data", "model")), (16,), mesh) == P(("data", "model"))
    assert sharding.fit(P("data", "model"), (4,), mesh) == P("data")  # spec past the rank is cut
    rules = ((r"q_proj/weight$", P(None, "model")),)
    assert sharding.spec_for("layers/3/self_attn/q_proj/weight", rules) == P(None, "model")
    assert sharding.spec_for("layers/3/self_attn/q_norm/weight", rules) == P()


def test_one_device_mesh_is_the_plain_program():
    """A 1x1 mesh runs the sharded path in this process: same tokens; a batch the data axis does not
    divide is refused before tracing."""
    import jax

    import specjax
    from helpers import tiny_target
    from specjax.engine import loop as engine
    target = tiny_target(160)
    mesh = sharding.make_mesh(1, 1, devices=jax.devices()[:1])
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    ref = specjax.generate(target, prompts, max_new_tokens=6)
    got = specjax.generate(target, prompts, max_new_tokens=6, mesh=mesh)
    assert got.sequences() == ref.sequences()
    with pytest.raises(ValueError, match="jax.sharding.Mesh"):
        specjax.generate(target, prompts, max_new_tokens=6, mesh="data=1")
    import types
    two_rows = types.SimpleNamespace(shape={"data": 2, "model": 1})  # refused before anything is placed
    with pytest.raises(ValueError, match="must be a multiple of the mesh's data axis"):
        engine._placed(two_rows, {}, ((),), engine.prepare_prompts([[1], [2], [3]], 10, 2), ())
    before = engine.trace_count()
    specjax.generate(target, prompts, max_new_tokens=6, mesh=mesh)
    assert engine.trace_count() == before  # compiled once per configuration


# ----------------------------------------------------------------------------- 8 simulated devices


def _compare(ref, got, what):
    # Different reduction orders (tensor parallel) may flip an exact tie only; the tiny models'
    # logits are O(1), so any difference is reported with its position.
    assert got == ref, f"{what}: sharded output differs from one device\n  one device: {ref}\n  sharded:    {got}"


def test_sharded_generation_equals_one_device_with_declared_layouts():
    """Meshes (8,1), (2,4), (1,8): greedy speculative (lm and feature drafters) and autoregressive
    output identical to one device's (greedy: its autoregressive output), dense and hybrid targets,
    batch 8 ragged; one compile each.
    Autoregressive on (2,4) for both targets; speculative on a pairwise cover (`mesh_worker.COVER`).
    Then the layouts (one subprocess for both: it is the compiles that cost)."""
    mesh_records = _run(["generate"], devices=8)
    _check_outputs(mesh_records)
    _check_layouts(mesh_records)


def test_composites_forward_the_contract_on_a_mesh():
    """AdaptiveShape, TreeGraft and Switch forward their block drafter's `partition_rules`: on mesh (2,4) its
    parameters are placed as the bare drafter's (the Markov tables over `model`); and FOLD composes
    through TreeGraft (on its strong lm drafter), greedy output on the mesh equal to one device's."""
    recs = _run(["composite"], devices=8)
    layouts = [r for r in recs if r["check"] == "composite-layout"]
    assert {r["wrapper"] for r in layouts} == {"adaptive", "treegraft", "switch"}
    for r in layouts:
        assert r["wrapped"] == r["bare"], f"{r['wrapper']}: placed unlike the bare drafter"
        assert "model" in r["bare"]["head/markov_embed"], r["bare"]["head/markov_embed"]
    (fold,) = [r for r in recs if r["check"] == "composite-fold"]
    assert fold["strong_fold"] and fold["cheap"] == "ngram"
    _compare(fold["reference"], fold["got"], "TreeGraft with FOLD on mesh (2,4)")


def _check_outputs(mesh_records):
    gens = [r for r in mesh_records if r["check"] == "generate"]
    seen = {(r["target"], r["drafter"], tuple(r["mesh"])) for r in gens}
    from mesh_worker import AR_MESH, COVER
    assert seen == COVER | {(t, "ar", AR_MESH) for t in ("dense", "hybrid")}
    for r in gens:
        what = f"{r['target']} {r['drafter']} mesh {r['mesh']}"
        _compare(r["reference"], r["first"], what)
        _compare(r["reference"], r["again"], what + " (second call)")
        assert r["traces"] == 1, f"{what}: traced {r['traces']} times for two calls"
    taus = {(r["target"], r["drafter"]): r["tau"] for r in gens if r["drafter"] == "lm"}
    assert taus[("dense", "lm")] > 1.5 and taus[("hybrid", "lm")] > 1.5  # the checks see accepted drafts


def _check_layouts(mesh_records):
    """Parameters (as placed), the target's cache, the drafter's state and the batch (as the program
    keeps them) have the shardings their tables declare, fitted to their shapes."""
    layouts = [r for r in mesh_records if r["check"] == "layout"]
    assert sorted((r["target"], tuple(r["mesh"])) for r in layouts) == [("dense", (2, 4)), ("hybrid", (2, 4))]
    for r in layouts:
        assert r["checked"] > 30 and not r["wrong"], (r["target"], r["mesh"], r["wrong"])
        s, mesh = r["sample"], tuple(r["mesh"])
        if mesh == (2, 4):  # tensor parallel where the table says, rows over data
            assert s["params/0/layers/0/mlp/gate_proj/weight"] == [None, "model"]
            assert s["params/0/layers/0/mlp/down_proj/weight"] == ["model"]
            assert s["params/1/head/q_proj/weight"] == [None, "model"]  # the drafter's own table
            assert s["root"] == ["data"]
            assert s["dstate/cache/k"][:2] == [None, "data"]
            if r["target"] == "hybrid":
                assert s["cache/state"] == [None, "data", "model"]  # 4 value heads over 4 devices
                assert s["cache/conv"] == [None, "data", None, "model"]
                assert s["params/0/layers/0/linear_attn/in_proj_qkvz/weight"] == [None, "model"]
            else:
                assert s["cache/k"] == [None, "data"]  # 2 KV heads do not split over 4: replicated
        length = s["cache/kv/length"] if r["target"] == "hybrid" else s["cache/length"]
        assert s["prompt"] == ["data"] and length == ["data"]


# ----------------------------------------------------------------------------- 2 processes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_share_one_mesh():
    """Two processes on 127.0.0.1, 4 simulated devices each, one global (2,4) mesh: each gets the tokens
    that one device gives (speculative and autoregressive)."""
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, str(WORKER), "distributed"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env=_env(4, SPECJAX_COORDINATOR=f"127.0.0.1:{port}", SPECJAX_NUM_PROCESSES=2,
                                       SPECJAX_PROCESS_ID=i))
             for i in range(2)]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=600)
            assert p.returncode == 0, err[-4000:]
            outs.append(_records(out)[-1])
    finally:
        for p in procs:
            p.kill()
    assert sorted(r["process"] for r in outs) == [0, 1]
    import specjax
    from mesh_worker import NEW_TOKENS, _prompts, _targets
    target, drafters = _targets()["dense"]
    one = specjax.generate(target, _prompts(target.config.vocab_size), max_new_tokens=NEW_TOKENS).sequences()
    for r in outs:  # greedy speculative and autoregressive: one device's autoregressive output
        assert r["processes"] == 2 and r["devices"] == 8 and r["local_devices"] == 4
        _compare(one, r["ar"], f"process {r['process']} ar")
        _compare(one, r["lm"], f"process {r['process']} lm")


def test_initialize_distributed_needs_every_variable():
    assert sharding.initialize_distributed({}) is False
    with pytest.raises(ValueError, match="SPECJAX_PROCESS_ID must be set"):
        sharding.initialize_distributed({"SPECJAX_COORDINATOR": "127.0.0.1:1", "SPECJAX_NUM_PROCESSES": "2"})


# ----------------------------------------------------------------------------- training


@pytest.fixture(scope="module")
def tiny_lm_config(tmp_path_factory):
    """The LM trainer's tiny config (test_train's corpus of real stdlib files), with 8 rows a batch so
    they split over every data axis."""
    from helpers import stdlib_sample
    from train import lm
    base = tmp_path_factory.mktemp("mesh_zoo")
    root, manifest, _ = stdlib_sample(base, {"train": 12, "validation": 2, "test": 1})
    cfg = {"name": "tiny-mesh", "model": {"model_type": "llama", "vocab_size": 300, "hidden_size": 32,
                                          "intermediate_size": 64, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1,
                                          "head_dim": 16, "tie_word_embeddings": True, "max_position_embeddings": 64},
           "tokenizer": str(base / "tokenizer.json"), "phases": [{"seq_len": 16, "steps": 30}],
           "batch_size": 8, "learning_rate": 1e-2, "warmup_steps": 3, "checkpoint_every": 10, "keep_checkpoints": 2,
           "eval_every": 100, "eval_seq_len": 16, "eval_tokens": 256,
           "corpus": {"manifest": str(manifest), "root": str(root)}}
    lm.config_from_dict(cfg)  # valid
    (base / "cfg.json").write_text(json.dumps(cfg))
    return base


def test_lm_trainer_on_a_mesh_matches_one_device(tiny_lm_config):
    """20 steps of the LM trainer's step on the mesh (2,4) give one device's loss curve (within
    1e-4); parameters and Adam moments stay laid out by the table; a checkpoint saved sharded by
    `train(mesh=...)` resumes on one device and lands where the one-device run does. The feature and
    block trainers on (2,4) take the steps one device takes (2 steps each)."""
    base = tiny_lm_config
    recs = {r["check"]: r for r in _run(["train", str(base / "cfg.json"), str(base / "run")], devices=8)}
    curves = recs["train-curves"]
    one = np.asarray(curves["one"])
    assert len(one) == 20 and one[-1] < one[0] - 0.5  # it learns
    np.testing.assert_allclose(curves["mesh"], one, atol=LOSS_TOL, rtol=0)
    specs = recs["train-layout"]["specs"]
    assert specs["params/layers/0/self_attn/q_proj/weight"] == [None, "model"]
    assert specs["opt_state/1/0/mu/layers/0/self_attn/q_proj/weight"] == [None, "model"]
    assert specs["opt_state/1/0/nu/layers/0/mlp/down_proj/weight"] == ["model"]
    res = recs["train-resume"]
    assert res["step"] == 20 and len(res["devices"]) == 1  # restored on one device
    assert res["max_param_diff"] < 1e-4
    for name in ("feature", "block"):  # the drafter trainers: data and tensor parallel, same steps
        r = recs[f"train-{name}"]
        assert r["step"] == 2 and r["sharded_params"] > 0 and r["max_param_diff"] < 1e-4, r
