"""Served speed when the cores are not all ours: a CPU quota, a busy neighbour, both (#31).

    python -m bench.threads [--engine DIR] [--levels 1 4] [--requests 3 8] [--quota 1.5]

SmolLM2-135M bf16: ours TP=1 (its thread count measured per step, runtime/core/
thread_policy.py, and pinned to one thread with AOTLLM_THREADS=1) beside llama-server on
the bf16 GGUF of the same checkpoint (-t 2, its default of every core, and -t 1), in four
settings, every server in every setting within one run:

- `none`: the machine to itself;
- `quota`: the server in a cgroup v1 with a CFS quota of `--quota` cores (a pod's CPU limit,
  bench/servers.py cpu_quota_cgroup), the client outside it;
- `neighbour`: one `while True: pass` process outside any quota, unpinned, started before
  the server (what AIPerf's timing service or a co-tenant does to a core);
- `quota+neighbour`: both.

bench.loadgen streams 128-token prompts, 32 tokens out, from the same cores. Writes
bench/results/<stamp>-threads/threads.md, .json and threads.png (tok/s per setting and
concurrency, one bar per server).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from bench import charts, common, systems
from bench.loadgen import LoadSpec, exact_length_body, run_load
from bench.prompts import load_tokenizer, make_prompts
from bench.servers import ServerSpec, cpu_quota_cgroup, in_cgroup, llama_spec, ours_spec, serve

PROMPT_LEN, MAX_TOKENS = 128, 32
SETTINGS = ("none", "quota", "neighbour", "quota+neighbour")


@contextlib.contextmanager
def neighbour() -> Iterator[None]:
    """A process that spins on one core for as long as the block runs."""
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)
        yield
    finally:
        proc.kill()
        proc.wait()


SERVERS = ("ours", "ours1", "llama2", "llama1")  # --servers keys, in servers()' order


def servers(engine: Path, gguf: Path) -> list[ServerSpec]:
    ours = ours_spec(engine, common.free_port(), 1, "auto", "ours (threads measured)")
    one = ours_spec(engine, common.free_port(), 1, "auto", "ours AOTLLM_THREADS=1")
    one = dataclasses.replace(one, env={**one.env, "AOTLLM_THREADS": "1"})
    llama2 = dataclasses.replace(llama_spec(gguf, common.free_port(), threads=2),
                                 name="llama-server -t 2")
    llama1 = dataclasses.replace(llama_spec(gguf, common.free_port(), threads=1),
                                 name="llama-server -t 1")
    return [ours, one, llama2, llama1]


def measure(spec: ServerSpec, setting: str, quota: float, levels: list[int],
            requests: list[int], tok: Any, logs: Path) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        if "neighbour" in setting:
            stack.enter_context(neighbour())
        if "quota" in setting:
            spec = in_cgroup(spec, stack.enter_context(cpu_quota_cgroup(quota, spec.name)))
        running = stack.enter_context(serve(spec, logs))
        url = running.spec.base_url
        # One warm pass, the same for every server: the probes of our thread policy start
        # a second into decoding, so the rows below measure the settled choice and its
        # later probes, as a server that has been up for a while runs.
        run_load(LoadSpec(base_url=url, prompts=make_prompts(tok, 4, PROMPT_LEN, seed=7),
                          max_tokens=MAX_TOKENS, concurrency=2, num_requests=4,
                          extra_body=exact_length_body(MAX_TOKENS)))
        for c, n in zip(levels, requests, strict=True):
            _, s = run_load(LoadSpec(
                base_url=url, prompts=make_prompts(tok, n, PROMPT_LEN, seed=100 + c),
                max_tokens=MAX_TOKENS, concurrency=c, num_requests=n,
                extra_body=exact_length_body(MAX_TOKENS)))
            row = {"setting": setting, "server": spec.name, "c": c,
                   "output_tok_s": s.output_tok_s, "itl_p50_ms": s.itl_p50_s * 1e3,
                   "itl_p99_ms": s.itl_p99_s * 1e3, "errors": s.errors}
            if spec.name.startswith("ours"):
                row["threads"] = _threads(url)
            rows.append(row)
            print(f"{setting:16} {spec.name:26} c={c:<3} {s.output_tok_s:7.1f} tok/s  "
                  f"ITL p50 {row['itl_p50_ms']:.1f} p99 {row['itl_p99_ms']:.1f} ms "
                  f"{row.get('threads', '')}", flush=True)
    return rows


def _threads(url: str) -> str:
    """The policy's state from /metrics: threads now, probes and switches so far (those
    made on run-queue waits), and the stepping thread's run-queue seconds."""
    import urllib.request

    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    got = {}
    for line in text.splitlines():
        for key in ("intra_op_threads", "thread_probes_total", "thread_switches_total",
                    "thread_contended_switches_total", "thread_run_queue_wait_seconds_total"):
            if line.startswith(f"llmserve_{key} "):
                got[key] = float(line.split()[1])

    def n(key: str) -> str:
        return f"{got[key]:.0f}" if key in got else "?"

    wait = got.get("thread_run_queue_wait_seconds_total")
    return (f"{n('intra_op_threads')} threads, {n('thread_probes_total')} probes, "
            f"{n('thread_switches_total')} switches ({n('thread_contended_switches_total')} on "
            f"run-queue waits), run-queue wait {'?' if wait is None else f'{wait:.2f}'} s")


