"""The build profile: the shapes an engine is compiled and warmed up for, and the choices
(backend, dtype) every engine records. Plain data, validated on construction."""

from __future__ import annotations

from dataclasses import asdict, dataclass

BACKENDS = ("aoti", "eager", "trtllm")
DTYPES = ("bfloat16", "float16", "float32")


@dataclass(frozen=True, slots=True)
class BuildProfile:
    """The shapes an engine is built and warmed up for; the server never exceeds them."""

    max_batch_size: int = 16
    max_num_tokens: int = 512  # token budget of one step (prefill chunks + decodes)
    max_seq_len: int = 1024  # prompt + generated tokens of one sequence
    tokens_per_block: int = 16

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "max_num_tokens", "max_seq_len", "tokens_per_block"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)}")
        if self.max_num_tokens < self.max_batch_size:
            raise ValueError(
                f"max_num_tokens ({self.max_num_tokens}) must be at least max_batch_size "
                f"({self.max_batch_size}) so that every running sequence can decode in one step"
            )
        if self.max_seq_len % self.tokens_per_block:
            raise ValueError(
                f"max_seq_len ({self.max_seq_len}) must be a multiple of tokens_per_block "
                f"({self.tokens_per_block})"
            )

    @property
    def max_blocks_per_seq(self) -> int:
        return self.max_seq_len // self.tokens_per_block

    def to_dict(self) -> dict[str, int]:
        return asdict(self)
