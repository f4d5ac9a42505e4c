"""The fake engine's "network": a deterministic next-token rule tests can predict exactly.

    next = (a * sum(last k tokens of prompt + generated) + b) % vocab_size

Generation rules shared by the Executor and by tests that predict its output:
- a candidate that would complete a bad word, or that is end_id before min_tokens tokens
  exist, is replaced by candidate+1 (mod vocab), like masking the best logit;
- end_id ends the sequence and is NOT part of the output (finish reason END_ID);
- a stop word IS part of the output (finish reason STOP_WORDS);
- otherwise max_tokens tokens are produced (finish reason LENGTH).

Penalties, as TensorRT-LLM's penalty kernel applies them (cpp/tensorrt_llm/kernels/
penaltyKernels.cu, `batchApplyPenalty`): the toy's logit of token v is 1 - 0.5 * d, d =
(v - next) mod vocab_size; temperature divides it first; then every token that occurs in the
prompt OR the output so far (the context phase fills the penalty workspace with the prompt's
tokens) has its logit divided (positive) or multiplied (negative) by repetition_penalty, and
presence_penalty and frequency_penalty * count subtracted. min_tokens masks end_id only.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from . import env


@dataclass(frozen=True)
class Penalties:
    """SamplingConfig's temperature and penalties (None = not set)."""

    temperature: float | None = None
    repetition: float | None = None
    presence: float | None = None
    frequency: float | None = None

    @property
    def any(self) -> bool:
        return any(v is not None for v in (self.repetition, self.presence, self.frequency))


NO_PENALTIES = Penalties()


@dataclass(frozen=True)
class ToyModel:
    k: int
    a: int
    b: int
    vocab_size: int

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, int]) -> ToyModel:
        return cls(k=int(d["k"]), a=int(d["a"]), b=int(d["b"]), vocab_size=int(d["vocab_size"]))

    @classmethod
    def from_engine_dir(cls, engine_dir: str | Path, rank: int = 0) -> ToyModel:
        """Read the parameters the build stored in rank{N}.engine (for test predictions)."""
        from .engine_file import read_engine_file

        return cls.from_dict(read_engine_file(Path(engine_dir) / f"rank{rank}.engine")["toy"])

    @classmethod
    def for_checkpoint(cls, hf_dir: Path, vocab_size: int) -> ToyModel:
        """Parameters derived from the HF directory (config bytes, weight file names and sizes),
        unless FAKE_TRTLLM_TOY overrides them. Different models give different outputs."""
        h = hashlib.sha256((hf_dir / "config.json").read_bytes())
        for f in sorted(hf_dir.iterdir()):
            if f.suffix in (".safetensors", ".bin"):
                h.update(json.dumps([f.name, f.stat().st_size]).encode())
        return cls.from_digest(h.digest(), vocab_size)

    @classmethod
    def from_digest(cls, d: bytes, vocab_size: int) -> ToyModel:
        override = env.toy_override()
        if override is not None:
            k, a, b = override
            return cls(k=k, a=a % vocab_size, b=b % vocab_size, vocab_size=vocab_size)
        a = 1 + int.from_bytes(d[:4], "little") % max(vocab_size - 1, 1)
        b = int.from_bytes(d[4:8], "little") % vocab_size
        return cls(k=2, a=a, b=b, vocab_size=vocab_size)

    def next_token(self, seq: Sequence[int]) -> int:
        return (self.a * sum(seq[-self.k :]) + self.b) % self.vocab_size

    def logit(self, seq: Sequence[int], v: int) -> float:
        return 1.0 - 0.5 * ((v - self.next_token(seq)) % self.vocab_size)

    def ranked(self, seq: Sequence[int], pen: Penalties) -> list[int]:
        """Tokens best first after temperature, then penalties (penaltyKernels.cu order),
        counting every occurrence in `seq` (prompt and output alike)."""
        counts = Counter(seq)
        inv_t = 1.0 / (pen.temperature + 1e-6) if pen.temperature is not None else 1.0

        def score(v: int) -> float:
            x = self.logit(seq, v) * inv_t
            n = counts.get(v, 0)
            if n:
                if pen.repetition is not None:
                    x = x * pen.repetition if x < 0 else x / pen.repetition
                if pen.presence is not None:
                    x -= pen.presence
                if pen.frequency is not None:
                    x -= pen.frequency * n
            return x

        nxt = self.next_token(seq)
        order = [(nxt + d) % self.vocab_size for d in range(self.vocab_size)]
        return sorted(order, key=score, reverse=True)  # stable: ties keep the toy's order

    def choose(
        self,
        seq: Sequence[int],
        n_generated: int,
        end_id: int | None,
        bad_words: Sequence[Sequence[int]],
        min_tokens: int,
        offset: int = 0,
        pen: Penalties = NO_PENALTIES,
        allowed: Callable[[int], bool] | None = None,
    ) -> int:
        """The greedy token (`offset` 0), or the offset-th candidate after it (sampling).
        `allowed`: a grammar's mask (guided decoding); a token it forbids is skipped as a
        banned one is (its logit masked to -inf)."""
        if pen.any:
            order = self.ranked(seq, pen)
            for cand in order[offset:] + order[:offset]:
                banned_end = end_id is not None and cand == end_id and n_generated < min_tokens
                if (not banned_end and not _completes(seq, cand, bad_words)
                        and (allowed is None or allowed(cand))):
                    return cand
            raise RuntimeError("fake toy model: every token is banned")
        cand = (self.next_token(seq) + offset) % self.vocab_size
        for _ in range(self.vocab_size):
            banned_end = end_id is not None and cand == end_id and n_generated < min_tokens
            if (not banned_end and not _completes(seq, cand, bad_words)
                    and (allowed is None or allowed(cand))):
                return cand
            cand = (cand + 1) % self.vocab_size
        raise RuntimeError("fake toy model: every token is banned")

    def generate(
        self,
        prompt: Sequence[int],
        max_tokens: int,
        *,
        end_id: int | None = None,
        stop_words: Sequence[Sequence[int]] = (),
        bad_words: Sequence[Sequence[int]] = (),
        min_tokens: int = 0,
    ) -> tuple[list[int], str]:
        """Greedy generation: (generated tokens, finish reason name)."""
        seq, out = list(prompt), []
        while len(out) < max_tokens:
            tok = self.choose(seq, len(out), end_id, bad_words, min_tokens)
            if end_id is not None and tok == end_id:
                return out, "END_ID"
            seq.append(tok)
            out.append(tok)
            if ends_with_stop_word(seq, stop_words):
                return out, "STOP_WORDS"
        return out, "LENGTH"


def _completes(seq: Sequence[int], cand: int, words: Sequence[Sequence[int]]) -> bool:
    longest = max((len(w) for w in words), default=0)
    tail = seq[max(0, len(seq) - longest + 1) :]
    return longest > 0 and ends_with_stop_word([*tail, cand], words)


def ends_with_stop_word(seq: Sequence[int], words: Sequence[Sequence[int]]) -> bool:
    return any(w and len(seq) >= len(w) and list(seq[-len(w) :]) == list(w) for w in words)