def report(rows: list[dict[str, Any]], names: list[str], levels: list[int], quota: float,
           out: Path) -> str:
    head = ["setting", "c", *names]
    body = []
    settings = [s for s in SETTINGS if any(r["setting"] == s for r in rows)]
    for setting in settings:
        for c in levels:
            cells: list[object] = [setting, c]
            for name in names:
                r = next((r for r in rows if (r["setting"], r["server"], r["c"])
                          == (setting, name, c)), None)
                cells.append("" if r is None else
                             f"{r['output_tok_s']:.1f} ({r['itl_p50_ms']:.0f} / "
                             f"{r['itl_p99_ms']:.0f} ms)")
            body.append(cells)
    ours, best_llama = names[0], [n for n in names if n.startswith("llama")]
    ratio = ["| setting | c | ours (measured) / best llama-server |", "|---|---|---|"]
    for setting in settings:
        for c in levels:
            mine = next((r["output_tok_s"] for r in rows
                         if (r["setting"], r["server"], r["c"]) == (setting, ours, c)), None)
            peer = max((r["output_tok_s"] for r in rows if r["setting"] == setting
                        and r["c"] == c and r["server"] in best_llama), default=None)
            if mine is not None and peer:
                ratio.append(f"| {setting} | {c} | {mine:.1f} / {peer:.1f} = {mine / peer:.2f}x |")
    info = common.machine_info()
    return "\n".join([
        f"# Threads under a CPU quota and beside a busy neighbour ({out.name})", "",
        f"{info['cpu']}, {info['cores']} cores. SmolLM2-135M bf16, ours TP=1 aoti against "
        "llama-server on the bf16 GGUF of the same checkpoint; bench.loadgen, "
        f"{PROMPT_LEN}-token prompts, {MAX_TOKENS} tokens out, streamed. quota: a cgroup v1 "
        f"CFS quota of {quota} cores around the server; neighbour: one spinning process, "
        "unpinned, outside the quota. Cells: output tok/s (ITL p50 / p99).", "",
        *common.md_table(head, body), "",
        "Ours with its measured thread count against the better of llama-server's -t 2 and -t 1 "
        "(a user of llama-server would have to know which to pick):", "", *ratio, "",
        "Our thread policy's state at the end of each row: " + "; ".join(
            f"{r['setting']} c={r['c']}: {r['threads']}" for r in rows
            if r["server"] == ours and "threads" in r),
    ]) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--engine", type=Path, default=None, help="default: pipeline build (bf16)")
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--requests", type=int, nargs="+", default=[3, 8])
    ap.add_argument("--quota", type=float, default=1.5, metavar="CORES")
    ap.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=SETTINGS)
    ap.add_argument("--servers", nargs="+", default=list(SERVERS), choices=SERVERS,
                    help="ours (measured threads), ours1 (AOTLLM_THREADS=1), llama2, llama1 "
                    "(llama-server -t 2 / -t 1: -t 2 beside a neighbour runs ~1 tok/s, minutes)")
    args = ap.parse_args(argv)
    if "ours" not in args.servers:
        raise SystemExit("error: --servers must include ours: the report compares it")
    if len(args.levels) != len(args.requests):
        raise SystemExit("error: --levels and --requests need the same number of values")
    hf_dir = common.demo_checkpoint()
    gguf = common.gguf_for(hf_dir)
    for need in (common.llama_server_bin(), gguf):
        if not need.exists():
            raise SystemExit(f"error: {need} is missing — run `make bench-peers` first")

    engine = args.engine or systems.build_engine(common.sh, hf_dir, 1)
    out = common.RESULTS / (datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ") + "-threads")
    out.mkdir(parents=True)
    tok = load_tokenizer(hf_dir)
    specs = [s for key, s in zip(SERVERS, servers(engine, gguf), strict=True)
             if key in args.servers]
    rows: list[dict[str, Any]] = []
    for setting in args.settings:
        for spec in specs:
            rows += measure(spec, setting, args.quota, args.levels, args.requests, tok,
                            out / "logs")
    names = [s.name for s in specs]
    text = report(rows, names, args.levels, args.quota, out)
    (out / "threads.md").write_text(text)
    (out / "threads.json").write_text(json.dumps(rows, indent=1))
    charts.settings_bars(rows, out / "threads.png", names)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
