"""Rank 0: the gates with the HTTP state kept current, admission, the engine loop, drain."""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any

from serve.api import HttpServerHandle, ServerState
from serve.comm import Comm
from serve.engine import LLMEngine
from serve.gates import GateFailure, GateLog
from serve.launch import LaunchConfig
from serve.scheduler import SchedulerConfig
from serve.startup import Startup, engine_summary, read_generation_eos

log = logging.getLogger("serve")
GATES = ("resolve", "compatible", "reserve", "load", "verify", "connect", "allocate", "kernels", "warmup")


class Rank0:
    def __init__(self, cfg: LaunchConfig, comm: Comm, life: Any, state: ServerState, http: HttpServerHandle) -> None:
        self.cfg, self.comm, self.life, self.state, self.http = cfg, comm, life, state, http
        self.log = GateLog()
        self.st = Startup(cfg, comm, self.log, interrupted=life.drain.is_set)
        self.engine: LLMEngine | None = None
        state.gates = self.log.to_list
        state.engine_report = self.report

    def report(self) -> dict[str, Any]:
        m = self.st.manifest
        return {
            "engine": engine_summary(m) if m else None,
            "gates": self.log.to_list(),
            "load": self.st.rank_loads or [self.log.get("load").evidence],
            "kv_cache": self.log.get("allocate").evidence,
            "world_size": self.comm.size,
            "phase": self.state.readiness.phase,
            "pid": os.getpid(),
        }

    def _resolve(self, ev: dict[str, Any]) -> None:
        from transformers import AutoTokenizer

        self.st.resolve(ev)
        m = self.st.manifest
        assert m is not None
        try:
            tok = AutoTokenizer.from_pretrained(self.cfg.engine)
        except (OSError, ValueError) as e:
            raise GateFailure("resolve", f"the engine has no usable tokenizer ({e})",
                              "rebuild from a checkpoint that includes its tokenizer files") from None
        self.state.tokenizer = tok
        self.state.model_name = m.model_name
        self.state.max_seq_len = m.profile.max_seq_len
        self.state.stop_token_ids = read_generation_eos(self.cfg.engine)
        ev["tokenizer"] = type(tok).__name__

    def startup(self) -> LLMEngine:
        for name in GATES:
            self.st.gate(name, self._resolve if name == "resolve" else getattr(self.st, name))
        with self.log.run("admission") as ev:
            m, runner = self.st.manifest, self.st.runner
            assert m is not None and runner is not None
            eos = tuple(dict.fromkeys((*self.state.eos_token_ids(), *self.st.model.eos_token_ids)))  # type: ignore[union-attr]
            sc = SchedulerConfig(
                max_batch_size=m.profile.max_batch_size, max_num_tokens=m.profile.max_num_tokens,
                block_size=m.profile.tokens_per_block, num_blocks=self.st.num_blocks,
                max_seq_len=m.profile.max_seq_len, eos_token_ids=eos, enable_prefix_caching=True,
            )
            engine = LLMEngine(runner, sc, self.comm)
            self.comm.allgather("admitted")
            self.comm.watch_peers(self._peer_failed)
            ev.update(open=True, max_queue=self.cfg.max_queue, url=f"http://{self.cfg.host}:{self.http.port}/v1")
        # Ready only once the gate is closed, so /health/ready never precedes the record.
        self.state.open_admission(engine)
        return engine

    def _peer_failed(self, why: str) -> None:
        if self.life.drain.is_set() and self.engine is not None and self.engine.num_unfinished() == 0:
            return  # a peer leaving at the very end of a drain is expected
        log.error("%s; the job cannot serve without it, exiting", why)
        self.state.readiness.set("failed", why)
        self.life.exit_now(1)

    def run(self) -> int:
        try:
            self.engine = engine = self.startup()
        except GateFailure as e:
            self.state.readiness.set("failed", str(e))
            print(f"error: {e}", file=sys.stderr)
            log.info("cold start so far:\n%s", self.log.table())
            self.http.stop(timeout=2)
            return 1
        log.info("admission open; cold start:\n%s", self.log.table())
        self._serve(engine)
        return 0

    def _serve(self, engine: LLMEngine) -> None:
        deadline: float | None = None
        while True:
            if self.life.drain.is_set():
                if deadline is None:
                    deadline = time.monotonic() + self.cfg.drain_timeout
                    self.state.begin_drain()
                    log.info("draining: %d running, up to %.0f s", engine.num_unfinished(), self.cfg.drain_timeout)
                idle = engine.num_unfinished() == 0 and self.state.in_flight() == 0
                if idle or time.monotonic() >= deadline:
                    break
            if engine.step() is None:
                engine._wake.wait(0.02 if deadline else 0.1)
                engine._wake.clear()
        left = engine.num_unfinished()
        engine.abort_all()
        engine.shutdown_workers()
        # Let the HTTP layer send the last responses before closing it.
        t_end = time.monotonic() + 2
        while self.state.in_flight() and time.monotonic() < t_end:
            time.sleep(0.01)
        self.http.stop(timeout=5)
        log.info("drained (%d request(s) cut at the deadline); exiting", left)
