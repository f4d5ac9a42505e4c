"""pipeline.resolve and pipeline.gguf: what a checkpoint must be before any heavy work starts.

Local checkpoints with truncated or missing weights, hf:// parsing, an offline or unreachable
Hub (against a fake cache; no test ever talks to huggingface.co), and bad GGUF files. Every
refusal is one BuildError line with the right exit code: 2 for bad input, 1 for environment.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from contract.errors import EXIT_BAD_INPUT, EXIT_FAILURE, BuildError
from contract.manifest import hash_file
from pipeline.gguf import COMPLETE_MARKER
from pipeline.resolve import resolve
from tests.conftest import REPO, subprocess_env

SHA = "0123456789abcdef0123456789abcdef01234567"


def make_checkpoint(d: Path, shards: int = 1) -> Path:
    """A checkpoint as far as resolve looks: config.json and valid safetensors shards."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    if shards == 1:
        save_file({"w": torch.arange(64, dtype=torch.float32)}, str(d / "model.safetensors"))
        return d
    weight_map = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({f"w{i}": torch.ones(16)}, str(d / name))
        weight_map[f"w{i}"] = name
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return d


def _refusal(model: str | Path, cache: Path | None = None) -> BuildError:
    with pytest.raises(BuildError) as info:
        resolve(str(model), cache)
    err = info.value
    assert "\n" not in str(err) and str(err).startswith("error: ") and " — " in str(err)
    return err


# --- local directories ---


def test_a_good_local_checkpoint_resolves(tmp_path: Path) -> None:
    ck = make_checkpoint(tmp_path / "My Model!")
    src = resolve(str(ck))
    assert (src.kind, src.local_dir, src.revision, src.name) == ("local", ck, None, "My-Model")
    sharded = make_checkpoint(tmp_path / "sharded", shards=3)
    assert resolve(str(sharded)).local_dir == sharded


@pytest.mark.parametrize(("cut", "expect"), [
    (lambda b: b[:-100], "file not fully covered"),  # a download stopped short
    (lambda b: b + b"\0" * 8, "file not fully covered"),  # trailing bytes
    (lambda b: b[:6], "header too small"),
    (lambda b: b"", "header too small"),
    (lambda b: b[:40], "invalid header length"),  # the header itself is cut
    (lambda b: b[:8] + b"{" * (len(b) - 8), "invalid JSON in header"),
])
def test_a_truncated_or_corrupt_shard_is_named(tmp_path: Path, cut, expect: str) -> None:
    ck = make_checkpoint(tmp_path / "ck")
    w = ck / "model.safetensors"
    w.write_bytes(cut(w.read_bytes()))
    err = _refusal(ck)
    assert err.cause.startswith(f"{w} is not a valid safetensors file (") and expect in err.cause
    assert "truncated or corrupt" in err.remedy and err.exit_code == EXIT_BAD_INPUT


def test_one_bad_shard_of_many_is_named(tmp_path: Path) -> None:
    ck = make_checkpoint(tmp_path / "ck", shards=3)
    bad = ck / "model-00002-of-00003.safetensors"
    bad.write_bytes(bad.read_bytes()[:-1])
    assert _refusal(ck).cause.startswith(f"{bad} is not a valid safetensors file")


def test_missing_shards_named_by_the_index(tmp_path: Path) -> None:
    ck = make_checkpoint(tmp_path / "ck", shards=3)
    (ck / "model-00001-of-00003.safetensors").unlink()
    (ck / "model-00003-of-00003.safetensors").unlink()
    err = _refusal(ck)
    assert err.cause == (f"{ck} is missing weight shards named by model.safetensors.index.json: "
                         "model-00001-of-00003.safetensors, model-00003-of-00003.safetensors")
    assert err.exit_code == EXIT_BAD_INPUT


@pytest.mark.parametrize("index", [
    b"{not json", b"[]", b'{"weight_map": []}', b'{"weight_map": {"w": 3}}',
    b'{"weight_map": {"w": "../other/model.safetensors"}}', b'{"metadata": {}}',
    b"\xff\xfe\x00binary",
])
def test_a_bad_index_is_refused(tmp_path: Path, index: bytes) -> None:
    ck = make_checkpoint(tmp_path / "ck", shards=2)
    (ck / "model.safetensors.index.json").write_bytes(index)
    err = _refusal(ck)
    assert err.cause.startswith(f"{ck / 'model.safetensors.index.json'} is not a valid "
                                "safetensors index"), err.cause


