"""Gates 1-9 on every rank: one sequence, whatever the engine's backend.

The manifest (gate 1) names the backend; from then on each gate's body is the backend's
(serve/backends/). Every gate runs on every rank; after each, the ranks exchange their
outcome, so one rank's failure stops all of them with the same message, and nobody waits
on a dead peer.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from contract.errors import BuildError
from contract.layout import GENERATION_CONFIG
from contract.manifest import Manifest, read_manifest
from runtime.comm import Comm
from runtime.engine_files import EngineFiles
from runtime.golden import GOLDEN_STEPS
from runtime.models.config import ModelConfig
from serve.backends import Backend, make_backend
from serve.gates import GateFailure, GateLog, shutdown_requested
from serve.launch import LaunchConfig

# Gate 10, admission, is rank 0's alone (serve/rank0.py).
GATES = ("resolve", "compatible", "reserve", "load", "verify", "connect", "allocate", "kernels",
         "warmup")
Evidence = dict[str, Any]
HOST_FACTS = "_host_facts"  # evidence a gate body shares with rank 0 (see Startup.gate)


@dataclass
class Startup:
    """What the gates learn, shared by the sequence and the backend that fills it in."""

    cfg: LaunchConfig
    comm: Comm
    log: GateLog
    interrupted: Callable[[], bool] = lambda: False
    manifest: Manifest | None = None
    model: ModelConfig | None = None
    backend: Backend | None = None
    files: EngineFiles | None = None  # verified private copies of what the gates read
    rank_loads: list[Evidence] = field(default_factory=list)  # every rank's load evidence
    # Rank 0 learns these from the tokenizer in gate 1; the backend reads them afterwards.
    eos_token_ids: tuple[int, ...] = ()
    pad_id: int = 0

    @property
    def rank(self) -> int:
        return self.comm.rank

    def gate(self, name: str, body: Callable[[Evidence], None]) -> None:
        """Run one gate here, then agree with every rank on its outcome. A body may leave
        facts about its host in evidence[HOST_FACTS]: rank 0 records every rank's, by host."""
        err: GateFailure | None = None
        facts: Any = None
        if self.interrupted():
            err = shutdown_requested(name)
        else:
            try:
                with self.log.run(name) as evidence:
                    body(evidence)
                    facts = evidence.pop(HOST_FACTS, None)
            except GateFailure as e:
                err = e
        try:
            outcomes = self.comm.allgather(
                [None if err is None else (err.cause, err.remedy), facts])
        except (ConnectionError, OSError) as e:
            self.comm.expect_end()
            raise GateFailure(name, f"a peer rank is gone: {e}",
                              "see the other ranks' messages") from e
        if err is not None:
            self.comm.expect_end()
            raise err
        for r, (out, _) in enumerate(outcomes):
            if out is not None:
                self.comm.expect_end()
                raise GateFailure(name, f"rank {r} on {self.comm.host_label(r)}: {out[0]}", out[1])
        if self.rank == 0 and any(f is not None for _, f in outcomes):
            self.log.amend(name, hosts=[{"rank": r, "host": self.comm.host_label(r), **(f or {})}
                                        for r, (_, f) in enumerate(outcomes)])
        # Every rank has every rank's facts: all of them refuse a job whose hosts run
        # different torch builds (the collectives and the numerics are torch's own).
        torch_on: dict[str, list[str]] = {}
        for r, (_, f) in enumerate(outcomes):
            if isinstance(f, dict) and "torch" in f:
                torch_on.setdefault(str(f["torch"]), []).append(
                    f"rank {r} on {self.comm.host_label(r)}")
        if len(torch_on) > 1:
            self.comm.expect_end()
            raise GateFailure(name, "the hosts run different torch versions: " + "; ".join(
                f"{v} on {', '.join(where)}" for v, where in torch_on.items()),
                "install the same torch on every host of the job")

    def run(self, on_resolved: Callable[[Evidence], None] | None = None,
            until: str = GATES[-1]) -> Backend:
        """Gates 1-9 (or up to `until`) in order; raises GateFailure naming the first that
        failed on any rank."""
        self.gate("resolve", lambda ev: self._resolve(ev, on_resolved))
        backend = self.backend
        assert backend is not None
        for name in GATES[1 : GATES.index(until) + 1]:
            self.gate(name, getattr(backend, name))
        return backend

    def _resolve(self, ev: Evidence, on_resolved: Callable[[Evidence], None] | None) -> None:
        try:
            m = read_manifest(self.cfg.engine)
        except BuildError as e:
            raise GateFailure("resolve", e.cause, e.remedy) from None
        self.manifest = m
        self.files = EngineFiles(self.cfg.engine, m)
        self.backend = make_backend(m.backend, self)
        self.backend.resolve(ev)
        ev.update(engine_id=m.engine_id, model=m.model_name, backend=m.backend, tp=m.tp,
                  dtype=m.dtype, schema=m.schema_version)
        if on_resolved is not None:
            on_resolved(ev)


def engine_summary(m: Manifest) -> dict[str, Any]:
    return {"engine_id": m.engine_id, "model": m.model_name, "backend": m.backend,
            "target": m.target.to_dict(), "tp": m.tp, "dtype": m.dtype,
            "profile": m.profile.to_dict(), "source": {"uri": m.source.uri, "revision": m.source.revision},
            "toolchain": m.toolchain, "bytes": m.total_size, "golden_steps": GOLDEN_STEPS}


def read_generation_eos(engine: Path) -> tuple[int, ...]:
    try:
        eos = json.loads((engine / GENERATION_CONFIG).read_text()).get("eos_token_id")
    except (OSError, json.JSONDecodeError):
        return ()
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)
