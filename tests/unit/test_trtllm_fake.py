"""The TensorRT-LLM contract fake follows shared/reference/tensorrt-llm-1.2-api.md.

Each test names the rule of the reference it checks; the fake is only as useful as it is
faithful, so these tests are the fake's contract with the reference.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

_FAKES = Path(__file__).resolve().parents[1] / "fakes"
_spec = importlib.util.spec_from_file_location("trtllm_fake_helper", _FAKES / "conftest_helper.py")
assert _spec is not None and _spec.loader is not None
_helper = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_helper)
trtllm_fake = _helper.trtllm_fake

SEC = timedelta(seconds=5)
VOCAB = 1000


_hf_dir = _helper.tiny_hf_dir
_convert = _helper.convert_checkpoint
_build = _helper.build_engine


@pytest.fixture
def engine(trtllm_fake: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """TP1 engine whose toy rule is next = last + 1 (FAKE_TRTLLM_TOY=1,1,1)."""
    monkeypatch.setenv("FAKE_TRTLLM_TOY", "1,1,1")
    _convert(_hf_dir(tmp_path), tmp_path / "ckpt", tp=1)
    return _build(tmp_path / "ckpt", tmp_path / "engine", max_batch_size=8,
                  max_num_tokens=512)


def _executor(engine: Path, **cfg: Any) -> Any:
    from tensorrt_llm.bindings import executor as ex

    return ex.Executor(str(engine), ex.ModelType.DECODER_ONLY, ex.ExecutorConfig(**cfg))


def _run(executor: Any, req: Any) -> list[Any]:
    """All responses of one request, up to the final one."""
    rid = executor.enqueue_request(req)
    out: list[Any] = []
    while not out or not (out[-1].has_error() or out[-1].result.is_final):
        got = executor.await_responses(rid, timeout=SEC)
        assert got, "no response within 5 s"
        out += got
    return out


# -- api_surface ---------------------------------------------------------------------------
def test_fake_matches_api_surface(trtllm_fake: ModuleType) -> None:
    import api_surface

    assert api_surface.check_fake() == []


def test_surface_check_reports_drift(trtllm_fake: ModuleType, monkeypatch: pytest.MonkeyPatch
                                     ) -> None:
    import api_surface
    from tensorrt_llm.bindings import executor as ex

    monkeypatch.setattr(ex.Executor, "cancel_request", lambda self, request_id=0: None)
    monkeypatch.setattr(ex.Executor, "pause", lambda self: None, raising=False)
    problems = "\n".join(api_surface.check_fake())
    assert "Executor.cancel_request" in problems and "'pause'" in problems


def test_check_call_uses_reference_signatures(trtllm_fake: ModuleType) -> None:
    import api_surface as s

    X = "tensorrt_llm.bindings.executor"
    s.check_call(f"{X}.Request", [1, 2], 8, streaming=True, end_id=2)
    with pytest.raises(s.SurfaceError, match="max_tokens"):
        s.check_call(f"{X}.Request", [1, 2], max_new_tokens=8)
    with pytest.raises(s.SurfaceError):
        s.check_call(f"{X}.Request", [1], 8, True)  # streaming is keyword-only
    s.check_call_shape("tensorrt_llm.Mapping", 0, ("world_size", "rank", "tp_size", "pp_size"))
    with pytest.raises(s.SurfaceError):
        s.check_call_shape("tensorrt_llm.Mapping", 4)  # Mapping(world_size, tp, pp, rank)
    s.check_call(f"{X}.Executor.await_responses", 3, timeout=SEC)
    s.check_call(f"{X}.Executor.await_responses", timeout=SEC)
    with pytest.raises(s.SurfaceError):
        s.check_call(f"{X}.Executor.await_responses", id=3)
    with pytest.raises(s.SurfaceError, match=r"not in the TensorRT-LLM 1\.2 reference"):
        s.check_call(f"{X}.Executor.pause")
    assert not s.entry("tensorrt_llm.models.PretrainedConfig.from_checkpoint").documented
    assert not s.entry("tensorrt_llm.LLM").faked


# -- checkpoint conversion and build (§1.1-§1.3) -----------------------------------------
def test_mapping_keyword_only_and_validated(trtllm_fake: ModuleType) -> None:
    Mapping = trtllm_fake.Mapping
    with pytest.raises(TypeError):
        Mapping(2, 2, 1, 0)
    assert Mapping(2, 1, tp_size=2).rank == 1  # the second positional argument is rank
    with pytest.raises(ValueError):
        Mapping(world_size=2, rank=0, tp_size=1, pp_size=1)
    with pytest.raises(ValueError):
        Mapping(world_size=2, rank=2, tp_size=2, pp_size=1)


def test_checkpoint_layout(trtllm_fake: ModuleType, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    _convert(_hf_dir(tmp_path), ckpt, tp=2)
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "config.json", "rank0.safetensors", "rank1.safetensors"]
    cfg = json.loads((ckpt / "config.json").read_text())
    for key in ("architecture", "dtype", "logits_dtype", "vocab_size", "max_position_embeddings",
                "hidden_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "hidden_act", "intermediate_size", "norm_epsilon",
                "position_embedding_type", "quantization"):
        assert key in cfg
    assert cfg["dtype"] == "bfloat16" and cfg["logits_dtype"] == "float32"
    assert cfg["mapping"]["world_size"] == 2 and cfg["mapping"]["tp_size"] == 2


def test_conversion_rejects_bad_input(trtllm_fake: ModuleType, tmp_path: Path) -> None:
    from tensorrt_llm.models import LLaMAForCausalLM

    with pytest.raises(ValueError, match="architecture"):
        LLaMAForCausalLM.from_hugging_face(_hf_dir(tmp_path, architectures=["GPT2LMHead"]),
                                           "auto")
    (tmp_path / "hf" / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError):
        LLaMAForCausalLM.from_hugging_face(_hf_dir(tmp_path) / "missing", "auto")
    with pytest.raises(TypeError):  # the HF directory is positional
        LLaMAForCausalLM.from_hugging_face(model_dir=str(tmp_path), dtype="auto")


def test_engine_layout_and_build_defaults(trtllm_fake: ModuleType, tmp_path: Path) -> None:
    from tensorrt_llm.builder import get_engine_version

    _convert(_hf_dir(tmp_path), tmp_path / "ckpt", tp=2)
    out = _build(tmp_path / "ckpt", tmp_path / "eng", max_input_len=4096)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "rank0.engine",
                                                     "rank1.engine"]
    cfg = json.loads((out / "config.json").read_text())
    assert set(cfg) == {"version", "pretrained_config", "build_config"}
    bc = cfg["build_config"]
    assert bc["max_seq_len"] == 512 and bc["max_input_len"] == 512  # clipped to max_seq_len
    assert bc["kv_cache_type"] == "paged" and bc["opt_num_tokens"] == 2048  # KVCacheType.PAGED
    assert bc["plugin_config"]["use_paged_context_fmha"] is True
    assert get_engine_version(out) == cfg["version"] == trtllm_fake.__version__


def test_engine_config_written_by_rank0_only(trtllm_fake: ModuleType, tmp_path: Path) -> None:
    import copy

    from tensorrt_llm.builder import build
    from tensorrt_llm.models import MODEL_MAP, PretrainedConfig

    _convert(_hf_dir(tmp_path), tmp_path / "ckpt", tp=2)
    cfg = PretrainedConfig.from_checkpoint(tmp_path / "ckpt")
    cfg = copy.deepcopy(cfg)
    cfg.set_rank(1)
    model = MODEL_MAP[cfg.architecture].from_checkpoint(str(tmp_path / "ckpt"), config=cfg)
    bc = trtllm_fake.BuildConfig(output_timing_cache=str(tmp_path / "timing.cache"))
    build(model, bc).save(str(tmp_path / "eng"))
    assert [p.name for p in (tmp_path / "eng").iterdir()] == ["rank1.engine"]


def test_build_config_rules(trtllm_fake: ModuleType, engine: Path) -> None:
    from tensorrt_llm.builder import build
    from tensorrt_llm.models import MODEL_MAP, PretrainedConfig
    from tensorrt_llm.plugin import PluginConfig

    BuildConfig = trtllm_fake.BuildConfig
    assert BuildConfig.model_fields["max_batch_size"].default == 2048
    with pytest.raises(ValueError):
        BuildConfig(max_batch_sz=8)  # unknown field
    with pytest.raises(TypeError):
        BuildConfig(8)  # keyword-only
    ckpt = engine.parent / "ckpt"
    model = MODEL_MAP["LlamaForCausalLM"].from_checkpoint(
        str(ckpt), config=PretrainedConfig.from_checkpoint(ckpt))
    bc = BuildConfig(opt_num_tokens=64, plugin_config=PluginConfig(multiple_profiles=True))
    with pytest.raises(RuntimeError):
        build(model, bc)


def test_trtllm_build_cli(trtllm_fake: ModuleType, tmp_path: Path) -> None:
    import api_surface
    from tensorrt_llm.commands.build import parse_arguments

    _convert(_hf_dir(tmp_path), tmp_path / "ckpt", tp=2)
    env = _helper.subprocess_env()
    base = ["trtllm-build", "--checkpoint_dir", str(tmp_path / "ckpt"), "--output_dir",
            str(tmp_path / "eng")]
    done = subprocess.run([*base, "--gemm_plugin", "auto", "--kv_cache_type", "paged",
                           "--use_paged_context_fmha", "enable", "--multiple_profiles", "enable",
                           "--workers", "2"], env=env, capture_output=True, text=True,
                          cwd=tmp_path)  # its timing cache defaults to ./model.cache
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in (tmp_path / "eng").iterdir()) == [
        "config.json", "rank0.engine", "rank1.engine"]
    bc = json.loads((tmp_path / "eng" / "config.json").read_text())["build_config"]
    assert bc["plugin_config"]["gemm_plugin"] == "auto"
    assert bc["plugin_config"]["multiple_profiles"] is True
    assert (tmp_path / "model.cache").is_file()
    bad = subprocess.run([*base, "--tp_size", "2"], env=env, capture_output=True, text=True,
                         cwd=tmp_path)
    assert bad.returncode != 0 and "--tp_size" in bad.stderr  # TP comes from the checkpoint
    for flag in api_surface.TRTLLM_BUILD_FLAGS:  # the fake's CLI accepts every documented flag
        if flag in ("--checkpoint_dir", "--model_config"):
            parse_arguments([flag, "x"])
            continue
        value = [] if flag in _STORE_TRUE else [_FLAG_VALUES.get(flag, "4")]
        parse_arguments(["--checkpoint_dir", "x", flag, *value])


_STORE_TRUE = ("--strip_plan", "--weight_streaming", "--fast_build", "--dry_run")
_FLAG_VALUES = {
    "--kv_cache_type": "paged", "--paged_kv_cache": "enable", "--context_fmha": "enable",
    "--remove_input_padding": "enable", "--use_paged_context_fmha": "enable",
    "--multiple_profiles": "enable", "--reduce_fusion": "enable", "--use_fused_mlp": "enable",
    "--gemm_plugin": "auto", "--gpt_attention_plugin": "auto", "--nccl_plugin": "auto",
}


# -- versions and portability (§1.4) -----------------------------------------------------
def test_versions_follow_environment(trtllm_fake: ModuleType, monkeypatch: pytest.MonkeyPatch
                                     ) -> None:
    import tensorrt

    monkeypatch.setenv("FAKE_TRTLLM_VERSION", "1.2.1")
    monkeypatch.setenv("FAKE_TENSORRT_VERSION", "10.14.1.48")
    assert trtllm_fake.__version__ == "1.2.1"
    assert tensorrt.__version__ == "10.14.1.48"


@pytest.mark.parametrize("env", [{}, {"FAKE_TRTLLM_VERSION": "1.2.1"},
                                 {"FAKE_TENSORRT_VERSION": "10.14.1.48"}])
def test_distribution_metadata_agrees_with_the_modules(env: dict[str, str]) -> None:
    """As pip leaves an install: importlib.metadata reports the version the module does,
    without importing it; `tensorrt` is provided by tensorrt_cu12_bindings beside a
    `tensorrt` meta-package of the same version (TensorRT 10's wheels)."""
    code = (
        "import importlib.metadata as md, json, sys\n"
        "seen = {m: md.version(m) for m in ('tensorrt_llm', 'tensorrt')}\n"
        "providers = md.packages_distributions().get('tensorrt')\n"
        "imported = [m for m in sys.modules if m.startswith('tensorrt')]\n"
        "import tensorrt, tensorrt_llm\n"
        "print(json.dumps([seen, providers, imported,\n"
        "                  [tensorrt_llm.__version__, tensorrt.__version__]]))\n"
    )
    base = {k: v for k, v in os.environ.items() if not k.startswith("FAKE_")}
    done = subprocess.run([sys.executable, "-c", code], env=_helper.subprocess_env({**base, **env}),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    seen, providers, imported, modules = json.loads(done.stdout)
    assert imported == [] and set(providers) == {"tensorrt_cu12_bindings"}
    assert [seen["tensorrt_llm"], seen["tensorrt"]] == modules
    for var, value in env.items():
        assert value in modules, var


@pytest.mark.parametrize(("var", "value", "logged"), [
    ("FAKE_TRTLLM_SM", "89",
     "generated on an incompatible device, expecting compute 9.0 got compute 8.9"),
    ("FAKE_TENSORRT_VERSION", "10.14.1.48",
     "not compatible with this version of TensorRT, expecting library version 10.13.0.35 got "
     "10.14.1.48"),
])
def test_engine_from_another_machine_fails_to_load(
    engine: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str],
    var: str, value: str, logged: str,
) -> None:
    monkeypatch.setenv(var, value)
    with pytest.raises(RuntimeError, match="Failed to deserialize cuda engine"):
        _executor(engine)
    err = capfd.readouterr().err
    assert f"[TRT] [E] 6: The engine plan file is {logged}, please rebuild." in err


def test_engine_from_another_trtllm_fails_to_load(engine: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_TRTLLM_VERSION", "1.2.1")
    with pytest.raises(RuntimeError, match=r"TensorRT-LLM 1\.2\.0, runtime is 1\.2\.1"):
        _executor(engine)


def test_old_format_config_and_world_size(trtllm_fake: ModuleType, engine: Path,
                                          tmp_path: Path) -> None:
    cfg = json.loads((engine / "config.json").read_text())
    (engine / "config.json").write_text(json.dumps(cfg["pretrained_config"]))
    with pytest.raises(RuntimeError, match="Invalid engine config"):
        _executor(engine)
    _convert(_hf_dir(tmp_path), tmp_path / "ckpt2", tp=2)
    tp2 = _build(tmp_path / "ckpt2", tmp_path / "tp2")
    with pytest.raises(RuntimeError) as info:
        _executor(tp2)  # one process, TP=2 engine: forgot mpirun
    assert str(info.value) == (  # executorImpl.cpp's words, exactly
        "[TensorRT-LLM][ERROR] Assertion failed: With communicationMode kLEADER, MPI worldSize "
        "is expected to be equal to tp*pp*cp when participantIds are not specified")


# -- Executor: requests and results (§2.1) -------------------------------------------------
def test_request_signature_rules(trtllm_fake: ModuleType) -> None:
    from tensorrt_llm.bindings import executor as ex

    with pytest.raises(TypeError):
        ex.Request([1, 2], max_new_tokens=4)
    with pytest.raises(TypeError):
        ex.Request([1, 2], 4, True)  # everything after max_tokens is keyword-only
    with pytest.raises(TypeError):
        ex.Request("hello", 4)  # token ids, not text
    with pytest.raises(TypeError):
        ex.Request([1], 4, stop_words=[7])  # a list of token-id lists
    req = ex.Request(input_token_ids=[1], max_tokens=4)
    with pytest.raises(AttributeError):
        req.max_new_tokens = 4  # type: ignore[attr-defined]


def test_non_streaming_includes_prompt_unless_excluded(engine: Path) -> None:
    from tensorrt_llm.bindings import executor as ex

    with _executor(engine) as e:
        (r,) = _run(e, ex.Request([5, 6, 7], 4, client_id=42))
        assert r.client_id == 42 and r.result.is_final
        assert r.result.output_token_ids == [[5, 6, 7, 8, 9, 10, 11]]  # next = last + 1
        assert r.result.finish_reasons == [ex.FinishReason.LENGTH]
        excl = ex.OutputConfig(exclude_input_from_output=True)
        (r,) = _run(e, ex.Request([5, 6, 7], 4, output_config=excl))
        assert r.result.output_token_ids == [[8, 9, 10, 11]]


def test_streaming_one_response_per_token(engine: Path) -> None:
    from tensorrt_llm.bindings import executor as ex

    with _executor(engine) as e:
        rs = _run(e, ex.Request([5, 6, 7], 3, streaming=True))
        assert [r.result.output_token_ids for r in rs] == [[[8]], [[9]], [[10]]]
        assert [r.result.is_final for r in rs] == [False, False, True]
        assert rs[-1].result.finish_reasons == [ex.FinishReason.LENGTH]
        rs = _run(e, ex.Request([5], 3, streaming=True, return_all_generated_tokens=True))
        assert [r.result.output_token_ids for r in rs] == [[[6]], [[6, 7]], [[6, 7, 8]]]


def test_end_id_and_stop_words(engine: Path) -> None:
    from tensorrt_llm.bindings import executor as ex

    FR = ex.FinishReason
    with _executor(engine) as e:
        (r,) = _run(e, ex.Request([5], 10, end_id=8, pad_id=0))
        assert r.result.output_token_ids == [[5, 6, 7]] and r.result.finish_reasons == [FR.END_ID]
        rs = _run(e, ex.Request([5], 10, end_id=8, streaming=True))
        assert [r.result.output_token_ids for r in rs] == [[[6]], [[7]], [[]]]
        (r,) = _run(e, ex.Request([5], 10, stop_words=[[9, 10], [99]]))
        assert r.result.output_token_ids == [[5, 6, 7, 8, 9, 10]]  # the stop word is kept
        assert r.result.finish_reasons == [FR.STOP_WORDS]
        (r,) = _run(e, ex.Request([5], 3, bad_words=[[7]], end_id=6,
                                  sampling_config=ex.SamplingConfig(min_tokens=1)))
        # 6 is end_id before min_tokens, 7 a bad word: the toy falls through to 8
        assert r.result.output_token_ids == [[5, 8, 9, 10]]


def test_toy_model_is_deterministic_and_predictable(trtllm_fake: ModuleType, tmp_path: Path
                                                    ) -> None:
    from tensorrt_llm._fake.toy import ToyModel
    from tensorrt_llm.bindings import executor as ex

    outs = []
    for i in range(2):  # two conversions and builds of the same model
        _convert(_hf_dir(tmp_path), tmp_path / f"ck{i}", tp=1)
        eng = _build(tmp_path / f"ck{i}", tmp_path / f"eng{i}")
        with _executor(eng) as e:
            outs.append(_run(e, ex.Request([3, 1, 4], 12))[0].result.output_token_ids[0])
    toy = ToyModel.from_engine_dir(tmp_path / "eng0")
    assert outs[0] == outs[1] == [3, 1, 4, *toy.generate([3, 1, 4], 12)[0]]
    assert outs[0][3] == (toy.a * (1 + 4) + toy.b) % VOCAB  # k = 2 by default
    (tmp_path / "o").mkdir()
    _convert(_hf_dir(tmp_path / "o", hidden_size=128), tmp_path / "o" / "ck", tp=1)
    other = ToyModel.from_engine_dir(_build(tmp_path / "o" / "ck", tmp_path / "o" / "eng"))
    assert (other.a, other.b) != (toy.a, toy.b)  # the rule comes from the checkpoint


def test_await_rules(engine: Path) -> None:
    from tensorrt_llm.bindings import executor as ex

    with _executor(engine) as e:
        rid = _run(e, ex.Request([1], 2))[0].request_id
        (again,) = e.await_responses(rid, timeout=SEC)
        assert again.has_error()
        assert again.error_msg == f"ReqId {rid} has already been processed and was terminated."
        with pytest.raises(RuntimeError):
            _ = again.result
        assert e.await_responses(10**6, timeout=timedelta(milliseconds=20)) == []
        assert e.await_responses(timeout=timedelta(milliseconds=20)) == []
        with pytest.raises(TypeError):
            e.await_responses(rid, timeout=0.1)  # a timedelta, not seconds
        a, b = e.enqueue_requests([ex.Request([1], 2), ex.Request([2], 2)])
        per_id = e.await_responses([a, b], timeout=SEC)
        assert [[r.request_id for r in rs] for rs in per_id] == [[a], [b]]


def test_cancel_finishes_with_cancelled(engine: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tensorrt_llm.bindings import executor as ex

    with _executor(engine) as e:
        with e._fake_hold():
            rid = e.enqueue_request(ex.Request([1, 2], 5))
            e.cancel_request(rid)
        (r,) = e.await_responses(rid, timeout=SEC)
        assert r.result.finish_reasons == [ex.FinishReason.CANCELLED]
        assert r.result.output_token_ids == [[1, 2]]
        monkeypatch.setenv("FAKE_TRTLLM_ITER_DELAY_MS", "20")
        rid = e.enqueue_request(ex.Request([1], 400, streaming=True))
        first = e.await_responses(rid, timeout=SEC)
        e.cancel_request(rid)
        rs = first + _drain_until_final(e, rid)
        assert rs[-1].result.finish_reasons == [ex.FinishReason.CANCELLED]
        assert len(rs) < 400


def test_allotted_time_and_responses_ready(engine: Path) -> None:
    from tensorrt_llm.bindings import executor as ex

    with _executor(engine) as e:
        with e._fake_hold():
            rid = e.enqueue_request(ex.Request([1], 5, allotted_time_ms=1))
            time.sleep(0.01)
        (r,) = e.await_responses(rid, timeout=SEC)
        assert r.result.finish_reasons == [ex.FinishReason.TIMED_OUT]
        rid = e.enqueue_request(ex.Request([1], 1))
        deadline = time.monotonic() + 5
        while e.get_num_responses_ready(rid) == 0 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert e.get_num_responses_ready(rid) == 1 == e.get_num_responses_ready()


def _drain_until_final(e: Any, rid: int) -> list[Any]:
    out: list[Any] = []
    while not out or not out[-1].result.is_final:
        out += e.await_responses(rid, timeout=SEC)
    return out


def test_max_queue_size_overflow_raises(engine: Path) -> None:
    from tensorrt_llm.bindings import executor as ex

    with _executor(engine, max_queue_size=2) as e, e._fake_hold():
        e.enqueue_requests([ex.Request([1], 2), ex.Request([2], 2)])
        with pytest.raises(RuntimeError, match="Maximum queue size of 2 has been reached"):
            e.enqueue_request(ex.Request([3], 2))
        assert e.get_num_responses_ready() == 0


def test_invalid_configs_and_requests(engine: Path, capfd: pytest.CaptureFixture[str]) -> None:
    from tensorrt_llm.bindings import executor as ex

    with pytest.raises(RuntimeError, match="Static batching type is deprecated"):
        _executor(engine, batching_type=ex.BatchingType.STATIC)
    with pytest.raises(TypeError):
        ex.ExecutorConfig(1)  # keyword arguments
    cfg = ex.ExecutorConfig()
    with pytest.raises(TypeError):
        cfg.kv_cache_config = {"free_gpu_memory_fraction": 0.5}
    with _executor(engine) as e:
        with pytest.raises(NotImplementedError):
            e.enqueue_request(ex.Request([1], 2, sampling_config=ex.SamplingConfig(beam_width=2)))
        (r,) = _run(e, ex.Request(list(range(600)), 2))  # > max_input_len (512)
        assert r.has_error() and "exceeds maximum input length" in r.error_msg
        (r,) = _run(e, ex.Request([1], 1000))  # clamped to max_seq_len
        assert len(r.result.output_token_ids[0]) == 512
        assert "Number of requested output tokens (1000)" in capfd.readouterr().err


def test_chunked_context_needs_paged_context_fmha(trtllm_fake: ModuleType, tmp_path: Path,
                                                  capfd: pytest.CaptureFixture[str]) -> None:
    from tensorrt_llm.plugin import PluginConfig

    _convert(_hf_dir(tmp_path), tmp_path / "ckpt", tp=1)
    eng = _build(tmp_path / "ckpt", tmp_path / "eng",
                 plugin_config=PluginConfig(use_paged_context_fmha=False))
    with _executor(eng, enable_chunked_context=True):
        pass
    assert "Chunked context" in capfd.readouterr().err


# -- stats (§2.1) and LEADER mode (§2.2) ---------------------------------------------------
def test_iteration_stats_fields_and_drain(engine: Path) -> None:
    from tensorrt_llm.bindings import executor as ex

    kv = ex.KvCacheConfig(max_tokens=320, free_gpu_memory_fraction=0.5)
    with _executor(engine, kv_cache_config=kv, max_batch_size=1) as e:
        e.enqueue_requests([ex.Request([1] * 40, 3), ex.Request([2], 3)])
        _drain_until_final(e, 2)
        stats = e.get_latest_iteration_stats()
        assert e.get_latest_iteration_stats() == []  # reading drains
        first = stats[0]
        assert first.num_new_active_requests == 1 and first.num_queued_requests == 1
        assert first.max_num_active_requests == 1
        k = first.kv_cache_stats
        assert k.max_num_blocks == 10 and k.tokens_per_block == 32  # max_tokens is smaller
        assert k.used_num_blocks == 2 and k.free_num_blocks == 8
        assert first.inflight_batching_stats.num_ctx_tokens == 40
        assert sum(s.num_completed_requests for s in stats) == 2
        js = json.loads(first.to_json_str())
        assert js["kvCacheStats"]["maxNumBlocks"] == 10 and "numActiveRequests" in js
        assert e.get_latest_request_stats() == []  # request_stats_max_iterations=0
    with _executor(engine, iter_stats_max_iterations=0) as e:
        _run(e, ex.Request([1], 2))
        assert e.get_latest_iteration_stats() == []


@pytest.mark.parametrize(("max_tokens", "fraction", "blocks"), [
    (None, 0.5, 39),  # 1 MiB GPU - 403456 B of weights = 645120 B; half / 256 B per token
    (10_000, 0.5, 39),  # both set: the smaller wins
    (320, None, 10),  # default fraction 0.9 gives more than 320 tokens
])
def test_kv_cache_sizing(engine: Path, monkeypatch: pytest.MonkeyPatch, max_tokens: int | None,
                         fraction: float | None, blocks: int) -> None:
    from tensorrt_llm.bindings import executor as ex

    monkeypatch.setenv("FAKE_TRTLLM_GPU_MEMORY_GIB", str(2**20 / 2**30))
    kv = ex.KvCacheConfig(max_tokens=max_tokens, free_gpu_memory_fraction=fraction)
    with _executor(engine, kv_cache_config=kv) as e:
        _run(e, ex.Request([1], 1))
        assert e.get_latest_iteration_stats()[0].kv_cache_stats.max_num_blocks == blocks
    monkeypatch.setenv("FAKE_TRTLLM_GPU_MEMORY_GIB", str(2**18 / 2**30))
    with pytest.raises(RuntimeError, match="out of memory"):
        _executor(engine)


def test_single_process_is_leader(engine: Path) -> None:
    from tensorrt_llm.bindings import executor as ex

    e = _executor(engine)
    assert e.can_enqueue_requests()
    e.shutdown()
    e.shutdown()  # idempotent
    assert not e.can_enqueue_requests()
    with pytest.raises(RuntimeError):
        e.enqueue_request(ex.Request([1], 1))


_MPIRUN = shutil.which("mpirun", path=str(Path(sys.executable).parent)) or shutil.which("mpirun")


def _mpi_probe(trtllm_fake: ModuleType, engine: Path, tmp_path: Path, scenario: str,
               ok: bool = True, **env: str) -> list[dict[str, Any]]:
    out = tmp_path / f"out-{scenario}-{len(list(tmp_path.iterdir()))}"
    out.mkdir()
    cmd = [_MPIRUN, "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-n", "2",
           sys.executable, str(_FAKES / "mpi_probe.py"), str(engine), str(out), scenario]
    done = subprocess.run(cmd, env={**_helper.subprocess_env(), **env}, capture_output=True,
                          text=True, timeout=60)
    assert (done.returncode == 0) is ok, done.stderr
    _PROBE_STDERR[scenario] = done.stderr
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


_PROBE_STDERR: dict[str, str] = {}


@pytest.mark.skipif(_MPIRUN is None, reason="needs mpirun")
def test_leader_mode_under_mpirun(trtllm_fake: ModuleType, tmp_path: Path) -> None:
    _convert(_hf_dir(tmp_path), tmp_path / "ckpt", tp=2)
    engine = _build(tmp_path / "ckpt", tmp_path / "eng")
    leader, worker = _mpi_probe(trtllm_fake, engine, tmp_path, "leader")
    assert leader["can_enqueue"] and not worker["can_enqueue"]
    assert len(leader["tokens"]) == 3 + 4
    for call in ("enqueueRequests", "awaitResponses", "cancelRequest",
                 "getLatestIterationStats"):
        key = {"enqueueRequests": "enqueue_error", "awaitResponses": "await_error",
               "cancelRequest": "cancel_error", "getLatestIterationStats": "stats_error"}[call]
        assert worker[key] == ("With LEADER communication mode, only leader rank is expected "
                               f"to call {call}")
    assert worker["shutdown_returned"] >= leader["shutdown_called"]  # blocked until then
    start = time.monotonic()
    lone, _ = _mpi_probe(trtllm_fake, engine, tmp_path, "missing",
                         FAKE_TRTLLM_COLLECTIVE_TIMEOUT_S="1")
    assert "every rank must construct it" in lone["construct_error"]
    assert time.monotonic() - start < 30


@pytest.mark.skipif(_MPIRUN is None, reason="needs mpirun")
def test_import_is_a_collective_and_the_world_is_the_libmpis(trtllm_fake: ModuleType,
                                                            tmp_path: Path) -> None:
    """`import tensorrt_llm` splits COMM_WORLD (`_utils.py`): a rank that never imports it
    leaves the others in their import (the fake fails after the collective timeout). And the
    MPI world `_utils` reports is the libmpi's: one process alone when the job's mpirun does
    not belong to it (FAKE_TRTLLM_MPI=singleton), whatever our own mpi4py says."""
    _convert(_hf_dir(tmp_path), tmp_path / "ckpt", tp=2)
    engine = _build(tmp_path / "ckpt", tmp_path / "eng")
    lone, rank1 = _mpi_probe(trtllm_fake, engine, tmp_path, "import",
                             FAKE_TRTLLM_COLLECTIVE_TIMEOUT_S="1")
    assert "import-time MPI collective" in lone["import_error"] and not rank1["imported"]
    assert [(w["rank"], w["size"]) for w in _mpi_probe(trtllm_fake, engine, tmp_path,
                                                       "world")] == [(0, 2), (1, 2)]
    alone = _mpi_probe(trtllm_fake, engine, tmp_path, "world", FAKE_TRTLLM_MPI="singleton")
    assert [(w["rank"], w["size"], w["mpi4py_size"]) for w in alone] == [(0, 1, 2), (0, 1, 2)]


@pytest.mark.skipif(_MPIRUN is None, reason="needs mpirun")
def test_executor_alive_at_mpi_finalize_aborts(trtllm_fake: ModuleType, tmp_path: Path) -> None:
    """With TP > 1 the Executor owns split communicators its destructor frees, unchecked
    (mpiUtils.cpp); Open MPI aborts on MPI_Comm_free after MPI_Finalize. Released and collected
    first, the job ends cleanly."""
    _convert(_hf_dir(tmp_path), tmp_path / "ckpt", tp=2)
    engine = _build(tmp_path / "ckpt", tmp_path / "eng")
    assert [r["released"] for r in _mpi_probe(trtllm_fake, engine, tmp_path,
                                              "finalize-released")] == [True, True]
    _mpi_probe(trtllm_fake, engine, tmp_path, "finalize-alive", ok=False)
    err = _PROBE_STDERR["finalize-alive"]
    assert "The MPI_Comm_free() function was called after MPI_FINALIZE was invoked" in err


# -- what the real Executor and builder do that a lenient fake would let pass ---------------
def test_build_config_kv_cache_type_takes_the_enum_only(trtllm_fake: ModuleType,
                                                        tmp_path: Path) -> None:
    from pydantic import ValidationError
    from tensorrt_llm.llmapi.kv_cache_type import KVCacheType

    BuildConfig = trtllm_fake.BuildConfig
    with pytest.raises(ValidationError, match="silently disables the paged KV cache"):
        BuildConfig(kv_cache_type="paged")
    assert BuildConfig().kv_cache_type is None  # None: PAGED at build time
    assert KVCacheType("PAGED") is KVCacheType.PAGED is KVCacheType("paged")
    assert BuildConfig(kv_cache_type=KVCacheType.PAGED).kv_cache_type is KVCacheType.PAGED


def test_executor_needs_attention_plugin_packed_input_paged_kv(trtllm_fake: ModuleType,
                                                               tmp_path: Path) -> None:
    from tensorrt_llm.llmapi.kv_cache_type import KVCacheType
    from tensorrt_llm.plugin import PluginConfig

    _convert(_hf_dir(tmp_path), tmp_path / "ckpt", tp=1)
    for i, cfg in enumerate([{"kv_cache_type": KVCacheType.CONTINUOUS},
                             {"plugin_config": PluginConfig(gpt_attention_plugin="disable")},
                             {"plugin_config": PluginConfig(remove_input_padding=False)}]):
        eng = _build(tmp_path / "ckpt", tmp_path / f"eng{i}", **cfg)
        with pytest.raises(RuntimeError, match="TrtGptModelInflightBatching requires GPT "
                           "attention/Mamba Conv 1d plugin with packed input and paged KV cache"):
            _executor(eng)


def test_plugin_config_ignores_unknown_keys(trtllm_fake: ModuleType) -> None:
    from tensorrt_llm.plugin import PluginConfig

    pc = PluginConfig(use_paged_context_fhma=False, tokens_per_block=16)  # a typo: dropped
    assert pc.use_paged_context_fmha is True and pc.tokens_per_block == 16
    assert not hasattr(pc, "use_paged_context_fhma")


def test_read_only_fields(trtllm_fake: ModuleType) -> None:
    from tensorrt_llm.bindings import executor as ex

    req = ex.Request([1, 2], 4)
    with pytest.raises(AttributeError):
        req.max_tokens = 8
    assert req.max_tokens == 4
    sc = ex.SchedulerConfig(ex.CapacitySchedulerPolicy.MAX_UTILIZATION)
    with pytest.raises(AttributeError):
        sc.capacity_scheduler_policy = ex.CapacitySchedulerPolicy.GUARANTEED_NO_EVICT
    assert sc.capacity_scheduler_policy is ex.CapacitySchedulerPolicy.MAX_UTILIZATION


def test_timing_cache_is_written_where_build_config_says(trtllm_fake: ModuleType,
                                                         tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         capfd: pytest.CaptureFixture[str]
                                                         ) -> None:
    from tensorrt_llm.builder import build
    from tensorrt_llm.models import MODEL_MAP, PretrainedConfig

    _convert(_hf_dir(tmp_path), tmp_path / "ckpt", tp=1)
    model = MODEL_MAP["LlamaForCausalLM"].from_checkpoint(
        str(tmp_path / "ckpt"), config=PretrainedConfig.from_checkpoint(tmp_path / "ckpt"))
    monkeypatch.chdir(tmp_path)
    build(model, trtllm_fake.BuildConfig())
    assert (tmp_path / "model.cache").is_file()  # the default: the working directory
    assert "timing every kernel" in capfd.readouterr().err
    cache = str(tmp_path / "t.cache")
    build(model, trtllm_fake.BuildConfig(output_timing_cache=cache, input_timing_cache=cache))
    build(model, trtllm_fake.BuildConfig(output_timing_cache=cache, input_timing_cache=cache))
    assert f"Loaded timing cache from {cache}" in capfd.readouterr().err


def test_small_kv_cache_shrinks_max_seq_len(engine: Path, capfd: pytest.CaptureFixture[str]
                                            ) -> None:
    """A cache that cannot hold one max_seq_len (512) sequence: the Executor shrinks the
    attention window, max_seq_len and max_input_len at construction, with a warning; requests
    then follow the smaller limits (trtGptModelInflightBatching.cpp)."""
    from tensorrt_llm.bindings import executor as ex

    kv = ex.KvCacheConfig(max_tokens=128)  # 4 blocks of 32
    with _executor(engine, kv_cache_config=kv) as e:
        err = capfd.readouterr().err
        assert ("maxAttentionWindow and maxSequenceLen are too large for at least one sequence "
                "to fit in kvCache. they are reduced to 128") in err
        assert "maxInputLen is reduced to 127" in err
        (r,) = _run(e, ex.Request(list(range(1, 130)), 2))
        assert r.has_error() and "exceeds maximum input length (127)" in r.error_msg
        (r,) = _run(e, ex.Request([1], 500, output_config=ex.OutputConfig(
            exclude_input_from_output=True)))
        assert len(r.result.output_token_ids[0]) == 127  # clamped to the new max_seq_len


def test_cancel_of_a_queued_request_waits_for_admission(engine: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from tensorrt_llm.bindings import executor as ex

    monkeypatch.setenv("FAKE_TRTLLM_ITER_DELAY_MS", "10")
    with _executor(engine, max_batch_size=1) as e:
        first = e.enqueue_request(ex.Request([1], 30, streaming=True))
        queued = e.enqueue_request(ex.Request([2], 30, streaming=True))
        e.await_responses(first, timeout=SEC)  # running; `queued` waits for the batch slot
        e.cancel_request(queued)
        assert e.await_responses(queued, timeout=timedelta(milliseconds=100)) == []
        rs = _drain_until_final(e, first)
        assert rs[-1].result.finish_reasons == [ex.FinishReason.LENGTH]  # never cancelled
        rs = _drain_until_final(e, queued)  # admitted once `first` ended, then cancelled
        assert rs[-1].result.finish_reasons == [ex.FinishReason.CANCELLED]
        assert len(rs) <= 2


def test_leader_shutdown_blocks_until_requests_finish(engine: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from tensorrt_llm.bindings import executor as ex

    monkeypatch.setenv("FAKE_TRTLLM_ITER_DELAY_MS", "10")
    e = _executor(engine, max_batch_size=1)
    a = e.enqueue_request(ex.Request([1], 40))
    b = e.enqueue_request(ex.Request([2], 40))  # queued behind `a`
    t0 = time.monotonic()
    e.shutdown()  # queues a terminate request behind both and keeps stepping
    assert time.monotonic() - t0 > 0.5  # 80 iterations of 10 ms
    for call in (lambda: e.await_responses(a, timeout=SEC), lambda: e.cancel_request(b),
                 lambda: e.enqueue_request(ex.Request([3], 1))):
        with pytest.raises(RuntimeError, match="Shutdown called"):
            call()


def test_sampling_without_a_seed_uses_seed_zero(engine: Path) -> None:
    """SamplingConfig.seed None is seed 0 (NVIDIA/TensorRT-LLM #1000, #2411)."""
    from tensorrt_llm.bindings import executor as ex

    def sample(**sc: Any) -> list[int]:
        cfg = ex.SamplingConfig(top_k=50, temperature=1.0, **sc)
        (r,) = _run(e, ex.Request([5], 12, sampling_config=cfg))
        return r.result.output_token_ids[0]

    with _executor(engine) as e:
        assert sample() == sample() == sample(seed=0)
        assert sample(seed=1) != sample(seed=2)
        greedy = _run(e, ex.Request([5], 3, sampling_config=ex.SamplingConfig(top_k=1)))
        assert greedy[0].result.output_token_ids == [[5, 6, 7, 8]]
