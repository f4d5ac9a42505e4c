"""Issue #36, served: speculation off and on, ours at TP=1 and TP=2 and llama-server with
its own draft model, the same weights and prompts, in one run over HTTP.

    python -m bench.spec_served [--k 4] [--concurrency 1 16] [--rounds 3] [--max-tokens 64]
                                [--systems ours-tp1 ours-tp2 llama-server] [--no-draft]

Every system serves the demo checkpoint in bfloat16: ours from `pipeline build` (TP=1 and
TP=2 engines), llama-server from the same checkpoint's bf16 GGUF (`bash bench/peers.sh
STEP` for STEP in llama, gguf, quant). Modes per system, each a server of its own on the same engine:
- ours: `--speculative off`, `ngram:K` (prompt lookup, the adaptive policy) and, at TP=1,
  `draft:INT4:K` (the same model's int4_wo engine drafting, built here);
- llama-server: no speculation; `--spec-type ngram-simple` (llama.cpp's prompt lookup, its
  defaults: a 12-token match, drafts of up to 48); and `--spec-type draft-simple -md <Q4_0
  GGUF> --spec-draft-n-max K` (llama.cpp's draft model: the Q4_0 of the same checkpoint
  drafting for its bf16, the same pairing as ours).
Prompts: bench/spec_decode.py's sets (`copy`: answers that copy their prompt; `free`: free
generation), chat template applied here and sent as token ids to /v1/completions, greedy,
streamed, up to --max-tokens, stopping at the model's end of turn. At concurrency c, c
requests run at once until a set's requests are done (at c=16 the set is cycled to 16);
tok/s is the output tokens over the wall time of the set. A system's modes are served at
once (the idle ones take no CPU) and measured in turn, the order rotated each round; the
median of the rounds is reported. Each mode's outputs must equal
its system's `off` outputs token for token (a difference is reported, and fails the run).
Writes bench/results/<stamp>-spec-served/spec-served.{md,json,png}.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from bench import common, systems
from bench.loadgen import LoadSpec, run_load
from bench.prompts import load_tokenizer
from bench.servers import ServerSpec, llama_spec, ours_spec, serve
from bench.spec_decode import set_prompts


def modes_for(system: str, k: int, draft_engine: Path | None, draft_gguf: Path | None
              ) -> list[tuple[str, tuple[str, ...]]]:
    """(mode label, extra server argv) of each mode of a system."""
    if system.startswith("ours"):
        out = [("off", ("--speculative", "off")), (f"ngram:{k}", ("--speculative", f"ngram:{k}"))]
        if system == "ours-tp1" and draft_engine is not None:
            out.append((f"draft int4:{k}", ("--speculative", f"draft:{draft_engine}:{k}")))
        return out
    out = [("off", ()), ("ngram-simple", ("--spec-type", "ngram-simple"))]
    if draft_gguf is not None:
        out.append((f"draft Q4_0:{k}", ("--spec-type", "draft-simple", "-md", str(draft_gguf),
                                        "--spec-draft-n-max", str(k), "--spec-draft-n-min", "0")))
    return out


def run_set(url: str, prompts: list[list[int]], c: int, max_tokens: int
            ) -> tuple[float, int, list[str]]:
    n = max(c, len(prompts))
    results, s = run_load(LoadSpec(base_url=url, prompts=prompts, max_tokens=max_tokens,
                                   concurrency=c, num_requests=n))
    bad = [r.error for r in results if not r.ok]
    if bad:
        raise RuntimeError(f"{len(bad)} requests failed: {bad[0]}")
    tokens = sum(r.output_tokens for r in results)
    return tokens / s.wall_s, tokens, [r.text for r in results]


def chart(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["set"], r["concurrency"]) for r in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4.2), squeeze=False)
    for ax, (name, c) in zip(axes[0], panels, strict=True):
        sel = [r for r in rows if (r["set"], r["concurrency"]) == (name, c)]
        labels = [f"{r['system']}\n{r['mode']}" for r in sel]
        ax.bar(range(len(sel)), [r["tok_s"] for r in sel],
               color=["#888" if r["mode"] == "off" else "#2a7" for r in sel])
        ax.set_xticks(range(len(sel)), labels, rotation=60, ha="right", fontsize=7)
        ax.set_title(f"{name}, c={c}")
        ax.set_ylabel("output tok/s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--systems", nargs="+", default=["ours-tp1", "ours-tp2", "llama-server"],
                    choices=["ours-tp1", "ours-tp2", "llama-server"])
    ap.add_argument("--no-draft", action="store_true", help="skip the draft-model modes")
    args = ap.parse_args(argv)
    hf_dir = common.demo_checkpoint()

    engines = {f"ours-tp{tp}": systems.build_engine(common.sh, hf_dir, tp) for tp in (1, 2)
               if f"ours-tp{tp}" in args.systems}
    draft_engine = None if args.no_draft else systems.build_engine(common.sh, hf_dir, 1, "int4_wo")
    gguf = common.gguf_for(hf_dir)
    draft_gguf = None if args.no_draft else systems.quant_gguf(hf_dir, "Q4_0")
    if "llama-server" in args.systems:
        for need in (common.llama_server_bin(), gguf, *([draft_gguf] if draft_gguf else [])):
            if not need.exists():
                raise SystemExit(f"error: {need} is missing: run `bash bench/peers.sh STEP` "
                                 "for STEP in llama, gguf, quant")
    sets = set_prompts(load_tokenizer(hf_dir), ["copy", "free"])
    out = common.RESULTS / (datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ") + "-spec-served")
    out.mkdir(parents=True)
    secs: dict[tuple[str, str, str, int], list[float]] = {}
    texts: dict[tuple[str, str, str, int], list[str]] = {}
    tokens: dict[tuple[str, str, str, int], int] = {}
    commands: dict[str, str] = {}
    for system in args.systems:
        modes = modes_for(system, args.k, draft_engine, draft_gguf)
        with contextlib.ExitStack() as stack:
            # Every mode's server of the system up at once, idle but for the one measured,
            # and the modes rotated round by round: the machine's drift spreads over all.
            urls: dict[str, str] = {}
            for mode, extra in modes:
                port = common.free_port()
                spec: ServerSpec = (ours_spec(engines[system], port, int(system[-1]), "auto",
                                              system)
                                    if system.startswith("ours")
                                    else llama_spec(gguf, port, threads=2))
                spec = dataclasses.replace(spec, argv=(*spec.argv, *extra),
                                           name=f"{system} {mode}")
                commands[spec.name] = spec.command
                urls[mode] = stack.enter_context(serve(spec, out / "logs")).spec.base_url
                run_set(urls[mode], sets["free"][:2], 2, 16)  # warm: a batch of two
            names = [m for m, _ in modes]
            for r in range(args.rounds):
                for name, prompts in sets.items():
                    for c in args.concurrency:
                        for mode in names[r % len(names):] + names[:r % len(names)]:
                            rate, n, txt = run_set(urls[mode], prompts, c, args.max_tokens)
                            key = (system, mode, name, c)
                            secs.setdefault(key, []).append(n / rate)
                            tokens[key] = n
                            if texts.setdefault(key, txt) != txt:
                                print(f"warning: {key}: output changed between rounds")
                            print(f"round {r} {system} {mode} {name} c={c}: {n} tokens "
                                  f"{rate:.1f} tok/s (load {common.loadavg()})", flush=True)
    rows = []
    for (system, mode, name, c), s in secs.items():
        base = (system, "off", name, c)
        rate = tokens[(system, mode, name, c)] / statistics.median(s)
        base_rate = tokens[base] / statistics.median(secs[base])
        rows.append({"system": system, "mode": mode, "set": name, "concurrency": c,
                     "tok_s": rate, "vs_off": rate / base_rate, "seconds": s,
                     "output_tokens": tokens[(system, mode, name, c)],
                     "same_output": texts[(system, mode, name, c)] == texts[base]})
    rows.sort(key=lambda r: (r["set"], r["concurrency"], r["system"]))
    table = common.md_table(
        ["set", "c", "system", "mode", "tok/s", "vs off", "tokens", "same output as off"],
        [[r["set"], r["concurrency"], r["system"], r["mode"], f"{r['tok_s']:.1f}",
          f"{r['vs_off']:.2f}x", r["output_tokens"], "yes" if r["same_output"] else "NO"]
         for r in rows])
    from contract.target import cpu_isa_level
    from runtime.host import cpu_flags

    info = {**common.machine_info(), "isa": cpu_isa_level(cpu_flags())}
    text = "\n".join([
        f"# Speculative decoding, served ({out.name})", "",
        f"Machine: {info.get('cpu', '?')} ({info.get('isa', '?')}); load {common.loadavg()}. "
        f"{args.rounds} rounds, median; greedy, up to {args.max_tokens} tokens, K={args.k}.", "",
        *table, "", "Commands:", "", *[f"- {k}: `{v}`" for k, v in commands.items()]])
    (out / "spec-served.md").write_text(text + "\n")
    (out / "spec-served.json").write_text(json.dumps({"rows": rows, "commands": commands,
                                                      "machine": info}, indent=1))
    chart(rows, out / "spec-served.png")
    print(text)
    print(f"wrote {out}")
    differ = [r for r in rows if not r["same_output"] and r["system"].startswith("ours")]
    return 1 if differ else 0


if __name__ == "__main__":
    raise SystemExit(main())
