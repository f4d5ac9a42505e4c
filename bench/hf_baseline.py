"""transformers `generate` at fixed batch sizes: the offline floor every engine must beat.

Greedy, prompts of exactly `prompt_len` tokens (so no padding), exactly `new_tokens` new
tokens per sequence (min_new_tokens = max_new_tokens), output tokens/s = batch * new / time.

    python -m bench.hf_baseline --hf-dir DIR [--quick] [--dtypes bfloat16 float32]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from bench.common import md_table
from bench.prompts import load_tokenizer, make_prompts

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass(frozen=True)
class GenerateResult:
    dtype: str
    batch: int
    new_tokens: int
    seconds: float
    output_tok_s: float


def load_model(hf_dir: Path, dtype: str) -> Any:
    from transformers import AutoModelForCausalLM

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=DTYPES[dtype])
    return model.eval()


@torch.inference_mode()
def generate_once(model: Any, prompts: list[list[int]], new_tokens: int) -> float:
    """Seconds for one greedy generate over the batch; checks the exact output length."""
    input_ids = torch.tensor(prompts, dtype=torch.long)  # [batch, prompt_len]
    mask = torch.ones_like(input_ids)
    pad = model.config.pad_token_id
    pad = model.config.eos_token_id if pad is None else pad
    t = time.perf_counter()
    out = model.generate(
        input_ids=input_ids,
        attention_mask=mask,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=pad,
    )  # [batch, prompt_len + new_tokens]
    seconds = time.perf_counter() - t
    if out.shape[1] != input_ids.shape[1] + new_tokens:
        raise RuntimeError(
            f"generate made {out.shape[1] - input_ids.shape[1]} tokens, not {new_tokens}"
        )
    return seconds


def run_baseline(
    hf_dir: Path,
    batches: Sequence[int] = (1, 4, 16),
    dtypes: Sequence[str] = ("bfloat16", "float32"),
    prompt_len: int = 128,
    new_tokens: int = 128,
    seed: int = 0,
) -> list[GenerateResult]:
    tok = load_tokenizer(hf_dir)
    prompts = make_prompts(tok, max(batches), prompt_len, seed=seed)
    results: list[GenerateResult] = []
    for dtype in dtypes:
        model = load_model(hf_dir, dtype)
        generate_once(model, prompts[:1], 4)  # warm the allocator and thread pool
        for b in batches:
            s = generate_once(model, prompts[:b], new_tokens)
            results.append(GenerateResult(dtype, b, new_tokens, s, b * new_tokens / s))
        del model
    return results


def format_table(results: Sequence[GenerateResult]) -> str:
    header = ["dtype", "batch", "new tokens", "seconds", "output tok/s"]
    rows = ([r.dtype, r.batch, r.new_tokens, f"{r.seconds:.2f}", f"{r.output_tok_s:.1f}"]
            for r in results)  # fmt: skip
    return "\n".join(md_table(header, rows))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--hf-dir", type=Path, default=None, help="default: python -m demo.model")
    ap.add_argument("--quick", action="store_true", help="batches 1 and 4, 16 new tokens")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=sorted(DTYPES))
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    from bench.common import demo_checkpoint

    hf_dir = args.hf_dir or demo_checkpoint()
    if not (hf_dir / "config.json").exists():
        print(f"hf_baseline: error: {hf_dir} is not a Hugging Face checkpoint")
        return 2
    batches = [1, 4] if args.quick else args.batches
    new = 16 if args.quick else args.new_tokens
    results = run_baseline(hf_dir, batches, args.dtypes, args.prompt_len, new)
    print(json.dumps([asdict(r) for r in results]) if args.json else format_table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
