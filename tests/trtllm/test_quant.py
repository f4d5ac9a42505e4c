"""`pipeline build --backend trtllm --quant ...`: the scheme reaches TensorRT-LLM's checkpoint
conversion as its own QuantConfig (W8A16, W4A16, FP8 on an FP8-capable GPU), checked against
the contract fake; what TensorRT-LLM cannot map is refused in one line."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest

from contract.manifest import read_manifest
from tests.trtllm.conftest import PROFILE_ARGS, pipeline_build


def _cli(capsys: pytest.CaptureFixture[str], ckpt: Path, *args: object) -> tuple[int, str, str]:
    from pipeline.cli import main

    capsys.readouterr()
    rc = main(["build", str(ckpt), "--backend", "trtllm", *PROFILE_ARGS, *map(str, args)])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize(("quant", "tp", "algo", "gemm_plugin"), [
    ("int8_wo", 2, "W8A16", "auto"), ("int4_wo", 1, "W4A16", "auto"), ("fp8", 1, "FP8", None),
])
def test_quant_maps_to_tensorrt_llm_quant_algo(
        chat_ckpt: Path, engine_tp2: Path, tmp_path: Path, quant: str, tp: int, algo: str,
        gemm_plugin: str | None) -> None:
    done = pipeline_build(chat_ckpt, tmp_path / "engines", tp, "--target", "sm_90",
                          "--quant", quant)
    assert done.returncode == 0, done.stderr
    engine = Path(done.stdout.strip().splitlines()[-1])
    trt = json.loads((engine / "config.json").read_text())
    q = trt["pretrained_config"]["quantization"]
    assert q["quant_algo"] == algo and q["kv_cache_quant_algo"] is None, q
    # The docs' advice: the GEMM plugin for FP16/BF16 GEMMs, off for FP8.
    assert trt["build_config"]["plugin_config"]["gemm_plugin"] == gemm_plugin
    m = read_manifest(engine)
    assert m.quant.scheme == quant and m.engine_id != engine_tp2.name
    assert read_manifest(engine_tp2).quant.scheme == "none"
    assert json.loads((engine_tp2 / "config.json").read_text())[
        "pretrained_config"]["quantization"]["quant_algo"] is None


@pytest.mark.parametrize(("args", "sm", "expected"), [
    (("--quant", "fp8", "--target", "sm_86"), "8.6", "--quant fp8 needs FP8 tensor cores"),
    (("--quant", "int4_wo", "--quant-group-size", "64", "--target", "sm_90"), "9.0",
     "--quant-group-size and --quant-lm-head are not mapped onto TensorRT-LLM"),
])
def test_what_tensorrt_llm_cannot_run_is_one_line(
        chat_ckpt: Path, tmp_path: Path, trtllm_fake: ModuleType,
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        args: tuple[str, ...], sm: str, expected: str) -> None:
    monkeypatch.setenv("AOTLLM_GPU_SM", sm)
    monkeypatch.setenv("FAKE_TRTLLM_SM", sm)
    rc, out, err = _cli(capsys, chat_ckpt, "--tp", "1", *args, "--store", tmp_path / "e")
    assert rc == 2 and out == "", err
    assert "Traceback" not in err and expected in err.strip().splitlines()[-1], err
    assert not (tmp_path / "e").exists()


def test_fp8_is_refused_for_our_own_backends(chat_ckpt: Path, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    from pipeline.cli import main

    capsys.readouterr()
    rc = main(["build", str(chat_ckpt), "--backend", "eager", "--tp", "1", "--quant", "fp8",
               "--store", str(tmp_path / "e")])
    err = capsys.readouterr().err
    assert rc == 2 and "TensorRT-LLM's kernels only" in err and "Traceback" not in err


def test_the_fake_refuses_what_from_hugging_face_cannot_quantize(
        chat_ckpt: Path, trtllm_fake: ModuleType) -> None:
    from tensorrt_llm.models import LLaMAForCausalLM
    from tensorrt_llm.models.modeling_utils import QuantConfig
    from tensorrt_llm.quantization import QuantAlgo

    with pytest.raises(ValueError, match="without calibration"):
        LLaMAForCausalLM.from_hugging_face(
            str(chat_ckpt), "float16", quant_config=QuantConfig(quant_algo=QuantAlgo.W4A16_AWQ))
    with pytest.raises(TypeError, match="QuantConfig"):
        LLaMAForCausalLM.from_hugging_face(str(chat_ckpt), "float16",
                                           quant_config={"quant_algo": "W8A16"})
