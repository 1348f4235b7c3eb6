"""Command line: `python -m specjax generate --model DIR --prompt TEXT`.

Subcommands are built by `build_parser()`; each one has an `add_*_args(parser)` function so later
features (drafters, trees, verification rules) add their flags to `generate` in one place.

Usage errors (a missing model directory, a bad prompt file, a prompt that does not fit the cache,
an out-of-range sampling parameter) exit with status 2 and one line on stderr, never a traceback.

Timing (`--json` fields, and the summary line on stderr in text mode) is for the whole batch,
measured around one `specjax.generate` call:
  wall_s        the timed generate call, end to end (host prep, compile if any, prefill, decode,
                copy back);
  compile_s     time JAX spent tracing, lowering and compiling: the union of the time spans of
                JAX's own compile events (`jax.monitoring`) during the first call;
  cache_hits    programs of that call loaded from the persistent compilation cache (on by
                default: `--compile-cache DIR`, `--no-compile-cache`; `specjax.io.compile_cache`);
  ms_per_token  (wall_s - the timed call's compile time) / decoding steps, where steps = the
                longest row's generated tokens (one step yields one token per row; prefill
                is included).
Without `--warmup` the timed call is the first one: subtracting compile time leaves other
first-call costs in (tens of ms on CPU), which dominate for tiny models. With `--warmup` the batch
runs once untimed first and the timed call is the second: a steady-state ms_per_token.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Sequence

from jax import monitoring

import specjax
from specjax.spec import profile as profile_lib
from specjax.spec import sampling
from specjax.models import sharding
from specjax.spec import tree as tree_lib
from specjax.spec import widths as widths_lib
from specjax.drafters.composite.adaptive import AdaptiveShape
from specjax.spec.calibration import STEP, read_calibration
from specjax.io.chat import check_messages, render_chat
from specjax.io.gguf import convert_gguf
from specjax.io.compile_cache import disable_programs, enable_compilation_cache
from specjax.drafters import block, compose
from specjax.drafters.block import parse_confidence
from specjax.models.fold import FoldConfig
from specjax.spec.profile import default_profile_name
from specjax.spec.widths import adaptive_widths, tree_widths
from specjax.spec.packing import Packing, load_packing

COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
                  "/jax/core/compile/jaxpr_to_mlir_module_duration",
                  "/jax/core/compile/backend_compile_duration")
CACHE_HIT = "/jax/compilation_cache/cache_hits"


class UsageError(Exception):
    """A problem with the user's input: reported as `prog: error: ...`, exit status 2."""


# ----------------------------------------------------------------------------- parser

