"""ReaDy (design §5c; `BlockConfig.state_layers` set, a hybrid target only): the block also reads the
target's committed Gated DeltaNet states S_l [H_v, dk, dv] of the read layers, after the last
committed token (`init`: the prefill's cache; `commit`: `Committed.target`; held in
`BlockState.target_state`):

    q_{l,p,h} = A_l(B_l^T norm(h_p)) + e_{l,p,h}   rank `reader_rank`, e a learned query per position
    o_{l,p,h} = S_{l,h}^T q_{l,p,h}                RMSNorm over d_v, concatenated over heads and layers
    h_p <- h_p + U(o_p)                            U = U_in . U_out, rank `reader_out_rank`, U_out = 0

at the input of backbone layer `reader_layer` (`num_layers`: before the final norm). Every node of a
round's tree reads the same committed state (the nodes' own states exist only after verification).
`zero_state=True` is the ablation: the same weights on S = 0, where the reader adds exactly nothing.
Departures from the ReaDy paper (no public code): one RMSNorm weight per read layer over d_v, a
low-rank U (the paper's reader is low-rank in its query only), and the training states come from
the target's chunked pass at anchors on a grid (`hybrid.prefix_states`, `train.block`).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.drafters.block.config import BlockConfig
from specjax.models.transformer import RMSNorm, rms_norm


class StateReader(nnx.Module):
    """ReaDy's reader (design §5c), per read layer l: a low-rank query map B_l [E, r], A_l
    [r, H*dk], a learned query e_l [W, H, dk] per block position, the RMSNorm weight over d_v of the
    read-outs, and the output map U = U_in [L*H*dv, r_out] . U_out [r_out, E] (U_out zero: a fresh
    reader adds nothing, so a DSpark checkpoint can be its starting point)."""

    def __init__(self, cfg: BlockConfig, rngs: nnx.Rngs, dtype):
        E, r, ro, W = cfg.hidden_size, cfg.reader_rank, cfg.reader_out_rank, cfg.block_size
        H, K, V = cfg.state_shape
        L = len(cfg.state_layers)
        self.norm = RMSNorm(E, cfg.rms_norm_eps, dtype)
        self.query_down = nnx.Param(jax.random.normal(rngs.params(), (L, E, r), dtype) / math.sqrt(E))
        self.query_up = nnx.Param(jax.random.normal(rngs.params(), (L, r, H * K), dtype) / math.sqrt(r * K))
        self.query_pos = nnx.Param(jax.random.normal(rngs.params(), (L, W, H, K), dtype) / math.sqrt(K))
        self.out_norm = nnx.Param(jnp.ones((L, V), dtype))
        self.out_in = nnx.Param(jax.random.normal(rngs.params(), (L * H * V, ro), dtype) / math.sqrt(L * H * V))
        self.out = nnx.Param(jnp.zeros((ro, E), dtype))


def read_states(head, h_BxAxWxE, states_LxBxAxHxKxV):
    """ReaDy's residual update U(o) [B, A, W, E] for A blocks of W positions, each block reading
    its own committed states S [L, B, A, H, dk, dv] (float32): per read layer l, head h and
    position p, q = A_l(B_l^T norm(h_p)) + e_{l,p,h}, o = S_{l,h}^T q, RMSNorm over d_v,
    concatenated over heads and layers, projected by U. A zero state reads zero: U(0) = 0."""
    rd, cfg = head.reader, head.config
    B, A, W, E = h_BxAxWxE.shape
    L = len(cfg.state_layers)
    H, K, V = cfg.state_shape
    n = rms_norm(rd.norm, h_BxAxWxE).astype(jnp.float32)
    q = jnp.einsum("bawe,ler->lbawr", n, rd.query_down[...].astype(jnp.float32))
    q = jnp.einsum("lbawr,lrm->lbawm", q, rd.query_up[...].astype(jnp.float32)).reshape(L, B, A, W, H, K)
    q = q + rd.query_pos[...].astype(jnp.float32)[:, None, None]
    o = jnp.einsum("lbahkv,lbawhk->lbawhv", states_LxBxAxHxKxV.astype(jnp.float32), q)
    o = o * jax.lax.rsqrt(jnp.mean(o * o, axis=-1, keepdims=True) + cfg.rms_norm_eps)
    o = o * rd.out_norm[...].astype(jnp.float32)[:, None, None, None, None]
    o = o.transpose(1, 2, 3, 0, 4, 5).reshape(B, A, W, L * H * V).astype(h_BxAxWxE.dtype)
    return (o @ rd.out_in[...]) @ rd.out[...]


def state_injector(head, states_LxBxAxHxKxV, A: int):
    """`backbone`'s `inject` for A blocks per row reading `states` (None: no reader)."""
    if head.reader is None:
        return None
    W = head.config.block_size

    def inject(x_BxQxE):
        B, _, E = x_BxQxE.shape
        return x_BxQxE + read_states(head, x_BxQxE.reshape(B, A, W, E), states_LxBxAxHxKxV).reshape(B, A * W, E)

    return inject


def check_state_target(cfg: BlockConfig, target) -> tuple[int, ...]:
    """ReaDy: the read layers' indices among the target's Gated DeltaNet layers (its state's first
    axis); ValueError when the target has no such layers or another state shape. () for DSpark."""
    if not cfg.reads_state:
        return ()
    linear = tuple(getattr(target.config, "linear_layers", ()))
    missing = [x for x in cfg.state_layers if x not in linear]
    if missing:
        raise ValueError(f"this ReaDy drafter reads the recurrent state of target layers {cfg.state_layers}, but "
                         f"layers {missing} of the target are not Gated DeltaNet layers (those are {linear or 'none'})")
    tc = target.config
    shape = (tc.linear_num_value_heads, tc.linear_key_head_dim, tc.linear_value_head_dim)
    if tuple(cfg.state_shape) != shape:
        raise ValueError(f"this ReaDy drafter reads states of shape {tuple(cfg.state_shape)}, the target's are {shape}")
    return tuple(linear.index(x) for x in cfg.state_layers)
