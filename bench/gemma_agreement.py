"""Gemma 3 270M, our served engine against llama-server on the same Q4_K_M GGUF (issue 35.3).

    python -m bench.gemma_agreement [--tokens 2040] [--window 1020] [--top 20] [--tp 1 2]
                                    [--skip agreement kld throughput] [--engine-tp1 DIR]

1. Agreement, teacher-forced over a fixed text (Newton's *Opticks*, bench/quant_accuracy's
   text, cut into windows of `--window` tokens, each opened by <bos>): for every position,
   our engine's next-token distribution (one /v1/completions request per window with
   `echo`, `max_tokens` 0 and `logprobs` N: the prompt's top-N log-probabilities) against
   llama-server's (/completion with `n_probs` N, `post_sampling_probs` false: its plain
   softmax of the logits, one request per position over growing prefixes, `cache_prompt`
   and `--swa-full` so each evaluates one new token; llama-server 0.3.36's vendor tree has
   no prompt log-probabilities: its /v1/completions refuses `echo`). Reported: top-1
   agreement, and mean KL(llama.cpp || ours) over the tokens both top-N lists hold plus one
   bucket for the rest of each side's mass (see `topn_kl`: a lower bound of the full KL).
2. llama.cpp's own figures for its Q4_K_M against the float model: `llama-perplexity
   --kl-divergence-base` on a float GGUF of the dequantized weights, then `--kl-divergence`
   on the Q4_K_M (bench/llama_kld.py).
3. Served throughput at c=1 and c=16, ours (TP=1, TP=2) and llama-server on the GGUF, in
   this run (bench/phases.sweep, bench/loadgen), with a chart.

Writes bench/results/<stamp>/gemma3.{md,json,png} and copies them to bench/results/latest/.
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import re
import shutil
import subprocess
import sys
import time
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import asdict, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from bench import common

TOP_N = 20  # our server's most (MAX_LOGPROBS); llama-server's n_probs the same
TARGET_TOP1, TARGET_KL = 0.95, 0.02  # issue 35's
LEVELS, REQUESTS = (1, 16), (4, 32)
KLD_CTX, KLD_CHUNKS = 1024, 4  # llama-perplexity: 4 chunks of 1024, second halves scored
REMAINDER_FLOOR = 1e-12  # a side whose listed tokens hold all its mass: its bucket's floor


# ---- the measure (pure) -----------------------------------------------------------------


def topn_kl(ref: Mapping[int, float], other: Mapping[int, float]) -> float:
    """KL(ref || other) of two next-token distributions known only by their top-N lists
    (token id -> log-probability), coarse-grained to the same buckets on both sides: one
    bucket per token both lists hold, and one for everything else (each side's remaining
    mass, 1 - its listed mass). Coarse-graining never raises KL (the data-processing
    inequality), so this is a lower bound of the full-vocabulary KL, equal to it when the
    listed tokens hold (nearly) all of both sides' mass."""
    shared = ref.keys() & other.keys()
    kl = sum(math.exp(ref[t]) * (ref[t] - other[t]) for t in shared)
    p_rest = max(1.0 - sum(math.exp(ref[t]) for t in shared), 0.0)
    q_rest = max(1.0 - sum(math.exp(other[t]) for t in shared), REMAINDER_FLOOR)
    if p_rest > 0.0:
        kl += p_rest * (math.log(p_rest) - math.log(q_rest))
    return max(kl, 0.0)  # rounding in the log-probabilities can leave -1e-9


def top1(lps: Mapping[int, float]) -> int:
    return max(lps, key=lambda t: lps[t])


def summarize(ref: Sequence[Mapping[int, float]], ours: Sequence[Mapping[int, float]]
              ) -> dict[str, float]:
    """Top-1 agreement, mean and max top-N KL, over positions both sides answered."""
    if len(ref) != len(ours) or not ref:
        raise ValueError(f"{len(ref)} reference positions against {len(ours)} of ours")
    kls = [topn_kl(r, o) for r, o in zip(ref, ours, strict=True)]
    agree = sum(top1(r) == top1(o) for r, o in zip(ref, ours, strict=True))
    covered = [sum(math.exp(v) for v in r.values()) for r in ref]
    return {"positions": len(ref), "top1_agreement": agree / len(ref),
            "mean_kl": sum(kls) / len(kls), "max_kl": max(kls),
            "p99_kl": sorted(kls)[min(len(kls) - 1, int(0.99 * len(kls)))],
            "ref_topn_mass_mean": sum(covered) / len(covered)}


