"""`make faults`: kill and break a TP=2 job at the worst moments; time how fast it ends.

    python -m bench.faults [--engine DIR | --tp 2] [--only NAME ...] [--limit 10]

Each scenario launches its own server (`python -m serve launch`, which starts mpirun),
injects one fault, and measures the seconds from the fault to the whole job gone: the
launcher exited and no process naming the job's run directory alive (mpirun, the rank
supervisors, the detached rank workers). The cause must be named in the launcher's stderr
or a rank log. A hard timeout (--hard-timeout) kills what is left, so nothing hangs here.

  load-kill1        kill -9 of rank 1's worker inside the load gate
  warmup-kill1      kill -9 of rank 1's worker inside the warmup gate
  traffic-kill1     kill -9 of rank 1's worker with requests streaming
  traffic-kill0     kill -9 of rank 0's worker with requests streaming
  warmup-sigterm    SIGTERM to the launcher inside the warmup gate
  rm-engine-load    the engine directory removed inside the load gate, before any shard is
                    read: the job must end, naming the file it could not read
  rm-engine-verify  the engine directory removed inside the verify gate: an aoti engine
                    reads its compiled package there (it must end, naming it), an eager
                    engine has read everything (it must serve on)
  rm-engine-connect the engine directory removed inside the connect gate, after every file
                    was read and verified: it must become ready and serve, then drain
  rm-engine-ready   the engine directory removed once ready: it keeps serving, then drains
  engine-fault      the engine loop fails under traffic (AOTLLM_INJECT_FAULT_AT_STEP)

A fault "inside gate G" lands there on any machine, fast or slow: the job runs with
AOTLLM_INJECT_GATE_HOLD=G:DIR, every rank stops inside G (running, its body not started)
and says so in DIR, the harness checks on /v1/engine that G is the gate running, injects
the fault, and only then releases the ranks. The gate seen running is the summary's
"fault landed" column; a fault that landed elsewhere is a finding.

A scenario's verdict depends on which side of the engine's reads its fault is: before
(the load gate, or the verify gate of an aoti engine, which reads its compiled package
there) the job must end within --limit seconds (10) with its cause named; after, the
server must keep serving from memory and drain cleanly. A hang, an unnamed cause, a client
left waiting, or an outcome of the wrong side is a finding (exit 1).
Written to bench/results/<UTC stamp>-faults/.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import signal
import stat
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

from bench import common
from bench.job import Job, build_demo_engine, http, launch, metric
from bench.soak import PROFILE
from bench.traffic import send
from bench.traffic_mix import Req, Result
from runtime.env import INJECT_FAULT_AT_STEP, INJECT_GATE_HOLD
from serve.startup import GATES, HOLD_RELEASE

FAULT_ENV = INJECT_FAULT_AT_STEP.name
Expect = Literal["end", "serve"]  # the job ends with its cause named | it keeps serving


def expect_after_rm(gate: str, backend: str) -> Expect:
    """What removing the engine directory inside `gate` must lead to. Up to the load gate
    the shards are not in memory yet: the job ends, naming the file. An aoti engine's
    verify gate still reads its compiled package (the verified private copy the kernels
    gate loads); an eager engine reads nothing after load. From connect on, every file is
    in memory or in the worker's private copy: the server serves on."""
    last_read = "verify" if backend == "aoti" else "load"
    return "end" if GATES.index(gate) <= GATES.index(last_read) else "serve"


@dataclass
class Row:
    name: str
    fault: str
    seconds: float | None = None  # fault -> whole job gone; None: it hung (killed by us)
    exit_code: int | None = None
    rank_exits: dict[int, int | None] = field(default_factory=dict)
    cause: str = ""
    cause_named: bool = False
    clients: str = ""  # what the clients got, where there were clients
    clients_ok: bool = True
    hit: str = ""  # where the fault actually landed (the gate running at the time)
    gate: str = ""  # the gate the scenario means to hit; "" when not a gate's scenario
    expect: Expect = "end"  # "serve": the server keeps serving; `seconds` is then the drain's
    notes: list[str] = field(default_factory=list)

    def findings(self, limit: float) -> list[str]:
        out = []
        if self.gate and self.hit != self.gate:
            out.append(f"landed in {self.hit or 'no gate'}, not in {self.gate}")
        if self.seconds is None:
            out.append("HANG: the job did not end (killed by the harness)")
        elif self.seconds > limit:
            out.append(f"slow: {self.seconds:.1f} s > {limit:.0f} s")
        if not self.cause_named:
            out.append("cause not named")
        if not self.clients_ok:
            out.append("clients: " + self.clients)
        if self.expect == "serve" and self.exit_code != 0:
            out.append(f"should have kept serving and drained; exited {self.exit_code}")
        return out


