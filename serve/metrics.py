"""The serving metrics (prefix `llmserve_`), on prometheus_client.

`ServingMetrics` is the one place that declares them. Each instance has its own
`CollectorRegistry`, never the process-global default, so two servers (or tests) in one
process do not collide. prometheus_client metrics are thread-safe: the HTTP event loop and
the scrape-time refresh may update them from different threads.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from contract.speculative import DEFAULT_NUM_TOKENS
from runtime.core.scheduler_config import SPEC_PER_POS
from serve.gcpolicy import GENERATIONS, PauseTotals

# The page is the plain text format with no `_created` series (they would double the
# counter and histogram lines and no dashboard reads them). The switch is process-wide.
prometheus_client.disable_created_metrics()

PREFIX = "llmserve_"
# The Gateway API Inference Extension's endpoint picker (llm-d, GKE, Envoy AI Gateway) picks a
# replica from three series of its "model server protocol"; its defaults are vLLM's names
# (--total-queued-requests-metric, --total-running-requests-metric,
# --kv-cache-usage-percentage-metric), so we serve them under those names as well as ours.
# vllm:gpu_cache_usage_perc is the kv-cache name of vLLM before v0.10 (older pickers).
VLLM_WAITING, VLLM_RUNNING = "vllm:num_requests_waiting", "vllm:num_requests_running"
VLLM_KV_USAGE, VLLM_KV_USAGE_OLD = "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"
KV_BLOCK_STATES = ("used", "cached", "free")

# Latency buckets follow vLLM's, stretched at the top because CPU engines are slow.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
               0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 80.0)
E2E_BUCKETS = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class ServingMetrics:
    """The serving metrics, registered on their own registry, with the scrape-time refresh.

    Counters are declared without `_total`; prometheus_client exposes them with it
    (`llmserve_num_preemptions` is scraped as `llmserve_num_preemptions_total`).
    """

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        p = PREFIX
        self.ttft = Histogram(f"{p}time_to_first_token_seconds",
                              "Time from request arrival to its first generated token.",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram(f"{p}inter_token_latency_seconds",
                             "Time between consecutive generated tokens of a request.",
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram(f"{p}e2e_request_latency_seconds",
                             "Time from request arrival to its last token.",
                             buckets=E2E_BUCKETS, registry=r)
        self.running = Gauge(f"{p}num_requests_running", "Requests in the running batch.",
                             registry=r)
        self.waiting = Gauge(f"{p}num_requests_waiting", "Requests waiting to be scheduled.",
                             registry=r)
        self.kv_usage = Gauge(f"{p}kv_cache_usage_ratio",
                              "Fraction of paged KV-cache blocks in use (0 to 1).", registry=r)
        # The picker's series: the same values as the three above, vLLM's names and help.
        self.picker = {
            "waiting": Gauge(VLLM_WAITING, "Number of requests waiting to be processed "
                             "(same as llmserve_num_requests_waiting).", registry=r),
            "running": Gauge(VLLM_RUNNING, "Number of requests in model execution batches "
                             "(same as llmserve_num_requests_running).", registry=r),
            "kv_usage": Gauge(VLLM_KV_USAGE, "KV-cache usage: 1 means 100 percent usage "
                              "(same as llmserve_kv_cache_usage_ratio).", registry=r),
            "kv_usage_old": Gauge(VLLM_KV_USAGE_OLD, f"The name of {VLLM_KV_USAGE} before "
                                  "vLLM 0.10 (for older endpoint pickers).", registry=r),
        }
        self.kv_blocks = Gauge(f"{p}kv_cache_blocks",
                               "Paged KV-cache blocks by state: used (held by requests), "
                               "cached (prefix cache, held by none, reusable), free.",
                               ("state",), registry=r)
        for state in KV_BLOCK_STATES:  # known states: on the page from the start, at 0
            self.kv_blocks.labels(state=state)
        self.gate_seconds = Gauge(f"{p}startup_gate_seconds",
                                  "Duration of each startup readiness gate.", ("gate",),
                                  registry=r)
        self.preemptions = Counter(f"{p}num_preemptions",
                                   "Requests preempted (recomputed) by the scheduler.",
                                   registry=r)
        self.prompt_tokens = Counter(f"{p}prompt_tokens",
                                     "Prompt tokens of HTTP requests that reached their first "
                                     "output token.", registry=r)
        self.generation_tokens = Counter(f"{p}generation_tokens",
                                         "Tokens generated for HTTP requests.", registry=r)
        self.request_success = Counter(f"{p}request_success",
                                       "Requests finished, by finish reason.",
                                       ("finished_reason",), registry=r)
        self.http_requests = Counter(f"{p}http_requests",
                                     "HTTP responses by route and status code.",
                                     ("route", "status"), registry=r)
        # Executor totals (ExecutorStats.extra) mirrored as counters: the KV cache's reuse,
        # which shows prefix-cache hits and n > 1 sharing one prefill.
        self.mirrored = {
            key: Counter(f"{p}{key.removesuffix('_total')}", doc, registry=r)
            for key, doc in (
                ("prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache."),
                ("prefix_cache_hits_total", "Prompt tokens the prefix cache served."),
                ("prompt_tokens_computed_total",
                 "Prompt tokens run through the model (prefix-cache hits and the siblings "
                 "of an n > 1 request, which share one prefill, excluded)."),
                ("forked_sequences_total",
                 "Sequences started from a sibling's prefill (n > 1, best_of)."),
                ("kv_blocks_copied_total",
                 "KV blocks copied on write when a sequence forked."),
                # vLLM's names and meaning: verify steps per sequence (drafts), drafted
                # tokens verified, and those accepted; the gauges below are their ratios.
                ("spec_decode_num_drafts_total",
                 "Speculative verify steps, counted per sequence (one sequence verifying "
                 "its drafts in one engine step)."),
                ("spec_decode_num_draft_tokens_total",
                 "Drafted tokens verified by speculative decoding."),
                ("spec_decode_num_accepted_tokens_total",
                 "Drafted tokens the target model accepted."),
                ("spec_decode_backoffs_total",
                 "Times the adaptive policy stopped a sequence's drafting for a while "
                 "(its drafts were not paying)."),
                # TGI's batch_forward_duration{method=decode|prefill}, as sums: the mean step
                # between two scrapes is the increase of the seconds over that of the steps.
                ("decode_steps_total", "Engine steps that only decoded."),
                ("decode_step_seconds_total",
                 "Seconds in engine steps that only decoded (schedule to sampled tokens)."),
                ("prefill_steps_total", "Engine steps with prompt tokens (decodes may join)."),
                ("prefill_step_seconds_total", "Seconds in engine steps with prompt tokens."),
                # runtime/core/thread_policy.py: a probe measures half (or twice) the
                # threads against the current count; a switch kept the other.
                ("thread_probes_total", "Measurements of another intra-op thread count."),
                ("thread_switches_total", "Times a measured thread count took over."),
                ("thread_contended_switches_total",
                 "Switches to fewer threads because the stepping thread waited on a run "
                 "queue (runtime/runqueue.py) for a share of its decode steps."),
                ("thread_run_queue_wait_seconds_total",
                 "Seconds the stepping thread was runnable but off a core during decode "
                 "steps (a neighbour, a spent CPU quota)."),
            )}
        self.intra_op_threads = Gauge(f"{p}intra_op_threads",
                                      "Intra-op threads rank 0's steps run with.", registry=r)
        # vLLM's spec_decode_num_accepted_tokens_per_pos: position i counts the verify steps
        # that accepted draft i (0-based), so position 0 over num_drafts is the first
        # draft's acceptance, and so on down the chain.
        self.spec_per_pos = Counter(f"{p}spec_decode_num_accepted_tokens_per_pos",
                                    "Verify steps that accepted the draft at this position "
                                    "(0-based).", ("position",), registry=r)
        for pos in range(DEFAULT_NUM_TOKENS):  # the default K's on the page from the start
            self.spec_per_pos.labels(position=str(pos))
        # Derived from the counters above, over the server's life (rates over a window are
        # the ratio of the counters' increases): accepted / drafted tokens, and tokens per
        # verify step, the bonus token included (1 + accepted / drafts; vLLM's mean
        # acceptance length).
        self.spec_acceptance_rate = Gauge(f"{p}spec_decode_draft_acceptance_rate",
                                          "Accepted over drafted tokens since start (0 when "
                                          "nothing was drafted).", registry=r)
        self.spec_mean_accepted_length = Gauge(f"{p}spec_decode_mean_acceptance_length",
                                               "Tokens per verify step since start: 1 + "
                                               "accepted tokens / drafts (0 when nothing was "
                                               "drafted).", registry=r)
        # Python's collector (serve/gcpolicy.py): a pause holds the GIL, so the engine loop and
        # the HTTP thread stall for it; the counters follow the process totals by increments.
        self.gc_pauses = Counter(f"{p}gc_pauses", "Collections of Python's cyclic garbage "
                                 "collector, by generation.", ("generation",), registry=r)
        self.gc_pause_seconds = Counter(f"{p}gc_pause_seconds", "Seconds the collections of "
                                        "each generation held the GIL.", ("generation",),
                                        registry=r)
        for gen in GENERATIONS:  # on the page from the start, at 0
            self.gc_pauses.labels(generation=str(gen))
            self.gc_pause_seconds.labels(generation=str(gen))
        # Structured output (runtime/core/grammar.py): the compiled-grammar cache, bounded by
        # bytes, and the compiles on its bounded pool, those abandoned past the deadline too.
        self.grammar_cache_bytes = Gauge(f"{p}grammar_cache_bytes",
                                         "Bytes of compiled grammars kept in the cache.",
                                         registry=r)
        self.grammar_cache_entries = Gauge(f"{p}grammar_cache_entries",
                                           "Compiled grammars kept in the cache.", registry=r)
        self.grammar_compiles_in_flight = Gauge(
            f"{p}grammar_compiles_in_flight", "Grammar compiles queued or running, those "
            "whose requests timed out included (they finish into the cache).", registry=r)
        self.grammar_compile_timeouts = Counter(
            f"{p}grammar_compile_timeouts", "Requests answered 400 because their grammar did "
            "not compile within --grammar-compile-timeout.", registry=r)
        # Counters that follow a source's running total (the executor's, the collector's):
        # see _follow.
        self._seen: dict[tuple[str, str], float] = {}  # (series, label) -> highest total
        self._lock = threading.Lock()

    def refresh(self, stats: object | None, gates: Sequence[dict[str, object]]) -> None:
        """Scrape-time update from `Executor.stats()` (an ExecutorStats) and the gate list."""
        if stats is not None:
            self.running.set(getattr(stats, "running", 0))
            self.waiting.set(getattr(stats, "waiting", 0))
            self.kv_usage.set(getattr(stats, "kv_usage", 0.0))
            self.picker["waiting"].set(getattr(stats, "waiting", 0))
            self.picker["running"].set(getattr(stats, "running", 0))
            for key in ("kv_usage", "kv_usage_old"):
                self.picker[key].set(getattr(stats, "kv_usage", 0.0))
            total = int(getattr(stats, "kv_blocks_total", 0))
            used = int(getattr(stats, "kv_blocks_used", 0))
            cached = int(getattr(stats, "kv_blocks_cached", 0))
            self.kv_blocks.labels(state="used").set(used)
            self.kv_blocks.labels(state="cached").set(cached)
            self.kv_blocks.labels(state="free").set(max(total - used - cached, 0))
            self._follow(self.preemptions, ("preemptions", ""),
                         float(getattr(stats, "preemptions_total", 0)))
            extra = getattr(stats, "extra", None) or {}
            for key in self.mirrored:
                if key in extra:
                    self._follow(self.mirrored[key], (key, ""), float(extra[key]))
            for key, value in extra.items():
                if key.startswith(SPEC_PER_POS):
                    pos = key.removeprefix(SPEC_PER_POS)
                    self._follow(self.spec_per_pos.labels(position=pos), ("per_pos", pos),
                                 float(value))
            if "intra_op_threads" in extra:
                self.intra_op_threads.set(float(extra["intra_op_threads"]))
            drafted = float(extra.get("spec_decode_num_draft_tokens_total", 0.0))
            drafts = float(extra.get("spec_decode_num_drafts_total", 0.0))
            accepted = float(extra.get("spec_decode_num_accepted_tokens_total", 0.0))
            self.spec_acceptance_rate.set(accepted / drafted if drafted else 0.0)
            self.spec_mean_accepted_length.set(1.0 + accepted / drafts if drafts else 0.0)
        for gate in gates:
            seconds = gate.get("seconds")
            if isinstance(seconds, (int, float)) and not isinstance(seconds, bool):
                self.gate_seconds.labels(gate=str(gate.get("name", "?"))).set(float(seconds))

    def refresh_grammar(self, stats: object | None) -> None:
        """Scrape-time update from `GrammarCompiler.stats()` (None: no compile yet)."""
        self.grammar_cache_bytes.set(getattr(stats, "cache_bytes", 0))
        self.grammar_cache_entries.set(getattr(stats, "cache_entries", 0))
        self.grammar_compiles_in_flight.set(getattr(stats, "in_flight", 0))

    def refresh_gc(self, totals: Mapping[int, PauseTotals]) -> None:
        """Scrape-time update from `gcpolicy.PAUSES.totals()`."""
        for gen, t in totals.items():
            g = str(gen)
            self._follow(self.gc_pauses.labels(generation=g), ("gc_pauses", g),
                         float(t.collections))
            self._follow(self.gc_pause_seconds.labels(generation=g), ("gc_seconds", g), t.seconds)

    def _follow(self, counter: Counter, key: tuple[str, str], total: float) -> None:
        """Move `counter` up to a source's running `total`. A restarted source (total back
        to 0) must not move the exported counter back: it stays put until the source passes
        the highest total seen. The lock makes read-compare-increment atomic."""
        with self._lock:
            seen = self._seen.get(key, 0.0)
            if total > seen:
                counter.inc(total - seen)
                self._seen[key] = total
