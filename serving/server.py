"""The gRPC server: jaxinfer.v1 + JetStream's Orchestrator + health + reflection, on one engine.

Life of a server: `start()` binds the port at once and answers health checks with NOT_SERVING (and
every RPC with UNAVAILABLE) while the model loads and every step shape compiles; then it turns
SERVING. `stop()` drains: health goes NOT_SERVING, new RPCs get UNAVAILABLE, requests in flight
finish (or are aborted after `drain_timeout`), then the port closes.

Every generating RPC is validated here (naming the field and limit on INVALID_ARGUMENT), then
submitted to the `AsyncEngine`, whose one thread batches all of them. A client that cancels,
disconnects or runs out of deadline aborts its request before the engine's next step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import errno
import functools
import itertools
import json
import logging
import socket
import threading
import time

import grpc
import jax
from grpc_health.v1 import health, health_pb2
from grpc_reflection.v1alpha import reflection, reflection_pb2
from prometheus_client import CollectorRegistry, Counter, Gauge

import jaxinfer
from jaxinfer.client import MIN_KEEPALIVE, check_request_id
from jaxinfer.errors import InvalidRequestError
from jaxinfer.jetstream import jetstream_pb2 as js
from jaxinfer.limits import check_cache_salt
from jaxinfer.llm import StreamDelta
from jaxinfer.sampling import SamplingParams
from jaxinfer.sharding import format_mesh
from jaxinfer.tokenizer import encode_prompt
from jaxinfer.v1 import jaxinfer_pb2 as pb
from serving import wire
from serving.async_engine import AsyncEngine, DrainingError, EngineFailedError, QueueFullError, RequestStream

log = logging.getLogger("jaxinfer.serving")
_DEADLINE_SLACK_S = 0.1
_UNARY_INTERVAL = 16  # tokens of a sample a unary Generate's handler takes at once
_TOKENIZE_THREADS = 2  # prompt texts tokenized at once (the tokenizers release the GIL)

SERVICE = "jaxinfer.v1.InferenceService"
JETSTREAM_SERVICE = "jetstream_proto.Orchestrator"
HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name  # grpc.health.v1.Health
HEALTH_SERVICES = ("", SERVICE, JETSTREAM_SERVICE)  # the names health checks answer for


@dataclasses.dataclass(kw_only=True)
class ServerConfig:
    """What `jaxinfer serve` takes. `engine` holds the LLM capacity arguments (page_size, ...)."""

    model: str | None = None
    dtype: str = "float32"
    host: str = "127.0.0.1"
    port: int = 9000
    metrics_port: int | None = None
    max_queued_requests: int = 256
    drain_timeout: float = 30.0
    stream_interval: int = 1  # GenerateStream sends a sample's tokens once this many have accumulated
    # The largest unary Generate response: gRPC's default limit on a received message, which most
    # clients keep (a larger response would reach them as an error after all the work was done).
    max_response_bytes: int = 4 * 1024 * 1024
    peer_timeout: float = 60.0  # multi-host: a step waiting this long on the other processes breaks the job
    peer_startup_timeout: float = 600.0  # the same while loading and warming up (load and compile times differ)
    # Warm up the prompt-logprobs programs too (a multi-process job always does: see Engine.warmup).
    warmup_prompt_logprobs: bool = False
    engine: dict = dataclasses.field(default_factory=dict)


class _CountReceived(grpc.aio.ServerInterceptor):
    """Counts the RPCs that `jaxinfer_requests` counts when they finish, as they arrive. gRPC ends a
    call whose deadline passes while its request is read without running the handler, so without
    this such calls would go uncounted. `observed`: the full paths ("/service/method") of the
    methods `Server._observe` wraps; a call to another service's method of the same name (answered
    UNIMPLEMENTED) is not counted."""

    def __init__(self, counter, observed: set[str]):
        self._counter = counter
        self._observed = observed

    async def intercept_service(self, continuation, details):
        if details.method in self._observed:
            self._counter.labels(details.method.rsplit("/", 1)[-1]).inc()
        return await continuation(details)


class RpcError(Exception):
    """Ends an RPC with `code` and a message for the client."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


def _invalid(message: str) -> RpcError:
    return RpcError(grpc.StatusCode.INVALID_ARGUMENT, message)


# JetStream's DecodeRequest has no sampling_params: the SamplingParams fields it sets, by its names.
_DECODE_FIELDS = {"max_tokens": "max_tokens", "n": "num_samples"}


def _in_fields(message: str, fields: dict[str, str]) -> str:
    """A SamplingParams refusal naming a request's own fields (`fields`: ours -> theirs)."""
    for ours, theirs in fields.items():
        message = message.replace(f"SamplingParams.{ours}", theirs)
    return message


def _too_large(size: str, limit: int) -> RpcError:
    return RpcError(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        f"the response is {size} bytes, past this server's max_response_bytes of {limit} (by default gRPC's "
        "limit on a message a client receives); use GenerateStream, which sends the tokens as they come, or "
        "lower n, logprobs or max_tokens",
    )


