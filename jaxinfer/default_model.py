"""The embedded default model: what `LLM()` and every CLI command use when no model is given.

For now it is a tiny Llama-shaped config with fixed-seed random weights and a byte tokenizer:
untrained, so its text is noise, and every entry point says so. It exists so that the whole stack
(API, CLI, benchmarks) runs on a fresh machine with nothing downloaded. A trained default model
replaces it with the checkpoint work.
"""

from __future__ import annotations

import dataclasses

from jaxinfer.config import ModelConfig
from jaxinfer.model import init_params
from jaxinfer.tokenizer import ByteTokenizer

SEED = 0
CONFIG = ModelConfig(
    name="jaxinfer-tiny-untrained",
    family="llama",
    vocab_size=256 + ByteTokenizer.OFFSET,
    hidden_size=128,
    intermediate_size=384,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    max_position_embeddings=1024,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_ids=(2,),
)


def load(*, dtype: str = "float32"):
    """Returns (cfg, params, tokenizer) of the embedded default model."""
    cfg = dataclasses.replace(CONFIG, dtype=dtype)
    return cfg, init_params(cfg, SEED), ByteTokenizer()
