"""The paged KV cache (device pytree), the per-step batch metadata, and the host page allocator.

Layout. Each layer owns one K and one V page pool of shape [K, P, S, H]: for each of the K KV heads,
P pages of S token slots (head-major: attention's gathers come out batched by head, and the pools
shard over KV heads on the leading axis). A sequence's tokens live in the pages listed in its
row of the page table, in order: token at position p sits in page `page_table[p // S]`, slot
`p % S`. Page 0 is reserved as a scratch page: padding tokens write there and unused page-table
entries point there, so no write ever lands in a page another sequence owns. It is never handed
out by the allocator and never read unmasked.

Hybrid models (`ModelConfig.hybrid_window`: Gemma 2/3) keep their sliding-window layers' K/V in
pools of their own, usually far smaller: a sequence holds there only the pages its window reaches,
listed in a second table (`Batch.window_page_table`) laid out like the first (entry i: the page of
positions [i * S, (i + 1) * S), the scratch page once it has left the window). Page ids of the two
kinds of pools are unrelated; each has its own allocator.

The cache holds no lengths or positions: those are per-step facts owned by the host scheduler and
travel in `Batch`. The cache is only ever replaced by the output of a jitted function.
"""

from __future__ import annotations

import collections
import hashlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxinfer.config import ModelConfig

SCRATCH_PAGE = 0


@struct.dataclass
class QuantizedPages:
    """An int8 page pool: values [K, P, S, H] int8 and one float32 scale per token and KV head
    (`scales` [K, P, S]); a slot holds `values * scales[..., None]`.

    Used wherever a plain [K, P, S, H] pool can be (KVCache.k / .v entries); `write_kv` quantizes
    into it and every attention backend dequantizes from it. Per-token-per-head scales follow each
    token's own range, so one outlier token cannot crush the resolution of its neighbours.
    """

    values: jax.Array  # [K, P, S, H] int8
    scales: jax.Array  # [K, P, S] float32

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape

    @property
    def dtype(self):
        return self.values.dtype

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        return (self.values.astype(jnp.float32) * self.scales[..., None]).astype(dtype)


Pool = jax.Array | QuantizedPages


