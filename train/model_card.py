"""Writes a zoo model's `README.md` model card from what its directory and run record say, plus a
fresh test-split evaluation, so every number in a card was measured by this command.

    python -m train.model_card --model models/code-target [--max-tokens N]
    python -m train.model_card --model models/code-target-feature
    python -m train.model_card --model models/code-target-dspark

An LM card (a Hugging Face directory from `train.lm`): architecture and parameter count, the
corpus and its splits, the training phases and tokens seen, validation loss at export, test-split
loss / perplexity next to the unigram baseline (`train.eval_ppl`). A feature-drafter card (a
directory from `train.feature`): its layers and the target it drafts for, the training run, and
the validation loss / top-1 agreement with the target at each unrolled step. The measured numbers
also go to `eval.json` beside the card.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import jax
from flax import nnx

from specjax.io.checkpoint import load_model
from specjax.models.config import HybridConfig
from train import corpus, eval_ppl
from train.common import resolve
from train.common import REPO
from train.common import repo_relative as _rel
from specjax.spec.profile import cpu_name


def _corpus_lines(manifest: corpus.Manifest) -> list[str]:
    c = {split: len(manifest.split(split)) for split in ("train", "validation", "test")}
    skipped = sum(f.split == "skipped" for f in manifest.files)
    return [f"The `.py` files of the {manifest.implementation} {manifest.python} standard library "
            f"(`train/corpus.py`, pinned by `train/manifest.json`), split by a hash of each path: "
            f"{c['train']} train / {c['validation']} validation / {c['test']} test files "
            f"({skipped} non-UTF-8 files skipped). Tokenizer: the zoo's byte-level BPE "
            "(`models/tokenizer`, 8192 tokens; id 0 `<|endoftext|>` separates documents, so prompts start with it)."]


def _architecture(cfg) -> str:
    if isinstance(cfg, HybridConfig):
        kinds = "".join("D" if t == "linear_attention" else "A" for t in cfg.layer_types)
        return (f"Qwen3-Next-style hybrid (`qwen3_next`): {cfg.num_layers} layers `{kinds}` (D = Gated DeltaNet "
                f"with {cfg.linear_num_key_heads} key / {cfg.linear_num_value_heads} value heads of "
                f"{cfg.linear_key_head_dim} / {cfg.linear_value_head_dim}, conv {cfg.linear_conv_kernel_dim}; "
                f"A = gated attention, {cfg.num_heads} query / {cfg.num_kv_heads} KV heads of {cfg.head_dim}, "
                f"partial RoPE {cfg.partial_rotary_factor}), d_model {cfg.hidden_size}, dense SwiGLU "
                f"{cfg.intermediate_size}, vocabulary {cfg.vocab_size}, "
                f"{'tied' if cfg.tie_word_embeddings else 'untied'} embeddings, context {cfg.max_position_embeddings}")
    return (f"Llama-style decoder (`{cfg.model_type}`): {cfg.num_layers} layers, d_model {cfg.hidden_size}, "
            f"{cfg.num_heads} query / {cfg.num_kv_heads} KV heads of {cfg.head_dim}, SwiGLU {cfg.intermediate_size}, "
            f"vocabulary {cfg.vocab_size}, {'tied' if cfg.tie_word_embeddings else 'untied'} embeddings, "
            f"RoPE θ {cfg.rope_theta:g}, context {cfg.max_position_embeddings}")


def lm_card(model_dir: Path, max_tokens: int | None = None, progress: bool = True, *, manifest_path: Path | None = None,
            root: Path | None = None, cache_dir: Path | None = eval_ppl.DEFAULT_CACHE,
            reuse_test: dict | None = None, compare: tuple[Path, ...] = ()) -> tuple[str, dict]:
    """(card text, eval record). `reuse_test`: a test-split result already measured for these very
    weights (`--reuse-eval`), instead of scoring the split again. `compare`: other models' exports
    whose measured test row (their `eval.json`) the card sets next to this one's."""
    model = load_model(str(model_dir))
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    info = json.loads((model_dir / "train_info.json").read_text())
    tcfg = info["run"]["config"]
    name = tcfg["name"]
    test = reuse_test if reuse_test is not None else eval_ppl.evaluate_model(
        model_dir, split="test", seq_len=tcfg.get("eval_seq_len", 512), max_tokens=max_tokens,
        manifest_path=manifest_path, root=root, cache_dir=cache_dir, progress=progress)
    phases = tcfg["phases"]
    phase_txt = ", then ".join(f"{p['steps']} steps at sequence {p['seq_len']}" for p in phases)
    history = _schedule_history(info["run"].get("schedule_changes") or [])
    total = sum(p["steps"] for p in phases)
    interim = info.get("interim", False)
    export_name = model_dir.name
    status = (f"**Interim export**: step {info['steps']} of {info.get('total_steps', total)} (training continues; "
              "rerun the command below to resume, then re-export and rewrite this card).\n\n" if interim else "")
    command = f"python -m train.lm --config configs/{name}.json --run-dir runs/{name} --export models/{name}"
    if info.get("note"):
        status = f"**{info['note']}** (step {info['steps']} of {info.get('total_steps', total)}).\n\n"
        command = (f"python -m train.lm --config configs/{name}.json --run-dir runs/{name} --max-steps {info['steps']}\n"
                   f"python -m train.lm --config configs/{name}.json --run-dir runs/{name} --export-latest "
                   f"--export models/{export_name} --note '{info['note']}'")
    manifest = corpus.read_manifest(manifest_path or corpus.MANIFEST_PATH)
    card_args = (f" --max-tokens {max_tokens}" if max_tokens else "") + "".join(f" --compare {_rel(d)}" for d in compare)
    card = f"""# {export_name}

{status}{_architecture(model.config)}; {n_params / 1e6:.2f}M parameters, stored as bfloat16 safetensors in
Hugging Face format (`config.json`, `model.safetensors`, `tokenizer.json`): `specjax.load_model` and
`transformers.AutoModelForCausalLM` both load it.

## Data
{_corpus_lines(manifest)[0]}

## Training
`train/lm.py`, config `configs/{name}.json`: {phase_txt}; batch {tcfg['batch_size']}; AdamW
(lr {tcfg['learning_rate']:g}, warm-up {tcfg['warmup_steps']}, cosine to {tcfg['min_lr_ratio']:g}×, weight decay
{tcfg['weight_decay']:g}, clip {tcfg['grad_clip']:g}); {'bfloat16 compute over float32 master weights' if tcfg.get('bf16_compute') else 'float32'}; seed {tcfg['seed']}.
Tokens seen: **{info['tokens_trained']:,}** in {info['steps']} steps, on this repo's 2-core CPU.
{history}
## Evaluation
| split | tokens scored | loss (nats/token) | perplexity | unigram perplexity |
|---|---:|---:|---:|---:|
| validation (at export, {tcfg.get('eval_tokens') or 'all'} tokens) | {tcfg.get('eval_tokens') or '-'} | {info['val_loss']:.4f} | {info['val_ppl']:.2f} | |
| test | {test['tokens']:,} | {test['loss']:.4f} | {test['ppl']:.2f} | {test['unigram_ppl']:.1f} |

Windows of {test['seq_len']} tokens over the split's token stream, each token scored once, float32.
{_comparison(export_name, n_params, info['tokens_trained'], test, compare)}Measured by `python -m train.model_card --model models/{export_name}{card_args}`
(the test row alone: `python -m train.eval_ppl --model models/{export_name} --split test`).

## Reproduce
```
{command}
python -m train.model_card --model models/{export_name}{card_args}
```
Resumable: the same command continues from the last checkpoint with the same data order.
"""
    return card, {"name": export_name, "config": name, "params": n_params, "tokens_trained": info["tokens_trained"], "steps": info["steps"],
                  "interim": interim, "val_loss": info["val_loss"], "test": test}