@dataclasses.dataclass(kw_only=True, eq=False)
class _Rpc:
    """One call as the server counts and logs it; its handler fills in `cid` and `stream`."""

    id: str  # the server's own, also the request id in the engine
    t0: float = dataclasses.field(default_factory=time.perf_counter)
    code: grpc.StatusCode = grpc.StatusCode.OK
    error: str | None = None  # for the log line
    cid: str | None = None  # the caller's request_id, if it sent one
    stream: RequestStream | None = None  # once admitted to the engine
    ended: bool = False  # counted and logged


def _status_of(e: BaseException, ctx) -> tuple[grpc.StatusCode, str | None]:
    """The status an exception ends its call with, and the error to log (none for a cancellation)."""
    if isinstance(e, RpcError):
        return e.code, str(e)
    if isinstance(e, (asyncio.CancelledError, GeneratorExit)):
        # The client gives up at its own deadline, which the server's (arrival + timeout) trails by
        # the transport's latency: a cancel that close to it is the deadline.
        remaining = ctx.time_remaining()
        deadline = remaining is not None and remaining <= _DEADLINE_SLACK_S
        return (grpc.StatusCode.DEADLINE_EXCEEDED if deadline else grpc.StatusCode.CANCELLED), None
    if isinstance(e, InvalidRequestError):  # found only by the engine thread: still the request's fault
        return grpc.StatusCode.INVALID_ARGUMENT, str(e)
    return grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}"


