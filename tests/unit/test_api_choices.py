"""A choice's text and log-probabilities in OpenAI's completion and chat shapes."""

from __future__ import annotations

import pytest
from transformers import PreTrainedTokenizerFast

from runtime.core.types import TokenLogprob
from serve.api.choices import ChatLogprobs, Choice, CompletionLogprobs, TokenTexts
from serve.api.detok import OutputText
from tests.unit.test_detok import build_tiny_tokenizer


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    return build_tiny_tokenizer()


def test_completion_arrays_with_echo_first_null_and_chosen_in_top(tok) -> None:
    texts = TokenTexts(tok)
    prompt = tok("the lazy dog")["input_ids"]
    out = tok(" and fox")["input_ids"]
    choice = Choice(0, OutputText(tok, prompt), CompletionLogprobs(texts))
    prompt_lps = [None] + [TokenLogprob(t, -1.5, ((7, -0.5),)) for t in prompt[1:]]
    assert choice.echo("the lazy dog", prompt, prompt_lps) == "the lazy dog"
    lps = [TokenLogprob(t, float("-inf") if i == 0 else -2.0, ((t, -2.0), (9, -3.0)))
           for i, t in enumerate(out)]
    text = choice.push(out, lps, "length")
    assert choice.text == "the lazy dog" + text and choice.finish == "length"
    assert choice.logprobs is not None
    got = choice.logprobs.take()
    n = len(prompt)
    assert got["tokens"] == [texts.text(t) for t in prompt + out]
    assert got["token_logprobs"][0] is None and got["top_logprobs"][0] is None
    assert got["token_logprobs"][1:n] == [-1.5] * (n - 1)
    assert got["top_logprobs"][1] == {texts.text(7): -0.5, texts.text(prompt[1]): -1.5}
    assert got["token_logprobs"][n] == -9999.0  # -inf is not JSON
    assert set(got["top_logprobs"][n + 1]) == {texts.text(out[1]), texts.text(9)}
    # Offsets: prompt tokens from 0, generated ones from the end of the echoed text.
    assert got["text_offset"][0] == 0 and got["text_offset"][n] == len("the lazy dog")
    assert choice.logprobs.take()["tokens"] == []  # a stream sends each piece once


def test_chat_entries_carry_bytes_and_top_alternatives(tok) -> None:
    texts = TokenTexts(tok)
    ids = tok("ça")["input_ids"]
    lps = ChatLogprobs(texts)
    lps.add([(t, TokenLogprob(t, -0.25, ((t, -0.25), (3, -4.0)))) for t in ids])
    content = lps.take()["content"]
    assert [e["token"] for e in content] == [texts.text(t) for t in ids]
    assert all(e["bytes"] == list(e["token"].encode()) for e in content)
    assert [t["logprob"] for t in content[0]["top_logprobs"]] == [-0.25, -4.0]


def test_a_stop_string_ends_the_choice_and_max_tokens_zero_shows_nothing(tok) -> None:
    ids = tok("stop here END and more")["input_ids"]
    choice = Choice(0, OutputText(tok, [], stop=["END"]), None)
    text = "".join(choice.push([t], None, None) for t in ids)
    assert text == "stop here " and choice.finish == "stop"
    discard = Choice(1, OutputText(tok, []), None, discard=True)
    assert discard.push(ids[:1], None, "length") == "" and discard.finish == "length"
    assert discard.num_tokens == 0


def test_a_text_several_top_tokens_share_keeps_the_most_probable(tok) -> None:
    """Byte-fallback pieces of one character all read U+FFFD alone: the completions
    top_logprobs dict (text -> value) keeps the best of them, not the last."""
    texts = TokenTexts(tok)
    pieces = [i for i in range(len(tok)) if texts.text(i) == "\ufffd"][:3]
    assert len(pieces) == 3, "the tiny tokenizer has byte-fallback pieces"
    choice = Choice(0, OutputText(tok, []), CompletionLogprobs(texts))
    best = TokenLogprob(pieces[0], -1.0, ((pieces[0], -1.0), (pieces[1], -1.5),
                                          (pieces[2], -2.0)))
    choice.push([pieces[0]], [best], None)
    assert choice.logprobs is not None
    assert choice.logprobs.take()["top_logprobs"] == [{"\ufffd": -1.0}]