def add_generate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, metavar="DIR",
                   help="model directory in Hugging Face format (config.json, model.safetensors, tokenizer.json)")
    p.add_argument("--weights", choices=("float32", "bfloat16", "int8"), default="float32",
                   help="the model's weight storage (default float32, as stored; int8: one scale per output "
                        "channel). Activations stay float32. Not bit-exact with float32; a bf16 / int8 "
                        "speculative run can still diverge from AR at the same --weights (docs/design.md §17)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", metavar="TEXT", help="one prompt")
    src.add_argument("--prompt-file", metavar="FILE.jsonl",
                     help='one JSON object per line with a "prompt" string; all prompts run as one batch')
    p.add_argument("--chat", action="store_true",
                   help="treat each prompt as a user message and render it with the model's chat template "
                        "(instruct models; --prompt-file rows with \"messages\" are always rendered)")
    p.add_argument("--max-new-tokens", type=int, default=64, metavar="N", help="tokens to generate per prompt (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 (default) is greedy")
    p.add_argument("--top-k", type=int, default=0, metavar="K", help="keep the K most likely tokens (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling mass (1 = off)")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="sampling seed (default 0)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="do not stop at EOS (default: stop at the model config's eos_token_id)")
    p.add_argument("--capacity", type=int, default=None, metavar="C",
                   help="KV-cache slots per row (default: just enough, at most the model's max_position_embeddings)")
    p.add_argument("--warmup", action="store_true",
                   help="run the batch once untimed first, so ms_per_token is the steady state "
                        "(compile_s then reports the warm-up's compilation)")
    p.add_argument("--drafter", action="append", default=[], metavar="DIR|ngram|mtp",
                   help="speculative decoding with this drafter: 'ngram' (prompt lookup), 'mtp' (the MTP layers "
                        "shipped in the model's own checkpoint), a feature-, block- or MTP-drafter directory, or "
                        "a small model directory with the same tokenizer. Give two, cheapest first, with --treegraft or --switch")
    p.add_argument("--treegraft", default=None, metavar="SCHEDULER_DIR|POLICY",
                   help="TreeGraft over the two --drafter flags (cheap, then strong): per round and row one action "
                        "(the cheap chain, the strong tree, a graft, a recovered subtree, their union) chosen by a "
                        "scheduler (a directory written by train/distill_scheduler.py) or a fixed policy: an action "
                        "(cheap, strong, graft, recover, union), switch, always (graft) or never; "
                        "--tree sets the verify budget")
    p.add_argument("--strong-tree", default=None, metavar="SPEC",
                   help="with --treegraft: the strong drafter's own tree (strong and union actions; default: its own "
                        "default tree where it fits --tree)")
    p.add_argument("--switch", type=int, default=None, metavar="MIN_MATCH",
                   help="Switch over the two --drafter flags (ngram, then a model drafter): each round, n-gram's --tree "
                        "where its match is an n-gram of at least MIN_MATCH tokens, the model drafter's --switch-tree "
                        "elsewhere (specjax.drafters.composite.treegraft, policy switch)")
    p.add_argument("--switch-tree", default=None, metavar="SPEC",
                   help="with --switch: the model drafter's tree (default chain=3; it must fit --tree)")
    p.add_argument("--cheap-tree", default=None, metavar="SPEC",
                   help="with --treegraft: the cheap drafter's candidate tree (default: a dynamic tree of about "
                        "twice the verify budget; a chain for ngram)")
    p.add_argument("--graft-nodes", type=int, default=None, metavar="G",
                   help="with --treegraft: grafted candidates per round (default: the verify budget - 1)")
    p.add_argument("--fold", default=None, metavar="default|sinks=S,window=W,lambda=L,...",
                   help="FOLD long-context attention for the lm / feature drafter(s) (training-free): sinks and the "
                        "last W keys keep their positions, far keys share one, far logits are sharpened by "
                        "max(1, 1 + lambda ln(n_far / W)); keys: sinks, window, far, lambda, beta (log-ratio|log-log), "
                        "positions (on|off), chunk, impl. 'default' = sinks=4,window=256,lambda=0.5 (specjax.models.fold)")
    p.add_argument("--tree", default=None, metavar="SPEC",
                   help="draft tree: 'chain=D', dynamic 'depth=D,topk=K,nodes=N', a JSON path list "
                        "'[[0],[1],[0,0]]' (default chain=4), or a block drafter's best-first tree "
                        "'ddtree,nodes=N' / 'treeflash,nodes=N[,m=M,k=K,rows=markov|head,select=taps]'")
    p.add_argument("--verify", default=None, choices=["greedy", "deterministic", "sampled", "sampled_noreplace", "margin"],
                   help="verification rule (default: greedy at temperature 0, deterministic otherwise); 'margin' is "
                        "AdaptiveSpec's LOSSY rule (with --margin): a draft token within the margin of the target's "
                        "best logit is accepted, so the output is no longer the target's own")
    p.add_argument("--margin", type=float, default=None, metavar="DELTA",
                   help="with --verify margin: the logit gap (>= 0) under which a draft token is accepted (0: lossless)")
    p.add_argument("--adaptive", action="store_true",
                   help="AdaptiveSpec's adaptive tree shape (lossless): the drafter drafts --tree, and each round the "
                        "target verifies the best-scored nodes up to the compiled width that maximises expected tokens "
                        "per second (--verify-profile from `python -m tools.profile_widths --adaptive`)")
    p.add_argument("--confidence", default="off", metavar="THRESHOLD|schedule|off",
                   help="a block drafter's (DSpark's) confidence cut, lossless under every rule: 'off' (default) "
                        "verifies the whole chain or tree; a threshold in (0, 1) stops each row's draft before its first "
                        "position of lower confidence; 'schedule' picks the draft lengths that maximise expected "
                        "tokens per second from a measured cost per verify width (--verify-profile)")
    p.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                   help="an MTP or feature drafter scores only the N most frequent tokens of its training data (the LM head's "
                        "N rows; lossless: q is zero elsewhere); default: the full vocabulary")
    p.add_argument("--draft-weights", default=None, choices=("float32", "bfloat16", "int8"),
                   help="storage dtype of the learned drafters' own networks' projections (weight-only, as --weights "
                        "for the target; lossless whatever it is: the target verifies); default: float32")
    p.add_argument("--untuned", action="store_true",
                   help="ignore the drafter directory's recorded defaults (tuned.json: tree, draft vocabulary, own "
                        "weight dtype, tuned on validation prompts); without it each one not given is taken from there")
    p.add_argument("--boundaries", type=int, default=None, metavar="B",
                   help="a DPara drafter's chain precomputes only its first B acceptance boundaries beside the "
                        "verification (the rest after it, in the rounds that reach them); default: every one")
    p.add_argument("--verify-profile", default=None, metavar="FILE",
                   help="with --confidence schedule: the verify-width cost profile of this machine, written by "
                        "python -m tools.profile_widths (default: bench/verify_profile_<model dir name>.json in the current "
                        "directory, else in the specjax repository)")
    pk = p.add_mutually_exclusive_group()
    pk.add_argument("--pack", action="store_true",
                    help="packed verification (design §19): each prompt's row verifies its own drafted nodes and the "
                         "target computes only those, not every row padded to the widest")
    pk.add_argument("--goodput", default=None, metavar="PROFILE.json",
                    help="--pack plus the goodput budget: nodes whose estimate (a drafter with q: the adaptive shape's, "
                         "calibrated online) does not pay for its slot are cut, by "
                         "this machine's packed cost table (python -m tools.profile_widths --packed ...; its row for "
                         "the number of prompts)")
    p.add_argument("--mesh", default=None, metavar="data=D,model=M",
                   help="run sharded on a device mesh (design §10): batch rows over D devices, tensor parallel over "
                        "M; D x M devices, of every process when SPECJAX_COORDINATOR / SPECJAX_NUM_PROCESSES / "
                        "SPECJAX_PROCESS_ID are set (jax.distributed)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object per prompt per line instead of plain text")
    cache = p.add_mutually_exclusive_group()
    cache.add_argument("--compile-cache", default=None, metavar="DIR",
                       help="persistent compilation cache folder (default: $SPECJAX_COMPILE_CACHE, else "
                            "~/.cache/specjax/jax-compile): a later call with the same configuration loads the "
                            "compiled programs instead of compiling them")
    cache.add_argument("--no-compile-cache", action="store_true",
                       help="compile every program afresh and write nothing to the cache folder")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specjax", description="Speculative decoding of language models in JAX.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    gen = sub.add_parser("generate", help="generate completions for one prompt or a JSONL batch",
                         usage="specjax generate --model DIR (--prompt TEXT | --prompt-file FILE.jsonl) [options] "
                               "(specjax generate -h lists them)",
                         description="Generate completions with specjax.generate (one compiled program per batch shape).")
    add_generate_args(gen)
    gen.set_defaults(run=run_generate, subparser=gen)
    conv = sub.add_parser("convert", help="convert a GGUF file into a Hugging Face model directory",
                          usage="specjax convert FILE.gguf OUT_DIR [--dtype float32|bfloat16]",
                          description="Dequantize a GGUF checkpoint (llama / qwen2 / qwen3) into config.json, "
                                      "model.safetensors, tokenizer.json and tokenizer_config.json (specjax.io.gguf).")
    conv.add_argument("gguf", metavar="FILE.gguf")
    conv.add_argument("out_dir", metavar="OUT_DIR")
    conv.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                      help="stored dtype (default float32: the dequantized values exactly)")
    conv.set_defaults(run=run_convert, subparser=conv)
    return parser


