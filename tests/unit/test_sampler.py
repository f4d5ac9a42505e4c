from __future__ import annotations

from collections import Counter

import pytest
import torch

from runtime.core.sampler import Sampler, first_max, make_generator
from runtime.core.types import SamplingParams


def rows(params: SamplingParams, n: int) -> list[tuple[SamplingParams, torch.Generator | None]]:
    gen = make_generator(params)
    return [(params, gen)] * n


def test_greedy_is_argmax() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=0.0)
    assert Sampler()(logits, rows(params, 6)) == logits.argmax(-1).tolist()
    assert make_generator(params) is None


def test_top_k_one_is_argmax_at_any_temperature() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=1.5, top_k=1, seed=3)
    assert Sampler()(logits, rows(params, 6)) == logits.argmax(-1).tolist()


def test_tiny_top_p_is_argmax() -> None:
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(2))
    params = SamplingParams(temperature=1.0, top_p=1e-6, seed=4)
    assert Sampler()(logits, rows(params, 8)) == logits.argmax(-1).tolist()


def test_same_seed_same_samples_and_different_seeds_differ() -> None:
    logits = torch.randn(64, 100, generator=torch.Generator().manual_seed(3))  # a "stream"
    sampler = Sampler()

    def run(seed: int) -> list[int]:
        params = SamplingParams(temperature=1.0, top_p=0.9, seed=seed)
        gen = make_generator(params)
        # One row per step, as a request sees it over 64 decode steps.
        return [sampler(logits[i : i + 1], [(params, gen)])[0] for i in range(64)]

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_unseeded_requests_draw_from_fresh_streams() -> None:
    logits = torch.zeros(64, 1000)
    params = SamplingParams(temperature=1.0)
    a = Sampler()(logits, rows(params, 64))
    b = Sampler()(logits, rows(params, 64))
    assert a != b


def test_a_row_does_not_depend_on_its_batch() -> None:
    logits = torch.randn(5, 30, generator=torch.Generator().manual_seed(4))
    mixed = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, top_k=5, seed=1),
        SamplingParams(temperature=1.2, top_p=0.8, seed=2),
        SamplingParams(temperature=1.0, seed=3),
        SamplingParams(temperature=0.5, top_k=3, top_p=0.5, seed=4),
    ]
    batched = Sampler()(logits, [(p, make_generator(p)) for p in mixed])
    alone = [Sampler()(logits[i : i + 1], [(p, make_generator(p))])[0] for i, p in enumerate(mixed)]
    assert batched == alone
    assert batched[0] == logits[0].argmax().item()


def test_top_k_never_picks_outside_the_top_k() -> None:
    logits = torch.randn(1, 40, generator=torch.Generator().manual_seed(5))
    params = SamplingParams(temperature=2.0, top_k=4, seed=6)
    picks = set(Sampler()(logits.expand(2000, -1), rows(params, 2000)))
    assert picks == set(logits[0].topk(4).indices.tolist())


def test_sampling_follows_the_softmax() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0]])
    n = 20_000
    params = SamplingParams(temperature=1.0, seed=7)
    counts = Counter(Sampler()(logits.expand(n, -1), rows(params, n)))
    freq = torch.tensor([counts[i] / n for i in range(4)])
    assert torch.allclose(freq, logits.softmax(-1)[0], atol=0.015)


def test_temperature_sharpens() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0]])
    n = 5000
    params = SamplingParams(temperature=0.25, seed=8)
    counts = Counter(Sampler()(logits.expand(n, -1), rows(params, n)))
    assert counts[2] / n == pytest.approx((logits / 0.25).softmax(-1)[0, 2].item(), abs=0.02)
    assert counts[2] / n > 0.95


def test_top_p_keeps_the_smallest_nucleus_and_renormalises() -> None:
    # probabilities 0.5, 0.3, 0.2: top_p 0.6 keeps the first two, in ratio 5:3
    logits = torch.tensor([[0.5, 0.3, 0.2]]).log()
    n = 20_000
    params = SamplingParams(temperature=1.0, top_p=0.6, seed=9)
    counts = Counter(Sampler()(logits.expand(n, -1), rows(params, n)))
    assert set(counts) == {0, 1}
    assert counts[0] / n == pytest.approx(5 / 8, abs=0.015)
    params = SamplingParams(temperature=1.0, top_p=0.5, seed=9)
    assert set(Sampler()(logits.expand(1000, -1), rows(params, 1000))) == {0}


def test_masked_tokens_are_never_picked() -> None:
    logits = torch.full((1, 10), float("-inf"))
    logits[0, 3] = 0.0
    logits[0, 7] = 0.0
    params = SamplingParams(temperature=1.0, seed=10)
    assert set(Sampler()(logits.expand(500, -1), rows(params, 500))) == {3, 7}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_low_and_high_precision_logits(dtype: torch.dtype) -> None:
    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(11)).to(dtype)
    greedy = SamplingParams(temperature=0.0)
    assert Sampler()(logits, rows(greedy, 4)) == logits.float().argmax(-1).tolist()
    params = SamplingParams(temperature=0.8, top_k=10, top_p=0.9, seed=12)
    out = Sampler()(logits, rows(params, 4))
    assert all(isinstance(t, int) and 0 <= t < 64 for t in out)


def test_shape_mismatch_is_an_error() -> None:
    with pytest.raises(ValueError):
        Sampler()(torch.zeros(2, 5), rows(SamplingParams(), 3))
    with pytest.raises(ValueError):
        Sampler()(torch.zeros(5), rows(SamplingParams(), 5))


