"""Sizing the engine at start-up: capacity settings in range, the KV cache's bytes and pages, what
must fit in free memory, and the longest sequence. Pure host arithmetic (and `jax.eval_shape`),
shared by the engine, `LLM`'s defaults, the CLI and the benchmarks."""

from __future__ import annotations

import dataclasses
import functools
import os

import jax

from jaxinfer.errors import InvalidRequestError
from jaxinfer.kv_cache import KVCache
from jaxinfer.scheduler import bucket, most_pages_held, pow2_floor


def prefill_token_limit(max_num_batched_tokens: int, max_model_len: int) -> int:
    """Padded tokens of one prompt-chunk call at most (rows bucket x length bucket)."""
    return min(pow2_floor(max_num_batched_tokens), bucket(max_model_len, minimum=16))


def default_window_kv_pages(cfg, *, max_model_len, page_size, max_num_seqs, max_num_batched_tokens) -> int | None:
    """A hybrid model's sliding-window pool by default: the most pages max_num_seqs sequences hold
    there at once, plus scratch (None: the model is not hybrid)."""
    if cfg.hybrid_window is None:
        return None
    held = most_pages_held(
        max_model_len,
        window=cfg.hybrid_window,
        page_size=page_size,
        max_prefill_tokens=prefill_token_limit(max_num_batched_tokens, max_model_len),
    )
    return max_num_seqs * held + 1


def layer_page_bytes(cfg, page_size: int) -> int:
    """Bytes of one layer's K and V for one page (int8: with its scales)."""
    return cfg.kv_bytes_per_token // cfg.num_layers * page_size


def kv_cache_bytes(cfg, *, num_kv_pages: int, page_size: int) -> int:
    """Bytes of a KV cache of num_kv_pages pages in every layer."""
    return layer_page_bytes(cfg, page_size) * cfg.num_layers * num_kv_pages


def window_pool_pages(cfg, *, num_kv_pages: int, num_window_kv_pages: int | None) -> int | None:
    """The pages of a hybrid model's sliding-window layers' own pools, or None where those layers
    share the global pool: the model is not hybrid, or its window pools would not be the smaller."""
    if cfg.hybrid_window is None or num_window_kv_pages is None or num_window_kv_pages >= num_kv_pages:
        return None
    return num_window_kv_pages


def free_device_bytes() -> int:
    """Free memory of this process's first device (the host's available RAM where the backend cannot
    say). Multi-host: its own device; jax.devices()[0] may be another process's, whose stats it cannot read."""
    try:
        stats = jax.local_devices()[0].memory_stats() or {}
        if "bytes_limit" in stats:
            return stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    except Exception:  # memory_stats is unimplemented on some backends
        pass
    return host_free_bytes()


def host_free_bytes() -> int:
    """The host's available RAM."""
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def cache_bytes_to_fit(cfg, *, num_kv_pages: int, num_window_pages: int | None, page_size: int, mesh=None):
    """(bytes, where): what of a KV cache must fit in the memory `free_device_bytes` reports. On a
    mesh, one device's share of every pool (KV heads split over `model`, or copied where fewer, see
    `sharding.kv_head_copies`; pages whole on every `data` device); on CPU devices, which share the
    host's memory, this process's devices' shares together."""
    create = functools.partial(
        KVCache.create, num_pages=num_kv_pages, page_size=page_size, num_window_pages=num_window_pages
    )
    if mesh is None:
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(jax.eval_shape(lambda: create(cfg)))), ""
    from jaxinfer import sharding

    wide = dataclasses.replace(cfg, num_kv_heads=cfg.num_kv_heads * sharding.kv_head_copies(cfg, mesh))
    shapes = jax.eval_shape(lambda: create(wide))
    held = sharding.shard_bytes(shapes, sharding.cache_shardings(shapes, mesh))
    mine = [b for d, b in held.items() if d.process_index == jax.process_index()]
    if devices_share_host_memory():
        return sum(mine), f" on this process's CPU devices ({len(mine)}, sharing the host's memory)"
    return max(mine), " per device"


def devices_share_host_memory() -> bool:
    """CPU devices (one, or several forced with --xla_force_host_platform_device_count) are all the
    host's one RAM."""
    return jax.local_devices()[0].platform == "cpu"


def check_cache_fits(cfg, *, num_kv_pages: int, num_window_pages: int | None, page_size: int, mesh=None) -> None:
    """A KV cache larger than the free memory is refused here, by name, not by the allocator (an
    out-of-memory error deep in JAX, or the process killed); see `cache_bytes_to_fit`."""
    need, per = cache_bytes_to_fit(
        cfg, num_kv_pages=num_kv_pages, num_window_pages=num_window_pages, page_size=page_size, mesh=mesh
    )
    free, where = free_device_bytes(), str(jax.local_devices()[0])
    if jax.process_count() > 1:  # every process must decide alike: else one refuses, the others wait on it
        from jaxinfer import distributed

        free = distributed.least(min(free >> 20, 2**31 - 1)) << 20  # in MiB: an int32
        where = "the device of the process with the least"
    if need > free:
        raise InvalidRequestError(
            f"num_kv_pages x page_size = {num_kv_pages} x {page_size} tokens: the KV cache would take "
            f"{need / 2**30:.1f} GiB{per}, more than the {free / 2**30:.1f} GiB free on {where}"
        )


# The longest sequence the engine runs (16M tokens): per-row host arrays (page tables, token history)
# are sized by it, so a config claiming an absurd context must not size them.
MAX_MODEL_LEN_LIMIT = 2**24


def default_max_model_len(cfg) -> int:
    """The model's maximum length, capped at MAX_MODEL_LEN_LIMIT."""
    return min(cfg.max_position_embeddings, MAX_MODEL_LEN_LIMIT)


def check_max_model_len(cfg, max_model_len) -> None:
    """Raises InvalidRequestError unless 2 <= max_model_len <= default_max_model_len(cfg).

    Past max_position_embeddings the model was never trained, and dynamic-NTK RoPE (loaded as plain
    RoPE, see `config._rope`) would start rescaling, which this engine does not do.
    """
    if (
        not isinstance(max_model_len, int)
        or isinstance(max_model_len, bool)
        or not (2 <= max_model_len <= default_max_model_len(cfg))
    ):
        limit = (
            f"{cfg.max_position_embeddings} for this model"
            if cfg.max_position_embeddings <= MAX_MODEL_LEN_LIMIT
            else f"{MAX_MODEL_LEN_LIMIT} (the engine's limit; this model's is {cfg.max_position_embeddings})"
        )
        raise InvalidRequestError(f"max_model_len must be an integer in [2, {limit}], got {max_model_len!r}")
