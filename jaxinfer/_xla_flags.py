"""XLA CPU defaults jaxinfer sets before JAX starts its backend (only where the user has not).

`--xla_cpu_experimental_ynn_fusion_type=-individual_dot` sends CPU matrix products to Eigen instead of
YNNPACK. Measured on the 2-core development machine, 150M Llama, float32 decode step:
batch 4: 47.7 -> 40.6 ms, batch 16: 87.9 -> 66.4 ms, batch 1 unchanged (18.5 vs 18.3 ms).
The flag only affects the CPU backend; it is read once, when the backend starts, so setting it after
JAX has already run a computation is harmless and has no effect.
"""

import os

_DEFAULTS = {"--xla_cpu_experimental_ynn_fusion_type": "-individual_dot"}


def apply_defaults() -> None:
    """Appends each default flag the user has not set; JAXINFER_XLA_DEFAULTS=0 turns this off."""
    if os.environ.get("JAXINFER_XLA_DEFAULTS", "1") == "0":
        return
    flags = os.environ.get("XLA_FLAGS", "")
    for name, value in _DEFAULTS.items():
        if name not in flags:
            flags = f"{flags} {name}={value}".strip()
    os.environ["XLA_FLAGS"] = flags