# ---- clients ------------------------------------------------------------------------------


class Clients:
    """A few long requests (streams and not) on a background event loop."""

    def __init__(self, job: Job, model: str, n: int, vocab: int, max_tokens: int = 200,
                 timeout_s: float = 60.0) -> None:
        self.results: list[Result] = []
        self.done = threading.Event()
        rng = random.Random(1)
        reqs = []
        for i in range(n):
            stream = i % 2 == 0
            body = {"model": model, "max_tokens": max_tokens, "temperature": 0,
                    "ignore_eos": True, "stream": stream,
                    "prompt": [rng.randrange(min(100, vocab // 2), min(40000, vocab))
                               for _ in range(rng.randint(8, 64))]}
            reqs.append(Req("stream" if stream else "completion", "/v1/completions", body,
                            len(body["prompt"])))
        self._thread = threading.Thread(target=self._run, args=(job.port, reqs, timeout_s),
                                        daemon=True)
        self._thread.start()

    def _run(self, port: int, reqs: list[Req], timeout_s: float) -> None:
        import aiohttp

        async def main() -> None:
            async with aiohttp.ClientSession() as session:
                async def one(i: int, req: Req) -> None:
                    res = Result(i, req.kind, req.stream, "ok", "read", False, time.time())
                    self.results.append(res)
                    await send(session, "127.0.0.1", port, req, res, timeout_s)
                    res.end_s = time.time()
                await asyncio.gather(*(one(i, r) for i, r in enumerate(reqs)))

        try:
            asyncio.run(main())
        finally:
            self.done.set()

    def summary(self, wait_s: float) -> tuple[str, bool]:
        """'outcome x count' and whether every client got an end (none still waiting)."""
        finished = self.done.wait(wait_s)
        counts: dict[str, int] = {}
        for r in self.results:
            key = r.outcome if r.outcome not in ("unexpected",) else _short(r.detail)
            key = f"{key}({r.status})" if r.status else key
            counts[key] = counts.get(key, 0) + 1
        text = ", ".join(f"{k} x{v}" for k, v in sorted(counts.items()))
        hung = not finished or any(r.detail.startswith("no answer within")
                                   for r in self.results)
        return text + (" — STILL WAITING" if not finished else ""), not hung


def _short(detail: str) -> str:
    if "in-band" in detail:
        return "in-band error"
    m = re.match(r"(\w+(?:Error|Disconnected|Exception)?)", detail)
    return m.group(1) if m else detail[:40]


# ---- scenario helpers --------------------------------------------------------------------


def wait_for(pred: Callable[[], bool], timeout: float, poll_s: float = 0.01) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(poll_s)
    return False


def cause_of(job: Job, patterns: list[str], since: float) -> tuple[str, bool]:
    """The first log line (launcher stderr, then rank logs) matching one of `patterns`;
    else the first error line. Lines with a timestamp before `since` are skipped."""
    lines = job.stderr().splitlines()
    for rank in range(job.tp):
        lines += job.rank_log(rank).splitlines()
    fresh = []
    for line in lines:
        m = re.match(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3})", line)
        if m:
            ts = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S").timestamp() + int(m.group(2)) / 1000
            if ts < since - 1.0:
                continue
        fresh.append(line.strip())
    for pat in patterns:
        for line in fresh:
            if re.search(pat, line):
                return line[:240], True
    errors = [ln for ln in fresh if re.search(r"error|ERROR|Error", ln)]
    return (errors[0][:240] if errors else "(nothing logged)"), False


def finish(row: Row, job: Job, fault_at: float, hard_timeout: float, patterns: list[str]
           ) -> None:
    gone = job.wait_gone(hard_timeout)
    if gone:
        assert job.gone_at is not None
        row.seconds = round(job.gone_at - fault_at, 2)
    else:
        row.notes.append(f"still alive after {hard_timeout:.0f} s: {job.left()} (killed)")
        job.kill_all()
    row.exit_code = job.exit_code if job.exit_code is not None else job.proc.poll()
    row.rank_exits = {r: job.run_file(r, "exit") for r in range(job.tp)}
    row.cause, row.cause_named = cause_of(job, patterns, fault_at)


def kill_rank(job: Job, rank: int) -> float:
    pid = job.worker_pids()[rank]
    os.kill(pid, signal.SIGKILL)
    return time.time()


def model_id(job: Job) -> str:
    return str(job.get_json("/v1/models")["data"][0]["id"])


def serving(job: Job, n: int) -> bool:
    """True once `n` requests run and tokens have come out."""
    page = job.metrics()
    return ((metric(page, "llmserve_num_requests_running") or 0) >= n
            and (metric(page, "llmserve_generation_tokens_total") or 0) > 4 * n)


def hold_at(job: Job, hold: Path, gate: str, timeout: float = 180.0) -> str:
    """Wait until every rank is held inside `gate` (see the module's docstring); returns
    the gate rank 0 reports running on /v1/engine then, which is where a fault injected now
    lands. Raises when the job ends first or the ranks never get there."""
    markers = [hold / f"held.rank{r}" for r in range(job.tp)]
    if not wait_for(lambda: all(m.exists() for m in markers) or job.proc.poll() is not None,
                    timeout, 0.02) or job.proc.poll() is not None:
        raise RuntimeError(f"the ranks were not held in the {gate} gate within {timeout:.0f} s "
                           f"(launcher exit {job.proc.poll()}): {job.stderr()[-600:]}")
    seen: list[str] = []  # the HTTP side of rank 0 may come up just after the hold began

    def probe() -> bool:
        gate_now = job.running_gate()
        if gate_now is not None:
            seen.append(gate_now)
        return gate_now is not None

    wait_for(probe, 30, 0.05)
    return seen[-1] if seen else "unknown"


def release(hold: Path) -> None:
    (hold / HOLD_RELEASE).touch()


# ---- scenarios ---------------------------------------------------------------------------

PEER_GONE = [r"was killed by SIG", r"peer rank is gone", r"lost the other ranks", r"lost rank 0",
             r"supervisor died", r"cannot serve without it", r"rank 1.*(gone|died|lost|exit)"]


def sc_kill1_at_gate(ctx: Ctx, gate: str) -> Row:
    row = Row(f"{gate}-kill1", f"kill -9 rank 1 worker inside the {gate} gate", gate=gate)
    job, hold = ctx.launch_held(row.name, gate)
    try:
        row.hit = hold_at(job, hold, gate)
        fault = kill_rank(job, 1)
        release(hold)
        finish(row, job, fault, ctx.hard_timeout, PEER_GONE)
    finally:
        job.kill_all()
    return row


def sc_traffic_kill(ctx: Ctx, rank: int) -> Row:
    row = Row(f"traffic-kill{rank}", f"kill -9 rank {rank} worker with 4 requests running")
    job = ctx.launch(row.name)
    try:
        job.wait_ready()
        clients = Clients(job, model_id(job), 4, ctx.vocab)
        if not wait_for(lambda: serving(job, 4), 120, 0.1):
            row.notes.append("the 4 requests were not all running before the kill")
        fault = kill_rank(job, rank)
        row.hit = "serving"
        patterns = PEER_GONE if rank == 1 else [r"was killed by SIG", r"lost rank 0", r"peer rank is gone",
                                                r"lost the other ranks", r"supervisor died",
                                                r"rank 0"]
        finish(row, job, fault, ctx.hard_timeout, patterns)
        row.clients, row.clients_ok = clients.summary(15)
    finally:
        job.kill_all()
    return row


def sc_warmup_sigterm(ctx: Ctx) -> Row:
    row = Row("warmup-sigterm", "SIGTERM to the launcher inside the warmup gate", gate="warmup")
    job, hold = ctx.launch_held(row.name, "warmup")
    try:
        row.hit = hold_at(job, hold, "warmup")
        job.signal_launcher(signal.SIGTERM)
        fault = time.time()
        release(hold)  # a stop signal ends the hold by itself; this is belt and braces
        finish(row, job, fault, ctx.hard_timeout,
               [r"shutdown requested", r"SIGTERM", r"drain"])
    finally:
        job.kill_all()
    return row


def _writable_copy(engine: Path, dst: Path) -> Path:
    shutil.copytree(engine, dst)
    for p in [dst, *dst.iterdir()]:
        p.chmod(p.stat().st_mode | stat.S_IWUSR)
    return dst


def sc_rm_engine_at(ctx: Ctx, gate: str) -> Row:
    """rm -rf of the engine directory inside `gate`; the verdict's side from
    expect_after_rm: the job ends naming the file, or it serves on and drains."""
    from contract.manifest import read_manifest

    expect = expect_after_rm(gate, read_manifest(ctx.engine).backend)
    row = Row(f"rm-engine-{gate}", f"rm -rf of the engine directory inside the {gate} gate "
              + ("(the job must end naming the file)" if expect == "end" else
                 "(it must serve from memory; time is SIGTERM -> gone)"),
              gate=gate, expect=expect)
    engine = _writable_copy(ctx.engine, ctx.out / row.name / "engine")
    job, hold = ctx.launch_held(row.name, gate, engine=engine)
    try:
        row.hit = hold_at(job, hold, gate)
        shutil.rmtree(engine)
        fault = time.time()
        release(hold)
        if expect == "end":
            # The cause must name what could not be read: a file of the engine.
            finish(row, job, fault, ctx.hard_timeout,
                   [rf"gate {gate} failed.*(rank\d+\.\w+|manifest\.json|\.so|\.pt2|"
                    r"No such file|cannot read)"])
        else:
            serve_then_drain(row, job, ctx.vocab, ctx.hard_timeout)
    finally:
        job.kill_all()
    return row


def serve_then_drain(row: Row, job: Job, vocab: int, hard_timeout: float) -> None:
    """The server, its engine directory gone, must get ready, answer 200 to streams,
    completions and a chat, and then drain on SIGTERM with exit 0."""
    try:
        job.wait_ready(120)
    except RuntimeError as e:
        row.clients, row.clients_ok = f"never ready: {str(e).splitlines()[0]}", False
        finish(row, job, time.time(), hard_timeout, [r"gate \w+ failed"])
        return
    model = model_id(job)
    clients = Clients(job, model, 4, vocab, max_tokens=24)
    text, ok = clients.summary(120)
    chat = http(job.port, "POST", "/v1/chat/completions",
                {"model": model, "messages": [{"role": "user", "content": "Hi"}],
                 "max_tokens": 8}, timeout=60)[0]
    engine_report = http(job.port, "GET", "/v1/engine")[0]
    ready = http(job.port, "GET", "/health/ready")[0]
    row.clients = f"{text}; chat {chat}, /v1/engine {engine_report}, ready {ready}"
    row.clients_ok = ok and all(r.outcome == "complete" for r in clients.results) \
        and chat == 200 and ready == 200
    if row.clients_ok:
        row.notes.append("kept serving from memory: every request answered 200")
    job.signal_launcher(signal.SIGTERM)
    finish(row, job, time.time(), hard_timeout, [r"drained", r"draining"])


def sc_rm_engine_ready(ctx: Ctx) -> Row:
    row = Row("rm-engine-ready", "rm -rf of the engine directory once ready; then traffic; "
              "then SIGTERM (time is SIGTERM -> gone)", expect="serve")
    engine = _writable_copy(ctx.engine, ctx.out / row.name / "engine")
    job = ctx.launch(row.name, engine=engine)
    try:
        job.wait_ready()
        shutil.rmtree(engine)
        row.hit = "after admission"
        serve_then_drain(row, job, ctx.vocab, ctx.hard_timeout)
    finally:
        job.kill_all()
    return row


def sc_engine_fault(ctx: Ctx) -> Row:
    row = Row("engine-fault", f"{FAULT_ENV}=60 with 4 requests running")
    job = ctx.launch(row.name, env={FAULT_ENV: "60"})
    try:
        job.wait_ready()
        clients = Clients(job, model_id(job), 4, ctx.vocab)
        pattern = r"the engine failed: RuntimeError: fault injected"
        if not wait_for(lambda: re.search(pattern, job.rank_log(0)) is not None, 120, 0.02):
            raise RuntimeError("the injected fault never fired")
        fault = time.time()
        row.hit = "serving"
        # The log line's own timestamp is when the fault was handled; use it when earlier.
        line = next(ln for ln in job.rank_log(0).splitlines() if re.search(pattern, ln))
        m = re.match(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3})", line)
        if m:
            fault = min(fault, datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S").timestamp()
                        + int(m.group(2)) / 1000)
        finish(row, job, fault, ctx.hard_timeout, [pattern])
        row.clients, row.clients_ok = clients.summary(15)
        bad = [r for r in clients.results if r.outcome not in ("5xx", "complete")]
        if bad:
            row.clients_ok = False
            row.notes.append("a client got neither its answer nor the engine's error: "
                             + "; ".join(f"{r.kind}: {r.detail[:80]}" for r in bad))
    finally:
        job.kill_all()
    return row


