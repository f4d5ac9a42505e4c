"""tensorrt_llm.mapping.Mapping: how a model is split across ranks (reference §1.1)."""

from __future__ import annotations

from typing import Any


class Mapping:
    """`tp_size`/`pp_size` are keyword-only: the second positional argument is `rank`."""

    def __init__(
        self,
        world_size: int = 1,
        rank: int = 0,
        gpus_per_node: int = 8,
        *,
        cp_size: int = 1,
        cp_config: dict[str, Any] | None = None,
        tp_size: int = 1,
        pp_size: int = 1,
        moe_cluster_size: int = -1,
        moe_tp_size: int = -1,
        moe_ep_size: int = -1,
        attn_tp_size: int = -1,
        attn_cp_size: int = -1,
        enable_attention_dp: bool = False,
    ) -> None:
        if world_size != tp_size * pp_size * cp_size:
            raise ValueError(
                f"world_size must equal to tp_size * pp_size * cp_size, but got {world_size} "
                f"!= {tp_size} * {pp_size} * {cp_size}"
            )
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is out of range [0, {world_size})")
        self.world_size = world_size
        self.rank = rank
        self.gpus_per_node = gpus_per_node
        self.cp_size = cp_size
        self.cp_config = cp_config
        self.tp_size = tp_size
        self.pp_size = pp_size
        self.moe_cluster_size = moe_cluster_size
        self.moe_tp_size = moe_tp_size
        self.moe_ep_size = moe_ep_size
        self.attn_tp_size = attn_tp_size
        self.attn_cp_size = attn_cp_size
        self.enable_attention_dp = enable_attention_dp

    def __repr__(self) -> str:
        return (
            f"Mapping(world_size={self.world_size}, rank={self.rank}, tp_size={self.tp_size}, "
            f"pp_size={self.pp_size}, cp_size={self.cp_size})"
        )
