"""The /metrics page of serve.metrics: names, types, help, labels, buckets, refresh."""

from __future__ import annotations

from dataclasses import dataclass, field

import prometheus_client
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from runtime.core.types import ExecutorStats
from serve.metrics import E2E_BUCKETS, ITL_BUCKETS, TTFT_BUCKETS, ServingMetrics

SeriesKey = tuple[str, frozenset[tuple[str, str]]]


@dataclass
class Page:
    """A parsed exposition page, keyed by the names as they appear on it."""

    helps: dict[str, str] = field(default_factory=dict)  # family (as on its TYPE line) -> help
    types: dict[str, str] = field(default_factory=dict)  # family -> counter/gauge/histogram
    samples: dict[SeriesKey, float] = field(default_factory=dict)
    series: list[tuple[str, dict[str, str]]] = field(default_factory=list)  # in page order

    def get(self, name: str, **labels: str) -> float | None:
        """The value of the series with exactly these labels, or None if it is absent."""
        return self.samples.get((name, frozenset(labels.items())))

    def value(self, name: str, **labels: str) -> float:
        value = self.get(name, **labels)
        assert value is not None, f"no series {name} {labels}"
        return value

    def labels(self, name: str) -> list[dict[str, str]]:
        """The label sets of every series of one sample name, in page order."""
        return [labels for n, labels in self.series if n == name]


def parse(text: str) -> Page:
    """Parse with prometheus_client's own parser; also insist on HELP, a known TYPE and
    no duplicate series, which the parser alone lets through."""
    assert text.endswith("\n")
    page = Page()
    for family in text_string_to_metric_families(text):
        assert family.type in ("counter", "gauge", "histogram"), (family.name, family.type)
        assert family.documentation, f"{family.name} has no HELP"
        # The parser names a counter family without `_total`; the page (TYPE line and
        # samples) carries it, so key by that.
        name = family.name + "_total" if family.type == "counter" else family.name
        assert name not in page.types, f"duplicate family {name}"
        page.helps[name], page.types[name] = family.documentation, family.type
        for s in family.samples:
            if family.type == "counter":
                assert s.name == name, f"counter sample {s.name} of {name}"
            key = (s.name, frozenset(s.labels.items()))
            assert key not in page.samples, f"duplicate series {key}"
            page.samples[key] = s.value
            page.series.append((s.name, s.labels))
    return page


def render(m: ServingMetrics) -> str:
    return generate_latest(m.registry).decode()


