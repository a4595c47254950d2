"""The `jaxinfer` command line: generate, serve, bench and convert."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import sys

from jaxinfer.config import ATTENTION_BACKENDS, DTYPES, KV_CACHE_DTYPES


def _id_list(flag: str):
    """An argparse type: comma-separated integers, as `flag` takes them."""

    def parse(s: str) -> list[int]:
        if not s.strip():
            raise argparse.ArgumentTypeError(f"{flag} is empty")
        try:
            return [int(x) for x in s.split(",")]  # "1,,2" is a typo, not [1, 2]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} must be comma-separated integers, got {s!r}") from None

    return parse


_prompt_ids = _id_list("--prompt-ids")


def _logit_bias(s: str) -> dict[int, float]:
    """`ID=BIAS[,ID=BIAS...]` as a dict."""
    out = {}
    for item in s.split(","):
        key, _, value = item.partition("=")
        try:
            out[int(key)] = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"--logit-bias takes comma-separated ID=BIAS pairs (e.g. 50256=-100), got {item!r}"
            ) from None
    return out


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """Capacity flags shared by every command that builds an engine."""
    e = p.add_argument_group("engine capacity")
    e.add_argument("--max-model-len", type=int, default=None, help="longest sequence (default: the model's)")
    e.add_argument("--page-size", type=int, default=16, help="tokens per KV-cache page")
    e.add_argument("--num-kv-pages", type=int, default=None, help="KV-cache pages (default: from free memory)")
    e.add_argument("--max-num-seqs", type=int, default=32, help="sequences running at once")
    e.add_argument("--max-num-batched-tokens", type=int, default=512, help="tokens computed per step")
    e.add_argument("--no-prefix-caching", action="store_true", help="do not share KV pages of common prefixes")
    e.add_argument(
        "--no-async-scheduling",
        action="store_true",
        help="read each step's results before dispatching the next (default: overlap them; same outputs)",
    )
    e.add_argument(
        "--attention-backend",
        default="auto",
        choices=ATTENTION_BACKENDS,
        help=(
            "paged attention: auto = the Pallas kernel on TPU and on GPUs from compute capability 8.0 on "
            "(the reference on older GPUs), the C++ 'native' kernel on CPU (the tiled pure-JAX 'xla' where it "
            "cannot be built); or forced"
        ),
    )
    e.add_argument(
        "--mesh",
        default=None,
        help="device mesh, e.g. 'data=2,model=4' (tensor parallel over model, rows over data; default: one device)",
    )
    e.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=KV_CACHE_DTYPES,
        help="KV-cache storage: the model dtype (auto), or int8 with per-token-per-head scales",
    )


def check_engine_flags(args) -> None:
    """The capacity flags' ranges, before anything loads (or `serve` binds its port)."""
    from jaxinfer.limits import check_capacity

    with in_flag_names(args):
        check_capacity(
            page_size=args.page_size,
            max_num_seqs=args.max_num_seqs,
            num_kv_pages=args.num_kv_pages,
            max_num_batched_tokens=args.max_num_batched_tokens,
        )


_FLAG_OF_FIELD = {"bad_words": "bad_word"}  # SamplingParams fields whose repeatable flag is singular


def flag_names(message: str, options) -> str:
    """An API refusal in the words of the command line: each argument or `SamplingParams.field` it
    names that the command takes as a flag in `options` (its option strings) becomes that flag:
    `max_model_len must be ...` -> `--max-model-len must be ...`. A plain word is a name only where it
    leads the message ("mesh data=1,model=3 has 3 devices"), else "the model's limit" would read
    "the --model's limit"."""

    def flag(m: re.Match) -> str:
        name = "--" + _FLAG_OF_FIELD.get(m.group(2), m.group(2)).replace("_", "-")
        is_name = m.group(1) or "_" in m.group(2) or m.start() == 0
        return name if is_name and name in options else m.group(0)

    return re.sub(r"(?<![\w./-])(SamplingParams\.)?([a-z][a-z0-9_]*)(?![\w/]|\.\w)", flag, message)


@contextlib.contextmanager
def in_flag_names(args):
    """Re-raises the InvalidRequestError of the block in the flags' names of `args`' command."""
    from jaxinfer.errors import InvalidRequestError

    try:
        yield
    except InvalidRequestError as e:
        raise InvalidRequestError(flag_names(str(e), args.options)) from None


