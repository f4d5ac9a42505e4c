"""Token sampling on rank 0: greedy, or temperature -> top-k -> top-p -> draw.

Each sampled row draws one uniform number from its own CPU `torch.Generator` and picks the
token by inverse CDF on the logits' device. So a seeded request gives the same tokens for
the same logits whatever else shares its batch, and only `n` floats cross to the device.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from runtime.types import SamplingParams

Row = tuple[SamplingParams, torch.Generator | None]


def make_generator(params: SamplingParams) -> torch.Generator | None:
    """A request's random stream: None when greedy, else seeded from `seed` or os.urandom."""
    if params.greedy:
        return None
    seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little")
    return torch.Generator(device="cpu").manual_seed(seed % 2**64)


class Sampler:
    def __init__(self) -> None:
        # For sampled rows that come without a generator.
        self._fallback = torch.Generator(device="cpu").manual_seed(
            int.from_bytes(os.urandom(8), "little")
        )

    def __call__(self, logits: torch.Tensor, rows: Sequence[Row]) -> list[int]:
        return self.sample(logits, rows)

    def sample(self, logits: torch.Tensor, rows: Sequence[Row]) -> list[int]:
        """logits: [n, vocab], any float dtype; rows: n (params, generator) -> n token ids."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(
                f"logits of shape {tuple(logits.shape)} do not match {len(rows)} sampling rows"
            )
        logits = logits.float()  # [n, V]
        greedy = [i for i, (p, _) in enumerate(rows) if p.greedy]
        if len(greedy) == len(rows):
            return logits.argmax(dim=-1).tolist()
        out = torch.empty(len(rows), dtype=torch.long, device=logits.device)  # [n]
        if greedy:
            idx = torch.tensor(greedy, device=logits.device)
            out[idx] = logits[idx].argmax(dim=-1)
        drawn = [i for i, (p, _) in enumerate(rows) if not p.greedy]
        idx = torch.tensor(drawn, device=logits.device)
        out[idx] = self._draw(logits[idx], [rows[i] for i in drawn])
        return out.tolist()

    def _draw(self, logits: torch.Tensor, rows: list[Row]) -> torch.Tensor:
        """logits: [m, V] float32, rows all non-greedy -> [m] token ids."""
        device = logits.device
        vocab = logits.shape[1]
        params = [p for p, _ in rows]
        temps = torch.tensor([p.temperature for p in params], device=device)  # [m]
        logits = logits / temps.unsqueeze(1)
        if any(0 < p.top_k < vocab or p.top_p < 1.0 for p in params):
            logits = logits.masked_fill(~self._keep_mask(logits, params), float("-inf"))
        # The draw always runs in vocabulary order, so a row's token depends only on its own
        # logits and generator, never on which other rows share the batch.
        probs = logits.softmax(dim=-1)  # [m, V]
        cdf = probs.cumsum(dim=-1)  # [m, V]
        u = torch.tensor(
            [torch.rand((), generator=g or self._fallback).item() for _, g in rows],
            dtype=torch.float32,
            device=device,
        )  # [m]
        # Inverse CDF: the first token whose cumulative mass exceeds u * total; tokens with
        # no mass never qualify, since the cumulative sum does not rise at them.
        target = (u * cdf[:, -1]).unsqueeze(1)  # [m, 1]
        pos = torch.searchsorted(cdf, target, right=True).squeeze(1)  # [m]
        # Rounding can put the target at the very top; fall back to the last token with mass.
        last = vocab - 1 - (probs > 0).flip(-1).float().argmax(dim=-1)  # [m]
        return torch.minimum(pos, last)

    @staticmethod
    def _keep_mask(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Top-k then top-p, as a [m, V] bool mask of the tokens each row keeps."""
        device = logits.device
        vocab = logits.shape[1]
        # Rows without a cut get limits that keep everything exactly (no rounding at 1.0).
        ks = torch.tensor(
            [p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=device
        )  # [m]
        ps = torch.tensor(
            [p.top_p if p.top_p < 1.0 else float("inf") for p in params], device=device
        )  # [m]
        # Both cuts keep a prefix of the descending order; stable, so ties break the same way.
        sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)  # [m, V]
        ranks = torch.arange(vocab, device=device)  # [V]
        keep = ranks.unsqueeze(0) < ks.unsqueeze(1)  # [m, V]
        probs = sorted_logits.masked_fill(~keep, float("-inf")).softmax(dim=-1)  # [m, V]
        # Keep the smallest prefix whose mass reaches top_p: drop a token once the mass
        # before it already does. The first token always stays (its prefix mass is 0).
        keep &= probs.cumsum(dim=-1) - probs < ps.unsqueeze(1)
        return torch.empty_like(keep).scatter_(1, order, keep)
