"""The scheduler -> runner contract: one `StepPlan` per step, plain data only.

Rank 0's scheduler makes a plan; it is pickled and broadcast over MPI; every rank's
`ModelRunner` executes it against its own copy of the per-sequence state. A sequence is
sent in full once (`NewSeq`), then only deltas: new block ids and the token rank 0
sampled for it in the previous step.

Runners apply a plan's fields in order: `freed_seq_ids` (forget), `new_seqs` (learn),
`accepted_tokens` then `appended_tokens`, `block_table_lens` (speculation's rollback),
`copied_blocks` (KV copy-on-write), then each `scheduled` entry's `new_block_ids`; then
they run the step.

Speculative decoding (runtime/core/spec.py): a decoding sequence may be scheduled with
1 + K tokens, its last sampled token and K drafted ones (`draft_token_ids`), which the
runners feed to the model without adding them to their tokens. Rank 0 keeps the accepted
prefix; the next plan carries it (`accepted_tokens`, before the token sampled after it in
`appended_tokens`) and, when blocks held only rejected positions and were freed,
the sequence's shortened block table length (`block_table_lens`). KV written at rejected
positions is left where it is: nothing reads past a sequence's computed tokens, and the
next steps overwrite it. A preempted sequence is freed in one plan and
comes back later as a `NewSeq`; so does a sequence forked from another (n > 1), whose
block table starts with its parent's blocks.

Block id 0 is the null block: the block manager never hands it out, and the runner
points padding slots at it, so padding writes never touch live KV data.
"""

from __future__ import annotations

from dataclasses import dataclass, field

NULL_BLOCK = 0


@dataclass(slots=True)
class NewSeq:
    """A sequence the runners have not seen, or one restarting after preemption.

    `token_ids` is the prompt, plus the tokens generated before a preemption (recompute).
    """

    seq_id: int
    token_ids: list[int]


@dataclass(slots=True)
class ScheduledSeq:
    seq_id: int
    num_computed_tokens: int  # tokens already in the KV cache before this step
    num_new_tokens: int  # tokens computed this step: a prefill chunk, or 1 for decode
    new_block_ids: list[int]  # appended to the sequence's block table before this step runs
    sample: bool  # the step's last token yields logits (end of prompt, or decode)
    # Prompt log-probabilities (echo): the first `prompt_logits` positions of this step's
    # chunk also yield logits rows, after every sampled row, in plan order.
    prompt_logits: int = 0
    # Speculation: the last len(draft_token_ids) of the step's tokens are these drafts (not
    # yet the sequence's); each position before a draft yields a logits row (K rows, after
    # the prompt rows, in plan order), the last one the ordinary sampled row.
    draft_token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class StepPlan:
    step_id: int
    new_seqs: list[NewSeq] = field(default_factory=list)
    # tokens rank 0 sampled in the previous step, to append before this step runs
    appended_tokens: dict[int, int] = field(default_factory=dict)
    # drafted tokens rank 0 accepted in the previous step, appended before appended_tokens
    accepted_tokens: dict[int, list[int]] = field(default_factory=dict)
    # block tables cut to this many blocks (the tail held only rejected draft positions)
    block_table_lens: dict[int, int] = field(default_factory=dict)
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    # sequences to forget, applied first (finished, cancelled, preempted)
    freed_seq_ids: list[int] = field(default_factory=list)
    # (source, destination) KV blocks to copy before the step: the last, partly filled
    # prompt block of a forked sequence, which siblings would otherwise write over
    copied_blocks: list[tuple[int, int]] = field(default_factory=list)
    shutdown: bool = False

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def num_draft_rows(self) -> int:
        return sum(len(s.draft_token_ids) for s in self.scheduled)
