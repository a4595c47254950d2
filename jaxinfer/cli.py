"""The `jaxinfer` command line: generate and bench (serve and convert arrive with their issues)."""

from __future__ import annotations

import argparse
import json
import sys


def _prompt_ids(s: str) -> list[int]:
    try:
        ids = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompt-ids must be comma-separated integers, got {s!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("--prompt-ids is empty")
    return ids


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxinfer", description="LLM inference on JAX/XLA.")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser(
        "generate",
        help="generate text from a prompt",
        description="Generate from one or more prompts (text or token ids).",
    )
    g.add_argument("prompt", nargs="*", help="prompt text (several prompts run as one batch)")
    g.add_argument("--model", help="Hugging Face checkpoint directory (default: the embedded default model)")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument(
        "--prompt-ids", type=_prompt_ids, action="append", help="a prompt as comma-separated token ids (repeatable)"
    )
    g.add_argument("--json", action="store_true", help="one JSON object per prompt")

    from jaxinfer import bench

    b = sub.add_parser(
        "bench",
        help="measure TTFT, decode throughput and bandwidth utilisation",
        description=bench.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench.add_arguments(b)
    return parser


def _generate(args) -> int:
    from jaxinfer import LLM, SamplingParams

    if bool(args.prompt) == bool(args.prompt_ids):
        raise SystemExit("error: give prompt text or --prompt-ids (not both, not neither)")
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
    )
    llm = LLM(args.model, dtype=args.dtype)
    if args.prompt:
        outs = llm.generate(args.prompt, params)
    else:
        outs = llm.generate(prompt_token_ids=args.prompt_ids, sampling_params=params)
    for out in outs:
        if args.json:
            print(
                json.dumps(
                    {
                        "model": llm.cfg.name,
                        "prompt": out.prompt,
                        "prompt_token_ids": out.prompt_token_ids,
                        "token_ids": out.token_ids,
                        "text": out.text,
                        "finish_reason": out.finish_reason,
                    }
                )
            )
        else:
            print(out.text if out.prompt is None else out.prompt + out.text)
    return 0


def main(argv: list[str] | None = None) -> int:
    from jaxinfer.errors import JaxinferError

    args = _parser().parse_args(argv)
    try:
        if args.command == "generate":
            return _generate(args)
        if args.command == "bench":
            from jaxinfer import bench

            bench.run(args)
            return 0
    except JaxinferError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 1


if __name__ == "__main__":
    sys.exit(main())