def run_convert(args: argparse.Namespace) -> int:
    try:
        out = convert_gguf(args.gguf, args.out_dir, dtype=args.dtype)
    except (OSError, ValueError, ImportError) as e:
        raise UsageError(str(e)) from None
    print(f"[specjax] wrote {out}", file=sys.stderr)
    return 0


# ----------------------------------------------------------------------------- inputs

def read_prompt_file(path: str) -> list[tuple[str, str | list]]:
    """("FILE:LINE", prompt) for each prompt of a JSONL file, the prompt a string ("prompt") or a chat
    ("messages": [{"role", "content"}, ...]); blank lines are skipped. Raises UsageError naming the line."""
    if not os.path.isfile(path):
        raise UsageError(f"--prompt-file {path}: no such file")
    prompts = []
    with open(path, "rb") as f:
        for n, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8-sig" if n == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise UsageError(f"{path}:{n}: not valid UTF-8 ({e.reason} at byte {e.start})") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise UsageError(f"{path}:{n}: not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise UsageError(f'{path}:{n}: expected a JSON object with a "prompt" key, got {type(obj).__name__}')
            if "messages" in obj:  # a chat: rendered with the model's chat template later
                if "prompt" in obj:
                    raise UsageError(f'{path}:{n}: give "prompt" or "messages", not both')
                try:
                    prompts.append((f"{path}:{n}", check_messages(obj["messages"], f"{path}:{n}")))
                except ValueError as e:
                    raise UsageError(str(e)) from None
                continue
            if "prompt" not in obj:
                raise UsageError(f'{path}:{n}: missing "prompt" key (or "messages")')
            if not isinstance(obj["prompt"], str):
                raise UsageError(f'{path}:{n}: "prompt" must be a string, got {type(obj["prompt"]).__name__}')
            if not obj["prompt"]:
                raise UsageError(f"{path}:{n}: empty prompt")
            prompts.append((f"{path}:{n}", obj["prompt"]))
    if not prompts:
        raise UsageError(f"{path}: no prompts in the file")
    return prompts


