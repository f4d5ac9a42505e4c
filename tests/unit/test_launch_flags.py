"""`serve launch` flags that shape scheduling: parsed into LaunchConfig and checked there."""

from __future__ import annotations

import pytest

from serve.launch import parse


def test_the_prefill_cap_flag_is_parsed_and_checked() -> None:
    """--max-prefill-tokens-while-decoding: a count, 0 for no cap, never negative."""
    assert parse(["--engine", "e"]).max_prefill_tokens_while_decoding is None  # per device
    assert parse(["--engine", "e", "--max-prefill-tokens-while-decoding", "64"]
                 ).max_prefill_tokens_while_decoding == 64
    with pytest.raises(ValueError, match="max-prefill-tokens-while-decoding must be >= 0"):
        parse(["--engine", "e", "--max-prefill-tokens-while-decoding", "-1"])