@dataclass
class Ctx:
    engine: Path
    tp: int
    out: Path
    hard_timeout: float
    vocab: int  # the clients' prompts are token ids below it

    def launch(self, name: str, engine: Path | None = None,
               env: dict[str, str] | None = None) -> Job:
        print(f"--- {name}", flush=True)
        return launch(engine or self.engine, self.out / name, self.tp,
                      ["--drain-timeout", "30"], env=env)

    def launch_held(self, name: str, gate: str, engine: Path | None = None) -> tuple[Job, Path]:
        """A job whose ranks stop inside `gate` until the harness releases them."""
        hold = (self.out / name / "hold").resolve()
        hold.mkdir(parents=True, exist_ok=True)
        return self.launch(name, engine, {INJECT_GATE_HOLD.name: f"{gate}:{hold}"}), hold


SCENARIOS: dict[str, Callable[[Ctx], Row]] = {
    "load-kill1": lambda c: sc_kill1_at_gate(c, "load"),
    "warmup-kill1": lambda c: sc_kill1_at_gate(c, "warmup"),
    "traffic-kill1": lambda c: sc_traffic_kill(c, 1),
    "traffic-kill0": lambda c: sc_traffic_kill(c, 0),
    "warmup-sigterm": sc_warmup_sigterm,
    "rm-engine-load": lambda c: sc_rm_engine_at(c, "load"),
    "rm-engine-verify": lambda c: sc_rm_engine_at(c, "verify"),
    "rm-engine-connect": lambda c: sc_rm_engine_at(c, "connect"),
    "rm-engine-ready": sc_rm_engine_ready,
    "engine-fault": sc_engine_fault,
}


