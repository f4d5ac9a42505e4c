"""runtime/tokenizer.py (the `tokenizers` library directly, no transformers) against
transformers' AutoTokenizer on the same saved files: ids, decoding, special tokens, the
chat template and the tokenizer info xgrammar builds its masks from."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from runtime.tokenizer import FastTokenizer
from tests.unit.test_detok import TEXTS, build_tiny_tokenizer

SMOLLM2 = Path.home() / ".cache" / "aot-llm" / "demo" / "SmolLM2-135M-Instruct"
CHATS = [
    [{"role": "user", "content": "Hello there"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo 👋"},
     {"role": "assistant", "content": "Hi!"}, {"role": "user", "content": "And again?"}],
]


def _dirs(tmp: Path) -> list[Path]:
    out = []
    for kind in ("bytelevel", "metaspace"):
        d = tmp / kind
        build_tiny_tokenizer(kind).save_pretrained(d)
        out.append(d)
    if (SMOLLM2 / "tokenizer.json").is_file():  # the demo model, where `make demo` fetched it
        out.append(SMOLLM2)
    return out


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[FastTokenizer, object]]:
    return [(FastTokenizer(d), AutoTokenizer.from_pretrained(d))
            for d in _dirs(tmp_path_factory.mktemp("tok"))]


def test_ids_and_text_match_transformers(pairs: list) -> None:
    for ours, hf in pairs:
        assert len(ours) == len(hf)
        assert (ours.eos_token_id, ours.bos_token_id, ours.pad_token_id) == \
            (hf.eos_token_id, hf.bos_token_id, hf.pad_token_id)
        for text in [*TEXTS, "", "  two  spaces", "<|endoftext|> after a special"]:
            for special in (True, False):
                ids = ours.encode(text, add_special_tokens=special)
                assert ids == hf(text, add_special_tokens=special)["input_ids"], (text, special)
                for skip in (True, False):
                    assert ours.decode(ids, skip_special_tokens=skip) == \
                        hf.decode(ids, skip_special_tokens=skip), (text, skip)
            ids = ours.encode(text)
            assert ours.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)


def test_chat_template_matches_transformers(pairs: list) -> None:
    for ours, hf in pairs:
        for chat in CHATS:
            for gen in (True, False):
                want = hf.apply_chat_template(chat, add_generation_prompt=gen, tokenize=False)
                assert ours.apply_chat_template(chat, add_generation_prompt=gen,
                                                tokenize=False) == want
                want_ids = hf.apply_chat_template(chat, add_generation_prompt=gen,
                                                  tokenize=True, return_dict=False)
                assert ours.apply_chat_template(chat, add_generation_prompt=gen) == \
                    [int(t) for t in want_ids]


def test_xgrammar_info_matches_transformers(pairs: list) -> None:
    import xgrammar as xgr

    for ours, hf in pairs:
        size = len(hf) + 3  # a model vocabulary padded past the tokenizer's
        stops = [hf.eos_token_id] if hf.eos_token_id is not None else None
        a = ours.xgrammar_info(size, stops)
        b = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=size, stop_token_ids=stops)
        assert a.decoded_vocab == b.decoded_vocab
        assert (a.vocab_type, a.add_prefix_space) == (b.vocab_type, b.add_prefix_space)
        assert list(a.stop_token_ids) == list(b.stop_token_ids)
