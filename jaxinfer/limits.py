"""Range checks that need no JAX: the engine's capacity settings and a request's cache salt.

The command line runs them on its flags before anything heavy imports, so a bad flag is answered at
once instead of after the seconds JAX takes to load; the engine and the server run the same checks
(the engine, LLM, the server and the client import them from here).
"""

from __future__ import annotations

from jaxinfer.errors import InvalidRequestError
from jaxinfer.tokenizer import require_unicode

MAX_CACHE_SALT_CHARS = 1024


def check_capacity(*, page_size, max_num_seqs, num_kv_pages, max_num_batched_tokens, num_window_kv_pages=None) -> None:
    """Raises InvalidRequestError naming the first capacity setting out of range (None: not given)."""
    for name, value, lo, hi in (
        ("page_size", page_size, 1, 2**16),
        ("max_num_seqs", max_num_seqs, 1, 2**14),  # warm-up compiles a decode shape per bucket up to it
        ("num_kv_pages", num_kv_pages, 2, 2**31 - 1),
        ("max_num_batched_tokens", max_num_batched_tokens, 16, 2**20),
        ("num_window_kv_pages", num_window_kv_pages, 2, 2**31 - 1),
    ):
        if value is None and name in ("num_kv_pages", "num_window_kv_pages"):
            continue
        if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
            raise InvalidRequestError(f"{name} must be an integer in [{lo}, {hi}], got {value!r}")
    if page_size & (page_size - 1):
        raise InvalidRequestError(f"page_size must be a power of two, got {page_size}")


def check_cache_salt(cache_salt, field: str = "cache_salt") -> None:
    """Refuses a salt that is not a non-empty string of at most MAX_CACHE_SALT_CHARS characters."""
    if cache_salt is None:
        return
    if not isinstance(cache_salt, str):
        raise InvalidRequestError(f"{field} must be a string, got {type(cache_salt).__name__}")
    if not cache_salt or len(cache_salt) > MAX_CACHE_SALT_CHARS:
        raise InvalidRequestError(
            f"{field} must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters, "
            f"got {len(cache_salt)} characters"
        )
    require_unicode(cache_salt, field)
