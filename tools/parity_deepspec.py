"""DeepSpec's own modeling code against our loader: DeepSpec ships no package, so this reads its
`deepspec/` package from a repository snapshot (`--deepspec DIR`, e.g. `git archive` of
deepseek-ai/DeepSpec), builds a tiny random `Qwen3DSparkModel` (DSpark: Markov rank 8 and the
confidence head; DFlash: markov_rank 0) over a tiny 8-layer target, saves it with DeepSpec's
`save_pretrained`, loads the directory with `load_drafter`, and compares the block's logits (base
+ the Markov term through DeepSpec's `markov_head.apply_block_logits`) and confidence logits with
DeepSpec's `_forward_backbone` on the same context features, at several anchors; then checks
greedy `generate` with the loaded drafter against AR (batch 1 and 4, ragged).

    python -m tools.parity_deepspec --deepspec /path/to/DeepSpec --revision COMMIT --out bench/interop_parity_deepspec
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile

import jax.numpy as jnp
import numpy as np

import specjax
from specjax.io.checkpoint import save_model
from specjax.drafters import drafter_kind, load_drafter
from specjax.drafters.block import train_logits
from specjax.drafters.block.network import target_features
from specjax.models import family, transformer
from specjax.models.config import ModelConfig
from tools.harness import Column, run_meta, write_outputs

V, E, H, K, D, F, L, B = 64, 32, 4, 2, 8, 48, 8, 4
LAYERS = [1, 3, 4]


def _features(target, toks):
    fam = family(target)
    T = toks.shape[1]
    out = fam.forward(target, toks, jnp.arange(T)[None], fam.init_cache(target, 1, T), jnp.tril(jnp.ones((1, T, T), bool)),
                      hidden_layers=tuple(LAYERS))
    return target_features(out)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m tools.parity_deepspec", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--deepspec", required=True, help="a DeepSpec checkout (the directory holding deepspec/)")
    ap.add_argument("--revision", default=None, help="the snapshot's commit, recorded in the results")
    ap.add_argument("--out", default="bench/interop_parity_deepspec")
    args = ap.parse_args(argv)
    import torch  # the hf extra
    from transformers import Qwen3Config
    sys.path.insert(0, args.deepspec)  # DeepSpec's modeling code, read from its repository
    from deepspec.modeling.dspark.qwen3.modeling import Qwen3DSparkModel

    tdir = tempfile.mkdtemp()
    save_model(transformer.init_model(ModelConfig(vocab_size=V, hidden_size=E, intermediate_size=64, num_layers=L,
                                                  num_heads=H, num_kv_heads=K, head_dim=D), seed=3), tdir)
    target = specjax.load_model(tdir)
    emb = torch.tensor(np.asarray(target.embed_tokens[...], np.float32))
    lm = torch.tensor(np.asarray(target.lm_head.weight[...], np.float32).T)
    rows = []
    for name, rank in (("DSpark (Markov rank 8, confidence)", 8), ("DFlash (markov_rank 0)", 0)):
        torch.manual_seed(0)
        cfg = Qwen3Config(vocab_size=V, hidden_size=E, intermediate_size=F, num_hidden_layers=2, num_attention_heads=H,
                          num_key_value_heads=K, head_dim=D, rms_norm_eps=1e-5, rope_theta=10000.0,
                          max_position_embeddings=512, attention_bias=False, tie_word_embeddings=False)
        cfg.architectures = ["Qwen3DSparkModel"]
        extra = dict(num_target_layers=L, block_size=B, layer_types=["full_attention"] * 2, mask_token_id=V - 1,
                     target_layer_ids=LAYERS, num_anchors=8, enable_confidence_head=rank > 0, markov_rank=rank)
        if rank:
            extra.update(confidence_head_with_markov=True, markov_head_type="vanilla")
        for k, v in extra.items():
            setattr(cfg, k, v)
        cfg._attn_implementation = "eager"
        m = Qwen3DSparkModel(cfg).eval()
        with torch.no_grad():  # post_init sets the norms to one: randomise them, and the heads
            for n, p in m.named_parameters():
                if p.dim() == 1 and "norm" in n:
                    p.copy_(1 + 0.2 * torch.randn_like(p))
            m.embed_tokens.weight.copy_(emb)
            m.lm_head.weight.copy_(lm)
            if rank:
                m.markov_head.markov_w2.weight.normal_(0, 0.3)
                m.confidence_head.proj.weight.normal_(0, 0.3)
        d = tempfile.mkdtemp()
        m.save_pretrained(d)
        assert drafter_kind(d) == "deepspec", drafter_kind(d)
        drafter = load_drafter(d, target, target_path=tdir, tuned=False)
        toks = np.random.default_rng(0).integers(0, V - 1, (1, 24)).astype(np.int32)
        feats = _features(target, jnp.asarray(toks))
        worst_logits = worst_conf = 0.0
        for s in (3, 9, 15):
            tp = train_logits(drafter.head, target, jnp.asarray(toks), feats, jnp.asarray([[s]]))
            ids = torch.tensor(toks[:, s:s + B], dtype=torch.long)  # the labels' previous tokens: [x_s .. x_{s+B-1}]
            block = torch.tensor([[int(toks[0, s])] + [V - 1] * (B - 1)])
            with torch.no_grad():
                h = m._forward_backbone(position_ids=torch.arange(s + B)[None], noise_embedding=m.embed_tokens(block),
                                        target_hidden_states=torch.tensor(np.asarray(feats[:, :s])), attention_mask=None,
                                        is_causal=False)
                base = m.compute_logits(h)
                if rank:
                    ref = m.markov_head.apply_block_logits(base[:, None], token_ids=ids[:, None], hidden_states=h[:, None])[:, 0]
                    conf = m.predict_confidence_step(h, prev_token_ids=ids)
                else:
                    ref, conf = base, None
            ours = np.asarray(tp.logits[0, 0] if rank else tp.base[0, 0])
            worst_logits = max(worst_logits, float(np.max(np.abs(ours - ref[0].numpy()))))
            if conf is not None:
                worst_conf = max(worst_conf, float(np.max(np.abs(np.asarray(tp.conf[0, 0]) - conf.reshape(-1).numpy()))))
        greedy = []
        for batch in (1, 4):
            prompts = [toks[0, :n].tolist() for n in (6, 11, 8, 14)[:batch]]
            ref_seq = specjax.generate(target, prompts, max_new_tokens=16).sequences()
            greedy.append(specjax.generate(target, prompts, max_new_tokens=16, drafters=[drafter]).sequences() == ref_seq)
        row = {"drafter": name, "anchors": 3, "max_abs_logits": worst_logits,
               "max_abs_confidence": worst_conf if rank else None, "greedy_equals_ar_b1_b4": all(greedy)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    cols = [Column("drafter (DeepSpec Qwen3DSparkModel)", "drafter", right=False), Column("anchors", "anchors"),
            Column("max abs Δ logits", "max_abs_logits", "{:.2e}"),
            Column("max abs Δ confidence", lambda r: "" if r["max_abs_confidence"] is None else f"{r['max_abs_confidence']:.2e}"),
            Column("greedy = AR (batch 1, 4)", "greedy_equals_ar_b1_b4", right=False)]
    write_outputs(args.out, run_meta("parity_deepspec", argv, deepspec_revision=args.revision), rows, cols,
                  title="DeepSpec's own modeling code against specjax's loader (float32, tiny random models)",
                  intro=["A tiny random `Qwen3DSparkModel` saved by DeepSpec's `save_pretrained`, loaded by "
                         "`specjax.drafters.load_drafter`; logits at 3 anchors against DeepSpec's `_forward_backbone`."])
    if any(r["max_abs_logits"] > 1e-4 or not r["greedy_equals_ar_b1_b4"] for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
