"""Incremental detokenization: text deltas as tokens arrive, with stop strings that never leak.

Decoding one token at a time is wrong for both tokenizer families we support: a byte-level BPE
token can hold half of a UTF-8 character, and SentencePiece drops the space of a word-initial
piece when it is decoded on its own. So every new token is decoded together with a few tokens
before it, and only the text that grew past what those earlier tokens already gave is emitted,
once it no longer ends in an incomplete character (U+FFFD). Text that ends in a run of byte-fallback
pieces ("<0xE2>", SentencePiece vocabularies) is held back too until the run ends: transformers decodes
such a run as a whole, into one U+FFFD per byte if any byte is invalid, so a valid first byte already
sent could later have been a U+FFFD. A window stays open for at most _MAX_PENDING tokens; then
it is taken in up to its last whole character (a long run of valid text is not cut mid-character).

Ids that decode to nothing (the special tokens a decode skips, ids past the tokenizer's vocabulary)
are left out of the windows altogether: the decode drops them anyway, and kept, they would fill the
prompt's context (six trailing specials, and a SentencePiece word loses its space) or a pending
window (a character split by 15 of them would come out as U+FFFD).

Stop strings: the text is searched for them as it grows; the last `max(len(stop)) - 1` characters
are held back from the stream until they can no longer begin a stop string, so a stop string is
never emitted, not even in part. With `include_stop` (vLLM's include_stop_str_in_output) the text
ends after the stop string instead, and nothing is held back.
"""

from __future__ import annotations

import functools

from jaxinfer.tokenizer import Tokenizer

