"""`serve launch --engine s3://...`: a real `mpirun -n 2` job reading its engine from a real
S3 server (SeaweedFS on loopback). The tag is resolved to an engine id once (rank 0) and
reported; each rank reads its own shard from the store (hashed while it lands) and fills
the cache, so the next start by engine id needs no store at all. A corrupted shard in the
store stops the start at the verify gate with the object's URL.
"""

from __future__ import annotations

from pathlib import Path

from contract.manifest import read_manifest
from contract.refs import engine_key
from runtime.store.objstore import ObjectStore
from tests.e2e.conftest import MODEL, Reference
from tests.e2e.harness import free_port, launch, run_to_exit
from tests.e2e.test_store import pipeline

PROMPT = "The capital of France is"


def _gate(report: dict, name: str) -> dict:
    return next(g for g in report["gates"] if g["name"] == name)["evidence"]


def test_serve_from_store_then_from_cache(engine_dir: Path, reference: Reference,
                                          s3_env: dict[str, str], tmp_path: Path) -> None:
    store = "s3://engines/serve"
    m = read_manifest(engine_dir)
    assert pipeline("push", str(engine_dir), store, "--tag", "prod", env=s3_env).returncode == 0
    cache = tmp_path / "cache"
    expected = reference.completion(PROMPT, 8, ignore_eos=True)

    srv = launch(f"{store}/{MODEL}@prod", tmp_path / "remote",
                 args=("--engine-cache", str(cache)), env=s3_env)
    try:
        srv.wait_ready(180)
        report = srv.call("GET", "/v1/engine").json()
        assert report["engine"]["engine_id"] == m.engine_id
        resolve = _gate(report, "resolve")
        assert (resolve["tag"], resolve["engine_id"]) == ("prod", m.engine_id)
        assert report["engine"]["resolved_from"] == f"{store}/{MODEL}@prod"
        for ld in report["load"]:  # each rank read its own shard from the store
            assert ld["from"] == "store", ld
            assert ld["object"] == f"{store}/{engine_key(MODEL, m.engine_id)}/rank{ld['rank']}.safetensors"
            assert ld["floor"] == "store_read_gbps" and ld["floors"]["store_read_gbps"] > 0
        out = srv.call("POST", "/v1/completions", {"model": MODEL, "prompt": PROMPT,
                                                   "max_tokens": 8, "ignore_eos": True,
                                                   "temperature": 0}).json()
        assert out["choices"][0]["text"] == expected.text
        assert f"serving engine {MODEL}/{m.engine_id} from {store}/{MODEL}@prod" in srv.logs(20000)
    finally:
        srv.close()
    cached = cache / MODEL / m.engine_id
    assert (cached / "manifest.json").read_bytes() == (engine_dir / "manifest.json").read_bytes()
    assert pipeline("verify", str(cached), env=s3_env).returncode == 0

    # The second start, by engine id, with the store unreachable: everything from the cache.
    dead = {**s3_env, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}"}
    srv = launch(f"{store}/{MODEL}/{m.engine_id}", tmp_path / "cached",
                 args=("--engine-cache", str(cache)), env=dead)
    try:
        srv.wait_ready(180)
        report = srv.call("GET", "/v1/engine").json()
        assert _gate(report, "resolve")["manifest_from"] == "cache"
        assert {ld["from"] for ld in report["load"]} == {"cache"}
        out = srv.call("POST", "/v1/completions", {"model": MODEL, "prompt": PROMPT,
                                                   "max_tokens": 8, "ignore_eos": True,
                                                   "temperature": 0}).json()
        assert out["choices"][0]["text"] == expected.text
    finally:
        srv.close()


def test_corrupted_shard_in_store_fails_the_start(engine_dir: Path, s3_env: dict[str, str],
                                                  tmp_path: Path) -> None:
    store_uri = "s3://engines/serve-corrupt"
    m = read_manifest(engine_dir)
    assert pipeline("push", str(engine_dir), store_uri, "--tag", "t", env=s3_env).returncode == 0
    key = engine_key(MODEL, m.engine_id, "rank1.safetensors")
    data = bytearray((engine_dir / "rank1.safetensors").read_bytes())
    data[len(data) // 2] ^= 0x01
    ObjectStore(store_uri).put(key, bytes(data))
    srv, rc = run_to_exit(f"{store_uri}/{MODEL}@t", tmp_path, 2, timeout=180, env=s3_env)
    assert rc != 0
    err = srv.stderr()
    assert "Traceback" not in err, err
    assert f"{store_uri}/{key}" in err and "sha256" in err, err


def test_missing_shard_in_store_fails_the_start(engine_dir: Path, s3_env: dict[str, str],
                                                tmp_path: Path) -> None:
    """Rank 1's shard deleted after the push: rank 1 stops at its load gate naming the
    object, and the whole job exits (rank 0 reads its own shard, present, first)."""
    store_uri = "s3://engines/serve-missing"
    m = read_manifest(engine_dir)
    assert pipeline("push", str(engine_dir), store_uri, "--tag", "t", env=s3_env).returncode == 0
    key = engine_key(MODEL, m.engine_id, "rank1.safetensors")
    ObjectStore(store_uri).delete(key)
    srv, rc = run_to_exit(f"{store_uri}/{MODEL}@t", tmp_path, 2, timeout=180, env=s3_env)
    assert rc != 0
    err = srv.stderr()
    assert "Traceback" not in err, err
    assert f"{store_uri}/{key}: no such object" in err, err
