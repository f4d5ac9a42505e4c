"""What the start-up sequence hands a backend: the job's context, and the resolved engine.

The common part of gate 1 (serve/startup.py) produces `Resolved`; the backend is built from
it (serve/backends/), so every later gate has the manifest, the engine's files and where
they are read from, never "not yet known". Neither type imports a backend: the backends
and the sequence both import this module, and not each other's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from contract.manifest import Manifest
from runtime.dist.comm import Comm
from runtime.store.files import EngineFiles
from runtime.store.source import EngineSource, Pinned
from serve.gates import GateLog
from serve.launch import LaunchConfig


def _never() -> bool:
    return False


@dataclass(frozen=True, slots=True)
class StopTokens:
    """The ids that end a sequence, and the id that pads one: rank 0 decides them once, from
    the tokenizer, generation_config.json and the model config (serve/rank0.py); the
    engine's scheduler or Executor uses them as given."""

    eos_token_ids: tuple[int, ...] = ()
    pad_id: int = 0

    def __post_init__(self) -> None:
        if not all(isinstance(t, int) and t >= 0 for t in (*self.eos_token_ids, self.pad_id)):
            raise ValueError(f"token ids must be non-negative ints: {self}")


@dataclass(slots=True)
class GateContext:
    """One rank's start-up: its launch configuration, the ranks, the gate timeline, and
    whether a stop signal arrived. `rank_loads` and `stop` are filled in by gates (connect,
    and rank 0's gate 1) for rank 0's report and serving."""

    cfg: LaunchConfig
    comm: Comm
    log: GateLog
    interrupted: Callable[[], bool] = _never
    rank_loads: list[dict[str, Any]] = field(default_factory=list)  # every rank's load evidence
    stop: StopTokens = field(default_factory=StopTokens)

    @property
    def rank(self) -> int:
        return self.comm.rank


@dataclass(frozen=True, slots=True)
class Resolved:
    """Gate 1's result: the engine's manifest, verified access to its files, and where they
    are read from (a directory, or a store pinned by rank 0)."""

    manifest: Manifest
    files: EngineFiles  # verified private copies of what the gates read
    source: EngineSource
    pinned: Pinned | None = None  # rank 0's resolution of a store reference

    def __post_init__(self) -> None:
        if self.pinned is not None and self.pinned.engine_id != self.manifest.engine_id:
            raise ValueError(f"the manifest is engine {self.manifest.engine_id}, not the "
                             f"pinned {self.pinned.engine_id}")
