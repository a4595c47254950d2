"""`LLM`: the offline Python API (contract), in the shape vLLM users expect."""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence

import jax
import numpy as np

from jaxinfer import _interrupts, default_model
from jaxinfer.capacity import (
    cache_bytes_to_fit,
    check_max_model_len,
    default_max_model_len,
    default_window_kv_pages,
    free_device_bytes,
    layer_page_bytes,
    window_pool_pages,
)
from jaxinfer.config import ATTENTION_BACKENDS, DTYPES, KV_CACHE_DTYPES
from jaxinfer.engine import Engine, Request
from jaxinfer.errors import CheckpointError, InvalidRequestError
from jaxinfer.kv_cache import pages_needed
from jaxinfer.limits import check_cache_salt, check_capacity
from jaxinfer.outputs import CompletionOutput, Logprob, RequestOutput, StreamDelta  # noqa: F401 - Logprob: its old home
from jaxinfer.sampling_params import GENERATION_CONFIG_CHOICES, SamplingParams, generation_defaults, is_int
from jaxinfer.sharding import format_mesh, make_mesh, parse_mesh
from jaxinfer.tokenizer import encode_prompt, load_tokenizer, render_chats, require_unicode


def _token_ids(p, field: str) -> list[int]:
    if (
        isinstance(p, (str, bytes))
        or not isinstance(p, Sequence | np.ndarray)
        or (isinstance(p, np.ndarray) and p.ndim != 1)
    ):
        raise InvalidRequestError(f"{field} must be a list of integers, got {type(p).__name__}")
    for i, t in enumerate(p):
        if not is_int(t):
            got = f"{t!r:.40} ({type(t).__name__})"
            raise InvalidRequestError(f"{field} must be a list of integers, but [{i}] is {got}")
    return [int(t) for t in p]


