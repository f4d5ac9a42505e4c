"""Speculative decoding with a draft engine (runtime/executors/draft.py) over real tiny
models at TP=1: the target's own model as the draft accepts every draft and changes no
output; its int4_wo quantization as the draft (self-speculation) changes no output either
and accepts fewer than all. Outputs are compared token for token with plain decoding."""

from __future__ import annotations

from pathlib import Path

import pytest

from contract.quant import Quantization, QuantSpec
from contract.speculative import Speculative
from runtime.core.scheduler import SchedulerConfig
from runtime.executors.draft import DraftEngineDrafter
from runtime.executors.loop import LLMEngine
from runtime.executors.torch import runner_from_checkpoint
from runtime.models.parallel import TPContext
from tests.runtime.spec_workload import greedy, run_requests, spec_prompts

BLOCK = 4
BLOCKS = 256
K = 4
INT4 = Quantization("int4_wo", QuantSpec("int4", 32))


def engine(path: Path, draft_quant: Quantization | None, max_tokens: int = 64,
           caching: bool = True) -> tuple[LLMEngine, DraftEngineDrafter | None]:
    runner, cfg = runner_from_checkpoint(path, TPContext(), "float32", BLOCKS, BLOCK)
    drafter = None
    spec = None
    if draft_quant is not None:
        draft_runner, _ = runner_from_checkpoint(path, TPContext(), "float32", BLOCKS, BLOCK,
                                                 quant=draft_quant)
        drafter = DraftEngineDrafter(draft_runner, K, BLOCKS, max_tokens, keep_logits=True)
        spec = Speculative("draft", K, engine=str(path))
    sc = SchedulerConfig(8, max_tokens, BLOCK, BLOCKS, 256, cfg.eos_token_ids,
                         enable_prefix_caching=caching, speculative=spec)
    return LLMEngine(runner, sc, drafter=drafter), drafter


def workload() -> list[tuple[list[int], object]]:
    prompts = spec_prompts(seed=2)
    reqs = [(p, greedy(40)) for p in prompts]
    reqs += [(prompts[1], greedy(7)), (prompts[3], greedy(30, stop_token_ids=(17,)))]
    from runtime.core.types import SamplingParams
    reqs.append((prompts[0], SamplingParams(max_tokens=12, temperature=0.8, seed=3)))
    return reqs  # type: ignore[return-value]


@pytest.mark.parametrize("draft", ["same", "int4"])
def test_draft_engine_outputs_equal_plain_decoding(tiny_models: dict[str, Path],
                                                    draft: str) -> None:
    path = tiny_models["llama"]
    reqs = workload()
    plain = run_requests(engine(path, None)[0], reqs)  # type: ignore[arg-type]
    spec, drafter = engine(path, Quantization() if draft == "same" else INT4)
    got = run_requests(spec, reqs)  # type: ignore[arg-type]
    for i in range(len(reqs)):
        assert got[str(i)][:2] == plain[str(i)][:2], f"request {i}"
    s = spec.stats().extra
    drafted = s["spec_decode_num_draft_tokens_total"]
    accepted = s["spec_decode_num_accepted_tokens_total"]
    assert drafted > 0
    if draft == "same":
        assert accepted == drafted  # its own model: every draft is what it would decode
    else:
        assert 0 < accepted < drafted
    assert max(n for _, _, sizes in got.values() for n in sizes) > 1
    assert drafter is not None
    assert drafter.blocks.num_used == 0 and not drafter.runner.seqs  # all forgotten
    assert drafter.stats.passes > 0


def test_small_step_budget_without_prefix_cache(tiny_models: dict[str, Path]) -> None:
    """A 12-token budget: drafts cut short by the step and the draft's catch-up chunked."""
    path = tiny_models["llama"]
    reqs = [(p, greedy(30)) for p in spec_prompts(seed=1)] * 2
    plain = run_requests(engine(path, None, 12, caching=False)[0], reqs)  # type: ignore[arg-type]
    spec, _ = engine(path, INT4, 12, caching=False)
    got = run_requests(spec, reqs)  # type: ignore[arg-type]
    assert {k: v[:2] for k, v in got.items()} == {k: v[:2] for k, v in plain.items()}
