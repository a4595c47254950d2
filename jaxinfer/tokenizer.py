"""Tokenizers: Hugging Face `tokenizer.json`, SentencePiece `tokenizer.model`, and a byte tokenizer;
plus the checkpoint's special-token settings and its chat template.

All three answer the same small interface (`encode`, `decode`, `vocab_size`, `bos_id`, `eos_ids`,
`special_tokens`, `chat_template`), so the engine never knows which one it holds.

Token ids are meant to equal those of transformers' `AutoTokenizer.from_pretrained` on the same
files (tested), which fixes a few rules that are easy to get subtly wrong:

- BOS/EOS with a tokenizer.json: its post-processor decides. transformers (v5) bakes
  `add_bos_token` / `add_eos_token` into it when saving and ignores the flags in
  tokenizer_config.json when a tokenizer.json is present; so do we.
- BOS/EOS with a SentencePiece model: tokenizer_config.json's `add_bos_token` and `add_eos_token`,
  false when unstated (transformers v5 reads them so). A bare tokenizer.model with no
  tokenizer_config.json at all keeps the Llama 1 convention: BOS, no EOS.
- Special-token strings (`bos_token`, `eos_token`, ...) come from tokenizer_config.json, then
  special_tokens_map.json. Inside text they (and a SentencePiece model's user-defined pieces) encode
  as their single id: a chat template writes them.
- SentencePiece: transformers ignores the model's own normaliser and whitespace collapsing, and
  puts the "▁" prefix only in front of text that does not already start with a space, and (unless
  `legacy`) only at the very start of the text, not after a special token.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import itertools
import json
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

from jaxinfer.errors import CheckpointError, InvalidRequestError

# The named special tokens of every transformers tokenizer (its SPECIAL_TOKENS_ATTRIBUTES); any other
# "*_token" entry of the configs is named too (`read_settings`), and all are chat template variables.
_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class Tokenizer(Protocol):
    vocab_size: int
    bos_id: int | None
    eos_ids: tuple[int, ...]
    special_tokens: dict[str, str]  # bos_token / eos_token / ... -> its string, for chat templates
    chat_template: str | None  # the "default" one
    chat_templates: dict[str, str]  # all of them by name (optional: a tokenizer of the user's own may lack it)
    byte_ids: frozenset[int]  # byte-fallback pieces "<0xNN>": a run of them decodes as a whole
    byte_values: dict[int, int]  # each of them -> its byte (optional: a tokenizer of the user's own may lack it)
    # Ids below vocab_size that decode(skip_special_tokens=True) drops (special tokens): no text.
    skipped_ids: frozenset[int]

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str: ...

    @property
    def max_token_bytes(self) -> int | None:
        """No token stands for more bytes of the text than this; None where no such bound holds (an
        unknown run of characters fused into one unknown token, a normaliser that may shrink text)."""
        ...


def encode_prompt(
    tok: Tokenizer,
    text: str,
    *,
    max_tokens: int | None,
    field: str,
    add_special_tokens: bool = True,
    truncate_prompt_tokens: int | None = None,
) -> list[int]:
    """`tok.encode(text, add_special_tokens=...)` for a prompt that may have at most `max_tokens` tokens
    (None: any number, as a request that keeps only its last ones may). `truncate_prompt_tokens`: the
    request's, named in a refusal (it keeps more tokens than the limit, so it could not help).

    A text that cannot fit under any tokenization (more UTF-8 bytes than max_tokens times the
    longest token's) is refused before the tokenizer runs: encoding megabytes only to refuse the
    result afterwards costs seconds, and on a server holds up every other request meanwhile. One that
    passes that bound (or has none: see `max_token_bytes`) is refused when its tokens are too many.
    """
    _refuse_fill_token(text, getattr(tok, "fill_token", None), field)
    if max_tokens is None:
        return tok.encode(text, add_special_tokens=add_special_tokens)
    per_token = getattr(tok, "max_token_bytes", None)  # None: no bound, the text is encoded and counted
    limit = None if per_token is None else max_tokens * per_token
    if limit is not None and (len(text) > limit or len(text.encode("utf-8", "surrogatepass")) > limit):
        size = len(text.encode("utf-8", "surrogatepass"))  # (chars <= bytes: the first test is cheap)
        # A request that truncates is refused here only when it keeps more than the limit: say so, or
        # the caller who asked for truncation is told just that the prompt is too long.
        keeps = (
            ""
            if truncate_prompt_tokens is None
            else f", and SamplingParams.truncate_prompt_tokens = {truncate_prompt_tokens} keeps more than that"
        )
        raise InvalidRequestError(
            f"{field}: {size} bytes of text cannot fit in {max_tokens} tokens (the prompt limit, "
            f"max_model_len - 1; no token of this tokenizer stands for more than {per_token} "
            f"byte{'' if per_token == 1 else 's'}){keeps}"
        )
    ids = tok.encode(text, add_special_tokens=add_special_tokens)
    if len(ids) > max_tokens:
        count, kept = len(ids), ""
        if truncate_prompt_tokens is not None:  # as Engine.validate words it for token ids
            count = min(count, truncate_prompt_tokens)
            kept = f" (its last SamplingParams.truncate_prompt_tokens = {truncate_prompt_tokens})"
        raise InvalidRequestError(
            f"{field}: prompt has {count} tokens{kept}; the limit is max_model_len - 1 = {max_tokens}"
        )
    return ids


def require_unicode(text: str, field: str) -> None:
    """Raises InvalidRequestError when `text` has no UTF-8 form: a lone surrogate, which is what
    Python makes of invalid bytes decoded with `surrogateescape` (command-line arguments, file names).
    The tokenizers would otherwise fail deep in native code with an unhelpful message."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequestError(
            f"{field} is not valid Unicode: lone surrogate {text[e.start]!r} at character {e.start} "
            "(invalid UTF-8 input?)"
        ) from None


@dataclasses.dataclass(frozen=True)
class TokenizerSettings:
    """What tokenizer_config.json, special_tokens_map.json and the chat template files say.

    None means "not stated": each tokenizer then applies its own default.
    """

    special_tokens: dict[str, str] = dataclasses.field(default_factory=dict)
    extra_special_tokens: tuple[str, ...] = ()  # additional / added special tokens, matched inside text
    # those of them the configs list (additional_special_tokens / extra_special_tokens), not the added
    # tokens marked special
    additional_special_tokens: tuple[str, ...] = ()
    added_tokens: tuple[tuple[int, str, bool], ...] = ()  # (id, text, special), from added_tokens_decoder / .json
    # added_tokens_decoder's AddedToken options by text: (lstrip, rstrip, single_word, normalized)
    added_token_options: tuple[tuple[str, tuple[bool, bool, bool, bool]], ...] = ()
    add_bos: bool | None = None
    add_eos: bool | None = None
    add_prefix_space: bool | None = None
    legacy: bool | None = None
    # The class transformers 5 builds (`resolve_tokenizer_class`: "Fast" dropped, `_AS_WRITTEN` for the
    # generic one), from tokenizer_config.json's or config.json's tokenizer_class and the model_type.
    tokenizer_class: str | None = None
    fill_token: str | None = None  # CodeLlama's infilling marker: transformers rewrites such prompts; refused here
    chat_templates: dict[str, str] = dataclasses.field(default_factory=dict)  # by name; "default" the main one
    has_config: bool = False  # whether there was a tokenizer_config.json at all

    @property
    def chat_template(self) -> str | None:
        return self.chat_templates.get("default")


def _read_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None