def engine_kwargs(args) -> dict:
    return dict(
        max_model_len=args.max_model_len,
        page_size=args.page_size,
        num_kv_pages=args.num_kv_pages,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=not args.no_prefix_caching,
        async_scheduling=not args.no_async_scheduling,
        attention_backend=args.attention_backend,
        kv_cache_dtype=args.kv_cache_dtype,
        mesh=args.mesh,
    )


DTYPE_HELP = "parameter and activation dtype; auto: what the checkpoint stores"  # generate's and serve's


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Shows each option's default after its help, unless the help already says it or there is none
    to show (None, off, empty). Descriptions keep their own line breaks."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (
            not action.option_strings
            or action.default in (None, False, [], {}, argparse.SUPPRESS)
            or "default" in text.lower()
        ):
            return text
        d = action.default  # a list as the flag takes it: 32,128
        shown = ",".join(map(str, d)).replace("%", "%%") if isinstance(d, (list, tuple)) else "%(default)s"
        return f"{text} (default: {shown})" if text else f"default: {shown}"


def _parser(*, bench_flags: bool = True) -> argparse.ArgumentParser:
    """The command line's parser. `bench_flags=False` leaves out `bench`'s own flags, whose module
    imports JAX: what `generate`, `serve` and `convert` parse with, so their bad flags are answered
    before JAX loads."""
    from jaxinfer.sampling_params import GENERATION_CONFIG_CHOICES

    parser = argparse.ArgumentParser(
        prog="jaxinfer", description="LLM inference on JAX/XLA.", formatter_class=HelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser(
        "generate",
        help="generate text from a prompt",
        formatter_class=HelpFormatter,
        description="Generate from one or more prompts (text or token ids).",
    )
    g.add_argument("prompt", nargs="*", help="prompt text (several prompts run as one batch)")
    g.add_argument(
        "--model", help="Hugging Face or `jaxinfer convert` checkpoint directory (default: the embedded default model)"
    )
    g.add_argument("--dtype", default="float32", choices=[*DTYPES, "auto"], help=DTYPE_HELP)
    # Sampling flags left out take the checkpoint's generation_config.json values (with --server, the
    # served model's; unless --generation-config none), else the command's own defaults
    # (_SAMPLING_DEFAULTS: greedy, 32 tokens).
    unset = "default: the checkpoint's generation_config.json, else %s"
    g.add_argument("--max-tokens", type=int, default=None, help=unset % _SAMPLING_DEFAULTS["max_tokens"])
    g.add_argument("--temperature", type=float, default=None, help=unset % "0 (greedy)")
    g.add_argument("--top-k", type=int, default=None, help=unset % "0 (off)")
    g.add_argument("--top-p", type=float, default=None, help=unset % _SAMPLING_DEFAULTS["top_p"])
    g.add_argument("--min-p", type=float, default=None, help=unset % _SAMPLING_DEFAULTS["min_p"])
    g.add_argument("--seed", type=int, default=None, help="sampling seed (sample i of a prompt uses seed + i)")
    g.add_argument("--presence-penalty", type=float, default=None, help="default: 0")
    g.add_argument("--frequency-penalty", type=float, default=None, help="default: 0")
    g.add_argument("--repetition-penalty", type=float, default=None, help=unset % "1 (off)")
    g.add_argument(
        "--generation-config",
        default="auto",
        choices=GENERATION_CONFIG_CHOICES,
        help="auto: sampling flags left out take the checkpoint's generation_config.json values (with "
        "--server: the served model's, as its ModelInfo shows them); none: always the command's own",
    )
    g.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    g.add_argument(
        "--stop-token-ids", type=_id_list("--stop-token-ids"), default=[], help="ids that end the output, e.g. 2,7"
    )
    g.add_argument("--bad-word", action="append", default=[], help="a word the output must not contain (repeatable)")
    g.add_argument(
        "--include-stop-str-in-output", action="store_true", help="the text ends after the stop string, not before"
    )
    g.add_argument("--min-tokens", type=int, default=0, help="tokens before EOS, a stop id or a stop string may end it")
    g.add_argument(
        "--logit-bias",
        type=_logit_bias,
        action="append",
        default=[],
        help="ID=BIAS pairs added to those tokens' logits, bias in [-100, 100] (comma-separated or repeated)",
    )
    g.add_argument(
        "--allowed-token-ids", type=_id_list("--allowed-token-ids"), default=None, help="only these ids may be drawn"
    )
    g.add_argument("--n", type=int, default=1, help="samples per prompt")
    g.add_argument(
        "--cache-salt",
        default=None,
        help="share prefix-cache pages only with requests of the same salt (vLLM's cache_salt)",
    )
    g.add_argument(
        "--logprobs", type=int, default=None, help="top-n log-probabilities per token (printed with --json only)"
    )
    g.add_argument(
        "--prompt-logprobs",
        type=int,
        default=None,
        help="top-n log-probabilities of every prompt token after the first (printed with --json only)",
    )
    g.add_argument(
        "--truncate-prompt-tokens",
        type=int,
        default=None,
        help="run only the prompt's last K tokens (-1: as many as --max-model-len allows)",
    )
    g.add_argument(
        "--keep-special-tokens",
        action="store_true",
        help="write special tokens (EOS, chat markers) into the text (SamplingParams.skip_special_tokens=False)",
    )
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS (up to --max-tokens)")
    g.add_argument("--stream", action="store_true", help="print text as it is generated (one prompt)")
    add_engine_arguments(g)
    g.add_argument(
        "--prompt-ids", type=_prompt_ids, action="append", help="a prompt as comma-separated token ids (repeatable)"
    )
    g.add_argument(
        "--json",
        action="store_true",
        help="one JSON object per sample (--n of them per prompt); with --stream, one per delta",
    )
    g.add_argument("--server", metavar="HOST:PORT", help="generate on a running `jaxinfer serve` instead of locally")
    g.add_argument("--timeout", type=float, default=None, help="with --server: each call's deadline in seconds")
    # What --server makes meaningless (the server's model and engine serve the request): refused if set.
    g.set_defaults(
        local_defaults={a.dest: a.default for a in g._actions if a.dest in _LOCAL_ONLY},
        options=frozenset(g._option_string_actions),  # for errors in flag names
    )

    from serving import main as serve_main

    s = sub.add_parser(
        "serve",
        help="serve the model over gRPC",
        formatter_class=HelpFormatter,
        description="Serve jaxinfer.v1, JetStream's Orchestrator, gRPC health and reflection on one "
        "continuous-batching engine. SIGTERM drains requests in flight, then exits 0.",
    )
    serve_main.add_arguments(s)
    s.set_defaults(options=frozenset(s._option_string_actions))

    b = sub.add_parser(
        "bench",
        help="measure TTFT, decode throughput and bandwidth utilisation",
        formatter_class=HelpFormatter,
    )
    if bench_flags:
        from jaxinfer import bench

        b.description = bench.__doc__
        bench.add_arguments(b)

    c = sub.add_parser(
        "convert",
        help="convert a Hugging Face checkpoint to jaxinfer's orbax format",
        formatter_class=HelpFormatter,
        description="Read a Hugging Face safetensors checkpoint and write a jaxinfer checkpoint (orbax "
        "parameters, config.json, tokenizer files) that `LLM(OUT_DIR)` / `--model OUT_DIR` restore directly. "
        "`jaxinfer bench load HF_DIR` compares the load times of the two formats.",
    )
    c.add_argument("hf_dir", metavar="HF_DIR", help="Hugging Face checkpoint directory (config.json, *.safetensors)")
    c.add_argument("out_dir", metavar="OUT_DIR", help="directory to write (must not exist, or be empty)")
    c.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="stored parameter dtype (default auto: what the checkpoint's config.json or weights say, as "
        "`--dtype auto` runs it; float16 is stored as bfloat16)",
    )
    return parser


