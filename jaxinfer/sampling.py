"""Sampling parameters (validated on the host) and the jitted per-row sampler.

Every parameter is a per-row array, so one batch can mix greedy and stochastic requests with
different settings. Randomness is keyed per request: row b draws from
fold_in(key(seed_b), step_b), where step_b counts the tokens that request has generated. A
request's samples therefore do not depend on which other requests share its batch.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxinfer.errors import InvalidRequestError


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How to pick each generated token, and when to stop.

    Attributes:
        max_tokens: tokens to generate at most (>= 1).
        temperature: 0 means greedy; otherwise logits are divided by it (>= 0).
        top_k: keep the k most likely tokens; 0 or -1 keeps all.
        top_p: keep the smallest set of tokens whose probability reaches top_p, in (0, 1].
        min_p: drop tokens less likely than min_p times the most likely one, in [0, 1].
        seed: makes sampling reproducible for this request, independent of its batch mates.
        stop_token_ids: extra token ids that end generation (not included in the output).
        ignore_eos: keep generating past the end-of-sequence token.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        def bad(field, value, limit):
            raise InvalidRequestError(f"SamplingParams.{field} {limit}, got {value!r}")

        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            bad("max_tokens", self.max_tokens, "must be an integer >= 1")
        if not _is_number(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            bad("temperature", self.temperature, "must be a finite number >= 0")
        if not _is_int(self.top_k) or self.top_k < -1:
            bad("top_k", self.top_k, "must be an integer >= 1, or 0 / -1 to disable")
        if not _is_number(self.top_p) or not (0 < self.top_p <= 1):
            bad("top_p", self.top_p, "must be in (0, 1]")
        if not _is_number(self.min_p) or not (0 <= self.min_p <= 1):
            bad("min_p", self.min_p, "must be in [0, 1]")
        if self.seed is not None and (not _is_int(self.seed) or not (0 <= self.seed < 2**32)):
            bad("seed", self.seed, "must be an integer in [0, 2**32)")
        if isinstance(self.stop_token_ids, (str, bytes)) or not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            bad("stop_token_ids", self.stop_token_ids, "must be a list of non-negative integers")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if not isinstance(self.ignore_eos, bool):
            bad("ignore_eos", self.ignore_eos, "must be a bool")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@struct.dataclass
class SamplingBatch:
    """Per-row sampling parameters as device arrays (a pytree), shaped [B] each."""

    temperature: jax.Array  # [B] float32, 0 = greedy
    top_k: jax.Array  # [B] int32, 0 = off
    top_p: jax.Array  # [B] float32
    min_p: jax.Array  # [B] float32
    seed: jax.Array  # [B] uint32
    step: jax.Array  # [B] int32, tokens this request has generated so far

    @classmethod
    def from_rows(cls, rows: list[tuple[SamplingParams, int, int]], batch_size: int) -> SamplingBatch:
        """rows: (params, seed, step) per live row; padded with greedy rows up to batch_size."""
        temp = np.zeros(batch_size, np.float32)
        top_k = np.zeros(batch_size, np.int32)
        top_p = np.ones(batch_size, np.float32)
        min_p = np.zeros(batch_size, np.float32)
        seed = np.zeros(batch_size, np.uint32)
        step = np.zeros(batch_size, np.int32)
        for i, (p, s, n) in enumerate(rows):
            temp[i], top_k[i], top_p[i], min_p[i] = p.temperature, max(p.top_k, 0), p.top_p, p.min_p
            seed[i], step[i] = s, n
        return cls(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed, step=step)


def _sample_row(logits, temperature, top_k, top_p, min_p, seed, step):
    """One row: temperature, then top-k, top-p (on the top-k renormalised), min-p; then draw."""
    v = logits.shape[-1]
    x = logits / jnp.maximum(temperature, 1e-6)
    order = jnp.argsort(-x)  # descending
    sx = x[order]
    rank = jnp.arange(v)
    keep = (top_k <= 0) | (rank < top_k)
    probs = jax.nn.softmax(jnp.where(keep, sx, -jnp.inf))
    exclusive_cum = jnp.cumsum(probs) - probs
    keep &= exclusive_cum < top_p  # rank 0 always survives: its exclusive sum is 0 < top_p
    keep &= probs >= min_p * probs[0]
    key = jax.random.fold_in(jax.random.key(seed), step)
    choice = jax.random.categorical(key, jnp.where(keep, sx, -jnp.inf))
    return order[choice].astype(jnp.int32)


@jax.jit
def sample(logits: jax.Array, params: SamplingBatch) -> jax.Array:
    """Picks one token per row.

    Args:
        logits: [B, V] float32.
        params: SamplingBatch with [B] fields.

    Returns:
        [B] int32 token ids. Greedy rows (temperature 0) take the argmax; when every row is
        greedy the sort-based path is skipped entirely.
    """
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def stochastic():
        drawn = jax.vmap(_sample_row)(
            logits, params.temperature, params.top_k, params.top_p, params.min_p, params.seed, params.step
        )
        return jnp.where(params.temperature == 0, greedy, drawn)

    return jax.lax.cond(jnp.all(params.temperature == 0), lambda: greedy, stochastic)
