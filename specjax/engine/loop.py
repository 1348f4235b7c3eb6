"""`generate`: prefill plus the whole decode loop as one jitted program.

The host only validates and pads the prompts, then calls one compiled function per (batch,
prompt bucket, max_new_tokens, greedy) shape; inside it a `lax.while_loop` runs until every row
has produced an EOS or `max_new_tokens` tokens. No host round-trip per token.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.spec import sampling
from specjax.models import sharding
from specjax.spec import tree as tree_lib
from specjax.spec import verify as verify_lib
from specjax.spec import widths as widths_lib
from specjax.drafters.base import Committed, DraftContext, Drafter, Proposal
from specjax.io import compile_cache
from specjax.models import family
from specjax.models import prefill as prefill_lib
from specjax.models.transformer import Model, model_attention
from specjax.spec import packing as packing_lib
from specjax.spec.sampling import SamplingParams
from specjax.models.sharding import BATCH, REPLICATED
from specjax.typing import Array, Bool, Int

PROMPT_BUCKET = 32  # prompts are right-padded to a multiple of this, so lengths share compiles
# Default budget for a recurrent target's per-node tree state buffer (see `check_state_budget`).
DEFAULT_STATE_BUDGET_BYTES = 1 << 30

_trace_count = 0


def trace_count() -> int:
    """How many times a generation program has been traced (tests check it stays put)."""
    return _trace_count


@dataclasses.dataclass(frozen=True)
class GenerationResult:
    tokens: np.ndarray  # int32 [B, max_new_tokens]; entries past `lengths` are padding
    lengths: np.ndarray  # int32 [B]: generated tokens per row, an EOS included
    stats: dict = dataclasses.field(default_factory=dict)
    # False when a lossy rule (verify="margin") produced the tokens: they are not the target's own
    lossless: bool = True

    def sequences(self) -> list[list[int]]:
        return [self.tokens[b, : self.lengths[b]].tolist() for b in range(len(self.lengths))]


@dataclasses.dataclass(frozen=True)
class PreparedBatch:
    tokens: np.ndarray  # int32 [B, P], right-padded
    lengths: np.ndarray  # int32 [B]
    capacity: int


def prepare_prompts(prompts: Sequence[Sequence[int]], vocab_size: int, max_new_tokens: int,
                    capacity: int | None = None, slack: int = 0, max_positions: int | None = None) -> PreparedBatch:
    """Validates and right-pads token-id prompts. Raises ValueError before anything is traced, also for a
    prompt longer than `max_positions` (the model's context, `max_position_embeddings`)."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or len(prompts) == 0:
        raise ValueError("prompts must be a non-empty list of token-id lists")
    if isinstance(prompts[0], (int, np.integer)):
        raise ValueError("prompts must be a list of token-id lists (got a flat list of ints; wrap it: [prompt])")
    if int(max_new_tokens) != max_new_tokens or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens}")
    rows = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            raise ValueError(f"prompt {i} is a string; tokenize it first (specjax.load_tokenizer)")
        arr = np.asarray(p)
        if arr.ndim != 1:
            raise ValueError(f"prompt {i} must be a flat sequence of token ids, got shape {arr.shape}")
        if arr.size == 0:
            raise ValueError(f"prompt {i} is empty")
        if not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"prompt {i} holds non-integer values ({arr.dtype})")
        if arr.min() < 0 or arr.max() >= vocab_size:
            bad = int(arr[(arr < 0) | (arr >= vocab_size)][0])
            raise ValueError(f"prompt {i} has token id {bad} outside the vocabulary [0, {vocab_size})")
        rows.append(arr.astype(np.int32))
    lengths = np.array([len(r) for r in rows], np.int32)
    if max_positions is not None and lengths.max() > max_positions:
        i = int(np.argmax(lengths))
        raise ValueError(f"prompt {i} has {lengths[i]} tokens, more than the model's context "
                         f"(max_position_embeddings = {max_positions}); shorten it")
    P = prefill_lib.prompt_bucket(int(lengths.max()), PROMPT_BUCKET)  # chunk multiples above one chunk
    need = int(lengths.max()) + max_new_tokens + slack
    if capacity is None:
        capacity = P + max_new_tokens + slack
    elif need > capacity:
        raise ValueError(f"the longest prompt ({lengths.max()} tokens) + max_new_tokens ({max_new_tokens})"
                         + (f" + tree slack ({slack})" if slack else "")
                         + f" = {need} exceeds the cache capacity {capacity}")
    P = min(P, capacity)
    tokens = np.zeros((len(rows), P), np.int32)
    for b, r in enumerate(rows):
        tokens[b, : len(r)] = r
    return PreparedBatch(tokens, lengths, capacity)