def feature_card(model_dir: Path) -> tuple[str, dict]:
    dcfg = json.loads((model_dir / "drafter_config.json").read_text())
    info = json.loads((model_dir / "train_info.json").read_text())
    run, final = info["run"], info["final"]
    cfg = run["config"]
    name = cfg["name"]
    import safetensors.numpy

    tensors = safetensors.numpy.load_file(str(model_dir / "model.safetensors"))
    n_params = sum(v.size for v in tensors.values())
    dtypes = "/".join(sorted({str(v.dtype) for v in tensors.values()}))
    size = (model_dir / "model.safetensors").stat().st_size
    agree = " / ".join(f"{a:.3f}" for a in final["val_agree"])
    steps_loss = " / ".join(f"{x:.3f}" for x in final["val_step_loss"])
    tokens = cfg["steps"] * cfg["batch_size"] * cfg["seq_len"]
    run_dir = info.get("run_dir") or f"runs/{name}"
    command = f"python -m train.feature --config configs/{name}.json --run-dir {run_dir} --export models/{name}"
    card = f"""# {name}

EAGLE-3-style feature drafter for `{cfg['target']}` (`specjax/drafters/feature.py`): fuses the target's
hidden states after layers {dcfg.get('target_layers')} into one vector, runs one decoder layer
(SwiGLU {dcfg.get('intermediate_size')}), and shares the target's embedding and LM head (not stored
here). {n_params / 1e6:.2f}M parameters of its own, stored as {dtypes} (`model.safetensors`, {size / 1e6:.1f} MB) + `drafter_config.json`;
`specjax.drafters.load_drafter` reads it for that target only (vocabulary and width checked; given
`target_path`, the target weights too, against the digest in `train_info.json`).

## Training
`train/feature.py`, config `configs/{name}.json`: training-time test with {cfg['ttt_steps']} unrolled steps
(loss weight {cfg['depth_decay']:g}^(step-1)), soft cross-entropy to the frozen target's next-token
distribution, on train-split windows of {cfg['seq_len']} tokens (a short-context drafter), batch
{cfg['batch_size']}, {cfg['steps']} steps ({tokens:,} positions), AdamW lr {cfg['learning_rate']:g} with warm-up
{cfg['warmup_steps']} and cosine decay.

## Evaluation (validation split, {cfg['eval_tokens']} tokens)
| unrolled step | 1 → {cfg['ttt_steps']} |
|---|---|
| loss | {steps_loss} |
| top-1 agreement with the target | {agree} |

Acceptance in speculative decoding (τ) is measured by `tools/bench.py`, not here.
{_feature_extras(cfg, model_dir=model_dir)}{_recipe_section(cfg, info, command)}{_continued_from(cfg, run, tokens)}
## Reproduce
```
{_feature_prereqs(cfg)}{_stage_command(cfg)}{command}
python -m train.model_card --model models/{name}
```
"""
    return card, {"name": model_dir.name, "config": name, "params": n_params, "val": final}


def _stage_info(cfg: dict) -> dict | None:
    """The `train_info.json` of the drafter a run continued from (`init_from`), where it is on this machine."""
    path = resolve(cfg["init_from"]) / "train_info.json" if cfg.get("init_from") else None
    return json.loads(path.read_text()) if path is not None and path.is_file() else None


def _stages(cfg: dict) -> list[tuple[str, dict]]:
    """(export path, `train_info.json`) of every drafter a run continued from, oldest first: `init_from`
    followed back through each start's own config while its record is on this machine."""
    out: list[tuple[str, dict]] = []
    while cfg.get("init_from") and all(cfg["init_from"] != p for p, _ in out):
        info = _stage_info(cfg)
        if info is None:
            break
        out.insert(0, (cfg["init_from"], info))
        cfg = info["run"]["config"]
    return out


def _stage_tokens(info: dict) -> int:
    c = info["run"]["config"]
    return info.get("tokens_trained") or c["steps"] * c["batch_size"] * c["seq_len"]


