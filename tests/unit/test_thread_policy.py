"""The intra-op thread count chosen from measured decode steps (runtime/core/thread_policy.py),
driven with step times of a simulated machine."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from runtime.core.thread_policy import ThreadPolicy


def drive(policy: ThreadPolicy, step_s: Callable[[int], float], seconds: float,
          tokens: int = 1) -> list[int]:
    """Decode steps for `seconds` of step time; the thread count of each step."""
    used, t = [], 0.0
    while t < seconds:
        n = policy.threads()
        used.append(n)
        s = step_s(n)
        policy.record(s, tokens, decode=True)
        t += s
    return used


def test_a_contended_team_gives_way_to_fewer_threads() -> None:
    # Two threads beside a busy neighbour: every parallel region waits for a descheduled
    # thread (1.3 s a step measured); one thread runs alone at 15 ms.
    p = ThreadPolicy(2)
    used = drive(p, lambda n: 1.3 if n == 2 else 0.015, 30.0)
    assert p.current == 1 and p.switches == 1
    assert used[-50:] == [1] * 50
    # Found early: one slow step, the probe's window at one thread, one slow step back.
    assert used[0] == 2 and used[1:30].count(2) == 1
    # The probe back up to two threads keeps losing: the period doubles each time, so
    # the slow count runs a small share of the time.
    time_at_two = sum(1.3 for n in used if n == 2)
    assert p.probes >= 2 and time_at_two < 0.5 * 30


def test_an_idle_machine_keeps_every_thread() -> None:
    p = ThreadPolicy(2)
    used = drive(p, lambda n: 0.010 if n == 2 else 0.017, 60.0)
    assert p.current == 2 and p.switches == 0 and p.probes >= 2
    # Probes: a window of a third of a second, at 5 s, 10 s, 20 s... apart.
    assert used.count(1) * 0.017 < 0.05 * 60


def test_it_climbs_back_when_the_neighbour_leaves() -> None:
    p = ThreadPolicy(4)
    busy = {"on": True}

    def step(n: int) -> float:
        return (0.5 if n > 2 else 0.02) if busy["on"] else 0.04 / n

    drive(p, step, 20.0)
    assert p.current == 2
    busy["on"] = False
    drive(p, step, 200.0)
    assert p.current == 4


def test_within_the_margin_the_current_count_stays() -> None:
    p = ThreadPolicy(2, margin=0.1)
    drive(p, lambda n: 0.010 if n == 2 else 0.0095, 60.0)  # 5 % apart: noise
    assert p.current == 2 and p.switches == 0


def test_prompt_steps_and_one_thread_plans_are_not_measured() -> None:
    p = ThreadPolicy(2)
    for _ in range(1000):
        p.record(1.0, 128, decode=False)
    assert p.phase == "run" and p.probes == 0
    one = ThreadPolicy(1)
    assert drive(one, lambda n: 1.0, 100.0) == [1] * 100 and one.probes == 0


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        ThreadPolicy(0)
    with pytest.raises(ValueError):
        ThreadPolicy(2, window_s=10.0, period_s=5.0)
    with pytest.raises(ValueError):
        ThreadPolicy(2, margin=1.5)
