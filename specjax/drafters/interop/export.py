"""Our drafters in vLLM's speculators format: the route from training in JAX to serving with vLLM.

    feature drafter -> eagle3   (one llama decoder layer; the draft vocabulary as d2t / t2d)
    DSpark          -> dspark   (sample_from_anchor: true, our slots; vanilla Markov head)
    DFlash          -> dflash   (a block drafter with markov_rank 0; sample_from_anchor as trained)

Every field vLLM would otherwise guess is written: `norm_before_residual` (vLLM assumes true when
absent), the aux layer ids (ours + 1: vLLM counts the residual entering a layer), `d2t` / `t2d`,
the mask token, `speculative_tokens`. Our own keys go under `specjax` (the target's weights
digest, checked when we load it back; the confidence temperatures). A block drafter with a learned
MASK vector, a draft vocabulary, ReaDy, DPara or a TreeFlash head has no published layout: refused.

    python -m specjax.drafters.interop.export models/code-target-dspark --target models/code-target \\
        --out exported/code-target-dspark
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from specjax.io.checkpoint import load_model, weights_sha256
from specjax.drafters import drafter_kind
from specjax.drafters.block import load_block_head
from specjax.drafters.feature import load_feature_head
from specjax.drafters.interop import block as block_layout
from specjax.drafters.interop import eagle3 as eagle3_layout
from specjax.drafters.interop.common import CONFIG, InteropError, read_json

SPECULATORS_VERSION = "0.9.0"  # the format version written (the `speculators` package that reads it back in tests)


def _speculators_config(algorithm: str, tokens: int, verifier: str, architectures: list[str]) -> dict:
    return {"algorithm": algorithm, "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": tokens, "verifier_accept_k": 1,
                                  "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": verifier, "architectures": architectures}}


def _layer_config(model_type: str, cfg, tc, num_layers: int, vocab: int) -> dict:
    rope = {"rope_theta": float(tc.rope_theta), "rope_type": tc.rope_scaling.rope_type}
    if tc.rope_scaling.rope_type != "default":
        sc = tc.rope_scaling
        rope.update(factor=sc.factor, low_freq_factor=sc.low_freq_factor, high_freq_factor=sc.high_freq_factor,
                    original_max_position_embeddings=sc.original_max_position_embeddings)
    return {"model_type": model_type, "architectures": ["LlamaForCausalLM" if model_type == "llama" else "Qwen3ForCausalLM"],
            "vocab_size": vocab, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
            "num_hidden_layers": num_layers, "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
            "head_dim": cfg.head_dim, "hidden_act": "silu", "rms_norm_eps": cfg.rms_norm_eps, "attention_bias": False,
            "mlp_bias": False, "max_position_embeddings": tc.max_position_embeddings, "rope_parameters": rope,
            "rope_theta": float(tc.rope_theta), "tie_word_embeddings": False,
            "layer_types": ["full_attention"] * num_layers}


def export(drafter_dir: str, target_dir: str, out: str, *, verifier: str | None = None, dtype: str = "bfloat16") -> dict:
    """Writes `out/config.json` + `out/model.safetensors`; returns the config written."""
    target = load_model(target_dir)
    tc = target.config
    kind = drafter_kind(drafter_dir)
    arch = read_json(os.path.join(target_dir, CONFIG)).get("architectures") or []
    verifier = verifier or os.path.basename(os.path.normpath(target_dir))
    ours = {"target_sha256": weights_sha256(target_dir), "source": os.path.basename(os.path.normpath(drafter_dir))}
    if kind == "feature":
        head = load_feature_head(drafter_dir)
        c = head.config
        tensors, ids = eagle3_layout.tensors_of(head, target)
        config = {"speculators_model_type": "eagle3", "architectures": ["Eagle3DraftModel"],
                  "transformer_layer_config": _layer_config("llama", c, tc, 1, tc.vocab_size),
                  "draft_vocab_size": int(len(ids)), "norm_before_residual": bool(c.norm_before_residual),
                  "norm_before_fc": False, "fc_norm": False, "norm_output": False, "embed_requires_grad": False,
                  "target_hidden_size": None,
                  "eagle_aux_hidden_state_layer_ids": [i + 1 for i in sorted(c.target_layers)],
                  "speculators_config": _speculators_config("eagle3", 3, verifier, arch)}
    elif kind == "block":
        head = load_block_head(drafter_dir)
        c = head.config
        tensors = block_layout.tensors_of(head)
        algorithm = "dspark" if c.markov_rank else "dflash"
        config = {"speculators_model_type": algorithm,
                  "architectures": ["DSparkDraftModel" if c.markov_rank else "DFlashDraftModel"],
                  "transformer_layer_config": _layer_config("qwen3", c, tc, c.num_layers, tc.vocab_size),
                  "draft_vocab_size": tc.vocab_size, "block_size": c.block_size,
                  "aux_hidden_state_layer_ids": [i + 1 for i in c.target_layers], "target_hidden_size": tc.hidden_size,
                  "mask_token_id": c.mask_token_id, "sample_from_anchor": bool(c.sample_from_anchor),
                  "sliding_window_non_causal": False,
                  "speculators_config": _speculators_config(algorithm, c.drafts, verifier, arch)}
        if c.markov_rank:
            config.update(markov_rank=c.markov_rank, markov_head_type="vanilla",
                          enable_confidence_head=bool(c.confidence), confidence_head_with_markov=True)
        if c.confidence_temperatures is not None:
            ours["confidence_temperatures"] = list(c.confidence_temperatures)
    else:
        raise InteropError(f"{drafter_dir}: a {kind!r} drafter has no speculators export (feature -> eagle3, "
                           "block -> dspark / dflash)")
    if max(c.target_layers) > tc.num_layers - 2:
        raise InteropError(f"{drafter_dir}: it reads target layer {max(c.target_layers)}, the last one: the published "
                           "code takes that one after the final norm")
    config.update(speculators_version=SPECULATORS_VERSION, tie_word_embeddings=False, dtype=dtype, specjax=ours)
    np_dtype = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32}[dtype]
    os.makedirs(out, exist_ok=True)
    save_file({k: (v if v.dtype.kind in "biu" else v.astype(np_dtype)) for k, v in tensors.items()},
              os.path.join(out, "model.safetensors"))
    with open(os.path.join(out, CONFIG), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    return config


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m specjax.drafters.interop.export", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("drafter", help="a feature or block drafter directory (ours)")
    ap.add_argument("--target", required=True, help="the target it was trained on (its weights digest is recorded)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--verifier", default=None, help="speculators_config.verifier.name_or_path (default: the target "
                    "directory's name; vLLM serves the exported drafter beside this model)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = ap.parse_args(argv)
    try:
        cfg = export(args.drafter, args.target, args.out, verifier=args.verifier, dtype=args.dtype)
    except (OSError, ValueError) as e:
        print(f"{ap.prog}: error: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"{args.out}: speculators {cfg['speculators_model_type']} ({args.dtype})")


if __name__ == "__main__":
    main()