def table(rows: list[Row], limit: float) -> list[str]:
    def fmt(r: Row) -> tuple[Any, ...]:
        findings = r.findings(limit)
        secs = "HANG" if r.seconds is None else f"{r.seconds:.2f}"
        exits = ", ".join(f"{k}:{v}" for k, v in r.rank_exits.items())
        return (r.name, r.hit or "-", secs, r.exit_code, exits, r.cause.replace("|", "/"),
                r.clients or "-", "; ".join(findings) or "ok")

    return common.md_table(["scenario", "fault landed", "s to exit", "exit", "rank exits",
                            "cause line", "clients", "verdict"], [fmt(r) for r in rows])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", type=Path, default=None)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--only", nargs="*", choices=sorted(SCENARIOS), default=None)
    ap.add_argument("--limit", type=float, default=10.0, help="seconds a job may take to end")
    ap.add_argument("--hard-timeout", type=float, default=45.0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    from contract.manifest import read_manifest
    from runtime.store.checkpoint import load_engine_model_config

    engine = args.engine or build_demo_engine(common.REPO / "engines", args.tp, PROFILE)
    tp = read_manifest(engine).tp
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out = args.out or common.RESULTS / f"{stamp}-faults"
    out.mkdir(parents=True, exist_ok=True)
    vocab = load_engine_model_config(engine).vocab_size
    ctx = Ctx(engine, tp, out, args.hard_timeout, vocab)
    rows: list[Row] = []
    for name in args.only or list(SCENARIOS):
        try:
            row = SCENARIOS[name](ctx)
        except Exception as e:  # the harness itself failed: say so, go on with the next
            row = Row(name, "(harness error)", notes=[f"{type(e).__name__}: {e}"[:400]])
        rows.append(row)
        print(f"    {row.seconds} s, exit {row.exit_code}, ranks {row.rank_exits}, "
              f"cause: {row.cause}" + (f"; clients: {row.clients}" if row.clients else "")
              + "".join(f"\n    note: {n}" for n in row.notes), flush=True)
    lines = [f"# Fault runs {out.name}", "", f"Engine `{engine}` (TP={tp}); a scenario over "
             f"{args.limit:.0f} s, without a named cause, or leaving a client waiting is a "
             "finding.", "", *table(rows, args.limit), ""]
    for r in rows:
        lines += [f"- {r.name}: {r.fault}" + "".join(f"; {n}" for n in r.notes)]
    md = "\n".join(lines) + "\n"
    (out / "summary.md").write_text(md)
    (out / "summary.json").write_text(json.dumps([asdict(r) for r in rows], indent=1))
    print(md, flush=True)
    findings = [r for r in rows if r.findings(args.limit)]
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
