"""Incremental detokenization and stop-string matching for streamed output.

Decoding token by token breaks in two ways: a multi-byte character split over several
byte-level tokens decodes to U+FFFD until its last byte arrives, and tokenizers with
leading-space markers (SentencePiece's "▁") drop the space when a token is decoded alone.
`IncrementalDetokenizer` therefore decodes a short sliding window (the previous few tokens
plus the new ones) and emits only the text that grew past the window's prefix, holding it
back while it ends in U+FFFD (vLLM's prefix/read-offset scheme).

`StopStringMatcher` holds back the longest tail of the text that could still become a
stop string, so no streamed delta ever contains a stop string or a prefix of one that
later completes. `OutputText` combines the two; the HTTP layer uses only that.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens used as left context so the first output token decodes with its space.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text deltas.

    The concatenation of all deltas plus `flush()` equals decoding the whole output at once
    (for tokenizers whose decode is concatenative over token boundaries).
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int] = (),
                 skip_token_ids: Iterable[int] = ()) -> None:
        self._tok = tokenizer
        self._skip = frozenset(skip_token_ids)
        context = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._ids: list[int] = context
        self._prefix_offset = 0  # start of the decode window
        self._read_offset = len(context)  # tokens before this are already emitted as text
        self.num_output_tokens = 0

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True,
                                clean_up_tokenization_spaces=False)

    def push(self, token_ids: Iterable[int]) -> str:
        """Add new tokens; return the text that is now certain (may be empty)."""
        new = [t for t in token_ids if t not in self._skip]
        if not new:
            return ""
        self.num_output_tokens += len(new)
        self._ids.extend(new)
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset:])
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT_CHAR):
            return ""  # an incomplete character (or nothing visible yet): wait for more
        delta = full_text[len(prefix_text):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return delta

    def flush(self) -> str:
        """At the end of the output: whatever is still held back, even if incomplete."""
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset:])
        self._prefix_offset = self._read_offset = len(self._ids)
        return full_text[len(prefix_text):]


class StopStringMatcher:
    """Cuts a text stream at the first stop string; never leaks a stop string prefix."""

    def __init__(self, stop: Sequence[str]) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self.stop = tuple(stop)
        self._max_len = max((len(s) for s in self.stop), default=0)
        self._pending = ""  # text received but not yet emitted
        self.matched: str | None = None

    def _held_back(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        for n in range(min(len(text), self._max_len - 1), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0

    def push(self, text: str) -> str:
        """Return the text that can be emitted; after a match, `matched` is set."""
        if self.matched is not None:
            return ""
        if not self.stop:
            return text
        buf = self._pending + text
        # Earliest match wins: text before it is output, everything after is dropped.
        hits = [(i, s) for s in self.stop if (i := buf.find(s)) >= 0]
        if hits:
            index, self.matched = min(hits)
            self._pending = ""
            return buf[:index]
        keep = self._held_back(buf)
        self._pending = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep]

    def flush(self) -> str:
        """The output ended without a match: release the held-back tail."""
        out, self._pending = self._pending, ""
        return "" if self.matched is not None else out


@dataclass(slots=True)
class TextDelta:
    text: str
    stopped: bool  # a stop string matched: finish with "stop" and cancel the request


class OutputText:
    """Token ids in, safe text deltas out: detokenization followed by stop matching."""

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int] = (),
                 stop: Sequence[str] = (), skip_token_ids: Iterable[int] = ()) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_token_ids)
        self._stop = StopStringMatcher(stop)
        self.text = ""  # everything emitted so far

    @property
    def stopped(self) -> bool:
        return self._stop.matched is not None

    def push(self, token_ids: Iterable[int]) -> TextDelta:
        if self.stopped:
            return TextDelta("", True)
        out = self._stop.push(self._detok.push(token_ids))
        self.text += out
        return TextDelta(out, self.stopped)

    def finish(self) -> TextDelta:
        """The request ended (EOS or length): emit held-back text, unless it stops."""
        if self.stopped:
            return TextDelta("", True)
        out = self._stop.push(self._detok.flush())
        if not self.stopped:
            out += self._stop.flush()
        self.text += out
        return TextDelta(out, self.stopped)
