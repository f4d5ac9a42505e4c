"""Cold start as an orchestrator sees it: `serve launch` (which starts mpirun) to the first
`/health/ready` 200, the gate table the server reports, then the first request against
the steady state of the same kind of request.

    python -m bench.ready ENGINE [--runs 3] [serve launch args, e.g. --engine-cache DIR]

ENGINE is anything `--engine` takes (a directory, STORE/MODEL@TAG, s3://...). Each run
prints launch -> ready, where the time went (before the first gate: mpirun, interpreter,
imports; then each gate), and first vs steady latency of one short chat completion
(8 tokens, greedy). Every request has a prompt of its own (the same length, a different
first block): a repeat of the first prompt would be served from the prefix cache and skip
most of its prefill, and "steady" would then measure a cache hit, not a warm engine (it
did: 1.4x "first vs steady" that was all prefill). The prefix-cache hits are read from
/metrics and printed, so the comparison shows it is like for like. The load average is
printed with every run: on a shared host it is the context the seconds need.
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

from bench.job import metric_sum, parse_metrics
from serve.gates import describe_load
from serve.metrics import PREFIX

BODY = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}


def chat_body(model: str, i: int) -> dict[str, Any]:
    """Request i's body: the system message leads the prompt's first KV block, so no two
    requests share a cached block; one digit keeps every prompt the same length."""
    return {**BODY, "model": model, "messages": [
        {"role": "system", "content": f"Request {i % 10}. You are a helpful assistant."},
        {"role": "user", "content": "What is the capital of France?"}]}


def _prefix_hits(base: str) -> float:
    """Prompt tokens the prefix cache has served so far (the server's /metrics)."""
    with urllib.request.urlopen(f"{base}/metrics", timeout=5) as r:
        page = parse_metrics(r.read().decode())
    return metric_sum(page, f"{PREFIX}prefix_cache_hits_total")


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
        model = report["engine"]["model"]
        first = _post(f"{base}/v1/chat/completions", chat_body(model, 0))
        rest = [_post(f"{base}/v1/chat/completions", chat_body(model, i + 1))
                for i in range(steady)]
        hits = _prefix_hits(base)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
        proc.wait(60)
    return {"ready_s": ready, "gates": report["gates"], "load": report["load"], "first_s": first,
            "steady_s": statistics.median(rest), "prefix_hits": hits,
            "load_avg": (load0, os.getloadavg()[0])}


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
    ap.add_argument("--steady", type=int, default=5, help="requests after the first (at most 9)")
    args, extra = ap.parse_known_args(argv)  # the rest goes to `serve launch`
    if not 1 <= args.steady <= 9:  # one digit tells the prompts apart
        ap.error("--steady must be between 1 and 9")
    runs = []
    for i in range(args.runs):
        r = one_run(args.engine, extra, args.steady)
        runs.append(r)
        print(f"run {i}: launch -> ready {r['ready_s']:.2f} s; first request "
              f"{r['first_s'] * 1e3:.0f} ms, steady {r['steady_s'] * 1e3:.0f} ms "
              f"({r['first_s'] / r['steady_s']:.2f}x, prefix-cache hits {r['prefix_hits']:.0f} "
              f"tokens); load avg {r['load_avg'][0]:.1f} -> "
              f"{r['load_avg'][1]:.1f} on {os.cpu_count()} CPUs")
        print(f"  {'gate':<18}{'start':>7}{'secs':>7}\n{table(r)}", flush=True)
    ready = [r["ready_s"] for r in runs]
    print(f"median launch -> ready {statistics.median(ready):.2f} s (min {min(ready):.2f}, "
          f"max {max(ready):.2f}) over {len(runs)} runs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
