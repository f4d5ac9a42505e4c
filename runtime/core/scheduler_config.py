"""The scheduler's configuration and statistics (plain data; see runtime/core/scheduler.py)."""

from __future__ import annotations

from dataclasses import dataclass

from contract.speculative import Speculative

# Adaptive speculation's defaults (SchedulerConfig.spec_*), measured with
# `python -m bench.spec_decode --profile` (SmolLM2-135M aoti bf16, TP=1, 2-core EPYC,
# every draft accepted; median decode step in ms by batch B and K drafts per sequence):
#   B=2: K=0 17.1, K=1 19.8, K=2 22.3, K=4 26.1 (5x the tokens for 1.5x the time)
#   B=4: K=0 19.9, K=1 366, K=2 148, K=4 150
#   B=8: K=0 303, K=1 3611
# (one run, 2026-12-03, load average 3-4 from other jobs on the 2 cores: B=1 K=0 read
# 112 ms where a quiet machine decodes in ~11, so single figures are noisy; the pattern
# is not: from 4 decoding sequences on, a verify step, whose 1 + K tokens per sequence
# run the prefill-attention group, costs 7-18x a decode step, more than K=4 all accepted
# can win back.) So nothing is drafted past 2. At B <= 2 one drafted token costs about
# 1-2 ms of a ~15 ms fixed step (token cost ~0.1) and a verify entry a little more.
SPEC_MAX_BATCH_SIZE = 2
SPEC_TOKEN_COST = 0.1
SPEC_VERIFY_COST = 0.05
# ExecutorStats.extra keys `<this><i>`: verify entries that accepted draft position i
# (serve/metrics.py exports them as one counter with a `position` label, as vLLM does).
SPEC_PER_POS = "spec_decode_num_accepted_tokens_per_pos_total:"


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_batch_size: int  # sequences holding KV blocks (running) at once
    max_num_tokens: int  # tokens computed per step, over all sequences
    block_size: int  # tokens per KV block
    num_blocks: int  # KV blocks in the pool, the null block included
    max_seq_len: int  # prompt + max_tokens limit per request
    eos_token_ids: tuple[int, ...] = ()
    enable_prefix_caching: bool = False
    # Logits rows one step may return (sampled rows plus prompt log-probability rows).
    # A compiled step function has a fixed upper bound (pipeline/compile/aoti.py); None
    # means no bound beyond max_num_tokens (eager).
    max_logit_rows: int | None = None
    # Prompt tokens one step may compute while some running sequence decodes (None: as
    # many as the budget leaves). Every decode in the step waits for the step, so a
    # 512-token chunk on a CPU stalls each stream for as long as 512 tokens take (about a
    # second for the 135M demo on 2 cores); smaller chunks while others decode bound that
    # stall. With nothing decoding, prompts take the whole budget (an idle server's TTFT).
    max_prefill_tokens_while_decoding: int | None = None
    # Prompt tokens the running sequences' chunks may take, in all, in a step that admits
    # a waiting sequence (None: they leave only the tokens the newcomers need; see the
    # scheduler's "First tokens behind a long prompt"). A request arriving during a long
    # prefill waits for the step in flight, then for the step that admits it: without a
    # cap that step carries the rest of the long prompt's chunk (484 of 996 tokens on a
    # 512-token budget, about a second on a CPU), so its first token came no sooner than
    # the long prompt's. With the cap that step is short, and the long prompt still
    # progresses (by up to this many tokens) in every step.
    max_prefill_tokens_while_waiting: int | None = None
    # Speculative decoding (runtime/core/spec.py): None, or the drafter and its K.
    speculative: Speculative | None = None
    # Adaptive speculation (runtime/core/spec_policy.py): K per sequence from its own
    # acceptance, between 0 and the drafter's K; False drafts K whenever the drafter finds
    # a match (the policy before issue #36 item 4, kept for measurements and tests).
    spec_adaptive: bool = True
    # No drafts at all in a step where more sequences than this decode. Measured on the
    # 2-core CPU with the SmolLM2-135M aoti bf16 engine (bench/spec_decode.py --profile):
    # SPEC_MAX_BATCH_SIZE's comment has the figures.
    spec_max_batch_size: int = SPEC_MAX_BATCH_SIZE
    # A decode step's time as 1 + spec_token_cost * tokens + spec_verify_cost * verifying
    # sequences, in units of its fixed cost (measured, as above): what drafts must pay for.
    spec_token_cost: float = SPEC_TOKEN_COST
    spec_verify_cost: float = SPEC_VERIFY_COST

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "max_num_tokens", "block_size", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_num_tokens < self.max_batch_size:
            raise ValueError(
                f"max_num_tokens ({self.max_num_tokens}) must be at least max_batch_size "
                f"({self.max_batch_size}) so that every running sequence can decode in one step"
            )
        if not isinstance(self.num_blocks, int) or self.num_blocks < 2:
            raise ValueError(
                f"num_blocks must be at least 2 (block 0 is the null block), "
                f"got {self.num_blocks!r}"
            )
        if not isinstance(self.eos_token_ids, tuple) or not all(
            isinstance(t, int) and t >= 0 for t in self.eos_token_ids
        ):
            raise ValueError(
                f"eos_token_ids must be a tuple of non-negative ints, got {self.eos_token_ids!r}"
            )
        for name in ("max_prefill_tokens_while_decoding", "max_prefill_tokens_while_waiting"):
            cap = getattr(self, name)
            if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool)
                                    or cap < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {cap!r}")
        if self.max_logit_rows is not None and self.max_logit_rows < self.max_batch_size:
            raise ValueError(
                f"max_logit_rows ({self.max_logit_rows}) must be at least max_batch_size "
                f"({self.max_batch_size}): every running sequence may sample in one step"
            )
        if not isinstance(self.spec_max_batch_size, int) or self.spec_max_batch_size < 0:
            raise ValueError(f"spec_max_batch_size must be a non-negative integer, got "
                             f"{self.spec_max_batch_size!r}")
        if not (self.spec_token_cost >= 0 and self.spec_verify_cost >= 0):
            raise ValueError("spec_token_cost and spec_verify_cost must be non-negative")
        if self.speculative is not None and not isinstance(self.speculative, Speculative):
            raise ValueError(f"speculative must be a Speculative or None, got "
                             f"{self.speculative!r}")

    @property
    def logit_rows(self) -> int:
        return self.max_logit_rows if self.max_logit_rows is not None else self.max_num_tokens


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    running: int
    waiting: int
    kv_blocks_used: int  # held by unfinished sequences
    kv_blocks_total: int  # usable blocks (the null block excluded)
    kv_blocks_cached: int  # prefix-cached blocks no sequence holds (free, reusable)
    preemptions_total: int
    steps_total: int
    tokens_last_step: int
    prompt_tokens_total: int  # prompts of sequences that produced their first token
    generation_tokens_total: int  # tokens sampled
    prefix_cache_queries_total: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits_total: int  # of those, tokens found (not computed again)
    prompt_tokens_computed_total: int = 0  # prompt positions run through the model
    forked_sequences_total: int = 0  # sequences started from a sibling's prefill (n > 1)
    kv_blocks_copied_total: int = 0  # copy-on-write of a fork's last prompt block
    rows_reclaimed_total: int = 0  # siblings preempted to give a waiting request its share
    spec_draft_tokens_total: int = 0  # drafted tokens verified (speculative decoding)
    spec_accepted_tokens_total: int = 0  # of those, accepted
    spec_drafts_total: int = 0  # verify entries (a sequence verifying drafts in a step)
    # accepted drafts by position: [i] counts verify entries that kept draft i (0-based)
    spec_accepted_per_pos: tuple[int, ...] = ()
    spec_backoffs_total: int = 0  # times a sequence stopped drafting for a while (adaptive)
