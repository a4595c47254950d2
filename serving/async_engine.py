"""The engine on its own thread, fed from asyncio: every RPC shares one continuous batch.

The `Engine` is single-threaded by design. `AsyncEngine` gives it a thread that loops: take the
commands the event loop queued (add a request, abort one), run one `step()`, hand each request's
deltas back to the event loop in one `call_soon_threadsafe` per step. RPC handlers only ever
`submit()` and read a `RequestStream`; they never touch the engine.

An abort (client cancel, disconnect, deadline) is a command like any other, taken before the next
step runs: the request stops within one step and its pages go back to the pool.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import queue
import threading
import time

from jaxinfer.engine import Engine
from jaxinfer.llm import StreamDelta
from jaxinfer.sampling import SamplingParams

log = logging.getLogger("jaxinfer.serving")


class QueueFullError(Exception):
    """The admission queue is full; the message says how full and what the limit is."""


class DrainingError(Exception):
    """The server is shutting down and takes no new requests."""


class EngineFailedError(Exception):
    """The engine raised while running this request's step (a bug); the message says what.

    `unavailable`: the job itself is broken (multi-host: a follower died or stopped answering);
    the server answers UNAVAILABLE and stops serving rather than INTERNAL.
    """

    def __init__(self, message: str, *, unavailable: bool = False):
        super().__init__(message)
        self.unavailable = unavailable


class EngineThreadDiedError(Exception):
    """The engine's thread ended on something other than an Exception (SystemExit, say): nothing
    steps the engine any more, so the server stops serving."""


@dataclasses.dataclass
class RequestStream:
    """The consumer side of one request: deltas arrive on `queue`, then None when it is done."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float
    queue: asyncio.Queue
    first_token_time: float | None = None
    completion_tokens: int = 0
    finished: bool = False
    error: Exception | None = None
    finish_reasons: dict[int, str] = dataclasses.field(default_factory=dict)
    interval: int = 1  # deltas are held back until a sample has this many new tokens
    held: dict[int, StreamDelta] = dataclasses.field(default_factory=dict)
    started: set[int] = dataclasses.field(default_factory=set)

    def _offer(self, d: StreamDelta) -> None:
        """Queues `d` for the consumer, or holds it (merged) until the sample has `interval` tokens.

        A sample's first tokens and its end are never held. Holding happens here, on the event loop,
        before the consumer is woken: a held delta costs no coroutine switch and no message.
        """
        if self.interval > 1:
            h = self.held.pop(d.index, None)
            if h is not None:
                d = h.then(d)
            if d.finish_reason is None and len(d.token_ids) < self.interval and d.index in self.started:
                self.held[d.index] = d
                return
            if d.token_ids:
                self.started.add(d.index)
        self.queue.put_nowait(d)

    async def __aiter__(self):
        while True:
            item = await self.queue.get()
            if item is None:
                if self.error is not None:
                    raise self.error
                return
            yield item