class Server:
    """One gRPC server over one engine. Given an `llm`, the server's engine thread owns `llm.engine`
    from `start()` on: nothing else may call into it (run offline work on another LLM)."""

    def __init__(self, config: ServerConfig, *, llm: jaxinfer.LLM | None = None):
        self.config = config
        self.llm = llm  # tests pass a loaded LLM; otherwise start() loads config.model
        self.async_engine: AsyncEngine | None = None
        self.state = "loading"  # loading -> serving -> draining -> stopped
        self.port: int | None = None
        self.load_error: BaseException | None = None
        self.ready = asyncio.Event()
        self._grpc: grpc.aio.Server | None = None
        self._health = health.aio.HealthServicer()
        self._health_status = health_pb2.HealthCheckResponse.NOT_SERVING  # of every HEALTH_SERVICES name
        self._metrics_http = None
        self._stopped = asyncio.Event()
        self._load_task: asyncio.Task | None = None
        self._load_thread: threading.Thread | None = None
        self._load_watch: asyncio.Future | None = None  # multi-host: bounds the waits on the peers while loading
        self._rpc_ids = itertools.count(1)
        # Prompt texts are tokenized off the event loop, on their own few threads: work queued for a
        # call that ends meanwhile (deadline, cancel) is dropped unrun, and the default pool
        # (shutdown uses it) never waits behind a backlog.
        self._tokenize_pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=_TOKENIZE_THREADS, thread_name_prefix="jaxinfer-tokenize"
        )
        self._observed: set[str] = set()  # "/service/method" counted in jaxinfer_requests (by _observe)
        self.registry = CollectorRegistry()
        self._requests = Counter(
            "jaxinfer_requests", "Finished RPCs by method and status code", ["method", "code"], registry=self.registry
        )
        self._received = Counter(
            "jaxinfer_requests_received",
            "RPCs received by method (received - finished: in flight, or ended before their handler ran, "
            "e.g. by a deadline of a few ms)",
            ["method"],
            registry=self.registry,
        )
        self._in_flight = Gauge(
            "jaxinfer_requests_in_flight", "Generating requests admitted and not finished", registry=self.registry
        )
        self._in_flight.set_function(lambda: self.async_engine.num_in_flight if self.async_engine else 0)
        self._queue_depth = Gauge(
            "jaxinfer_queue_depth", "Sequences admitted and waiting for a running slot or pages", registry=self.registry
        )
        self._queue_depth.set_function(lambda: len(self.llm.engine.scheduler.waiting) if self.async_engine else 0)
        self.registry.register(_EngineCollector(self))

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> int:
        """Binds and starts serving health checks; loads the model in the background. Returns the port.

        Raises OSError naming the address when a port cannot be bound; nothing is left running or
        bound then."""
        # The metrics port first: a gRPC port bound by a server that never starts stays bound until
        # the process exits, and a started one cannot be left behind (its finalizer needs the loop).
        self._start_metrics()
        try:
            # Clients' keepalive pings (jaxinfer.client: every 30 s by default, 1 s at least) are
            # welcome even while a call waits for its first byte: gRPC's default policy answers a
            # second ping within 5 minutes without data with GOAWAY, failing the call.
            server = grpc.aio.server(
                interceptors=[_CountReceived(self._received, self._observed)],
                options=[
                    ("grpc.so_reuseport", 0),
                    ("grpc.http2.min_ping_interval_without_data_ms", int(MIN_KEEPALIVE * 1000)),
                    ("grpc.http2.max_ping_strikes", 0),
                ],
            )
            names = (SERVICE, JETSTREAM_SERVICE, HEALTH_SERVICE, reflection.SERVICE_NAME)
            server.add_generic_rpc_handlers(
                (
                    self._inference_handler(),
                    self._jetstream_handler(),
                    self._health_handler(),
                    _reflection_handler(names),
                )
            )
            _check_host(self.config.host, self.config.port)
            address = f"{_host_for_bind(self.config.host)}:{self.config.port}"
            try:
                self.port = server.add_insecure_port(address)
            except RuntimeError:  # newer grpcio raises where older ones returned 0
                self.port = 0
            if self.port == 0:
                raise OSError(f"cannot bind {address}: is the port in use, or the address not this machine's?")
            await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
            try:
                await server.start()
            except BaseException:
                await server.stop(None)
                raise
        except BaseException:
            self._stop_metrics()
            raise
        self._grpc = server
        self._load_task = asyncio.get_running_loop().create_task(self._load())  # held: tasks are weakly referenced
        return self.port

    def _start_metrics(self) -> None:
        port = self.config.metrics_port
        if port is None:
            return
        from prometheus_client import start_http_server

        try:
            self._metrics_http, _ = start_http_server(port, addr=self.config.host, registry=self.registry)
        except OSError as e:  # errno's words, not "[Errno 98] ...", which names neither flag nor port
            reason = e.strerror or str(e)
            reason = reason[:1].lower() + reason[1:]
            where = f"{_host_for_bind(self.config.host)}:{port}"
            raise OSError(f"--metrics-port {port}: cannot listen on {where} ({reason})") from e

    def _stop_metrics(self) -> None:
        if self._metrics_http is not None:
            self._metrics_http.shutdown()
            self._metrics_http.server_close()  # shutdown() only ends the loop: this frees the port
            self._metrics_http = None

    @property
    def metrics_port(self) -> int | None:
        return self._metrics_http.server_port if self._metrics_http else None

    async def _load(self) -> None:
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def settle(result=None, error=None):  # on the loop; the watchdog may have failed the load first
            if done.done():
                return
            # A future refuses StopIteration (set_exception raises TypeError; the load never settled).
            if isinstance(error, StopIteration):
                error = RuntimeError(f"StopIteration: {error}")
            done.set_result(result) if error is None else done.set_exception(error)

        def load():  # a daemon thread: a SIGTERM during loading must not wait for it
            try:
                llm = self.llm
                if llm is None:
                    llm = jaxinfer.LLM(self.config.model, dtype=self.config.dtype, **self.config.engine)
                t0 = time.perf_counter()
                n = llm.engine.warmup(prompt_logprobs=self.config.warmup_prompt_logprobs or None)
                log.info(json.dumps({"event": "warmup", "compilations": n, "seconds": time.perf_counter() - t0}))
                loop.call_soon_threadsafe(settle, llm)
            except BaseException as e:  # reported by the health check and the log
                from jaxinfer.distributed import PeerFailureError, lost_peers

                if jax.process_count() > 1 and (first := lost_peers(e)):
                    # A follower gone while loading: the job is broken (exit 1), not the model (2).
                    why = f"while loading, a collective with the other processes failed (did a follower exit?): {first}"
                    e = PeerFailureError(why)
                loop.call_soon_threadsafe(settle, None, e)

        async def watch_peers():  # multi-host: a process that hung while loading would block us forever
            from jaxinfer.distributed import PeerFailureError, peer_wait

            limit = self.config.peer_startup_timeout
            while not done.done():
                await asyncio.sleep(min(0.5, limit / 4))
                if peer_wait.seconds() > limit:
                    why = (
                        f"while loading, a collective has waited {limit:.0f} s for the other processes "
                        "(one exited or hung?)"
                    )
                    settle(error=PeerFailureError(why))

        self._load_thread = threading.Thread(target=load, name="jaxinfer-load", daemon=True)
        self._load_thread.start()
        if jax.process_count() > 1:
            self._load_watch = asyncio.ensure_future(watch_peers())
        try:
            self.llm = await done
            if self.state != "loading":  # stop() came first
                return
            # Starting the engine's thread fails the load too when it fails (the server would
            # otherwise stay "loading" for good, the task's error unseen).
            async_engine = AsyncEngine(
                self.llm.engine,
                max_queued=self.config.max_queued_requests,
                peer_timeout=self.config.peer_timeout if jax.process_count() > 1 else None,
                on_broken=self._on_broken,
            )
            async_engine.start()
        except asyncio.CancelledError:
            return  # stop() during loading
        except BaseException as e:
            self.load_error = e
            log.error(json.dumps({"event": "load_failed", "error": f"{type(e).__name__}: {e}"}))
            self.state = "failed"
            self.ready.set()
            return
        self.async_engine = async_engine
        self.state = "serving"
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        log.info(json.dumps({"event": "ready", "model": self.llm.cfg.name, "port": self.port}))
        self.ready.set()

    async def _set_health(self, status) -> None:
        """Every name health checks answer for gets `status` (Check and Watch read the stock servicer's,
        List this server's record of it: the stock aio servicer leaves List unimplemented)."""
        self._health_status = status
        for name in HEALTH_SERVICES:
            await self._health.set(name, status)

    async def _health_list(self, request, ctx) -> health_pb2.HealthListResponse:
        statuses = {name: health_pb2.HealthCheckResponse(status=self._health_status) for name in HEALTH_SERVICES}
        return health_pb2.HealthListResponse(statuses=statuses)

    def _on_broken(self, error: Exception) -> None:
        """The engine broke for good (multi-host: a follower died or hung; or its thread ended):
        stop serving, say so in health."""
        self.state = "failed"
        self.load_error = error
        asyncio.ensure_future(self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING))

    async def stop(self, drain_timeout: float | None = None) -> bool:
        """Drains and stops. Returns True if every request in flight finished within the drain time."""
        if self.state in ("draining", "stopped"):
            await self._stopped.wait()
            return True
        timeout = self.config.drain_timeout if drain_timeout is None else drain_timeout
        if self._load_task is not None and not self._load_task.done():
            self._load_task.cancel()  # the load thread itself cannot be interrupted: see still_loading
        self.state = "draining"
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        drained = True
        if self.async_engine is not None:
            self.async_engine.draining = True
            drained = await self.async_engine.wait_idle(timeout)
            if not drained:
                log.warning("drain time (%.1f s) is up: aborting %d requests", timeout, self.async_engine.num_in_flight)
            await self.async_engine.shutdown()
            await self.async_engine.wait_idle(5.0)
        if self._grpc is not None:
            await self._grpc.stop(grace=1.0)
        self._stop_metrics()
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)
        self.state = "stopped"
        self.ready.set()  # wakes anyone still waiting for a load that will never be used
        self._stopped.set()
        return drained

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    @property
    def still_loading(self) -> bool:
        """True when the model is still loading or warming up on its thread (stopped meanwhile).
        That thread is inside JAX and cannot be interrupted; a process must not run its normal
        interpreter teardown under it (it aborts): `jaxinfer serve` exits at once instead."""
        return self._load_thread is not None and self._load_thread.is_alive()

    # -- shared request path ------------------------------------------------------------------

    def _check_serving(self) -> None:
        if self.state == "loading":
            raise RpcError(grpc.StatusCode.UNAVAILABLE, "the server is loading and warming up the model; retry soon")
        if self.state == "failed":
            raise RpcError(grpc.StatusCode.UNAVAILABLE, f"the server cannot serve: {self.load_error}")
        if self.state != "serving":
            raise RpcError(grpc.StatusCode.UNAVAILABLE, "the server is draining (shutting down); retry elsewhere")

    def _tokenize(
        self, text: str, field: str, params: SamplingParams | None = None, *, allow_empty: bool = False
    ) -> list[int]:
        """The prompt's ids; a text too large for the prompt limit (`params`' own: none when they keep
        only its last tokens, see Engine.prompt_token_limit) is refused before it is tokenized. An
        empty text is refused as a prompt; `Tokenize` (`allow_empty`) answers what the tokenizer
        makes of it (its BOS alone, or nothing), as `tokenizer.encode("")` does."""
        if not text and not allow_empty:
            raise _invalid(f"{field}: the prompt is empty")
        tok = self.llm.tokenizer
        if tok is None:
            raise _invalid(
                f"{field}: this model has no tokenizer (neither tokenizer.json nor tokenizer.model); "
                "send token ids instead"
            )
        try:
            params = params or SamplingParams()
            limit = self.llm.engine.prompt_token_limit(params)
            return encode_prompt(
                tok, text, max_tokens=limit, field=field, truncate_prompt_tokens=params.truncate_prompt_tokens
            )
        except InvalidRequestError as e:
            raise _invalid(str(e)) from None

    async def _tokenize_off_loop(
        self, text: str, field: str, params: SamplingParams | None = None, *, allow_empty: bool = False
    ) -> list[int]:
        """`_tokenize` on the tokenize pool: a text may be megabytes (up to the message limit, or the
        prompt limit times the longest token's bytes), which would hold up every stream for a second
        on the event loop."""
        tokenize = functools.partial(self._tokenize, text, field, params, allow_empty=allow_empty)
        return await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, tokenize)

    def _admit(
        self,
        prompt_ids,
        params: SamplingParams,
        field: str,
        rpc: _Rpc,
        *,
        interval: int = 1,
        cache_salt: str | None = None,
        param_fields: dict[str, str] | None = None,
    ) -> RequestStream:
        """Validates and submits. A refusal about a sampling parameter names `sampling_params`, or
        where the request has no such field, the request's own field `param_fields` maps it to."""
        try:
            self.llm.engine.validate(prompt_ids, params)
        except InvalidRequestError as e:  # about the prompt, or about a sampling parameter
            message = str(e)
            if not message.startswith("SamplingParams."):
                raise _invalid(f"{field}: {message}") from None
            if param_fields is None:
                raise _invalid(f"sampling_params: {message}") from None
            raise _invalid(_in_fields(message, param_fields)) from None
        try:
            return self.async_engine.submit(
                prompt_ids, params, request_id=rpc.id, interval=interval, cache_salt=cache_salt
            )
        except QueueFullError as e:
            raise RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)) from None
        except DrainingError as e:
            raise RpcError(grpc.StatusCode.UNAVAILABLE, str(e)) from None
        except EngineFailedError as e:
            raise _engine_failed(e) from None

    def _observe(self, method: str, handler, *, streaming: bool, service: str = SERVICE):
        """Wraps a handler: RpcError -> status, cancellation -> abort, metrics and the log line."""
        self._observed.add(f"/{service}/{method}")  # counted on arrival too (_CountReceived)

        def begin(request) -> None:
            if isinstance(request, wire.BadMessage):
                raise _invalid(request.error)
            if method != "GetModelInfo":
                self._check_serving()

        async def fail(ctx, e: BaseException, rpc: _Rpc) -> None:
            """Records the status; re-raises a cancellation, ends anything else with its code."""
            rpc.code, rpc.error = _status_of(e, ctx)
            if isinstance(e, (asyncio.CancelledError, GeneratorExit)):
                raise e
            gone = _ended(ctx)
            if gone:  # the deadline passed (or the client left) before the answer: that is its status
                rpc.code = grpc.StatusCode.DEADLINE_EXCEEDED if not ctx.done() else grpc.StatusCode.CANCELLED
            if rpc.code is grpc.StatusCode.INTERNAL:
                log.exception("%s failed", method)
            # Counted before the client hears the status, so a scrape right after it sees the RPC.
            self._end_rpc(method, rpc)
            if gone:
                # gRPC core has already ended the call: an abort would fail inside grpc.aio and log a
                # traceback; ending the handler as a cancellation is what grpc.aio expects.
                raise asyncio.CancelledError
            await ctx.abort(rpc.code, rpc.error or rpc.code.name)

        if streaming:

            async def wrapped(request, ctx):
                rpc = _Rpc(id=f"{next(self._rpc_ids):06d}")
                try:
                    begin(request)
                    async for item in handler(request, ctx, rpc):
                        if _ended(ctx):  # a write now would fail inside grpc.aio, which logs a traceback
                            raise asyncio.CancelledError
                        yield item
                except BaseException as e:
                    await fail(ctx, e, rpc)
                finally:
                    self._end_rpc(method, rpc)

        else:

            async def wrapped(request, ctx):
                rpc = _Rpc(id=f"{next(self._rpc_ids):06d}")
                try:
                    begin(request)
                    response = await handler(request, ctx, rpc)
                    if _ended(ctx):  # its deadline passed meanwhile: a reply would fail inside grpc.aio
                        raise asyncio.CancelledError
                    return response
                except BaseException as e:
                    await fail(ctx, e, rpc)
                finally:
                    self._end_rpc(method, rpc)

        return wrapped

    def _end_rpc(self, method: str, rpc: _Rpc) -> None:
        """Once per call: aborts what it left in the engine, counts its status, logs its line (for
        the generating methods, and any call that reached the engine)."""
        if rpc.ended:
            return
        rpc.ended = True
        stream = rpc.stream
        aborted = stream is not None and not stream.finished and self.async_engine is not None
        if aborted:  # the engine ends it at its next step; the line says so now (tokens: those seen)
            self.async_engine.abort(stream)
        self._requests.labels(method, rpc.code.name).inc()
        if stream is None and method not in ("Generate", "GenerateStream", "Decode"):
            return
        line = {"event": "request", "id": rpc.id, "method": method, "code": rpc.code.name, "client_request_id": rpc.cid}
        if stream is not None:
            line.update(
                prompt_tokens=len(stream.prompt_ids),
                completion_tokens=stream.completion_tokens,
                n=stream.params.n,
                max_tokens=stream.params.max_tokens,
                finish_reasons=[
                    stream.finish_reasons.get(i, "abort" if aborted else None) for i in range(stream.params.n)
                ],
                ttft_s=None if stream.first_token_time is None else round(stream.first_token_time - stream.arrival, 6),
            )
        line["latency_s"] = round(time.perf_counter() - rpc.t0, 6)
        if rpc.error:
            line["error"] = rpc.error
        log.info(json.dumps(line))

    # -- jaxinfer.v1 ----------------------------------------------------------------------------

    def _inference_handler(self):
        def unary(name, fn, req_cls, resp_cls):
            return grpc.unary_unary_rpc_method_handler(
                self._observe(name, fn, streaming=False),
                request_deserializer=wire.Parser(req_cls),
                response_serializer=resp_cls.SerializeToString,
            )

        handlers = {
            "Generate": unary("Generate", self._generate, pb.GenerateRequest, pb.GenerateResponse),
            "GenerateStream": grpc.unary_stream_rpc_method_handler(
                self._observe("GenerateStream", self._generate_stream, streaming=True),
                request_deserializer=wire.Parser(pb.GenerateRequest),
                response_serializer=pb.GenerateStreamResponse.SerializeToString,
            ),
            "Tokenize": unary("Tokenize", self._tokenize_rpc, pb.TokenizeRequest, pb.TokenizeResponse),
            "GetModelInfo": unary("GetModelInfo", self._model_info, pb.GetModelInfoRequest, pb.ModelInfo),
        }
        return grpc.method_handlers_generic_handler(SERVICE, handlers)

    async def _start_generate(self, request: pb.GenerateRequest, rpc: _Rpc, *, streaming: bool) -> RequestStream:
        try:
            check_request_id(request.request_id)
        except InvalidRequestError as e:
            raise _invalid(str(e)) from None
        rpc.cid = request.request_id or None
        which = request.WhichOneof("prompt")
        if which is None:
            raise _invalid("prompt: set one of text or token_ids")
        try:
            params = wire.sampling_params(request.sampling_params, self.llm.get_default_sampling_params())
        except InvalidRequestError as e:
            raise _invalid(f"sampling_params: {e}") from None
        if which == "text":
            ids = await self._tokenize_off_loop(request.text, "text", params)
        else:
            ids = list(request.token_ids.ids)
        ids = self.llm.engine.truncated(ids, params)  # what runs: the response's prompt_token_ids
        salt = request.cache_salt if request.HasField("cache_salt") else None
        try:
            check_cache_salt(salt)
        except InvalidRequestError as e:
            raise _invalid(str(e)) from None
        # A unary call only needs the end: holding its deltas spares a wake-up per step. It takes them
        # every _UNARY_INTERVAL tokens all the same, to end a response growing past max_response_bytes.
        interval = self.config.stream_interval if streaming else _UNARY_INTERVAL
        stream = rpc.stream = self._admit(ids, params, which, rpc, interval=interval, cache_salt=salt)
        return stream

    def _usage(self, stream: RequestStream) -> pb.Usage:
        return pb.Usage(prompt_tokens=len(stream.prompt_ids), completion_tokens=stream.completion_tokens)

    async def _generate(self, request, ctx, rpc):
        stream = await self._start_generate(request, rpc, streaming=False)
        n = stream.params.n
        comps = [pb.Completion(index=i) for i in range(n)]
        texts = [[] for _ in range(n)]
        prompt_logprobs = []
        limit = self.config.max_response_bytes
        size = 0  # a lower bound of the response's size so far: ends the request once past the limit
        try:
            async for d in stream:
                prompt_logprobs += (d.prompt_logprobs or [None])[1:]  # the first prompt token has none
                c = comps[d.index]
                c.token_ids.extend(d.token_ids)
                texts[d.index].append(d.text)
                lps = wire.logprobs_proto(d.logprobs or [])
                c.logprobs.extend(lps)
                size += len(d.token_ids) + len(d.text) + sum(x.ByteSize() for x in lps)
                if size > limit:
                    raise _too_large(f"more than {size}", limit)
                if d.finish_reason is not None:
                    c.finish_reason = wire.FINISH_REASONS[d.finish_reason]
                    wire.set_stop_reason(c, d.stop_reason)
        except EngineFailedError as e:
            raise _engine_failed(e) from None
        for c, t in zip(comps, texts):
            c.text = "".join(t)
        response = pb.GenerateResponse(
            request_id=rpc.cid or stream.request_id,
            prompt_token_ids=stream.prompt_ids,
            completions=comps,
            usage=self._usage(stream),
            prompt_logprobs=wire.logprobs_proto(prompt_logprobs),
        )
        size = response.ByteSize()
        if size > limit:
            raise _too_large(str(size), limit)
        return response

    async def _generate_stream(self, request, ctx, rpc):
        stream = await self._start_generate(request, rpc, streaming=True)
        finished = 0  # samples whose last message has been sent (the engine may be steps ahead)
        first = True  # the stream's first message also carries the prompt's token ids
        try:
            async for d in _coalesced(stream):
                if not (d.token_ids or d.text or d.finish_reason):
                    continue
                finished += d.finish_reason is not None
                msg = pb.GenerateStreamResponse(
                    request_id=rpc.cid or stream.request_id,
                    index=d.index,
                    token_ids=d.token_ids,
                    text=d.text,
                    finish_reason=wire.FINISH_REASONS[d.finish_reason],
                    logprobs=wire.logprobs_proto(d.logprobs or []),
                    prompt_logprobs=wire.logprobs_proto((d.prompt_logprobs or [None])[1:]),
                )
                wire.set_stop_reason(msg, d.stop_reason)
                if first:
                    msg.prompt_token_ids.extend(stream.prompt_ids)
                    first = False
                if finished == stream.params.n and d.finish_reason is not None:
                    msg.usage.CopyFrom(self._usage(stream))  # the last message of the request
                yield msg
        except EngineFailedError as e:
            raise _engine_failed(e) from None

    async def _tokenize_rpc(self, request, ctx, rpc):
        ids = await self._tokenize_off_loop(request.text, "text", allow_empty=True)
        return pb.TokenizeResponse(token_ids=ids)

    async def _model_info(self, request, ctx, rpc):
        if self.llm is None or self.state in ("loading", "failed"):
            self._check_serving()
        cfg, eng = self.llm.cfg, self.llm.engine
        dev = jax.devices()[0]
        return pb.ModelInfo(
            model_name=cfg.name,
            family=cfg.family,
            max_model_len=eng.max_model_len,
            vocab_size=cfg.vocab_size,
            dtype=cfg.dtype,
            mesh=(
                f"1 device ({dev.platform}: {dev.device_kind}), unsharded"
                if eng.mesh is None
                else f"{format_mesh(dict(eng.mesh.shape))} over {eng.mesh.size} {dev.platform} devices"
            ),
            kv_pages_total=eng.pool.capacity,
            kv_window_pages_total=0 if eng.window_pool is None else eng.window_pool.capacity,
            page_size=eng.page_size,
            kv_cache_bytes=eng.kv_cache_bytes,
            kv_bytes_per_token=eng.kv_bytes_per_token,
            max_num_seqs=eng.max_num_seqs,
            max_num_batched_tokens=eng.max_num_batched_tokens,
            eos_token_ids=list(cfg.eos_token_ids),
            has_tokenizer=self.llm.tokenizer is not None,
            version=jaxinfer.__version__,
            default_sampling_params=wire.sampling_fields_proto(self.llm.generation_overrides),
        )

    # -- grpc.health.v1 ---------------------------------------------------------------------------

    def _health_handler(self):
        """grpc.health.v1.Health: the stock servicer (whose statuses start() and stop() set), behind
        request parsing that answers a malformed request with INVALID_ARGUMENT instead of a
        traceback. Check, List and Watch, as the stock registration has them."""
        handlers = {
            "Check": grpc.unary_unary_rpc_method_handler(
                _parsed(self._health.Check),
                request_deserializer=_HEALTH_REQUEST_PARSER,
                response_serializer=health_pb2.HealthCheckResponse.SerializeToString,
            ),
            "List": grpc.unary_unary_rpc_method_handler(
                _parsed(self._health_list),
                request_deserializer=wire.Parser(health_pb2.HealthListRequest),
                response_serializer=health_pb2.HealthListResponse.SerializeToString,
            ),
            "Watch": grpc.unary_stream_rpc_method_handler(
                _parsed(self._health.Watch),
                request_deserializer=_HEALTH_REQUEST_PARSER,
                response_serializer=health_pb2.HealthCheckResponse.SerializeToString,
            ),
        }
        return grpc.method_handlers_generic_handler(HEALTH_SERVICE, handlers)

    # -- JetStream ------------------------------------------------------------------------------

    def _jetstream_handler(self):
        handlers = {
            "Decode": grpc.unary_stream_rpc_method_handler(
                self._observe("Decode", self._decode, streaming=True, service=JETSTREAM_SERVICE),
                request_deserializer=wire.Parser(js.DecodeRequest),
                response_serializer=js.DecodeResponse.SerializeToString,
            ),
            "HealthCheck": grpc.unary_unary_rpc_method_handler(
                _parsed(self._jetstream_health),
                request_deserializer=wire.Parser(js.HealthCheckRequest),
                response_serializer=js.HealthCheckResponse.SerializeToString,
            ),
        }
        return grpc.method_handlers_generic_handler(JETSTREAM_SERVICE, handlers)

    async def _jetstream_health(self, request, ctx):
        return js.HealthCheckResponse(is_live=self.state == "serving")

    async def _decode(self, request, ctx, rpc):
        """JetStream's Decode: greedy; token ids answer token ids, text answers text (and its ids).

        Every message carries one sample per requested sample, in order; a step that adds nothing
        visible (text held back mid-character or mid-stop-string) sends nothing, and its tokens go
        out with the next message. The stop token is never sent.
        """
        if request.max_tokens <= 0:
            raise _invalid(f"max_tokens must be >= 1, got {request.max_tokens}")
        which = request.WhichOneof("content")
        if which is None:
            raise _invalid("content: set one of text_content or token_content")
        text_mode = which == "text_content"
        if text_mode:
            ids = await self._tokenize_off_loop(request.text_content.text, "text_content.text")
        else:
            ids = list(request.token_content.token_ids)
        if request.num_samples < 0:
            raise _invalid(f"num_samples must be >= 0 (0 means 1), got {request.num_samples}")
        try:
            params = SamplingParams(max_tokens=request.max_tokens, temperature=0.0, n=max(1, request.num_samples))
        except InvalidRequestError as e:
            raise _invalid(_in_fields(str(e), _DECODE_FIELDS)) from None
        stream = rpc.stream = self._admit(ids, params, which, rpc, param_fields=_DECODE_FIELDS)
        n = params.n
        pending_ids = [[] for _ in range(n)]
        pending_text = [[] for _ in range(n)]
        try:
            async for d in _steps(stream):
                for x in d:
                    pending_ids[x.index] += x.token_ids
                    pending_text[x.index].append(x.text)
                done = len(stream.finish_reasons) == n
                if text_mode:
                    visible = any("".join(t) for t in pending_text)
                else:
                    visible = any(pending_ids)
                if visible or (done and any(pending_ids)):
                    samples = []
                    for i in range(n):
                        if text_mode:
                            samples.append(
                                js.DecodeResponse.StreamContent.Sample(
                                    text="".join(pending_text[i]), token_ids=pending_ids[i]
                                )
                            )
                        else:
                            samples.append(js.DecodeResponse.StreamContent.Sample(token_ids=pending_ids[i]))
                        pending_ids[i], pending_text[i] = [], []
                    yield js.DecodeResponse(stream_content=js.DecodeResponse.StreamContent(samples=samples))
        except EngineFailedError as e:
            raise _engine_failed(e) from None


