"""Gates 1-9 for a TensorRT-LLM engine (DESIGN §4), beside serve/startup.py's torch gates.

The gate machinery (`Startup.gate`: run on every rank, agree the outcome over our control
plane) is inherited; the bodies differ. TensorRT-LLM's Executor reads the engine itself and
sizes its own KV cache, so: `load` reads and hashes the rank's plan (TensorRT-LLM re-reads it
from the page cache), `allocate` settles the KvCacheConfig, and `kernels` constructs the
Executor on every rank (collective, LEADER mode), timed.
"""

from __future__ import annotations

import json
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from pipeline.compile.trtllm import INSTALL, TRTLLM_CONFIG, gpu_sm, load_model_config
from pipeline.errors import BuildError
from pipeline.manifest import Manifest, hash_file, read_manifest
from serve import floors
from serve.executors.trtllm import TrtllmExecutor, construct_executor, kv_cache_config
from serve.gates import GateFailure
from serve.startup import Startup
from serve.types import SamplingParams
from serve.warmup import decode_batch_sizes

WARMUP_DECODE_TOKENS = 4


def rebuild_command(m: Manifest, tp: int | None = None, sm: str | None = None) -> str:
    p = m.profile
    return (f"pipeline build {m.source.uri} --backend trtllm --tp {tp or m.tp} --dtype {m.dtype} "
            f"--target {sm or m.target.sm} --max-batch-size {p.max_batch_size} "
            f"--max-num-tokens {p.max_num_tokens} --max-seq-len {p.max_seq_len} "
            f"--tokens-per-block {p.tokens_per_block}")