def _continued_from(cfg: dict, run: dict, tokens: int) -> str:
    """A continued run's start (`init_from`): the drafter it started from, its digest, the budget of every
    stage before it."""
    if not cfg.get("init_from"):
        return ""
    digest = (run.get("init_from_sha256") or "")[:12]
    stages = _stages(cfg)
    if not stages:
        return (f"\nContinued from `{cfg['init_from']}` (weights sha256 `{digest}…`; its record is not on this "
                "machine).\n")
    prev = stages[-1][1]
    pcfg, timing = prev["run"]["config"], prev.get("timing") or {}
    before = sum(_stage_tokens(info) for _, info in stages)
    pcache = f" on the cache `{pcfg['cache']}`" if pcfg.get("cache") else ""
    earlier = "" if len(stages) == 1 else (
        f" after {len(stages) - 1} earlier stage(s) (" + "; ".join(
            f"`{path}`: {_stage_tokens(info):,} positions" for path, info in stages[:-1]) + ")")
    return (f"\nContinued from `{cfg['init_from']}` (`init_from`; weights sha256 `{digest}…`, checked when the run "
            f"opened): that drafter's own run (`configs/{pcfg['name']}.json`, `{prev.get('run_dir')}`) trained "
            f"{_stage_tokens(prev):,} positions{pcache} in {timing.get('train_step_s', 0) / 60:.1f} min of steps"
            f"{earlier or ' first'}, so these weights saw {before + tokens:,} positions in all. Its validation agreement, steps "
            f"1 → {pcfg['ttt_steps']}: " + " / ".join(f"{a:.3f}" for a in prev["final"]["val_agree"]) + ".\n")


def _stage_command(cfg: dict) -> str:
    """The commands that train the drafters a run continues from, oldest first (first, in Reproduce)."""
    return "".join(
        f"python -m train.feature --config configs/{info['run']['config']['name']}.json "
        f"--run-dir {info.get('run_dir') or 'runs/' + info['run']['config']['name']} --export {path}\n"
        for path, info in _stages(cfg))


def _vocab_ceiling(cfg: dict, model_dir: Path | None) -> str:
    """The share of the cache's positions whose target argmax is in the draft vocabulary (the ceiling on
    agreement it sets), where the run had a cache on this machine and the export ships its ranking."""
    from specjax.drafters import vocab as vocab_lib
    from train import target_cache
    if model_dir is None or not cfg.get("cache") or not (model_dir / vocab_lib.RANKING_FILE).exists():
        return ""
    try:
        cache = target_cache.TargetCache(resolve(cfg["cache"]))
    except ValueError:
        return ""
    V = cache.manifest["vocab_size"]
    share = cache.argmax_share(vocab_lib.read_ranking(str(model_dir), V)[:cfg["draft_vocab"]])
    return (f" On the training cache, the target's argmax is one of them at {share:.1%} of positions: the ceiling "
            "on agreement this vocabulary sets.")


def _feature_extras(cfg: dict, block: bool = False, model_dir: Path | None = None) -> str:
    """The card's sections on a reduced draft vocabulary and on extra training data (the target's own
    continuations), where the config has them (`block`: a block drafter's vocabulary, fixed at training)."""
    out = ""
    if cfg.get("draft_vocab"):
        n = f"{cfg['draft_vocab']:,}"
        choice = (f"Its Markov head is sized for them ({n} output columns, {n} + 1 input rows: one for every token\n"
                  f"outside), so N is fixed at training; the export ships the ranking (`token_ranking.safetensors`),\n"
                  f"whose first {n} are the ids." if block else
                  f"The export\nships the ranking of every token (`token_ranking.safetensors`), so any N up to {n} is chosen at\n"
                  f"load time: `load_drafter(..., draft_vocab=N)`, `--draft-vocab N`.")
        out += f"""
## Reduced draft vocabulary
Trained on the {n} most frequent target tokens of its training stream (EAGLE-3's d2t: the
head scores only their LM-head rows; the target's distribution renormalised over them). {choice} q is zero outside: lossless.{_vocab_ceiling(cfg, model_dir)}
"""
    if cfg.get("extra_train"):
        summary = resolve(cfg["extra_train"]).with_suffix(".json")
        if summary.exists():
            s = json.loads(summary.read_text())
            g = s["generated_tokens"]
            what = (f"{s['code_prompts']} code prompts and {s['chat_prompts']} chat prompts (train split), "
                    f"{g['code']:,} + {g['chat']:,} greedy tokens generated by the target, {s['stream_tokens']:,} "
                    f"tokens with their prompts")
        else:
            what = "its greedy continuations of train-split prompts"
        times = cfg.get("extra_repeat", 1)
        share = f", repeated {times} times (oversampled)" if times > 1 else ""
        out += f"""
## Training data
The corpus's train split in the target's tokenization, plus the target's own continuations
(`{cfg['extra_train']}`, `python -m train.continuations`): {what}{share}.
"""
    return out


