"""One choice of a response: its text state, and its log-probabilities in OpenAI's shapes.

Completions: {"tokens", "token_logprobs", "top_logprobs", "text_offset"}, four parallel
arrays; each top_logprobs entry maps token text -> log-probability for the top k and the
chosen token (vLLM's answer; lm-eval's greedy check reads it). With echo the prompt's
tokens come first, the very first with null log-probability and null alternatives (there
is nothing before it to predict it), as in OpenAI's and vLLM's answers.
Chat: {"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}.

Token text is the token decoded alone (a piece of a multi-byte character decodes to
U+FFFD, as in vLLM); `bytes` are that text's UTF-8 bytes. -inf (a token a grammar or
min_tokens ruled out) is reported as -9999.0, as vLLM does, since JSON has no infinity.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from functools import lru_cache
from typing import Any

from runtime.core.types import TokenLogprob
from serve.api.detok import OutputText
from serve.api.reasoning import ReasoningSplitter

MIN_LOGPROB = -9999.0


class TokenTexts:
    """token id -> its text alone, cached (a response may repeat the same ids often)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        self.text = lru_cache(maxsize=65536)(self._decode)

    def _decode(self, token: int) -> str:
        return self._tok.decode([token], skip_special_tokens=False,
                                clean_up_tokenization_spaces=False)


def _lp(value: float) -> float:
    return max(value, MIN_LOGPROB)


class CompletionLogprobs:
    """The four parallel arrays of a completion choice's `logprobs`."""

    def __init__(self, texts: TokenTexts, offset: int = 0) -> None:
        self.texts = texts
        self.offset = offset  # text length before the next token
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top_logprobs: list[dict[str, float] | None] = []
        self.text_offset: list[int] = []

    def add(self, entries: Iterable[tuple[int, TokenLogprob | None]]) -> None:
        for token, lp in entries:
            text = self.texts.text(token)
            self.tokens.append(text)
            self.text_offset.append(self.offset)
            self.offset += len(text)
            if lp is None:
                self.token_logprobs.append(None)
                self.top_logprobs.append(None)
                continue
            # Most probable first: a text that several tokens decode to (byte-fallback
            # pieces all read "\ufffd") keeps its most probable token's value, as the chosen
            # token's row in transformers' top-k does.
            top: dict[str, float] = {}
            for t, v in lp.top:
                top.setdefault(self.texts.text(t), _lp(v))
            top.setdefault(text, _lp(lp.logprob))
            self.token_logprobs.append(_lp(lp.logprob))
            self.top_logprobs.append(top)

    def take(self) -> dict[str, Any]:
        """Everything added so far, and start afresh (a stream sends each piece once)."""
        out = {"tokens": self.tokens, "token_logprobs": self.token_logprobs,
               "top_logprobs": self.top_logprobs, "text_offset": self.text_offset}
        self.tokens, self.token_logprobs, self.top_logprobs, self.text_offset = [], [], [], []
        return out


class ChatLogprobs:
    """A chat choice's `logprobs.content` entries."""

    def __init__(self, texts: TokenTexts) -> None:
        self.texts = texts
        self.content: list[dict[str, Any]] = []

    def _entry(self, token: int, value: float) -> dict[str, Any]:
        text = self.texts.text(token)
        return {"token": text, "logprob": _lp(value), "bytes": list(text.encode())}

    def add(self, entries: Iterable[tuple[int, TokenLogprob | None]]) -> None:
        for token, lp in entries:
            if lp is None:
                continue
            entry = self._entry(token, lp.logprob)
            entry["top_logprobs"] = [self._entry(t, v) for t, v in lp.top]
            self.content.append(entry)

    def take(self) -> dict[str, Any]:
        out, self.content = self.content, []
        return {"content": out, "refusal": None}


class Choice:
    """One output sequence of a request, as the client sees it."""

    def __init__(self, index: int, output: OutputText, logprobs: CompletionLogprobs |
                 ChatLogprobs | None, discard: bool = False) -> None:
        self.index = index
        self.output = output
        self.logprobs = logprobs
        self.discard = discard  # max_tokens 0: its one generated token is not shown
        self.prefix = ""  # echo: the prompt text, shown before the output
        self.finish: str | None = None
        self.num_tokens = 0
        self.cumulative_logprob: float | None = None
        self.reasoning: ReasoningSplitter | None = None  # --reasoning-parser (chat)

    @property
    def text(self) -> str:
        return self.prefix + self.output.text

    def echo(self, text: str, prompt: Sequence[int],
             prompt_logprobs: Sequence[TokenLogprob | None] | None) -> str:
        """Show the prompt first; its log-probabilities (the first one null) when asked."""
        self.prefix = text
        if isinstance(self.logprobs, CompletionLogprobs):
            lps = prompt_logprobs or [None] * len(prompt)
            self.logprobs.add(zip(prompt, lps))
            # Offsets of generated tokens count from the end of the echoed text.
            self.logprobs.offset = len(text)
        return text

    def push(self, tokens: Sequence[int], logprobs: Sequence[TokenLogprob] | None,
             final: str | None) -> str:
        """New tokens -> the text that may be shown now; sets `finish` when the choice
        ends: a stop string matched, or the engine's `final` reason (stop or length)."""
        if self.discard:  # max_tokens 0: only the prompt is shown
            if final is not None:
                self.finish = "length"
            return ""
        self.num_tokens += len(tokens)
        if self.logprobs is not None and logprobs:
            self.logprobs.add(zip(tokens, logprobs))
        delta = self.output.push(tokens)
        text = delta.text
        if delta.stopped:
            self.finish = "stop"
        elif final is not None:
            tail = self.output.finish()
            text += tail.text
            self.finish = "stop" if tail.stopped else final
        return text
