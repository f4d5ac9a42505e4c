"""pipeline.progress: plain start/end lines off a TTY, live tqdm bars on one."""

from __future__ import annotations

import io
from types import SimpleNamespace

import pytest

from pipeline import progress as progress_mod
from pipeline.progress import Progress, format_bytes


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture(autouse=True)
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Each perf_counter() call moves time on by 0.5 s, so the lines are deterministic."""
    now = [0.0]

    def tick() -> float:
        now[0] += 0.5
        return now[0]

    monkeypatch.setattr(progress_mod, "time", SimpleNamespace(perf_counter=tick))
    return now


def run_stages(p: Progress) -> None:
    with p.stage("build"):
        with p.stage("digest", total=3 << 20, unit="B") as st:
            advance = st.advance  # callers pass the bound method around
            for _ in range(3):
                advance(1 << 20)
        p.message("cache miss")
        with p.stage("convert", unit="tensors") as st:
            st.update(4, total=4)
        with pytest.raises(RuntimeError), p.stage("golden"):
            raise RuntimeError("boom")


def test_off_a_tty_only_start_and_end_lines() -> None:
    out = io.StringIO()
    p = Progress(out)
    run_stages(p)
    assert out.getvalue().splitlines() == [
        "build ...",
        "  digest ...",
        "  digest: 3.0 MiB  0.5 s  6.0 MiB/s",
        "  cache miss",
        "  convert ...",
        "  convert: 4 tensors  0.5 s  8 tensors/s",
        "  golden ...",
        "  golden: failed after 0.5 s",
        "build: 3.5 s",
    ]
    assert "\x1b" not in out.getvalue() and "\r" not in out.getvalue()
    assert p.durations == {"build": 3.5}


def test_on_a_tty_bars_then_the_same_end_lines() -> None:
    out = FakeTTY()
    run_stages(Progress(out))
    text = out.getvalue()
    assert "\r" in text and "  digest: " in text and "%|" in text  # a bar was drawn
    assert "digest ..." not in text  # no start lines: the bar shows the stage started
    assert "\rbuild ..." in text  # ...or, with no total to draw a bar for, its name
    ends = [ln.rsplit("\r", 1)[-1] for ln in text.splitlines()]
    assert "  digest: 3.0 MiB  0.5 s  6.0 MiB/s" in ends
    assert "  golden: failed after 0.5 s" in ends and ends[-1] == "build: 3.5 s"


def test_silent_and_disabled_print_nothing() -> None:
    out = FakeTTY()
    run_stages(Progress(out, enabled=False))
    assert out.getvalue() == ""
    p = Progress.silent()
    run_stages(p)
    assert set(p.durations) == {"build"}


@pytest.mark.parametrize(("n", "text"), [(0, "0 B"), (1023, "1023 B"), (1536, "1.5 KiB"),
                                         (5 << 30, "5.0 GiB"), (3 << 40, "3072.0 GiB")])
def test_format_bytes(n: int, text: str) -> None:
    assert format_bytes(n) == text
