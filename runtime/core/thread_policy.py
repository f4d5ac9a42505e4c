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
the current count (or, below the plan, twice it) and compares it with the current count's
latest window (kept as it runs, so no step is spent re-measuring it); the faster per decoded
token by `margin` is kept. A win by less than `give_up` is measured once more: the current
count runs a window again right after the probe, and the probe must beat that one as well
(a burst on a shared host in the one window compared made a wrong switch). A probe that is
`give_up` times slower per token after a single step stops there: a contended team's step
can take a second, and a probe must not cost more than one. The first probe comes after
`period_s`, or after one second where the policy is blind to run-queue waits and starts at
the plan's count; a probe that loses doubles the period up to
`max_period_s`, or waits 50 times what it cost (up to ten minutes) if that is longer, and
one that wins resets it, so a steady setting costs a window every minute at most. A
neighbour that arrives later shows as `min_steps` steps in a row `give_up` times slower than
the fastest of their size since the last choice, and brings the next probe forward.
Contention is also seen directly: a window of steps whose stepping thread waited
`wait_share` of its time on a run queue (runtime/runqueue.py) halves a team at once, with
no probe, and makes a probe up lose.

Only decode steps (no prompt tokens) are compared by rate: their cost per token is
comparable from step to step; a prompt chunk's is not. The run-queue rule takes every step,
prompt chunks too: a share of time waited is a share whatever the step computed, and a
burst of new requests beside a busy neighbour is all prompt steps (AIPerf: its timing
service took a core at 100 % as its profiling phase began, and four 158-token prompts took
2.3-4.8 s to their first token at two threads, unseen). Plain data, no torch: the engine
loop applies the count (runtime/executors/loop.py).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Literal

Phase = Literal["run", "probe", "confirm"]
Step = tuple[float, int, float]  # a decode step: seconds, tokens, run-queue seconds
FIRST_PROBE_S = 1.0  # decode seconds before the first probe
COST_SHARE = 0.02  # a losing probe's cost, as a share of the decode time until the next
MAX_COSTLY_PERIOD_S = 600.0  # the longest wait a costly probe earns


