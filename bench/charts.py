"""The report's PNG charts (matplotlib, Agg): small files, readable at a glance."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

DPI = 80
SIZE = (8.0, 4.2)


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def waterfall(
    bars: list[dict[str, Any]],
    floors: dict[str, float],
    others: dict[str, float],
    path: Path,
    title: str = "Cold start: launch to ready",
) -> Path:
    """Our gates as bars on a time axis; floors as marks on the load bar; peers' ready times."""
    fig, ax = plt.subplots(figsize=SIZE)
    names = [b["name"] for b in bars]
    for i, b in enumerate(bars):
        ax.barh(i, b["seconds"], left=b["start"], color="tab:blue")
        ax.text(b["start"] + b["seconds"], i, f" {b['seconds']:.2f} s", va="center", fontsize=8)
    load_i = next((i for i, n in enumerate(names) if n == "load"), None)
    if load_i is not None:
        start = bars[load_i]["start"]
        for (label, secs), color in zip(floors.items(), ("tab:red", "tab:green"), strict=False):
            ax.plot([start + secs] * 2, [load_i - 0.4, load_i + 0.4], color=color, lw=2,
                    label=f"floor: {label} ({secs:.2f} s)")  # fmt: skip
    for (label, secs), style in zip(others.items(), ("--", ":", "-."), strict=False):
        ax.axvline(secs, color="gray", ls=style, label=f"{label} ready: {secs:.1f} s")
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("seconds since launch")
    ax.set_title(title)
    if floors or others:
        ax.legend(fontsize=7, loc="lower right")
    return _save(fig, path)


def rss_curve(series: list[dict[str, Any]], path: Path, mid_s: float | None = None,
              title: str = "Soak: RSS of each rank's serving process") -> Path:
    """VmRSS (MiB) of each rank over the soak; a mark at its middle, where the halves meet."""
    fig, ax = plt.subplots(figsize=SIZE)
    ranks = sorted({int(r) for row in series for r in row["rss_kib"]})
    for rank in ranks:
        pts = [(row["t"], row["rss_kib"].get(rank, row["rss_kib"].get(str(rank))))
               for row in series]
        pts = [(t, v / 1024) for t, v in pts if v is not None]
        ax.plot([t for t, _ in pts], [v for _, v in pts], marker=".", label=f"rank {rank}")
    if mid_s is not None:
        ax.axvline(mid_s, color="gray", ls=":", label="middle of the traffic")
    ax.set_xlabel("seconds of traffic")
    ax.set_ylabel("RSS, MiB")
    ax.set_title(title)
    ax.legend(fontsize=7, loc="lower right")
    return _save(fig, path)


def throughput(
    series: dict[str, list[tuple[int, float]]],
    baseline: list[tuple[int, float]],
    path: Path,
    floor: list[tuple[int, float]] | None = None,
) -> Path:
    """Output tokens/s against concurrency, one line per system; transformers as a dashed line;
    the decode floor (best possible on this machine) as red marks."""
    fig, ax = plt.subplots(figsize=SIZE)
    if floor:
        ax.plot([p[0] for p in floor], [p[1] for p in floor], ls="none", marker="_", ms=30,
                mew=2, color="tab:red", label="decode floor (bandwidth / matmul rate)")  # fmt: skip
    for name, pts in series.items():
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    if baseline:
        ax.plot([p[0] for p in baseline], [p[1] for p in baseline], ls="--", marker="x",
                color="gray", label="transformers generate (batch)")  # fmt: skip
    ax.set_xscale("log", base=2)
    ticks = sorted({p[0] for pts in [*series.values(), baseline, floor or []] for p in pts})
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.set_ylim(bottom=0)
    ax.set_xlabel("concurrent requests (transformers: batch size)")
    ax.set_ylabel("output tokens/s")
    ax.set_title("Served throughput against concurrency")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    return _save(fig, path)


