"""`make bench`: every system side by side in one run, on the same weights and prompts.

    python -m bench.run [--quick] [--quant] [--gemma3] [--spec] [--engine-tp1 DIR] [--engine-tp2 DIR] [--skip NAME ...]

Order: engines of ours built (or reused), floors (nothing else running), transformers
generate, then each served system in turn: cold start (page cache dropped before launch
when allowed), what warmup buys (the first requests after ready, one at a time), then the
concurrency sweep. Each system has a time budget (bench/systems.py), so the run ends within
40 minutes on 2 cores. A peer that `make bench-peers` did not install is skipped with a
note. `--quant` adds our int8_wo/int4_wo engines and llama-server on the Q8_0/Q4_0 GGUFs
they are built from (c=1 and c=16 only, ~20 minutes more). `--gemma3` adds Gemma 3 270M:
our TP=1 engine and llama-server on the wheels' Q4_K_M GGUF (c=1 and c=16, ~10 minutes
more; `make bench-peers` first). `--spec` adds our TP=1 and TP=2 engines served with
prompt-lookup speculation on (`--speculative ngram:4`, c=1 and c=16, ~8 minutes more), each
checked against its twin with speculation off. Writes bench/results/<UTC stamp>/ and refreshes bench/results/latest/. SIGTERM and
Ctrl-C stop the running server and still write the report.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, replace
from datetime import datetime, timezone
from pathlib import Path
from types import FrameType
from typing import Any

from bench import common, floors, hf_baseline, phases, report, systems
from bench.servers import ServerSpec, http_get, serve
from runtime.store.floors import drop_page_cache

FULL = phases.Workload()
QUICK = phases.Workload(
    max_tokens=16, levels=(1, 4), requests_per_level=(2, 4), warm_requests=4,
    study_first=3, study_steady=3, study_max_tokens=8,
)  # fmt: skip


class Run:
    """Accumulates results, commands and notes; every external command goes through here."""

    def __init__(self, out: Path, quick: bool, quant: bool = False, gemma3: bool = False,
                 spec: bool = False) -> None:
        self.out = out
        self.quick = quick
        self.t0 = time.perf_counter()
        self.deadline = (self.t0 + systems.TOTAL_BUDGET_S
                         + (systems.QUANT_BUDGET_S if quant else 0)
                         + (systems.GEMMA3_BUDGET_S if gemma3 else 0)
                         + (systems.SPEC_BUDGET_S if spec else 0))
        self.res: dict[str, Any] = {
            "started_utc": out.name, "quick": quick, "machine": common.machine_info(),
            "versions": {}, "commands": [], "notes": [], "systems": {},
        }  # fmt: skip

    def note(self, text: str) -> None:
        print(f"note: {text}", flush=True)
        self.res["notes"].append(text)

    def command(self, text: str) -> None:
        self.res["commands"].append(text)

    def sh(self, argv: list[str]) -> str:
        self.command(common.cmdline(argv))
        timeout = max(self.deadline - time.perf_counter(), 1.0)
        out = subprocess.run(argv, cwd=common.REPO, capture_output=True, text=True, timeout=timeout)
        if out.returncode != 0:
            raise RuntimeError(f"{argv[0]} failed ({out.returncode}): {out.stderr.strip()[-400:]}")
        return out.stdout


def versions(hf_dir: Path) -> dict[str, str]:
    import torch
    import transformers

    v = {"torch": torch.__version__, "transformers": transformers.__version__,
         "model": str(hf_dir)}  # fmt: skip
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=common.REPO,
                         capture_output=True, text=True, check=False)  # fmt: skip
    v["project commit"] = git.stdout.strip() or "uncommitted"
    if common.llama_server_bin().exists():
        ver = subprocess.run([str(common.llama_server_bin()), "--version"], capture_output=True,
                             text=True, check=False, timeout=30)  # fmt: skip
        v["llama-server"] = " ".join((ver.stdout + ver.stderr).split())[:160]
    v["llama.cpp peer"] = common.peer_status(common.llama_peer())
    v["vllm peer"] = common.peer_status("vllm")
    return v


def only_levels(wl: phases.Workload, levels: tuple[int, ...] | None) -> phases.Workload:
    """The workload restricted to `levels` (those of its own it has)."""
    if levels is None:
        return wl
    pairs = [(c, n) for c, n in zip(wl.levels, wl.requests_per_level, strict=True)
             if c in levels] or [(wl.levels[0], wl.requests_per_level[0])]  # fmt: skip
    return replace(wl, levels=tuple(c for c, _ in pairs),
                   requests_per_level=tuple(n for _, n in pairs))  # fmt: skip


def measure_system(
    run: Run, spec: ServerSpec, wl: phases.Workload, tok: Any, cold: bool, sweep: bool
) -> dict[str, Any]:
    budget = systems.QUICK_BUDGET_S if run.quick else systems.BUDGET_S[spec.name]
    deadline = min(time.perf_counter() + budget, run.deadline)
    spec = replace(spec, ready_timeout_s=min(spec.ready_timeout_s, phases.left(deadline)))
    entry: dict[str, Any] = {"status": "ok", "command": spec.command, "budget_s": budget}
    run.command(spec.command)
    if spec.name == "vllm":
        systems.fresh_vllm_cache()
        entry["compile_cache"] = "empty at launch (compiles before ready)"
    if cold:
        entry["page_cache_dropped"] = drop_page_cache()
    entry["loadavg_at_launch"] = common.loadavg()
    print(f"{spec.name}: launching", flush=True)
    with serve(spec, run.out / "logs") as running:
        entry["ready_s"] = running.ready_s
        print(f"{spec.name}: ready in {running.ready_s:.2f} s", flush=True)
        if spec.name.startswith("ours"):
            rep = phases.engine_report(running)
            entry["engine_report"] = rep
            entry["bars"] = phases.gate_bars(rep, running.ready_s)
            entry["load"] = phases.load_figures(rep)
        entry["study"] = phases.warmup_study(running, wl, tok, deadline)
        n = wl.study_first + wl.study_steady
        run.command(f"# in process: bench.loadgen {spec.base_url} -c 1 -n {n} "
                    f"--max-tokens {wl.study_max_tokens} (warmup study)")  # fmt: skip
        if sweep:
            entry["sweep"], cut = phases.sweep(running, wl, tok, deadline)
            pairs = zip(wl.levels, wl.requests_per_level, strict=True)
            levels = " ".join(f"-c {c} -n {k}" for c, k in pairs)
            run.command(f"# in process: bench.loadgen {spec.base_url} -c 16 -n "
                        f"{wl.warm_requests} --max-tokens 16 (warm pass), then {levels} "
                        f"--max-tokens {wl.max_tokens}")  # fmt: skip
            if cut:
                run.note(f"{spec.name}: levels {cut} not measured, its {budget:.0f} s ran out")
        if spec.name.startswith("ours"):
            entry["thread_policy"] = thread_policy(spec)
            print(f"{spec.name}: thread policy {entry['thread_policy']}", flush=True)
    return entry


def thread_policy(spec: ServerSpec) -> dict[str, float]:
    """The server's step-thread counters at the end of its run (/metrics): a probe that
    moved a quiet server to fewer threads explains a slow level."""
    status, body = http_get(f"{spec.base_url}/metrics")
    out: dict[str, float] = {}
    for line in body.decode(errors="replace").splitlines() if status == 200 else []:
        name, _, value = line.partition(" ")
        if name.startswith("llmserve_thread_") or name == "llmserve_intra_op_threads":
            try:
                out[name.removeprefix("llmserve_")] = float(value)
            except ValueError:
                continue
    return out


def _measure(run: Run, args: argparse.Namespace, wl: phases.Workload) -> None:
    from bench.prompts import load_tokenizer

    run.command(f"{common.VENV_PYTHON} -m bench.run " + " ".join(sys.argv[1:]))
    hf_dir = args.hf_dir or common.demo_checkpoint()
    run.res["versions"] = versions(hf_dir)
    tok = load_tokenizer(hf_dir)
    planned = systems.plan(hf_dir, args.skip, {1: args.engine_tp1, 2: args.engine_tp2}, run.sh)
    if args.quant:
        planned += systems.plan_quant(hf_dir, run.sh, args.skip)
    if args.gemma3:
        planned += systems.plan_gemma3(run.sh, args.skip)
    if args.spec:
        planned += systems.plan_spec(planned, args.skip)
    files = systems.engine_files(planned)
    print("floors", flush=True)
    run.res["floors"] = floors.measure_all(args.quick, files, hf_dir)
    run.command(f"# in process: bench.floors {'--quick ' if args.quick else ''}--files "
                f"{' '.join(str(f) for f in files)} --model {hf_dir}")  # fmt: skip
    if not files:
        run.note("no engine of ours to read: the storage-read floor was not measured")
    print("transformers generate", flush=True)
    batches = (1, 4) if args.quick else (1, 4, 16)
    base = hf_baseline.run_baseline(hf_dir, batches, ("bfloat16",), wl.prompt_len, wl.max_tokens)
    run.res["hf_baseline"] = [asdict(b) for b in base]
    run.command(f"# in process: bench.hf_baseline --hf-dir {hf_dir} --dtypes bfloat16 "
                f"--batches {' '.join(map(str, batches))} --new-tokens {wl.max_tokens}")  # fmt: skip
    cold = not args.warm_start
    if cold and not drop_page_cache():
        run.note("page cache cannot be dropped here: cold starts and storage reads are warm")
        cold = False
    for p in planned:
        if p.spec is None:
            run.res["systems"][p.name] = {"status": f"skipped: {p.why[:200]}"}
            run.note(f"{p.name} skipped: {p.why}")
        elif run.deadline - time.perf_counter() < 120.0:
            run.res["systems"][p.name] = {"status": "skipped: the run's time budget ran out"}
        else:
            try:
                own = load_tokenizer(p.tokenizer_dir) if p.tokenizer_dir else tok
                entry = measure_system(run, p.spec, only_levels(wl, p.levels), own, cold,
                                       p.sweep)
            except Exception as exc:  # one failed system must not cost the others their numbers
                traceback.print_exc()
                why = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
                entry = {"status": f"failed: {why}", "command": p.spec.command}
            run.res["systems"][p.name] = entry
    run.note("the load generator runs on the same 2 cores as the server it measures")


def _interrupt(signum: int, frame: FrameType | None) -> None:
    # Turn SIGTERM/SIGHUP into the same path as Ctrl-C: context managers stop the server.
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke run: tiny counts, 2 levels")
    ap.add_argument("--quant", action="store_true",
                    help="add int8_wo/int4_wo engines and llama-server on Q8_0/Q4_0 (issue 12)")
    ap.add_argument("--gemma3", action="store_true",
                    help="add Gemma 3 270M (ours TP=1, llama-server on the same GGUF; issue 35)")
    ap.add_argument("--spec", action="store_true",
                    help="add ours TP=1 and TP=2 with speculation on (ngram:4; issue 36)")
    ap.add_argument("--engine-tp1", type=Path, default=None, help="default: pipeline build")
    ap.add_argument("--engine-tp2", type=Path, default=None, help="default: pipeline build")
    ap.add_argument("--hf-dir", type=Path, default=None, help="default: python -m demo.model")
    ap.add_argument("--skip", nargs="*", default=[],
                    choices=(*systems.SYSTEMS, *systems.QUANT_SYSTEMS, *systems.GEMMA3_SYSTEMS,
                             *systems.SPEC_SYSTEMS))
    ap.add_argument("--warm-start", action="store_true", help="do not drop the page cache")
    ap.add_argument("--no-latest", action="store_true", help="leave bench/results/latest alone")
    args = ap.parse_args(argv)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)

    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    run = Run(common.RESULTS / stamp, args.quick, args.quant, args.gemma3, args.spec)
    run.out.mkdir(parents=True, exist_ok=True)
    wl = QUICK if args.quick else FULL
    run.res["workload"] = asdict(wl)
    code = 0
    try:
        _measure(run, args, wl)
    except KeyboardInterrupt as exc:
        run.note(f"interrupted ({exc or 'Ctrl-C'}); the report holds what was measured so far")
        code = 130
    except Exception as exc:  # setup failed (no checkpoint, ...): still write what we have
        traceback.print_exc()
        run.note(f"run failed: {exc}")
        code = 1
    finally:
        run.res["duration_s"] = time.perf_counter() - run.t0
        report.render(run.res, run.out)
        if not args.no_latest and not args.quick:
            report.update_latest(run.out)
    print(f"report: {run.out / 'report.md'}")
    return code


if __name__ == "__main__":
    raise SystemExit(main())
