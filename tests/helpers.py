"""Test helpers shared by the generation tests (and, later, the speculative-decoding tests).

`compare_greedy` tells an honest near-tie from a real mismatch: two greedy decoders may part
ways where the reference's top-2 logits are within float noise of each other; anywhere else a
differing token is a bug.
"""
from __future__ import annotations

import contextlib
import functools
import math
import warnings
from typing import Callable, Sequence

import numpy as np

NEAR_TIE_TOL = 1e-4


class NearTieWarning(UserWarning):
    """Two greedy decodings parted at a position where the top logits are within tolerance."""


def _rows(tokens) -> list[list[int]]:
    if len(tokens) and np.ndim(tokens[0]) == 0:  # one sequence, not a batch of them
        return [[int(t) for t in tokens]]
    return [[int(t) for t in row] for row in tokens]


def compare_greedy(reference_tokens: Sequence, candidate_tokens: Sequence,
                   logits_fn_for_prefix: Callable[[int, list[int]], np.ndarray],
                   *, tol: float = NEAR_TIE_TOL) -> tuple[int, int]:
    """Compares greedy generations row by row.

    reference_tokens, candidate_tokens: one sequence of generated token ids, or a batch (a list
      of rows); each row holds only the generated tokens (no prompt, no padding).
    logits_fn_for_prefix(row, generated_prefix) -> [V] reference logits for the token that
      follows the row's prompt + generated_prefix.

    Returns (n_exact, n_near_tie): rows identical, and rows that part at a position where the
    reference logits of both tokens are within `tol` of the maximum (an honest near-tie: after it
    the two continuations cannot be compared). Each near-tie is reported with a NearTieWarning.
    Raises AssertionError on any other difference, including a length difference.
    """
    ref_rows, cand_rows = _rows(reference_tokens), _rows(candidate_tokens)
    if len(ref_rows) != len(cand_rows):
        raise AssertionError(f"batch sizes differ: reference {len(ref_rows)} rows, candidate {len(cand_rows)}")
    n_exact = n_near = 0
    for row, (ref, cand) in enumerate(zip(ref_rows, cand_rows)):
        if ref == cand:
            n_exact += 1
            continue
        common = min(len(ref), len(cand))
        diff = next((i for i in range(common) if ref[i] != cand[i]), None)
        if diff is None:
            raise AssertionError(f"row {row}: the generations agree on their first {common} tokens but have "
                                 f"lengths {len(ref)} (reference) and {len(cand)} (candidate)")
        logits = np.asarray(logits_fn_for_prefix(row, ref[:diff]), np.float64).reshape(-1)
        top = float(logits.max())
        gap_ref, gap_cand = top - logits[ref[diff]], top - logits[cand[diff]]
        top2 = np.sort(logits)[-2:][::-1]
        where = (f"row {row}, generated position {diff}: reference token {ref[diff]} (logit gap to max "
                 f"{gap_ref:.3g}), candidate token {cand[diff]} (gap {gap_cand:.3g}); top-2 logits {top2.tolist()}")
        if gap_ref <= tol and gap_cand <= tol:
            n_near += 1
            msg = f"honest near-tie at {where}"
            print(msg)
            warnings.warn(msg, NearTieWarning, stacklevel=2)
        else:
            raise AssertionError(f"greedy mismatch at {where}\n  reference: {ref}\n  candidate: {cand}")
    return n_exact, n_near


# Chi-square goodness of fit. scipy is not a dependency of specjax: the critical value at
# alpha = 1e-6 uses the Wilson–Hilferty approximation, which over-estimates the exact quantile
# for small df (it errs toward passing; the power tests show wrong rules land far above it).
ALPHA_Z = 4.753424308822899  # standard normal upper quantile at 1e-6


def chi_square(counts, probs, min_expected=5.0):
    """(statistic, df, critical value at 1e-6). Cells with zero probability must stay empty
    (any draw there gives an infinite statistic); cells expected below `min_expected` are pooled."""
    counts = np.asarray(counts, np.float64)
    probs = np.asarray(probs, np.float64)
    n = counts.sum()
    if np.any(counts[probs == 0] > 0):
        return math.inf, 0, 0.0
    exp = n * probs[probs > 0]
    obs = counts[probs > 0]
    small = exp < min_expected
    if small.any():
        exp = np.append(exp[~small], exp[small].sum())
        obs = np.append(obs[~small], obs[small].sum())
    df = exp.size - 1
    stat = float(np.sum((obs - exp) ** 2 / exp))
    if df == 0:
        return stat, 0, 0.0
    crit = df * (1 - 2 / (9 * df) + ALPHA_Z * math.sqrt(2 / (9 * df))) ** 3
    return stat, df, crit


