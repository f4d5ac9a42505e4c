"""This machine's physical floors, measured in the same run as the systems they bound.

- memory read bandwidth: sum over a large array (torch, all threads; numpy for reference)
- host memory copy bandwidth: copy into a destination that is already faulted in
- bfloat16 and float32 matmul rates: torch.mm on large square matrices
- sequential read of given files from storage, page cache dropped first when allowed
- the decode floor for a model: weight bytes per step / bandwidth at batch 1, and
  operations per step / the faster matmul rate at batch 16

    python -m bench.floors [--quick] [--files F ...] [--model HF_DIR]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from runtime.store import floors

GB = 1e9


def memory_read_gbs(nbytes: int = 1 << 30, repeats: int = 5) -> dict[str, float]:
    """Read bandwidth in GB/s: the best of `repeats` full sums over an nbytes float32 array
    (runtime/store/floors.py, as the server measures it; numpy for reference)."""
    a = np.ones(nbytes // 4, dtype=np.float32)  # [n]
    numpy_s = floors.best_seconds(lambda: a.sum(), repeats)
    return {"torch_sum": floors.memory_read_gbps(nbytes, repeats), "numpy_sum": nbytes / numpy_s / GB}


def memory_copy_gbs(nbytes: int = 1 << 30, repeats: int = 5) -> dict[str, float]:
    """Host copy bandwidth in GB/s (bytes copied / time) into a pre-faulted destination
    (runtime/store/floors.py, as the server measures it; numpy for reference)."""
    a = np.ones(nbytes // 4, dtype=np.float32)
    b = np.zeros_like(a)
    numpy_s = floors.best_seconds(lambda: np.copyto(b, a), repeats)
    return {"torch_copy": floors.host_copy_gbps(nbytes, repeats),
            "numpy_copyto": nbytes / numpy_s / GB}


def matmul_tflops(n: int = 2048, dtype: torch.dtype = torch.bfloat16, repeats: int = 3) -> float:
    """Dense matmul rate in TFLOP/s (2 n^3 per product)."""
    a = torch.randn(n, n).to(dtype)  # [n, n]
    b = torch.randn(n, n).to(dtype)  # [n, n]
    s = floors.best_seconds(lambda: torch.mm(a, b), repeats)
    return 2 * n**3 / s / 1e12


@dataclass(frozen=True)
class DecodeFloor:
    params: int  # weights used by matmuls each step (the embedding lookup reads only rows)
    weight_bytes: int  # bytes of those weights in the serving dtype
    flops_per_token: float
    batch1_tok_s: float  # bandwidth bound: one step reads every weight once
    batch16_tok_s: float  # max of the bandwidth and compute bounds for a 16-sequence step
    batch16_bound: str


def model_matmul_params(hf_dir: Path) -> tuple[int, dict[str, Any]]:
    """Parameters that decode multiplies by each step, from safetensors headers."""
    from safetensors import safe_open

    config = json.loads((hf_dir / "config.json").read_text())
    total = 0
    embed = 0
    has_lm_head = False
    for f in sorted(hf_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 (safe_open is not a dict)
                numel = int(np.prod(st.get_slice(name).get_shape()))
                total += numel
                if name.endswith("embed_tokens.weight"):
                    embed = numel
                has_lm_head = has_lm_head or name.endswith("lm_head.weight")
    # Tied: the embedding matrix is read once per step as the LM head. Untied: the
    # embedding is only gathered by row, the LM head is read whole.
    params = total if not has_lm_head else total - embed
    return params, config


def decode_floor(
    hf_dir: Path,
    read_gbs: float,
    tflops: float,
    dtype_bytes: int = 2,
    context: int = 192,
    batch: int = 16,
) -> DecodeFloor:
    """Best possible decode tokens/s at batch 1 and `batch`, given bandwidth and matmul rate.

    Attention adds 4 * layers * context * heads * head_dim operations per token (QK^T and PV
    at an average context of `context` tokens); its KV reads are small next to the weights.
    """
    params, cfg = model_matmul_params(hf_dir)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    attn = 4 * cfg["num_hidden_layers"] * context * cfg["num_attention_heads"] * head_dim
    flops = 2.0 * params + attn
    weight_bytes = params * dtype_bytes
    step_bw_s = weight_bytes / (read_gbs * GB)
    step_compute_s = batch * flops / (tflops * 1e12)
    bound = "bandwidth" if step_bw_s >= step_compute_s else "compute"
    return DecodeFloor(
        params=params,
        weight_bytes=weight_bytes,
        flops_per_token=flops,
        batch1_tok_s=1.0 / max(step_bw_s, flops / (tflops * 1e12)),
        batch16_tok_s=batch / max(step_bw_s, step_compute_s),
        batch16_bound=bound,
    )


def measure_all(
    quick: bool = False, files: Sequence[Path] = (), model: Path | None = None
) -> dict[str, Any]:
    size = (256 << 20) if quick else (1 << 30)
    reps = 2 if quick else 5
    out: dict[str, Any] = {
        "threads": torch.get_num_threads(),
        "memory_read_gbs": memory_read_gbs(size, reps),
        "memory_copy_gbs": memory_copy_gbs(size, reps),
        "bf16_matmul_tflops": matmul_tflops(1024 if quick else 2048, torch.bfloat16, reps),
        "fp32_matmul_tflops": matmul_tflops(1024 if quick else 2048, torch.float32, reps),
    }
    if files:
        out["storage_read"] = floors.files_read(files)
    if model is not None:
        bw = max(out["memory_read_gbs"].values())
        # A bf16 model's products may run in float32 (weights widened on the fly, as our
        # kernels do on hosts without bf16 arithmetic, where torch's bf16 mm is a slow
        # fallback): the faster of the two rates bounds the step.
        rate = max(out["bf16_matmul_tflops"], out["fp32_matmul_tflops"])
        floor = decode_floor(model, bw, rate)
        out["decode_floor_bf16"] = asdict(floor)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--files", type=Path, nargs="*", default=[])
    ap.add_argument("--model", type=Path, default=None, help="HF checkpoint for the decode floor")
    args = ap.parse_args(argv)
    missing = [str(f) for f in args.files if not f.is_file()]
    if missing or (args.model and not (args.model / "config.json").exists()):
        print(f"floors: error: no such file or checkpoint: {missing or args.model}")
        return 2
    print(json.dumps(measure_all(args.quick, args.files, args.model), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
