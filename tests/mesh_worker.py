"""What `test_sharding.py` runs in subprocesses, where XLA simulates several CPU devices (a flag read
once, when jax is imported: the other tests keep one device). Prints one JSON line per check.

    python tests/mesh_worker.py generate              # 8 devices: meshes (8,1), (2,4), (1,8)
    python tests/mesh_worker.py composite             # 8 devices: composites forward the contract on (2,4)
    python tests/mesh_worker.py distributed           # one of 2 processes (SPECJAX_* env), 4 devices each
    python tests/mesh_worker.py train CONFIG RUN_DIR  # 8 devices: the LM trainer on a mesh and on one device
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

MESHES = ((8, 1), (2, 4), (1, 8))
# Which (target, drafter, mesh) run speculatively (autoregressive: every target on the mixed mesh). A
# pairwise cover, not the whole product (compiling a sharded program is what these tests cost): every
# mesh sees both targets and both drafters (so the target's sharded forward runs on every mesh), every
# drafter runs on both targets, and the mixed mesh (2,4) runs all four pairs.
COVER = {("dense", "lm", m) for m in MESHES} | {("hybrid", "feature", m) for m in MESHES} | {
    ("dense", "feature", (2, 4)), ("hybrid", "lm", (2, 4))}
AR_MESH = (2, 4)  # the autoregressive program on a mesh (speculative rounds run the same target forward on every mesh)
LAYOUT_MESH = (2, 4)  # where the parameter, cache and drafter-state layouts are inspected (both axes > 1)
PROMPT_LENGTHS = (5, 9, 3, 12, 7, 4, 10, 6)  # a ragged batch of 8 (divides every data axis)
NEW_TOKENS = 12


def emit(**record):
    print(json.dumps(record), flush=True)


def _prompts(vocab: int):
    import numpy as np
    rng = np.random.default_rng(0)
    return [rng.integers(0, vocab, size=n).tolist() for n in PROMPT_LENGTHS]


def _targets():
    """Tiny dense and hybrid targets, each with an lm drafter (a noisy copy: partial acceptance) and a
    feature drafter (an untrained EAGLE-3 head over two target layers)."""
    from flax import nnx

    from helpers import noisy_copy, tiny_hybrid_config, tiny_target
    from specjax.drafters.feature import FeatureConfig, FeatureDrafter, FeatureHead
    from specjax.drafters.lm import LMDrafter
    from specjax.models import hybrid
    dense = tiny_target(160, seed=0)
    # the tests' tiny hybrid (linear, full attention), here with 2 linear key heads and 4 value heads
    hyb = hybrid.init_model(tiny_hybrid_config(160, 2, linear_num_key_heads=2, linear_num_value_heads=4), seed=0)
    out = {}
    for name, target in (("dense", dense), ("hybrid", hyb)):
        head = FeatureHead(FeatureConfig.for_target(target.config, target_layers=(0, 1)), nnx.Rngs(3))
        out[name] = (target, {"lm": LMDrafter(noisy_copy(target, 0.05, 1)), "feature": FeatureDrafter(head, target)})
    return out


def _spec(x) -> list:
    return [list(e) if isinstance(e, tuple) else e for e in x.sharding.spec]


def generate() -> None:
    import jax
    from flax import nnx

    from specjax.engine import loop as engine
    from specjax.models import sharding
    from specjax.models import family
    assert len(jax.devices()) == 8, jax.devices()
    for tname, (target, drafters) in _targets().items():
        prompts = _prompts(target.config.vocab_size)
        # One device's greedy output, autoregressive: what every sharded run must give (greedy speculative
        # decoding on one device gives it too, which the rest of the suite proves).
        ref = engine.generate(target, prompts, max_new_tokens=NEW_TOKENS).sequences()
        for shape in MESHES:
            mesh = sharding.make_mesh(*shape)
            ar = ("ar",) if shape == AR_MESH else ()
            for dname in ar + tuple(d for d in drafters if (tname, d, shape) in COVER):
                kw = {} if dname == "ar" else {"drafters": [drafters[dname]]}
                before = engine.trace_count()
                first = engine.generate(target, prompts, max_new_tokens=NEW_TOKENS, mesh=mesh, **kw)
                again = engine.generate(target, prompts, max_new_tokens=NEW_TOKENS, mesh=mesh, **kw)
                emit(check="generate", target=tname, drafter=dname, mesh=list(shape), reference=ref,
                     first=first.sequences(), again=again.sequences(), traces=engine.trace_count() - before,
                     tau=float(first.stats["tau"].mean()) if dname != "ar" else None)
            if shape != LAYOUT_MESH:
                continue
            # Declared layouts: the parameters as placed, the cache and drafter state as the program keeps them.
            d = drafters["feature"]
            graphdef, state = nnx.split((target, d))
            batch = engine.prepare_prompts(prompts, target.config.vocab_size, NEW_TOKENS, slack=8)
            rules = (family(target).PARTITION_RULES, d.partition_rules)
            placed, prompt, lengths = engine._placed(mesh, state, rules, batch, ())
            declared = jax.tree_util.tree_map_with_path(
                lambda kp, _: sharding.spec_for(sharding.path_str(kp[1:]), rules[kp[0].key]), state)
            with sharding.mesh_context(mesh):
                carry = jax.jit(lambda st, p, n: engine.spec_start(
                    *nnx.merge(graphdef, st), p, n, engine.SamplingParams.make(0.0, 0, 1.0), jax.random.key(0),
                    jax.numpy.asarray([-1]), capacity=batch.capacity, max_new_tokens=NEW_TOKENS,
                    spec=d.resolve_tree(engine.tree_lib.parse_tree_spec("chain=4")), greedy=True))(placed, prompt,
                                                                                                  lengths)
            B = len(prompts)
            groups = {"params": (placed, declared), "cache": (carry.cache, family(target).cache_partition(carry.cache)),
                      "dstate": (carry.dstate, d.state_partition(carry.dstate, B)), "prompt": (prompt, sharding.BATCH),
                      "root": (carry.root, sharding.BATCH)}
            checked, wrong, sample = 0, [], {}
            for group, (tree, specs) in groups.items():
                want = sharding.shardings(specs, tree, mesh)
                for (kp, x), w in zip(jax.tree_util.tree_flatten_with_path(tree)[0], jax.tree.leaves(want)):
                    path = "/".join(filter(None, (group, sharding.path_str(kp))))
                    checked += 1
                    sample[path] = _spec(x)
                    if not x.sharding.is_equivalent_to(w, x.ndim):
                        wrong.append(f"{path}: {x.sharding.spec} declared {w.spec}")
            emit(check="layout", target=tname, mesh=list(shape), checked=checked, wrong=wrong, sample=sample)


def composite() -> None:
    """A wrapped block drafter is placed on mesh (2,4) like the bare one (AdaptiveShape, TreeGraft,
    Switch forward `partition_rules`), and FOLD composes through TreeGraft: greedy output on the mesh equals
    one device's autoregressive output."""
    import jax
    from flax import nnx

    from helpers import noisy_copy, tiny_target
    from specjax.engine import loop as engine
    from specjax.models import sharding
    from specjax.spec import widths
    from specjax.drafters.composite.adaptive import AdaptiveShape
    from specjax.drafters import BlockConfig, BlockDrafter, BlockHead, LMDrafter, NgramDrafter
    from specjax.models.fold import FoldConfig
    from specjax.models import family
    from specjax.drafters.composite.treegraft import Switch
    from specjax.drafters.composite.treegraft import TreeGraft
    assert len(jax.devices()) == 8, jax.devices()
    target = tiny_target(160, seed=0)
    prompts = _prompts(target.config.vocab_size)
    mesh = sharding.make_mesh(2, 4)
    bare = BlockDrafter(BlockHead(BlockConfig.for_target(target.config, block_size=4, num_layers=1, markov_rank=8,
                                                         target_layers=(0, 1)), nnx.Rngs(1)), target)
    batch = engine.prepare_prompts(prompts, target.config.vocab_size, NEW_TOKENS, slack=16)

    def layout(d, under: str) -> dict:
        """The block head's parameters as placed: {path below the head: spec}."""
        _, state = nnx.split((target, d))
        placed, _, _ = engine._placed(mesh, state, (family(target).PARTITION_RULES, d.partition_rules), batch, ())
        out = {}
        for kp, x in jax.tree_util.tree_flatten_with_path(placed[1])[0]:
            path = sharding.path_str(kp)
            if path.startswith(under + "head/"):
                out[path[len(under):]] = _spec(x)
        return out

    wrapped = {"adaptive": (AdaptiveShape(bare, (1.0,) * len(widths.adaptive_widths(5))), "inner/"),
               "treegraft": (TreeGraft(NgramDrafter(), bare), "strong/"),
               "switch": (Switch(NgramDrafter(), bare), "strong/")}
    ref_layout = layout(bare, "")
    for name, (d, under) in wrapped.items():
        emit(check="composite-layout", wrapper=name, bare=ref_layout, wrapped=layout(d, under))
    folded = TreeGraft(NgramDrafter(), LMDrafter(noisy_copy(target, 0.05, 1))).with_fold(
        FoldConfig(sinks=1, window=4, chunk=8))
    ref = engine.generate(target, prompts, max_new_tokens=NEW_TOKENS).sequences()
    got = engine.generate(target, prompts, max_new_tokens=NEW_TOKENS, mesh=mesh, drafters=[folded])
    emit(check="composite-fold", strong_fold=folded.strong.fold is not None, cheap=folded.cheap.name,
         reference=ref, got=got.sequences(), tau=float(got.stats["tau"].mean()))


