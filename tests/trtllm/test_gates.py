"""TensorRT-LLM gates (serve/backends/trtllm.py) in this process, one rank (our Comm of size 1):
each compatibility mismatch fails its gate with a one-line cause and what to rebuild."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import ModuleType

import pytest

from runtime.dist.comm import Comm
from serve.backends.trtllm import Constructed, TrtllmServing
from serve.gates import GateFailure, GateLog
from serve.launch import LaunchConfig
from serve.stages import GateContext
from serve.startup import Startup


def _run_gates(engine: Path, upto: str = "warmup", **launch: object) -> Startup:
    cfg = LaunchConfig(engine=engine, **launch)  # type: ignore[arg-type]
    st = Startup(GateContext(cfg, Comm(), GateLog()))
    try:
        st.run(until=upto)
    except GateFailure:
        _close(st)
        raise
    return st


def _close(st: Startup) -> None:
    b = st.value  # what the last gate that passed produced
    if not isinstance(b, (Constructed, TrtllmServing)):
        return
    if b.adapter is not None:
        b.adapter.shutdown()
    elif b.executor is not None:
        b.executor.shutdown()


def _fails(engine: Path, gate: str, *expected: str, **launch: object) -> str:
    with pytest.raises(GateFailure) as info:
        _close(_run_gates(engine, **launch))
    msg = str(info.value)
    assert info.value.gate == gate, msg
    assert "\n" not in msg and all(e in msg for e in expected), msg
    return msg


def _copy(engine: Path, dst: Path) -> Path:
    out = Path(shutil.copytree(engine, dst))
    for p in out.iterdir():
        p.chmod(0o644)
    return out


def test_all_gates_pass_and_golden_matches(trtllm_fake: ModuleType, engine_tp1: Path) -> None:
    st = _run_gates(engine_tp1, kv_cache_tokens=1024)
    try:
        ev = {g.name: g.evidence for g in st.log.gates}
        assert ev["warmup"]["golden"] == "8 greedy tokens, identical"
        assert [s["batch"] for s in ev["warmup"]["shapes"]] == [1, 4, 2, 1]
        assert ev["kernels"]["ranks"] == [{"rank": 0, "leader": True,
                                           "seconds": ev["kernels"]["construct_s"]}]
        assert ev["allocate"]["max_tokens"] == 1024 and ev["allocate"]["tokens"] == 1024
        assert ev["verify"]["files"] == ["rank0.engine", "config.json", "model_config.json"]
    finally:
        _close(st)


REBUILD = "rebuild the engine on this host: pipeline build"


@pytest.mark.parametrize(("env", "expected"), [
    ({"AOTLLM_GPU_SM": "sm_89", "FAKE_TRTLLM_SM": "8.9"},
     "the engine was built for a sm_90 GPU but this GPU is sm_89"),
    ({"FAKE_TRTLLM_VERSION": "1.2.1"},
     "the engine was built by TensorRT-LLM 1.2.0 but this host has TensorRT-LLM 1.2.1"),
    ({"FAKE_TENSORRT_VERSION": "10.14.1.48"},
     "the engine was built by TensorRT 10.13.0.35 but this host has TensorRT 10.14.1.48"),
])
def test_version_and_sm_mismatch_fail_compatible(trtllm_fake: ModuleType, engine_tp1: Path,
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 env: dict[str, str], expected: str) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    msg = _fails(engine_tp1, "compatible", expected, REBUILD, "--backend trtllm --tp 1")
    if "AOTLLM_GPU_SM" in env:
        assert "--target sm_89" in msg  # rebuild for the GPU that is here


def test_world_size_mismatch_fails_compatible(trtllm_fake: ModuleType, engine_tp2: Path) -> None:
    _fails(engine_tp2, "compatible", "the engine was built for TP=2 but mpirun started 1 rank(s)",
           f"mpirun -n 2 serve launch --engine {engine_tp2}", "--backend trtllm --tp 1")


def test_missing_tensorrt_llm_fails_compatible(engine_tp1: Path) -> None:
    with pytest.raises(ImportError):
        import tensorrt_llm  # noqa: F401
    _fails(engine_tp1, "compatible", "TensorRT-LLM is not installed here",
           "pip install '.[trtllm]'", "NVIDIA GPU")


def test_sm_mismatch_unseen_by_torch_fails_kernels(trtllm_fake: ModuleType, engine_tp1: Path,
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   capfd: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("AOTLLM_GPU_SM", raising=False)
    monkeypatch.setenv("FAKE_TRTLLM_SM", "8.9")  # the GPU differs; only TensorRT can tell
    _fails(engine_tp1, "kernels", "could not construct the Executor",
           "Failed to deserialize cuda engine", "built for sm_90", "rebuild it here")
    assert "expecting compute 9.0 got compute 8.9" in capfd.readouterr().err  # TensorRT's log


def test_corrupt_engine_fails_verify(trtllm_fake: ModuleType, engine_tp1: Path,
                                     tmp_path: Path) -> None:
    eng = _copy(engine_tp1, tmp_path / "eng")
    data = (eng / "rank0.engine").read_bytes()
    (eng / "rank0.engine").write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    _fails(eng, "verify", "rank0.engine does not match the manifest's sha256",
           f"pipeline verify {eng}")


def test_golden_mismatch_fails_warmup(trtllm_fake: ModuleType, engine_tp1: Path,
                                      tmp_path: Path) -> None:
    eng = _copy(engine_tp1, tmp_path / "eng")
    m = json.loads((eng / "manifest.json").read_text())
    m["golden"]["tokens"][3] = (m["golden"]["tokens"][3] + 1) % 300
    (eng / "manifest.json").write_text(json.dumps(m))
    _fails(eng, "warmup", "the golden prompt gave", "the build recorded", warmup="none")


def test_too_small_kv_cache_fails_allocate(trtllm_fake: ModuleType, engine_tp1: Path) -> None:
    _fails(engine_tp1, "allocate", "--kv-cache-tokens 100 cannot hold one 256-token sequence",
           kv_cache_tokens=100)


def test_unknown_backend_is_refused_at_resolve(engine_tp1: Path, tmp_path: Path) -> None:
    eng = _copy(engine_tp1, tmp_path / "eng")
    m = json.loads((eng / "manifest.json").read_text())
    (eng / "manifest.json").write_text(json.dumps({**m, "backend": "onnx"}))
    _fails(eng, "resolve", "the engine's backend 'onnx' cannot be served", "--backend aoti")


def test_kv_cache_smaller_than_a_sequence_fails_warmup_naming_it(
        trtllm_fake: ModuleType, engine_tp1: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """TensorRT-LLM does not refuse a KV cache that cannot hold one max_seq_len sequence: it
    shrinks max_seq_len and max_input_len at construction, with a warning, and later rejects
    long prompts one by one. The warmup gate names the cache before any long prompt runs."""
    # 80 GiB x 5e-7 of a fraction = ~43 kB: ~160 tokens of this engine's KV at 256 B/token.
    msg = _fails(engine_tp1, "warmup", "the KV cache TensorRT-LLM allocated holds",
                 "less than one 256-token sequence", "--kv-cache-fraction",
                 kv_cache_fraction=5e-7)
    assert "exceeds maximum input length" not in msg
    err = capfd.readouterr().err
    assert "maxAttentionWindow and maxSequenceLen are too large" in err  # TensorRT-LLM's log


def test_release_tells_whether_the_executor_is_gone(trtllm_fake: ModuleType,
                                                    engine_tp1: Path) -> None:
    """The Executor is a nanobind class without weak references: release() must still tell
    an Executor it destroyed from one that something else keeps alive past MPI_Finalize."""
    import weakref

    from runtime.executors.trtllm_setup import construct_executor, kv_cache_config

    ex = construct_executor(engine_tp1, kv_cache_config(None, 1024))
    with pytest.raises(TypeError):
        weakref.ref(ex)
    ex.shutdown()
    backend = TrtllmServing.__new__(TrtllmServing)  # as after the kernels gate and close()
    backend.adapter, backend.executor = None, ex
    backend._executor_ref = None  # what the kernels gate kept before (weakref -> TypeError)
    holder = [ex]
    del ex
    assert backend.release() is False  # the list still holds it
    assert backend.executor is None
    backend.executor = holder.pop()
    assert backend.release() is True
