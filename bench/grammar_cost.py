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

Times are CPU time of the one thread doing the work (torch limited to one thread), so
they stay meaningful on a loaded machine, where wall-clock times of small tensor ops
swing by 100x as threads wait for a core.

Writes bench/results/latest/grammar.md and prints it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.common import RESULTS, demo_checkpoint, md_table
from runtime.core.grammar import GrammarCompiler, GrammarState
from runtime.core.logits import SeqSampling
from runtime.core.sampler import Sampler, make_generator
from runtime.core.types import GuidedSpec, SamplingParams

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24},
    "age": {"type": "integer", "minimum": 0, "maximum": 130},
    "city": {"type": "string", "maxLength": 24},
    "languages": {"type": "array", "maxItems": 4, "items": {"type": "string", "maxLength": 12}},
    "employed": {"type": "boolean"}},
    "required": ["name", "age", "city", "languages", "employed"], "additionalProperties": False}
SPEC = GuidedSpec("json_schema", json.dumps(SCHEMA))


def _ms(fn: Callable[[], Any], repeat: int) -> float:
    """Median CPU milliseconds of `fn` over `repeat` runs (after one warm-up run)."""
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.thread_time()
        fn()
        times.append((time.thread_time() - t0) * 1e3)
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
            t0 = time.thread_time()
            picks = sampler.sample_seqs(logits[i % 8], states)
            for s, (tok, _) in zip(states, picks):
                s.accept(tok, None)
            times.append((time.thread_time() - t0) * 1e3)
            for j, s in enumerate(states):  # a finished document starts again
                if s.grammar is not None and s.grammar.terminated:
                    states[j] = _states(comp, 1, eos)[0]
        out[name] = statistics.median(times)
    return out


def parts(compiler: GrammarCompiler, tok: Any, vocab: int, eos: int) -> dict[str, float]:
    """One row's grammar work, split: fill the bitmask, apply it (xgrammar's kernel), and
    the whole of runtime.core.grammar.apply_grammars (allocate, fill, control-character words,
    apply)."""
    import xgrammar as xgr

    from runtime.core.grammar import apply_grammars

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
    t0 = time.thread_time()
    fresh = GrammarCompiler(tok, vocab, [eos])
    fresh.compile(GuidedSpec("json_object"))
    first = (time.thread_time() - t0) * 1e3
    other = GuidedSpec("json_schema", json.dumps({**SCHEMA, "title": "another"}))
    t0 = time.thread_time()
    fresh.compile(other)
    cold = (time.thread_time() - t0) * 1e3
    cached = _ms(lambda: fresh.compile(other), 50)
    return {"tokenizer info + first grammar (once per server)": first,
            "a new JSON Schema": cold, "the same schema again (cache)": cached}


def engine_decode(hf_dir: Path, tok: Any, compiler: GrammarCompiler, tokens: int
                  ) -> dict[str, float]:
    """CPU ms per output token of a whole greedy decode, without and with the grammar, and
    of the grammar's own work inside the latter (mask and accept, timed in place)."""
    import runtime.core.logits as logits_mod
    from runtime.core.scheduler import SchedulerConfig
    from runtime.executors.loop import LLMEngine
    from runtime.executors.torch import runner_from_checkpoint
    from runtime.models.parallel import TPContext

    spent = [0.0]

    def timed(fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[0] += time.thread_time() - t0
        return wrapper

    runner, _ = runner_from_checkpoint(hf_dir, TPContext(), "float32", 64, 16)
    engine = LLMEngine(runner, SchedulerConfig(4, 256, 16, 64, 512, (tok.eos_token_id,)))
    messages = [{"role": "user", "content": "Describe a person as JSON: name, age, city, "
                 "languages, employed."}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                     return_dict=False)
    out: dict[str, float] = {}
    real_apply, real_accept = logits_mod.apply_grammars, GrammarState.accept
    logits_mod.apply_grammars = timed(real_apply)  # type: ignore[assignment]
    GrammarState.accept = timed(real_accept)  # type: ignore[method-assign]
    try:
        for name, grammar in (("plain", None), ("json_schema", compiler.compile(SPEC))):
            params = SamplingParams(max_tokens=tokens, temperature=0.0,
                                    guided=SPEC if grammar else None, grammar=grammar,
                                    ignore_eos=grammar is None)
            engine.add_request(name, list(prompt), params, lambda ev: None)
            engine.step()  # the prefill
            spent[0] = 0.0
            steps: list[float] = []
            while engine.num_unfinished():
                t0 = time.thread_time()
                engine.step()
                steps.append((time.thread_time() - t0) * 1e3)
            out[name] = statistics.median(steps)  # one token per decode step
            out[f"{name} tokens"] = len(steps) + 1
            out[f"{name} grammar"] = spent[0] * 1e3 / max(1, len(steps))
    finally:
        logits_mod.apply_grammars = real_apply  # type: ignore[assignment]
        GrammarState.accept = real_accept  # type: ignore[method-assign]
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hf-dir", type=Path, default=None)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--skip-engine", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    hf_dir = args.hf_dir or demo_checkpoint()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(hf_dir))
    vocab = len(tok)
    eos = int(tok.eos_token_id)
    load = os.getloadavg()[0]
    lines = [f"# Grammar-constrained decoding cost ({hf_dir.name}, vocabulary {vocab})", "",
             f"CPU time of one thread (torch set to 1 thread); load average {load:.1f} on "
             f"{os.cpu_count()} cores at the start. `python -m bench.grammar_cost`", ""]
    compiles = compile_times(tok, vocab, eos)
    compiler = GrammarCompiler(tok, vocab, [eos])
    lines += ["## Compiling", "", *md_table(["what", "CPU ms"],
                                            [[k, f"{v:.1f}"] for k, v in compiles.items()]), ""]
    lines += ["## One row's grammar work per token", "", *md_table(
        ["part", "CPU ms"], [[k, f"{v:.3f}"] for k, v in parts(compiler, tok, vocab, eos).items()]),
        ""]
    rows = []
    for batch in (1, 8):
        r = sampler_steps(compiler, vocab, eos, batch, args.tokens)
        rows.append([str(batch), f"{r['plain']:.2f}", f"{r['grammar']:.2f}",
                     f"{(r['grammar'] - r['plain']) / batch:.3f}"])
    lines += ["## Sampler step (random logits, temperature 1)", "", *md_table(
        ["batch", "plain CPU ms/step", "grammar CPU ms/step", "grammar CPU ms/token"], rows),
        ""]
    if not args.skip_engine:
        e = engine_decode(hf_dir, tok, compiler, min(args.tokens, 64))
        lines += ["## Whole decode step (LLMEngine eager, TP=1, float32, greedy, batch 1)",
                  "", *md_table(["", "CPU ms/token", "of which grammar", "tokens"], [
                      ["plain", f"{e['plain']:.1f}", "-", str(e["plain tokens"])],
                      ["json_schema", f"{e['json_schema']:.1f}",
                       f"{e['json_schema grammar']:.3f}", str(e["json_schema tokens"])],
                  ]), "", f"The grammar's own work: {e['json_schema grammar']:.3f} CPU ms per "
                  f"token, {e['json_schema grammar'] / e['json_schema'] * 100:.2f} % of a "
                  "decode step of this 135M-parameter model (the two runs' step times also "
                  "differ by their different outputs and lengths).", ""]
    text = "\n".join(lines)
    print(text)
    out = RESULTS / "latest" / "grammar.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")


if __name__ == "__main__":
    main()
