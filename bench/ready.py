"""Cold start as an orchestrator sees it: `serve launch` (which starts mpirun) to the first
`/health/ready` 200, the gate table the server reports, then the first request against
the steady state of the same request.

    python -m bench.ready ENGINE [--runs 3] [serve launch args, e.g. --engine-cache DIR]

ENGINE is anything `--engine` takes (a directory, STORE/MODEL@TAG, s3://...). Each run
prints launch -> ready, where the time went (before the first gate: mpirun, interpreter,
imports; then each gate), and first vs steady latency of one short chat completion
(8 tokens, greedy). The load average is printed with every run: on a shared host it is
the context the seconds need.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from serve.gates import describe_load

BODY = {"messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 8, "temperature": 0, "ignore_eos": True}


def _get(url: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, None
    except OSError:
        return 0, None


def _post(url: str, body: dict[str, Any]) -> float:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=120) as r:
        r.read()
    return time.perf_counter() - t0


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_run(engine: str, extra: list[str], steady: int) -> dict[str, Any]:
    port = _free_port()
    run_dir = Path(tempfile.mkdtemp(prefix="bench-ready-"))
    cmd = [sys.executable, "-m", "serve", "launch", "--engine", engine, "--port", str(port),
           "--run-dir", str(run_dir), *extra]
    load0 = os.getloadavg()[0]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        while _get(f"{base}/health/ready")[0] != 200:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited {proc.returncode}: "
                                   f"{proc.stderr.read().decode()[-2000:] if proc.stderr else ''}")
            time.sleep(0.02)
        ready = time.monotonic() - t0
        _, report = _get(f"{base}/v1/engine")
        body = {**BODY, "model": report["engine"]["model"]}
        first = _post(f"{base}/v1/chat/completions", body)
        rest = [_post(f"{base}/v1/chat/completions", body) for _ in range(steady)]
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
        proc.wait(60)
    return {"ready_s": ready, "gates": report["gates"], "load": report["load"], "first_s": first,
            "steady_s": statistics.median(rest), "load_avg": (load0, os.getloadavg()[0])}


def table(run: dict[str, Any]) -> str:
    gates = run["gates"]
    first_gate = min((g["start"] or 0) for g in gates)
    lines = [f"  {'before the gates':<18}{0:>7.2f}{first_gate:>7.2f}  mpirun, interpreters, "
             "imports, bootstrap"]
    for g in gates:
        ev = {k: v for k, v in g["evidence"].items() if not isinstance(v, (dict, list))}
        brief = ", ".join(f"{k}={v}" for k, v in list(ev.items())[:4])
        lines.append(f"  {g['name']:<18}{g['start'] or 0:>7.2f}{g['seconds'] or 0:>7.2f}  "
                     f"{brief[:90]}")
    lines += [f"    load {describe_load(ld)}" for ld in run["load"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.ready")
    ap.add_argument("engine")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steady", type=int, default=5, help="requests after the first")
    args, extra = ap.parse_known_args(argv)  # the rest goes to `serve launch`
    runs = []
    for i in range(args.runs):
        r = one_run(args.engine, extra, args.steady)
        runs.append(r)
        print(f"run {i}: launch -> ready {r['ready_s']:.2f} s; first request "
              f"{r['first_s'] * 1e3:.0f} ms, steady {r['steady_s'] * 1e3:.0f} ms "
              f"({r['first_s'] / r['steady_s']:.2f}x); load avg {r['load_avg'][0]:.1f} -> "
              f"{r['load_avg'][1]:.1f} on {os.cpu_count()} CPUs")
        print(f"  {'gate':<18}{'start':>7}{'secs':>7}\n{table(r)}", flush=True)
    ready = [r["ready_s"] for r in runs]
    print(f"median launch -> ready {statistics.median(ready):.2f} s (min {min(ready):.2f}, "
          f"max {max(ready):.2f}) over {len(runs)} runs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
