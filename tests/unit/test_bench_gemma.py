"""bench/gemma_agreement's measure: KL over two top-N lists with a remainder bucket."""

from __future__ import annotations

import math

import pytest
import torch

from bench.gemma_agreement import summarize, top1, topn_kl, windows


def _lp(probs: dict[int, float]) -> dict[int, float]:
    return {t: math.log(p) for t, p in probs.items()}


def test_identical_lists_have_zero_kl() -> None:
    p = _lp({1: 0.5, 2: 0.3, 3: 0.1})
    assert topn_kl(p, p) == pytest.approx(0.0, abs=1e-12)


def test_complete_lists_give_the_exact_kl() -> None:
    p, q = {0: 0.7, 1: 0.2, 2: 0.1}, {0: 0.5, 1: 0.3, 2: 0.2}
    want = sum(p[t] * math.log(p[t] / q[t]) for t in p)
    assert topn_kl(_lp(p), _lp(q)) == pytest.approx(want, rel=1e-12)


def test_the_rest_of_each_side_is_one_bucket() -> None:
    # Shared: token 1. Token 2 only in p's list, token 3 only in q's: both go to the bucket.
    p, q = {1: 0.6, 2: 0.3}, {1: 0.4, 3: 0.5}
    p_rest, q_rest = 1 - 0.6, 1 - 0.4
    want = 0.6 * math.log(0.6 / 0.4) + p_rest * math.log(p_rest / q_rest)
    assert topn_kl(_lp(p), _lp(q)) == pytest.approx(want, rel=1e-12)


def test_it_is_a_lower_bound_of_the_full_kl() -> None:
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        lp = torch.log_softmax(torch.randn(2, 200, generator=g) * 3, dim=-1).double()
        full = float((lp[0].exp() * (lp[0] - lp[1])).sum())
        tops = [dict(zip(*(x.tolist() for x in reversed(row.topk(20))), strict=True))
                for row in lp]  # fmt: skip
        got = topn_kl(tops[0], tops[1])
        assert 0.0 <= got <= full + 1e-9


def test_a_side_whose_list_holds_all_its_mass_gets_a_floor_not_log0() -> None:
    p, q = {1: 0.5, 2: 0.5}, {1: 1.0}
    assert math.isfinite(topn_kl(_lp(p), _lp(q)))


def test_summarize_counts_top1_agreement() -> None:
    ref = [_lp({1: 0.6, 2: 0.4}), _lp({3: 0.9, 4: 0.1})]
    ours = [_lp({1: 0.7, 2: 0.3}), _lp({4: 0.6, 3: 0.4})]
    s = summarize(ref, ours)
    assert top1(ref[1]) == 3 and s["positions"] == 2 and s["top1_agreement"] == 0.5
    with pytest.raises(ValueError):
        summarize(ref, ours[:1])


def test_windows_open_with_bos_and_cover_the_tokens() -> None:
    w = windows(list(range(10, 20)), bos=2, tokens=7, window=3)
    assert w == [[2, 10, 11, 12], [2, 13, 14, 15], [2, 16]]


def test_a_text_maps_to_its_ordinary_token_not_its_byte_fallback() -> None:
    from bench.gemma_agreement import text_map

    texts = ["I", "<0x49>:I", "A", "\ufffd", "\ufffd", "x", "x"]
    texts[1] = "I"
    m = text_map(texts, [False, True, False, True, True, False, False])
    assert m == {"I": 0, "A": 2, "\ufffd": None, "x": None}


def test_each_tp_gets_its_row_against_the_same_llama_side() -> None:
    from bench.gemma_agreement import _by_tp

    a = {"top1_agreement": 0.9627, "mean_kl": 0.0037, "p99_kl": 0.021, "max_kl": 0.16}
    b = {**a, "top1_agreement": 0.94}
    assert _by_tp({"agreement_tp": {"1": a}}) == []  # one engine: the main table says it all
    lines = _by_tp({"agreement_tp": {"1": a, "2": b}})
    assert "| TP=1 | 96.27% | 0.00370 | 0.0210 / 0.1600 | yes |" in lines
    assert "| TP=2 | 94.00% | 0.00370 | 0.0210 / 0.1600 | no |" in lines