def _token_text(value) -> str | None:
    """A special token as written in the configs: a string or an AddedToken dict {"content": ...}."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _named_token_text(value) -> str | None:
    """A "*_token" entry transformers takes for a token: a string, or an AddedToken as the configs write
    one (with its "__type"); a bare object with a "content" is something else to it."""
    if isinstance(value, dict) and value.get("__type") != "AddedToken":
        return None
    return _token_text(value)


CHAT_TEMPLATE_DIR = "additional_chat_templates"  # transformers 5: named templates, one NAME.jinja each


def _read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{path} is not valid UTF-8: {e}") from None


def _chat_templates(model_dir: str, config: dict) -> dict[str, str]:
    """The checkpoint's chat templates by name, "default" for the main one, read as transformers 5
    reads them: the files if there are any (chat_template.jinja is "default", and each
    additional_chat_templates/NAME.jinja is NAME), else tokenizer_config.json's chat_template (a
    string, or a list of {"name", "template"}), else chat_template.json's."""
    templates = {}
    path = os.path.join(model_dir, "chat_template.jinja")
    if os.path.isfile(path):
        templates["default"] = _read_text(path)
    extra = os.path.join(model_dir, CHAT_TEMPLATE_DIR)
    if os.path.isdir(extra):
        for name in sorted(os.listdir(extra)):
            if name.endswith(".jinja") and os.path.isfile(os.path.join(extra, name)):
                templates[name.removesuffix(".jinja")] = _read_text(os.path.join(extra, name))
    if templates:
        return templates
    template = config.get("chat_template")
    if template is None:
        path = os.path.join(model_dir, "chat_template.json")
        if os.path.isfile(path):
            data = _read_json(path)
            if not isinstance(data, dict):
                raise CheckpointError(f"{path} must hold a JSON object with a chat_template")
            template = data.get("chat_template")
    if isinstance(template, list):
        templates = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
    elif template is not None:
        templates = {"default": template}
    for name, text in templates.items():
        if not isinstance(name, str) or not isinstance(text, str):
            raise CheckpointError(
                f"{model_dir}: chat template {name!r} must be a string with a string name, got {type(text).__name__}"
            )
    return templates


def choose_chat_template(templates: Mapping[str, str], *, tools) -> str | None:
    """The template a conversation is rendered with, as transformers picks it: "tool_use" when tools
    are passed and the checkpoint names one, else "default". None: the checkpoint has no template.

    Raises:
        InvalidRequestError: named templates, and none of them is "default" (nor "tool_use" with tools).
    """
    if tools is not None and "tool_use" in templates:
        return templates["tool_use"]
    if "default" in templates or not templates:
        return templates.get("default")
    raise InvalidRequestError(
        f"this model has named chat templates {sorted(templates)} and no 'default' one"
        + (" (pass tools= to use 'tool_use')" if "tool_use" in templates else "")
    )


def _token_id(value, field: str) -> int:
    """A token id as the configs write it: an int, or in added_tokens_decoder's keys a decimal string."""
    if isinstance(value, str) and value.isdecimal() and value.isascii():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**31:
        raise CheckpointError(f"{field} must be a token id (an integer in [0, 2**31)), got {value!r}")
    return value


def read_settings(model_dir: str) -> TokenizerSettings:
    """Reads the special-token settings and chat template of a checkpoint directory."""
    config, tokens_map = {}, {}
    path = os.path.join(model_dir, "tokenizer_config.json")
    has_config = os.path.isfile(path)
    if has_config:
        config = _read_json(path)
    path = os.path.join(model_dir, "special_tokens_map.json")
    if os.path.isfile(path):
        tokens_map = _read_json(path)
    if not isinstance(config, dict) or not isinstance(tokens_map, dict):
        raise CheckpointError(f"{model_dir}: tokenizer_config.json / special_tokens_map.json must hold JSON objects")
    # transformers' rule: a config with added_tokens_decoder (what transformers 4.34+ writes) says
    # everything and special_tokens_map.json is not read; an older one is overridden by the map.
    if "added_tokens_decoder" in config:
        tokens_map = {}
    model_config = {}
    path = os.path.join(model_dir, "config.json")
    if os.path.isfile(path):
        model_config = _read_json(path)
        if not isinstance(model_config, dict):
            raise CheckpointError(f"{path} must hold a JSON object")
    declared = config.get("tokenizer_class") or model_config.get("tokenizer_class")
    # A jaxinfer checkpoint's config.json (checkpoint.py) names the family, which is the model_type
    # for this purpose (gemma3 for gemma3_text too: both register GemmaTokenizer).
    model_type = model_config.get("model_type", model_config.get("family"))
    if declared is not None and not isinstance(declared, str):
        raise CheckpointError(f"{model_dir}: tokenizer_class must be a string, got {declared!r}")
    if model_type is not None and not isinstance(model_type, str):
        raise CheckpointError(f"{model_dir}: config.json's model_type (or family) must be a string, got {model_type!r}")
    tj = os.path.join(model_dir, "tokenizer.json")
    tokenizer_class = resolve_tokenizer_class(declared, model_type, byte_level=_mentions_byte_level(tj))

    special = {}
    defaults = _CLASS_SPECIAL_TOKENS.get(tokenizer_class, {})
    for name in _SPECIAL_NAMES:
        # (a key present with null says none, over the class's default)
        text = _token_text(tokens_map[name] if name in tokens_map else config.get(name, defaults.get(name)))
        if text is not None:
            special[name] = text
    fill = None
    if tokenizer_class == "CodeLlamaTokenizer":
        # CodeLlamaTokenizer names its infilling markers and fill token (its defaults unless the config
        # names others, or null for none), special whatever tokenizer.json says; the fill token marks
        # where the middle goes in a prompt.
        for key, default in (*_CODE_LLAMA_MARKERS.items(), ("fill_token", "<FILL_ME>")):
            if (text := _token_text(config.get(key, default))) is not None:
                special[key] = text
        fill = special.get("fill_token")
    # transformers 5 names every other "*_token" entry that holds a token too (Gemma 3's boi_token,
    # image_token): special like the seven, and a variable of chat templates. The config's first, then
    # special_tokens_map.json's; an `extra_special_tokens` object names more, over all of these.
    for key, value in (*config.items(), *tokens_map.items()):
        if isinstance(key, str) and key.endswith("_token") and key not in special:
            if (text := _named_token_text(value)) is not None:
                special[key] = text
    extra = []
    for key in ("additional_special_tokens", "extra_special_tokens"):
        for source in (config, tokens_map):
            values = source.get(key)
            if isinstance(values, dict):  # named model-specific tokens (transformers 5's form)
                for name, value in values.items():
                    if isinstance(name, str) and (text := _token_text(value)) is not None:
                        special[name] = text
                values = list(values.values())
            if values is not None and not isinstance(values, list):
                raise CheckpointError(f"{model_dir}: {key} in the tokenizer settings must be a list, got {values!r}")
            for v in values or ():
                if (t := _token_text(v)) is not None:
                    extra.append(t)
    additional = tuple(dict.fromkeys(extra))  # before the added tokens marked special join `extra`
    decoder = config.get("added_tokens_decoder") or {}
    if not isinstance(decoder, dict):
        raise CheckpointError(f"{model_dir}: tokenizer_config.json's added_tokens_decoder must be an object")
    added = {}  # id -> (text, special)
    options = {}  # text -> (lstrip, rstrip, single_word, normalized)
    for key, entry in decoder.items():
        if isinstance(entry, dict) and (t := _token_text(entry)) is not None:
            is_special = bool(entry.get("special"))
            added[_token_id(key, f"{model_dir}: added_tokens_decoder key")] = (t, is_special)
            flags = (entry.get("lstrip"), entry.get("rstrip"), entry.get("single_word"), entry.get("normalized"))
            options[t] = (*(bool(f) for f in flags[:3]), not is_special if flags[3] is None else bool(flags[3]))
            if entry.get("special"):
                extra.append(t)
    path = os.path.join(model_dir, "added_tokens.json")  # {text: id}, written by older transformers
    if os.path.isfile(path):
        listed = _read_json(path)
        if not isinstance(listed, dict):
            raise CheckpointError(f"{path} must hold a JSON object of token text -> id")
        named = {*special.values(), *extra}
        for t, i in listed.items():
            added.setdefault(_token_id(i, f"{path}: the id of {t!r}"), (t, t in named))

    def flag(name):
        value = config.get(name)
        return None if value is None else bool(value)

    return TokenizerSettings(
        special_tokens=special,
        extra_special_tokens=tuple(dict.fromkeys(extra)),
        additional_special_tokens=additional,
        added_tokens=tuple((i, t, sp) for i, (t, sp) in sorted(added.items())),
        added_token_options=tuple(options.items()),
        add_bos=flag("add_bos_token"),
        add_eos=flag("add_eos_token"),
        add_prefix_space=flag("add_prefix_space"),
        legacy=flag("legacy"),
        tokenizer_class=tokenizer_class,
        fill_token=fill,
        chat_templates=_chat_templates(model_dir, config),
        has_config=has_config,
    )