# ---- the two sides ------------------------------------------------------------------------


def text_to_id(tokenizer: Any) -> dict[str, int | None]:
    """Our server names top_logprobs by token text (each token decoded alone, as
    serve/api/choices.TokenTexts does): text -> its token id. A byte-fallback token
    (`<0x49>`) decodes to the same text as the ordinary token of that character ('I'), and
    the server keeps the more probable of the two, which is the ordinary one: the text maps
    to it. Texts several ordinary tokens share (none in Gemma 3's vocabulary) map to None
    and are left out of the comparison."""
    n = len(tokenizer)
    texts = tokenizer.batch_decode([[i] for i in range(n)], skip_special_tokens=False,
                                   clean_up_tokenization_spaces=False)
    pieces = tokenizer.convert_ids_to_tokens(list(range(n)))
    return text_map(texts, [bool(_BYTE_PIECE.match(p or "")) for p in pieces])


_BYTE_PIECE = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")


def text_map(texts: Sequence[str], is_byte: Sequence[bool]) -> dict[str, int | None]:
    """text -> the one ordinary token id decoding to it (byte-fallback ids only where no
    ordinary token has the text); None where the text is ambiguous."""
    out: dict[str, int | None] = {}
    for i, text in enumerate(texts):
        if is_byte[i]:
            continue
        out[text] = None if text in out else i
    for i, text in enumerate(texts):
        if is_byte[i] and text not in out:
            out[text] = i
        elif is_byte[i] and out.get(text) is not None and is_byte[out[text]]:  # type: ignore[index]
            out[text] = None
    return out


def _post(conn: http.client.HTTPConnection, path: str, body: dict[str, Any]) -> Any:
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = resp.read()
    if resp.status != 200:
        raise RuntimeError(f"POST {path}: HTTP {resp.status}: {data[:300]!r}")
    return json.loads(data)


def ours_window(port: int, model: str, ids: Sequence[int], top: int,
                ids_of: Mapping[str, int | None]) -> list[dict[int, float]]:
    """Positions 1..len(ids)-1 of one window: our top-N log-probabilities by token id."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=900)
    try:
        r = _post(conn, "/v1/completions", {"model": model, "prompt": list(ids),
                                            "max_tokens": 0, "echo": True, "logprobs": top,
                                            "temperature": 0.0})  # fmt: skip
    finally:
        conn.close()
    tops = r["choices"][0]["logprobs"]["top_logprobs"]
    if len(tops) < len(ids) or tops[0] is not None:
        raise RuntimeError(f"echo gave {len(tops)} top_logprobs for {len(ids)} prompt tokens")
    out = []
    for entry in tops[1:len(ids)]:
        out.append({i: v for text, v in entry.items() if (i := ids_of.get(text)) is not None})
    return out


def llama_window(port: int, ids: Sequence[int], top: int) -> list[dict[int, float]]:
    """Positions 1..len(ids)-1: llama-server's top-N log-probabilities, one request per
    growing prefix (its prompt cache makes each evaluate only the new token)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    out = []
    try:
        for t in range(1, len(ids)):
            r = _post(conn, "/completion", {
                "prompt": list(ids[:t]), "n_predict": 1, "n_probs": top,
                "post_sampling_probs": False, "cache_prompt": True, "temperature": 0.0,
                "id_slot": 0})
            entry = r["completion_probabilities"][0]["top_logprobs"]
            out.append({int(e["id"]): float(e["logprob"]) for e in entry})
            if t % 200 == 0:
                print(f"  llama-server: {t} / {len(ids) - 1} positions", flush=True)
    finally:
        conn.close()
    return out


def windows(ids: Sequence[int], bos: int, tokens: int, window: int) -> list[list[int]]:
    """The text's first `tokens` ids cut into windows of `window`, each opened by <bos>."""
    ids = list(ids[:tokens])
    return [[bos, *ids[s:s + window]] for s in range(0, len(ids), window)]


# ---- the run ------------------------------------------------------------------------------


def llama_agreement_spec(gguf: Path, port: int, ctx: int, threads: int) -> Any:
    from bench.servers import ServerSpec

    argv = (str(common.llama_server_bin()), "-m", str(gguf), "-np", "1", "-c", str(ctx),
            "--swa-full", "-t", str(threads), "-tb", str(threads), "--host", "127.0.0.1",
            "--port", str(port))  # fmt: skip
    return ServerSpec("llama-server-agreement", argv, port, "/health")


