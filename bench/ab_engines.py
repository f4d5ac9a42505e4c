"""Two TP=1 engines of one model, their steps side by side in one process.

    python -m bench.ab_engines --engines A_DIR B_DIR [--batches 1 16] [--prompts 128 512]
                               [--steps 64] [--context 128] [--rounds 6]

Why: this host is shared and noisy; a decode step of the same engine measured in separate
processes a minute apart moved by 10-15 % (SmolLM2-135M int4_wo, 2 cores, AMD EPYC Zen 5:
3.9 to 4.5 ms), more than the changes it is meant to judge. Here both engines are loaded once
(their weights side by side in memory, one kernels library: the first engine's) and measured
in alternating rounds, A then B, then B then A, so drift falls on both: per round, a decode
window of `--steps` steps at each batch (bench/profile.py's engine_level) and the time to the
first token of a `--prompts` prompt. Reported: each side's median and the median of the
per-round ratios B / A (below 1: B is faster). What this compares is the engines' programs
and weights; their kernels are the first engine's (load a library first to compare those).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import RESULTS, loadavg, md_table
from bench.profile import engine_level, scheduler_config
from contract.manifest import read_manifest
from runtime.core.types import SamplingParams
from runtime.dist.comm import Comm
from runtime.executors.loop import LLMEngine
from runtime.executors.torch import runner_from_engine
from runtime.models.parallel import TPContext
from runtime.store.files import EngineFiles


def load_engine(engine_dir: Path, comm: Comm) -> tuple[LLMEngine, int]:
    """An engine loop over a TP=1 engine's verified files, and its vocabulary size."""
    m = read_manifest(engine_dir)
    if m.tp != 1:
        raise SystemExit(f"error: {engine_dir} is a TP={m.tp} engine; this compares TP=1 engines")
    sc = scheduler_config(m.profile)
    runner, cfg = runner_from_engine(engine_dir, m.backend, m.dtype, TPContext(0, 1),
                                     sc.num_blocks, sc.block_size, sc.max_num_tokens,
                                     files=EngineFiles(engine_dir, m))
    return LLMEngine(runner, sc, comm), cfg.vocab_size


def first_token_ms(engine: LLMEngine, length: int, vocab: int, tag: str) -> float:
    """Steps from a `length`-token prompt's arrival to its first token, in ms (the scheduler
    keeps no prefix cache: the same prompt again is computed again)."""
    done: list[bool] = []
    engine.add_request(tag, [(7 * i) % vocab for i in range(length)],
                       SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
                       lambda ev: done.append(True))
    t0 = time.perf_counter()
    while not done:
        engine.step()
    ms = (time.perf_counter() - t0) * 1e3
    while engine.step() is not None:  # the request's end
        pass
    return ms


def measure(engines: list[tuple[LLMEngine, int]], batches: list[int], prompts: list[int],
            steps: int, context: int, rounds: int) -> dict[str, dict[str, list[float]]]:
    """Per measure ("decode bN" ms a step, "prompt L" ms to the first token), per side, one
    value a round; the sides alternate their order round by round."""
    out: dict[str, dict[str, list[float]]] = {}
    for r in range(rounds + 1):  # round 0 warms both up and is not kept
        order = (0, 1) if r % 2 == 0 else (1, 0)
        for side in order:
            engine, vocab = engines[side]
            values: dict[str, float] = {}
            for b in batches:
                values[f"decode b{b} ms"] = engine_level(engine, b, context, steps, vocab)["ms_per_step"]
            for n in prompts:
                values[f"prompt {n} ms"] = first_token_ms(engine, n, vocab, f"r{r}s{side}")
            if r == 0:
                continue
            for k, v in values.items():
                out.setdefault(k, {"A": [], "B": []})["AB"[side]].append(v)
    return out


def summary(series: dict[str, dict[str, list[float]]]) -> list[list[str]]:
    rows = []
    for k, s in series.items():
        ratios = [b / a for a, b in zip(s["A"], s["B"])]
        rows.append([k, f"{statistics.median(s['A']):.3f}", f"{statistics.median(s['B']):.3f}",
                     f"{statistics.median(ratios):.3f}",
                     f"{min(ratios):.3f}-{max(ratios):.3f}"])
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.ab_engines", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", type=Path, nargs=2, required=True, metavar=("A", "B"))
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 16])
    ap.add_argument("--prompts", type=int, nargs="*", default=[128, 512])
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--threads", type=int, default=None, help="default: torch's own count")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.steps < 1:
        ap.error("--rounds and --steps must be at least 1")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    comm = Comm.from_mpi()
    comm.init_process_group("gloo")
    engines = [load_engine(d, comm) for d in args.engines]
    series = measure(engines, args.batches, args.prompts, args.steps, args.context, args.rounds)
    for engine, _ in engines:
        engine.shutdown_workers()
    report: dict[str, Any] = {"engines": [str(d) for d in args.engines], "rounds": args.rounds,
                              "threads": torch.get_num_threads(), "load": loadavg(),
                              "series": series}
    print(f"A {args.engines[0]}\nB {args.engines[1]}\n{torch.get_num_threads()} thread(s), "
          f"{args.rounds} rounds, load {report['load']}")
    print("\n".join(md_table(["measure", "A median", "B median", "B / A (median of rounds)",
                              "range"], summary(series))))
    out = args.out or RESULTS / time.strftime("%Y%m%d-%H%M%S") / "ab_engines.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"written {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