# How transformers 5 (checked against 5.25) picks the tokenizer class of a checkpoint directory. The
# class matters because the classes with a constructor of their own (below) keep only the vocabulary,
# merges and post-processor of a tokenizer.json and rebuild the rest (the added tokens come from
# tokenizer_config.json's added_tokens_decoder, or the file's where it has none: jaxinfer keeps the
# file's in either case, which differs only where the two lists disagree); the generic one
# (TokenizersBackend, "PreTrainedTokenizerFast") reads the file as written.
_AS_WRITTEN = "TokenizersBackend"
# config.json's model_type -> the class transformers registers for it (none for Llama: the generic one
# then; Mistral: the generic one, when the optional mistral-common package is not installed, which
# jaxinfer does not ask for).
_REGISTERED_CLASSES = {
    "mistral": _AS_WRITTEN,
    "ministral": _AS_WRITTEN,  # (also a Mistral config.json with layer_types, as transformers reads it)
    "qwen2": "Qwen2Tokenizer",
    "qwen3": "Qwen2Tokenizer",
    "gemma": "GemmaTokenizer",
    "gemma2": "GemmaTokenizer",
    "gemma3": "GemmaTokenizer",
    "gemma3_text": "GemmaTokenizer",
}
# Model types whose registered class wins over the class the checkpoint names (transformers'
# MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS, as far as it concerns the families jaxinfer loads).
_CLASS_FORCED_BY_MODEL_TYPE = frozenset({"qwen2"})
_GENERIC_CLASSES = frozenset({"PreTrainedTokenizer", "PreTrainedTokenizerFast", "TokenizersBackend", "PythonBackend"})
# The special tokens each class names when the configs leave the name out (its constructor's defaults).
_CLASS_SPECIAL_TOKENS = {
    "LlamaTokenizer": {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"},
    "CodeLlamaTokenizer": {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"},
    "GemmaTokenizer": {
        "unk_token": "<unk>",
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "pad_token": "<pad>",
        "mask_token": "<mask>",
    },
    "GPT2Tokenizer": dict.fromkeys(("unk_token", "bos_token", "eos_token"), "<|endoftext|>"),
    "Qwen2Tokenizer": dict.fromkeys(("unk_token", "eos_token", "pad_token"), "<|endoftext|>"),
}


def resolve_tokenizer_class(declared: str | None, model_type: str | None, *, byte_level: bool) -> str:
    """The class transformers 5's AutoTokenizer builds (without its "Fast" suffix; `_AS_WRITTEN` for
    the generic one), from the class the checkpoint declares (tokenizer_config.json, else config.json),
    config.json's model_type, and whether the tokenizer.json is byte-level. Its order:

    1. a byte-level file declared LlamaTokenizer is read as written (Llama 3 style files saved under
       that name; DeepSeek), unless the model type forces its own class;
    2. where the model type registers another class than the declared one: the generic registration
       (Mistral) wins, then a forced one (Qwen 2), else the declared class;
    3. the declared class, or without one, the model type's.

    A Mistral v0.1 checkpoint (LlamaTokenizer under model_type mistral) is therefore read as written,
    a Llama 2 one rebuilt, a Llama one that names no class read as written; a SmolLM one
    (GPT2Tokenizer under llama) loses what its file's pre-tokenizer adds to GPT-2's (its digit
    splitting), as in transformers 5.
    """
    if declared in _GENERIC_CLASSES:
        declared = _AS_WRITTEN
    elif declared is not None:
        declared = declared.removesuffix("Fast")
    registered = _REGISTERED_CLASSES.get(model_type or "")
    if declared == "LlamaTokenizer" and byte_level and model_type not in _CLASS_FORCED_BY_MODEL_TYPE:
        return _AS_WRITTEN
    if declared is not None and registered is not None and registered != declared:
        if registered == _AS_WRITTEN:
            return _AS_WRITTEN
        return registered if model_type in _CLASS_FORCED_BY_MODEL_TYPE else declared
    return declared or registered or _AS_WRITTEN


# CodeLlamaTokenizer's infilling markers and their defaults (tokenizer_config.json keys).
_CODE_LLAMA_MARKERS = {
    "prefix_token": "▁<PRE>",
    "middle_token": "▁<MID>",
    "suffix_token": "▁<SUF>",
    "eot_token": "▁<EOT>",
}


def _rebuild_as_llama_tokenizer(tok, settings: TokenizerSettings) -> None:
    """What transformers 5's LlamaTokenizer does to a tokenizer.json it loads (Llama 2 checkpoints name
    that class; Mistral's too, but their model_type has the file read as written): it keeps the file's
    vocabulary, merges and post-processor, and replaces the rest. No normaliser (the files'
    Prepend("▁") + Replace(" ", "▁") doubled a leading space and added "▁" after special tokens); a
    Metaspace pre-tokenizer that
    prepends "▁" to the first word only ("always": after every special token, when `legacy` is
    true; "never" with add_prefix_space false); byte fallback; a decoder that strips the prefix.
    CodeLlamaTokenizer does the same but ignores `legacy` and always strips the decoded prefix."""
    from tokenizers import decoders, pre_tokenizers

    if _bpe_model(tok) is None:
        return  # transformers rebuilds a BPE; anything else is read as written
    code = settings.tokenizer_class == "CodeLlamaTokenizer"
    prefix = settings.add_prefix_space if settings.add_prefix_space is not None else True
    scheme = ("always" if settings.legacy and not code else "first") if prefix else "never"
    tok.model.fuse_unk = True
    tok.model.byte_fallback = True
    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme, split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(content=" ", left=1)] if prefix or code else []))


def _bpe_model(tok):
    """The file's BPE model with what every rebuilding class builds afresh: no dropout (the file's
    would make encoding random), merges never skipped for a word the vocabulary holds whole (Llama 3's
    files set that). None for a model of another kind, which the rebuilds leave as written."""
    from tokenizers import models

    if not isinstance(tok.model, models.BPE):
        return None
    tok.model.dropout = None
    tok.model.ignore_merges = False
    return tok.model


def _rebuild_as_gemma_tokenizer(tok, settings: TokenizerSettings) -> None:
    """transformers 5's GemmaTokenizer: spaces become "▁" (no prefix), split after each, byte fallback."""
    from tokenizers import decoders, normalizers, pre_tokenizers

    if (model := _bpe_model(tok)) is None:
        return
    unk = settings.special_tokens.get("unk_token", "<unk>")
    if model.token_to_id(unk) is None:
        raise CheckpointError(
            f"no unk_token {unk!r} in the vocabulary, which GemmaTokenizer (the class "
            "transformers builds for this checkpoint) needs: transformers cannot encode text with it either"
        )
    model.fuse_unk = True
    model.byte_fallback = True
    model.unk_token = unk
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])


# Qwen 2's pre-tokenizer split (a fact of its tokenizer, as transformers and Qwen's files write it).
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _rebuild_as_byte_level_bpe(tok, settings: TokenizerSettings, *, qwen: bool) -> None:
    """transformers 5's GPT2Tokenizer (GPT-2's byte-level pre-tokenizer alone: no normaliser, and
    nothing else the file's pre-tokenizer had, such as digit splitting) and Qwen2Tokenizer (NFC, then
    Qwen's split, then bytes); `add_prefix_space` from the config, false when unstated."""
    from tokenizers import Regex, decoders, normalizers, pre_tokenizers

    if (model := _bpe_model(tok)) is None:
        return
    model.fuse_unk = False
    model.byte_fallback = False
    model.continuing_subword_prefix = ""
    model.end_of_word_suffix = ""
    model.unk_token = None  # a byte no merge covers is dropped, not <unk>
    prefix = bool(settings.add_prefix_space)
    if qwen:
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=prefix, use_regex=False),
            ]
        )
    else:
        tok.normalizer = None
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=prefix)
    tok.decoder = decoders.ByteLevel()


