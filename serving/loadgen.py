"""`jaxinfer bench serve`: a load generator for a server on loopback, and the offline yardstick.

N streaming clients share one asyncio loop; requests arrive as a Poisson process (`--request-rate`,
or all at once) and at most `--concurrency` are in flight. Every request is token ids with a fixed
output length (greedy, EOS ignored), so the work is the same however the server batches it. The
run is bounded by the request count and by `--duration-limit`; whatever is still open then is
cancelled and counted.

Without `--server` it starts `jaxinfer serve` itself (loopback, a free port). With `--vs-offline` it
also loads an offline engine of the same configuration in this process and runs the very same
requests through both, one side at a time (the other idle), in rounds (`_compare`), and prints the
median served / offline output-token throughput: the price of gRPC, streaming and the engine thread.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import typing

import numpy as np

from jaxinfer.bench import RANGES_MAX_MODEL_LEN, drive_engine, latencies, percentile, workload_params
from jaxinfer.errors import InvalidRequestError


@dataclasses.dataclass
class Outcome:
    sent: float
    arrival: float = float("nan")  # when the workload says it arrives (TTFT counts from here)
    first: float | None = None
    done: float | None = None
    tokens: list[int] = dataclasses.field(default_factory=list)
    code: str = "OK"


def _check(args) -> None:
    if args.vs_offline and args.request_rate != float("inf"):
        raise InvalidRequestError(
            "--vs-offline compares throughput on the same work, and the offline engine takes every "
            "request at once: use --request-rate inf (the default) with it"
        )


def workload(args, vocab_size: int, seed: int = 0):
    """(prompts, params, arrival offsets in seconds): the same every run for the same arguments."""
    _check(args)
    lo_p, hi_p = (args.prompt_len_range + args.prompt_len_range)[:2]
    lo_o, hi_o = (args.output_len_range + args.output_len_range)[:2]
    rng = np.random.default_rng(seed)
    n = args.num_requests
    prompts = [rng.integers(3, vocab_size, int(k)).tolist() for k in rng.integers(lo_p, hi_p + 1, n)]
    params = workload_params(rng.integers(lo_o, hi_o + 1, n), penalties=getattr(args, "penalties", False))
    if args.request_rate == float("inf"):
        arrivals = np.zeros(n)
    else:
        arrivals = np.cumsum(rng.exponential(1.0 / args.request_rate, n))
    return prompts, params, arrivals.tolist()


async def drive(address: str, prompts, params, arrivals, *, concurrency: int, duration_limit: float):
    """Runs the load; returns (outcomes, wall seconds from the first send to the last finish)."""
    from jaxinfer.client import AsyncClient, ServerError

    sem = asyncio.Semaphore(concurrency)
    outcomes: list[Outcome | None] = [None] * len(prompts)

    async with AsyncClient(address) as client:
        start = time.perf_counter()

        async def one(i):
            await asyncio.sleep(max(0.0, start + arrivals[i] - time.perf_counter()))
            async with sem:
                o = outcomes[i] = Outcome(sent=time.perf_counter(), arrival=start + arrivals[i])
                try:
                    async for d in client.stream(prompt_token_ids=prompts[i], sampling_params=params[i]):
                        if d.token_ids and o.first is None:
                            o.first = time.perf_counter()
                        o.tokens += d.token_ids
                    o.done = time.perf_counter()
                except ServerError as e:
                    o.code = e.code
                except asyncio.CancelledError:
                    o.code = "CANCELLED (duration limit)"

        tasks = [asyncio.create_task(one(i)) for i in range(len(prompts))]
        _, pending = await asyncio.wait(tasks, timeout=duration_limit)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    sent = [o.sent for o in outcomes if o is not None]
    done = [o.done for o in outcomes if o is not None and o.done is not None]
    wall = (max(done) - min(sent)) if done else float("nan")
    return [o if o is not None else Outcome(sent=float("nan"), code="NOT SENT") for o in outcomes], wall


def summarize(outcomes, wall: float) -> dict:
    """Throughput, and TTFT / TPOT percentiles of the successful requests. TTFT counts from the
    request's arrival (its Poisson time, or the start), so time spent waiting for one of the
    client's `--concurrency` slots is in it, as the offline engine's TTFT includes its queue."""
    ok = [o for o in outcomes if o.code == "OK"]
    ttft = [o.first - o.arrival for o in ok if o.first is not None]
    tpot = [(o.done - o.first) / (len(o.tokens) - 1) for o in ok if len(o.tokens) > 1]
    tokens = sum(len(o.tokens) for o in ok)
    return {
        "requests_ok": len(ok),
        "output_tokens": tokens,
        "wall_s": wall,
        "output_tokens_per_s": tokens / wall if wall == wall and wall > 0 else float("nan"),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "tpot_p50_s": percentile(tpot, 50),
        "tpot_p99_s": percentile(tpot, 99),
        "errors": dict(collections.Counter(o.code for o in outcomes if o.code != "OK")),
    }


# How long a server may take to load and warm up before the load starts. Not --duration-limit,
# which bounds the load itself: a short one could never cover a model's start.
STARTUP_LIMIT = 1800.0


def _wait_serving(client, proc: subprocess.Popen | None, errors=None) -> None:
    """Until the server reports SERVING; the server this bench started must not exit meanwhile."""
    deadline = time.monotonic() + STARTUP_LIMIT
    while client.health() != "SERVING":
        if proc is not None and proc.poll() is not None:
            raise InvalidRequestError(f"the server exited with status {proc.returncode} while starting{_why(errors)}")
        if time.monotonic() > deadline:
            raise InvalidRequestError(f"{client.target} was not SERVING after {STARTUP_LIMIT:g} s")
        time.sleep(0.2)


def serve_argv(args, model_dir, max_model_len: int) -> list[str]:
    """`jaxinfer serve`'s arguments for the server this bench starts: the offline engine's
    configuration (`offline_kwargs`), on loopback, with a queue that holds every request."""
    argv = ["serve", "--host", "127.0.0.1", "--port", "0"]
    argv += ["--dtype", args.dtype, "--max-model-len", str(max_model_len)]
    argv += ["--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    argv += ["--max-queued-requests", str(args.num_requests), "--stream-interval", str(args.stream_interval)]
    if model_dir:
        argv += ["--model", model_dir]
    if not args.prefix_caching:
        argv.append("--no-prefix-caching")
    return argv


def _start_server(args, model_dir, max_model_len: int) -> tuple[subprocess.Popen, str, typing.IO[str]]:
    """The started server, its address, and the file its stderr goes to (the caller closes it)."""
    cmd = [sys.executable, "-m", "jaxinfer.cli", *serve_argv(args, model_dir, max_model_len)]
    errors = tempfile.TemporaryFile("w+")  # the server's stderr: why it failed to start, if it does
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=errors, text=True)
    line = proc.stdout.readline()
    if "listening on" not in line:
        proc.kill()
        proc.wait()
        why = _why(errors)
        errors.close()
        raise InvalidRequestError(f"the server did not start: {line.strip() or 'no output'}{why}")
    address = line.split("listening on ", 1)[1].split(",")[0].split(";")[0].strip()
    return proc, address, errors


def _why(errors) -> str:
    """The server's own `error:` line from its stderr, as the reason it stopped (a bench-derived
    max_model_len said in this bench's flags); '' if it printed none."""
    if errors is None:
        return ""
    errors.seek(0)
    lines = [ln.strip() for ln in errors.read().splitlines() if ln.startswith("error: ")]
    if not lines:
        return ""
    why = lines[-1].removeprefix("error: ")
    if why.startswith("--max-model-len "):  # a flag this bench passed, derived from its own
        why = f"max_model_len {why.split(' ', 1)[1]} (max_model_len here is {RANGES_MAX_MODEL_LEN})"
    return f": {why}"


