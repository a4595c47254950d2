"""`jaxinfer bench`: where the time goes in prefill and decode, against ceilings measured in the same run.

Decode streams every weight (and the whole live KV cache) once per step, so its honest yardstick is
memory bandwidth: we report bytes a step must read / step time, as a fraction of the fastest
streaming read this process can do on the same device right now (the best of three XLA reads of a
buffer much larger than the caches: `ReadCeiling`), measured right before each timed run: MBU is the
median of those pairs, and is printed against the run's best ceiling too. Prefill is compute-bound;
we report its achieved FLOP/s next to TTFT: 2 x the weights' parameters (the embedding table is a
lookup, not a product) x tokens, the LM head once (only the last token's logits are computed), and
attention's own products (a sliding-window layer's over its window only).

With --vs-hf, Hugging Face transformers runs `generate` on the same weights in the same process,
and the ratios are printed side by side. Timings are medians over repeats; compilation is excluded
by a warm-up run of every shape.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import glob
import json
import math
import os
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import _malloc
from jaxinfer.errors import InvalidRequestError
from jaxinfer.tokenizer import require_unicode

PRESETS = {
    # The ~150M-parameter Llama shape the project's decode targets are stated for.
    "llama-150m": dict(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=4,
        max_position_embeddings=2048,
    ),
    "llama-tiny": dict(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    ),
}


def _ints(s: str) -> list[int]:
    try:
        values = [int(x) for x in s.split(",")]  # "1,,2" is a typo, not [1, 2]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {s!r}")
    return values


def _checked(cast, ok, expected: str):
    """An argparse type: `cast(s)`, refused (naming what was expected) unless `ok(value)`; nan fails."""

    def parse(s: str):
        try:
            value = cast(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {s!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {s}")
        return value

    return parse


_positive_int = _checked(int, lambda v: v >= 1, "a positive integer")
_positive_seconds = _checked(float, lambda v: 0 < v < math.inf, "a positive, finite number of seconds")
_rate = _checked(float, lambda v: v > 0, "a positive number of requests per second (or inf)")


def _len_range(s: str) -> list[int]:
    """MIN,MAX (or one value for both) of positive token counts, MIN <= MAX."""
    values = _ints(s)
    if len(values) > 2 or values[0] > values[-1]:
        raise argparse.ArgumentTypeError(f"expected MIN,MAX with 1 <= MIN <= MAX, got {s!r}")
    return values


# `jaxinfer bench MODE ...` modes that parse their own flags (see cli._main).
OWN_FLAG_MODES = ("kernels", "load", "mesh", "window-pools")


class _Given(argparse.Action):
    """Stores the flag's value and notes it as given on the command line (see `_check_mode_flags`)."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        namespace.given = {*getattr(namespace, "given", ()), self.dest}


class _GivenFlag(_Given):
    """`store_true`, noted as given."""

    def __init__(self, option_strings, dest, default=False, **kw):
        super().__init__(option_strings, dest, nargs=0, default=default, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        super().__call__(parser, namespace, True, option_string)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "mode",
        nargs="?",
        default="latency",
        choices=["latency", "throughput", "serve", *OWN_FLAG_MODES],
        help="latency: TTFT, decode step, MBU (default); throughput: many requests offline, "
        "continuous batching against one request at a time; serve: streaming gRPC clients against "
        "`jaxinfer serve` (started here unless --server is given). With flags of their own (`jaxinfer bench "
        "MODE --help`): kernels: the paged-attention kernels against a measured copy bandwidth; load: HF "
        "safetensors vs orbax load time; mesh: bytes per device on each mesh; window-pools: a hybrid "
        "model's window pools against one pool size",
    )
    p.add_argument(
        "--model", help="Hugging Face or `jaxinfer convert` checkpoint directory (default: the embedded default model)"
    )
    p.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        help="write a random-weight HF checkpoint of this shape (needs transformers) and bench it",
    )
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="parameter dtype")
    p.add_argument("--prompt-lens", action=_Given, type=_ints, default=[32, 128, 512], help="TTFT prompt lengths")
    p.add_argument("--batch-sizes", action=_Given, type=_ints, default=[1, 4, 16], help="decode batch sizes")
    p.add_argument(
        "--context", action=_Given, type=_positive_int, default=128, help="prompt length for the decode runs"
    )
    p.add_argument("--new-tokens", action=_Given, type=int, default=64, help="tokens generated per decode run")
    p.add_argument(
        "--repeats",
        action=_Given,
        type=int,
        default=3,
        help="timed repeats (serve --vs-offline: measured rounds after a warm-up round)",
    )
    p.add_argument("--vs-hf", action=_GivenFlag, help="also run HF transformers generate on the same weights")
    p.add_argument("--json", action="store_true", help="print one JSON object with every figure at the end")
    p.add_argument(
        "--profile",
        action=_Given,
        metavar="DIR",
        help="latency mode: trace one more decode run at the first batch size with the JAX profiler into DIR "
        "(open it in ui.perfetto.dev or TensorBoard) and print where each jitted program's time went, by op",
    )
    t = p.add_argument_group("throughput mode")
    t.add_argument("--num-requests", action=_Given, type=_positive_int, default=256, help="requests in the workload")
    t.add_argument(
        "--prompt-len-range", action=_Given, type=_len_range, default=[16, 256], help="min,max prompt tokens"
    )
    t.add_argument(
        "--output-len-range", action=_Given, type=_len_range, default=[16, 256], help="min,max generated tokens"
    )
    t.add_argument(
        "--max-num-seqs", action=_Given, type=_positive_int, default=64, help="the engine's running sequences at most"
    )
    t.add_argument(
        "--max-num-batched-tokens",
        action=_Given,
        type=_positive_int,
        default=512,
        help="the engine's tokens per step at most",
    )
    t.add_argument(
        "--prefix-caching",
        action=_GivenFlag,
        help="keep the prefix cache on (off by default: the baseline run would warm it for the other)",
    )
    t.add_argument(
        "--penalties",
        action=_GivenFlag,
        help="every fourth request also asks for repetition_penalty 1.2 and frequency_penalty 0.3, so "
        "nearly every step carries a penalised row",
    )
    t.add_argument(
        "--vs-sync",
        action=_GivenFlag,
        help="run the continuous workload again reading each step's results before the next step "
        "(async scheduling off), and print the ratio",
    )
    sv = p.add_argument_group(
        "serve mode (also takes --num-requests, --prompt-len-range, --output-len-range, and for the server it "
        "starts --max-num-seqs, --max-num-batched-tokens, --prefix-caching)"
    )
    sv.add_argument(
        "--server", action=_Given, metavar="HOST:PORT", help="a running server (default: start one on loopback)"
    )
    sv.add_argument("--concurrency", action=_Given, type=_positive_int, default=32, help="streams in flight at most")
    sv.add_argument(
        "--request-rate",
        action=_Given,
        type=_rate,
        default=float("inf"),
        help="Poisson arrivals per second (default: all at once)",
    )
    sv.add_argument(
        "--duration-limit",
        action=_Given,
        type=_positive_seconds,
        default=600.0,
        help="seconds; open requests are then cancelled",
    )
    sv.add_argument(
        "--stream-interval", action=_Given, type=_positive_int, default=1, help="the started server's --stream-interval"
    )
    sv.add_argument(
        "--vs-offline", action=_GivenFlag, help="also run the same requests on an offline engine and print the ratio"
    )
    t.add_argument(
        "--baseline-requests",
        action=_Given,
        type=_positive_int,
        default=None,
        help="run only the first K requests one at a time for the baseline (default: all)",
    )
    t.add_argument(
        "--rounds",
        action=_Given,
        type=_positive_int,
        default=1,
        help="run the baseline and the continuous workload alternately this many times on the same engine "
        "and pool each side's rounds (a 2-vCPU machine's speed drifts by 10-20%% between minutes)",
    )


