"""What a request gives back: `RequestOutput` (one prompt), its `CompletionOutput` samples, the
`StreamDelta`s a stream yields, and each token's `Logprob`. Plain dataclasses that import no JAX, so
the gRPC client (jaxinfer.client) builds them without loading it; jaxinfer.llm and jaxinfer.engine
re-export them.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jaxinfer.engine import SeqUpdate


@dataclasses.dataclass
class Logprob:
    token_id: int
    logprob: float
    top: dict[int, float]  # the top-n token ids and their log-probabilities, most likely first


@dataclasses.dataclass
class CompletionOutput:
    """One sample. `token_ids` excludes the prompt and an EOS or stop_token_ids token that ended it
    (unlike vLLM, whose token_ids, logprobs and cumulative_logprob end with that token; its text
    leaves it out, as here); a stop string's tokens stay (the text alone is cut at it), as in vLLM."""

    index: int
    token_ids: list[int]
    text: str
    # "stop" | "length" | "abort". A stop/EOS token drawn as the max_tokens-th token is "stop" (the
    # model ended it, as vLLM V0 says too), where vLLM V1 checks the length first and says "length".
    finish_reason: str
    logprobs: list[Logprob] | None = None
    # The stop token id (from SamplingParams.stop_token_ids) or stop string that ended it; None when
    # EOS, max_tokens or an abort did (vLLM's meaning).
    stop_reason: int | str | None = None
    # Sum of the chosen tokens' log-probabilities; None unless logprobs were asked for.
    cumulative_logprob: float | None = None

    def finished(self) -> bool:
        """Whether the sample has ended (vLLM's method): always, in a RequestOutput."""
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    """The result of one prompt: `outputs` holds its n samples; the properties mirror sample 0.

    `prompt_logprobs` (with SamplingParams.prompt_logprobs), as vLLM's: one entry per prompt token,
    None for the first (nothing comes before it), then each token's Logprob given those before it.
    Shorter only when the request was aborted before its prompt was computed."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list[Logprob | None] | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> list[Logprob] | None:
        return self.outputs[0].logprobs

    @property
    def stop_reason(self) -> int | str | None:
        return self.outputs[0].stop_reason

    @property
    def cumulative_logprob(self) -> float | None:
        return self.outputs[0].cumulative_logprob

    @property
    def finished(self) -> bool:
        """Whether every sample has ended (vLLM's field): always so for what `generate` and `chat`
        return, as they return a request only then (a stream yields StreamDelta instead)."""
        return all(o.finish_reason is not None for o in self.outputs)


@dataclasses.dataclass
class StreamDelta:
    """What one step added to a streamed request."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    index: int = 0  # which sample, when n > 1
    stop_reason: int | str | None = None  # with finish_reason "stop": see CompletionOutput.stop_reason
    logprobs: list[Logprob] | None = None  # the new tokens', when SamplingParams.logprobs asks
    # With SamplingParams.prompt_logprobs: RequestOutput.prompt_logprobs, on sample 0's first delta.
    prompt_logprobs: list[Logprob | None] | None = None

    @classmethod
    def of(cls, u: SeqUpdate) -> StreamDelta:
        """What the engine update `u` added to its sample."""
        return cls(
            token_ids=u.token_ids,
            text=u.text,
            finish_reason=u.finish_reason,
            index=u.seq.index,
            stop_reason=u.seq.stop_reason if u.finish_reason else None,
            logprobs=u.logprobs,
            prompt_logprobs=None if u.prompt_logprobs is None else [None, *u.prompt_logprobs],
        )

    def then(self, later: StreamDelta) -> StreamDelta:
        """This delta and a later one of the same sample, as one (the later one's end, if any)."""
        asked = self.logprobs is not None or later.logprobs is not None
        return dataclasses.replace(
            later,
            token_ids=self.token_ids + later.token_ids,
            text=self.text + later.text,
            logprobs=(self.logprobs or []) + (later.logprobs or []) if asked else None,
            prompt_logprobs=self.prompt_logprobs or later.prompt_logprobs,
        )
