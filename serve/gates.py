"""Readiness gates: each records start, end, evidence and, on failure, cause and remedy.

A gate either passes with evidence a person can read, or raises GateFailure; the worker
then reports it, every rank exits non-zero, and nobody takes traffic.
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from contract.errors import BuildError
from runtime.env import LAUNCH_TIME

GATE_NAMES = (
    "resolve", "compatible", "reserve", "load", "verify", "connect", "allocate", "kernels",
    "warmup", "admission",
)
# Gates 1-9 run on every rank (serve/startup.py); gate 10, admission, is rank 0's alone.
STARTUP_GATES = GATE_NAMES[:-1]
Evidence = dict[str, Any]
# Evidence a gate body shares with rank 0 (see serve/startup.py Startup.gate): rank 0
# records every rank's, by host.
HOST_FACTS = "_host_facts"
In = TypeVar("In")
Out = TypeVar("Out")
Next = TypeVar("Next")


class GateFailure(Exception):
    def __init__(self, gate: str, cause: str, remedy: str) -> None:
        super().__init__(f"gate {gate} failed: {cause} — {remedy}")
        self.gate, self.cause, self.remedy = gate, cause, remedy


def shutdown_requested(gate: str) -> GateFailure:
    """A stop signal arrived before admission: start-up ends at the next safe point."""
    return GateFailure(gate, "shutdown requested before admission", "nothing to do")


@dataclass(frozen=True, slots=True)
class GateStep(Generic[In, Out]):
    """One start-up gate: its name, and its body, which takes what the gate before it
    produced (and the evidence dict to fill in) and returns what the next gate needs."""

    name: str
    body: Callable[[In, Evidence], Out]

    def __post_init__(self) -> None:
        if self.name not in STARTUP_GATES:
            raise ValueError(f"{self.name!r} is not a start-up gate (one of {STARTUP_GATES})")


@dataclass(frozen=True, slots=True)
class GateChain(Generic[Out]):
    """The gates a backend runs after resolve, in order: each step's input is the previous
    step's output, so a gate can only use what an earlier gate produced (the types say
    which), and the list is the order. Built with `then`; run by serve/startup.py."""

    steps: tuple[GateStep[Any, Any], ...] = ()

    def __post_init__(self) -> None:
        names = [s.name for s in self.steps]
        want = [n for n in STARTUP_GATES if n in names]
        if names != want:
            raise ValueError(f"gates out of order or repeated: {names}, expected {want}")

    def then(self, name: str, body: Callable[[Out, Evidence], Next]) -> GateChain[Next]:
        return GateChain((*self.steps, GateStep(name, body)))


@dataclass(slots=True)
class Gate:
    name: str
    state: str = "pending"  # pending | running | passed | failed
    start: float | None = None  # seconds since launch
    end: float | None = None
    evidence: dict[str, Any] = field(default_factory=dict)
    reason: str | None = None

    @property
    def seconds(self) -> float | None:
        return None if self.start is None or self.end is None else self.end - self.start

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "state": self.state, "start": self.start, "end": self.end,
                "seconds": self.seconds, "evidence": self.evidence, "reason": self.reason}


class GateLog:
    """The gate timeline of one worker; thread-safe to read from the HTTP thread."""

    def __init__(self, t0: float | None = None) -> None:
        # Times count from the launch (the supervisor records it) when known, so the
        # timeline includes interpreter start-up and MPI bootstrap, not only the gates.
        launched = LAUNCH_TIME.raw()
        if t0 is None and launched:
            t0 = time.perf_counter() - max(0.0, time.time() - float(launched))
        self.t0 = time.perf_counter() if t0 is None else t0
        self.gates = [Gate(n) for n in GATE_NAMES]
        self._lock = threading.Lock()

    def get(self, name: str) -> Gate:
        return next(g for g in self.gates if g.name == name)

    def evidence(self, name: str) -> dict[str, Any]:
        """A copy of a gate's evidence, safe to hand to another thread."""
        with self._lock:
            return copy.deepcopy(self.get(name).evidence)

    def amend(self, name: str, **evidence: Any) -> None:
        """Add to a closed gate's evidence (a later gate learned more about it)."""
        with self._lock:
            self.get(name).evidence.update(evidence)

    @contextmanager
    def run(self, name: str) -> Iterator[dict[str, Any]]:
        """Time a gate; the body fills in the evidence dict or raises GateFailure.

        The body writes a private dict, published under the lock when the gate closes:
        the HTTP thread reads the timeline at any moment (/health/ready), and a dict that
        grows while it is being serialized fails the read.
        """
        gate = self.get(name)
        with self._lock:
            gate.state, gate.start = "running", time.perf_counter() - self.t0
        evidence: dict[str, Any] = {}
        try:
            yield evidence
        except GateFailure as e:
            self._close(gate, "failed", f"{e.cause} — {e.remedy}", evidence)
            raise
        except BuildError as e:  # a refusal with its own cause and remedy (engine files)
            self._close(gate, "failed", f"{e.cause} — {e.remedy}", evidence)
            raise GateFailure(name, e.cause, e.remedy) from None
        except Exception as e:  # an unexpected error still fails the gate by name
            self._close(gate, "failed", f"{type(e).__name__}: {e}", evidence)
            raise GateFailure(name, f"{type(e).__name__}: {e}", "see the worker log") from e
        self._close(gate, "passed", None, evidence)

    def _close(self, gate: Gate, state: str, reason: str | None,
               evidence: dict[str, Any]) -> None:
        with self._lock:
            gate.state, gate.end, gate.reason = state, time.perf_counter() - self.t0, reason
            gate.evidence = evidence

    def to_list(self) -> list[dict[str, Any]]:
        with self._lock:
            return copy.deepcopy([g.to_dict() for g in self.gates])

    def table(self) -> str:
        """The cold-start report as one readable table."""
        rows = [("gate", "state", "start s", "seconds", "evidence")]
        for g in self.to_list():
            ev = g["reason"] or ", ".join(f"{k}={_fmt(v)}" for k, v in g["evidence"].items()
                                          if not isinstance(v, (dict, list)))
            rows.append((g["name"], g["state"], _fmt(g["start"]), _fmt(g["seconds"]), ev))
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r[:4], widths)) + "  " + r[4] for r in rows]
        return "\n".join(lines)


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 100 else f"{v:.0f}"
    return str(v)


def describe_load(ld: dict[str, Any]) -> str:
    """One rank's load gate evidence (/v1/engine `load`) as a line: bytes, source, GB/s
    against the floor that applies (the store's ranged GETs, else local storage)."""
    fl = ld.get("floors", {})
    floor = (f"store {fl.get('store_read_gbps')} GB/s (ranged GETs of a probe object)"
             if "store_read_gbps" in fl else
             f"storage {fl.get('storage_read_gbps')} GB/s ({fl.get('storage_mode')})")
    return (f"rank {ld.get('rank')}: {ld.get('bytes', 0) / 2**20:.1f} MiB from "
            f"{ld.get('from', 'directory')} in {ld.get('read_s')} s = {ld.get('gbps')} GB/s "
            f"({ld.get('vs_floor')} of the floor); floors: {floor}, "
            f"host copy {fl.get('host_copy_gbps')} GB/s")