def _seconds(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _median_time(fn, repeats: int) -> float:
    return statistics.median(_seconds(fn) for _ in range(repeats))


class ReadCeiling:
    """Streaming-read bandwidth (bytes/s) of this device, three ways: an XLA reduction of the whole
    array, one per row (each a contiguous 16 KiB run; rows split over the cores), and the matvec a
    decode step's projections do. MBU is taken against the best: on the 2-core CPU the row sums read
    51-52 GB/s where the whole-array sum read 47-50 and the matvec 46 (as fast as torch's 2-thread
    sum, 48-51), so the two of them alone overstated MBU by up to ~10%.

    The three programs are compiled once, so that the ceiling can be measured again right before
    each timed decode run (see `_run`): this shared machine's read speed drifts by tens of percent
    within minutes (40-74 GB/s in one hour), which a ceiling taken minutes apart from the step it
    divides turns into MBU swings of the same size. The buffer lives only while `measure` runs: a
    bench of a model that fills an accelerator's memory keeps its headroom between measurements.
    On the CPU the buffer is instead kept, in huge pages as an engine's weights are (jaxinfer._malloc):
    a ceiling read in 4 KiB pages would flatter MBU (a C streaming read: ~12% slower in them; these
    XLA reads 2-4%), and the move into huge pages, ~1 s for 512 MB, is paid once.
    """

    def __init__(self, nbytes: int = 512 * 2**20):
        self.shape = (nbytes // 4 // 4096, 4096)
        self._kept = None  # the CPU's buffer, once in huge pages
        self.readers = (
            ("reduce", jax.jit(lambda a, b: jnp.sum(a))),
            ("rows", jax.jit(lambda a, b: jnp.sum(a, axis=1))),
            ("matvec", jax.jit(lambda a, b: b @ a)),
        )

    def measure(self, repeats: int = 5) -> dict[str, float]:
        """Bytes/s of each read: its fastest of `repeats` runs (the least disturbed one), after one
        untimed run (compilation the first time; the buffer's pages touched)."""
        if self._kept is None:
            x = jnp.ones(self.shape, jnp.float32)
            v = jnp.ones(self.shape[:1], jnp.float32)
            if x.devices().pop().platform == "cpu":
                _malloc.back_with_huge_pages([x], what="read ceiling", background=False)
                self._kept = (x, v)
        else:
            x, v = self._kept
        out = {}
        for name, f in self.readers:
            f(x, v).block_until_ready()
            times = []
            for _ in range(repeats):
                t = time.perf_counter()
                f(x, v).block_until_ready()
                times.append(time.perf_counter() - t)
            out[name] = x.nbytes / min(times)
        del x, v
        return out


def measure_read_bandwidth(nbytes: int = 512 * 2**20, repeats: int = 5) -> dict[str, float]:
    """One measurement: `ReadCeiling(nbytes).measure(repeats)`."""
    return ReadCeiling(nbytes).measure(repeats)


def _write_preset(name: str, path: str) -> None:
    import torch
    import transformers

    config = transformers.LlamaConfig(**PRESETS[name])
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path)


def _check_hf_stack(flag: str) -> None:
    """`--preset` writes its checkpoint with transformers, `--vs-hf` runs transformers: both need the
    Hugging Face stack, which only the test extra installs."""
    import importlib.util

    missing = [m for m in ("torch", "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        raise InvalidRequestError(
            f"{flag} needs {' and '.join(missing)} (the Hugging Face reference stack), which `pip install -e .` "
            'does not install: `pip install -e ".[test]"` adds it'
        )


def _is_hf_directory(model: str | None) -> bool:
    """A Hugging Face checkpoint directory: a config.json, and not a jaxinfer checkpoint (which has one too)."""
    from jaxinfer import checkpoint

    return bool(model) and os.path.isfile(os.path.join(model, "config.json")) and not checkpoint.is_checkpoint(model)


# The flags each mode reads beyond --model, --preset, --dtype and --json; a flag set to anything but
# its default in another mode is refused (`bench serve --rounds 1` ran its own count of rounds).
_WORKLOAD = {"num_requests", "prompt_len_range", "output_len_range", "max_num_seqs", "max_num_batched_tokens"}
MODE_FLAGS = {
    "latency": {"prompt_lens", "batch_sizes", "context", "new_tokens", "repeats", "vs_hf", "profile"},
    "throughput": {*_WORKLOAD, "prefix_caching", "penalties", "vs_sync", "baseline_requests", "rounds"},
    "serve": {*_WORKLOAD, "prefix_caching", "repeats", "server", "concurrency", "request_rate", "duration_limit"}
    | {"stream_interval", "vs_offline"},
}


def _check_mode_flags(args) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    defaults = vars(parser.parse_args([]))
    given = getattr(args, "given", set())  # on the command line, even at its default value

    def set_(dest: str) -> bool:
        return dest in given or getattr(args, dest, defaults[dest]) != defaults[dest]

    for dest in sorted(set().union(*MODE_FLAGS.values()) - MODE_FLAGS[args.mode]):
        if set_(dest):
            modes = " and ".join(m for m, flags in MODE_FLAGS.items() if dest in flags)
            raise InvalidRequestError(
                f"--{dest.replace('_', '-')} is a flag of the {modes} mode{'s' if ' and ' in modes else ''}; "
                f"it does nothing in {args.mode} mode"
            )
    if args.mode != "serve":
        return
    # Within serve mode the engine flags configure the server the bench starts (and the offline engine
    # of --vs-offline), and --repeats counts --vs-offline's rounds.
    if args.server:
        engine_flags = ["max_num_seqs", "max_num_batched_tokens", "prefix_caching"]
        for dest in ["stream_interval", *([] if args.vs_offline else engine_flags)]:
            if set_(dest):
                raise InvalidRequestError(
                    f"--{dest.replace('_', '-')} configures the server `bench serve` starts"
                    f"{'' if dest == 'stream_interval' else ' (and the offline engine of --vs-offline)'}; "
                    "with --server it does nothing"
                )
    if set_("repeats") and not args.vs_offline:
        raise InvalidRequestError("--repeats counts the rounds of --vs-offline; without it it does nothing")


def run(args) -> dict:
    from jaxinfer import LLM, SamplingParams
    from jaxinfer.model import params_nbytes

    if args.model and args.preset:
        raise InvalidRequestError("pass --model or --preset, not both")
    _check_mode_flags(args)
    if args.vs_hf and not (args.preset or _is_hf_directory(args.model)):
        # Refused now: transformers would only fail on it after the whole benchmark had run.
        raise InvalidRequestError(
            "--vs-hf needs a Hugging Face checkpoint (a directory with config.json): pass --model DIR "
            f"or --preset NAME{f', not {args.model}' if args.model else ''}"
        )
    for flag, on in (("--preset", args.preset), ("--vs-hf", args.vs_hf)):
        if on:  # refused now: without it the comparison would fail after the whole benchmark had run
            _check_hf_stack(flag)
    if args.profile:  # refused now, not after minutes of benchmarking
        require_unicode(args.profile, "--profile")  # (the profiler takes UTF-8 paths only)
        try:
            os.makedirs(args.profile, exist_ok=True)
        except OSError as e:
            reason = f"cannot create the trace directory ({e.strerror})"
            raise InvalidRequestError(f"--profile {args.profile}: {reason}") from None
    if args.new_tokens < 2:
        raise InvalidRequestError("--new-tokens must be >= 2 (decode time is measured between tokens)")
    if args.repeats < 1:
        raise InvalidRequestError(f"--repeats must be >= 1, got {args.repeats}")

    with contextlib.ExitStack() as stack:
        model_dir = args.model
        if args.preset:
            model_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="jaxinfer-bench-"))
            print(f"writing random-weight {args.preset} checkpoint to {model_dir} ...", file=sys.stderr)
            _write_preset(args.preset, model_dir)
        if args.mode == "serve":
            from serving import loadgen

            return loadgen.run(args, model_dir)
        if args.mode == "throughput":
            return _throughput(args, model_dir, LLM)
        return _run(args, model_dir, LLM, SamplingParams, params_nbytes)


