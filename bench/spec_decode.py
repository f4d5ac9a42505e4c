"""Issue #36's measurement: speculative decoding (n-gram prompt lookup) on and off, in one
run, on one engine, in process (no HTTP), batched through the engine loop:

    python -m bench.spec_decode --engine DIR [--k 4] [--rounds 3] [--new-tokens 64]
                                [--concurrency 1 16] [--sets copy free] [--out DIR]
    python -m bench.spec_decode --engine DIR --profile   # where a verify step's time goes
    make bench-spec   # --build --out bench/results/latest (spec.md, spec.png, spec.json)
    python -m bench.spec_decode --hf-dir DIR   # the eager path, from a checkpoint

Two prompt sets, chat template, greedy with the model's own stop tokens: `copy` (answers
that copy their prompt: "Repeat this text exactly: ...") and `free` (free generation:
stories, explanations, lists). At concurrency c, c requests of the set (cycled) are
submitted at once and the engine loop steps until all finish. Each round runs every
(set, c) with speculation off, ngram:K with a fixed K (the policy before issue #36 item 4)
and ngram:K adaptive (SchedulerConfig.spec_adaptive), the order rotated round by round so
that the machine's drift spreads over all three; outputs must be identical token for
token, and tokens/s is the output tokens over the seconds of the whole batch (prefill
included). Prints a markdown table; with --out also writes spec.json, spec.md and the
chart spec.png there (`make bench-spec`).

--profile runs the copy prompt (every draft accepted, so every decode step verifies K) at
batch sizes 1..16 and K 0..K, and reports the median decode step in ms: the figures the
adaptive policy's cost model and SchedulerConfig.spec_max_batch_size come from.
"""

from __future__ import annotations

import argparse
import json
import os
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
FREE = (
    "Write a short story about a robot who learns to paint.",
    "Explain why the sky is blue to a ten-year-old.",
    "Give three tips for learning a new language.",
    "Describe a day in the life of a lighthouse keeper.",
    "What are the benefits of regular exercise?",
    "Write a poem about the sea in winter.",
    "How does a bicycle stay upright?",
    "Suggest a plan for a weekend trip to the mountains.",
)
SETS = {
    "copy": (PROMPTS["copy-prose"], PROMPTS["copy-code"]),
    "free": FREE,
}
MODES = ("off", "fixed", "adaptive")
# Fixed K is measured up to this concurrency only: at c=16 its verify steps take seconds
# each on 2 cores (--profile: B=8, K=1 ran 3.6 s a step), which would make the run far
# longer than a bench's few minutes, and the profile already shows it does not pay there.
FIXED_MAX_CONCURRENCY = 4


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


def engine_for(runner: Any, setup: Any, k: int, adaptive: bool = True,
               max_batch: int | None = None) -> Any:
    from contract.speculative import Speculative
    from runtime.core.scheduler import SchedulerConfig
    from runtime.executors.loop import LLMEngine

    cfg, p, blocks = setup
    extra = {} if max_batch is None else {"spec_max_batch_size": max_batch}
    sc = SchedulerConfig(p.max_batch_size, p.max_num_tokens, p.tokens_per_block, blocks,
                         p.max_seq_len, cfg.eos_token_ids, enable_prefix_caching=False,
                         speculative=Speculative("ngram", k) if k else None,
                         spec_adaptive=adaptive, **extra)  # type: ignore[arg-type]
    return LLMEngine(runner, sc)


def batch(engine: Any, prompts: list[list[int]], new_tokens: int,
          steps: list[tuple[int, int, int, float]] | None = None
          ) -> tuple[list[list[int]], float]:
    """All prompts at once through the engine loop, to the end; with `steps`, each step's
    (sequences, tokens, draft tokens, seconds) is appended to it."""
    from runtime.core.types import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0.0)
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}

    def cb(ev: Any) -> None:
        out[ev.request_id].extend(ev.token_ids)

    t = time.perf_counter()
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), list(ids), params, cb)
    while engine.num_unfinished():
        t0 = time.perf_counter()
        plan = engine.step()
        if steps is not None and plan is not None:
            steps.append((len(plan.scheduled), plan.num_tokens, plan.num_draft_rows,
                          time.perf_counter() - t0))
    return [out[str(i)] for i in range(len(prompts))], time.perf_counter() - t


