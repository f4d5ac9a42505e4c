"""Iteration and request statistics (reference §2.1 "Iteration and KV stats")."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(slots=True)
class KvCacheStats:
    max_num_blocks: int = 0
    free_num_blocks: int = 0
    used_num_blocks: int = 0
    tokens_per_block: int = 0
    alloc_total_blocks: int = 0
    alloc_new_blocks: int = 0
    reused_blocks: int = 0
    missed_blocks: int = 0
    cache_hit_rate: float = 0.0


@dataclass(slots=True)
class InflightBatchingStats:
    num_scheduled_requests: int = 0
    num_context_requests: int = 0
    num_gen_requests: int = 0
    num_paused_requests: int = 0
    num_ctx_tokens: int = 0
    micro_batch_id: int = 0
    avg_num_decoded_tokens_per_iter: float = 0.0


@dataclass(slots=True)
class IterationStats:
    timestamp: str = ""
    iter: int = 0
    iter_latency_ms: float = 0.0
    new_active_requests_queue_latency_ms: float = 0.0
    num_new_active_requests: int = 0
    num_active_requests: int = 0
    num_queued_requests: int = 0
    num_completed_requests: int = 0
    max_num_active_requests: int = 0
    gpu_mem_usage: int = 0
    cpu_mem_usage: int = 0
    pinned_mem_usage: int = 0
    kv_cache_stats: KvCacheStats | None = None
    cross_kv_cache_stats: KvCacheStats | None = None
    inflight_batching_stats: InflightBatchingStats | None = None
    specdec_stats: Any = None

    def to_json_str(self) -> str:
        """camelCase keys, as trtllm-serve's /metrics shows them (kvCacheStats, gpuMemUsage)."""
        return json.dumps(_camel(asdict(self)))


@dataclass(slots=True)
class RequestStats:
    """Per-request entry; the reference names no fields, the fake keeps two."""

    id: int
    num_generated_tokens: int


@dataclass(slots=True)
class RequestStatsPerIteration:
    iter: int
    request_stats: list[RequestStats] = field(default_factory=list)


def _camel(d: Any) -> Any:
    if isinstance(d, dict):
        return {_camel_key(k): _camel(v) for k, v in d.items() if v is not None}
    return d


def _camel_key(k: str) -> str:
    head, *rest = k.split("_")
    return head + "".join(p[:1].upper() + p[1:] for p in rest)
