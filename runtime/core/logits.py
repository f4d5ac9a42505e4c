"""Per-sequence sampling state and the logits processors that read it (rank 0 only).

Before the draw, each row's logits go through, in this order (vLLM's):
  1. the grammar mask (structured output): forbidden tokens -> -inf;
  2. logit_bias: added to the listed tokens' logits;
  3. repetition_penalty on every token seen in the prompt or the output (a positive
     logit is divided by it, a negative one multiplied: HF's and vLLM's definition);
     frequency_penalty * count and presence_penalty * (count > 0) subtracted for tokens
     of the output (OpenAI's definition);
  4. min_tokens: the sequence's stop tokens -> -inf until it has that many tokens, unless
     nothing else is left (a grammar that is complete allows only stop tokens, and the
     grammar wins).
Temperature, log-probabilities and the draw follow in runtime/core/sampler.py.

Every step is computed row by row from the row's own state, so a sequence's result never
depends on which other sequences share the batch.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch

from runtime.core.grammar import GrammarState, apply_grammars
from runtime.core.types import SamplingParams


class SeqSampling:
    """What the sampler needs to know about one sequence beyond its logits row."""

    def __init__(self, params: SamplingParams, generator: torch.Generator | None,
                 stop_token_ids: Sequence[int] = (), prompt_token_ids: Sequence[int] = (),
                 grammar: GrammarState | None = None) -> None:
        self.params = params
        self.generator = generator
        self.stop_token_ids = tuple(sorted(set(stop_token_ids)))
        self.grammar = grammar
        self.num_output = 0
        self.cumulative_logprob = 0.0
        self.grammar_violated = False  # a token the grammar did not allow (cannot happen)
        self._counts: Counter[int] = Counter()  # output token -> occurrences
        # Only the repetition penalty reads the prompt; kept as the distinct ids.
        self._prompt = (torch.tensor(sorted(set(prompt_token_ids)), dtype=torch.long)
                        if params.repetition_penalty != 1.0 else None)

    def fork(self, generator: torch.Generator | None) -> SeqSampling:
        """A sibling at the same position (n > 1): same history, its own random stream."""
        child = SeqSampling.__new__(SeqSampling)
        child.params, child.generator = self.params, generator
        child.stop_token_ids, child._prompt = self.stop_token_ids, self._prompt
        child.grammar = self.grammar.fork() if self.grammar is not None else None
        child.num_output, child.cumulative_logprob = self.num_output, self.cumulative_logprob
        child.grammar_violated = self.grammar_violated
        child._counts = Counter(self._counts)
        return child

    def accept(self, token: int, logprob: float | None) -> None:
        """Record the token sampled for this sequence."""
        self.num_output += 1
        if logprob is not None:
            self.cumulative_logprob += logprob
        if self.params.has_penalties:
            self._counts[token] += 1
        if self.grammar is not None and not self.grammar.accept(token):
            self.grammar_violated = True

    def output_counts(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(distinct output token ids [k], their counts [k] float32)."""
        ids = torch.tensor(list(self._counts), dtype=torch.long, device=device)
        counts = torch.tensor(list(self._counts.values()), dtype=torch.float32, device=device)
        return ids, counts

    def seen_tokens(self, device: torch.device) -> torch.Tensor:
        """Distinct ids of the prompt and the output (for the repetition penalty)."""
        out = torch.tensor(list(self._counts), dtype=torch.long)
        both = out if self._prompt is None else torch.cat([self._prompt, out])
        return torch.unique(both).to(device)


def leaves_untouched(s: SeqSampling) -> bool:
    """apply_processors would not change this state's row (the cases it tests, negated)."""
    p = s.params
    return (s.grammar is None and not p.logit_bias and not p.has_penalties
            and not (s.num_output < p.min_tokens and s.stop_token_ids))


def apply_processors(logits: torch.Tensor, states: Sequence[SeqSampling]) -> None:
    """Steps 1-4 above, in place on logits [m, V] float32 (one row per state)."""
    apply_grammars(logits, [(i, s.grammar) for i, s in enumerate(states)
                            if s.grammar is not None])
    device = logits.device
    vocab = logits.shape[1]
    for i, s in enumerate(states):
        p = s.params
        row = logits[i]  # a view: writes go to `logits`
        if p.logit_bias:
            ids = torch.tensor([t for t, _ in p.logit_bias if t < vocab], dtype=torch.long,
                               device=device)
            bias = torch.tensor([b for t, b in p.logit_bias if t < vocab],
                                dtype=torch.float32, device=device)
            row.index_add_(0, ids, bias)
        if p.repetition_penalty != 1.0:
            seen = s.seen_tokens(device)
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / p.repetition_penalty,
                                    vals * p.repetition_penalty)
        if (p.frequency_penalty or p.presence_penalty) and s.num_output:
            ids, counts = s.output_counts(device)
            row.index_add_(0, ids, -(p.frequency_penalty * counts + p.presence_penalty))
        if s.num_output < p.min_tokens and s.stop_token_ids:
            stops = torch.tensor(s.stop_token_ids, dtype=torch.long, device=device)
            stops = stops[stops < vocab]
            masked = row.index_fill(0, stops, float("-inf"))
            if torch.isfinite(masked).any():
                row.copy_(masked)
