"""Serving a TensorRT-LLM engine: rank 0 (gates, admission, drain) and the other ranks.

serve/worker.py dispatches here when the engine's manifest says backend "trtllm". Rank 0
runs the gates with the HTTP state kept current, opens admission with the TrtllmExecutor
adapter and waits for a drain; the other ranks pass the gates, then block in the Executor's
shutdown() (LEADER mode: their executor threads follow the leader) until rank 0 shuts down.

MPI: the supervisor process bootstrapped our control plane over MPI before starting this
worker; TensorRT-LLM then initializes MPI again in this process, as the same rank. Open MPI
then needs this process to finalize before the supervisor does (else its finalize hangs),
so a clean exit finalizes here, while the supervisor is alive to finalize after us.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import Any

from serve.comm import Comm
from serve.gates import GateFailure, GateLog
from serve.launch import LaunchConfig
from serve.plan import StepPlan
from serve.rank0 import GATES, Rank0
from serve.startup_trtllm import TrtllmStartup

log = logging.getLogger("serve")
FINALIZE_TIMEOUT_S = 10.0


def finalize_mpi(supervisor_pid: int) -> None:
    """MPI_Finalize (bounded) when MPI is up and our supervisor still waits for us."""
    if os.getppid() != supervisor_pid or supervisor_pid <= 1:
        return  # the supervisor is gone (a drain past Open MPI's kill): nobody to hang
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None:
        import mpi4py

        mpi4py.rc.initialize = False  # never initialize MPI just to finalize it
        from mpi4py import MPI as mpi
    if not mpi.Is_initialized() or mpi.Is_finalized():
        return
    t = threading.Thread(target=mpi.Finalize, name="mpi-finalize", daemon=True)
    t.start()
    t.join(FINALIZE_TIMEOUT_S)
    if t.is_alive():
        log.warning("MPI_Finalize did not return within %.0f s; exiting anyway", FINALIZE_TIMEOUT_S)


class TrtllmRank0(Rank0):
    """Rank 0 for a TensorRT-LLM engine: Rank0's gate table, report and peer watch, with
    TrtllmStartup's gates and the TrtllmExecutor adapter instead of our engine loop."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.st = TrtllmStartup(self.cfg, self.comm, self.log, interrupted=self.life.drain.is_set)
        self._supervisor = os.getppid()

    def _resolve(self, ev: dict[str, Any]) -> None:
        super()._resolve(ev)  # manifest, tokenizer, model name, generation_config eos
        st, tok = self.st, self.state.tokenizer
        assert isinstance(st, TrtllmStartup) and st.model is not None
        st.eos_token_ids = tuple(dict.fromkeys((*self.state.eos_token_ids(),
                                                *st.model.eos_token_ids)))
        pad = getattr(tok, "pad_token_id", None)
        st.pad_id = int(pad) if isinstance(pad, int) else (st.eos_token_ids or (0,))[0]

    def startup(self) -> Any:  # type: ignore[override]
        for name in GATES:
            self.st.gate(name, self._resolve if name == "resolve" else getattr(self.st, name))
        with self.log.run("admission") as ev:
            adapter = self.st.adapter  # type: ignore[attr-defined]
            assert adapter is not None
            self.comm.allgather("admitted")
            self.comm.watch_peers(self._peer_failed)
            ev.update(open=True, max_queue=self.cfg.max_queue, executor="TensorRT-LLM",
                      url=f"http://{self.cfg.host}:{self.http.port}/v1")
        # Ready only once the gate is closed, as Rank0.startup does.
        self.state.open_admission(adapter)
        return adapter

    def run(self) -> int:
        rc = super().run()
        if rc == 0:
            finalize_mpi(self._supervisor)
        return rc

    def _serve(self, adapter: Any) -> None:  # type: ignore[override]
        deadline: float | None = None
        while True:
            if adapter.error is not None:  # the job cannot serve without its Executor
                log.error("%s; exiting", adapter.error)
                self.state.readiness.set("failed", adapter.error)
                self.life.exit_now(1)
            if self.life.drain.is_set():
                if deadline is None:
                    deadline = time.monotonic() + self.cfg.drain_timeout
                    self.state.begin_drain()
                    log.info("draining: %d running, up to %.0f s", adapter.num_unfinished(),
                             self.cfg.drain_timeout)
                idle = adapter.num_unfinished() == 0 and self.state.in_flight() == 0
                if idle or time.monotonic() >= deadline:
                    break
            self.life.drain.wait(0.02 if deadline else 0.1)
        left = adapter.cancel_all()
        # Tell the other ranks this is an orderly end before their shutdown() returns.
        self.comm.send_plan(StepPlan(step_id=-1, shutdown=True))
        try:
            adapter.shutdown()
            log.info("Executor shut down (rank 0, the leader); the other ranks are released")
        except Exception:
            log.exception("Executor.shutdown() failed")
        t_end = time.monotonic() + 2
        while self.state.in_flight() and time.monotonic() < t_end:
            time.sleep(0.01)
        self.http.stop(timeout=5)
        log.info("drained (%d request(s) cut at the deadline); exiting", left)


def _watch_leader(comm: Comm, orderly: threading.Event, life: Any) -> None:
    """Ranks > 0: rank 0 sends one shutdown plan before it shuts down; EOF without it means
    rank 0 died, and our shutdown() would wait for it forever."""
    try:
        plan = comm.recv_plan()
        if plan.shutdown:
            orderly.set()
            return
    except (ConnectionError, OSError, EOFError):
        pass
    if not orderly.is_set():
        log.error("lost rank 0 (the leader) before it shut down; exiting")
        life.exit_now(1)


def serve_worker_trtllm(cfg: LaunchConfig, comm: Comm, life: Any) -> int:
    supervisor = os.getppid()
    st = TrtllmStartup(cfg, comm, GateLog(), interrupted=life.drain.is_set)
    try:
        for name in GATES:
            st.gate(name, getattr(st, name))
        comm.allgather("admitted")
    except GateFailure as e:
        print(f"error: rank {comm.rank}: {e}", file=sys.stderr)
        return 1
    orderly = threading.Event()
    threading.Thread(target=_watch_leader, args=(comm, orderly, life), name="leader-watch",
                     daemon=True).start()
    log.info("Executor constructed (not the leader); blocking in Executor.shutdown() until "
             "rank 0 shuts down")
    st.executor.shutdown()
    log.info("Executor.shutdown() returned; exiting")
    finalize_mpi(supervisor)
    return 0
