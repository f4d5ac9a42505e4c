"""The model architecture as the engine sees it, read from a Hugging Face config.

Everything the runtime needs is validated here, once; an architecture or option we do
not implement is refused by name rather than silently mis-run.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from contract.errors import BuildError

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
    "Phi3ForCausalLM", "Gemma3ForCausalLM", "MixtralForCausalLM", "Qwen3MoeForCausalLM",
)
# Mixture-of-experts families: every layer's MLP is a routed set of experts (moe.py).
_MOE = ("MixtralForCausalLM", "Qwen3MoeForCausalLM")
_SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")
_SUPPORTED_ACTS = ("silu", "gelu_pytorch_tanh")
# Architectures whose config.json lists each layer's attention type ("sliding_attention" /
# "full_attention") and whose sliding windows we honour; Mistral's and Phi-3's cover every layer.
_LAYER_TYPED = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Gemma3ForCausalLM")
_EVERY_LAYER = ("MistralForCausalLM", "Phi3ForCausalLM", "MixtralForCausalLM", "Qwen3MoeForCausalLM")
# transformers drops these families' window unless `use_sliding_window` switches it on.
_WINDOW_SWITCHED = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")


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
    # What the families beyond Llama add (runtime/models/llama.py reads them; the defaults
    # are Llama's, so engines written before they existed read as they were built).
    hidden_act: str = "silu"  # the MLP's gate: SwiGLU (silu) or GeGLU (gelu_pytorch_tanh)
    qk_norm: bool = False  # an RMSNorm over head_dim on every q and k head (Qwen3, Gemma 3)
    norm_offset: float = 0.0  # RMSNorm scales by (offset + w): Gemma's norms are (1 + w)
    sandwich_norms: bool = False  # Gemma: norms after attention and around the MLP too
    embed_scale: float = 1.0  # Gemma: the embeddings times sqrt(hidden)
    query_pre_attn_scalar: float | None = None  # attention scale^-2 when not head_dim
    sliding_windows: tuple[int, ...] = ()  # per layer, keys a query sees (0: all); () all 0
    rope_local: RopeConfig | None = None  # the sliding layers' RoPE when it differs (Gemma 3)
    # Mixture of experts (Mixtral, Qwen3-MoE): every layer's MLP is `num_experts` SwiGLU
    # experts of `moe_intermediate_size`, `num_experts_per_tok` of them weighted per token by
    # the router's softmax (renormalised over the chosen ones with `norm_topk_prob`). 0: dense.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise BuildError(
                f"num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})",
                "the checkpoint's config.json is inconsistent; fix or re-export it",
            )
        if self.num_experts and not (0 < self.num_experts_per_tok <= self.num_experts
                                     and self.moe_intermediate_size > 0):
            raise BuildError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must be in 1..num_experts "
                f"({self.num_experts}) and moe_intermediate_size "
                f"({self.moe_intermediate_size}) positive",
                "the checkpoint's config.json is inconsistent; fix or re-export it",
            )

    @property
    def moe(self) -> bool:
        """Every layer's MLP is a mixture of experts (runtime/models/moe.py)."""
        return self.num_experts > 0

    @property
    def dense_mlp(self) -> bool:
        return self.num_experts == 0

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelConfig:
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in SUPPORTED_ARCHITECTURES:
            raise BuildError(
                f"unsupported architecture {arch!r}",
                f"supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}",
            )
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
        if act not in _SUPPORTED_ACTS:
            raise BuildError(f"unsupported hidden_act {act!r}",
                             f"supported: {', '.join(_SUPPORTED_ACTS)}")
        if cfg.get("mlp_bias"):
            raise BuildError("unsupported option mlp_bias=true", "only bias-free MLPs are implemented")
        _refuse_unsupported(arch, cfg)
        moe = _moe_fields(arch, cfg)
        gemma = arch == "Gemma3ForCausalLM"
        rope_params = cfg.get("rope_parameters") or {}
        if gemma and "full_attention" in rope_params:  # transformers 5: one dict a layer type
            rope = _rope_config(cfg, rope_params["full_attention"])
            rope_local = _rope_config(cfg, rope_params.get("sliding_attention") or {})
        elif gemma:  # transformers 4 spelling: rope_theta (global), rope_local_base_freq
            rope = _rope_config(cfg)
            rope_local = RopeConfig(theta=float(cfg.get("rope_local_base_freq", 10000.0)))
        else:
            rope, rope_local = _rope_config(cfg), None
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
            hidden_act=act,
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM"),
            norm_offset=1.0 if gemma else 0.0,
            sandwich_norms=gemma,
            embed_scale=float(cfg["hidden_size"]) ** 0.5 if gemma else 1.0,
            query_pre_attn_scalar=(float(cfg.get("query_pre_attn_scalar", 256)) if gemma else None),
            sliding_windows=_sliding_windows(arch, cfg),
            rope_local=rope_local,
            **moe,
        )

    @property
    def attn_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

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
        # An MoE model runs no dense MLP: its experts' intermediate size is what is split.
        inter = ("expert intermediate size", self.moe_intermediate_size) if self.moe else (
            "intermediate size", self.intermediate_size)
        for what, n in (("vocabulary size", self.vocab_size), inter):
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
        d["sliding_windows"] = tuple(d.get("sliding_windows", ()))
        if d.get("rope_local") is not None:
            d["rope_local"] = RopeConfig(**d["rope_local"])
        return cls(**d)

    def window(self, layer: int) -> int:
        """Keys a query of `layer` attends (itself and the window - 1 before it); 0: all."""
        return self.sliding_windows[layer] if self.sliding_windows else 0


