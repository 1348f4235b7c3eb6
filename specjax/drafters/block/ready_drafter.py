"""`ReadyDrafter`: ReaDy (design §5c, `ready.py`) behind the drafter contract: the block drafter whose
backbone also reads the hybrid target's committed recurrent state, held in `BlockState.target_state`
(`init`: after the prefill; `commit`: `Committed.target`). `zero_state=True` is the ablation: the reader
on zeroed states, where it adds exactly nothing."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from specjax.drafters.base import Committed, register
from specjax.drafters.block.drafter import BlockDrafter
from specjax.drafters.block.network import BlockState
from specjax.drafters.block.ready import check_state_target, state_injector


@register
class ReadyDrafter(BlockDrafter):
    """ReaDy over the block network (a head with `state_layers`), for a hybrid target."""
    name = "ready"
    RUN_OPTIONS = BlockDrafter.RUN_OPTIONS + ("zero_state",)

    @classmethod
    def takes(cls, cfg) -> bool:
        return bool(cfg.reads_state) and not cfg.boundary

    def __init__(self, head, target, confidence="off", costs=None, widths=None, path_calibration=None,
                 zero_state: bool = False):
        super().__init__(head, target, confidence=confidence, costs=costs, widths=widths,
                         path_calibration=path_calibration)
        self.state_index = check_state_target(head.config, target)  # the read layers' indices in the target's state
        self.zero_state = bool(zero_state)

    def run_options(self) -> dict:
        return {**super().run_options(), "zero_state": self.zero_state}

    def read_state(self, target_cache):
        """The read layers' committed delta-rule states [L_read, B, H, dk, dv] (zeros for the ablation)."""
        st = target_cache.state[jnp.asarray(self.state_index)].astype(jnp.float32)
        return jnp.zeros_like(st) if self.zero_state else st

    def init(self, prompt_BxP, lengths_B, capacity, target_out) -> BlockState:
        if getattr(target_out, "cache", None) is None:
            raise ValueError("a ReaDy drafter reads the target's state after the prefill: target_out.cache is None")
        st = super().init(prompt_BxP, lengths_B, capacity, target_out)
        return dataclasses.replace(st, target_state=self.read_state(target_out.cache))

    def inject(self, state: BlockState):
        if state.target_state is None:
            raise ValueError("this ReaDy drafter's state holds no target state: make it with this drafter's init")
        return state_injector(self.head, state.target_state[:, :, None], 1)

    def commit(self, state: BlockState, committed: Committed) -> BlockState:
        """The cache extended, and the target's committed state after this round (a finished row's stands
        still, like its cache)."""
        if committed.target is None:
            raise ValueError("a ReaDy drafter commits the target's committed state: Committed.target is None")
        return dataclasses.replace(super().commit(state, committed), target_state=self.read_state(committed.target))