def model_id(port: int) -> str:
    from bench.servers import get_json

    data = get_json(f"http://127.0.0.1:{port}/v1/models")
    if not data or not data.get("data"):
        raise RuntimeError("GET /v1/models listed no model")
    return str(data["data"][0]["id"])


def agreement(res: dict[str, Any], args: argparse.Namespace, gguf: Path, hf_dir: Path,
              engines: dict[int, Path], out: Path) -> None:
    """Every engine's side (TP=1's cached with --ours-positions), then llama-server's once;
    res["agreement"] is TP=1's (or the lowest TP's), res["agreement_tp"] each engine's."""
    from bench.prompts import load_tokenizer
    from bench.quant_accuracy import load_text
    from bench.servers import ours_spec, serve

    tok = load_tokenizer(hf_dir)
    text, source = load_text()
    ids = tok(text, add_special_tokens=False)["input_ids"]
    wins = windows(ids, int(tok.bos_token_id), args.tokens, args.window)
    ids_of = text_to_id(tok)
    res["agreement_text"] = {**source, "tokens": sum(len(w) - 1 for w in wins),
                             "windows": len(wins), "window": args.window}
    ours_tp: dict[int, list[dict[int, float]]] = {}
    for tp, engine in sorted(engines.items()):
        t0 = time.perf_counter()
        cache = args.ours_positions if tp == 1 else None
        if cache is not None and cache.exists():  # ours measured earlier (same text and engine)
            ours = [{int(k): v for k, v in d.items()} for d in json.loads(cache.read_text())]
            res["notes"].append(f"our side's positions read from {cache} (measured earlier)")
        else:
            spec = ours_spec(engine, common.free_port(), tp, "auto", f"ours-tp{tp}")
            with serve(spec, out / "logs") as s:
                port = s.spec.port
                ours = [p for w in wins for p in ours_window(port, model_id(port), w, args.top,
                                                             ids_of)]  # fmt: skip
            res["commands"].append(spec.command)
            if cache is not None:
                cache.write_text(json.dumps(ours))
        ours_tp[tp] = ours
        print(f"ours TP={tp}: {len(ours)} positions in {time.perf_counter() - t0:.0f} s",
              flush=True)
    if "llama" in args.skip_side or not ours_tp:
        return
    t0 = time.perf_counter()
    spec = llama_agreement_spec(gguf, common.free_port(), args.window + 16, args.threads)
    with serve(spec, out / "logs") as s:
        ref = [p for w in wins for p in llama_window(s.spec.port, w, args.top)]
    res["commands"].append(spec.command)
    print(f"llama-server: {len(ref)} positions in {time.perf_counter() - t0:.0f} s", flush=True)
    res["agreement_tp"] = {str(tp): summarize(ref, ours) for tp, ours in ours_tp.items()}
    res["agreement"] = res["agreement_tp"][str(min(ours_tp))]
    print(json.dumps(res["agreement_tp"]), flush=True)


def float_gguf(quantized: Path) -> Path:
    """The float GGUF llama-perplexity's KL base runs on (see bench/peers.sh `gemma3`)."""
    path = common.cache_dir() / "gguf" / "gemma-3-270m-f32.gguf"
    if not path.exists():
        raise SystemExit(f"error: {path} is missing — run `bash bench/peers.sh gemma3`")
    return path


def kld(res: dict[str, Any], args: argparse.Namespace, gguf: Path) -> None:
    from bench import llama_kld
    from bench.quant_accuracy import load_text

    text, _ = load_text()
    base = float_gguf(gguf)
    res["llama_perplexity"] = llama_kld.run(text, {"Q4_K_M": gguf}, KLD_CTX, args.threads,
                                            base=base, chunks=KLD_CHUNKS)


