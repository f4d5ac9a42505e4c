"""tensorrt_llm.bindings.executor.Executor in LEADER mode (reference §2.1, §2.2).

Every rank constructs it (collectively); rank 0, the leader, runs the execution thread and
is the only one allowed to enqueue, await, cancel or read stats. Other ranks call
shutdown(), which blocks until the leader's shutdown() sends them a terminate message.

The leader's shutdown() blocks too: it queues a terminate request and keeps stepping until
every queued and active request has finished (executorImpl.cpp). After shutdown() every
leader-only call fails with "Shutdown called". With more than one rank, every rank owns
split communicators that its destructor frees (see _fake/mpi.py: freed after MPI_Finalize,
the process aborts).
"""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..._fake import env, mpi
from ._config import ExecutorConfig
from ._enums import BatchingType, CommunicationMode, ModelType
from ._guided import GuidedDecoder
from ._load import ERR, LoadedEngine, kv_cache_blocks, load_engine
from ._loop import Loop
from ._request import Request
from ._responses import AWAIT_OVERLOADS, await_responses, enqueue, resolve_await
from ._stats import IterationStats, RequestStatsPerIteration

STATIC_BATCHING = (
    "Static batching type is deprecated. Please use in-flight batching with "
    "CapacitySchedulerPolicy::kSTATIC_BATCH instead."
)
LEADER_ONLY = "With LEADER communication mode, only leader rank is expected to call {}"
SHUTDOWN_CALLED = ERR + "Assertion failed: Shutdown called"
KV_TOO_SMALL = (
    "maxAttentionWindow and maxSequenceLen are too large for at least one sequence to fit in "
    "kvCache. they are reduced to {}"
)