def distributed() -> None:
    from specjax.models import sharding
    assert sharding.initialize_distributed()
    import jax

    from specjax.engine import loop as engine
    target, drafters = _targets()["dense"]
    prompts = _prompts(target.config.vocab_size)
    mesh = sharding.make_mesh(2, 4)  # over both processes' devices
    out = {"process": jax.process_index(), "processes": jax.process_count(), "devices": len(jax.devices()),
           "local_devices": len(jax.local_devices())}
    for dname in ("ar", "lm"):  # the test compares them with one device's, computed in its own process
        kw = {} if dname == "ar" else {"drafters": [drafters[dname]]}
        out[dname] = engine.generate(target, prompts, max_new_tokens=NEW_TOKENS, mesh=mesh, **kw).sequences()
    emit(check="distributed", **out)


def train(config_path: str, run_dir: str) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from specjax.models import sharding
    from train import lm
    assert len(jax.devices()) == 8
    cfg = lm.load_config(config_path)
    _, _, train_step, _ = lm._step_fns(cfg)
    from tokenizers import Tokenizer
    streams = lm.load_streams(cfg, Tokenizer.from_file(cfg.tokenizer), None)
    rules = lm.family_rules(cfg.model)
    curves = {}
    for name, shape in (("one", None), ("mesh", (2, 4))):
        mesh = None if shape is None else sharding.make_mesh(*shape)
        with sharding.mesh_context(mesh):
            state = sharding.place_params(lm.init_state(cfg), rules, mesh)
            losses = []
            for step in range(20):
                batch = lm.step_batch(cfg, streams.train, step)
                batch = jnp.asarray(batch) if mesh is None else sharding.place(batch, lm.BATCH_AxMxT1, mesh)
                state, m = train_step(state, batch)
                losses.append(float(m["loss"]))
        curves[name] = losses
        if shape is None:
            one_device = state
        if shape == (2, 4):  # parameters and their Adam moments, as laid out after 20 steps
            emit(check="train-layout", specs={sharding.path_str(kp): _spec(x) for kp, x in
                                              jax.tree_util.tree_flatten_with_path(state)[0] if "layers/0/" in
                                              sharding.path_str(kp)})
    emit(check="train-curves", **curves)
    # The trainer itself on the mesh: 10 steps saved sharded, then resumed on one device to step 20,
    # against the 20 steps above on one device (the same batches: a batch is a function of the step).
    lm.train(cfg, run_dir, None, max_steps=10, progress=False, mesh=sharding.make_mesh(2, 4))
    resumed = lm.train(cfg, run_dir, None, max_steps=20, progress=False)
    diff = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
               for a, b in zip(jax.tree.leaves(resumed["params"]), jax.tree.leaves(one_device["params"])))
    devices = {str(d) for x in jax.tree.leaves(resumed["params"]) for d in x.devices()}
    emit(check="train-resume", step=int(resumed["step"]), max_param_diff=diff, devices=sorted(devices))

    # The drafter trainers on the mesh: 2 steps of the feature (EAGLE-3) and block (DSpark) trainers on
    # the LM just trained (exported by the LM trainer), against the same 3 steps on one device.
    from tokenizers import Tokenizer as Tok

    from train import block, feature
    target_dir = run_dir + "-export"
    lm.export(cfg, resumed["params"], Tok.from_file(cfg.tokenizer), Path(target_dir), {"steps": 20})
    # 2 of 3 steps: no validation pass (its compile is not what is tested here)
    common = dict(target=target_dir, seq_len=32, batch_size=8, steps=3, warmup_steps=1, checkpoint_every=2,
                  eval_every=100, eval_tokens=256, manifest=cfg.corpus.manifest, corpus_root=cfg.corpus.root)
    for name, trainer, tcfg in (
            ("feature", feature, feature.FeatureTrainConfig(name="mesh-feature", ttt_steps=2, **common)),
            ("block", block, block.BlockTrainConfig(name="mesh-block", block_size=4, num_layers=1, markov_rank=8,
                                                    anchors=4, **common))):
        states = {where: trainer.train(tcfg, f"{run_dir}-{name}-{where}", max_steps=2, progress=False,
                                       mesh=None if where == "one" else sharding.make_mesh(2, 4))
                  for where in ("one", "mesh")}
        diff = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                   for a, b in zip(jax.tree.leaves(states["one"]["params"]), jax.tree.leaves(states["mesh"]["params"])))
        sharded = sum(not x.sharding.is_fully_replicated for x in jax.tree.leaves(states["mesh"]["params"]))
        emit(check=f"train-{name}", step=int(states["mesh"]["step"]), max_param_diff=diff, sharded_params=sharded)


if __name__ == "__main__":
    {"generate": generate, "composite": composite, "distributed": distributed, "train": train}[sys.argv[1]](*sys.argv[2:])