def check_model_dir(path: str) -> None:
    if not os.path.isdir(path):
        raise UsageError(f"--model {path}: no such directory")
    for name in ("config.json", "tokenizer.json"):
        if not os.path.isfile(os.path.join(path, name)):
            raise UsageError(f"--model {path}: no {name} in the model directory")


# ----------------------------------------------------------------------------- timing

@contextlib.contextmanager
def compile_timer():
    """Yields a dict whose "compile_s" is, on exit, the union of JAX's compile-event time spans
    (trace, lower to MLIR, backend compile) recorded inside the block."""

    spans: list[tuple[float, float]] = []

    def listener(event, start_time, end_time, **kwargs):
        if event in COMPILE_EVENTS:
            spans.append((start_time, end_time))

    def hit(event, **kwargs):
        if event == CACHE_HIT:
            out["cache_hits"] += 1

    out = {"compile_s": 0.0, "cache_hits": 0}
    monitoring.register_event_time_span_listener(listener)
    monitoring.register_event_listener(hit)
    try:
        yield out
    finally:
        monitoring.unregister_event_time_span_listener(listener)
        monitoring.unregister_event_listener(hit)
        total, end = 0.0, float("-inf")
        for s, e in sorted(spans):  # union: nested events (a jit traced inside a trace) count once
            if e <= end:
                continue
            total += e - max(s, end)
            end = e
        out["compile_s"] = total


# ----------------------------------------------------------------------------- generate