def _recipe_section(cfg: dict, info: dict, command: str) -> str:
    """Issue 43's recipe where the run used it: the offline target cache (its stream's mix, the
    positions it holds, the epochs the run made over it), the initialisation from the target, a
    token MASK; and the CPU, the wall time and the exact command of the run."""
    lines = []
    if cfg.get("cache"):
        mpath = resolve(cfg["cache"]) / "manifest.json"
        trained = info.get("tokens_trained") or cfg["steps"] * cfg["batch_size"] * cfg["seq_len"]
        if mpath.exists():
            m = json.loads(mpath.read_text())
            held = m["windows"] * m["seq_len"]
            mix = m.get("mix") or {}
            share = (f"; {mix['extra_share']:.0%} of the stream is the target's own continuations (`{mix['extra']}`, "
                     f"{mix['extra_tokens']:,} tokens × {mix.get('extra_repeat', 1)}) interleaved window by window with "
                     f"the corpus's first {mix['corpus_tokens']:,} train tokens") if mix.get("extra") else ""
            lines.append(f"Offline target cache `{cfg['cache']}` (`python -m train.target_cache`): {m['windows']:,} windows × "
                         f"{m['seq_len']} = {held:,} positions, the target's layers {m['layers']} and top-{m['topk']} "
                         f"log-probabilities, built once in {m['seconds'] / 60:.1f} min{share}. The run read "
                         f"{trained:,} positions from it: {trained / held:.1f} epochs.")
            if m.get("weights", "float32") != "float32":
                lines.append(f"The cache was built from the target at {m['weights']} weights (`--weights {m['weights']}`, "
                             "batch-invariant attention): the drafter learns the target as it is deployed at that dtype; "
                             "the run loaded its target (embedding, LM head, validation) at the same weights.")
            lines.append("Built with: `" + _cache_commands(cfg, m) + "`.")
        else:
            lines.append(f"Offline target cache `{cfg['cache']}` (not on this machine: its manifest is not recorded here).")
    if cfg.get("init_from_target"):
        lines.append("Initialised from the target (`init_from_target`): the decoder layers from the target's top "
                     "attention layers (a hybrid's full-attention layers: the query half of the gated q_proj, "
                     "its (1 + w) norms as scales), `fc` passing the last read layer's feature through.")
    if cfg.get("mask_token_id") is not None:
        lines.append(f"MASK slots are the target's embedding of token {cfg['mask_token_id']} (`mask_token_id`, as the "
                     "published DSpark / DFlash layouts: the drafter exports to vLLM's speculators format exactly).")
    timing = info.get("timing") or {}
    if timing:
        sessions = len(timing.get("sessions", [])) or 1
        lines.append(f"Wall time {timing.get('wall_s', 0) / 60:.1f} min over {sessions} session(s) "
                     f"({timing.get('train_step_s', 0) / 60:.1f} min in training steps) on {cpu_name()}, "
                     f"{os.cpu_count()} cores.")
        for t in timing.get("sessions", []):
            if t.get("estimated"):
                lines.append(f"The session of steps {t['steps'][0]}–{t['steps'][1]} is estimated: {t['estimated']}.")
    lines.append(f"Command: `{command}`.")
    return "\n## Recipe\n" + "\n".join(lines) + "\n"


def _cache_commands(cfg: dict, m: dict) -> str:
    """The commands that made a cache, from its manifest (and its continuations' summary)."""
    mix = m.get("mix") or {}
    cmds = []
    for extra in (mix.get("extra") or "").split(","):  # `--extra` may join several streams
        summary = resolve(extra).with_suffix(".json") if extra else None
        if summary is None or not summary.exists():
            continue
        s = json.loads(summary.read_text())
        questions = (s.get("questions") or {}).get("requested")
        q_seed = (s.get("questions") or {}).get("first_seed", 1)
        cmds.append(f"python -m train.continuations --target {cfg['target']} --out {extra} --code {s['code_prompts']} "
                    f"--chat {s['chat_prompts']} --new-tokens {s['new_tokens']}"
                    + (f" --skip-code {s['code_skipped']}" if s.get("code_skipped") else "")
                    + (f" --questions {questions}" if questions else "")
                    + (f" --question-seed {q_seed}" if questions and q_seed != 1 else "")
                    + (f" --samples {s['samples_per_prompt']} --temperature {s['temperature']:g}" if s.get("samples_per_prompt") else "")
                    + (f" --weights {s['weights']}" if s.get("weights", "float32") != "float32" else ""))
    cache = (f"python -m train.target_cache --target {cfg['target']} --layers {','.join(map(str, m['layers']))} "
             f"--out {cfg['cache']} --windows {m['windows']}")
    if mix.get("extra"):
        cache += f" --corpus-tokens {mix['corpus_tokens']} --extra {mix['extra']} --extra-repeat {mix.get('extra_repeat', 1)}"
    if m.get("state_layers"):
        cache += f" --state-layers {','.join(map(str, m['state_layers']))} --state-every {m['state_every']}"
    if m.get("weights", "float32") != "float32":
        cache += f" --weights {m['weights']}"
    return "` then `".join(cmds + [cache])


def _feature_prereqs(cfg: dict) -> str:
    if not cfg.get("extra_train"):
        return ""
    return (f"python -m train.continuations --target {cfg['target']} --out {cfg['extra_train']} "
            "--code 128 --chat 128 --new-tokens 192\n")


def mtp_card(model_dir: Path) -> tuple[str, dict]:
    """The card of an MTP module (`train.mtp`)."""
    dcfg = json.loads((model_dir / "drafter_config.json").read_text())
    info = json.loads((model_dir / "train_info.json").read_text())
    cfg, final = info["run"]["config"], info["final"]
    name = cfg["name"]
    import safetensors.numpy

    tensors = safetensors.numpy.load_file(str(model_dir / "model.safetensors"))
    n_params = sum(v.size for v in tensors.values())
    size = (model_dir / "model.safetensors").stat().st_size
    fmt = lambda xs: " / ".join(f"{x:.3f}" for x in xs)  # noqa: E731
    tokens = cfg["steps"] * cfg["batch_size"] * cfg["seq_len"]
    objective = ("soft cross-entropy to the frozen target's distribution of the predicted token" if cfg["loss"] == "distill"
                 else "cross-entropy on the data's own token")
    run_dir = info.get("run_dir") or f"runs/{name}"
    command = f"python -m train.mtp --config configs/{name}.json --run-dir {run_dir} --export models/{name}"
    card = f"""# {name}

Multi-token-prediction module for `{cfg['target']}` (`specjax/drafters/mtp.py`, design §5f):
h' = fc([norm(E[t+1]); norm(h_t)]) (2d → d), {dcfg['num_layers']} decoder layer(s) of the target's own
family with a KV cache of their own, a final norm and the target's LM head → t+2; drafting step j feeds
its own h' back through layer j mod {dcfg['num_layers']}. h is the target's last hidden state after its
final norm (what its LM head reads). {n_params / 1e6:.2f}M parameters of its own, bf16
({size / 1e6:.1f} MB), stored under Qwen3-Next's names (`mtp.fc`, `mtp.pre_fc_norm_embedding`,
`mtp.pre_fc_norm_hidden`, `mtp.layers.*`, `mtp.norm`): a directory of its own here (copying the target
to ship them inside would add the target's size to the zoo); `specjax.drafters.mtp.merge_into_target`
writes the same tensors into a target's own safetensors, where `--drafter mtp` reads them (the target's
weight digest excludes `mtp.*`). `specjax.drafters.load_drafter` reads this directory for that target
only (shapes checked; given `target_path`, the target weights too, against the digest in `train_info.json`).

## Training
`train/mtp.py`, config `configs/{name}.json`, post hoc on the frozen target: training-time test with
{cfg['ttt_steps']} unrolled steps (each step fed the module's own previous output, as in drafting; loss weight
{cfg['depth_decay']:g}^(step-1)), {objective}, on train-split windows of {cfg['seq_len']} tokens, batch
{cfg['batch_size']}, {cfg['steps']} steps ({tokens:,} positions), AdamW lr {cfg['learning_rate']:g} with warm-up
{cfg['warmup_steps']} and cosine decay.

## Evaluation (validation split, {cfg['eval_tokens']} tokens)
| unrolled step | 1 → {cfg['ttt_steps']} |
|---|---|
| loss | {fmt(final['val_step_loss'])} |
| top-1 agreement with the target | {fmt(final['val_agree'])} |

Acceptance in speculative decoding (τ) is measured by `tools/bench.py`, not here.
{_feature_extras(cfg, model_dir=model_dir)}{_recipe_section(cfg, info, command)}
## Reproduce
```
{command}
python -m train.model_card --model models/{name}
```
"""
    return card, {"name": model_dir.name, "config": name, "params": n_params, "val": final}


