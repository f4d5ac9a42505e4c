"""Reference outputs from Hugging Face transformers on the same weights."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM


@cache
def hf_model(path: str) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()


@torch.inference_mode()
def last_logits(path: Path, tokens: list[int]) -> torch.Tensor:
    return hf_model(str(path))(torch.tensor([tokens])).logits[0, -1]


@torch.inference_mode()
def greedy(path: Path, prompt: list[int], max_new_tokens: int) -> list[int]:
    out = hf_model(str(path)).generate(
        torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
    )
    return out[0, len(prompt):].tolist()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