def run_generate(args: argparse.Namespace) -> int:

    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be a positive integer, got {args.max_new_tokens}")
    if args.capacity is not None and args.capacity < 1:
        raise UsageError(f"--capacity must be a positive integer, got {args.capacity}")
    try:
        sampling.validate(args.temperature, args.top_k, args.top_p)
    except ValueError as e:  # name the flag, not the keyword argument
        msg = str(e)
        for kw in ("temperature", "top_k", "top_p"):
            if msg.startswith(kw + " "):
                msg = "--" + kw.replace("_", "-") + msg[len(kw):]
        raise UsageError(msg) from None
    if args.prompt is not None:
        if not args.prompt:
            raise UsageError("--prompt: empty prompt")
        sources = [("--prompt", args.prompt)]
    else:
        sources = read_prompt_file(args.prompt_file)
    check_model_dir(args.model)
    mesh = mesh_arg(args.mesh)  # a bad --mesh too (and several processes join here, before any device is used)
    fold = fold_config(args)  # a bad --fold is refused before anything loads
    stack = drafter_stack(args)  # and so are drafter flags that do not go together
    compile_cache(args)  # before the first compile (loading compiles small programs too)

    try:
        model = specjax.load_model(args.model, weights=args.weights)
        tokenizer = specjax.load_tokenizer(args.model)
    except (OSError, ValueError) as e:
        raise UsageError(f"cannot load the model: {e}") from None
    cfg = model.config
    confidence, costs = confidence_args(args, n_prompts=len(sources))
    try:  # each option reaches the drafters that take it (`compose.load_parts`)
        drafters = compose.load_parts(args.drafter, model, target_path=args.model, tuned=not args.untuned, fold=fold,
                                      confidence=confidence, costs=costs, draft_vocab=args.draft_vocab,
                                      draft_weights=args.draft_weights)
    except (OSError, ValueError) as e:
        raise UsageError(f"--drafter: {e}") from None
    if stack is not None:
        try:
            drafters = [compose.build(stack, drafters)]
        except (OSError, ValueError) as e:
            flag = {"treegraft": f"--treegraft {args.treegraft}", "switch": "--switch", None: "--boundaries"}
            raise UsageError(f"{flag[stack.composite]}: {e}") from None
    if args.adaptive:
        drafters = [adaptive_drafter(args, drafters, len(sources))]
    elif args.goodput and len(drafters) == 1 and drafters[0].gives_q and not drafters[0].reads_own_tree:
        try:  # the goodput budget cuts by calibrated estimates, learnt online (`AdaptiveShape.estimator`)
            d = drafters[0]
            n = d.resolve_tree(tree_lib.parse_tree_spec(d.default_tree if args.tree is None else args.tree)).num_nodes
            drafters = [AdaptiveShape.estimator(d, n)]
        except ValueError as e:
            raise UsageError(f"--goodput: {e}") from None

    prompts = chat_prompts(args, sources)
    ids = [tokenizer.encode(s).ids for s in prompts]
    limit = args.capacity if args.capacity is not None else cfg.max_position_embeddings
    limit_name = f"--capacity {limit}" if args.capacity is not None else f"the model's max_position_embeddings ({limit})"
    for (where, _), p in zip(sources, ids):
        if not p:
            raise UsageError(f"{where}: the prompt encodes to no tokens")
        if len(p) + args.max_new_tokens > limit:
            raise UsageError(f"{where}: prompt too long for the cache: {len(p)} prompt tokens + "
                             f"{args.max_new_tokens} new tokens = {len(p) + args.max_new_tokens} > {limit_name}")

    eos = () if args.ignore_eos else None  # None: the model config's eos_token_id
    eos_ids = set() if args.ignore_eos else set(cfg.eos_ids)
    kwargs = dict(generate_kwargs(args), eos_token_id=eos, mesh=mesh)
    if args.margin is not None and args.verify != "margin":
        raise UsageError("--margin is read by --verify margin only")
    if drafters:
        kwargs.update(drafters=drafters, tree=args.tree, verify=args.verify)
        if args.verify == "margin":
            if args.margin is None:
                raise UsageError("--verify margin needs --margin DELTA (a logit gap >= 0)")
            kwargs["margin"] = args.margin
            print(f"warning: --verify margin (delta {args.margin:g}) is lossy: the output is not the target's own "
                  "(AdaptiveSpec's margin rule; see tools/bench_adaptive.py for its divergence)", file=sys.stderr)
        if args.pack:
            kwargs["packing"] = Packing()
        elif args.goodput:
            try:
                kwargs["packing"] = load_packing(args.goodput, len(ids))
            except ValueError as e:
                raise UsageError(f"--goodput: {e}") from None
    elif args.tree is not None or args.verify is not None or args.pack or args.goodput:
        raise UsageError("--tree, --verify, --pack and --goodput need a --drafter")
    try:
        if args.warmup:  # compiles (timed) and runs once; the reported run is the second
            with compile_timer() as timing:
                specjax.generate(model, ids, **kwargs)
        with compile_timer() as timing_run:
            t0 = time.perf_counter()
            result = specjax.generate(model, ids, **kwargs)
            wall = time.perf_counter() - t0
    except ValueError as e:  # generate validates every input before tracing
        raise UsageError(str(e)) from None
    if not args.warmup:
        timing = timing_run

    seqs = result.sequences()
    steps = max(len(s) for s in seqs)
    run_s = wall - min(timing_run["compile_s"], wall)
    compile_s = timing["compile_s"]
    ms_per_token = 1000.0 * run_s / steps
    if args.json:
        for i, (prompt, p, s) in enumerate(zip(prompts, ids, seqs)):
            print(json.dumps({
                "index": i,
                "prompt": prompt,
                "prompt_tokens": len(p),
                "prompt_ids": p,
                "tokens": s,
                "text": tokenizer.decode(s),
                "finish_reason": "eos" if s and s[-1] in eos_ids else "length",
                "lossless": bool(result.lossless),
                "batch_size": len(seqs),
                "ms_per_token": round(ms_per_token, 3),
                "compile_s": round(compile_s, 4),
                "cache_hits": timing["cache_hits"],
                "wall_s": round(wall, 4),
                "warmup": bool(args.warmup),
                **spec_stats(result, i, drafters[0] if drafters else None),
            }, ensure_ascii=False), flush=True)
    else:
        for i, s in enumerate(seqs):
            if len(seqs) > 1:
                print(f"=== [{i}] ===")
            print(tokenizer.decode(s), flush=True)
        print(f"[specjax] batch {len(seqs)}, {sum(map(len, seqs))} tokens in {steps} steps: "
              f"{ms_per_token:.2f} ms/token, compile {compile_s:.2f} s ({timing['cache_hits']} programs from the "
              f"compilation cache), wall {wall:.2f} s",
              file=sys.stderr)
    return 0


