"""Speculative decoding (n-gram prompt lookup) through the engine at TP=1 and TP=2: greedy
outputs token for token those of the plain engine, drafts accepted, blocks all returned."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from contract.speculative import Speculative
from runtime.core.scheduler import SchedulerConfig
from runtime.executors.loop import LLMEngine
from runtime.executors.torch import runner_from_checkpoint
from runtime.models.parallel import TPContext
from tests.conftest import run_mpirun
from tests.runtime.spec_workload import build_workload, greedy, run_requests, spec_prompts

BLOCK = 4


def make_engine(path: Path, spec: Speculative | None, caching: bool = True,
                max_tokens: int = 64) -> LLMEngine:
    runner, cfg = runner_from_checkpoint(path, TPContext(), "float32", 256, BLOCK)
    sc = SchedulerConfig(8, max_tokens, BLOCK, 256, 256, cfg.eos_token_ids,
                         enable_prefix_caching=caching, speculative=spec,
                         spec_max_batch_size=8)  # the verify path at every batch size
    return LLMEngine(runner, sc)


def test_greedy_outputs_equal_plain_decoding(tiny_models: dict[str, Path]) -> None:
    path = tiny_models["llama"]
    reqs = build_workload(make_engine(path, Speculative("ngram", 5)))
    assert any(p.max_tokens < 40 and p.temperature == 0 for _, p in reqs), "max_tokens mid-draft"
    assert any(p.stop_token_ids for _, p in reqs), "a stop token mid-draft"
    plain = run_requests(make_engine(path, None), reqs)
    spec = make_engine(path, Speculative("ngram", 5))
    got = run_requests(spec, reqs)
    for i in range(len(reqs)):
        assert got[str(i)][:2] == plain[str(i)][:2], f"request {i}: {reqs[i][1]}"
    s = spec.stats().extra
    assert 0 < s["spec_decode_num_accepted_tokens_total"] <= s["spec_decode_num_draft_tokens_total"]
    # fewer steps than tokens: verify steps produced several tokens at once
    assert max(n for _, _, sizes in got.values() for n in sizes) > 1
    assert spec.stats().steps_total < plain_steps(plain)


def plain_steps(result: dict[str, tuple[list[int], str, list[int]]]) -> int:
    return sum(len(tokens) for tokens, _, _ in result.values())


def test_small_budget_and_no_prefix_cache(tiny_models: dict[str, Path]) -> None:
    """A step budget that cuts drafts short and forces chunked prefills beside verify steps."""
    path = tiny_models["llama"]
    prompts = spec_prompts(seed=1)
    reqs = [(p, greedy(30)) for p in prompts] * 2
    plain = run_requests(make_engine(path, None, caching=False, max_tokens=12), reqs)
    got = run_requests(make_engine(path, Speculative("ngram", 7), caching=False, max_tokens=12),
                       reqs)
    assert {k: v[:2] for k, v in got.items()} == {k: v[:2] for k, v in plain.items()}


def test_tp2_greedy_outputs_equal_plain_decoding(tiny_models: dict[str, Path],
                                                  tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    proc = run_mpirun(2, [sys.executable, "-m", "tests.runtime.mpi_spec_worker", str(out),
                          str(tiny_models["llama"])])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["world"] == 2
    assert result["spec"] == result["plain"]
    assert any(stop for stop in result["stops"]), "a stop token mid-draft"
    assert result["accepted"] > 0
