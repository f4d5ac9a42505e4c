"""The model architecture as the engine sees it, read from a Hugging Face config.

Everything the runtime needs is validated here, once; an architecture or option we do
not implement is refused by name rather than silently mis-run.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from contract.errors import BuildError

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
_SUPPORTED_ROPE_TYPES = ("default", "llama3")


@dataclass(frozen=True, slots=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    rope: RopeConfig
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise BuildError(
                f"num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})",
                "the checkpoint's config.json is inconsistent; fix or re-export it",
            )

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelConfig:
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in SUPPORTED_ARCHITECTURES:
            raise BuildError(
                f"unsupported architecture {arch!r}",
                f"supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}",
            )
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise BuildError(f"unsupported hidden_act {act!r}", "only SwiGLU (silu) is implemented")
        # Sliding-window attention would silently change results on long prompts.
        if cfg.get("use_sliding_window") or (
            arch == "MistralForCausalLM" and cfg.get("sliding_window") not in (None, 0)
            and cfg["sliding_window"] < cfg.get("max_position_embeddings", 0)
        ):
            raise BuildError(
                "sliding-window attention is not implemented",
                "use a checkpoint without sliding_window (or set it to null in config.json)",
            )
        if cfg.get("mlp_bias"):
            raise BuildError("unsupported option mlp_bias=true", "only bias-free MLPs are implemented")
        rope = _rope_config(cfg)
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            architecture=arch,
            model_type=cfg.get("model_type", ""),
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v bias; Llama and Mistral have it when attention_bias is set.
            qkv_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
            rope=rope,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    def tp_heads(self, tp: int) -> tuple[int, int]:
        """(query heads, KV heads) over all ranks once laid out for `tp` ranks.

        KV heads split evenly when tp divides them and replicate when they divide tp.
        Otherwise (SmolLM2's 3 KV heads at TP=2) zero heads are appended: a dummy KV head
        with its query group, whose zero query and output-projection weights contribute
        exactly nothing, so every rank holds the same shapes and runs the same program.
        """
        q, kv = self.num_attention_heads, self.num_key_value_heads
        if q % tp == 0 and (kv % tp == 0 or tp % kv == 0):
            return q, kv
        padded_kv = -(-kv // tp) * tp
        return padded_kv * (q // kv), padded_kv

    def check_tp(self, tp: int) -> None:
        """Raise BuildError if this model cannot be split `tp` ways."""
        if tp > self.num_attention_heads:
            raise BuildError(
                f"--tp {tp} exceeds the {self.num_attention_heads} attention heads",
                f"choose a --tp of at most {self.num_attention_heads}",
            )
        for what, n in (("vocabulary size", self.vocab_size), ("intermediate size", self.intermediate_size)):
            if n % tp:
                raise BuildError(
                    f"--tp {tp} does not divide the {what} ({n})",
                    f"choose a --tp that divides {n}",
                )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        d = dict(d)
        d["rope"] = RopeConfig(**d["rope"])
        d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
        return cls(**d)


def _rope_config(cfg: dict[str, Any]) -> RopeConfig:
    # transformers 5 moved rope_theta into rope_parameters; accept both spellings.
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in _SUPPORTED_ROPE_TYPES:
        raise BuildError(
            f"unsupported RoPE scaling type {rope_type!r}",
            f"supported: {', '.join(_SUPPORTED_ROPE_TYPES)}",
        )
    if rope_type == "default":
        return RopeConfig(theta=float(theta))
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(params["factor"]),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
    )
