"""The host-side scheduler: which tokens of which sequences run in the next step.

Every step gets a token budget (`max_num_batched_tokens`). Running sequences come first, oldest
first: a sequence in decode costs one token; a sequence still working through its prompt gets the
next chunk of it (chunked prefill), so a long prompt never stalls the running streams for more
than one chunk. Chunks are cut to fit the padded shape of the prompt-chunk call rather than padded
up to it (see `_chunk_length`). Waiting sequences are admitted with what budget, sequence slots and
KV pages remain. Pages are allocated as a sequence grows, never reserved ahead.

When a running sequence needs a page and none is free, the most recently admitted running
sequence is preempted: its pages are released and it goes back to the front of the queue, to be
recomputed from its tokens (prompt + what it has generated) when there is room again. Recomputing
gives the same K/V, so its output is unchanged.

Prefix caching: a sequence's full pages are registered under a digest of all tokens up to the end
of the page. A newly admitted sequence walks its prompt page by page and takes every page already
cached (shared read-only, reference counted) instead of computing it. The n samples of one request
share their prompt this way: while one of them computes the prompt's full pages, the others wait for
them at the head of the queue rather than computing the same pages again.

Sliding windows: when every layer of the model attends only to a window of W keys, a page whose
tokens all lie more than W - 1 positions before the next token to compute is never read again. It
goes back to the pool (or, if the prefix cache holds it, becomes evictable) and its entry in the
sequence's table becomes the scratch page, which attention masks: a long windowed sequence holds
about W / page_size + 1 pages, not one per page of its length.

Hybrid models (global layers interleaved with sliding-window ones: Gemma 2/3) have two page groups,
each with its own pool: the global layers' pages are kept for the sequence's life, the windowed
layers' pages are given back as above. A sequence holds pages in every group; growing it takes
pages from each (or none, if any is short), a prefix hit needs its pages cached in each (the
windowed group: only the ones its window reaches), and preemption frees them all.

The output is a `StepPlan`: plain host data. The engine turns it into device arrays; on several
hosts the leader broadcasts it so every process runs the same step.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import time

import numpy as np

from jaxinfer.kv_cache import SCRATCH_PAGE, PagePool, page_hash, pages_needed
from jaxinfer.sampling import SamplingParams

# Padding a prompt chunk may carry before it is cut to the bucket below: about what one more call
# costs (on 2 Zen 5 cores the 150M model's prompt calls take ~12 ms + ~0.47 ms per padded token, so
# one call is worth ~25 tokens; 2026-11-28, shapes (1, 16) to (4, 128)).
_MAX_CHUNK_PADDING = 32


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass
class PageGroup:
    """Layers whose K/V share one page pool, and how far back they attend (None: the whole context)."""

    pool: PagePool
    window: int | None = None


@dataclasses.dataclass(eq=False)
class GroupPages:
    """A sequence's pages in one group's pool: entry i holds positions [i * S, (i + 1) * S)."""

    pages: list[int] = dataclasses.field(default_factory=list)
    num_dropped: int = 0  # leading pages given back as they left the sliding window (entries: scratch)


@dataclasses.dataclass(eq=False)
class Sequence:
    """One generated sample: its tokens (prompt then output), pages and progress."""

    seq_id: int
    request_id: str
    index: int  # which of the request's n samples
    params: SamplingParams
    seed: int
    tokens: list[int]
    prompt_len: int
    arrival_time: float = dataclasses.field(default_factory=time.perf_counter)
    status: SeqStatus = SeqStatus.WAITING
    groups: list[GroupPages] = dataclasses.field(default_factory=list)  # one per page group (Scheduler.add)
    num_computed: int = 0  # tokens whose K/V are in the cache
    num_keyed: int = 0  # leading pages it holds that are in the prefix cache (taken from it or registered)
    digests: list[bytes] = dataclasses.field(default_factory=list)  # prefix digests of its tokens' full pages
    salt: bytes = b""  # the parent digest of its first page: kv_cache.salt_digest(its request's cache_salt)
    bad_words: tuple[tuple[int, ...], ...] = ()  # its params' bad_words as token ids (Engine.bad_word_ids)
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it (not EOS)
    first_scheduled_time: float | None = None  # when it first left the queue (a preemption does not reset it)
    first_token_time: float | None = None
    last_token_time: float | None = None
    detok: object = None  # IncrementalDetokenizer, owned by the engine
    logprobs: list | None = None  # Logprob per output token, when asked for
    # Logprob of each prompt token after the first, when asked for (a request's sample 0 only): the
    # positions filed so far, in order. While some position is neither filed nor computed
    # (`pending_prompt_logprobs`), the sequence reads nothing from the prefix cache and takes no
    # one-token chunk (a decode call's logits are the sampler's alone), so every position is
    # computed by a prompt-chunk call that returns them.
    prompt_logprobs: list | None = None
    siblings: list = dataclasses.field(default_factory=list)  # the request's n samples (this one included)
    # Its last token is a placeholder: the token a step still running on the device sampled, read
    # after the next step is dispatched (the engine's async scheduling). Only a running sequence in
    # decode has one, and only between steps; the engine replaces it before anything reads it.
    ahead: bool = False
    _array: np.ndarray = dataclasses.field(default_factory=lambda: np.empty(0, np.int32), repr=False)
    _array_len: int = dataclasses.field(default=0, repr=False)

    def token_array(self) -> np.ndarray:
        """`tokens` as int32 (a view into a buffer that grows by doubling). Tokens are only ever appended
        (a placeholder taken off is forgotten here too), so each call copies only the new ones: the
        sampler's penalty history reads every row's whole context each step, and converting the list
        each time cost ~2.5 ms per step at 32 rows x 4k tokens."""
        n = len(self.tokens)
        if n > len(self._array):
            grown = np.empty(max(64, 2 * n), np.int32)
            grown[: self._array_len] = self._array[: self._array_len]
            self._array = grown
        if n > self._array_len:
            self._array[self._array_len : n] = self.tokens[self._array_len :]
            self._array_len = n
        return self._array[:n]

    @property
    def pending_prompt_logprobs(self) -> bool:
        """Whether some prompt position still needs a call that returns its log-probabilities: one
        neither filed nor computed by a call already dispatched (a step run ahead files them when
        it is read)."""
        if self.prompt_logprobs is None:
            return False
        return max(len(self.prompt_logprobs), self.num_computed) < self.prompt_len - 1

    @property
    def pages(self) -> list[int]:
        """Its pages in the first group's pool (every layer's, unless the model is hybrid)."""
        return self.groups[0].pages

    @property
    def num_dropped(self) -> int:
        return self.groups[0].num_dropped

    def drop_placeholder(self) -> None:
        """Takes off the placeholder of a token still on the device (see `ahead`), if it has one."""
        if self.ahead:
            self.tokens.pop()
            self._array_len = min(self._array_len, len(self.tokens))  # the real token replaces it there too
            self.ahead = False

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.prompt_len : len(self.tokens) - self.ahead]  # never the placeholder

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED


@dataclasses.dataclass(frozen=True)
class Chunk:
    """Tokens [start, start + length) of `seq` run this step; `samples` if the last one yields a token."""

    seq: Sequence
    start: int
    length: int

    @property
    def samples(self) -> bool:
        return self.start + self.length == len(self.seq.tokens)


@dataclasses.dataclass
class StepPlan:
    prefill: list[Chunk]  # chunks of more than one token
    decode: list[Chunk]  # single-token chunks (decode, or the last token of a prompt)

    @property
    def empty(self) -> bool:
        return not self.prefill and not self.decode


class Scheduler:
    """Args:
    groups: the page groups, one pool each: one for most models; a hybrid model's global layers,
        then its sliding-window layers.
    """

    def __init__(
        self,
        *,
        groups: list[PageGroup],
        page_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_prefill_tokens: int,
    ):
        self.groups = groups
        self.enable_prefix_cache = groups[0].pool.enable_prefix_cache  # every group's setting
        self.page_size = page_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # Padded tokens of one prefill call at most (rows bucket x length bucket).
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []  # admission order
        self.num_preemptions = 0
        self.prefix_cache_hit_tokens = 0
        # Per group: pages handed to a sequence since the engine last looked (poisoning).
        self.new_pages: list[list[int]] = [[] for _ in self.groups]

    def add(self, seq: Sequence) -> None:
        if not seq.groups:
            seq.groups = [GroupPages() for _ in self.groups]
        self.waiting.append(seq)

    # -- pages ------------------------------------------------------------------------------

    def _release(self, seq: Sequence) -> None:
        for group, held in zip(self.groups, seq.groups):
            group.pool.release(held.pages[held.num_dropped :])
            held.pages, held.num_dropped = [], 0
        seq.num_keyed = 0

    def _drop_out_of_window(self, seq: Sequence) -> None:
        """Gives back seq's pages that lie wholly before the window of its next token to compute."""
        for group, held in zip(self.groups, seq.groups):
            if group.window is None:
                continue
            end = min(self._window_start(group, seq.num_computed), len(held.pages))
            if end > held.num_dropped:
                group.pool.release(held.pages[held.num_dropped : end])
                held.pages[held.num_dropped : end] = [SCRATCH_PAGE] * (end - held.num_dropped)
                held.num_dropped = end

    def _grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Gives `seq` enough pages in every group for `num_tokens` tokens; False (and none taken) if
        any group's pool is short."""
        want = pages_needed(num_tokens, self.page_size)
        needs = [want - len(held.pages) for held in seq.groups]
        if any(need > group.pool.num_free for group, need in zip(self.groups, needs)):
            return False
        for group, held, need, new in zip(self.groups, seq.groups, needs, self.new_pages):
            if need > 0:
                pages = group.pool.allocate(need)
                held.pages += pages
                new += pages
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._requeue(seq)
        self.num_preemptions += 1

    def _requeue(self, seq: Sequence) -> None:
        """Back to the head of the queue with no pages, to compute from its first token again."""
        self._release(seq)
        seq.num_computed = 0
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)

    def recompute_all(self) -> None:
        """The KV cache was lost (a device failure): every sequence gives its pages back and starts
        over from its first token, as after a preemption (not counted as one), and the prefix cache
        forgets every page."""
        for seq in reversed(self.running):
            self._requeue(seq)
        self.running.clear()
        for seq in self.waiting:  # holding nothing between steps, unless a step failed mid-schedule
            self._release(seq)
            seq.num_computed = 0
        for group in self.groups:
            group.pool.forget_cached()

    def _reuse_prefix(self, seq: Sequence) -> None:
        """Takes the cached pages that hold this sequence's leading full pages.

        With a sliding window only the pages the next token's window reaches are needed: a hit on
        the first k pages needs pages (k * S - W + 1) // S .. k - 1 cached, not the ones before (the
        digests chain every earlier token, so a hit still means the whole prefix matched). That
        matters because a windowed sequence gives its earliest pages back first, so they are also
        the first evicted. With several groups, a hit needs its pages in every group's pool."""
        s = self.page_size
        # Always leave at least one token to compute: it produces the logits to sample from.
        hit = (len(seq.tokens) - 1) // s if self.enable_prefix_cache and not seq.pending_prompt_logprobs else 0
        for group in self.groups:  # the whole-context groups: their longest cached run from page 0
            if group.window is None:
                n = 0
                while n < hit and group.pool.contains(self._digest(seq, n)):
                    n += 1
                hit = n
        windowed = [g for g in self.groups if g.window is not None]
        cached = [[g.pool.contains(self._digest(seq, i)) for i in range(hit)] for g in windowed]
        while hit > 0 and not all(all(c[self._first_needed(g, hit) : hit]) for g, c in zip(windowed, cached)):
            hit -= 1
        for group, held in zip(self.groups, seq.groups):
            first = self._first_needed(group, hit) if hit else 0
            held.pages = [SCRATCH_PAGE] * first + [group.pool.lookup(self._digest(seq, i)) for i in range(first, hit)]
            held.num_dropped = first
        seq.num_keyed = hit
        seq.num_computed = hit * s
        self.prefix_cache_hit_tokens += seq.num_computed

    def _first_needed(self, group: PageGroup, hit: int) -> int:
        """The first of a hit's `hit` pages a group needs: its window's start (page hit - 1 at least:
        it proves the match), or 0."""
        return min(self._window_start(group, hit * self.page_size), hit - 1) if group.window is not None else 0

    def most_pages_held(self, num_tokens: int, group: PageGroup | None = None) -> int:
        """The most pages a sequence of num_tokens tokens holds at once in a group (default: the
        first): all of them, or with a sliding window those from its window's start to the end of
        its largest chunk."""
        group = self.groups[0] if group is None else group
        return most_pages_held(
            num_tokens, window=group.window, page_size=self.page_size, max_prefill_tokens=self.max_prefill_tokens
        )

    def _window_start(self, group: PageGroup, position: int) -> int:
        """The first page the group's window of the token at `position` reaches (0 without a window)."""
        return 0 if group.window is None else max(position - group.window + 1, 0) // self.page_size

    def _sibling_computing_prefix(self, seq: Sequence) -> bool:
        """True while another sample of seq's request is computing pages seq could share: full pages
        of the tokens the two have in common (the prompt, and any output they drew alike; a sample
        preempted after it generated shares none of its own tokens with the others otherwise)."""
        if not self.enable_prefix_cache:
            return False
        for s in seq.siblings:
            if s is seq or s.status is not SeqStatus.RUNNING:
                continue
            common, end = seq.prompt_len, min(len(seq.tokens) - 1, len(s.tokens))
            while common < end and seq.tokens[common] == s.tokens[common]:
                common += 1
            if s.num_computed < min(common, end) // self.page_size * self.page_size:
                return True
        return False

    def register_full_pages(self, seq: Sequence) -> None:
        """After a step: offers the sequence's newly completed full pages to the prefix cache."""
        if not self.enable_prefix_cache:
            return
        full = seq.num_computed // self.page_size
        for group, held in zip(self.groups, seq.groups):
            for i in range(max(seq.num_keyed, held.num_dropped), full):
                group.pool.register(held.pages[i], self._digest(seq, i))
        seq.num_keyed = max(seq.num_keyed, full)

    def _digest(self, seq: Sequence, i: int) -> bytes:
        """Prefix-cache key of seq's page i (full). Tokens are only ever appended, so a sequence's keys
        never change: each is computed once, not again for every step a blocked queue head retries."""
        s = self.page_size
        while len(seq.digests) <= i:
            j = len(seq.digests)
            seq.digests.append(page_hash(seq.digests[-1] if seq.digests else seq.salt, seq.tokens[j * s : (j + 1) * s]))
        return seq.digests[i]

    # -- scheduling -------------------------------------------------------------------------

    def schedule(self, hold: frozenset[Sequence] | set[Sequence] = frozenset()) -> StepPlan:
        """The next step's chunks. `hold`: running sequences to leave out of this step (they keep
        their pages): the engine's, whose token still on the device is their last."""
        budget = self.max_num_batched_tokens
        decode: list[Chunk] = []
        prefill: list[Chunk] = []
        preempted: list[Sequence] = []

        # Running sequences: decode first (cheap, latency-critical), then prompt chunks, oldest first.
        order = sorted(self.running, key=lambda q: (len(q.tokens) - q.num_computed > 1,))
        for seq in order:
            if seq.status is not SeqStatus.RUNNING or budget <= 0 or seq in hold:
                continue
            owes = seq.pending_prompt_logprobs  # then even one token runs in the prompt-chunk call
            n = self._chunk_length(
                min(len(seq.tokens) - seq.num_computed, budget, self.max_prefill_tokens), prefill, prompt_call=owes
            )
            if n == 0:
                continue  # its next chunk runs next step
            self._drop_out_of_window(seq)
            while not self._grow(seq, seq.num_computed + n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING:
                continue
            (prefill if n > 1 or owes else decode).append(Chunk(seq, seq.num_computed, n))
            budget -= n

        # Waiting sequences, first come first served; none in a step that had to preempt.
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.num_computed == 0 and not seq.groups[0].pages:
                if self._sibling_computing_prefix(seq):
                    break
                self._reuse_prefix(seq)
                self._drop_out_of_window(seq)
            remaining = len(seq.tokens) - seq.num_computed
            owes = seq.pending_prompt_logprobs
            n = self._chunk_length(min(remaining, budget, self.max_prefill_tokens), prefill, prompt_call=owes)
            if n == 0 or not self._grow(seq, seq.num_computed + n):
                # Not admitted this step: a waiting sequence holds no pages, or preemption could not
                # reclaim them (it only sees running ones) and the engine could wedge. The prefix
                # pages go back to the cache and are looked up again next time.
                self.prefix_cache_hit_tokens -= seq.num_computed
                self._release(seq)
                seq.num_computed = 0
                break
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.perf_counter()
            self.running.append(seq)
            (prefill if n > 1 or owes else decode).append(Chunk(seq, seq.num_computed, n))
            budget -= n

        # A preempted sequence may have been scheduled before it was chosen as a victim.
        decode = [c for c in decode if c.seq.status is SeqStatus.RUNNING]
        prefill = [c for c in prefill if c.seq.status is SeqStatus.RUNNING]
        return StepPlan(prefill=prefill, decode=decode)

    def _chunk_length(self, n: int, prefill: list[Chunk], *, prompt_call: bool) -> int:
        """How many of a sequence's next n prompt tokens to compute this step (0: none this step).
        `prompt_call`: the chunk joins the prompt-chunk call even at one token (its prompt logprobs
        are pending), so it has to fit that call's shape like any other.

        A prompt-chunk call costs its padded shape (rows and length rounded up to powers of two), so
        chunks are cut to fit the shape instead of the shape growing around them. The first chunk of
        a step that its bucket would pad by more than _MAX_CHUNK_PADDING tokens is cut to the power
        of two below (200 tokens: 128 now, then 64 and 8, computing 208 instead of 256). A further
        chunk takes at most the first one's bucket, and joins only if the call stays at least 3/4
        real tokens.
        """
        if n == 0 or (n == 1 and not prompt_call):
            return n  # a single token goes to the decode call
        if not prefill:
            if bucket(n, minimum=16) - n > _MAX_CHUNK_PADDING:
                n = pow2_floor(n)
            return n
        length = bucket(max(c.length for c in prefill), minimum=16)
        n = min(n, length)
        shape = bucket(len(prefill) + 1) * length
        real = sum(c.length for c in prefill) + n
        return n if shape <= self.max_prefill_tokens and 4 * real >= 3 * shape else 0

    def finish(self, seq: Sequence, reason: str) -> None:
        """Ends a sequence (any state) and releases its pages."""
        if seq.finished:
            return
        seq.finish_reason = reason
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED
        self._release(seq)


def most_pages_held(num_tokens: int, *, window: int | None, page_size: int, max_prefill_tokens: int) -> int:
    """The most pages a sequence of num_tokens tokens holds at once: all of them, or with a sliding
    window of W keys those from its window's start to the end of its largest chunk."""
    need = pages_needed(num_tokens, page_size)
    if window is None:
        return need
    return min(need, (window - 1 + max_prefill_tokens) // page_size + 2)


def bucket(n: int, *, minimum: int = 1, maximum: int | None = None) -> int:
    """Smallest power of two >= max(n, minimum), clipped to maximum: the shape buckets of every step."""
    b = max(minimum, 1 << max(0, (n - 1).bit_length()))
    return min(b, maximum) if maximum is not None else b


def pow2_floor(n: int) -> int:
    """Largest power of two <= n (n >= 1)."""
    return 1 << (n.bit_length() - 1)


def decode_bucket(n: int, *, rows_multiple: int = 1) -> int:
    """Rows of a single-token (decode) call: a power of two, and above 16 also three quarters of
    one (24, 48, 96, 192, ...) when that divides by `rows_multiple` (a mesh's `data` axis: rows it
    cannot split would run whole on every replica).

    A large decode batch is compute-bound where the matmuls are (CPUs), and a padding row costs what
    a real one does: on the 2-core CPU a 150M model's decode step took 57 ms at 48 rows and 77 ms at
    64, and `jaxinfer bench throughput` (47.5 decode rows a step on average) went from 5.62x to 6.05x.
    Each doubling of max_num_seqs past 16 adds one bucket, compiled in the warm-up: its decode
    shapes (one per page-table width) and samplers, 24 more compilations there (66 s -> 80 s).
    Multiples of 8 past 16 (20, 28, 40, 56, ...) gained nothing more for twice the compilations."""
    b = bucket(n)
    three_quarters = 3 * b // 4
    if b > 16 and n <= three_quarters and three_quarters % rows_multiple == 0:
        return three_quarters
    return b
