"""The Executor adapter (serve/executors/trtllm.py) in this process, over the contract fake:
streaming, stop ids, cancel, errors and statistics, predicted by the fake's toy rule."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from runtime.core.types import SamplingParams, TokenEvent

EOS = 0


@pytest.fixture
def adapter(trtllm_fake: ModuleType, engine_tp1: Path) -> Iterator[Any]:
    from runtime.executors.trtllm import TrtllmExecutor
    from runtime.executors.trtllm_setup import construct_executor, kv_cache_config

    ex = construct_executor(engine_tp1, kv_cache_config(None, 1024))
    a = TrtllmExecutor(ex, eos_token_ids=(EOS,), pad_id=EOS)
    try:
        yield a
    finally:
        a.shutdown()


def _toy(engine: Path) -> Any:
    from tensorrt_llm._fake.toy import ToyModel

    return ToyModel.from_engine_dir(engine)


class _Sink:
    def __init__(self) -> None:
        self.events: list[TokenEvent] = []
        self.done = threading.Event()

    def __call__(self, ev: TokenEvent) -> None:
        self.events.append(ev)
        if ev.finish_reason is not None:
            self.done.set()

    @property
    def tokens(self) -> list[int]:
        return [t for ev in self.events for t in ev.token_ids]


def test_tokens_stream_as_the_engine_computes_them(adapter: Any, engine_tp1: Path) -> None:
    prompt = [5, 17, 33, 2]
    want, reason = _toy(engine_tp1).generate(prompt, 12, end_id=EOS)
    sink = _Sink()
    adapter.add_request("r1", prompt, SamplingParams(max_tokens=12, temperature=0.0), sink)
    assert sink.done.wait(10)
    assert sink.tokens == want  # the prompt is excluded; end_id is not an output token
    assert sink.events[-1].finish_reason == ("stop" if reason == "END_ID" else "length")
    assert all(ev.num_prompt_tokens == 4 for ev in sink.events)
    assert len(sink.events) >= len(want)  # streamed token by token, not in one piece
    assert adapter.num_unfinished() == 0


def test_request_mapping(adapter: Any) -> None:
    sampled = adapter.make_request([1, 2, 3], SamplingParams(
        max_tokens=7, temperature=0.7, top_p=0.9, top_k=5, seed=3, stop_token_ids=(9, 11)))
    assert (sampled.input_token_ids, sampled.max_tokens) == ([1, 2, 3], 7)
    assert sampled.streaming and sampled.output_config.exclude_input_from_output
    assert (sampled.end_id, sampled.pad_id, sampled.stop_words) == (EOS, EOS, [[9], [11]])
    sc = sampled.sampling_config
    assert (sc.beam_width, sc.temperature, sc.top_p, sc.top_k, sc.seed) == (1, 0.7, 0.9, 5, 3)
    greedy = adapter.make_request([1], SamplingParams(max_tokens=2, temperature=0.0,
                                                      ignore_eos=True))
    assert greedy.sampling_config.top_k == 1 and greedy.end_id is None
    assert greedy.stop_words is None
    # No seed from the client: a fresh one per request, never TensorRT-LLM's default (0).
    seeds = {adapter.make_request([1], SamplingParams(max_tokens=2, temperature=0.7))
             .sampling_config.seed for _ in range(4)}
    assert None not in seeds and 0 not in seeds and len(seeds) == 4
    assert all(0 < s < 2**64 for s in seeds)


def _sample(adapter: Any, prompt: list[int], **params: Any) -> list[int]:
    sink = _Sink()
    adapter.add_request(f"s{id(sink)}", prompt,
                        SamplingParams(max_tokens=16, ignore_eos=True, **params), sink)
    assert sink.done.wait(10)
    return sink.tokens


def test_sampling_without_a_seed_is_random(adapter: Any) -> None:
    """TensorRT-LLM seeds a request without a seed with 0 (the fake does too): identical
    prompts would get identical "random" samples unless the adapter draws a seed."""
    prompt = [5, 17, 33, 2]
    a, b = (_sample(adapter, prompt, temperature=1.0, top_k=50) for _ in range(2))
    assert len(a) == len(b) == 16 and a != b
    # A seed the client gives is honoured: the same seed, the same sample.
    c, d = (_sample(adapter, prompt, temperature=1.0, top_k=50, seed=7) for _ in range(2))
    assert c == d


def test_stop_word_ends_the_request(adapter: Any, engine_tp1: Path) -> None:
    prompt = [5, 17, 33, 2]
    free, _ = _toy(engine_tp1).generate(prompt, 6)
    sink = _Sink()
    adapter.add_request("r", prompt, SamplingParams(max_tokens=6, temperature=0.0,
                                                    stop_token_ids=(free[2],), ignore_eos=True),
                        sink)
    assert sink.done.wait(10)
    assert sink.tokens == free[:free.index(free[2]) + 1]
    assert sink.events[-1].finish_reason == "stop"


def test_cancel_reaches_cancel_request(adapter: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_TRTLLM_ITER_DELAY_MS", "20")
    calls: list[int] = []
    real = type(adapter._ex).cancel_request
    monkeypatch.setattr(type(adapter._ex), "cancel_request",
                        lambda self, id, /: (calls.append(id), real(self, id))[1])
    sink = _Sink()
    adapter.add_request("long", [3, 4], SamplingParams(max_tokens=200, ignore_eos=True,
                                                      temperature=0.0), sink)
    trt_id = adapter._by_request["long"]
    while len(sink.tokens) < 3:
        time.sleep(0.01)
    adapter.cancel("long")
    assert sink.done.wait(10)
    assert calls == [trt_id]
    assert sink.events[-1].finish_reason == "cancelled" and len(sink.tokens) < 200
    assert adapter.num_unfinished() == 0
    adapter.cancel("long")  # already finished: nothing to cancel, no error
    assert calls == [trt_id]


def test_engine_error_response_becomes_an_error_event(adapter: Any) -> None:
    sink = _Sink()
    too_long = list(range(1, 300))  # max_input_len is 255
    adapter.add_request("bad", too_long, SamplingParams(max_tokens=1), sink)
    assert sink.done.wait(10)
    ev = sink.events[-1]
    assert ev.finish_reason == "error" and ev.token_ids == [] and "exceeds" in (ev.error or "")


def test_statistics_come_from_iteration_stats(adapter: Any,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_TRTLLM_ITER_DELAY_MS", "20")
    sink = _Sink()
    adapter.add_request("s", list(range(1, 40)), SamplingParams(max_tokens=100, ignore_eos=True,
                                                               temperature=0.0), sink)
    deadline = time.monotonic() + 10
    while adapter.stats().running == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    st = adapter.stats()
    assert st.running == 1 and st.kv_blocks_total == 1024 // 16 and st.kv_blocks_used >= 3
    assert 0 < st.kv_usage < 1 and st.steps_total >= 1
    assert st.extra["kv_tokens_per_block"] == 16.0
    adapter.cancel("s")
    assert sink.done.wait(10)
    deadline = time.monotonic() + 5
    while adapter.stats().running and time.monotonic() < deadline:
        time.sleep(0.02)
    st = adapter.stats()
    assert st.running == 0 and st.prompt_tokens_total == 39 and st.generation_tokens_total >= 1


def test_refused_enqueue_is_a_value_error(trtllm_fake: ModuleType, engine_tp1: Path) -> None:
    from runtime.executors.trtllm import TrtllmExecutor
    from runtime.executors.trtllm_setup import construct_executor, kv_cache_config

    a = TrtllmExecutor(construct_executor(engine_tp1, kv_cache_config(None, None)))
    a.shutdown()
    with pytest.raises(ValueError, match="shutting down"):
        a.add_request("x", [1], SamplingParams(), _Sink())


def test_shutdown_ends_running_requests_promptly(trtllm_fake: ModuleType, engine_tp1: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The leader's Executor.shutdown() blocks until every queued and active request has
    finished: shutdown() must cancel them first (and a queued one ends only once admitted),
    deliver their final events, then drop the Executor."""
    from runtime.executors.trtllm import TrtllmExecutor
    from runtime.executors.trtllm_setup import construct_executor, kv_cache_config

    monkeypatch.setenv("FAKE_TRTLLM_ITER_DELAY_MS", "20")
    ex = construct_executor(engine_tp1, kv_cache_config(None, 1024))
    a = TrtllmExecutor(ex, eos_token_ids=(EOS,), pad_id=EOS)
    sinks = [_Sink() for _ in range(6)]  # max_batch_size is 4: two wait in the queue
    for i, sink in enumerate(sinks):
        a.add_request(f"long{i}", [3, 4], SamplingParams(max_tokens=250, ignore_eos=True,
                                                         temperature=0.0), sink)
    while len(sinks[0].tokens) < 3:
        time.sleep(0.01)
    t0 = time.monotonic()
    assert a.shutdown() is True
    took = time.monotonic() - t0
    assert took < 4, f"shutdown took {took:.1f} s: it waited for 250-token requests to finish"
    assert all(s.done.is_set() for s in sinks)
    assert {s.events[-1].finish_reason for s in sinks} == {"cancelled"}
    assert a.num_unfinished() == 0 and a._ex is None  # the Executor can be destroyed now
    a.cancel("long0")  # after shutdown: nothing to do, no error


