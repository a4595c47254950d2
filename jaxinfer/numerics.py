"""Reductions whose rounding does not depend on the shape around them (batch invariance).

XLA CPU picks a reduction's strategy (vectorised across rows, or along them; how far to unroll) from
the whole operand shape. The same row summed inside a [23, D] array and inside a [7, D] one can then
round differently in the last bit, so a request's numbers would depend on how its prompt was chunked
and on its batch mates, and a near-tie between two logits could flip a greedy token. The sums on a
request's path that XLA would otherwise schedule per shape go through `sum_last_axis`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def sum_last_axis(x: jax.Array) -> jax.Array:
    """Sum over the last axis (kept, size 1) in an order fixed by that axis' size alone.

    The row is halved while its length is even (x[:n/2] + x[n/2:], elementwise, so the same
    additions for any leading shape), then the odd rest is added left to right. Same cost as a reduce
    for power-of-two widths; lengths with an odd part over 64 are zero-padded to a multiple of 64.
    """
    n = x.shape[-1]
    if n // (n & -n) > 64:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, -n % 64)])
        n = x.shape[-1]
    while n % 2 == 0 and n > 1:
        n //= 2
        x = x[..., :n] + x[..., n:]
    total = x[..., :1]
    for i in range(1, n):
        total = total + x[..., i : i + 1]
    return total