def block_card(model_dir: Path) -> tuple[str, dict]:
    """The card of a block drafter (DSpark / DFlash, `train.block`)."""
    dcfg = json.loads((model_dir / "drafter_config.json").read_text())
    info = json.loads((model_dir / "train_info.json").read_text())
    run, final, timing, calib = info["run"], info["final"], info["timing"], info.get("calibration")
    cfg = run["config"]
    name = cfg["name"]
    import safetensors.numpy

    tensors = safetensors.numpy.load_file(str(model_dir / "model.safetensors"))
    n_params = sum(v.size for v in tensors.values())
    size = (model_dir / "model.safetensors").stat().st_size
    W = dcfg["block_size"]
    kind = "DFlash (no Markov head, no confidence head)" if dcfg["markov_rank"] == 0 else (
        f"DSpark: Markov head of rank {dcfg['markov_rank']} ({dcfg['markov']})"
        + (", confidence head" if dcfg["confidence"] else ""))
    fmt = lambda xs: " / ".join(f"{x:.3f}" for x in xs)  # noqa: E731
    heldout = (f"on {calib['heldout_blocks']} held-out blocks; fitted on {calib['fit_blocks']}" if calib and "heldout_blocks"
               in calib else "on the blocks it was fitted on")
    calib_text = "" if not calib else f"""
## Confidence calibration
Sequential temperature scaling on the validation blocks (per position, left to right, minimising the
{"log loss" if calib.get("objective") == "log_loss" else "ECE"} of the cumulative product of confidences against "all positions up to k accepted"; the labels
are the estimate above): temperatures {fmt(calib['temperatures'])}; ECE before
{fmt(calib['ece_before'])}, after {fmt(calib['ece_after'])} ({heldout}).
"""
    loss_tail = ("\n+ BCE(c_k, 1 − ½‖p_d − p_t‖₁), the Markov head teacher-forced" if dcfg["confidence"] else
                 ", the Markov head teacher-forced" if dcfg["markov_rank"] else "")
    if cfg.get("freeze_backbone"):
        loss_tail = (" on the TreeFlash head's rows (the previous token teacher-forced), the backbone frozen "
                     "(no confidence term: its head is the backbone's)")
    tf_label = ("agreement, previous token teacher-forced (TreeFlash rows)" if cfg.get("freeze_backbone")
                else "agreement, Markov input teacher-forced")
    run_dir = info.get("run_dir") or f"runs/{name}"
    command = f"python -m train.block --config configs/{name}.json --run-dir {run_dir} --export models/{model_dir.name}"
    made = _calibration_made(model_dir)
    taps_made = next((v for k, v in made.items() if k != "step"), None)
    calib_cmd = "\n" + taps_made["command"] if taps_made else ""
    reader_text = _reader_section(dcfg, cfg, info, fmt) if dcfg.get("state_layers") else ""
    if dcfg.get("ar_intermediate") and not dcfg.get("boundary"):
        reader_text += _treeflash_section(model_dir, dcfg, cfg, info, fmt)
        kind = "TreeFlash head on " + kind
    if dcfg.get("state_layers"):
        kind = "ReaDy (" + kind + ", reading the target's recurrent states)"
    if dcfg.get("boundary"):
        reader_text += _boundary_section(dcfg, cfg, info, fmt)
        kind = "DPara (" + kind + ", blocks precomputed for every acceptance boundary)"
    block_input = (f"MASK x {W}: precomputed before the anchor, the bonus token, exists" if dcfg.get("boundary")
                   else f"[anchor, MASK x {W - 1}]")
    card = f"""# {model_dir.name}

One-pass block drafter for `{cfg['target']}` (`specjax/drafters/block.py`, design §5b), {kind}.
A block of {W} positions ({block_input}) is drafted in one forward of {dcfg['num_layers']} decoder
layers (SwiGLU {dcfg['intermediate_size']}, q/k norm, non-causal inside the block) whose keys and values
are the target's fused hidden states after layers {dcfg['target_layers']} plus the block; the target's
embedding and LM head are shared (not stored here). {n_params / 1e6:.2f}M parameters of its own, stored
in bf16: `model.safetensors` is {size / 1e6:.1f} MB. `specjax.drafters.load_drafter` reads it for that
target only (vocabulary and width checked; given `target_path`, the weights digest in `train_info.json`).

## Training
`train/block.py`, config `configs/{name}.json`: {cfg['anchors']} anchors per train-split window of
{cfg['seq_len']} tokens, batch {cfg['batch_size']}, {cfg['steps']} steps: {info['tokens_trained']:,} target positions,
{info['block_positions_trained']:,} drafted block positions. Loss {cfg['ce_weight']:g}·CE + {cfg['l1_weight']:g}·Σ_k exp(−k/{cfg['decay']:g})·‖p_d − p_t‖₁{loss_tail}; AdamW lr {cfg['learning_rate']:g}, warm-up
{cfg['warmup_steps']}, cosine decay. Training steps took {timing['train_step_s'] / 60:.1f} min
({timing['tokens_per_s']:,.0f} target tokens/s; wall {timing['wall_s'] / 60:.1f} min with evaluation and
checkpoints) on this repository's CPU machine.

## Evaluation (validation split, {final['val_blocks']} blocks)
Each block drafted as in decoding: greedy through the Markov head with the drafter's own previous
token. Compared with the target's argmax given the data (an estimate of acceptance: the target is
conditioned on the data, not on the draft; `tools/bench.py` measures the real τ).

| position | 1 → {W} |
|---|---|
| agreement with the target | {fmt(final['val_agree'])} |
| acceptance by position (all up to k agree) | {fmt(final['val_accept'])} |
| {tf_label} | {fmt(final['val_agree_teacher_forced'])} |
| ‖p_d − p_t‖₁ | {fmt(final['val_l1'])} |

Estimated τ (1 + expected accepted per block): {final['val_tau_estimate']:.2f}.
{reader_text}{calib_text}{_feature_extras(cfg, block=True, model_dir=model_dir)}{_recipe_section(cfg, info, command)}
## Reproduce
```
{_feature_prereqs(cfg)}{command}{calib_cmd}
python -m train.model_card --model models/{model_dir.name}
```
"""
    return card, {"name": model_dir.name, "config": name, "params": n_params, "bytes": size, "val": final,
                  "calibration": calib}