def percentile(values, q: float) -> float:
    """The q-th percentile of `values` (NaN when there are none)."""
    return float(np.percentile(np.asarray(values), q)) if len(values) else float("nan")


def drive_engine(engine, prompts, params) -> tuple[float, list, list]:
    """Submits all requests at once and steps until done; returns (wall seconds, sequences, the gaps
    between consecutive tokens of each sequence)."""
    t0 = time.perf_counter()
    reqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    last, gaps = {}, []
    while engine.has_unfinished():
        updates = engine.step()
        now = time.perf_counter()  # the step's tokens are on the host
        for u in updates:
            if u.token_ids:
                if u.seq.seq_id in last:
                    gaps.append(now - last[u.seq.seq_id])
                last[u.seq.seq_id] = now
    wall = time.perf_counter() - t0
    for r in reqs:
        engine.release(r.request_id)
    return wall, [s for r in reqs for s in r.seqs], gaps


def latencies(seqs, gaps) -> dict:
    """TTFT per request; ITL per token (every gap between two tokens of a sequence); TPOT per
    request (its mean time per output token after the first, what vLLM's benchmarks call TPOT)."""
    ttft = [s.first_token_time - s.arrival_time for s in seqs]
    tpot = [(s.last_token_time - s.first_token_time) / (len(s.output_ids) - 1) for s in seqs if len(s.output_ids) > 1]
    return {
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "itl_p50_s": percentile(gaps, 50),
        "itl_p99_s": percentile(gaps, 99),
        "tpot_p50_s": percentile(tpot, 50),
        "tpot_p99_s": percentile(tpot, 99),
    }


def _phase_totals(engine) -> dict:
    """Running totals of the engine's jitted calls by phase: seconds, calls, tokens computed."""
    s = engine.stats()
    return {
        ph: (s["step_seconds"][ph]["sum"], s["step_seconds"][ph]["count"], s["step_tokens"][ph])
        for ph in ("prefill", "decode")
    }


def _add_phases(into: dict, before: dict, after: dict) -> dict:
    """`into` plus `after - before` of two `_phase_totals`: the rounds of one side pooled."""
    return {ph: tuple(i + a - b for i, a, b in zip(into[ph], after[ph], before[ph])) for ph in into}


def _phases(before: dict, after: dict, wall: float) -> dict:
    """Where a run's wall time went: prompt calls, decode calls, and the rest (host work)."""
    (p_s, p_n, p_tok), (d_s, d_n, d_tok) = (tuple(a - b for a, b in zip(after[ph], before[ph])) for ph in before)
    return {
        "prefill_s": p_s,
        "prefill_calls": p_n,
        "prefill_tokens": p_tok,
        "decode_s": d_s,
        "decode_calls": d_n,
        "decode_rows": d_tok,
        "other_s": wall - p_s - d_s,
    }


WORKLOAD_PENALTIES = dict(repetition_penalty=1.2, frequency_penalty=0.3)


def workload_params(output_lens, *, penalties: bool = False) -> list:
    """Greedy with EOS ignored, so the work is fixed by the lengths; with `penalties`, every fourth
    request also has WORKLOAD_PENALTIES (`--penalties`)."""
    from jaxinfer.sampling import SamplingParams

    extra = [WORKLOAD_PENALTIES if penalties and i % 4 == 0 else {} for i in range(len(output_lens))]
    return [
        SamplingParams(max_tokens=int(n), temperature=0.0, ignore_eos=True, **e) for n, e in zip(output_lens, extra)
    ]


# How the throughput and serve modes derive max_model_len from their flags (said when it is refused).
RANGES_MAX_MODEL_LEN = "the largest of --prompt-len-range plus that of --output-len-range, plus 1"


@contextlib.contextmanager
def _sized_by(**how: str):
    """The engine's refusal of a size this bench derived from its flags, said with the flags' names
    (`max_model_len must be ..., got 100001` alone names no flag the user typed). `how`: engine
    argument -> how the bench derives it."""
    try:
        yield
    except InvalidRequestError as e:
        name = str(e).split(" ", 1)[0]
        if name in how:
            raise InvalidRequestError(f"{e} ({name} here is {how[name]})") from None
        raise