# name on the page -> (type, help, label names): what dashboards and alerts depend on.
EXPECTED = {
    "llmserve_time_to_first_token_seconds":
        ("histogram", "Time from request arrival to its first generated token.", ()),
    "llmserve_inter_token_latency_seconds":
        ("histogram", "Time between consecutive generated tokens of a request.", ()),
    "llmserve_e2e_request_latency_seconds":
        ("histogram", "Time from request arrival to its last token.", ()),
    "llmserve_num_requests_running": ("gauge", "Requests in the running batch.", ()),
    "llmserve_num_requests_waiting": ("gauge", "Requests waiting to be scheduled.", ()),
    "llmserve_kv_cache_usage_ratio":
        ("gauge", "Fraction of paged KV-cache blocks in use (0 to 1).", ()),
    "vllm:num_requests_waiting": ("gauge", "Number of requests waiting to be processed "
                                  "(same as llmserve_num_requests_waiting).", ()),
    "vllm:num_requests_running": ("gauge", "Number of requests in model execution batches "
                                  "(same as llmserve_num_requests_running).", ()),
    "vllm:kv_cache_usage_perc": ("gauge", "KV-cache usage: 1 means 100 percent usage "
                                 "(same as llmserve_kv_cache_usage_ratio).", ()),
    "vllm:gpu_cache_usage_perc": ("gauge", "The name of vllm:kv_cache_usage_perc before "
                                  "vLLM 0.10 (for older endpoint pickers).", ()),
    "llmserve_kv_cache_blocks":
        ("gauge", "Paged KV-cache blocks by state: used (held by requests), cached (prefix "
         "cache, held by none, reusable), free.", ("state",)),
    "llmserve_startup_gate_seconds":
        ("gauge", "Duration of each startup readiness gate.", ("gate",)),
    "llmserve_num_preemptions_total":
        ("counter", "Requests preempted (recomputed) by the scheduler.", ()),
    "llmserve_prompt_tokens_total":
        ("counter", "Prompt tokens of HTTP requests that reached their first output token.", ()),
    "llmserve_generation_tokens_total": ("counter", "Tokens generated for HTTP requests.", ()),
    "llmserve_request_success_total":
        ("counter", "Requests finished, by finish reason.", ("finished_reason",)),
    "llmserve_http_requests_total":
        ("counter", "HTTP responses by route and status code.", ("route", "status")),
    "llmserve_prefix_cache_queries_total":
        ("counter", "Prompt tokens looked up in the prefix cache.", ()),
    "llmserve_prefix_cache_hits_total": ("counter", "Prompt tokens the prefix cache served.", ()),
    "llmserve_prompt_tokens_computed_total":
        ("counter", "Prompt tokens run through the model (prefix-cache hits and the siblings "
         "of an n > 1 request, which share one prefill, excluded).", ()),
    "llmserve_forked_sequences_total":
        ("counter", "Sequences started from a sibling's prefill (n > 1, best_of).", ()),
    "llmserve_kv_blocks_copied_total":
        ("counter", "KV blocks copied on write when a sequence forked.", ()),
    "llmserve_spec_decode_num_drafts_total":
        ("counter", "Speculative verify steps, counted per sequence (one sequence verifying "
         "its drafts in one engine step).", ()),
    "llmserve_spec_decode_num_draft_tokens_total":
        ("counter", "Drafted tokens verified by speculative decoding.", ()),
    "llmserve_spec_decode_num_accepted_tokens_total":
        ("counter", "Drafted tokens the target model accepted.", ()),
    "llmserve_spec_decode_backoffs_total":
        ("counter", "Times the adaptive policy stopped a sequence's drafting for a while "
         "(its drafts were not paying).", ()),
    "llmserve_spec_decode_num_accepted_tokens_per_pos_total":
        ("counter", "Verify steps that accepted the draft at this position (0-based).",
         ("position",)),
    "llmserve_spec_decode_draft_acceptance_rate":
        ("gauge", "Accepted over drafted tokens since start (0 when nothing was drafted).", ()),
    "llmserve_spec_decode_mean_acceptance_length":
        ("gauge", "Tokens per verify step since start: 1 + accepted tokens / drafts (0 when "
         "nothing was drafted).", ()),
    "llmserve_decode_steps_total": ("counter", "Engine steps that only decoded.", ()),
    "llmserve_decode_step_seconds_total":
        ("counter", "Seconds in engine steps that only decoded (schedule to sampled tokens).",
         ()),
    "llmserve_prefill_steps_total":
        ("counter", "Engine steps with prompt tokens (decodes may join).", ()),
    "llmserve_prefill_step_seconds_total":
        ("counter", "Seconds in engine steps with prompt tokens.", ()),
    "llmserve_thread_probes_total":
        ("counter", "Measurements of another intra-op thread count.", ()),
    "llmserve_thread_switches_total":
        ("counter", "Times a measured thread count took over.", ()),
    "llmserve_thread_contended_switches_total":
        ("counter", "Switches to fewer threads because the stepping thread waited on a run "
         "queue (runtime/runqueue.py) for a share of its decode steps.", ()),
    "llmserve_thread_run_queue_wait_seconds_total":
        ("counter", "Seconds the stepping thread was runnable but off a core during decode "
         "steps (a neighbour, a spent CPU quota).", ()),
    "llmserve_intra_op_threads": ("gauge", "Intra-op threads rank 0's steps run with.", ()),
    "llmserve_gc_pauses_total":
        ("counter", "Collections of Python's cyclic garbage collector, by generation.",
         ("generation",)),
    "llmserve_gc_pause_seconds_total":
        ("counter", "Seconds the collections of each generation held the GIL.",
         ("generation",)),
    "llmserve_grammar_cache_bytes":
        ("gauge", "Bytes of compiled grammars kept in the cache.", ()),
    "llmserve_grammar_cache_entries": ("gauge", "Compiled grammars kept in the cache.", ()),
    "llmserve_grammar_compiles_in_flight":
        ("gauge", "Grammar compiles queued or running, those whose requests timed out "
         "included (they finish into the cache).", ()),
    "llmserve_grammar_compile_timeouts_total":
        ("counter", "Requests answered 400 because their grammar did not compile within "
         "--grammar-compile-timeout.", ()),
}


def test_names_types_help_and_label_names() -> None:
    m = ServingMetrics()
    m.refresh(None, [{"name": "load", "seconds": 1.0}])
    m.request_success.labels(finished_reason="stop").inc()
    m.http_requests.labels(route="/v1/completions", status="200").inc()
    text = render(m)
    page = parse(text)
    assert page.types == {name: kind for name, (kind, _, _) in EXPECTED.items()}
    assert page.helps == {name: doc for name, (_, doc, _) in EXPECTED.items()}
    lines = text.splitlines()
    for name, (kind, _, labelnames) in EXPECTED.items():
        assert f"# TYPE {name} {kind}" in lines  # counters are typed under their _total name
        sample = f"{name}_count" if kind == "histogram" else name
        assert {tuple(lab) for lab in page.labels(sample)} == {labelnames}, name
    # No `_created` series: the page has the same samples as before prometheus_client.
    assert not any("_created" in line for line in lines)