_REBUILDS = {
    "LlamaTokenizer": _rebuild_as_llama_tokenizer,
    "CodeLlamaTokenizer": _rebuild_as_llama_tokenizer,
    "GemmaTokenizer": _rebuild_as_gemma_tokenizer,
    "GPT2Tokenizer": functools.partial(_rebuild_as_byte_level_bpe, qwen=False),
    "Qwen2Tokenizer": functools.partial(_rebuild_as_byte_level_bpe, qwen=True),
}


def _refuse_fill_token(text: str, fill: str | None, field: str = "prompt") -> None:
    """transformers' CodeLlamaTokenizer turns a prompt holding its fill token ("def f(<FILL_ME>)")
    into an infilling prompt (prefix, suffix and middle markers around the two halves); jaxinfer does
    not, so it refuses the text rather than encode it differently."""
    if fill is not None and fill in text:
        raise InvalidRequestError(
            f"{field} holds the fill token {fill!r}: CodeLlama infilling prompts are not supported; write the "
            "prefix/suffix/middle markers out yourself, or pass prompt_token_ids"
        )


def _add_config_tokens(tok, settings: TokenizerSettings) -> None:
    """What transformers does on loading a tokenizer.json beside a tokenizer_config.json: the config's
    added_tokens_decoder entries the file does not hold as they are written, the named special tokens
    (bos_token, eos_token, ...) and the additional special tokens it holds as no added token are
    added. A text the vocabulary has keeps its id, another gets the next one; it is special where its
    entry says so or it is a named special token, and is then matched inside text and skipped by
    decode.
    (A chat model's <|im_end|> kept in the vocabulary, declared special only in the config, was
    encoded as the characters of its text and kept by a skipping decode.)"""
    from tokenizers import AddedToken

    present = {t.content: t for t in tok.get_added_tokens_decoder().values()}
    # bos_token, eos_token, ...: special whatever the file says; one the vocabulary lacks gets the next
    # id in the order transformers adds them (the seven, then the other named ones)
    named = dict.fromkeys(settings.special_tokens.values())
    options = dict(settings.added_token_options)
    wanted = {text: special or text in named for _, text, special in settings.added_tokens}
    for text in named:
        wanted[text] = True
    for text in settings.extra_special_tokens:
        if text not in present:
            wanted.setdefault(text, True)
    new = []
    for text, special in wanted.items():
        lstrip, rstrip, single_word, normalized = options.get(text, (False, False, False, not special))
        have = present.get(text)
        if have is not None and (have.special, have.lstrip, have.rstrip, have.single_word, have.normalized) == (
            special,
            lstrip,
            rstrip,
            single_word,
            normalized,
        ):
            continue
        new.append(
            AddedToken(
                text, special=special, lstrip=lstrip, rstrip=rstrip, single_word=single_word, normalized=normalized
            )
        )
    if new:
        tok.add_tokens(new)


def _bos_only_post_processor(tok, bos: str | None) -> None:
    """CodeLlamaTokenizer passes add_bos_token=True to its base class, which then writes its own
    post-processor over the file's: BOS (where it has one) and never EOS (the config's add_*_token
    flags are dropped when a tokenizer.json is read)."""
    from tokenizers import processors

    bos_id = tok.token_to_id(bos) if bos is not None else None
    if bos_id is None:
        tok.post_processor = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1", special_tokens=[])
    else:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, bos_id)]
        )


def _readd_plain_special_tokens(tok, settings: TokenizerSettings) -> None:
    """What Qwen2Tokenizer's constructor ends with: every named and listed special token added again as
    a plain special token, which drops the lstrip / rstrip / single_word flags the files gave it."""
    from tokenizers import AddedToken

    texts = dict.fromkeys((*settings.special_tokens.values(), *settings.additional_special_tokens))
    tok.add_tokens([AddedToken(text, special=True) for text in texts])


def _with_own_eos(eos_ids, own: int | None) -> tuple[int, ...]:
    """The model's EOS ids (config.json / generation_config.json) and the tokenizer's own eos_token, as
    vLLM stops on both: chat fine-tunes often name <|eot_id|> / <|im_end|> only in the tokenizer."""
    return tuple(dict.fromkeys((*eos_ids, *((own,) if own is not None else ()))))


def _mentions_byte_level(path: str) -> bool:
    """transformers 5's test for "this LlamaTokenizer file is really byte-level, read it as written"
    (`_tokenizer_json_has_byte_level`): the text '"ByteLevel"' anywhere in tokenizer.json, in a
    vocabulary entry or a post-processor too. (What the pipeline really does is `_is_byte_level`.)"""
    try:
        with open(path, encoding="utf-8") as f:
            return '"ByteLevel"' in f.read()
    except (OSError, ValueError):
        return False


def _is_byte_level(path: str) -> bool:
    """Whether a tokenizer.json uses a ByteLevel pre-tokenizer or decoder (GPT-2 / Llama 3 style): then
    every byte of text has a token (`HFTokenizer.max_token_bytes`). (A file that cannot be read says
    no here; loading it then names what is wrong.)"""
    try:
        with open(path, encoding="utf-8") as f:
            spec = json.load(f)
    except (OSError, ValueError, RecursionError):
        return False

    def uses(node) -> bool:  # the component itself, or one inside a Sequence
        if isinstance(node, list):
            return any(uses(n) for n in node)
        return isinstance(node, dict) and (node.get("type") == "ByteLevel" or any(uses(v) for v in node.values()))

    return isinstance(spec, dict) and (uses(spec.get("pre_tokenizer")) or uses(spec.get("decoder")))


class _ChatTemplating:
    """transformers' `apply_chat_template` on jaxinfer's tokenizers: scripts written for vLLM, whose
    `LLM.get_tokenizer()` is a transformers tokenizer, render a prompt with
    `llm.get_tokenizer().apply_chat_template(messages, tokenize=False, add_generation_prompt=True)`."""

    def apply_chat_template(  # transformers' parameters in transformers' order: positional calls work too
        self,
        conversation,
        tools=None,
        documents=None,
        chat_template: str | None = None,
        add_generation_prompt: bool = False,
        continue_final_message: bool = False,
        tokenize: bool = True,
        sanitize_control_tokens: bool = False,
        padding=False,
        truncation: bool = False,
        max_length: int | None = None,
        return_tensors=None,
        return_dict: bool = True,
        return_assistant_tokens_mask: bool = False,
        tokenizer_kwargs=None,
        **kwargs,
    ):
        """As transformers 5's: the rendered text (tokenize=False); else its ids, encoded without
        adding BOS/EOS (the template writes its own), as {"input_ids", "attention_mask"}
        (return_dict, transformers 5's default) or a plain list. A list of conversations gives a
        list of texts, or of id lists (one dict of lists). Further keyword arguments are template
        variables (e.g. enable_thinking=False), as `LLM.chat`'s `chat_template_kwargs`.
        transformers' tokenizer options (padding, truncation, tensors, ...) are not implemented:
        refused by name unless left at their defaults."""
        # Named here, not left to **kwargs: as template variables they were silently ignored, and a
        # script asking for tensors, padding, truncation or sanitized control tokens got plain,
        # unpadded, whole lists, and control tokens in its messages read as control tokens.
        options = {
            "sanitize_control_tokens": sanitize_control_tokens,
            "padding": padding,
            "truncation": truncation,
            "max_length": max_length,
            "return_tensors": return_tensors,
            "return_assistant_tokens_mask": return_assistant_tokens_mask,
            "tokenizer_kwargs": tokenizer_kwargs,
        }
        if given := [k for k, v in options.items() if v not in (None, False, {}, "do_not_pad")]:
            raise InvalidRequestError(
                f"apply_chat_template here does not implement transformers' {given}: render with "
                "tokenize=False and tokenize the text as you need it"
            )
        texts, batched = render_chats(
            self,
            conversation,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=tools,
            documents=documents,
            chat_template=chat_template,
            chat_template_kwargs=kwargs,
            kwargs_name="apply_chat_template's template variables (keyword arguments)",
        )
        if not tokenize:
            return texts if batched else texts[0]
        ids = [self.encode(t, add_special_tokens=False) for t in texts]
        if not return_dict:
            return ids if batched else ids[0]
        masks = [[1] * len(i) for i in ids]
        if not batched:
            return _Encoding(input_ids=ids[0], attention_mask=masks[0])
        return _Encoding(input_ids=ids, attention_mask=masks)