def _throughput(args, model_dir, LLM) -> dict:
    """Offline throughput: N mixed requests through one continuous batch vs one at a time."""
    lo_p, hi_p = (args.prompt_len_range + args.prompt_len_range)[:2]
    lo_o, hi_o = (args.output_len_range + args.output_len_range)[:2]
    rng = np.random.default_rng(0)
    prompt_lens = rng.integers(lo_p, hi_p + 1, args.num_requests)
    output_lens = rng.integers(lo_o, hi_o + 1, args.num_requests)
    with _sized_by(
        max_model_len=RANGES_MAX_MODEL_LEN,
        max_num_seqs="--max-num-seqs",
        max_num_batched_tokens="--max-num-batched-tokens",
    ):
        llm = LLM(
            model_dir,
            dtype=args.dtype,
            max_model_len=hi_p + hi_o + 1,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            enable_prefix_caching=args.prefix_caching,
        )
    cfg = llm.cfg
    prompts = [rng.integers(3, cfg.vocab_size, n).tolist() for n in prompt_lens]
    params = workload_params(output_lens, penalties=args.penalties)
    from jaxinfer.engine import num_compiles

    t = time.perf_counter()
    compiled = llm.engine.warmup()
    llm.engine.wait_for_huge_pages()  # both sides timed on memory as it will stay
    after_warmup = num_compiles()
    print(
        f"model {cfg.name}: {cfg.num_params / 1e6:.1f}M params, {cfg.dtype}; warm-up: {compiled} XLA "
        f"compilations (step shapes and samplers) in {time.perf_counter() - t:.0f} s; "
        f"KV cache {llm.stats()['kv_pages_total']} pages, "
        f"{llm.stats()['kv_cache_bytes'] / 1e6:.0f} MB"
    )
    print(
        f"{args.num_requests} requests: prompts {lo_p}-{hi_p} tokens, outputs {lo_o}-{hi_o} tokens, "
        f"max_num_seqs {args.max_num_seqs}, max_num_batched_tokens {args.max_num_batched_tokens}"
        + ("; every fourth with repetition 1.2 and frequency 0.3 penalties" if args.penalties else "")
    )

    k = min(args.baseline_requests or args.num_requests, args.num_requests)
    base_wall, base_seqs, base_gaps = 0.0, [], []
    cb_wall, cb_seqs, cb_gaps = 0.0, [], []
    zero = {ph: (0.0, 0, 0) for ph in ("prefill", "decode")}
    base_phases, cb_phases, round_ratios = zero, zero, []
    for _ in range(args.rounds):  # alternating, so a drift of the machine's speed falls on both sides
        t0 = _phase_totals(llm.engine)
        wall_0, seqs_0 = base_wall, len(base_seqs)
        for p, sp in zip(prompts[:k], params[:k]):
            wall, seqs, gaps = drive_engine(llm.engine, [p], [sp])
            base_wall += wall
            base_seqs += seqs
            base_gaps += gaps
        t1 = _phase_totals(llm.engine)
        wall, seqs, gaps = drive_engine(llm.engine, prompts, params)
        t2 = _phase_totals(llm.engine)
        base_phases, cb_phases = _add_phases(base_phases, t0, t1), _add_phases(cb_phases, t1, t2)
        cb_wall += wall
        cb_seqs += seqs
        cb_gaps += gaps
        base_rate = sum(len(s.output_ids) for s in base_seqs[seqs_0:]) / (base_wall - wall_0)
        round_ratios.append(sum(len(s.output_ids) for s in seqs) / wall / base_rate)
    base_tokens = sum(len(s.output_ids) for s in base_seqs)
    cb_tokens = sum(len(s.output_ids) for s in cb_seqs)
    last_round, last_wall = seqs, wall  # the continuous workload's last round
    t2 = _phase_totals(llm.engine)
    if args.vs_sync:
        llm.engine.async_scheduling = False
        sync_wall, sync_seqs, sync_gaps = drive_engine(llm.engine, prompts, params)
        llm.engine.async_scheduling = True
        t3 = _phase_totals(llm.engine)
        if [s.output_ids for s in sync_seqs] != [s.output_ids for s in last_round]:
            raise RuntimeError("async scheduling changed the outputs")  # a bug, not a measurement
    stats = llm.stats()
    rows = {
        "one_at_a_time": {
            "requests": k * args.rounds,
            "wall_s": base_wall,
            "output_tokens_per_s": base_tokens / base_wall,
            "requests_per_s": k * args.rounds / base_wall,
            **latencies(base_seqs, base_gaps),
            **_phases(zero, base_phases, base_wall),
        },
        "continuous": {
            "requests": args.num_requests * args.rounds,
            "wall_s": cb_wall,
            "output_tokens_per_s": cb_tokens / cb_wall,
            "requests_per_s": args.num_requests * args.rounds / cb_wall,
            **latencies(cb_seqs, cb_gaps),
            **_phases(zero, cb_phases, cb_wall),
        },
    }
    if args.vs_sync:
        rows["continuous_sync"] = {
            "requests": args.num_requests,
            "wall_s": sync_wall,
            "output_tokens_per_s": sum(len(s.output_ids) for s in sync_seqs) / sync_wall,
            "requests_per_s": args.num_requests / sync_wall,
            **latencies(sync_seqs, sync_gaps),
            **_phases(t2, t3, sync_wall),
        }
    ratio = rows["continuous"]["output_tokens_per_s"] / rows["one_at_a_time"]["output_tokens_per_s"]
    print(
        f"\n{'mode':>14} {'requests':>9} {'wall s':>8} {'out tok/s':>10} {'req/s':>7} "
        f"{'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8} {'TPOT p50':>8} {'TPOT p99':>8}"
    )
    for name, r in rows.items():
        print(
            f"{name:>14} {r['requests']:>9} {r['wall_s']:>8.1f} {r['output_tokens_per_s']:>10.1f} "
            f"{r['requests_per_s']:>7.2f} {r['ttft_p50_s'] * 1e3:>7.0f}ms {r['ttft_p99_s'] * 1e3:>7.0f}ms "
            f"{r['itl_p50_s'] * 1e3:>6.1f}ms {r['itl_p99_s'] * 1e3:>6.1f}ms "
            f"{r['tpot_p50_s'] * 1e3:>6.1f}ms {r['tpot_p99_s'] * 1e3:>6.1f}ms"
        )
    print(
        f"\nwhere the time went (a jitted call counts until its tokens are on the host; other = host work)"
        f"\n{'mode':>14} {'prompt s':>9} {'prompt tok/s':>13} {'decode s':>9} {'steps':>6} {'rows/step':>10} "
        f"{'ms/step':>8} {'other s':>8}"
    )
    for name, r in rows.items():
        steps = max(r["decode_calls"], 1)
        print(
            f"{name:>14} {r['prefill_s']:>9.2f} {r['prefill_tokens'] / max(r['prefill_s'], 1e-9):>13.0f} "
            f"{r['decode_s']:>9.2f} {r['decode_calls']:>6} {r['decode_rows'] / steps:>10.1f} "
            f"{r['decode_s'] / steps * 1e3:>8.1f} {r['other_s']:>8.2f}"
        )
    note = "" if k == args.num_requests else f" (baseline measured on the first {k} requests)"
    if args.rounds > 1:
        each = ", ".join(f"{r:.2f}x" for r in round_ratios)
        note += f"; {args.rounds} alternating rounds pooled, each round {each}"
    print(f"continuous batching / one at a time: {ratio:.2f}x output-token throughput{note}")
    if args.vs_sync:
        print(f"async scheduling / one step at a time: {sync_wall / last_wall:.2f}x (same outputs)")
    print(
        f"preemptions {stats['num_preemptions']}, prefix-cache hit tokens {stats['prefix_cache_hit_tokens']}, "
        f"XLA compilations after warm-up: {num_compiles() - after_warmup}"
    )
    report = {
        "model": cfg.name,
        "ratio": ratio,
        "round_ratios": round_ratios,
        **rows,
        "stats": {k2: v for k2, v in stats.items() if not isinstance(v, dict)},
    }
    if args.json:
        print(json.dumps(report))
    return report


