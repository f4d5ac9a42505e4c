"""TP=2 under a real `mpirun -n 2`: logit parity and in-flight batching parity."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import run_mpirun
from tests.runtime.hf_reference import greedy, last_logits, rel_err
from tests.runtime.mpi_worker import PROMPTS
from tests.runtime.test_engine import staggered_workload


@pytest.fixture(scope="module")
def tp2_result(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("tp2") / "result.json"
    specs = [f"{k}={p}" for k, p in tiny_models.items()]
    proc = run_mpirun(2, [sys.executable, "-m", "tests.runtime.mpi_worker", str(out), *specs])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2", "llama_kv1", "llama_kv3"])
def test_tp2_logit_parity(tp2_result: dict, tiny_models: dict[str, Path], kind: str) -> None:
    assert tp2_result["world"] == 2
    a, b = PROMPTS
    logits = torch.tensor(tp2_result[kind]["logits"])
    refs = [a, b, [*a, 50], [*b, 60]]
    for row, toks in zip(logits, refs):
        assert rel_err(row, last_logits(tiny_models[kind], toks)) < 1e-4


@pytest.mark.parametrize("kind", ["llama", "qwen2", "llama_kv1", "llama_kv3"])
def test_tp2_inflight_batching_matches_generate_alone(tp2_result: dict, tiny_models: dict[str, Path], kind: str) -> None:
    generated = tp2_result[kind]["generated"]
    for i, (_, prompt, mt) in enumerate(staggered_workload()):
        assert generated[str(i)] == greedy(tiny_models[kind], prompt, mt), f"request {i}"