def _treeflash_section(model_dir: Path, dcfg: dict, cfg: dict, info: dict, fmt) -> str:
    """TreeFlash's card section: the head, its backbone reference, its rows against the backbone's
    Markov rows on the validation blocks, and the path calibration where one is stored."""
    final = info["final"]
    E, Ia = dcfg["hidden_size"], dcfg["ar_intermediate"]
    where = (f"Only the head is stored here; every other parameter is the backbone's, read from "
             f"`{dcfg['backbone']}` (relative to this directory), whose weights digest "
             f"`{dcfg['backbone_sha256'][:12]}…` is pinned: a retrained backbone is refused."
             if dcfg.get("backbone") else "The backbone's parameters are stored with the head.")
    rows = ""
    if "val_agree_teacher_forced_markov" in final:
        rows = f"""
| validation, previous token teacher-forced | position 1 → {dcfg['block_size']} |
|---|---|
| top-1 agreement, TreeFlash rows | {fmt(final['val_agree_teacher_forced'])} |
| top-1 agreement, the backbone's Markov rows | {fmt(final['val_agree_teacher_forced_markov'])} |
| target's argmax in the top 4, TreeFlash rows | {fmt(final['val_top4_teacher_forced'])} |
| target's argmax in the top 4, Markov rows | {fmt(final['val_top4_teacher_forced_markov'])} |
"""
    cal_file = model_dir / "calibration.json"
    made = _calibration_made(model_dir)
    kinds = [k for k in made if k != "step"]
    cal = ""
    if kinds:
        c = json.loads(cal_file.read_text())
        m = made[kinds[0]]
        lines = "\n".join(f"| {k} | {sum(map(sum, c['tables'][k]['seen'])):,} | {fmt([x for x in made[k]['acceptance_by_depth'] if x is not None])} |"
                           for k in kinds)
        cal = f"""
## Path calibration (TAPS)
`calibration.json` (its row kinds' tables): g(q, depth), the probability that a node whose own draft probability is q is
accepted given its parent is, per row kind, {c['tables'][kinds[0]]['bins']} bins of q per depth (shrunk toward the depth's
mean, isotonic in q), fitted on {m['sequences']} greedy continuations of {m['split']}-split prompts
({m['rounds_per_sequence']} rounds each; top {m['k']} nodes per row, {m['m']} candidates per position).
`select=taps` ranks paths by the product of g along them. Command: `{m['command']}`.

| rows | nodes | accepted fraction of a row's top {c['k']}, by depth (parent accepted) |
|---|---:|---|
{lines}
"""
    return f"""
## TreeFlash head (design §5e)
h'_k = h_k + D(silu(G)·U) with [U; G] = Linear([norm(E[x_{{k−1}}]); norm(h_k)]) ({2 * E} → {2 * Ia}, with bias),
D: {Ia} → {E} zero-initialised, on the backbone's output before the final norm; the conditional logits
for a previous token x are the LM head of norm(h'_k) plus the backbone's Markov term W2(W1[x]).
Trained on the frozen backbone `{cfg['init_from']}` (`freeze_backbone`: only the head learns; the DSpark
objective on its teacher-forced rows). {where} Chains still draft through the Markov head; the head
fills the conditional rows of `treeflash` trees (`tree="treeflash,nodes=N,m=…,k=…"`).
{rows}{cal}"""


def _dspark_peer(cfg: dict):
    """(directory name, train_info) of the DSpark drafter of the same target in the zoo, or None."""
    target = Path(cfg["target"])
    info = target.parent / f"{target.name}-dspark" / "train_info.json"
    if not info.is_absolute():
        info = REPO / info
    return (info.parent.name, json.loads(info.read_text())) if info.exists() else None