# Tiny models shared by the speculative-decoding tests: one definition of each, built once per
# process (`functools.cache`: every module that asks for the same arguments gets the same object).
# The models are read-only: a test that changes weights builds its own model, or changes a copy.

@functools.cache
def tiny_target(vocab: int, seed: int = 0):
    """A random 2-layer Llama-style target (O(1) logits: few near-ties). Shared: do not modify."""
    from specjax.models import transformer
    from specjax.models.config import ModelConfig
    cfg = ModelConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, max_position_embeddings=512)
    return transformer.init_model(cfg, seed=seed)


def tiny_hybrid_config(vocab: int = 64, num_layers: int = 3, **overrides):
    """The tiny hybrid (Qwen3-Next-style) target's config: linear-attention layers around one
    full-attention layer (2 layers: linear, full; 3: linear, full, linear). `overrides`: other fields."""
    from specjax.models.config import HybridConfig
    fields = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_layers=num_layers, num_heads=4,
                  num_kv_heads=2, head_dim=16,
                  layer_types=("linear_attention", "full_attention", "linear_attention")[:num_layers],
                  linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
                  partial_rotary_factor=0.5, max_position_embeddings=512)
    return HybridConfig(**{**fields, **overrides})


@functools.cache
def tiny_hybrid(vocab: int = 64, num_layers: int = 3, seed: int = 1):
    """A random hybrid target of `tiny_hybrid_config(vocab, num_layers)`. Shared: do not modify."""
    from specjax.models import hybrid
    return hybrid.init_model(tiny_hybrid_config(vocab, num_layers), seed=seed)


@functools.cache
def noisy_lm_drafter(vocab: int, scale: float = 0.1, seed: int = 9):
    """An lm drafter on `noisy_copy(tiny_target(vocab), scale, seed)`: partial, row-varying acceptance.
    Shared: do not modify."""
    from specjax.drafters import LMDrafter
    return LMDrafter(noisy_copy(tiny_target(vocab), scale, seed))


def noisy_copy(model, scale: float, seed: int):
    """The model's weights plus noise (numpy: nothing to compile). Agrees with it often, not always:
    a drafter with partial, row-varying acceptance."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    graphdef, state = nnx.split(model)
    rng = np.random.default_rng(seed)
    noisy = jax.tree.map(lambda x: jnp.asarray(np.asarray(x) + scale * np.std(np.asarray(x))
                                               * rng.normal(size=x.shape), x.dtype), state)
    return nnx.merge(graphdef, noisy)


@functools.cache
def tiny_drafter_model(vocab: int, seed: int = 5):
    """An independent 1-layer random LM with the same vocabulary (rarely agrees with the target).
    Shared: do not modify."""
    from specjax.models import transformer
    from specjax.models.config import ModelConfig
    cfg = ModelConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=16)
    return transformer.init_model(cfg, seed=seed)


def train_block_on_own_outputs(target, head, tc, anchors_fn, steps: int, seed: int, vocab: int):
    """A tiny block drafter (`head`) trained with train.block's loss (`tc`) on the target's own
    greedy continuations of random prompts (partial, row-varying acceptance). `anchors_fn(key, B, T)`
    draws each step's anchors. Returns (trained head, data [24, 40])."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    import specjax
    from train.block import block_loss
    rng = np.random.default_rng(seed)
    prompts = rng.integers(0, vocab, (24, 6)).tolist()
    res = specjax.generate(target, prompts, max_new_tokens=34)
    data = np.array([p + s for p, s in zip(prompts, res.sequences())], np.int32)
    gdef, params, consts = nnx.split(head, nnx.Param, ...)  # consts: a draft vocabulary's ids, if any
    tx = optax.adam(3e-3)

    @jax.jit
    def step(params, opt, key):
        anchors = anchors_fn(key, data.shape[0], data.shape[1])
        g = jax.grad(lambda p: block_loss(nnx.merge(gdef, p, consts), target, jnp.asarray(data), anchors, tc)[0])(params)
        u, opt = tx.update(g, opt, params)
        return optax.apply_updates(params, u), opt

    opt = tx.init(params)
    for i in range(steps):
        params, opt = step(params, opt, jax.random.key(i))
    return nnx.merge(gdef, params, consts), data