class _Encoding(dict):
    """transformers' BatchEncoding as far as scripts read one: its keys, also as attributes."""

    def __getattr__(self, name: str):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class HFTokenizer(_ChatTemplating):
    """A `tokenizers` fast tokenizer (tokenizer.json); BOS/EOS come from its own post-processor.

    Under a class that transformers 5 rebuilds from the file's vocabulary (`resolve_tokenizer_class`:
    LlamaTokenizer, CodeLlamaTokenizer, GemmaTokenizer, GPT2Tokenizer, Qwen2Tokenizer), the pipeline
    is rebuilt the same way (`_REBUILDS`); under any other the file is read as written.
    """

    def __init__(self, path: str, *, settings: TokenizerSettings | None = None, eos_ids: tuple[int, ...] = ()):
        from tokenizers import Tokenizer as _Tok

        try:
            self._tok = _Tok.from_file(path)
        except Exception as e:  # the library raises a bare Exception on malformed files
            raise CheckpointError(f"{path}: cannot load tokenizer ({e})") from None
        # A file saved with truncation or padding switched on (a fine-tuning run's) would cut or pad
        # every prompt; transformers switches both off for each call.
        self._tok.no_truncation()
        self._tok.no_padding()
        settings = settings or TokenizerSettings()
        self._byte_level = _is_byte_level(path)
        if (rebuild := _REBUILDS.get(settings.tokenizer_class)) is not None:
            try:
                rebuild(self._tok, settings)
            except CheckpointError as e:
                raise CheckpointError(f"{path}: {e}") from None
        _add_config_tokens(self._tok, settings)
        if settings.tokenizer_class == "Qwen2Tokenizer":
            _readd_plain_special_tokens(self._tok, settings)
        if settings.tokenizer_class == "CodeLlamaTokenizer":
            try:
                _bos_only_post_processor(self._tok, settings.special_tokens.get("bos_token"))
            except Exception as e:  # the library's template parser raises bare exceptions
                raise CheckpointError(f"{path}: bos_token cannot head a post-processor template ({e})") from None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.byte_values = {i: b for b in range(256) if (i := self._tok.token_to_id(f"<0x{b:02X}>")) is not None}
        self.byte_ids = frozenset(self.byte_values)
        self.skipped_ids = frozenset(i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)
        self.special_tokens = dict(settings.special_tokens)
        self.chat_templates = dict(settings.chat_templates)
        self.chat_template = settings.chat_template
        self.fill_token = settings.fill_token
        self.bos_id = self._id(self.special_tokens.get("bos_token"))
        eos_id = self._id(self.special_tokens.get("eos_token"))
        self.eos_ids = _with_own_eos(eos_ids, eos_id)

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        _refuse_fill_token(text, self.fill_token, "text")
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    @functools.cached_property
    def max_token_bytes(self) -> int | None:
        """The longest token's UTF-8 length, where every byte of text has a token of its own (byte-level
        BPE, all 256 byte-fallback pieces); a Unigram or WordPiece model without them folds a run of
        unknown characters of any length into one unknown token. An NFC normaliser can shrink text
        threefold (a Hangul syllable's three jamo, 9 bytes, compose into 3); any other, without bound."""
        if not (self._byte_level or len(self.byte_ids) == 256):
            return None
        shrink = {"NoneType": 1, "NFC": 3}.get(type(self._tok.normalizer).__name__)
        if shrink is None:
            return None
        longest = max((len(t.encode("utf-8")) for t in self._tok.get_vocab(with_added_tokens=True)), default=1)
        return longest * shrink

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)


