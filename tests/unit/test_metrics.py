"""Prometheus text exposition of serve.metrics."""

from __future__ import annotations

import math
import re
import threading

import pytest

from runtime.types import ExecutorStats
from serve.metrics import Counter, Histogram, MetricsRegistry, ServingMetrics, format_value

# One sample line: name, optional {labels}, value (text format 0.0.4).
SAMPLE_RE = re.compile(
    r'^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)'
    r'(?:\{(?P<labels>(?:[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\[\\"n])*",?)*)\})?'
    r' (?P<value>[-+]?(?:[0-9.eE+-]+|Inf|NaN))$')


def parse(text: str) -> tuple[dict[str, str], dict[str, str], list[tuple[str, str, float]]]:
    """A strict little parser: returns HELP and TYPE per family and all samples."""
    assert text.endswith("\n")
    helps: dict[str, str] = {}
    types: dict[str, str] = {}
    samples: list[tuple[str, str, float]] = []
    for line in text.rstrip("\n").split("\n"):
        if line.startswith("# HELP "):
            name, _, doc = line[7:].partition(" ")
            assert name not in helps, f"duplicate HELP for {name}"
            helps[name] = doc
        elif line.startswith("# TYPE "):
            name, _, kind = line[7:].partition(" ")
            assert kind in ("counter", "gauge", "histogram"), line
            assert name in helps, "TYPE must follow HELP"
            types[name] = kind
        else:
            m = SAMPLE_RE.match(line)
            assert m, f"malformed sample line: {line!r}"
            samples.append((m["name"], m["labels"] or "", float(m["value"])))
    return helps, types, samples


def test_counter_gauge_render_with_help_type_and_labels() -> None:
    reg = MetricsRegistry()
    c = reg.counter("llmserve_requests_total", "Requests.\nSecond line \\ slash.", ("code",))
    c.inc(code="200")
    c.inc(2, code="200")
    c.inc(code='4"0\n0')
    g = reg.gauge("llmserve_temp", "A gauge.")
    g.set(0.25)
    text = reg.render()
    helps, types, samples = parse(text)
    assert helps["llmserve_requests_total"] == "Requests.\\nSecond line \\\\ slash."
    assert types == {"llmserve_requests_total": "counter", "llmserve_temp": "gauge"}
    assert ("llmserve_requests_total", 'code="200"', 3.0) in samples
    assert 'llmserve_requests_total{code="4\\"0\\n0"} 1.0' in text.splitlines()
    assert ("llmserve_temp", "", 0.25) in samples


def test_histogram_buckets_are_cumulative_with_inf_sum_and_count() -> None:
    reg = MetricsRegistry()
    h = reg.histogram("llmserve_latency_seconds", "Latency.", [0.1, 1.0, 10.0])
    for v in (0.05, 0.1, 0.5, 2.0, 100.0):
        h.observe(v)
    _, types, samples = parse(reg.render())
    assert types["llmserve_latency_seconds"] == "histogram"
    buckets = [(lab, v) for n, lab, v in samples if n == "llmserve_latency_seconds_bucket"]
    # le is an upper bound, inclusive: 0.1 falls in the 0.1 bucket.
    assert buckets == [('le="0.1"', 2), ('le="1.0"', 3), ('le="10.0"', 4), ('le="+Inf"', 5)]
    values = {n: v for n, _, v in samples}
    assert values["llmserve_latency_seconds_count"] == 5
    assert values["llmserve_latency_seconds_sum"] == pytest.approx(102.65)
    assert h.count() == 5


def test_labelled_histogram_keeps_le_last_and_series_apart() -> None:
    reg = MetricsRegistry()
    h = reg.histogram("llmserve_step_seconds", "Step.", [1.0], ("phase",))
    h.observe(0.5, phase="prefill")
    h.observe(3.0, phase="decode")
    lines = reg.render().splitlines()
    assert 'llmserve_step_seconds_bucket{phase="decode",le="1.0"} 0' in lines
    assert 'llmserve_step_seconds_bucket{phase="decode",le="+Inf"} 1' in lines
    assert 'llmserve_step_seconds_count{phase="prefill"} 1' in lines