def causal_pairs(cfg, n: int) -> int:
    """Query-key pairs of one n-token prompt, summed over the layers: the query at position p sees
    p + 1 keys, or at most a sliding-window layer's window (its attention skips the tiles before
    the window, as its decode reads only its window: `ModelConfig.kv_bytes_read`)."""
    from jaxinfer.config import SlidingWindow

    def pairs(kind) -> int:
        w = kind.window if isinstance(kind, SlidingWindow) else n
        m = min(n, w)  # the first m queries see every key before them; each later one sees w
        return m * (m + 1) // 2 + (n - m) * w

    return sum(pairs(cfg.attention_kind(i)) for i in range(cfg.num_layers))


def prefill_flops(cfg, n: int) -> int:
    """Matmul FLOPs of a batch-1 prefill of n tokens: every body weight once per prompt token (norm
    weights too: <0.2%), the LM head once (logits only for the last token; the embedding table is a
    lookup), and attention's QK^T and PV over each layer's causal pairs (`causal_pairs`; as
    notebooks/anatomy_of_inference.ipynb counts them, there for global layers only)."""
    head = cfg.vocab_size * cfg.hidden_size
    body = cfg.num_params - head * (1 if cfg.tie_word_embeddings else 2)
    attention = 2 * 2 * cfg.num_heads * cfg.head_dim * causal_pairs(cfg, n)
    return 2 * body * n + 2 * head + attention