def eos_array(model: Model, eos_token_id) -> np.ndarray:
    if eos_token_id is None:
        ids = model.config.eos_ids
    elif isinstance(eos_token_id, (int, np.integer)):
        ids = (int(eos_token_id),)
    else:
        ids = tuple(int(e) for e in eos_token_id)
    for e in ids:
        if not 0 <= e < model.config.vocab_size:
            raise ValueError(f"eos_token_id {e} is outside the vocabulary [0, {model.config.vocab_size})")
    return np.array(ids if ids else (-1,), np.int32)  # -1 never matches a token


def generate(model: Model, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 64,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
             eos_token_id: int | Sequence[int] | None = None, seed: int = 0,
             capacity: int | None = None, drafters: Sequence = (), tree=None,
             verify: str | None = None, margin: float | None = None,
             state_budget_bytes: int | None = None, mesh: jax.sharding.Mesh | None = None,
             packing: packing_lib.Packing | None = None) -> GenerationResult:
    """Generation of a ragged batch of token-id prompts, autoregressive or speculative.

    temperature == 0 is greedy. `eos_token_id` defaults to the model config's; a row stops at
    its first EOS (which is kept in its output). `capacity` (default: just enough) sizes the KV cache.
    With `drafters`, each round drafts a tree (`tree`: a spec string, path list or TreeSpec) and
    verifies it with `verify` ("greedy" at temperature 0; "deterministic" — the default when
    sampling —, "sampled" or "sampled_noreplace"); verify="margin" with `margin=δ` is AdaptiveSpec's
    lossy margin rule (opt-in, never a default; the result says `lossless=False`; see `specjax.spec.verify`).
    A recurrent (hybrid) target verifies a tree with a per-node state buffer; `state_budget_bytes`
    bounds it (see `check_state_budget`; default: the larger of 1 GiB and the committed cache).

    `packing` (`specjax.spec.packing.Packing`, design §19): each row verifies its own nodes and the
    target computes only those (packed into the smallest compiled budget), in place of the width
    every row shares; `Packing()` gives per-row widths, `load_packing(profile, batch)` adds the goodput
    budget (nodes cut where their estimate does not pay for their slot). The stats then carry
    `mean_T`, the nodes the verify forward computed per round.

    `mesh` (a `jax.sharding.Mesh` with axes `data` and/or `model`, `specjax.models.sharding.make_mesh`) runs
    the same one program sharded (design §10): the target's and the drafter's parameters by their
    families' partition tables (tensor parallel over `model`), the batch rows over `data` (the batch
    must be a multiple of its size), the caches, drafter state and tree buffers pinned to match every
    round; the outputs come back replicated. A mesh over several processes (`jax.distributed`,
    `sharding.initialize_distributed`) works alike: every process calls `generate` with the same arguments.
    """
    sampling.validate(temperature, top_k, top_p)
    eos = eos_array(model, eos_token_id)
    if mesh is not None:
        mesh = sharding.check_mesh(mesh)
    if drafters:
        return _generate_speculative(model, prompts, list(drafters), tree, verify, eos, margin=margin,
                                     max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                                     top_p=top_p, seed=seed, capacity=capacity,
                                     state_budget_bytes=state_budget_bytes, mesh=mesh, packing=packing)
    if tree is not None or verify is not None or margin is not None or packing is not None:
        raise ValueError("tree=, verify=, margin= and packing= need at least one drafter")
    batch = prepare_prompts(prompts, model.config.vocab_size, max_new_tokens, capacity,
                            max_positions=model.config.max_position_embeddings)
    graphdef, state = nnx.split(model)
    inputs = _placed(mesh, state, (family(model).PARTITION_RULES,), batch,
                     (SamplingParams.make(temperature, top_k, top_p), jax.random.key(seed), jnp.asarray(eos)))
    with sharding.mesh_context(mesh):
        tokens, lengths = _run(_generate_ar, graphdef, inputs, mesh, capacity=batch.capacity,
                               max_new_tokens=int(max_new_tokens), greedy=temperature == 0)
    return GenerationResult(sharding.gather(tokens), sharding.gather(lengths))


def _run(program, graphdef, inputs: tuple, mesh, **static):
    """A generation program on its inputs: without a mesh through `compile_cache.call` (the traced-program
    store, where the caller switched it on: the CLI), else the plain call."""
    if mesh is None:
        return compile_cache.call(program, (graphdef,), inputs, **static)
    return program(graphdef, *inputs, **static)