def test_unlabelled_metrics_export_zero_before_any_update() -> None:
    reg = MetricsRegistry()
    reg.counter("llmserve_x_total", "X.")
    reg.histogram("llmserve_y_seconds", "Y.", [1.0])
    _, _, samples = parse(reg.render())
    assert ("llmserve_x_total", "", 0.0) in samples
    assert ("llmserve_y_seconds_count", "", 0.0) in samples


@pytest.mark.parametrize(("make", "match"), [
    (lambda r: r.counter("vllm_requests_total", "no prefix"), "llmserve_"),
    (lambda r: r.counter("llmserve_requests", "no _total"), "_total"),
    (lambda r: r.gauge("llmserve_bad-name", "dash"), "must match"),
    (lambda r: r.gauge("llmserve_g", "le label", ("le",)), "invalid label"),
    (lambda r: r.histogram("llmserve_h", "unsorted", [2.0, 1.0]), "increasing"),
])
def test_invalid_definitions_are_rejected(make, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make(MetricsRegistry())


def test_counter_rejects_decrease_and_wrong_labels() -> None:
    c = Counter("llmserve_c_total", "C.", ("a",))
    with pytest.raises(ValueError, match="only go up"):
        c.inc(-1, a="x")
    with pytest.raises(ValueError, match="takes labels"):
        c.inc(b="x")
    c.set_total(5, a="x")
    c.set_total(3, a="x")  # a restarted source must not move the counter back
    assert c.value(a="x") == 5


def test_registry_returns_existing_metric_and_refuses_type_clash() -> None:
    reg = MetricsRegistry()
    assert reg.counter("llmserve_a_total", "A.") is reg.counter("llmserve_a_total", "A.")
    with pytest.raises(ValueError, match="already registered"):
        reg.gauge("llmserve_a_total", "A.")


def test_format_value_special_floats() -> None:
    assert format_value(math.inf) == "+Inf"
    assert format_value(-math.inf) == "-Inf"
    assert format_value(math.nan) == "NaN"
    assert format_value(3) == "3.0"


def test_concurrent_observations_are_not_lost() -> None:
    h = Histogram("llmserve_h_seconds", "H.", [0.5])

    def work() -> None:
        for _ in range(5000):
            h.observe(0.1)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert h.count() == 20000


def test_serving_metrics_names_and_scrape_refresh() -> None:
    m = ServingMetrics()
    stats = ExecutorStats(running=3, waiting=2, kv_blocks_total=10, kv_blocks_used=4,
                          preemptions_total=7)
    gates = [{"name": "load", "seconds": 1.5}, {"name": "warmup", "seconds": None}]
    m.refresh(stats, gates)
    helps, types, samples = parse(m.registry.render())
    assert all(name.startswith("llmserve_") for name in helps)
    expected = {
        "llmserve_time_to_first_token_seconds": "histogram",
        "llmserve_inter_token_latency_seconds": "histogram",
        "llmserve_e2e_request_latency_seconds": "histogram",
        "llmserve_num_requests_running": "gauge",
        "llmserve_num_requests_waiting": "gauge",
        "llmserve_kv_cache_usage_ratio": "gauge",
        "llmserve_startup_gate_seconds": "gauge",
        "llmserve_num_preemptions_total": "counter",
        "llmserve_prompt_tokens_total": "counter",
        "llmserve_generation_tokens_total": "counter",
        "llmserve_request_success_total": "counter",
    }
    assert expected.items() <= types.items()
    values = {(n, lab): v for n, lab, v in samples}
    assert values[("llmserve_num_requests_running", "")] == 3
    assert values[("llmserve_num_requests_waiting", "")] == 2
    assert values[("llmserve_kv_cache_usage_ratio", "")] == pytest.approx(0.4)
    assert values[("llmserve_num_preemptions_total", "")] == 7
    assert values[("llmserve_startup_gate_seconds", 'gate="load"')] == 1.5
    assert ("llmserve_startup_gate_seconds", 'gate="warmup"') not in values  # not run yet