def drafter_stack(args: argparse.Namespace):
    """The `compose.Stack` the drafter flags describe (None: the one --drafter as loaded)."""
    if args.treegraft is not None and (args.switch is not None or args.switch_tree is not None):
        raise UsageError("--treegraft and --switch combine the two --drafter flags in different ways: give one")
    if args.treegraft is None and (args.cheap_tree is not None or args.graft_nodes is not None
                                   or args.strong_tree is not None):
        raise UsageError("--cheap-tree, --graft-nodes and --strong-tree need --treegraft")
    if args.switch is None and args.switch_tree is not None:
        raise UsageError("--switch-tree needs --switch")
    n = len(args.drafter)
    if args.boundaries is not None:
        if n != 1 or args.treegraft is not None or args.switch is not None:
            raise UsageError("--boundaries is a DPara drafter's option: give one DPara --drafter")
        return compose.Stack.make(args.drafter, boundaries=args.boundaries)
    if args.treegraft is not None:
        if n != 2:
            raise UsageError(f"--treegraft combines exactly two --drafter flags (cheapest first), got {n}")
        return compose.Stack.make(args.drafter, "treegraft", policy=args.treegraft, cheap_tree=args.cheap_tree,
                                  strong_tree=args.strong_tree,
                                  graft_nodes=args.graft_nodes)
    if args.switch is not None:
        if n != 2:
            raise UsageError(f"--switch combines exactly two --drafter flags (ngram, then a model drafter), got {n}")
        return compose.Stack.make(args.drafter, "switch", min_match=args.switch, model_tree=args.switch_tree)
    if n > 1:
        raise UsageError("--drafter: several drafters share one tree only under TreeGraft or Switch: "
                         "add --treegraft SCHEDULER_DIR|always|never or --switch MIN_MATCH")
    return None


def chat_prompts(args: argparse.Namespace, sources) -> list[str]:
    """The prompt texts: chats ("messages" rows, or every prompt under --chat) rendered with the model's
    chat template (specjax.io.chat), plain prompts as given."""
    out = []
    for where, src in sources:
        if isinstance(src, str) and not args.chat:
            out.append(src)
            continue
        messages = src if isinstance(src, list) else [{"role": "user", "content": src}]
        try:
            out.append(render_chat(args.model, messages))
        except ValueError as e:
            raise UsageError(f"{where}: {e}") from None
    return out


def compile_cache(args: argparse.Namespace):
    """Switches the persistent compilation cache on (the folder) unless --no-compile-cache or
    $SPECJAX_COMPILE_CACHE=off; returns the folder or None."""
    if args.no_compile_cache:
        return None
    try:
        return enable_compilation_cache(args.compile_cache, programs=True)
    except ValueError as e:
        if args.compile_cache is not None:
            raise UsageError(f"--compile-cache: {e}") from None
        print(f"[specjax] warning: no compilation cache ({e}); compiling afresh (--compile-cache DIR to choose "
              f"a folder, --no-compile-cache to silence this)", file=sys.stderr)
        return None


