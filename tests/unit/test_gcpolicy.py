"""serve.gcpolicy: collections timed by generation; the collector held during start-up and
the start-up heap frozen at admission (in a child process: gc state is process-wide)."""

from __future__ import annotations

import gc
import json
import subprocess
import sys

from serve.gcpolicy import GcPauses


def test_every_collection_is_counted_and_timed_by_generation() -> None:
    pauses = GcPauses()
    pauses.install()
    pauses.install()  # idempotent: one callback, not two
    gc.disable()  # only the two collections below, none triggered by the allocations
    try:
        before = pauses.totals()
        junk = [[i] for i in range(200_000)]  # a heap worth walking
        gc.collect(2)
        gc.collect(0)
        del junk
        after = pauses.totals()
    finally:
        gc.enable()
        gc.callbacks.remove(pauses._callback)
    assert after[2].collections == before[2].collections + 1
    assert after[0].collections == before[0].collections + 1
    assert after[2].seconds > before[2].seconds
    assert after[2].max_seconds > 0
    rep = pauses.report()
    assert rep["gen2"]["collections"] == after[2].collections
    assert rep["gen2"]["max_ms"] > 0


CHILD = """
import gc, json, os
from serve.gcpolicy import PAUSES, freeze_heap, hold_collector
PAUSES.install()
hold_collector()
held = not gc.isenabled()
startup = [[i] for i in range(100_000)]  # long-lived objects made by the gates
ev = freeze_heap()
print(json.dumps({"held": held, "enabled_after": gc.isenabled(), "ev": ev,
                  "collections": sum(t.collections for t in PAUSES.totals().values()),
                  "frozen": gc.get_freeze_count()}))
"""


def _child(env_value: str | None) -> dict:
    import os

    env = {k: v for k, v in os.environ.items() if k != "AOTLLM_GC_FREEZE"}
    if env_value is not None:
        env["AOTLLM_GC_FREEZE"] = env_value
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                         env=env, check=True, timeout=120)
    return json.loads(out.stdout)


def test_startup_runs_no_collection_and_admission_freezes_what_it_made() -> None:
    r = _child(None)
    assert r["held"] and r["enabled_after"]
    assert r["collections"] == 0  # 100k new containers, and not one collection
    assert r["frozen"] >= 100_000 and r["ev"]["gc_frozen_objects"] == r["frozen"]


def test_the_escape_hatch_leaves_the_collector_alone() -> None:
    r = _child("0")
    assert not r["held"] and r["enabled_after"]
    assert r["frozen"] == 0 and "off" in r["ev"]["gc_freeze"]
    assert r["collections"] > 0  # the same allocations did trigger collections
