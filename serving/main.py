"""`jaxinfer serve`: the command line around `serving.server.Server`."""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import signal
import sys
import threading
import traceback


def add_arguments(p: argparse.ArgumentParser) -> None:
    from jaxinfer.cli import DTYPE_HELP, add_engine_arguments
    from jaxinfer.config import DTYPES
    from jaxinfer.sampling_params import GENERATION_CONFIG_CHOICES

    p.add_argument(
        "--model", help="Hugging Face or `jaxinfer convert` checkpoint directory (default: the embedded default model)"
    )
    p.add_argument("--dtype", default="float32", choices=[*DTYPES, "auto"], help=DTYPE_HELP)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=9000, help="gRPC port (0: any free port, printed at start)")
    p.add_argument(
        "--metrics-port", type=int, default=None, help="serve Prometheus metrics on this port (bound to --host too)"
    )
    p.add_argument(
        "--max-queued-requests",
        type=int,
        default=256,
        help="requests admitted beyond max-num-seqs; more get RESOURCE_EXHAUSTED",
    )
    p.add_argument("--drain-timeout", type=float, default=30.0, help="seconds SIGTERM waits for requests in flight")
    p.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        help="GenerateStream sends a sample's tokens once this many have accumulated (the first and the "
        "last at once); >1 trades smoothness for less per-token transport work",
    )
    p.add_argument(
        "--max-response-bytes",
        type=int,
        default=4 * 1024 * 1024,
        help="largest unary Generate response (default 4 MiB: gRPC's default limit on a message a client "
        "receives); a larger one ends with RESOURCE_EXHAUSTED as soon as it passes the limit. Raise it only "
        "for clients that raise theirs (jaxinfer.client does); GenerateStream has no such limit",
    )
    p.add_argument(
        "--generation-config",
        default="auto",
        choices=GENERATION_CONFIG_CHOICES,
        help="auto: sampling fields a request leaves unset take the model's generation_config.json values "
        "(as in vLLM); none: SamplingParams' defaults",
    )
    p.add_argument(
        "--warmup-prompt-logprobs",
        action="store_true",
        help="also compile the prompt-logprobs programs before serving (else the first request with "
        "prompt_logprobs at each prefill shape compiles one; a multi-host job always compiles them)",
    )
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="log verbosity")
    add_engine_arguments(p)
    d = p.add_argument_group("multi-host (every process runs the same command with its own --process-id)")
    d.add_argument("--coordinator-address", help="HOST:PORT of process 0's coordinator (jax.distributed)")
    d.add_argument("--num-processes", type=int, help="processes in the job")
    d.add_argument("--process-id", type=int, help="this process (0 is the leader: scheduler and gRPC server)")
    d.add_argument(
        "--distributed",
        action="store_true",
        help="join a job JAX detects by itself (TPU pod slices, SLURM) instead of the three flags above",
    )
    d.add_argument(
        "--peer-timeout",
        type=float,
        default=60.0,
        help="multi-host, serving: seconds one process may wait on the others (a step; an idle leader's heartbeat) "
        "before the job counts as broken: the leader fails requests and stops serving, a follower exits. "
        "The leader's value counts: it sends it to the followers",
    )
    d.add_argument(
        "--peer-startup-timeout",
        type=float,
        default=600.0,
        help="multi-host, joining, loading and warming up: the same bound, larger, as the processes' start, loading "
        "and compiling times differ; a process waiting longer to join exits with status 2, one waiting longer "
        "while loading with status 1",
    )


def check_flags(args) -> None:
    """Raises InvalidRequestError naming the first flag out of its range (before anything binds or
    loads)."""
    from jaxinfer.cli import check_engine_flags
    from jaxinfer.errors import InvalidRequestError

    for name, lo, hi in (
        ("port", 0, 65535),
        ("metrics_port", 0, 65535),
        ("max_queued_requests", 0, 10**6),
        ("stream_interval", 1, 10**6),
        ("max_response_bytes", 1024, 2**31 - 1),
    ):
        v = getattr(args, name)
        if v is not None and not lo <= v <= hi:
            raise InvalidRequestError(f"--{name.replace('_', '-')} must be in [{lo}, {hi}], got {v}")
    check_engine_flags(args)
    if args.metrics_port and args.metrics_port == args.port:  # else "cannot bind ...: is the port in use"
        raise InvalidRequestError(f"--port and --metrics-port must differ, both are {args.port}")
    for name, limit, ok in (
        ("drain_timeout", ">= 0", lambda v: v >= 0),
        ("peer_timeout", "> 0", lambda v: v > 0),
        ("peer_startup_timeout", "> 0", lambda v: v > 0),
    ):
        v = getattr(args, name)
        if not (math.isfinite(v) and ok(v)):  # nan would never time out; <= 0 would spin
            flag = "--" + name.replace("_", "-")
            raise InvalidRequestError(f"{flag} must be a finite number of seconds {limit}, got {v}")


