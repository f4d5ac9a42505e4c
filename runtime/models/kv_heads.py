"""The TP head plan: which KV heads each rank holds, and which rows of each it attends.

When the ranks divide the KV heads (or the KV heads divide the ranks), each rank holds its
own heads (or one replicated head) and attends them for every row. Otherwise
ModelConfig.tp_heads pads the heads to a multiple of the ranks: SmolLM2's 3 KV heads at
TP=2 are 4 slots, 2 a rank. Padding at the end gave rank 0 heads 0 and 1 and rank 1 head 2
and a zero head, so rank 0 attended twice what rank 1 did and set the pace of every step
(batch 16: 6.1 ms of attention a step on rank 0, 30 layers, one thread a rank).

Balanced, each rank takes H / tp heads of the work. A head that straddles two ranks is held
by both (its q, k and v rows and its o_proj columns on each; the slot was a zero head's
before) and each attends it for its share of the queries: a slot attends the query at
position p when lo <= p % modulus < hi. The other rank's output there is zeros, and the
o_proj all-reduce adds the two into the whole head. SmolLM2 at TP=2: rank 0 attends head 0
and head 1 at even positions, rank 1 head 1 at odd positions and head 2.

By position, not by the query's row in the batch: a token is then attended by the same rank
whether a decode step, a prompt chunk or a speculative verify step computes it, so its
logits are bit for bit the same (by row, the all-reduce added a token's partial sums in
another order under speculation, and greedy outputs flipped at near-ties). A prompt's
consecutive positions still split its work evenly; a decode batch splits by its sequences'
position parity, even on average.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from contract.quant import QuantSpec
from runtime.models.config import ModelConfig
from runtime.quant import QTensor, q_cat_cols, q_cat_rows, q_cols, q_pad_cols, q_pad_rows, q_rows


@dataclass(frozen=True, slots=True)
class KVSlot:
    head: int | None  # the model's KV head in this slot; None: a zero head (padding)
    modulus: int = 1  # attends the queries at positions p with lo <= p % modulus < hi
    lo: int = 0
    hi: int = 1

    def __post_init__(self) -> None:
        if self.modulus < 1 or not 0 <= self.lo <= self.hi <= self.modulus:
            raise ValueError(f"KV slot rows {self.lo}..{self.hi} mod {self.modulus}")


ZERO_SLOT = KVSlot(None, 1, 0, 0)


def padded(cfg: ModelConfig, tp: int) -> bool:
    """Whether tp_heads pads the KV heads for `tp` ranks (the plan has shared or zero slots)."""
    return cfg.tp_heads(tp)[1] != cfg.num_key_value_heads


def _shared_plan(h: int, tp: int, per: int) -> list[list[KVSlot]] | None:
    """Rank r takes the work [r * h, (r + 1) * h) in units of 1/tp of a head: the heads that
    interval touches, each for the share of rows it covers. None when a rank would touch
    more heads than it has slots (7 heads over 4 ranks: 1.75 a rank can touch 3 of 2)."""
    plan = []
    for r in range(tp):
        a, b = r * h, (r + 1) * h
        slots = []
        for j in range(a // tp, -(-b // tp)):
            lo, hi = max(a - j * tp, 0), min(b - j * tp, tp)
            slots.append(KVSlot(j) if (lo, hi) == (0, tp) else KVSlot(j, tp, lo, hi))
        if len(slots) > per:
            return None
        plan.append(slots + [ZERO_SLOT] * (per - len(slots)))
    return plan


def shares_heads(cfg: ModelConfig, tp: int, linear: QuantSpec | None = None) -> bool:
    """Whether the padded layout shares straddling heads between ranks (see the module
    docstring). `linear`: the decoder linears' quantization; grouped, each head group's
    o_proj input columns must be whole groups, since a shared head's are cut out alone."""
    if not padded(cfg, tp):
        return False
    if linear is not None and linear.group_size and group_width(cfg) % linear.group_size:
        return False
    per = cfg.tp_heads(tp)[1] // tp
    return _shared_plan(cfg.num_key_value_heads, tp, per) is not None


def group_width(cfg: ModelConfig) -> int:
    """Query rows (o_proj input columns) of one KV head's group."""
    return cfg.num_attention_heads // cfg.num_key_value_heads * cfg.head_dim


def kv_plan(cfg: ModelConfig, tp: int, linear: QuantSpec | None = None) -> list[list[KVSlot]]:
    """Each rank's KV slots, rank by rank (every rank has the same number)."""
    h = cfg.num_key_value_heads
    if shares_heads(cfg, tp, linear):
        plan = _shared_plan(h, tp, cfg.tp_heads(tp)[1] // tp)
        assert plan is not None
        return plan
    return [[KVSlot(j) if j < h else ZERO_SLOT for j in range(*kv_head_range(cfg, tp, r))]
            for r in range(tp)]


def kv_head_rows(cfg: ModelConfig, tp: int, rank: int, linear: QuantSpec | None = None) -> torch.Tensor:
    """[local KV heads, 3] int64 (modulus, lo, hi) a rank's attention reads (the kernels
    skip a zero slot's cache and the rows a slot does not attend; they output zeros)."""
    return torch.tensor([[s.modulus, s.lo, s.hi] for s in kv_plan(cfg, tp, linear)[rank]],
                        dtype=torch.int64)


def rows_from_live(live: int, slots: int) -> torch.Tensor:
    """kv_head_rows for shards of stop 29, which stored how many of the slots were real
    (zero heads at the end) as `kv_heads_live`."""
    return torch.tensor([[1, 0, 1 if h < live else 0] for h in range(slots)], dtype=torch.int64)


def kv_head_range(cfg: ModelConfig, tp: int, rank: int) -> tuple[int, int]:
    """[start, end) of the (padded) KV heads rank `rank` holds where no head is shared."""
    _, hk = cfg.tp_heads(tp)
    if tp <= hk:
        per = hk // tp
        return rank * per, (rank + 1) * per
    head = rank // (tp // hk)  # ranks sharing one replicated KV head are neighbours
    return head, head + 1


def shared_slots(cfg: ModelConfig, tp: int, rank: int,
                 linear: QuantSpec | None) -> list[int | None] | None:
    """Rank `rank`'s KV head in each slot when the plan shares heads (None: a zero slot);
    None when it does not (shares_heads): then kv_head_range's heads, zeros appended."""
    if not shares_heads(cfg, tp, linear):
        return None
    return [s.head for s in kv_plan(cfg, tp, linear)[rank]]


def slot_heads(t: torch.Tensor, heads: list[int | None], width: int, dim: int) -> torch.Tensor:
    """Each slot's `width` rows (dim 0) or columns (dim 1) of head j, zeros for a zero slot:
    a rank's q, k or v rows, or its o_proj columns, under a shared plan."""
    shape = list(t.shape)
    shape[dim] = width
    return torch.cat([t.narrow(dim, j * width, width) if j is not None else t.new_zeros(shape)
                      for j in heads], dim=dim)


def slot_qheads(t: QTensor, heads: list[int | None], width: int, dim: int, what: str) -> QTensor:
    """slot_heads for a quantized tensor (shares_heads made the columns whole groups)."""
    if dim == 0:
        zero = q_pad_rows(q_rows(t, 0, 0), width)
        return q_cat_rows([q_rows(t, j * width, (j + 1) * width) if j is not None else zero
                           for j in heads])
    zero = q_pad_cols(q_cols(t, 0, 0, what), width, what)
    return q_cat_cols([q_cols(t, j * width, (j + 1) * width, what) if j is not None else zero
                       for j in heads])
