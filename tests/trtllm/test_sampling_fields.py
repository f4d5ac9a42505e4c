"""The sampling and output fields the trtllm adapter maps onto TensorRT-LLM's
SamplingConfig / OutputConfig (over the contract fake), and the ones it refuses with a
400 naming the field."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from runtime.core.types import GuidedSpec, SamplingParams, UnsupportedParameter
from tests.trtllm.test_adapter import EOS, _Sink


@pytest.fixture
def adapter(trtllm_fake: ModuleType, engine_tp1: Path) -> Iterator[Any]:
    from runtime.executors.trtllm import TrtllmExecutor
    from runtime.executors.trtllm_setup import construct_executor, kv_cache_config

    a = TrtllmExecutor(construct_executor(engine_tp1, kv_cache_config(None, 1024)),
                       eos_token_ids=(EOS,), pad_id=EOS)
    try:
        yield a
    finally:
        a.shutdown()


def test_penalties_min_tokens_and_logprobs_are_mapped(adapter: Any) -> None:
    req = adapter.make_request([1, 2], SamplingParams(
        max_tokens=9, temperature=0.8, seed=4, repetition_penalty=1.2, min_tokens=3, logprobs=0))
    sc = req.sampling_config
    assert (sc.repetition_penalty, sc.presence_penalty, sc.frequency_penalty) == (1.2, None, None)
    assert (sc.min_tokens, sc.seed) == (3, 4)
    assert req.output_config.return_log_probs
    plain = adapter.make_request([1], SamplingParams(max_tokens=2, temperature=0.0))
    psc = plain.sampling_config
    assert (psc.repetition_penalty, psc.presence_penalty, psc.frequency_penalty,
            psc.min_tokens) == (None, None, None, None)
    assert not plain.output_config.return_log_probs


def test_priority_keeps_its_order_in_tensorrt_llms_scale(adapter: Any) -> None:
    from runtime.executors.trtllm_request import trtllm_priority

    def prio(p: int) -> float:
        return adapter.make_request([1], SamplingParams(max_tokens=2, priority=p)).priority

    assert prio(0) == 0.5  # TensorRT-LLM's default: not passed at all
    values = [prio(p) for p in (-(2**31), -1000, -1, 1, 2, 1000, 2**31 - 1)]
    assert all(0.0 <= v <= 1.0 for v in values)
    assert values == sorted(values, reverse=True) and len(set(values)) == len(values)
    assert trtllm_priority(-1) > 0.5 > trtllm_priority(1)


def test_the_chosen_tokens_logprobs_come_back(adapter: Any) -> None:
    sink = _Sink()
    adapter.add_request("lp", [5, 17, 33, 2], SamplingParams(max_tokens=5, temperature=0.0,
                                                             ignore_eos=True, logprobs=0), sink)
    assert sink.done.wait(10)
    lps = [lp for ev in sink.events for lp in (ev.logprobs or [])]
    assert [lp.token for lp in lps] == sink.tokens and len(lps) == 5
    assert all(lp.logprob == 0.0 and lp.top == () for lp in lps)  # the fake's toy is certain


@pytest.mark.parametrize(("param", "params"), [
    ("logprobs", SamplingParams(logprobs=3)),
    ("prompt_logprobs", SamplingParams(prompt_logprobs=1)),
    ("logit_bias", SamplingParams(logit_bias=((3, 1.0),))),
    ("guided", SamplingParams(guided=GuidedSpec("json_schema", json.dumps({"type": "object"})))),
    ("num_sequences", SamplingParams(n=2)),
    ("num_sequences", SamplingParams(n=1, best_of=3)),
    # TensorRT-LLM counts the prompt's tokens for these (penaltyKernels.cu); we do not.
    ("presence_penalty", SamplingParams(presence_penalty=0.5)),
    ("frequency_penalty", SamplingParams(frequency_penalty=-0.3)),
])
def test_what_is_not_mapped_is_refused_naming_the_field(adapter: Any, param: str,
                                                        params: SamplingParams) -> None:
    with pytest.raises(UnsupportedParameter) as info:
        adapter.add_request("x", [1, 2], params, _Sink())
    assert info.value.param == param and "trtllm" in str(info.value)
    assert adapter.num_unfinished() == 0


def test_repetition_penalty_serves_what_our_torch_sampler_serves(adapter: Any,
                                                                  engine_tp1: Path) -> None:
    """The fake applies TensorRT-LLM's penalty kernel to the toy's logits (temperature first,
    prompt tokens counted); greedy tokens with repetition_penalty must be the ones our own
    logits processors (runtime/core/logits.py) pick from the same logits."""
    import torch
    from tensorrt_llm._fake.toy import ToyModel

    from runtime.core.logits import SeqSampling, apply_processors

    toy = ToyModel.from_engine_dir(engine_tp1)
    head = [5, 17]
    prompt = [toy.next_token(head), 3, *head]  # the toy's next token is already in the prompt
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                            repetition_penalty=2.5)
    sink = _Sink()
    adapter.add_request("rep", prompt, params, sink)
    assert sink.done.wait(10)

    state, seq, want = SeqSampling(params, None, (), prompt), list(prompt), []
    for _ in range(params.max_tokens):
        row = torch.tensor([[toy.logit(seq, v) for v in range(toy.vocab_size)]])
        apply_processors(row, [state])
        tok = int(row[0].argmax())
        state.accept(tok, None)
        seq.append(tok)
        want.append(tok)
    assert sink.tokens == want
    assert want != toy.generate(prompt, 8)[0]  # the penalty changed the answer
