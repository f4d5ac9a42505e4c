"""TensorRT-LLM engines (docs/design.md §4): the same gates, TensorRT-LLM's Executor underneath.

TensorRT-LLM's Executor reads the engine itself and sizes its own KV cache, so: `load`
reads and hashes the rank's plan (TensorRT-LLM re-reads it from the page cache),
`allocate` settles the KvCacheConfig, and `kernels` constructs the Executor on every rank
(collective, LEADER mode), timed. Rank 0 serves through the TrtllmExecutor adapter; the
other ranks block in the Executor's shutdown() (their executor threads follow the leader)
until rank 0 shuts down.

MPI: the supervisor process bootstrapped our control plane over MPI before starting this
worker; TensorRT-LLM then initializes MPI again in this process, as the same rank. Open MPI
then needs this process to finalize before the supervisor does (else its finalize hangs),
so a clean exit finalizes here, while the supervisor is alive to finalize after us. Before
it does, the Executor and everything holding it are released and collected: with TP > 1 the
Executor owns split communicators that its destructor frees with MPI_Comm_free, unchecked,
and Open MPI aborts a process that calls MPI after MPI_Finalize.

The compatible gate never lets one rank import tensorrt_llm alone: the import is an MPI
collective (`_utils.py`), so the ranks first agree over our control plane that every one of
them can import it. It then compares the MPI world TensorRT-LLM sees with ours: an mpirun
that does not belong to TensorRT-LLM's libmpi starts every rank as a world of its own.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from contract.layout import MODEL_CONFIG_TRTLLM, TRTLLM_CONFIG, rank_trt_engine
from contract.manifest import Manifest, hash_file
from runtime.core.plan import StepPlan
from runtime.core.types import SamplingParams
from runtime.dist.mpi import mpi_library_version
from runtime.executors.trtllm import TrtllmExecutor
from runtime.executors.trtllm_setup import (
    INSTALL,
    construct_executor,
    guided_decoding_config,
    kv_cache_config,
    load_model_config,
    trtllm_missing,
)
from runtime.host import gpu_sm
from runtime.store import floors
from serve.backends.base import Backend, EngineFault, Serving
from serve.backends.trtllm_mpi import check_mpi_world, finalize_mpi, watch_leader
from serve.gates import HOST_FACTS, Evidence, GateChain, GateFailure, shutdown_requested
from serve.stages import GateContext, Resolved
from serve.warmup import decode_batch_sizes

log = logging.getLogger("serve")
WARMUP_DECODE_TOKENS = 4
KV_STATS_WAIT_S = 2.0  # iteration statistics reach the adapter on its next poll


def rebuild_command(m: Manifest, tp: int | None = None, sm: str | None = None) -> str:
    p = m.profile
    return (f"pipeline build {m.source.uri} --backend trtllm --tp {tp or m.tp} --dtype {m.dtype} "
            f"--target {sm or m.target.sm} --max-batch-size {p.max_batch_size} "
            f"--max-num-tokens {p.max_num_tokens} --max-seq-len {p.max_seq_len} "
            f"--tokens-per-block {p.tokens_per_block}")


@dataclass(frozen=True, slots=True)
class Constructed:
    """The kernels gate's result: the Executor every rank constructed, and on rank 0 (the
    leader) the adapter the HTTP layer submits to."""

    executor: Any  # tensorrt_llm.bindings.executor.Executor
    adapter: TrtllmExecutor | None  # rank 0 only


class TrtllmBackend(Backend):
    def __init__(self, ctx: GateContext, resolved: Resolved, ev: Evidence) -> None:
        super().__init__(ctx, resolved)
        m = self.manifest
        _ = self.engine_dir  # TensorRT-LLM reads a directory: not an engine still in a store
        try:
            engine_config = json.loads(self.files.get(TRTLLM_CONFIG).read_text())
            self.model = load_model_config(self.files.get(MODEL_CONFIG_TRTLLM).parent)
            mapping = engine_config["pretrained_config"]["mapping"]
            version = engine_config["version"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise GateFailure("resolve", f"the engine's {TRTLLM_CONFIG} or {MODEL_CONFIG_TRTLLM} is "
                              f"unreadable ({type(e).__name__}: {e})",
                              f"rebuild it: {rebuild_command(m)}") from None
        if mapping.get("tp_size") != m.tp:
            raise GateFailure("resolve", f"{TRTLLM_CONFIG} says tp_size="
                              f"{mapping.get('tp_size')} but the manifest says TP={m.tp}",
                              f"rebuild it: {rebuild_command(m)}")
        ev.update(trtllm_config_version=version)

    def gates(self) -> GateChain[Serving]:
        chain: GateChain[None] = GateChain()
        return (chain.then("compatible", self.compatible)
                .then("reserve", self.reserve)
                .then("load", self.load)
                .then("verify", self.verify)
                .then("connect", self.connect)
                .then("allocate", self.allocate)
                .then("kernels", self.kernels)
                .then("warmup", self.warmup))

    # ---- 2 compatible ------------------------------------------------------------------

    def compatible(self, _: None, ev: Evidence) -> None:
        """World size, TensorRT-LLM on every rank, the MPI world TensorRT-LLM sees, versions,
        GPU SM: every mismatch named, one line."""
        m = self.manifest
        problems: list[str] = []
        run = f"mpirun -n {m.tp} serve launch --engine {self.cfg.engine}"
        self.check_world(f"run: {run}, or rebuild for {self.comm.size} rank(s): "
                         f"{rebuild_command(m, tp=self.comm.size)}")
        # Importing tensorrt_llm is an MPI collective: agree first that every rank can.
        missing = self.comm.allgather(trtllm_missing())
        if missing[self.rank] is not None:
            raise GateFailure("compatible", f"this is a TensorRT-LLM engine but TensorRT-LLM is "
                              f"not installed here ({missing[self.rank]})", INSTALL)
        others = [r for r, why in enumerate(missing) if why is not None]
        if others:
            raise GateFailure("compatible", f"TensorRT-LLM is not installed on rank(s) "
                              f"{', '.join(f'{r} ({self.comm.host_label(r)})' for r in others)} "
                              f"({missing[others[0]]}), so no rank "
                              "imports it (its import is an MPI collective every rank must join)",
                              f"install it on every host of the job: {INSTALL}")
        try:
            import tensorrt
            import tensorrt_llm
        except ImportError as e:
            raise GateFailure("compatible", f"this is a TensorRT-LLM engine but TensorRT-LLM "
                              f"cannot be imported here ({e})", INSTALL) from None
        check_mpi_world(self.rank, self.comm.size, self.cfg.mpirun, self.cfg.engine)
        have = {"tensorrt_llm": str(tensorrt_llm.__version__),
                "tensorrt": str(tensorrt.__version__)}
        for key, name in (("tensorrt_llm", "TensorRT-LLM"), ("tensorrt", "TensorRT")):
            if m.toolchain.get(key) != have[key]:
                problems.append(f"the engine was built by {name} {m.toolchain.get(key)} but this "
                                f"host has {name} {have[key]}")
        sm = gpu_sm()
        if sm is not None and sm != m.target.sm:
            problems.append(f"the engine was built for a {m.target.sm} GPU but this GPU is {sm}")
        if problems:
            raise GateFailure("compatible", "; ".join(problems) + " (TensorRT engines are tied "
                              "to the exact GPU SM, TensorRT and TensorRT-LLM)",
                              f"rebuild the engine on this host: {rebuild_command(m, sm=sm)}")
        self.check_files_present(ev)
        ev[HOST_FACTS].update(gpu=sm or "unknown", **have)
        ev.update(world=self.comm.size, target=str(m.target), **have,
                  mpi=mpi_library_version() or "unknown",
                  gpu=sm or "not queryable here (torch sees no CUDA device); TensorRT checks the "
                  "plan's SM when the Executor deserializes it (kernels gate)")

    # ---- 3 reserve ---------------------------------------------------------------------

    def reserve(self, _: None, ev: Evidence) -> None:
        plan = (self.engine_dir / rank_trt_engine(self.rank)).stat().st_size
        ev.update(engine_bytes=plan)
        if not torch.cuda.is_available():
            ev["free_bytes"] = "not measurable here (torch sees no CUDA device)"
            return
        free = torch.cuda.mem_get_info(self.comm.local_rank % torch.cuda.device_count())[0]
        ev["free_bytes"] = free
        if free < plan:
            raise GateFailure("reserve", f"{free / 2**30:.2f} GiB free on the GPU, but the engine "
                              f"alone is {plan / 2**30:.2f} GiB",
                              "free GPU memory, or rebuild with more --tp")

    # ---- 4 load (5 verify: the base class) ----------------------------------------------

    def load(self, _: None, ev: Evidence) -> None:
        # TensorRT-LLM reads the engine directory itself (kernels gate): the plan it reads is
        # the one hashed here, unless the read-only engine file is replaced in between.
        self.files.require(rank_trt_engine(self.rank))
        path = self.engine_dir / rank_trt_engine(self.rank)
        floor, mode = floors.storage_read_gbps(path)
        t0 = time.perf_counter()
        # The one read: into the page cache, hashed on the way.
        self.loaded = {path.name: hash_file(path)}
        secs = time.perf_counter() - t0
        size = path.stat().st_size
        gbps = size / secs / 1e9 if secs else 0.0
        ev.update(rank=self.rank, file=path.name, bytes=size, read_s=round(secs, 4),
                  gbps=round(gbps, 3), floors={"storage_read_gbps": round(floor, 3),
                                               "storage_mode": mode},
                  note="TensorRT-LLM deserializes it from the page cache in the kernels gate")


    def init_collectives(self) -> str:
        return "TensorRT-LLM's own (MPI + NCCL), set up in the kernels gate"

    # ---- 7 allocate --------------------------------------------------------------------

    def allocate(self, _: None, ev: Evidence) -> Any:
        """Returns the KvCacheConfig every rank constructs the Executor with."""
        m = self.manifest
        tokens, frac = self.cfg.kv_cache_tokens, self.cfg.kv_cache_fraction
        if tokens is not None and tokens < m.profile.max_seq_len:
            raise GateFailure("allocate", f"--kv-cache-tokens {tokens} cannot hold one "
                              f"{m.profile.max_seq_len}-token sequence",
                              f"give --kv-cache-tokens of at least {m.profile.max_seq_len}")
        kv = kv_cache_config(frac, tokens)
        ev.update(free_gpu_memory_fraction=frac, max_tokens=tokens,
                  sized_by="--kv-cache-tokens" if tokens is not None else
                  f"--kv-cache-fraction {frac}" if frac is not None else
                  "TensorRT-LLM's default (0.9 of the memory free after the engine)",
                  allocated_by="the Executor's constructor (kernels gate)")
        return kv

    # ---- 8 kernels ---------------------------------------------------------------------

    def kernels(self, kv: Any, ev: Evidence) -> Constructed:
        m = self.manifest
        # Structured output: xgrammar's tokenizer information, on every rank alike.
        guided, guided_off = guided_decoding_config(self.engine_dir)
        t0 = time.perf_counter()
        try:
            executor = construct_executor(self.engine_dir, kv, guided)
        except Exception as e:  # TensorRT(-LLM) says why on stderr; the exception is terse
            raise GateFailure(
                "kernels", f"TensorRT-LLM could not construct the Executor for rank "
                f"{self.rank}: {' '.join(str(e).split())}",
                f"the engine was built for {m.target.sm} with TensorRT "
                f"{m.toolchain.get('tensorrt')} and TensorRT-LLM "
                f"{m.toolchain.get('tensorrt_llm')}; if this host differs, rebuild it here: "
                f"{rebuild_command(m)}") from None
        secs = time.perf_counter() - t0
        leader = bool(executor.can_enqueue_requests())
        ranks = self.comm.allgather({"rank": self.rank, "leader": leader,
                                     "seconds": round(secs, 3)})
        if [r["leader"] for r in ranks] != [r == 0 for r in range(self.comm.size)]:
            raise GateFailure("kernels", f"expected rank 0 alone to be the leader, got {ranks}",
                              "check the MPI launch (one process per engine rank, rank 0 first)")
        stop = self.ctx.stop  # rank 0's, decided in gate 1 (serve/rank0.py)
        adapter = TrtllmExecutor(executor, eos_token_ids=stop.eos_token_ids, pad_id=stop.pad_id,
                                 guided_unavailable=guided_off) if self.rank == 0 else None
        ev.update(kind="TensorRT-LLM Executor (LEADER mode)", construct_s=round(secs, 3),
                  ranks=ranks, guided_decoding="xgrammar" if guided_off is None
                  else f"off: {guided_off}")
        return Constructed(executor, adapter)

    # ---- 9 warmup (rank 0 drives; the others' executors follow the leader) --------------

    def warmup(self, built: Constructed, ev: Evidence) -> TrtllmServing:
        serving = TrtllmServing(self.ctx, built)
        if self.rank != 0:
            ev["driven_by"] = "rank 0"
            return serving
        m, adapter = self.manifest, serving.leader
        p, vocab = m.profile, self.model.vocab_size
        prompt = [(7 * i + 11) % vocab for i in range(p.max_seq_len)]
        self._check_kv_cache(adapter, ev, prompt[:1])
        if self.cfg.warmup == "auto":
            # Largest first: a full-budget prefill, then decode batches max, ..., 2, 1.
            shapes: list[dict[str, Any]] = []
            n = max(1, min(p.max_num_tokens, p.max_seq_len - 1 - WARMUP_DECODE_TOKENS))
            for batch, length in [(1, n), *((b, 8) for b in decode_batch_sizes(p.max_batch_size))]:
                if self.ctx.interrupted():  # a stop signal waits for one shape, not all
                    raise shutdown_requested("warmup")
                sp = SamplingParams(max_tokens=WARMUP_DECODE_TOKENS, temperature=0.0,
                                    ignore_eos=True)
                t0 = time.perf_counter()
                try:
                    adapter.generate([prompt[i: i + length] for i in range(batch)], [sp] * batch)
                except (RuntimeError, TimeoutError, ValueError) as e:
                    raise GateFailure(
                        "warmup", f"{batch} request(s) of {length} prompt tokens failed: {e}",
                        "see the worker log; free GPU memory, or rebuild with a smaller "
                        "--max-batch-size / --max-num-tokens") from None
                shapes.append({"batch": batch, "prompt_tokens": length,
                               "ms": round((time.perf_counter() - t0) * 1e3, 1)})
            ev["shapes"] = shapes
        else:
            ev["shapes"] = "skipped (--warmup none)"
        self._golden(adapter, ev)
        return serving

    def _check_kv_cache(self, adapter: TrtllmExecutor, ev: Evidence, prompt: list[int]) -> None:
        """One token through the Executor, then the KV cache it allocated (from its iteration
        statistics) must hold one max_seq_len sequence. TensorRT-LLM does not refuse a smaller
        cache: it shrinks max_seq_len and max_input_len at construction, with a warning, and
        then rejects the longer prompts one by one."""
        p = self.manifest.profile
        try:
            adapter.generate([prompt], [SamplingParams(max_tokens=1, temperature=0.0,
                                                       ignore_eos=True)])
        except (RuntimeError, TimeoutError, ValueError) as e:
            raise GateFailure("warmup", f"a one-token request failed: {e}",
                              "see the worker log") from None
        deadline = time.monotonic() + KV_STATS_WAIT_S
        st = adapter.stats()
        while not st.kv_blocks_total and time.monotonic() < deadline:
            time.sleep(0.01)
            st = adapter.stats()
        tpb = int(st.extra.get("kv_tokens_per_block", p.tokens_per_block))
        kv_tokens = st.kv_blocks_total * tpb
        self.ctx.log.amend("allocate", blocks=st.kv_blocks_total, tokens=kv_tokens)
        ev["kv_cache_tokens"] = kv_tokens or "not reported by TensorRT-LLM"
        if st.kv_blocks_total and kv_tokens < p.max_seq_len:
            raise GateFailure("warmup", f"the KV cache TensorRT-LLM allocated holds {kv_tokens} "
                              f"tokens, less than one {p.max_seq_len}-token sequence (it would "
                              f"serve at most {kv_tokens} tokens per sequence)",
                              "raise --kv-cache-fraction or --kv-cache-tokens, free GPU memory, "
                              "or rebuild with a smaller --max-seq-len")

    def _golden(self, adapter: TrtllmExecutor, ev: Evidence) -> None:
        m = self.manifest
        record = m.golden
        want = list(record.get("tokens", []))
        sp = SamplingParams(max_tokens=len(want), temperature=0.0, ignore_eos=True)
        try:
            [(got, _)] = adapter.generate([list(record["prompt_token_ids"])], [sp])
        except (RuntimeError, TimeoutError, ValueError, KeyError) as e:
            raise GateFailure("warmup", f"the golden prompt failed: {e}",
                              f"run `pipeline verify {self.cfg.engine}` and rebuild it") from None
        ev["golden"] = f"{len(got)} greedy tokens, {'identical' if got == want else 'DIFFERENT'}"
        if got != want:
            raise GateFailure(
                "warmup", f"the golden prompt gave {got}, the build recorded {want}",
                f"run `pipeline verify {self.cfg.engine}` and rebuild it: {rebuild_command(m)}")



class TrtllmServing(Serving):
    """The Executor the gates constructed: rank 0 serves through its adapter, the other
    ranks block in its shutdown() until rank 0 shuts down."""

    def __init__(self, ctx: GateContext, built: Constructed) -> None:
        self.comm, self.cfg = ctx.comm, ctx.cfg
        self.executor: Any = built.executor  # held here alone from now on (see release)
        self.adapter = built.adapter
        self._supervisor = os.getppid()

    @property
    def leader(self) -> TrtllmExecutor:
        if self.adapter is None:
            raise RuntimeError("only rank 0 (the leader) submits requests")
        return self.adapter

    def open(self, ev: Evidence) -> TrtllmExecutor:
        ev["executor"] = "TensorRT-LLM"
        if self.cfg.speculative not in (None, "off"):
            log.warning("--speculative is not applied: TensorRT-LLM engines configure their own")
            ev["speculative"] = "not applied (TensorRT-LLM)"
        if self.cfg.max_prefill_tokens_while_decoding:
            log.warning("--max-prefill-tokens-while-decoding is not applied: TensorRT-LLM's "
                        "Executor schedules its own chunks (the engine's max_num_tokens)")
            ev["max_prefill_tokens_while_decoding"] = "not applied (TensorRT-LLM schedules)"
        if self.cfg.max_prefill_tokens_while_waiting:
            log.warning("--max-prefill-tokens-while-waiting is not applied: TensorRT-LLM's "
                        "Executor schedules its own chunks (the engine's max_num_tokens)")
            ev["max_prefill_tokens_while_waiting"] = "not applied (TensorRT-LLM schedules)"
        return self.leader

    def poll(self, timeout: float) -> None:
        if self.leader.error is not None:  # the job cannot serve without its Executor
            raise EngineFault(self.leader.error)
        time.sleep(timeout)  # the adapter's own thread drives the Executor

    def close(self) -> int:
        left = self.leader.cancel_all()
        # Tell the other ranks this is an orderly end before their shutdown() returns.
        self.comm.send_plan(StepPlan(step_id=-1, shutdown=True))
        # Cancels what is still queued or running and waits for it: the leader's
        # Executor.shutdown() blocks until no request is left.
        if self.leader.shutdown():  # the Executor itself is dropped by release()
            log.info("Executor shut down (rank 0, the leader); the other ranks are released")
        else:
            log.error("Executor.shutdown() did not return; the other ranks may wait for it")
        return left

    def follow(self, exit_now: Callable[[int], None]) -> int:
        orderly = threading.Event()
        threading.Thread(target=watch_leader, args=(self.comm, orderly, exit_now),
                         name="leader-watch",
                         daemon=True).start()
        log.info("Executor constructed (not the leader); blocking in Executor.shutdown() until "
                 "rank 0 shuts down")
        self.executor.shutdown()  # the Executor itself is dropped by release()
        log.info("Executor.shutdown() returned; exiting")
        return 0

    def release(self) -> bool:
        """Drop every reference to the Executor and collect, so that its destructor (which
        frees its MPI communicators) runs now, while MPI is up. False when an Executor is
        still alive afterwards (something outside this backend holds it).

        The Executor is a nanobind class without weak references (`nb::class_<Executor>` in
        cpp/tensorrt_llm/nanobind/executor/executor.cpp), so it is held here, and only here,
        until this drops it: its reference count then says whether the drop destroys it."""
        if self.adapter is not None:
            self.adapter.shutdown(cancel_wait_s=0.0)  # done by close(): drops its reference
        ex, self.executor = self.executor, None
        if ex is None:
            return True
        others = _other_references(ex)
        if others:  # held by a reference cycle (a frame, a closure): collect it
            gc.collect()
            others = _other_references(ex)
        if others:
            log.error("the TensorRT-LLM Executor is still referenced (%d other reference(s)) "
                      "before MPI_Finalize; its destructor would free MPI communicators after "
                      "it", others)
        del ex  # the last reference when others == 0: the Executor is destroyed here
        return not others

    def finalize(self) -> None:
        self.release()
        finalize_mpi(self._supervisor)


def _other_references(obj: object) -> int:
    """References to `obj` beyond the caller's one local: its count less that of an object
    held the same way (the baseline differs between Python versions)."""
    probe = object()
    return sys.getrefcount(obj) - sys.getrefcount(probe) - 1