def _placed(mesh, state, rules: tuple, batch: PreparedBatch, replicated: tuple) -> tuple:
    """The program's inputs (state, prompt, lengths, *replicated): as they are without a mesh; on a
    mesh, `state` (an `nnx.split` state: one part per module, part i laid out by `rules[i]`) by its
    partition tables, the prompt rows over `data`, the rest replicated."""
    prompt, lengths = jnp.asarray(batch.tokens), jnp.asarray(batch.lengths)
    if mesh is None:
        return (state, prompt, lengths) + tuple(replicated)
    B, data = len(batch.lengths), sharding.axis_size(mesh, sharding.DATA)
    if B % data:
        raise ValueError(f"the batch ({B} rows) must be a multiple of the mesh's data axis ({data}): its rows are "
                         f"split over it (pad the batch, or use a smaller data axis)")
    if len(rules) == 1:  # nnx.split of one module: its paths start at the module
        specs = sharding.param_specs(state, rules[0])
    else:  # nnx.split of a tuple of modules: the first key is the module's index
        specs = jax.tree_util.tree_map_with_path(
            lambda kp, _: sharding.spec_for(sharding.path_str(kp[1:]), rules[kp[0].key]), state)
    return (sharding.place(state, specs, mesh), sharding.place(prompt, BATCH, mesh),
            sharding.place(lengths, BATCH, mesh)) + tuple(sharding.place(x, REPLICATED, mesh) for x in replicated)


def is_eos(tokens_B, eos_E):
    return jnp.any(tokens_B[:, None] == eos_E[None, :], axis=-1)


def last_logits(logits_BxTxV, lengths_B):
    """Each row's logits at its last prompt position (a whole prefill's [B, P, V] or a chunked one's [B, 1, V])."""
    return prefill_lib.prompt_logits(logits_BxTxV, lengths_B)


@jax.jit(static_argnames=("graphdef", "capacity", "max_new_tokens", "greedy"))
def _generate_ar(graphdef, state, prompt_BxP, lengths_B, params: SamplingParams, key, eos_E,
                 *, capacity: int, max_new_tokens: int, greedy: bool):
    global _trace_count
    _trace_count += 1
    model = nnx.merge(graphdef, state)
    B = prompt_BxP.shape[0]
    M = max_new_tokens
    fam = family(model)  # transformer or hybrid: the target's functions
    cache = fam.init_cache(model, B, capacity)
    with jax.named_scope("prefill"):
        out = prefill_lib.prefill(fam, model, prompt_BxP, lengths_B, cache)  # in chunks when long
        tok_B = sampling.sample(jax.random.fold_in(key, 0), last_logits(out.logits, lengths_B), params, greedy)
    buf_BxM = jnp.zeros((B, M), jnp.int32).at[:, 0].set(tok_B)
    done_B = is_eos(tok_B, eos_E)
    n_B = jnp.ones((B,), jnp.int32)
    # on a mesh (design §10): rows over `data`, the cache as its family lays it out; no-op otherwise
    pin = lambda c: sharding.constrain(c, (REPLICATED, BATCH, fam.cache_partition(c[2]), BATCH, BATCH, BATCH))

    def cond(carry):
        i, _, _, done_B, _, _ = carry
        return (i < M) & ~jnp.all(done_B)

    def body(carry):
        i, tok_B, cache, done_B, n_B, buf_BxM = carry
        with jax.named_scope("decode"):  # the one-token forward (what speculation replaces)
            out = fam.decode_step(model, tok_B, cache)
        tok_B = sampling.sample(jax.random.fold_in(key, i), out.logits[:, 0], params, greedy)
        tok_B = jnp.where(done_B, 0, tok_B)
        buf_BxM = buf_BxM.at[:, i].set(tok_B)
        n_B = n_B + (~done_B).astype(jnp.int32)
        done_B = done_B | is_eos(tok_B, eos_E)
        return pin((i + 1, tok_B, out.cache, done_B, n_B, buf_BxM))

    _, _, _, _, n_B, buf_BxM = jax.lax.while_loop(cond, body, pin((jnp.int32(1), tok_B, out.cache, done_B, n_B, buf_BxM)))
    return sharding.constrain((buf_BxM, n_B), REPLICATED)  # every process reads the whole result


# ----------------------------------------------------------------------------- speculative



def resolve_rule(verify: str | None, temperature: float) -> str:
    if verify is not None and verify not in verify_lib.RULES:
        raise ValueError(f"unknown verification rule {verify!r}; choose from {', '.join(verify_lib.RULES)}")
    if verify == "margin":  # lossy, at any temperature (greedy margin at 0, relaxed deterministic above)
        return "margin"
    if temperature == 0:
        if verify not in (None, "greedy"):
            raise ValueError(f"verify={verify!r} samples; it needs temperature > 0 (temperature 0 is greedy)")
        return "greedy"
    if verify == "greedy":
        raise ValueError("verify='greedy' needs temperature 0")
    return verify or "deterministic"