def run(args, model_dir: str | None) -> dict:
    """Drives the server; with `--vs-offline`, in rounds against an offline engine (see `_compare`)."""
    from jaxinfer.client import Client

    _check(args)  # before minutes of starting a server
    lo_p, hi_p = (args.prompt_len_range + args.prompt_len_range)[:2]
    lo_o, hi_o = (args.output_len_range + args.output_len_range)[:2]
    max_model_len = hi_p + hi_o + 1
    proc = errors = None
    address = args.server
    if address is None:
        print("starting `jaxinfer serve` on loopback ...", file=sys.stderr)
        proc, address, errors = _start_server(args, model_dir, max_model_len)
    try:
        with Client(address) as c:
            status = c.health()
            if status == "UNREACHABLE" and proc is None:  # `jaxinfer serve` listens while it loads
                raise InvalidRequestError(f"--server {address}: nothing answers there (is `jaxinfer serve` running?)")
            if status != "SERVING":
                print(f"waiting up to {STARTUP_LIMIT:g} s for {address} to report SERVING", file=sys.stderr)
            _wait_serving(c, proc, errors)
            info = c.model_info()
        rate = "all at once" if args.request_rate == float("inf") else f"Poisson {args.request_rate:g}/s"
        print(
            f"server {address}: model {info['model_name']}, max_num_seqs {info['max_num_seqs']}; "
            f"{args.num_requests} requests ({rate}), concurrency {args.concurrency}, prompts {lo_p}-{hi_p} "
            f"tokens, outputs {lo_o}-{hi_o} tokens"
        )

        vocab = info["vocab_size"]

        def serve_round(prompts, params, arrivals) -> tuple[list[Outcome], dict]:
            outcomes, wall = asyncio.run(
                drive(
                    address,
                    prompts,
                    params,
                    arrivals,
                    concurrency=args.concurrency,
                    duration_limit=args.duration_limit,
                )
            )
            return outcomes, summarize(outcomes, wall)

        if args.vs_offline:
            llm = _offline_llm(args, model_dir, max_model_len, info["model_name"])
            report, rows = _compare(args, vocab, serve_round, llm)
        else:
            served = serve_round(*workload(args, vocab))[1]
            report, rows = {"served": served, "errors": served["errors"]}, {"served (gRPC)": served}
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
            errors.close()
    print(
        f"\n{'':>22} {'ok':>5} {'out tok':>8} {'wall s':>7} {'out tok/s':>10} "
        f"{'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9}"
    )
    for name, r in rows.items():
        print(
            f"{name:>22} {r['requests_ok']:>5} {r['output_tokens']:>8} {r['wall_s']:>7.2f} "
            f"{r['output_tokens_per_s']:>10.1f} {r['ttft_p50_s'] * 1e3:>7.1f}ms {r['ttft_p99_s'] * 1e3:>7.1f}ms "
            f"{r['tpot_p50_s'] * 1e3:>7.2f}ms {r['tpot_p99_s'] * 1e3:>7.2f}ms"
        )
    print(f"errors by code: {report['errors'] or 'none'}")
    if args.vs_offline:
        ratios = ", ".join(f"{x['ratio']:.3f}" for x in report["rounds"])
        print(
            f"served / offline output-token throughput: {report['ratio']:.3f} (median of {len(report['rounds'])} "
            f"rounds: {ratios}; warm-up round {report['warmup_ratio']:.3f}, not counted); "
            f"{report['identical_outputs']}/{args.num_requests} outputs identical to offline in every round"
        )
    if args.json:
        print(json.dumps(report))
    return report


