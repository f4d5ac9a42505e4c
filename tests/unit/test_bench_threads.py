"""bench/threads.py's report: every server in every setting, and ours against the better of
llama-server's two thread counts (plain data, no servers started)."""

from __future__ import annotations

from pathlib import Path

from bench import charts
from bench.threads import SETTINGS, report

NAMES = ["ours (threads measured)", "ours AOTLLM_THREADS=1", "llama-server -t 2",
         "llama-server -t 1"]


def row(setting: str, server: str, c: int, tok_s: float) -> dict[str, object]:
    return {"setting": setting, "server": server, "c": c, "output_tok_s": tok_s,
            "itl_p50_ms": 10.0, "itl_p99_ms": 20.0, "errors": 0,
            **({"threads": "1 threads, 2 probes, 1 switches"} if server.startswith("ours") else {})}


def test_the_ratio_is_against_the_better_llama_thread_count(tmp_path: Path) -> None:
    rows = [row("quota", NAMES[0], 1, 80.0), row("quota", NAMES[1], 1, 81.0),
            row("quota", NAMES[2], 1, 40.0), row("quota", NAMES[3], 1, 64.0),
            row("none", NAMES[0], 1, 90.0), row("none", NAMES[2], 1, 100.0)]
    text = report(rows, NAMES, [1], 1.5, tmp_path / "x-threads")
    # ours against llama -t 1 (the better under the quota), not -t 2
    assert "| quota | 1 | 80.0 / 64.0 = 1.25x |" in text
    assert "| none | 1 | 90.0 / 100.0 = 0.90x |" in text
    # the one-thread twin of ours is a column, never the comparison
    assert "81.0 / " not in text
    # the settings measured have their rows, the others none
    assert "| quota | 1 |" in text and "| none | 1 |" in text
    assert all(f"| {s} | 1 |" not in text for s in SETTINGS if s not in ("quota", "none"))
    assert "quota c=1: 1 threads, 2 probes, 1 switches" in text
    png = charts.settings_bars(rows, tmp_path / "t.png", NAMES)
    assert png.stat().st_size > 1000
