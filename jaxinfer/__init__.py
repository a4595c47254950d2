"""jaxinfer: LLM inference on JAX/XLA with a paged KV cache and continuous batching."""

# isort: off
from jaxinfer._xla_flags import apply_defaults as _apply_xla_defaults

_apply_xla_defaults()  # before anything below can start the JAX backend

from jaxinfer.errors import CheckpointError, InvalidRequestError, JaxinferError, UnsupportedModelError  # noqa: E402
from jaxinfer.llm import LLM, RequestOutput  # noqa: E402
from jaxinfer.sampling import SamplingParams  # noqa: E402

# isort: on

__all__ = [
    "LLM",
    "CheckpointError",
    "InvalidRequestError",
    "JaxinferError",
    "RequestOutput",
    "SamplingParams",
    "UnsupportedModelError",
]
__version__ = "0.1.0"
