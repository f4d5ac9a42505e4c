"""Incremental detokenization and stop strings, on real (tiny, offline-trained) tokenizers."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from serve.api.detok import IncrementalDetokenizer, OutputText, StopStringMatcher

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Héllo wörld, ça va? Grüße aus München.",
    "日本語のテキストです。",
    "emoji 🙂 and ✓ marks",
    "stop here END and more END text",
] * 3
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TEXTS = ["Héllo wörld 日本語 🙂 ✓ the lazy dog", "ça va? 🙂🙂 Grüße", "plain ascii text only"]


def build_tiny_tokenizer(kind: str = "bytelevel") -> PreTrainedTokenizerFast:
    """A real HF fast tokenizer trained in memory: byte-level BPE (GPT-2 style) with a
    small vocabulary, so most non-ASCII characters span several tokens; or "metaspace"
    (SentencePiece style, leading-space marker) to exercise the dropped-space case."""
    tok = Tokenizer(models.BPE())
    if kind == "bytelevel":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Metaspace()
        alphabet = sorted(set("".join(CORPUS + TEXTS)) | {"▁"})
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIALS,
                                  initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   additional_special_tokens=SPECIALS[1:])
    fast.chat_template = CHAT_TEMPLATE
    return fast


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    return build_tiny_tokenizer()


def _stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    deltas = [detok.push([t]) for t in ids]
    deltas.append(detok.flush())
    return deltas


@pytest.mark.parametrize("text", TEXTS)
def test_token_by_token_equals_full_decode_and_never_emits_replacement_char(
        tok: PreTrainedTokenizerFast, text: str) -> None:
    ids = tok(text)["input_ids"]
    deltas = _stream(IncrementalDetokenizer(tok), ids)
    assert "".join(deltas) == tok.decode(ids) == text
    assert all("\ufffd" not in d for d in deltas)


def test_multibyte_character_is_held_back_until_complete(tok: PreTrainedTokenizerFast) -> None:
    ids = tok("🙂")["input_ids"]
    assert len(ids) > 1, "the tiny vocabulary should split the emoji into byte tokens"
    detok = IncrementalDetokenizer(tok)
    assert [detok.push([t]) for t in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.push([ids[-1]]) == "🙂"


def test_chunked_pushes_match_single_pushes(tok: PreTrainedTokenizerFast) -> None:
    ids = tok(TEXTS[0])["input_ids"]
    rng = random.Random(0)
    for _ in range(20):
        detok, out, i = IncrementalDetokenizer(tok), [], 0
        while i < len(ids):
            n = rng.randint(1, 4)
            out.append(detok.push(ids[i:i + n]))
            i += n
        out.append(detok.flush())
        assert "".join(out) == TEXTS[0]


def test_flush_releases_an_incomplete_character(tok: PreTrainedTokenizerFast) -> None:
    ids = tok("🙂")["input_ids"]
    detok = IncrementalDetokenizer(tok)
    assert detok.push(ids[:1]) == ""
    assert "\ufffd" in detok.flush()  # output ended mid-character: show what we have


def test_metaspace_first_token_keeps_its_space_with_prompt_context() -> None:
    tok = build_tiny_tokenizer("metaspace")
    prompt = tok("The quick", add_special_tokens=False)["input_ids"]
    output = tok(" brown fox jumps", add_special_tokens=False)["input_ids"]
    alone = tok.decode(output)
    full = tok.decode(prompt + output)
    expected = full[len(tok.decode(prompt)):]
    assert expected.startswith(" ") and not alone.startswith(" ")  # the hazard is real
    assert "".join(_stream(IncrementalDetokenizer(tok, prompt), output)) == expected


def test_eos_and_special_tokens_are_not_in_the_text(tok: PreTrainedTokenizerFast) -> None:
    ids = tok("the lazy dog")["input_ids"]
    out = OutputText(tok, skip_token_ids=[tok.eos_token_id])
    text = out.push([*ids, tok.eos_token_id]).text + out.finish().text
    assert text == "the lazy dog"
    assert "<|endoftext|>" not in text
    # An eos id that the tokenizer does not mark special is still dropped from the text.
    plain_eos = tok("!", add_special_tokens=False)["input_ids"]
    assert len(plain_eos) == 1
    out = OutputText(tok, skip_token_ids=plain_eos)
    assert out.push([*ids, *plain_eos]).text + out.finish().text == "the lazy dog"


def _feed(stops: list[str], chunks: list[str]) -> tuple[list[str], StopStringMatcher]:
    m = StopStringMatcher(stops)
    out = [m.push(c) for c in chunks]
    out.append(m.flush())
    return out, m


@pytest.mark.parametrize(("stops", "chunks", "expected", "matched"), [
    (["END"], ["abc E", "N", "D more"], "abc ", "END"),
    (["END"], ["abc EN", "x"], "abc ENx", None),  # a prefix that did not complete
    (["END"], ["E", "N"], "EN", None),  # held back until the output ended
    (["\n\n", "###"], ["a#", "#", "\n\n#"], "a##", "\n\n"),  # "##" held, then released
    (["bc", "abcd"], ["xab", "cd"], "x", "abcd"),  # the earliest match wins, not the first
    (["bc", "abcd"], ["xabx", "bcd"], "xabx", "bc"),
    (["aab"], ["aa", "aab"], "aa", "aab"),  # overlapping prefixes: "aaaab"
    (["😀"], ["hi 😀 there"], "hi ", "😀"),
])
def test_stop_string_matcher(stops: list[str], chunks: list[str], expected: str,
                             matched: str | None) -> None:
    out, m = _feed(stops, chunks)
    assert "".join(out) == expected
    assert m.matched == matched


def test_stop_matcher_never_leaks_a_stop_prefix_under_random_splits() -> None:
    rng = random.Random(1)
    alphabet = "abc END\n"
    stops = ["END", "c\nc", "bb"]
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        hits = [i for s in stops if (i := text.find(s)) >= 0]
        expected = text[:min(hits)] if hits else text
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, 4)))
        chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        m, emitted = StopStringMatcher(stops), ""
        for c in chunks:
            emitted += m.push(c)
            # Everything streamed so far is final: a prefix of the true answer.
            assert expected.startswith(emitted), (text, chunks, emitted)
        emitted += m.flush()
        assert emitted == expected


def test_output_text_stops_across_token_boundaries(tok: PreTrainedTokenizerFast) -> None:
    text = "stop here END and more END text"
    ids = tok(text)["input_ids"]
    out = OutputText(tok, stop=["END"])
    streamed: list[str] = []
    for t in ids:
        delta = out.push([t])
        streamed.append(delta.text)
        assert "E" not in "".join(streamed).replace("here", "")  # no partial "END" leaked
        if delta.stopped:
            break
    assert out.stopped
    assert "".join(streamed) == out.text == "stop here "
    assert out.push(ids).text == ""  # nothing after the stop


def test_output_text_finish_releases_held_back_prefix(tok: PreTrainedTokenizerFast) -> None:
    ids = tok("the lazy E")["input_ids"]
    out = OutputText(tok, stop=["END"])
    first = out.push(ids)
    assert first.text == "the lazy " and not first.stopped
    last = out.finish()
    assert last.text == "E" and not last.stopped
    assert out.text == "the lazy E"


def test_stop_string_made_of_multibyte_tokens(tok: PreTrainedTokenizerFast) -> None:
    ids = tok("Grüße 日本語のテキスト")["input_ids"]
    out = OutputText(tok, stop=["本語"])
    text = "".join(out.push([t]).text for t in ids) + out.finish().text
    assert text == "Grüße 日"
    assert out.stopped


def test_empty_stop_string_is_rejected() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        StopStringMatcher(["END", ""])
