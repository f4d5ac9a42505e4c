"""Issue #36's draft-engine measurement: speculation off, n-gram prompt lookup and a draft
engine, in one run, on one engine, at concurrency 1, in process (no HTTP). The n-gram
policy's own measurement (adaptive K, c=16, the chart) is bench/spec_decode.py.

    python -m bench.spec_draft --engine DIR [--k 4 6] [--rounds 3] [--new-tokens 160]
    python -m bench.spec_draft --engine DIR --draft DRAFT_DIR [--draft-k 4]
    python -m bench.spec_draft --hf-dir DIR   # the eager path, from a checkpoint

With --draft (a TP=1 engine of the same tokenizer, e.g. the int4_wo build of the same
model), draft:K runs beside ngram:K; its drafter is loaded as the server loads it (files
verified, its own KV cache) and the table splits each step's time into the draft's
(catch-up plus K - 1 decodes) and the target's (the verify step).

Prompts whose answers copy their prompt ("Repeat this text exactly: ...", chat template)
and one of free generation. Each round runs every prompt with speculation off, then with
each K, on the same runner (the server's token bucket), greedy with the model's own stop
tokens; the outputs must be identical token for token, and tokens/s is the output tokens
over the seconds of the whole generate call (prefill included). Prints a markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from bench.common import machine_info, md_table
from bench.spec_decode import CODE, PARAGRAPH, make_runner

PROMPTS = {
    "copy-prose": f"Repeat this text exactly, without any comment:\n\n{PARAGRAPH}",
    "copy-code": f"Rename the function merge to merge_sorted and repeat the code:\n\n{CODE}",
    "free": "Write a short story about a robot who learns to paint.",
}


Mode = tuple[str, int]  # ("off", 0), ("ngram", K), ("draft", K)


def load_drafter(draft_dir: Path, k: int, setup: Any) -> Any:
    """The draft engine's drafter, as the serving job builds it (serve/backends/torch.py)."""
    from contract.speculative import Speculative
    from runtime.executors.draft import check_draft, load_draft, open_draft, vocab_hashes_of

    cfg, p, blocks = setup
    spec = Speculative("draft", k, engine=str(draft_dir))
    path, dm, dcfg = open_draft(spec)
    check_draft(dm, dcfg, path, k, device=dm.target.device, vocab_size=cfg.vocab_size,
                vocab=vocab_hashes_of(path))
    draft_blocks = (blocks - 1) * p.tokens_per_block // dm.profile.tokens_per_block + 8
    return load_draft(spec, path, dm, draft_blocks), spec


def engine_for(runner: Any, setup: Any, mode: Mode, draft: Any = None) -> Any:
    from contract.speculative import Speculative
    from runtime.core.scheduler import SchedulerConfig
    from runtime.executors.loop import LLMEngine

    cfg, p, blocks = setup
    method, k = mode
    drafter, spec = None, None
    if method == "ngram":
        spec = Speculative("ngram", k)
    elif method == "draft":
        drafter, spec = draft
    sc = SchedulerConfig(p.max_batch_size, p.max_num_tokens, p.tokens_per_block, blocks,
                         p.max_seq_len, cfg.eos_token_ids, enable_prefix_caching=False,
                         speculative=spec)
    return LLMEngine(runner, sc, drafter=drafter)


def one(runner: Any, setup: Any, mode: Mode, prompt: list[int], new_tokens: int,
        draft: Any = None) -> tuple[list[int], float, dict[str, float]]:
    from runtime.core.types import SamplingParams

    engine = engine_for(runner, setup, mode, draft)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0)
    drafter = draft[0] if draft and mode[0] == "draft" else None
    d0 = drafter.stats.seconds if drafter else 0.0
    t = time.perf_counter()
    (out,) = engine.generate([prompt], [params])
    seconds = time.perf_counter() - t
    extra = dict(engine.stats().extra)
    extra["steps"] = float(engine.stats().steps_total)
    extra["draft_seconds"] = drafter.stats.seconds - d0 if drafter else 0.0
    return out, seconds, extra


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--engine", type=Path, default=None, help="a built TP=1 engine")
    ap.add_argument("--hf-dir", type=Path, default=None, help="default: python -m demo.model")
    ap.add_argument("--k", type=int, nargs="+", default=[4, 6], help="ngram K values")
    ap.add_argument("--draft", type=Path, default=None,
                    help="a draft engine (TP=1, same tokenizer): adds draft:K")
    ap.add_argument("--draft-k", type=int, nargs="+", default=[4])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=160)
    ap.add_argument("--prompts", nargs="+", choices=sorted(PROMPTS), default=list(PROMPTS))
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
    modes: list[Mode] = [("off", 0), *(("ngram", k) for k in args.k)]
    drafts: dict[int, Any] = {}
    if args.draft is not None:
        for k in args.draft_k:
            drafts[k] = load_drafter(args.draft, k, setup)
            modes.append(("draft", k))
    first = next(iter(prompts.values()))
    for mode in modes:  # warm the allocator, thread pool and kernels (the draft's too)
        one(runner, setup, mode, first, 8, drafts.get(mode[1]))
    secs: dict[tuple[str, Mode], list[float]] = {}
    outs: dict[tuple[str, Mode], list[int]] = {}
    extras: dict[tuple[str, Mode], dict[str, float]] = {}
    for r in range(args.rounds):
        for name, ids in prompts.items():
            for mode in modes:
                out, s, extra = one(runner, setup, mode, list(ids), args.new_tokens,
                                    drafts.get(mode[1]))
                secs.setdefault((name, mode), []).append(s)
                if outs.setdefault((name, mode), out) != out:
                    raise RuntimeError(f"{name} {mode}: output changed between rounds")
                extras.setdefault((name, mode), extra)
                print(f"round {r} {name} {mode[0]}:{mode[1]}: {len(out)} tokens "
                      f"{len(out) / s:.1f} tok/s", flush=True)
    rows = []
    for name, ids in prompts.items():
        base = outs[(name, ("off", 0))]
        base_rate = len(base) / statistics.median(secs[(name, ("off", 0))])
        for mode in modes:
            out = outs[(name, mode)]
            sec = statistics.median(secs[(name, mode)])
            rate = len(out) / sec
            ex = extras[(name, mode)]
            drafted = ex.get("spec_decode_num_draft_tokens_total", 0.0)
            accepted = ex.get("spec_decode_num_accepted_tokens_total", 0.0)
            steps = ex["steps"]
            # Per step, of the first round's run: the draft's share, and the rest (the
            # target's step: prefill or verify, sampling and scheduling included).
            draft_ms = 1000 * ex["draft_seconds"] / steps
            step_ms = 1000 * (secs[(name, mode)][0] - ex["draft_seconds"]) / steps
            rows.append([name, len(ids), "off" if mode[0] == "off" else f"{mode[0]}:{mode[1]}",
                         len(out), f"{rate:.1f}", f"{rate / base_rate:.2f}x",
                         f"{accepted / drafted:.2f}" if drafted else "-",
                         f"{len(out) / steps:.2f}", f"{step_ms:.1f}",
                         f"{draft_ms:.1f}" if mode[0] == "draft" else "-",
                         "yes" if out == base else "NO"])
    info = machine_info()
    print(f"\n{label}; c=1, greedy, median of {args.rounds} rounds; {info}\n")
    print("\n".join(md_table(["prompt", "prompt tokens", "speculative", "output tokens",
                              "tok/s", "vs off", "accepted/drafted", "tokens/step",
                              "target ms/step", "draft ms/step", "same output"], rows)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