@pytest.mark.parametrize(
    "kw", [dict(temperature=-0.1), dict(temperature=2.5), dict(top_p=0.0), dict(top_k=-1)]
)
def test_invalid_params_are_rejected_by_sampling_params(kw: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**kw)  # type: ignore[arg-type]


def test_large_and_negative_seeds_are_accepted() -> None:
    for seed in (2**70, -5):
        params = SamplingParams(temperature=1.0, seed=seed)
        assert make_generator(params) is not None


# ---- the full pipeline: processors, temperature, log-probabilities --------------------

from runtime.core.logits import SeqSampling  # noqa: E402


def _state(params: SamplingParams, prompt: list[int] = (), stops: tuple[int, ...] = ()
           ) -> SeqSampling:
    return SeqSampling(params, make_generator(params), stops, list(prompt))


def test_logprobs_follow_temperature_and_list_the_top_k() -> None:
    logits = torch.randn(1, 30, generator=torch.Generator().manual_seed(20))
    p = SamplingParams(temperature=0.5, seed=1, logprobs=3)
    ((token, lp),) = Sampler().sample_seqs(logits, [_state(p)])
    ref = (logits[0] / 0.5).log_softmax(-1)
    assert lp is not None and lp.token == token
    assert lp.logprob == pytest.approx(ref[token].item(), abs=1e-5)
    assert [t for t, _ in lp.top] == ref.topk(3).indices.tolist()
    greedy = SamplingParams(temperature=0.0, logprobs=0)
    ((token, lp),) = Sampler().sample_seqs(logits, [_state(greedy)])
    assert token == logits.argmax().item() and lp is not None and lp.top == ()
    assert lp.logprob == pytest.approx(logits[0].log_softmax(-1)[token].item(), abs=1e-5)


def test_penalties_bias_and_min_tokens_formulas() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, 1.0]])
    p = SamplingParams(temperature=0, repetition_penalty=2.0, presence_penalty=0.5,
                       frequency_penalty=0.25, logit_bias=((4, -3.0),), min_tokens=3,
                       logprobs=0)
    s = _state(p, prompt=[1], stops=(3,))
    s.accept(0, None)
    s.accept(0, None)
    # token 0: seen twice in the output -> 2.0 / 2 - 0.5 - 2 * 0.25 = 0.0; token 1 in the
    # prompt -> -1.0 * 2 = -2.0; token 3 is the stop token, masked (2 < min_tokens 3);
    # token 4 biased: 1.0 - 3.0 = -2.0; token 2 untouched: 0.5.
    ((token, lp),) = Sampler().sample_seqs(logits, [s])
    want = torch.tensor([0.0, -2.0, 0.5, float("-inf"), -2.0]).log_softmax(-1)
    assert token == 2 and lp is not None
    assert lp.logprob == pytest.approx(want[2].item(), abs=1e-6)
    s.accept(2, None)  # three tokens out: the stop token is allowed again
    ((token, _),) = Sampler().sample_seqs(logits, [s])
    assert token == 3


def test_the_pipeline_does_not_depend_on_the_batch() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(21))
    mixed = [SamplingParams(temperature=0.9, seed=1, presence_penalty=1.0, logprobs=2),
             SamplingParams(temperature=0.0, repetition_penalty=1.5, logprobs=1),
             SamplingParams(temperature=1.3, seed=3, logit_bias=((7, 5.0),), top_k=5),
             SamplingParams(temperature=0.7, seed=4, min_tokens=2, top_p=0.8)]
    def states() -> list[SeqSampling]:
        out = [_state(p, prompt=[1, 2, 3], stops=(5,)) for p in mixed]
        for s in out:
            s.accept(3, None)
        return out
    batched = Sampler().sample_seqs(logits, states())
    alone = [Sampler().sample_seqs(logits[i:i + 1], [s])[0] for i, s in enumerate(states())]
    assert batched == alone


def test_plain_greedy_rows_skip_the_float_copy_and_choose_the_same_tokens() -> None:
    gen = torch.Generator().manual_seed(22)
    # bf16 rounding makes ties common: the first maximum must win, as after a float32 copy.
    logits = (torch.randn(16, 4000, generator=gen) * 2).round().bfloat16()
    logits[3, 10] = logits[3, 900] = logits[3].max() + 1  # an exact tie
    plain = [_state(SamplingParams(temperature=0.0)) for _ in range(16)]
    tokens = [t for t, _ in Sampler().sample_seqs(logits, plain)]
    assert tokens == logits.float().argmax(dim=-1).tolist()
    assert tokens[3] == 10
    # Any processor or log-probability takes the full pipeline: a stop token masked before
    # min_tokens is never chosen, even where it is the maximum.
    masked = _state(SamplingParams(temperature=0.0, min_tokens=2), stops=(10,))
    ((token, _),) = Sampler().sample_seqs(logits[3:4], [masked])
    assert token == 900
    ((token, lp),) = Sampler().sample_seqs(logits[3:4], [_state(SamplingParams(temperature=0.0,
                                                                               logprobs=0))])
    assert token == 10 and lp is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_first_max_is_argmax_ties_and_nans_included(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(7)
    threads = torch.get_num_threads()
    try:
        for n_threads in (1, 2):
            torch.set_num_threads(n_threads)
            for rows in (1, 16, 64):
                # Values 0..4 over a 49k vocabulary: every row has thousands of tied maxima.
                logits = torch.randint(0, 5, (rows, 49152), generator=gen).to(dtype)
                logits[0, 40000] = logits[0, 30000] = float("nan")  # NaN wins, the first one
                assert first_max(logits).tolist() == logits.argmax(dim=-1).tolist()
                assert first_max(logits)[0] == 30000
    finally:
        torch.set_num_threads(threads)