def _boundary_section(dcfg: dict, cfg: dict, info: dict, fmt) -> str:
    """DPara's card section: how its blocks are made and trained, the estimate by acceptance boundary,
    and the DSpark drafter it started from side by side (where it is in the zoo)."""
    W = dcfg["block_size"]
    final = info["final"]
    rows = [("this model (boundaries 0, 1, .. cycled over the blocks)", final)]
    peer = _dspark_peer(cfg)
    if peer is not None:
        rows.append((f"`{peer[0]}` (DSpark: anchor embedded, every context position a target feature)", peer[1]["final"]))
    table = "\n".join(f"| {n} | {fmt(r['val_accept'])} | {r['val_tau_estimate']:.2f} |" for n, r in rows)
    by = final.get("val_tau_estimate_by_boundary", [])
    Ia = dcfg.get("ar_intermediate") or 0
    light = (f"an autoregressive head, h' = h + D(silu(G)·U) with [U; G] = Linear([norm(E[x_(k−1)]); h]) (width {Ia}), "
             f"then the LM head and the Markov term, trained with the backbone" if Ia else
             f"the Markov head (rank {dcfg['markov_rank']})")
    start = f"started from `{cfg['init_from']}` (the token projection fresh)" if cfg.get("init_from") else "trained from scratch"
    return f"""
## Boundary-precomputed blocks (DPara, design §5d)
While the target verifies a round's draft, the backbone drafts the next round's block for every
acceptance boundary at once: block n (one per draft node) has {W} MASK positions after node n and sees
the committed context plus node n and its ancestors, which enter as token embeddings through a learned
projection (`token_proj`, `token_norm`) in place of the target features they do not have yet; one
forward, block-diagonal mask. The commit keeps the block of the last accepted node; the next round
drafts from it through {light} (the bonus token enters there: the block holds no anchor).
Training: boundary g in 0..{W} per block, p(g) ∝ exp(−g/{cfg.get('lag_decay', 2.0):g}); the block at anchor a (the bonus)
sees target features before a − g − 1 and tokens a − g − 1 .. a − 1 as embeddings; {start}.

| validation (self-fed) | acceptance by position | τ estimate |
|---|---|---:|
{table}

τ estimate by acceptance boundary 0 → {len(by) - 1}: {fmt(by)}.
"""


def _reader_section(dcfg: dict, cfg: dict, info: dict, fmt) -> str:
    """ReaDy's card section: the reader's config, how the training states were had, the zeroed-state
    ablation and the DSpark drafter of the same target side by side (where it is in the zoo)."""
    H, K, V = dcfg["state_shape"]
    L = len(dcfg["state_layers"])
    where = (f"the input of backbone layer {dcfg['reader_layer']}" if dcfg["reader_layer"] < dcfg["num_layers"]
             else "the backbone's output, before the final norm")
    rows = [("this model", info["final"])]
    if "final_zero_state" in info:
        rows.append(("this model, reader on zeroed states", info["final_zero_state"]))
    peer = _dspark_peer(cfg)
    if peer is not None:
        rows.append((f"`{peer[0]}` (DSpark, {peer[1]['run']['config']['steps']} steps)", peer[1]["final"]))
    table = "\n".join(f"| {n} | {fmt(r['val_accept'])} | {r['val_tau_estimate']:.2f} |" for n, r in rows)
    start = f"started from `{cfg['init_from']}`" if cfg.get("init_from") else ("not from a trained DSpark: the backbone from the target (`init_from_target`), the reader fresh" if cfg.get("init_from_target") else "trained from scratch")
    return f"""
## Recurrent-state reader (ReaDy, design §5c)
Reads the committed Gated DeltaNet state S [{H}, {K}, {V}] of target layers {dcfg['state_layers']} ({L} layers):
per layer, head and block position a query q = A(Bᵀ·norm(h_p)) + e_p (rank {dcfg['reader_rank']}, a learned
query per position), o = Sᵀq, RMSNorm over d_v, all {L}×{H} read-outs concatenated and projected by
U (rank {dcfg['reader_out_rank']}, zero-initialised) onto {where}. The state is the one committed
after the last accepted token (the same for every node of a round's tree).
Training states: the target's chunked forward with chunks of {cfg['state_every']} tokens gives its state
at every multiple of {cfg['state_every']} (`hybrid.prefix_states`), and the anchors are drawn on that grid
(the state of an anchor at a is the state after the tokens before a, as when a is a round's root); {start}.

| validation (self-fed) | acceptance by position | τ estimate |
|---|---|---|
{table}

The zeroed-state row is the same weights with S = 0 (the reader then adds nothing): what the state
itself is worth. The DSpark row's validation blocks start anywhere, this model's on the grid of
{cfg['state_every']}: both are {cfg['anchors']} evenly spread blocks per window of the same split.
"""


def _comparison(name: str, n_params: int, tokens: int, test: dict, others: tuple[Path, ...]) -> str:
    """A table of this model's test row next to other exports' (read from their eval.json)."""
    if not others:
        return ""
    rows = [f"| `{name}` (this model) | {n_params / 1e6:.2f}M | {tokens:,} | {test['loss']:.4f} | {test['ppl']:.2f} |"]
    for d in others:
        ev = json.loads((d / "eval.json").read_text())
        if (ev["test"]["tokens"], ev["test"]["seq_len"]) != (test["tokens"], test["seq_len"]):
            raise ValueError(f"{d}/eval.json scored other test tokens ({ev['test']['tokens']} in windows of "
                             f"{ev['test']['seq_len']}); compare models scored on the same split")
        rows.append(f"| `{ev['name']}` | {ev['params'] / 1e6:.2f}M | {ev['tokens_trained']:,} | "
                    f"{ev['test']['loss']:.4f} | {ev['test']['ppl']:.2f} |")
    return ("\nOn the same test tokens (each model's `eval.json`):\n\n| model | parameters | tokens trained | test loss | "
            "test ppl |\n|---|---:|---:|---:|---:|\n" + "\n".join(rows) + "\n\n")