# What `generate` samples with where neither a flag nor the checkpoint's generation_config.json says.
_SAMPLING_DEFAULTS = dict(
    max_tokens=32,
    temperature=0.0,
    top_k=0,
    top_p=1.0,
    min_p=0.0,
    presence_penalty=0.0,
    frequency_penalty=0.0,
    repetition_penalty=1.0,
)

_LOCAL_ONLY = (
    "model",
    "dtype",
    "max_model_len",
    "page_size",
    "num_kv_pages",
    "max_num_seqs",
    "max_num_batched_tokens",
    "no_prefix_caching",
    "no_async_scheduling",
    "attention_backend",
    "mesh",
    "kv_cache_dtype",
)


def _generate(args) -> int:
    # The flags are checked with what imports no JAX: a bad one is answered before JAX loads.
    from jaxinfer.errors import InvalidRequestError
    from jaxinfer.limits import check_cache_salt
    from jaxinfer.sampling_params import SamplingParams

    if args.server is not None:
        from jaxinfer.client import check_target

        args.server = check_target(args.server.strip(), "--server")
        given = [f"--{k.replace('_', '-')}" for k, v in args.local_defaults.items() if getattr(args, k) != v]
        if given:
            raise InvalidRequestError(
                f"{', '.join(given)}: the server's model and engine settings apply with --server; "
                "set them on `jaxinfer serve`"
            )
    elif args.timeout is not None:
        raise InvalidRequestError("--timeout applies to --server calls only")
    if bool(args.prompt) == bool(args.prompt_ids):
        raise InvalidRequestError("give prompt text or --prompt-ids (not both, not neither)")
    if args.stream and (len(args.prompt) + len(args.prompt_ids or []) != 1 or args.n != 1):
        raise InvalidRequestError("--stream takes exactly one prompt and --n 1")
    given = {k: getattr(args, k) for k in _SAMPLING_DEFAULTS if getattr(args, k) is not None}
    fixed = dict(
        seed=args.seed,
        ignore_eos=args.ignore_eos,
        stop=args.stop,
        n=args.n,
        logprobs=args.logprobs,
        prompt_logprobs=args.prompt_logprobs,
        truncate_prompt_tokens=args.truncate_prompt_tokens,
        skip_special_tokens=not args.keep_special_tokens,
        stop_token_ids=args.stop_token_ids,
        include_stop_str_in_output=args.include_stop_str_in_output,
        bad_words=args.bad_word,
        min_tokens=args.min_tokens,
        logit_bias={k: v for d in args.logit_bias for k, v in d.items()} or None,
        allowed_token_ids=args.allowed_token_ids,
    )

    def params_over(recommended: dict) -> SamplingParams:
        """Flags given, else the model's generation_config.json, else the command's defaults."""
        if args.generation_config == "none":
            recommended = {}
        recommended = {k: v for k, v in recommended.items() if k in _SAMPLING_DEFAULTS}
        return SamplingParams(**{**_SAMPLING_DEFAULTS, **recommended, **given}, **fixed)

    with in_flag_names(args):
        params_over({})  # the flags are checked before anything loads
    check_cache_salt(args.cache_salt, "--cache-salt")
    if args.server:
        return _generate_remote(args, params_over)
    check_engine_flags(args)
    from jaxinfer import LLM

    with in_flag_names(args):
        llm = LLM(args.model, dtype=args.dtype, generation_config=args.generation_config, **engine_kwargs(args))
        params = params_over(llm.generation_overrides)
    # vLLM's prompt dicts: text or ids, with the salt when one is given.
    salt = {} if args.cache_salt is None else {"cache_salt": args.cache_salt}
    prompts = [{"prompt": p, **salt} for p in args.prompt] or [
        {"prompt_token_ids": ids, **salt} for ids in args.prompt_ids
    ]
    try:
        if args.stream:
            _print_stream(args, llm.stream(prompts[0], params), has_text=llm.tokenizer is not None)
            return 0
        outs = llm.generate(prompts, params)
    except InvalidRequestError as e:
        raise InvalidRequestError(_prompt_named_as_given(flag_names(str(e), args.options), args)) from None
    _print_outputs(args, llm.cfg.name, outs, has_text=llm.tokenizer is not None)
    return 0