def _default_num_pages(cfg, *, max_num_seqs, max_model_len, page_size, window_pages, mesh=None) -> int:
    """Enough pages for every slot at full length, capped at a quarter of free memory. A hybrid
    model's sliding-window layers take `window_pages` pages of their own where the count comes out
    larger than that (`window_pool_pages`): the other layers share what they leave. On a mesh the
    quarter is of what must fit (`cache_bytes_to_fit`: one device's share, or on CPU all of them)."""
    want = max_num_seqs * pages_needed(max_model_len, page_size) + 1
    layer_page = layer_page_bytes(cfg, page_size)
    budget = int(free_device_bytes() * 0.25)
    if mesh is not None:  # in bytes of the unsharded cache, which the counts below are sized in
        fit = functools.partial(cache_bytes_to_fit, cfg, num_kv_pages=2, num_window_pages=None, page_size=page_size)
        budget = int(budget * fit()[0] / fit(mesh=mesh)[0])
    if window_pages is not None:
        windowed = sum(cfg.in_window_pool(i) for i in range(cfg.num_layers))
        split = (budget - windowed * window_pages * layer_page) // ((cfg.num_layers - windowed) * layer_page)
        n = min(want, split)
        if window_pool_pages(cfg, num_kv_pages=n, num_window_kv_pages=window_pages) is not None:
            return n
    # One pool size for every layer (with the window pools no smaller, the engine does not split).
    return max(2, min(want, budget // (cfg.num_layers * layer_page)))


def _model_path(model) -> str | None:
    """The directory `model` names: None for an embedded model made in memory (e.g. the tiny random
    one), the embedded default model's assets for None."""
    if isinstance(model, str) and model in default_model.EMBEDDED:
        return None
    return default_model.ASSETS if model is None else os.fspath(model)


def _auto_dtype(model) -> str:
    """dtype="auto": what the checkpoint stores (a Hugging Face one: `loading.auto_dtype`; a jaxinfer
    one: its stored dtype, the embedded default model's bfloat16); float32 for the generated embedded
    models."""
    from jaxinfer import checkpoint, loading

    path = _model_path(model)
    if path is None:
        return "float32"
    try:
        if checkpoint.is_checkpoint(path):
            return checkpoint.load_config(path).dtype
    except (OSError, ValueError, RecursionError, CheckpointError):
        return "float32"  # restoring names what is wrong with the checkpoint
    return loading.auto_dtype(path)


def _generation_overrides(model, generation_config: str) -> dict:
    """The checkpoint's generation_config.json defaults (see `generation_defaults`) as SamplingParams
    fields; says on stderr when there are any, as vLLM does."""
    path = _model_path(model)
    if generation_config == "none" or path is None:
        return {}
    defaults = generation_defaults(path)
    if defaults:
        shown = ", ".join(f"{k}={v!r}" for k, v in defaults.items())
        print(
            f"jaxinfer: default sampling parameters from {os.path.join(path, 'generation_config.json')}: {shown} "
            '(LLM(..., generation_config="none") or --generation-config none to ignore them)',
            file=sys.stderr,
        )
    return defaults


_announced_default = False  # the embedded default model's line is printed once per process


def _load(model, dtype: str, mesh):
    """(cfg, params, tokenizer) of `model`: None (the embedded default), an embedded name, a jaxinfer
    (orbax) checkpoint directory or a Hugging Face one. On a mesh, parameters are read straight onto
    their shardings (each process reads only what its devices hold), never staged on one device."""
    from jaxinfer import checkpoint
    from jaxinfer.loading import load_hf_checkpoint
    from jaxinfer.sharding import param_shardings

    def shardings(cfg):
        return None if mesh is None else param_shardings(cfg, mesh)

    path = _model_path(model)
    if path is None:
        return default_model.EMBEDDED[model](dtype=dtype)  # made in memory; the engine places it
    if model is None or checkpoint.is_checkpoint(path):  # jaxinfer's orbax format (`jaxinfer convert`)
        cfg, params = checkpoint.restore(path, dtype=dtype, shardings=shardings)
    else:
        cfg, params = load_hf_checkpoint(path, dtype=dtype, shardings=shardings)
    tokenizer = load_tokenizer(path, eos_ids=cfg.eos_token_ids)
    if tokenizer is not None and tokenizer.eos_ids != cfg.eos_token_ids:  # the tokenizer's own EOS stops too
        cfg = dataclasses.replace(cfg, eos_token_ids=tuple(tokenizer.eos_ids))
    cfg = _drop_unreachable_eos(cfg, path)
    global _announced_default
    if model is None and not _announced_default:  # once: `bench mesh` loads it once per mesh
        _announced_default = True
        print(
            f"jaxinfer: using the embedded default model {cfg.name!r} ({cfg.num_params / 1e6:.1f}M "
            "parameters trained on the King James Bible: it writes KJV-style English, nothing more)",
            file=sys.stderr,
        )
    return cfg, params, tokenizer


def _lay_out_weights(cfg, params, mesh):
    """(cfg, params) with the projections' float32 weights in the CPU kernel's column strips where
    that kernel runs them (jaxinfer.matmul): a float32 model on the CPU, on one device in one
    process, the native library built with the strips in AVX-512. `JAXINFER_F32_STRIPS=1` takes
    them in AVX2 too (the same bits; on an AVX-512 CPU built without it, the AVX2 tiles were 1.02-1.12x
    XLA's dot at 1-8 rows but 0.66-0.71x at 48-256: not measured on a CPU that has only AVX2), `=0`
    keeps the declared layout and XLA's products."""
    from jaxinfer import native

    wanted = os.environ.get("JAXINFER_F32_STRIPS", "auto")
    if (
        cfg.weight_strips
        or cfg.dtype != "float32"
        or jax.default_backend() != "cpu"
        or mesh is not None
        or jax.process_count() > 1
        or wanted == "0"
        or not (cols := native.f32_strip_cols())
        or (native.f32_strips_isa() != "avx512" and wanted != "1")
    ):
        return cfg, params
    from jaxinfer.model import has_weight_strips, to_weight_strips

    if not has_weight_strips(params, cols):  # (a small model: its products stay XLA's)
        return cfg, params
    return dataclasses.replace(cfg, weight_strips=cols), to_weight_strips(params, cols)


def _drop_unreachable_eos(cfg, path: str):
    """An end-of-sequence id at or past the vocabulary can never be sampled, so it can never end a
    request: drop it, and say so, rather than let the user wait for a stop that cannot come."""
    outside = [t for t in cfg.eos_token_ids if t >= cfg.vocab_size]
    if not outside:
        return cfg
    kept = tuple(t for t in cfg.eos_token_ids if t < cfg.vocab_size)
    print(
        f"jaxinfer: {path}: eos_token_id {', '.join(map(str, outside))} is outside the vocabulary "
        f"(vocab_size {cfg.vocab_size}) and can never be generated; ignoring it"
        + ("" if kept else " (no end-of-sequence token left: requests end at max_tokens or a stop)"),
        file=sys.stderr,
    )
    return dataclasses.replace(cfg, eos_token_ids=kept)


def _leader_channel():
    """Multi-host leader: the channel its engine broadcasts each step on (followers get None)."""
    if jax.process_count() == 1:
        return None
    from jaxinfer.distributed import StepChannel, is_leader

    return StepChannel() if is_leader() else None


class LLM:
    """Loads a model and generates from it.

    Args:
        model: a local Hugging Face checkpoint directory, or one `jaxinfer convert` wrote (orbax);
            None for the embedded default model; "embedded:tiny-random" for a tiny random-weight one.
        dtype: "float32" or "bfloat16", for parameters, activations and the KV cache; "auto": the
            checkpoint's own (bfloat16 for a bfloat16 or float16 checkpoint, else float32).
        max_model_len: longest sequence (prompt + output); defaults to the model's maximum.
        page_size: tokens per KV-cache page.
        num_kv_pages: pages in the cache; defaults to what max_num_seqs full-length sequences need,
            capped at a quarter of free memory.
        max_num_seqs: sequences running together at most.
        max_num_batched_tokens: tokens computed per step (decode rows + prompt chunks).
        enable_prefix_caching: share the KV pages of common prompt prefixes between requests.
        attention_backend: "auto" (the Pallas kernel on TPU and on GPUs from compute capability 8.0
            on, "native" on CPU, or "xla" where it cannot be built; on GPU the reference before
            Ampere and where the kernel cannot tile the shape: page size or head_dim not a power of
            two), "reference" (plain pure JAX: the oracle), "xla" (pure JAX in cache-sized tiles that
            stop at each row group's length), "native" (the C++ CPU kernel of jaxinfer.native, built
            with the machine's compiler on first use: the fast one on CPU), or "pallas" (the kernel;
            on CPU in interpret mode: slow, for checking).
        kv_cache_dtype: "auto" (the model dtype) or "int8" (int8 K/V with one float32 scale per token
            and KV head: (H + 4) / (2H) of bfloat16's bytes, so about twice the tokens fit).
        mesh: shard over devices: "data=2,model=4" (or {"data": 2, "model": 4}) uses the first 8
            devices (a multi-process mesh must use all of them). Tensor parallelism over `model`
            (heads, MLP, vocabulary; KV heads replicated when they do not split evenly), batch rows
            over `data`. None: one device. See jaxinfer.sharding for the rules table.
        tensor_parallel_size: vLLM's name for `mesh={"model": n}` (1: one device); give one or
            the other.
        generation_config: "auto": the checkpoint's generation_config.json sets the default
            SamplingParams (temperature, top_k, top_p, min_p, repetition_penalty, max_new_tokens as
            max_tokens; see `get_default_sampling_params`), as in vLLM; "none": SamplingParams' own.
        warmup: compile every step shape now, so no request ever waits for a compilation.
        async_scheduling: dispatch each engine step before reading the results of the one before,
            so the host's bookkeeping overlaps the device's work (same outputs; see
            `Engine._run_ahead`). False: one step at a time.
        seed: where requests without their own `SamplingParams.seed` get theirs, as vLLM's
            LLM(seed=): with an integer, a script's unseeded requests draw the same seeds in the
            order they are submitted, so a rerun samples the same tokens; None: fresh entropy.

    One LLM may be used from several threads (a web app's workers, a notebook's): their requests
    join the same continuous batches, each call returning only its own outputs.
    """

    def __init__(
        self,
        model: str | os.PathLike | None = None,
        *,
        dtype: str = "float32",
        max_model_len: int | None = None,
        page_size: int = 16,
        num_kv_pages: int | None = None,
        max_num_seqs: int = 32,
        max_num_batched_tokens: int = 512,
        enable_prefix_caching: bool = True,
        attention_backend: str = "auto",
        kv_cache_dtype: str = "auto",
        mesh: str | dict | None = None,
        tensor_parallel_size: int | None = None,
        generation_config: str = "auto",
        warmup: bool = False,
        async_scheduling: bool = True,
        seed: int | None = None,
    ):
        if model is not None and not isinstance(model, (str, os.PathLike)):
            raise InvalidRequestError(f"model must be a directory path or an embedded model's name, got {model!r}")
        if mesh is not None and not isinstance(mesh, (str, Mapping)):
            raise InvalidRequestError(f"mesh must be a string like 'data=2,model=4' or a mapping, got {mesh!r}")
        if tensor_parallel_size is not None:
            if not is_int(tensor_parallel_size) or tensor_parallel_size < 1:
                raise InvalidRequestError(
                    f"tensor_parallel_size must be None or an integer >= 1, got {tensor_parallel_size!r}"
                )
            if mesh is not None:
                raise InvalidRequestError(
                    f"give mesh or tensor_parallel_size, not both (mesh={mesh!r}, "
                    f"tensor_parallel_size={tensor_parallel_size!r}): tensor_parallel_size=n is mesh='model=n'"
                )
            mesh = None if tensor_parallel_size == 1 else {"model": int(tensor_parallel_size)}
        if not isinstance(enable_prefix_caching, bool) or not isinstance(warmup, bool):
            raise InvalidRequestError(
                f"enable_prefix_caching and warmup must be True or False, got {enable_prefix_caching!r}, {warmup!r}"
            )
        if not isinstance(async_scheduling, bool):
            raise InvalidRequestError(f"async_scheduling must be True or False, got {async_scheduling!r}")
        if seed is not None and (not is_int(seed) or seed < 0):  # NumPy integers too, as elsewhere
            raise InvalidRequestError(f"seed must be None or an integer >= 0, got {seed!r}")
        seed = None if seed is None else int(seed)
        if dtype == "auto" and isinstance(model, (str, os.PathLike, type(None))):
            dtype = _auto_dtype(model)
        if dtype not in DTYPES:
            raise InvalidRequestError(f"dtype must be one of {(*DTYPES, 'auto')}, got {dtype!r}")
        if attention_backend not in ATTENTION_BACKENDS:
            raise InvalidRequestError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, got {attention_backend!r}"
            )
        if attention_backend == "native":
            from jaxinfer import native

            if jax.default_backend() != "cpu":
                raise InvalidRequestError(
                    f'attention_backend="native" is the CPU kernel; this platform is {jax.default_backend()}'
                )
            if not native.available():
                raise InvalidRequestError(f'attention_backend="native" cannot run here: {native.why_unavailable()}')
        if generation_config not in GENERATION_CONFIG_CHOICES:
            raise InvalidRequestError(
                f"generation_config must be one of {GENERATION_CONFIG_CHOICES}, got {generation_config!r}"
            )
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise InvalidRequestError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
        # NumPy integers act as Python ones, as in SamplingParams.
        page_size, max_num_seqs, num_kv_pages, max_num_batched_tokens, max_model_len = (
            int(v) if is_int(v) else v
            for v in (page_size, max_num_seqs, num_kv_pages, max_num_batched_tokens, max_model_len)
        )
        # Validated before anything loads.
        check_capacity(
            page_size=page_size,
            max_num_seqs=max_num_seqs,
            num_kv_pages=num_kv_pages,
            max_num_batched_tokens=max_num_batched_tokens,
        )
        if max_model_len is not None and (not is_int(max_model_len) or max_model_len < 2):
            # The upper limit is the model's (checked once its config is read); the type is not.
            raise InvalidRequestError(f"max_model_len must be None or an integer >= 2, got {max_model_len!r}")
        if tensor_parallel_size is not None:  # (the device count starts JAX: after the cheap checks)
            try:  # a refusal names what the caller gave, not the mesh it stands for
                parse_mesh(mesh)
            except InvalidRequestError as e:
                raise InvalidRequestError(f"tensor_parallel_size={tensor_parallel_size!r}: {e}") from None
        multi_process = jax.process_count() > 1
        if multi_process:  # before loading: a different model or mesh would fail there, unnamed
            from jaxinfer import distributed

            distributed.check_same_job(
                {
                    "model (files)": distributed.model_fingerprint(model),
                    "dtype": dtype,
                    # As parsed: "model=4,data=2" and "data=2,model=4" are one mesh.
                    "mesh": None if mesh is None else format_mesh(parse_mesh(mesh)),
                    "max_model_len": max_model_len,
                    "page_size": page_size,
                    "num_kv_pages": num_kv_pages,
                    "max_num_seqs": max_num_seqs,
                    "max_num_batched_tokens": max_num_batched_tokens,
                    "enable_prefix_caching": enable_prefix_caching,
                    "attention_backend": attention_backend,
                    "kv_cache_dtype": kv_cache_dtype,
                    "processes": jax.process_count(),
                }
            )
        device_mesh = None if mesh is None else make_mesh(mesh)
        cfg, params, tokenizer = _load(model, dtype, device_mesh)
        cfg = dataclasses.replace(cfg, attention_backend=attention_backend, kv_cache_dtype=kv_cache_dtype)
        cfg, params = _lay_out_weights(cfg, params, device_mesh)
        if max_model_len is None:
            max_model_len = default_max_model_len(cfg)
        check_max_model_len(cfg, max_model_len)  # before it sizes the default page count
        window_pages = default_window_kv_pages(
            cfg,
            max_model_len=max_model_len,
            page_size=page_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
        )
        if num_kv_pages is None:
            num_kv_pages = _default_num_pages(
                cfg,
                max_num_seqs=max_num_seqs,
                max_model_len=max_model_len,
                page_size=page_size,
                window_pages=window_pages,
                mesh=device_mesh,
            )
            if multi_process:  # each process measured its own free memory: all take the leader's count
                num_kv_pages = distributed.leader_value(num_kv_pages)
        self.cfg = cfg
        self.tokenizer = tokenizer
        # The fields the checkpoint's generation_config.json sets (`jaxinfer generate` merges them too).
        self._generation_overrides = _generation_overrides(model, generation_config)
        self._default_params = SamplingParams(**self._generation_overrides)
        self.engine = Engine(
            cfg,
            params,
            max_model_len=max_model_len,
            page_size=page_size,
            num_kv_pages=num_kv_pages,
            num_window_kv_pages=window_pages,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_prefix_caching=enable_prefix_caching,
            tokenizer=tokenizer,
            mesh=device_mesh,
            channel=_leader_channel(),
            async_scheduling=async_scheduling,
            seed=seed,
        )
        # Updates of the requests this LLM started, by request id. Whichever call steps the engine
        # (a generate(), or any of several open streams) files every request's updates here, so
        # interleaved streams, or a generate() while a stream is open, lose nothing.
        self._updates: dict[str, list] = {}
        # The engine is not thread-safe (each step donates the cache the next one reads): whichever
        # thread steps it, adds or ends a request holds this lock.
        self._lock = threading.RLock()
        # Requests whose end came while this thread was inside a step: a stream abandoned in a
        # reference cycle is closed by the garbage collector wherever it runs, which can be in the
        # middle of `engine.step()` (the RLock lets it in), where aborting would corrupt the step.
        self._stepping = False
        self._deferred_ends: list[Request] = []
        if warmup:
            self.engine.warmup()

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def params(self):
        """The parameters in the model's own layout (`self.cfg`). The engine holds the only copy on
        the devices; over a mesh whose model axis copies the KV heads, the K/V weights here are taken
        out of its widened ones when asked for (an LLM holding the unwidened set too kept every
        weight twice)."""
        return self.engine.model_params()

    def get_tokenizer(self):
        """The model's tokenizer (`llm.tokenizer`; None for a checkpoint without one), as in vLLM."""
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate`, `chat` and `stream` use when given no SamplingParams (and what the server
        starts from for fields a request leaves unset): the checkpoint's generation_config.json
        recommendations over SamplingParams' defaults, unless the LLM was made with
        generation_config="none"."""
        return self._default_params

    @property
    def generation_overrides(self) -> dict:
        """Just the SamplingParams fields the checkpoint's generation_config.json sets (empty with
        generation_config="none"): what `get_default_sampling_params` takes over SamplingParams' own
        defaults, and what the server's ModelInfo.default_sampling_params holds."""
        return dict(self._generation_overrides)

    def _encode(self, text: str, field: str, params: SamplingParams) -> list[int]:
        if not isinstance(text, str):
            raise InvalidRequestError(f"{field} must be a string, got {type(text).__name__}")
        if not text:
            raise InvalidRequestError(f"{field} is empty")
        require_unicode(text, field)
        if self.tokenizer is None:
            raise InvalidRequestError(
                "this model directory has no tokenizer (neither tokenizer.json nor tokenizer.model): pass token ids "
                "instead (prompt_token_ids=, or --prompt-ids)"
            )
        return encode_prompt(
            self.tokenizer,
            text,
            max_tokens=self.engine.prompt_token_limit(params),
            field=field,
            truncate_prompt_tokens=params.truncate_prompt_tokens,
        )

    def _prompt_item(self, p, name: str, params: SamplingParams) -> tuple[str | None, list[int], str | None]:
        """(text, ids, cache salt) of the prompt a refusal calls `name`: a string, or a vLLM-style prompt
        dict ({"prompt": text} or {"prompt_token_ids": [...]}, and optionally "cache_salt")."""
        if not isinstance(p, Mapping):
            return p, self._encode(p, name, params), None
        keys = set(p) - {"cache_salt"}
        if unknown := sorted(map(str, keys - {"prompt", "prompt_token_ids"})):
            raise InvalidRequestError(
                f"{name}: unsupported prompt field(s) {unknown}; a prompt dict holds 'prompt' (text) "
                "or 'prompt_token_ids', and optionally 'cache_salt'"
            )
        if len(keys) != 1:
            raise InvalidRequestError(f"{name} must hold exactly one of 'prompt' or 'prompt_token_ids'")
        salt = p.get("cache_salt")
        check_cache_salt(salt, f"{name}.cache_salt")
        if "prompt" in p:
            return p["prompt"], self._encode(p["prompt"], f"{name}.prompt", params), salt
        return None, _token_ids(p["prompt_token_ids"], f"{name}.prompt_token_ids"), salt

    def _prompts(self, prompts, sampling_params, prompt_token_ids, *, name_of=None):
        """Normalises and validates inputs; returns (texts, ids, params, cache salts). Raises before any
        work starts.

        `name_of(i)`: what a refusal calls prompt i (default prompts[i] or prompt_token_ids[i]; chat: the
        caller's messages[i], not ids made of them; stream: its one prompt or prompt_token_ids)."""
        if (prompts is None) == (prompt_token_ids is None):
            raise InvalidRequestError("pass exactly one of prompts or prompt_token_ids")
        if isinstance(prompts, (str, Mapping)):
            prompts = [prompts]
        if prompts is not None and (isinstance(prompts, bytes) or not isinstance(prompts, Sequence)):
            raise InvalidRequestError(
                f"prompts must be a string, a prompt dict or a list of them, got {type(prompts).__name__}"
            )
        if prompts is not None:
            sampling_params = self._params_list(sampling_params, len(prompts))
            name_of = name_of or (lambda i: f"prompts[{i}]")
            items = [self._prompt_item(p, name_of(i), sp) for i, (p, sp) in enumerate(zip(prompts, sampling_params))]
            texts, ids, salts = map(list, zip(*items)) if items else ([], [], [])
        else:
            if (
                isinstance(prompt_token_ids, (str, bytes))
                or not isinstance(prompt_token_ids, Sequence | np.ndarray)
                or (isinstance(prompt_token_ids, np.ndarray) and prompt_token_ids.ndim == 0)
            ):
                raise InvalidRequestError("prompt_token_ids must be a list of token-id lists (or one list of ids)")
            if len(prompt_token_ids) and all(is_int(t) for t in prompt_token_ids):
                prompt_token_ids = [prompt_token_ids]  # one prompt, as a flat list of ids
            texts = salts = [None] * len(prompt_token_ids)
            name_of = name_of or (lambda i: f"prompt_token_ids[{i}]")
            ids = [_token_ids(p, name_of(i)) for i, p in enumerate(prompt_token_ids)]
            sampling_params = self._params_list(sampling_params, len(ids))
        for i, (p, sp) in enumerate(zip(ids, sampling_params)):
            try:
                self.engine.validate(p, sp)
            except InvalidRequestError as e:
                raise InvalidRequestError(f"{name_of(i)}: {e}") from None
        return texts, ids, sampling_params, salts

    def _params_list(self, sampling_params, count: int) -> list[SamplingParams]:
        """One SamplingParams per prompt (None: the model's defaults; one: for every prompt)."""
        if sampling_params is None:
            sampling_params = self._default_params
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * count
        if isinstance(sampling_params, (str, bytes)) or not isinstance(sampling_params, Sequence):
            raise InvalidRequestError(
                f"sampling_params must be a SamplingParams or a list of them, got {type(sampling_params).__name__}"
            )
        sampling_params = list(sampling_params)
        if len(sampling_params) != count:
            raise InvalidRequestError(
                f"got {len(sampling_params)} sampling_params for {count} prompts (pass one, or one per prompt)"
            )
        for i, sp in enumerate(sampling_params):
            if not isinstance(sp, SamplingParams):
                raise InvalidRequestError(f"sampling_params[{i}] must be a SamplingParams")
        return sampling_params

    def generate(
        self,
        prompts: str | Mapping | Sequence[str | Mapping] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generates for every prompt (text or token ids); returns outputs in prompt order.

        A prompt is a string or, as in vLLM, a dict: {"prompt": text} or {"prompt_token_ids": ids};
        one list may mix them. A dict may add "cache_salt" (a string, as in vLLM): its prompt shares
        prefix-cache pages only with prompts of the same salt. Without sampling_params,
        `get_default_sampling_params()` applies. `use_tqdm=True` shows a progress bar over the
        finished prompts (needs the tqdm package).

        All prompts run through the continuous-batching engine together. Every prompt is validated
        before any work starts, so a bad one loses nothing.
        """
        return self._generate(*self._prompts(prompts, sampling_params, prompt_token_ids), use_tqdm=use_tqdm)

    def _generate(self, texts, ids, params, salts, *, use_tqdm: bool = False) -> list[RequestOutput]:
        if not isinstance(use_tqdm, bool):  # "no" would have shown a bar
            raise InvalidRequestError(f"use_tqdm must be True or False, got {use_tqdm!r}")
        bar = _progress_bar(len(ids)) if use_tqdm else None
        requests = []
        try:
            for p, sp, salt in zip(ids, params, salts):
                self._start(p, sp, salt, requests)
            done = 0
            while not self._all_finished(requests):
                self._step()
                if bar is not None:
                    now = sum(r.finished for r in requests)
                    bar.update(now - done)
                    done = now
            texts_so_far = {s.seq_id: [] for r in requests for s in r.seqs}
            for r in requests:
                for u in self._updates[r.request_id]:
                    texts_so_far[u.seq.seq_id].append(u.text)
            return [
                self._output(r, t, {k: "".join(v) for k, v in texts_so_far.items()}) for r, t in zip(requests, texts)
            ]
        finally:  # also on Ctrl-C or an error mid-way: leave nothing running for the next call
            self._end(*requests)
            if bar is not None:
                bar.close()

    def chat(
        self,
        messages: Sequence[dict] | Sequence[Sequence[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool | None = None,
        continue_final_message: bool = False,
        tools: Sequence[Mapping | Callable] | None = None,
        documents: Sequence[Mapping] | None = None,
        chat_template: str | None = None,
        chat_template_kwargs: Mapping | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generates the next turn of a conversation, rendered with the model's chat template.

        Args:
            messages: one conversation, a list of {"role": ..., "content": ...} dicts, or a list of
                conversations.
            sampling_params: one for all conversations, or one per conversation.
            add_generation_prompt: end the prompt with the template's opening of an assistant turn;
                by default True, unless continue_final_message (the two cannot be combined).
            continue_final_message: leave the last message open (cut after its text, before whatever
                ends a turn) so the model goes on writing it, e.g. a prefilled assistant answer.
            tools: the functions the model may call, for templates that support tool use: JSON-schema
                dicts ({"type": "function", "function": {"name", "description", "parameters"}}) or
                Python functions with type hints and a Google-style docstring, described as
                transformers describes them (`jaxinfer.tool_schema`). Tool calls and results go in
                `messages` (an assistant message's "tool_calls", a "tool" role message). The model's
                reply is returned as text: parsing a tool call out of it is the caller's.
            documents: for retrieval-augmented templates, dicts such as {"title": ..., "text": ...}.
            chat_template: the template to render with instead of the model's: Jinja source, or the
                name of one of the model's named templates (as transformers' `apply_chat_template`
                and vLLM's `LLM.chat` take it). For a model without one, or another format.
            chat_template_kwargs: further variables for the template, e.g. {"enable_thinking": False}
                for Qwen 3.
            use_tqdm: a progress bar over the finished conversations, as in `generate`.

        Returns:
            One RequestOutput per conversation, as `generate` returns; `prompt` is the rendered text.
            The rendered text is tokenized without adding BOS/EOS: the template writes its own.
        """
        tok = self.tokenizer
        if tok is None:
            raise InvalidRequestError(
                "this model directory has no tokenizer (neither tokenizer.json nor tokenizer.model), "
                "so it cannot render a chat"
            )
        if add_generation_prompt is None:
            add_generation_prompt = continue_final_message is not True
        texts, batched = render_chats(
            tok,
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=tools,
            documents=documents,
            chat_template=chat_template,
            chat_template_kwargs=chat_template_kwargs,
        )
        params = self._params_list(sampling_params, len(texts))
        ids = []
        for i, text in enumerate(texts):
            field = f"messages[{i}]" if batched else "messages"
            max_tokens = self.engine.prompt_token_limit(params[i])
            truncate = params[i].truncate_prompt_tokens
            ids.append(
                encode_prompt(
                    tok,
                    text,
                    max_tokens=max_tokens,
                    field=field,
                    add_special_tokens=False,
                    truncate_prompt_tokens=truncate,
                )
            )
        name_of = (lambda i: f"messages[{i}]") if batched else (lambda i: "messages")
        outs = self._generate(*self._prompts(None, params, ids, name_of=name_of), use_tqdm=use_tqdm)
        for out, text in zip(outs, texts):
            out.prompt = text
        return outs

    def stream(
        self,
        prompt: str | Mapping | None = None,
        sampling_params: SamplingParams | None = None,
        *,
        prompt_token_ids: Sequence[int] | None = None,
    ) -> Iterator[StreamDelta]:
        """Yields the tokens and text of one request as they are made.

        Text deltas come from incremental detokenization: never a broken UTF-8 character, never a
        lost leading space, never any part of a stop string. Closing the generator early aborts the
        request and frees its pages. Bad input is refused by this call; the request starts at the
        first `next()`.
        """
        if isinstance(prompt, (list, tuple)):  # else the wrapping below blames "prompts[0]", a string
            raise InvalidRequestError(
                f"stream takes one prompt (a string or a prompt dict), got a {type(prompt).__name__}; "
                "generate takes several"
            )
        if (prompt is None) == (prompt_token_ids is None):
            raise InvalidRequestError("pass exactly one of prompt or prompt_token_ids")
        if isinstance(sampling_params, (list, tuple)):  # one per prompt is generate's form
            raise InvalidRequestError(
                f"stream takes one SamplingParams (or None), got a {type(sampling_params).__name__}"
            )
        name = "prompt" if prompt is not None else "prompt_token_ids"  # its one prompt, named as passed
        texts, ids, params, salts = self._prompts(
            None if prompt is None else [prompt],
            sampling_params,
            None if prompt_token_ids is None else [prompt_token_ids],
            name_of=lambda i: name,
        )
        return self._stream(ids[0], params[0], salts[0])

    def _stream(self, prompt_ids: list[int], params: SamplingParams, salt: str | None) -> Iterator[StreamDelta]:
        started = []
        try:
            req = self._start(prompt_ids, params, salt, started)
            mine = self._updates[req.request_id]
            ended = set()  # samples whose finish_reason has been yielded
            while True:
                while mine:
                    u = mine.pop(0)
                    if u.token_ids or u.text or u.finish_reason:
                        if u.finish_reason:
                            ended.add(u.seq.index)
                        yield StreamDelta.of(u)
                with self._lock:  # a request another thread's step ended has its updates filed by now
                    if mine:
                        continue
                    finished = req.finished
                if finished:
                    # Ended without an update filed here: aborted through llm.engine.abort() directly.
                    for s in req.seqs:
                        if s.index not in ended:
                            yield StreamDelta(token_ids=[], text="", finish_reason=s.finish_reason, index=s.index)
                    return
                self._step()
        finally:
            # A stream still open at interpreter exit: nothing to free, and modules its abort would
            # touch (prometheus_client) are half torn down (a TypeError traceback at exit).
            if not sys.is_finalizing():
                self._end(*started)

    def _start(self, prompt_ids: list[int], params: SamplingParams, salt: str | None, into: list) -> Request:
        """Adds a request, appended to `into` before a Ctrl-C held back meanwhile is delivered: the
        caller's cleanup then always knows every request the engine has."""
        with self._lock, _interrupts.deferred():
            req = self.engine.add_request(prompt_ids, params, cache_salt=salt)
            self._updates[req.request_id] = []
            into.append(req)
            return req

    def _all_finished(self, requests: list[Request]) -> bool:
        """Under the lock: a step marks requests finished before it has filed their last updates."""
        with self._lock:
            return all(r.finished for r in requests)

    def _step(self) -> None:
        """One engine step; each update is filed under its request, whichever call (or thread)
        asked for the step."""
        # Ctrl-C is held back over the bookkeeping and lets through only while the engine compiles or
        # waits for the device; waiting for the lock stays interruptible.
        with self._lock, _interrupts.deferred():
            self._stepping = True
            updates = []
            try:
                updates = self.engine.step()
            finally:
                # A step that raised may have advanced (or ended) other calls' requests first: their
                # updates are filed now, or a stream would see its request finished without them.
                updates = updates or self.engine.take_undelivered()
                self._stepping = False
                for u in updates:
                    if (mine := self._updates.get(u.seq.request_id)) is not None:
                        mine.append(u)
                while self._deferred_ends:
                    self._end(self._deferred_ends.pop())

    def _end(self, *requests: Request) -> None:
        """Aborts the requests still running and forgets them and their updates. All of them: a
        Ctrl-C (a second one, say) is held back until the last is done, not let through after the
        first; it is held while waiting for the lock too, as a cleanup must not be skipped."""
        with _interrupts.deferred(), self._lock:
            if self._stepping:  # the garbage collector, finalizing a stream inside this thread's step
                self._deferred_ends.extend(requests)
                return
            for req in requests:
                if not req.finished:
                    self.engine.abort(req.request_id)
                self.engine.release(req.request_id)
                self._updates.pop(req.request_id, None)

    def stats(self) -> dict:
        """Engine gauges, counters and latency histograms (see `Engine.stats`)."""
        with self._lock:
            return self.engine.stats()

    def _output(self, req: Request, prompt: str | None, texts: dict[int, str]) -> RequestOutput:
        outputs = [
            CompletionOutput(
                index=s.index,
                token_ids=list(s.output_ids),
                text=texts.get(s.seq_id, ""),
                finish_reason=s.finish_reason,
                logprobs=s.logprobs,
                stop_reason=s.stop_reason,
                cumulative_logprob=None if s.logprobs is None else sum(lp.logprob for lp in s.logprobs),
            )
            for s in req.seqs
        ]
        plp = req.seqs[0].prompt_logprobs
        return RequestOutput(
            request_id=req.request_id,
            prompt=prompt,
            prompt_token_ids=req.prompt_ids,
            outputs=outputs,
            prompt_logprobs=None if plp is None else [None, *plp],
        )


def _progress_bar(total: int):
    """A tqdm bar over `total` prompts, for `use_tqdm=True` (tqdm is optional)."""
    try:
        from tqdm.auto import tqdm
    except ImportError:
        raise InvalidRequestError("use_tqdm=True needs the tqdm package (pip install tqdm)") from None
    return tqdm(total=total, desc="Generating", unit="prompt")
