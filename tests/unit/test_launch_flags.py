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


def test_the_waiting_prefill_cap_flag_is_parsed_and_checked() -> None:
    """--max-prefill-tokens-while-waiting: a count, 0 for no cap, never negative."""
    assert parse(["--engine", "e"]).max_prefill_tokens_while_waiting is None  # per device
    assert parse(["--engine", "e", "--max-prefill-tokens-while-waiting", "0"]
                 ).max_prefill_tokens_while_waiting == 0
    with pytest.raises(ValueError, match="max-prefill-tokens-while-waiting must be >= 0"):
        parse(["--engine", "e", "--max-prefill-tokens-while-waiting", "-1"])


def test_the_grammar_flags_are_parsed_and_checked() -> None:
    """--grammar-compile-timeout, --grammar-compile-workers, --grammar-cache-mib."""
    cfg = parse(["--engine", "e"])
    assert (cfg.grammar_compile_timeout, cfg.grammar_compile_workers,
            cfg.grammar_cache_mib) == (5.0, 2, 256)
    cfg = parse(["--engine", "e", "--grammar-compile-timeout", "0.5",
                 "--grammar-compile-workers", "1", "--grammar-cache-mib", "0"])
    assert (cfg.grammar_compile_timeout, cfg.grammar_compile_workers,
            cfg.grammar_cache_mib) == (0.5, 1, 0)
    for flag, value in (("--grammar-compile-timeout", "0"), ("--grammar-compile-workers", "0"),
                        ("--grammar-cache-mib", "-1")):
        with pytest.raises(ValueError, match=flag):
            parse(["--engine", "e", flag, value])


def test_the_speculative_flag_is_parsed_and_checked() -> None:
    """--speculative: unset (the engine's choice), off, ngram or ngram:K; anything else is
    refused before a rank starts."""
    assert parse(["--engine", "e"]).speculative is None
    assert parse(["--engine", "e", "--speculative", "off"]).speculative == "off"
    assert parse(["--engine", "e", "--speculative", "ngram:6"]).speculative == "ngram:6"
    for bad in ("ngram:0", "eagle", "ngram:x"):
        with pytest.raises(ValueError, match="--speculative"):
            parse(["--engine", "e", "--speculative", bad])


def test_the_build_flag_is_checked() -> None:
    from contract.profile import BuildProfile
    from contract.speculative import Speculative
    from pipeline.config import BuildConfig

    assert BuildConfig("m", speculative=Speculative("ngram", 4)).speculative is not None
    with pytest.raises(ValueError, match="aoti and eager"):
        BuildConfig("m", backend="trtllm", speculative=Speculative("ngram", 4))
    with pytest.raises(ValueError, match="max-num-tokens"):
        BuildConfig("m", speculative=Speculative("ngram", 8),
                    profile=BuildProfile(max_batch_size=4, max_num_tokens=8))