def throughput(res: dict[str, Any], args: argparse.Namespace, gguf: Path, hf_dir: Path,
               engines: dict[int, Path], out: Path) -> None:
    from bench import phases
    from bench.prompts import load_tokenizer
    from bench.servers import llama_spec, ours_spec, serve

    tok = load_tokenizer(hf_dir)
    wl = phases.Workload(max_tokens=args.max_tokens, levels=LEVELS, requests_per_level=REQUESTS)
    res["workload"] = asdict(wl)
    specs = [ours_spec(engines[tp], common.free_port(), tp, "auto", f"ours-tp{tp}")
             for tp in sorted(engines)]  # fmt: skip
    specs.append(llama_spec(gguf, common.free_port(), threads=args.threads))
    for spec in specs:
        entry: dict[str, Any] = {"command": spec.command, "loadavg_at_launch": common.loadavg()}
        res["commands"].append(spec.command)
        try:
            deadline = time.perf_counter() + args.budget
            spec = replace(spec, ready_timeout_s=min(spec.ready_timeout_s, args.budget))
            with serve(spec, out / "logs") as running:
                entry["ready_s"] = running.ready_s
                entry["sweep"], entry["cut"] = phases.sweep(running, wl, tok, deadline)
            entry["status"] = "ok"
        except Exception as exc:  # one failed system must not cost the others their numbers
            traceback.print_exc()
            entry["status"] = f"failed: {str(exc).splitlines()[0][:200] if str(exc) else exc!r}"
        res["systems"][spec.name] = entry


# ---- the report ---------------------------------------------------------------------------


def render(res: dict[str, Any], out: Path) -> str:
    m = res["machine"]
    lines = [
        "# Gemma 3 270M: our engine against llama-server on the same GGUF",
        "",
        f"Run {res['started_utc']} on {m['cpu']}, {m['cores']} cores, {m['memory']} "
        "(AVX-512 BF16; the 2 cores are shared with other work and noisy: load average "
        f"{res.get('loadavg_start', '?')} at the start). GGUF: `{res['gguf']}` (Q4_K_M: Q4_K, "
        "Q6_K, Q5_0 and Q8_0 blocks); our engines are built from it by `pipeline build` "
        "(dequantized exactly, then bfloat16: dense, not block-quantized). "
        "Made by `python -m bench.gemma_agreement`.",
        "",
    ]
    a = res.get("agreement")
    if a:
        t = res["agreement_text"]
        ok1, okk = a["top1_agreement"] >= TARGET_TOP1, a["mean_kl"] <= TARGET_KL
        lines += [
            "## Teacher-forced agreement with llama-server",
            "",
            f"{t['tokens']} positions: {t['work']} ({t['package']}, sha256 "
            f"{t['sha256'][:12]}...), {t['windows']} windows of {t['window']} tokens, each "
            "opened by `<bos>`. Ours: TP=1 aoti bfloat16 engine, one `/v1/completions` "
            "request per window with `echo`, `max_tokens` 0, `logprobs` "
            f"{res['top']}. llama-server: `/completion` with `n_probs` {res['top']}, "
            "`post_sampling_probs` false, one request per position over growing prefixes "
            "(`cache_prompt`, `--swa-full`).",
            "",
            *common.md_table(
                ["figure", "value", "target", "met"],
                [["top-1 agreement", f"{a['top1_agreement']:.2%}", f">= {TARGET_TOP1:.0%}",
                  "yes" if ok1 else "no"],
                 [f"mean KL(llama.cpp ‖ ours), top-{res['top']} + remainder bucket",
                  f"{a['mean_kl']:.5f}", f"<= {TARGET_KL}", "yes" if okk else "no"],
                 ["p99 / max KL", f"{a['p99_kl']:.4f} / {a['max_kl']:.4f}", "", ""],
                 [f"llama.cpp's top-{res['top']} mass (mean)", f"{a['ref_topn_mass_mean']:.4f}",
                  "", ""]]),
            "",
            *_by_tp(res),
            f"KL is over the tokens both top-{res['top']} lists hold, plus one bucket for "
            "the rest of each side's mass: a lower bound of the full-vocabulary KL (the "
            "coarse-graining can only lower it), tight when the lists hold most of the mass. "
            "Our server names its top tokens by text: a text maps to its ordinary token, not "
            "its byte-fallback twin (`<0x49>` also reads 'I').",
            "",
        ]
    elif "agreement_error" in res:
        lines += ["## Teacher-forced agreement with llama-server", "",
                  f"Not measured: {res['agreement_error']}", ""]
    lp = res.get("llama_perplexity")
    if lp:
        base = lp["base"]
        lines += [
            "## llama.cpp's own figures: its Q4_K_M against the float model",
            "",
            f"`llama-perplexity --kl-divergence-base` on `{Path(base['gguf']).name}` (the "
            f"Q4_K_M dequantized exactly to float32), then `--kl-divergence` on the Q4_K_M; "
            f"the same text, {lp['chunks']} chunks of {lp['ctx']} tokens, second halves "
            f"scored (llama.cpp's method). Float model perplexity: {base['perplexity']}.",
            "",
            *common.md_table(["GGUF", "mean KL vs float", "top-1 agreement", "perplexity"],
                             [[r["scheme"], r["mean_kl"], f"{r['top1_agreement_pct']} %",
                               r["perplexity"]] for r in lp["rows"]]),
            "",
        ]
    elif "kld_error" in res:
        lines += ["## llama.cpp's own figures", "", f"Not measured: {res['kld_error']}", ""]
    if res["systems"]:
        lines += ["## Served throughput", "",
                  f"Prompts of {res['workload']['prompt_len']} tokens, "
                  f"{res['workload']['max_tokens']} output tokens each (`ignore_eos`), "
                  "streamed; a warm pass of 16 at c=16 first; the load generator shares the "
                  "2 cores.", ""]
        rows = []
        for name, e in res["systems"].items():
            if e.get("status") != "ok":
                rows.append([name, e.get("status"), "", "", "", ""])
                continue
            for s in e["sweep"]:
                rows.append([name, s["concurrency"], f"{s['output_tok_s']:.1f}",
                             f"{s['ttft_p50_s'] * 1e3:.0f}", f"{s['itl_p50_s'] * 1e3:.1f}",
                             f"{s['errors']} / {s['foreign_cpu_share']:.0%}"])
        lines += common.md_table(["system", "c", "output tok/s", "TTFT p50 ms", "ITL p50 ms",
                                  "errors / other work"], rows)
        lines += ["", *_ratios(res), "", "![throughput](gemma3.png)", ""]
    lines += ["## Commands", "", *[f"    {c}" for c in res["commands"]], ""]
    if res["notes"]:
        lines += ["## Notes", "", *[f"- {n}" for n in res["notes"]], ""]
    text = "\n".join(lines)
    (out / "gemma3.md").write_text(text)
    return text