def check_margin(rule: str, margin) -> float:
    """δ for the margin rule (ValueError unless a finite number >= 0); 0.0 for the lossless rules,
    which take none."""
    if rule != "margin":
        if margin is not None:
            raise ValueError(f"margin= is read by verify='margin' only (the lossy rule), not {rule!r}")
        return 0.0
    if margin is None:
        raise ValueError("verify='margin' needs margin=δ (a logit gap >= 0; 0 is the lossless rule)")
    try:
        m = float(margin)
    except (TypeError, ValueError):
        raise ValueError(f"margin must be a number >= 0, got {margin!r}") from None
    if not math.isfinite(m) or m < 0:
        raise ValueError(f"margin must be a finite number >= 0, got {margin!r}")
    return m


def check_state_budget(model, batch: int, num_nodes: int, capacity: int, state_budget_bytes: int | None = None) -> int:
    """Refuses (ValueError) a tree whose per-node recurrent-state buffer would not fit the budget.

    A hybrid target keeps, during verification, every tree node's delta-rule and convolution
    state: `batch * num_nodes * family(model).node_state_bytes(config)` bytes (0 for attention-only
    targets, whose tree K/V live in the cache's scratch slots, already covered by `capacity`).
    The budget is `state_budget_bytes` when given, else the larger of DEFAULT_STATE_BUDGET_BYTES
    (1 GiB) and the committed cache itself at this batch and capacity (K/V + recurrent state):
    by default the tree may at most double the cache's memory. Returns the buffer's bytes.
    """
    fam = family(model)
    per_node = fam.node_state_bytes(model.config)
    need = batch * num_nodes * per_node
    if state_budget_bytes is not None and (int(state_budget_bytes) != state_budget_bytes or state_budget_bytes < 0):
        raise ValueError(f"state_budget_bytes must be a non-negative integer, got {state_budget_bytes}")
    if need == 0:
        return 0
    cache = fam.cache_bytes(model.config, batch, capacity)
    budget = state_budget_bytes if state_budget_bytes is not None else max(DEFAULT_STATE_BUDGET_BYTES, cache)
    if need > budget:
        raise ValueError(
            f"the tree's per-node recurrent-state buffer needs {need:,} bytes ({batch} rows x {num_nodes} nodes x "
            f"{per_node:,} bytes per node) but the state budget is {budget:,} bytes"
            + ("" if state_budget_bytes is not None else f" (default: max(1 GiB, the committed cache {cache:,} bytes))")
            + "; use a smaller tree or batch, or raise state_budget_bytes")
    return need


@dataclasses.dataclass(frozen=True)
class RoundPlan:
    """The host-side setup of a speculative loop, before tracing (`plan_rounds`)."""
    spec: Any  # the resolved tree spec
    rule: str  # the verification rule
    mode: str  # how the drafter picks children: "topk" | "sample" | "sample_noreplace"
    delta: float  # the margin rule's delta (0 otherwise)
    slack: int  # cache slots past prompt + max_new_tokens the rounds write


def plan_rounds(model: Model, drafter: Drafter, tree, verify, temperature: float, margin=None) -> RoundPlan:
    """What every speculative loop checks and decides on the host before tracing: the drafter's
    vocabulary, its resolved tree, the rule, the drafter's own refusals and the scratch it needs.
    `generate` starts from it."""
    V = model.config.vocab_size
    if drafter.vocab_size is not None and drafter.vocab_size != V:
        raise ValueError(f"drafter {drafter.name!r} has vocabulary {drafter.vocab_size} but the target has {V}: "
                         "a drafter must share the target's tokenizer")
    spec = drafter.resolve_tree(tree_lib.parse_tree_spec(drafter.default_tree if tree is None else tree))
    rule = resolve_rule(verify, temperature)
    delta = check_margin(rule, margin)
    mode = {"sampled": "sample", "sampled_noreplace": "sample_noreplace"}.get(rule, "topk")
    # The drafter refuses what it cannot draft (e.g. sampled rules without q) and says what scratch it needs.
    scratch = drafter.check_tree(spec, rule)
    widths_lib.check_widths(drafter.verify_widths(spec), spec.num_nodes)
    if mode != "topk" and isinstance(spec, tree_lib.DynamicTree):
        raise ValueError(f"verify={rule!r} draws candidates from q: it needs a static tree, not a dynamic one")
    evaluated = max(spec.pool_size if isinstance(spec, tree_lib.DynamicTree) else spec.num_nodes, scratch)
    slack = max(spec.num_nodes, evaluated) + spec.max_depth + 2
    return RoundPlan(spec, rule, mode, delta, slack)