def _prompt_named_as_given(message: str, args) -> str:
    """A refusal of the prompt dicts built above, naming what was typed: "prompt 2" or "--prompt-ids",
    not the API's "prompts[1].prompt"."""
    count = len(args.prompt) or len(args.prompt_ids)

    def name(m: re.Match) -> str:
        label = "prompt" if args.prompt else "--prompt-ids"
        return f"{label} {int(m.group(2)) + 1}" if count > 1 else label

    return re.sub(r"^(prompts\[(\d+)\]|prompt)(\.prompt_token_ids|\.prompt)?", name, message)


def _generate_remote(args, params_over) -> int:
    import grpc

    from jaxinfer.client import INT32_MAX, Client, ServerError, _request
    from jaxinfer.errors import InvalidRequestError

    def wire_params(recommended: dict):
        """`params_over`'s, a length past what the wire carries (int32) sent as the largest int32:
        as locally, it runs to the model's limit."""
        p = params_over(recommended)
        clamped = {k: INT32_MAX for k in ("max_tokens", "min_tokens") if (getattr(p, k) or 0) > INT32_MAX}
        return dataclasses.replace(p, **clamped) if clamped else p

    # Every request is checked as the client will send it before the first RPC; a refusal names the
    # flag, as a local run's does.
    checked = wire_params({})
    try:
        for prompt in args.prompt:
            _request(prompt, checked, None, None, args.cache_salt)
        for ids in args.prompt_ids or []:
            _request(None, checked, ids, None, args.cache_salt)
    except InvalidRequestError as e:
        message = re.sub(r"^sampling_params\.", "SamplingParams.", str(e))
        message = re.sub(r"^prompt_token_ids", "--prompt-ids", message)
        raise InvalidRequestError(flag_names(message, args.options)) from None
    with in_flag_names(args):  # `timeout must be ...` -> `--timeout must be ...`
        client = Client(args.server, timeout=args.timeout)
    with client:
        # The model info says what the served model recommends for the flags left out, and whether it
        # has a tokenizer: without one, its token ids are printed, as locally.
        try:
            info = client.model_info()
        except ServerError as e:
            if e.code == "UNAVAILABLE" and client.health() == "UNREACHABLE":
                raise ServerError(
                    grpc.StatusCode.UNAVAILABLE,
                    f"--server {args.server}: nothing answers there (is `jaxinfer serve` running?)",
                ) from None
            raise
        params = wire_params(info["default_sampling_overrides"])
        salt = args.cache_salt
        if args.stream:
            if args.prompt:
                deltas = client.stream(args.prompt[0], params, cache_salt=salt)
            else:
                deltas = client.stream(prompt_token_ids=args.prompt_ids[0], sampling_params=params, cache_salt=salt)
            _print_stream(args, deltas, has_text=info["has_tokenizer"])
            return 0
        # Over the streaming RPC, gathered: a unary answer past the server's --max-response-bytes
        # (64 samples with logprobs) would be refused where a local run prints it.
        if args.prompt:
            outs = [client._generate_streamed(p, params, cache_salt=salt) for p in args.prompt]
        else:
            outs = [
                client._generate_streamed(prompt_token_ids=p, sampling_params=params, cache_salt=salt)
                for p in args.prompt_ids
            ]
        _print_outputs(args, info["model_name"], outs, has_text=info["has_tokenizer"])
    return 0


