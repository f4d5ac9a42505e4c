"""Terminal progress on stderr: one line per stage, a live bar only on a TTY.

Usage (the build opens the top-level stages; a callee opens sub-stages inside them, which
print indented)::

    with progress.stage("convert", total=nbytes, unit="B") as st:
        for chunk in ...:
            st.advance(len(chunk))

Off a TTY (CI logs, pipes) only the start and end line of each stage is printed, so logs
stay short; on a TTY the current stage is redrawn in place at most 10 times a second.
"""

from __future__ import annotations

import sys
import time
from types import TracebackType
from typing import TextIO

_REDRAW_S = 0.1


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

    def __init__(self, progress: Progress, name: str, total: float | None, unit: str) -> None:
        self.progress = progress
        self.name = name
        self.total = total
        self.unit = unit
        self.done = 0.0
        self.depth = 0
        self.started = time.perf_counter()
        self.elapsed = 0.0
        self._last_draw = 0.0

    def advance(self, n: float = 1) -> None:
        self.update(self.done + n)

    def update(self, done: float, total: float | None = None) -> None:
        self.done = done
        if total is not None:
            self.total = total
        now = time.perf_counter()
        if now - self._last_draw >= _REDRAW_S:
            self._last_draw = now
            self.progress._draw(self)

    def describe(self, final: bool = False) -> str:
        elapsed = (self.elapsed if final else time.perf_counter() - self.started) or 1e-9
        parts = []
        if self.total and not final:
            parts.append(f"{100 * self.done / self.total:5.1f}%")
        if self.done:
            amount = _format_amount(self.done, self.unit)
            if self.total and not final:
                amount += f" / {_format_amount(self.total, self.unit)}"
            parts.append(amount)
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
        self.progress._finish(self, failed=exc_type is not None)


class Progress:
    """Reports stages on ``stream`` (stderr by default); ``Progress.silent()`` prints nothing."""

    def __init__(
        self, stream: TextIO | None = None, *, live: bool | None = None, enabled: bool = True
    ) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        if live is None:
            isatty = getattr(self.stream, "isatty", None)
            live = bool(isatty and isatty())
        self.live = live and enabled
        self.durations: dict[str, float] = {}  # top-level stage name -> seconds
        self._open: list[Stage] = []
        self._line_dirty = False

    @classmethod
    def silent(cls) -> Progress:
        return cls(enabled=False)

    def stage(self, name: str, total: float | None = None, unit: str = "") -> Stage:
        st = Stage(self, name, total, unit)
        st.depth = len(self._open)
        if self._open:
            self._clear()
        self._open.append(st)
        if not self.live:
            self._line(st.depth, f"{name} ...")
        return st

    def message(self, text: str) -> None:
        self._clear()
        self._line(len(self._open), text)

    def _line(self, depth: int, text: str) -> None:
        if self.enabled:
            self.stream.write("  " * depth + text + "\n")
            self.stream.flush()

    def _clear(self) -> None:
        if self._line_dirty:
            self.stream.write("\r\033[K")
            self._line_dirty = False

    def _draw(self, st: Stage) -> None:
        if not self.live or not self._open or self._open[-1] is not st:
            return
        self.stream.write(f"\r\033[K{'  ' * st.depth}{st.name}: {st.describe()}")
        self.stream.flush()
        self._line_dirty = True

    def _finish(self, st: Stage, failed: bool) -> None:
        if st in self._open:
            self._open.remove(st)
        if st.depth == 0:
            self.durations[st.name] = self.durations.get(st.name, 0.0) + st.elapsed
        self._clear()
        status = "failed after " + f"{st.elapsed:.1f} s" if failed else st.describe(final=True)
        self._line(st.depth, f"{st.name}: {status}")
