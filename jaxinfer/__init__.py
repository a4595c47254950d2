"""jaxinfer: LLM inference on JAX/XLA with a paged KV cache and continuous batching."""

# isort: off
from jaxinfer._xla_flags import apply_defaults as _apply_xla_defaults

_apply_xla_defaults()  # before anything below can start the JAX backend

from jaxinfer.errors import CheckpointError, InvalidRequestError, JaxinferError, UnsupportedModelError  # noqa: E402
from jaxinfer.outputs import CompletionOutput, RequestOutput  # noqa: E402
from jaxinfer.sampling_params import SamplingParams  # noqa: E402

# isort: on


def __getattr__(name: str):
    # LLM imports JAX (seconds on a small CPU), so only when first asked for: the command line
    # checks its flags, and the gRPC client (jaxinfer.client) runs, without it.
    if name == "LLM":
        from jaxinfer.llm import LLM

        return LLM
    raise AttributeError(f"module 'jaxinfer' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), "LLM"})


__all__ = [
    "LLM",
    "CheckpointError",
    "CompletionOutput",
    "InvalidRequestError",
    "JaxinferError",
    "RequestOutput",
    "SamplingParams",
    "UnsupportedModelError",
]
__version__ = "0.1.0"
