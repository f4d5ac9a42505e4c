"""Deterministic benchmark prompts of an exact token length.

Every system gets the same token ids (llama-server, vLLM and our server all accept a
list of ids as the OpenAI `prompt`), so prompt length does not depend on how each one
tokenizes text. Each prompt opens with different words, so no system gains from a
prefix cache that the others would not.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

# Plain words, fixed, so the prompts are the same on every machine.
_WORD_TEXT = (
    "the river city morning engine paper garden window silver market quiet number "
    "letter mountain story winter table orange signal kitchen bridge forest music "
    "planet yellow teacher animal summer doctor island camera pencil ocean village "
    "station language history science friend family season rocket cloud thunder "
    "harbor lantern castle journey machine painter meadow library theater whistle "
    "blanket festival compass"
)
_WORDS = tuple(_WORD_TEXT.split())


def _text(rng: random.Random, words: int) -> str:
    sentences: list[str] = []
    while sum(len(s.split()) for s in sentences) < words:
        n = rng.randint(6, 14)
        body = " ".join(rng.choice(_WORDS) for _ in range(n))
        sentences.append(body[0].upper() + body[1:] + ".")
    return " ".join(sentences)


def load_tokenizer(hf_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(hf_dir))


def make_prompts(tokenizer: Any, count: int, length: int, seed: int = 0) -> list[list[int]]:
    """`count` prompts of exactly `length` token ids each, the same for the same seed."""
    if count < 1 or length < 1:
        raise ValueError(f"count and length must be >= 1, got {count} and {length}")
    rng = random.Random(seed)
    prompts: list[list[int]] = []
    for i in range(count):
        text = f"Story {seed}-{i}. " + _text(rng, words=length * 2)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) < length:
            raise RuntimeError(f"prompt text too short: {len(ids)} < {length} tokens")
        prompts.append(list(ids[:length]))
    return prompts
