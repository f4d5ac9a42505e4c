"""Rank 0's OpenAI-compatible HTTP layer (aiohttp on its own thread and event loop)."""

from __future__ import annotations

from serve.api.protocol import ApiError, GenerationRequest
from serve.api.server import HttpBindError, HttpServerHandle, build_app, start_http_server
from serve.api.state import Phase, Readiness, ServerState

__all__ = [
    "ApiError",
    "GenerationRequest",
    "HttpBindError",
    "HttpServerHandle",
    "Phase",
    "Readiness",
    "ServerState",
    "build_app",
    "start_http_server",
]
