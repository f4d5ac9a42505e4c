"""aoti and eager engines: our loader, KV cache, compiled step function and engine loop."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from contract.layout import DECODE_PROGRAM, ENGINE_CONFIG, KERNELS_LIB, rank_shard
from contract.manifest import Manifest
from contract.speculative import Speculative
from runtime import kernels
from runtime.core.plan import StepPlan
from runtime.core.scheduler import SchedulerConfig
from runtime.core.thread_policy import ThreadPolicy
from runtime.env import INJECT_FAULT_AT_STEP, THREADS
from runtime.executors.draft import (
    DraftEngineDrafter,
    DraftEngineError,
    check_draft,
    load_draft,
    open_draft,
    vocab_hashes,
)
from runtime.executors.golden import check_golden, replay_golden
from runtime.executors.loop import LLMEngine, worker_loop
from runtime.executors.runner import ModelRunner
from runtime.executors.torch import (
    SplitStep,
    allocate_kv_cache,
    engine_runner,
    package_files,
    package_name,
)
from runtime.host import host_matches
from runtime.models.config import ModelConfig
from runtime.models.factory import kv_bytes_per_block, torch_dtype
from runtime.models.parallel import WORLD_GROUP_NAME, TPContext
from runtime.quant import runs_here
from runtime.runqueue import RunQueueClock
from runtime.store import floors
from runtime.store.checkpoint import load_engine_model_config, load_engine_quant
from runtime.store.loader import LoadedShard
from runtime.store.source import StoreSource
from serve.backends.base import Backend, EngineFault, Serving
from serve.cpu_quota import cpu_quota
from serve.gates import HOST_FACTS, Evidence, GateChain, GateFailure, shutdown_requested
from serve.launch import (
    CPU_KV_FRACTION,
    CPU_PREFILL_WHILE_DECODING,
    CPU_PREFILL_WHILE_WAITING,
    GPU_KV_FRACTION,
)
from serve.stages import GateContext, Resolved
from serve.warmup import PHASE_DONE, Interrupted, follow, warm_prefill, warmup_shapes

log = logging.getLogger("serve")
REBUILD = "rebuild the engine on this host with `pipeline build`"
# Fault injection for fault tests and soak runs: the engine loop raises at this step.
FAULT_ENV = INJECT_FAULT_AT_STEP.name


@dataclass(frozen=True, slots=True)
class KvCache:
    """The allocate gate's result: the rank's shard (from load) and its KV cache."""

    shard: LoadedShard
    kv: torch.Tensor
    num_blocks: int  # the null block included
    draft_blocks: int = 0  # the draft engine's KV blocks (rank 0, speculative draft:ENGINE)

    def __post_init__(self) -> None:
        if self.num_blocks < 2:
            raise ValueError(f"a KV cache needs the null block and one more, got {self.num_blocks}")


@dataclass(frozen=True, slots=True)
class Built:
    """The kernels gate's result: the runner over the shard's weights and the KV cache."""

    runner: ModelRunner
    num_blocks: int
    drafter: DraftEngineDrafter | None = None  # rank 0, speculative draft:ENGINE


class TorchBackend(Backend):
    def __init__(self, ctx: GateContext, resolved: Resolved, ev: Evidence) -> None:
        super().__init__(ctx, resolved)
        self.device = "cpu"  # compatible picks the GPU of a CUDA engine
        src = self.files.get(ENGINE_CONFIG).parent
        self.model = load_engine_model_config(src)
        if load_engine_quant(src) != self.manifest.quant:
            raise GateFailure("resolve", f"{ENGINE_CONFIG} and the manifest disagree on the "
                              "engine's quantization", REBUILD)
        # The engine's drafter unless --speculative says otherwise (parsed at launch).
        cfg = ctx.cfg
        self.spec = (self.manifest.speculative if cfg.speculative is None
                     else Speculative.parse(cfg.speculative))
        # speculative draft:ENGINE, on rank 0: its directory, manifest and model (compatible)
        self.draft: tuple[Path, Manifest, ModelConfig] | None = None

    def gates(self) -> GateChain[Serving]:
        chain: GateChain[None] = GateChain()
        return (chain.then("compatible", self.compatible)
                .then("reserve", self.reserve)
                .then("load", self.load)
                .then("verify", self.verify_shard)
                .then("connect", self.connect_shard)
                .then("allocate", self.allocate)
                .then("kernels", self.kernels)
                .then("warmup", self.warmup))

    # ---- 2 compatible, 3 reserve ------------------------------------------------------

    def compatible(self, _: None, ev: Evidence) -> None:
        m = self.manifest
        self.check_world()
        ok, why = host_matches(m.target.to_dict())
        if not ok:
            raise GateFailure("compatible", why, REBUILD)
        built_torch = m.toolchain.get("torch")
        if m.backend == "aoti" and built_torch != torch.__version__:
            raise GateFailure(
                "compatible",
                f"the engine's kernels were compiled by torch {built_torch}, this host runs {torch.__version__}",
                REBUILD,
            )
        ok, quant = runs_here(m.quant, m.backend, m.target.device, self.files.listed(KERNELS_LIB),
                              m.weight_layout)
        if not ok:
            raise GateFailure("compatible", quant, REBUILD)
        if m.target.device == "cuda":
            self.device = f"cuda:{self.comm.local_rank % max(1, torch.cuda.device_count())}"
            torch.cuda.set_device(self.device)
        self.check_files_present(ev)
        if self.spec is not None and self.spec.method == "draft" and self.rank == 0:
            ev["draft"] = self._check_draft()
        ev.update(target=str(m.target), host=why, world=self.comm.size, torch=torch.__version__,
                  quant=quant)
        ev[HOST_FACTS].update(isa=why, torch=torch.__version__)

    def _check_draft(self) -> dict[str, Any]:
        """speculative draft:ENGINE: the draft engine can draft for this one here (TP=1, a
        torch backend, this host, the same vocabulary and tokenizer files, K in its step)."""
        assert self.spec is not None
        m = self.manifest
        try:
            path, dm, dcfg = open_draft(self.spec)
            check_draft(dm, dcfg, path, self.spec.num_tokens, device=m.target.device,
                        vocab_size=self.model.vocab_size, vocab=vocab_hashes(m))
        except DraftEngineError as e:
            raise GateFailure("compatible", e.cause,
                              f"{e.remedy}, or serve with --speculative off|ngram") from None
        self.draft = (path, dm, dcfg)
        return {"engine": str(path), "engine_id": dm.engine_id, "backend": dm.backend,
                "dtype": dm.dtype, "quant": dm.quant.describe()}

    def _draft_token_bytes(self) -> float:
        """KV bytes the draft engine holds per token (0 without one)."""
        if self.draft is None:
            return 0.0
        _, dm, dcfg = self.draft
        dbs = dm.profile.tokens_per_block
        return kv_bytes_per_block(dcfg, 1, dbs, torch_dtype(dm.dtype)) / dbs

    def _min_kv_blocks(self) -> int:
        p = self.manifest.profile
        return math.ceil(p.max_seq_len / p.tokens_per_block) + 1  # + null block

    def _free_bytes(self) -> int:
        if self.device.startswith("cuda"):
            return torch.cuda.mem_get_info()[0]
        return floors.host_available_bytes()

    def _block_bytes(self) -> int:
        m = self.manifest
        return kv_bytes_per_block(self.model, m.tp, m.profile.tokens_per_block, torch_dtype(m.dtype))

    def reserve(self, _: None, ev: Evidence) -> None:
        m = self.manifest
        weights = sum(f.size for f in m.rank_files(self.rank))
        kv_min = self._min_kv_blocks() * self._block_bytes()
        if self.draft is not None:  # rank 0 holds the draft engine too
            weights += sum(f.size for f in self.draft[1].rank_files(0))
            kv_min += int(self._draft_token_bytes() * m.profile.max_seq_len)
        free = self._free_bytes()
        ev.update(weights_bytes=weights, kv_min_bytes=kv_min, free_bytes=free)
        if free < weights + kv_min:
            raise GateFailure(
                "reserve",
                f"{free / 2**30:.2f} GiB free, but weights ({weights / 2**30:.2f} GiB) plus one "
                f"{m.profile.max_seq_len}-token sequence of KV cache ({kv_min / 2**30:.2f} GiB) need "
                f"{(weights + kv_min) / 2**30:.2f} GiB",
                "free memory, or rebuild with a smaller --max-seq-len or more --tp",
            )

    # ---- 4 load, 5 verify (base), 6 connect -------------------------------------------

    def load(self, _: None, ev: Evidence) -> LoadedShard:
        name = rank_shard(self.rank)
        entry = self.files.require(name)
        try:
            fl = self._floors(name, entry.size)
            shard, how = self.source.load_shard(name, self.device)
        except OSError as e:  # the engine directory changed under us (removed, unmounted)
            raise GateFailure("load", f"cannot read {name} ({e.strerror or e})",
                              f"restore or rebuild the engine in {self.source.where}") from None
        self.loaded = {name: shard.sha256}
        floor_key = "store_read_gbps" if how["from"] == "store" else "storage_read_gbps"
        floor = fl.get(floor_key) or 0.0
        ev.update(rank=self.rank, bytes=shard.nbytes, read_s=round(shard.read_s, 4),
                  gbps=round(shard.read_gbps, 3), h2d_s=round(shard.h2d_s, 4), floors=fl, **how,
                  vs_floor=round(shard.read_gbps / floor, 3) if floor else None,
                  floor=floor_key,
                  vs_host_copy_floor=round(shard.read_gbps / fl["host_copy_gbps"], 3))
        return shard

    def _floors(self, name: str, size: int) -> dict[str, Any]:
        """The floors the load is measured against: the storage it reads (a local file, or
        the store's ranged GETs of its probe object) and the host memory copy."""
        fl: dict[str, Any] = {}
        src, entry = self.source, self.files.require(name)
        if isinstance(src, StoreSource):
            path = src.cache.lookup(src.ref.model, src.engine_id, entry) if src.cache else None
            if path is None:
                gbps, what = floors.store_read_gbps(src.store, src.key(name), size)
                fl.update(store_read_gbps=round(gbps, 3), store_probe=what)
        else:
            path = src.shard_path(name)
        if path is not None:
            read_gbps, mode = floors.storage_read_gbps(path)
            fl.update(storage_read_gbps=round(read_gbps, 3), storage_mode=mode)
        fl["host_copy_gbps"] = round(floors.host_copy_gbps(), 3)
        if self.device.startswith("cuda"):
            fl["h2d_gbps"] = round(floors.h2d_gbps(self.device), 3)
        return fl

    def verify_shard(self, shard: LoadedShard, ev: Evidence) -> LoadedShard:
        self.verify(shard, ev)
        self.source.keep(rank_shard(self.rank), shard)  # verified: may be cached
        return shard

    def small_files(self) -> tuple[str, ...]:
        if self.manifest.backend == "aoti":  # native code: loaded from the verified copy
            listed = (KERNELS_LIB,) if self.files.listed(KERNELS_LIB) else ()
            return (*package_files(self.files.entries, self.rank), *listed)
        return ()

    def connect_shard(self, shard: LoadedShard, ev: Evidence) -> LoadedShard:
        self.connect(shard, ev)  # an all-gather: every rank has verified (and cached) its files
        if self.rank == 0:
            ev.update(self.source.finish())
        return shard

    def init_collectives(self) -> str:
        backend = "nccl" if self.device.startswith("cuda") else "gloo"
        self.comm.init_process_group(backend)
        if self.comm.size == 1 or not self.files.listed(KERNELS_LIB):
            return backend
        # The engine's compiled collectives (aotllm::*) take shared memory when every rank
        # is on this host; otherwise they go through the process group just made.
        kernels.load(self.files.get(KERNELS_LIB))
        m, cfg = self.manifest, self.model
        p = m.profile
        slot = kernels.slot_bytes_for(p.max_num_tokens, cfg.hidden_size, cfg.vocab_size, m.tp)
        return kernels.attach_shared_memory(self.comm, WORLD_GROUP_NAME, slot)

    # ---- 7 allocate, 8 kernels, 9 warmup ------------------------------------------------

    def allocate(self, shard: LoadedShard, ev: Evidence) -> KvCache:
        m, p = self.manifest, self.manifest.profile
        # Rank 0's blocks also pay for the draft's KV of the same tokens (+ K per sequence,
        # below): the draft never runs out before the engine does.
        per_block = self._block_bytes() + int(self._draft_token_bytes() * p.tokens_per_block)
        useful = math.ceil(p.max_batch_size * p.max_seq_len / p.tokens_per_block) + 1
        if self.cfg.kv_cache_tokens is not None:
            blocks = math.ceil(self.cfg.kv_cache_tokens / p.tokens_per_block) + 1
            source = "--kv-cache-tokens"
        else:
            on_gpu = self.device.startswith("cuda")
            frac = self.cfg.kv_cache_fraction or (GPU_KV_FRACTION if on_gpu else CPU_KV_FRACTION)
            free = self._free_bytes()
            blocks = min(int(frac * free) // per_block, useful)
            source = f"fraction {frac} of {free / 2**30:.1f} GiB free"
        blocks = min(self.comm.allgather(blocks))  # every rank must hold the same blocks
        need = self._min_kv_blocks()
        if blocks < need:
            raise GateFailure(
                "allocate",
                f"the KV cache holds {blocks - 1} blocks ({(blocks - 1) * p.tokens_per_block} tokens, "
                f"{blocks * per_block / 2**20:.1f} MiB) but one {p.max_seq_len}-token sequence needs "
                f"{need - 1} blocks ({need * per_block / 2**20:.1f} MiB)",
                "raise --kv-cache-fraction or --kv-cache-tokens, or free memory",
            )
        kv = allocate_kv_cache(self.model, m.tp, blocks, p.tokens_per_block, m.dtype, self.device)
        ev.update(blocks=blocks - 1, tokens=(blocks - 1) * p.tokens_per_block,
                  bytes=blocks * self._block_bytes(), sized_by=source)
        draft_blocks = 0
        if self.draft is not None and self.spec is not None:
            dm = self.draft[1]
            dbs = dm.profile.tokens_per_block
            tokens = (blocks - 1) * p.tokens_per_block + p.max_batch_size * self.spec.num_tokens
            draft_blocks = math.ceil(tokens / dbs) + 1
            ev["draft"] = {"blocks": draft_blocks - 1, "tokens": (draft_blocks - 1) * dbs,
                           "bytes": int(draft_blocks * dbs * self._draft_token_bytes())}
        return KvCache(shard, kv, blocks, draft_blocks)

    def kernels(self, cache: KvCache, ev: Evidence) -> Built:
        m = self.manifest
        tp = TPContext(self.rank, self.comm.size)
        # The package is the copy verified in gate 5, never the engine directory's file.
        runner = engine_runner(m.backend, self.model, tp, m.dtype, cache.shard, self.files.dir,
                               cache.kv, m.profile.tokens_per_block, m.profile.max_num_tokens,
                               self.device, m.quant)
        names = package_files(self.files.entries, self.rank) if m.backend == "aoti" else []
        ev.update(kind="AOTInductor package, weights bound" if m.backend == "aoti" else "eager modules",
                  package=package_name(names, self.rank) if names else None,
                  package_bytes=sum(self.files.entries[n].size for n in names))
        if isinstance(runner.step_fn, SplitStep):
            ev["decode_program"] = {"package": package_name(names, self.rank, DECODE_PROGRAM),
                                    "max_tokens": runner.step_fn.max_tokens}
        drafter = None
        if self.draft is not None and self.spec is not None:
            # The draft engine's shard is read and hashed as the engine's was (every file
            # against its manifest), its package loaded from the verified copy.
            t0 = time.perf_counter()
            path, dm, _ = self.draft
            drafter = load_draft(self.spec, path, dm, cache.draft_blocks, self.device)
            ev["draft"] = {"engine_id": dm.engine_id, "seconds": round(time.perf_counter() - t0, 3),
                           "bytes": sum(f.size for f in dm.rank_files(0)), "verified": True}
        return Built(runner, cache.num_blocks, drafter)

    def warmup(self, built: Built, ev: Evidence) -> TorchServing:
        """Rank 0 drives; the golden record is checked in two steps (a teacher-forced
        prefill, then one decode step at the profile's largest batch), so the decode path,
        the prefill path and the largest decode batch are all exercised once, and with a
        decode program beside the step program (contract/layout.py DECODE_PROGRAM) one
        prompt just too long for it runs the step program once. On a CPU that is the whole
        warmup: a compiled step has no per-shape state to build (no JIT, no graph capture;
        measured, the first run of a shape takes as long as the next of that program).
        On a GPU (or with --warmup full) the profile's shapes run first, largest first."""
        m, runner = self.manifest, built.runner
        serving = TorchServing(self, built)
        if self.rank != 0:
            follow(runner, self.comm)
            ev["driven_by"] = "rank 0"
            return serving
        send, p = self.comm.send_plan, m.profile
        sweep = self.cfg.warmup == "full" or (self.cfg.warmup == "auto" and
                                               self.device.startswith("cuda"))
        try:
            if sweep:
                t0 = time.perf_counter()
                ev["shapes"] = warmup_shapes(runner, p, built.num_blocks, send,
                                             self.ctx.interrupted)
                ev["shapes_s"] = round(time.perf_counter() - t0, 3)
            if self.ctx.interrupted():
                raise Interrupted
        except Interrupted:
            send(StepPlan(PHASE_DONE))  # the other ranks stop following, then hear why
            raise shutdown_requested("warmup") from None
        record = m.golden
        t0 = time.perf_counter()
        # --warmup none: the build's greedy steps, one a token (no batch beyond one row)
        tops, reference, ev["golden_steps"] = replay_golden(
            runner, record, p.max_num_tokens, p.max_batch_size, send,
            fast=self.cfg.warmup != "none")
        ev["golden_s"] = round(time.perf_counter() - t0, 3)
        if not sweep:
            ev["shapes"] = ("the golden steps (--warmup none)" if self.cfg.warmup == "none" else
                            "the golden steps: prefill, and decode at the largest batch")
            if self.cfg.warmup != "none" and isinstance(runner.step_fn, SplitStep):
                # The golden steps are few tokens each: the decode program ran them. The
                # step program's first run pays for what it touches first (measured: a
                # 64-token prompt 160 ms, then 52), which the first long prompt would.
                ev["step_program"] = warm_prefill(runner, p, built.num_blocks, send,
                                                  runner.step_fn.max_tokens + 1)
        send(StepPlan(PHASE_DONE))
        if built.drafter is not None:
            ev["draft"] = self._warm_draft(built.drafter, record["prompt_token_ids"])
        ok, evidence = check_golden(reference, tops, m.dtype, m.quant.scheme)
        ev["golden"] = evidence
        if not ok:
            raise GateFailure(
                "warmup", f"the golden prompt no longer gives the built engine's logits ({evidence})",
                f"{self.source.verify_hint}, and rebuild the engine",
            )
        return serving



    @staticmethod
    def _warm_draft(drafter: DraftEngineDrafter, prompt: list[int]) -> dict[str, Any]:
        """One draft of the golden prompt (its catch-up and K - 1 decodes), then forgotten:
        the draft's shapes run once before the first request, and its times are evidence."""
        t0 = time.perf_counter()
        drafter.prepare([(-1, prompt, drafter.num_tokens)])
        drafts = drafter.propose(prompt, None, -1)
        drafter.forget(-1)
        return {"tokens": len(drafts), "seconds": round(time.perf_counter() - t0, 3)}


class TorchServing(Serving):
    """The runner the gates built, and, from admission on, rank 0's engine loop over it."""

    def __init__(self, backend: TorchBackend, built: Built) -> None:
        self.ctx, self.manifest, self.device = backend.ctx, backend.manifest, backend.device
        self.runner, self.num_blocks = built.runner, built.num_blocks
        self.spec, self.drafter = backend.spec, built.drafter
        self._engine: LLMEngine | None = None

    @property
    def engine(self) -> LLMEngine:
        if self._engine is None:
            raise RuntimeError("the engine loop starts at admission (open)")
        return self._engine

    def open(self, ev: Evidence) -> LLMEngine:
        p, cfg = self.manifest.profile, self.ctx.cfg
        # A compiled step function returns at most max_num_tokens logits rows (the bound
        # pipeline/compile/aoti.py exports it with), which is the scheduler's default.
        on_gpu = self.device.startswith("cuda")
        cap = cfg.max_prefill_tokens_while_decoding
        if cap is None:
            cap = 0 if on_gpu else CPU_PREFILL_WHILE_DECODING
        wait_cap = cfg.max_prefill_tokens_while_waiting
        if wait_cap is None:
            wait_cap = 0 if on_gpu else CPU_PREFILL_WHILE_WAITING
        # The engine's drafter unless --speculative says otherwise (resolved in gate 1). A
        # verify row is a prompt chunk to the compiled step, so any engine runs any K (the
        # scheduler keeps drafts within the step's tokens and logits rows).
        spec = self.spec
        sc = SchedulerConfig(
            max_batch_size=p.max_batch_size, max_num_tokens=p.max_num_tokens,
            block_size=p.tokens_per_block, num_blocks=self.num_blocks,
            max_seq_len=p.max_seq_len, eos_token_ids=self.ctx.stop.eos_token_ids,
            enable_prefix_caching=True, max_prefill_tokens_while_decoding=cap or None,
            max_prefill_tokens_while_waiting=wait_cap or None, speculative=spec,
        )
        ev["max_prefill_tokens_while_decoding"] = cap or "no cap"
        ev["max_prefill_tokens_while_waiting"] = wait_cap or "no cap"
        # One rank on the CPU with a choice of threads: its steps choose how many
        # (runtime/core/thread_policy.py). Several ranks would have to choose together;
        # AOTLLM_THREADS is the user's own choice.
        tuned = (not on_gpu and torch.get_num_threads() > 1 and THREADS.raw() is None
                 and (self.ctx.comm is None or self.ctx.comm.size == 1))
        # Under a fractional quota the rounded-down share starts, and a probe tries the rest.
        quota = cpu_quota() if tuned else None
        threads = (ThreadPolicy(torch.get_num_threads(),
                                start=min(torch.get_num_threads(), quota.whole_threads(1))
                                if quota is not None else 0,
                                sees_waits=RunQueueClock().available) if tuned else None)
        ev["step_threads"] = (f"chosen per step, measured: at most {threads.most}, starting "
                              f"at {threads.current}" if threads is not None
                              else torch.get_num_threads())
        self._engine = LLMEngine(self.runner, sc, self.ctx.comm, self.drafter, threads)
        # The drafter and how K is chosen per sequence (runtime/core/spec_policy.py).
        policy = self._engine.scheduler.spec_policy
        ev["speculative"] = {
            "drafter": str(spec) if spec else "off",
            "from": "the engine's manifest" if cfg.speculative is None else "--speculative",
            **({"policy": policy.describe() if policy is not None else {"policy": "fixed K"}}
               if spec else {})}
        return self._engine

    def poll(self, timeout: float) -> None:
        engine = self.engine
        try:
            fault_at = INJECT_FAULT_AT_STEP.raw()
            if fault_at is not None and engine.stats().steps_total >= int(fault_at):
                raise RuntimeError(f"fault injected at step {fault_at} ({FAULT_ENV})")
            ran = engine.step()
        except Exception as e:  # out of memory, a kernel error, a bug: nothing more is served
            log.debug("the engine step failed", exc_info=True)
            why = f"the engine failed: {type(e).__name__}: {' '.join(str(e).split())}"
            engine.fail_all(why)
            raise EngineFault(why) from e
        if ran is None:
            engine.wait_for_work(timeout)

    def close(self) -> int:
        left = self.engine.num_unfinished()
        self.engine.abort_all()
        self.engine.shutdown_workers()
        return left

    def follow(self, exit_now: Callable[[int], None]) -> int:
        try:
            worker_loop(self.runner, self.ctx.comm)
        except (ConnectionError, OSError) as e:
            log.error("lost rank 0 (%s); exiting", e)
            return 1
        return 0