def server_config(args):
    """The ServerConfig of `jaxinfer serve`'s flags."""
    from jaxinfer.cli import engine_kwargs
    from serving.server import ServerConfig

    return ServerConfig(
        model=args.model,
        dtype=args.dtype,
        host=args.host,
        port=args.port,
        metrics_port=args.metrics_port,
        max_queued_requests=args.max_queued_requests,
        drain_timeout=args.drain_timeout,
        stream_interval=args.stream_interval,
        max_response_bytes=args.max_response_bytes,
        peer_timeout=args.peer_timeout,
        peer_startup_timeout=args.peer_startup_timeout,
        warmup_prompt_logprobs=args.warmup_prompt_logprobs,
        engine=engine_kwargs(args) | {"generation_config": args.generation_config},
    )


def configure_logging(level: str) -> None:
    """Our own log lines (one JSON line per request among them) from `level` up; other libraries'
    (orbax, JAX) only from WARNING up, unless DEBUG is asked for: their INFO chatter buried ours."""
    logging.basicConfig(level="DEBUG" if level == "DEBUG" else "WARNING", format="%(message)s", stream=sys.stderr)
    logging.getLogger("jaxinfer").setLevel(level)


def run(args) -> int:
    from jaxinfer.cli import flag_names
    from jaxinfer.errors import InvalidRequestError

    try:
        check_flags(args)  # before anything imports JAX: a bad flag is answered at once
    except InvalidRequestError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from serving.server import Server

    configure_logging(args.log_level)
    multi = (args.coordinator_address, args.num_processes, args.process_id)
    if args.distributed or any(v is not None for v in multi):  # a 0 or "" is refused by name, not ignored
        from jaxinfer import distributed

        try:
            distributed.initialize(
                args.coordinator_address,
                args.num_processes,
                args.process_id,
                initialization_timeout=args.peer_startup_timeout,
            )
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        except Exception as e:  # JAX's runtime: the coordinator never answered, or refused this process
            where = args.coordinator_address or "the detected cluster"
            print(f"error: cannot join the multi-host job at {where}: {type(e).__name__}: {e}", file=sys.stderr)
            return 2
        if not distributed.is_leader():
            return _follow(args)
    config = server_config(args)

    import jax

    async def main() -> int:
        server = Server(config)
        try:
            port = await server.start()
        except OSError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        from jaxinfer.distributed import is_loopback

        if not is_loopback(args.host):
            what = "gRPC and metrics ports" if server.metrics_port else "gRPC port"
            print(
                f"jaxinfer serve: WARNING: {what} bound to {args.host}, reachable beyond this machine",
                file=sys.stderr,
            )
        metrics = f", metrics on {args.host}:{server.metrics_port}" if server.metrics_port else ""
        print(f"jaxinfer serve: listening on {args.host}:{port}{metrics}; loading the model", flush=True)
        loop = asyncio.get_running_loop()
        stopping = set()  # the event loop holds tasks weakly: keep the drain alive until it is done
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda: stopping.add(loop.create_task(server.stop())))
        await server.ready.wait()
        if server.state == "failed":
            from jaxinfer.distributed import PeerFailureError

            print(f"error: {flag_names(str(server.load_error), args.options)}", file=sys.stderr)
            await server.stop(0)
            code = 1 if isinstance(server.load_error, PeerFailureError) else 2
            if server.still_loading or jax.process_count() > 1:  # a thread blocked on a peer; JAX's exit barrier
                return _exit_now(code)
            return code
        if server.state == "serving":
            print(f"jaxinfer serve: ready ({server.llm.cfg.name})", flush=True)
        await server.wait_stopped()
        if server.async_engine is not None and server.async_engine.broken is not None:
            print(f"jaxinfer serve: stopped; the multi-host job was broken ({server.async_engine.broken})", flush=True)
            return _exit_now(1)
        if server.still_loading or (server.async_engine is None and jax.process_count() > 1):
            # Stopped before the model was ready: nothing was accepted. Multi-host, the followers
            # are in collectives that will not come: JAX's exit barrier would wait on them.
            print("jaxinfer serve: stopped while loading the model", flush=True)
            return _exit_now(0)
        print("jaxinfer serve: stopped", flush=True)
        return 0

    return asyncio.run(main())


