"""Trains an MTP module post hoc on a frozen target (design §5f, `specjax/drafters/mtp.py`).

Each batch runs the frozen target once for its last hidden state (after the final norm: what its LM
head reads) and its next-token distributions. The module is trained as it drafts (training-time
test, `mtp.ttt_logits`): step 1 at every position p predicts t_{p+2} from (h_p, t_{p+1}); steps
2..k feed the module's own output back (layer (k-1) mod n), each seeing what it sees when drafting.
Loss: soft cross-entropy to the target's distribution of the predicted token (`loss: "distill"`,
the default: what acceptance rewards), or cross-entropy on the data's own token (`loss: "tokens"`),
per step weighted by `depth_decay ** (step - 1)` (`ttt_steps: 1` is the plain t_{i+2} objective).
Same machinery as `train.feature` (`drafter_run.run_unrolled`): AdamW with warm-up + cosine, orbax
checkpoints (resumable, same data order), validation to metrics.jsonl, and the export: the `mtp.*`
tensors in Qwen3-Next's names, bf16, in a directory of their own (`drafter_config.json` +
`model.safetensors`, and `token_ranking.safetensors`: the target's tokens by their count in the training
split, for a reduced draft vocabulary); `specjax.drafters.mtp.merge_into_target` copies them into the target's own
safetensors, where `--drafter mtp` finds them (its weight digest, which excludes `mtp.*`, is unchanged).

    python -m train.mtp --config configs/code-target-mtp.json --run-dir runs/code-target-mtp \\
        --export models/code-target-mtp
"""
from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.io.checkpoint import load_model, load_tokenizer
from specjax.drafters import mtp as M, vocab
from specjax.models import family, transformer
from train import drafter_run
from train.lm import load_streams_for
from train.common import REPO, resolve

LOSSES = ("distill", "tokens")


@dataclasses.dataclass(frozen=True)
class MTPTrainConfig:
    name: str
    target: str  # the target's Hugging Face directory
    num_layers: int = 1  # MTP layers (Qwen3-Next and DeepSeek-V3 ship one)
    ttt_steps: int = 4  # unrolled steps (1: only t_{i+2})
    depth_decay: float = 0.8
    loss: str = "distill"  # "distill": the target's distribution; "tokens": the data's token
    seq_len: int = 512
    batch_size: int = 8
    steps: int = 300
    seed: int = 0
    learning_rate: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 30
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    checkpoint_every: int = 50
    eval_every: int = 100
    eval_tokens: int = 16384
    manifest: str = "train/manifest.json"
    corpus_root: str | None = None  # None: this interpreter's stdlib
    max_files: int | None = None  # per split (tests)
    # An offline target cache holding the target's last layer (`train.target_cache`, a superset of layers
    # is fine): steps read h and the target's top-k from it instead of running the target. None: online.
    cache: str | None = None
    # Start the MTP layers from the target's top attention layer, fc passing h through (`start_from_target`).
    init_from_target: bool = False
    # EAGLE-3's reduced draft vocabulary in training: the head is trained on the N most frequent tokens of
    # the training stream (the cache's windows where there is one), the target's distribution
    # renormalised over them; the export's ranking is that one. None: all V (the ranking: the corpus's).
    draft_vocab: int | None = None

    def __post_init__(self):
        if self.loss == "tokens" and self.cache:
            raise ValueError('loss "tokens" reads the data\'s tokens; with a cache use loss "distill"')
        if self.loss == "tokens" and self.draft_vocab:
            raise ValueError('loss "tokens" predicts any token; a reduced draft_vocab needs loss "distill"')
        if self.loss not in LOSSES:
            raise ValueError(f"loss {self.loss!r}: expected one of {LOSSES}")
        if self.num_layers < 1 or self.ttt_steps < 1:
            raise ValueError(f"num_layers and ttt_steps must be >= 1, got {self.num_layers} / {self.ttt_steps}")


def load_config(path) -> MTPTrainConfig:
    return drafter_run.load_config(MTPTrainConfig, path)


def mtp_loss(head: M.MTPHead, target, tokens_BxT, decay: float, steps: int, loss: str = "distill",
             cached: dict | None = None, vocab_ids=None):
    """(weighted loss, (per-step loss [K], per-step top-1 agreement with the target [K])). `cached`: the
    batch's offline target cache (the last layer's output, the top-k), in place of the target's pass.
    `vocab_ids` [N]: a reduced draft vocabulary (the loss and the agreement over those tokens)."""
    B, T = tokens_BxT.shape
    if cached is None:
        fam = family(target)
        out = fam.forward(target, tokens_BxT, jnp.broadcast_to(jnp.arange(T)[None], (B, T)), fam.init_cache(target, B, T),
                          transformer.causal_mask(B, T), hidden_layers=head.config.target_layers)
        feats, t_logits = out.hidden[0], out.logits
    else:
        feats = cached["features"].astype(head.fc.weight.dtype)
        t_logits = (cached["topk_ids"], cached["topk_logp"])  # sparse: no [B, T, V] target is built
    h = jax.lax.stop_gradient(M.target_hidden(target, feats))
    if vocab_ids is not None:
        rows = jax.lax.stop_gradient(vocab.head_rows(target, vocab_ids))  # [N, E]
        logits = M.ttt_logits(head, target, tokens_BxT, h, steps, rows)  # [K, B, T, N]
        t_logits = drafter_run.draft_vocab_target(t_logits, vocab_ids, head.config.vocab_size)
        return drafter_run.unrolled_loss(logits, jax.lax.stop_gradient(t_logits), decay)
    logits = M.ttt_logits(head, target, tokens_BxT, h, steps)  # [K, B, T, V]
    return drafter_run.unrolled_loss(logits, jax.lax.stop_gradient(t_logits), decay,
                                     tokens_BxT if loss == "tokens" else None)


