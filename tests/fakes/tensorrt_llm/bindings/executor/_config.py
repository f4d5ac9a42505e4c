"""Executor configuration classes of tensorrt_llm.bindings.executor (reference §2.1, §2.2)."""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass, field
from typing import Any

from ._enums import BatchingType, CapacitySchedulerPolicy, CommunicationMode, CommunicationType
from ._guided import GuidedDecodingConfig
from ._typed import Typed

_INT = (int,)
_OPT_INT = (int, None)
_OPT_FLOAT = (float, None)


@dataclass(slots=True)
class SchedulerConfig(Typed):
    """Fields are read-only after construction (nanobind read-only properties)."""

    _TYPES = {"capacity_scheduler_policy": (CapacitySchedulerPolicy,)}  # noqa: RUF012

    capacity_scheduler_policy: CapacitySchedulerPolicy = CapacitySchedulerPolicy.GUARANTEED_NO_EVICT
    context_chunking_policy: Any = None
    dynamic_batch_config: Any = None
    _frozen: bool = field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_frozen", True)

    def __setattr__(self, name: str, value: Any) -> None:
        if getattr(self, "_frozen", False):
            raise AttributeError(f"property '{name}' of 'SchedulerConfig' object has no setter")
        Typed.__setattr__(self, name, value)

    def __copy__(self) -> SchedulerConfig:
        return SchedulerConfig(self.capacity_scheduler_policy, self.context_chunking_policy,
                               self.dynamic_batch_config)


@dataclass(slots=True)
class KvCacheConfig(Typed):
    _TYPES = {  # noqa: RUF012
        "enable_block_reuse": (bool,),
        "max_tokens": _OPT_INT,
        "max_attention_window": (list, None),
        "sink_token_length": _OPT_INT,
        "free_gpu_memory_fraction": _OPT_FLOAT,
        "host_cache_size": _OPT_INT,
        "onboard_blocks": (bool,),
        "cross_kv_cache_fraction": _OPT_FLOAT,
        "secondary_offload_min_priority": _OPT_INT,
        "event_buffer_max_size": _INT,
        "enable_partial_reuse": (bool,),
        "copy_on_partial_reuse": (bool,),
        "use_uvm": (bool,),
    }

    enable_block_reuse: bool = True
    max_tokens: int | None = None
    max_attention_window: list[int] | None = None
    sink_token_length: int | None = None
    free_gpu_memory_fraction: float | None = None
    host_cache_size: int | None = None
    onboard_blocks: bool = True
    cross_kv_cache_fraction: float | None = None
    secondary_offload_min_priority: int | None = None
    event_buffer_max_size: int = 0
    _: KW_ONLY
    enable_partial_reuse: bool = True
    copy_on_partial_reuse: bool = True
    use_uvm: bool = False
    runtime_defaults: Any = None


@dataclass(slots=True)
class OrchestratorConfig(Typed):
    _TYPES = {"is_orchestrator": (bool,), "worker_executable_path": (str,)}  # noqa: RUF012

    is_orchestrator: bool = True
    worker_executable_path: str = ""
    orch_leader_comm: Any = None
    spawn_processes: bool = True


@dataclass(slots=True)
class ParallelConfig(Typed):
    _TYPES = {  # noqa: RUF012
        "communication_type": (CommunicationType,),
        "communication_mode": (CommunicationMode,),
        "device_ids": (list, None),
        "participant_ids": (list, None),
        "orchestrator_config": (OrchestratorConfig, None),
        "num_nodes": _OPT_INT,
    }

    communication_type: CommunicationType = CommunicationType.MPI
    communication_mode: CommunicationMode = CommunicationMode.LEADER
    device_ids: list[int] | None = None
    participant_ids: list[int] | None = None
    orchestrator_config: OrchestratorConfig | None = None
    num_nodes: int | None = None


@dataclass(slots=True)
class ExtendedRuntimePerfKnobConfig(Typed):
    _TYPES = {  # noqa: RUF012
        "multi_block_mode": (bool,),
        "cuda_graph_mode": (bool,),
        "cuda_graph_cache_size": _INT,
    }

    multi_block_mode: bool = True
    cuda_graph_mode: bool = False
    cuda_graph_cache_size: int = 0


@dataclass(slots=True, kw_only=True)
class ExecutorConfig(Typed):
    _TYPES = {  # noqa: RUF012
        "max_beam_width": _INT,
        "scheduler_config": (SchedulerConfig,),
        "kv_cache_config": (KvCacheConfig,),
        "enable_chunked_context": (bool,),
        "normalize_log_probs": (bool,),
        "iter_stats_max_iterations": _INT,
        "request_stats_max_iterations": _INT,
        "batching_type": (BatchingType,),
        "max_batch_size": _OPT_INT,
        "max_num_tokens": _OPT_INT,
        "parallel_config": (ParallelConfig, None),
        "gpu_weights_percent": (float,),
        "max_queue_size": _OPT_INT,
        "extended_runtime_perf_knob_config": (ExtendedRuntimePerfKnobConfig,),
        "recv_poll_period_ms": _INT,
        "gather_generation_logits": (bool,),
        "guided_decoding_config": (GuidedDecodingConfig, None),
    }

    max_beam_width: int = 1
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    kv_cache_config: KvCacheConfig = field(default_factory=KvCacheConfig)
    enable_chunked_context: bool = False
    normalize_log_probs: bool = True
    iter_stats_max_iterations: int = 1000
    request_stats_max_iterations: int = 0
    batching_type: BatchingType = BatchingType.INFLIGHT
    max_batch_size: int | None = None  # None: the engine's value
    max_num_tokens: int | None = None  # None: the engine's value
    parallel_config: ParallelConfig | None = None
    peft_cache_config: Any = None
    logits_post_processor_config: Any = None
    decoding_config: Any = None
    gpu_weights_percent: float = 1.0
    max_queue_size: int | None = None
    extended_runtime_perf_knob_config: ExtendedRuntimePerfKnobConfig = field(
        default_factory=ExtendedRuntimePerfKnobConfig
    )
    debug_config: Any = None
    recv_poll_period_ms: int = 0
    max_seq_idle_microseconds: int | None = None
    spec_dec_config: Any = None
    guided_decoding_config: GuidedDecodingConfig | None = None
    additional_model_outputs: Any = None
    cache_transceiver_config: Any = None
    gather_generation_logits: bool = False
