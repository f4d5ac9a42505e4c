"""Speculative decoding (n-gram prompt lookup) through the engine at TP=1 and TP=2: greedy
outputs token for token those of the plain engine (log-probabilities too, within the
rounding of a verify step's logits against a decode step's), drafts accepted, blocks all
returned; seeded sampled requests speculate and repeat themselves run to run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from contract.profile import BuildProfile
from contract.speculative import Speculative
from pipeline.build import build_engine
from pipeline.config import BuildConfig
from runtime.core.scheduler import SchedulerConfig
from runtime.core.types import SamplingParams, TokenEvent, TokenLogprob
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
        if reqs[i][1].greedy:  # a sampled request's stream is drawn differently when drafting
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


def test_tp2_aoti_bf16_speculation_keeps_every_logprob_bit_for_bit(
        tiny_models: dict[str, Path], tmp_path: Path) -> None:
    """3 KV heads over 2 ranks share the middle one (runtime/models/kv_heads.py): each token
    attends it on the rank its position names, so a verify step (the sequence's tokens as a
    prompt chunk's rows) and plain decode (one batch row each) add the same partial sums in
    the o_proj all-reduce. By batch row they did not, and bf16 log-probabilities differed in
    their last bits (greedy SmolLM2 at TP=2 flipped at near-ties). A compiled bf16 engine,
    as served: tokens and every greedy log-probability equal, bit for bit."""
    profile = BuildProfile(max_batch_size=8, max_num_tokens=64, max_seq_len=128,
                           tokens_per_block=BLOCK)
    engine = build_engine(BuildConfig(model=str(tiny_models["llama_kv3"]), tp=2, backend="aoti",
                                      dtype="bfloat16", target="cpu", profile=profile,
                                      store=str(tmp_path / "store"))).engine_dir
    out = tmp_path / "result.json"
    proc = run_mpirun(2, [sys.executable, "-m", "tests.runtime.mpi_spec_worker", str(out),
                          str(engine)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["spec"] == result["plain"]
    assert result["accepted"] > 0
    lps, want = result["spec_logprobs"], result["plain_logprobs"]
    assert lps.keys() == want.keys() and len(lps) == len(result["plain"])
    for k in want:
        assert lps[k] == want[k], f"request {k}: {lps[k]} != {want[k]}"


Traced = dict[str, tuple[list[int], list[TokenLogprob], list[int]]]


def run_traced(engine: LLMEngine, reqs: list[tuple[list[int], SamplingParams]]) -> Traced:
    """All requests at once to the end: tokens, log-probabilities, event sizes."""
    out: Traced = {str(i): ([], [], []) for i in range(len(reqs))}

    def cb(ev: TokenEvent) -> None:
        tokens, lps, sizes = out[ev.request_id]
        tokens.extend(ev.token_ids)
        lps.extend(ev.logprobs or ())
        if ev.token_ids:
            sizes.append(len(ev.token_ids))

    for i, (prompt, params) in enumerate(reqs):
        engine.add_request(str(i), prompt, params, cb)
    while engine.num_unfinished():
        engine.step()
    assert engine.scheduler.block_manager.num_used == 0
    return out


def test_logprobs_and_seeded_sampled_requests_speculate(tiny_models: dict[str, Path]) -> None:
    path = tiny_models["llama"]
    prompts = spec_prompts()
    reqs = [(p, greedy(30, logprobs=3)) for p in prompts]
    # The tiny random model's rows are nearly flat: at 0.7 drafts are all but always
    # rejected (the residual draw runs), at 0.02 some are kept.
    reqs += [(p, SamplingParams(max_tokens=30, temperature=t, top_p=0.95, seed=11 + i,
                                logprobs=1, ignore_eos=True))
             for t in (0.7, 0.02) for i, p in enumerate(prompts)]
    plain = run_traced(make_engine(path, None), reqs)
    spec_engine = make_engine(path, Speculative("ngram", 5))
    got = run_traced(spec_engine, reqs)
    for i, (_, params) in enumerate(reqs):
        tokens, lps, _ = got[str(i)]
        assert len(lps) == len(tokens)
        if not params.greedy:
            continue
        want_tokens, want_lps, _ = plain[str(i)]
        assert tokens == want_tokens, f"request {i}"
        for a, b in zip(lps, want_lps):
            # The same processed distribution; its logits row comes from a verify step
            # (several positions at once) rather than a decode step: equal to rounding.
            assert a.token == b.token and abs(a.logprob - b.logprob) < 1e-4
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
    for kind in (True, False):
        ids = [str(i) for i, (_, p) in enumerate(reqs) if p.greedy == kind]
        assert any(max(got[k][2]) > 1 for k in ids), f"drafts accepted (greedy: {kind})"
    s = spec_engine.stats().extra
    assert 0 < s["spec_decode_num_accepted_tokens_total"] < s["spec_decode_num_draft_tokens_total"]
    # seeded sampled requests: the same tokens and log-probabilities run to run
    again = run_traced(make_engine(path, Speculative("ngram", 5)), reqs)
    assert again == got
