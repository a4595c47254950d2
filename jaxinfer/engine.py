"""The continuous-batching engine: requests in, one stream of jitted steps, tokens and text out.

Each `step()` asks the scheduler for a `StepPlan` (which chunks of which sequences run), turns it
into at most two model calls - `prefill` for prompt chunks ([B, T] rows), `decode_step` for
single-token rows ([B, 1]) - each followed by the jitted sampler, dispatches everything before
waiting on any of it, then feeds the sampled tokens back to their sequences: stop conditions,
incremental detokenization, metrics. A prompt chunk of a request that asked for prompt_logprobs
runs in `prefill_with_prompt_logprobs` instead, which also returns every position's log-probabilities.

With async scheduling (the default) a step's results are read only after the next step is
dispatched, whose decode rows take the sampled tokens on the device: the host's bookkeeping then
overlaps the device's work instead of following it (`Engine._run_ahead`).

Shapes come from a fixed set of buckets decided at construction (`prefill_shapes`, `decode_shapes`),
all compiled by `warmup()`, so a serving engine never compiles after it starts taking traffic. The
prompt-logprobs programs are compiled there only when asked (always on a multi-process job); else
each prefill shape's compiles at its first use.
`LLM.generate` and the gRPC server both drive this one engine.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import itertools
import logging
import os
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import _interrupts, _malloc
from jaxinfer import model as model_lib
from jaxinfer.attention import resolve_backend
from jaxinfer.capacity import (
    check_cache_fits,
    check_max_model_len,
    default_window_kv_pages,
    prefill_token_limit,
    window_pool_pages,
)
from jaxinfer.config import ModelConfig
from jaxinfer.detokenizer import IncrementalDetokenizer
from jaxinfer.errors import InvalidRequestError
from jaxinfer.kv_cache import (
    SCRATCH_PAGE,
    Batch,
    KVCache,
    PagePool,
    QuantizedPages,
    pages_needed,
    salt_digest,
)
from jaxinfer.limits import check_cache_salt, check_capacity
from jaxinfer.metrics import EngineMetrics
from jaxinfer.outputs import Logprob
from jaxinfer.sampling import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORDS,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_STOP_TOKEN_IDS,
    SampleOutput,
    SamplingBatch,
    SamplingParams,
    history_width,
    history_widths,
    is_int,
    sample,
)
from jaxinfer.scheduler import Chunk, PageGroup, Scheduler, Sequence, bucket, decode_bucket
from jaxinfer.sharding import shard_bytes
from jaxinfer.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# ----------------------------------------------------------------------------------------------
# Compilation counting: every XLA backend compile in this process, however it was triggered.

_compile_count = 0
_compile_lock = threading.Lock()


def _on_compile(name: str, *args, **kwargs):
    # JAX times its compile-or-load-from-the-persistent-cache (`jax_compilation_cache_dir`) step under
    # this one event, so a program XLA compiled and one the cache handed back count once each: either
    # way the jit cache missed and the program was traced and lowered. (The cache's own
    # "/jax/compilation_cache/cache_hits" fires inside that step: counting it too counted a load twice.)
    global _compile_count
    if name == "/jax/core/compile/backend_compile_duration":
        with _compile_lock:
            _compile_count += 1


jax.monitoring.register_event_duration_secs_listener(_on_compile)


def num_compiles() -> int:
    """XLA compilations (or persistent-cache loads) so far in this process: "no recompiles" reads this."""
    return _compile_count


def _poison_pages(cache: KVCache, pages: jax.Array, layers: tuple[int, ...]) -> KVCache:
    """Fills `pages` of the given layers' pools with NaN (the layers of one page group)."""

    def poison(i, pool):  # an int8 pool cannot hold NaN: its scales can, and every read multiplies by them
        if i not in layers:
            return pool
        if isinstance(pool, QuantizedPages):
            return QuantizedPages(values=pool.values, scales=pool.scales.at[:, pages].set(jnp.nan))
        return pool.at[:, pages].set(jnp.asarray(jnp.nan, pool.dtype))

    return KVCache(
        k=tuple(poison(i, p) for i, p in enumerate(cache.k)), v=tuple(poison(i, p) for i, p in enumerate(cache.v))
    )


_poison_pages_jit = jax.jit(_poison_pages, static_argnames=("layers",))

# ----------------------------------------------------------------------------------------------
# Warm-up: compilations side by side.

# Threads the warm-up compiles on, at most (one per core below that).
_MAX_COMPILE_THREADS = 8


def _in_parallel(calls: list) -> list:
    """[call() for call in calls], run on up to one thread per core: what the warm-up compiles.

    XLA compiles with the GIL released, so two programs compile side by side while a third is
    traced: the default model's 49 step programs took 26.5 against 35.9 s on 2 cores, with 2
    threads (2026-12-06). The first failure is raised; on it or a Ctrl-C no call not yet started
    starts."""
    workers = min(len(calls), os.cpu_count() or 1, _MAX_COMPILE_THREADS)
    if workers < 2:
        return [call() for call in calls]
    pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="jaxinfer-warmup")
    try:
        futures = [pool.submit(call) for call in calls]
        return [f.result() for f in futures]
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


_compiler: concurrent.futures.ThreadPoolExecutor | None = None  # see _compile_off_main_thread


def _compile_off_main_thread(compile_fn, *args) -> None:
    """`compile_fn(*args)` on a worker thread, waited for on the main one.

    JAX gives way to a Ctrl-C in the middle of a compilation, but the compilation itself goes on in
    XLA's threads; an interpreter exiting meanwhile then crashes in the runtime's teardown (a
    segfault on exit after a Ctrl-C, 5 of 11 runs of a `generate` interrupted mid-compile; jax
    0.11). On a worker thread the compilation is never interrupted, only the main thread's wait is,
    and Python joins the worker at exit: the process ends after the compilation, cleanly."""
    global _compiler
    if threading.current_thread() is not threading.main_thread():
        compile_fn(*args)
        return
    if _compiler is None:
        _compiler = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxinfer-compile")
    _compiler.submit(compile_fn, *args).result()


# ----------------------------------------------------------------------------------------------
# Async scheduling: a decode row's input token read from the previous step's output on the device.

_PLACEHOLDER = -1  # a sequence's last token while the step that samples it runs (Sequence.ahead)


@functools.partial(jax.jit, static_argnames=("size",))
def _pad_tokens(tokens: jax.Array, size: int) -> jax.Array:
    """A call's sampled tokens [B] at the head of a vector of fixed `size`: the merge below then has
    one shape per decode bucket, whatever calls the step before made."""
    return jnp.zeros(size, tokens.dtype).at[: tokens.shape[0]].set(tokens)


@jax.jit
def _merge_tokens(host: jax.Array, first: jax.Array, second: jax.Array, src: jax.Array, use: jax.Array) -> jax.Array:
    """A decode call's input tokens [B, 1]: the host's, or where use[i], entry src[i] of the step
    before's sampled tokens (its two calls' padded vectors, end to end)."""
    prev = jnp.concatenate([first, second])
    return jnp.where(use[:, None], prev[src][:, None], host)


@dataclasses.dataclass(eq=False)
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)


@dataclasses.dataclass(eq=False)
class _Call:
    """One model call of a step and its sampler, dispatched: the results are still on the device."""

    phase: str  # "prefill" | "decode"
    chunks: list[Chunk]
    samples: list[bool]  # each chunk's Chunk.samples as dispatched (a placeholder changes it after)
    out: SampleOutput
    plp: object  # PromptLogprobs, or None


@dataclasses.dataclass(eq=False)
class _Step:
    calls: list[_Call]
    started: float  # when it was dispatched
    # Run ahead (Engine._run_ahead): its chunks were counted as computed when it was dispatched, and
    # each sequence it samples for holds a placeholder until its results are read.
    ahead: bool = False
    tokens: tuple = ()  # (first call's, last call's) sampled tokens, padded to Engine._token_slots
    rows: dict = dataclasses.field(default_factory=dict)  # Sequence -> its token's index in `tokens` end to end