_HEALTH_REQUEST_PARSER = wire.Parser(health_pb2.HealthCheckRequest)


def _ended(ctx) -> bool:
    """True once gRPC core has ended the call: its deadline has passed, or the client went away."""
    remaining = ctx.time_remaining()
    return ctx.done() or (remaining is not None and remaining <= 0)


def _reflection_handler(service_names) -> grpc.GenericRpcHandler:
    """Server reflection: the stock servicer, behind request parsing that answers a malformed request
    with INVALID_ARGUMENT (the stock registration answers UNKNOWN and logs a traceback)."""
    servicer = reflection.aio.ReflectionServicer(service_names)

    async def info(request_iterator, ctx):
        async def parsed():
            async for request in request_iterator:
                if isinstance(request, wire.BadMessage):
                    await ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, request.error)
                yield request

        async for response in servicer.ServerReflectionInfo(parsed(), ctx):
            yield response

    handler = grpc.stream_stream_rpc_method_handler(
        info,
        request_deserializer=wire.Parser(reflection_pb2.ServerReflectionRequest),
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    return grpc.method_handlers_generic_handler(reflection.SERVICE_NAME, {"ServerReflectionInfo": handler})


def _parsed(handler):
    """Wraps a handler that `_observe` does not (health checks): a request `wire.Parser` could not
    parse is answered INVALID_ARGUMENT with its message, the way `_observe` answers it."""

    async def wrapped(request, ctx):
        if isinstance(request, wire.BadMessage):
            await ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, request.error)
        return await handler(request, ctx)

    return wrapped


