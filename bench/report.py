"""Turn one run's results into bench/results/<UTC stamp>/report.md + PNGs, and refresh latest/.

python -m bench.report bench/results/<stamp>/results.json   (re-render a finished run)
"""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path
from typing import Any

from bench import charts
from bench.common import RESULTS

HEADLINE_LEVEL = 16
CONTENDED = 0.05  # share of the machine's CPU taken by other work that makes a level suspect


def _f(v: Any, fmt: str = ".1f", scale: float = 1.0, unit: str = "") -> str:
    if not isinstance(v, (int, float)) or math.isnan(v):
        return "n/a"
    return format(v * scale, fmt) + unit


def _level(system: dict[str, Any], c: int) -> dict[str, Any] | None:
    return next((s for s in system.get("sweep", []) if s["concurrency"] == c), None)


def _max_ratio(study: dict[str, Any] | None, key: str = "e2e_ratio") -> float:
    vals = [v for v in (study or {}).get(key, []) if isinstance(v, (int, float))]
    return max(vals) if vals else math.nan


def headline(res: dict[str, Any]) -> list[str]:
    floor = res.get("floors", {}).get("decode_floor_bf16", {})
    f16 = floor.get("batch16_tok_s", math.nan)
    lines = [
        f"| system | launch to ready (s) | tok/s @{HEADLINE_LEVEL} | TTFT p50 @{HEADLINE_LEVEL} (ms) "
        f"| ITL p50 @{HEADLINE_LEVEL} (ms) | first-10 worst / steady | % of decode floor @16 |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, sys_ in res.get("systems", {}).items():
        if sys_.get("status") != "ok":
            lines.append(f"| {name} | {sys_.get('status')} | | | | | |")
            continue
        lv = _level(sys_, HEADLINE_LEVEL) or {}
        tok = lv.get("output_tok_s", math.nan)
        lines.append(
            f"| {name} | {_f(sys_.get('ready_s'), '.2f')} | {_f(tok)} "
            f"| {_f(lv.get('ttft_p50_s'), '.0f', 1e3)} | {_f(lv.get('itl_p50_s'), '.1f', 1e3)} "
            f"| {_f(_max_ratio(sys_.get('study')), '.2f', unit='x')} | {_f(tok / f16 * 100 if f16 else math.nan, '.0f', unit='%')} |"
        )
    return lines


def targets(res: dict[str, Any]) -> list[str]:
    """The team's targets (issue 5), checked against this run for each server of ours."""
    sys_ = res.get("systems", {})
    llama = (_level(sys_.get("llama-server", {}), HEADLINE_LEVEL) or {}).get("output_tok_s")
    nowarm = _max_ratio(sys_.get("ours-tp1-nowarmup", {}).get("study"))
    lines = ["| target | " + " | ".join(n for n in sys_ if n in ("ours-tp1", "ours-tp2")) + " |"]
    ours = [sys_[n] for n in ("ours-tp1", "ours-tp2") if n in sys_]
    if not ours:
        return ["No server of ours in this run."]
    lines.append("|---|" + "---|" * len(ours))

    def row(label: str, cell: Any) -> str:
        return f"| {label} | " + " | ".join(cell(s) for s in ours) + " |"

    def tput(s: dict[str, Any]) -> str:
        t = (_level(s, HEADLINE_LEVEL) or {}).get("output_tok_s")
        if t is None or llama is None:
            return "n/a"
        return f"{'met' if t >= llama else 'missed'} ({t:.0f} vs {llama:.0f} tok/s)"

    def ready(s: dict[str, Any]) -> str:
        r = s.get("ready_s")
        return "n/a" if r is None else f"{'met' if r < 10 else 'missed'} ({r:.1f} s)"

    def warm(s: dict[str, Any]) -> str:
        m = _max_ratio(s.get("study"))
        return "n/a" if math.isnan(m) else f"{'met' if m <= 1.1 else 'missed'} ({m:.2f}x)"

    lines += [
        row(f"throughput @{HEADLINE_LEVEL} >= llama-server", tput),
        row("launch to ready < 10 s", ready),
        row("first 10 requests within 1.1x of steady state (warmup auto)", warm),
        f"\nWithout warmup (ours-tp1-nowarmup) the worst of the first 10 requests was "
        f"{_f(nowarm, '.2f', unit='x')} the steady-state median.",
    ]
    return lines


def _sweep_table(res: dict[str, Any]) -> list[str]:
    lines = [
        "| system | concurrency | requests | errors | length mismatches | output tok/s "
        "| TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) | e2e p50 (s) | other work's CPU share |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, sys_ in res.get("systems", {}).items():
        for s in sys_.get("sweep", []):
            lines.append(
                f"| {name} | {s['concurrency']} | {s['requests']} | {s['errors']} "
                f"| {s['token_count_mismatches']} | {_f(s['output_tok_s'])} "
                f"| {_f(s['ttft_p50_s'], '.0f', 1e3)} / {_f(s['ttft_p99_s'], '.0f', 1e3)} "
                f"| {_f(s['itl_p50_s'], '.1f', 1e3)} / {_f(s['itl_p99_s'], '.1f', 1e3)} "
                f"| {_f(s['e2e_p50_s'], '.2f')} | {_f(s.get('foreign_cpu_share'), '.0%')} |"
            )
    return lines


def _floors_section(res: dict[str, Any]) -> list[str]:
    fl = res.get("floors", {})
    if not fl:
        return ["Floors were not measured."]
    out = [
        f"- memory read bandwidth: {json.dumps({k: round(v, 2) for k, v in fl['memory_read_gbs'].items()})} GB/s",
        f"- host memory copy (pre-faulted destination): {json.dumps({k: round(v, 2) for k, v in fl['memory_copy_gbs'].items()})} GB/s",
        f"- matmul rate: bfloat16 {_f(fl['bf16_matmul_tflops'], '.3f')} TFLOP/s, "
        f"float32 {_f(fl['fp32_matmul_tflops'], '.3f')} TFLOP/s ({fl['threads']} threads)",
    ]
    if "storage_read" in fl:
        st = fl["storage_read"]
        out.append(
            f"- sequential read of the engine files: {st['bytes'] / 1e6:.1f} MB in "
            f"{st['seconds']:.3f} s = {st['gbs']:.2f} GB/s, page cache {st['page_cache']}"
        )
    dfl = fl.get("decode_floor_bf16")
    if dfl:
        out.append(
            f"- decode floor (bfloat16, {dfl['params'] / 1e6:.1f} M matmul parameters, "
            f"{dfl['weight_bytes'] / 1e6:.0f} MB read per step): batch 1 "
            f"{dfl['batch1_tok_s']:.1f} tok/s (bandwidth bound); batch 16 "
            f"{dfl['batch16_tok_s']:.1f} tok/s ({dfl['batch16_bound']} bound)"
        )
    return out


def _distance(res: dict[str, Any]) -> list[str]:
    dfl = res.get("floors", {}).get("decode_floor_bf16")
    if not dfl:
        return ["No decode floor (model not measured)."]
    lines = ["| system | c=1 tok/s | % of batch-1 floor | c=16 tok/s | % of batch-16 floor |",
             "|---|---|---|---|---|"]  # fmt: skip
    rows = [(n, _level(s, 1), _level(s, 16)) for n, s in res.get("systems", {}).items()
            if s.get("sweep")]  # fmt: skip
    base = {b["batch"]: b for b in res.get("hf_baseline", []) if b["dtype"] == "bfloat16"}
    rows.append(("transformers generate", base.get(1), base.get(16)))
    for name, l1, l16 in rows:
        t1 = (l1 or {}).get("output_tok_s", math.nan)
        t16 = (l16 or {}).get("output_tok_s", math.nan)
        lines.append(
            f"| {name} | {_f(t1)} | {_f(t1 / dfl['batch1_tok_s'] * 100, '.0f', unit='%')} "
            f"| {_f(t16)} | {_f(t16 / dfl['batch16_tok_s'] * 100, '.0f', unit='%')} |"
        )
    return lines


def _cold_start(res: dict[str, Any]) -> list[str]:
    lines = [
        "| system | launch to ready (s) | page cache dropped | load average at launch | note |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {n} | {_f(s.get('ready_s'), '.2f')} | {s.get('page_cache_dropped', False)} "
        f"| {s.get('loadavg_at_launch', '')} | {s.get('compile_cache', '')} |"
        for n, s in res.get("systems", {}).items()
        if s.get("status") == "ok"
    ]
    st = res.get("floors", {}).get("storage_read")
    cp = res.get("floors", {}).get("memory_copy_gbs", {})
    for n, s in res.get("systems", {}).items():
        if s.get("bars"):
            lines += ["", f"Gates of {n}:", "", "| gate | start (s) | seconds |", "|---|---|---|"]
            lines += [f"| {b['name']} | {b['start']:.3f} | {b['seconds']:.3f} |" for b in s["bars"]]
        load = s.get("load")
        if load and st and cp:
            disk_floor = load["bytes"] / (st["gbs"] * 1e9)
            copy_floor = load["bytes"] / (max(cp.values()) * 1e9)
            lines.append(
                f"\nLoad gate of {n}: {load['bytes'] / 1e6:.1f} MB in {load['seconds']:.3f} s "
                f"({load['bytes'] / load['seconds'] / 1e9:.2f} GB/s); floors: storage read "
                f"{disk_floor:.3f} s ({st['page_cache']}) -> load/floor "
                f"{load['seconds'] / disk_floor:.1f}x; host copy {copy_floor:.3f} s -> "
                f"load/floor {load['seconds'] / copy_floor:.1f}x. Slowest rank's own read: "
                f"{_f(load.get('read_s'), '.3f')} s; the server's start-up probe: storage "
                f"{load.get('server_storage_gbps')} GB/s ({load.get('server_storage_mode')}), "
                f"host copy {load.get('server_host_copy_gbps')} GB/s"
            )
    return lines


def _warmup_table(res: dict[str, Any]) -> list[str]:
    lines = ["| system | steady e2e median (s) | e2e ratio of requests 1..10 | worst TTFT ratio |",
             "|---|---|---|---|"]  # fmt: skip
    for n, s in res.get("systems", {}).items():
        st = s.get("study")
        if not st:
            continue
        ratios = " ".join(_f(v, ".2f") for v in st["e2e_ratio"])
        lines.append(
            f"| {n} | {_f(st['steady_median_e2e_s'], '.3f')} | {ratios} "
            f"| {_f(_max_ratio(st, 'ttft_ratio'), '.2f', unit='x')} |"
        )
    return lines


def contention_notes(res: dict[str, Any]) -> list[str]:
    """Levels measured while other processes took a noticeable share of the CPU."""
    cores = int(res.get("machine", {}).get("cores") or 1)
    busy = [
        f"{n} c={lv['concurrency']} ({lv['foreign_cpu_share']:.0%})"
        for n, s in res.get("systems", {}).items()
        for lv in s.get("sweep", [])
        if lv.get("foreign_cpu_share", 0.0) > CONTENDED
    ]
    if not busy:
        return []
    return [
        f"CONTENDED: other processes took more than {CONTENDED:.0%} of the {cores} cores' time "
        "while these were measured (their numbers are low): " + ", ".join(busy)
    ]


def render(res: dict[str, Any], out: Path) -> str:
    pngs = charts.render_all(res, out, HEADLINE_LEVEL)
    res.setdefault("notes", [])
    res["notes"] = [n for n in res["notes"] if not n.startswith("CONTENDED")]
    res["notes"] += contention_notes(res)
    m, v = res.get("machine", {}), res.get("versions", {})
    md = [
        f"# Benchmark report {res.get('started_utc', '')}",
        "",
        f"Mode: {'quick (smoke run; numbers are not comparable)' if res.get('quick') else 'full'}; "
        f"duration {_f(res.get('duration_s'), '.0f')} s.",
        "",
        "## Headline",
        "",
        *headline(res),
        "",
        "Targets:",
        "",
        *targets(res),
        "",
        "## Machine and versions",
        "",
        *[f"- {k}: {val}" for k, val in {**m, **v}.items()],
        "",
        f"Workload: `{json.dumps(res.get('workload', {}))}`",
        "",
        "## 1. Served throughput and latency",
        "",
        *_sweep_table(res),
        "",
        "transformers `generate` (offline, no server):",
        "",
        *_baseline_table(res),
        "",
        "## 2. Cold start",
        "",
        *_cold_start(res),
        "",
        "## 3. What warmup buys",
        "",
        *_warmup_table(res),
        "",
        "## 4. The limit",
        "",
        *_floors_section(res),
        "",
        *_distance(res),
        "",
        "## Charts",
        "",
        *[f"![{p}]({p})" for p in pngs],
        "",
        "## Notes",
        "",
        *[f"- {n}" for n in res.get("notes", [])],
        "",
        "## Commands run",
        "",
        "```",
        *res.get("commands", []),
        "```",
        "",
    ]
    text = "\n".join(md)
    (out / "report.md").write_text(text)
    (out / "results.json").write_text(json.dumps(res, indent=1, default=str))
    return text


def _baseline_table(res: dict[str, Any]) -> list[str]:
    from bench.hf_baseline import GenerateResult, format_table

    rows = [GenerateResult(**b) for b in res.get("hf_baseline", [])]
    return format_table(rows).splitlines() if rows else ["not run"]


def update_latest(out: Path) -> Path:
    """Copy report.md and the PNGs (not the raw JSON or logs) to bench/results/latest."""
    latest = RESULTS / "latest"
    if latest.exists():
        shutil.rmtree(latest)
    latest.mkdir(parents=True)
    for p in [out / "report.md", *sorted(out.glob("*.png"))]:
        shutil.copy2(p, latest / p.name)
    (latest / "SOURCE").write_text(f"{out.name}\n")
    return latest


if __name__ == "__main__":
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else RESULTS / "latest" / "results.json"
    data = json.loads(path.read_text())
    print(render(data, path.parent))
