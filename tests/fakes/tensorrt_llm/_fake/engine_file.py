"""Format of the fake's rank{N}.engine: a magic line, then JSON.

A real plan file is opaque TensorRT bytes tied to the GPU SM and the exact TensorRT version;
the fake records both (and the TensorRT-LLM version) so a load can reject a mismatch the way
the reference describes. Nothing outside the fake may rely on this format.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

MAGIC = b"FAKE-TRT-PLAN v1\n"


def engine_bytes(payload: dict[str, Any]) -> bytes:
    return MAGIC + json.dumps(payload, sort_keys=True).encode()


def parse_engine_bytes(data: bytes) -> dict[str, Any]:
    if not data.startswith(MAGIC):
        raise ValueError("not a fake TensorRT plan")
    return json.loads(data[len(MAGIC) :])


def read_engine_file(path: Path) -> dict[str, Any]:
    return parse_engine_bytes(path.read_bytes())
