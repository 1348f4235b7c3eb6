"""The block drafter's configuration (design §5b–§5e): one frozen dataclass for DSpark, DFlash
(`markov_rank=0`), ReaDy (`state_layers`), DPara (`boundary`) and the TreeFlash head
(`ar_intermediate`), and the confidence-cut option."""
from __future__ import annotations

import dataclasses

MARKOV_KINDS = ("vanilla",)


@dataclasses.dataclass(frozen=True)
class BlockConfig:
    hidden_size: int  # = the target's (embedding and LM head are shared)
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    num_layers: int
    block_size: int  # W: positions drafted per forward
    target_layers: tuple[int, ...]
    vocab_size: int
    markov_rank: int = 128  # r; 0 = DFlash (no Markov head, no confidence head)
    markov: str = "vanilla"
    confidence: bool = True
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    confidence_temperatures: tuple[float, ...] | None = None  # per position, from calibration
    # ReaDy (design §5c): the recurrent-state reader, on when `state_layers` is not empty
    state_layers: tuple[int, ...] = ()  # the target's Gated DeltaNet layers whose committed state is read
    state_shape: tuple[int, int, int] | None = None  # (H_v, dk, dv) of the target's delta-rule state
    reader_rank: int = 8  # rank of the query map A(B^T norm(h))
    reader_out_rank: int = 64  # rank of the zero-initialised output map U
    reader_layer: int = 1  # the backbone layer whose input gets h + U(o) (num_layers: before the final norm)
    # TreeFlash (design §5e): the autoregressive-approximation head, on when ar_intermediate > 0
    ar_intermediate: int = 0  # I of [U; G] = Linear([norm(E[x_{k-1}]); h_k]) (2E -> 2I), D: I -> E
    # DPara (design §5d): the next round's block precomputed for every acceptance boundary while the
    # target verifies; the draft tokens enter the context as token embeddings through `token_proj`
    boundary: bool = False
    # EAGLE-3's reduced draft vocabulary (`specjax.drafters.vocab`): N > 0 scores the N most frequent target
    # tokens of the training stream (the drafter's token ranking) in the base logits and the Markov head
    # (W1 gets one more row, for every token outside); q is zero elsewhere. Fixed at training. 0: all V.
    draft_vocab: int = 0
    # The published layouts' block input (DFlash, DSpark as z-lab, DeepSpec and speculators write them;
    # `specjax.drafters.interop`): MASK slots are the target's frozen embedding of this token (None: a
    # learned MASK vector, `mask_embed`). Only a drafter with a token MASK exports exactly.
    mask_token_id: int | None = None
    # Slot semantics: True, slot k predicts the token at start+k+1 (W drafts: ours, DSpark, DeepSpec);
    # False, slot k predicts the token at start+k and slot 0 (the anchor's) drafts nothing (W-1 drafts:
    # z-lab DFlash, speculators' `sample_from_anchor: false`)
    sample_from_anchor: bool = True

    @property
    def drafts(self) -> int:
        """Draft positions per block: W, or W-1 when the anchor's slot predicts nothing."""
        return self.block_size if self.sample_from_anchor else self.block_size - 1

    def __post_init__(self):
        if not 0 <= self.draft_vocab <= self.vocab_size:
            raise ValueError(f"draft_vocab must be in 0..{self.vocab_size} (0: the full vocabulary), got {self.draft_vocab}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.mask_token_id is not None and not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} is outside the vocabulary (0..{self.vocab_size - 1})")
        if not self.sample_from_anchor:
            if self.block_size < 2:
                raise ValueError("a block whose anchor slot drafts nothing (sample_from_anchor=False) needs block_size >= 2")
            if self.boundary or self.state_layers or self.ar_intermediate:
                raise ValueError("sample_from_anchor=False (the published DFlash slots) is built for DSpark / DFlash "
                                 "only: not with DPara, ReaDy or a TreeFlash head")
        if self.markov_rank < 0:
            raise ValueError(f"markov_rank must be >= 0 (0: DFlash), got {self.markov_rank}")
        if self.markov not in MARKOV_KINDS:
            raise ValueError(f"markov head {self.markov!r} is not built; choose from {MARKOV_KINDS}")
        if self.confidence and self.markov_rank == 0:
            raise ValueError("the confidence head reads the Markov embedding: it needs markov_rank > 0")
        t = self.confidence_temperatures
        if t is not None and len(t) != self.drafts:
            raise ValueError(f"confidence_temperatures has {len(t)} entries for {self.drafts} draft positions")
        if self.ar_intermediate < 0:
            raise ValueError(f"ar_intermediate must be >= 0 (0: no TreeFlash head), got {self.ar_intermediate}")
        if self.boundary and self.state_layers:
            raise ValueError("boundary-precomputed drafting (DPara) is built for a DSpark / DFlash backbone: "
                             "not with a state reader (ReaDy)")
        if self.state_layers:
            if self.state_shape is None or len(self.state_shape) != 3:
                raise ValueError("a state reader (state_layers) needs state_shape (H_v, dk, dv) of the target's state")
            if len(set(self.state_layers)) != len(self.state_layers):
                raise ValueError(f"state_layers {self.state_layers} repeats a layer")
            if self.reader_rank < 1 or self.reader_out_rank < 1:
                raise ValueError(f"reader ranks must be >= 1, got {self.reader_rank} / {self.reader_out_rank}")
            if not 0 <= self.reader_layer <= self.num_layers:
                raise ValueError(f"reader_layer must be in 0..{self.num_layers} (the backbone layer whose input is "
                                 f"updated; {self.num_layers}: before the final norm), got {self.reader_layer}")

    @property
    def has_ar_head(self) -> bool:
        """TreeFlash: conditional rows from the autoregressive-approximation head."""
        return self.ar_intermediate > 0

    @property
    def ar_drafts(self) -> bool:
        """DPara with an autoregressive head: the head (`ar_logits`) drafts every position, trained with
        the backbone (its light head); without one the Markov head does."""
        return self.boundary and self.has_ar_head

    @property
    def reads_state(self) -> bool:
        """ReaDy: the block reads the target's committed recurrent states."""
        return bool(self.state_layers)

    @classmethod
    def for_target(cls, target_cfg, *, block_size=8, num_layers=2, markov_rank=128, confidence=True,
                   target_layers=None, intermediate_size=None, state_layers=(), reader_rank=8, reader_out_rank=64,
                   reader_layer=1, ar_intermediate=0, boundary=False, draft_vocab=0, mask_token_id=None,
                   sample_from_anchor=True) -> "BlockConfig":
        """`state_layers`: () for DSpark / DFlash; target layer indices of Gated DeltaNet layers, or
        "all" (every one), for ReaDy (a hybrid target only)."""
        L = target_cfg.num_layers
        layers = tuple(target_layers) if target_layers is not None else tuple(sorted({min(1, L - 1), L // 2, max(L - 2, 0)}))
        state_layers = state_layers or ()
        state_shape = None
        if isinstance(state_layers, str) and state_layers != "all":
            raise ValueError(f"state_layers must be 'all' or a list of target layers, got {state_layers!r}")
        if state_layers:
            linear = tuple(getattr(target_cfg, "linear_layers", ()))
            if not linear:
                raise ValueError("a state reader (ReaDy) reads a hybrid target's Gated DeltaNet states; this target "
                                 "has no linear-attention layers")
            state_layers = linear if state_layers == "all" else tuple(int(x) for x in state_layers)
            missing = [x for x in state_layers if x not in linear]
            if missing:
                raise ValueError(f"state_layers {missing} are not Gated DeltaNet layers of the target (those are {linear})")
            state_shape = (target_cfg.linear_num_value_heads, target_cfg.linear_key_head_dim,
                           target_cfg.linear_value_head_dim)
        return cls(hidden_size=target_cfg.hidden_size, num_heads=target_cfg.num_heads,
                   num_kv_heads=target_cfg.num_kv_heads, head_dim=target_cfg.head_dim,
                   intermediate_size=intermediate_size or target_cfg.intermediate_size, num_layers=num_layers,
                   block_size=block_size, target_layers=layers, vocab_size=target_cfg.vocab_size,
                   markov_rank=markov_rank, confidence=confidence and markov_rank > 0,
                   rms_norm_eps=target_cfg.rms_norm_eps, state_layers=tuple(state_layers), state_shape=state_shape,
                   reader_rank=reader_rank, reader_out_rank=reader_out_rank, reader_layer=reader_layer,
                   ar_intermediate=ar_intermediate, boundary=boundary, draft_vocab=draft_vocab or 0,
                   mask_token_id=mask_token_id, sample_from_anchor=sample_from_anchor)


def parse_confidence(confidence):
    """"off" (or None) | "schedule" | a threshold in (0, 1) (a number or a numeric string); ValueError else."""
    if confidence in (None, "off", "schedule"):
        return confidence or "off"
    try:
        t = float(confidence)
    except (TypeError, ValueError):
        raise ValueError(f"confidence must be 'off', 'schedule' or a threshold in (0, 1), got {confidence!r}") from None
    if not 0 < t < 1:
        raise ValueError(f"confidence threshold must be in (0, 1), got {confidence!r}")
    return t


def check_confidence(confidence, cfg: BlockConfig):
    """`parse_confidence`, and a cut needs the confidence head (DFlash has none)."""
    c = parse_confidence(confidence)
    if c != "off" and not cfg.confidence:
        raise ValueError("this block drafter has no confidence head (DFlash): use confidence='off'")
    return c