def _generate_speculative(model: Model, prompts, drafters, tree, verify, eos, *, max_new_tokens,
                          temperature, top_k, top_p, seed, capacity, margin=None,
                          state_budget_bytes=None, mesh=None, packing=None) -> GenerationResult:
    if len(drafters) > 1:
        raise ValueError("several drafters share one tree only under TreeGraft: pass one drafter, e.g. "
                         "specjax.drafters.composite.treegraft.TreeGraft(cheap, strong, policy=...)")
    drafter = drafters[0]
    if not isinstance(drafter, Drafter):
        raise ValueError(f"a drafter must subclass specjax.drafters.Drafter (the drafter contract), got "
                         f"{type(drafter).__name__}")
    plan = plan_rounds(model, drafter, tree, verify, temperature, margin)
    spec, rule, mode, delta, slack = plan.spec, plan.rule, plan.mode, plan.delta, plan.slack
    V = model.config.vocab_size
    batch = prepare_prompts(prompts, V, max_new_tokens, capacity, slack=slack,
                            max_positions=model.config.max_position_embeddings)
    check_state_budget(model, len(batch.lengths), spec.num_nodes, batch.capacity, state_budget_bytes)
    packing = check_packing(model, packing, len(batch.lengths), spec.num_nodes)
    if packing is not None and mesh is not None:
        raise ValueError("packed verification runs on one device: it packs nodes across rows, which a mesh shards "
                         "over `data` (not built; use packing=None on a mesh)")
    drafter.validate(batch.capacity)  # the drafter's own checks against its cache capacity (e.g. FOLD's window)
    graphdef, state = nnx.split((model, drafter))
    inputs = _placed(mesh, state, (family(model).PARTITION_RULES, drafter.partition_rules), batch,
                     (SamplingParams.make(temperature, top_k, top_p), jax.random.key(seed), jnp.asarray(eos),
                      jnp.float32(delta)))
    with sharding.mesh_context(mesh):
        tokens, lengths, stats = _run(_generate_spec, graphdef, inputs, mesh, capacity=batch.capacity,
                                      max_new_tokens=int(max_new_tokens), rule=rule, spec=spec, mode=mode,
                                      greedy=temperature == 0, packing=packing)
    tokens, lengths = sharding.gather(tokens), sharding.gather(lengths)
    stats = {k: sharding.gather(v) for k, v in stats.items()}
    rounds = np.maximum(stats["rounds"], 1)
    stats["tau"] = 1.0 + stats["accepted"] / rounds
    stats["depth_acceptance"] = stats["accepted_at_depth"] / rounds[:, None]
    stats["mean_verify_width"] = stats["verified_nodes"] / rounds
    stats["mean_T"] = float(stats["batch_nodes"][0] / max(int(stats["batch_rounds"][0]), 1))
    return GenerationResult(tokens, lengths, stats, lossless=verify_lib.LOSSLESS[rule])


def _write_rows(buf_BxT, new_BxK, start_B):
    return jax.vmap(lambda b, n, s: jax.lax.dynamic_update_slice(b, n, (s,)))(buf_BxT, new_BxK, start_B)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RoundStats:
    """Per-row counters of the loop (the engine's; a drafter adds its own through `loop_stats`)."""
    rounds: Int[Array, "B"]  # rounds the row took part in
    accepted: Int[Array, "B"]  # accepted draft tokens (bonus tokens not counted)
    accepted_at_depth: Int[Array, "B D"]  # rounds whose accepted path reached depth d+1
    verified_nodes: Int[Array, "B"]  # tree nodes the target verified, summed over the row's rounds
    # the loop's rounds and the nodes the target's verify forward computed in them (B x width, or the
    # packed budget T), the same in every row: mean T = batch_nodes / batch_rounds
    batch_rounds: Int[Array, "B"]
    batch_nodes: Int[Array, "B"]

    @classmethod
    def zeros(cls, B: int, D: int) -> "RoundStats":
        z = jnp.zeros((B,), jnp.int32)
        return cls(rounds=z, accepted=z, accepted_at_depth=jnp.zeros((B, D), jnp.int32), verified_nodes=z,
                   batch_rounds=z, batch_nodes=z)

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoopCarry:
    """The state of the generation loop between rounds."""
    r: Int[Array, ""]  # round counter (folds into the RNG key)
    root: Int[Array, "B"]  # the last emitted token of each row: next round's tree root
    cache: Any  # the target's committed cache (KVCache, or HybridCache for a hybrid target)
    dstate: Any  # the drafter's state
    done: Bool[Array, "B"]  # the row hit EOS or max_new_tokens
    n_out: Int[Array, "B"]  # tokens emitted so far per row
    buf: Int[Array, "B M+D+1"]  # emitted tokens (a round may write up to D+1 past M; cut at the end)
    stats: RoundStats


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RoundOutput:
    """What one round did (for TreeGraft's value system and the benches)."""
    proposal: Proposal
    verdict: verify_lib.Verdict
    committed: Committed
    active: Bool[Array, "B"]  # rows still generating at the round's start
    emitted: Int[Array, "B"]  # tokens this round added to each row's output