class SentencePieceTokenizer(_ChatTemplating):
    """A SentencePiece model (tokenizer.model), encoding as transformers' Llama/Gemma tokenizers do.

    The model's normaliser, whitespace collapsing and dummy prefix are switched off in a copy of its
    proto: the prefix is then added here, by transformers' rule (see the module docstring).
    """

    def __init__(
        self,
        path: str,
        *,
        add_bos: bool = True,
        eos_ids: tuple[int, ...] = (),
        settings: TokenizerSettings | None = None,
    ):
        import sentencepiece as spm
        from sentencepiece import sentencepiece_model_pb2

        settings = settings or TokenizerSettings(add_bos=add_bos)
        try:
            with open(path, "rb") as f:
                proto = sentencepiece_model_pb2.ModelProto.FromString(f.read())
            own_prefix = proto.normalizer_spec.add_dummy_prefix
            user_defined = [p.piece for p in proto.pieces if p.type == p.USER_DEFINED]
            proto.normalizer_spec.name = "identity"
            proto.normalizer_spec.precompiled_charsmap = b""
            proto.normalizer_spec.add_dummy_prefix = False
            proto.normalizer_spec.remove_extra_whitespaces = False
            self._sp = spm.SentencePieceProcessor(model_proto=proto.SerializeToString())
        except (OSError, RuntimeError, ValueError) as e:
            raise CheckpointError(f"{path}: cannot load SentencePiece model ({e})") from None
        except Exception as e:  # protobuf's DecodeError
            raise CheckpointError(f"{path}: cannot load SentencePiece model ({type(e).__name__}: {e})") from None
        self._num_pieces = self._sp.get_piece_size()
        # Tokens the configs add past the model's own pieces (a pad token at 32000, tool markers) have
        # ids of their own: matched inside text like the special tokens, and a non-special one decodes
        # to its text, as in transformers.
        unk = self._sp.unk_id()
        is_piece = {t for _, t, _ in settings.added_tokens if self._sp.piece_to_id(t) != unk}
        is_piece |= {self._sp.id_to_piece(unk)} if unk >= 0 else set()
        # (An entry whose text is a piece already, "</s>" at 400, changes nothing: transformers ignores it.)
        self._added = {i: t for i, t, _ in settings.added_tokens if i >= self._num_pieces and t not in is_piece}
        self._added_ids = {t: i for i, t in self._added.items()}
        self.vocab_size = max([self._num_pieces, *(i + 1 for i in self._added)])
        # A named or listed special token the model and the configs give no id gets the next one, as
        # transformers appends it (GemmaTokenizer's "<pad>" and "<mask>" over a model without them).
        for text in dict.fromkeys((*settings.special_tokens.values(), *settings.extra_special_tokens)):
            if text and text not in self._added_ids and self._sp.piece_to_id(text) == unk and text not in is_piece:
                self._added[self.vocab_size] = text
                self._added_ids[text] = self.vocab_size
                self.vocab_size += 1
        self.chat_templates = dict(settings.chat_templates)
        self.chat_template = settings.chat_template
        self.special_tokens = dict(settings.special_tokens)
        cls = settings.tokenizer_class or ""
        self._prefix_space = settings.add_prefix_space if settings.add_prefix_space is not None else own_prefix
        if cls == "GemmaTokenizer":
            self._prefix_space = False  # Gemma's tokenizer never adds one, whatever the config says
        if settings.add_prefix_space is None and cls in ("LlamaTokenizer", "CodeLlamaTokenizer"):
            self._prefix_space = True  # LlamaTokenizer's default, whatever the model's own flag
        code = cls == "CodeLlamaTokenizer"
        # The generic class (transformers' TokenizersBackend: no tokenizer class named, or Mistral's)
        # converts the model as SentencePiece encodes: the model's own dummy prefix (add_prefix_space
        # is not read) in front of every run of text, after each special token and before a leading
        # space too (" hi" is "▁", "▁hi"); with `legacy` false, only at the start, as LlamaTokenizer.
        generic = cls == _AS_WRITTEN
        if generic:
            self._prefix_space = own_prefix
        self._prefix_always = generic and settings.legacy is not False
        self._prefix_everywhere = self._prefix_always or (bool(settings.legacy) and not code)  # CodeLlama: no
        self._strip_decoded = self._prefix_space or code  # and always strips a decoded leading space
        self.fill_token = settings.fill_token
        bos = self._piece_id(self.special_tokens.get("bos_token"))
        self.bos_id = bos if bos is not None else (self._sp.bos_id() if self._sp.bos_id() >= 0 else None)
        eos = self._piece_id(self.special_tokens.get("eos_token"))
        eos = eos if eos is not None else (self._sp.eos_id() if self._sp.eos_id() >= 0 else None)
        add_bos = settings.add_bos if settings.add_bos is not None else not settings.has_config or code
        self.add_bos = add_bos and self.bos_id is not None
        self.add_eos = bool(settings.add_eos) and eos is not None
        self._eos_id = eos
        self.eos_ids = _with_own_eos(eos_ids, eos)
        # Special tokens are matched inside text (longest first) and encoded as their own id.
        specials = {}
        for token in (*self.special_tokens.values(), *settings.extra_special_tokens, *user_defined, *self._added_ids):
            if (i := self._piece_id(token)) is not None:
                specials[token] = i
        self._specials = specials
        # AddedToken lstrip / rstrip (added_tokens_decoder): the whitespace on that side goes with the token.
        self._strip = {t: o[:2] for t, o in settings.added_token_options if t in specials and any(o[:2])}
        self._split = re.compile("|".join(re.escape(t) for t in sorted(specials, key=len, reverse=True)) or "(?!)")
        # For decode, as transformers: the special tokens it skips (control pieces, <unk>, the named and
        # additional special tokens), and the byte-fallback pieces "<0xNN>" with their byte.
        named = (*self.special_tokens.values(), *settings.extra_special_tokens)
        self._skipped = frozenset(
            {i for i in range(self._num_pieces) if self._sp.is_control(i)}
            | {unk}
            | {i for token in named if (i := self._piece_id(token)) is not None}
        )
        byte_ids = ((self._sp.piece_to_id(f"<0x{b:02X}>"), b) for b in range(256))
        self.byte_values = {i: b for i, b in byte_ids if self._sp.is_byte(i)}
        self.byte_ids = frozenset(self.byte_values)
        self.skipped_ids = self._skipped

    def _piece_id(self, token: str | None) -> int | None:
        if not token:
            return None
        if token in self._added_ids:
            return self._added_ids[token]
        i = self._sp.piece_to_id(token)
        return None if i == self._sp.unk_id() and token != self._sp.id_to_piece(self._sp.unk_id()) else i

    def _encode_text(self, text: str, at_start: bool) -> list[int]:
        if not text:
            return []
        if not self._prefix_space or not (at_start or self._prefix_everywhere):
            return self._sp.encode(text, out_type=int)
        if self._prefix_always:
            return self._sp.encode(" " + text, out_type=int)
        return self._sp.encode(text if text.startswith((" ", "▁")) else " " + text, out_type=int)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        _refuse_fill_token(text, self.fill_token, "text")
        ids, pos = [], 0
        for m in self._split.finditer(text):
            if m.start() < pos:  # (inside whitespace an rstrip token took)
                continue
            lstrip, rstrip = self._strip.get(m.group(), (False, False))
            before = text[pos : m.start()]
            ids += self._encode_text(before.rstrip() if lstrip else before, pos == 0)
            ids.append(self._specials[m.group()])
            pos = m.end()
            while rstrip and pos < len(text) and text[pos].isspace():
                pos += 1
        ids += self._encode_text(text[pos:], pos == 0)
        if add_special_tokens:
            ids = [self.bos_id, *ids] if self.add_bos else ids
            ids = [*ids, self._eos_id] if self.add_eos else ids
        return ids

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        """The text of `ids` as transformers decodes it.

        Special tokens are dropped first (or with skip_special_tokens=False, each is its own text:
        "<s>", "<unk>"); a non-special added token is its text; other ids past the model's pieces (a
        config vocabulary padded beyond the tokenizer's) decode to nothing, as in the tokenizer.json
        path. A run of byte pieces is one UTF-8 string, or if invalid, one U+FFFD per byte
        (transformers' ByteFallback; SentencePiece's own decode would keep the valid bytes).
        """
        skipped = self._skipped if skip_special_tokens else frozenset()
        ids = [i for i in map(int, ids) if (0 <= i < self._num_pieces or i in self._added) and i not in skipped]
        parts = []
        for kind, run in itertools.groupby(ids, key=self._kind):
            if kind == "piece":
                parts.append(self._sp.decode(list(run)))
            elif kind == "added":  # through transformers' decoder too: "▁" is a space
                parts.extend(self._added[i].replace("▁", " ") for i in run)
            elif kind == "special":  # a control piece decodes to nothing in SentencePiece
                parts.extend(self._sp.id_to_piece(i) for i in run)
            else:
                data = bytes(self.byte_values[i] for i in run)
                try:
                    parts.append(data.decode("utf-8"))
                except UnicodeDecodeError:
                    parts.append("\ufffd" * len(data))
        text = "".join(parts)
        return text[1:] if self._strip_decoded and text.startswith(" ") else text

    def _kind(self, i: int) -> str:
        if i in self.byte_values:
            return "byte"
        return "added" if i in self._added else "special" if i in self._skipped else "piece"

    @functools.cached_property
    def max_token_bytes(self) -> int | None:
        """The longest piece's UTF-8 length with byte fallback; None without it, where a run of unknown
        characters of any length is one <unk> (the model's normaliser is off: see the class)."""
        if len(self.byte_values) < 256:
            return None
        pieces = (self._sp.id_to_piece(i) for i in range(self._num_pieces))
        return max((len(p.encode("utf-8")) for p in (*pieces, *self._specials)), default=1)


class ByteTokenizer(_ChatTemplating):
    """UTF-8 bytes offset by 3 (0 pad, 1 BOS, 2 EOS): for the embedded tiny random model (`embedded:tiny-random`)."""

    OFFSET = 3

    def __init__(self):
        self.vocab_size = 256 + self.OFFSET
        self.bos_id = 1
        self.eos_ids = (2,)
        self.special_tokens = {}
        self.chat_templates = {}
        self.chat_template = None
        self.max_token_bytes = 1
        self.byte_ids = frozenset()  # its ids are bytes, but decoded by Python's rules, not ByteFallback's
        self.byte_values = {}
        self.skipped_ids = frozenset(range(self.OFFSET))

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        ids = [b + self.OFFSET for b in text.encode("utf-8")]
        return [self.bos_id, *ids] if add_special_tokens else ids

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        """Its pad, BOS and EOS ids have no text: nothing, whether special tokens are skipped or not."""
        data = bytes(i - self.OFFSET for i in ids if self.OFFSET <= i < self.vocab_size)
        return data.decode("utf-8", errors="replace")


def load_tokenizer(model_dir: str, *, eos_ids: tuple[int, ...] = ()) -> Tokenizer | None:
    """Finds the tokenizer in a checkpoint directory: tokenizer.json first, then tokenizer.model.

    Returns None when there is neither: such a model still serves token-id prompts.
    """
    settings = read_settings(model_dir)
    tj = os.path.join(model_dir, "tokenizer.json")
    if os.path.isfile(tj):
        return HFTokenizer(tj, settings=settings, eos_ids=eos_ids)
    sp = os.path.join(model_dir, "tokenizer.model")
    if os.path.isfile(sp):
        if settings.tokenizer_class in ("GPT2Tokenizer", "Qwen2Tokenizer"):
            raise CheckpointError(
                f"{model_dir}: a SentencePiece tokenizer.model without a tokenizer.json, under "
                f"{settings.tokenizer_class} (the class transformers 5 builds here, from tokenizer_config.json's "
                "tokenizer_class and config.json's model_type), which would re-encode its vocabulary as a "
                "byte-level BPE; jaxinfer does not build that: add the checkpoint's tokenizer.json"
            )
        return SentencePieceTokenizer(sp, settings=settings, eos_ids=eos_ids)
    return None


# ----------------------------------------------------------------------------------------------
# Chat templates.