@dataclasses.dataclass
class SeqUpdate:
    """What one step did to one sequence: tokens added, text released, finished or not (see
    `SeqUpdate.of`)."""

    seq: Sequence
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[Logprob] | None = None  # token_ids', one each, when the request asked for logprobs
    prompt_logprobs: list[Logprob] | None = None  # on the sample's first update, when asked: prompt tokens 1, 2, ...

    @classmethod
    def of(cls, seq: Sequence, new_tokens: list[int], text: str, finish_reason: str | None) -> SeqUpdate:
        """The update that adds `new_tokens` (already appended to seq, each with its Logprob when asked
        for). The sample's first (no output before it) carries the prompt's logprobs."""
        lps = None if seq.logprobs is None else seq.logprobs[len(seq.logprobs) - len(new_tokens) :]
        first = len(seq.tokens) - seq.prompt_len == len(new_tokens)
        plp = list(seq.prompt_logprobs) if first and seq.prompt_logprobs is not None else None
        return cls(seq, new_tokens, text, finish_reason, lps, plp)


class Engine:
    """Owns the parameters, the KV cache and the scheduler; `step()` advances every request.

    Args:
        cfg, params: the model.
        tokenizer: for text output and stop strings; None for token-ids-only use.
        max_model_len: longest sequence (prompt + output).
        page_size: tokens per KV page (a power of two).
        num_kv_pages: pages in the cache (one is scratch). A hybrid model's (`cfg.hybrid_window`)
            sliding-window layers have pools of their own, of num_window_kv_pages pages.
        num_window_kv_pages: None: what max_num_seqs sequences hold at most inside their windows
            (when that is fewer than num_kv_pages; else one pool size for all layers).
        max_num_seqs: sequences running at once.
        max_num_batched_tokens: tokens computed per step (decode rows + prompt chunks).
        enable_prefix_caching: share cached prompt pages between requests.
        poison_reused_pages: fill every page with NaN as it is handed to a sequence, whether it was
            freed by another or evicted from the prefix cache (tests: proves stale data never leaks).
        mesh: a jax.sharding.Mesh with axes ("data", "model") (see jaxinfer.sharding); parameters
            and the KV cache are placed by the rules table, step batches split rows over `data`,
            and the steps trace under the mesh (the Pallas kernels then run under shard_map).
            None: one device, as placed by JAX.
        channel: multi-host only (jaxinfer.distributed.StepChannel): on the leader, every step's
            inputs are broadcast to the followers before the step runs.
        async_scheduling: dispatch each step before reading the one before's results, so the
            host's work (reading tokens, stop conditions, text, scheduling, building the next inputs)
            overlaps the device's (see `_run_ahead`). Outputs are the same either way. On one
            process only (a multi-process job's followers get host inputs). An attribute: may be
            switched between steps.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        params,
        tokenizer: Tokenizer | None = None,
        *,
        max_model_len: int,
        page_size: int = 16,
        num_kv_pages: int,
        max_num_seqs: int = 32,
        max_num_batched_tokens: int = 512,
        enable_prefix_caching: bool = True,
        poison_reused_pages: bool = False,
        mesh=None,
        channel=None,
        num_window_kv_pages: int | None = None,
        async_scheduling: bool = True,
        seed: int | None = None,
    ):
        if not isinstance(async_scheduling, bool):
            raise InvalidRequestError(f"async_scheduling must be True or False, got {async_scheduling!r}")
        if seed is not None and (not is_int(seed) or seed < 0):  # NumPy integers too, as LLM takes them
            raise InvalidRequestError(f"seed must be None or an integer >= 0, got {seed!r}")
        check_capacity(
            page_size=page_size,
            max_num_seqs=max_num_seqs,
            num_kv_pages=num_kv_pages,
            max_num_batched_tokens=max_num_batched_tokens,
            num_window_kv_pages=num_window_kv_pages,
        )
        check_max_model_len(cfg, max_model_len)
        self.cfg = cfg
        self.kv_bytes_per_token = cfg.kv_bytes_per_token  # the model's own (a mesh may store copies)
        # One width for every row's logit_bias with its min_tokens bans (stop ids and EOS ids), one for
        # allowed_token_ids (distinct ids in the vocabulary): two bias programs per batch size.
        self._bias_width = bucket(MAX_LOGIT_BIAS + MAX_STOP_TOKEN_IDS + len(cfg.eos_token_ids) + 2 * MAX_BAD_WORDS)
        self._allowed_width = max(2, min(MAX_ALLOWED_TOKEN_IDS, bucket(cfg.vocab_size)))
        self._top_n = min(MAX_LOGPROBS, cfg.vocab_size)  # prompt_logprobs' top-n, as the sampler's
        self.params = params
        self._kv_copies = 1  # KV heads stored this many times over (a mesh's model axis: see below)
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.page_size = page_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_pages_per_seq = pages_needed(max_model_len, page_size)
        self.max_prefill_tokens = prefill_token_limit(max_num_batched_tokens, max_model_len)
        self.poison_reused_pages = poison_reused_pages
        window = cfg.hybrid_window  # a hybrid model's sliding-window layers may have pages of their own
        if window is not None and num_window_kv_pages is None:
            num_window_kv_pages = default_window_kv_pages(
                cfg,
                max_model_len=max_model_len,
                page_size=page_size,
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
            )
        num_window_pages = window_pool_pages(cfg, num_kv_pages=num_kv_pages, num_window_kv_pages=num_window_kv_pages)
        # Before anything is sized by the page counts (the pools' host arrays too).
        check_cache_fits(
            cfg, num_kv_pages=num_kv_pages, num_window_pages=num_window_pages, page_size=page_size, mesh=mesh
        )
        self.pool = PagePool(num_kv_pages, enable_prefix_cache=enable_prefix_caching)
        groups = [PageGroup(self.pool, cfg.kv_window)]
        self.window_pool = None  # the sliding-window layers' pool, when split
        if num_window_pages is not None:
            self.window_pool = PagePool(num_window_pages, enable_prefix_cache=enable_prefix_caching)
            groups.append(PageGroup(self.window_pool, window))
        # The layers whose pools each group's page ids index.
        layers = range(cfg.num_layers)
        if self.window_pool is None:
            self._group_layers = [tuple(layers)]
        else:
            self._group_layers = [tuple(i for i in layers if not cfg.in_window_pool(i))]
            self._group_layers.append(tuple(i for i in layers if cfg.in_window_pool(i)))
        self.scheduler = Scheduler(
            groups=groups,
            page_size=page_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_prefill_tokens=self.max_prefill_tokens,
        )
        self.mesh = mesh
        self.channel = channel
        self._sample_device = None
        if jax.process_count() > 1:
            if mesh is None:
                raise InvalidRequestError("a multi-process job needs a mesh over every process's devices (--mesh)")
            # The leader samples from its own copy of the replicated logits, on one of its devices.
            self._sample_device = next(d for d in mesh.devices.flat if d.process_index == jax.process_index())
        if mesh is None:
            # Committed to the parameters' device from the start: a step's outputs are committed
            # when any input is, and a jit's cache is keyed on placement, so an uncommitted first
            # cache would make the first warm-up shape compile a second time in service.
            leaf = next(iter(jax.tree.leaves(params)), None)
            device = next(iter(leaf.devices())) if isinstance(leaf, jax.Array) else jax.devices()[0]
            create = functools.partial(
                KVCache.create, cfg, num_pages=num_kv_pages, page_size=page_size, num_window_pages=num_window_pages
            )
            self._new_cache = jax.jit(create, out_shardings=jax.sharding.SingleDeviceSharding(device))
            # The model's own jitted steps: every engine of the same shapes shares their compilations.
            prefill, decode, prompt_lp = model_lib.jitted_steps(cfg, device.platform)
            self._steps = (prefill, decode)
            self._prompt_lp_step = prompt_lp
            self._poison_step = _poison_pages_jit
            # Decode inputs always go in as arrays on this device (a merge's output is one, and a
            # jitted function's cache tells committed arrays from host ones: two programs otherwise).
            self._token_sharding = jax.sharding.SingleDeviceSharding(device)
        else:
            from jaxinfer import sharding

            # KV heads fewer than the model axis are stored once per device that needs them (see
            # sharding.kv_head_copies): the engine's cfg then counts the copies.
            self._kv_copies = sharding.kv_head_copies(cfg, mesh)
            cfg, self.params = sharding.place_params(cfg, params, mesh)
            self.cfg = cfg
            create = functools.partial(
                KVCache.create, cfg, num_pages=num_kv_pages, page_size=page_size, num_window_pages=num_window_pages
            )
            cache_sh = sharding.cache_shardings(jax.eval_shape(create), mesh)
            self._new_cache = jax.jit(create, out_shardings=cache_sh)
            # The steps pin their outputs: logits replicated (the sampler wants whole rows), the
            # cache exactly as it came in, so donation aliases it and no step ever recompiles
            # for a drifted sharding.
            outs = (sharding.replicated(mesh), cache_sh)
            options = model_lib.step_compiler_options(cfg, mesh.devices.flat[0].platform)
            jit = functools.partial(
                jax.jit, donate_argnames=("cache",), compiler_options=options, static_argnames=("cfg",)
            )
            self._steps = tuple(jit(fn, out_shardings=outs) for fn in (model_lib.forward, model_lib.decode_step_fn))
            self._prompt_lp_step = jit(
                model_lib.forward_with_prompt_logprobs,
                static_argnames=("cfg", "top_n"),
                out_shardings=(*outs, sharding.replicated(mesh)),
            )
            self._poison_step = jax.jit(_poison_pages, static_argnames=("layers",), out_shardings=cache_sh)
            self._token_sharding = None  # every input is placed by sharding.batch_shardings
        platform = (mesh.devices.flat[0] if mesh is not None else device).platform
        # The C++ kernel reads a row's pages up to its length whatever the table's width, so its
        # decode calls all take the widest table: a quarter of the decode programs to compile where
        # a model's context spans four widths (the others read, or loop over, the whole table).
        self._one_decode_width = resolve_backend(cfg.attention_backend, platform) == "native"
        if platform == "cpu":
            _malloc.keep_large_blocks()  # each run's large temporaries reused, not faulted in anew
        self.cache = self._new_cache()
        # On the CPU, the weights and the cache move into huge pages while the engine runs (a
        # decode step streams them all: ~1.09x at batch 1 for the 150M model; _malloc explains).
        # The new cache is all zeros: its pages are given back, to come again as huge pages when written.
        self._cpu_memory = platform == "cpu"
        self._huge_pages: list = []  # the threads moving memory into huge pages
        if self._cpu_memory:
            self._back_with_huge_pages(jax.tree.leaves(self.params), what="engine")
        # Device memory the cache holds, every device and copy counted (on a mesh: KV heads copied
        # for the `model` axis, pages whole on every `data` device).
        self.kv_cache_bytes = sum(shard_bytes(self.cache).values())
        self._undelivered: list[SeqUpdate] = []  # made by a step, not yet returned (see `step`)
        self.metrics = EngineMetrics(
            kv_pages_total=self.pool.capacity,
            kv_cache_bytes=self.kv_cache_bytes,
            kv_window_pages_total=None if self.window_pool is None else self.window_pool.capacity,
        )
        self._memory_per_device = self._measure_memory_per_device()
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self._seq_ids = itertools.count()
        self._compiled_shapes: set[tuple] = set()  # step shapes this engine has compiled (see _donating_call)
        # Seeds of unseeded requests: the engine's own entropy (or `seed`'s stream, vLLM's
        # LLM(seed=): the same seeds in the order requests arrive, run after run), so a user's
        # np.random.seed() neither repeats them nor has its stream advanced by generate().
        self._seeds = np.random.default_rng(None if seed is None else int(seed))
        self._min_mp = min(self.max_pages_per_seq, bucket(max(1, 128 // page_size)))
        # Decode rows must split over a mesh's `data` axis (see scheduler.decode_bucket).
        self._rows_multiple = 1 if mesh is None else dict(mesh.shape).get("data", 1)
        self.async_scheduling = async_scheduling
        self._ahead: _Step | None = None  # the step run ahead, whose results are not read yet
        self._results_time = 0.0  # when the last call's results were read (step-time metrics)
        # The most rows any call has: the size a step's sampled tokens are padded to for the next.
        self._token_slots = max(b for b, _, _ in self.decode_shapes() + self.prefill_shapes())
        self._after_step()  # the gauges read true (all pages free) before the first step

    # -- shapes -----------------------------------------------------------------------------

    def _decode_mp(self, max_kv_len: int) -> int:
        if self._one_decode_width:
            return self.max_pages_per_seq
        return bucket(pages_needed(max_kv_len, self.page_size), minimum=self._min_mp, maximum=self.max_pages_per_seq)

    def _decode_rows(self, n: int) -> int:
        return decode_bucket(n, rows_multiple=self._rows_multiple)

    def decode_shapes(self) -> list[tuple[int, int, int]]:
        """(rows, tokens per row, page-table width) of every single-token call the engine can make."""
        rows = sorted({self._decode_rows(b) for b in range(1, self.max_num_seqs + 1)})
        widths = sorted({self._decode_mp(n) for n in range(1, self.max_model_len + 1, self.page_size)})
        return [(b, 1, w) for b in rows for w in widths]

    def prefill_shapes(self) -> list[tuple[int, int, int]]:
        """(rows, tokens per row, page-table width) of every prompt-chunk call the engine can make."""
        shapes = []
        t = 16
        while t <= self.max_prefill_tokens:
            b = 1
            while b * t <= self.max_prefill_tokens and b <= bucket(self.max_num_seqs):
                shapes.append((b, t, self.max_pages_per_seq))
                b *= 2
            t *= 2
        return shapes

    def warmup(self, *, sampler: bool = True, prompt_logprobs: bool | None = None) -> int:
        """Compiles every step shape now. Returns how many XLA compilations that took.

        `prompt_logprobs`: also the prompt-logprobs program of every prefill shape (otherwise each
        compiles at its first use). None: only where a compilation while serving would be mistaken
        for a hung peer, on a multi-process job. Multi-host: every process calls it (same shapes,
        same order); followers with sampler=False.
        """
        if prompt_logprobs is None:
            prompt_logprobs = jax.process_count() > 1
        compiled = self._warmup(sampler, prompt_logprobs)
        self._after_step()  # the gauges, compilations included, as of the end of the warm-up
        return compiled

    def _warmup_inputs(self, b: int, t: int, mp: int, with_targets: bool) -> tuple[Batch, np.ndarray | None]:
        """An empty step of one shape: (batch, prompt-logprobs targets or None)."""
        table = np.full((b, mp), SCRATCH_PAGE, np.int32)
        tokens = np.zeros((b, t), np.int32)
        if t == 1 and self._token_sharding is not None:
            tokens = jax.device_put(tokens, self._token_sharding)  # as `_decode_tokens` passes them
        batch = Batch(
            tokens=tokens,
            q_lens=np.zeros(b, np.int32),
            kv_lens=np.zeros(b, np.int32),
            page_table=table,
            window_page_table=None if self.window_pool is None else table.copy(),
        )
        return batch, (np.zeros((b, t), np.int32) if with_targets else None)

    def _precompile(self, shapes: list[tuple[int, int, int, bool]]) -> None:
        """Compiles the step programs of `shapes` side by side (`_in_parallel`); the warm-up's calls
        then find them compiled (`_compiled_shapes`, and jit's own cache)."""

        def compile_one(shape):
            batch, targets = self._warmup_inputs(*shape)
            self._compile(*self._step_call(batch, shape[1], targets))

        _in_parallel([functools.partial(compile_one, shape) for shape in shapes])

    def _warmup(self, sampler: bool, prompt_logprobs: bool) -> int:
        before = num_compiles()
        step_logits = {}  # rows -> logits exactly as a step returns them
        shapes = [(*shape, False) for shape in self.decode_shapes() + self.prefill_shapes()]
        shapes += [(*shape, True) for shape in self.prefill_shapes()] if prompt_logprobs else []
        if jax.process_count() == 1:  # (a multi-process job compiles in the order its peers do)
            self._precompile(shapes)
        for b, t, mp, with_targets in shapes:
            batch, targets = self._warmup_inputs(b, t, mp, with_targets)
            if jax.process_count() > 1:  # the leader's broadcast of a step's inputs: a program per shape
                from jaxinfer.distributed import warm_step_broadcast

                warm_step_broadcast(batch, targets)
            step_logits[b], _ = self._run_step(batch, t, targets=targets, multi_process_warmup=jax.process_count() > 1)
        if not sampler:
            return num_compiles() - before
        # The sampler is warmed on the steps' own logits: a jitted function's cache is keyed on its
        # arguments' placement too, and logits from committed parameters are committed arrays: a
        # sampler warmed on host arrays would be another program than the one requests call.
        calls = []
        for b, logits in sorted(step_logits.items()):
            if self._sample_device is not None:  # multi-host leader: its local copy, as _model_step takes
                logits = next(s.data for s in logits.addressable_shards if s.device == self._sample_device)
            for w in history_widths(self.max_model_len):
                calls.append(functools.partial(sample, logits, SamplingBatch.from_rows([], b, w)))
            for allowed_width in (1, self._allowed_width):  # logit_bias, min_tokens, allowed_token_ids
                batch = SamplingBatch.from_rows([], b, bias_width=self._bias_width, allowed_width=allowed_width)
                calls.append(functools.partial(sample, logits, batch))
        outs = _in_parallel(calls)
        # The small programs below compile on this thread: Ctrl-C waits for them (see
        # _compile_off_main_thread: a compilation it interrupts crashes the interpreter's exit).
        with _interrupts.deferred():
            if self.channel is None:  # async scheduling: every call's tokens padded for the next step
                for tokens in {out.tokens.shape[0]: out.tokens for out in outs}.values():  # a program per row count
                    padded = _pad_tokens(tokens, size=self._token_slots)
            if self.channel is None:  # ... and every decode bucket's merge of them
                for b in sorted({b for b, _, _ in self.decode_shapes()}):
                    zeros = np.zeros(b, np.int32)
                    _merge_tokens(zeros[:, None], padded, padded, zeros, zeros.astype(bool))
            jax.block_until_ready(self.cache)
            if self.poison_reused_pages and self.channel is None:
                # A step hands out any number of pages, padded to a power of two: one program per size.
                for g, group in enumerate(self.scheduler.groups):
                    n = 1
                    while n <= bucket(group.pool.capacity):
                        self._poison(np.zeros(n, np.int32), g)  # page 0: the scratch page
                        n *= 2
        return num_compiles() - before

    def _model_step(self, batch: Batch, t: int, targets: np.ndarray | None = None):
        """One jitted prefill (t > 1) or decode (t == 1) call; replaces the cache. Returns (logits,
        PromptLogprobs of `targets` or None): see `_run_step`.

        Multi-host leader: broadcasts the inputs first; returns its local copies. Any failure there
        is a failure of the job (a follower gone), reported as PeerFailureError.
        """
        if self.channel is None:
            return self._run_step(batch, t, targets=targets)
        from jaxinfer.distributed import PeerFailureError, peer_wait

        try:
            with peer_wait():
                self.channel.send_step(batch, t, targets)
                out = self._run_step(batch, t, targets=targets)

                def local(x):
                    return next(s.data for s in x.addressable_shards if s.device == self._sample_device)

                return jax.block_until_ready(jax.tree.map(local, out))
        except Exception as e:
            raise PeerFailureError(f"a step across the processes failed (a follower died?): {e}") from e

    def heartbeat(self, interval: float) -> None:
        """Multi-host leader with nothing to run: a sign of life to the followers, when nothing was
        broadcast for `interval` seconds. A hung follower blocks it (and the server's watchdog
        notices); a dead one fails it with PeerFailureError."""
        if self.channel is None or time.monotonic() - self.channel.last_sent < interval:
            return
        from jaxinfer.distributed import PeerFailureError

        try:
            self.channel.send_heartbeat()
        except Exception as e:
            raise PeerFailureError(f"a heartbeat to the other processes failed (a follower died?): {e}") from e

    def _back_with_huge_pages(self, params, *, what: str) -> None:
        """`params` and the present cache (new, so all zeros: its pages given back, to come again as
        huge pages when written) into huge pages; the thread that moves the rest is kept for
        `wait_for_huge_pages`."""
        thread = _malloc.back_with_huge_pages(
            params, zeros=jax.block_until_ready(jax.tree.leaves(self.cache)), what=what
        )
        self._huge_pages = [t for t in self._huge_pages if t.is_alive()] + ([thread] if thread else [])

    def wait_for_huge_pages(self, timeout: float | None = None) -> bool:
        """Waits until the weights and the cache are in huge pages, as far as the kernel allowed (CPU
        only; see _malloc.back_with_huge_pages): for a benchmark that must time the engine as it will
        run. Whether that work is over (True where there was none)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for thread in self._huge_pages:
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return not any(thread.is_alive() for thread in self._huge_pages)

    def close(self) -> None:
        """Multi-host leader: tells the followers to exit (they return from run_follower)."""
        if self.channel is not None:
            self.channel.send_stop()
            self.channel = None

    def _run_step(self, batch: Batch, t: int, *, targets=None, multi_process_warmup: bool = False):
        """One step on this process's devices: (logits [B, V], None), or with `targets` [B, t] (the
        token after each position) from `prefill_with_prompt_logprobs`: (logits, PromptLogprobs).

        `multi_process_warmup`: compile first, then run and wait for the step as a wait on the other
        processes (`peer_wait`), so that the startup watchdog times the collective, not this
        process's own compilation."""
        step, inputs, kw = self._step_call(batch, t, targets)
        if self.mesh is None:
            return self._donating_call(step, inputs, kw)
        from jaxinfer.distributed import peer_wait

        with jax.set_mesh(self.mesh):
            if multi_process_warmup:
                self._compile(step, inputs, kw)
            with peer_wait() if multi_process_warmup else contextlib.nullcontext():
                out = self._donating_call(step, inputs, kw)
                if multi_process_warmup:
                    jax.block_until_ready(out)
        return out

    def _step_call(self, batch: Batch, t: int, targets=None) -> tuple:
        """(jitted step, its inputs after params and cache, its keywords) for one step; the inputs
        placed on the mesh where there is one."""
        if targets is None:
            step, inputs, kw = self._steps[t == 1], (batch,), dict(cfg=self.cfg)
        else:
            step, inputs, kw = self._prompt_lp_step, (batch, targets), dict(cfg=self.cfg, top_n=self._top_n)
        if self.mesh is not None:
            from jaxinfer import sharding

            inputs = jax.device_put(inputs, sharding.batch_shardings(inputs, self.mesh))
        return step, inputs, kw

    @staticmethod
    def _shapes(step, inputs: tuple) -> tuple:
        return (step, jax.tree.structure(inputs), *(np.shape(x) for x in jax.tree.leaves(inputs)))

    def _compile(self, step, inputs: tuple, kw: dict) -> None:
        """Compiles `step` for these inputs unless this engine has already (jit's own cache keeps
        the program). Safe on several threads at once."""
        shapes = self._shapes(step, inputs)
        if shapes in self._compiled_shapes:
            return
        with jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext():
            step.lower(self.params, self.cache, *inputs, **kw).compile()
        self._compiled_shapes.add(shapes)

    def _donating_call(self, step, inputs: tuple, kw: dict):
        """`step(params, cache, *inputs, **kw) -> (logits, cache[, prompt_logprobs])`, a jitted call
        that donates the cache: keeps the new cache, returns (logits, prompt_logprobs or None).

        On the main thread a Ctrl-C is held back from the donation until the new cache is kept: landing
        in between, it would leave the engine with a deleted cache, and every sequence would start
        over. The call only enqueues work; a shape this engine has not run yet is compiled first,
        with Ctrl-C let through (nothing is donated yet).
        """
        if self._shapes(step, inputs) not in self._compiled_shapes:
            with _interrupts.allowed():
                _compile_off_main_thread(self._compile, step, inputs, kw)
        with _interrupts.deferred():
            logits, self.cache, *plp = step(self.params, self.cache, *inputs, **kw)
        return logits, (plp[0] if plp else None)

    def _poison(self, pages: np.ndarray, group: int) -> None:
        """Fills pages of one page group's pools with NaN."""
        if self.channel is not None:
            from jaxinfer.distributed import PeerFailureError

            try:
                self.channel.send_poison(pages, group)
            except Exception as e:
                raise PeerFailureError(f"broadcasting freed pages failed (a follower died?): {e}") from e
        self._run_poison(pages, group)

    def _run_poison(self, pages: np.ndarray, group: int) -> None:
        self.cache = self._poison_step(self.cache, pages, self._group_layers[group])

    # -- requests ---------------------------------------------------------------------------

    def truncated(self, prompt_ids: list[int], params: SamplingParams) -> list[int]:
        """The prompt as the request runs it: its last `params.truncate_prompt_tokens` tokens (-1:
        max_model_len - 1), or all of it."""
        k = params.truncate_prompt_tokens
        if k == -1:
            k = self.max_model_len - 1
        return list(prompt_ids[-k:]) if k is not None and len(prompt_ids) > k else prompt_ids

    def prompt_token_limit(self, params: SamplingParams) -> int | None:
        """The most tokens a request's prompt may have before truncation: max_model_len - 1, or None
        (any number) when truncate_prompt_tokens leaves every prompt short enough to run."""
        k = params.truncate_prompt_tokens
        return None if k is not None and (k == -1 or k < self.max_model_len) else self.max_model_len - 1

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raises InvalidRequestError (naming the field and limit) if the request cannot run (its
        prompt truncated first, as `add_request` runs it)."""
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"params must be a SamplingParams, got {type(params).__name__}")
        if isinstance(prompt_ids, (str, bytes)) or not isinstance(prompt_ids, (list, tuple)):
            raise InvalidRequestError(f"prompt_ids must be a list of token ids, got {type(prompt_ids).__name__}")
        if not prompt_ids:
            raise InvalidRequestError("prompt is empty: it must hold at least one token")
        kept = self.truncated(prompt_ids, params)
        # The length first (a request of millions of ids is refused at once: on a server this runs on
        # the event loop), then every id's type (a Python int is the common case, checked fastest).
        if len(kept) < self.max_model_len and not all(type(t) is int or is_int(t) for t in prompt_ids):
            raise InvalidRequestError("prompt_ids must hold integers")
        prompt_ids = kept
        if len(prompt_ids) >= self.max_model_len:
            kept = (
                ""
                if params.truncate_prompt_tokens is None
                else f" (its last SamplingParams.truncate_prompt_tokens = {params.truncate_prompt_tokens})"
            )
            raise InvalidRequestError(
                f"prompt has {len(prompt_ids)} tokens{kept}; the limit is max_model_len - 1 = {self.max_model_len - 1}"
            )
        bad = [t for t in prompt_ids if not (0 <= t < self.cfg.vocab_size)]
        if bad:
            raise InvalidRequestError(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.cfg.vocab_size})")
        for field in ("stop_token_ids", "logit_bias", "allowed_token_ids"):
            bad = [t for t in getattr(params, field) or () if t >= self.cfg.vocab_size]
            if bad:
                raise InvalidRequestError(
                    f"SamplingParams.{field}: {bad[0]} is outside the vocabulary [0, {self.cfg.vocab_size})"
                )
        if params.bad_words and self.tokenizer is None:
            raise InvalidRequestError("SamplingParams.bad_words needs the model's tokenizer; this model has none")
        if (
            params.allowed_token_ids
            and params.min_tokens
            and set(params.allowed_token_ids) <= set(self._stop_ids(params))
        ):
            raise InvalidRequestError(
                "SamplingParams.allowed_token_ids holds only ids that end the output (EOS or stop_token_ids), "
                f"which min_tokens ({params.min_tokens}) forbids: no token could be drawn"
            )
        length = min(len(prompt_ids) + (params.max_tokens or self.max_model_len), self.max_model_len)
        for group, name in zip(self.scheduler.groups, ("num_kv_pages", "num_window_kv_pages")):
            # The last token's K/V is never computed (the sequence ends on it; a step run ahead holds
            # it back): length - 1 tokens hold pages. Counting the last one refused requests that fit,
            # every request at page_size 1 with the smallest cache.
            need = self.scheduler.most_pages_held(length - 1, group)
            if need > group.pool.capacity:
                asked = (
                    f"= {params.max_tokens}"
                    if params.max_tokens is not None
                    else f"None (up to max_model_len = {self.max_model_len})"
                )
                raise InvalidRequestError(
                    f"SamplingParams.max_tokens {asked} with a {len(prompt_ids)}-token prompt needs {need} KV pages; "
                    f"the cache has {group.pool.capacity} ({name} less the scratch page): "
                    f"lower max_tokens or raise {name}"
                )
        if params.stop and self.tokenizer is None:
            raise InvalidRequestError("SamplingParams.stop needs a tokenizer; this model has none")

    @_interrupts.deferred()  # half-added, a request would run with no owner
    def add_request(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        request_id: str | None = None,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        validated: bool = False,
    ) -> Request:
        """Queues a request. `arrival_time` (time.perf_counter()): when it arrived, if earlier than now
        (a server that received it while a step ran); latency metrics count from it. `cache_salt`:
        prefix-cache pages are shared only between requests with the same salt (or none).
        `validated`: the caller has run `validate` on these arguments already (a server does, on its
        event loop), so the engine's thread does not pass over the prompt again."""
        if not validated:
            self.validate(prompt_ids, params)
        bad_words = self.bad_word_ids(params.bad_words)
        check_cache_salt(cache_salt)
        salt = salt_digest(cache_salt)
        prompt_ids = [int(t) for t in self.truncated(prompt_ids, params)]
        if request_id is not None and not isinstance(request_id, str):
            raise InvalidRequestError(f"request_id must be a string, got {type(request_id).__name__}")
        rid = request_id if request_id is not None else str(next(self._ids))
        if rid in self.requests:
            raise InvalidRequestError(f"request_id {rid!r} is already in use")
        now = time.perf_counter() if arrival_time is None else min(arrival_time, time.perf_counter())
        seqs = []
        for i in range(params.n):
            seed = params.seed + i if params.seed is not None else int(self._seeds.integers(2**32))
            seq = Sequence(
                seq_id=next(self._seq_ids),
                request_id=rid,
                index=i,
                params=params,
                seed=seed % 2**32,
                tokens=list(prompt_ids),
                prompt_len=len(prompt_ids),
                arrival_time=now,
                salt=salt,
                bad_words=bad_words,
            )
            seq.detok = (
                IncrementalDetokenizer(
                    self.tokenizer,
                    prompt_ids,
                    params.stop,
                    include_stop=params.include_stop_str_in_output,
                    skip_special_tokens=params.skip_special_tokens,
                )
                if self.tokenizer is not None
                else None
            )
            seq.logprobs = [] if params.logprobs is not None else None
            # One request's prompt: its log-probabilities are computed (and reported) once, by sample 0.
            seq.prompt_logprobs = [] if params.prompt_logprobs is not None and i == 0 else None
            seq.siblings = seqs
            seqs.append(seq)
            self.scheduler.add(seq)
        req = Request(request_id=rid, prompt_ids=list(prompt_ids), params=params, seqs=seqs)
        self.requests[rid] = req
        self.metrics.prompt_tokens.inc(len(prompt_ids))
        return req

    def bad_word_ids(self, words: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
        """Each word's token ids as the tokenizer encodes it alone and after a space (where that
        differs: a word starting a line and one inside a sentence are different tokens), leading
        whitespace dropped first. A word the tokenizer encodes as nothing is left out."""
        if not words:
            return ()
        out = []
        for w in words:
            for text in (w.lstrip(), " " + w.lstrip()):
                ids = tuple(self.tokenizer.encode(text, add_special_tokens=False))
                if ids and ids not in out:
                    out.append(ids)
        return tuple(out)

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running)

    @_interrupts.deferred()  # half-aborted, a request would keep samples running
    def abort(self, request_id: str) -> list[SeqUpdate]:
        """Ends a request now (finish reason 'abort') and frees its pages; unknown ids are ignored."""
        req = self.requests.get(request_id)
        if req is None:
            return []
        ended = [seq for seq in req.seqs if not seq.finished]
        for seq in ended:  # every sample's pages, before anything that could raise
            seq.drop_placeholder()  # the token its step sampled is dropped when read
            self.scheduler.finish(seq, "abort")
            self.metrics.count_finished("abort")
            self._observe_end(seq)
        self._after_step()
        updates = []
        for seq in ended:
            try:
                text = self._final_text(seq)
            except Exception:  # a tokenizer that cannot decode what is held back: the abort still stands
                log.exception("request %s: the final text of an aborted sample could not be decoded", request_id)
                text = ""
            updates.append(SeqUpdate.of(seq, [], text, "abort"))
        return updates

    def release(self, request_id: str) -> None:
        """Forgets a finished request (the caller has taken its outputs)."""
        req = self.requests.get(request_id)
        if req is not None and req.finished:
            del self.requests[request_id]

    # -- the step ---------------------------------------------------------------------------

    def step(self) -> list[SeqUpdate]:
        """Runs one scheduled step. Returns an update for every sequence that advanced or ended.
        With async scheduling these are the results of the step before, read while this one runs
        (the first step of a run returns none; the step after the last returns the rest).

        Updates are collected on the engine until returned: if the step is interrupted (Ctrl-C while
        it waits for the device) after some sequences advanced, the next step returns theirs too.

        A step that fails on the device (out of memory, a device error) has consumed the cache it
        was donated: the engine then makes a new, empty cache before re-raising, and every
        sequence starts over from its first token, so the engine serves on."""
        with _interrupts.deferred():  # Ctrl-C only while compiling or waiting for the device
            if self.cache is None:  # the replacement for a lost cache failed too (out of memory): again
                self.cache = self._new_cache()
            try:
                return self._step()
            except BaseException:
                if self.channel is None and self._cache_lost():  # multi-host: the job is broken anyway
                    self._renew_cache()
                raise

    def take_undelivered(self) -> list[SeqUpdate]:
        """The updates of a step that raised after some sequences advanced (or ended), which the
        next step would otherwise return: for a caller that files them now."""
        updates, self._undelivered = self._undelivered, []
        return updates

    def _cache_lost(self) -> bool:
        """Whether the cache is gone: donated to a call that failed, or that call's outputs (every
        use of them raises its error)."""
        try:
            if any(leaf.is_deleted() for leaf in jax.tree.leaves(self.cache)):
                return True
            jax.block_until_ready(self.cache)
        except Exception:
            return True
        return False

    def _renew_cache(self) -> None:
        """Host state first: whatever happens next, nothing reads the lost contents."""
        seqs = len(self.scheduler.running)
        self._drop_ahead()
        self.scheduler.recompute_all()
        self._after_step()
        log.error(
            "a failed step took the KV cache with it: a new, empty cache replaces it; %d running "
            "sequences start over and the prefix cache is empty",
            seqs,
        )
        self.cache = None  # whatever the failed step left, before allocating its replacement
        self.cache = self._new_cache()  # if this fails too, the next step tries again
        if self._cpu_memory:
            self._back_with_huge_pages([], what="new cache")

    def _step(self) -> list[SeqUpdate]:
        ahead = self._ahead
        # A sequence whose token still on the device is its last (max_tokens, max_model_len) sits
        # this step out: it has no next token, and no page for one.
        hold = {seq for seq in ahead.rows if seq.ahead and self._ends_by_length(seq)} if ahead else ()
        plan = self.scheduler.schedule(hold)
        self._take_new_pages()
        if plan.empty:
            if ahead is not None:
                self._collect(ahead)
            elif self.has_unfinished():  # a scheduler bug; fail loudly rather than spin forever
                raise RuntimeError(
                    f"scheduler made no progress: {len(self.scheduler.waiting)} waiting, "
                    f"{len(self.scheduler.running)} running, {self.pool.num_free} pages free"
                )
            self._after_step()
            updates, self._undelivered = self._undelivered, []
            return updates
        calls = []
        started = time.perf_counter()
        # A Ctrl-C while the calls compile or run leaves every sequence as it was (the cache keeps
        # what they wrote, rewritten alike when they run again); it is let through there (see
        # `_donating_call`, `_dispatch` and the waits in `_collect`) and held back elsewhere.
        if plan.prefill:
            t = bucket(max(c.length for c in plan.prefill), minimum=16)
            out = self._dispatch(plan.prefill, t, self.max_pages_per_seq)
            calls.append(_Call("prefill", plan.prefill, [c.samples for c in plan.prefill], *out))
        if plan.decode:
            # Longest first: the "xla" attention works in groups of neighbouring rows and stops each
            # group at its longest row, so rows of similar length should be neighbours.
            decode = sorted(plan.decode, key=lambda c: -c.start)
            out = self._dispatch(decode, 1, self._decode_mp(decode[0].start + 1))
            calls.append(_Call("decode", decode, [c.samples for c in decode], *out))
        step = _Step(calls, started)
        if ahead is not None:
            self._collect(ahead)  # while this step runs
        # On one process any step may run ahead: the next one's penalties and bad words read the
        # tokens still on the device (`sample(last=)`), prompt logprobs are filed when it is read.
        # The followers of a multi-process job get every step's inputs from the host.
        if self.async_scheduling and self.channel is None:
            self._run_ahead(step)
        else:
            self._collect(step)
        self._after_step()
        updates, self._undelivered = self._undelivered, []
        return updates

    def _run_ahead(self, step: _Step) -> None:
        """Leaves a dispatched step running: counts its chunks as computed now and gives each
        sequence it samples for a placeholder as its last token, so that the next step is scheduled
        and dispatched before this one's results are read, and they are read while that one runs.

        The next step's decode rows take their token from this step's output on the device
        (`_decode_tokens`), as do penalty histories and bad-word bans (`sample(last=)`), and the device runs the
        steps in order (each takes the cache the one before returned), so pages a sequence gives back
        are rewritten only after its last step. What the engine learns a step late is that a sequence
        stopped on a token (EOS, a stop id or string): it then ran one row for nothing, whose output is
        dropped. A sequence whose placeholder is its last token by length sits the next step out (`hold`
        in `_step`)."""
        size = self._token_slots
        padded = [_pad_tokens(call.out.tokens, size=size) for call in step.calls]
        step.tokens = (padded[0], padded[-1])
        # Ahead before any sequence is: should the loop raise part way, the sequences it did not
        # reach run their chunks again next step, as after a failed `_collect`.
        step.ahead = True
        self._ahead = step
        for k, call in enumerate(step.calls):
            for i, (chunk, samples) in enumerate(zip(call.chunks, call.samples)):
                seq = chunk.seq
                if seq.finished:  # stopped on the step before's token, read just now
                    continue
                if samples:
                    seq.tokens.append(_PLACEHOLDER)
                    seq.ahead = True
                    step.rows[seq] = k * size + i
                seq.num_computed += chunk.length
                self.scheduler.register_full_pages(seq)  # the device computes them before any reader

    def _ends_by_length(self, seq: Sequence) -> bool:
        """Whether the sequence's last token ends it by length (max_tokens, or max_model_len)."""
        generated = len(seq.tokens) - seq.prompt_len
        return generated >= (seq.params.max_tokens or self.max_model_len) or len(seq.tokens) >= self.max_model_len

    def _drop_ahead(self) -> None:
        """Forgets the step run ahead (its cache is lost): its sequences lose their placeholders."""
        if self._ahead is not None:
            for seq in self._ahead.rows:
                seq.drop_placeholder()
            self._ahead = None

    def _collect(self, step: _Step) -> None:
        """Reads a dispatched step's results and feeds them to its sequences (stop conditions,
        text, metrics); the updates join `_undelivered`. A step run ahead had its chunks counted
        already: only the tokens that replace its placeholders are left."""
        updates = self._undelivered
        m = self.metrics
        # The calls run one after the other on the device, and after the step before: each one's
        # time runs from the previous results (or its dispatch, if later) to its own.
        started = max(step.started, self._results_time)
        for call in step.calls:
            want_lp = any(c.seq.logprobs is not None for c in call.chunks)
            with _interrupts.allowed():
                tokens = np.asarray(call.out.tokens)
                lp = None
                if want_lp:
                    out = call.out
                    lp = (np.asarray(out.logprob), np.asarray(out.top_ids), np.asarray(out.top_logprobs))
                plp = None if call.plp is None else jax.tree.map(np.asarray, call.plp)
            now = self._results_time = time.perf_counter()
            m.step_time[call.phase].observe(now - started)
            m.count_step_tokens(call.phase, sum(c.length for c in call.chunks))
            started = now
            for i, (chunk, samples) in enumerate(zip(call.chunks, call.samples)):
                seq = chunk.seq
                if step.ahead:
                    if plp is not None and not seq.finished:
                        self._add_prompt_logprobs(seq, chunk, plp, i)
                    if not (samples and seq.ahead):  # nothing sampled; or aborted (or read) already
                        continue
                    seq.drop_placeholder()
                else:
                    if seq.finished:  # aborted while the step ran: its pages are gone already
                        continue
                    if plp is not None:
                        self._add_prompt_logprobs(seq, chunk, plp, i)
                    seq.num_computed += chunk.length
                    self.scheduler.register_full_pages(seq)
                    if not samples:
                        continue
                updates.append(self._append(seq, int(tokens[i]), now, None if lp is None else (lp, i)))
        if self._ahead is step:
            self._ahead = None

    def _dispatch(self, chunks: list[Chunk], t: int, mp: int):
        """Runs one model call and its sampler: (SampleOutput, PromptLogprobs or None), on the device."""
        b = self._decode_rows(len(chunks)) if t == 1 else bucket(len(chunks))
        tok = np.zeros((b, t), np.int32)
        q = np.zeros(b, np.int32)
        kv = np.zeros(b, np.int32)
        tables = [np.full((b, mp), SCRATCH_PAGE, np.int32) for _ in self.scheduler.groups]
        rows, bans, bans_if_last = [], [], []
        for i, c in enumerate(chunks):
            seq = c.seq
            tok[i, : c.length] = seq.tokens[c.start : c.start + c.length]
            q[i], kv[i] = c.length, c.start + c.length
            for table, held in zip(tables, seq.groups):
                table[i, : len(held.pages)] = held.pages
            history = seq.token_array() if seq.params.has_penalties else seq.tokens
            generated = len(seq.tokens) - seq.prompt_len
            rows.append((seq.params, seq.seed, generated, history, seq.prompt_len))
            ban = self._stop_ids(seq.params) if generated < seq.params.min_tokens else ()
            after = None
            if seq.bad_words and c.samples:
                banned, after = self._bad_word_bans(seq)
                ban = (*ban, *banned)
            bans.append(ban or None)
            bans_if_last.append(after)
        window_table = tables[1] if len(tables) > 1 else None
        if t == 1 and self.channel is None:
            tok = self._decode_tokens(tok, chunks)
        batch = Batch(tokens=tok, q_lens=q, kv_lens=kv, page_table=tables[0], window_page_table=window_table)
        targets = None
        if any(c.seq.pending_prompt_logprobs for c in chunks):
            # Each position's next prompt token (whatever comes after the prompt is not scored).
            targets = np.zeros((b, t), np.int32)
            for i, c in enumerate(chunks):
                end = min(c.start + c.length + 1, c.seq.prompt_len)
                if c.seq.pending_prompt_logprobs and end > c.start + 1:
                    targets[i, : end - c.start - 1] = c.seq.tokens[c.start + 1 : end]
        logits, plp = self._model_step(batch, t, targets)
        # The token history is only sent (and only as wide as needed) when some row has a penalty.
        width = history_width(rows, maximum=self.max_model_len)
        allowed = any(p.allowed_token_ids for p, *_ in rows)
        biased = allowed or any(bans) or any(bans_if_last) or any(p.logit_bias for p, *_ in rows)
        sb = SamplingBatch.from_rows(
            rows,
            b,
            width,
            bans=bans,
            bans_if_last=bans_if_last,
            bias_width=self._bias_width if biased else 1,
            allowed_width=self._allowed_width if allowed else 1,
        )
        # A decode call's input tokens are its rows' last tokens: a row that ran ahead takes its
        # placeholder's token from them (its penalties' history, the bad words it completes).
        last = tok if t == 1 else None
        # Ctrl-C is held over the call: a sampler of a new shape compiles in it, and a compilation
        # it interrupted crashes the interpreter's exit (see _compile_off_main_thread).
        with _interrupts.deferred():
            return sample(logits, sb, last), plp

    def _decode_tokens(self, tok: np.ndarray, chunks: list[Chunk]):
        """A decode call's input tokens as a device array. A row whose sequence ran ahead takes its
        token from the step before's output, still on the device (see `_run_ahead`)."""
        ahead = [i for i, c in enumerate(chunks) if c.seq.ahead]
        if not ahead:
            return tok if self._token_sharding is None else jax.device_put(tok, self._token_sharding)
        src = np.zeros(len(tok), np.int32)
        use = np.zeros(len(tok), bool)
        for i in ahead:
            src[i], use[i] = self._ahead.rows[chunks[i].seq], True
        return _merge_tokens(tok, *self._ahead.tokens, src, use)

    @staticmethod
    def _add_prompt_logprobs(seq: Sequence, chunk: Chunk, plp, row: int) -> None:
        """Files the chunk's prompt positions not filed yet (a preempted sequence computes its
        prompt again), if its sequence asked for them: position p scores prompt token p + 1."""
        chosen, top_ids, top_lps = plp
        n = seq.params.prompt_logprobs
        got = seq.prompt_logprobs
        if got is None or len(got) >= seq.prompt_len - 1:
            return
        if chunk.start > len(got):  # the scheduler guarantees it cannot happen: never report a gap
            raise RuntimeError(f"sequence {seq.seq_id}: prompt positions {len(got)}..{chunk.start - 1} were skipped")
        for p in range(len(got), min(chunk.start + chunk.length, seq.prompt_len - 1)):
            j = p - chunk.start
            top = {int(a): float(v) for a, v in zip(top_ids[row, j, :n], top_lps[row, j, :n])}
            got.append(Logprob(seq.tokens[p + 1], float(chosen[row, j]), top))

    @staticmethod
    def _bad_word_bans(seq: Sequence) -> tuple[list[int], list[tuple[int, int]]]:
        """The last token of every bad word whose other tokens end the sequence's tokens: (bans,
        bans_if_last). When the last token is a placeholder (still on the device), a word whose
        tokens before it match is banned only if that token is the word's second to last: (its
        last, its second to last), for the device to decide (`SamplingBatch.bias_if_last`)."""
        tokens, bans, after = seq.tokens, [], []
        known = len(tokens) - seq.ahead  # the tokens on the host
        for w in seq.bad_words:
            if len(w) == 1:
                bans.append(w[0])
            elif not seq.ahead:
                if len(w) <= len(tokens) + 1 and tokens[1 - len(w) :] == list(w[:-1]):
                    bans.append(w[-1])
            elif len(w) <= known + 2 and tokens[known + 2 - len(w) : known] == list(w[:-2]):
                after.append((w[-1], w[-2]))
        return bans, after

    def _stop_ids(self, p: SamplingParams) -> tuple[int, ...]:
        """The ids that would end a sequence: what min_tokens keeps it from drawing."""
        return p.stop_token_ids if p.ignore_eos else (*p.stop_token_ids, *self.cfg.eos_token_ids)

    def _append(self, seq: Sequence, token: int, now: float, lp) -> SeqUpdate:
        p = seq.params
        m = self.metrics
        if seq.first_token_time is None:
            if all(s.first_token_time is None for s in seq.siblings):  # the request's first token
                m.ttft.observe(now - seq.arrival_time)
                scheduled = seq.first_scheduled_time if seq.first_scheduled_time is not None else seq.arrival_time
                m.queue_time.observe(scheduled - seq.arrival_time)
                m.prefill_time.observe(now - scheduled)
            seq.first_token_time = now
        else:
            m.itl.observe(now - seq.last_token_time)
        seq.last_token_time = now
        if token in self.cfg.eos_token_ids and not p.ignore_eos:
            return self._finish(seq, [], "stop")
        if token in p.stop_token_ids:
            seq.stop_reason = token
            return self._finish(seq, [], "stop")
        seq.tokens.append(token)
        m.generated_tokens.inc()
        if lp is not None and seq.logprobs is not None:
            (chosen, top_ids, top_lps), i = lp
            n = p.logprobs
            seq.logprobs.append(
                Logprob(token, float(chosen[i]), {int(a): float(b) for a, b in zip(top_ids[i, :n], top_lps[i, :n])})
            )
        generated = len(seq.tokens) - seq.prompt_len  # (seq.output_ids would copy them)
        if seq.detok is not None:
            # Searched only past the first min_tokens tokens' text, as vLLM's V1 detokenizer does: a stop
            # string may end the output no sooner than EOS or a stop id may (the min_tokens-th token's
            # text was searched too, so min_tokens=1 could still end with no text).
            seq.detok.add(token, find_stops=generated > p.min_tokens)
            if seq.detok.stopped:
                return self._finish(seq, [token], "stop")
        if self._ends_by_length(seq):
            return self._finish(seq, [token], "length")
        text = seq.detok.pop_delta() if seq.detok is not None else ""
        return SeqUpdate.of(seq, [token], text, None)

    def _finish(self, seq: Sequence, new_tokens: list[int], reason: str) -> SeqUpdate:
        text = self._final_text(seq)
        if seq.detok is not None and seq.detok.stopped:
            # (With reason "length": the final flush completed a stop string, its last character half-made.)
            reason, seq.stop_reason = "stop", seq.detok.stop_string
        self.scheduler.finish(seq, reason)
        self.metrics.count_finished(reason)
        self._observe_end(seq)
        return SeqUpdate.of(seq, new_tokens, text, reason)

    def _observe_end(self, seq: Sequence) -> None:
        """Request latency, once per request: when its last sample ends (finished or aborted)."""
        if all(s.finished for s in seq.siblings):
            self.metrics.e2e.observe(time.perf_counter() - seq.arrival_time)

    def _final_text(self, seq: Sequence) -> str:
        if seq.detok is None:
            return ""
        seq.detok.flush()
        return seq.detok.pop_delta(final=True)

    def _take_new_pages(self) -> None:
        """Pages handed to sequences by this step's schedule(); with poison_reused_pages, fills them
        with NaN now, after scheduling and before the step's dispatch: before their new owner writes."""
        s = self.scheduler
        for g, new in enumerate(s.new_pages):
            if new and self.poison_reused_pages:
                pages = np.asarray(sorted(set(new)), np.int32)
                pad = bucket(len(pages)) - len(pages)
                self._poison(np.pad(pages, (0, pad), constant_values=SCRATCH_PAGE), g)
            new.clear()

    def _after_step(self) -> None:
        s = self.scheduler
        m = self.metrics
        m.kv_pages_free.set(self.pool.num_free)
        m.kv_pages_used.set(self.pool.capacity - self.pool.num_free)
        if self.window_pool is not None:
            m.kv_window_pages_free.set(self.window_pool.num_free)
            m.kv_window_pages_used.set(self.window_pool.capacity - self.window_pool.num_free)
        m.running.set(len(s.running))
        m.waiting.set(len(s.waiting))
        m.compiles.set(num_compiles())
        m.sync_counters(preemptions=s.num_preemptions, prefix_hits=s.prefix_cache_hit_tokens)

    # -- metrics ----------------------------------------------------------------------------

    def model_params(self):
        """The parameters in the model's own layout: the engine's own, or where a mesh copies the KV
        heads (`sharding.kv_head_copies`), new arrays with one of each head's copies."""
        if self._kv_copies == 1:
            return self.params
        from jaxinfer.sharding import narrow_kv_heads

        return narrow_kv_heads(self.params, self._kv_copies)

    def memory_per_device(self) -> dict:
        """The most parameter and KV-cache bytes any one device holds (they shrink as `model` grows)."""
        return dict(self._memory_per_device)

    def _measure_memory_per_device(self) -> dict:
        # Read off the arrays' shards once, at construction: the layout never changes afterwards.
        from jaxinfer.sharding import bytes_per_device

        params, cache = bytes_per_device(self.params), bytes_per_device(self.cache)
        return {"param_bytes_per_device": max(params.values()), "kv_cache_bytes_per_device": max(cache.values())}

    def stats(self) -> dict:
        s, m = self.scheduler, self.metrics
        return {
            "kv_pages_total": self.pool.capacity,
            "kv_pages_free": self.pool.num_free,
            "kv_pages_cached": self.pool.num_cached,
            # A hybrid model's sliding-window layers' pools (see kv_cache): their own page count.
            **(
                {}
                if self.window_pool is None
                else {
                    "kv_window_pages_total": self.window_pool.capacity,
                    "kv_window_pages_free": self.window_pool.num_free,
                }
            ),
            "kv_cache_bytes": self.kv_cache_bytes,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            **self.memory_per_device(),
            "running": len(s.running),
            "waiting": len(s.waiting),
            "num_preemptions": s.num_preemptions,
            "prefix_cache_hit_tokens": s.prefix_cache_hit_tokens,
            "num_compiles": num_compiles(),
            "finished_sequences": dict(m.finished_counts),
            "ttft_seconds": m.ttft.as_dict(),
            "itl_seconds": m.itl.as_dict(),
            "request_latency_seconds": m.e2e.as_dict(),
            # Per request (n samples count once): TTFT = queue time + prefill time, to the request's
            # first token; latency to its last sample's end (aborts included). ITL: per sample.
            "queue_time_seconds": m.queue_time.as_dict(),
            "prefill_time_seconds": m.prefill_time.as_dict(),
            "step_seconds": {phase: h.as_dict() for phase, h in m.step_time.items()},
            "step_tokens": dict(m.step_token_counts),
        }
