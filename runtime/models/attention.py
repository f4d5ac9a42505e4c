"""Paged attention over a ragged token batch, in plain tensor operations.

One step's tokens are flattened ([T]); decode tokens and prefill chunks are mixed freely.
Attention runs in two groups so that neither pays for the other's shape:

- decode group: one query per sequence, [Bd] rows;
- prefill group: a sequence's chunk of queries padded to the step's longest chunk, [Bp, Q].

Both groups gather their keys and values a whole block at a time through their block
tables (never slot by slot: per-slot gathers compile into loops slower than the matmuls),
and GQA broadcasts query groups over a KV head instead of copying KV heads. The runner
pads an empty group with one dummy row that points at the null block, so every shape is
at least 1 and one compiled program serves every mix.

Cache layout, per layer: k_cache, v_cache [num_blocks, block_size, kv_heads, head_dim], each
its own argument; slot = block * block_size + offset. Their memory is head-major
(runtime/models/factory.py kv_cache_view): nothing here assumes contiguous caches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: where each token's k/v is written
    out_index: torch.Tensor  # [T] int64: row of cat(decode_out, prefill_out.flatten) per token
    dec_q_index: torch.Tensor  # [Bd] int64: token index of each decode query
    dec_block_tables: torch.Tensor  # [Bd, Md] int64 (padded with the null block)
    dec_ctx_lens: torch.Tensor  # [Bd] int64: keys visible to each decode query
    pf_q_index: torch.Tensor  # [Bp, Q] int64: token index of each prefill query (padded)
    pf_block_tables: torch.Tensor  # [Bp, Mp] int64
    # [Hk, 3] int64 (modulus, lo, hi): KV head h attends row r when lo <= r % modulus < hi
    # (runtime/models/kv_heads.py: a head shared by two ranks, a zero head); r is a decode
    # query's batch row, or a prompt query's row in its chunk. Its output elsewhere is
    # zeros. None: every row of every head.
    kv_live: torch.Tensor | None = None


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    block_index: torch.Tensor, block_offset: torch.Tensor,
) -> None:
    """k, v [T, Hk, D] -> cache[block_index, block_offset] (in place).

    An index_put_ on the cache argument itself, never on a view of it: AOTInductor then
    writes in place, where a write through a view of a larger input compiles into a copy of
    the whole cache on every step.
    """
    k_cache.index_put_((block_index, block_offset), k)
    v_cache.index_put_((block_index, block_offset), v)


def _gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """cache [NB, bs, Hk, D], block_tables [B, M] -> [B, Hk, M * bs, D]."""
    b, m = block_tables.shape
    _, bs, hk, d = cache.shape
    blocks = cache[block_tables]  # [B, M, bs, Hk, D]
    return blocks.reshape(b, m * bs, hk, d).transpose(1, 2)


def _softmax_av(scores: torch.Tensor, mask: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    # Softmax in float32 for bf16/fp16 models; masked keys get -inf. Every query row has
    # at least key 0 visible, so no row is all -inf.
    probs = scores.float().masked_fill(~mask, float("-inf")).softmax(dim=-1).to(v.dtype)
    return probs @ v


def decode_attention(
    qd: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    ctx_lens: torch.Tensor, scale: float, window: int = 0,
) -> torch.Tensor:
    """One query per sequence, qd [Bd, Hq, D] -> [Bd, Hq * D], in tensor operations: the
    numerical reference (eager engines) for the fused kernel aoti engines call. `window`:
    the query (at position ctx_len - 1) sees only the last `window` keys (0: all)."""
    bd, hq, d = qd.shape
    hk = k_cache.shape[2]
    q4 = qd.view(bd, hk, hq // hk, d)  # [Bd, Hk, g, D] against [Bd, Hk, C, D] keys
    kd = _gather_blocks(k_cache, block_tables)
    vd = _gather_blocks(v_cache, block_tables)
    sd = (q4 @ kd.transpose(-1, -2)) * scale  # [Bd, Hk, g, C]
    cd = torch.arange(kd.shape[2], device=qd.device)
    maskd = cd.unsqueeze(0) < ctx_lens.unsqueeze(1)  # [Bd, C]
    if window:
        maskd = maskd & (cd.unsqueeze(0) >= ctx_lens.unsqueeze(1) - window)
    maskd = maskd.view(bd, 1, 1, -1)
    return _softmax_av(sd, maskd, vd).reshape(bd, hq * d)


def _row_mask(kv_rows: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """[*pos.shape, Hk] bool: which KV heads attend the queries at positions `pos` (kv_rows:
    AttentionMetadata's kv_live). By position, not by batch row, as the kernels: a token's
    shared head is then attended by the same rank whichever step computes it."""
    r = pos.unsqueeze(-1) % kv_rows[:, 0]
    return (r >= kv_rows[:, 1]) & (r < kv_rows[:, 2])


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor,
    meta: AttentionMetadata, scale: float, use_kernels: bool = False, window: int = 0,
) -> torch.Tensor:
    """q [T, Hq, D] (keys/values already written) -> attention output [T, Hq * D].

    `use_kernels`: both groups run our fused kernels (runtime/kernels/paged_attention.cpp),
    which read K/V in place with an online softmax, instead of the tensor operations: the
    decode rows one query each, the prompt chunks in tiles of rows, each causal to its own
    position.

    `window` (a sliding-window layer; 0: global): a query at position p attends the keys at
    p - window < position <= p, as transformers' sliding_window_overlay; the kernels do not
    read the blocks wholly before every query's window.
    """
    _, hq, d = q.shape
    hk = k_cache.shape[2]
    g = hq // hk

    qd = q[meta.dec_q_index]  # [Bd, Hq, D]
    bd = qd.shape[0]
    if use_kernels:
        od = torch.ops.aotllm.paged_decode_attention(
            qd, k_cache, v_cache, meta.dec_block_tables, meta.dec_ctx_lens, scale, meta.kv_live,
            window).reshape(bd, hq * d)
    else:
        od = decode_attention(qd, k_cache, v_cache, meta.dec_block_tables, meta.dec_ctx_lens,
                              scale, window)
        if meta.kv_live is not None:  # the rows another rank attends: zeros, as the kernel
            keep = _row_mask(meta.kv_live, meta.dec_ctx_lens - 1).unsqueeze(-1)  # [Bd, Hk, 1]
            od = (od.view(bd, hk, g * d) * keep).reshape(bd, hq * d)

    bp, nq = meta.pf_q_index.shape
    qp = q[meta.pf_q_index]  # [Bp, Q, Hq, D]
    if use_kernels:
        # The prompt chunks' queries in tiles of rows against their own sequence's blocks,
        # each causal to its own position: every key block is widened once per tile, not
        # once per query row (the decode kernel with one row per query, before).
        qpos = positions[meta.pf_q_index]  # [Bp, Q]
        op = torch.ops.aotllm.paged_prefill_attention(
            qp, k_cache, v_cache, meta.pf_block_tables, qpos, scale, meta.kv_live, window
        ).reshape(bp * nq, hq * d)
        return torch.cat((od, op), dim=0)[meta.out_index]  # [T, Hq * D]

    # Prefill group: queries [Bp, Q] -> [Bp, Hk, g * Q, D]; causal by absolute position.
    qp = qp.view(bp, nq, hk, g, d).permute(0, 2, 3, 1, 4).reshape(bp, hk, g * nq, d)
    kp = _gather_blocks(k_cache, meta.pf_block_tables)
    vp = _gather_blocks(v_cache, meta.pf_block_tables)
    sp = (qp @ kp.transpose(-1, -2)) * scale  # [Bp, Hk, g * Q, C]
    qpos = positions[meta.pf_q_index]  # [Bp, Q]
    cp = torch.arange(kp.shape[2], device=q.device)
    maskp = cp.view(1, 1, -1) <= qpos.unsqueeze(-1)  # [Bp, Q, C]
    if window:
        maskp = maskp & (cp.view(1, 1, -1) > qpos.unsqueeze(-1) - window)
    maskp = maskp.unsqueeze(1).unsqueeze(1).expand(bp, 1, g, nq, -1).reshape(bp, 1, g * nq, -1)
    op = _softmax_av(sp, maskp, vp)  # [Bp, Hk, g * Q, D]
    op = op.view(bp, hk, g, nq, d).permute(0, 3, 1, 2, 4)  # [Bp, Q, Hk, g, D]
    if meta.kv_live is not None:
        op = op * _row_mask(meta.kv_live, qpos).view(bp, nq, hk, 1, 1)
    op = op.reshape(bp * nq, hq * d)

    return torch.cat((od, op), dim=0)[meta.out_index]  # [T, Hq * D]