def start_from_target(head: M.MTPHead, target) -> None:
    """Issue 43's initialisation: every MTP layer a copy of the target's top attention layer (a
    hybrid's last full-attention layer), the final norm the target's, and `fc` passing h through
    (its embedding half zero), so step 0 runs the target's top layer once more over h."""
    src = next((layer for layer in reversed(list(target.layers)) if getattr(layer, "self_attn", None) is not None), None)
    if src is None:
        raise ValueError("init_from_target: the target has no attention layer to copy")
    dt = head.fc.weight.dtype
    copy = lambda x: jnp.array(x, dt)  # noqa: E731  (a copy: the training state is donated)
    for layer in head.layers:
        nnx.update(layer, jax.tree.map(copy, nnx.state(src, nnx.Param)))
    head.norm.weight.set_value(copy(target.norm.weight.get_value()))
    E = head.config.hidden_size
    head.fc.weight.set_value(jnp.zeros((2 * E, E), dt).at[E:].set(jnp.eye(E, dtype=dt)))


@functools.lru_cache(maxsize=4)
def _fns(cfg: MTPTrainConfig, target_dir: str, vocab_ids: tuple[int, ...] | None = None, weights: str = "float32"):
    target = load_model(target_dir, weights=weights)
    hcfg = M.MTPConfig.for_target(target.config, cfg.num_layers)
    head_def = nnx.graphdef(nnx.eval_shape(lambda: M.MTPHead(hcfg, target.config, nnx.Rngs(0))))
    tgt_def, tgt_params = nnx.split(target)

    def loss_of(params, tokens, cached=None):
        return mtp_loss(nnx.merge(head_def, params), nnx.merge(tgt_def, tgt_params), tokens, cfg.depth_decay,
                        cfg.ttt_steps, cfg.loss, cached, None if vocab_ids is None else jnp.asarray(vocab_ids))

    def init_params():
        head = M.MTPHead(hcfg, target.config, nnx.Rngs(cfg.seed))
        if cfg.init_from_target:
            start_from_target(head, target if weights == "float32" else load_model(target_dir))  # from the float weights
        return nnx.state(head, nnx.Param)

    return target, head_def, *drafter_run.unrolled_steps(cfg, loss_of, init_params, RULES)


def training_ranking(cfg: MTPTrainConfig, run_dir) -> np.ndarray:
    """The target's tokens by their count in the training split (the reduced draft vocabulary's
    ranking, `specjax.drafters.vocab`): int32 [V]."""
    target_dir = resolve(cfg.target)
    streams = load_streams_for(load_tokenizer(str(target_dir)), cfg.manifest, cfg.corpus_root, cfg.max_files,
                               Path(run_dir) / "token-cache")
    return vocab.token_ranking(streams.train, _fns(cfg, str(target_dir))[0].config.vocab_size)


RULES = M.MTPDrafter.partition_rules  # the module's layout on a mesh: its layer has the dense names


@drafter_run.on_mesh
def train(cfg: MTPTrainConfig, run_dir, export_dir=None, *, max_steps=None, overwrite=False, progress=True, mesh=None):
    """Trains (or resumes) the module; exports when finished. `mesh`: as `train.feature`'s."""
    target_dir = str(resolve(cfg.target))
    ranking, ids = (drafter_run.draft_ranking(cfg, drafter_run.train_stream(cfg, run_dir), target_dir)
                    if cfg.draft_vocab is not None else (None, None))  # the N most frequent tokens it trains on
    target, head_def, train_step, eval_step, init = _fns(cfg, target_dir, ids, drafter_run.target_weights(cfg))

    def save(params, d):
        M.save_mtp_head(nnx.merge(head_def, params), str(d))
        vocab.save_ranking(str(d), training_ranking(cfg, run_dir) if ranking is None else ranking)

    return drafter_run.run_unrolled(cfg, run_dir, export_dir, train_step, eval_step, init, RULES, save,
                                    max_steps=max_steps, overwrite=overwrite, progress=progress, mesh=mesh,
                                    cache_layers=(target.config.num_layers - 1,))


def main(argv=None):
    drafter_run.main(__doc__, load_config, train, argv)


if __name__ == "__main__":
    jax.config.update("jax_compilation_cache_dir", str(REPO / "runs" / "jax-cache"))
    main()