def test_min_tokens_holds_back_every_eos_id_not_only_end_id(trtllm_fake: ModuleType,
                                                            engine_tp1: Path) -> None:
    """TensorRT-LLM's min_tokens masks the Request's end_id alone; a model's other eos ids
    (Llama 3's <|eot_id|>), sent as stop words, must not end the request before min_tokens
    either, as our own sampler masks every stop id."""
    from runtime.executors.trtllm import TrtllmExecutor
    from runtime.executors.trtllm_setup import construct_executor, kv_cache_config

    toy, prompt = _toy(engine_tp1), [5, 17, 33, 2]
    plain, _ = toy.generate(prompt, 8, end_id=EOS)
    other = plain[1]  # the second token the model would give is the other eos id
    assert EOS not in plain[:2] and plain[0] != other
    first, _ = toy.generate(prompt, 5, end_id=EOS, bad_words=[[other]], min_tokens=5)
    rest, _ = toy.generate(prompt + first, 3, end_id=EOS, stop_words=[[other]])
    a = TrtllmExecutor(construct_executor(engine_tp1, kv_cache_config(None, 1024)),
                       eos_token_ids=(EOS, other), pad_id=EOS)
    try:
        sink = _Sink()
        a.add_request("m", prompt, SamplingParams(max_tokens=8, temperature=0.0, min_tokens=5),
                      sink)
        assert sink.done.wait(10)
    finally:
        a.shutdown()
    assert other not in sink.tokens[:5] and sink.tokens == first + rest
    assert sink.events[-1].finish_reason in ("stop", "length") and a.num_unfinished() == 0