def test_unlabelled_series_start_at_zero_and_labelled_ones_appear_when_used() -> None:
    page = parse(render(ServingMetrics()))
    for name in ("llmserve_num_requests_running", "llmserve_num_preemptions_total",
                 "llmserve_prompt_tokens_total", "llmserve_time_to_first_token_seconds_count",
                 "llmserve_e2e_request_latency_seconds_sum"):
        assert page.value(name) == 0.0, name
    for state in ("used", "cached", "free"):  # known label values start at zero too
        assert page.value("llmserve_kv_cache_blocks", state=state) == 0.0, state
    for name in ("llmserve_startup_gate_seconds", "llmserve_request_success_total",
                 "llmserve_http_requests_total"):
        assert page.labels(name) == [], name


@pytest.mark.parametrize(("attr", "name", "buckets"), [
    ("ttft", "llmserve_time_to_first_token_seconds", TTFT_BUCKETS),
    ("itl", "llmserve_inter_token_latency_seconds", ITL_BUCKETS),
    ("e2e", "llmserve_e2e_request_latency_seconds", E2E_BUCKETS),
])
def test_histogram_buckets_are_cumulative_with_inclusive_bounds(
        attr: str, name: str, buckets: tuple[float, ...]) -> None:
    m = ServingMetrics()
    low, high = buckets[0], buckets[-1]
    for v in (low / 2, low, high, high * 2):  # a bucket's bound is inclusive: low is in it
        getattr(m, attr).observe(v)
    page = parse(render(m))
    bounds = [lab["le"] for lab in page.labels(f"{name}_bucket")]
    assert bounds == [repr(b) for b in buckets] + ["+Inf"]
    assert page.value(f"{name}_bucket", le=repr(low)) == 2
    assert page.value(f"{name}_bucket", le=repr(buckets[1])) == 2
    assert page.value(f"{name}_bucket", le=repr(high)) == 3
    assert page.value(f"{name}_bucket", le="+Inf") == 4
    assert page.value(f"{name}_count") == 4
    assert page.value(f"{name}_sum") == pytest.approx(low * 1.5 + high * 3)


