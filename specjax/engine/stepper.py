"""Single speculative rounds driven from the host, TreeGraft's policy chosen per call.

The same round as the engine's loop body (`loop.spec_start` / `loop.spec_round`), jitted once for all
policies; the offline value system (`train/value_system.py`) and the benchmark's oracle baseline use it."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.drafters.composite.treegraft import POLICIES, TreeGraft, grafted_on_path
from specjax.engine import loop as engine
from specjax.spec.sampling import SamplingParams

class RoundStepper:
    """One speculative round per call, from the host, with TreeGraft's policy chosen per call.

    The same round as the engine's loop body (draft, verify, commit, emit with EOS and
    max_new_tokens), jitted once for all policies (the policy is a traced Setting). `step` is a
    pure function of the carry, so both branches of a round can run from the same state:
    the value system and the oracle baseline.
    """

    def __init__(self, model, tg: TreeGraft, spec, *, max_new_tokens: int, rule: str = "greedy",
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, eos_token_id=(), seed: int = 0,
                 capacity: int | None = None):
        self.model, self.tg = model, tg
        self.plan = engine.plan_rounds(model, tg, spec, rule, temperature)  # the engine's own setup
        self.spec, self.rule = self.plan.spec, self.plan.rule
        self.max_new_tokens = int(max_new_tokens)
        self.params = SamplingParams.make(temperature, top_k, top_p)
        self.eos = jnp.asarray(engine.eos_array(model, eos_token_id))
        self.key = jax.random.key(seed)
        self.capacity = capacity
        keep = tg.policy
        self.states = {}
        for p in POLICIES:
            tg.set_policy(p)
            self.graphdef, state = nnx.split((model, tg))
            self.states[p] = jax.tree.map(lambda x: x, state)  # new Variables (same arrays): a snapshot
        tg.set_policy(keep)

    @property
    def slack(self) -> int:
        return self.plan.slack

    def capacity_for(self, prompts) -> int:
        """One cache capacity that fits every prompt (so one compiled round serves them all)."""
        longest = max(len(p) for p in prompts)
        return engine.PROMPT_BUCKET * -(-longest // engine.PROMPT_BUCKET) + self.max_new_tokens + self.slack

    def start(self, prompts) -> engine.LoopCarry:
        batch = engine.prepare_prompts(prompts, self.model.config.vocab_size, self.max_new_tokens, self.capacity,
                                       slack=self.slack)
        self.tg.validate(batch.capacity)
        return _start(self.graphdef, self.states["never"], jnp.asarray(batch.tokens), jnp.asarray(batch.lengths),
                      self.params, self.key, self.eos, capacity=batch.capacity, max_new_tokens=self.max_new_tokens,
                      spec=self.spec, greedy=self.rule == "greedy")

    def step(self, carry, policy: str):
        """(next carry, info): info holds per-row arrays (accepted, active, invoked, features,
        grafted path / tokens, calibration statistic) of this round."""
        return _round(self.graphdef, self.states[policy], carry, self.params, self.key, self.eos,
                      max_new_tokens=self.max_new_tokens, rule=self.rule, spec=self.spec)

    @staticmethod
    def done(carry) -> bool:
        return bool(np.all(np.asarray(carry.done)))

    @staticmethod
    def outputs(carry) -> list[list[int]]:
        buf, n = np.asarray(carry.buf), np.asarray(carry.n_out)
        return [buf[b, :n[b]].tolist() for b in range(len(n))]


@functools.partial(jax.jit, static_argnames=("graphdef", "capacity", "max_new_tokens", "spec", "greedy"))
def _start(graphdef, state, prompt_BxP, lengths_B, params, key, eos_E, *, capacity, max_new_tokens, spec, greedy):
    model, tg = nnx.merge(graphdef, state)
    return engine.spec_start(model, tg, prompt_BxP, lengths_B, params, key, eos_E, capacity=capacity,
                             max_new_tokens=max_new_tokens, spec=spec, greedy=greedy)


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "rule", "spec"))
def _round(graphdef, state, carry, params, key, eos_E, *, max_new_tokens, rule, spec):
    """The engine's round (`engine.spec_round`) plus TreeGraft's per-round record."""
    model, tg = nnx.merge(graphdef, state)
    new, rnd = engine.spec_round(model, tg, carry, params, key, eos_E, max_new_tokens=max_new_tokens, rule=rule,
                                 spec=spec, mode="topk")
    info, active, vd = rnd.proposal.state.pending, rnd.active, rnd.verdict
    through, n_graft_tok = grafted_on_path(info, rnd.committed)
    out = dict(accepted=vd.num_accepted, emitted=rnd.emitted, active=active, invoked=info.invoked & active,
               features=info.features, grafted_path=through & active, grafted_tokens=n_graft_tok,
               n_grafted=info.n_grafted, calib_sum=info.calib_sum, calib_n=info.calib_n)
    return new, out