def _print_stream(args, deltas, *, has_text: bool = True) -> None:
    """Deltas as they come: text after the prompt, or with --json one object per delta; a model
    without a tokenizer streams its token ids."""
    if not args.json and args.prompt:
        print(args.prompt[0], end="", flush=True)
    try:
        for d in deltas:
            if args.json:
                obj = {"token_ids": list(d.token_ids), "text": d.text, "finish_reason": d.finish_reason}
                print(json.dumps(obj), flush=True)
            elif has_text:
                print(d.text, end="", flush=True)
            elif d.token_ids:
                print(",".join(map(str, d.token_ids)), end=",", flush=True)
    finally:  # also before an error's line (a deadline mid-stream), which would run on from the text
        if not args.json:
            print(flush=True)


def _logprob_json(lp) -> dict:
    return {"token_id": lp.token_id, "logprob": lp.logprob, "top": {str(k): v for k, v in lp.top.items()}}


def _print_outputs(args, model_name: str, outs, *, has_text: bool = True) -> None:
    for out in outs:
        for o in out.outputs:
            if args.json:
                obj = {
                    "model": model_name,
                    "prompt": out.prompt,
                    "prompt_token_ids": out.prompt_token_ids,
                    "index": o.index,
                    "token_ids": o.token_ids,
                    "text": o.text,
                    "finish_reason": o.finish_reason,
                }
                if o.logprobs is not None:
                    obj["logprobs"] = [_logprob_json(lp) for lp in o.logprobs]
                if out.prompt_logprobs is not None:
                    obj["prompt_logprobs"] = [None if lp is None else _logprob_json(lp) for lp in out.prompt_logprobs]
                print(json.dumps(obj))
            elif not has_text:  # no tokenizer: the ids, as --prompt-ids takes them
                print(",".join(map(str, o.token_ids)))
            else:
                print(o.text if out.prompt is None else out.prompt + o.text)


