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
from bench.common import RESULTS, md_table

HEADLINE_LEVEL = 16
CONTENDED = 0.05  # share of the machine's CPU taken by other work that makes a level suspect
OURS = ("ours-tp1", "ours-tp2")  # the servers of ours the cold-start targets are checked for


def _f(v: Any, fmt: str = ".1f", scale: float = 1.0, unit: str = "") -> str:
    if not isinstance(v, (int, float)) or math.isnan(v):
        return "n/a"
    return format(v * scale, fmt) + unit


def _ms(seconds: Any, fmt: str = ".0f") -> str:
    return _f(seconds, fmt, 1e3)


def _x(ratio: Any) -> str:
    return _f(ratio, ".2f", unit="x")


def _pct_of(v: Any, whole: Any) -> str:
    return _f(v / whole * 100, ".0f", unit="%")


def _systems(res: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return res.get("systems", {})


def _floors(res: dict[str, Any]) -> dict[str, Any]:
    return res.get("floors", {})


def _level(system: dict[str, Any], c: int) -> dict[str, Any]:
    """A system's sweep measurements at concurrency c; {} if that level was not measured."""
    return next((s for s in system.get("sweep", []) if s["concurrency"] == c), {})


def _tok_s(system: dict[str, Any], c: int) -> Any:
    return _level(system, c).get("output_tok_s", math.nan)


def _max_ratio(study: dict[str, Any] | None, key: str = "e2e_ratio") -> float:
    vals = [v for v in (study or {}).get(key, []) if isinstance(v, (int, float))]
    return max(vals) if vals else math.nan


def headline(res: dict[str, Any]) -> list[str]:
    f16 = _floors(res).get("decode_floor_bf16", {}).get("batch16_tok_s", math.nan)
    c = HEADLINE_LEVEL
    header = ["system", "launch to ready (s)", f"tok/s @{c}", f"TTFT p50 @{c} (ms)",
              f"ITL p50 @{c} (ms)", "first-10 worst / steady", "% of decode floor @16"]  # fmt: skip
    rows: list[list[Any]] = []
    for name, sys_ in _systems(res).items():
        if sys_.get("status") != "ok":
            rows.append([name, sys_.get("status")])  # the other cells stay empty
            continue
        lv = _level(sys_, c)
        tok = lv.get("output_tok_s", math.nan)
        rows.append([
            name, _f(sys_.get("ready_s"), ".2f"), _f(tok), _ms(lv.get("ttft_p50_s")),
            _ms(lv.get("itl_p50_s"), ".1f"), _x(_max_ratio(sys_.get("study"))),
            _pct_of(tok, f16) if f16 else "n/a",
        ])  # fmt: skip
    return md_table(header, rows)


def _ratio_row(target: str, num: Any, den: Any, need: float, unit: str = "tok/s") -> list[str]:
    """[target, measured, verdict] for num / den >= need; n/a when either was not measured."""
    if not isinstance(num, (int, float)) or not isinstance(den, (int, float)) or not den:
        return [target, "n/a", "not measured"]
    r = num / den
    return [target, f"{num:.1f} / {den:.1f} {unit} = {r:.2f}x", "met" if r >= need else "missed"]


def targets(res: dict[str, Any]) -> list[str]:
    """The targets checked against this run: issue 31's (every CPU target: each weight kind
    against llama-server on the same weights, int4 against our bf16, the first request near
    steady), issue 11's (TP=2 against TP=1), issue 12's (int8 and int4 against our bf16)
    and issue 5's (ready in 10 s, the first 10 requests near steady)."""
    sys_ = _systems(res)

    def tok(name: str, c: int) -> Any:
        return _level(sys_.get(name, {}), c).get("output_tok_s")

    rows = []
    for ours, peer in (("ours-tp1", "llama-server"), ("ours-tp1-int8", "llama-server-q8_0"),
                       ("ours-tp1-int4", "llama-server-q4_0")):  # fmt: skip
        if ours in sys_ or ours == "ours-tp1":
            for c, need in ((1, 1.1), (16, 1.5)):
                rows.append(_ratio_row(f"{ours} c={c} >= {need}x {peer}", tok(ours, c),
                                       tok(peer, c), need))  # fmt: skip
    rows += [
        _ratio_row("TP=2 c=1 >= 0.9x TP=1", tok("ours-tp2", 1), tok("ours-tp1", 1), 0.9),
        _ratio_row("TP=2 c=16 >= 0.9x TP=1", tok("ours-tp2", 16), tok("ours-tp1", 16), 0.9),
    ]  # fmt: skip
    if any(n in sys_ for n in ("ours-tp1-int8", "ours-tp1-int4")):
        for ours, need in (("ours-tp1-int8", 1.6), ("ours-tp1-int4", 2.0), ("ours-tp1-int4", 2.2)):
            rows.append(_ratio_row(f"{ours} c=1 >= {need}x ours-tp1 (bf16)", tok(ours, 1),
                                   tok("ours-tp1", 1), need))  # fmt: skip
    if "ours-gemma3-tp1" in sys_:
        for c, need in ((1, 1.1), (16, 1.5)):  # issue 31's speed targets, on issue 35's model
            rows.append(_ratio_row(f"ours-gemma3-tp1 c={c} >= {need}x llama-server-gemma3",
                                   tok("ours-gemma3-tp1", c), tok("llama-server-gemma3", c),
                                   need))  # fmt: skip
    for name in ("ours-tp1-ngram", "ours-tp2-ngram"):  # issue 36: speculation never costs
        if name in sys_:
            off = name.removesuffix("-ngram")
            for c in (1, 16):
                rows.append(_ratio_row(f"{name} c={c} >= 0.95x {off} (speculation off)",
                                       tok(name, c), tok(off, c), 0.95))  # fmt: skip
    for name in OURS:
        s = sys_.get(name, {})
        if s.get("status") != "ok":
            continue
        r, m = s.get("ready_s"), _max_ratio(s.get("study"))
        if r is not None:
            rows.append([f"{name} launch to ready < 10 s", f"{r:.1f} s", "met" if r < 10 else "missed"])
        first = ((s.get("study") or {}).get("e2e_ratio") or [None])[0]
        if isinstance(first, (int, float)):
            rows.append([f"{name} first request within 1.1x of steady (warmup auto)", _x(first),
                         "met" if first <= 1.1 else "missed"])  # fmt: skip
        if not math.isnan(m):
            rows.append([f"{name} first 10 requests within 1.1x of steady (warmup auto)", _x(m),
                         "met" if m <= 1.1 else "missed"])  # fmt: skip
    nowarm = _max_ratio(sys_.get("ours-tp1-nowarmup", {}).get("study"))
    return [
        *md_table(["target", "measured", "verdict"], rows),
        f"\nWithout warmup (ours-tp1-nowarmup) the worst of the first 10 requests was "
        f"{_x(nowarm)} the steady-state median.",
    ]


def _sweep_table(res: dict[str, Any]) -> list[str]:
    header = ["system", "concurrency", "requests", "errors", "length mismatches", "output tok/s",
              "TTFT p50 / p99 (ms)", "ITL p50 / p99 (ms)", "e2e p50 (s)",
              "other work's CPU share"]  # fmt: skip

    def p50_p99(s: dict[str, Any], metric: str, fmt: str) -> str:
        return f"{_ms(s[f'{metric}_p50_s'], fmt)} / {_ms(s[f'{metric}_p99_s'], fmt)}"

    rows = (
        [name, s["concurrency"], s["requests"], s["errors"], s["token_count_mismatches"],
         _f(s["output_tok_s"]), p50_p99(s, "ttft", ".0f"), p50_p99(s, "itl", ".1f"),
         _f(s["e2e_p50_s"], ".2f"), _f(s.get("foreign_cpu_share"), ".0%")]
        for name, sys_ in _systems(res).items()
        for s in sys_.get("sweep", [])
    )  # fmt: skip
    return md_table(header, rows)


def _floors_section(res: dict[str, Any]) -> list[str]:
    fl = _floors(res)
    if not fl:
        return ["Floors were not measured."]

    def gbs(key: str) -> str:
        return json.dumps({k: round(v, 2) for k, v in fl[key].items()})

    out = [
        f"- memory read bandwidth: {gbs('memory_read_gbs')} GB/s",
        f"- host memory copy (pre-faulted destination): {gbs('memory_copy_gbs')} GB/s",
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
    dfl = _floors(res).get("decode_floor_bf16")
    if not dfl:
        return ["No decode floor (model not measured)."]
    rows = [(n, _tok_s(s, 1), _tok_s(s, 16)) for n, s in _systems(res).items() if s.get("sweep")]
    base = {b["batch"]: b.get("output_tok_s", math.nan) for b in res.get("hf_baseline", [])
            if b["dtype"] == "bfloat16"}  # fmt: skip
    rows.append(("transformers generate", base.get(1, math.nan), base.get(16, math.nan)))
    return md_table(
        ["system", "c=1 tok/s", "% of batch-1 floor", "c=16 tok/s", "% of batch-16 floor"],
        ([n, _f(t1), _pct_of(t1, dfl["batch1_tok_s"]), _f(t16), _pct_of(t16, dfl["batch16_tok_s"])]
         for n, t1, t16 in rows),
    )  # fmt: skip


def _cold_start(res: dict[str, Any]) -> list[str]:
    systems = _systems(res)
    lines = md_table(
        ["system", "launch to ready (s)", "page cache dropped", "load average at launch", "note"],
        ([n, _f(s.get("ready_s"), ".2f"), s.get("page_cache_dropped", False),
          s.get("loadavg_at_launch", ""), s.get("compile_cache", "")]
         for n, s in systems.items() if s.get("status") == "ok"),
    )  # fmt: skip
    st = _floors(res).get("storage_read")
    cp = _floors(res).get("memory_copy_gbs", {})
    for n, s in systems.items():
        if s.get("bars"):
            gates = ([b["name"], f"{b['start']:.3f}", f"{b['seconds']:.3f}"] for b in s["bars"])
            lines += ["", f"Gates of {n}:", "", *md_table(["gate", "start (s)", "seconds"], gates)]
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
    studies = {n: s["study"] for n, s in _systems(res).items() if s.get("study")}
    return md_table(
        ["system", "steady e2e median (s)", "e2e ratio of requests 1..10", "worst TTFT ratio"],
        ([n, _f(st["steady_median_e2e_s"], ".3f"), " ".join(_f(v, ".2f") for v in st["e2e_ratio"]),
          _x(_max_ratio(st, "ttft_ratio"))] for n, st in studies.items()),
    )  # fmt: skip


def contention_notes(res: dict[str, Any]) -> list[str]:
    """Levels measured while other processes took a noticeable share of the CPU."""
    cores = int(res.get("machine", {}).get("cores") or 1)
    busy = [
        f"{n} c={lv['concurrency']} ({lv['foreign_cpu_share']:.0%})"
        for n, s in _systems(res).items()
        for lv in s.get("sweep", [])
        if lv.get("foreign_cpu_share", 0.0) > CONTENDED
    ]
    if not busy:
        return []
    return [
        f"CONTENDED: other processes took more than {CONTENDED:.0%} of the {cores} cores' time "
        "while these were measured (their numbers are low): " + ", ".join(busy)
    ]


def _blocks(*blocks: str | list[str]) -> str:
    """Markdown from blocks of lines (a str is a one-line block), each followed by a blank line."""
    return "\n".join(line for b in blocks for line in ([b] if isinstance(b, str) else b) + [""])


def render(res: dict[str, Any], out: Path) -> str:
    pngs = charts.render_all(res, out, HEADLINE_LEVEL)
    res.setdefault("notes", [])
    res["notes"] = [n for n in res["notes"] if not n.startswith("CONTENDED")]
    res["notes"] += contention_notes(res)
    m, v = res.get("machine", {}), res.get("versions", {})
    text = _blocks(
        f"# Benchmark report {res.get('started_utc', '')}",
        f"Mode: {'quick (smoke run; numbers are not comparable)' if res.get('quick') else 'full'}; "
        f"duration {_f(res.get('duration_s'), '.0f')} s.",
        "## Headline",
        headline(res),
        "Targets:",
        targets(res),
        "## Machine and versions",
        [f"- {k}: {val}" for k, val in {**m, **v}.items()],
        f"Workload: `{json.dumps(res.get('workload', {}))}`",
        "## 1. Served throughput and latency",
        _sweep_table(res),
        "transformers `generate` (offline, no server):",
        _baseline_table(res),
        "## 2. Cold start",
        _cold_start(res),
        "## 3. What warmup buys",
        _warmup_table(res),
        "## 4. The limit",
        _floors_section(res),
        _distance(res),
        "## Charts",
        [f"![{p}]({p})" for p in pngs],
        "## Notes",
        [f"- {n}" for n in res.get("notes", [])],
        "## Commands run",
        ["```", *res.get("commands", []), "```"],
    )
    (out / "report.md").write_text(text)
    (out / "results.json").write_text(json.dumps(res, indent=1, default=str))
    return text


def _baseline_table(res: dict[str, Any]) -> list[str]:
    from bench.hf_baseline import GenerateResult, format_table

    rows = [GenerateResult(**b) for b in res.get("hf_baseline", [])]
    return format_table(rows).splitlines() if rows else ["not run"]


def update_latest(out: Path) -> Path:
    """Copy report.md and the PNGs (not the raw JSON or logs) to bench/results/latest,
    replacing the previous run's; the other results kept there (quant.md, ready.md, ...,
    written by other benches) stay."""
    latest = RESULTS / "latest"
    latest.mkdir(parents=True, exist_ok=True)
    for old in [latest / "report.md", latest / "SOURCE", *latest.glob("*.png")]:
        old.unlink(missing_ok=True)
    for p in [out / "report.md", *sorted(out.glob("*.png"))]:
        shutil.copy2(p, latest / p.name)
    (latest / "SOURCE").write_text(f"{out.name}\n")
    return latest


if __name__ == "__main__":
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else RESULTS / "latest" / "results.json"
    data = json.loads(path.read_text())
    print(render(data, path.parent))
