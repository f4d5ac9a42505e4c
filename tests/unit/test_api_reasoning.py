"""--reasoning-parser: thinking -> reasoning_content, answer -> content, whole or streamed.

The texts are the shapes the models print (Qwen3 and DeepSeek-R1 with `<think>`, Magistral
with `[THINK]`); streamed, they are cut into pieces at every position, and into the tiny
tokenizer's real token pieces, so a marker split over tokens is covered.
"""

from __future__ import annotations

import itertools

import pytest

from serve.api.reasoning import (
    FORMATS,
    ReasoningSplitter,
    reasoning_delta,
    reasoning_format,
    reasoning_message,
    reasoning_opened,
)
from serve.launch import parse
from tests.unit.test_detok import build_tiny_tokenizer

QWEN3 = ("<think>\nThe user asks for the capital of France. That is Paris.\n</think>\n\n"
         "The capital of France is Paris.")
R1 = ("Okay, the capital of France... it is Paris.\n</think>\n\n"
      "The capital of France is **Paris**.")
MAGISTRAL = "[THINK]2 + 2: add them, 4.[/THINK]The answer is 4."

CASES = [
    # (parser, text, prompt opened the block, reasoning, content)
    ("qwen3", QWEN3, False, "The user asks for the capital of France. That is Paris.",
     "The capital of France is Paris."),
    ("qwen3", "Paris is the capital.", False, "", "Paris is the capital."),
    ("qwen3", "  Paris <think>not a block</think>", False, "",
     "  Paris <think>not a block</think>"),
    ("qwen3", "<think>cut off while thin", False, "cut off while thin", ""),
    ("qwen3", "<think>\n\n</think>\n\nHi!", False, "", "Hi!"),  # thinking switched off
    ("qwen3", "thinking first</think>answer", True, "thinking first", "answer"),
    ("qwen3", "<th", False, "", "<th"),  # a start marker's piece, then the end
    ("deepseek_r1", R1, False, "Okay, the capital of France... it is Paris.",
     "The capital of France is **Paris**."),
    ("deepseek_r1", "<think>a</think>b", False, "a", "b"),
    ("deepseek_r1", "no end marker at all", False, "no end marker at all", ""),
    ("mistral", MAGISTRAL, False, "2 + 2: add them, 4.", "The answer is 4."),
    ("mistral", QWEN3, False, "", QWEN3),  # another format's markers are text
]


def _stream(splitter: ReasoningSplitter, pieces: list[str]) -> tuple[str, str]:
    reasoning = content = ""
    for piece in pieces:
        r, c = splitter.push(piece)
        reasoning, content = reasoning + r, content + c
    r, c = splitter.flush()
    return reasoning + r, content + c


@pytest.mark.parametrize(("name", "text", "opened", "reasoning", "content"), CASES)
def test_whole_text_splits_into_reasoning_and_content(name: str, text: str, opened: bool,
                                                      reasoning: str, content: str) -> None:
    splitter = ReasoningSplitter(FORMATS[name], opened)
    assert splitter.split(text) == (reasoning, content)
    message = reasoning_message(splitter, text)
    assert message["reasoning_content"] == (reasoning or None)
    assert message["content"] == (content if content or not reasoning else None)


@pytest.mark.parametrize(("name", "text", "opened", "reasoning", "content"), CASES)
def test_any_two_or_three_pieces_stream_to_the_same_split(name: str, text: str, opened: bool,
                                                          reasoning: str, content: str
                                                          ) -> None:
    fmt = FORMATS[name]
    cuts = range(1, len(text))
    for i, j in itertools.combinations_with_replacement(cuts, 2):
        pieces = [text[:i], text[i:j], text[j:]]
        assert _stream(ReasoningSplitter(fmt, opened), pieces) == (reasoning, content), pieces
    # one character at a time: no marker or marker piece ever leaks into either part
    splitter = ReasoningSplitter(fmt, opened)
    for ch in text:
        r, c = splitter.push(ch)
        assert fmt.start not in r + c and fmt.end not in r
    splitter.flush()
    assert (splitter.reasoning, splitter.content) == (reasoning, content)


def test_real_token_pieces_with_markers_split_over_tokens() -> None:
    """The tiny tokenizer has no `<think>` token: the markers arrive as several tokens,
    each decoded alone as the detokenizer hands them over."""
    tok = build_tiny_tokenizer()
    ids = tok("<think>the sky is blue</think>Blue.", add_special_tokens=False)["input_ids"]
    pieces = [tok.decode([t]) for t in ids]
    assert len(pieces) > 5 and "<think>" not in pieces  # the marker is split
    assert "".join(pieces) == "<think>the sky is blue</think>Blue."
    deltas = []
    splitter = ReasoningSplitter(FORMATS["qwen3"])
    for k, piece in enumerate(pieces):
        finish = "stop" if k == len(pieces) - 1 else None
        deltas.append(reasoning_delta(splitter, piece, finish))
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    content = "".join(d.get("content", "") for d in deltas)
    assert (reasoning, content) == ("the sky is blue", "Blue.")
    assert not any("reasoning_content" in d and "content" in d for d in deltas[:3])


def test_prompt_opened_by_the_template() -> None:
    tok = build_tiny_tokenizer()
    fmt = FORMATS["qwen3"]
    assert reasoning_opened(fmt, tok, tok("Question?\n<think>\n")["input_ids"])
    assert not reasoning_opened(fmt, tok, tok("Question?")["input_ids"])


def test_the_launch_option_names_the_known_parsers() -> None:
    cfg = parse(["--engine", "e", "--engine-cache", "none", "--reasoning-parser", "qwen3"])
    assert cfg.reasoning_parser == "qwen3"
    assert parse(["--engine", "e", "--engine-cache", "none"]).reasoning_parser is None
    with pytest.raises(ValueError, match="deepseek_r1, mistral, qwen3"):
        parse(["--engine", "e", "--engine-cache", "none", "--reasoning-parser", "r2d2"])
    with pytest.raises(ValueError, match="unknown reasoning parser 'x'"):
        reasoning_format("x")
