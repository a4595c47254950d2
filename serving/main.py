"""`jaxinfer serve`: the command line around `serving.server.Server`."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    from jaxinfer.cli import add_engine_arguments

    p.add_argument("--model", help="Hugging Face checkpoint directory (default: the embedded default model)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=9000, help="gRPC port (0: any free port, printed at start)")
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics on this port")
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
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    add_engine_arguments(p)


def run(args) -> int:
    from jaxinfer.cli import engine_kwargs
    from serving.server import Server, ServerConfig

    for name, lo in (("port", 0), ("metrics_port", 0), ("max_queued_requests", 0), ("stream_interval", 1)):
        v = getattr(args, name)
        if v is not None and not (lo <= v <= (65535 if "port" in name else 10**6)):
            print(f"error: --{name.replace('_', '-')} out of range: {v}", file=sys.stderr)
            return 2
    logging.basicConfig(level=args.log_level, format="%(message)s", stream=sys.stderr)
    config = ServerConfig(
        model=args.model,
        dtype=args.dtype,
        host=args.host,
        port=args.port,
        metrics_port=args.metrics_port,
        max_queued_requests=args.max_queued_requests,
        drain_timeout=args.drain_timeout,
        stream_interval=args.stream_interval,
        engine=engine_kwargs(args),
    )

    async def main() -> int:
        server = Server(config)
        try:
            port = await server.start()
        except OSError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        if args.host not in ("127.0.0.1", "localhost", "::1"):
            print(f"jaxinfer serve: WARNING: bound to {args.host}, reachable beyond this machine", file=sys.stderr)
        metrics = f", metrics on {args.host}:{server.metrics_port}" if server.metrics_port else ""
        print(f"jaxinfer serve: listening on {args.host}:{port}{metrics}; loading the model", flush=True)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda: loop.create_task(server.stop()))
        await server.ready.wait()
        if server.state == "failed":
            print(f"error: {server.load_error}", file=sys.stderr)
            await server.stop(0)
            return 2
        if server.state == "serving":
            print(f"jaxinfer serve: ready ({server.llm.cfg.name})", flush=True)
        await server.wait_stopped()
        print("jaxinfer serve: stopped", flush=True)
        return 0

    return asyncio.run(main())
