"""Gates 1-9 of a torch engine's worker (rank-local work plus cross-rank agreement).

Every gate runs on every rank; after each, the ranks exchange their outcome, so one rank's
failure stops all of them with the same message, and nobody waits on a dead peer.
"""

from __future__ import annotations

import json
import math
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pipeline.convert import load_engine_model_config
from pipeline.errors import BuildError
from pipeline.golden import GOLDEN_STEPS, check_golden, run_golden
from pipeline.manifest import Manifest, hash_file, read_manifest
from pipeline.models.config import ModelConfig
from pipeline.models.factory import kv_bytes_per_block, torch_dtype
from pipeline.models.parallel import TPContext
from pipeline.target import host_matches
from serve import floors
from serve.comm import Comm
from serve.executors.torch import allocate_kv_cache, make_step_fn
from serve.gates import GateFailure, GateLog
from serve.launch import CPU_KV_FRACTION, GPU_KV_FRACTION, LaunchConfig
from serve.loader import LoadedShard, load_shard
from serve.plan import StepPlan
from serve.runner import ModelRunner
from serve.warmup import PHASE_DONE, follow, warmup_shapes

REBUILD = "rebuild the engine on this host with `pipeline build`"


@dataclass
class Startup:
    cfg: LaunchConfig
    comm: Comm
    log: GateLog
    interrupted: Callable[[], bool] = lambda: False
    manifest: Manifest | None = None
    model: ModelConfig | None = None
    device: str = "cpu"
    shard: LoadedShard | None = None
    runner: ModelRunner | None = None
    num_blocks: int = 0
    rank_loads: list[dict[str, Any]] = field(default_factory=list)

    @property
    def rank(self) -> int:
        return self.comm.rank

    def gate(self, name: str, body: Callable[[dict[str, Any]], None]) -> None:
        err: GateFailure | None = None
        if self.interrupted():
            err = GateFailure(name, "shutdown requested before admission", "nothing to do")
        else:
            try:
                with self.log.run(name) as evidence:
                    body(evidence)
            except GateFailure as e:
                err = e
        try:
            outcomes = self.comm.allgather(None if err is None else (err.cause, err.remedy))
        except (ConnectionError, OSError) as e:
            raise GateFailure(name, f"a peer rank is gone ({e})", "see the other ranks' messages") from e
        if err is not None:
            raise err
        for r, out in enumerate(outcomes):
            if out is not None:
                raise GateFailure(name, f"rank {r}: {out[0]}", out[1])

    # ---- 1 resolve ---------------------------------------------------------------------

    def resolve(self, ev: dict[str, Any]) -> None:
        try:
            m = read_manifest(self.cfg.engine)
        except BuildError as e:
            raise GateFailure("resolve", e.cause, e.remedy) from None
        if m.backend not in ("aoti", "eager"):
            raise GateFailure("resolve", f"backend {m.backend!r} is not a torch engine", "use --backend aoti or eager")
        self.manifest, self.model = m, load_engine_model_config(self.cfg.engine)
        ev.update(engine_id=m.engine_id, model=m.model_name, backend=m.backend, tp=m.tp,
                  dtype=m.dtype, schema=m.schema_version)

    # ---- 2 compatible ------------------------------------------------------------------

    def compatible(self, ev: dict[str, Any]) -> None:
        m = self.manifest
        assert m is not None
        if self.comm.size != m.tp:
            raise GateFailure(
                "compatible",
                f"the engine was built for TP={m.tp} but mpirun started {self.comm.size} rank(s)",
                f"run: mpirun -n {m.tp} serve launch --engine {self.cfg.engine}",
            )
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
        if m.target.device == "cuda":
            self.device = f"cuda:{self.comm.local_rank % max(1, torch.cuda.device_count())}"
            torch.cuda.set_device(self.device)
        ev.update(target=str(m.target), host=why, world=self.comm.size, torch=torch.__version__)

    # ---- 3 reserve ---------------------------------------------------------------------

    def _min_kv_blocks(self) -> int:
        m = self.manifest
        assert m is not None
        return math.ceil(m.profile.max_seq_len / m.profile.tokens_per_block) + 1  # + null block

    def reserve(self, ev: dict[str, Any]) -> None:
        m, cfg = self.manifest, self.model
        assert m is not None and cfg is not None
        weights = sum(f.size for f in m.rank_files(self.rank))
        kv_min = self._min_kv_blocks() * kv_bytes_per_block(
            cfg, m.tp, m.profile.tokens_per_block, torch_dtype(m.dtype))
        free = torch.cuda.mem_get_info()[0] if self.device.startswith("cuda") else floors.host_available_bytes()
        ev.update(weights_bytes=weights, kv_min_bytes=kv_min, free_bytes=free)
        if free < weights + kv_min:
            raise GateFailure(
                "reserve",
                f"{free / 2**30:.2f} GiB free, but weights ({weights / 2**30:.2f} GiB) plus one "
                f"{m.profile.max_seq_len}-token sequence of KV cache ({kv_min / 2**30:.2f} GiB) need "
                f"{(weights + kv_min) / 2**30:.2f} GiB",
                "free memory, or rebuild with a smaller --max-seq-len or more --tp",
            )

    # ---- 4 load, 5 verify --------------------------------------------------------------

    def load(self, ev: dict[str, Any]) -> None:
        path = self.cfg.engine / f"rank{self.rank}.safetensors"
        read_gbps, mode = floors.storage_read_gbps(path)
        fl: dict[str, Any] = {"storage_read_gbps": round(read_gbps, 3), "storage_mode": mode,
                              "host_copy_gbps": round(floors.host_copy_gbps(), 3)}
        if self.device.startswith("cuda"):
            fl["h2d_gbps"] = round(floors.h2d_gbps(self.device), 3)
        self.shard = shard = load_shard(path, self.device)
        ev.update(rank=self.rank, bytes=shard.nbytes, read_s=round(shard.read_s, 4),
                  gbps=round(shard.read_gbps, 3), h2d_s=round(shard.h2d_s, 4), floors=fl,
                  vs_storage_floor=round(shard.read_gbps / read_gbps, 3) if read_gbps else None,
                  vs_host_copy_floor=round(shard.read_gbps / fl["host_copy_gbps"], 3))

    def verify(self, ev: dict[str, Any]) -> None:
        m, shard = self.manifest, self.shard
        assert m is not None and shard is not None
        expected = {f.path: f.sha256 for f in m.rank_files(self.rank)}
        name = shard.path.name
        checked = [name]
        bad = [name] if expected.get(name) != shard.sha256 else []
        # The small files this rank reads through other loaders (kernels, config).
        for rel, digest in expected.items():
            if rel == name or not (rel.startswith(f"rank{self.rank}.") or rel == "config.json"):
                continue
            checked.append(rel)
            if hash_file(self.cfg.engine / rel) != digest:
                bad.append(rel)
        ev.update(files=checked, sha256=shard.sha256[:16], hashed_while_loading=True)
        if bad:
            raise GateFailure(
                "verify", f"{', '.join(bad)} does not match the manifest's sha256 (corrupted or modified)",
                f"restore or rebuild the engine; `pipeline verify {self.cfg.engine}` lists every bad file",
            )

    # ---- 6 connect ---------------------------------------------------------------------

    def connect(self, ev: dict[str, Any]) -> None:
        m = self.manifest
        assert m is not None
        backend = "nccl" if self.device.startswith("cuda") else "gloo"
        self.comm.init_process_group(backend)
        mine = {"rank": self.rank, "engine_id": m.engine_id, "host": socket.gethostname(),
                "load": self.log.get("load").evidence}
        everyone = self.comm.allgather(mine)
        ids = {e["engine_id"] for e in everyone}
        if len(ids) > 1 or [e["rank"] for e in everyone] != list(range(self.comm.size)):
            raise GateFailure("connect", f"ranks disagree on the engine: {sorted(ids)}", "give every rank the same --engine")
        self.rank_loads = [e["load"] for e in everyone]
        ev.update(backend=backend if self.comm.size > 1 else "none (TP=1)", world=self.comm.size,
                  hosts=sorted({e["host"] for e in everyone}))

    # ---- 7 allocate --------------------------------------------------------------------

    def allocate(self, ev: dict[str, Any]) -> None:
        m, cfg = self.manifest, self.model
        assert m is not None and cfg is not None
        p = m.profile
        per_block = kv_bytes_per_block(cfg, m.tp, p.tokens_per_block, torch_dtype(m.dtype))
        useful = math.ceil(p.max_batch_size * p.max_seq_len / p.tokens_per_block) + 1
        if self.cfg.kv_cache_tokens is not None:
            blocks, source = math.ceil(self.cfg.kv_cache_tokens / p.tokens_per_block) + 1, "--kv-cache-tokens"
        else:
            on_gpu = self.device.startswith("cuda")
            frac = self.cfg.kv_cache_fraction or (GPU_KV_FRACTION if on_gpu else CPU_KV_FRACTION)
            free = torch.cuda.mem_get_info()[0] if on_gpu else floors.host_available_bytes()
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
        self.num_blocks = blocks
        self.kv = allocate_kv_cache(cfg, m.tp, blocks, p.tokens_per_block, m.dtype, self.device)
        ev.update(blocks=blocks - 1, tokens=(blocks - 1) * p.tokens_per_block,
                  bytes=blocks * per_block, sized_by=source)

    # ---- 8 kernels ---------------------------------------------------------------------

    def kernels(self, ev: dict[str, Any]) -> None:
        m, cfg, shard = self.manifest, self.model, self.shard
        assert m is not None and cfg is not None and shard is not None
        tp = TPContext(self.rank, self.comm.size)
        step_fn = make_step_fn(m.backend, cfg, tp, m.dtype, shard.weights, self.cfg.engine, self.device)
        self.runner = ModelRunner(step_fn, self.kv, m.profile.tokens_per_block)
        self.runner.keepalive = shard
        pkg = self.cfg.engine / f"rank{self.rank}.pt2"
        ev.update(kind="AOTInductor package, weights bound" if m.backend == "aoti" else "eager modules",
                  package_bytes=pkg.stat().st_size if pkg.exists() else 0)

    # ---- 9 warmup (rank 0 drives, the others execute) ---------------------------------

    def warmup(self, ev: dict[str, Any]) -> None:
        m, runner = self.manifest, self.runner
        assert m is not None and runner is not None
        if self.rank != 0:
            follow(runner, self.comm)
            ev["driven_by"] = "rank 0"
            return
        send = self.comm.send_plan
        if self.cfg.warmup == "auto":
            t0 = time.perf_counter()
            ev["shapes"] = warmup_shapes(runner, m.profile, self.num_blocks, send)
            ev["shapes_s"] = round(time.perf_counter() - t0, 3)
        else:
            ev["shapes"] = "skipped (--warmup none)"
        record = m.golden
        _, tops = run_golden(runner, record["prompt_token_ids"], len(record["tokens"]),
                             forced=record["tokens"], send=send)
        send(StepPlan(PHASE_DONE))
        ok, evidence = check_golden(record, tops, m.dtype)
        ev["golden"] = evidence
        if not ok:
            raise GateFailure(
                "warmup", f"the golden prompt no longer gives the built engine's logits ({evidence})",
                f"run `pipeline verify {self.cfg.engine}` and rebuild the engine",
            )


def engine_summary(m: Manifest) -> dict[str, Any]:
    return {"engine_id": m.engine_id, "model": m.model_name, "backend": m.backend,
            "target": m.target.to_dict(), "tp": m.tp, "dtype": m.dtype,
            "profile": m.profile.to_dict(), "source": {"uri": m.source.uri, "revision": m.source.revision},
            "toolchain": m.toolchain, "bytes": m.total_size, "golden_steps": GOLDEN_STEPS}


def read_generation_eos(engine: Path) -> tuple[int, ...]:
    try:
        eos = json.loads((engine / "generation_config.json").read_text()).get("eos_token_id")
    except (OSError, json.JSONDecodeError):
        return ()
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)