@functools.cache
def trained_dspark(vocab: int = 64, hybrid_layers: int = 0, steps: int = 100, seed: int = 0, block_size: int = 4):
    """A tiny DSpark drafter (1 layer, Markov rank 16) trained with train.block's loss on its target's
    own greedy continuations (`train_block_on_own_outputs`): on those prompts it is right often, not
    always. The target: `tiny_target(vocab)`, or `tiny_hybrid(vocab, hybrid_layers)` when
    `hybrid_layers` > 0. Returns (target, head, data [24, 40]). Shared: do not modify."""
    from flax import nnx

    from specjax.drafters.block import BlockConfig, BlockHead
    from train.block import BlockTrainConfig, sample_anchors
    target = tiny_hybrid(vocab, hybrid_layers) if hybrid_layers else tiny_target(vocab)
    cfg = BlockConfig.for_target(target.config, block_size=block_size, num_layers=1, markov_rank=16)
    head, data = train_block_on_own_outputs(
        target, BlockHead(cfg, nnx.Rngs(seed)), BlockTrainConfig(name="t", target="t", anchors=8),
        lambda key, B, T: sample_anchors(key, B, T, 8, block_size), steps, seed, vocab)
    return target, head, data


def first_two_chi_squares(first, second, n, p0, p1, V: int, min_rows: int = 2000) -> list[tuple]:
    """(stat, df, critical value at 1e-6) of the first two emitted tokens of many rounds against the
    target: the first token over all rows against softmax(p0), the second given each first token x
    against softmax(p1[x]) where at least `min_rows` rows accepted x. `n`: accepted draft tokens per row."""
    soft = lambda x: np.exp(x - x.max(-1, keepdims=True)) / np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)  # noqa: E731
    out = [chi_square(np.bincount(first, minlength=V), soft(np.asarray(p0)))]
    out += [chi_square(np.bincount(second[(n >= 1) & (first == x1)], minlength=V), soft(np.asarray(p1[x1])))
            for x1 in range(V) if ((n >= 1) & (first == x1)).sum() >= min_rows]
    return out


def assert_first_two_follow(first, second, n, p0, p1, V: int, min_rows: int = 2000):
    """`first_two_chi_squares`, each within its critical value."""
    for i, (stat, df, crit) in enumerate(first_two_chi_squares(first, second, n, p0, p1, V, min_rows)):
        assert stat <= crit, f"{'first token' if i == 0 else 'second token'}: chi2 {stat:.1f} > {crit:.1f} (df {df})"


def spread_target(vocab: int = 8, seed: int = 4):
    """A tiny dense target whose next-token distributions spread (O(1) logits): the sampling tests'."""
    from specjax.models import transformer
    from specjax.models.config import ModelConfig
    tcfg = ModelConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                       num_kv_heads=1, head_dim=16, max_position_embeddings=64)
    target = transformer.init_model(tcfg, seed=seed)
    target.embed_tokens.set_value(target.embed_tokens.get_value() * 40)
    return target


def prefilled_state(drafter, target, prompt, capacity: int = 16):
    """The drafter's state after a prefill of one prompt (batch 1). One jitted program (run eagerly,
    the prefill and the drafter's init compile each of their many small ops, for every prompt length)."""
    import jax.numpy as jnp
    return _jitted_prefilled_state(capacity)(drafter, target, jnp.asarray([prompt]), jnp.asarray([len(prompt)]))


@functools.cache
def _jitted_prefilled_state(capacity: int):
    import jax

    from specjax.models import family

    def run(drafter, target, toks, n):
        fam = family(target)
        pre = fam.prefill(target, toks, n, fam.init_cache(target, 1, capacity), hidden_layers=tuple(drafter.target_layers))
        return drafter.init(toks, n, capacity, pre)
    return jax.jit(run)