def spec_start(model, drafter, prompt_BxP, lengths_B, params: SamplingParams, key, eos_E, *, capacity: int,
               max_new_tokens: int, spec, greedy: bool) -> LoopCarry:
    """Prefill target and drafter and emit the first token: the loop's initial carry."""
    B, M, D = prompt_BxP.shape[0], max_new_tokens, spec.max_depth
    fam = family(model)  # transformer or hybrid: the target's functions
    with jax.named_scope("prefill"):
        out = prefill_lib.prefill(fam, model, prompt_BxP, lengths_B, fam.init_cache(model, B, capacity),
                                  hidden_layers=tuple(drafter.target_layers))  # in chunks when long
        root_B = sampling.sample(jax.random.fold_in(key, 0), last_logits(out.logits, lengths_B), params, greedy)
    with jax.named_scope("draft_init"):
        dstate = drafter.prepare(drafter.init(prompt_BxP, lengths_B, capacity, out), spec)
    carry = LoopCarry(r=jnp.int32(1), root=root_B, cache=out.cache,
                      dstate=dstate,
                      done=is_eos(root_B, eos_E) | (M <= 1), n_out=jnp.ones((B,), jnp.int32),
                      buf=jnp.zeros((B, M + D + 1), jnp.int32).at[:, 0].set(root_B),
                      stats=RoundStats.zeros(B, D))
    return pin_carry(carry, fam, drafter)


def pin_carry(carry: LoopCarry, fam, drafter) -> LoopCarry:
    """The carry pinned to its layout on the context mesh (design §10): rows over `data`, the target's
    cache by its family (`cache_partition`), the drafter's state by `drafter.state_partition`. A
    no-op without a mesh (`sharding.constrain`)."""
    specs = LoopCarry(r=REPLICATED, root=BATCH, cache=fam.cache_partition(carry.cache),
                      dstate=drafter.state_partition(carry.dstate, carry.root.shape[0]), done=BATCH, n_out=BATCH,
                      buf=BATCH, stats=BATCH)
    return sharding.constrain(carry, specs)


def spec_round(model, drafter, carry: LoopCarry, params: SamplingParams, key, eos_E, *, max_new_tokens: int,
               rule: str, spec, mode: str, margin=0.0, greedy: bool | None = None,
               packing: packing_lib.Packing | None = None) -> tuple[LoopCarry, RoundOutput]:
    """One round: draft a tree, verify it in one target forward, commit the accepted path in the
    target and the drafter, emit accepted + bonus tokens (cut at EOS and max_new_tokens).

    The body of the generation loop, and (jitted alone) the single round that TreeGraft's value
    system steps from the host. A drafter with several `verify_widths` has the target verify only
    the smallest compiled width that holds every active row's last valid node (`lax.switch`).
    `margin` / `greedy` (default: rule == "greedy"): the lossy margin rule's δ and temperature-0 flag.
    `packing` (`specjax.spec.packing.Packing`): each row verifies its own live nodes, packed (design §19),
    in place of the width switch; with its cost table, the goodput budget cuts nodes first."""
    M, D = max_new_tokens, spec.max_depth
    layers = tuple(drafter.target_layers)
    fam = family(model)
    root_B, cache, done_B = carry.root, carry.cache, carry.done
    k_draft, k_verify = jax.random.split(jax.random.fold_in(key, carry.r))
    active = ~done_B
    with jax.named_scope("draft"):
        prop = drafter.propose(carry.dstate, root_B, DraftContext(spec, mode, params, k_draft, active=active))
    tree = sharding.constrain(prop.tree, BATCH)  # tree buffers: rows over `data` (no-op without a mesh)
    tree = tree_lib.well_formed(tree, root_B, D)  # the engine verifies a well-formed tree whatever was proposed
    widths = widths_lib.check_widths(drafter.verify_widths(spec), spec.num_nodes)
    with jax.named_scope("verify_forward"):
        if packing is not None:
            logits, hidden, tcache, width, tree, computed = _verify_forward_packed(model, fam, tree, prop.est, cache,
                                                                                   active, packing, D, layers)
        elif len(widths) == 1:
            tout = fam.forward(model, tree.tokens, tree_lib.positions(tree, cache.length), cache,
                               tree_lib.ancestor_mask(tree, D), hidden_layers=layers, parents=tree.parents)
            logits, hidden, tcache = tout.logits, tout.hidden, tout.cache
            width = jnp.int32(widths[0])
        else:
            logits, hidden, tcache, width, tree = _verify_forward_switch(model, fam, tree, cache, active, widths, D,
                                                                         layers)
        if packing is None:
            computed = width * root_B.shape[0]  # every row padded to the width
    with jax.named_scope("verify_walk"):
        vd = verify_lib.verify(tree, logits, k_verify, rule=rule, max_depth=D, params=params,
                               draft_probs_BxNxV=prop.probs, margin=margin,
                               greedy=rule == "greedy" if greedy is None else greedy)
    keep_B = jnp.where(active, vd.num_accepted + 1, 0)  # finished rows stand still
    with jax.named_scope("commit"):
        features = None
        if layers:  # target features along the accepted path, for feature drafters
            features = jnp.take_along_axis(jnp.concatenate(hidden, axis=-1), vd.path[..., None], axis=1)
        cache = fam.commit(tcache, vd.path, keep_B)
        committed = Committed(tokens=jnp.concatenate([root_B[:, None], vd.tokens], axis=1), count=keep_B, features=features,
                              target=cache, nodes=vd.path)
        dstate = drafter.commit(prop.state, committed)
    new, out = _emit(carry, prop, vd, committed, dstate, cache, active, width, computed, eos_E, M, D)
    return pin_carry(new, fam, drafter), out


