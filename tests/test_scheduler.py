"""The scheduler and page pools alone, through thousands of random steps (no model, no device).

A stand-in for the engine runs each StepPlan the way the model would touch the cache and remembers,
for every slot of every page, whose K/V it wrote there: the slot at position p of a sequence holds
(its cache salt, its tokens up to and including p), since a transformer's K/V at p depend on exactly
those. Before a chunk runs, every key it attends to must hold its own sequence's identity - a
prefix page shared between requests, a page recomputed after a preemption and a page reused after
another request freed it all have to pass the same check - and every slot it writes must be in a
page that nobody else holds and the prefix cache does not offer. Between steps the reference counts
must equal the holders the sequences list, and at the end every page must be free again.

The engine's own tests run a model through the same situations (tests/test_engine.py); this one
reaches far more interleavings of arrivals, n > 1 samples, prompt logprobs, cache salts, aborts,
preemptions, evictions, sliding windows and lost caches than a model run could in the same seconds.
"""

import collections
import dataclasses

import numpy as np
import pytest

from jaxinfer.capacity import prefill_token_limit
from jaxinfer.kv_cache import SCRATCH_PAGE, PagePool, salt_digest
from jaxinfer.sampling import SamplingParams
from jaxinfer.scheduler import PageGroup, Scheduler, SeqStatus, Sequence, bucket


@dataclasses.dataclass(frozen=True)
class Setup:
    page_size: int = 8
    num_pages: int = 40  # the (first) pool's pages, scratch included
    window: int | None = None  # every layer's sliding window (hybrid=False) or the windowed layers'
    hybrid: bool = False  # global layers in the first pool, windowed layers in a second one
    num_window_pages: int = 12
    prefix_cache: bool = True
    max_num_seqs: int = 6
    max_num_batched_tokens: int = 64
    max_model_len: int = 160


SETUPS = {
    "tight": Setup(),  # preempts often
    "roomy": Setup(page_size=16, num_pages=200, max_num_seqs=16, max_num_batched_tokens=256),
    "no-prefix-cache": Setup(prefix_cache=False),
    "window": Setup(window=20, num_pages=16),  # Mistral v0.1: every layer windowed
    "hybrid": Setup(window=20, hybrid=True, num_pages=60),  # Gemma 2/3: two pools
    "tiny-budget": Setup(max_num_batched_tokens=16, max_num_seqs=3, num_pages=24),
    # Not a power of two: a prompt-chunk call's padded shape may reach 32 tokens only, fewer than a
    # step's 48, so fitting the call is the chunk's own check, not a consequence of the budget.
    "odd-budget": Setup(max_num_batched_tokens=48, max_num_seqs=5),
}


def _identity(seq: Sequence, position: int) -> tuple:
    """What the K/V written at `position` of `seq` depend on: its salt and every token up to there."""
    return seq.salt, tuple(seq.tokens[: position + 1])


