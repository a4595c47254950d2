"""The embedded default model: what `LLM()` and every CLI command use when no model is given.

A 5.8M-parameter Llama (6 layers, D 256, 8 query / 4 KV heads, tied embeddings, a 4096-piece
SentencePiece BPE vocabulary with byte fallback) trained from scratch on the King James Bible by
`python -m jaxinfer.train` (see WORKSPACE.md, "Default model", for the command and figures). It is
shipped in the package as a jaxinfer checkpoint (`jaxinfer/assets/default_model/`, bfloat16
parameters) and writes KJV-flavoured English: enough to see that the whole stack works, on a fresh
machine with nothing downloaded. It knows nothing but that one book.

`TINY_RANDOM` names a second embedded model: two layers of fixed-seed random weights over a byte
tokenizer. Its text is noise, but it compiles and runs in a fraction of the time, which is what
tests of the engine's mechanics want: `LLM(default_model.TINY_RANDOM)`.
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import os

from jaxinfer.config import ModelConfig
from jaxinfer.tokenizer import ByteTokenizer

ASSETS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "default_model")
TINY_RANDOM = "embedded:tiny-random"

SEED = 0
TINY_CONFIG = ModelConfig(
    name="jaxinfer-tiny-random",
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
CONFIG = TINY_CONFIG  # the name tests and notebooks use for "a tiny Llama config"


def load(*, dtype: str = "float32", shardings=None):
    """Returns (cfg, params, tokenizer) of the trained default model, restored from the package."""
    from jaxinfer import checkpoint
    from jaxinfer.tokenizer import load_tokenizer

    cfg, params = checkpoint.restore(ASSETS, dtype=dtype, shardings=shardings)
    return cfg, params, load_tokenizer(ASSETS, eos_ids=cfg.eos_token_ids)


def tiny_random(*, dtype: str = "float32"):
    """Returns (cfg, params, tokenizer) of the tiny untrained model (random weights, bytes)."""
    from jaxinfer.model import init_params

    cfg = dataclasses.replace(TINY_CONFIG, dtype=dtype)
    return cfg, init_params(cfg, SEED), ByteTokenizer()


EMBEDDED = {TINY_RANDOM: tiny_random}


@functools.cache
def corpus_words() -> frozenset[str]:
    """Every word of the training corpus, lower-cased (shipped beside the model for checks)."""
    with gzip.open(os.path.join(ASSETS, "corpus_words.txt.gz"), "rt") as f:
        return frozenset(w for w in f.read().split() if w)