def fold_config(args: argparse.Namespace):
    """The `--fold` flag as a `specjax.models.fold.FoldConfig` (None without it)."""
    if args.fold is None:
        return None
    if not args.drafter:
        raise UsageError("--fold changes a drafter's attention: it needs a --drafter (lm or feature)")
    try:
        return FoldConfig.parse(args.fold)
    except ValueError as e:
        raise UsageError(f"--fold {args.fold}: {e}") from None


def confidence_args(args: argparse.Namespace, n_prompts: int):
    """(confidence, costs) for `load_drafter` from --confidence / --verify-profile. `costs` (round
    seconds per verify width) only for 'schedule', from the profile's batch size nearest the run's."""
    conf = args.confidence.strip().lower() if args.confidence else "off"
    taps = None
    if args.tree is not None and "select=taps" in args.tree:
        try:
            taps = tree_lib.parse_tree_spec(args.tree)
        except ValueError as e:
            raise UsageError(f"--tree {args.tree}: {e}") from None
    if conf == "off" and taps is not None and args.verify_profile is not None:  # TAPS chooses its budget per round
        try:
            return "off", profile_lib.costs_at_widths(profile_lib.load_profile(args.verify_profile), n_prompts,
                                                      tree_widths(taps.num_nodes))
        except ValueError as e:
            raise UsageError(f"--verify-profile {args.verify_profile}: {e}") from None
    if conf != "schedule" and args.verify_profile is not None:
        if not args.adaptive:
            raise UsageError("--verify-profile is read only with --confidence schedule, --adaptive or a --tree with "
                             "select=taps")
        return conf if conf == "off" else _parse_conf(conf), None
    if conf == "off":
        return "off", None
    if not args.drafter:
        raise UsageError(f"--confidence {args.confidence} needs a block --drafter (DSpark)")
    if len(args.drafter) > 1 or args.treegraft is not None:
        raise UsageError("--confidence cuts a single block drafter's draft: not with several drafters or --treegraft")
    if conf != "schedule":
        try:
            return parse_confidence(conf), None
        except ValueError as e:
            raise UsageError(f"--confidence: {e}") from None
    # 'schedule': the costs need the drafter's verify widths (the default ones of a chain's node
    # count) and a profile; a drafter that is not a block drafter with a confidence head is refused
    # by load_drafter, so look for the profile only for one that is.
    drafter = args.drafter[0]
    try:
        cfg = block.read_config(drafter)
    except (OSError, ValueError):
        return "schedule", None  # not a block drafter: load_drafter says so
    if not cfg.confidence:
        return "schedule", None  # DFlash: load_drafter says it has no confidence head
    try:
        spec = tree_lib.parse_tree_spec(f"chain={cfg.block_size}" if args.tree is None else args.tree)
    except ValueError as e:
        raise UsageError(f"--tree {args.tree}: {e}") from None
    if not tree_lib.is_chain(spec):
        raise UsageError(f"--confidence schedule cuts a chain: use --tree chain=k (k <= {cfg.block_size}), "
                         f"not {args.tree}")
    widths = widths_lib.chain_widths(spec.num_nodes)
    path = args.verify_profile or find_verify_profile(args.model)
    make = (f"python -m tools.profile_widths --target {args.model} --drafter {drafter} --batch {n_prompts}"
            + (f" --tree {args.tree}" if args.tree is not None else f" --tree chain={cfg.block_size}"))
    if path is None:
        name = profile_lib.default_profile_name(args.model)
        raise UsageError(f"--confidence schedule needs the verify-width cost profile of this machine (no bench/{name} "
                         f"here or in the specjax repository): make one with `{make}`, or pass --verify-profile FILE")
    if not os.path.isfile(path):
        raise UsageError(f"--verify-profile {path}: no such file (make one with `{make}`)")
    try:
        costs = profile_lib.costs_from_profile(profile_lib.load_profile(path), n_prompts, widths)
    except ValueError as e:
        raise UsageError(f"--verify-profile {path}: {e}") from None
    return "schedule", costs