def validate_messages(messages, field: str = "messages") -> list[dict]:
    """Checks one conversation: a non-empty list of {"role": str, "content": str | list | dict} dicts
    (a dict: a tool's structured result, which e.g. Llama 3.1's template writes as JSON).

    Keys whose value is None are dropped (as transformers does: templates test for a key's presence).

    Raises:
        InvalidRequestError: naming the message and field at fault.
    """
    if isinstance(messages, (str, bytes, dict)) or not isinstance(messages, Sequence):
        raise InvalidRequestError(
            f"{field} must be a list of {{'role': ..., 'content': ...}} messages, got {type(messages).__name__}"
        )
    if not messages:
        raise InvalidRequestError(f"{field} is empty: a conversation needs at least one message")
    out = []
    for i, message in enumerate(messages):
        where = f"{field}[{i}]"
        if not isinstance(message, dict):
            raise InvalidRequestError(f"{where} must be a dict with 'role' and 'content', got {type(message).__name__}")
        message = {k: v for k, v in message.items() if v is not None}
        role = message.get("role")
        if role is None:
            raise InvalidRequestError(f"{where}.role is missing")
        if not isinstance(role, str) or not role:
            raise InvalidRequestError(f"{where}.role must be a non-empty string, got {role!r}")
        if "content" not in message and not message.get("tool_calls"):
            raise InvalidRequestError(f"{where}.content is missing")
        content = message.get("content")
        if content is not None and not isinstance(content, (str, list, dict)):
            raise InvalidRequestError(
                f"{where}.content must be a string, a list of parts or a dict (a tool's result), "
                f"got {type(content).__name__}"
            )
        _require_unicode_everywhere(message, where)
        out.append(message)
    return out


# How deep the lists and dicts of a message, tool or document may nest. Real ones nest a few levels
# (content parts, a JSON schema's properties); past this, and in one that contains itself, the walks
# below would end in Python's RecursionError.
MAX_CHAT_DATA_DEPTH = 64


def _check_depth(depth: int, top: str) -> None:
    """Refuses a list or dict `depth` levels inside what is walked; `top` names the field it is in
    (the path one level down, e.g. messages[0].content: the full path would repeat itself)."""
    if depth > MAX_CHAT_DATA_DEPTH:
        raise InvalidRequestError(
            f"{top} nests lists and dicts more than {MAX_CHAT_DATA_DEPTH} deep (does it contain itself?)"
        )


def _require_unicode_everywhere(value, where: str, depth: int = 0, top: str = "") -> None:
    """require_unicode on every string in a message (role, content, content parts, names, ...)."""
    top = where if depth <= 1 else top
    if isinstance(value, str):
        require_unicode(value, where)
    elif isinstance(value, dict):
        _check_depth(depth, top)
        for k, v in value.items():
            _require_unicode_everywhere(v, f"{where}.{k}", depth + 1, top)
    elif isinstance(value, (list, tuple)):
        _check_depth(depth, top)
        for i, v in enumerate(value):
            _require_unicode_everywhere(v, f"{where}[{i}]", depth + 1, top)


def _jinja_environment():
    """A sandboxed Jinja environment configured as transformers configures it for chat templates."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` marks assistant text for training masks: render as is."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body).set_lineno(lineno)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson escapes HTML characters; templates expect plain JSON.
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env


@functools.lru_cache(maxsize=32)  # a model's template compiles once; a caller's own, bounded in number
def _compile_chat_template(template: str):
    """A chat template's Jinja source compiled in jaxinfer's sandbox. Raises CheckpointError naming
    the line when it does not compile."""
    import jinja2

    try:
        return _jinja_environment().from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise CheckpointError(f"chat_template does not compile: {e} (line {e.lineno})") from None


@functools.lru_cache(maxsize=32)  # as _compile_chat_template: a caller's templates, bounded in number
def _iterates_content(template: str) -> bool:
    """Whether a chat template takes a message's content apart (written for OpenAI-style lists of
    parts, as vision-language templates are) rather than printing it as a string: it loops over the
    content, or picks parts out of it with filters (`content | selectattr('type', ...)`,
    `map(attribute='text')`). Variables set from the content (`{% set c = m.get('content') %}`)
    count as the content."""
    import jinja2
    from jinja2 import nodes

    def names(node) -> set[str]:
        found = set()
        for n in [node, *node.find_all((nodes.Getitem, nodes.Getattr, nodes.Name, nodes.Const))]:
            if isinstance(n, nodes.Getitem) and isinstance(n.arg, nodes.Const):
                found.add(str(n.arg.value))
            elif isinstance(n, nodes.Getattr):
                found.add(n.attr)
            elif isinstance(n, nodes.Name):
                found.add(n.name)
            elif isinstance(n, nodes.Const) and isinstance(n.value, str):  # m.get('content')
                found.add(n.value)
        return found

    try:
        tree = _jinja_environment().parse(template)
    except jinja2.TemplateSyntaxError:
        return False  # render_chat_template names the syntax error
    content = {"content"}
    assigns = [a for a in tree.find_all(nodes.Assign) if isinstance(a.target, nodes.Name)]
    while grown := {a.target.name for a in assigns if names(a.node) & content} - content:
        content |= grown
    if any(names(loop.iter) & content for loop in tree.find_all(nodes.For)):
        return True
    part_keys = {"type", "text"}
    for f in tree.find_all(nodes.Filter):
        if f.name in ("selectattr", "rejectattr", "map") and f.node is not None and names(f.node) & content:
            args = {a.value for a in f.args if isinstance(a, nodes.Const)}
            args |= {k.value.value for k in f.kwargs if isinstance(k.value, nodes.Const)}
            if args & part_keys:
                return True
    return False


def _text_content(message: dict, where: str) -> dict:
    """A message whose content is a list of parts, as a string-content template needs it: the text
    parts joined by newlines (as vLLM does for such templates). Other parts cannot be shown to a
    text-only template."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            raise InvalidRequestError(
                f"{where}.content[{j}] is of type {kind or type(part).__name__!r}, not a text part "
                "({'type': 'text', 'text': ...}); this model's chat template takes text only"
            )
        texts.append(part["text"])
    return {**message, "content": "\n".join(texts)}


# Template variables the renderer sets itself; chat_template_kwargs may not replace them.
_RESERVED_TEMPLATE_VARIABLES = ("messages", "add_generation_prompt", "tools", "documents")

# The names a message's reasoning goes by; a template reads one of them (Qwen 3 reasoning_content,
# gpt-oss thinking), so a message carrying any of them gets the first two as well, as in transformers.
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