def _exit_on_stop_signals(who: str) -> None:
    """SIGTERM or SIGINT ends this process at once (status 128 + the signal), whatever its main thread
    is doing. A follower's main thread sits in collectives (C code, where no Python handler runs) and
    JAX's distributed runtime installs a C handler for SIGTERM (its preemption notice) that does
    nothing else: a follower told to stop went on serving until the leader stopped it. The C side of
    Python's handler writes the signal's number to the wakeup fd from whichever thread takes it, and a
    thread of ours waits on that. The job cannot serve without this process: the leader finds it
    gone at its next collective (UNAVAILABLE, NOT_SERVING), as for any follower that dies."""
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    signal.set_wakeup_fd(write_end)
    stops = (signal.SIGTERM, signal.SIGINT)
    for sig in stops:
        signal.signal(sig, lambda *_: None)  # the main thread's part: nothing (the thread below acts)

    def watch() -> None:
        while True:
            for number in os.read(read_end, 64):
                if number in stops:
                    sys.stderr.write(
                        f"{who}: {signal.Signals(number).name}; exiting (the job cannot serve without it)\n"
                    )
                    _exit_now(128 + number)

    threading.Thread(target=watch, name="jaxinfer-stop-signals", daemon=True).start()


def _exit_now(code: int) -> int:
    """Exit at once, skipping interpreter teardown and `jax.distributed`'s shutdown barrier.

    For a thread that cannot be stopped: an engine thread blocked in a collective on a dead or hung
    peer (the barrier would wait until the heartbeat timeout, the teardown forever and then abort),
    or a model still loading inside JAX when the server was told to stop (the teardown aborts the
    process under it). Nothing is left to flush but the standard streams."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _follow(args) -> int:
    """A follower: the same model and mesh as the leader, then the leader's steps until it stops."""
    import jax

    import jaxinfer
    from jaxinfer.cli import engine_kwargs, error_status, is_usage_error
    from jaxinfer.distributed import PeerFailureError, StepChannel, Watchdog, lost_peers, run_follower

    log = logging.getLogger("jaxinfer.serving")
    me = jax.process_index()

    def hung(seconds: float) -> None:  # on the watchdog's thread: the main one is stuck in a collective
        limit = watchdog.limit
        if watchdog.phase == "serving":
            why = f"the leader has sent nothing for {limit:g} s (its --peer-timeout; idle, it sends heartbeats)"
        else:
            why = f"waited {limit:g} s for the other processes while loading (--peer-startup-timeout)"
        # Straight to stderr: the main thread is stuck in C code, but a logging lock is not worth the risk.
        sys.stderr.write(f"jaxinfer serve: follower {me}: {why}: a process hung; exiting\n")
        _exit_now(1)

    watchdog = Watchdog(args.peer_startup_timeout, hung)
    _exit_on_stop_signals(f"jaxinfer serve: follower {me}")
    # Every exit goes through _exit_now, not the interpreter's: its exit runs JAX's shutdown, and
    # once the leader (which hosts the coordination service) is gone - it exits on the same bad
    # setting, or after its stop without waiting for us (recoverable mode) - the disconnect RPC
    # fails and JAX aborts the process (SIGABRT instead of the status below; ~1 clean stop in 4).
    try:
        llm = jaxinfer.LLM(args.model, dtype=args.dtype, **engine_kwargs(args))
        llm.engine.warmup(sampler=False)
        log.info("jaxinfer serve: follower %d of %d ready", me, jax.process_count())
        code = run_follower(llm.engine, StepChannel(), watchdog)
    except PeerFailureError as e:  # the leader gone or hung
        log.error("jaxinfer serve: follower %d: %s", me, e)
        return _exit_now(1)
    except SystemExit as e:
        return _exit_now(e.code if isinstance(e.code, int) else 1)
    except BaseException as e:  # answered as cli.main answers it (a bug's traceback printed, not raised)
        if first := lost_peers(e):
            # A collective or the coordinator gone: the leader exited (its port taken, a bad setting, a crash).
            log.error("jaxinfer serve: follower %d: lost the other processes (did the leader exit?): %s", me, first)
            return _exit_now(1)
        if os.environ.get("JAXINFER_TRACEBACK") and not is_usage_error(e):
            traceback.print_exc()
        return _exit_now(error_status(e))
    log.info("jaxinfer serve: follower %d: the leader stopped; exiting", me)
    return _exit_now(code)
