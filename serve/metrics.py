"""A small dependency-free Prometheus registry (text exposition format 0.0.4).

Every metric name carries the `llmserve_` prefix. Metrics are updated from the HTTP
event loop and, for gauges refreshed at scrape time, from whichever thread scrapes; each
metric has its own lock, so updates from the engine thread are safe too.
"""

from __future__ import annotations

import bisect
import math
import re
import threading
from collections.abc import Iterable, Sequence
from typing import Any, TypeVar, cast

PREFIX = "llmserve_"
_NAME_RE = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_LABEL_RE = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")

# Latency buckets follow vLLM's, stretched at the top because CPU engines are slow.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
               0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 80.0)
E2E_BUCKETS = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


def format_value(value: float) -> str:
    """Prometheus float text: +Inf, -Inf, NaN, otherwise Python's shortest repr."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _label_text(names: Sequence[str], values: Sequence[str], extra: str = "") -> str:
    parts = [f'{n}="{_escape_label(v)}"' for n, v in zip(names, values, strict=True)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


class _Metric:
    kind = ""

    def __init__(self, name: str, help_text: str, labelnames: Sequence[str] = ()) -> None:
        if not name.startswith(PREFIX) or not _NAME_RE.match(name):
            raise ValueError(f"metric name {name!r} must match {_NAME_RE.pattern} "
                             f"and start with {PREFIX!r}")
        for label in labelnames:
            if not _LABEL_RE.match(label) or label.startswith("__") or label == "le":
                raise ValueError(f"invalid label name {label!r} for metric {name}")
        self.name = name
        self.help = help_text
        self.labelnames = tuple(labelnames)
        self._lock = threading.Lock()
        self._children: dict[tuple[str, ...], Any] = {}

    def _key(self, labels: dict[str, str]) -> tuple[str, ...]:
        if set(labels) != set(self.labelnames):
            raise ValueError(f"{self.name} takes labels {self.labelnames}, got {tuple(labels)}")
        return tuple(str(labels[n]) for n in self.labelnames)

    def _samples(self) -> list[str]:
        raise NotImplementedError

    def render(self) -> str:
        lines = [f"# HELP {self.name} {_escape_help(self.help)}", f"# TYPE {self.name} {self.kind}"]
        with self._lock:
            lines.extend(self._samples())
        return "\n".join(lines) + "\n"


class Counter(_Metric):
    """Monotonic counter. Name must end in `_total`."""

    kind = "counter"

    def __init__(self, name: str, help_text: str, labelnames: Sequence[str] = ()) -> None:
        if not name.endswith("_total"):
            raise ValueError(f"counter name {name!r} must end with '_total'")
        super().__init__(name, help_text, labelnames)
        if not self.labelnames:
            self._children[()] = 0.0

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        if amount < 0:
            raise ValueError(f"{self.name}: counters only go up (got inc({amount}))")
        key = self._key(labels)
        with self._lock:
            self._children[key] = float(self._children.get(key, 0.0)) + amount

    def set_total(self, total: float, **labels: str) -> None:
        """Mirror a monotonic total kept elsewhere (e.g. the executor's preemption count)."""
        key = self._key(labels)
        with self._lock:
            current = float(self._children.get(key, 0.0))
            # A restarted source must not make the exported counter go backwards.
            self._children[key] = max(current, float(total))

    def value(self, **labels: str) -> float:
        with self._lock:
            return float(self._children.get(self._key(labels), 0.0))

    def _samples(self) -> list[str]:
        return [f"{self.name}{_label_text(self.labelnames, k)} {format_value(v)}"
                for k, v in sorted(self._children.items())]


class Gauge(_Metric):
    kind = "gauge"

    def __init__(self, name: str, help_text: str, labelnames: Sequence[str] = ()) -> None:
        super().__init__(name, help_text, labelnames)
        if not self.labelnames:
            self._children[()] = 0.0

    def set(self, value: float, **labels: str) -> None:
        key = self._key(labels)
        with self._lock:
            self._children[key] = float(value)

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        key = self._key(labels)
        with self._lock:
            self._children[key] = float(self._children.get(key, 0.0)) + amount

    def value(self, **labels: str) -> float:
        with self._lock:
            return float(self._children.get(self._key(labels), 0.0))

    def _samples(self) -> list[str]:
        return [f"{self.name}{_label_text(self.labelnames, k)} {format_value(v)}"
                for k, v in sorted(self._children.items())]


class _HistogramData:
    __slots__ = ("counts", "sum")

    def __init__(self, n_buckets: int) -> None:
        self.counts = [0] * (n_buckets + 1)  # last slot: above the largest bound (+Inf)
        self.sum = 0.0


class Histogram(_Metric):
    kind = "histogram"

    def __init__(self, name: str, help_text: str, buckets: Iterable[float],
                 labelnames: Sequence[str] = ()) -> None:
        super().__init__(name, help_text, labelnames)
        bounds = [float(b) for b in buckets if not math.isinf(b)]
        if not bounds or bounds != sorted(set(bounds)):
            raise ValueError(f"{name}: buckets must be non-empty, strictly increasing")
        self.buckets = tuple(bounds)
        if not self.labelnames:
            self._children[()] = _HistogramData(len(self.buckets))

    def observe(self, value: float, **labels: str) -> None:
        key = self._key(labels)
        with self._lock:
            data = self._children.get(key)
            if data is None:
                data = self._children[key] = _HistogramData(len(self.buckets))
            # First bound >= value; index len(buckets) is the +Inf bucket.
            data.counts[bisect.bisect_left(self.buckets, value)] += 1
            data.sum += value

    def count(self, **labels: str) -> int:
        with self._lock:
            data = self._children.get(self._key(labels))
            return sum(data.counts) if data is not None else 0

    def _samples(self) -> list[str]:
        lines: list[str] = []
        for key, data in sorted(self._children.items()):
            cumulative = 0
            bounds = [*self.buckets, math.inf]
            for bound, n in zip(bounds, data.counts, strict=True):
                cumulative += n
                le = f'le="{format_value(bound)}"'
                lines.append(f"{self.name}_bucket{_label_text(self.labelnames, key, le)} "
                             f"{cumulative}")
            labels = _label_text(self.labelnames, key)
            lines.append(f"{self.name}_sum{labels} {format_value(data.sum)}")
            lines.append(f"{self.name}_count{labels} {cumulative}")
        return lines


_M = TypeVar("_M", bound=_Metric)


class MetricsRegistry:
    """Holds metrics by name; `render()` is the body of GET /metrics."""

    CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._metrics: dict[str, _Metric] = {}

    def _get_or_add(self, metric: _M) -> _M:
        with self._lock:
            existing = self._metrics.get(metric.name)
            if existing is None:
                self._metrics[metric.name] = metric
                return metric
        if type(existing) is not type(metric) or existing.labelnames != metric.labelnames:
            raise ValueError(f"metric {metric.name} already registered with another type/labels")
        return cast(_M, existing)

    def counter(self, name: str, help_text: str, labelnames: Sequence[str] = ()) -> Counter:
        return self._get_or_add(Counter(name, help_text, labelnames))

    def gauge(self, name: str, help_text: str, labelnames: Sequence[str] = ()) -> Gauge:
        return self._get_or_add(Gauge(name, help_text, labelnames))

    def histogram(self, name: str, help_text: str, buckets: Iterable[float],
                  labelnames: Sequence[str] = ()) -> Histogram:
        return self._get_or_add(Histogram(name, help_text, buckets, labelnames))

    def get(self, name: str) -> _Metric | None:
        with self._lock:
            return self._metrics.get(name)

    def render(self) -> str:
        with self._lock:
            metrics = list(self._metrics.values())
        return "".join(m.render() for m in metrics)


class ServingMetrics:
    """The serving metrics, registered on one registry, with the scrape-time refresh."""

    def __init__(self, registry: MetricsRegistry | None = None) -> None:
        r = self.registry = registry or MetricsRegistry()
        p = PREFIX
        self.ttft = r.histogram(f"{p}time_to_first_token_seconds",
                                "Time from request arrival to its first generated token.",
                                TTFT_BUCKETS)
        self.itl = r.histogram(f"{p}inter_token_latency_seconds",
                               "Time between consecutive generated tokens of a request.",
                               ITL_BUCKETS)
        self.e2e = r.histogram(f"{p}e2e_request_latency_seconds",
                               "Time from request arrival to its last token.", E2E_BUCKETS)
        self.running = r.gauge(f"{p}num_requests_running", "Requests in the running batch.")
        self.waiting = r.gauge(f"{p}num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = r.gauge(f"{p}kv_cache_usage_ratio",
                                "Fraction of paged KV-cache blocks in use (0 to 1).")
        self.gate_seconds = r.gauge(f"{p}startup_gate_seconds",
                                    "Duration of each startup readiness gate.", ("gate",))
        self.preemptions = r.counter(f"{p}num_preemptions_total",
                                     "Requests preempted (recomputed) by the scheduler.")
        self.prompt_tokens = r.counter(f"{p}prompt_tokens_total",
                                       "Prompt tokens of HTTP requests that reached their first output token.")
        self.generation_tokens = r.counter(f"{p}generation_tokens_total",
                                           "Tokens generated for HTTP requests.")
        self.request_success = r.counter(f"{p}request_success_total",
                                         "Requests finished, by finish reason.",
                                         ("finished_reason",))
        self.http_requests = r.counter(f"{p}http_requests_total",
                                       "HTTP responses by route and status code.",
                                       ("route", "status"))

    def refresh(self, stats: object | None, gates: Sequence[dict[str, object]]) -> None:
        """Scrape-time update from `Executor.stats()` (an ExecutorStats) and the gate list."""
        if stats is not None:
            self.running.set(getattr(stats, "running", 0))
            self.waiting.set(getattr(stats, "waiting", 0))
            self.kv_usage.set(getattr(stats, "kv_usage", 0.0))
            self.preemptions.set_total(getattr(stats, "preemptions_total", 0))
        for gate in gates:
            seconds = gate.get("seconds")
            if isinstance(seconds, (int, float)) and not isinstance(seconds, bool):
                self.gate_seconds.set(float(seconds), gate=str(gate.get("name", "?")))
