"""Fidelity recorded at build: the engine against transformers on the same weights.

The build's golden run leaves the engine's log-probabilities over a fixed text
(runtime/executors/golden.py FIDELITY_TEXT, contract/layout.py FIDELITY_FILE). Here transformers computes the same in
float32 (the reference) and in the engine's dtype (the drift a user of that dtype accepts
from transformers itself), and the manifest records, for each against float32: the mean
|delta log-prob| of the text's next tokens, the mean KL(float32 || it) over the vocabulary,
and top-1 agreement. A 16-bit engine further from float32 than 1.5x transformers' own drift
in that dtype fails the build with the numbers (an LM head that rounds its logits, a kernel
that loses precision); a quantized engine's figures are recorded and judged only against
garbage (its quantization error is the point of it): any engine further than GARBAGE_KL
from float32 is not the model, and fails.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from contract.errors import EXIT_FAILURE, BuildError
from contract.layout import FIDELITY_FILE

if TYPE_CHECKING:  # torch is imported where it is used: `pipeline inspect` needs none
    import torch

# A checkpoint larger than this many parameters is not loaded twice more into memory by the
# build (float32 and 16-bit copies): its fidelity is recorded as skipped, with the reason.
MAX_PARAMS = 2_000_000_000
RATIO = 1.5  # how much further from float32 than transformers' own 16-bit drift may we be
# Below this mean KL (nats) both are noise: a tiny random model's near-uniform outputs.
KL_FLOOR = 1e-4
# Above this mean KL (nats) an engine, quantized or not, is not the model it was built from.
# Measured: Gemma 3 270M int8_wo 0.0032; a tied int8 LM head read in the wrong layout 74.9
# (the defect this bound would have stopped at build).
GARBAGE_KL = 1.0


def compare(ref: torch.Tensor, other: torch.Tensor, ids: list[int]) -> dict[str, float]:
    """Log-softmax rows [n - 1, vocab] of `other` against `ref` (row i predicts ids[i + 1])."""
    import torch

    nxt = torch.tensor(ids[1:])
    rows = torch.arange(len(nxt))
    delta = (other[rows, nxt] - ref[rows, nxt]).abs()
    kl = (ref.exp() * (ref - other)).sum(-1).clamp_min(0)  # KL(ref || other), per row
    agree = (other.argmax(-1) == ref.argmax(-1)).float()
    return {"mean_abs_dlogprob": round(float(delta.mean()), 6),
            "mean_kl": round(float(kl.mean()), 7),
            "top1_agreement": round(float(agree.mean()), 4)}


def _hf_logprobs(source: Path, ids: list[int], dtype: torch.dtype, vocab: int) -> torch.Tensor:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
    model.eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()  # [n - 1, vocab]
    return torch.log_softmax(logits[:, :vocab], dim=-1)


def _params(source: Path) -> int:
    from safetensors import safe_open

    total = 0
    for f in source.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():  # noqa: SIM118 (safe_open is no mapping)
                total += math.prod(st.get_slice(k).get_shape())
    return total


def measure_fidelity(engine_dir: Path, source: Path, dtype: str,
                     quantized: bool) -> dict[str, Any]:
    """The fidelity record of the engine in `engine_dir` (its golden run's FIDELITY_FILE,
    removed here), or why there is none; raises BuildError when a 16-bit engine drifts."""
    import torch

    path = engine_dir / FIDELITY_FILE
    if not path.is_file():
        return {"skipped": "the golden run computed no log-probabilities (token budget < 2)"}
    saved = torch.load(path)
    os.unlink(path)
    ids, ours = saved["ids"], saved["logprobs"]
    params = _params(source)
    if params > MAX_PARAMS:
        return {"skipped": f"{params / 1e9:.1f}B parameters: transformers not loaded at build"}
    try:
        ref = _hf_logprobs(source, ids, torch.float32, ours.shape[-1])
    except Exception as e:  # a checkpoint transformers cannot load: say so, build on
        return {"skipped": f"transformers could not run the checkpoint ({type(e).__name__})"}
    record: dict[str, Any] = {"reference": "transformers float32", "tokens": len(ids),
                              "engine": compare(ref, ours, ids)}
    if dtype != "float32":
        other = _hf_logprobs(source, ids, getattr(torch, dtype), ours.shape[-1])
        record[f"transformers_{dtype}"] = compare(ref, other, ids)
    verdict = judge(record, dtype, quantized)
    if verdict:
        raise BuildError(verdict,
                         "a kernel or layout loses precision on this target; report it with the "
                         "engine's `pipeline inspect` output", exit_code=EXIT_FAILURE)
    return record


def judge(record: dict[str, Any], dtype: str, quantized: bool) -> str:
    """'' when the engine is within RATIO of transformers' own drift in `dtype` (a quantized
    or float32 engine: within GARBAGE_KL of float32); else why."""
    ours = record["engine"]
    if ours["mean_kl"] > GARBAGE_KL:
        return (f"the engine is not the model: mean KL {ours['mean_kl']:.3g} nats from "
                f"transformers float32 (bound {GARBAGE_KL}), top-1 agreement "
                f"{ours['top1_agreement']:.2%} over {record['tokens']} tokens")
    own = record.get(f"transformers_{dtype}")
    if quantized or own is None:
        return ""
    bound = max(RATIO * own["mean_kl"], KL_FLOOR)
    if ours["mean_kl"] <= bound:
        return ""
    return (f"the engine is further from transformers float32 than transformers' own {dtype} "
            f"is: mean KL {ours['mean_kl']:.3g} against {own['mean_kl']:.3g} (bound {bound:.3g}), "
            f"mean |delta log-prob| {ours['mean_abs_dlogprob']:.3g} against "
            f"{own['mean_abs_dlogprob']:.3g}, top-1 agreement {ours['top1_agreement']:.2%} "
            f"against {own['top1_agreement']:.2%} over {record['tokens']} tokens")


def describe(record: dict[str, Any]) -> str:
    """One line for `pipeline inspect`."""
    if not record:
        return "-"
    if "skipped" in record:
        return f"skipped: {record['skipped']}"
    parts = []
    for name in ("engine", *(k for k in record if k.startswith("transformers_"))):
        f = record[name]
        parts.append(f"{name.replace('_', ' ')}: KL {f['mean_kl']:.3g}, |dlogp| "
                     f"{f['mean_abs_dlogprob']:.3g}, top-1 {f['top1_agreement']:.1%}")
    return f"vs {record['reference']} over {record['tokens']} tokens; " + "; ".join(parts)