def one(runner: Any, setup: Any, k: int, prompt: list[int], new_tokens: int
        ) -> tuple[list[int], float, dict[str, float]]:
    engine = engine_for(runner, setup, k)
    (out,), secs = batch(engine, [prompt], new_tokens)
    return out, secs, engine.stats().extra


def profile(runner: Any, setup: Any, prompt: list[int], ks: list[int],
            sizes: tuple[int, ...] = (1, 2, 4, 8, 16), new_tokens: int = 24) -> list[list[str]]:
    """Median decode-step time at batch size B with every sequence verifying K drafts (the
    copy prompt: all accepted), fixed K (no adaptive policy, no batch threshold)."""
    rows = []
    base: dict[int, float] = {}
    for b in sizes:
        for k in [0, *ks]:
            steps: list[tuple[int, int, int, float]] = []
            engine = engine_for(runner, setup, k, adaptive=False)
            batch(engine, [prompt] * b, new_tokens, steps)
            # steady decode steps: every sequence in the step, each with 1 + K tokens
            times = [s for n, t, d, s in steps if n == b and t == b * (k + 1) and d == b * k]
            if not times:
                continue
            ms = 1000 * statistics.median(times)
            base.setdefault(b, ms)
            rows.append([str(b), str(k), str(len(times)), f"{ms:.1f}", f"{ms / base[b]:.2f}",
                         f"{b * (k + 1) / ms * 1000:.0f}",
                         f"{(b * (k + 1) / ms) / (b / base[b]):.2f}x"])
            print(f"profile B={b} K={k}: {ms:.1f} ms/step over {len(times)} steps", flush=True)
    return rows


def set_prompts(tok: Any, names: list[str]) -> dict[str, list[list[int]]]:
    def ids(text: str) -> list[int]:
        return list(tok(tok.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False),
            add_special_tokens=False)["input_ids"])
    return {name: [ids(t) for t in SETS[name]] for name in names}


def measure(runner: Any, setup: Any, sets: dict[str, list[list[int]]], k: int,
            concurrency: list[int], rounds: int, new_tokens: int,
            modes: tuple[str, ...] = MODES) -> list[dict[str, Any]]:
    """Every (set, c) with speculation off, fixed and adaptive, interleaved round by round."""
    work = [(name, c) for name in sets for c in concurrency]
    secs: dict[tuple[str, int, str], list[float]] = {}
    outs: dict[tuple[str, int, str], list[list[int]]] = {}
    extra: dict[tuple[str, int, str], dict[str, float]] = {}
    for r in range(rounds):
        for name, c in work:
            prompts = [sets[name][i % len(sets[name])] for i in range(c)]
            n_modes = len(modes)
            order = modes[r % n_modes:] + modes[:r % n_modes]  # rotated: drift spreads out
            for mode in order:
                if mode == "fixed" and c > FIXED_MAX_CONCURRENCY:
                    continue
                engine = engine_for(runner, setup, 0 if mode == "off" else k,
                                    adaptive=mode == "adaptive")
                out, s = batch(engine, prompts, new_tokens)
                key = (name, c, mode)
                secs.setdefault(key, []).append(s)
                if outs.setdefault(key, out) != out:
                    raise RuntimeError(f"{key}: output changed between rounds")
                extra[key] = dict(engine.stats().extra)
                n = sum(map(len, out))
                print(f"round {r} {name} c={c} {mode}: {n} tokens {n / s:.1f} tok/s "
                      f"(load {os.getloadavg()[0]:.2f})", flush=True)
    rows = []
    for name, c in work:
        base = outs[(name, c, "off")]
        base_rate = sum(map(len, base)) / statistics.median(secs[(name, c, "off")])
        for mode in modes:
            key = (name, c, mode)
            if key not in secs:
                continue
            n = sum(map(len, outs[key]))
            rate = n / statistics.median(secs[key])
            ex = extra[key]
            drafted = ex.get("spec_decode_num_draft_tokens_total", 0.0)
            rows.append({
                "set": name, "concurrency": c, "mode": mode if mode == "off" else
                f"ngram:{k} {mode}", "output_tokens": n, "tok_s": rate,
                "vs_off": rate / base_rate, "seconds": secs[key],
                "drafted": drafted,
                "accepted": ex.get("spec_decode_num_accepted_tokens_total", 0.0),
                "drafts": ex.get("spec_decode_num_drafts_total", 0.0),
                "same_output": outs[key] == base})
    return rows


