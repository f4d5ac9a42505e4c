"""Speculative decoding with a draft engine through the HTTP server (issue #36):
`serve launch --speculative draft:DIR:4` on the session's TP=2 engine, the draft a TP=1
int4_wo build of the same checkpoint (self-speculation) run on rank 0. Greedy answers are
transformers' exactly, drafts are counted on /metrics, the drafter and its gates'
evidence on /v1/engine. `pipeline build --speculative draft:...` records the draft by path
and engine id; a draft engine that cannot draft is refused in one line, naming the cause
and the remedy, at build, at launch and at the compatible gate."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from contract.manifest import read_manifest
from contract.speculative import Speculative
from runtime.executors.draft import DraftEngineError, check_draft, open_draft, vocab_hashes
from runtime.store.checkpoint import load_engine_model_config
from tests.conftest import REPO, subprocess_env
from tests.e2e.conftest import MAX_SEQ_LEN, MODEL, Reference
from tests.e2e.harness import Server, launch
from tests.e2e.test_serve_spec import PROMPT, counter

TARGET_ARGS = ("--tp", "1", "--backend", "eager", "--dtype", "float32",
               "--max-seq-len", str(MAX_SEQ_LEN), "--max-num-tokens", "128",
               "--max-batch-size", "16")
DRAFT_ARGS = (*TARGET_ARGS, "--quant", "int4_wo", "--quant-group-size", "32")


def build(checkpoint: Path, store: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pipeline", "build", str(checkpoint), *args,
                           "--store", str(store)], cwd=REPO, env=subprocess_env(),
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def draft_dir(served_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    proc = build(served_checkpoint, tmp_path_factory.mktemp("draft-store"), *DRAFT_ARGS)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return Path(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def draft_server(engine_dir: Path, draft_dir: Path,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = launch(engine_dir, tmp_path_factory.mktemp("spec-draft"),
                 args=("--speculative", f"draft:{draft_dir}:4"))
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.close()


def test_greedy_completions_equal_transformers_with_a_draft_engine(
        draft_server: Server, draft_dir: Path, reference: Reference) -> None:
    client = draft_server.client()
    for prompt, n in ((PROMPT, 40), ("The quick brown fox", 24), ("hello", 30)):
        want = reference.completion(prompt, n)
        got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=n,
                                        temperature=0)
        assert got.choices[0].text == want.text, prompt
        assert got.choices[0].finish_reason == want.finish_reason
    # a sampled request decodes one token at a time and still answers
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8,
                                    temperature=0.8, seed=1)
    assert got.usage is not None and got.usage.completion_tokens >= 1
    page = draft_server.metrics()
    drafted = counter(page, "llmserve_spec_decode_num_draft_tokens_total")
    accepted = counter(page, "llmserve_spec_decode_num_accepted_tokens_total")
    assert 0 < accepted <= drafted
    report = draft_server.call("GET", "/v1/engine").json()
    spec = report["speculative"]
    assert (spec["drafter"], spec["from"]) == (f"draft:{draft_dir}:4", "--speculative")
    assert spec["policy"]["policy"] == "adaptive"
    # the draft's evidence at the gates that check, size, load and warm it
    gates = {g["name"]: g["evidence"] for g in report["gates"]}
    assert gates["compatible"]["draft"]["engine_id"] == draft_dir.name
    assert gates["allocate"]["draft"]["blocks"] > 0
    assert gates["kernels"]["draft"]["verified"] is True
    assert gates["warmup"]["draft"]["tokens"] == 4


def test_build_records_the_draft_and_refuses_a_bad_one(
        served_checkpoint: Path, engine_dir: Path, draft_dir: Path, tmp_path: Path) -> None:
    proc = build(served_checkpoint, tmp_path / "s1", *TARGET_ARGS,
                 "--speculative", f"draft:{draft_dir}:3")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    spec = read_manifest(Path(proc.stdout.strip().splitlines()[-1])).speculative
    assert spec == Speculative("draft", 3, engine=str(draft_dir.resolve()),
                               engine_id=draft_dir.name)
    for bad, why in ((engine_dir, "TP=2"), (tmp_path / "nothing", "no manifest.json")):
        proc = build(served_checkpoint, tmp_path / "s2", *TARGET_ARGS,
                     "--speculative", f"draft:{bad}:3")
        assert proc.returncode != 0
        assert why in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]


def test_launch_refuses_a_bad_draft_engine_in_one_line(engine_dir: Path,
                                                       tmp_path: Path) -> None:
    for bad, why in ((engine_dir, "is TP=2"), (tmp_path / "nothing", "no manifest.json")):
        proc = subprocess.run([sys.executable, "-m", "serve", "launch", "--engine",
                               str(engine_dir), "--speculative", f"draft:{bad}:4"],
                              cwd=REPO, env=subprocess_env(), capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 2
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and why in lines[0] and "--speculative" in lines[0], lines


def test_a_draft_of_another_vocabulary_or_tokenizer_is_refused(engine_dir: Path,
                                                               draft_dir: Path) -> None:
    target = read_manifest(engine_dir)
    cfg = load_engine_model_config(engine_dir)
    path, dm, dcfg = open_draft(Speculative("draft", 4, engine=str(draft_dir)))
    kw = dict(device=target.target.device, vocab_size=cfg.vocab_size, vocab=vocab_hashes(target))
    check_draft(dm, dcfg, path, 4, **kw)  # type: ignore[arg-type]  # the same checkpoint: fine
    with pytest.raises(DraftEngineError, match="vocabulary"):
        check_draft(dm, dataclasses.replace(dcfg, vocab_size=dcfg.vocab_size + 2), path, 4,
                    **kw)  # type: ignore[arg-type]
    with pytest.raises(DraftEngineError, match=r"tokenizer\.json differs"):
        check_draft(dm, dcfg, path, 4, **{**kw, "vocab": {"tokenizer.json": "0" * 64}})  # type: ignore[arg-type]
    with pytest.raises(DraftEngineError, match="K=15"):
        check_draft(dataclasses.replace(dm, profile=dataclasses.replace(
            dm.profile, max_num_tokens=8, max_batch_size=4)), dcfg, path, 15, **kw)  # type: ignore[arg-type]
    with pytest.raises(DraftEngineError, match=r"not the"):
        open_draft(Speculative("draft", 4, engine=str(draft_dir), engine_id="0" * 16))
