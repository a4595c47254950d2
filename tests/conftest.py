"""Test setup: CPU only, 8 virtual devices (for sharding tests), set before JAX is imported."""

import os

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drops JAX's compiled programs after each test module.

    Every XLA CPU executable keeps about 14 memory mappings while a jit cache holds it. One pytest
    process compiles thousands of programs; kept all session, they passed Linux's default
    vm.max_map_count (65,530) late in the suite, and XLA then segfaulted inside a compile (seen
    here, always in the same test; each half of the suite alone stayed under the limit).
    """
    yield
    import gc

    import jax

    jax.clear_caches()
    gc.collect()
