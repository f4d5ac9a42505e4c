"""`make soak`: minutes of mixed, hostile traffic against a TP=2 server, then its invariants.

    python -m bench.soak [--duration 180] [--engine DIR | --tp 2 --backend aoti|eager]
                         [--max-queue 8] [--concurrency 6] [--kv-cache-tokens 2048] [--seed 0]

Without --engine it builds (or reuses) the SmolLM2-135M demo model as a bf16 TP=2 engine
(aoti, what production serves, unless --backend eager) with a small profile (512-token context, batch 8, 256 tokens a step) in engines/. The
server runs as in production: `python -m serve launch` on its own, which starts mpirun.
The traffic is bench/traffic.py's: streaming and not, completions and chat, random lengths
up to the context limit and over it, cancels, client resets, give-ups and bursts over
--max-queue. The KV cache is kept small (--kv-cache-tokens) so preemption happens too.

After the traffic, checked (the exit status is 1 when one fails):
  - no 5xx: neither an HTTP status >= 500 nor an in-band error event, client-side and in
    the server's own llmserve_http_requests_total;
  - every request settled as expected: each accepted one answered completely (finish
    reason, usage consistent) or cancelled by us; over-limit ones 400, bursts 429 with
    Retry-After (at least one);
  - the server's success counter agrees: completed <= successes <= completed + cancelled;
  - within a few seconds of the last request: nothing running or waiting and no KV block
    in use (blocks kept in the prefix cache reported apart);
  - the server still answers, then drains on SIGTERM: exit 0, every rank 0, nothing left.
Reported: outcome counts by kind, requests/s and tokens/s, each rank's RSS before, during
and after (VmRSS of rank{N}.pid). Written to bench/results/<UTC stamp>-soak/.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import sys
import time
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from bench import charts, common
from bench.job import Job, build_demo_engine, http, launch, metric, metric_sum
from bench.traffic import TrafficReport, run_traffic
from bench.traffic_mix import OUTCOMES, RequestMaker, Workload

PROFILE = ("--max-seq-len", "512", "--max-batch-size", "8", "--max-num-tokens", "256")
KV_SETTLE_S = 15.0  # after the last request, how long KV blocks may take to come back
# A plateau is judged on soaks of 10 minutes or more: shorter ones are still warming caps
# (allocator arenas, the prefix cache, grammar caches) and say nothing about a leak.
PLATEAU_MIN_S = 600.0
PLATEAU_PCT = 2.0


def rss_plateau(series: list[dict[str, Any]], wall_s: float) -> dict[int, dict[str, Any]]:
    """Per rank: RSS growth over the first and the second half of the traffic (from the
    first sample to the one nearest the middle, from there to the last), and whether the
    second half grew less than PLATEAU_PCT % of the RSS at the middle."""
    out: dict[int, dict[str, Any]] = {}
    ranks = sorted({int(r) for row in series for r in row["rss_kib"]})
    for rank in ranks:
        pts = [(row["t"], row["rss_kib"].get(rank)) for row in series]
        pts = [(t, v) for t, v in pts if v is not None]
        if len(pts) < 3:
            continue
        mid = min(pts, key=lambda p: abs(p[0] - wall_s / 2))
        first, last = pts[0][1], pts[-1][1]
        second = last - mid[1]
        pct = round(100.0 * second / mid[1], 2)
        out[rank] = {"start_kib": first, "mid_kib": mid[1], "end_kib": last, "mid_t": mid[0],
                     "first_half_kib": mid[1] - first, "second_half_kib": second,
                     "second_half_pct": pct, "ok": pct < PLATEAU_PCT}
    return out


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")


def engine_for(args: argparse.Namespace) -> tuple[Path, int]:
    from contract.manifest import read_manifest

    engine = args.engine or build_demo_engine(common.REPO / "engines", args.tp, PROFILE,
                                              args.backend)
    return engine, read_manifest(engine).tp


def kv_state(job: Job) -> dict[str, float | None]:
    page = job.metrics()
    return {
        "running": metric(page, "llmserve_num_requests_running"),
        "waiting": metric(page, "llmserve_num_requests_waiting"),
        "kv_used": metric(page, "llmserve_kv_cache_blocks", state="used"),
        "kv_cached": metric(page, "llmserve_kv_cache_blocks", state="cached"),
        "kv_free": metric(page, "llmserve_kv_cache_blocks", state="free"),
        "kv_usage_ratio": metric(page, "llmserve_kv_cache_usage_ratio"),
    }


def server_counters(job: Job) -> dict[str, float]:
    page = job.metrics()
    return {
        "http_5xx": metric_sum(page, "llmserve_http_requests_total", status=r"5\d\d"),
        "http_429": metric_sum(page, "llmserve_http_requests_total", status="429"),
        "http_400": metric_sum(page, "llmserve_http_requests_total", status="400"),
        "http_499": metric_sum(page, "llmserve_http_requests_total", status="499"),
        "gen_200": metric_sum(page, "llmserve_http_requests_total",
                              route=r"/v1/(chat/)?completions", status="200"),
        "success": metric_sum(page, "llmserve_request_success_total"),
        "generation_tokens": metric(page, "llmserve_generation_tokens_total") or 0.0,
        "prompt_tokens": metric(page, "llmserve_prompt_tokens_total") or 0.0,
        "preemptions": metric(page, "llmserve_num_preemptions_total") or 0.0,
    }


def _mib(kib: int | None) -> str:
    return "-" if kib is None else f"{kib / 1024:.1f}"


class Soak:
    def __init__(self, args: argparse.Namespace, out: Path) -> None:
        self.args, self.out = args, out
        self.checks: list[tuple[str, bool, str]] = []
        self.rss_series: list[dict[str, Any]] = []
        self.res: dict[str, Any] = {"started_utc": out.name, "args": {
            k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "machine": common.machine_info()}

    def check(self, name: str, ok: bool, detail: str) -> None:
        self.checks.append((name, ok, detail))
        print(f"  [{'ok' if ok else 'FAIL'}] {name}: {detail}", flush=True)

    def sample(self, job: Job, t: float, rep: TrafficReport | None = None) -> None:
        kv = kv_state(job)
        row = {"t": round(t, 1), "rss_kib": job.rss(), **kv}
        self.rss_series.append(row)
        if rep is not None:
            c = rep.counts()
            rss = " ".join(f"r{r}={_mib(v)}MiB" for r, v in row["rss_kib"].items())
            print(f"  t={t:5.0f}s sent={len(rep.results)} "
                  + " ".join(f"{k}={c[k]}" for k in (*OUTCOMES, "pending") if c[k])
                  + f" running={kv['running']} waiting={kv['waiting']} kv_used={kv['kv_used']}"
                  f" kv_cached={kv['kv_cached']} {rss}", flush=True)

    def run(self) -> int:
        a = self.args
        engine, tp = engine_for(a)
        self.res["engine"] = {"dir": str(engine), "tp": tp}
        server_args = ["--max-queue", str(a.max_queue), "--drain-timeout", "30"]
        if a.kv_cache_tokens:
            server_args += ["--kv-cache-tokens", str(a.kv_cache_tokens)]
        job = launch(engine, self.out / "job", tp, server_args)
        self.res["server_command"] = job.stderr().splitlines()[0]
        try:
            return self._run(job, engine, tp)
        finally:
            left = job.kill_all()
            if left:
                print(f"killed what was left of the job: {left}", flush=True)

    def _run(self, job: Job, engine: Path, tp: int) -> int:
        from transformers import AutoTokenizer

        a = self.args
        ready_s = job.wait_ready()
        print(f"server ready in {ready_s:.1f} s on port {job.port} (engine {engine}, TP={tp})",
              flush=True)
        models = job.get_json("/v1/models")
        card = models["data"][0]
        tok = AutoTokenizer.from_pretrained(engine)
        work = Workload(max_seq_len=int(card["max_model_len"]),
                        vocab=min(len(tok), 49152), max_queue=a.max_queue,
                        burst_size=a.burst_size or 3 * a.max_queue,
                        burst_every_s=a.burst_every)
        maker = RequestMaker(tok, work, card["id"], random.Random(a.seed))
        report = job.get_json("/v1/engine")
        self.res["ready_s"] = round(ready_s, 2)
        self.res["profile"] = report["engine"]["profile"]
        self.res["kv_cache"] = report["kv_cache"]
        self.res["workload"] = vars(work)
        time.sleep(2.0)  # let start-up's allocations settle before the first RSS reading
        before = job.rss()
        counters0 = server_counters(job)
        self.sample(job, 0.0)
        print(f"soak: {a.duration:.0f} s, {a.concurrency} clients, bursts of "
              f"{work.burst_size} every {work.burst_every_s:.0f} s, --max-queue {a.max_queue}, "
              f"context {work.max_seq_len}", flush=True)

        rep = asyncio.run(run_traffic(
            "127.0.0.1", job.port, maker, work, a.duration, a.concurrency, a.max_requests,
            on_tick=lambda r, t: self.sample(job, t, r), tick_s=a.tick))
        traffic_end = time.monotonic()
        print(f"traffic done: {len(rep.results)} requests in {rep.wall_s:.1f} s "
              f"({rep.stopped_by}); checking", flush=True)

        # ---- the server settles --------------------------------------------------------
        settle_s = None
        kv = kv_state(job)
        while time.monotonic() - traffic_end < KV_SETTLE_S:
            kv = kv_state(job)
            if kv["running"] == 0 and kv["waiting"] == 0 and kv["kv_used"] == 0:
                settle_s = time.monotonic() - traffic_end
                break
            time.sleep(0.2)
        time.sleep(1.0)
        after = job.rss()
        self.sample(job, time.monotonic() - traffic_end + rep.wall_s)
        counters1 = server_counters(job)
        delta = {k: counters1[k] - counters0[k] for k in counters1}
        final = job.get_json("/health/ready")
        status, _, body = http(job.port, "POST", "/v1/completions",
                               {"model": card["id"], "prompt": "The end of the soak is",
                                "max_tokens": 8, "temperature": 0}, timeout=60)

        # ---- drain -----------------------------------------------------------------
        job.signal_launcher(signal.SIGTERM)
        sigterm_at = time.time()
        gone = job.wait_gone(60.0)
        drain = {"exit": job.exit_code, "ranks": {r: job.run_file(r, "exit") for r in range(tp)},
                 "seconds": round(job.gone_at - sigterm_at, 2) if job.gone_at else None,
                 "left": [] if gone else job.left()}

        # ---- checks ------------------------------------------------------------------
        print("checks:", flush=True)
        results = rep.results
        c = rep.counts()
        by_kind: dict[str, Counter[str]] = {}
        for r in results:
            by_kind.setdefault(r.kind, Counter())[r.outcome] += 1
        five = [r for r in results if r.outcome == "5xx"]
        self.check("no 5xx (client)", not five,
                   f"{len(five)} of {len(results)}" + (f"; first: {five[0].detail}" if five else ""))
        self.check("no 5xx (server metrics)", delta["http_5xx"] == 0,
                   f"llmserve_http_requests_total 5xx +{delta['http_5xx']:.0f}")
        odd = [r for r in results if r.outcome == "unexpected"]
        accepted = c["complete"] + c["cancelled"]
        self.check("every accepted request answered or cancelled by us", not odd,
                   f"{accepted} accepted: {c['complete']} complete, {c['cancelled']} cancelled "
                   f"by us; {len(odd)} unexpected" + "".join(
                       f"\n      #{r.index} {r.kind} {r.action} status={r.status}: {r.detail}"
                       for r in odd[:10]))
        ok_success = c["complete"] <= delta["success"] <= c["complete"] + c["cancelled"]
        self.check("server successes agree", ok_success,
                   f"complete {c['complete']} <= llmserve_request_success_total "
                   f"+{delta['success']:.0f} <= complete + cancelled {accepted}")
        bursts_429 = sum(1 for r in results if r.burst and r.outcome == "rejected")
        self.check("bursts over --max-queue get 429 + Retry-After",
                   bursts_429 > 0 and delta["http_429"] == c["rejected"],
                   f"{c['rejected']} rejected ({bursts_429} in {rep.bursts} bursts), server "
                   f"counted {delta['http_429']:.0f}; Retry-After on every one")
        over = by_kind.get("over_limit", Counter())
        self.check("over the context limit: 400", over["invalid"] > 0 and
                   over["invalid"] + over["rejected"] == sum(over.values()),
                   f"{over['invalid']} x 400 context_length_exceeded, {over['rejected']} x 429")
        at = by_kind.get("at_limit", Counter()) + by_kind.get("at_limit_chat", Counter())
        self.check("at the context limit: 200", at["complete"] > 0 and
                   at["complete"] + at["rejected"] + at["cancelled"] == sum(at.values()),
                   f"{at['complete']} complete of {sum(at.values())}")
        self.check("nothing running or waiting, no KV block used, after the traffic",
                   settle_s is not None,
                   f"after {settle_s:.1f} s" if settle_s is not None else
                   f"still {kv} after {KV_SETTLE_S:.0f} s")
        self.check("still serving afterwards",
                   isinstance(final, dict) and final.get("status") == "ready" and status == 200,
                   f"ready={final.get('status') if isinstance(final, dict) else None}, "
                   f"a last completion: {status}" + ("" if status == 200 else f" {body[:200]!r}"))
        self.check("SIGTERM drains: exit 0, every rank 0, nothing left",
                   gone and drain["exit"] == 0 and all(v == 0 for v in drain["ranks"].values()),
                   f"exit {drain['exit']} ranks {drain['ranks']} in {drain['seconds']} s"
                   + (f", left {drain['left']}" if drain["left"] else ""))

        plateau = rss_plateau(self.rss_series, rep.wall_s)
        if a.duration >= PLATEAU_MIN_S:
            self.check("RSS plateaus: the second half grows < 2 % of the mid-soak RSS",
                       all(p["ok"] for p in plateau.values()),
                       "; ".join(f"rank {r}: {_mib(p['first_half_kib'])} MiB in the first "
                                 f"half, {_mib(p['second_half_kib'])} MiB in the second "
                                 f"({p['second_half_pct']} % of {_mib(p['mid_kib'])} MiB)"
                                 for r, p in plateau.items()))

        # ---- figures -----------------------------------------------------------------
        done = [r for r in results if r.outcome == "complete"]
        tokens = sum(max(r.completion_tokens, 0) for r in done)
        rss = {}
        for rank in sorted(set(before) | set(after)):
            series = [row["rss_kib"].get(rank) for row in self.rss_series]
            series = [v for v in series if v is not None]
            b, e = before.get(rank), after.get(rank)
            half = series[len(series) // 2] if series else None
            rss[rank] = {"before_kib": b, "after_kib": e, "peak_kib": max(series or [0]),
                         "mid_kib": half,
                         "growth_kib": (e - b) if b is not None and e is not None else None,
                         "second_half_growth_kib": (e - half) if e is not None and half else None}
        self.res.update({
            "traffic": {"requests": len(results), "wall_s": round(rep.wall_s, 1),
                        "stopped_by": rep.stopped_by, "bursts": rep.bursts,
                        "outcomes": dict(c), "by_kind": {k: dict(v) for k, v in by_kind.items()},
                        "requests_per_s": round(len(done) / rep.wall_s, 3),
                        "tokens_per_s": round(tokens / rep.wall_s, 2),
                        "completion_tokens": tokens,
                        "server_generation_tokens_per_s":
                            round(delta["generation_tokens"] / rep.wall_s, 2)},
            "server_counters_delta": delta,
            "kv_after": kv, "kv_settle_s": None if settle_s is None else round(settle_s, 2),
            "rss": rss, "rss_plateau": plateau, "rss_series": self.rss_series, "drain": drain,
            "checks": [{"name": n, "ok": ok, "detail": d} for n, ok, d in self.checks],
            "results": [r.to_dict() for r in results],
        })
        failed = [n for n, ok, _ in self.checks if not ok]
        self.res["passed"] = not failed
        charts.rss_curve(self.rss_series, self.out / "rss.png", rep.wall_s / 2)
        self._write()
        print(self._markdown(), flush=True)
        print(f"wrote {self.out}/summary.md and summary.json", flush=True)
        return 1 if failed else 0

    # ---- report ----------------------------------------------------------------------

    def _write(self) -> None:
        (self.out / "summary.json").write_text(json.dumps(self.res, indent=1, default=str))
        (self.out / "summary.md").write_text(self._markdown())

    def _markdown(self) -> str:
        r = self.res
        t = r["traffic"]
        lines = [f"# Soak {r['started_utc']}", "",
                 f"Engine `{r['engine']['dir']}` (TP={r['engine']['tp']}), profile "
                 f"{r['profile']}, KV cache {r['kv_cache'].get('blocks')} blocks; server "
                 f"`{r['server_command'].lstrip('$ ')}`; ready in {r['ready_s']} s.",
                 f"Machine: {r['machine']['cpu']}, {r['machine']['cores']} cores "
                 "(shared with other work).", "",
                 f"**{'PASSED' if r['passed'] else 'FAILED'}**: {t['requests']} requests in "
                 f"{t['wall_s']} s ({t['stopped_by']}), {t['bursts']} bursts.", "",
                 "## Checks", ""]
        lines += common.md_table(["check", "result", "detail"],
                                 [(c["name"], "ok" if c["ok"] else "**FAIL**",
                                   c["detail"].replace("\n", "<br>")) for c in r["checks"]])
        lines += ["", "## Outcomes by kind", ""]
        kinds = sorted(t["by_kind"])
        lines += common.md_table(["kind", *OUTCOMES, "total"],
                                 [(k, *(t["by_kind"][k].get(o, 0) for o in OUTCOMES),
                                   sum(t["by_kind"][k].values())) for k in kinds]
                                 + [("**all**", *(t["outcomes"].get(o, 0) for o in OUTCOMES),
                                     t["requests"])])
        d = r["server_counters_delta"]
        lines += ["", "## Figures", "",
                  f"- throughput: {t['requests_per_s']} completed requests/s, "
                  f"{t['tokens_per_s']} completion tokens/s (client-side, complete requests); "
                  f"server generated {t['server_generation_tokens_per_s']} tokens/s "
                  "(cancelled requests' tokens included)",
                  f"- server counters over the soak: {d['success']:.0f} successes, "
                  f"{d['http_5xx']:.0f} x 5xx, {d['http_429']:.0f} x 429, {d['http_400']:.0f} x 400, "
                  f"{d['http_499']:.0f} x 499, {d['preemptions']:.0f} preemptions",
                  f"- KV blocks after the traffic: used {r['kv_after']['kv_used']}, prefix-cached "
                  f"{r['kv_after']['kv_cached']}, free {r['kv_after']['kv_free']} "
                  f"(back to 0 used after {r['kv_settle_s']} s)",
                  f"- drain on SIGTERM: exit {r['drain']['exit']}, ranks {r['drain']['ranks']}, "
                  f"{r['drain']['seconds']} s", "",
                  "RSS of each rank's serving process (VmRSS, MiB):", ""]
        lines += common.md_table(
            ["rank", "before", "mid-soak", "after", "peak", "growth", "2nd-half growth"],
            [(rank, _mib(v["before_kib"]), _mib(v["mid_kib"]), _mib(v["after_kib"]),
              _mib(v["peak_kib"]), _mib(v["growth_kib"]), _mib(v["second_half_growth_kib"]))
             for rank, v in r["rss"].items()])
        lines += ["", "Plateau (the halves of the traffic; judged from "
                  f"{PLATEAU_MIN_S / 60:.0f} minutes on, < {PLATEAU_PCT:.0f} % of the "
                  "mid-soak RSS in the second half); the curve is rss.png:", ""]
        lines += common.md_table(
            ["rank", "start", "middle", "end", "1st-half growth", "2nd-half growth",
             "2nd half, % of middle"],
            [(rank, _mib(p["start_kib"]), _mib(p["mid_kib"]), _mib(p["end_kib"]),
              _mib(p["first_half_kib"]), _mib(p["second_half_kib"]), p["second_half_pct"])
             for rank, p in r["rss_plateau"].items()])
        return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", type=Path, default=None,
                    help="engine directory (default: build the eager SmolLM2 demo engine)")
    ap.add_argument("--tp", type=int, default=2, help="TP of the engine built by default")
    ap.add_argument("--backend", choices=("aoti", "eager"), default="aoti",
                    help="backend of the engine built by default: aoti, what production "
                    "serves (eager's ATen/oneDNN path keeps growing per-shape caches: "
                    "bench/results/latest/soak.md)")
    ap.add_argument("--duration", type=float, default=180.0, help="seconds of traffic")
    ap.add_argument("--max-requests", type=int, default=100_000)
    ap.add_argument("--concurrency", type=int, default=6, help="steady clients")
    ap.add_argument("--max-queue", type=int, default=8, help="the server's --max-queue")
    ap.add_argument("--burst-size", type=int, default=0, help="default 3 x --max-queue")
    ap.add_argument("--burst-every", type=float, default=25.0, help="seconds between bursts")
    ap.add_argument("--kv-cache-tokens", type=int, default=2048,
                    help="the server's KV cache (small, so preemption happens); 0: default")
    ap.add_argument("--tick", type=float, default=15.0, help="seconds between samples")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if not 1 <= args.max_requests <= 100_000 or not 1 <= args.concurrency <= 64:
        ap.error("--max-requests must be in 1..100000 and --concurrency in 1..64")
    if args.duration <= 0:
        ap.error("--duration must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = args.out or common.RESULTS / f"{_now()}-soak"
    out.mkdir(parents=True, exist_ok=True)
    return Soak(args, out).run()


if __name__ == "__main__":
    sys.exit(main())