class AsyncEngine:
    """Runs `engine` on a daemon thread; `submit`/`abort` are called from the event loop.

    Args:
        engine: the engine (already warmed up, if compilations must not delay requests).
        max_queued: requests admitted beyond the `engine.max_num_seqs` that can run at once;
            `submit` raises QueueFullError past `max_num_seqs + max_queued` requests in flight.
    """

    def __init__(self, engine: Engine, *, max_queued: int = 256, peer_timeout: float | None = None, on_broken=None):
        self.engine = engine
        self.peer_timeout = peer_timeout  # multi-host: longest a step may take before the job counts as broken
        self.on_broken = on_broken  # called on the event loop once, with the error, when the job breaks
        self.broken: Exception | None = None
        self.max_queued = max_queued
        self.max_in_flight = engine.max_num_seqs + max_queued
        self.draining = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # owned by the event loop
        self._ids = itertools.count()
        self._stop = threading.Event()
        self._peer_failed = False  # set on the engine thread when a collective failed
        self._thread = threading.Thread(target=self._run, name="jaxinfer-engine", daemon=True)
        if engine.channel is not None:  # multi-host leader: the followers bound their waits by ours
            engine.channel.peer_timeout = peer_timeout

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread.start()
        if self.peer_timeout is not None:
            self._watchdog = self._loop.create_task(self._watch_steps())

    async def _watch_steps(self) -> None:
        """Multi-host: a wait on the followers (a step, or an idle heartbeat) blocked past
        peer_timeout (a follower hung without dying) breaks the job."""
        from jaxinfer.distributed import PeerFailureError, peer_wait

        while self.broken is None and not self._stop.is_set():
            await asyncio.sleep(min(0.5, self.peer_timeout / 4))
            if peer_wait.seconds() > self.peer_timeout:
                why = f"a step or heartbeat has waited {self.peer_timeout:.0f} s for the other processes"
                self._die(PeerFailureError(why))

    def _break(self, error: Exception) -> None:
        """Event loop: the job is broken for good; new requests get UNAVAILABLE."""
        if self.broken is None:
            self.broken = error
            log.error("the engine is broken for good: %s", error)
            if self.on_broken is not None:
                self.on_broken(error)

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    # -- event-loop side --------------------------------------------------------------------

    def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        request_id: str | None = None,
        interval: int = 1,
        cache_salt: str | None = None,
    ) -> RequestStream:
        """Queues a request for the engine. Raises QueueFullError or DrainingError. The request must
        have passed `Engine.validate` (the server runs it on the event loop): the engine's thread,
        which runs every step, does not pass over the prompt again.

        `interval`: deltas reach the stream once a sample has that many new tokens (see `_offer`).
        `cache_salt`: see `Engine.add_request`.
        """
        if self.broken is not None:
            raise self._failure(self.broken)
        if self.draining:
            raise DrainingError("the server is draining (shutting down) and takes no new requests")
        if len(self._streams) >= self.max_in_flight:
            raise QueueFullError(
                f"the admission queue is full: {len(self._streams)} requests in flight, the limit is "
                f"max_num_seqs ({self.engine.max_num_seqs}) + max_queued_requests ({self.max_queued}); retry later"
            )
        rid = request_id if request_id is not None else f"r{next(self._ids)}"
        if rid in self._streams:
            raise ValueError(f"request id {rid!r} is in flight already")
        stream = RequestStream(
            request_id=rid,
            prompt_ids=prompt_ids,
            params=params,
            arrival=time.perf_counter(),
            queue=asyncio.Queue(),
            interval=interval,
        )
        self._streams[rid] = stream
        self._commands.put(("add", rid, prompt_ids, params, stream.arrival, cache_salt))
        return stream

    def abort(self, stream: RequestStream) -> None:
        """Stops a request within one step and frees its pages (a no-op once it has finished)."""
        if not stream.finished:
            self._commands.put(("abort", stream.request_id))

    async def wait_idle(self, timeout: float) -> bool:
        """Waits until no request is in flight; False if `timeout` seconds passed first."""
        deadline = time.monotonic() + timeout
        while self._streams:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.02)
        return True

    async def shutdown(self) -> None:
        """Aborts whatever is left (each stream ends with finish reason 'abort') and stops the engine
        thread; the event loop keeps running meanwhile, delivering those last messages."""
        for stream in list(self._streams.values()):
            self.abort(stream)
        self._stop.set()
        self._commands.put(("wake",))
        await asyncio.get_running_loop().run_in_executor(None, self._join)

    def _join(self) -> None:
        # A broken multi-host job may have left the thread blocked in a collective that never returns.
        self._thread.join(timeout=30 if self.broken is None else 1)
        if self.broken is not None:
            return
        if self._thread.is_alive():  # multi-host: blocked on a peer that hung after the watch ended
            from jaxinfer.distributed import PeerFailureError

            self.broken = PeerFailureError("at shutdown, the engine's last step or heartbeat never finished")
            return
        if self.engine.channel is None:
            return
        # Multi-host: tell the followers to stop, on a thread of its own: a follower that hung since
        # the last heartbeat would block the broadcast forever.
        closer = threading.Thread(target=self._close_engine, name="jaxinfer-close", daemon=True)
        closer.start()
        closer.join(timeout=self.peer_timeout)
        if closer.is_alive():
            from jaxinfer.distributed import PeerFailureError

            self.broken = PeerFailureError(f"telling the followers to stop waited {self.peer_timeout:.0f} s")

    def _close_engine(self) -> None:
        try:
            self.engine.close()  # multi-host: the followers exit
        except Exception as e:  # a follower died while the job idled (between heartbeats): broken
            from jaxinfer.distributed import PeerFailureError

            log.error("telling the followers to stop failed: %s: %s", type(e).__name__, str(e).splitlines()[0][:300])
            self.broken = PeerFailureError(f"telling the followers to stop failed ({type(e).__name__})")

    def _deliver(self, batch: list[tuple[str, object]]) -> None:
        """Runs on the event loop: routes one step's deltas (or a failure) to their streams."""
        now = time.perf_counter()
        for rid, item in batch:
            stream = self._streams.get(rid)
            if stream is None:
                continue
            if isinstance(item, StreamDelta):
                # The first token may be a stop token, which ends the sample without being sent; it
                # was made all the same (the engine's TTFT counts it too). An abort made nothing.
                made = item.token_ids or item.finish_reason not in (None, "abort")
                if made and stream.first_token_time is None:
                    stream.first_token_time = now
                stream.completion_tokens += len(item.token_ids)
                if item.finish_reason is not None:
                    stream.finish_reasons[item.index] = item.finish_reason
                stream._offer(item)
            else:  # the request is over: None, or the exception that ended it
                for held in stream.held.values():
                    stream.queue.put_nowait(held)
                stream.held.clear()
                stream.error = item
                stream.finished = True
                del self._streams[rid]
                stream.queue.put_nowait(None)

    # -- engine thread ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as e:  # not an Exception (those fail a step's requests): the thread ends
            died = EngineThreadDiedError(f"the engine thread stopped on {type(e).__name__}: {e}")
            log.critical("%s", died, exc_info=True)
            try:
                self._loop.call_soon_threadsafe(self._die, died)
            except RuntimeError:  # the event loop is closed already
                pass

    def _die(self, error: Exception) -> None:
        """Event loop: nothing will step the engine again; every request in flight fails now."""
        self._break(error)
        self._deliver([(rid, self._failure(self.broken)) for rid in list(self._streams)])

    def _serve(self) -> None:
        engine = self.engine
        while not self._stop.is_set():
            batch: list[tuple[str, object]] = []
            try:
                block = not engine.has_unfinished()
                while True:
                    try:
                        cmd = self._commands.get(block=block, timeout=0.5 if block else None)
                    except queue.Empty:
                        break
                    block = False
                    self._apply(cmd, batch)
                if engine.has_unfinished():
                    self._collect(engine.step(), batch)
                elif self.peer_timeout is not None and self.broken is None and not self._peer_failed:  # idle
                    engine.heartbeat(min(self.peer_timeout / 4, 10.0))
            except Exception as e:  # a bug in a step: fail what is running, keep serving
                from jaxinfer.distributed import PeerFailureError

                if isinstance(e, PeerFailureError):  # not a bug: the job is gone; nothing more can run
                    self._peer_failed = True
                    log.error("%s", e)
                    self._post(self._break, e)
                else:
                    log.exception("engine step failed; failing the requests in flight")
                batch += self._fail_all(e)
            if batch:
                self._post(self._deliver, batch)
        self._finish_on_stop()

    def _finish_on_stop(self) -> None:
        """After the loop: applies what is still queued (shutdown()'s aborts arrive while a step
        runs) and aborts anything left, so every stream gets its end (finish reason 'abort') instead
        of waiting until the gRPC server cancels it."""
        if self.broken is not None or self._peer_failed:
            return  # the job is gone: _fail_all has already ended every stream
        batch: list[tuple[str, object]] = []
        try:
            while True:
                try:
                    self._apply(self._commands.get_nowait(), batch)
                except queue.Empty:
                    break
            for rid in list(self.engine.requests):
                self._collect(self.engine.abort(rid), batch)
        except Exception as e:
            log.exception("aborting the requests left at shutdown failed")
            batch += self._fail_all(e)
        if batch:
            self._post(self._deliver, batch)

    def _post(self, fn, *args) -> None:
        """Engine thread: runs `fn(*args)` on the event loop. Once that loop has closed (its owner
        ended without `shutdown()`), nobody can read a stream any more: the thread stops quietly
        instead of dying on the RuntimeError with a misleading critical log."""
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            if not self._loop.is_closed():
                raise
            if not self._stop.is_set():
                log.info("the event loop has closed; the engine thread stops")
                self._stop.set()

    def _apply(self, cmd: tuple, batch: list) -> None:
        engine = self.engine
        if cmd[0] == "add":
            _, rid, prompt_ids, params, arrival, salt = cmd
            try:
                # The server's arrival time: TTFT and latency include the wait for the engine thread.
                engine.add_request(
                    prompt_ids, params, request_id=rid, arrival_time=arrival, cache_salt=salt, validated=True
                )
            except Exception as e:  # validated already; anything left is reported, not raised
                batch.append((rid, e))
        elif cmd[0] == "abort":
            self._collect(engine.abort(cmd[1]), batch)

    def _collect(self, updates, batch: list) -> None:
        done = set()
        for u in updates:
            batch.append((u.seq.request_id, StreamDelta.of(u)))
            if u.finish_reason is not None:
                done.add(u.seq.request_id)
        for rid in done:
            req = self.engine.requests.get(rid)
            if req is not None and req.finished:
                self.engine.release(rid)
                batch.append((rid, None))

    @staticmethod
    def _failure(error: Exception) -> EngineFailedError:
        from jaxinfer.distributed import PeerFailureError

        if isinstance(error, PeerFailureError):
            return EngineFailedError(f"the multi-host job is broken: {error}", unavailable=True)
        if isinstance(error, EngineThreadDiedError):
            return EngineFailedError(str(error), unavailable=True)
        return EngineFailedError(f"the engine failed while running this request: {type(error).__name__}: {error}")

    def _fail_all(self, error: Exception) -> list:
        batch = []
        failure = self._failure(error)
        self.engine.take_undelivered()  # updates of the requests failed here: none is sent after its failure
        for rid in list(self.engine.requests):
            try:
                self.engine.abort(rid)
            except Exception:
                log.exception("abort of %s failed", rid)
            self.engine.requests.pop(rid, None)
            batch.append((rid, failure))
        return batch
