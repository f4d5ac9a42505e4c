"""What grammar-constrained decoding (structured output) costs per token.

    python -m bench.grammar_cost [--hf-dir DIR] [--tokens N] [--skip-engine]

On the demo model's tokenizer (SmolLM2, 49,152 tokens; `python -m demo.model`):

1. the sampler alone, per step, with and without a JSON-Schema grammar on every row
   (batch 1 and 8, random logits): the grammar's share is xgrammar filling the token
   bitmask, its kernel applying it to the logits, and the matcher accepting the token;
2. a whole decode in process (LLMEngine, eager, TP=1): the same chat prompt answered
   greedily with and without `response_format` json_schema, milliseconds per output
   token, so the grammar's share of a real step shows;
3. compiling the schema, cold and from the cache.

Writes bench/results/latest/grammar.md and prints it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.common import RESULTS, demo_checkpoint, md_table
from runtime.grammar import GrammarCompiler, GrammarState
from runtime.logits import SeqSampling
from runtime.sampler import Sampler, make_generator
from runtime.types import GuidedSpec, SamplingParams

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24},
    "age": {"type": "integer", "minimum": 0, "maximum": 130},
    "city": {"type": "string", "maxLength": 24},
    "languages": {"type": "array", "maxItems": 4, "items": {"type": "string", "maxLength": 12}},
    "employed": {"type": "boolean"}},
    "required": ["name", "age", "city", "languages", "employed"], "additionalProperties": False}
SPEC = GuidedSpec("json_schema", json.dumps(SCHEMA))


def _ms(fn: Callable[[], Any], repeat: int) -> float:
    """Median milliseconds of `fn` over `repeat` runs (after one warm-up run)."""
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _states(compiler: GrammarCompiler | None, batch: int, eos: int) -> list[SeqSampling]:
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=10_000)
    out = []
    for i in range(batch):
        grammar = GrammarState(compiler.compile(SPEC), [eos]) if compiler else None
        out.append(SeqSampling(params, make_generator(params, i), [eos], [], grammar))
    return out


def sampler_steps(compiler: GrammarCompiler, vocab: int, eos: int, batch: int,
                  tokens: int) -> dict[str, float]:
    """ms per sampler step (one token per row) without and with the grammar."""
    gen = torch.Generator().manual_seed(0)
    logits = [torch.randn(batch, vocab, generator=gen) * 4 for _ in range(8)]
    sampler = Sampler()
    out: dict[str, float] = {}
    for name, comp in (("plain", None), ("grammar", compiler)):
        states = _states(comp, batch, eos)
        times = []
        for i in range(tokens):
            t0 = time.perf_counter()
            picks = sampler.sample_seqs(logits[i % 8], states)
            for s, (tok, _) in zip(states, picks):
                s.accept(tok, None)
            times.append((time.perf_counter() - t0) * 1e3)
            for j, s in enumerate(states):  # a finished document starts again
                if s.grammar is not None and s.grammar.terminated:
                    states[j] = _states(comp, 1, eos)[0]
        out[name] = statistics.median(times)
    return out


def parts(compiler: GrammarCompiler, tok: Any, vocab: int, eos: int) -> dict[str, float]:
    """One row's grammar work, split: fill the bitmask, apply it (xgrammar's kernel), and
    the whole of runtime.grammar.apply_grammars (allocate, fill, control-character words,
    apply)."""
    import xgrammar as xgr

    from runtime.grammar import apply_grammars

    state = _states(compiler, 1, eos)[0].grammar
    assert state is not None
    # Inside a string value, where most tokens are allowed (the largest mask).
    for token in tok.encode('{"name": "Ada'):
        assert state.accept(token)
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    logits = torch.randn(1, vocab)
    return {
        "fill bitmask (xgrammar)": _ms(lambda: state.fill(bitmask, 0), 200),
        "apply bitmask (xgrammar kernel)": _ms(
            lambda: xgr.apply_token_bitmask_inplace(logits, bitmask), 200),
        "apply_grammars, all of it": _ms(lambda: apply_grammars(logits, [(0, state)]), 200),
    }


def compile_times(tok: Any, vocab: int, eos: int) -> dict[str, float]:
    t0 = time.perf_counter()
    fresh = GrammarCompiler(tok, vocab, [eos])
    fresh.compile(GuidedSpec("json_object"))
    first = (time.perf_counter() - t0) * 1e3
    other = GuidedSpec("json_schema", json.dumps({**SCHEMA, "title": "another"}))
    t0 = time.perf_counter()
    fresh.compile(other)
    cold = (time.perf_counter() - t0) * 1e3
    cached = _ms(lambda: fresh.compile(other), 50)
    return {"tokenizer info + first grammar (once per server)": first,
            "a new JSON Schema": cold, "the same schema again (cache)": cached}


def engine_decode(hf_dir: Path, tok: Any, compiler: GrammarCompiler, tokens: int
                  ) -> dict[str, float]:
    """ms per output token of a whole greedy decode, without and with the grammar."""
    from runtime.engine import LLMEngine
    from runtime.executors.torch import runner_from_checkpoint
    from runtime.models.parallel import TPContext
    from runtime.scheduler import SchedulerConfig
    from runtime.types import TokenEvent

    runner, _ = runner_from_checkpoint(hf_dir, TPContext(), "float32", 64, 16)
    engine = LLMEngine(runner, SchedulerConfig(4, 256, 16, 64, 512, (tok.eos_token_id,)))
    messages = [{"role": "user", "content": "Describe a person as JSON: name, age, city, "
                 "languages, employed."}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                     return_dict=False)
    out: dict[str, float] = {}
    for name, grammar in (("plain", None), ("json_schema", compiler.compile(SPEC))):
        params = SamplingParams(max_tokens=tokens, temperature=0.0, guided=SPEC if grammar
                                else None, grammar=grammar, ignore_eos=grammar is None)
        events: list[tuple[float, int]] = []

        def cb(ev: TokenEvent, events: list[tuple[float, int]] = events) -> None:
            events.append((time.perf_counter(), len(ev.token_ids)))

        engine.add_request(name, list(prompt), params, cb)
        while engine.num_unfinished():
            engine.step()
        stamps = [t for t, _ in events]
        gaps = [b - a for a, b in itertools.pairwise(stamps[1:])]  # decode steps only
        out[name] = statistics.median(gaps) * 1e3
        out[f"{name} tokens"] = sum(n for _, n in events)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hf-dir", type=Path, default=None)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--skip-engine", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    hf_dir = args.hf_dir or demo_checkpoint()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(hf_dir))
    vocab = len(tok)
    eos = int(tok.eos_token_id)
    load = os.getloadavg()[0]
    lines = [f"# Grammar-constrained decoding cost ({hf_dir.name}, vocabulary {vocab}, "
             f"{torch.get_num_threads()} torch threads, load average {load:.1f} on "
             f"{os.cpu_count()} cores at the start)", ""]
    compiles = compile_times(tok, vocab, eos)
    compiler = GrammarCompiler(tok, vocab, [eos])
    lines += ["## Compiling", "", *md_table(["what", "ms"],
                                            [[k, f"{v:.1f}"] for k, v in compiles.items()]), ""]
    lines += ["## One row's grammar work per token", "", *md_table(
        ["part", "ms"], [[k, f"{v:.3f}"] for k, v in parts(compiler, tok, vocab, eos).items()]),
        ""]
    rows = []
    for batch in (1, 8):
        r = sampler_steps(compiler, vocab, eos, batch, args.tokens)
        rows.append([str(batch), f"{r['plain']:.2f}", f"{r['grammar']:.2f}",
                     f"{(r['grammar'] - r['plain']) / batch:.3f}"])
    lines += ["## Sampler step (random logits, temperature 1)", "", *md_table(
        ["batch", "plain ms/step", "grammar ms/step", "grammar ms/token"], rows), ""]
    if not args.skip_engine:
        e = engine_decode(hf_dir, tok, compiler, min(args.tokens, 64))
        lines += ["## Whole decode step (LLMEngine eager, TP=1, float32, greedy, batch 1)",
                  "", *md_table(["", "ms/token", "tokens"], [
                      ["plain", f"{e['plain']:.1f}", str(e["plain tokens"])],
                      ["json_schema", f"{e['json_schema']:.1f}", str(e["json_schema tokens"])],
                  ]), "", f"Grammar overhead: {e['json_schema'] - e['plain']:+.1f} ms/token "
                  f"({(e['json_schema'] / e['plain'] - 1) * 100:+.1f} %).", ""]
    text = "\n".join(lines)
    print(text)
    out = RESULTS / "latest" / "grammar.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")


if __name__ == "__main__":
    main()
