"""A mixture-of-experts layer (Mixtral, Qwen3-MoE) with static shapes.

The router (a replicated linear, float weights even in a quantized engine) scores every
expert per token; the softmax over all experts is taken in float32, the top
`num_experts_per_tok` kept and, with `norm_topk_prob` (always for Mixtral), renormalised to
sum to one: transformers' MixtralTopKRouter / Qwen3MoeTopKRouter.

Static shapes, for torch.export and AOTInductor: every expert runs over every token of the
step and its output is weighted by the token's routing weight for it, zero for the experts
the token did not choose. A gather of only the chosen tokens (transformers' loop over
`nonzero`) has data-dependent shapes that an exported program cannot hold. The cost is
compute: num_experts / num_experts_per_tok times the routed FLOPs (Mixtral 8 / 2: 4x the
MLP's). Weight traffic is the same as a routed kernel's once a step's tokens touch every
expert (a prefill, a decode batch of a few sequences); a decode step of one sequence reads
every expert's weights instead of its top-k.

Tensor parallel: each expert is the dense MLP split the same way (gate/up by rows, down by
columns, runtime/models/sharding.py); its down projection returns the rank's partial sum,
and the weighted sum over experts is all-reduced once.
"""

from __future__ import annotations

import torch
from torch import nn

from runtime.models.config import ModelConfig
from runtime.models.layers import ReplicatedLinear
from runtime.models.parallel import TPContext


class SparseMoeBlock(nn.Module):
    """`experts`: one module per expert, each [T, hidden] -> the rank's unreduced
    [T, hidden] partial sum (llama.MLP with reduce_results False)."""

    def __init__(self, cfg: ModelConfig, tp: TPContext, dtype: torch.dtype,
                 experts: list[nn.Module]) -> None:
        super().__init__()
        if len(experts) != cfg.num_experts:
            raise ValueError(f"{len(experts)} experts given for a model of {cfg.num_experts}")
        self.gate = ReplicatedLinear(cfg.hidden_size, cfg.num_experts, tp, dtype)
        self.experts = nn.ModuleList(experts)
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.tp = tp

    def routing_weights(self, x: torch.Tensor) -> torch.Tensor:
        """[T, hidden] -> [T, num_experts] float32: each token's weight for each expert,
        zero outside its top-k."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)  # [T, E]
        top, index = torch.topk(probs, self.top_k, dim=-1)  # [T, k]
        if self.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return torch.zeros_like(probs).scatter(1, index, top)  # [T, E]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        weights = self.routing_weights(x)
        out: torch.Tensor | None = None
        for e, expert in enumerate(self.experts):
            # As transformers' Mixtral: each expert's output times its float32 weight, rounded
            # to the model dtype, added in expert order (its Qwen3-MoE rounds the weight to
            # the model dtype first: in bf16 one rounding apart; float32 engines exact).
            y = (expert(x) * weights[:, e, None]).to(x.dtype)  # [T, hidden], partial over ranks
            out = y if out is None else out + y
        assert out is not None
        return self.tp.all_reduce(out)