@pytest.mark.parametrize(("setup", "expect"), [
    (lambda d: (d / "config.json").unlink(), "has no config.json"),
    (lambda d: (d / "config.json").write_text("{"), "config.json is not valid JSON"),
    (lambda d: (d / "config.json").write_bytes(b"\xff\xfe"), "config.json is not valid JSON"),
    (lambda d: (d / "model.safetensors").unlink(), "has no *.safetensors weights"),
    (lambda d: ((d / "model.safetensors").rename(d / "pytorch_model.bin")),
     "has no *.safetensors weights (found pytorch_model.bin, which is not supported)"),
])
def test_incomplete_checkpoints(tmp_path: Path, setup, expect: str) -> None:
    ck = make_checkpoint(tmp_path / "ck")
    setup(ck)
    err = _refusal(ck)
    assert expect in err.cause and err.exit_code == EXIT_BAD_INPUT


def test_not_a_directory(tmp_path: Path) -> None:
    assert "does not exist" in _refusal(tmp_path / "nope").cause
    (tmp_path / "file").write_text("x")
    assert "is a file, not a checkpoint directory" in _refusal(tmp_path / "file").cause


# --- hf:// ---


def fake_hf_cache(cache: Path, repo: str = "org/tiny", refs: dict[str, str] | None = None) -> Path:
    """The Hub cache layout snapshot_download reads offline: refs/<branch> holds a commit sha,
    snapshots/<sha>/ the files."""
    base = cache / f"models--{repo.replace('/', '--')}"
    snap = make_checkpoint(base / "snapshots" / SHA)
    for ref, sha in (refs if refs is not None else {"main": SHA}).items():
        (base / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (base / "refs" / ref).write_text(sha)
    return snap


@pytest.fixture
def offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return cache


@pytest.mark.parametrize("uri", [
    "hf://org/tiny", "hf://org/tiny@main", f"hf://org/tiny@{SHA}", "hf://org/tiny@refs/pr/1",
])
def test_offline_resolves_from_the_cache(offline: Path, uri: str) -> None:
    snap = fake_hf_cache(offline, refs={"main": SHA, "refs/pr/1": SHA})
    src = resolve(uri)
    assert (src.kind, src.local_dir, src.revision, src.name, src.uri) == ("hf", snap, SHA, "tiny", uri)


@pytest.mark.parametrize("uri", [
    "hf://org", "hf://org/", "hf:///tiny", "hf://org/tiny/extra", "hf://org/tiny@",
    "hf://../tiny", "hf://org/..", "hf://org/na--me", "hf://org/na..me", "hf://-org/tiny",
    "hf://org/tiny.", "hf://org/ti ny", "hf://org/tiny@../../etc", "hf://org/tiny@/abs",
    "hf://org/tiny@main/", "hf://org/tiny@a@b", "hf://org/" + "x" * 97,
])
def test_unparsable_hf_uris_are_bad_input(offline: Path, uri: str) -> None:
    fake_hf_cache(offline)
    err = _refusal(uri)
    assert err.cause.startswith(f"cannot parse {uri!r}"), err.cause
    assert err.exit_code == EXIT_BAD_INPUT


def test_offline_and_not_cached_is_an_environment_failure(offline: Path) -> None:
    err = _refusal("hf://org/absent@v1")
    assert err.cause == (f"org/absent@v1 is not in the local Hugging Face cache ({offline}) and "
                         "HF_HUB_OFFLINE forbids downloading it")
    assert err.exit_code == EXIT_FAILURE
    fake_hf_cache(offline)  # the repo is cached, this branch is not
    err = _refusal("hf://org/tiny@v2")
    assert err.cause.startswith("org/tiny@v2 is not in the local Hugging Face cache")
    assert err.exit_code == EXIT_FAILURE


def test_a_truncated_shard_in_the_hub_cache_is_named(offline: Path) -> None:
    snap = fake_hf_cache(offline)
    w = snap / "model.safetensors"
    w.write_bytes(w.read_bytes()[:-3])
    err = _refusal("hf://org/tiny")
    assert err.cause.startswith(f"{w} is not a valid safetensors file")


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cli(*args: str, env: dict[str, str] | None = None, timeout: float = 120):
    return subprocess.run([sys.executable, "-m", "pipeline", *args], cwd=REPO,
                          env={**subprocess_env(), **(env or {})}, capture_output=True, text=True,
                          timeout=timeout)


def _one_line_error(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and " — " in last, stderr
    return last


def test_an_unreachable_hub_is_an_environment_failure(tmp_path: Path) -> None:
    """Online, with nothing listening where the Hub should be (HF_ENDPOINT on a closed local
    port): exit 1, and the message says the network failed, not that downloads are off."""
    endpoint = f"http://127.0.0.1:{_closed_port()}"
    env = {"HF_ENDPOINT": endpoint, "HF_HUB_CACHE": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "0",
           "AOT_LLM_CACHE": str(tmp_path / "c"), "HF_HUB_ETAG_TIMEOUT": "5"}
    r = _cli("build", "hf://org/tiny@main", "--tp", "1", "--backend", "eager",
             "--store", str(tmp_path / "store"), env=env)
    assert r.returncode == EXIT_FAILURE, r.stderr
    last = _one_line_error(r.stderr)
    assert last.startswith(f"error: cannot reach {endpoint} to download org/tiny@main"), last
    assert not (tmp_path / "store").exists()


def test_hf_errors_from_the_command_line(tmp_path: Path) -> None:
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hf")}
    r = _cli("build", "hf://../x", "--tp", "1", "--store", str(tmp_path / "s"), env=env)
    assert r.returncode == EXIT_BAD_INPUT
    assert _one_line_error(r.stderr).startswith("error: cannot parse 'hf://../x'")
    r = _cli("build", "hf://org/tiny", "--tp", "1", "--store", str(tmp_path / "s"), env=env)
    assert r.returncode == EXIT_FAILURE
    assert "HF_HUB_OFFLINE forbids downloading it" in _one_line_error(r.stderr)


# --- GGUF ---


def _gguf_cache_entries(cache: Path) -> list[str]:
    d = cache / "gguf"
    return sorted(p.name for p in d.iterdir()) if d.is_dir() else []


@pytest.mark.parametrize(("content", "expect"), [
    (None, "does not exist"),
    (b"", "is not a GGUF file (bad magic b'')"),
    (b"GGU", "is not a GGUF file (bad magic b'GGU')"),
    (b"PK\x03\x04 a zip, not a gguf", "is not a GGUF file (bad magic b'PK\\x03\\x04')"),
])
def test_a_bad_gguf_is_refused_before_any_work(tmp_path: Path, content: bytes | None,
                                               expect: str) -> None:
    f = tmp_path / "model.gguf"
    if content is not None:
        f.write_bytes(content)
    err = _refusal(f, tmp_path / "cache")
    assert expect in err.cause and err.exit_code == EXIT_BAD_INPUT
    assert _gguf_cache_entries(tmp_path / "cache") == []


# A process that dies (SIGKILL) while dequantizing: it leaves its locked staging directory.
_DEQUANTIZE_AND_DIE = """
import sys, time
from pathlib import Path
from pipeline.store import staging_dir
with staging_dir(Path(sys.argv[1]), "model-0123456789abcdef") as tmp:
    (tmp / "model.safetensors").write_bytes(b"x" * 4096)
    print(tmp, flush=True)
    time.sleep(300)
"""


def test_a_gguf_with_a_good_magic_and_bad_body(tmp_path: Path) -> None:
    """A truncated GGUF gets as far as the dequantizer, which refuses it in one line and leaves
    nothing in the cache; what an earlier, killed dequantization left is removed on the way."""
    cache = tmp_path / "cache"
    (cache / "gguf").mkdir(parents=True)
    proc = subprocess.Popen([sys.executable, "-c", _DEQUANTIZE_AND_DIE, str(cache / "gguf")],
                            cwd=REPO, env=subprocess_env(), stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    leftover = Path(proc.stdout.readline().strip())
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert leftover.is_dir() and leftover.name.startswith(".tmp-model-0123456789abcdef-")
    f = tmp_path / "model.gguf"
    f.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 10)
    t0 = time.perf_counter()
    err = _refusal(f, cache)
    assert err.cause.startswith(f"cannot read GGUF file {f}: "), err.cause
    assert err.exit_code == EXIT_BAD_INPUT
    assert _gguf_cache_entries(cache) == [], os.listdir(cache / "gguf")
    assert time.perf_counter() - t0 < 60



def test_a_gguf_cache_hit_also_removes_killed_leftovers(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    (cache / "gguf").mkdir(parents=True)
    f = tmp_path / "model.gguf"
    f.write_bytes(b"GGUF\x03\x00\x00\x00 already dequantized once")
    done = make_checkpoint(cache / "gguf" / f"model-{hash_file(f)[:16]}")
    (done / COMPLETE_MARKER).write_text("{}")
    proc = subprocess.Popen([sys.executable, "-c", _DEQUANTIZE_AND_DIE, str(cache / "gguf")],
                            cwd=REPO, env=subprocess_env(), stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    leftover = Path(proc.stdout.readline().strip())
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert leftover.is_dir()
    src = resolve(str(f), cache)
    assert (src.kind, src.local_dir, src.revision) == ("gguf", done, f"sha256:{hash_file(f)}")
    assert _gguf_cache_entries(cache) == [done.name]
