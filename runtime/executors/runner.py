"""ModelRunner: applies step plans to per-sequence state and runs the step function.

Every rank runs one. It keeps its own copy of each sequence's tokens and block table,
learned from the plans (sent in full once, then deltas), turns a plan into the flat
tensors of the model's step function, and runs it (eager module or AOTInductor package:
the same positional signature).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from runtime.core.plan import NULL_BLOCK, ScheduledSeq, StepPlan

StepFn = Callable[..., torch.Tensor]


@dataclass(slots=True)
class SeqState:
    token_ids: list[int]
    block_table: list[int] = field(default_factory=list)


def _pad(rows: list[list[int]], fill: int) -> torch.Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor([r + [fill] * (width - len(r)) for r in rows], dtype=torch.int64)


def prepare_inputs(
    items: list[tuple[SeqState, ScheduledSeq]], block_size: int
) -> tuple[tuple[torch.Tensor, ...], list[int]]:
    """Flatten one step into the step function's arguments (all but the KV cache).

    Returns the arguments in `LlamaForCausalLM.forward` order and the seq ids whose logits
    rows come back, in row order; rows asked for by `prompt_logits` follow those rows, then
    each verified draft's row (the position before it), in plan order.
    """
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    dec_q, dec_tables, dec_ctx = [], [], []
    pf_rows: list[tuple[int, int, list[int]]] = []  # (first token index, count, block table)
    owner: list[tuple[str, int, int]] = []  # per token: group, row, column
    logits_index, sampled, extra, draft_rows = [], [], [], []
    for state, s in items:
        start, n = s.num_computed_tokens, s.num_new_tokens
        first = len(ids)
        k = len(s.draft_token_ids)
        # Positions past the sequence's known tokens are its drafts (speculation).
        known = start + n - k
        for p in range(start, start + n):
            ids.append(state.token_ids[p] if p < known else s.draft_token_ids[p - known])
            pos.append(p)
            slots.append(state.block_table[p // block_size] * block_size + p % block_size)
        nblocks = (start + n + block_size - 1) // block_size
        if n == 1:
            owner.append(("d", len(dec_q), 0))
            dec_q.append(first)
            dec_tables.append(state.block_table[:nblocks])
            dec_ctx.append(start + 1)
        else:
            owner.extend(("p", len(pf_rows), c) for c in range(n))
            pf_rows.append((first, n, state.block_table[:nblocks]))
        if s.sample:
            logits_index.append(first + n - 1)
            sampled.append(s.seq_id)
        extra.extend(range(first, first + s.prompt_logits))
        draft_rows.extend(range(first + n - 1 - k, first + n - 1))
    # An empty group gets one dummy row on the null block so that no shape is ever 0.
    if not dec_q:
        dec_q, dec_tables, dec_ctx = [0], [[NULL_BLOCK]], [1]
    if not pf_rows:
        pf_rows = [(0, 1, [NULL_BLOCK])]
    logits_index += extra + draft_rows
    if not logits_index:
        logits_index = [0]
    width = max(n for _, n, _ in pf_rows)
    pf_q = [[first + min(c, n - 1) for c in range(width)] for first, n, _ in pf_rows]
    bd = len(dec_q)
    out_index = [row if g == "d" else bd + row * width + col for g, row, col in owner]
    t = torch.tensor
    args = (
        t(ids, dtype=torch.int64),
        t(pos, dtype=torch.int64),
        t(slots, dtype=torch.int64),
        t(out_index, dtype=torch.int64),
        t(dec_q, dtype=torch.int64),
        _pad(dec_tables, NULL_BLOCK),
        t(dec_ctx, dtype=torch.int64),
        t(pf_q, dtype=torch.int64),
        _pad([table for _, _, table in pf_rows], NULL_BLOCK),
        t(logits_index, dtype=torch.int64),
    )
    return args, sampled


def pad_tokens(args: tuple[torch.Tensor, ...], to: int) -> tuple[torch.Tensor, ...]:
    """Pad a step's token dimension to `to` tokens: ids, positions, slots and out_index get
    dummy entries (slot 0 is in the null block, which nothing real reads; row 0 of the
    attention output is some real row), so only the padded rows' compute is wasted."""
    ids, pos, slots, out_index, *rest = args
    n = to - ids.shape[0]
    if n <= 0:
        return args
    z = torch.zeros(n, dtype=ids.dtype)
    return (torch.cat((ids, z)), torch.cat((pos, z)), torch.cat((slots, z)),
            torch.cat((out_index, z)), *rest)