def table(rows: list[dict[str, Any]]) -> list[str]:
    return md_table(["set", "c", "speculative", "output tokens", "tok/s", "vs off",
                     "accepted/drafted", "verify steps", "same output"],
                    [[r["set"], r["concurrency"], r["mode"], r["output_tokens"],
                      f"{r['tok_s']:.1f}", f"{r['vs_off']:.2f}x",
                      f"{r['accepted'] / r['drafted']:.2f}" if r["drafted"] else "-",
                      int(r["drafts"]) or "-", "yes" if r["same_output"] else "NO"]
                     for r in rows])


def write(out: Path, label: str, args: argparse.Namespace, rows: list[dict[str, Any]],
          prof: list[list[str]], load: tuple[str, str]) -> None:
    from bench import charts

    out.mkdir(parents=True, exist_ok=True)
    info = machine_info()
    (out / "spec.json").write_text(json.dumps({
        "engine": label, "k": args.k, "rounds": args.rounds, "new_tokens": args.new_tokens,
        "machine": info, "load_before": load[0], "load_after": load[1], "rows": rows,
        "profile": prof}, indent=1))
    charts.spec_decode(rows, out / "spec.png")
    lines = [f"# Speculative decoding on and off ({label})", "",
             f"n-gram prompt lookup, K={args.k}; greedy, {args.new_tokens} new tokens per "
             f"request, median of {args.rounds} interleaved rounds; {info}; load average "
             f"before {load[0]}, after {load[1]}.", "", *table(rows), "", "![](spec.png)"]
    if prof:
        lines += ["", "## Decode step by batch size and K (every draft accepted)", "",
                  *profile_table(prof)]
    (out / "spec.md").write_text("\n".join(lines) + "\n")


def profile_table(prof: list[list[str]]) -> list[str]:
    return md_table(["batch", "K", "steps", "ms/step", "vs K=0", "tokens/s if all accepted",
                     "vs K=0"], prof)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--engine", type=Path, default=None, help="a built TP=1 engine")
    ap.add_argument("--hf-dir", type=Path, default=None, help="default: python -m demo.model")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--sets", nargs="+", choices=sorted(SETS), default=list(SETS))
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                    help="off is always run (the reference)")
    ap.add_argument("--profile", action="store_true", help="decode step time by batch and K")
    ap.add_argument("--build", action="store_true",
                    help="build (or reuse) the TP=1 aoti bf16 demo engine in engines/")
    ap.add_argument("--out", type=Path, default=None, help="write spec.json, spec.md, spec.png")
    args = ap.parse_args(argv)
    from bench.common import demo_checkpoint
    from bench.prompts import load_tokenizer

    hf_dir = args.hf_dir or demo_checkpoint()
    tok = load_tokenizer(hf_dir)
    if args.build:  # `make bench-spec`: the demo engine, TP=1 aoti bf16 (a cache hit when built)
        from bench.common import REPO
        from bench.job import build_demo_engine

        args.engine = build_demo_engine(REPO / "engines", 1, (), "aoti")
    runner, setup, label = make_runner(args.engine, None if args.engine else hf_dir)
    sets = set_prompts(tok, ["copy"] if args.profile else args.sets)
    load_before = f"{os.getloadavg()[0]:.2f}"
    one(runner, setup, 0, sets["copy" if args.profile else args.sets[0]][0], 8)  # warm up
    if args.profile:
        ks = sorted({1, 2, args.k})
        prof = profile(runner, setup, sets["copy"][0], ks)
        print(f"\n{label}; {machine_info()}; load {load_before} -> "
              f"{os.getloadavg()[0]:.2f}\n")
        print("\n".join(profile_table(prof)))
        return 0
    modes = tuple(m for m in MODES if m == "off" or m in args.modes)
    rows = measure(runner, setup, sets, args.k, args.concurrency, args.rounds, args.new_tokens,
                   modes)
    load = (load_before, f"{os.getloadavg()[0]:.2f}")
    print(f"\n{label}; greedy, median of {args.rounds} rounds; {machine_info()}; "
          f"load {load[0]} -> {load[1]}\n")
    print("\n".join(table(rows)))
    if args.out is not None:
        write(args.out, label, args, rows, [], load)
        print(f"report: {args.out / 'spec.md'}")
    return 0 if all(r["same_output"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
