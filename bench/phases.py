"""The measurements made against one running server: warmup study, sweep, cold-start report."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bench.common import cpu_snapshot, foreign_cpu_share
from bench.loadgen import LoadSpec, exact_length_body, run_load
from bench.servers import Running, get_json
from bench.stats import LoadSummary, RequestResult, median


@dataclass(frozen=True)
class Workload:
    """What every system is asked to do; the same object drives every system in a run."""

    prompt_len: int = 128
    max_tokens: int = 128
    levels: tuple[int, ...] = (1, 4, 16, 64)
    requests_per_level: tuple[int, ...] = (3, 8, 32, 64)
    warm_requests: int = 16  # one pass at concurrency 16 before the sweep, for every system
    study_first: int = 10  # the first requests after ready, one at a time
    study_steady: int = 10  # then this many more for the steady-state median
    study_max_tokens: int = 32

    def __post_init__(self) -> None:
        if len(self.levels) != len(self.requests_per_level):
            raise ValueError("levels and requests_per_level must have the same length")
        if any(n < c for c, n in zip(self.levels, self.requests_per_level, strict=True)):
            raise ValueError("each level needs at least as many requests as workers")


# Seeds per phase: every system gets the same prompts, and no phase reuses another's
# prompts (a prefix cache must not make a later phase look faster).
STUDY_SEED, WARM_SEED, LEVEL_SEED = 1000, 2000, 3000


def left(deadline: float) -> float:
    """Seconds until a time.perf_counter() deadline (never below one, so a spec stays valid)."""
    return max(deadline - time.perf_counter(), 1.0)


def _spec(
    running: Running,
    prompts: Sequence[list[int]],
    max_tokens: int,
    concurrency: int,
    n: int,
    deadline: float,
) -> LoadSpec:
    # Bounded by the system's time budget: a slow system costs its own numbers, not the
    # whole run's 40 minutes (requests cut short are counted as errors).
    budget = left(deadline)
    return LoadSpec(
        base_url=running.spec.base_url,
        prompts=list(prompts),
        max_tokens=max_tokens,
        concurrency=concurrency,
        num_requests=n,
        extra_body=exact_length_body(max_tokens),
        request_timeout_s=min(600.0, budget),
        total_timeout_s=budget,
    )


def warmup_study(running: Running, wl: Workload, tokenizer: Any, deadline: float) -> dict[str, Any]:
    """Latency of each of the first requests after ready over the steady-state median."""
    from bench.prompts import make_prompts

    n = wl.study_first + wl.study_steady
    prompts = make_prompts(tokenizer, n, wl.prompt_len, seed=STUDY_SEED)
    results, summary = run_load(_spec(running, prompts, wl.study_max_tokens, 1, n, deadline))
    first, steady = results[: wl.study_first], results[wl.study_first :]
    steady_e2e = median([r.e2e_s for r in steady if r.ok])
    steady_ttft = median([r.ttft_s for r in steady if r.ok])
    return {
        "max_tokens": wl.study_max_tokens,
        "first": [_brief(r) for r in first],
        "steady_median_e2e_s": steady_e2e,
        "steady_median_ttft_s": steady_ttft,
        "e2e_ratio": [r.e2e_s / steady_e2e if r.ok else None for r in first],
        "ttft_ratio": [r.ttft_s / steady_ttft if r.ok else None for r in first],
        "errors": summary.errors,
        "first_error": summary.first_error,
    }


def _brief(r: RequestResult) -> dict[str, Any]:
    return {"ttft_s": r.ttft_s, "e2e_s": r.e2e_s, "tokens": r.output_tokens, "error": r.error}


def sweep(
    running: Running, wl: Workload, tokenizer: Any, deadline: float
) -> tuple[list[dict[str, Any]], list[int]]:
    """Warm every system the same way, then throughput and latency at each concurrency.

    Returns the measured levels and the levels skipped because the time budget ran out.
    """
    from bench.prompts import make_prompts

    warm = make_prompts(tokenizer, wl.warm_requests, wl.prompt_len, seed=WARM_SEED)
    run_load(_spec(running, warm, 16, min(16, wl.warm_requests), wl.warm_requests, deadline))
    out: list[dict[str, Any]] = []
    skipped: list[int] = []
    for c, n in zip(wl.levels, wl.requests_per_level, strict=True):
        if deadline - time.perf_counter() < 5.0:
            skipped.append(c)
            continue
        prompts = make_prompts(tokenizer, n, wl.prompt_len, seed=LEVEL_SEED + c)
        before = cpu_snapshot(running.proc.pid)
        _, summary = run_load(_spec(running, prompts, wl.max_tokens, c, n, deadline))
        # Anything else running on these cores skews the numbers: keep the evidence.
        foreign = foreign_cpu_share(before, cpu_snapshot(running.proc.pid), summary.wall_s)
        out.append({**summary.to_dict(), "foreign_cpu_share": foreign})
        print(f"  {running.spec.name} c={c}: {_line(summary, foreign)}", flush=True)
    return out, skipped


def _line(s: LoadSummary, foreign: float) -> str:
    return (
        f"{s.output_tok_s:.1f} tok/s, TTFT p50 {s.ttft_p50_s * 1e3:.0f} ms, "
        f"ITL p50 {s.itl_p50_s * 1e3:.1f} ms, errors {s.errors}, "
        f"length mismatches {s.token_count_mismatches}, other work {foreign:.0%} of the CPU"
    )


def engine_report(running: Running) -> dict[str, Any] | None:
    """Our server's cold-start report (GET /v1/engine): gates and load figures."""
    return get_json(f"{running.spec.base_url}/v1/engine")