def _convert(args) -> int:
    import time

    from jaxinfer import checkpoint

    t = time.perf_counter()
    cfg = checkpoint.convert_hf(args.hf_dir, args.out_dir, dtype=args.dtype)
    print(
        f"wrote {args.out_dir}: {cfg.name} ({cfg.num_params / 1e6:.1f}M parameters, {cfg.dtype}) "
        f"in {time.perf_counter() - t:.1f}s"
    )
    return 0


def _bench_load(argv: list[str]) -> int:
    from jaxinfer import checkpoint

    p = argparse.ArgumentParser(
        prog="jaxinfer bench load",
        formatter_class=HelpFormatter,
        description="Time loading one model from its Hugging Face safetensors and from its jaxinfer (orbax) "
        "checkpoint (converted into a temp dir unless --orbax-dir is given). Prints one JSON object.",
    )
    p.add_argument("hf_dir", metavar="HF_DIR", help="Hugging Face checkpoint directory")
    p.add_argument("--orbax-dir", default=None, help="an existing `jaxinfer convert` output of HF_DIR")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="parameter dtype")
    p.add_argument("--repeats", type=int, default=3, help="loads of each format (their median is reported)")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    result = checkpoint.bench_load(args.hf_dir, dtype=args.dtype, repeats=args.repeats, orbax_dir=args.orbax_dir)
    print(json.dumps(result))
    return 0


def _bench_window_pools(argv: list[str]) -> int:
    from jaxinfer import bench

    p = argparse.ArgumentParser(
        prog="jaxinfer bench window-pools",
        formatter_class=HelpFormatter,
        description="A Gemma-3-shaped model (5 sliding-window layers + 1 global), the same KV-cache bytes: "
        "every layer's pool at one size, against the window layers in pools of their own and the global "
        "layer given the bytes that frees. Same requests, same tokens (checked); prints throughput and "
        "preemptions side by side.",
    )
    for flag, default, text in (
        ("--num-requests", 32, "greedy requests, all submitted at once"),
        ("--prompt-len", 768, "prompt tokens per request"),
        ("--output-len", 256, "tokens generated per request"),
        ("--window", 128, "keys the sliding-window layers attend to"),
        ("--one-size-pages", 400, "pages of every layer's pool in the one-size run (sets the bytes both runs get)"),
        ("--max-num-seqs", 16, "sequences running at once"),
        ("--max-num-batched-tokens", 128, "tokens per engine step"),
    ):
        p.add_argument(flag, type=bench._positive_int, default=default, help=text)
    p.add_argument("--json", action="store_true", help="print the two runs' figures as JSON")
    args = p.parse_args(argv)
    rows = bench.window_pools(
        num_requests=args.num_requests,
        prompt_len=args.prompt_len,
        output_len=args.output_len,
        window=args.window,
        one_size_pages=args.one_size_pages,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    if args.json:
        print(json.dumps(rows))
        return 0
    for r in rows:
        window = "" if r["window_pages"] is None else f" + {r['window_pages']} window pages"
        print(
            f"{r['run']:>14}: {r['kv_cache_bytes'] / 2**20:.1f} MiB KV, {r['global_pages']} pages{window}; "
            f"{r['wall_s']:.1f} s, {r['output_tok_s']:.0f} output tok/s, {r['preemptions']} preemptions, "
            f"{r['mean_running']:.1f} sequences running per step (max {r['max_running']})"
        )
    print(f"window pools / one pool size: {rows[1]['output_tok_s'] / rows[0]['output_tok_s']:.2f}x output tok/s")
    return 0


def _bench_mesh(argv: list[str]) -> int:
    import os

    p = argparse.ArgumentParser(
        prog="jaxinfer bench mesh",
        formatter_class=HelpFormatter,
        description="Parameter and KV-cache bytes per device for each mesh (measured from the arrays' shards), "
        "and whether every mesh gives the first one's greedy tokens.",
    )
    p.add_argument("--model", default=None, help="checkpoint directory (default: the embedded default model)")
    p.add_argument(
        "--meshes",
        default="data=1,model=1;data=1,model=2;data=1,model=4;data=1,model=8;data=2,model=4",
        help="meshes to compare, separated by ';'",
    )
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="parameter dtype")
    p.add_argument("--num-kv-pages", type=int, default=256, help="KV-cache pages of each engine")
    p.add_argument("--cpu-devices", type=int, default=None, help="run on N virtual CPU devices (XLA host platform)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.cpu_devices is not None and not 1 <= args.cpu_devices <= 1024:
        p.error(f"--cpu-devices must be in [1, 1024], got {args.cpu_devices}")
    if args.cpu_devices:
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={args.cpu_devices}"
        )
        import jax

        jax.config.update("jax_platforms", "cpu")
    from jaxinfer.bench import mesh_memory

    rows = mesh_memory(args.model, args.meshes.split(";"), dtype=args.dtype, num_kv_pages=args.num_kv_pages)
    if args.json:
        print(json.dumps(rows))
        return 0
    base = rows[0]
    print(f"{'mesh':<18}{'devices':>8}{'params/device':>16}{'x first':>9}{'KV/device':>14}{'x first':>9}  same tokens")
    for r in rows:
        p_ratio = r["param_bytes_per_device"] / base["param_bytes_per_device"]
        kv_ratio = r["kv_cache_bytes_per_device"] / base["kv_cache_bytes_per_device"]
        print(
            f"{r['mesh']:<18}{r['devices']:>8}{r['param_bytes_per_device'] / 1e6:>13.2f} MB{p_ratio:>9.3f}"
            f"{r['kv_cache_bytes_per_device'] / 1e6:>11.2f} MB{kv_ratio:>9.3f}  {r['same_tokens_as_first']}"
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    return run_command(_main, argv)


def run_command(command, *args) -> int:
    """`command(*args)`'s exit status; an exception ends it with one line on stderr (`error_status`)
    instead of a traceback, unless JAXINFER_TRACEBACK is set and it is no usage error."""
    try:
        return command(*args)
    except Exception as e:
        if os.environ.get("JAXINFER_TRACEBACK") and not is_usage_error(e):
            raise
        return error_status(e)
    except KeyboardInterrupt:
        return 130


def is_usage_error(e: BaseException) -> bool:
    """Bad input: a JaxinferError, or a file or directory the command could not read (named by the OS)."""
    from jaxinfer.errors import JaxinferError

    return isinstance(e, JaxinferError | OSError)


def error_status(e: BaseException) -> int:
    """The exit status of a command that `e` ended, after saying why in one line on stderr: 2 for bad
    input, 130 for Ctrl-C, 1 for anything else - a bug (JAXINFER_TRACEBACK=1 shows where)."""
    if isinstance(e, KeyboardInterrupt):
        return 130
    if is_usage_error(e):
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"error: unexpected {type(e).__name__}: {e} (JAXINFER_TRACEBACK=1 shows where)", file=sys.stderr)
    return 1


