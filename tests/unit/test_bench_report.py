"""The benchmark report's markdown (charts stubbed: no matplotlib work)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from bench import report
from bench.common import md_table


def test_md_table_pads_short_rows() -> None:
    assert md_table(["a", "b", "c"], [[1, "x", ""], ["only"]]) == [
        "| a | b | c |",
        "|---|---|---|",
        "| 1 | x |  |",
        "| only | | |",
    ]


def _level(c: int, tok: float) -> dict[str, Any]:
    return {
        "concurrency": c, "requests": 4, "errors": 0, "token_count_mismatches": 0,
        "output_tok_s": tok, "ttft_p50_s": 0.1234, "ttft_p99_s": math.nan, "itl_p50_s": 0.02,
        "itl_p99_s": 0.05, "e2e_p50_s": 1.5, "foreign_cpu_share": 0.2,
    }  # fmt: skip


def test_render_sections(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(report.charts, "render_all", lambda res, out, level: ["t.png"])
    res: dict[str, Any] = {
        "started_utc": "X", "machine": {"cores": 2}, "notes": ["CONTENDED: stale"],
        "floors": {
            "memory_read_gbs": {"torch_sum": 30.123}, "memory_copy_gbs": {"torch_copy": 15.0},
            "bf16_matmul_tflops": 0.4, "fp32_matmul_tflops": 0.2, "threads": 2,
            "decode_floor_bf16": {"params": 1e8, "weight_bytes": 2e8, "batch1_tok_s": 100.0,
                                  "batch16_tok_s": 1000.0, "batch16_bound": "compute"},
        },
        "hf_baseline": [{"dtype": "bfloat16", "batch": 1, "new_tokens": 8, "seconds": 1.0,
                         "output_tok_s": 8.0}],
        "systems": {
            "ours-tp1": {"status": "ok", "ready_s": 9.5, "sweep": [_level(1, 50.0), _level(16, 400.0)],
                         "study": {"steady_median_e2e_s": 1.0, "e2e_ratio": [1.2, None, 1.0],
                                   "ttft_ratio": [1.5]}},
            "llama-server": {"status": "ok", "ready_s": 0.9, "sweep": [_level(16, 500.0)]},
            "vllm": {"status": "skipped: not installed"},
        },
    }  # fmt: skip
    text = report.render(res, tmp_path)
    assert (tmp_path / "report.md").read_text() == text
    lines = text.splitlines()
    assert "| ours-tp1 | 9.50 | 400.0 | 123 | 20.0 | 1.20x | 40% |" in lines
    assert "| vllm | skipped: not installed | | | | | |" in lines
    assert "| throughput @16 >= llama-server | missed (400 vs 500 tok/s) |" in lines
    assert "| launch to ready < 10 s | met (9.5 s) |" in lines
    assert "| ours-tp1 | 16 | 4 | 0 | 0 | 400.0 | 123 / n/a | 20.0 / 50.0 | 1.50 | 20% |" in lines
    assert "| ours-tp1 | 1.000 | 1.20 n/a 1.00 | 1.50x |" in lines
    assert "| ours-tp1 | 50.0 | 50% | 400.0 | 40% |" in lines
    assert "| transformers generate | 8.0 | 8% | n/a | n/a |" in lines
    assert "| bfloat16 | 1 | 8 | 1.00 | 8.0 |" in lines
    assert '- memory read bandwidth: {"torch_sum": 30.12} GB/s' in lines
    assert "No server of ours" not in text and "![t.png](t.png)" in lines
    notes = [ln for ln in lines if ln.startswith("- CONTENDED")]
    assert len(notes) == 1 and "ours-tp1 c=1 (20%)" in notes[0]  # the stale note is replaced


def test_targets_columns_follow_their_headers() -> None:
    res = {"systems": {"ours-tp2": {"ready_s": 12.0}, "ours-tp1": {"ready_s": 8.0}}}
    lines = report.targets(res)
    assert lines[0] == "| target | ours-tp2 | ours-tp1 |"
    assert "| launch to ready < 10 s | missed (12.0 s) | met (8.0 s) |" in lines
