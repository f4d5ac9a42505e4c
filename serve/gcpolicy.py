"""Python's cyclic garbage collector on a serving rank: its pauses timed, held during
start-up, and the start-up heap frozen at admission.

Why: after the gates a rank's heap holds the long-lived objects of torch, the tokenizer and
the loaded program, and the collector's oldest generation walks every one of them each time
it runs, holding the GIL: the engine loop, the HTTP thread and (at TP > 1) every other rank,
waiting at the next collective, stall for as long. `gc.freeze()` moves what exists at
admission into the permanent generation, which no collection walks; what requests allocate
afterwards is collected as before. vLLM and SGLang freeze their heap after start-up for the
same reason. The pauses stay visible: /metrics counts them by generation and /v1/engine
reports the totals, so a regression shows as numbers, not as a mysterious ITL p99.
"""

from __future__ import annotations

import gc
import threading
import time
from dataclasses import dataclass
from typing import Any

from runtime.env import GC_FREEZE, flag

GENERATIONS = (0, 1, 2)
# "0" leaves the heap unfrozen (an escape hatch, and the A/B of the bench's measurement).
FREEZE_ENV = GC_FREEZE.name


@dataclass
class PauseTotals:
    """One generation's collections since the process started."""

    collections: int = 0
    seconds: float = 0.0
    max_seconds: float = 0.0


class GcPauses:
    """Times every collection through `gc.callbacks` (called on the collecting thread,
    which holds the GIL, so start and stop pair up without a lock; readers copy under one)."""

    def __init__(self) -> None:
        self._start = 0.0
        self._totals = {g: PauseTotals() for g in GENERATIONS}
        self._lock = threading.Lock()
        self._installed = False

    def install(self) -> None:
        if not self._installed:
            gc.callbacks.append(self._callback)
            self._installed = True

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
            return
        dt = time.perf_counter() - self._start
        with self._lock:
            t = self._totals[int(info.get("generation", 2))]
            t.collections += 1
            t.seconds += dt
            t.max_seconds = max(t.max_seconds, dt)

    def totals(self) -> dict[int, PauseTotals]:
        with self._lock:
            return {g: PauseTotals(t.collections, t.seconds, t.max_seconds)
                    for g, t in self._totals.items()}

    def report(self) -> dict[str, Any]:
        """For /v1/engine: per generation, collections, total and longest pause (ms)."""
        return {f"gen{g}": {"collections": t.collections, "total_ms": round(t.seconds * 1e3, 3),
                            "max_ms": round(t.max_seconds * 1e3, 3)}
                for g, t in self.totals().items()}


PAUSES = GcPauses()


def hold_collector() -> None:
    """From the worker's start to admission: no collections. The gates allocate long-lived
    objects by the hundred thousand (the loaded program, the tokenizer), and each time the
    oldest generation's share grows by a quarter the collector walks all of it: measured two
    full collections, 145 ms of a Q4_0 engine's cold start. What start-up leaves as cyclic
    garbage (66 objects on that engine) is frozen with the rest."""
    if flag(GC_FREEZE):
        gc.disable()


def freeze_heap() -> dict[str, Any]:
    """At admission: freeze everything start-up left (no collection walks it again) and let
    the collector run for what requests allocate. Returns the gate's evidence."""
    if not flag(GC_FREEZE):
        return {"gc_frozen_objects": 0, "gc_freeze": f"off ({FREEZE_ENV}=0)"}
    gc.freeze()
    gc.enable()
    return {"gc_frozen_objects": gc.get_freeze_count()}
