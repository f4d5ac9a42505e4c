"""`make bench`: every system side by side in one run, on the same weights and prompts.

    python -m bench.run [--quick] [--engine-tp1 DIR] [--engine-tp2 DIR] [--skip NAME ...]

Order: floors first (nothing else running), transformers generate, then each served
system in turn: cold start (page cache dropped before launch when allowed), what warmup
buys (the first requests after ready, one at a time), then the concurrency sweep. A peer
that `make bench-peers` did not install is skipped with a note. Writes
bench/results/<UTC stamp>/ and refreshes bench/results/latest/.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
import traceback
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from bench import common, floors, hf_baseline, phases, report
from bench.servers import ServerSpec, llama_spec, ours_spec, serve, vllm_spec

SYSTEMS = ("ours-tp1", "ours-tp1-nowarmup", "ours-tp2", "llama-server", "vllm")
FULL = phases.Workload()
QUICK = phases.Workload(
    max_tokens=16, levels=(1, 4), requests_per_level=(2, 4), warm_requests=4,
    study_first=3, study_steady=3, study_max_tokens=8,
)  # fmt: skip


class Run:
    """Accumulates results, commands and notes; every external command goes through here."""

    def __init__(self, out: Path, quick: bool) -> None:
        self.out = out
        self.t0 = time.perf_counter()
        self.res: dict[str, Any] = {
            "started_utc": out.name, "quick": quick, "machine": common.machine_info(),
            "versions": {}, "commands": [], "notes": [], "systems": {},
        }  # fmt: skip

    def note(self, text: str) -> None:
        print(f"note: {text}", flush=True)
        self.res["notes"].append(text)

    def command(self, text: str) -> None:
        self.res["commands"].append(text)

    def sh(self, argv: list[str], timeout: float = 3600.0) -> str:
        self.command(common.cmdline(argv))
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
    v["llama.cpp peer"] = common.peer_status("llama")
    v["vllm peer"] = common.peer_status("vllm")
    return v


def build_engine(run: Run, hf_dir: Path, tp: int) -> Path:
    """`pipeline build` prints the engine directory last; a second build is a cache hit."""
    out = run.sh(
        [
            str(common.VENV_PYTHON),
            "-m",
            "pipeline",
            "build",
            str(hf_dir),
            "--tp",
            str(tp),
            "--dtype",
            "bfloat16",
        ]
    )
    return Path(out.strip().splitlines()[-1].strip())


def measure_system(
    run: Run, spec: ServerSpec, wl: phases.Workload, tok: Any, cold: bool, sweep: bool = True
) -> dict[str, Any]:
    entry: dict[str, Any] = {"status": "ok", "command": spec.command}
    run.command(spec.command)
    if cold:
        entry["page_cache_dropped"] = floors.drop_page_cache()
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
        entry["study"] = phases.warmup_study(running, wl, tok)
        n = wl.study_first + wl.study_steady
        run.command(f"# in process: bench.loadgen {spec.base_url} -c 1 -n {n} "
                    f"--max-tokens {wl.study_max_tokens} (warmup study)")  # fmt: skip
        if sweep:
            entry["sweep"] = phases.sweep(running, wl, tok)
            levels = " ".join(
                f"-c {c} -n {k}" for c, k in zip(wl.levels, wl.requests_per_level, strict=True)
            )
            run.command(f"# in process: bench.loadgen {spec.base_url} -c 16 -n "
                        f"{wl.warm_requests} --max-tokens 16 (warm pass), then {levels} "
                        f"--max-tokens {wl.max_tokens}")  # fmt: skip
    return entry


def _tp(name: str) -> int:
    return 2 if name == "ours-tp2" else 1


def specs(run: Run, args: argparse.Namespace, hf_dir: Path) -> list[tuple[ServerSpec | None, str]]:
    """(spec, why not) per system in the run order; spec None means skipped for `why`."""
    out: list[tuple[ServerSpec | None, str]] = []
    engines: dict[int, Path | str] = {}
    wanted = {_tp(n) for n in SYSTEMS if n.startswith("ours") and n not in args.skip}
    for tp, given in ((1, args.engine_tp1), (2, args.engine_tp2)):
        if tp not in wanted:
            engines[tp] = "not built (skipped)"
            continue
        try:
            engines[tp] = given or build_engine(run, hf_dir, tp)
        except (RuntimeError, subprocess.TimeoutExpired, OSError) as exc:
            engines[tp] = f"engine build failed: {exc}"
    for name in SYSTEMS:
        if name in args.skip:
            out.append((None, "skipped on the command line"))
            continue
        port = common.free_port()
        if name.startswith("ours"):
            tp = _tp(name)
            eng = engines[tp]
            if isinstance(eng, str):
                out.append((None, eng))
                continue
            warm = "none" if name.endswith("nowarmup") else "auto"
            out.append((ours_spec(eng, port, tp, warm, name), ""))
        elif name == "llama-server":
            gguf = common.gguf_for(hf_dir)
            ok = common.llama_server_bin().exists() and gguf.exists()
            why = (
                f"not installed: {common.peer_status('llama')}; gguf: {common.peer_status('gguf')}"
            )
            out.append((llama_spec(gguf, port), "") if ok else (None, why))
        else:
            ok = common.peer_status("vllm").startswith("ok") and common.vllm_python().exists()
            why = f"not installed: {common.peer_status('vllm')}"
            out.append((vllm_spec(hf_dir, port), "") if ok else (None, why))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke run: tiny counts, 2 levels")
    ap.add_argument("--engine-tp1", type=Path, default=None)
    ap.add_argument("--engine-tp2", type=Path, default=None)
    ap.add_argument("--hf-dir", type=Path, default=None, help="default: python -m pipeline.demo")
    ap.add_argument("--skip", nargs="*", default=[], choices=SYSTEMS)
    ap.add_argument("--warm-start", action="store_true", help="do not drop the page cache")
    ap.add_argument("--no-latest", action="store_true", help="leave bench/results/latest alone")
    args = ap.parse_args(argv)

    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    run = Run(common.RESULTS / stamp, args.quick)
    run.out.mkdir(parents=True, exist_ok=True)
    wl = QUICK if args.quick else FULL
    run.res["workload"] = asdict(wl)
    try:
        _measure(run, args, wl)
    except KeyboardInterrupt:
        run.note("interrupted; the report holds what was measured so far")
    finally:
        run.res["duration_s"] = time.perf_counter() - run.t0
        report.render(run.res, run.out)
        if not args.no_latest:
            report.update_latest(run.out)
    print(f"report: {run.out / 'report.md'}")
    return 0


def _measure(run: Run, args: argparse.Namespace, wl: phases.Workload) -> None:
    from bench.prompts import load_tokenizer

    run.command(f"{common.VENV_PYTHON} -m bench.run " + " ".join(sys.argv[1:]))
    hf_dir = args.hf_dir or common.demo_checkpoint()
    run.res["versions"] = versions(hf_dir)
    tok = load_tokenizer(hf_dir)
    plan = specs(run, args, hf_dir)
    engine_files = _engine_files(plan)
    print("floors", flush=True)
    run.res["floors"] = floors.measure_all(args.quick, engine_files, hf_dir)
    files = " ".join(str(f) for f in engine_files)
    run.command(f"# in process: bench.floors {'--quick ' if args.quick else ''}"
                f"--files {files} --model {hf_dir}")  # fmt: skip
    if not engine_files:
        run.note("no engine of ours to read: the storage-read floor was not measured")
    print("transformers generate", flush=True)
    base = hf_baseline.run_baseline(
        hf_dir, (1, 4) if args.quick else (1, 4, 16), ("bfloat16",), wl.prompt_len, wl.max_tokens
    )
    run.res["hf_baseline"] = [asdict(b) for b in base]
    run.command(f"# in process: bench.hf_baseline --hf-dir {hf_dir} --dtypes bfloat16 "
                f"--batches {' '.join(str(b.batch) for b in base)} --new-tokens {wl.max_tokens}")  # fmt: skip
    cold = not args.warm_start
    if cold and not floors.drop_page_cache():
        run.note("page cache cannot be dropped here: cold starts and storage reads are warm")
        cold = False
    for name, (spec, why) in zip(SYSTEMS, plan, strict=True):
        if spec is None:
            run.res["systems"][name] = {"status": f"skipped ({why[:200]})"}
            run.note(f"{name} skipped: {why}")
            continue
        try:
            entry = measure_system(
                run, spec, wl, tok, cold, sweep=not spec.name.endswith("nowarmup")
            )
        except Exception as exc:  # one failed system must not cost the others their numbers
            traceback.print_exc()
            entry = {"status": f"failed: {str(exc).splitlines()[0][:200]}", "command": spec.command}
        run.res["systems"][name] = entry
    run.note("the load generator runs on the same 2 cores as the server it measures")


def _engine_files(plan: list[tuple[ServerSpec | None, str]]) -> list[Path]:
    for spec, _ in plan:
        if spec is not None and spec.name == "ours-tp1":
            engine = Path(spec.argv[spec.argv.index("--engine") + 1])
            return sorted(p for p in engine.iterdir() if p.suffix in (".safetensors", ".pt2"))
    return []


if __name__ == "__main__":
    raise SystemExit(main())
