"""Activate the TensorRT-LLM contract fake for one test, never globally.

In a test module (or a conftest.py):

    from pathlib import Path
    import importlib.util

    _spec = importlib.util.spec_from_file_location(
        "trtllm_fake_helper", Path(__file__).resolve().parents[1] / "fakes" / "conftest_helper.py")
    _helper = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_helper)
    trtllm_fake = _helper.trtllm_fake          # the fixture

    def test_something(trtllm_fake):          # trtllm_fake is the `tensorrt_llm` module
        from tensorrt_llm.bindings import executor as trtllm
        ...

Helpers to make a tiny Llama HF directory, convert it and build engines with the fake (the
documented Python path: from_hugging_face -> save_checkpoint -> from_checkpoint -> build ->
save) are here too: tiny_hf_dir, convert_checkpoint, build_engine.

(With a tests/conftest.py, `pytest_plugins = ["fakes.conftest_helper"]` also works, since
pytest puts tests/ on sys.path for a rootdir conftest.) The fixture prepends tests/fakes to
sys.path, sets default FAKE_* variables, and afterwards removes tests/fakes from sys.path
and purges `tensorrt_llm*`, `tensorrt*` and the api_surface modules from sys.modules. For a
subprocess (mpirun, trtllm-build) pass `env=subprocess_env()`.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

FAKES_DIR = Path(__file__).resolve().parent
_OWNED = ("tensorrt_llm", "tensorrt", "api_surface", "_surface_entries", "_surface_compare")
DEFAULT_ENV = {
    "FAKE_TRTLLM_VERSION": "1.2.0",
    "FAKE_TENSORRT_VERSION": "10.13.0.35",
    "FAKE_TRTLLM_SM": "9.0",
}


# The fake "install" as pip leaves it: distribution metadata beside the packages, read by
# importlib.metadata without importing anything. TensorRT 10's `tensorrt` module ships in
# tensorrt-cu12-bindings, beside a `tensorrt` meta-package of the same version.
DISTS = {"tensorrt_llm": (("tensorrt_llm", "tensorrt_llm"),),
         "tensorrt": (("tensorrt", None), ("tensorrt_cu12_bindings", "tensorrt"))}
VERSION_VARS = {"tensorrt_llm": "FAKE_TRTLLM_VERSION", "tensorrt": "FAKE_TENSORRT_VERSION"}


def write_dists(root: Path, versions: dict[str, str]) -> Path:
    """`root` holding the dist-info directories of the fake at `versions` ({"tensorrt_llm":
    "1.2.1", ...}: the others at their defaults). The fake's own directory holds them at the
    defaults; put `root` before it on the path for another version."""
    root.mkdir(parents=True, exist_ok=True)
    for module, dists in DISTS.items():
        version = versions.get(module, DEFAULT_ENV[VERSION_VARS[module]])
        for name, top_level in dists:
            info = root / f"{name}-{version}.dist-info"
            info.mkdir(exist_ok=True)
            (info / "METADATA").write_text(
                f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
            if top_level:
                (info / "top_level.txt").write_text(top_level + "\n")
    return root


def _dists_for(env: dict[str, str]) -> Path | None:
    """A directory of dist-infos matching the FAKE_*_VERSION variables of `env`, or None when
    they are the defaults (the fake's directory has those)."""
    versions = {m: env[v] for m, v in VERSION_VARS.items()
                if env.get(v, DEFAULT_ENV[v]) != DEFAULT_ENV[v]}
    if not versions:
        return None
    key = "_".join(f"{m}-{v}" for m, v in sorted(versions.items()))
    base = Path(tempfile.gettempdir()) / f"aotllm-fake-dists-{os.getuid()}"
    root = base / key
    if not root.is_dir():
        base.mkdir(exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=base))
        write_dists(tmp, versions)
        try:
            tmp.rename(root)
        except OSError:  # made meanwhile by another process
            shutil.rmtree(tmp, ignore_errors=True)
    return root


def purge_fake_modules() -> None:
    for name in list(sys.modules):
        if any(name == p or name.startswith(p + ".") for p in _OWNED):
            del sys.modules[name]


def subprocess_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for a child process that must import the fake or run `trtllm-build`."""
    env = dict(os.environ if base is None else base)
    for key, value in DEFAULT_ENV.items():
        env.setdefault(key, value)
    dists = _dists_for(env)  # the metadata agrees with FAKE_*_VERSION, as a real install's
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(dists or ""), str(FAKES_DIR),
                                                      env.get("PYTHONPATH")]))
    env["PATH"] = os.pathsep.join(filter(None, [str(FAKES_DIR / "bin"), env.get("PATH")]))
    env["FAKE_TRTLLM_PYTHON"] = sys.executable
    return env


@pytest.fixture
def trtllm_fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    for key, value in DEFAULT_ENV.items():
        monkeypatch.setenv(key, os.environ.get(key, value))
    purge_fake_modules()
    monkeypatch.syspath_prepend(str(FAKES_DIR))
    import tensorrt_llm

    yield tensorrt_llm
    purge_fake_modules()  # monkeypatch then restores sys.path and the environment


def tiny_hf_dir(root: Path, **overrides: Any) -> Path:
    """<root>/hf: a Llama config (vocab 1000, max_position_embeddings 512) and a weight file."""
    d = root / "hf"
    d.mkdir(exist_ok=True)
    cfg = {
        "architectures": ["LlamaForCausalLM"], "vocab_size": 1000, "hidden_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 128, "max_position_embeddings": 512, "torch_dtype": "bfloat16",
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, **overrides,
    }  # fmt: skip
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "model.safetensors").write_bytes(b"weights")
    return d


def convert_checkpoint(hf: Path, ckpt: Path, tp: int) -> None:
    import tensorrt_llm
    from tensorrt_llm.models import LLaMAForCausalLM

    for rank in range(tp):
        mapping = tensorrt_llm.Mapping(world_size=tp, rank=rank, tp_size=tp, pp_size=1)
        model = LLaMAForCausalLM.from_hugging_face(str(hf), "auto", mapping=mapping)
        model.save_checkpoint(str(ckpt), save_config=(rank == 0))


def build_engine(ckpt: Path, out: Path, **build_config: Any) -> Path:
    """Every rank of the checkpoint, as trtllm-build's build_model does it."""
    import tensorrt_llm
    from tensorrt_llm.builder import build
    from tensorrt_llm.models import MODEL_MAP, PretrainedConfig

    # TensorRT's timing cache beside the engine, never in the working directory.
    build_config.setdefault("output_timing_cache", str(out.parent / f"{out.name}.timing"))
    build_config.setdefault("input_timing_cache", build_config["output_timing_cache"])
    base = PretrainedConfig.from_checkpoint(ckpt)
    for rank in range(base.mapping.world_size):
        cfg = copy.deepcopy(base)
        cfg.set_rank(rank)
        model = MODEL_MAP[cfg.architecture].from_checkpoint(str(ckpt), config=cfg)
        build(model, tensorrt_llm.BuildConfig(**build_config)).save(str(out))
    return out