def _tok_s(res: dict[str, Any], name: str, c: int) -> float | None:
    e = res["systems"].get(name) or {}
    for s in e.get("sweep") or []:
        if s["concurrency"] == c:
            return float(s["output_tok_s"])
    return None


def _ratios(res: dict[str, Any]) -> list[str]:
    out = []
    for name in res["systems"]:
        if not name.startswith("ours"):
            continue
        for c in LEVELS:
            a, b = _tok_s(res, name, c), _tok_s(res, "llama-server", c)
            if a and b:
                out.append(f"- {name} / llama-server at c={c}: {a / b:.2f}x")
    return out


def chart(res: dict[str, Any], out: Path) -> None:
    from bench import charts

    series = {name: [(s["concurrency"], s["output_tok_s"]) for s in e.get("sweep") or []]
              for name, e in res["systems"].items()}  # fmt: skip
    if any(series.values()):
        charts.throughput(series, [], out / "gemma3.png")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gemma_agreement", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2040, help="scored positions (text tokens)")
    ap.add_argument("--window", type=int, default=1020,
                    help="text tokens per window (+ <bos> must fit the engine's max_seq_len)")
    ap.add_argument("--top", type=int, default=TOP_N)
    ap.add_argument("--tp", type=int, nargs="*", default=[1, 2])
    ap.add_argument("--engine-tp1", type=Path, default=None, help="default: pipeline build")
    ap.add_argument("--engine-tp2", type=Path, default=None, help="default: pipeline build")
    ap.add_argument("--skip", nargs="*", default=[], choices=("agreement", "kld", "throughput"))
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--budget", type=float, default=300.0, help="seconds per served system")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-latest", action="store_true")
    ap.add_argument("--ours-positions", type=Path, default=None,
                    help="our side's per-position top-N: read when the file exists, else "
                         "measured and written there")
    ap.add_argument("--skip-side", nargs="*", default=[], choices=("llama",),
                    help="agreement: measure our side only (with --ours-positions)")
    ap.add_argument("--merge", type=Path, nargs="*", default=[],
                    help="gemma3.json of earlier runs: their sections this run skips are kept")
    args = ap.parse_args(argv)

    from pipeline.resolve import resolve

    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out = common.RESULTS / stamp
    out.mkdir(parents=True, exist_ok=True)
    try:
        gguf = common.gemma3_gguf()
    except RuntimeError as exc:
        raise SystemExit(f"error: {exc}") from None
    hf_dir = resolve(str(gguf)).local_dir  # the build's own dequantization (a cache hit)
    res: dict[str, Any] = {"started_utc": stamp, "machine": common.machine_info(),
                           "loadavg_start": common.loadavg(), "gguf": gguf.name,
                           "top": args.top, "commands": [common.cmdline(
                               ["python", "-m", "bench.gemma_agreement", *(argv or sys.argv[1:])])],
                           "notes": [], "systems": {}}  # fmt: skip
    run = _Sh(res)
    given = {1: args.engine_tp1, 2: args.engine_tp2}
    engines: dict[int, Path] = {}
    for tp in sorted({1, *args.tp}):
        try:
            engines[tp] = given[tp] or _build(run, gguf, tp)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            res["notes"].append(f"TP={tp} engine build failed: {str(exc)[:300]}")
    if not common.llama_server_bin().exists():
        res["notes"].append(f"llama-server missing: {common.peer_status(common.llama_peer())}")
    try:
        peer = common.llama_server_bin().exists() or "llama" in args.skip_side
        if "agreement" not in args.skip and engines and peer:
            try:
                agreement(res, args, gguf, hf_dir, engines, out)
            except Exception as exc:
                traceback.print_exc()
                res["agreement_error"] = str(exc)[:300]
        if "kld" not in args.skip:
            try:
                kld(res, args, gguf)
            except (Exception, SystemExit) as exc:
                traceback.print_exc()
                res["kld_error"] = str(exc)[:300]
        if "throughput" not in args.skip:
            throughput(res, args, gguf, hf_dir, {tp: engines[tp] for tp in args.tp
                                                 if tp in engines}, out)  # fmt: skip
    except KeyboardInterrupt:
        res["notes"].append("interrupted; the report holds what was measured")
    finally:
        for path in args.merge:
            _merge(res, json.loads(path.read_text()), path)
        (out / "gemma3.json").write_text(json.dumps(res, indent=2, default=str))
        chart(res, out)
        print(render(res, out))
        if not args.no_latest:
            latest = common.RESULTS / "latest"
            for f in ("gemma3.md", "gemma3.png"):
                if (out / f).exists():
                    shutil.copy2(out / f, latest / f)
    return 0


