"""The scheduler -> runner contract: one `StepPlan` per step, plain data only.

Rank 0's scheduler makes a plan; it is pickled and broadcast over MPI; every rank's
`ModelRunner` executes it against its own copy of the per-sequence state. A sequence is
sent in full once (`NewSeq`), then only deltas: new block ids and the token rank 0
sampled for it in the previous step.

Runners apply a plan's fields in order: `freed_seq_ids` (forget), `new_seqs` (learn),
`appended_tokens`, `copied_blocks` (KV copy-on-write), then each `scheduled` entry's
`new_block_ids`; then they run the step. A preempted sequence is freed in one plan and
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


@dataclass(slots=True)
class StepPlan:
    step_id: int
    new_seqs: list[NewSeq] = field(default_factory=list)
    # tokens rank 0 sampled in the previous step, to append before this step runs
    appended_tokens: dict[int, int] = field(default_factory=dict)
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