@dataclass
class ThreadPolicy:
    most: int  # the plan's threads: never more
    start: int = 0  # the count the first steps run with (0: `most`)
    window_s: float = 0.3  # decode time measured per arm: three CFS periods (100 ms each)
    period_s: float = 5.0  # a choice holds this long before the next probe
    max_period_s: float = 60.0
    margin: float = 0.1  # the other count must be this much faster per token to take over
    min_steps: int = 3  # and measured over at least this many steps
    give_up: float = 2.0  # a probe this much slower per token ends after one step
    # Contention seen directly: the share of step time the stepping thread spent runnable
    # but off its core (runtime/runqueue.py) that makes a team of more than one give way
    # at once, and makes a probe up lose. A quarter: a neighbour that holds a core that
    # long stalls every parallel region for its time slices (two threads beside a busy
    # process: a third of each step waited, steps swinging from 5 to 60 ms), while the load
    # generator's own bursts beside a c=16 run wait 1-7 % of each half second and now and
    # then over 10 % of a window, where two threads still decode 1.6x faster than one
    # (SmolLM2 int8, AVX2 forced, AMD EPYC Zen 5, 2 cores: a tenth halved that team for
    # the rest of the run, c=16 at 268-375 tok/s against 409-421 kept at two threads).
    wait_share: float = 0.25
    # Whether `record` is given run-queue waits (runtime/runqueue.py's `available`): then a
    # contended team gives way on them, and the first probe need not come early to find it.
    sees_waits: bool = False

    current: int = field(init=False)
    phase: Phase = field(init=False, default="run")
    probes: int = field(init=False, default=0)
    switches: int = field(init=False, default=0)
    contended: int = field(init=False, default=0)  # switches down on run-queue waits
    waited_s: float = field(init=False, default=0.0)  # run-queue seconds of all steps
    _candidate: int = field(init=False, default=0)
    _period: float = field(init=False, default=0.0)
    _since: float = field(init=False, default=0.0)  # decode seconds since the last probe
    # The current count's latest decode steps, (seconds, tokens, run-queue seconds): at
    # least `window_s` and `min_steps` of them once there are that many.
    _recent: deque[Step] = field(init=False, default_factory=deque)
    _arm: list[Step] = field(init=False, default_factory=list)
    # A probe that won by less than `give_up`: the current count's window run again after
    # it, which the probe must also beat.
    _again: list[Step] = field(init=False, default_factory=list)
    # The current count's latest steps of any kind, prompt chunks too: the run-queue rule's
    # window.
    _any: deque[Step] = field(init=False, default_factory=deque)
    # The fastest step seen per token count since the last decision, and how many steps
    # in a row have taken `give_up` times that: a change (a neighbour, a spent quota).
    _fastest: dict[int, float] = field(init=False, default_factory=dict)
    _slow_run: int = field(init=False, default=0)
    _down_next: bool = field(init=False, default=True)

    def __post_init__(self) -> None:
        if self.most < 1:
            raise ValueError(f"most must be at least 1, got {self.most}")
        if not 0 < self.window_s < self.period_s <= self.max_period_s:
            raise ValueError("need 0 < window_s < period_s <= max_period_s")
        if not 0 <= self.margin < 1 or self.min_steps < 1 or self.give_up <= 1 + self.margin:
            raise ValueError("need 0 <= margin < 1, min_steps >= 1 and give_up > 1 + margin")
        if not 0 < self.wait_share < 1:
            raise ValueError(f"wait_share must be in (0, 1), got {self.wait_share}")
        if not 0 <= self.start <= self.most:
            raise ValueError(f"start must be in [0, {self.most}], got {self.start}")
        self.current = self.start or self.most
        # Blind to run-queue waits, the first probe comes early when it would go down: a
        # contended team costs a second a step, and a server that starts beside a busy
        # neighbour should not pay it for `period_s`. Seeing the waits, the team gives way
        # on them within a window, and an early probe would only cost an uncontended
        # server a window at half its threads (4-13 % of a short c=1 run, measured).
        # Starting below the plan (a fractional quota), a probe up is only a chance of
        # more, and takes its time.
        early = self.current == self.most and not self.sees_waits
        self._period = min(self.period_s, FIRST_PROBE_S) if early else self.period_s

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

    @staticmethod
    def _rate(steps: deque[Step] | list[Step]) -> float:
        """Tokens per second over `steps`."""
        return sum(t for _, t, _ in steps) / max(sum(s for s, _, _ in steps), 1e-12)

    def _waiting(self, steps: deque[Step] | list[Step]) -> bool:
        """Whether `steps`, a window's time of them, spent `wait_share` of it off a core
        (a share of time: one contended step of a second is a window by itself)."""
        seconds = sum(s for s, _, _ in steps)
        return (seconds >= self.window_s
                and sum(w for _, _, w in steps) >= self.wait_share * seconds)

    def _keep(self, step: Step, recent: deque[Step] | None = None) -> None:
        """`step` onto `recent` (the current count's decode steps by default), which keeps a
        window's time and `min_steps` of them."""
        recent = self._recent if recent is None else recent
        recent.append(step)
        while (len(recent) > self.min_steps
               and sum(s for s, _, _ in recent) - recent[0][0] >= self.window_s):
            recent.popleft()

    def _switch(self, count: int, recent: deque[Step]) -> None:
        """`count` takes over, with `recent` as its latest steps; the next probe in
        `period_s`."""
        self.current = count
        self.switches += 1
        self._period = self.period_s
        self._recent = recent
        self._any = deque(recent)

    def _decided(self) -> None:
        self.phase, self._since = "run", 0.0
        self._fastest, self._slow_run = {}, 0  # the chosen count's steps set a new normal

    def record(self, seconds: float, tokens: int, decode: bool, waited: float = 0.0) -> None:
        """One step's seconds and tokens computed, and the seconds the stepping thread
        waited on a run queue meanwhile; decode steps are compared by rate, every step
        counts for the run-queue rule."""
        if tokens < 1 or self.most < 2:
            return
        self.waited_s += waited
        step = (seconds, tokens, min(waited, seconds))
        if self.phase == "run":
            self._keep(step, self._any)
        if not decode:
            if self.phase == "run" and self.current > 1 and self._waiting(self._any):
                self._switch(self.current // 2, deque())
                self.contended += 1
                self._decided()
            return
        if self.phase == "run":
            self._keep(step)
            self._since += seconds
            if self.current > 1 and self._waiting(self._any):
                # The team waits for its own threads: the cores are not all ours (a
                # neighbour, a spent quota). Fewer threads now, no probe: a probe's windows
                # compare rates that a contention coming and going (AIPerf's) makes noise
                # of, while the wait itself is the cause, measured.
                self._switch(self.current // 2, deque())
                self.contended += 1
                self._decided()
                return
            # Steps far slower than the fastest of the same size since the last decision:
            # something changed (a neighbour, AIPerf's busy timing service, a quota), so
            # the next probe is now rather than in a minute. Per token count, so that a
            # batch that shrinks (fewer tokens a step, each dearer) does not look like it.
            fastest = self._fastest.get(tokens)
            self._slow_run = (self._slow_run + 1 if fastest is not None
                              and seconds > self.give_up * fastest else 0)
            self._fastest[tokens] = seconds if fastest is None else min(fastest, seconds)
            # Not sooner than two seconds after the last probe when it would go down (the
            # answer to contention), `period_s` when up: a contention that comes and goes
            # (AIPerf's) would otherwise bring a probe every few steps.
            soonest = 2 * FIRST_PROBE_S if self.current == self.most else self.period_s
            if self._slow_run >= self.min_steps and self._since >= soonest:
                self._since = max(self._since, self._period)
            if self._since >= self._period:
                other = self._other()
                if other is not None:
                    self.phase, self._candidate, self._arm = "probe", other, []
            return
        if self.phase == "confirm":
            self._again.append(step)
            if not self._window_done(self._again):
                return
            self._decide(self._rate(self._again))
            return
        arm = self._arm
        arm.append(step)
        base = self._rate(self._recent)
        lost_already = self._rate(arm) * self.give_up < base
        if not lost_already and not self._window_done(arm):
            return
        self.probes += 1
        if self._wins(base) and self._rate(arm) < base * self.give_up:
            # A win by less than `give_up` is measured once more: the current count's
            # window again, right after the probe. A host whose speed moves from one window
            # to the next (a neighbour's burst in the current count's window, memory
            # shared with other machines) made one thread win a c=1 bf16 decode where
            # it is 1.3x slower (AVX2 forced, AMD EPYC Zen 5, 2 cores: served
            # c=1 65.8 tok/s against llama-server's 92.9 until a later probe took it back).
            self.phase, self._again = "confirm", []
            return
        self._decide(base)

    def _window_done(self, steps: list[Step]) -> bool:
        seconds = sum(s for s, _, _ in steps)
        return ((seconds >= self.window_s and len(steps) >= self.min_steps)
                or seconds >= 4 * self.window_s)

    def _wins(self, base: float) -> bool:
        """Whether the probe's arm beat `base` (tokens per second) by the margin without
        waiting on a run queue: more threads that wait would give way again at once."""
        waits = self._candidate > 1 and self._waiting(self._arm)
        return self._rate(self._arm) > base * (1 + self.margin) and not waits

    def _decide(self, base: float) -> None:
        """End the probe: its count takes over if it beat `base` and the current count's
        window before it (the faster of the two); otherwise the next probe waits longer."""
        arm, before = self._arm, self._rate(self._recent)
        base = max(base, before)
        if self._wins(base):
            self._switch(self._candidate, deque(arm))
        else:
            # What the probe cost beyond the current count's rate for the same tokens: the
            # next probe waits at least `COST_SHARE`'s inverse times that (one step of a
            # contended team beside a neighbour took 2.5 s: probes a minute apart would
            # cost 4 % of the time), up to `MAX_COSTLY_PERIOD_S`.
            arm_s, arm_tokens = sum(s for s, _, _ in arm), sum(t for _, t, _ in arm)
            lost = max(0.0, arm_s - arm_tokens / max(before, 1e-12))
            self._period = min(MAX_COSTLY_PERIOD_S,
                               max(min(self.max_period_s, self._period * 2), lost / COST_SHARE))
            if self._again:  # the current count's latest steps, measured just now
                self._recent = deque(self._again)
        self._again = []
        self._decided()

    def as_dict(self) -> dict[str, float]:
        return {"intra_op_threads": float(self.current),
                "thread_probes_total": float(self.probes),
                "thread_switches_total": float(self.switches),
                "thread_contended_switches_total": float(self.contended),
                "thread_run_queue_wait_seconds_total": self.waited_s}