def next_logits(target, seqs, capacity: int = 16) -> np.ndarray:
    """The target's logits [len(seqs), V] (float64) for the token after each sequence of `seqs` (token
    lists, up to `capacity` long): one jitted prefill of them all, right-padded to `capacity` (one
    compile per target, batch size and capacity, whatever the lengths)."""
    import jax.numpy as jnp
    n = np.asarray([len(s) for s in seqs], np.int32)
    toks = np.zeros((len(seqs), capacity), np.int32)
    for i, s in enumerate(seqs):
        toks[i, :len(s)] = s
    logits = _jitted_prefill_logits(capacity)(target, jnp.asarray(toks), jnp.asarray(n))
    return np.asarray(logits, np.float64)[np.arange(len(seqs)), n - 1]


def prefix_logits_fn(model, prompts):
    """`compare_greedy`'s reference: fn(row, generated_prefix) -> the model's logits [V] for the token
    after prompts[row] + generated_prefix (`next_logits`, padded to a multiple of 32: few compiles)."""
    def fn(row, prefix):
        ids = [int(t) for t in prompts[row]] + [int(t) for t in prefix]
        return next_logits(model, [ids], 32 * -(-(len(ids) + 1) // 32))[0]
    return fn


@functools.cache
def _jitted_prefill_logits(capacity: int):
    import jax

    from specjax.models import family

    def run(target, toks, n):
        fam = family(target)
        return fam.prefill(target, toks, n, fam.init_cache(target, toks.shape[0], capacity)).logits
    return jax.jit(run)


def full_features(target, toks_BxT, layers):
    """The target's fused hidden states at `layers` over the whole sequence (a causal forward) [B, T, F]:
    what a block drafter's training pass reads."""
    import jax.numpy as jnp

    from specjax.models import family
    fam = family(target)
    B, T = toks_BxT.shape
    out = fam.forward(target, toks_BxT, jnp.broadcast_to(jnp.arange(T)[None], (B, T)), fam.init_cache(target, B, T),
                      jnp.tril(jnp.ones((B, T, T), bool)), hidden_layers=layers)
    return jnp.concatenate(out.hidden, -1)


def stdlib_sample(base, want: dict, vocab_size: int = 300):
    """A fake stdlib of real stdlib files (any Python version) under `base/lib`, `want` files per split
    (small top-level modules), its manifest and a byte-level BPE tokenizer trained on its train split.
    Returns (root, manifest path, tokenizer path)."""
    import collections

    from train import corpus
    from train.tokenizer import train_tokenizer
    src, root = corpus.stdlib_root(), base / "lib"
    have = collections.Counter()
    for rel in corpus.list_files(src):
        split, size = corpus.split_of(rel), (src / rel).stat().st_size
        if "/" not in rel and 2_000 < size < 30_000 and have[split] < want[split]:
            try:
                text = (src / rel).read_text(encoding="utf-8")
            except UnicodeDecodeError:
                continue
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_text(text, encoding="utf-8")
            have[split] += 1
    assert have == collections.Counter(want), have
    manifest = base / "manifest.json"
    corpus.write_manifest(corpus.scan(root), manifest)
    tok = train_tokenizer(corpus.iter_texts("train", corpus.read_manifest(manifest), root), vocab_size=vocab_size)
    tok.save(str(base / "tokenizer.json"))
    return root, manifest, base / "tokenizer.json"


@contextlib.contextmanager
def cheap_compiles():
    """XLA's optimisation passes dominate the compile time of tiny models' many programs: skip them
    inside the block (results do not depend on it), then restore the setting."""
    import jax
    old = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", True)
    try:
        yield
    finally:
        jax.config.update("jax_disable_most_optimizations", old)


def word_model_dir(target, path: str) -> str:
    """`target` saved in `path` with a word-level tokenizer of a tiny code vocabulary ("def", "add",
    "(", ... then w0, w1, ...): a model directory the CLI loads, whose programs are the ones the tests
    compiled for `target` (same configuration and shapes)."""
    import specjax
    from tokenizers import Tokenizer, models, pre_tokenizers
    words = ["<unk>", "def", "add", "(", ")", ":", "a", "b", ",", "return", "+"] + [f"w{i}" for i in range(40)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    specjax.save_model(target, path, tokenizer=tok)
    return path