def _by_tp(res: dict[str, Any]) -> list[str]:
    """Each engine's figures when more than one TP was measured (the same text and
    llama-server side): a TP=2 engine splits every layer's heads and MLP over two ranks."""
    by = res.get("agreement_tp", {})
    if len(by) < 2:
        return []
    rows = [[f"TP={tp}", f"{a['top1_agreement']:.2%}", f"{a['mean_kl']:.5f}",
             f"{a['p99_kl']:.4f} / {a['max_kl']:.4f}",
             "yes" if a["top1_agreement"] >= TARGET_TOP1 and a["mean_kl"] <= TARGET_KL else "no"]
            for tp, a in sorted(by.items())]
    return ["Each engine of ours against the same llama-server side:", "",
            *common.md_table(["engine", "top-1 agreement", "mean KL", "p99 / max KL",
                              "targets met"], rows), ""]


def _merge(res: dict[str, Any], other: dict[str, Any], path: Path) -> None:
    """Sections of an earlier run's results that this run did not measure."""
    taken = []
    for key in ("agreement", "agreement_tp", "agreement_text", "llama_perplexity", "workload"):
        if key in other and key not in res:
            res[key] = other[key]
            taken.append(key)
    for name, entry in other.get("systems", {}).items():
        if name not in res["systems"]:
            res["systems"][name] = entry
            taken.append(name)
    if taken:
        res["commands"] += [c for c in other.get("commands", []) if c not in res["commands"]]
        res["notes"].append(f"{', '.join(taken)}: from the run of {other['started_utc']} "
                            f"(load average {other.get('loadavg_start', '?')} at its start)")


class _Sh:
    def __init__(self, res: dict[str, Any]) -> None:
        self.res = res

    def __call__(self, argv: list[str]) -> str:
        self.res["commands"].append(common.cmdline(argv))
        p = subprocess.run(argv, cwd=common.REPO, capture_output=True, text=True, timeout=3600)
        if p.returncode != 0:
            raise RuntimeError(f"{argv[2]} failed ({p.returncode}): {p.stderr.strip()[-300:]}")
        return p.stdout


def _build(sh: _Sh, gguf: Path, tp: int) -> Path:
    from bench.systems import build_engine

    return build_engine(sh, gguf, tp)


if __name__ == "__main__":
    raise SystemExit(main())