def quantize_int8(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Symmetric per-vector int8: x [..., H] -> (values [..., H] int8, scales [...] float32).

    scale = max|x| / 127, values = round(x / scale); an all-zero vector gets scale 0 (and zeros).
    """
    x = x.astype(jnp.float32)
    scales = jnp.max(jnp.abs(x), axis=-1) / 127.0
    safe = jnp.where(scales == 0.0, 1.0, scales)
    values = jnp.clip(jnp.round(x / safe[..., None]), -127, 127).astype(jnp.int8)
    return values, scales


@struct.dataclass
class KVCache:
    """K/V page pools for all layers. Replaced, never mutated; donated to the jitted steps.

    Each pool is a [K, P, S, H] array in the model dtype, or a QuantizedPages (int8 + scales).
    """

    k: tuple[Pool, ...]  # L x [K, P, S, H]
    v: tuple[Pool, ...]  # L x [K, P, S, H]

    @property
    def num_pages(self) -> int:
        """Pages of the largest pools (a hybrid model's global layers)."""
        return max(pool.shape[1] for pool in self.k)

    @property
    def page_size(self) -> int:
        return self.k[0].shape[2]

    @property
    def nbytes(self) -> int:
        return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves((self.k, self.v)))

    @classmethod
    def create(
        cls, cfg: ModelConfig, *, num_pages: int, page_size: int, num_window_pages: int | None = None
    ) -> KVCache:
        """Zeroed pools of num_pages pages; with num_window_pages, a hybrid model's sliding-window
        layers get pools of that many pages instead (addressed by `Batch.window_page_table`)."""

        def pool(layer: int) -> Pool:
            pages = num_window_pages if num_window_pages is not None and cfg.in_window_pool(layer) else num_pages
            shape = (cfg.num_kv_heads, pages, page_size, cfg.head_dim)
            if cfg.kv_cache_dtype == "int8":
                return QuantizedPages(values=jnp.zeros(shape, jnp.int8), scales=jnp.zeros(shape[:3], jnp.float32))
            return jnp.zeros(shape, jnp.dtype(cfg.dtype))

        layers = range(cfg.num_layers)
        return cls(k=tuple(pool(i) for i in layers), v=tuple(pool(i) for i in layers))


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
    # [B, MP] int32: the same for a hybrid model's sliding-window pools (None: those layers use
    # page_table, their pools being as large as the others).
    window_page_table: jax.Array | None = None

    def positions(self) -> jax.Array:
        """[B, T] absolute position of every token slot (meaningless where not valid())."""
        t = jnp.arange(self.tokens.shape[1], dtype=jnp.int32)
        return (self.kv_lens - self.q_lens)[:, None] + t[None, :]

    def valid(self) -> jax.Array:
        """[B, T] bool: the slot holds a real new token."""
        t = jnp.arange(self.tokens.shape[1], dtype=jnp.int32)
        return t[None, :] < self.q_lens[:, None]

    def slots(self, page_size: int, table: jax.Array | None = None) -> jax.Array:
        """[B, T] flat cache slot (page * S + offset) each new token is written to, by `table`
        (default: page_table)."""
        table = self.page_table if table is None else table
        pos = self.positions()
        valid = self.valid()
        col = jnp.clip(pos // page_size, 0, table.shape[1] - 1)
        page = jnp.take_along_axis(table, col, axis=1)
        slot = page * page_size + pos % page_size
        return jnp.where(valid, slot, SCRATCH_PAGE * page_size)


class OutOfPagesError(RuntimeError):
    """The pool cannot satisfy an allocation; the scheduler decides what to do about it."""


def page_hash(parent: bytes, tokens) -> bytes:
    """Key of a full page: a digest of its tokens and of the key of the page before it.

    A cryptographic digest, not Python's hash(): a collision would hand one request the K/V of
    different tokens, so it must be out of reach of anyone choosing prompts.
    """
    return hashlib.blake2b(parent + np.asarray(tokens, np.int64).tobytes(), digest_size=16).digest()


def salt_digest(cache_salt: str | None) -> bytes:
    """The parent key of a request's first page: b"" without a salt, else a digest of the salt.

    Requests with different salts (tenants) then never share prefix pages, so one cannot learn from
    its time to first token whether another sent the same prompt (vLLM's `cache_salt`). A page key
    chains its parent's, so every page of a salted request differs from every unsalted one."""
    if cache_salt is None:
        return b""
    return hashlib.blake2b(b"cache_salt\0" + cache_salt.encode("utf-8"), digest_size=16).digest()


class PagePool:
    """Host-side owner of page ids: the free list, reference counts, and the prefix cache.

    A page is in exactly one of three states:
      * free: in `_free`, content meaningless;
      * in use: refcount > 0, owned by one sequence, or shared read-only by several through the
        prefix cache (only full pages are ever shared, and nobody writes into a full page);
      * cached: refcount 0 but its content is a known prefix page (`_hash_of`); kept in LRU order
        and reused by a later request with the same prefix, or evicted when pages run short.
    Cached pages count as free capacity. Page 0 (scratch) is never handed out.
    """

    def __init__(self, num_pages: int, *, enable_prefix_cache: bool = True):
        if num_pages < 2:
            raise ValueError(f"num_kv_pages must be at least 2 (one is scratch), got {num_pages}")
        self.num_pages = num_pages
        self.enable_prefix_cache = enable_prefix_cache
        self._free = list(range(num_pages - 1, SCRATCH_PAGE, -1))  # pop() gives low ids first
        self._refs = np.zeros(num_pages, np.int32)
        self._page_of: dict[bytes, int] = {}  # prefix hash -> page
        self._hash_of: dict[int, bytes] = {}  # page -> prefix hash
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU first
        self.num_evictions = 0  # cached pages handed out again for new contents

    @property
    def capacity(self) -> int:
        """Pages that can ever be allocated (all but scratch)."""
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        """Pages allocatable now: free plus cached-but-unused (evictable)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        return len(self._page_of)

    def allocate(self, n: int) -> list[int]:
        """n private pages, evicting least-recently-used cached pages if the free list runs short."""
        if n > self.num_free:
            raise OutOfPagesError(f"need {n} KV pages, {self.num_free} free")
        pages = []
        for _ in range(n):
            if self._free:
                page = self._free.pop()
            else:
                page, _ = self._evictable.popitem(last=False)
                del self._page_of[self._hash_of.pop(page)]
                self.num_evictions += 1
            self._refs[page] = 1
            pages.append(page)
        return pages

    def release(self, pages: list[int]) -> list[int]:
        """Drops one reference to each page. Returns the pages that became free (not cached)."""
        freed = []
        for p in pages:
            if not (0 < p < self.num_pages) or self._refs[p] <= 0:
                raise ValueError(f"page {p} is not allocated")
            self._refs[p] -= 1
            if self._refs[p] == 0:
                if p in self._hash_of:
                    self._evictable[p] = None
                else:
                    self._free.append(p)
                    freed.append(p)
        return freed

    def lookup(self, key: bytes) -> int | None:
        """The cached page holding this prefix page, with a reference taken; None on a miss."""
        page = self._page_of.get(key) if self.enable_prefix_cache else None
        if page is None:
            return None
        if self._refs[page] == 0:
            del self._evictable[page]
        self._refs[page] += 1
        return page

    def contains(self, key: bytes) -> bool:
        """Whether a cached page holds this prefix page (no reference taken)."""
        return self.enable_prefix_cache and key in self._page_of

    def register(self, page: int, key: bytes) -> None:
        """Records that `page` (full, in use) holds the prefix page `key`, for later requests to share."""
        if not self.enable_prefix_cache or key in self._page_of or page in self._hash_of:
            return
        self._page_of[key] = page
        self._hash_of[page] = key

    def refcount(self, page: int) -> int:
        return int(self._refs[page])

    def forget_cached(self) -> None:
        """Empties the prefix cache (the pages' contents are gone): cached pages become free, pages
        in use stay with their owners but are never shared again."""
        self._free.extend(reversed(self._evictable))
        self._evictable.clear()
        self._page_of.clear()
        self._hash_of.clear()


def pages_needed(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)
