"""Build a rank's model skeleton and bind a rank's weights to it (eager engines)."""

from __future__ import annotations

import torch

from contract.quant import NONE, Quantization
from runtime.models.config import ModelConfig
from runtime.models.llama import LlamaForCausalLM, local_heads
from runtime.models.parallel import TPContext

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def torch_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPES)}") from None


def build_model(cfg: ModelConfig, tp: TPContext, dtype: torch.dtype, device: str = "cpu",
                use_kernels: bool = False, quant: Quantization = NONE,
                weight_layout: str = "rows") -> LlamaForCausalLM:
    """A model whose parameters are uninitialised (bind weights with `bind_weights`)."""
    with torch.device(device):
        return LlamaForCausalLM(cfg, tp, dtype, use_kernels, quant, weight_layout).eval()


def bind_weights(model: LlamaForCausalLM, weights: dict[str, torch.Tensor]) -> None:
    """Bind a rank's tensors to the model without copying (strict: names and shapes)."""
    model.load_state_dict(weights, strict=True, assign=True)
    for p in model.parameters():
        p.requires_grad_(False)


def kv_cache_shape(cfg: ModelConfig, tp: int, num_blocks: int, block_size: int) -> tuple[int, ...]:
    """[layers, 2 (k, v), num_blocks, block_size, local KV heads, head_dim]."""
    _, hk = local_heads(cfg, tp)
    return (cfg.num_hidden_layers, 2, num_blocks, block_size, hk, cfg.head_dim)


def kv_bytes_per_block(cfg: ModelConfig, tp: int, block_size: int, dtype: torch.dtype) -> int:
    n = 1
    for s in kv_cache_shape(cfg, tp, 1, block_size):
        n *= s
    return n * torch.empty((), dtype=dtype).element_size()
