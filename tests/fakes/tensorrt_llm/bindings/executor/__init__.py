"""tensorrt_llm.bindings.executor: the C++ Executor's Python bindings (reference §2.1, §2.2)."""

from __future__ import annotations

from ._config import (
    ExecutorConfig,
    ExtendedRuntimePerfKnobConfig,
    KvCacheConfig,
    OrchestratorConfig,
    ParallelConfig,
    SchedulerConfig,
)
from ._enums import (
    BatchingType,
    CapacitySchedulerPolicy,
    CommunicationMode,
    CommunicationType,
    FinishReason,
    ModelType,
)
from ._executor import Executor
from ._guided import GuidedDecodingConfig, GuidedDecodingParams
from ._request import OutputConfig, Request, Response, Result, SamplingConfig
from ._stats import InflightBatchingStats, IterationStats, KvCacheStats

__all__ = [
    "BatchingType",
    "CapacitySchedulerPolicy",
    "CommunicationMode",
    "CommunicationType",
    "Executor",
    "ExecutorConfig",
    "ExtendedRuntimePerfKnobConfig",
    "FinishReason",
    "GuidedDecodingConfig",
    "GuidedDecodingParams",
    "InflightBatchingStats",
    "IterationStats",
    "KvCacheConfig",
    "KvCacheStats",
    "ModelType",
    "OrchestratorConfig",
    "OutputConfig",
    "ParallelConfig",
    "Request",
    "Response",
    "Result",
    "SamplingConfig",
    "SchedulerConfig",
]
