"""Tiny models of the newer families built by `pipeline build` at TP=2 and served under
`mpirun -n 2`: their greedy completions, streamed and not, are exactly what transformers
generates in float32. Gemma 3 (sliding and global layers, one KV head replicated on both
ranks, (1 + w) norms, GeGLU, scaled embeddings) over prompts that run past the sliding
window; Qwen3 (q/k norms, explicit head_dim); Phi-3 (fused qkv and gate_up cut for TP, a
sliding window on every layer); Mixtral and Qwen3-MoE (4 experts, top 2, each expert split
over both ranks)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from contract.manifest import read_manifest
from tests.conftest import REPO, make_served_checkpoint, subprocess_env
from tests.e2e.conftest import BUILD_ARGS, Reference
from tests.e2e.harness import Server, launch

PROMPTS = ("The quick brown fox jumps over the lazy dog", "Grüße aus München, 1 2 3")


@pytest.fixture(scope="module", params=["gemma3", "qwen3", "phi3", "mixtral", "qwen3_moe"])
def family_engine(request: pytest.FixtureRequest,
                  tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    kind = request.param
    root = tmp_path_factory.mktemp(kind)
    checkpoint = make_served_checkpoint(root / f"tiny-{kind}", kind, seed=5)
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline", "build", str(checkpoint), *BUILD_ARGS,
         "--store", str(root / "store")],
        cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return checkpoint, Path(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def family_server(family_engine: tuple[Path, Path],
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = launch(family_engine[1], tmp_path_factory.mktemp(f"{family_engine[0].name}-server"))
    try:
        srv.wait_ready(timeout=300)
        yield srv
    finally:
        srv.close()


def test_a_served_family_generates_what_transformers_does(
        family_engine: tuple[Path, Path], family_server: Server) -> None:
    checkpoint, engine = family_engine
    model = checkpoint.name
    assert read_manifest(engine).tp == 2
    reference = Reference(checkpoint, engine)
    client = family_server.client()
    for prompt in PROMPTS:
        want = reference.completion(prompt, 24, ignore_eos=True)
        assert want.prompt_tokens + 24 > 4  # past the window of Gemma 3's sliding layer
        r = client.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.choices[0].text == want.text, (prompt, r.choices[0].text, want.text)
        stream = client.completions.create(model=model, prompt=prompt, max_tokens=24,
                                           temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        texts = [c.choices[0].text for c in stream if c.choices]
        assert len(texts) > 2 and "".join(texts) == want.text, prompt
