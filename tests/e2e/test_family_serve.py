"""A tiny Gemma 3 (sliding and global layers, one KV head replicated on both ranks, (1 + w)
norms, GeGLU, scaled embeddings) built by `pipeline build` at TP=2 and served under
`mpirun -n 2`: its greedy completions, streamed and not, are exactly what transformers
generates in float32, over prompts that run past the sliding window."""

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

MODEL = "tiny-gemma3"
PROMPTS = ("The quick brown fox jumps over the lazy dog", "Grüße aus München, 1 2 3")


@pytest.fixture(scope="module")
def gemma3_engine(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("gemma3")
    checkpoint = make_served_checkpoint(root / MODEL, "gemma3", seed=5)
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline", "build", str(checkpoint), *BUILD_ARGS,
         "--store", str(root / "store")],
        cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return checkpoint, Path(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def gemma3_server(gemma3_engine: tuple[Path, Path],
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = launch(gemma3_engine[1], tmp_path_factory.mktemp("gemma3-server"))
    try:
        srv.wait_ready(timeout=300)
        yield srv
    finally:
        srv.close()


def test_a_served_gemma3_generates_what_transformers_does(
        gemma3_engine: tuple[Path, Path], gemma3_server: Server) -> None:
    checkpoint, engine = gemma3_engine
    assert read_manifest(engine).tp == 2
    reference = Reference(checkpoint, engine)
    client = gemma3_server.client()
    for prompt in PROMPTS:
        want = reference.completion(prompt, 24, ignore_eos=True)
        assert want.prompt_tokens + 24 > 4  # past the window of the sliding layer
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.choices[0].text == want.text, (prompt, r.choices[0].text, want.text)
        stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24,
                                           temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        texts = [c.choices[0].text for c in stream if c.choices]
        assert len(texts) > 2 and "".join(texts) == want.text, prompt