class Driver:
    """Runs a scheduler's plans as the engine would (synchronously: no step runs ahead), checking
    every read and write of the cache and the page accounting."""

    def __init__(self, setup: Setup, rng: np.random.Generator, scheduler: type[Scheduler] = Scheduler):
        self.setup, self.rng = setup, rng
        s = setup
        window_all = None if s.hybrid else s.window
        self.groups = [PageGroup(PagePool(s.num_pages, enable_prefix_cache=s.prefix_cache), window=window_all)]
        if s.hybrid:
            pool = PagePool(s.num_window_pages, enable_prefix_cache=s.prefix_cache)
            self.groups.append(PageGroup(pool, window=s.window))
        self.max_prefill_tokens = prefill_token_limit(s.max_num_batched_tokens, s.max_model_len)
        self.sched = scheduler(
            groups=self.groups,
            page_size=s.page_size,
            max_num_seqs=s.max_num_seqs,
            max_num_batched_tokens=s.max_num_batched_tokens,
            max_prefill_tokens=self.max_prefill_tokens,
        )
        self.slots = [collections.defaultdict(dict) for _ in self.groups]  # group -> page -> slot -> identity
        self.requests: list[list[Sequence]] = []
        self.counts = collections.Counter()
        self._ids = 0

    # -- requests -----------------------------------------------------------------------------

    def add_request(self, stems: list[list[int]]) -> bool:
        """A random request (a prompt that often starts with one of `stems`); False if the pools
        could never hold it (the engine refuses those)."""
        rng, s = self.rng, self.setup
        stem = stems[rng.integers(len(stems))]
        head = stem[: rng.integers(len(stem) + 1)] if rng.random() < 0.7 else []
        tail = rng.integers(3, 7, size=rng.integers(0 if head else 1, 40)).tolist()  # 4 ids: accidental hits too
        prompt = (head + tail)[: s.max_model_len - 1]
        max_tokens = int(rng.integers(1, 40))
        length = min(len(prompt) + max_tokens, s.max_model_len)
        if any(self.sched.most_pages_held(length, g) > g.pool.capacity for g in self.groups):
            return False
        n = int(rng.choice([1, 1, 2, 3]))
        params = SamplingParams(max_tokens=max_tokens, n=n, prompt_logprobs=1 if rng.random() < 0.15 else None)
        salt = salt_digest(rng.choice([None, None, "tenant-a", "tenant-b"]))
        seqs: list[Sequence] = []
        for i in range(n):
            self._ids += 1
            seq = Sequence(
                seq_id=self._ids,
                request_id=str(len(self.requests)),
                index=i,
                params=params,
                seed=i,
                tokens=list(prompt),
                prompt_len=len(prompt),
                salt=salt,
            )
            seq.prompt_logprobs = [] if params.prompt_logprobs is not None and i == 0 else None
            seq.siblings = seqs
            seqs.append(seq)
            self.sched.add(seq)
        self.requests.append(seqs)
        return True

    def abort_one(self) -> None:
        live = [r for r in self.requests if not all(q.finished for q in r)]
        if live:
            for seq in live[self.rng.integers(len(live))]:
                self.sched.finish(seq, "abort")
            self.counts["aborts"] += 1

    def lose_the_cache(self) -> None:
        """A failed step: every sequence starts over, the prefix cache forgets, the contents are gone."""
        self.sched.recompute_all()
        self.sched.new_pages = [[] for _ in self.groups]
        self.slots = [collections.defaultdict(dict) for _ in self.groups]
        self.counts["lost caches"] += 1

    @property
    def unfinished(self) -> bool:
        return bool(self.sched.running or self.sched.waiting)

    # -- one step -----------------------------------------------------------------------------

    def step(self) -> None:
        sched, s = self.sched, self.setup
        hits_before, preemptions_before = sched.prefix_cache_hit_tokens, sched.num_preemptions
        # The engine leaves out of a step the sequences whose token still on the device ends them
        # (async scheduling); any running sequence may be held here, and keeps its pages meanwhile.
        hold = {q for q in sched.running if self.rng.random() < 0.05}
        plan = sched.schedule(hold)
        self.counts["prefix hit tokens"] += sched.prefix_cache_hit_tokens - hits_before
        self.counts["preemptions"] += sched.num_preemptions - preemptions_before
        # Freshly allocated pages hold whatever was there: forget it (the engine may poison them).
        for slots, new in zip(self.slots, sched.new_pages):
            for page in new:
                slots.pop(page, None)
            new.clear()
        if self.unfinished and not hold:
            assert not plan.empty, "the scheduler made no progress"
        chunks = plan.prefill + plan.decode
        assert len({id(c.seq) for c in chunks}) == len(chunks), "a sequence twice in one step"
        assert sum(c.length for c in chunks) <= s.max_num_batched_tokens
        assert len(sched.running) <= s.max_num_seqs
        assert all(c.length == 1 and not c.seq.pending_prompt_logprobs for c in plan.decode)
        if plan.prefill:
            t = bucket(max(c.length for c in plan.prefill), minimum=16)
            assert bucket(len(plan.prefill)) * t <= self.max_prefill_tokens
        for c in chunks:
            assert c.seq.status is SeqStatus.RUNNING and c.start == c.seq.num_computed and c.seq not in hold
            assert c.length >= 1 and c.start + c.length <= len(c.seq.tokens)
            self._check_reads(c.seq, c.start)
        for c in chunks:
            self._write(c.seq, c.start, c.length)
        for c in chunks:
            self._finish_chunk(c, prompt_call=c in plan.prefill)
        self._check_accounting()

    def _page(self, g: int, seq: Sequence, position: int) -> int:
        pages = seq.groups[g].pages
        assert position // self.setup.page_size < len(pages), (seq.seq_id, position, "no page for it")
        page = pages[position // self.setup.page_size]
        assert page != SCRATCH_PAGE, (seq.seq_id, position, "the scratch page")
        return page

    def _check_reads(self, seq: Sequence, start: int) -> None:
        """The keys before the chunk that its queries attend to hold this sequence's K/V."""
        for g, group in enumerate(self.groups):
            first = 0 if group.window is None else max(0, start - group.window + 1)
            for p in range(first, start):
                page = self._page(g, seq, p)
                got = self.slots[g][page].get(p % self.setup.page_size)
                assert got == _identity(seq, p), (seq.seq_id, g, p, page, "reads K/V that are not its own")

    def _write(self, seq: Sequence, start: int, length: int) -> None:
        for g, group in enumerate(self.groups):
            for p in range(start, start + length):
                page = self._page(g, seq, p)
                assert group.pool.refcount(page) == 1, (seq.seq_id, p, page, "writes a page others hold")
                assert page not in group.pool._hash_of, (seq.seq_id, p, page, "writes a page the prefix cache offers")
                self.slots[g][page][p % self.setup.page_size] = _identity(seq, p)

    def _finish_chunk(self, chunk, *, prompt_call: bool) -> None:
        """What the engine does with a chunk's results: prompt logprobs filed, pages offered to the
        prefix cache, a token sampled, length and random stops."""
        seq, sched = chunk.seq, self.sched
        if seq.finished:
            return
        filed = seq.prompt_logprobs
        if prompt_call and filed is not None and len(filed) < seq.prompt_len - 1:
            assert chunk.start <= len(filed), (seq.seq_id, "prompt positions skipped")
            filed.extend([None] * (min(chunk.start + chunk.length, seq.prompt_len - 1) - len(filed)))
        seq.num_computed += chunk.length
        sched.register_full_pages(seq)
        if not chunk.samples:
            return
        seq.tokens.append(int(self.rng.integers(3, 5)))  # two ids: n samples often draw alike
        self.counts["tokens"] += 1
        if len(seq.output_ids) >= seq.params.max_tokens or len(seq.tokens) >= self.setup.max_model_len:
            sched.finish(seq, "length")
        elif self.rng.random() < 0.02:
            sched.finish(seq, "stop")
        if seq.finished and seq.prompt_logprobs is not None:
            assert len(seq.prompt_logprobs) == seq.prompt_len - 1, (seq.seq_id, "prompt logprobs missing")

    def _check_accounting(self) -> None:
        """Each page's reference count is the number of sequences that list it; waiting ones hold none."""
        for g, group in enumerate(self.groups):
            held = collections.Counter()
            for seq in self.sched.running:
                pages = seq.groups[g]
                held.update(p for p in pages.pages[pages.num_dropped :] if p != SCRATCH_PAGE)
            for seq in self.sched.waiting:
                assert not seq.groups[g].pages, (seq.seq_id, "a waiting sequence holds pages")
            pool = group.pool
            for page in range(1, pool.num_pages):
                assert pool.refcount(page) == held[page], (g, page, pool.refcount(page), held[page])
            assert pool.num_free == pool.capacity - len(held)
            self.counts["window pages given back"] += sum(
                seq.groups[g].num_dropped for seq in self.sched.running if group.window is not None
            )


def _run(setup: Setup, seed: int, num_requests: int = 80) -> Driver:
    rng = np.random.default_rng(seed)
    d = Driver(setup, rng)
    stems = [rng.integers(3, 7, size=int(rng.integers(8, 80))).tolist() for _ in range(3)]
    added = 0
    for _ in range(20_000):
        while added < num_requests and rng.random() < 0.35:
            added += d.add_request(stems)
        if rng.random() < 0.03:
            d.abort_one()
        if rng.random() < 0.004:
            d.lose_the_cache()
        if not d.unfinished and added >= num_requests:
            break
        d.step()
    else:
        raise AssertionError(
            f"not done after 20,000 steps: {len(d.sched.running)} running, {len(d.sched.waiting)} waiting"
        )
    for group in d.groups:
        assert group.pool.num_free == group.pool.capacity  # cached pages count as free
    return d


@pytest.mark.parametrize("name", SETUPS)
def test_random_steps_read_only_their_own_kv_and_give_every_page_back(name):
    setup = SETUPS[name]
    totals = collections.Counter()
    for seed in range(6):
        totals += _run(setup, seed).counts
    # The situations this exists for happened (else it checks little).
    assert totals["tokens"] > 1000 and totals["aborts"] > 0 and totals["lost caches"] > 0, totals
    if name in ("tight", "window", "tiny-budget"):
        assert totals["preemptions"] > 0, totals
    if setup.prefix_cache:
        assert totals["prefix hit tokens"] > 0, totals
    else:
        assert totals["prefix hit tokens"] == 0, totals
    if setup.window is not None:
        assert totals["window pages given back"] > 0, totals


def test_the_checks_catch_a_shared_page_written_into():
    """The driver is not vacuous: a scheduler that writes into a page the prefix cache shares fails it."""

    class Leaky(Scheduler):
        def _reuse_prefix(self, seq):
            super()._reuse_prefix(seq)
            if seq.num_computed:  # recompute the last hit page, writing into the shared copy
                seq.num_keyed -= 1
                seq.num_computed -= self.page_size

    d = Driver(SETUPS["roomy"], np.random.default_rng(0), scheduler=Leaky)
    stems = [[5] * 40]
    with pytest.raises(AssertionError, match="writes a page"):
        for _ in range(200):
            d.add_request(stems)
            d.step()