_CONTEXT = 6  # prompt tokens of context for the first output tokens
_MAX_PENDING = 16  # tokens a window may hold back (an incomplete character or byte run) before it emits anyway


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: list[int],
        stop: tuple[str, ...] = (),
        *,
        include_stop: bool = False,
        skip_special_tokens: bool = True,
    ):
        # (Only a False is passed on: a tokenizer of the user's own may take no such argument.)
        self._decode = (
            tokenizer.decode if skip_special_tokens else functools.partial(tokenizer.decode, skip_special_tokens=False)
        )
        silent = getattr(tokenizer, "skipped_ids", frozenset()) if skip_special_tokens else frozenset()
        vocab = getattr(tokenizer, "vocab_size", None)
        self._has_text = lambda i: i not in silent and (vocab is None or 0 <= i < vocab)
        self._byte_ids = getattr(tokenizer, "byte_ids", frozenset())
        self._byte_values = getattr(tokenizer, "byte_values", {})
        self._ids = self._context(prompt_ids)  # then the output's ids
        self._prefix = 0  # start of the decoding window
        self._read = len(self._ids)  # tokens before this are already in `text`
        self.text = ""  # the output text so far (stop string and what follows removed)
        self._emitted = 0  # characters of `text` already returned by `pop_delta`
        self._stop = stop
        self._search_back = max((len(s) for s in stop), default=1) - 1  # old text a new stop string may start in
        self._include_stop = include_stop
        self._holdback = 0 if include_stop else self._search_back  # text not yet streamed
        self._unsearched = 0  # text taken in without a search (see `add`): no stop string ends in it
        self.stopped = False
        self.stop_string: str | None = None  # the stop string that ended the text (the earliest in it)

    def _context(self, prompt_ids: list[int]) -> list[int]:
        """The prompt's last _CONTEXT ids with text, or up to 3 more where those would begin inside a
        character spelled in byte-fallback pieces (on a continuation byte): the output's first bytes
        may continue that run, and transformers decodes a run as a whole, so a context cut inside a
        character made every byte after it U+FFFD ("🙃" after a prompt ending in two emoji came out
        as four U+FFFD)."""
        ids = []
        for i in reversed(prompt_ids):
            if len(ids) == _CONTEXT + 3:
                break
            if self._has_text(i):
                ids.append(i)
        ids.reverse()
        first = max(0, len(ids) - _CONTEXT)
        values = self._byte_values
        while first > 0 and first > len(ids) - _CONTEXT - 3 and ids[first - 1] in values:
            if ids[first] not in values or values[ids[first]] & 0xC0 != 0x80:  # not a continuation byte
                break
            first -= 1
        return ids[first:]

    def add(self, token_id: int, *, find_stops: bool = True) -> None:
        """Appends one generated token; sets `stopped` if the text now contains a stop string.

        `find_stops=False` (min_tokens not yet passed): the text is not searched, and a stop string that
        ends in the text taken in meanwhile is never one; one it began and a later token ends is."""
        if self.stopped or not self._has_text(token_id):
            return
        self._ids.append(token_id)
        self._advance(final=False, find_stops=find_stops)

    def flush(self) -> None:
        """At the end of generation: takes in whatever is pending, even an incomplete character."""
        if not self.stopped and self._read < len(self._ids):
            self._advance(final=True)

    def _advance(self, *, final: bool, find_stops: bool = True) -> None:
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        start = max(0, len(self.text) - self._search_back)
        end = len(self._ids)
        pending = (after.endswith("\ufffd") or self._byte_run_open(after)) and not final
        if pending and end - self._read < _MAX_PENDING:
            # A character or byte run is still incomplete: keep the window open, but a stop string may
            # already be complete in the text before it (a token can end one character and begin the next).
            whole = after.rstrip("\ufffd")
            if find_stops and len(whole) > len(before):
                self._find_stop(self.text + whole[len(before) :], start)
            elif not find_stops:  # its whole characters are made now, unsearched, though taken in later
                self._unsearched = max(self._unsearched, len(self.text) + len(whole) - len(before))
            return
        if pending:  # the window is full: take it in up to its last whole character
            end, after = self._whole_prefix(before, after)
        if len(after) <= len(before):
            return  # nothing new yet
        self._prefix, self._read = self._read, end
        self.text += after[len(before) :]
        if find_stops:
            self._find_stop(self.text, start)
        else:
            self._unsearched = max(self._unsearched, len(self.text))

    def _byte_run_open(self, after: str) -> bool:
        """Whether the window ends in a byte-fallback run a later byte piece may still join: its last
        id is a byte piece, or only ids that add no text (special tokens the decode skips) follow
        the window's last one (decode drops them first, so the bytes on either side are one run)."""
        ids = self._ids
        if ids[-1] in self._byte_ids:
            return True
        last = next((i for i in range(len(ids) - 2, self._read - 1, -1) if ids[i] in self._byte_ids), None)
        return last is not None and self._decode(ids[self._prefix : last + 1]) == after

    def _whole_prefix(self, before: str, after: str) -> tuple[int, str]:
        """The longest run of the window's tokens that decodes to more than `before` without ending in
        U+FFFD, and its text. A long run of byte pieces cut at the window's end decodes as invalid as a
        whole (every byte U+FFFD), so the cut goes back to where its last whole character ends: six CJK
        characters spelled in bytes are 18 pieces.

        A window invalid throughout (stray bytes) is taken in as it decodes, but for its last tokens
        where they may begin a character the next ones complete: the cut is the last one whose text the
        tokens after it only extend. (Taken in whole, a lead byte at the end came out as U+FFFD and the
        character it began was lost: the next window's text was no longer than the one before it.)"""
        ids = self._ids
        texts = {len(ids): after}
        for end in range(len(ids), self._read, -1):
            text = texts[end] = after if end == len(ids) else self._decode(ids[self._prefix : end])
            if len(text) > len(before) and not text.endswith("\ufffd"):
                return end, text
        for end in range(len(ids) - 1, self._read, -1):
            if len(before) < len(texts[end]) < len(after) and after.startswith(texts[end]):
                return end, texts[end]
        return len(ids), after

    def _find_stop(self, text: str, start: int) -> None:
        """Ends the text at the earliest stop string that begins at or after `start` and ends past
        the text taken in unsearched."""
        hits = [(i, s) for s in self._stop if (i := text.find(s, max(start, self._unsearched - len(s) + 1))) >= 0]
        if hits:
            at, self.stop_string = min(hits, key=lambda hit: hit[0])  # ties: the first listed
            self.text = text[: at + len(self.stop_string) if self._include_stop else at]
            self.stopped = True

    def pop_delta(self, *, final: bool = False) -> str:
        """New text since the last call; holds back a possible stop-string start unless final."""
        end = len(self.text) if (final or self.stopped) else max(self._emitted, len(self.text) - self._holdback)
        delta = self.text[self._emitted : end]
        self._emitted = end
        return delta
