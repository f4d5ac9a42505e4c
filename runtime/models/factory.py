"""Build a rank's model skeleton and bind a rank's weights to it (eager engines)."""

from __future__ import annotations

import math

import torch

from contract.quant import NONE, Quantization
from runtime.models.config import ModelConfig
from runtime.models.kv_heads import rows_from_live
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
    """Bind a rank's tensors to the model without copying (strict: names and shapes).
    Shards written before `kv_head_rows` existed take it from stop 29's `kv_heads_live`
    (zero heads at the end), or the model's own: every row of every KV head attended,
    padding included, as the engines before that did."""
    if "kv_head_rows" not in weights:
        own = model.kv_head_rows.detach().clone()
        live = weights.get("kv_heads_live")
        rows = own if live is None else rows_from_live(int(live), own.shape[0])
        weights = {k: v for k, v in weights.items() if k != "kv_heads_live"} | {"kv_head_rows": rows}
    model.load_state_dict(weights, strict=True, assign=True)
    for p in model.parameters():
        p.requires_grad_(False)


def kv_cache_shape(cfg: ModelConfig, tp: int, num_blocks: int, block_size: int) -> tuple[int, ...]:
    """[layers, 2 (k, v), num_blocks, block_size, local KV heads, head_dim]: the shape
    every user of the cache indexes (its memory is head-major, see kv_cache_view)."""
    _, hk = local_heads(cfg, tp)
    return (cfg.num_hidden_layers, 2, num_blocks, block_size, hk, cfg.head_dim)


def kv_cache_view(flat: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """The cache of logical `shape` (kv_cache_shape) over `flat` storage laid out
    [layers, 2, blocks, KV heads, block_size, head_dim]: one head's rows of a block are
    one contiguous run. Slot-major (the heads of a slot together), a decode kernel reading
    one head strides over the others' rows, which the hardware prefetcher does not follow
    across blocks; SmolLM2 at batch 16, context 150, 30 layers' caches: attention 18-20 ms
    a step slot-major, 12-13 ms head-major (8-9 ms with the keys in cache). The compiled
    program is exported with these strides (pipeline/compile/aoti.py), so every cache an
    engine is given must come from here."""
    layers, two, blocks, bs, hk, d = shape
    return flat.view(layers, two, blocks, hk, bs, d).transpose(3, 4)


def empty_kv_cache(shape: tuple[int, ...], dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    """A zeroed cache of logical `shape` in the head-major layout (kv_cache_view)."""
    return kv_cache_view(torch.zeros(math.prod(shape), dtype=dtype, device=device), shape)


def kv_bytes_per_block(cfg: ModelConfig, tp: int, block_size: int, dtype: torch.dtype) -> int:
    n = 1
    for s in kv_cache_shape(cfg, tp, 1, block_size):
        n *= s
    return n * torch.empty((), dtype=dtype).element_size()
