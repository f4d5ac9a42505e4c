"""Gates 1-9 on every rank: one sequence, whatever the engine's backend.

The manifest (gate 1) names the backend; from then on each gate's body is the backend's
(serve/backends/). Every gate runs on every rank; after each, the ranks exchange their
outcome, so one rank's failure stops all of them with the same message, and nobody waits
on a dead peer.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from contract.errors import BuildError
from contract.layout import GENERATION_CONFIG
from contract.manifest import Manifest
from runtime.dist.comm import Comm
from runtime.env import INJECT_GATE_DELAY, INJECT_GATE_HOLD
from runtime.executors.golden import GOLDEN_STEPS
from runtime.models.config import ModelConfig
from runtime.store.files import EngineFiles
from runtime.store.source import EngineSource, Pinned, StoreSource, open_source
from serve.backends import Backend, make_backend
from serve.gates import GateFailure, GateLog, shutdown_requested
from serve.launch import LaunchConfig

log = logging.getLogger("serve")
# Fault injection for tests: "GATE:SECONDS[,GATE:SECONDS...]" holds every rank at the start
# of those gates (a stop signal ends a hold), so a signal or a probe lands while start-up is
# certainly in progress however fast the gates are.
GATE_DELAY_ENV = INJECT_GATE_DELAY.name
# Fault injection for the fault harness: "GATE:DIR" holds every rank inside GATE (its state
# is running, its body has not started) until DIR/release appears, after writing
# DIR/held.rank{N}. The harness injects its fault while every rank is held, then releases
# them, so the fault lands in the gate it names whatever the machine's speed.
GATE_HOLD_ENV = INJECT_GATE_HOLD.name
HOLD_RELEASE = "release"
HOLD_CAP_S = 300.0  # a harness that died without releasing does not hold a rank forever
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
    source: EngineSource | None = None  # where the engine is read from (directory, store)
    pinned: Pinned | None = None  # rank 0's resolution of a store reference
    pin_error: tuple[str, str] | None = None
    rank_loads: list[Evidence] = field(default_factory=list)  # every rank's load evidence
    # Rank 0 learns these from the tokenizer in gate 1; the backend reads them afterwards.
    eos_token_ids: tuple[int, ...] = ()
    pad_id: int = 0

    @property
    def rank(self) -> int:
        return self.comm.rank

    def _injected_delay(self, name: str) -> None:
        holds = dict(h.partition(":")[::2] for h in (INJECT_GATE_DELAY.raw() or "").split(","))
        if name not in holds:
            return
        t_end = time.monotonic() + float(holds[name] or 0)
        while time.monotonic() < t_end and not self.interrupted():
            time.sleep(0.02)

    def _injected_hold(self, name: str) -> None:
        gate, _, where = (INJECT_GATE_HOLD.raw() or "").partition(":")
        if gate != name or not where:
            return
        held = Path(where)
        tmp = held / f".held.rank{self.rank}.tmp"
        tmp.write_text(f"{os.getpid()} {time.time()}")
        tmp.rename(held / f"held.rank{self.rank}")  # whole, or not there at all
        t_end = time.monotonic() + HOLD_CAP_S
        while (time.monotonic() < t_end and not self.interrupted()
               and not (held / HOLD_RELEASE).exists()):
            time.sleep(0.01)

    def gate(self, name: str, body: Callable[[Evidence], None]) -> None:
        """Run one gate here, then agree with every rank on its outcome. A body may leave
        facts about its host in evidence[HOST_FACTS]: rank 0 records every rank's, by host."""
        err: GateFailure | None = None
        facts: Any = None
        self._injected_delay(name)
        if self.interrupted():
            err = shutdown_requested(name)
        else:
            try:
                with self.log.run(name) as evidence:
                    self._injected_hold(name)
                    if self.interrupted():
                        raise shutdown_requested(name)
                    body(evidence)
                    facts = evidence.pop(HOST_FACTS, None)
            except GateFailure as e:
                err = e
        try:
            outcomes = self.comm.allgather(
                [None if err is None else (err.cause, err.remedy), facts])
        except (ConnectionError, OSError) as e:
            self.comm.peer_watch.expect_end()
            raise GateFailure(name, f"a peer rank is gone: {e}",
                              "see the other ranks' messages") from e
        if err is not None:
            self.comm.peer_watch.expect_end()
            raise err
        for r, (out, _) in enumerate(outcomes):
            if out is not None:
                self.comm.peer_watch.expect_end()
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
            self.comm.peer_watch.expect_end()
            raise GateFailure(name, "the hosts run different torch versions: " + "; ".join(
                f"{v} on {', '.join(where)}" for v, where in torch_on.items()),
                "install the same torch on every host of the job")

    def run(self, on_resolved: Callable[[Evidence], None] | None = None,
            until: str = GATES[-1]) -> Backend:
        """Gates 1-9 (or up to `until`) in order; raises GateFailure naming the first that
        failed on any rank."""
        self._pin()
        self.gate("resolve", lambda ev: self._resolve(ev, on_resolved))
        backend = self.backend
        assert backend is not None
        for name in GATES[1 : GATES.index(until) + 1]:
            self.gate(name, getattr(backend, name))
        return backend

    def run_gate(self, name: str) -> Backend:
        """One more backend gate after `run(until=...)` stopped short of it."""
        backend = self.backend
        assert backend is not None
        self.gate(name, getattr(backend, name))
        return backend

    def _pin(self) -> None:
        """Before gate 1, on every rank: rank 0 turns a store reference (a tag) into an
        engine id and reads its manifest, and every rank takes rank 0's answer, so all of
        them serve the same engine even when the tag moves meanwhile."""
        try:
            self.source = open_source(self.cfg.engine, self.cfg.engine_cache,
                                      deadline=self.cfg.store_deadline)
        except BuildError as e:  # the same on every rank: they parse the same argument
            self.pin_error = (e.cause, e.remedy)
            return
        if not isinstance(self.source, StoreSource):
            return
        wire: dict[str, Any] | None = None
        if self.rank == 0:
            try:
                wire = self.source.pin().to_wire()
            except BuildError as e:
                wire = {"error": [e.cause, e.remedy]}
        wire = self.comm.allgather(wire)[0]
        if "error" in wire:
            self.pin_error = (wire["error"][0], wire["error"][1])
        else:
            self.pinned = Pinned.from_wire(wire)

    def _resolve(self, ev: Evidence, on_resolved: Callable[[Evidence], None] | None) -> None:
        if self.pin_error is not None:
            raise GateFailure("resolve", *self.pin_error)
        source = self.source
        assert source is not None
        try:
            if isinstance(source, StoreSource):
                assert self.pinned is not None
                m = source.adopt(self.pinned)
                ev.update(self.pinned.evidence)
                if source.local:  # a store directory: serve the engine's own directory
                    self.source = source = EngineSource(source.engine_dir())
                    m = source.read_manifest()
            else:
                m = source.read_manifest()
        except BuildError as e:
            raise GateFailure("resolve", e.cause, e.remedy) from None
        self.manifest = m
        self.files = source.open(m)
        self.backend = make_backend(m.backend, self)
        self.backend.resolve(ev)
        ev.update(engine_id=m.engine_id, model=m.model_name, backend=m.backend, tp=m.tp,
                  dtype=m.dtype, schema=m.schema_version, source=source.where)
        if m.engine_id != (self.pinned.engine_id if self.pinned else m.engine_id):
            raise GateFailure("resolve", f"{source.where} holds engine {m.engine_id}, not the "
                              f"pinned {self.pinned.engine_id if self.pinned else ''}",
                              "push the engine again")
        log.info("serving engine %s/%s from %s", m.model_name, m.engine_id, source.where)
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