def _parse_conf(conf: str):
    try:
        return parse_confidence(conf)
    except ValueError as e:
        raise UsageError(f"--confidence: {e}") from None


def adaptive_drafter(args: argparse.Namespace, drafters: list, n_prompts: int):
    """--adaptive: the one drafter wrapped in `AdaptiveShape`, its costs from --verify-profile at the
    widths of the resolved --tree (`specjax.spec.widths.adaptive_widths`), with the drafter directory's
    `calibration.json` ("step" table) when it has one."""
    if len(drafters) != 1:
        raise UsageError("--adaptive shapes one drafter's tree: pass exactly one --drafter")
    d = drafters[0]
    try:
        spec = d.resolve_tree(tree_lib.parse_tree_spec(d.default_tree if args.tree is None else args.tree))
    except ValueError as e:
        raise UsageError(f"--tree {args.tree}: {e}") from None
    widths = adaptive_widths(spec.num_nodes)
    tree = args.tree or d.default_tree
    make = (f"python -m tools.profile_widths --adaptive --target {args.model} --drafter {args.drafter[0]} "
            f"--batch {n_prompts} --tree '{tree}'")
    path = args.verify_profile
    if path is None:
        raise UsageError(f"--adaptive needs this machine's verify-width cost profile: make one with `{make}` and pass "
                         "--verify-profile FILE")
    try:
        profile = profile_lib.load_profile(path)
        costs = profile_lib.costs_at_widths(profile, n_prompts, widths)
        row = profile["rows"][str(profile_lib.profile_batch(profile, n_prompts))]
        step = float(row["draft_s"]) / spec.max_depth if "draft_s" in row else None  # a chain may stop early
        cal = read_calibration(args.drafter[0]) if os.path.isdir(args.drafter[0]) else None
        cal = cal if cal is not None and STEP in cal.kinds() else None  # a TAPS-only file: no prior
        return AdaptiveShape(d, costs, calibration=cal, draft_step_s=step)
    except ValueError as e:
        raise UsageError(f"--adaptive: {e} (make a profile with `{make}`)") from None


def find_verify_profile(model_path: str) -> str | None:
    """bench/verify_profile_<model dir name>.json in the current directory, else in the specjax
    repository (next to the package); None when neither exists."""

    name = default_profile_name(model_path)
    for root in (Path.cwd(), Path(__file__).resolve().parents[1]):
        f = root / "bench" / name
        if f.is_file():
            return str(f)
    return None


def spec_stats(result, row: int, drafter=None) -> dict:
    """Per-prompt speculative statistics for --json (empty for autoregressive runs); a drafter's own
    sections (a composite's: `Drafter.report`) beside them."""
    if "tau" not in result.stats:
        return {}
    st = result.stats
    out = {"tau": round(float(st["tau"][row]), 4), "rounds": int(st["rounds"][row]),
           "accepted": int(st["accepted"][row]),
           "depth_acceptance": [round(float(x), 4) for x in st["depth_acceptance"][row]]}
    if "mean_verify_width" in st:  # nodes the target verified per round (< the tree's when drafts are cut)
        out["mean_verify_width"] = round(float(st["mean_verify_width"][row]), 4)
    if "drafted" in st:  # a block drafter's draft positions proposed after its cuts (per round: / rounds)
        out["drafted"] = int(st["drafted"][row])
    if drafter is not None:
        out.update(drafter.report(st, row))
    return out


def mesh_arg(text: str | None):
    """The --mesh flag's mesh (None without it); joins a multi-process run first when its variables are set."""
    if text is None:
        return None
    try:
        shape = sharding.parse_mesh_shape(text)
        sharding.initialize_distributed()
        return sharding.make_mesh(**shape)
    except ValueError as e:
        raise UsageError(f"--mesh: {e}") from None


def generate_kwargs(args: argparse.Namespace) -> dict:
    """Keyword arguments for `specjax.generate` from the `generate` flags (drafter / tree /
    verification flags add theirs here)."""
    return dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                top_p=args.top_p, seed=args.seed, capacity=args.capacity)


# ----------------------------------------------------------------------------- entry point

def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except UsageError as e:
        args.subparser.error(str(e))  # `specjax generate: error: ...`, exit status 2
    finally:
        disable_programs()  # the traced-program store is this command's (a library caller opts in itself)
    return 2
