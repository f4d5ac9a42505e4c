"""A quantized aoti engine served for real: `pipeline build --quant int4_wo` at TP=2, then
`mpirun -n 2 python -m serve launch`; the gates report the scheme (compatible: the kernels
that run it; warmup: the golden record the quantized engine produced, checked at the
scheme's tolerance), `pipeline inspect` shows it, and greedy completions are exactly what
transformers generates on the dequantized weights."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from contract.layout import QPANEL_LAYOUTS
from contract.manifest import read_manifest
from tests.conftest import REPO, subprocess_env
from tests.e2e.conftest import MODEL, Reference
from tests.e2e.harness import Server, assert_a_flipped_byte_fails_the_verify_gate, launch
from tests.runtime.test_quant_engine import _dequantized_checkpoint

# A small hidden size under a larger vocabulary slice: the golden prefill all-gathers a
# logits row per token (35 x 128 local vocab x 4 B), more than 64 tokens of hidden 64; the
# shared-memory slots must be sized for the logits too (kernels.slot_bytes_for).
BUILD = ("--tp", "2", "--backend", "aoti", "--dtype", "float32", "--quant", "int4_wo",
         "--quant-group-size", "32", "--max-seq-len", "256", "--max-num-tokens", "64",
         "--max-batch-size", "16")


@pytest.fixture(scope="module")
def int4_engine(served_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    store = tmp_path_factory.mktemp("qstore")
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline", "build", str(served_checkpoint), *BUILD,
         "--store", str(store)],
        cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return Path(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def int4_server(int4_engine: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = launch(int4_engine, tmp_path_factory.mktemp("qserver"))
    try:
        srv.wait_ready(timeout=300)
        yield srv
    finally:
        srv.close()


def test_a_served_int4_engine_generates_what_transformers_does_on_its_weights(
        int4_engine: Path, int4_server: Server, served_checkpoint: Path, tmp_path: Path) -> None:
    m = read_manifest(int4_engine)
    assert m.quant.describe() == "int4_wo: linears int4 group 32; lm_head not quantized"
    out = subprocess.run([sys.executable, "-m", "pipeline", "inspect", str(int4_engine)],
                         cwd=REPO, env=subprocess_env(), capture_output=True, text=True).stdout
    assert "int4_wo: linears int4 group 32" in out, out

    gates = {g["name"]: g["evidence"] for g in int4_server.call("GET", "/v1/engine").json()["gates"]}
    op = "linear_qpanel" if m.weight_layout in QPANEL_LAYOUTS else "linear_int4"
    assert f"aotllm::{op}" in str(gates["compatible"]["quant"]), gates["compatible"]
    assert "int4_wo" in gates["warmup"]["golden"], gates["warmup"]
    # A CPU engine's two programs (contract/layout.py DECODE_PROGRAM), both verified before
    # use; the golden steps ran on the decode program, one prompt just too long for it
    # warmed the step program.
    kernels, verified = gates["kernels"], gates["verify"]["files"]
    assert kernels["package"] == "rank0.aoti", kernels
    assert kernels["decode_program"] == {"package": "rank0.decode.aoti", "max_tokens": 16}
    assert any(f.startswith("rank0.decode.aoti/") and f.endswith(".so") for f in verified)
    warm = gates["warmup"]["step_program"]
    assert warm["shape"] == "prefill 17 tokens" and warm["ms"] > 0, warm

    exact = _dequantized_checkpoint(served_checkpoint, m.quant, tmp_path / "deq")
    reference = Reference(exact, int4_engine)
    for prompt in ("The quick brown fox", "Grüße aus München, 1 2 3"):
        want = reference.completion(prompt, 8, ignore_eos=True)
        r = int4_server.client().completions.create(
            model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
            extra_body={"ignore_eos": True})
        assert r.choices[0].text == want.text, (prompt, r.choices[0].text, want.text)


def test_a_flipped_byte_in_the_decode_program_fails_the_verify_gate(
        int4_engine: Path, tmp_path: Path) -> None:
    """The second program of a rank only runs steps of a few tokens: it is verified before
    use like everything else the rank loads."""
    assert_a_flipped_byte_fails_the_verify_gate(int4_engine, "rank1.decode.aoti", 4096, tmp_path)