class Executor:
    # A nanobind class: no __weakref__ slot, so weakref.ref(executor) raises TypeError (as
    # nanobind's classes do unless bound with nb::is_weak_referenceable(), which
    # cpp/tensorrt_llm/nanobind/executor/executor.cpp does not pass for Executor).
    __slots__ = ("_comms", "_leader", "_loop", "_next_id", "_shut", "_world")

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        model_type: ModelType,
        executor_config: ExecutorConfig,
    ) -> None:
        if isinstance(model_path, (bytes, bytearray)):
            raise NotImplementedError("the fake implements only the model_path overload")
        if not isinstance(model_path, (str, os.PathLike)):
            raise TypeError(f"Executor(): model_path must be str or a path, got {model_path!r}")
        if not isinstance(model_type, ModelType):
            raise TypeError(f"Executor(): model_type must be a ModelType, got {model_type!r}")
        if not isinstance(executor_config, ExecutorConfig):
            raise TypeError("Executor(): executor_config must be an ExecutorConfig")
        if model_type is not ModelType.DECODER_ONLY:
            raise NotImplementedError("the TensorRT-LLM fake serves DECODER_ONLY engines only")
        if executor_config.batching_type is BatchingType.STATIC:
            raise RuntimeError(STATIC_BATCHING)
        _check_parallel(executor_config)
        self._world = mpi.world()
        self._leader = 0  # the first participant
        self._shut = False
        self._loop: Loop | None = None
        self._comms: list[mpi.OwnedComm] = []  # freed when this object is destroyed
        self._next_id = 1  # request ids start at 1
        loaded, error = self._try_load(Path(model_path), executor_config)
        # Construction is collective: all ranks agree on what they loaded, or all fail.
        mine = (
            str(Path(model_path).resolve()),
            model_type.name,
            _fingerprint(executor_config),
            error,
        )
        views = mpi.agree(self._world, mine, env.collective_timeout_s())
        errors = [v[-1] for v in views if v[-1] is not None]
        if errors:
            raise RuntimeError(
                error or f"Executor construction failed on another rank: {errors[0]}"
            )
        if len({v[:3] for v in views}) != 1:
            raise RuntimeError(
                f"fake TensorRT-LLM: ranks constructed the Executor with different "
                f"arguments: {[v[:3] for v in views]}"
            )
        assert loaded is not None
        self._comms = mpi.split_owned(self._world)
        if self._world.rank == self._leader:
            self._loop = self._start(*loaded, executor_config)

    def _try_load(
        self, model_path: Path, cfg: ExecutorConfig
    ) -> tuple[tuple[LoadedEngine, int, GuidedDecoder | None] | None, str | None]:
        try:
            eng = load_engine(model_path, self._world.rank, self._world.size)
            # TrtGptModelInflightBatching makes its GuidedDecoder on the last PP rank (every
            # rank here: PP = 1) when the config has one; LLGUIDANCE is refused there.
            gdc = cfg.guided_decoding_config
            guided = None if gdc is None else GuidedDecoder(gdc, eng.toy.vocab_size)
            return (eng, kv_cache_blocks(eng, cfg.kv_cache_config), guided), None
        except RuntimeError as e:
            return None, str(e)

    @staticmethod
    def _start(eng: LoadedEngine, blocks: int, guided: GuidedDecoder | None,
               cfg: ExecutorConfig) -> Loop:
        # The executor keeps its own copy: later changes to the caller's config do nothing.
        cfg = copy.copy(cfg)
        cfg.scheduler_config = copy.copy(cfg.scheduler_config)
        cfg.kv_cache_config = copy.copy(cfg.kv_cache_config)
        b = eng.build
        if cfg.enable_chunked_context and not b["plugin_config"]["use_paged_context_fmha"]:
            env.log(
                "WARNING",
                "Chunked context is not supported without paged context FMHA; "
                "disabling it (rebuild with --use_paged_context_fmha enable)",
            )
            cfg.enable_chunked_context = False
        limits = {}
        for name in ("max_batch_size", "max_num_tokens"):
            asked = getattr(cfg, name)
            limits[name] = b[name] if asked is None else min(asked, b[name])
            if asked is not None and asked > b[name]:
                env.log(
                    "WARNING",
                    f"{name} ({asked}) is larger than the engine's ({b[name]}); using {b[name]}",
                )
        if blocks < 1:
            raise RuntimeError(ERR + "Assertion failed: the KV cache has no blocks (free GPU "
                               "memory, or raise free_gpu_memory_fraction / max_tokens)")
        # A cache too small for one max_seq_len sequence shrinks the attention window and
        # max_seq_len (trtGptModelInflightBatching.cpp), it does not fail requests later.
        max_seq_len, max_input_len = b["max_seq_len"], b["max_input_len"]
        fits = blocks * eng.build["plugin_config"]["tokens_per_block"]
        if fits < max_seq_len:
            max_seq_len = fits
            env.log("WARNING", KV_TOO_SMALL.format(max_seq_len))
            if max_input_len > max_seq_len - 1:
                max_input_len = max_seq_len - 1
                env.log("WARNING", f"maxInputLen is reduced to {max_input_len}")
        return Loop(eng, cfg, limits["max_batch_size"], limits["max_num_tokens"], blocks,
                    max_seq_len, max_input_len, guided)

    # -- leader-only API ---------------------------------------------------------------
    def _leader_loop(self, method: str) -> Loop:
        if self._world.rank != self._leader:
            raise RuntimeError(LEADER_ONLY.format(method))
        if self._shut or self._loop is None:
            raise RuntimeError(SHUTDOWN_CALLED + (", cannot enqueue requests"
                                                  if method == "enqueueRequests" else ""))
        return self._loop

    def enqueue_request(self, request: Request, /) -> int:
        return self.enqueue_requests([request])[0]

    def enqueue_requests(self, requests: list[Request], /) -> list[int]:
        loop = self._leader_loop("enqueueRequests")
        if not isinstance(requests, list):
            raise TypeError(f"enqueue_requests(): expected a list of Request, got {requests!r}")
        with loop.cond:
            ids = enqueue(loop, requests, self._next_id)
            self._next_id += len(requests)
        return ids

    def await_responses(self, *args: Any, **kwargs: Any) -> list[Any]:
        target, timeout = resolve_await(args, kwargs)
        return await_responses(self._leader_loop("awaitResponses"), target, timeout)

    await_responses._overloads = AWAIT_OVERLOADS  # type: ignore[attr-defined]

    def get_num_responses_ready(self, id: int | None = None) -> int:
        loop = self._leader_loop("getNumResponsesReady")
        with loop.cond:
            return sum(1 for r in loop.ready if id is None or r.request_id == id)

    def cancel_request(self, id: int, /) -> None:
        loop = self._leader_loop("cancelRequest")
        with loop.cond:
            # Applied to the active batch each iteration: a queued request is cancelled only
            # once it has been admitted.
            if any(seq.id == id for seq in loop.queued + loop.active):
                loop.cancelled.add(id)
            loop.cond.notify_all()

    def get_latest_iteration_stats(self) -> list[IterationStats]:
        return _drain(self._leader_loop("getLatestIterationStats"), "iter_stats")

    def get_latest_request_stats(self) -> list[RequestStatsPerIteration]:
        return _drain(self._leader_loop("getLatestRequestStats"), "req_stats")

    def get_latest_debug_tensors(self) -> list[Any]:
        self._leader_loop("getLatestDebugTensors")
        return []

    def get_kv_cache_event_manager(self) -> None:
        if self._loop is not None and self._loop.cfg.kv_cache_config.event_buffer_max_size > 0:
            raise NotImplementedError("the TensorRT-LLM fake has no KV cache event manager")
        return None

    # -- every rank --------------------------------------------------------------------
    def can_enqueue_requests(self) -> bool:
        return self._world.rank == self._leader and not self._shut

    def shutdown(self) -> None:
        if self._shut:
            return
        self._shut = True
        if self._loop is not None:
            self._loop.terminate()  # blocks until queued and active requests have finished
            mpi.send_terminate(self._world, self._leader)
        else:
            mpi.wait_terminate(self._world, self._leader)  # blocks until the leader shuts down

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    @contextlib.contextmanager
    def _fake_hold(self) -> Iterator[None]:
        """Fake-only test hook: no iteration runs inside the block (deterministic queues)."""
        loop = self._leader_loop("_fake_hold")
        with loop.cond:
            loop.hold += 1
        try:
            yield
        finally:
            with loop.cond:
                loop.hold -= 1
                loop.cond.notify_all()


def _fingerprint(cfg: ExecutorConfig) -> str:
    """The settings every rank must agree on (opaque callback configs excluded)."""
    return repr(
        (
            cfg.max_beam_width,
            cfg.scheduler_config,
            cfg.kv_cache_config,
            cfg.enable_chunked_context,
            cfg.batching_type,
            cfg.max_batch_size,
            cfg.max_num_tokens,
            cfg.max_queue_size,
            cfg.guided_decoding_config is not None,
        )
    )


def _check_parallel(cfg: ExecutorConfig) -> None:
    pc = cfg.parallel_config
    if pc is None:
        return
    if pc.communication_mode is CommunicationMode.ORCHESTRATOR:
        raise NotImplementedError("the TensorRT-LLM fake implements LEADER mode only")
    if pc.participant_ids is not None:
        raise NotImplementedError("the TensorRT-LLM fake does not implement participant_ids")


def _drain(loop: Loop, attr: str) -> list[Any]:
    with loop.cond:
        buf = getattr(loop, attr)
        out = list(buf)
        buf.clear()
        return out
