"""The feature (EAGLE-3) drafter's drafting pass equals its training pass (`feature.ttt_logits`), with a
commit in between, as tests/test_block.py and tests/test_mtp.py check for theirs."""
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from helpers import tiny_target
from specjax.drafters import feature as F
from specjax.drafters.base import Committed, DraftContext
from specjax.models import transformer
from specjax.spec.sampling import SamplingParams
from specjax.spec.tree import parse_tree_spec

VOCAB = 96


def _features(target, toks_BxT, layers):
    B, T = toks_BxT.shape
    out = transformer.forward(target, toks_BxT, jnp.broadcast_to(jnp.arange(T)[None], (B, T)),
                              transformer.init_cache(target, B, T), transformer.causal_mask(B, T), hidden_layers=layers)
    return F.target_features(out)


def test_drafting_pass_equals_training_pass():
    """Prefill, one round's commit (the root and two accepted draft tokens, with the target's features
    along them), then a greedy chain: q at each node equals `ttt_logits` at the last committed position
    over the sequence that continues with the chain."""
    target = tiny_target(VOCAB, seed=0)
    head = F.FeatureHead(F.FeatureConfig.for_target(target.config, target_layers=(0, 1)), nnx.Rngs(3))
    d = F.FeatureDrafter(head, target)
    seq = jnp.asarray(np.random.default_rng(1).integers(0, VOCAB, (1, 16)))
    feats = _features(target, seq, d.target_layers)
    p0 = 7  # the prompt: tokens 0..6; the round's root is token 7
    pre = transformer.prefill(target, seq[:, :p0], jnp.asarray([p0]), transformer.init_cache(target, 1, 32),
                              hidden_layers=d.target_layers)
    state = d.init(seq[:, :p0], jnp.asarray([p0]), 32, pre)
    n = 3  # the root and two accepted draft tokens, committed with the target's features along them
    state = d.commit(state, Committed(tokens=seq[:, p0:p0 + 4], count=jnp.asarray([n]), features=feats[:, p0:p0 + 4]))
    a = p0 + n - 1  # the last committed position; the next root is token a + 1
    ctx = DraftContext(parse_tree_spec("chain=4"), "topk", SamplingParams.make(0.0), jax.random.key(0))
    prop = d.propose(state, seq[:, a + 1], ctx)
    full = jnp.concatenate([seq[:, :a + 1], prop.tree.tokens], axis=1)  # committed, root, the drafted chain
    logits = F.ttt_logits(head, target, full, _features(target, full, d.target_layers), 4)
    np.testing.assert_allclose(np.asarray(jax.nn.softmax(logits[:, 0, a], -1)), np.asarray(prop.probs[0, :4]),
                               atol=1e-5)
