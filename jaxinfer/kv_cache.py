"""The paged KV cache (device pytree), the per-step batch metadata, and the host page allocator.

Layout. Each layer owns one K and one V page pool of shape [P, S, K, H]: P pages of S token slots,
each slot holding all K KV-heads of one token. A sequence's tokens live in the pages listed in its
row of the page table, in order: token at position p sits in page `page_table[p // S]`, slot
`p % S`. Page 0 is reserved as a scratch page: padding tokens write there and unused page-table
entries point there, so no write ever lands in a page another sequence owns. It is never handed
out by the allocator and never read unmasked.

The cache holds no lengths or positions: those are per-step facts owned by the host scheduler and
travel in `Batch`. The cache is only ever replaced by the output of a jitted function.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxinfer.config import ModelConfig

SCRATCH_PAGE = 0


@struct.dataclass
class KVCache:
    """K/V page pools for all layers. Replaced, never mutated; donated to the jitted steps."""

    k: tuple[jax.Array, ...]  # L x [P, S, K, H]
    v: tuple[jax.Array, ...]  # L x [P, S, K, H]

    @property
    def num_pages(self) -> int:
        return self.k[0].shape[0]

    @property
    def page_size(self) -> int:
        return self.k[0].shape[1]

    @property
    def nbytes(self) -> int:
        return sum(a.size * a.dtype.itemsize for a in (*self.k, *self.v))

    @classmethod
    def create(cls, cfg: ModelConfig, *, num_pages: int, page_size: int) -> KVCache:
        shape = (num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)
        dtype = jnp.dtype(cfg.dtype)
        return cls(
            k=tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)),
            v=tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)),
        )


@struct.dataclass
class Batch:
    """What one step computes: B rows, each a sequence contributing up to T new tokens.

    Positions are derived (`positions()`): the new tokens of a row occupy positions
    [kv_lens - q_lens, kv_lens). Rows with q_lens == 0 are padding.
    """

    tokens: jax.Array  # [B, T] int32; padding positions hold any valid id
    q_lens: jax.Array  # [B] int32; new tokens in this row (0 for a padding row)
    kv_lens: jax.Array  # [B] int32; context length after this step, new tokens included
    page_table: jax.Array  # [B, MP] int32; pages of each row in order, SCRATCH_PAGE past the end

    def positions(self) -> jax.Array:
        """[B, T] absolute position of every token slot (meaningless where not valid())."""
        t = jnp.arange(self.tokens.shape[1], dtype=jnp.int32)
        return (self.kv_lens - self.q_lens)[:, None] + t[None, :]

    def valid(self) -> jax.Array:
        """[B, T] bool: the slot holds a real new token."""
        t = jnp.arange(self.tokens.shape[1], dtype=jnp.int32)
        return t[None, :] < self.q_lens[:, None]

    def slots(self, page_size: int) -> jax.Array:
        """[B, T] flat cache slot (page * S + offset) each new token is written to."""
        pos = self.positions()
        valid = self.valid()
        col = jnp.clip(pos // page_size, 0, self.page_table.shape[1] - 1)
        page = jnp.take_along_axis(self.page_table, col, axis=1)
        slot = page * page_size + pos % page_size
        return jnp.where(valid, slot, SCRATCH_PAGE * page_size)


class OutOfPagesError(RuntimeError):
    """The allocator cannot satisfy a request; the scheduler decides what to do about it."""


class PageAllocator:
    """Host-side free list of cache pages. Page 0 (scratch) is never handed out."""

    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"num_kv_pages must be at least 2 (one is scratch), got {num_pages}")
        self.num_pages = num_pages
        # Pop from the end: low page numbers first, which keeps tests readable.
        self._free = list(range(num_pages - 1, SCRATCH_PAGE, -1))
        self._owned = np.zeros(num_pages, dtype=bool)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def capacity(self) -> int:
        """Pages that can ever be allocated (all but scratch)."""
        return self.num_pages - 1

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPagesError(f"need {n} KV pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        self._owned[pages] = True
        return pages

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if not (0 < p < self.num_pages) or not self._owned[p]:
                raise ValueError(f"page {p} is not allocated")
            self._owned[p] = False
            self._free.append(p)


def pages_needed(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)