def _main(argv: list[str]) -> int:
    if argv[:2] == ["bench", "kernels"]:  # its own flags: see pallas_kernels/bench.py
        from pallas_kernels import bench as kernel_bench

        return kernel_bench.main(argv[2:], prog="jaxinfer bench kernels")
    if argv[:2] == ["bench", "load"]:  # HF safetensors vs orbax load time: see jaxinfer.checkpoint.bench_load
        return _bench_load(argv[2:])
    if argv[:2] == ["bench", "mesh"]:  # bytes per device per mesh: see jaxinfer.bench.mesh_memory
        return _bench_mesh(argv[2:])
    if argv[:2] == ["bench", "window-pools"]:  # hybrid models' pools: see jaxinfer.bench.window_pools
        return _bench_window_pools(argv[2:])
    args = _parser(bench_flags=argv[:1] not in (["generate"], ["serve"], ["convert"])).parse_args(argv)
    if args.command == "generate":
        return _generate(args)
    if args.command == "serve":
        from serving import main as serve_main

        return serve_main.run(args)
    if args.command == "convert":
        return _convert(args)
    if args.command == "bench":
        from jaxinfer import bench
        from jaxinfer.errors import InvalidRequestError

        if args.mode in bench.OWN_FLAG_MODES:  # reached only with flags before the mode
            raise InvalidRequestError(
                f"`jaxinfer bench {args.mode}` takes flags of its own: put them after the mode "
                f"(`jaxinfer bench {args.mode} --help`)"
            )
        bench.run(args)
        return 0
    return 1


if __name__ == "__main__":
    sys.exit(main())
