"""Terminal progress on stderr: one line per stage, a live tqdm bar only on a TTY.

Usage (the build opens the top-level stages; a callee opens sub-stages inside them, which
print indented)::

    with progress.stage("convert", total=nbytes, unit="B") as st:
        for chunk in ...:
            st.advance(len(chunk))

Off a TTY (CI logs, pipes) only the start and end line of each stage is printed, so logs
stay short. On a TTY tqdm draws each open stage as a bar (nested stages on the lines below)
and redraws it in place; the end lines scroll above the bars.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from types import TracebackType
from typing import TextIO

from tqdm import tqdm


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _format_amount(n: float, unit: str) -> str:
    if unit == "B":
        return format_bytes(n)
    text = f"{n:.0f}" if n == int(n) or n >= 100 else f"{n:.1f}"
    return f"{text} {unit}".rstrip()


class Stage:
    """One timed stage; advance it with ``advance(n)`` or set it with ``update(done)``."""

    def __init__(
        self, progress: Progress, name: str, total: float | None, unit: str, depth: int
    ) -> None:
        self.progress = progress
        self.name = name
        self.total = total
        self.unit = unit
        self.depth = depth
        self.done: float = 0  # an int while advanced by ints, so tqdm shows "4/6", not "4.0/6"
        self.started = time.perf_counter()
        self.elapsed = 0.0
        # The live bar. Disabled off a TTY, where tqdm then draws nothing and costs nothing.
        # leave=False: the bar is wiped at the end, and our end line (the same one a log gets)
        # takes its place. tqdm throttles redraws (mininterval) and stacks nested bars itself.
        # Without a total there is no bar to draw; "name ..." says what is running (tqdm's
        # "0it [00:00, ?it/s]" would not tick anyway: it redraws only when advanced).
        self._bar = tqdm(
            desc="  " * depth + name, total=total, unit=unit or "it", leave=False,
            unit_scale=unit == "B", unit_divisor=1024, mininterval=0.1,
            bar_format=None if total else "{desc} ...",
            file=progress.stream, disable=not progress.live, dynamic_ncols=True,
        )

    def advance(self, n: float = 1) -> None:
        self.update(self.done + n)

    def update(self, done: float, total: float | None = None) -> None:
        if total is not None:
            self.total = self._bar.total = total
            self._bar.bar_format = None  # now there is a bar to draw
        self._bar.update(done - self.done)
        self.done = done

    def summary(self) -> str:
        """The end line's text: amount, elapsed time, rate."""
        elapsed = self.elapsed or 1e-9
        parts = [_format_amount(self.done, self.unit)] if self.done else []
        parts.append(f"{elapsed:.1f} s")
        if self.done and elapsed > 0.05:
            parts.append(f"{_format_amount(self.done / elapsed, self.unit)}/s")
        return "  ".join(parts)

    def __enter__(self) -> Stage:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.elapsed = time.perf_counter() - self.started
        self._bar.close()
        self.progress._finish(self, failed=exc_type is not None)


class Progress:
    """Reports stages on ``stream`` (stderr by default); ``Progress.silent()`` prints nothing."""

    def __init__(
        self, stream: TextIO | None = None, *, live: bool | None = None, enabled: bool = True,
        checkpoint: Callable[[], None] | None = None,
    ) -> None:
        # Called as each stage starts: the CLI re-raises there a stop signal whose exception
        # Python swallowed (raised inside a finalizer), so the build still stops.
        self.checkpoint = checkpoint
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        if live is None:
            isatty = getattr(self.stream, "isatty", None)
            live = bool(isatty and isatty())
        self.live = live and enabled
        self.durations: dict[str, float] = {}  # top-level stage name -> seconds
        self._depth = 0  # stages open now; a new one nests under them

    @classmethod
    def silent(cls) -> Progress:
        return cls(enabled=False)

    def stage(self, name: str, total: float | None = None, unit: str = "") -> Stage:
        if self.checkpoint is not None:
            self.checkpoint()
        st = Stage(self, name, total, unit, self._depth)
        self._depth += 1
        if not self.live:  # on a TTY the bar shows the stage has started
            self._line(st.depth, f"{name} ...")
        return st

    def message(self, text: str) -> None:
        self._line(self._depth, text)

    def _line(self, depth: int, text: str) -> None:
        if not self.enabled:
            return
        if self.live:  # tqdm lifts the live bars off the screen, prints, redraws them below
            tqdm.write("  " * depth + text, file=self.stream)
        else:  # a log gets the plain line, whatever other tqdm bars are open
            self.stream.write("  " * depth + text + "\n")
        self.stream.flush()

    def _finish(self, st: Stage, failed: bool) -> None:
        self._depth = max(self._depth - 1, 0)
        if st.depth == 0:
            self.durations[st.name] = self.durations.get(st.name, 0.0) + st.elapsed
        status = f"failed after {st.elapsed:.1f} s" if failed else st.summary()
        self._line(st.depth, f"{st.name}: {status}")
