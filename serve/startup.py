"""Gates 1-9 on every rank: one sequence, whatever the engine's backend.

Gate 1 (resolve) is the sequence's own: it reads the manifest, and the manifest names the
backend (serve/backends/), which it builds from what it resolved. The backend's gate chain
(`Backend.gates()`, an ordered list of typed steps, serve/gates.py) is then gates 2-9: each
step takes what the one before it produced, and the last produces the engine ready to
serve. Every gate runs on every rank; after each, the ranks exchange their outcome, so one
rank's failure stops all of them with the same message, and nobody waits on a dead peer.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from contract.errors import BuildError
from contract.layout import GENERATION_CONFIG
from contract.manifest import Manifest
from runtime.env import INJECT_GATE_DELAY, INJECT_GATE_HOLD
from runtime.executors.golden import GOLDEN_STEPS
from runtime.store.source import EngineSource, Pinned, StoreSource, open_source
from serve.backends import Backend, Serving, make_backend
from serve.gates import (
    HOST_FACTS,
    STARTUP_GATES,
    Evidence,
    GateFailure,
    GateStep,
    shutdown_requested,
)
from serve.stages import GateContext, Resolved

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
GATES = STARTUP_GATES  # gate 10, admission, is rank 0's alone (serve/rank0.py)
R = TypeVar("R")


class Startup:
    """One rank's run of gates 1-9. `run(until=...)` may stop after any gate and a later
    `run()` goes on from there; `resolved` and `backend` are there once gate 1 passed."""

    def __init__(self, ctx: GateContext) -> None:
        self.ctx, self.cfg, self.comm, self.log = ctx, ctx.cfg, ctx.comm, ctx.log
        self.resolved: Resolved | None = None
        self.backend: Backend | None = None
        self.value: Any = None  # what the last gate that ran produced
        self._steps: list[GateStep[Any, Any]] = []  # the backend's gates not yet run

    @property
    def rank(self) -> int:
        return self.comm.rank

    def _injected_delay(self, name: str) -> None:
        holds = dict(h.partition(":")[::2] for h in (INJECT_GATE_DELAY.raw() or "").split(","))
        if name not in holds:
            return
        t_end = time.monotonic() + float(holds[name] or 0)
        while time.monotonic() < t_end and not self.ctx.interrupted():
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
        while (time.monotonic() < t_end and not self.ctx.interrupted()
               and not (held / HOLD_RELEASE).exists()):
            time.sleep(0.01)

    def gate(self, name: str, body: Callable[[Evidence], R]) -> R:
        """Run one gate here, then agree with every rank on its outcome; returns what the
        body returned. A body may leave facts about its host in evidence[HOST_FACTS]: rank 0
        records every rank's, by host."""
        err: GateFailure | None = None
        facts: Any = None
        result: Any = None
        self._injected_delay(name)
        if self.ctx.interrupted():
            err = shutdown_requested(name)
        else:
            try:
                with self.log.run(name) as evidence:
                    self._injected_hold(name)
                    if self.ctx.interrupted():
                        raise shutdown_requested(name)
                    result = body(evidence)
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
        return result

    def run(self, on_resolved: Callable[[Evidence], None] | None = None,
            until: str = GATES[-1]) -> Any:
        """Gates 1-9 (or up to `until`) in order, from the first not yet run; raises
        GateFailure naming the first that failed on any rank. Returns what the last gate run
        produced: after warmup, the engine ready to serve (see `serve`)."""
        if self.backend is None:
            pinned = self._pin()
            self.resolved, self.backend = self.gate(
                "resolve", lambda ev: self._resolve(pinned, ev, on_resolved))
            self._steps = list(self.backend.gates().steps)
        while self._steps and GATES.index(self._steps[0].name) <= GATES.index(until):
            step, value = self._steps.pop(0), self.value
            self.value = self.gate(step.name, partial(step.body, value))
        return self.value

    def serve(self, on_resolved: Callable[[Evidence], None] | None = None) -> Serving:
        """Every gate left; the engine ready to serve."""
        serving = self.run(on_resolved)
        if not isinstance(serving, Serving):
            raise TypeError(f"the backend's last gate produced {type(serving).__name__}, "
                            "not the engine ready to serve")
        return serving

    def _pin(self) -> EngineSource | tuple[StoreSource, Pinned] | GateFailure:
        """Before gate 1, on every rank: rank 0 turns a store reference (a tag) into an
        engine id and reads its manifest, and every rank takes rank 0's answer, so all of
        them serve the same engine even when the tag moves meanwhile. A failure here is
        gate 1's, reported by it."""
        try:
            source = open_source(self.cfg.engine, self.cfg.engine_cache,
                                 deadline=self.cfg.store_deadline)
        except BuildError as e:  # the same on every rank: they parse the same argument
            return GateFailure("resolve", e.cause, e.remedy)
        if not isinstance(source, StoreSource):
            return source
        wire: dict[str, Any] | None = None
        if self.rank == 0:
            try:
                wire = source.pin().to_wire()
            except BuildError as e:
                wire = {"error": [e.cause, e.remedy]}
        wire = self.comm.allgather(wire)[0]
        if "error" in wire:
            return GateFailure("resolve", wire["error"][0], wire["error"][1])
        return source, Pinned.from_wire(wire)

    def _resolve(self, pinned: EngineSource | tuple[StoreSource, Pinned] | GateFailure,
                 ev: Evidence, on_resolved: Callable[[Evidence], None] | None
                 ) -> tuple[Resolved, Backend]:
        if isinstance(pinned, GateFailure):
            raise pinned
        source, pin = pinned if isinstance(pinned, tuple) else (pinned, None)
        try:
            if isinstance(source, StoreSource) and pin is not None:
                m = source.adopt(pin)
                ev.update(pin.evidence)
                if source.local:  # a store directory: serve the engine's own directory
                    source = EngineSource(source.engine_dir())
                    m = source.read_manifest()
            else:
                m = source.read_manifest()
        except BuildError as e:
            raise GateFailure("resolve", e.cause, e.remedy) from None
        where = dict(engine_id=m.engine_id, model=m.model_name, backend=m.backend, tp=m.tp,
                     dtype=m.dtype, schema=m.schema_version, source=source.where)
        if pin is not None and pin.engine_id != m.engine_id:
            ev.update(where)
            raise GateFailure("resolve", f"{source.where} holds engine {m.engine_id}, not the "
                              f"pinned {pin.engine_id}", "push the engine again")
        resolved = Resolved(m, source.open(m), source, pin)
        backend = make_backend(self.ctx, resolved, ev)
        ev.update(where)
        self.resolved, self.backend = resolved, backend  # rank 0's gate-1 work reads them
        log.info("serving engine %s/%s from %s", m.model_name, m.engine_id, source.where)
        if on_resolved is not None:
            on_resolved(ev)
        return resolved, backend


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