# Steps of up to this many tokens (decode batches) keep their exact shape: they run our
# weight-streaming kernel, which keeps no per-shape state, and padding them costs most.
PAD_FROM_TOKENS = 4


class ModelRunner:
    def __init__(self, step_fn: StepFn, kv_cache: torch.Tensor, block_size: int,
                 token_bucket: int = 1, max_tokens: int | None = None) -> None:
        """`token_bucket`: pad steps of more than a few tokens to a multiple of it (at most
        `max_tokens`). Every distinct token count is a new matrix shape, and oneDNN keeps a
        primitive per shape: unpadded, a server's memory grows with each new prompt length
        until its caches fill (measured: +0.5 GiB per rank in a 4-minute soak)."""
        self.step_fn = step_fn
        self.token_bucket = token_bucket
        self.max_tokens = max_tokens
        self.pad_from = PAD_FROM_TOKENS  # steps of more tokens than this are padded
        self.kv_cache = kv_cache  # [layers, 2, num_blocks, block_size, Hk, D], head-major memory
        # The step function takes each layer's K and V cache as its own tensor.
        self.k_caches = [kv_cache[i, 0] for i in range(kv_cache.shape[0])]
        self.v_caches = [kv_cache[i, 1] for i in range(kv_cache.shape[0])]
        self.block_size = block_size
        self.seqs: dict[int, SeqState] = {}
        self.keepalive: object = None  # what the step function's weights are views of

    def apply(self, plan: StepPlan) -> list[tuple[SeqState, ScheduledSeq]]:
        """Update per-sequence state from a plan, in the documented order."""
        for sid in plan.freed_seq_ids:
            self.seqs.pop(sid, None)
        for new in plan.new_seqs:
            self.seqs[new.seq_id] = SeqState(list(new.token_ids))
        for sid, toks in plan.accepted_tokens.items():
            if sid in self.seqs:
                self.seqs[sid].token_ids.extend(toks)
        for sid, tok in plan.appended_tokens.items():
            if sid in self.seqs:
                self.seqs[sid].token_ids.append(tok)
        for sid, n in plan.block_table_lens.items():
            if sid in self.seqs:
                del self.seqs[sid].block_table[n:]
        for src, dst in plan.copied_blocks:
            for k, v in zip(self.k_caches, self.v_caches):
                k[dst].copy_(k[src])
                v[dst].copy_(v[src])
        items = []
        for s in plan.scheduled:
            state = self.seqs[s.seq_id]
            state.block_table.extend(s.new_block_ids)
            items.append((state, s))
        return items

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> tuple[list[int], torch.Tensor | None]:
        """Run one step; returns (seq ids, logits [n, vocab]) for the rows to sample,
        followed by the `prompt_logits` rows the plan asked for, then the draft rows."""
        items = self.apply(plan)
        if not items:
            return [], None
        args, sampled = prepare_inputs(items, self.block_size)
        t = args[0].shape[0]
        # Only steps with prompt tokens are padded: decodes and verify rows (speculation)
        # take a bounded set of shapes (at most max_batch_size * (1 + K) tokens), and a
        # 5-token verify step padded to 16 rows costs the compute of 16 (bench/spec_decode.py,
        # 135M demo, aoti on AVX512-BF16 without AMX: free generation at K=4 ran at half the
        # speed of plain decoding with it).
        prompt = any(s.num_new_tokens > 1 + len(s.draft_token_ids) for s in plan.scheduled)
        if self.token_bucket > 1 and t > self.pad_from and prompt:
            bucket = -(-t // self.token_bucket) * self.token_bucket
            args = pad_tokens(args, bucket if self.max_tokens is None else
                              min(bucket, self.max_tokens))
        dev = self.kv_cache.device
        logits = self.step_fn(*(a.to(dev, non_blocking=True) for a in args), self.k_caches, self.v_caches)
        rows = len(sampled) + sum(s.prompt_logits for s in plan.scheduled) + plan.num_draft_rows
        return sampled, logits[:rows]
