"""llama.cpp's own KL divergence of its quantized GGUFs, for bench/quant_accuracy.py.

`llama-perplexity` (built by `make bench-peers`) runs the bf16 GGUF over the text once and
saves its logits (`--kl-divergence-base`), then runs each quantized GGUF against them
(`--kl-divergence`) and prints mean KL divergence, top-1 agreement ("Same top p") and
perplexity. Its chunks of `ctx` tokens score only their second halves (its own method), so
these figures cross-check the GGUF rows of quant_accuracy rather than repeat them.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path

from bench import common

CHUNKS = 10  # chunks of `ctx` tokens: 10 x 1024 = the 10240 tokens quant_accuracy scores
_FIGURES = {
    "mean_kl": re.compile(r"Mean\s+KLD:\s+(-?[0-9.]+)"),
    "top1_agreement_pct": re.compile(r"Same top p:\s+([0-9.]+)"),
    "perplexity": re.compile(r"Mean PPL\(Q\)\s*:\s*([0-9.]+)"),
}
_BASE_PPL = re.compile(r"Final estimate: PPL = ([0-9.]+)")


def binary() -> Path:
    return common.cache_dir() / "llama-build" / "bin" / "llama-perplexity"


def _perplexity(argv: list[str]) -> str:
    out = subprocess.run([str(binary()), *argv], capture_output=True, text=True, timeout=1800,
                         check=False)  # fmt: skip
    if out.returncode != 0:
        tail = (out.stdout + out.stderr).strip()[-400:]
        raise RuntimeError(f"llama-perplexity failed ({out.returncode}): {tail}")
    return out.stdout + out.stderr


def run(text: str, ggufs: dict[str, Path], ctx: int, threads: int, base: Path | None = None,
        chunks: int = CHUNKS) -> dict[str, object]:
    """{"base": {...}, "rows": [{"scheme", "mean_kl", "top1_agreement_pct", "perplexity"}]}
    against `base` (default: the bf16 GGUF of `make bench-peers`); rows print as they come."""
    if not binary().exists():
        raise SystemExit(f"error: {binary()} is missing — run `make bench-peers` first")
    base = base or common.gguf_for(common.demo_checkpoint())
    if not base.exists():
        raise SystemExit(f"error: {base} is missing — run `make bench-peers` first")
    with tempfile.TemporaryDirectory(prefix="llama-kld-") as tmp:
        text_file, logits = Path(tmp) / "text.txt", Path(tmp) / "base.kld"
        text_file.write_text(text)
        common_args = ["-f", str(text_file), "-c", str(ctx), "--chunks", str(chunks),
                       "-t", str(threads)]  # fmt: skip
        log = _perplexity(["-m", str(base), *common_args, "--kl-divergence-base", str(logits)])
        m = _BASE_PPL.search(log)
        result: dict[str, object] = {"base": {"gguf": str(base),
                                              "perplexity": float(m.group(1)) if m else None},
                                     "ctx": ctx, "chunks": chunks, "rows": []}  # fmt: skip
        print(f"llama-perplexity --kl-divergence ({chunks} chunks of {ctx}, second halves "
              f"scored), base {base.name}: PPL {result['base']['perplexity']}")  # type: ignore[index]
        print("| llama.cpp | mean KL vs bf16 | top-1 agreement | perplexity |")
        print("|---|---|---|---|")
        for label, path in ggufs.items():
            log = _perplexity(["-m", str(path), *common_args, "--kl-divergence-base", str(logits),
                               "--kl-divergence"])  # fmt: skip
            row: dict[str, object] = {"scheme": label, "gguf": str(path)}
            for key, rx in _FIGURES.items():
                m = rx.search(log)
                row[key] = float(m.group(1)) if m else None
            result["rows"].append(row)  # type: ignore[union-attr]
            print(f"| {label} | {row['mean_kl']} | {row['top1_agreement_pct']} % | "
                  f"{row['perplexity']} |", flush=True)
    return result
