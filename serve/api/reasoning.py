"""Reasoning output (`serve launch --reasoning-parser NAME`): a thinking model's output split
into its thinking (`reasoning_content`) and its answer (`content`), as vLLM and SGLang return
them for chat completions.

The formats differ only in their markers and in whether the chat template opens the
thinking block in the prompt:

- `qwen3`: `<think>...</think>` at the start of the output; output that does not start with
  `<think>` is all answer (Qwen3 with thinking off, or any model that did not think).
- `deepseek_r1`: the template ends the prompt inside the thinking block (DeepSeek-R1's
  `<think>\\n`), so everything before `</think>` is thinking, a leading `<think>` or not;
  output without `</think>` is all thinking (cut off while thinking).
- `mistral`: Magistral's `[THINK]...[/THINK]`, as `qwen3`.

Whatever the format, a prompt that ends with the start marker (the template opened the
block) starts the output inside the thinking. The split works on streamed text deltas:
text that could be the start of a marker is held back until the next delta decides it, so
a marker split over several tokens ("<th", "ink>") never leaks into either field. The
whitespace around the markers is dropped, as SGLang does; an output with no thinking
comes back as it was generated.
NOTE: the markers must survive detokenization: a model whose `<think>` is a *special* token
(skipped when decoding) cannot be split this way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["FORMATS", "ReasoningFormat", "ReasoningSplitter", "reasoning_delta",
           "reasoning_format", "reasoning_message", "reasoning_opened"]


@dataclass(frozen=True, slots=True)
class ReasoningFormat:
    name: str
    start: str
    end: str
    implicit_start: bool  # output before `end` is thinking even without `start`


FORMATS: dict[str, ReasoningFormat] = {f.name: f for f in (
    ReasoningFormat("deepseek_r1", "<think>", "</think>", implicit_start=True),
    ReasoningFormat("qwen3", "<think>", "</think>", implicit_start=False),
    ReasoningFormat("mistral", "[THINK]", "[/THINK]", implicit_start=False),
)}


def reasoning_format(name: str) -> ReasoningFormat:
    """The format of a `--reasoning-parser` name (ValueError listing the known ones)."""
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; known: "
                         f"{', '.join(sorted(FORMATS))}") from None


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


State = Literal["open", "reasoning", "content"]


class ReasoningSplitter:
    """Text deltas in, (reasoning, content) deltas out, for one output sequence.

    ```
    "open"  --start marker-->  "reasoning"  --end marker-->  "content"
      |  (anything else: "content"; with implicit_start or a prompt that opened
      |   the block, "reasoning")
    ```
    """

    def __init__(self, fmt: ReasoningFormat, prompt_opened: bool = False) -> None:
        self.fmt = fmt
        self.prompt_opened = prompt_opened
        self.state: State = "open"
        self._fallback: State = "reasoning" if fmt.implicit_start or prompt_opened \
            else "content"
        self._buf = ""  # received, not yet emitted
        self._strip = True  # drop leading whitespace of the part being emitted
        self.reasoning = ""  # everything emitted so far, per part
        self.content = ""

    def split(self, text: str) -> tuple[str, str]:
        """A whole output at once, with a splitter of the same configuration."""
        fresh = ReasoningSplitter(self.fmt, self.prompt_opened)
        r1, c1 = fresh.push(text)
        r2, c2 = fresh.flush()
        return r1 + r2, c1 + c2

    def push(self, text: str) -> tuple[str, str]:
        """A new text delta -> the (reasoning, content) text certain now."""
        self._buf += text
        reasoning = content = ""
        while True:
            if self.state == "open":
                head = self._buf.lstrip()
                if head.startswith(self.fmt.start):
                    self._enter("reasoning", head[len(self.fmt.start):])
                    continue
                if self.fmt.start.startswith(head):  # empty, or a part of the marker
                    break
                # Not a start marker: the whole output belongs to the fallback part (its
                # leading whitespace stripped by the part's own rule).
                self._enter(self._fallback, self._buf, strip=self._fallback == "reasoning")
                continue
            if self.state == "reasoning":
                at = self._buf.find(self.fmt.end)
                if at >= 0:
                    reasoning += self._emit(self._buf[:at].rstrip())
                    self._enter("content", self._buf[at + len(self.fmt.end):])
                    continue
                # Hold back what could become the end marker, and trailing whitespace
                # (it is dropped if the marker follows).
                keep = _partial_suffix(self._buf, self.fmt.end)
                ready = self._buf[:len(self._buf) - keep]
                sure = ready.rstrip()
                reasoning += self._emit(sure)
                self._buf = self._buf[len(sure):]
                break
            content += self._emit(self._buf)
            self._buf = ""
            break
        self.reasoning += reasoning
        self.content += content
        return reasoning, content

    def flush(self) -> tuple[str, str]:
        """The output ended: what is still held back."""
        reasoning = content = ""
        if self.state == "open":
            # Only whitespace or a part of the start marker came: that is the answer (or
            # the thinking, when the prompt opened it).
            self._enter(self._fallback, self._buf, strip=self._fallback == "reasoning")
        if self.state == "reasoning":
            reasoning = self._emit(self._buf.rstrip())
        else:
            content = self._emit(self._buf)
        self._buf = ""
        self.reasoning += reasoning
        self.content += content
        return reasoning, content

    def _enter(self, state: State, rest: str, strip: bool = True) -> None:
        self.state, self._buf, self._strip = state, rest, strip

    def _emit(self, text: str) -> str:
        if self._strip:
            text = text.lstrip()
            self._strip = not text
        return text


def reasoning_opened(fmt: ReasoningFormat, tokenizer: Any, prompt_ids: Sequence[int]) -> bool:
    """Whether the rendered prompt ends inside a thinking block (the template opened it)."""
    tail = tokenizer.decode(list(prompt_ids[-8:]), skip_special_tokens=False,
                            clean_up_tokenization_spaces=False)
    return tail.rstrip().endswith(fmt.start)


def reasoning_delta(splitter: ReasoningSplitter, text: str | None, finish: str | None
                    ) -> dict[str, str]:
    """A streamed chat delta's `reasoning_content` and `content` for a new piece of text
    (None: none); at the finish, with whatever the splitter still held back."""
    reasoning, content = splitter.push(text or "")
    if finish is not None:
        r, c = splitter.flush()
        reasoning, content = reasoning + r, content + c
    delta: dict[str, str] = {}
    if reasoning:
        delta["reasoning_content"] = reasoning
    if content:
        delta["content"] = content
    return delta


def reasoning_message(splitter: ReasoningSplitter, text: str) -> dict[str, str | None]:
    """A chat message's `content` and `reasoning_content` for its whole text; content is
    null when the output was all thinking, reasoning_content null when there was none."""
    reasoning, content = splitter.split(text)
    return {"content": content if content or not reasoning else None,
            "reasoning_content": reasoning or None}
