"""The remote load against the store's read floor, measured the way the load gate does,
repeated and interleaved so that a loaded machine's noise hits both alike.

    python -m bench.store_load s3://BUCKET/PREFIX/MODEL/ENGINE_ID [--rank 0] [--repeat 5]

Floor: the shard's bytes as parallel ranged GETs with nothing done to them (no copy, no
hash). Load: runtime/store/loader.py's read_object_hashed, the load gate's path (ranged GETs
straight into one host buffer, sha256 as the parts land). Prints each run and the medians.
"""

from __future__ import annotations

import argparse
import os
import statistics

from contract.layout import rank_shard
from contract.refs import engine_key, parse_ref
from runtime.store.loader import read_object_hashed
from runtime.store.objstore import CONCURRENCY, PART_BYTES, ObjectStore


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.store_load")
    ap.add_argument("ref", help="STORE/MODEL/ENGINE_ID (an engine already pushed)")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)
    ref = parse_ref(args.ref)
    assert ref.engine_id is not None, "name the engine by id"
    store = ObjectStore(ref.store)
    key = engine_key(ref.model, ref.engine_id, rank_shard(args.rank))
    size = store.head(key)
    assert size, f"{store.url(key)} is missing"
    floors, loads = [], []
    print(f"{store.url(key)}: {size / 2**20:.1f} MiB, {CONCURRENCY} ranged GETs of "
          f"{PART_BYTES >> 20} MiB at a time")
    for i in range(args.repeat):
        secs = store.read_parts(key, size, lambda _o, _d: None)
        floors.append(size / secs / 1e9)
        _, _, secs = read_object_hashed(store, key, size)
        loads.append(size / secs / 1e9)
        print(f"run {i}: floor {floors[-1]:.3f} GB/s, load {loads[-1]:.3f} GB/s "
              f"({loads[-1] / floors[-1]:.0%}), load avg {os.getloadavg()[0]:.1f}")
    f, ld = statistics.median(floors), statistics.median(loads)
    print(f"median: floor {f:.3f} GB/s, load {ld:.3f} GB/s = {ld / f:.0%} of the floor")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
