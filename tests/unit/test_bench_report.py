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
    assert "| ours-tp1 c=16 >= 1.5x llama-server | 400.0 / 500.0 tok/s = 0.80x | missed |" in lines
    assert "| ours-tp1 c=1 >= 1.1x llama-server | n/a | not measured |" in lines
    assert "| ours-tp1 first request within 1.1x of steady (warmup auto) | 1.20x | missed |" in lines
    assert "| ours-tp1 launch to ready < 10 s | 9.5 s | met |" in lines
    assert "| ours-tp1 | 16 | 4 | 0 | 0 | 400.0 | 123 / n/a | 20.0 / 50.0 | 1.50 | 20% |" in lines
    assert "| ours-tp1 | 1.000 | 1.20 n/a 1.00 | 1.50x |" in lines
    assert "| ours-tp1 | 50.0 | 50% | 400.0 | 40% |" in lines
    assert "| transformers generate | 8.0 | 8% | n/a | n/a |" in lines
    assert "| bfloat16 | 1 | 8 | 1.00 | 8.0 |" in lines
    assert '- memory read bandwidth: {"torch_sum": 30.12} GB/s' in lines
    assert "No server of ours" not in text and "![t.png](t.png)" in lines
    notes = [ln for ln in lines if ln.startswith("- CONTENDED")]
    assert len(notes) == 1 and "ours-tp1 c=1 (20%)" in notes[0]  # the stale note is replaced


def test_targets_of_tp_and_quantized_engines() -> None:
    def sys_(**tok: float) -> dict[str, Any]:
        return {"status": "ok", "sweep": [_level(int(c[1:]), t) for c, t in tok.items()]}

    res = {"systems": {
        "ours-tp1": {**sys_(c1=40.0, c16=130.0), "ready_s": 12.0,
                     "study": {"e2e_ratio": [1.02, 0.98, None, 1.14]}},
        "ours-tp2": sys_(c1=37.0, c16=110.0),
        "llama-server": sys_(c1=40.0, c16=100.0),
        "ours-tp1-int8": sys_(c1=64.0, c16=150.0),
        "ours-tp1-int4": sys_(c1=80.0),
        "llama-server-q8_0": sys_(c1=70.0, c16=100.0),
        "ours-tp1-ngram": sys_(c1=39.0, c16=120.0),
    }}  # fmt: skip
    lines = report.targets(res)
    assert lines[0] == "| target | measured | verdict |"
    assert "| ours-tp1 c=1 >= 1.1x llama-server | 40.0 / 40.0 tok/s = 1.00x | missed |" in lines
    assert "| ours-tp1 c=16 >= 1.5x llama-server | 130.0 / 100.0 tok/s = 1.30x | missed |" in lines
    assert "| TP=2 c=1 >= 0.9x TP=1 | 37.0 / 40.0 tok/s = 0.93x | met |" in lines
    assert "| TP=2 c=16 >= 0.9x TP=1 | 110.0 / 130.0 tok/s = 0.85x | missed |" in lines
    assert "| ours-tp1-int8 c=1 >= 1.6x ours-tp1 (bf16) | 64.0 / 40.0 tok/s = 1.60x | met |" in lines
    assert "| ours-tp1-int8 c=1 >= 1.1x llama-server-q8_0 | 64.0 / 70.0 tok/s = 0.91x | missed |" in lines
    assert "| ours-tp1-int8 c=16 >= 1.5x llama-server-q8_0 | 150.0 / 100.0 tok/s = 1.50x | met |" in lines
    assert "| ours-tp1-int4 c=1 >= 2.0x ours-tp1 (bf16) | 80.0 / 40.0 tok/s = 2.00x | met |" in lines
    assert "| ours-tp1-int4 c=1 >= 2.2x ours-tp1 (bf16) | 80.0 / 40.0 tok/s = 2.00x | missed |" in lines
    assert "| ours-tp1-int4 c=16 >= 1.5x llama-server-q4_0 | n/a | not measured |" in lines
    assert "| ours-tp1 launch to ready < 10 s | 12.0 s | missed |" in lines
    # issue 31: the first request itself; issue 5: the worst of the first 10
    assert "| ours-tp1 first request within 1.1x of steady (warmup auto) | 1.02x | met |" in lines
    assert "| ours-tp1 first 10 requests within 1.1x of steady (warmup auto) | 1.14x | missed |" in lines
    # speculation on against the same engine with it off (issue 36: never below 0.95x)
    assert "| ours-tp1-ngram c=1 >= 0.95x ours-tp1 (speculation off) | 39.0 / 40.0 tok/s = 0.97x | met |" in lines
    assert "| ours-tp1-ngram c=16 >= 0.95x ours-tp1 (speculation off) | 120.0 / 130.0 tok/s = 0.92x | missed |" in lines
    assert not any("ours-tp2-ngram" in line for line in lines)


def test_update_latest_replaces_the_run_and_keeps_other_results(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    latest = tmp_path / "latest"
    latest.mkdir()
    for name in ("report.md", "old.png", "quant.md"):
        (latest / name).write_text("before")
    run = tmp_path / "20261201T000000Z"
    run.mkdir()
    (run / "report.md").write_text("new")
    (run / "throughput.png").write_text("png")
    (run / "results.json").write_text("{}")
    report.update_latest(run)
    assert sorted(p.name for p in latest.iterdir()) == [
        "SOURCE", "quant.md", "report.md", "throughput.png"]
    assert (latest / "report.md").read_text() == "new"
    assert (latest / "quant.md").read_text() == "before"  # another bench's results stay