def _run(args, model_dir, LLM, SamplingParams, params_nbytes) -> dict:
    max_len = max(max(args.prompt_lens), args.context + args.new_tokens) + 1
    max_seqs = max(args.batch_sizes)
    with _sized_by(
        max_model_len="1 + the larger of the largest --prompt-lens and --context + --new-tokens",
        max_num_seqs="the largest --batch-sizes",
        max_num_batched_tokens="the largest of 16, the largest --prompt-lens and --context x the largest --batch-sizes",
    ):
        llm = LLM(
            model_dir,
            dtype=args.dtype,
            max_model_len=max_len,
            max_num_seqs=max_seqs,
            max_num_batched_tokens=max(16, max(args.prompt_lens), max_seqs * args.context),  # 16: the engine's least
            # Every timing repeats the same prompts: a warm prefix cache would skip the prefill we time.
            enable_prefix_caching=False,
        )
    llm.engine.wait_for_huge_pages()  # timed on the memory the engine will keep (_malloc)
    cfg = llm.cfg
    weight_bytes = params_nbytes(llm.params)
    # Decode reads every weight except the embedding table (only B rows of it) once per step.
    embed_bytes = cfg.vocab_size * cfg.hidden_size * jnp.dtype(cfg.dtype).itemsize
    streamed_bytes = weight_bytes - (0 if cfg.tie_word_embeddings else embed_bytes)
    # The ceiling is measured now, again right before each timed decode run (that run's MBU is
    # against it: the two side by side), and after the decode runs; the best figure of each kind is
    # kept for the run's best ceiling, against which MBU errs on the low side, never the high side.
    reader = ReadCeiling()
    bw = reader.measure()
    ceiling = max(bw.values())
    rng = np.random.default_rng(0)
    low = 3  # clear of pad/BOS/EOS in every tokenizer we ship
    report: dict = {
        "model": cfg.name,
        "dtype": cfg.dtype,
        "params": cfg.num_params,
        "weight_bytes": weight_bytes,
        "weight_strips": cfg.weight_strips,
        "kv_bytes_per_token": cfg.kv_bytes_per_token,
        "device": str(jax.devices()[0]),
        "read_bandwidth_GBps": {k: v / 1e9 for k, v in bw.items()},
        "ttft": [],
        "decode": [],
    }
    print(
        f"model {cfg.name}: {cfg.num_params / 1e6:.1f}M params, {cfg.dtype}, weights {weight_bytes / 1e6:.1f} MB"
        + (f" (in {cfg.weight_strips}-column strips: the native float32 products)" if cfg.weight_strips else "")
        + f", KV cache {cfg.kv_bytes_per_token} B/token ({cfg.kv_bytes_per_token / 1024:.1f} KiB)"
    )
    print(
        f"device {jax.devices()[0]}; streaming read ceiling {ceiling / 1e9:.1f} GB/s "
        "(" + ", ".join(f"{k} {v / 1e9:.1f}" for k, v in bw.items()) + ")"
    )

    greedy1 = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    scored = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
    print("\nprefill (batch 1): time to first token; with prompt_logprobs (every position's, and the top 20)")
    print(f"{'prompt':>8} {'TTFT ms':>10} {'GFLOP/s':>10} {'+prompt_lp ms':>14} {'ratio':>6}")
    for n in args.prompt_lens:
        prompt = rng.integers(low, cfg.vocab_size, n).tolist()
        for sp in (greedy1, scored):
            llm.generate(prompt_token_ids=[prompt], sampling_params=sp)  # compile this bucket
        t = _median_time(lambda p=prompt: llm.generate(prompt_token_ids=[p], sampling_params=greedy1), args.repeats)
        t_lp = _median_time(lambda p=prompt: llm.generate(prompt_token_ids=[p], sampling_params=scored), args.repeats)
        flops = prefill_flops(cfg, n)
        print(f"{n:>8} {t * 1e3:>10.1f} {flops / t / 1e9:>10.1f} {t_lp * 1e3:>14.1f} {t_lp / t:>6.2f}")
        report["ttft"].append(
            {"prompt_len": n, "ttft_s": t, "flops": flops, "gflops": flops / t / 1e9, "prompt_logprobs_ttft_s": t_lp}
        )

    print(
        f"\ndecode: prompt {args.context}, {args.new_tokens} new tokens per sequence "
        "(rows: mean rows per step once every row decodes; rows prefilled earlier finish earlier;\n"
        "ceiling: the read ceiling measured right before each run, median; MBU: each run against its own)"
    )
    print(f"{'batch':>6} {'rows':>6} {'step ms':>9} {'tok/s':>9} {'GB/s':>8} {'ceiling':>8} {'MBU':>6}")
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    # A row's K/V bytes per step, averaged over the decode window's steps (the j-th reads context + j
    # tokens): a sliding-window layer reads min(context + j, window), and that at the mean context
    # would overstate the mean where the window ends inside the run.
    kv_per_row = statistics.fmean(cfg.kv_bytes_read(args.context + j) for j in range(1, args.new_tokens))
    for b in args.batch_sizes:
        prompts = [rng.integers(low, cfg.vocab_size, args.context).tolist() for _ in range(b)]
        llm.generate(prompt_token_ids=prompts, sampling_params=params)  # compile every bucket on the way
        runs, paired = [], []  # paired: (bytes/s of the run, the ceiling measured just before it)
        for _ in range(args.repeats):
            now = reader.measure(repeats=3)
            bw = {k: max(v, now[k]) for k, v in bw.items()}
            step_i, total_i, rows_i = _decode_once(llm, prompts, params)
            runs.append((step_i, total_i, rows_i))
            paired.append(((streamed_bytes + rows_i * kv_per_row) / step_i, max(now.values())))
        step = statistics.median(r[0] for r in runs)
        rows = statistics.median(r[2] for r in runs)
        achieved = (streamed_bytes + rows * kv_per_row) / step
        row = {
            "batch": b,
            "rows_per_step": rows,
            "step_s": step,
            "tokens_per_s": rows / step,
            "GBps": achieved / 1e9,
            # Each run against the ceiling measured just before it, the median of those ratios.
            "mbu": statistics.median(a / c for a, c in paired),
            "paired_ceiling_GBps": statistics.median(c for _, c in paired) / 1e9,
            "total_s": statistics.median(r[1] for r in runs),
        }
        report["decode"].append(row)
        print(
            f"{b:>6} {rows:>6.1f} {step * 1e3:>9.2f} {rows / step:>9.1f} "
            f"{achieved / 1e9:>8.1f} {row['paired_ceiling_GBps']:>8.1f} {row['mbu']:>6.0%}"
        )

    llc = last_level_cache_bytes() if jax.devices()[0].platform == "cpu" else None
    report["last_level_cache_bytes"] = llc
    smallest = min((streamed_bytes + r["rows_per_step"] * kv_per_row for r in report["decode"]), default=None)
    if llc and smallest is not None and smallest < llc:
        print(
            f"note: a step reads {smallest / 2**20:.0f} MiB, which fits in this CPU's {llc / 2**20:.0f} MiB "
            "last-level cache: much of it comes from the cache, not from memory, so GB/s and MBU can pass "
            "the memory's read ceiling (a model several times larger than the cache measures memory)"
        )

    if args.profile:
        b = args.batch_sizes[0]
        prompts = [rng.integers(low, cfg.vocab_size, args.context).tolist() for _ in range(b)]
        before = llm.stats()["step_seconds"]
        with jax.profiler.trace(args.profile, create_perfetto_trace=True):
            _decode_once(llm, prompts, params)
        after = llm.stats()["step_seconds"]
        calls = {phase: after[phase]["count"] - before[phase]["count"] for phase in after}
        report["profile"] = {"engine_calls": calls, "programs": profile_summary(args.profile)}
        _print_profile(report["profile"]["programs"], f"one decode run at batch {b}, traced into {args.profile}")
        print("engine calls in it: " + ", ".join(f"{n} {phase}" for phase, n in calls.items()))

    report["sampler"] = _sampler_times(cfg.vocab_size, args.batch_sizes, SamplingParams)

    again = reader.measure()
    del reader
    bw = {k: max(v, again[k]) for k, v in bw.items()}
    ceiling = max(bw.values())
    report["read_bandwidth_GBps"] = {k: v / 1e9 for k, v in bw.items()}
    for row in report["decode"]:
        row["mbu_vs_best"] = row["GBps"] * 1e9 / ceiling
    if report["decode"]:
        print(
            f"best ceiling of the run (before, between and after the decode runs): {ceiling / 1e9:.1f} GB/s; "
            "MBU against it: " + ", ".join(f"batch {r['batch']} {r['mbu_vs_best']:.0%}" for r in report["decode"])
        )

    if args.vs_hf:
        report["hf"] = _vs_hf(args, model_dir, llm, report, rng, low)
    if args.json:
        print(json.dumps(report))
    return report


SAMPLER_SETTINGS = {
    "greedy": dict(temperature=0.0),
    "temperature": dict(temperature=0.8),
    "top-k 50": dict(temperature=0.8, top_k=50),
    "top-p 0.95": dict(temperature=0.8, top_p=0.95),
    "k 50 p 0.9": dict(temperature=0.6, top_k=50, top_p=0.9),  # Llama 3's generation_config, HF's top_k
}


def last_level_cache_bytes() -> int | None:
    """The largest CPU cache's size in bytes, as Linux reports it for CPU 0 (None where it does not)."""
    sizes = []
    for entry in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            with open(entry) as f:
                text = f.read().strip()
        except OSError:
            continue
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:].upper(), 1)
        digits = text[:-1] if scale != 1 else text
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    return max(sizes, default=None)


def _sampler_times(vocab: int, batch_sizes: list[int], SamplingParams) -> list[dict]:
    """Time of the sampler alone on [batch, vocab] logits, per setting: part of every decode step
    (the decode table above is greedy, which skips everything but an argmax)."""
    from jaxinfer.sampling import SamplingBatch, native_cuts, sample

    print("\nsampler: one call on [batch, vocab] logits (inside every decode step), ms. The logits are N(0, 9),")
    print("flatter than a trained model's: top-p 0.95 keeps thousands of tokens of them, top-k 50 and Llama 3's")
    if native_cuts():
        print("k 50 p 0.9 a few dozen; every cut by the C++ radix kernel (native.cut_thresholds), two passes per row")
    else:
        print("k 50 p 0.9 a few dozen (searched among the 2048 of each row's top blocks; top-p 0.95's rows whole)")
    print(f"{'batch':>6} " + " ".join(f"{name:>12}" for name in SAMPLER_SETTINGS))
    rows = []
    for b in batch_sizes:
        logits = jnp.asarray(np.random.default_rng(b).standard_normal((b, vocab), np.float32) * 3)
        row = {"batch": b}
        for name, kw in SAMPLER_SETTINGS.items():
            p = SamplingParams(seed=1, **kw)
            sb = SamplingBatch.from_rows([(p, 1, i, [], 0) for i in range(b)], b)
            sample(logits, sb).tokens.block_until_ready()  # compile
            call = functools.partial(sample, logits, sb)
            row[name] = min(_seconds(lambda call=call: call().tokens.block_until_ready()) for _ in range(5))
        rows.append(row)
        print(f"{b:>6} " + " ".join(f"{row[name] * 1e3:>12.2f}" for name in SAMPLER_SETTINGS))
    return rows


