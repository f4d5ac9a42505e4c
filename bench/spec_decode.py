"""Issue #36's measurement: speculative decoding (n-gram prompt lookup) on and off, in one
run, on one engine, at concurrency 1, in process (no HTTP):

    python -m bench.spec_decode --engine DIR [--k 4 6] [--rounds 3] [--new-tokens 160]
    python -m bench.spec_decode --hf-dir DIR   # the eager path, from a checkpoint
    python -m bench.spec_decode --temperature 0.7   # sampled (seeded), not greedy

Prompts whose answers copy their prompt ("Repeat this text exactly: ...", chat template)
and one of free generation. Each round runs every prompt with speculation off, then with
each K, on the same runner (the server's token bucket), greedy with the model's own stop
tokens; the outputs must be identical token for token, and tokens/s is the output tokens
over the seconds of the whole generate call (prefill included). Prints a markdown table.
With --temperature > 0 the requests are sampled with a fixed seed: each setting must repeat
its own output round to round, but speculation draws its random numbers differently
(acceptance tests, then a residual draw), so outputs with and without it differ; they
follow the same distribution (tests/unit/test_spec_accept.py).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from bench.common import machine_info, md_table

PARAGRAPH = (
    "The old lighthouse stood at the edge of the cliff for more than two hundred years. "
    "Every night its keeper climbed the narrow stairs, trimmed the wick and polished the "
    "great lens until it shone. Ships passing in the dark relied on its steady beam to "
    "find the harbour entrance, and the fishermen of the village said that no storm had "
    "ever put the light out. When the keeper grew old, his daughter took over the work, "
    "and she kept the lamp burning through the longest winter anyone could remember."
)
CODE = (
    "def merge(a, b):\n    out = []\n    i = j = 0\n    while i < len(a) and j < len(b):\n"
    "        if a[i] <= b[j]:\n            out.append(a[i])\n            i += 1\n"
    "        else:\n            out.append(b[j])\n            j += 1\n"
    "    out.extend(a[i:])\n    out.extend(b[j:])\n    return out\n"
)
PROMPTS = {
    "copy-prose": f"Repeat this text exactly, without any comment:\n\n{PARAGRAPH}",
    "copy-code": f"Rename the function merge to merge_sorted and repeat the code:\n\n{CODE}",
    "free": "Write a short story about a robot who learns to paint.",
}


def make_runner(engine_dir: Path | None, hf_dir: Path | None) -> tuple[Any, Any, Any]:
    from contract.manifest import read_manifest
    from contract.profile import BuildProfile
    from runtime.executors.torch import (
        TOKEN_BUCKET,
        runner_from_checkpoint,
        runner_from_engine,
    )
    from runtime.models.parallel import TPContext
    from runtime.store.files import EngineFiles

    if engine_dir is not None:
        m = read_manifest(engine_dir)
        if m.tp != 1:
            raise SystemExit(f"{engine_dir} is a TP={m.tp} engine; this benchmark runs TP=1")
        p = m.profile
        blocks = 4 * p.max_seq_len // p.tokens_per_block + 1
        runner, cfg = runner_from_engine(engine_dir, m.backend, m.dtype, TPContext(), blocks,
                                         p.tokens_per_block, p.max_num_tokens,
                                         files=EngineFiles(engine_dir, m))
        label = f"{m.backend} {m.dtype} engine {m.engine_id}"
    else:
        assert hf_dir is not None
        p = BuildProfile(max_batch_size=4)
        blocks = 4 * p.max_seq_len // p.tokens_per_block + 1
        runner, cfg = runner_from_checkpoint(hf_dir, TPContext(), "bfloat16", blocks,
                                             p.tokens_per_block)
        label = "eager bfloat16 from the checkpoint"
        # As an engine runs it (engine_runner): prompt steps padded to the token bucket.
        runner.token_bucket, runner.max_tokens = TOKEN_BUCKET, p.max_num_tokens
    return runner, (cfg, p, blocks), label


def engine_for(runner: Any, setup: Any, k: int) -> Any:
    from contract.speculative import Speculative
    from runtime.core.scheduler import SchedulerConfig
    from runtime.executors.loop import LLMEngine

    cfg, p, blocks = setup
    sc = SchedulerConfig(p.max_batch_size, p.max_num_tokens, p.tokens_per_block, blocks,
                         p.max_seq_len, cfg.eos_token_ids, enable_prefix_caching=False,
                         speculative=Speculative("ngram", k) if k else None)
    return LLMEngine(runner, sc)


def one(runner: Any, setup: Any, k: int, prompt: list[int], new_tokens: int,
        temperature: float = 0.0) -> tuple[list[int], float, dict[str, float]]:
    from runtime.core.types import SamplingParams

    engine = engine_for(runner, setup, k)
    params = SamplingParams(max_tokens=new_tokens, temperature=temperature,
                            seed=0 if temperature else None)
    t = time.perf_counter()
    (out,) = engine.generate([prompt], [params])
    return out, time.perf_counter() - t, engine.stats().extra


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--engine", type=Path, default=None, help="a built TP=1 engine")
    ap.add_argument("--hf-dir", type=Path, default=None, help="default: python -m demo.model")
    ap.add_argument("--k", type=int, nargs="+", default=[4, 6])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=160)
    ap.add_argument("--prompts", nargs="+", choices=sorted(PROMPTS), default=list(PROMPTS))
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="0: greedy (default); else sampled with seed 0")
    args = ap.parse_args(argv)
    from bench.common import demo_checkpoint
    from bench.prompts import load_tokenizer

    hf_dir = args.hf_dir or demo_checkpoint()
    tok = load_tokenizer(hf_dir)
    runner, setup, label = make_runner(args.engine, None if args.engine else hf_dir)
    prompts = {name: list(tok(tok.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False),
        add_special_tokens=False)["input_ids"]) for name, text in PROMPTS.items()
        if name in args.prompts}
    one(runner, setup, 0, next(iter(prompts.values())), 8)  # warm the allocator, thread pool and kernels
    ks = [0, *args.k]
    secs: dict[tuple[str, int], list[float]] = {}
    outs: dict[tuple[str, int], list[int]] = {}
    accept: dict[tuple[str, int], tuple[float, float]] = {}
    for r in range(args.rounds):
        for name, ids in prompts.items():
            for k in ks:
                out, s, extra = one(runner, setup, k, list(ids), args.new_tokens,
                                    args.temperature)
                secs.setdefault((name, k), []).append(s)
                if outs.setdefault((name, k), out) != out:
                    raise RuntimeError(f"{name} K={k}: output changed between rounds")
                accept[(name, k)] = (extra.get("spec_decode_num_draft_tokens_total", 0.0),
                                     extra.get("spec_decode_num_accepted_tokens_total", 0.0))
                print(f"round {r} {name} K={k}: {len(out)} tokens {len(out) / s:.1f} tok/s",
                      flush=True)
    rows = []
    for name, ids in prompts.items():
        base = outs[(name, 0)]
        base_rate = len(base) / statistics.median(secs[(name, 0)])
        for k in ks:
            out = outs[(name, k)]
            rate = len(out) / statistics.median(secs[(name, k)])
            drafted, accepted = accept[(name, k)]
            rows.append([name, len(ids), "off" if not k else f"ngram:{k}", len(out),
                         f"{rate:.1f}", f"{rate / base_rate:.2f}x",
                         f"{accepted / drafted:.2f}" if drafted else "-",
                         "-" if args.temperature else "yes" if out == base else "NO"])
    info = machine_info()
    mode = f"temperature {args.temperature}, seed 0" if args.temperature else "greedy"
    print(f"\n{label}; c=1, {mode}, median of {args.rounds} rounds; {info}\n")
    print("\n".join(md_table(["prompt", "prompt tokens", "speculative", "output tokens",
                              "tok/s", "vs off", "accepted/drafted", "same output"], rows)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
