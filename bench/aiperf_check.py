"""Cross-check the bench's load generator with NVIDIA's AIPerf, on ours and llama-server.

    python -m bench.aiperf_check [--engine DIR] [--levels 1 16] [--requests 4 32]

For each server (ours at TP=1 on a bf16 engine, llama-server on the bf16 GGUF of the same
checkpoint; both from `make bench-peers`) and each concurrency: bench.loadgen (128-token
prompts on /v1/completions, 128 tokens out, streamed) and then `aiperf profile` (the
field's client: chat endpoint, streamed, synthetic prompts of 128 tokens before the chat
template, 128 out, ignore_eos, server token counts) against the same running server.
Both clients run on the same 2 cores as the server, so both take CPU from it, equally for
both servers; the table puts the two clients' throughput, TTFT and ITL side by side.
Writes bench/results/<stamp>/aiperf.md and .json.

The clients need a core the servers do not use. Measured on the 2-core CI VM (stop 21):
AIPerf 0.13's timing service kept one core 70-90 % busy for the whole run, and our server's
two OpenMP compute threads then waited on the preempted one at every parallel region: a c=1
stream fell from 35 to ~1.2 tokens/s, and the two clients' numbers were not comparable. So
by default the servers are confined to all cores but the last (taskset; our ranks size their
threads by it, llama-server gets -t to match) and both clients run on the last one
(`--shared-cores`: everything on every core, as `make bench` runs).

`--cpu-quota 1.5` runs each server in a cgroup with that CFS quota (a pod's CPU limit; root
and cgroup v1 needed), unpinned, with the clients outside it on the same cores: ours sizes
its threads by the quota (serve/cpu_quota.py), llama-server keeps its -t of every core, as a
user would start both in such a pod. `--ours-env - OMP_WAIT_POLICY=PASSIVE` runs our server
twice, the second with that environment (ours only: llama.cpp's ggml uses OpenMP too).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import subprocess
import time
import urllib.request
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from bench import common, systems
from bench.loadgen import LoadSpec, exact_length_body, run_load
from bench.prompts import load_tokenizer, make_prompts
from bench.servers import cpu_quota_cgroup, in_cgroup, llama_spec, ours_spec, pinned, serve

PROMPT_LEN = MAX_TOKENS = 128


def aiperf_bin() -> Path:
    return common.cache_dir() / "aiperf-venv" / "bin" / "aiperf"


def run_aiperf(url: str, tokenizer: Path, c: int, n: int, out: Path) -> dict[str, Any]:
    """One `aiperf profile` run; its JSON export's headline figures."""
    with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as r:
        model = json.loads(r.read())["data"][0]["id"]  # the name the server answers to
    argv = [str(aiperf_bin()), "profile", "--model", model, "--url", url,
            "--endpoint-type", "chat", "--streaming", "--tokenizer", str(tokenizer),
            "--use-server-token-count", "--extra-inputs", "ignore_eos:true",
            "--concurrency", str(c), "--request-count", str(n),
            "--prompt-input-tokens-mean", str(PROMPT_LEN), "--prompt-input-tokens-stddev", "0",
            "--prompt-output-tokens-mean", str(MAX_TOKENS), "--prompt-output-tokens-stddev", "0",
            "--warmup-request-count", str(min(c, 4)), "--random-seed", "0",
            "--output-artifact-dir", str(out), "--ui-type", "none", "--no-server-metrics",
            "--no-gpu-telemetry"]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=1800, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"aiperf failed ({proc.returncode}): {proc.stderr.strip()[-400:]}")
    d = json.loads((out / "profile_export_aiperf.json").read_text())
    return {
        "command": common.cmdline(argv),
        "output_tok_s": d["output_token_throughput"]["avg"],
        "ttft_p50_ms": d["time_to_first_token"]["p50"],
        "itl_p50_ms": d["inter_token_latency"]["p50"],
        "itl_p99_ms": d["inter_token_latency"]["p99"],
        "requests": d["request_count"]["avg"],
        "isl_avg": d["input_sequence_length"]["avg"],
        "osl_avg": d["output_sequence_length"]["avg"],
    }


def run_ours(url: str, prompts: list[list[int]], c: int, n: int) -> dict[str, Any]:
    _, s = run_load(LoadSpec(base_url=url, prompts=prompts, max_tokens=MAX_TOKENS,
                             concurrency=c, num_requests=n,
                             extra_body=exact_length_body(MAX_TOKENS)))  # fmt: skip
    return {"output_tok_s": s.output_tok_s, "ttft_p50_ms": s.ttft_p50_s * 1e3,
            "itl_p50_ms": s.itl_p50_s * 1e3, "itl_p99_ms": s.itl_p99_s * 1e3,
            "requests": s.requests, "errors": s.errors}  # fmt: skip


