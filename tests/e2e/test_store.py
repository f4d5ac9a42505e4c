"""Engines in a real object store: SeaweedFS's S3 gateway on loopback (tests/conftest.py).

`pipeline push` / `pipeline pull` / `pipeline list`, a tag moved by a second push, and the
failures a replica meets: a corrupted object, a missing shard, refused credentials, an
endpoint nobody answers on, a store that dies in the middle of a read. Every failure is one
line on stderr naming the object and the cause. Serving from s3:// is in test_store_serve.py.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from contract.manifest import read_manifest
from contract.refs import engine_key
from runtime.store.objstore import ObjectStore, StoreError
from tests.conftest import REPO, subprocess_env
from tests.e2e.conftest import BUILD_ARGS, MODEL


def pipeline(*args: str, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pipeline", *args], cwd=REPO,
                          env={**subprocess_env(), **env}, capture_output=True, text=True,
                          timeout=timeout)


def one_line_error(proc: subprocess.CompletedProcess[str]) -> str:
    """The CLI's failure: exit 1, no traceback, one `error:` line on stderr."""
    assert proc.returncode == 1, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, proc.stderr
    return errors[0]


@pytest.fixture(scope="module")
def other_engine(served_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A second engine of the same model (TP=1): what a tag moves to."""
    store = tmp_path_factory.mktemp("store-tp1")
    args = list(BUILD_ARGS)
    args[args.index("--tp") + 1] = "1"
    proc = subprocess.run([sys.executable, "-m", "pipeline", "build", str(served_checkpoint),
                           *args, "--store", str(store)], cwd=REPO, env=subprocess_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return Path(proc.stdout.strip().splitlines()[-1])


def test_push_pull_list_and_tag_move(engine_dir: Path, other_engine: Path, s3_env: dict[str, str],
                                     tmp_path: Path) -> None:
    store = "s3://engines/push-pull"
    m, m2 = read_manifest(engine_dir), read_manifest(other_engine)
    assert m.engine_id != m2.engine_id

    first = pipeline("push", str(engine_dir), store, "--tag", "prod", env=s3_env)
    assert first.returncode == 0, first.stderr
    assert f"{store}/{MODEL}/{m.engine_id}" in first.stdout
    again = pipeline("push", str(engine_dir), store, env=s3_env)
    assert again.returncode == 0 and "nothing uploaded" in again.stdout, again.stdout

    cache = tmp_path / "cache"
    pulled = pipeline("pull", f"{store}/{MODEL}@prod", "--cache", str(cache), env=s3_env)
    assert pulled.returncode == 0, pulled.stderr
    out = Path(pulled.stdout.strip().splitlines()[-1])
    assert out == cache / MODEL / m.engine_id
    for f in m.files:  # every file, byte for byte, and the manifest (written last)
        assert (out / f.path).read_bytes() == (engine_dir / f.path).read_bytes(), f.path
    assert (out / "manifest.json").read_bytes() == (engine_dir / "manifest.json").read_bytes()
    # The cached engine is an engine directory: `pipeline verify` accepts it.
    assert pipeline("verify", str(out), env=s3_env).returncode == 0

    # A second push with the same tag moves it; engines by id stay where they are.
    moved = pipeline("push", str(other_engine), store, "--tag", "prod", env=s3_env)
    assert moved.returncode == 0, moved.stderr
    repull = pipeline("pull", f"{store}/{MODEL}@prod", "--cache", str(cache), env=s3_env)
    assert repull.returncode == 0, repull.stderr
    assert Path(repull.stdout.strip().splitlines()[-1]).name == m2.engine_id
    by_id = pipeline("pull", f"{store}/{MODEL}/{m.engine_id}", "--cache", str(cache), env=s3_env)
    assert by_id.returncode == 0 and "fetched   0 B" in by_id.stdout, by_id.stdout

    listing = pipeline("list", "--store", store, env=s3_env)
    rows = {ln.split()[1]: ln for ln in listing.stdout.splitlines()[1:]}
    assert set(rows) == {m.engine_id, m2.engine_id}
    assert rows[m2.engine_id].split()[-1] == "prod" and rows[m.engine_id].split()[-1] == "-"


def _push_copy(engine_dir: Path, store: str, env: dict[str, str]) -> ObjectStore:
    proc = pipeline("push", str(engine_dir), store, "--tag", "t", env=env)
    assert proc.returncode == 0, proc.stderr
    return ObjectStore(store)


def test_corrupted_object_is_named(engine_dir: Path, s3_env: dict[str, str], tmp_path: Path
                                   ) -> None:
    store_uri = "s3://engines/corrupt"
    m = read_manifest(engine_dir)
    store = _push_copy(engine_dir, store_uri, s3_env)
    key = engine_key(MODEL, m.engine_id, "rank1.safetensors")
    data = bytearray((engine_dir / "rank1.safetensors").read_bytes())
    data[-1] ^= 0xFF  # same size, one bit pattern off: only the hash can tell
    store.put(key, bytes(data))
    line = one_line_error(pipeline("pull", f"{store_uri}/{MODEL}@t", "--cache",
                                   str(tmp_path / "c"), env=s3_env))
    assert f"{store_uri}/{key}" in line and "does not match the manifest's sha256" in line, line
    # Nothing unverified reaches the cache under its final name, and no manifest commits it.
    assert not (tmp_path / "c" / MODEL / m.engine_id / "manifest.json").exists()
    assert not (tmp_path / "c" / MODEL / m.engine_id / "rank1.safetensors").exists()


def test_missing_shard_is_named(engine_dir: Path, s3_env: dict[str, str], tmp_path: Path) -> None:
    store_uri = "s3://engines/missing"
    m = read_manifest(engine_dir)
    store = _push_copy(engine_dir, store_uri, s3_env)
    key = engine_key(MODEL, m.engine_id, "rank0.safetensors")
    store.delete(key)
    line = one_line_error(pipeline("pull", f"{store_uri}/{MODEL}/{m.engine_id}", "--cache",
                                   str(tmp_path / "c"), env=s3_env))
    assert f"{store_uri}/{key}" in line and "no such object" in line, line


def test_refused_credentials_and_unknown_tag(engine_dir: Path, s3_env: dict[str, str],
                                             tmp_path: Path) -> None:
    bad = {**s3_env, "AWS_SECRET_ACCESS_KEY": "not-the-secret"}
    line = one_line_error(pipeline("push", str(engine_dir), "s3://engines/creds", env=bad))
    assert "refused the credentials" in line and "AWS_SECRET_ACCESS_KEY" in line, line
    line = one_line_error(pipeline("pull", f"s3://engines/creds/{MODEL}@nope", "--cache",
                                   str(tmp_path), env=s3_env))
    assert f"s3://engines/creds/{MODEL}/tags/nope" in line and "no such object" in line, line


def test_unreachable_endpoint_gives_up_at_the_deadline(tmp_path: Path) -> None:
    from tests.e2e.harness import free_port

    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}", "AWS_ACCESS_KEY_ID": "x",
           "AWS_SECRET_ACCESS_KEY": "y", "AWS_REGION": "us-east-1",
           "AOTLLM_STORE_DEADLINE_S": "3"}
    line = one_line_error(pipeline("pull", f"s3://engines/x/{MODEL}@prod", "--cache",
                                   str(tmp_path), env=env))
    assert "unreachable" in line and env["AWS_ENDPOINT_URL"] in line, line
    assert f"s3://engines/x/{MODEL}/tags/prod" in line, line


def test_store_dying_mid_read_ends_the_read(tmp_path: Path) -> None:
    """A store of its own, killed (SIGKILL) once the first part of a ranged read has landed:
    the read fails as unreachable within its deadline instead of hanging."""
    from demo.seaweed import SeaweedS3

    with SeaweedS3(tmp_path / "dying") as s3, pytest.MonkeyPatch.context() as mp:
        for k, v in s3.env().items():
            mp.setenv(k, v)
        store = ObjectStore("s3://dying/x", deadline=3.0)
        size = 4 << 20
        store.put("blob", bytes(range(256)) * (size // 256))
        landed: list[int] = []

        def sink(offset: int, data: object) -> None:
            if not landed:
                s3.kill()
            landed.append(offset)

        t0 = time.monotonic()
        with pytest.raises(StoreError) as err:
            store.read_parts("blob", size, sink, part=64 << 10, concurrency=2)
        elapsed = time.monotonic() - t0
    assert err.value.kind == "unreachable", err.value
    assert "s3://dying/x/blob" in str(err.value)
    assert 0 < len(landed) < size // (64 << 10)  # it stopped early, not after every part
    assert elapsed < 60, elapsed  # bounded by the deadline (with retries), not a hang


def test_store_server_takes_fresh_ports_when_one_is_taken(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The fixture's server: a listener that takes one of its ports between the check and
    weed's bind makes weed exit; the server starts again on fresh ports instead of failing."""
    import socket

    import demo.seaweed as seaweed

    with socket.socket() as busy:
        busy.bind((seaweed.HOST, 0))
        busy.listen()
        draws: list[list[int]] = []
        free_ports = seaweed._free_ports

        def first_draw_taken(n: int) -> list[int]:
            ports = free_ports(n)
            if not draws:
                ports[-1] = busy.getsockname()[1]  # the S3 gateway's port
            draws.append(ports)
            return ports

        monkeypatch.setattr(seaweed, "_free_ports", first_draw_taken)
        with seaweed.SeaweedS3(tmp_path / "ports") as s3:
            assert len(draws) == 2
            assert s3.port == draws[1][-1] != busy.getsockname()[1]
            for k, v in s3.env().items():
                monkeypatch.setenv(k, v)
            ObjectStore("s3://ports/x").put("ping", b"1")  # it serves
