"""End-to-end fixtures: one TP=2 engine per session, served under a real `mpirun -n 2`.

Server start-ups dominate the run time (10-20 s each on two cores), so one healthy server
is shared by the API tests; the lifecycle tests launch their own, one per scenario.
The reference for every output is Hugging Face transformers on the same checkpoint.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoTokenizer

from serve.startup import GATE_DELAY_ENV
from tests.conftest import REPO, subprocess_env
from tests.e2e.harness import Server, launch
from tests.runtime.hf_reference import hf_model

MODEL = "tiny-chat"  # the checkpoint's directory name, which becomes the engine's model name
MAX_SEQ_LEN = 256
BUILD_ARGS = ("--tp", "2", "--backend", "eager", "--dtype", "float32",
              "--max-seq-len", str(MAX_SEQ_LEN), "--max-num-tokens", "128",
              "--max-batch-size", "16")


@pytest.fixture(scope="session")
def engine_dir(served_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    store = tmp_path_factory.mktemp("store")
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline", "build", str(served_checkpoint), *BUILD_ARGS,
         "--store", str(store)],
        cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    engine = Path(proc.stdout.strip().splitlines()[-1])
    assert (engine / "manifest.json").is_file(), proc.stdout
    return engine


@dataclass(frozen=True)
class Expected:
    """transformers' greedy continuation of one prompt, as the API should report it."""

    prompt_tokens: int
    tokens: tuple[int, ...]  # generated ids, the eos id included when it was generated
    text: str
    finish_reason: str


class Reference:
    """Greedy generation with transformers (float32), the eos the server uses included."""

    def __init__(self, checkpoint: Path, engine: Path) -> None:
        self.checkpoint = checkpoint
        self.tok = AutoTokenizer.from_pretrained(engine)  # the tokenizer files served
        self.eos: int = self.tok.eos_token_id

    def completion_ids(self, prompt: str) -> list[int]:
        return list(self.tok(prompt, add_special_tokens=True)["input_ids"])

    def chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        out = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                           return_dict=False)
        if isinstance(out, Mapping):
            out = out["input_ids"]
        return [int(t) for t in out]

    def completion(self, prompt: str, max_tokens: int, ignore_eos: bool = False) -> Expected:
        return self.greedy(tuple(self.completion_ids(prompt)), max_tokens, ignore_eos)

    def chat(self, messages: list[dict[str, str]], max_tokens: int) -> Expected:
        return self.greedy(tuple(self.chat_ids(messages)), max_tokens)

    @cache  # noqa: B019 - one Reference per session; the cache is meant to live as long
    def greedy(self, prompt: tuple[int, ...], max_tokens: int, ignore_eos: bool = False
               ) -> Expected:
        eos = None if ignore_eos else self.eos
        # One thread: with the servers' processes on the same two cores, two threads make
        # this tiny model's generate ~15x slower (the threads wait for each other).
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            with torch.inference_mode():
                out = hf_model(str(self.checkpoint)).generate(
                    torch.tensor([prompt]),
                    attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                    max_new_tokens=max_tokens, do_sample=False, eos_token_id=eos,
                    pad_token_id=self.eos,
                )
        finally:
            torch.set_num_threads(threads)
        tokens = tuple(out[0, len(prompt):].tolist())
        stopped = eos is not None and tokens[-1] == eos
        text = self.tok.decode([t for t in tokens if ignore_eos or t != self.eos],
                               skip_special_tokens=True, clean_up_tokenization_spaces=False)
        return Expected(len(prompt), tokens, text, "stop" if stopped else "length")


@pytest.fixture(scope="session")
def reference(served_checkpoint: Path, engine_dir: Path) -> Reference:
    return Reference(served_checkpoint, engine_dir)


@pytest.fixture(scope="session")
def server(engine_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The shared healthy TP=2 server; its start-up probes are in `server.history`.

    The tiny engine's gates pass in well under the second the HTTP layer takes to come up
    on its thread: held at the kernels and the warmup gates (a few seconds in all), the
    probes see start-up progress gate by gate however fast or loaded the machine is."""
    srv = launch(engine_dir, tmp_path_factory.mktemp("server"),
                 env={GATE_DELAY_ENV: "kernels:3,warmup:2"})
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.close()


def usage_of(obj: Any) -> tuple[int, int]:
    return obj.usage.prompt_tokens, obj.usage.completion_tokens