def gate_bars(report: dict[str, Any] | None, ready_s: float) -> list[dict[str, Any]]:
    """Gates as (name, start, seconds) bars on the launch-to-ready time axis.

    A gate's `start` counts from the moment rank 0's gate log was made, after mpirun and
    the Python imports; that lead-in is the first bar, so the bars end where ready does.
    """
    gates = [
        g for g in (report or {}).get("gates", [])
        if isinstance(g, dict) and isinstance(g.get("start"), (int, float))
    ]  # fmt: skip
    if not gates:
        return [{"name": "launch to ready", "start": 0.0, "seconds": ready_s}]
    ends = [float(g["start"]) + float(g.get("seconds") or 0.0) for g in gates]
    lead = max(ready_s - max(ends), 0.0)
    first = lead + min(float(g["start"]) for g in gates)
    bars = [{"name": "process start (mpirun, imports, bind)", "start": 0.0, "seconds": first}]
    bars += [
        {"name": str(g["name"]), "start": lead + float(g["start"]),
         "seconds": float(g.get("seconds") or 0.0)}
        for g in gates
    ]  # fmt: skip
    return bars


def load_figures(report: dict[str, Any] | None) -> dict[str, float] | None:
    """Our load gate: bytes over all ranks, the gate's wall seconds, each rank's read rate.

    Ranks load their shards at the same time, so the gate's wall time is what a cold start
    pays; `read_s` is the slowest rank's own read time.
    """
    if not report:
        return None
    ranks = [r for r in report.get("load") or [] if isinstance(r, dict) and "bytes" in r]
    if not ranks:
        return None
    gate = next((g for g in report.get("gates", []) if g.get("name") == "load"), {})
    read_s = max(float(r.get("read_s") or 0.0) for r in ranks)
    seconds = gate.get("seconds")
    floors = ranks[0].get("floors") or {}
    return {
        "bytes": float(sum(r["bytes"] for r in ranks)),
        "seconds": float(seconds) if isinstance(seconds, (int, float)) else read_s,
        "read_s": read_s,
        "server_storage_gbps": floors.get("storage_read_gbps"),
        "server_storage_mode": floors.get("storage_mode"),
        "server_host_copy_gbps": floors.get("host_copy_gbps"),
    }