def _engine_failed(e: EngineFailedError) -> RpcError:
    return RpcError(grpc.StatusCode.UNAVAILABLE if e.unavailable else grpc.StatusCode.INTERNAL, str(e))


async def _steps(stream: RequestStream):
    """Groups a stream's deltas by engine step (all deltas of one step arrive together)."""
    async for first in stream:
        batch = [first]
        while not stream.queue.empty():
            item = stream.queue.get_nowait()
            if item is None:
                yield batch
                if stream.error is not None:
                    raise stream.error
                return
            batch.append(item)
        yield batch


async def _coalesced(stream: RequestStream):
    """A stream's deltas, those already queued merged into one per sample.

    When the handler keeps up, that is what each step (or `stream_interval`) released. When it falls
    behind (many streams, a fast model), a sample's queued deltas leave as one message: fewer,
    larger messages instead of a backlog, so the transport never holds the engine back.
    """
    async for batch in _steps(stream):
        merged: dict[int, StreamDelta] = {}
        for d in batch:
            m = merged.get(d.index)
            merged[d.index] = d if m is None else m.then(d)
        for d in merged.values():
            yield d


class _EngineCollector:
    """Serves the engine's own metrics (TTFT, ITL, KV pages, ...) through the server's registry."""

    def __init__(self, server: Server):
        self.server = server

    def collect(self):
        llm = self.server.llm
        if llm is not None:
            yield from llm.engine.metrics.registry.collect()


def _check_host(host: str, port: int = 0) -> None:
    """OSError naming --host when it does not resolve or is not an address of this machine, and the
    port when another process listens there: gRPC would log its own error line before ours ("Failed
    to add port"). (A port taken between this check and gRPC's bind is still refused, after it.)"""
    name = host.strip("[]")
    if not name:
        raise OSError("--host is empty: give an address of this machine (127.0.0.1 by default)")
    try:
        infos = socket.getaddrinfo(name, 0, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise OSError(f"--host {host!r} does not resolve ({e})") from None
    in_use = False
    for family, kind, proto, _, addr in infos:
        try:
            with socket.socket(family, kind, proto) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC binds: TIME_WAIT is no user
                s.bind((addr[0], port, *addr[2:]))
            return
        except OSError as e:
            in_use = in_use or e.errno == errno.EADDRINUSE
    if in_use:
        raise OSError(f"cannot bind {_host_for_bind(host)}:{port}: the port is in use")
    raise OSError(f"--host {host!r} is not an address of this machine (cannot bind to it)")


def _host_for_bind(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
