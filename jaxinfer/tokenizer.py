"""Tokenizers: Hugging Face `tokenizer.json`, SentencePiece `tokenizer.model`, and a byte tokenizer.

All three answer the same small interface (`encode`, `decode`, `vocab_size`, `bos_id`,
`eos_ids`), so the engine never knows which one it holds.
"""

from __future__ import annotations

import json
import os
from typing import Protocol

from jaxinfer.errors import CheckpointError


class Tokenizer(Protocol):
    vocab_size: int
    bos_id: int | None
    eos_ids: tuple[int, ...]

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class HFTokenizer:
    """A `tokenizers` fast tokenizer; special tokens (BOS) come from its own post-processor."""

    def __init__(self, path: str, *, eos_ids: tuple[int, ...] = ()):
        from tokenizers import Tokenizer as _Tok

        try:
            self._tok = _Tok.from_file(path)
        except Exception as e:  # the library raises a bare Exception on malformed files
            raise CheckpointError(f"{path}: cannot load tokenizer ({e})") from None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_ids = eos_ids
        self.bos_id = None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=True).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)


class SentencePieceTokenizer:
    """A SentencePiece model; BOS is prepended when `add_bos` (the Llama 1/2 convention)."""

    def __init__(self, path: str, *, add_bos: bool = True, eos_ids: tuple[int, ...] = ()):
        import sentencepiece as spm

        try:
            self._sp = spm.SentencePieceProcessor(model_file=path)
        except (OSError, RuntimeError) as e:
            raise CheckpointError(f"{path}: cannot load SentencePiece model ({e})") from None
        self.vocab_size = self._sp.get_piece_size()
        self.bos_id = self._sp.bos_id() if self._sp.bos_id() >= 0 else None
        self.add_bos = add_bos and self.bos_id is not None
        own_eos = (self._sp.eos_id(),) if self._sp.eos_id() >= 0 else ()
        self.eos_ids = eos_ids or own_eos

    def encode(self, text: str) -> list[int]:
        ids = self._sp.encode(text, out_type=int)
        return [self.bos_id, *ids] if self.add_bos else ids

    def decode(self, ids: list[int]) -> str:
        return self._sp.decode([int(i) for i in ids])


class ByteTokenizer:
    """UTF-8 bytes offset by 3 (0 pad, 1 BOS, 2 EOS): for the embedded untrained default model."""

    OFFSET = 3

    def __init__(self):
        self.vocab_size = 256 + self.OFFSET
        self.bos_id = 1
        self.eos_ids = (2,)

    def encode(self, text: str) -> list[int]:
        return [self.bos_id, *(b + self.OFFSET for b in text.encode("utf-8"))]

    def decode(self, ids: list[int]) -> str:
        data = bytes(i - self.OFFSET for i in ids if self.OFFSET <= i < self.vocab_size)
        return data.decode("utf-8", errors="replace")


def load_tokenizer(model_dir: str, *, eos_ids: tuple[int, ...] = ()) -> Tokenizer | None:
    """Finds the tokenizer in a checkpoint directory: tokenizer.json first, then tokenizer.model.

    Returns None when there is neither: such a model still serves token-id prompts.
    """
    config = {}
    config_path = os.path.join(model_dir, "tokenizer_config.json")
    if os.path.isfile(config_path):
        try:
            with open(config_path) as f:
                config = json.load(f)
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{config_path} is not valid JSON: {e}") from None
    tj = os.path.join(model_dir, "tokenizer.json")
    if os.path.isfile(tj):
        return HFTokenizer(tj, eos_ids=eos_ids)
    sp = os.path.join(model_dir, "tokenizer.model")
    if os.path.isfile(sp):
        return SentencePieceTokenizer(sp, add_bos=bool(config.get("add_bos_token", True)), eos_ids=eos_ids)
    return None
