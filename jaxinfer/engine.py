"""The generation engine: requests in, jitted steps out, tokens back to requests.

This first version batches continuously at step granularity: waiting requests are admitted when
a sequence slot and enough KV pages for their whole prompt plus `max_tokens` are free; a step is
either one prefill of all newly admitted prompts or one decode of every running sequence; a
finished sequence frees its pages at once and its slot goes to the next request.

All shapes come from a small set of buckets (powers of two for batch rows, prompt length and
page-table width), so a new request whose sizes fall in a bucket already seen never recompiles.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import threading
import time

import jax
import numpy as np

from jaxinfer import model as model_lib
from jaxinfer.config import ModelConfig
from jaxinfer.errors import InvalidRequestError
from jaxinfer.kv_cache import SCRATCH_PAGE, Batch, KVCache, PageAllocator, pages_needed
from jaxinfer.sampling import SamplingBatch, SamplingParams, sample

# ----------------------------------------------------------------------------------------------
# Compilation counting: every XLA backend compile in this process, however it was triggered.

_compile_count = 0
_compile_lock = threading.Lock()


def _on_event(name: str, *args, **kwargs):
    global _compile_count
    if name == "/jax/core/compile/backend_compile_duration":
        with _compile_lock:
            _compile_count += 1


jax.monitoring.register_event_duration_secs_listener(_on_event)


def num_compiles() -> int:
    """XLA compilations so far in this process (the test for "no recompiles" reads this)."""
    return _compile_count


def _forward_and_sample(params, cache, batch, sampling, *, cfg):
    logits, cache = model_lib.forward(params, cache, batch, cfg=cfg)
    return sample(logits, sampling), cache


# The engine runs the model and the sampler as ONE jitted program per step: one dispatch, and the
# [B, V] logits never leave the device. `prefill` / `decode_step` stay the public functional API.
_step_fn = jax.jit(_forward_and_sample, static_argnames=("cfg",), donate_argnames=("cache",))


def bucket(n: int, *, minimum: int = 1, maximum: int | None = None) -> int:
    """Smallest power of two >= max(n, minimum), clipped to maximum."""
    b = max(minimum, 1 << max(0, (n - 1).bit_length()))
    return min(b, maximum) if maximum is not None else b


@dataclasses.dataclass(eq=False)
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    arrival_time: float = dataclasses.field(default_factory=time.perf_counter)
    output_ids: list[int] = dataclasses.field(default_factory=list)
    pages: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    first_token_time: float | None = None
    token_times: list[float] = dataclasses.field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def context_len(self) -> int:
        """Tokens whose K/V are in the cache once the last generated token is fed back."""
        return len(self.prompt_ids) + len(self.output_ids)


class Engine:
    """Owns the parameters, the KV cache and the scheduler; `step()` advances every request."""

    def __init__(
        self,
        cfg: ModelConfig,
        params,
        *,
        max_model_len: int,
        page_size: int = 16,
        num_kv_pages: int,
        max_num_seqs: int = 32,
        max_num_batched_tokens: int = 2048,
    ):
        if page_size < 1 or page_size & (page_size - 1):
            raise InvalidRequestError(f"page_size must be a power of two >= 1, got {page_size}")
        if max_num_seqs < 1:
            raise InvalidRequestError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        self.cfg = cfg
        self.params = params
        self.max_model_len = max_model_len
        self.page_size = page_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max(max_num_batched_tokens, 16)
        self.max_pages_per_seq = pages_needed(max_model_len, page_size)
        self.allocator = PageAllocator(num_kv_pages)
        self.cache = KVCache.create(cfg, num_pages=num_kv_pages, page_size=page_size)
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self._ids = itertools.count()

    # -- requests ---------------------------------------------------------------------------

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raises InvalidRequestError (naming the field and limit) if the request cannot run."""
        if not prompt_ids:
            raise InvalidRequestError("prompt is empty: it must hold at least one token")
        if len(prompt_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {len(prompt_ids)} tokens; the limit is max_model_len - 1 = {self.max_model_len - 1}"
            )
        bad = [t for t in prompt_ids if not (0 <= t < self.cfg.vocab_size)]
        if bad:
            raise InvalidRequestError(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.cfg.vocab_size})")
        need = pages_needed(self._reserved_tokens(len(prompt_ids), params), self.page_size)
        if need > self.allocator.capacity:
            raise InvalidRequestError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) needs {need} KV pages; "
                f"the cache has {self.allocator.capacity}: lower max_tokens or raise num_kv_pages"
            )

    def add_request(
        self, prompt_ids: list[int], params: SamplingParams, *, request_id: str | None = None, seed: int | None = None
    ) -> Request:
        self.validate(prompt_ids, params)
        if seed is None:
            seed = params.seed if params.seed is not None else int(np.random.randint(0, 2**32, dtype=np.uint64))
        req = Request(
            request_id=request_id or str(next(self._ids)), prompt_ids=list(prompt_ids), params=params, seed=seed
        )
        self.waiting.append(req)
        return req

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _reserved_tokens(self, prompt_len: int, params: SamplingParams) -> int:
        # The last generated token is never fed back, so it needs no cache slot.
        return min(prompt_len + params.max_tokens - 1, self.max_model_len)

    # -- scheduling -------------------------------------------------------------------------

    def _admit(self) -> list[Request]:
        admitted: list[Request] = []
        longest = 0
        while self.waiting and len(self.running) + len(admitted) < self.max_num_seqs:
            req = self.waiting[0]
            longest_next = max(longest, len(req.prompt_ids))
            rows = bucket(len(admitted) + 1)
            if admitted and rows * bucket(longest_next, minimum=16) > self.max_num_batched_tokens:
                break
            need = pages_needed(self._reserved_tokens(len(req.prompt_ids), req.params), self.page_size)
            if need > self.allocator.num_free:
                break
            self.waiting.popleft()
            req.pages = self.allocator.allocate(need)
            admitted.append(req)
            longest = longest_next
        return admitted

    def step(self) -> list[Request]:
        """Runs one prefill or decode step. Returns the requests that finished in it."""
        admitted = self._admit()
        if admitted:
            self.running.extend(admitted)
            rows, decoding = admitted, False
            q_lens = [len(r.prompt_ids) for r in rows]
            t = bucket(max(q_lens), minimum=16, maximum=bucket(self.max_model_len))
            tokens = [r.prompt_ids for r in rows]
        elif self.running:
            rows, decoding = self.running, True
            q_lens = [1] * len(rows)
            t = 1
            tokens = [[r.output_ids[-1]] for r in rows]
        else:
            return []

        b = bucket(len(rows))
        kv_lens = [r.context_len for r in rows] if decoding else q_lens
        mp = bucket(pages_needed(max(kv_lens), self.page_size), maximum=self.max_pages_per_seq)
        batch = self._batch(rows, tokens, q_lens, kv_lens, b, t, mp)
        sampling = SamplingBatch.from_rows([(r.params, r.seed, len(r.output_ids)) for r in rows], b)
        tokens_out, self.cache = _step_fn(self.params, self.cache, batch, sampling, cfg=self.cfg)
        new_tokens = np.asarray(tokens_out)
        now = time.perf_counter()
        finished = []
        for req, tok in zip(rows, new_tokens[: len(rows)].tolist()):
            self._append(req, tok, now)
            if req.finished:
                finished.append(req)
        if finished:
            self.running = [r for r in self.running if not r.finished]
            for req in finished:
                self.allocator.free(req.pages)
                req.pages = []
        return finished

    def _batch(self, rows, tokens, q_lens, kv_lens, b, t, mp) -> Batch:
        tok = np.zeros((b, t), np.int32)
        q = np.zeros(b, np.int32)
        kv = np.zeros(b, np.int32)
        table = np.full((b, mp), SCRATCH_PAGE, np.int32)
        for i, req in enumerate(rows):
            tok[i, : q_lens[i]] = tokens[i]
            q[i], kv[i] = q_lens[i], kv_lens[i]
            used = pages_needed(kv_lens[i], self.page_size)
            table[i, :used] = req.pages[:used]
        return Batch(tokens=tok, q_lens=q, kv_lens=kv, page_table=table)

    def _append(self, req: Request, token: int, now: float) -> None:
        p = req.params
        if req.first_token_time is None:
            req.first_token_time = now
        req.token_times.append(now)
        if (token in self.cfg.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
            req.finish_reason = "stop"
            return
        req.output_ids.append(token)
        if len(req.output_ids) >= p.max_tokens or req.context_len >= self.max_model_len:
            req.finish_reason = "length"

    def abort(self, req: Request) -> None:
        """Ends a request now and frees its pages (finish reason 'abort')."""
        if req.finished:
            return
        req.finish_reason = "abort"
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.running:
            self.running.remove(req)
            self.allocator.free(req.pages)
            req.pages = []
