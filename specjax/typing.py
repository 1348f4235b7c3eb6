"""Array type aliases used across specjax (jaxtyping, in the spirit of recurrentgemma).

Dimension names: B batch rows, T tokens in a forward block, N tree nodes, C cache capacity,
L layers, H query heads, K key/value heads, D head dim, E model width, V vocabulary.
"""
from typing import TypeAlias

import jax
from jaxtyping import Array, Bool, Float, Int

Tokens: TypeAlias = Int[Array, "B T"]
Positions: TypeAlias = Int[Array, "B T"]
Lengths: TypeAlias = Int[Array, "B"]
BlockMask: TypeAlias = Bool[Array, "B T T"]
Logits: TypeAlias = Float[Array, "B T V"]
Hidden: TypeAlias = Float[Array, "B T E"]
KV: TypeAlias = Float[Array, "L B C K D"]
PRNGKey: TypeAlias = jax.Array

__all__ = ["Array", "Bool", "Float", "Int", "Tokens", "Positions", "Lengths", "BlockMask",
           "Logits", "Hidden", "KV", "PRNGKey"]