@jax.named_scope("emit")
def _emit(carry: LoopCarry, prop, vd, committed, dstate, cache, active, width, computed, eos_E, M: int, D: int):
    """The round's emission: accepted tokens and the bonus into the output buffer, stopping rules, stats.
    `width`: the nodes each row verified (a scalar, or [B] when packed); `computed`: the nodes the
    target's forward computed this round (B x width, or the packed budget T)."""
    done_B, n_out_B, buf = carry.done, carry.n_out, carry.buf
    # Emit the accepted tokens and the bonus, cut at the first EOS and at max_new_tokens.
    i = jnp.arange(D + 1)[None]
    n = vd.num_accepted[:, None]
    emitted = jnp.where(i < n, jnp.pad(vd.tokens, ((0, 0), (0, 1))), jnp.where(i == n, vd.bonus[:, None], 0))
    hit = is_eos(emitted.reshape(-1), eos_E).reshape(emitted.shape) & (i <= n)
    count = jnp.where(jnp.any(hit, axis=1), jnp.argmax(hit, axis=1) + 1, vd.num_accepted + 1)
    count = jnp.where(active, jnp.minimum(count, M - n_out_B), 0)
    buf = _write_rows(buf, emitted, n_out_B)
    n_out_B = n_out_B + count
    done_B = done_B | (active & jnp.any(hit & (i < count[:, None]), axis=1)) | (n_out_B >= M)
    act = active.astype(jnp.int32)
    st = carry.stats
    stats = RoundStats(rounds=st.rounds + act, accepted=st.accepted + act * vd.num_accepted,
                       accepted_at_depth=st.accepted_at_depth
                       + act[:, None] * (jnp.arange(D)[None] < vd.num_accepted[:, None]).astype(jnp.int32),
                       verified_nodes=st.verified_nodes + act * width,
                       batch_rounds=st.batch_rounds + 1, batch_nodes=st.batch_nodes + computed)
    new = LoopCarry(r=carry.r + 1, root=jnp.where(active, vd.bonus, carry.root), cache=cache, dstate=dstate,
                    done=done_B, n_out=n_out_B, buf=buf, stats=stats)
    return new, RoundOutput(proposal=prop, verdict=vd, committed=committed, active=active, emitted=count)


def verify_need(tree: tree_lib.TreeBuffers, active_B) -> Int[Array, ""]:
    """The tree width this round must verify: max over active rows of 1 + the largest index of a
    valid node (at least 1: the root)."""
    N = tree.num_nodes
    last_B = jnp.max(jnp.where(tree.valid, jnp.arange(N, dtype=jnp.int32)[None], 0), axis=1)
    return jnp.maximum(jnp.max(jnp.where(active_B, last_B + 1, 1)), 1).astype(jnp.int32)


def _verify_forward_switch(model, fam, tree: tree_lib.TreeBuffers, cache, active_B, widths: tuple[int, ...],
                           max_depth: int, layers: tuple[int, ...]):
    """The target's verification forward at the smallest compiled width that holds every active
    row's last valid node (design §3b): one `lax.switch` branch per width, each traced once, running
    the first w nodes and padding logits, hidden states and the per-node cache back to N nodes.
    Returns (logits [B, N, V], hidden, cache, width, tree): `tree` with every node at or past the
    chosen width invalid (a no-op on active rows; finished rows never walk the padding)."""
    N = tree.num_nodes
    need = verify_need(tree, active_B)
    index = jnp.sum(jnp.asarray(widths, jnp.int32) < need).astype(jnp.int32)  # smallest width >= need
    pos = tree_lib.positions(tree, cache.length)

    def branch(w):
        def run(_):
            sub = jax.tree.map(lambda x: x[:, :w], tree)
            out = fam.forward(model, sub.tokens, pos[:, :w], cache, tree_lib.ancestor_mask(sub, max_depth),
                              hidden_layers=layers, parents=sub.parents)

            def pad(x):  # [B, w, ...] -> [B, N, ...]
                return jnp.pad(x, [(0, 0), (0, N - w)] + [(0, 0)] * (x.ndim - 2))

            return pad(out.logits), tuple(pad(h) for h in out.hidden), fam.pad_nodes(out.cache, N)
        return run

    logits, hidden, tcache = jax.lax.switch(index, [branch(w) for w in widths], None)
    width = jnp.asarray(widths, jnp.int32)[index]
    tree = dataclasses.replace(tree, valid=tree.valid & (jnp.arange(N)[None] < width))
    return logits, hidden, tcache, width, tree


