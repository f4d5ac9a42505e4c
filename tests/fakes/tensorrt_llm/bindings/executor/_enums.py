"""Enumerations of tensorrt_llm.bindings.executor (reference §2.1, §2.2)."""

from __future__ import annotations

from enum import Enum


class ModelType(Enum):
    DECODER_ONLY = 0
    ENCODER_ONLY = 1
    ENCODER_DECODER = 2


class BatchingType(Enum):
    STATIC = 0
    INFLIGHT = 1


class CapacitySchedulerPolicy(Enum):
    MAX_UTILIZATION = 0
    GUARANTEED_NO_EVICT = 1
    STATIC_BATCH = 2


class CommunicationType(Enum):
    MPI = 0


class CommunicationMode(Enum):
    LEADER = 0
    ORCHESTRATOR = 1


class FinishReason(Enum):
    NOT_FINISHED = 0
    END_ID = 1
    STOP_WORDS = 2
    LENGTH = 3
    TIMED_OUT = 4
    CANCELLED = 5