def latency(rows: dict[str, dict[str, float]], path: Path, concurrency: int) -> Path:
    """TTFT and ITL p50/p99 per system at one concurrency (grouped bars, log scale, ms)."""
    metrics = ("ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s")
    fig, ax = plt.subplots(figsize=SIZE)
    names = list(rows)
    width = 0.8 / max(len(names), 1)
    for j, name in enumerate(names):
        vals = [rows[name].get(m, math.nan) * 1e3 for m in metrics]
        xs = [i + j * width for i in range(len(metrics))]
        ax.bar(xs, vals, width=width, label=name)
    ax.set_xticks([i + width * (len(names) - 1) / 2 for i in range(len(metrics))],
                  ["TTFT p50", "TTFT p99", "ITL p50", "ITL p99"])  # fmt: skip
    ax.set_yscale("log")
    ax.set_ylabel("milliseconds")
    ax.set_title(f"Latency percentiles at {concurrency} concurrent requests")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def warmup(ratios: dict[str, list[float | None]], path: Path) -> Path:
    """Each of the first requests after ready over the steady-state median, per system."""
    fig, ax = plt.subplots(figsize=SIZE)
    for name, vals in ratios.items():
        pts = [(i + 1, v) for i, v in enumerate(vals) if v is not None]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    ax.axhline(1.1, color="gray", ls="--", label="target 1.1x")
    ax.set_xlabel("request number after ready")
    ax.set_ylabel("latency / steady-state median")
    ax.set_title("What warmup buys")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def render_all(res: dict[str, Any], out: Path, headline_level: int = 16) -> list[str]:
    """Every chart a run's results allow; returns the PNG file names."""
    made: list[str] = []
    systems = res.get("systems", {})
    ours = next((s for n, s in systems.items() if n.startswith("ours") and s.get("bars")), None)
    if ours:
        floors: dict[str, float] = {}
        load, fl = ours.get("load"), res.get("floors", {})
        if load and "storage_read" in fl:
            floors["storage read"] = load["bytes"] / (fl["storage_read"]["gbs"] * 1e9)
        if load and fl.get("memory_copy_gbs"):
            floors["host copy"] = load["bytes"] / (max(fl["memory_copy_gbs"].values()) * 1e9)
        others = {n: s["ready_s"] for n, s in systems.items()
                  if not n.startswith("ours") and s.get("ready_s")}  # fmt: skip
        made.append(waterfall(ours["bars"], floors, others, out / "cold_start.png").name)
    series = {
        n: [(x["concurrency"], x["output_tok_s"]) for x in s.get("sweep", [])]
        for n, s in systems.items()
    }
    base = [(b["batch"], b["output_tok_s"]) for b in res.get("hf_baseline", [])
            if b["dtype"] == "bfloat16"]  # fmt: skip
    if any(series.values()):
        dfl = res.get("floors", {}).get("decode_floor_bf16")
        floor = [(1, dfl["batch1_tok_s"]), (16, dfl["batch16_tok_s"])] if dfl else None
        made.append(throughput(series, base, out / "throughput.png", floor).name)
        levels = sorted({x for pts in series.values() for x, _ in pts})
        c = headline_level if headline_level in levels else levels[-1]
        rows = {
            n: lv for n, s in systems.items() for lv in s.get("sweep", []) if lv["concurrency"] == c
        }
        made.append(latency(rows, out / "latency.png", c).name)
    ratios = {n: s["study"]["e2e_ratio"] for n, s in systems.items() if s.get("study")}
    if ratios:
        made.append(warmup(ratios, out / "warmup.png").name)
    return made


def spec_decode(rows: list[dict[str, Any]], path: Path,
                title: str = "Speculative decoding: tokens/s against speculation off") -> Path:
    """One group of bars per (prompt set, concurrency), one bar per mode, as a ratio to off
    (1.0 marked): where speculation pays and where it must cost nothing."""
    fig, ax = plt.subplots(figsize=SIZE)
    groups = list(dict.fromkeys((r["set"], r["concurrency"]) for r in rows))
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    width = 0.8 / max(1, len(modes))
    for j, mode in enumerate(modes):
        xs, ys = [], []
        for i, g in enumerate(groups):
            r = next((r for r in rows if (r["set"], r["concurrency"]) == g and r["mode"] == mode),
                     None)
            if r is not None:
                xs.append(i + (j - (len(modes) - 1) / 2) * width)
                ys.append(r["vs_off"])
        bars = ax.bar(xs, ys, width, label=mode)
        for b, y in zip(bars, ys, strict=True):
            ax.text(b.get_x() + b.get_width() / 2, y, f"{y:.2f}", ha="center", va="bottom",
                    fontsize=7)
    ax.axhline(1.0, color="gray", ls=":")
    ax.set_xticks(range(len(groups)), [f"{s}, c={c}" for s, c in groups])
    ax.set_ylabel("output tokens/s, relative to off")
    ax.set_title(title)
    ax.legend(fontsize=7)
    return _save(fig, path)


def settings_bars(rows: list[dict[str, Any]], path: Path, servers: list[str],
                  title: str = "Served tok/s under a CPU quota and beside a busy neighbour") -> Path:
    """One group of bars per (setting, concurrency), one bar per server, in tokens/s."""
    fig, ax = plt.subplots(figsize=SIZE)
    groups = list(dict.fromkeys((r["setting"], r["c"]) for r in rows))
    width = 0.8 / max(1, len(servers))
    for j, name in enumerate(servers):
        xs, ys = [], []
        for i, g in enumerate(groups):
            r = next((r for r in rows if (r["setting"], r["c"]) == g and r["server"] == name),
                     None)
            if r is not None:
                xs.append(i + (j - (len(servers) - 1) / 2) * width)
                ys.append(r["output_tok_s"])
        bars = ax.bar(xs, ys, width, label=name)
        for b, y in zip(bars, ys, strict=True):
            ax.text(b.get_x() + b.get_width() / 2, y, f"{y:.0f}", ha="center", va="bottom",
                    fontsize=6)
    ax.set_xticks(range(len(groups)), [f"{s}\nc={c}" for s, c in groups], fontsize=7)
    ax.set_ylabel("output tokens/s")
    ax.set_title(title)
    ax.legend(fontsize=7)
    return _save(fig, path)