def table(rows: list[dict[str, Any]]) -> list[str]:
    out = ["| server | c | client | output tok/s | TTFT p50 (ms) | ITL p50 / p99 (ms) |",
           "|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        out.append(f"| {r['server']} | {r['c']} | {r['client']} | {r['output_tok_s']:.1f} | "
                   f"{r['ttft_p50_ms']:.0f} | {r['itl_p50_ms']:.1f} / {r['itl_p99_ms']:.1f} |")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--engine", type=Path, default=None, help="default: pipeline build (bf16)")
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--requests", type=int, nargs="+", default=[4, 32])
    ap.add_argument("--shared-cores", action="store_true",
                    help="servers and clients on every core (default: the clients get the last)")
    ap.add_argument("--cpu-quota", type=float, default=None, metavar="CORES",
                    help="each server in a cgroup with this CPU quota (implies --shared-cores)")
    ap.add_argument("--llama-threads", type=int, default=None, metavar="N",
                    help="llama-server's -t (default: every server core; beside AIPerf's busy "
                    "timing service -t 2 ran ~1 tok/s on 2 cores, -t 1 is its better setting)")
    ap.add_argument("--ours-env", nargs="+", default=["-"], metavar="K=V[,K=V]",
                    help="our server once per value, with that environment added ('-': none)")
    args = ap.parse_args(argv)
    if args.cpu_quota is not None:
        args.shared_cores = True
    if len(args.levels) != len(args.requests):
        raise SystemExit("error: --levels and --requests need the same number of values")
    hf_dir = common.demo_checkpoint()
    gguf = common.gguf_for(hf_dir)
    for need in (aiperf_bin(), common.llama_server_bin(), gguf):
        if not need.exists():
            raise SystemExit(f"error: {need} is missing — run `make bench-peers` first")

    engine = args.engine or systems.build_engine(common.sh, hf_dir, 1)
    out = common.RESULTS / datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ-aiperf")
    out.mkdir(parents=True)
    tok = load_tokenizer(hf_dir)
    rows: list[dict[str, Any]] = []
    cores = sorted(os.sched_getaffinity(0))
    split = not args.shared_cores and len(cores) >= 2
    server_cores = set(cores[:-1]) if split else set(cores)
    specs = []
    for variant in args.ours_env:
        extra = {} if variant == "-" else dict(kv.split("=", 1) for kv in variant.split(","))
        spec = ours_spec(engine, common.free_port(), 1, "auto",
                         "ours-tp1" + ("" if variant == "-" else f" {variant}"))
        specs.append(dataclasses.replace(spec, env={**spec.env, **extra}))
    specs.append(llama_spec(gguf, common.free_port(),
                            threads=args.llama_threads or len(server_cores)))
    if split:
        specs = [pinned(s, server_cores) for s in specs]
        os.sched_setaffinity(0, {cores[-1]})  # this process's loadgen, and AIPerf under it
    placement = (f"servers on cores {sorted(server_cores)}, both clients on core {cores[-1]}"
                 if split else f"servers and clients on the same {len(cores)} cores")
    if args.cpu_quota is not None:
        placement += f"; each server in a cgroup with a CPU quota of {args.cpu_quota} cores"
    for spec in specs:
        with contextlib.ExitStack() as stack:
            if args.cpu_quota is not None:
                prefix = stack.enter_context(cpu_quota_cgroup(args.cpu_quota, spec.name))
                spec = in_cgroup(spec, prefix)
            running = stack.enter_context(serve(spec, out / "logs"))
            url = running.spec.base_url
            warm = make_prompts(tok, 8, PROMPT_LEN, seed=7)
            run_ours(url, warm, 4, 8)  # the same warm pass for both servers
            for c, n in zip(args.levels, args.requests, strict=True):
                prompts = make_prompts(tok, n, PROMPT_LEN, seed=100 + c)
                rows.append({"server": spec.name, "c": c, "client": "bench.loadgen",
                             **run_ours(url, prompts, c, n)})  # fmt: skip
                print(table(rows[-1:])[-1], flush=True)
                t = time.perf_counter()
                res = run_aiperf(url, hf_dir, c, n, out / f"aiperf-{spec.name.replace(' ', '_')}-c{c}")
                rows.append({"server": spec.name, "c": c, "client": "aiperf", **res,
                             "seconds": time.perf_counter() - t})  # fmt: skip
                print(table(rows[-1:])[-1], flush=True)
    text = "\n".join([
        f"# bench.loadgen against AIPerf ({out.name})", "",
        f"Engine {engine}; llama-server on {gguf.name}; {PROMPT_LEN}-token prompts, "
        f"{MAX_TOKENS} tokens out, streamed; {placement}. AIPerf's prompts are {PROMPT_LEN} "
        "tokens before the chat template (its ISL below counts the template too).", "",
        *table(rows), "",
        "AIPerf ISL / OSL per run: " + ", ".join(
            f"{r['server']} c={r['c']}: {r['isl_avg']:.0f} / {r['osl_avg']:.0f}"
            for r in rows if r["client"] == "aiperf"),
    ])  # fmt: skip
    (out / "aiperf.md").write_text(text + "\n")
    (out / "aiperf.json").write_text(json.dumps(rows, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