def min_rows(model) -> int:
    """The smallest block the model's attention takes (a batch-invariant one pads shorter blocks)."""
    return getattr(model_attention(model), "min_rows", 1)


def check_packing(model, packing, batch: int, num_nodes: int):
    """`generate(packing=)` checked on the host (ValueError): a `Packing`, a family that packs, budgets
    that fit this batch and tree. Returns the packing with its budgets resolved."""
    if packing is None:
        return None
    if not isinstance(packing, packing_lib.Packing):
        raise ValueError(f"packing must be a specjax.spec.packing.Packing (or None), got {type(packing).__name__}")
    if not getattr(family(model), "PACKS", False):
        raise ValueError(f"packed verification is built for dense transformer targets; {type(model).__module__} "
                         "does not pack its forward (use the verify-width switch: packing=None)")
    if num_nodes < min_rows(model):
        raise ValueError(f"packed verification needs trees of at least {min_rows(model)} nodes on this model")
    return dataclasses.replace(packing, budgets=packing.resolve(batch, num_nodes, min_rows(model)))


def _verify_forward_packed(model, fam, tree: tree_lib.TreeBuffers, est_BxN, cache, active_B, packing, max_depth: int,
                           layers: tuple[int, ...]):
    """The target's verification forward over the round's live nodes, packed (design §19): each
    active row's valid nodes (a finished row's none), cut first by the goodput budget when `packing`
    has a cost table (estimates: the proposal's `est`, else exp(tree.score)); one `lax.switch` branch
    per compiled budget T, the smallest holding them. Returns (logits [B, N, V], hidden, cache,
    nodes verified per row [B], tree with the cut nodes invalid, T)."""
    B, N = tree.valid.shape
    budgets = packing.resolve(B, N, min_rows(model))
    anc = tree_lib.ancestor_mask(tree, max_depth)
    live = packing_lib.live_nodes(tree.valid, active_B)
    if packing.goodput:
        est = packing_lib.score_estimates(tree.score, tree.valid) if est_BxN is None else est_BxN
        live, _ = packing_lib.choose_packed(est, live, anc, packing.round_s, budgets)
    index = jnp.sum(jnp.asarray(budgets, jnp.int32) < jnp.sum(live)).astype(jnp.int32)
    pos = tree_lib.positions(tree, cache.length)

    def branch(T):
        def run(_):
            out = fam.forward(model, tree.tokens, pos, cache, anc, hidden_layers=layers, parents=tree.parents,
                              pack=packing_lib.pack_index(live, T))
            return out.logits, out.hidden, out.cache
        return run

    logits, hidden, tcache = jax.lax.switch(index, [branch(T) for T in budgets], None)
    tree = dataclasses.replace(tree, valid=jnp.where(active_B[:, None], live, tree.valid))
    return logits, hidden, tcache, jnp.sum(live, axis=1, dtype=jnp.int32), tree, jnp.asarray(budgets, jnp.int32)[index]


@jax.jit(static_argnames=("graphdef", "capacity", "max_new_tokens", "rule", "spec", "mode", "greedy", "packing"))
def _generate_spec(graphdef, state, prompt_BxP, lengths_B, params: SamplingParams, key, eos_E, margin, *,
                   capacity: int, max_new_tokens: int, rule: str, spec, mode: str, greedy: bool, packing=None):
    global _trace_count
    _trace_count += 1
    model, drafter = nnx.merge(graphdef, state)
    M, D = max_new_tokens, spec.max_depth
    carry = spec_start(model, drafter, prompt_BxP, lengths_B, params, key, eos_E, capacity=capacity,
                       max_new_tokens=M, spec=spec, greedy=greedy)
    carry = jax.lax.while_loop(
        lambda c: ~jnp.all(c.done),
        lambda c: spec_round(model, drafter, c, params, key, eos_E, max_new_tokens=M, rule=rule, spec=spec,
                             mode=mode, margin=margin, greedy=greedy, packing=packing)[0],
        carry)
    stats = {**carry.stats.as_dict(), **drafter.loop_stats(carry.dstate)}  # plus a drafter's own counters
    buf = jnp.where(jnp.arange(M + D + 1)[None] < carry.n_out[:, None], carry.buf, 0)[:, :M]
    return sharding.constrain((buf, carry.n_out, stats), REPLICATED)  # every process reads the whole result
