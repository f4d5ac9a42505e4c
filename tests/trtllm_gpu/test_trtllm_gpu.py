"""First run on a GPU host (`make test-trtllm`): a tiny Llama through the real TensorRT-LLM.

For TP=1 and TP=2 (two GPUs): `pipeline build --backend trtllm` (conversion, engine build,
golden run under mpirun), the golden tokens checked against transformers, `serve launch` on
its own (it starts mpirun), readiness, one greedy completion checked against transformers,
SIGTERM, a clean drain, exit 0 on every rank.

Never run in this repository's CI, which has neither a GPU nor TensorRT-LLM: it is written
against the same documented API as the backend and is the check a GPU user runs first.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO, make_tiny_checkpoint, subprocess_env
from tests.trtllm_gpu.conftest import gpus

pytestmark = [pytest.mark.trtllm_gpu, pytest.mark.usefixtures("gpu_host")]

MAX_SEQ_LEN = 256
NEW_TOKENS = 8
# A greedy token is accepted when transformers' logit for it is within this of the maximum:
# a random tiny model can have near-ties that float32 kernels order differently.
TIE = 1e-3


def _checkpoint(root: Path) -> Path:
    """A random Llama small enough to build in seconds, with head_dim 64 (TensorRT-LLM's
    attention kernels' common size), a real tokenizer, float32 weights."""
    from tests.unit.test_detok import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    vocab = len(tok) + len(tok) % 2
    out = make_tiny_checkpoint(root / "tiny-llama", "llama", seed=1, vocab_size=vocab,
                               hidden_size=256, intermediate_size=512, num_attention_heads=4,
                               num_key_value_heads=2, num_hidden_layers=2,
                               max_position_embeddings=1024, rope_scaling=None)
    tok.save_pretrained(out)
    return out


def _hf_check(ckpt: Path, prompt: list[int], got: list[int]) -> None:
    """Every token TensorRT-LLM chose is transformers' greedy choice (up to a near-tie)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt, torch_dtype=torch.float32).eval()
    ids = torch.tensor([prompt + got])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1: len(prompt) - 1 + len(got)]
    for i, tok in enumerate(got):
        best = float(logits[i].max())
        assert float(logits[i, tok]) >= best - TIE * max(1.0, abs(best)), (
            f"token {i}: TensorRT-LLM chose {tok}, transformers {int(logits[i].argmax())} "
            f"(logits {float(logits[i, tok]):.5f} vs {best:.5f}); all: {got}")


def _hf_greedy(ckpt: Path, prompt: list[int], n: int) -> tuple[list[int], int]:
    """transformers' greedy tokens, and how many of them precede the first near-tie."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt, torch_dtype=torch.float32).eval()
    seq, safe = list(prompt), None
    for i in range(n):
        with torch.no_grad():
            logits = model(torch.tensor([seq])).logits[0, -1]
        top2 = torch.topk(logits, 2).values
        if safe is None and float(top2[0] - top2[1]) < TIE * max(1.0, abs(float(top2[0]))):
            safe = i
        seq.append(int(logits.argmax()))
    return seq[len(prompt):], n if safe is None else safe


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _checkpoint(tmp_path_factory.mktemp("trtllm-gpu"))


@pytest.mark.parametrize("tp", [1, 2])
def test_build_serve_compare_drain(tp: int, ckpt: Path, tmp_path: Path) -> None:
    if gpus() < tp:
        pytest.skip(f"TP={tp} needs {tp} GPUs; torch sees {gpus()}")
    env = subprocess_env()

    # 1. Build: conversion, engine build, golden run (under mpirun when tp > 1).
    build = subprocess.run(
        [sys.executable, "-m", "pipeline", "build", str(ckpt), "--backend", "trtllm",
         "--tp", str(tp), "--dtype", "float32", "--max-batch-size", "4",
         "--max-num-tokens", "256", "--max-seq-len", str(MAX_SEQ_LEN), "--tokens-per-block",
         "32", "--store", str(tmp_path / "engines")],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=3600)
    assert build.returncode == 0, build.stderr[-4000:]
    engine = Path(build.stdout.strip().splitlines()[-1])
    assert not (tmp_path / "model.cache").exists()  # the timing cache stayed in staging
    manifest = json.loads((engine / "manifest.json").read_text())
    golden = manifest["golden"]
    _hf_check(ckpt, golden["prompt_token_ids"], golden["tokens"])

    # 2. Serve it as a user would: `serve launch` on its own starts mpirun -n TP.
    port, run = _free_port(), tmp_path / "run"
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "serve", "launch", "--engine", str(engine), "--port", str(port),
         "--run-dir", str(run), "--kv-cache-fraction", "0.2", "--drain-timeout", "30"],
        env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 900
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-4000:]
            try:
                if _get(url + "/health/ready") == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "not ready after 900 s"
            time.sleep(1)

        # 3. One greedy completion, compared with transformers on the same prompt ids.
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(engine)
        prompt = "the quick brown fox"
        out = _post(url + "/v1/completions", {"model": manifest["model_name"], "prompt": prompt,
                                              "max_tokens": NEW_TOKENS, "temperature": 0,
                                              "ignore_eos": True})
        text = out["choices"][0]["text"]
        want, safe = _hf_greedy(ckpt, tok(prompt, add_special_tokens=True)["input_ids"],
                                NEW_TOKENS)
        assert text.startswith(tok.decode(want[:safe], skip_special_tokens=True)), (text, want)
        assert out["usage"]["completion_tokens"] == NEW_TOKENS

        # 4. Drain: SIGTERM, as an orchestrator would; every rank exits 0.
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        log.close()
    serve_log = (tmp_path / "serve.log").read_text()
    assert rc == 0, serve_log[-4000:]
    assert [(run / f"rank{r}.exit").read_text().strip() for r in range(tp)] == ["0"] * tp
    assert "MPI_FINALIZE" not in serve_log and "Traceback" not in serve_log