def _refuse_unsupported(arch: str, cfg: dict[str, Any]) -> None:
    """Options of the newer families that would silently change results: refused by name."""
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(key) is not None:
            raise BuildError(f"unsupported option {key}={cfg[key]}",
                             "logit soft-capping is not implemented (Gemma 3 has none)")
    if cfg.get("use_bidirectional_attention"):
        raise BuildError("unsupported option use_bidirectional_attention=true",
                         "only causal decoders are implemented")
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    prf = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if float(prf) != 1.0:
        raise BuildError(f"unsupported partial_rotary_factor {prf}",
                         "only RoPE over the whole head is implemented")


def _moe_fields(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """The ModelConfig fields of a mixture-of-experts family (none for a dense one).

    Mixtral renormalises the top-k softmax weights always; Qwen3-MoE when `norm_topk_prob`
    (transformers' default: not). Qwen3-MoE layers that keep a dense MLP
    (`decoder_sparse_step` above 1, `mlp_only_layers`) are refused: no released checkpoint
    has them and every layer of our decoder is the same kind."""
    if arch not in _MOE:
        return {}
    if arch == "MixtralForCausalLM":
        return dict(num_experts=cfg["num_local_experts"], num_experts_per_tok=cfg["num_experts_per_tok"],
                    moe_intermediate_size=cfg["intermediate_size"], norm_topk_prob=True)
    step = cfg.get("decoder_sparse_step", 1)
    if step != 1:
        raise BuildError(f"unsupported option decoder_sparse_step={step}",
                         "only Qwen3-MoE models whose every layer is sparse (step 1) are implemented")
    if cfg.get("mlp_only_layers"):
        raise BuildError(f"unsupported option mlp_only_layers={cfg['mlp_only_layers']}",
                         "only Qwen3-MoE models whose every layer is sparse are implemented")
    # transformers 5 writes num_local_experts (num_experts is its alias); released configs num_experts.
    n = cfg.get("num_experts") or cfg.get("num_local_experts")
    if not n:
        raise BuildError("Qwen3-MoE config without num_experts",
                         "a dense Qwen3 checkpoint is Qwen3ForCausalLM")
    return dict(num_experts=n, num_experts_per_tok=cfg["num_experts_per_tok"],
                moe_intermediate_size=cfg["moe_intermediate_size"],
                norm_topk_prob=bool(cfg.get("norm_topk_prob", False)))


def _sliding_windows(arch: str, cfg: dict[str, Any]) -> tuple[int, ...]:
    """Each layer's window (0: global), or () where no layer has one."""
    n, window = cfg["num_hidden_layers"], cfg.get("sliding_window") or 0
    if arch in _WINDOW_SWITCHED and not cfg.get("use_sliding_window"):
        window = 0  # transformers' Qwen2/3 configs drop the window unless it is switched on
    if window >= cfg.get("max_position_embeddings", window + 1):
        window = 0  # no position can see past it (Mistral v0.2+ configs: our kernels run)
    if not window or arch not in (*_LAYER_TYPED, *_EVERY_LAYER):
        return ()
    if arch in _EVERY_LAYER:
        windows = (window,) * n
    else:
        types = cfg.get("layer_types")
        if types is None and arch == "Gemma3ForCausalLM":  # transformers 4: every 6th global
            pattern = cfg.get("sliding_window_pattern", 6)
            types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                     for i in range(n)]
        if types is None:  # Qwen2/3 before layer_types: sliding from max_window_layers on
            start = cfg.get("max_window_layers", n) if cfg.get("use_sliding_window") else n
            types = ["sliding_attention" if i >= start else "full_attention" for i in range(n)]
        windows = tuple(window if t == "sliding_attention" else 0 for t in types)
    return windows if any(windows) else ()


def _rope_config(cfg: dict[str, Any], params: dict[str, Any] | None = None) -> RopeConfig:
    # transformers 5 moved rope_theta into rope_parameters; accept both spellings.
    if params is None:
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
    if rope_type == "linear":
        return RopeConfig(theta=float(theta), rope_type=rope_type, factor=float(params["factor"]))
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(params["factor"]),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
    )