def _compare(args, vocab: int, serve_round, llm) -> tuple[dict, dict]:
    """Served vs offline in rounds: one warm-up round, then `args.repeats` measured ones.

    Both sides stay loaded throughout, each idle while the other runs, so every round compares them
    on the same machine seconds apart, several times, rather than once each. The warm-up round is
    printed but not counted: in it the 150M model ran 1.28x (served) and 1.16x (offline) slower than
    in the rounds after it, so one comparison alone mostly measures which side ran first. Rounds
    alternate which side goes first and use a different workload seed (identical for
    the two sides of a round), so the prefix cache, when on, cannot carry one round into the next.
    """
    rounds = []
    for r in range(1 + args.repeats):
        prompts, params, arrivals = workload(args, vocab, seed=r)
        if r % 2 == 0:
            outcomes, served = serve_round(prompts, params, arrivals)
            offline = _offline_run(llm, prompts, params)
        else:
            offline = _offline_run(llm, prompts, params)
            outcomes, served = serve_round(prompts, params, arrivals)
        same = sum(o.tokens == t for o, t in zip(outcomes, offline.pop("token_ids")))
        ratio = served["output_tokens_per_s"] / offline["output_tokens_per_s"]
        rounds.append({"served": served, "offline": offline, "ratio": ratio, "identical_outputs": same})
        label = "warm-up round (not counted)" if r == 0 else f"round {r}"
        print(
            f"{label}: served {served['output_tokens_per_s']:.1f} tok/s, offline "
            f"{offline['output_tokens_per_s']:.1f} tok/s, ratio {ratio:.3f}",
            file=sys.stderr,
        )
    warm, measured = rounds[0], rounds[1:]
    mid = sorted(measured, key=lambda x: x["ratio"])[(len(measured) - 1) // 2]
    report = {
        "served": mid["served"],
        "offline": mid["offline"],
        "ratio": statistics.median(x["ratio"] for x in measured),
        "rounds": measured,
        "warmup_ratio": warm["ratio"],
        "identical_outputs": min(x["identical_outputs"] for x in rounds),
        "errors": dict(sum((collections.Counter(x["served"]["errors"]) for x in rounds), collections.Counter())),
    }
    rows = {}
    for i, x in enumerate(measured, 1):
        rows[f"served (gRPC) #{i}"] = x["served"]
        rows[f"offline (engine) #{i}"] = x["offline"]
    return report, rows


def offline_kwargs(args, model_dir, max_model_len: int) -> dict:
    """The LLM arguments of the offline yardstick: the started server's configuration (`serve_argv`)."""
    return dict(
        model=model_dir,
        dtype=args.dtype,
        max_model_len=max_model_len,
        # The served side never has more than --concurrency requests in flight: neither may this one.
        max_num_seqs=min(args.max_num_seqs, args.concurrency),
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=args.prefix_caching,
    )


def _offline_llm(args, model_dir, max_model_len, served_model: str):
    """An offline engine of the server's configuration, in this process."""
    from jaxinfer import LLM

    llm = LLM(**offline_kwargs(args, model_dir, max_model_len), warmup=True)
    llm.engine.wait_for_huge_pages()
    if args.concurrency < args.max_num_seqs:
        print(
            f"offline engine: max_num_seqs {args.concurrency} (= --concurrency: the served side runs at most "
            "that many requests at once)",
            file=sys.stderr,
        )
    if llm.cfg.name != served_model:
        raise InvalidRequestError(
            f"the server runs {served_model!r}, --vs-offline loaded {llm.cfg.name!r}: pass --model"
        )
    return llm


def _offline_run(llm, prompts, params) -> dict:
    """The same requests, all submitted at once to the offline engine."""
    wall, seqs, gaps = drive_engine(llm.engine, prompts, params)
    tokens = sum(len(s.output_ids) for s in seqs)
    return {
        "requests_ok": len(seqs),
        "output_tokens": tokens,
        "wall_s": wall,
        "output_tokens_per_s": tokens / wall,
        **latencies(seqs, gaps),
        "errors": {},
        "token_ids": [s.output_ids for s in seqs],
    }
