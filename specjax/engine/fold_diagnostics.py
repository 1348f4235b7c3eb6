"""FOLD diagnostics (design §7): the attention entropy and the mass on far keys of a FOLD
drafter's first draft step, recomputed from the reference definition while the drafter runs
(`fold.recording`). Used by `python -m tools.bench_long` to explain τ against context length."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.engine import loop as engine
from specjax.models import fold as fold_lib
from specjax.spec import tree as tree_lib
from specjax.drafters.base import DraftContext
from specjax.models import family
from specjax.models import prefill as prefill_lib
from specjax.spec.sampling import SamplingParams


def attention_diagnostics(target, drafter, prompts, *, seed: int = 0) -> dict:
    """Attention entropy and mass on far keys of a FOLD drafter's first draft step (the root
    query, every layer) after prefilling `prompts` (token-id lists, a ragged batch).

    The drafter must have FOLD on; for the plain drafter's numbers use
    `FoldConfig(..., fold_positions=False, sharpen=0)`, which computes the plain attention while
    still labelling the far keys. Returns {"entropy", "far_mass", "total"} (means over rows and
    layers, floats) and "per_layer" ([layers] lists)."""
    if getattr(drafter, "fold", None) is None:
        raise ValueError("attention_diagnostics needs a drafter with FOLD on (see its docstring for the plain one)")
    spec = tree_lib.chain(1)
    batch = engine.prepare_prompts(prompts, target.config.vocab_size, 1, slack=spec.num_nodes + 3)
    graphdef, state = nnx.split((target, drafter))

    @jax.jit
    def run(state, tokens, lengths):
        tgt, dr = nnx.merge(graphdef, state)
        fam = family(tgt)
        B = tokens.shape[0]
        cache = fam.init_cache(tgt, B, batch.capacity)
        out = prefill_lib.prefill(fam, tgt, tokens, lengths, cache, hidden_layers=tuple(dr.target_layers))
        root = jnp.argmax(engine.last_logits(out.logits, lengths), -1).astype(jnp.int32)
        dstate = dr.init(tokens, lengths, batch.capacity, out)
        ctx = DraftContext(spec, "topk", SamplingParams.make(0.0, 0, 1.0), jax.random.key(seed))
        with fold_lib.recording() as rec:
            dr.propose(dstate, root, ctx)
        return rec

    rec = run(state, jnp.asarray(batch.tokens), jnp.asarray(batch.lengths))
    out = {}
    for name in ("entropy", "far_mass", "total"):
        per_layer = [float(np.mean(np.asarray(r[name]))) for r in rec]
        out[name] = float(np.mean(per_layer))
        out["per_layer_" + name] = per_layer
    return out