def _with_reasoning_aliases(message: dict) -> dict:
    reasoning = next((message[k] for k in _REASONING_KEYS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def check_tools(tools) -> list[dict] | None:
    """The `tools` a chat template is given: each a JSON-schema dict, taken as it is, or a Python
    function, described by `tool_schema.function_schema`. None stays None (templates test for it)."""
    if tools is None:
        return None
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Iterable):
        raise InvalidRequestError(
            f"tools must be a list of tool schemas (dicts) or functions, got {type(tools).__name__}"
        )
    import inspect

    from jaxinfer.tool_schema import function_schema

    out = []
    for i, tool in enumerate(tools):
        if isinstance(tool, Mapping):
            tool = _json_data(tool, f"tools[{i}]")
        elif inspect.isfunction(tool) or inspect.ismethod(tool):
            try:
                tool = function_schema(tool)
            except InvalidRequestError as e:
                raise InvalidRequestError(f"tools[{i}]: {e}") from None
        else:
            raise InvalidRequestError(
                f"tools[{i}] must be a JSON-schema dict or a function with type hints and a docstring, "
                f"got {type(tool).__name__}"
            )
        _require_unicode_everywhere(tool, f"tools[{i}]")
        out.append(tool)
    return out


def check_documents(documents) -> list[dict] | None:
    """The `documents` a retrieval-augmented chat template is given: dicts, usually with "title"
    and "text" (what each template reads is its own business). None stays None."""
    if documents is None:
        return None
    if isinstance(documents, (str, bytes, Mapping)) or not isinstance(documents, Iterable):
        raise InvalidRequestError(
            f"documents must be a list of dicts (e.g. {{'title': ..., 'text': ...}}), got {type(documents).__name__}"
        )
    out = []
    for i, doc in enumerate(documents):
        if not isinstance(doc, Mapping):
            raise InvalidRequestError(
                f"documents[{i}] must be a dict (e.g. with 'title' and 'text'), got {type(doc).__name__}"
            )
        doc = _json_data(doc, f"documents[{i}]")
        _require_unicode_everywhere(doc, f"documents[{i}]")
        out.append(doc)
    return out


def _json_data(value, where: str, depth: int = 0, top: str = ""):
    """`value` as plain JSON data for a template (which writes it with `tojson` or prints it): the
    subclasses of str / int / float (enum members, ...) as their base values, as transformers hands
    them over; anything with no JSON form is refused by its path."""
    top = where if depth <= 1 else top
    if value is None or type(value) in (str, int, float, bool):
        return value
    if type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0:  # a NumPy scalar
        return _json_data(value.item(), where, depth, top)
    for base in (bool, str, int, float):
        if isinstance(value, base):
            return base(value) if base is not str else str.__str__(value)
    if isinstance(value, Mapping):
        _check_depth(depth, top)
        if bad := [k for k in value if not isinstance(k, str)]:
            raise InvalidRequestError(f"{where} has a key that is not a string: {bad[0]!r}")
        return {str.__str__(k): _json_data(v, f"{where}.{k}", depth + 1, top) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        _check_depth(depth, top)
        items = [_json_data(v, f"{where}[{j}]", depth + 1, top) for j, v in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)
    raise InvalidRequestError(
        f"{where} is a {type(value).__name__}, which has no JSON form (strings, numbers, booleans, None, lists, dicts)"
    )


def check_chat_options(
    template_kwargs, *, add_generation_prompt, continue_final_message, kwargs_name: str = "chat_template_kwargs"
) -> dict:
    """Validates the template variables (returned as a dict; `kwargs_name` names them in a refusal)
    and the two turn options."""
    for name, value in (
        ("add_generation_prompt", add_generation_prompt),
        ("continue_final_message", continue_final_message),
    ):
        if not isinstance(value, bool):
            raise InvalidRequestError(f"{name} must be True or False, got {value!r}")
    if add_generation_prompt and continue_final_message:
        raise InvalidRequestError(
            "continue_final_message=True continues the last message, add_generation_prompt=True opens a new one: "
            "pass add_generation_prompt=False with it"
        )
    if template_kwargs is None:
        return {}
    if not isinstance(template_kwargs, Mapping) or not all(isinstance(k, str) for k in template_kwargs):
        raise InvalidRequestError(
            f"{kwargs_name} must be a dict with string keys, got {type(template_kwargs).__name__}"
        )
    if taken := [k for k in _RESERVED_TEMPLATE_VARIABLES if k in template_kwargs]:
        raise InvalidRequestError(f"{kwargs_name} may not set {taken}: they are arguments of their own")
    return _json_data(template_kwargs, kwargs_name)


# Appended to the final message's text with continue_final_message; the rendering is cut where it
# lands, so whatever the template writes after the message (an end-of-turn token) goes. transformers'
# own tag, so the two cut in the same place.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _tag_final(message: dict) -> dict:
    """A copy of `message` with _CONTINUE_TAG after its text (its last text part's, for a list)."""
    content = message.get("content")
    if isinstance(content, str):
        return {**message, "content": content + _CONTINUE_TAG}
    if isinstance(content, list):
        for j in range(len(content) - 1, -1, -1):
            part = content[j]
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                parts = list(content)
                parts[j] = {**part, "text": part["text"] + _CONTINUE_TAG}
                return {**message, "content": parts}
    raise InvalidRequestError("continue_final_message: the final message has no text to continue")


def _cut_at_tag(rendered: str) -> str:
    """The rendered conversation cut right where the final message's text ended (see _CONTINUE_TAG);
    a template that trims the message also trimmed its trailing spaces, so they go here too."""
    at = rendered.rfind(_CONTINUE_TAG.strip())
    if at < 0:
        raise InvalidRequestError(
            "continue_final_message: the chat template does not reproduce the final message's text "
            "(it rewrites or drops part of it), so there is no place to continue from"
        )
    return rendered[:at] if rendered.startswith(_CONTINUE_TAG, at) else rendered[:at].rstrip()


def render_chat_template(
    template: str,
    messages: list[dict],
    *,
    add_generation_prompt: bool = True,
    special_tokens: dict[str, str] | None = None,
    template_kwargs: dict | None = None,
    continue_final_message: bool = False,
    field: str = "messages",
    tools: list[dict] | None = None,
    documents: list[dict] | None = None,
) -> str:
    """Renders one (validated) conversation into the prompt text the model was trained on.

    The template sees `messages`, `add_generation_prompt`, `tools` and `documents` (checked by
    `check_tools` / `check_documents`; None when not given), the named special tokens (`bos_token`,
    `eos_token`, ...) and `template_kwargs` (e.g. Qwen 3's `enable_thinking`), as with transformers'
    `apply_chat_template`. A message's reasoning is also under the names other templates read
    (`_with_reasoning_aliases`). `continue_final_message` leaves the last message open (see
    `_CONTINUE_TAG`). `field` names the conversation in errors.

    Raises:
        InvalidRequestError: the template refused the conversation (`raise_exception`), e.g. roles
            that do not alternate; the message is the template's own.
        CheckpointError: the template itself is broken.
    """
    import jinja2

    compiled = _compile_chat_template(template)
    if continue_final_message:
        messages = [*messages[:-1], _tag_final(messages[-1])]
    if not _iterates_content(template):
        messages = [_text_content(m, f"{field}[{i}]") for i, m in enumerate(messages)]
    messages = [_with_reasoning_aliases(m) for m in messages]
    try:
        rendered = compiled.render(
            **{**(special_tokens or {}), **(template_kwargs or {})},
            messages=messages,
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
        )
    except jinja2.exceptions.SecurityError as e:
        raise CheckpointError(f"chat_template tried an unsafe operation: {e}") from None
    except jinja2.exceptions.TemplateError as e:
        raise InvalidRequestError(f"{field}: the chat template refused them: {e}") from None
    except Exception as e:  # a template written for string content given a list of parts, ...
        raise InvalidRequestError(
            f"{field}: the chat template failed on them ({type(e).__name__}: {e}); "
            "check the content types the template expects"
        ) from None
    return _cut_at_tag(rendered) if continue_final_message else rendered


def render_chats(
    tok,
    messages,
    *,
    add_generation_prompt: bool,
    continue_final_message: bool = False,
    tools=None,
    documents=None,
    chat_template: str | None = None,
    chat_template_kwargs: Mapping | None = None,
    kwargs_name: str = "chat_template_kwargs",
) -> tuple[list[str], bool]:
    """The texts of one conversation (a list of message dicts) or of a list of them, rendered with
    `tok`'s chat template - or `chat_template`: Jinja source, or the name of one of the tokenizer's
    templates, as transformers' `apply_chat_template` takes it - and whether `messages` was a list
    of conversations. Every argument is checked and a refusal names it (`messages[i]` in a list).
    `LLM.chat` and the tokenizers' `apply_chat_template` render with it (`kwargs_name`: what the
    caller calls the template variables)."""
    template_kwargs = check_chat_options(
        chat_template_kwargs,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        kwargs_name=kwargs_name,
    )
    tools, documents = check_tools(tools), check_documents(documents)
    named = getattr(tok, "chat_templates", None) or {}
    if tok.chat_template != named.get("default"):  # set by hand: it alone counts, as in transformers
        named = {"default": tok.chat_template}
    named = {k: v for k, v in named.items() if v}
    if chat_template is not None:
        if not isinstance(chat_template, str) or not chat_template.strip():
            raise InvalidRequestError(
                "chat_template must be a non-empty string: Jinja source, or the name of one of the model's "
                f"templates {sorted(named)}; got {chat_template!r}"[:300]
            )
        template = named.get(chat_template, chat_template)
    else:
        template = choose_chat_template(named, tools=tools)
    if not template:
        raise InvalidRequestError(
            "this model has no chat_template (tokenizer_config.json 'chat_template' or chat_template.jinja): "
            "pass chat_template=, or format the prompt yourself"
        )
    batched = isinstance(messages, (list, tuple)) and bool(messages) and isinstance(messages[0], (list, tuple))
    texts = []
    for i, conv in enumerate(list(messages) if batched else [messages]):
        field = f"messages[{i}]" if batched else "messages"
        try:
            texts.append(
                render_chat_template(
                    template,
                    validate_messages(conv, field),
                    add_generation_prompt=add_generation_prompt,
                    special_tokens=tok.special_tokens,
                    template_kwargs=template_kwargs,
                    continue_final_message=continue_final_message,
                    field=field,
                    tools=tools,
                    documents=documents,
                )
            )
        except CheckpointError as e:  # a broken template: the caller's, if they passed it
            if chat_template is None:
                raise
            raise InvalidRequestError(str(e)) from None
    return texts, batched