def _schedule_history(changes: list[dict]) -> str:
    """The `--reschedule` history of a run (the cosine follows each new total from that step on)."""
    if not changes:
        return ""
    fmt = lambda phases: " + ".join(f"{p['steps']}@{p['seq_len']}" for p in phases)
    steps = "; ".join(f"at step {c['at_step']}: {fmt(c['old_phases'])} → {fmt(c['new_phases'])}" for c in changes)
    return (f"The plan was changed while training (`--reschedule`; steps@sequence, the learning rate's cosine "
            f"follows the new total from that step on): {steps}. An exact replay stops at each of those steps "
            f"(`--max-steps`) and resumes with the next config and `--reschedule`.\n")


def _calibration_made(model_dir: Path) -> dict:
    """{kind: what made its table} of the directory's `calibration.json` ({} without one)."""
    f = model_dir / "calibration.json"
    return json.loads(f.read_text()).get("made", {}) if f.exists() else {}


def adaptive_section(model_dir: Path) -> str:
    """The card's note on the "step" table of `calibration.json` (the adaptive shape's g(q, depth),
    `train.adaptive_calibration`), or "" when the directory has none."""
    f = model_dir / "calibration.json"
    made = _calibration_made(model_dir).get("step")
    if made is None:
        return ""
    t = json.loads(f.read_text())["tables"]["step"]
    seen = [sum(r) for r in t["seen"]]
    hits = [sum(r) for r in made["hits"]]
    rates = " / ".join(f"{h / n:.2f}" for h, n in zip(hits, seen) if n)
    return f"""
## Adaptive-shape calibration

`calibration.json`, its "step" table: `specjax.drafters.composite.adaptive.AdaptiveShape`'s g(q, depth), the rate at
which a node whose parent was accepted is accepted itself, by depth and by bin of its own draft
probability q given its parent ({t['depths']} depths x {t['bins']} bins; `rate` is the fit the
drafter uses: shrunk toward all depths, non-decreasing in q; `seen` and "made" -> "hits" the counts). Fitted on
{made.get('prompts')} validation prompts ({made.get('kind')}), {made.get('new_tokens')} new tokens each, trees
{', '.join(made.get('trees', []))}, every round verifying the whole tree: {int(sum(seen))} observed nodes,
acceptance by depth {rates}.

```
{made.get('command')}
```
"""


def _earlier_runs_note(model_dir: Path, command: str) -> str:
    """A line under an ablation whose runs (`--run NAME=DIR`) do not include this export's run: the
    ablation was measured on an earlier training of the drafter (the recipe's evidence, not these weights')."""
    import shlex
    try:
        words = shlex.split(command)
    except ValueError:
        return ""
    runs = [w.partition("=")[2] for a, w in zip(words, words[1:]) if a == "--run"]
    info = model_dir / "train_info.json"
    mine = json.loads(info.read_text()).get("run_dir") if info.is_file() else None
    if not runs or mine is None or mine in runs:
        return ""
    return (f"\nThese runs ({', '.join(f'`{r}`' for r in runs)}) are an earlier training of this drafter, not this "
            f"export's (`{mine}`): the comparison is the recipe's evidence, not these weights'.\n")


def ablation_section(model_dir: Path, bench_dir: Path | None = None) -> str:
    """The card's recipe ablations: every `bench/ablation_*.json` whose meta names this model
    (`tools.ablation_table --model`), as a table of its rows at equal steps, or "" when none does."""
    bench_dir = bench_dir or REPO / "bench"
    parts = []
    for f in sorted(bench_dir.glob("ablation_*.json")):
        d = json.loads(f.read_text())
        m = d.get("meta", {})
        if m.get("model") != model_dir.name:
            continue
        tau = lambda r: "" if r.get("tau_est") is None else f"{r['tau_est']:.3f}"  # noqa: E731 (unrolled drafters: none)
        rows = "\n".join(f"| {r['variant']} | {r['what']} | {r['steps']} | {r.get('agree', r.get('agree0', ''))} | "
                         f"{r.get('accept', '')} | {tau(r)} |" for r in d["rows"])
        title = m.get("title") or f.stem.replace("_", " ")
        parts.append(f"{title} ([bench/{f.stem}.md](../../bench/{f.stem}.md); {m.get('cpu', 'CPU not recorded')}, "
                     f"{m.get('date', '')[:10]}):\n\n| variant | what | steps | agreement with the target | "
                     f"acceptance @0/1/2 | τ estimate |\n|---|---|---:|---|---|---:|\n{rows}\n"
                     + _earlier_runs_note(model_dir, m.get("command", "")))
    if not parts:
        return ""
    return ("\n## Recipe ablations (equal steps)\n\nValidation of each variant at the same step "
            "(agreement: block drafters by block position, unrolled drafters by step; one seed each).\n\n"
            + "\n".join(parts))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, type=Path)
    ap.add_argument("--max-tokens", type=int, default=None, help="score at most this many test tokens")
    ap.add_argument("--compare", type=Path, nargs="*", default=[], metavar="DIR",
                    help="exports (with eval.json) whose test row the card shows next to this model's")
    ap.add_argument("--reuse-eval", action="store_true",
                    help="rewrite the card with the test result already in eval.json (same steps and tokens)")
    args = ap.parse_args(argv)
    if (args.model / "drafter_config.json").exists():
        kind = json.loads((args.model / "drafter_config.json").read_text()).get("drafter")
        card, record = {"block": block_card, "mtp": mtp_card}.get(kind, feature_card)(args.model)
    else:
        reuse = None
        if args.reuse_eval:
            old = json.loads((args.model / "eval.json").read_text())
            info = json.loads((args.model / "train_info.json").read_text())
            if (old.get("steps"), old.get("tokens_trained")) != (info["steps"], info["tokens_trained"]):
                sys.exit(f"error: {args.model}/eval.json was measured for other weights; run without --reuse-eval")
            reuse = old["test"]
        card, record = lm_card(args.model, args.max_tokens, progress=True, reuse_test=reuse,
                               compare=tuple(args.compare))
    (args.model / "README.md").write_text(card + ablation_section(args.model) + adaptive_section(args.model))
    (args.model / "eval.json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {_rel(args.model / 'README.md')}")


if __name__ == "__main__":
    main()
