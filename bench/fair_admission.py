"""Fair admission (issue #37 item 5), measured on a served engine over HTTP.

    python -m bench.fair_admission --engine ENGINE_DIR [--tp 1] [--rounds 5]

Two scenarios, each repeated `rounds` times on one server:
- behind a long prompt: a ~1,000-token prompt is sent, then 50 ms later a one-word prompt;
  the short request's time to first token (streamed) is reported, with the long one's.
- behind n=16: a request with n=16, ignore_eos, max_tokens=120 runs; once its siblings
  hold the batch, a one-token request is sent; its latency is reported.

Before and after in one run: the same engine is served twice at once (`before`:
`--max-prefill-tokens-while-waiting 0`, the cap off; `after`: the server's default, or
`--wait-cap N`), and the two take turns round by round, so that a noisy machine slows
both alike. Both log at DEBUG: the engine loop's step lines (runtime/executors/loop.py)
give, per long-prompt round, the step that admitted the short request, its tokens and
seconds. It prints JSON lines, one per configuration and scenario.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import signal
import statistics
import tempfile
import time
from itertools import pairwise
from pathlib import Path
from typing import Any

import openai

from bench.job import Job, launch, metric

CONFIGS = ("before", "after")
_QUEUED = re.compile(r"queued (\S+) as seq (\d+): (\d+) prompt tokens, before step (\d+)")
_STEP = re.compile(r"step (\d+): (\d+) tokens in ([0-9.]+) s \[([^\]]*)\]")


async def _ttft(client: Any, model: str, prompt: str, max_tokens: int, **extra: Any
                ) -> tuple[float, float]:
    """(seconds to the first token, seconds to the end) of one streamed completion."""
    t0 = time.monotonic()
    first = None
    stream = await client.completions.create(model=model, prompt=prompt,
                                             max_tokens=max_tokens, temperature=0.0,
                                             stream=True, extra_body=extra)
    async for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].text:
            first = time.monotonic() - t0
    end = time.monotonic() - t0
    return (first if first is not None else end), end


async def _long_prompt_round(client: Any, model: str, long_prompt: str) -> dict[str, float]:
    long_task = asyncio.create_task(_ttft(client, model, long_prompt, 8))
    await asyncio.sleep(0.05)
    short_first, _ = await _ttft(client, model, "Hello", 4)
    long_first, _ = await long_task
    return {"short_ttft_s": short_first, "long_ttft_s": long_first}


async def _n16_round(client: Any, model: str, job: Job) -> dict[str, float]:
    big = asyncio.create_task(client.completions.create(
        model=model, prompt="Once upon a time", max_tokens=120, n=16, temperature=0.8,
        extra_body={"ignore_eos": True}))
    t0 = time.monotonic()
    while (metric(job.metrics(), "llmserve_num_requests_running") or 0) < 16:
        await asyncio.sleep(0.02)
        if time.monotonic() - t0 > 60:
            raise RuntimeError("n=16 never filled the batch")
    _, short_end = await _ttft(client, model, "Hello", 1)
    t1 = time.monotonic()
    await big
    return {"one_token_latency_s": short_end, "n16_rest_s": time.monotonic() - t1}


def step_trace(log: str, long_min_tokens: int = 500) -> list[dict[str, Any]]:
    """Per long-prompt round, from the engine's DEBUG lines: the step the short request
    (queued right after a long prompt) was queued before and first scheduled in, that
    step's tokens and seconds, the long prompt's chunk in it, and the steps and seconds
    from the long prompt's queueing to the short one's first token."""
    queued = [(m.group(1), int(m.group(2)), int(m.group(3)), int(m.group(4)))
              for m in _QUEUED.finditer(log)]
    steps: dict[int, tuple[int, float, dict[int, str]]] = {}
    for m in _STEP.finditer(log):
        entries = dict((int(a), b) for a, _, b in
                       (e.partition(":") for e in m.group(4).split()))
        steps[int(m.group(1))] = (int(m.group(2)), float(m.group(3)), entries)
    out = []
    for (_, long_sid, long_n, long_at), (_, sid, n, at) in pairwise(queued):
        if long_n < long_min_tokens or n >= long_min_tokens:
            continue
        first = next((k for k in sorted(steps) if k >= at and sid in steps[k][2]), None)
        if first is None:
            continue
        tokens, seconds, entries = steps[first]
        out.append({
            "long_queued_before_step": long_at, "short_queued_before_step": at,
            "short_first_step": first, "step_tokens": tokens, "step_s": seconds,
            "long_chunk_in_it": entries.get(long_sid, "-"),
            "steps_long_queued_to_short_first": first - long_at + 1,
            "seconds_of_those_steps": round(sum(steps[k][1] for k in range(long_at, first + 1)
                                                if k in steps), 3),
            "chunks_before": [steps[k][2].get(long_sid, "-") for k in range(long_at, first)
                              if k in steps],
        })
    return out


async def _measure(args: argparse.Namespace, jobs: dict[str, Job]) -> None:
    """Every scenario's rounds, the configurations taking turns round by round: a noisy
    machine slows both alike (each server idles while the other runs its round)."""
    clients, models, caps = {}, {}, {}
    for name, job in jobs.items():
        job.wait_ready(timeout=300)
        clients[name] = openai.AsyncOpenAI(base_url=f"{job.base_url}/v1", api_key="unused",
                                           max_retries=0, timeout=600)
        models[name] = (await clients[name].models.list()).data[0].id
        await _ttft(clients[name], models[name], "warm up", 2)
        caps[name] = _caps(job.get_json("/v1/engine") or {})
    words = " ".join(f"word{i}" for i in range(args.long_words))
    for scenario in args.scenarios.split(","):
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in jobs}
        for r in range(args.rounds):
            for name, job in jobs.items():
                client, model = clients[name], models[name]
                if scenario == "long_prompt":
                    # Each round's long prompt starts differently: the prefix cache would
                    # otherwise serve every round after the first from the first's blocks.
                    result = await _long_prompt_round(
                        client, model, f"List {name} {r}. Summarize this list: {words}")
                else:
                    result = await _n16_round(client, model, job)
                runs[name].append(result)
        for name, job in jobs.items():
            summary = {k: round(statistics.median(x[k] for x in runs[name]), 3)
                       for k in runs[name][0]}
            line: dict[str, Any] = {"config": name, **caps[name], "scenario": scenario,
                                    "median": summary,
                                    "runs": [{k: round(v, 3) for k, v in x.items()}
                                             for x in runs[name]]}
            if scenario == "long_prompt":
                line["steps"] = step_trace(job.rank_log(0))
            print(json.dumps(line), flush=True)
    for client in clients.values():
        await client.close()


def _caps(report: Any) -> dict[str, Any]:
    """The prefill caps the server reports (/v1/engine's gate evidence)."""
    found: dict[str, Any] = {}

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                if k.startswith("max_prefill_tokens_while_"):
                    found[k] = v
                else:
                    walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(report)
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--long-words", type=int, default=275,
                    help="words in the long prompt (275: 996 tokens on SmolLM2)")
    ap.add_argument("--configs", default=",".join(CONFIGS),
                    help="before (--max-prefill-tokens-while-waiting 0), after (the default "
                    "or --wait-cap), comma-separated, served side by side, taking turns")
    ap.add_argument("--wait-cap", type=int, default=None,
                    help="--max-prefill-tokens-while-waiting for `after` (default: the "
                    "server's own)")
    ap.add_argument("--scenarios", default="long_prompt,n16")
    args = ap.parse_args()
    names = args.configs.split(",")
    if not names or any(name not in CONFIGS for name in names):
        raise SystemExit(f"--configs: a comma-separated list of {CONFIGS}")
    with tempfile.TemporaryDirectory() as tmp:
        jobs = {}
        try:
            for name in names:
                flags = ["--log-level", "debug"]  # the engine's step lines
                if name == "before":
                    flags += ["--max-prefill-tokens-while-waiting", "0"]
                elif args.wait_cap is not None:
                    flags += ["--max-prefill-tokens-while-waiting", str(args.wait_cap)]
                jobs[name] = launch(Path(args.engine), Path(tmp) / name, args.tp, flags)
            asyncio.run(_measure(args, jobs))
        finally:
            for job in jobs.values():
                job.signal_launcher(signal.SIGTERM)  # drain, then whatever is left
            for job in jobs.values():
                if not job.wait_gone(60):
                    job.kill_all()

if __name__ == "__main__":
    main()