def profile_summary(trace_dir: str, top: int = 4) -> list[dict]:
    """Where each jitted program's time went, from the newest Perfetto trace under `trace_dir`.

    Reads the device-op events (those the runtime tags with `hlo_module` and `hlo_op`) and groups
    them by program and, inside one, by op kind (the HLO op name up to its first dot: `dot`, `while`,
    `loop_fusion`, ...). Per program: `runs` (distinct executions, by the events' `run_id`),
    `wall_ms` per run (first op's start to last op's end), `op_ms` per run (summed op durations) and
    each op kind's share of the latter. `op_ms` may exceed the wall time where ops overlap, and fall
    short of it where work is not attributed to an op: on CPU a large matmul's Eigen worker threads
    are not (prefill's GEMMs), while a decode step's matrix-vector products are.
    """
    import glob
    import gzip

    paths = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
    if not paths:
        raise FileNotFoundError(f"no *.trace.json.gz under {trace_dir}: the profiler wrote no Perfetto trace")
    with gzip.open(max(paths, key=os.path.getmtime)) as f:
        events = json.load(f)["traceEvents"]
    programs: dict[str, dict] = {}
    for e in events:
        a = e.get("args") or {}
        if e.get("ph") != "X" or "hlo_op" not in a or "hlo_module" not in a:
            continue
        prog = programs.setdefault(a["hlo_module"], {"us": 0.0, "spans": {}, "ops": {}})
        prog["us"] += e["dur"]
        lo, hi = prog["spans"].get(a.get("run_id"), (e["ts"], e["ts"] + e["dur"]))
        prog["spans"][a.get("run_id")] = (min(lo, e["ts"]), max(hi, e["ts"] + e["dur"]))
        op = prog["ops"].setdefault(a["hlo_op"].split(".")[0], [0.0, 0])  # "cond.21.clone" -> "cond"
        op[0] += e["dur"]
        op[1] += 1
    rows = []
    for name, prog in sorted(programs.items(), key=lambda kv: -kv[1]["us"]):
        runs = len(prog["spans"])  # events without a run_id count as one run
        ops = sorted(prog["ops"].items(), key=lambda kv: -kv[1][0])
        rows.append(
            {
                "program": name,
                "runs": runs,
                "wall_ms": sum(hi - lo for lo, hi in prog["spans"].values()) / runs / 1e3,
                "op_ms": prog["us"] / runs / 1e3,
                "ops": [{"kind": k, "share": us / prog["us"], "per_run": n / runs} for k, (us, n) in ops[:top]],
            }
        )
    return rows


def _print_profile(rows: list[dict], what: str) -> None:
    print(f"\nprofile of {what}")
    print(f"{'program':>16} {'runs':>5} {'wall ms':>8} {'op ms':>8}  largest op kinds (share of op ms, calls per run)")
    for r in rows:
        ops = ", ".join(f"{o['kind']} {o['share']:.0%} ({o['per_run']:.0f})" for o in r["ops"])
        print(f"{r['program'][:16]:>16} {r['runs']:>5} {r['wall_ms']:>8.2f} {r['op_ms']:>8.2f}  {ops}")


def _decode_once(llm, prompts, params) -> tuple[float, float, float]:
    """(seconds per decode step, prefill + decode time, mean rows per decode step) of one batch
    through the engine.

    The decode window runs from the step that gave the last row its first token to the last step.
    Rows whose prompts were prefilled in earlier calls are ahead and finish first, so the window's
    last steps carry fewer rows than the batch: the tokens are counted, not assumed (a batch of 64
    with prompts up to 512 tokens averaged 56 rows per step), and tok/s is rows / step time.
    """
    t0 = time.perf_counter()
    reqs = [llm.engine.add_request(p, params) for p in prompts]
    steps = []  # (time the step's tokens were on the host, tokens it generated)
    while llm.engine.has_unfinished():
        updates = llm.engine.step()
        steps.append((time.perf_counter(), sum(len(u.token_ids) for u in updates)))
    start = max(s.first_token_time for r in reqs for s in r.seqs)
    k = next(i for i, (t, _) in enumerate(steps) if t >= start)  # the step that started the last row
    window = steps[k + 1 :]
    if not window:
        raise InvalidRequestError("no decode step after the last row's first token: use at least 2 new tokens")
    seconds = steps[-1][0] - steps[k][0]
    return seconds / len(window), steps[-1][0] - t0, sum(n for _, n in window) / len(window)


