"""TP=2 across two "hosts" (two network namespaces joined by a veth pair) next to TP=2 on
one host, on the same engine and load, alternating within one run (needs root).

One host: both ranks in one namespace, shared-memory collectives. Two hosts: rank 0 in
namespace A, rank 1 in B, gloo over the veth pair, each "host" pinned to one core (as the
one-host ranks get one core's worth of threads each). The gap is the price of collectives
over TCP instead of shared memory, per step.

    sudo .venv/bin/python -m bench.multihost --engine ENGINE_DIR [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from bench.common import REPO, free_port, loadavg, md_table
from bench.loadgen import LoadSpec, exact_length_body, run_load
from bench.servers import ServerSpec, get_json, serve
from bench.stats import LoadSummary

RESULTS = REPO / "bench" / "results" / "latest" / "multihost.md"
PROMPTS = ("The quick brown fox", "Once upon a time", "In a distant galaxy", "Dear diary,")


def _load(base_url: str, concurrency: int, requests: int, max_tokens: int) -> LoadSummary:
    _, summary = run_load(LoadSpec(base_url, PROMPTS, max_tokens=max_tokens,
                                   concurrency=concurrency, num_requests=requests,
                                   extra_body=exact_length_body(max_tokens)))
    if summary.errors:
        raise RuntimeError(f"{summary.errors} request(s) failed: {summary.first_error}")
    return summary


def one_host_spec(engine: Path) -> ServerSpec:
    argv = (sys.executable, "-m", "serve", "launch", "--engine", str(engine), "--port",
            str(port := free_port()))
    return ServerSpec("tp2-one-host", argv, port, "/health/ready")


@contextmanager
def two_hosts_spec(engine: Path, workdir: Path) -> Iterator[ServerSpec]:
    from tests.e2e.netns import Relay, TwoHosts  # the test's namespaces, pinned to a core each

    hosts = TwoHosts(workdir, pin_cores=True)
    relay = Relay(hosts.ns_a, 8000)
    try:
        argv = (*hosts.prefix_a(), sys.executable, "-m", "serve", "launch", "--engine",
                str(engine), "--host", "127.0.0.1", "--port", "8000", *hosts.launch_args())
        yield ServerSpec("tp2-two-hosts", argv, relay.port, "/health/ready")
    finally:
        relay.close()
        hosts.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", type=Path, required=True, help="a TP=2 engine directory")
    p.add_argument("--rounds", type=int, default=2, help="one-host/two-host pairs (default 2)")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args(argv)
    if os.geteuid() != 0:
        print("error: network namespaces need root; run it as root", file=sys.stderr)
        return 2
    rows: list[list[object]] = []
    with tempfile.TemporaryDirectory(prefix="bench-multihost-") as tmp:
        logs = Path(tmp) / "logs"
        for rnd in range(args.rounds):
            for kind in ("one", "two"):
                with (two_hosts_spec(args.engine, Path(tmp) / f"h{rnd}") if kind == "two"
                      else _nullspec(one_host_spec(args.engine))) as spec, \
                        serve(spec, logs) as running:
                    report = get_json(f"{running.spec.base_url}/v1/engine") or {}
                    s = _load(running.spec.base_url, args.concurrency, args.requests,
                              args.max_tokens)
                rows.append([rnd + 1, spec.name, _collectives(report), f"{s.output_tok_s:.1f}",
                             f"{s.itl_p50_s * 1000:.1f}", f"{s.ttft_p50_s * 1000:.0f}",
                             f"{running.ready_s:.1f}", loadavg()])
                print(" | ".join(map(str, rows[-1])), flush=True)
    ratio = _ratio(rows)
    text = "\n".join([
        "# TP=2 across two network namespaces vs one host", "",
        f"`python -m bench.multihost --engine {args.engine}`: {args.concurrency} concurrent "
        f"streams, {args.requests} requests of {args.max_tokens} tokens a round.", "",
        *md_table(["round", "setup", "collectives", "output tok/s", "ITL p50 ms", "TTFT p50 ms",
                   "ready s", "load avg"], rows), "",
        f"Two hosts / one host, output tok/s (mean of the rounds): {ratio:.2f}", ""])
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(text)
    print(text)
    return 0


@contextmanager
def _nullspec(spec: ServerSpec) -> Iterator[ServerSpec]:
    yield spec


def _collectives(report: dict[str, object]) -> str:
    gates = report.get("gates") or []
    connect = next((g for g in gates if isinstance(g, dict) and g.get("name") == "connect"), {})
    return str((connect.get("evidence") or {}).get("collectives", "?"))


def _ratio(rows: list[list[object]]) -> float:
    by = {name: [float(str(r[3])) for r in rows if r[1] == name]
          for name in ("tp2-one-host", "tp2-two-hosts")}
    one, two = (sum(v) / len(v) for v in by.values())
    return two / one


if __name__ == "__main__":
    raise SystemExit(main())
