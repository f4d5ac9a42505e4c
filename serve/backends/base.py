"""What a backend supplies to the one start-up sequence (serve/startup.py) and to rank 0's
serving loop: its gates as an ordered, typed chain (`gates()`), and what that chain ends in,
the `Serving` half: the executor admission opens with, how it is driven, and what the other
ranks do while rank 0 serves.

The base class holds what every backend shares: the TP world-size check, the cross-rank
agreement on the engine in `connect`, and checking every byte loaded against the manifest
in `verify`.
"""

from __future__ import annotations

import socket
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from serve.gates import HOST_FACTS, Evidence, GateChain, GateFailure
from serve.stages import GateContext, Resolved

if TYPE_CHECKING:
    from runtime.core.types import Executor
    from runtime.models.config import ModelConfig

T = TypeVar("T")


class EngineFault(RuntimeError):
    """The engine cannot go on serving (its executor failed); rank 0 fails the job."""


class Serving(ABC):
    """What the gates end in: an engine ready to serve, on one rank."""

    @abstractmethod
    def open(self, ev: Evidence) -> Executor:
        """Rank 0, gate 10: the executor the HTTP layer submits to."""

    @abstractmethod
    def poll(self, timeout: float) -> None:
        """Rank 0's loop: advance the engine, or wait up to `timeout` seconds for work.
        Raises EngineFault when the engine cannot serve any more."""

    @abstractmethod
    def close(self) -> int:
        """Rank 0 after the drain: cut what is left (returns how many), release the ranks."""

    @abstractmethod
    def follow(self, exit_now: Callable[[int], None]) -> int:
        """Ranks > 0 after admission: serve until rank 0 ends the job; the exit code.
        `exit_now(code)` leaves at once from any thread (the job is failing)."""

    def finalize(self) -> None:  # noqa: B027 (most backends have nothing to finalize)
        """After a clean exit, before the process ends."""


class Backend(ABC):
    """One engine kind at serve time, built in gate 1 (resolve) from the resolved engine:
    its constructor reads what the engine says about itself beyond the manifest (the
    model config) and fails gate 1 when that is unusable."""

    model: ModelConfig  # set by every backend's constructor

    def __init__(self, ctx: GateContext, resolved: Resolved) -> None:
        self.ctx = ctx
        self.cfg, self.comm = ctx.cfg, ctx.comm
        self.manifest, self.files, self.source = resolved.manifest, resolved.files, resolved.source
        # Set by load: the digest of each file this rank read, computed while reading it.
        self.loaded: dict[str, str] = {}

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def engine_dir(self) -> Path:
        """The engine's local directory, for backends whose runtime reads it itself."""
        d = self.source.local_dir
        if d is None:
            raise GateFailure("resolve", f"this engine's runtime reads a directory, and "
                              f"{self.source.where} is in an object store",
                              f"pull it first (`pipeline pull {self.source.where}`) and serve "
                              "the directory it prints")
        return d

    @abstractmethod
    def gates(self) -> GateChain[Serving]:
        """Gates 2-9 in order (compatible ... warmup), each taking what the one before it
        produced; the last produces the engine ready to serve."""

    # ---- gates shared by every backend ---------------------------------------------------

    def check_world(self, remedy: str | None = None) -> None:
        m = self.manifest
        if self.comm.size != m.tp:
            raise GateFailure(
                "compatible",
                f"the engine was built for TP={m.tp} but mpirun started {self.comm.size} rank(s)",
                remedy or f"run: mpirun -n {m.tp} serve launch --engine {self.cfg.engine}",
            )

    def check_files_present(self, ev: Evidence) -> None:
        """Every file this rank will read is on this host's storage at the manifest's size
        (the bytes are hashed as they are read, in load and verify): an engine copied to
        only some hosts, or copied in part, fails here naming the host's missing files."""
        entries = self.manifest.rank_files(self.rank)
        facts = ev.setdefault(HOST_FACTS, {})
        if self.source.local_dir is None:  # an engine in a store: each rank reads its own
            # objects (or its cache's verified copies); a missing one is named when read.
            facts.update(files=len(entries), bytes=sum(f.size for f in entries),
                         source="store")
            return
        bad = self.files.missing([f.path for f in entries])
        if bad:
            shown = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
            raise GateFailure(
                "compatible", f"the engine is not complete on this host's storage: {shown} "
                f"missing or of the wrong size in {self.cfg.engine}",
                "give every host the same engine at the same path (a shared volume, or pull it "
                "by tag on each host), then `pipeline verify` it there")
        facts.update(files=len(entries), bytes=sum(f.size for f in entries))

    def small_files(self) -> tuple[str, ...]:
        """Other files this rank loads later (kernels); verified copies made in verify."""
        return ()

    def verify(self, loaded: T, ev: Evidence) -> T:
        """Every file load read (self.loaded) against the manifest's digests; the small
        files verified copies. Passes load's result on."""
        expected = {f.path: f.sha256 for f in self.manifest.rank_files(self.rank)}
        bad = [name for name, digest in self.loaded.items() if expected.get(name) != digest]
        if bad:
            raise GateFailure(
                "verify", f"{', '.join(self._where(n) for n in bad)} does not match the "
                "manifest's sha256 (corrupted or modified)",
                f"restore or rebuild the engine; {self.source.verify_hint}")
        for rel in self.small_files():
            self.files.get(rel)
        first = next(iter(self.loaded.values()), "")
        ev.update(files=[*self.loaded, *(f for f in self.files.verified if f not in self.loaded)],
                  sha256=first[:16], hashed_while_loading=True)
        return loaded

    def _where(self, name: str) -> str:
        """A file as a person finds it: its object's URL when it came from a store."""
        loaded_from = self.ctx.log.evidence("load").get("object")
        return loaded_from if loaded_from and loaded_from.endswith("/" + name) else name

    def init_collectives(self) -> str:
        """Bring up the data plane between ranks; returns what it is (connect evidence)."""
        return "none"

    def connect(self, prev: T, ev: Evidence) -> T:
        """Every rank agrees on the engine and the host map; the data plane comes up.
        Passes the previous gate's result on."""
        collectives = self.init_collectives()
        me = self.comm.host_of(self.rank)
        mine = {"rank": self.rank, "engine_id": self.manifest.engine_id,
                "host": socket.gethostname(), "key": me.key if me else None,
                "load": self.ctx.log.evidence("load")}
        everyone = self.comm.allgather(mine)
        ids = {e["engine_id"] for e in everyone}
        if len(ids) > 1 or [e["rank"] for e in everyone] != list(range(self.comm.size)):
            raise GateFailure("connect", f"ranks disagree on the engine: {sorted(ids)}",
                              "give every rank the same --engine")
        moved = [e["rank"] for e, h in zip(everyone, self.comm.hosts) if e["key"] != h.key]
        if moved:
            raise GateFailure("connect", f"rank(s) {moved} report another host than at the "
                              "bootstrap", "report this: the ranks' host map is inconsistent")
        self.ctx.rank_loads[:] = [e["load"] for e in everyone]
        hosts = self.comm.num_hosts
        if self.comm.size > 1 and hosts > 1:
            collectives = f"{collectives} across {hosts} hosts"
        ev.update(collectives=collectives if self.comm.size > 1 else "none (TP=1)",
                  world=self.comm.size, hosts=sorted({e["host"] for e in everyone}),
                  ranks=[{"rank": r, **h.to_dict()} for r, h in enumerate(self.comm.hosts)])
        return prev
