"""Rank 0: the gates with the HTTP state kept current, admission, the serving loop, drain."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any

from contract.layout import GENERATION_CONFIG, TOKENIZER_FILES
from runtime.store.files import EngineFiles
from serve.backends import EngineFault, Serving
from serve.cores import pin_compute_thread
from serve.gates import Evidence, GateFailure, GateLog
from serve.gcpolicy import PAUSES, freeze_heap
from serve.http_startup import HttpStartup, HttpStartupFailed
from serve.launch import EXIT_DRAIN_CUT
from serve.lifecycle import Lifecycle
from serve.stages import GateContext, Resolved, StopTokens
from serve.startup import Startup, engine_summary, read_generation_eos

if TYPE_CHECKING:
    from runtime.core.types import Executor
    from runtime.dist.comm import Comm
    from runtime.tokenizer import FastTokenizer
    from serve.api import HttpServerHandle, ServerState
    from serve.launch import LaunchConfig

log = logging.getLogger("serve")
PEER_FAILED_GRACE_S = 2.0  # a dead peer: time for the engine loop to answer what is in flight
PEER_LOST_WAIT_S = 1.0  # an engine failure: how long a dead peer's hang-up may take to arrive


class Rank0:
    def __init__(self, cfg: LaunchConfig, comm: Comm, life: Lifecycle,
                 threads: dict[str, object] | None = None) -> None:
        self.cfg, self.comm, self.life = cfg, comm, life
        self.threads = threads or {}
        self.log = GateLog()
        self.ctx = GateContext(cfg, comm, self.log, interrupted=life.drain.is_set)
        self.st = Startup(self.ctx)
        self._tok_thread: threading.Thread | None = None
        self._tok: FastTokenizer | None = None
        self._tok_error = ""
        self._tok_s = 0.0
        self._http = HttpStartup(cfg, self._attach)

    def _attach(self, state: ServerState) -> None:
        """The HTTP state, before it answers its first request: the timeline and report."""
        state.gates = self.log.to_list
        state.engine_report = self.report

    @property
    def state(self) -> ServerState:
        return self._http.wait()[0]

    @property
    def http(self) -> HttpServerHandle:
        return self._http.wait()[1]

    def report(self) -> dict[str, Any]:
        m = self.st.resolved.manifest if self.st.resolved is not None else None
        return {
            # What --engine named (a tag, say) beside the engine id it resolved to.
            "engine": {**engine_summary(m), "resolved_from": self.cfg.engine} if m else None,
            "gates": self.log.to_list(),
            "load": self.ctx.rank_loads or [self.log.evidence("load")],
            "kv_cache": self.log.evidence("allocate"),
            # The drafter the engine loop runs (speculative decoding), once admission opened.
            "speculative": self.log.evidence("admission").get("speculative"),
            "world_size": self.comm.size,
            "topology": self.comm.topology(),
            "threads": self.threads,
            "gc": PAUSES.report(),
            "phase": self.state.readiness.phase,
            "pid": os.getpid(),
        }

    def _tokenizer(self, ev: Evidence) -> None:
        """Gate 1 on rank 0: the tokenizer files, verified; the tokenizer itself loads on a
        thread of its own while the other gates run (it is needed only at admission)."""
        resolved = self._resolved()
        files = resolved.files
        # Only the tokenizer files the manifest lists, from their verified copies.
        files.get_listed((*TOKENIZER_FILES, GENERATION_CONFIG))
        self._tok_thread = threading.Thread(target=self._load_tokenizer, args=(files,),
                                            name="tokenizer", daemon=True)
        self._tok_thread.start()
        ev["tokenizer"] = "loading beside the other gates"
        if resolved.manifest.backend == "trtllm":  # its kernels gate needs the eos ids
            self._tokenizer_ready(ev)

    def _resolved(self) -> Resolved:
        """What gate 1 resolved (its rank-0 work runs once it has)."""
        if self.st.resolved is None:
            raise RuntimeError("gate 1 (resolve) has not resolved the engine yet")
        return self.st.resolved

    def _load_tokenizer(self, files: EngineFiles) -> None:
        from runtime.tokenizer import FastTokenizer

        t0 = time.perf_counter()
        try:
            tok = FastTokenizer(files.dir)
            if self.cfg.chat_template is not None:  # --chat-template replaces the engine's
                tok.chat_template = self.cfg.chat_template.read_text()
        except Exception as e:  # a missing or unreadable tokenizer.json, a bad config
            self._tok_error = f"{type(e).__name__}: {' '.join(str(e).split())}"
            self._tok_s = time.perf_counter() - t0
            return
        # What the first request would otherwise pay: jinja2's import and the template's
        # compilation, the first encode and decode.
        with contextlib.suppress(Exception):  # a template may refuse this conversation
            tok.decode(tok.encode("Hello"), skip_special_tokens=True)
            if tok.chat_template:
                tok.apply_chat_template([{"role": "user", "content": "Hello"}],
                                        add_generation_prompt=True)
        self._tok = tok
        self._tok_s = time.perf_counter() - t0

    def _tokenizer_ready(self, ev: Evidence | None = None) -> None:
        """Before admission: the tokenizer, and with it the ids that end a sequence."""
        assert self._tok_thread is not None
        if self.state.tokenizer is not None:
            return
        self._tok_thread.join()
        if self._tok is None:
            raise GateFailure("resolve", f"the engine has no usable tokenizer ({self._tok_error})",
                              "rebuild from a checkpoint that includes its tokenizer files")
        resolved, backend = self._resolved(), self.st.backend
        if backend is None:
            raise RuntimeError("gate 1 (resolve) has not built the backend yet")
        m, model, files = resolved.manifest, backend.model, resolved.files
        tok = self._tok
        self.state.tokenizer = tok
        self.state.model_name = m.model_name
        self.state.max_seq_len = m.profile.max_seq_len
        self.state.stop_token_ids = read_generation_eos(files.dir)
        self.state.vocab_size = model.vocab_size
        # The one place the ids that end a sequence are decided: generation_config.json's,
        # the tokenizer's and the model config's. The HTTP layer (each request's stop ids),
        # the scheduler and TensorRT-LLM's Executor all take this set as it is.
        eos = tuple(dict.fromkeys((*self.state.eos_token_ids(), *model.eos_token_ids)))
        pad = tok.pad_token_id
        self.ctx.stop = StopTokens(eos, int(pad) if isinstance(pad, int) else (eos or (0,))[0])
        self.state.stop_token_ids = eos
        found = {"tokenizer": type(tok).__name__, "tokenizer_s": round(self._tok_s, 3),
                 "tokenizer_vocab": len(tok)}
        if ev is not None:  # still inside gate 1
            ev.update(found)
        else:
            self.log.amend("resolve", **found)

    def startup(self) -> tuple[Serving, Executor]:
        self.st.run(on_resolved=self._tokenizer, until="kernels")
        # Liveness before the warmup: the HTTP layer came up on its thread while the gates
        # ran (it is needed for admission anyway), so a probe or a stop signal always finds
        # the job still starting, never past a warmup that raced it.
        _ = self.http
        serving = self.st.serve()
        self._tokenizer_ready()
        with self.log.run("admission") as ev:
            executor = serving.open(ev)
            ev.update(freeze_heap())
            self.comm.allgather("admitted")
            # From now on a failed peer fails the requests in flight, and a rank > 0 whose
            # host is stopping may ask for a drain (the peer watch reads the request).
            self.life.on_peer_failure = self._peer_failed
            self.comm.peer_watch.accept_drain_requests()
            ev.update(open=True, max_queue=self.cfg.max_queue,
                      url=f"http://{self.cfg.host}:{self.http.port}/v1")
        # Ready only once the gate is closed, so /health/ready never precedes the record.
        self.state.open_admission(executor)
        self.life.serving.set()
        return serving, executor

    def _peer_failed(self, why: str) -> None:
        executor = self.state.executor
        if self.life.drain.is_set() and executor is not None and executor.num_unfinished() == 0:
            return  # a peer leaving at the very end of a drain is expected
        log.error("%s; the job cannot serve without it, exiting", why)
        self.state.readiness.set("failed", why)
        # Requests in flight: the engine loop's next collective fails as well and it answers
        # each of them (a 500, or a final SSE error event; see _fail). Leaving at once
        # would drop their connections instead, so give it a moment (bounded) first.
        t_end = time.monotonic() + PEER_FAILED_GRACE_S
        while (executor is not None and (executor.num_unfinished() or self.state.in_flight())
               and time.monotonic() < t_end):
            time.sleep(0.01)
        self.life.exit_now(1)

    def run(self) -> int:
        # This thread loads, warms up and runs the steps; the threads it starts from here
        # (OpenMP's) share its cores, the HTTP thread (already started) runs anywhere.
        pinned = pin_compute_thread(self.comm.local_rank, self.comm.local_size)
        if pinned is not None:
            self.threads["step_thread_cores"] = pinned
        try:
            serving, executor = self.startup()
        except GateFailure as e:
            self.life.error(str(e))
            log.info("cold start so far:\n%s", self.log.table())
            with contextlib.suppress(Exception):  # an HTTP layer that never came up
                self.state.readiness.set("failed", str(e))
                self.http.stop(timeout=2)
            return 1
        except HttpStartupFailed as e:  # e.g. the port was taken after all
            self.life.error(f"{e} — choose another --port or stop the other server")
            return 2
        log.info("admission open; cold start:\n%s", self.log.table())
        cut = self._serve(serving, executor)
        serving.finalize()
        return EXIT_DRAIN_CUT if cut else 0

    def _fail(self, why: str) -> None:
        """The engine failed: every request already has its error; let the HTTP layer send
        them (a 500, or a final SSE error event), then end the job."""
        lost = self.comm.peer_watch.lost_peer(PEER_LOST_WAIT_S)
        if lost is not None:  # a collective failed because a peer died: name it and its host
            why = f"{lost}; {why}"
        log.error("%s; exiting", why)
        self.state.readiness.set("failed", why)
        t_end = time.monotonic() + 2
        while self.state.in_flight() and time.monotonic() < t_end:
            time.sleep(0.01)
        self.http.stop(timeout=2)
        self.life.exit_now(1)

    def _serve(self, serving: Serving, executor: Executor) -> int:
        """Serve until drained; returns how many requests the drain deadline cut off."""
        deadline: float | None = None
        while True:
            if self.life.drain.is_set():
                if deadline is None:
                    deadline = time.monotonic() + self.cfg.drain_timeout
                    self.state.begin_drain()
                    log.info("draining: %d running, up to %.0f s", executor.num_unfinished(),
                             self.cfg.drain_timeout)
                idle = executor.num_unfinished() == 0 and self.state.in_flight() == 0
                if idle or time.monotonic() >= deadline:
                    break
            try:
                serving.poll(0.02 if deadline else 0.1)
            except EngineFault as e:
                self._fail(str(e))
        left = serving.close()
        # Let the HTTP layer send the last responses before closing it.
        t_end = time.monotonic() + 2
        while self.state.in_flight() and time.monotonic() < t_end:
            time.sleep(0.01)
        self.http.stop(timeout=5)
        log.info("drained (%d request(s) cut at the deadline); exiting", left)
        return left
