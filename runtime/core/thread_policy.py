"""How many intra-op threads rank 0's steps run with, chosen from what the steps measure.

A step's parallel regions (OpenMP's, ours in runtime/kernels/parallel.h, AOTInductor's)
end in a barrier that waits for every thread of the team. When another process competes
for one of the cores (a load generator beside the server, a noisy neighbour) or a pod's CPU
quota runs out mid-period, one thread of the team is off its core for a scheduler slice
(milliseconds) and every region waits for it: a decode step has a few hundred regions.
Measured on 2 cores (AMD EPYC, AVX-512 BF16), SmolLM2 bf16 TP=1 served under a 1.5-core
quota beside one spinning process: 2 threads ran c=1 at ITL 1349 ms (AIPerf), OpenMP's
passive wait policy 23 ms, 1 thread 14.7 ms (llama-server: -t 2 3040 ms p99, -t 1 14 ms).
Alone on the same two cores, 2 threads are the faster by ~1.7x. Neither choice is right in
every setting and the process cannot see its neighbours, so it measures: the plan's count
(serve/threads.py) runs, and every `period_s` a probe runs a window of decode steps at half
the current count (or, below the plan, twice it), then a window at the current count again;
the faster per decoded token by `margin` is kept. The first probe comes after one second; a
probe that loses doubles the period up to `max_period_s`, one that wins resets it, so a
steady setting costs a window every minute.

Only decode steps (no prompt tokens) are measured: their cost per token is comparable from
step to step; a prompt chunk's is not. Plain data, no torch: the engine loop applies the
count (runtime/executors/loop.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Phase = Literal["run", "probe", "back"]
FIRST_PROBE_S = 1.0  # decode seconds before the first probe


@dataclass
class ThreadPolicy:
    most: int  # the plan's threads: never more
    window_s: float = 0.3  # decode time measured per arm: three CFS periods (100 ms each)
    period_s: float = 5.0  # a choice holds this long before the next probe
    max_period_s: float = 60.0
    margin: float = 0.1  # the other count must be this much faster per token to take over
    min_steps: int = 3  # and measured over at least this many steps

    current: int = field(init=False)
    phase: Phase = field(init=False, default="run")
    probes: int = field(init=False, default=0)
    switches: int = field(init=False, default=0)
    _candidate: int = field(init=False, default=0)
    _period: float = field(init=False, default=0.0)
    _since: float = field(init=False, default=0.0)  # decode seconds since the last probe
    _arm: list[float] = field(init=False, default_factory=lambda: [0.0, 0.0, 0.0])
    _probe_rate: float = field(init=False, default=0.0)
    _down_next: bool = field(init=False, default=True)

    def __post_init__(self) -> None:
        if self.most < 1:
            raise ValueError(f"most must be at least 1, got {self.most}")
        if not 0 < self.window_s < self.period_s <= self.max_period_s:
            raise ValueError("need 0 < window_s < period_s <= max_period_s")
        if not 0 <= self.margin < 1 or self.min_steps < 1:
            raise ValueError("need 0 <= margin < 1 and min_steps >= 1")
        self.current = self.most
        # The first probe comes early: a contended team costs a second a step, and a
        # server that starts beside a busy neighbour should not pay it for `period_s`.
        self._period = min(self.period_s, FIRST_PROBE_S)

    def threads(self) -> int:
        """The count the next step runs with."""
        return self._candidate if self.phase == "probe" else self.current

    def _other(self) -> int | None:
        down = self.current // 2 if self.current > 1 else None
        up = min(self.most, self.current * 2) if self.current < self.most else None
        if down is not None and up is not None:
            self._down_next = not self._down_next
            return down if not self._down_next else up
        return down if down is not None else up

    def record(self, seconds: float, tokens: int, decode: bool) -> None:
        """One step's seconds and tokens computed; only decode steps count."""
        if not decode or tokens < 1 or self.most < 2:
            return
        if self.phase == "run":
            self._since += seconds
            if self._since >= self._period:
                other = self._other()
                if other is not None:
                    self.phase, self._candidate, self._arm = "probe", other, [0.0, 0.0, 0.0]
            return
        arm = self._arm
        arm[0] += seconds
        arm[1] += tokens
        arm[2] += 1
        # Enough measured, or a count so slow that a few steps tell (one step of a team
        # that waits on a descheduled thread can take a second).
        if (arm[0] < self.window_s or arm[2] < self.min_steps) and arm[0] < 4 * self.window_s:
            return
        rate = arm[1] / arm[0]  # tokens per second
        self._arm = [0.0, 0.0, 0.0]
        if self.phase == "probe":
            self.phase, self._probe_rate = "back", rate
            return
        self.probes += 1
        self.phase, self._since = "run", 0.0
        if self._probe_rate > rate * (1 + self.margin):
            self.current = self._candidate
            self.switches += 1
            self._period = self.period_s
        else:
            self._period = min(self.max_period_s, self._period * 2)

    def as_dict(self) -> dict[str, float]:
        return {"intra_op_threads": float(self.current),
                "thread_probes_total": float(self.probes),
                "thread_switches_total": float(self.switches)}
