"""jaxinfer: LLM inference on JAX/XLA with a paged KV cache and continuous batching."""

from jaxinfer.errors import CheckpointError, InvalidRequestError, JaxinferError, UnsupportedModelError
from jaxinfer.llm import LLM, RequestOutput
from jaxinfer.sampling import SamplingParams

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