@dataclass
class TrtllmStartup(Startup):
    engine_config: dict[str, Any] = field(default_factory=dict)  # TensorRT-LLM's config.json
    eos_token_ids: tuple[int, ...] = ()  # rank 0 sets them from the tokenizer before kernels
    pad_id: int = 0
    kv: Any = None  # the KvCacheConfig every rank constructs the Executor with
    executor: Any = None  # tensorrt_llm.bindings.executor.Executor, every rank
    adapter: TrtllmExecutor | None = None  # rank 0 only
    digest: str = ""  # sha256 of this rank's plan, computed while loading it

    # ---- 1 resolve ---------------------------------------------------------------------

    def resolve(self, ev: dict[str, Any]) -> None:
        engine = self.cfg.engine
        try:
            m = read_manifest(engine)
        except BuildError as e:
            raise GateFailure("resolve", e.cause, e.remedy) from None
        if m.backend != "trtllm":
            raise GateFailure("resolve", f"backend {m.backend!r} is not a TensorRT-LLM engine",
                              "serve it through the torch gates (serve/startup.py)")
        try:
            self.engine_config = json.loads((engine / TRTLLM_CONFIG).read_text())
            self.model = load_model_config(engine)
            mapping = self.engine_config["pretrained_config"]["mapping"]
            version = self.engine_config["version"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise GateFailure("resolve", f"the engine's {TRTLLM_CONFIG} or model_config.json is "
                              f"unreadable ({type(e).__name__}: {e})",
                              f"rebuild it: {rebuild_command(m)}") from None
        if mapping.get("tp_size") != m.tp:
            raise GateFailure("resolve", f"{TRTLLM_CONFIG} says tp_size="
                              f"{mapping.get('tp_size')} but the manifest says TP={m.tp}",
                              f"rebuild it: {rebuild_command(m)}")
        self.manifest = m
        ev.update(engine_id=m.engine_id, model=m.model_name, backend=m.backend, tp=m.tp,
                  dtype=m.dtype, schema=m.schema_version, trtllm_config_version=version)

    # ---- 2 compatible ------------------------------------------------------------------

    def compatible(self, ev: dict[str, Any]) -> None:
        """World size, TensorRT-LLM, TensorRT, GPU SM: every mismatch named, one line."""
        m = self.manifest
        assert m is not None
        problems: list[str] = []
        run = f"mpirun -n {m.tp} serve launch --engine {self.cfg.engine}"
        if self.comm.size != m.tp:
            raise GateFailure(
                "compatible",
                f"the engine was built for TP={m.tp} but mpirun started {self.comm.size} rank(s)",
                f"run: {run}, or rebuild for {self.comm.size} rank(s): "
                f"{rebuild_command(m, tp=self.comm.size)}",
            )
        try:
            import tensorrt
            import tensorrt_llm
        except ImportError as e:
            raise GateFailure("compatible", f"this is a TensorRT-LLM engine but TensorRT-LLM is "
                              f"not installed here ({e})", INSTALL) from None
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
        ev.update(world=self.comm.size, target=str(m.target), **have,
                  gpu=sm or "not queryable here (torch sees no CUDA device); TensorRT checks the "
                  "plan's SM when the Executor deserializes it (kernels gate)")

    # ---- 3 reserve ---------------------------------------------------------------------

    def reserve(self, ev: dict[str, Any]) -> None:
        m = self.manifest
        assert m is not None
        plan = (self.cfg.engine / f"rank{self.rank}.engine").stat().st_size
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

    # ---- 4 load, 5 verify --------------------------------------------------------------

    def load(self, ev: dict[str, Any]) -> None:
        path = self.cfg.engine / f"rank{self.rank}.engine"
        floor, mode = floors.storage_read_gbps(path)
        t0 = time.perf_counter()
        self.digest = hash_file(path)  # the one read: into the page cache, hashed on the way
        secs = time.perf_counter() - t0
        size = path.stat().st_size
        gbps = size / secs / 1e9 if secs else 0.0
        ev.update(rank=self.rank, file=path.name, bytes=size, read_s=round(secs, 4),
                  gbps=round(gbps, 3), floors={"storage_read_gbps": round(floor, 3),
                                               "storage_mode": mode},
                  note="TensorRT-LLM deserializes it from the page cache in the kernels gate")

    def verify(self, ev: dict[str, Any]) -> None:
        m = self.manifest
        assert m is not None
        expected = {f.path: f.sha256 for f in m.rank_files(self.rank)}
        mine = f"rank{self.rank}.engine"
        bad = [mine] if expected.get(mine) != self.digest else []
        checked = [mine]
        for rel in (TRTLLM_CONFIG, "model_config.json"):
            checked.append(rel)
            if rel not in expected or hash_file(self.cfg.engine / rel) != expected[rel]:
                bad.append(rel)
        ev.update(files=checked, sha256=self.digest[:16], hashed_while_loading=True)
        if bad:
            raise GateFailure(
                "verify", f"{', '.join(bad)} does not match the manifest's sha256 (corrupted or "
                "modified)", f"restore or rebuild the engine; `pipeline verify {self.cfg.engine}` "
                "lists every bad file")

    # ---- 6 connect ---------------------------------------------------------------------

    def connect(self, ev: dict[str, Any]) -> None:
        m = self.manifest
        assert m is not None
        mine = {"rank": self.rank, "engine_id": m.engine_id, "host": socket.gethostname(),
                "load": self.log.get("load").evidence}
        everyone = self.comm.allgather(mine)
        ids = {e["engine_id"] for e in everyone}
        if len(ids) > 1 or [e["rank"] for e in everyone] != list(range(self.comm.size)):
            raise GateFailure("connect", f"ranks disagree on the engine: {sorted(ids)}",
                              "give every rank the same --engine")
        self.rank_loads = [e["load"] for e in everyone]
        ev.update(world=self.comm.size, hosts=sorted({e["host"] for e in everyone}),
                  collectives="TensorRT-LLM's own (MPI + NCCL), set up in the kernels gate")

    # ---- 7 allocate --------------------------------------------------------------------

    def allocate(self, ev: dict[str, Any]) -> None:
        m = self.manifest
        assert m is not None
        tokens, frac = self.cfg.kv_cache_tokens, self.cfg.kv_cache_fraction
        if tokens is not None and tokens < m.profile.max_seq_len:
            raise GateFailure("allocate", f"--kv-cache-tokens {tokens} cannot hold one "
                              f"{m.profile.max_seq_len}-token sequence",
                              f"give --kv-cache-tokens of at least {m.profile.max_seq_len}")
        self.kv = kv_cache_config(frac, tokens)
        ev.update(free_gpu_memory_fraction=frac, max_tokens=tokens,
                  sized_by="--kv-cache-tokens" if tokens is not None else
                  f"--kv-cache-fraction {frac}" if frac is not None else
                  "TensorRT-LLM's default (0.9 of the memory free after the engine)",
                  allocated_by="the Executor's constructor (kernels gate)")

    # ---- 8 kernels ---------------------------------------------------------------------

    def kernels(self, ev: dict[str, Any]) -> None:
        m = self.manifest
        assert m is not None
        t0 = time.perf_counter()
        try:
            self.executor = construct_executor(self.cfg.engine, self.kv)
        except Exception as e:  # TensorRT(-LLM) says why on stderr; the exception is terse
            raise GateFailure(
                "kernels", f"TensorRT-LLM could not construct the Executor for rank "
                f"{self.rank}: {' '.join(str(e).split())}",
                f"the engine was built for {m.target.sm} with TensorRT "
                f"{m.toolchain.get('tensorrt')} and TensorRT-LLM "
                f"{m.toolchain.get('tensorrt_llm')}; if this host differs, rebuild it here: "
                f"{rebuild_command(m)}") from None
        secs = time.perf_counter() - t0
        leader = bool(self.executor.can_enqueue_requests())
        ranks = self.comm.allgather({"rank": self.rank, "leader": leader,
                                     "seconds": round(secs, 3)})
        if [r["leader"] for r in ranks] != [r == 0 for r in range(self.comm.size)]:
            raise GateFailure("kernels", f"expected rank 0 alone to be the leader, got {ranks}",
                              "check the MPI launch (one process per engine rank, rank 0 first)")
        if self.rank == 0:
            self.adapter = TrtllmExecutor(self.executor, eos_token_ids=self.eos_token_ids,
                                          pad_id=self.pad_id)
        ev.update(kind="TensorRT-LLM Executor (LEADER mode)", construct_s=round(secs, 3),
                  ranks=ranks)

    # ---- 9 warmup (rank 0 drives; the others' executors follow the leader) --------------

    def warmup(self, ev: dict[str, Any]) -> None:
        m, adapter, cfg = self.manifest, self.adapter, self.model
        if self.rank != 0:
            ev["driven_by"] = "rank 0"
            return
        assert m is not None and adapter is not None and cfg is not None
        p, vocab = m.profile, cfg.vocab_size
        prompt = [(7 * i + 11) % vocab for i in range(p.max_seq_len)]
        if self.cfg.warmup == "auto":
            # Largest first: a full-budget prefill, then decode batches max, ..., 2, 1.
            shapes: list[dict[str, Any]] = []
            n = max(1, min(p.max_num_tokens, p.max_seq_len - 1 - WARMUP_DECODE_TOKENS))
            for batch, length in [(1, n), *((b, 8) for b in decode_batch_sizes(p.max_batch_size))]:
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
        self._golden(ev)
        st = adapter.stats()
        tpb = int(st.extra.get("kv_tokens_per_block", p.tokens_per_block))
        kv_tokens = st.kv_blocks_total * tpb
        self.log.get("allocate").evidence.update(blocks=st.kv_blocks_total, tokens=kv_tokens)
        if st.kv_blocks_total and kv_tokens < p.max_seq_len:
            raise GateFailure("warmup", f"the KV cache TensorRT-LLM allocated holds {kv_tokens} "
                              f"tokens, less than one {p.max_seq_len}-token sequence",
                              "raise --kv-cache-fraction or --kv-cache-tokens, or free GPU memory")

    def _golden(self, ev: dict[str, Any]) -> None:
        m, adapter = self.manifest, self.adapter
        assert m is not None and adapter is not None
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