class _TokenTimestamps:
    """A transformers stopping criterion that never stops and records when each token was made."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids, scores, **kwargs):
        import torch

        if input_ids.is_cuda:  # the token is made when the GPU is done with it, not when queued
            torch.cuda.synchronize()
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def _vs_hf(args, model_dir, llm, report, rng, low) -> list[dict]:
    """HF transformers generate on the same weights, timed the way ours is: decode step time from the
    first and last generated token's timestamps (a stopping criterion records one per token), total
    from the call. A difference of two whole runs (N tokens minus 1) can come out <= 0 on a tiny
    model and a noisy machine; timestamps inside one run cannot.

    Each repeat runs HF and then jaxinfer on the same prompts, alternating, and the ratio is of the
    two medians: on a noisy shared machine a slow minute then hits both sides, not one.
    """
    import torch
    import transformers

    from jaxinfer import SamplingParams

    torch.set_num_threads(os.cpu_count() or 1)
    dtype = torch.float32 if args.dtype == "float32" else torch.bfloat16
    # HF on the device ours runs on: a GPU run compares against HF on the same GPU, never its CPU.
    device = "cuda" if jax.default_backend() == "gpu" and torch.cuda.is_available() else "cpu"
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval().to(device)
    cfg = llm.cfg
    rows = []
    print(
        f"\nvs HF transformers {transformers.__version__} (torch {torch.__version__}, {device}, "
        f"{torch.get_num_threads()} threads), same weights, greedy"
    )
    print(
        f"{'batch':>6} {'HF step ms':>11} {'HF tok/s':>9} {'ours tok/s':>11} {'decode ratio':>13} "
        f"{'HF total s':>11} {'ours total s':>13} {'total ratio':>12}"
    )
    for ours in report["decode"]:
        b = ours["batch"]
        ids = torch.tensor(rng.integers(low, cfg.vocab_size, (b, args.context))).to(device)

        def gen(n, ids=ids) -> tuple[float, float]:
            stamps = _TokenTimestamps()
            t0 = time.perf_counter()
            with torch.no_grad():
                model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=n,
                    min_new_tokens=n,
                    do_sample=False,
                    pad_token_id=0,
                    stopping_criteria=transformers.StoppingCriteriaList([stamps]),
                )
            total = time.perf_counter() - t0
            assert len(stamps.times) == n, (len(stamps.times), n)
            return (stamps.times[-1] - stamps.times[0]) / (n - 1), total

        gen(2)  # warm-up
        prompts = ids.tolist()
        params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
        theirs, mine = [], []
        for _ in range(args.repeats):
            theirs.append(gen(args.new_tokens))
            mine.append(_decode_once(llm, prompts, params))
        step = statistics.median(t[0] for t in theirs)
        tn = statistics.median(t[1] for t in theirs)
        our_step = statistics.median(m[0] for m in mine)
        our_total = statistics.median(m[1] for m in mine)
        our_rate = statistics.median(m[2] for m in mine) / our_step  # HF runs all b rows every step
        rows.append(
            {
                "batch": b,
                "hf_step_s": step,
                "hf_tokens_per_s": b / step,
                "ours_step_s": our_step,
                "ours_tokens_per_s": our_rate,
                "ratio": our_rate / (b / step),
                "hf_total_s": tn,
                "ours_total_s": our_total,
                "total_ratio": tn / our_total,
            }
        )
        print(
            f"{b:>6} {step * 1e3:>11.2f} {b / step:>9.1f} {our_rate:>11.1f} {our_rate / (b / step):>12.2f}x "
            f"{tn:>11.2f} {our_total:>13.2f} {tn / our_total:>11.2f}x"
        )
    return rows


def mesh_memory(model, meshes: list[str], *, dtype: str = "float32", num_kv_pages: int = 256, page_size: int = 16):
    """Parameter and KV-cache bytes per device for each mesh, read off the arrays' own shards, and
    whether each mesh's greedy tokens equal the first mesh's (so the sharding is checked, not assumed).

    Returns a list of dicts, one per mesh, in order.
    """
    from jaxinfer import LLM, SamplingParams

    rng = np.random.default_rng(0)
    rows, first = [], None
    for spec in meshes:
        llm = LLM(model, dtype=dtype, mesh=spec, num_kv_pages=num_kv_pages, page_size=page_size, max_model_len=128)
        if first is None:
            low = 3 if llm.cfg.vocab_size > 8 else 0
            prompts = [rng.integers(low, llm.cfg.vocab_size, n).tolist() for n in (5, 17, 40)]
        sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        tokens = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=sp)]
        first = tokens if first is None else first
        mem = llm.engine.memory_per_device()
        mesh = llm.engine.mesh
        rows.append(
            {
                "mesh": spec,
                "devices": 1 if mesh is None else mesh.size,
                **mem,
                "same_tokens_as_first": tokens == first,
            }
        )
        del llm
    return rows


def window_pools(
    *,
    num_requests: int = 32,
    prompt_len: int = 768,
    output_len: int = 256,
    window: int = 128,
    one_size_pages: int = 400,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 128,
    page_size: int = 16,
) -> list[dict]:
    """A hybrid model's window pools against one pool size for all layers, in the same KV-cache bytes.

    A Gemma-3-shaped random model (5 layers with a `window`-key sliding window, 1 global; 23M-class
    shapes kept small for the CPU) runs the same greedy requests twice: once with every layer's pool
    at `one_size_pages`, once with the window layers' pools at the engine's default and the global
    layers given what that frees from the same bytes. Both runs must give the same tokens.
    Returns one dict per run (wall time, output tok/s, preemptions, sequences running per step).
    """
    from jaxinfer import SamplingParams
    from jaxinfer.capacity import default_window_kv_pages, kv_cache_bytes, layer_page_bytes
    from jaxinfer.config import GlobalAttention, ModelConfig, SlidingWindow
    from jaxinfer.engine import Engine
    from jaxinfer.model import init_params

    cfg = ModelConfig(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        num_layers=6,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        max_position_embeddings=prompt_len + output_len,
        eos_token_ids=(2,),
        layer_attention=(SlidingWindow(window),) * 5 + (GlobalAttention(),),
    )
    params = init_params(cfg, seed=0)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, cfg.vocab_size, prompt_len).tolist() for _ in range(num_requests)]
    sp = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    common = dict(
        max_model_len=prompt_len + output_len,
        page_size=page_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        enable_prefix_caching=False,  # random prompts: nothing to share; keeps the two runs alike
    )
    budget = kv_cache_bytes(cfg, num_kv_pages=one_size_pages, page_size=page_size)
    window_pages = default_window_kv_pages(cfg, **{k: v for k, v in common.items() if k != "enable_prefix_caching"})
    layer_page = layer_page_bytes(cfg, page_size)
    windowed = sum(cfg.in_window_pool(i) for i in range(cfg.num_layers))
    global_pages = (budget - windowed * window_pages * layer_page) // layer_page
    if global_pages <= one_size_pages:
        raise InvalidRequestError(
            f"the window pools ({window_pages} pages x {windowed} layers) leave the global layer no more than "
            f"{one_size_pages} pages: raise one_size_pages or lower max_num_seqs"
        )
    rows, outputs = [], []
    for name, pages, wpages in (
        ("one pool size", one_size_pages, one_size_pages),
        ("window pools", global_pages, window_pages),
    ):
        engine = Engine(cfg, params, num_kv_pages=pages, num_window_kv_pages=wpages, **common)
        assert engine.cache.nbytes <= budget
        engine.warmup()
        engine.wait_for_huge_pages()
        t0 = time.perf_counter()
        reqs = [engine.add_request(p, sp) for p in prompts]
        running = []
        while engine.has_unfinished():
            engine.step()
            running.append(len(engine.scheduler.running))
        wall = time.perf_counter() - t0
        stats = engine.stats()
        outputs.append([r.seqs[0].output_ids for r in reqs])
        rows.append(
            {
                "run": name,
                "kv_cache_bytes": engine.cache.nbytes,
                "global_pages": stats["kv_pages_total"],
                "window_pages": stats.get("kv_window_pages_total"),
                "wall_s": wall,
                "output_tok_s": num_requests * output_len / wall,
                "preemptions": stats["num_preemptions"],
                "mean_running": float(np.mean(running)),
                "max_running": max(running),
            }
        )
        del engine
    if outputs[0] != outputs[1]:
        raise AssertionError("the two runs gave different tokens")
    return rows