def test_bucket_boundaries_are_unchanged() -> None:
    assert TTFT_BUCKETS == (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                            1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
    assert ITL_BUCKETS == (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                           0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 80.0)
    assert E2E_BUCKETS == (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
                           30.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


def test_scrape_refresh_sets_gauges_and_gate_seconds() -> None:
    m = ServingMetrics()
    stats = ExecutorStats(running=3, waiting=2, kv_blocks_total=10, kv_blocks_used=4,
                          kv_blocks_cached=1, preemptions_total=7)
    gates = [{"name": "load", "seconds": 1.5}, {"name": "warmup", "seconds": None},
             {"name": "flag", "seconds": True}]
    m.refresh(stats, gates)
    page = parse(render(m))
    assert page.value("llmserve_num_requests_running") == 3
    assert page.value("llmserve_num_requests_waiting") == 2
    assert page.value("llmserve_kv_cache_usage_ratio") == pytest.approx(0.4)
    # The endpoint picker's series (vLLM's names): the same values, usage as a fraction.
    assert page.value("vllm:num_requests_waiting") == 2
    assert page.value("vllm:num_requests_running") == 3
    assert page.value("vllm:kv_cache_usage_perc") == pytest.approx(0.4)
    assert page.value("vllm:gpu_cache_usage_perc") == pytest.approx(0.4)
    assert page.types["llmserve_kv_cache_blocks"] == "gauge"
    blocks = {state: page.value("llmserve_kv_cache_blocks", state=state)
              for state in ("used", "cached", "free")}
    assert blocks == {"used": 4, "cached": 1, "free": 5}  # they add up to the total
    assert page.value("llmserve_num_preemptions_total") == 7
    # Only gates that ran (a number of seconds, not None nor a bool) get a series.
    assert page.labels("llmserve_startup_gate_seconds") == [{"gate": "load"}]
    assert page.value("llmserve_startup_gate_seconds", gate="load") == 1.5

    m.refresh(ExecutorStats(running=0, waiting=0, kv_blocks_total=10, kv_blocks_cached=3), [])
    page = parse(render(m))
    assert page.value("llmserve_num_requests_running") == 0
    assert page.value("llmserve_kv_cache_usage_ratio") == 0
    # Idle: nothing in use, the prefix cache still reported apart from the free blocks.
    assert page.value("llmserve_kv_cache_blocks", state="used") == 0
    assert page.value("llmserve_kv_cache_blocks", state="cached") == 3
    assert page.value("llmserve_kv_cache_blocks", state="free") == 7
    assert page.value("llmserve_startup_gate_seconds", gate="load") == 1.5  # kept


def test_preemption_counter_mirrors_the_total_and_never_goes_backwards() -> None:
    m = ServingMetrics()

    def scrape(total: int | None) -> float:
        m.refresh(None if total is None else ExecutorStats(preemptions_total=total), [])
        return parse(render(m)).value("llmserve_num_preemptions_total")

    assert scrape(5) == 5
    assert scrape(5) == 5  # the same total again adds nothing
    assert scrape(None) == 5  # no stats this scrape (executor failed): unchanged
    assert scrape(2) == 5  # a restarted source must not move the counter back
    assert scrape(4) == 5
    assert scrape(8) == 8  # it follows again once the source passes the highest total


def test_each_instance_has_its_own_registry() -> None:
    a, b = ServingMetrics(), ServingMetrics()  # a second would raise on a shared registry
    assert a.registry is not b.registry
    a.generation_tokens.inc(3)
    a.http_requests.labels(route="/x", status="200").inc()
    assert parse(render(a)).value("llmserve_generation_tokens_total") == 3
    page_b = parse(render(b))
    assert page_b.value("llmserve_generation_tokens_total") == 0
    assert page_b.labels("llmserve_http_requests_total") == []
    default = generate_latest(prometheus_client.REGISTRY).decode()
    assert "llmserve_" not in default  # nothing leaks into the process-global registry


def test_label_values_are_escaped_and_survive_a_round_trip() -> None:
    m = ServingMetrics()
    odd = 'a "quoted"\nback\\slash'
    m.http_requests.labels(route=odd, status="404").inc(2)
    assert parse(render(m)).value("llmserve_http_requests_total", route=odd, status="404") == 2


def test_executor_totals_are_mirrored_as_counters_that_never_go_back() -> None:
    from runtime.core.scheduler_config import SPEC_PER_POS
    from runtime.core.types import ExecutorStats

    m = ServingMetrics()
    m.refresh(ExecutorStats(extra={"prompt_tokens_computed_total": 40.0,
                                   "forked_sequences_total": 3.0}), [])
    m.refresh(ExecutorStats(extra={"prompt_tokens_computed_total": 10.0}), [])  # a restart
    m.refresh(ExecutorStats(extra={"prompt_tokens_computed_total": 45.0}), [])
    page = parse(render(m))
    assert page.value("llmserve_prompt_tokens_computed_total") == 45.0
    assert page.value("llmserve_forked_sequences_total") == 3.0
    m.refresh(ExecutorStats(extra={"spec_decode_num_draft_tokens_total": 20.0,
                                   "spec_decode_num_accepted_tokens_total": 12.0}), [])
    page = parse(render(m))
    assert page.value("llmserve_spec_decode_num_draft_tokens_total") == 20.0
    assert page.value("llmserve_spec_decode_num_accepted_tokens_total") == 12.0
    assert page.value("llmserve_spec_decode_draft_acceptance_rate") == 0.6
    # vLLM's per-position counter and the mean acceptance length (bonus token included)
    m.refresh(ExecutorStats(extra={"spec_decode_num_draft_tokens_total": 20.0,
                                   "spec_decode_num_accepted_tokens_total": 12.0,
                                   "spec_decode_num_drafts_total": 6.0,
                                   f"{SPEC_PER_POS}0": 5.0, f"{SPEC_PER_POS}1": 4.0,
                                   f"{SPEC_PER_POS}2": 2.0, f"{SPEC_PER_POS}3": 1.0}), [])
    page = parse(render(m))
    assert page.value("llmserve_spec_decode_num_drafts_total") == 6.0
    assert [page.value("llmserve_spec_decode_num_accepted_tokens_per_pos_total",
                       position=str(i)) for i in range(4)] == [5.0, 4.0, 2.0, 1.0]
    assert page.value("llmserve_spec_decode_mean_acceptance_length") == 3.0


def test_gc_pauses_are_mirrored_by_generation_from_the_process_totals() -> None:
    from serve.gcpolicy import PauseTotals

    m = ServingMetrics()
    page = parse(render(m))
    assert [page.value("llmserve_gc_pauses_total", generation=g) for g in "012"] == [0, 0, 0]
    m.refresh_gc({0: PauseTotals(7, 0.002, 0.001), 2: PauseTotals(1, 0.08, 0.08)})
    m.refresh_gc({0: PauseTotals(9, 0.003, 0.001), 2: PauseTotals(1, 0.08, 0.08)})
    page = parse(render(m))
    assert page.value("llmserve_gc_pauses_total", generation="0") == 9
    assert page.value("llmserve_gc_pause_seconds_total", generation="0") == pytest.approx(0.003)
    assert page.value("llmserve_gc_pauses_total", generation="1") == 0
    assert page.value("llmserve_gc_pause_seconds_total", generation="2") == pytest.approx(0.08)
